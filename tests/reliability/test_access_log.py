"""The access log: its time, from the request's start to its answer's last byte, and who asked."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from manyeyes.app.middleware import AccessLog
from manyeyes.app.services.metrics import Metrics


def logged_ms(app, caplog) -> float:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        try:
            asyncio.run(AccessLog(app, Metrics())(scope, receive, send))
        except RuntimeError:
            pass
    (record,) = [r for r in caplog.records if r.name == "manyeyes.access"]
    return orjson.loads(record.getMessage())["ms"]


def test_the_time_ends_at_the_last_byte_not_when_the_app_winds_down(caplog):
    async def answers_then_lingers(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.1)  # counted: the client is still waiting
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})
        await asyncio.sleep(0.6)  # not counted: the client has its answer

    assert 100 <= logged_ms(answers_then_lingers, caplog) < 600


def test_without_an_answer_the_time_ends_when_the_app_does(caplog):
    async def fails(scope, receive, send):
        await asyncio.sleep(0.1)
        raise RuntimeError("boom")

    assert logged_ms(fails, caplog) >= 100


def logged_clients(settings, requests, caplog) -> list[tuple[int, str]]:
    """(status, client) of each access log line of `requests`: (path, headers) from 127.0.0.1."""
    import httpx

    from manyeyes.app.config import Settings
    from manyeyes.app.main import create_app

    app = create_app(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, **settings))

    async def send_all():
        transport = httpx.ASGITransport(app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            for path, headers in requests:
                await client.get(path, headers=headers)

    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        asyncio.run(send_all())
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access"]
    return [(line["status"], line["client"]) for line in lines]


def test_each_line_says_who_asked_by_key_id_else_by_address(caplog):
    """The access log never said who made a request: with 30 users an operator could tell neither
    who flooded the server nor whose key was refused (review h47b)."""
    import hashlib

    key = "alpha-key-0123456789"
    key_id = "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]
    settings = dict(api_keys=[key], close_metrics=True, trusted_proxies=["127.0.0.1"], allowed_hosts=["viz.example.org"])
    proxied = {"x-forwarded-for": "198.51.100.9, 203.0.113.7"}
    logged = logged_clients(settings, [
        ("/metrics", {"authorization": f"Bearer {key}"}),
        ("/metrics", {"authorization": "Bearer wrong", **proxied}),  # a refused key: the proxied client's address
        ("/healthz", {}),
        ("/healthz", {"host": "rebound.example", **proxied}),  # open to every name
        ("/metrics", {"host": "rebound.example", **proxied}),  # refused before any key is looked at
    ], caplog)
    assert logged == [(200, key_id), (401, "addr:203.0.113.7"), (200, "addr:127.0.0.1"), (200, "addr:203.0.113.7"),
                      (421, "addr:203.0.113.7")]
    assert key not in caplog.text and hashlib.sha256(key.encode()).hexdigest() not in caplog.text


@pytest.mark.slow
def test_a_served_line_carries_its_client_and_a_utc_time():
    """Under `manyeyes serve`: the client on every line, and the time in UTC, marked so, whatever
    the machine's zone (it was local, without one)."""
    import datetime
    import os
    import re
    import subprocess
    import sys

    import httpx

    from tests.reliability.conftest import free_port, wait_until

    port = free_port()
    env = {**os.environ, "MANYEYES_MODELS": '{"tiny-gpt": "tiny-gpt"}', "MANYEYES_DEVICE": "cpu", "TZ": "XXX-9"}
    proc = subprocess.Popen([sys.executable, "-m", "manyeyes", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def answered() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None
        wait_until(answered, 120, "the server to answer")
        asked = datetime.datetime.now(datetime.timezone.utc)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    line = next((line for line in out.splitlines() if "manyeyes.access" in line and '"/healthz"' in line), out)
    stamp = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z INFO manyeyes\.access \{", line)
    assert stamp, line
    logged = datetime.datetime.fromisoformat(stamp[1]).replace(tzinfo=datetime.timezone.utc)
    assert abs((logged - asked).total_seconds()) < 60, line  # UTC, not the machine's UTC+9
    assert orjson.loads(line[line.index("{"):])["client"] == "addr:127.0.0.1", line
