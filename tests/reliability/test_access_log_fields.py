"""The access log's line (review h48b, item 6): a bounded path, the error code of an error answer,
and a request id that the answer carries too."""

from __future__ import annotations

import asyncio
import logging
import re

import orjson
import pytest

from manyeyes.app.config import Settings
from manyeyes.app.middleware import AccessLog, Gzip, error_response, send_error
from manyeyes.app.services.metrics import Metrics
from tests.api.conftest import serve

KEY = "fields-key-0123456789"


@pytest.fixture(scope="module")
def locked():
    client = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, api_keys=[KEY], max_body_bytes=1000))
    yield client
    client.__exit__(None, None, None)


def lines(caplog) -> list[dict]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access"]


def test_a_long_path_is_cut_in_the_log(locked, caplog):
    """2,000 GETs of 60 KB paths wrote 120 MB of log in 31 s (flood.py): each line held its path whole."""
    path = "/api/v1/runs/" + "a" * 60_000
    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        assert locked.get(path).status_code == 401
        assert locked.get("/healthz").status_code == 200
    long, short = lines(caplog)
    assert long["path"] == path[:508] + "..." and long["path_length"] == len(path)  # 512 characters in all
    assert len(orjson.dumps(long)) < 1200
    assert short["path"] == "/healthz" and "path_length" not in short


def test_an_error_line_carries_its_code(locked, caplog):
    """A 429 said neither queue_full, client_share nor work: only the status was logged."""
    key = {"Authorization": f"Bearer {KEY}"}
    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        assert locked.post("/api/v1/attention", json={"text": "no key"}).status_code == 401  # ClientIdentity's send_error
        assert locked.post("/api/v1/attention", content=b"x" * 5000,
                           headers={**key, "Content-Type": "application/json"}).status_code == 413  # BodyLimit's
        assert locked.post("/api/v1/attention", json={"text": "a", "model": "nope"}, headers=key).status_code == 404  # an ApiError
        assert locked.post("/api/v1/attention", json={"txt": "a"}, headers=key).status_code == 422  # validation
        assert locked.post("/api/v1/attention", json={"text": "fine"}, headers=key).status_code == 200
    logged = [(line["status"], line.get("code")) for line in lines(caplog)]
    assert logged == [(401, "unauthorized"), (413, "body_too_large"), (404, "unknown_model"), (422, "invalid_request"),
                      (200, None)]


def run_app(app, headers=()) -> tuple[list[dict], int]:
    """One GET through AccessLog(app): the headers of its answer's start, and its status."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/api/v1/attention", "headers": list(headers), "query_string": b""}
    asyncio.run(AccessLog(app, Metrics())(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["headers"], start["status"]


@pytest.mark.parametrize("how", ["error_response", "send_error", "gzipped"])
def test_the_code_of_a_429_whichever_way_it_was_written(caplog, how):
    async def app(scope, receive, send):
        if how == "send_error":
            await send_error(send, 429, "client_share", "your share of the queue is full")
        else:
            await error_response(429, "queue_full", "the queue is full " + "x" * 2000)(scope, receive, send)

    if how == "gzipped":  # compressed on its way out: its body cannot be read, its code is still known
        app = Gzip(app, minimum_size=10)
    headers = [(b"accept-encoding", b"gzip")]
    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        answer, status = run_app(app, headers)
    assert status == 429
    if how == "gzipped":
        assert (b"content-encoding", b"gzip") in answer
    (line,) = lines(caplog)
    assert line["code"] == ("client_share" if how == "send_error" else "queue_full")


def test_a_request_id_is_kept_or_made_and_sent_back(locked, caplog):
    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        kept = locked.get("/healthz", headers={"X-Request-ID": "req-42.a:b_C"})
        made = [locked.get("/healthz") for _ in range(2)]
        too_long = locked.get("/healthz", headers={"X-Request-ID": "a" * 65})
        unsafe = locked.get("/healthz", headers={"X-Request-ID": 'a"b c'})
        refused = locked.post("/api/v1/attention", json={"text": "no key"}, headers={"X-Request-ID": "refused-1"})
    answers = [kept, *made, too_long, unsafe, refused]
    ids = [r.headers["x-request-id"] for r in answers]
    assert ids[0] == "req-42.a:b_C" and ids[-1] == "refused-1"
    for made_id in ids[1:5]:
        assert re.fullmatch(r"[0-9a-f]{16}", made_id), made_id
    assert len(set(ids)) == len(ids)
    assert [line["request_id"] for line in lines(caplog)] == ids
