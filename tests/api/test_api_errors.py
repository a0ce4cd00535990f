"""Every error is JSON {"error": {"code", "message"}} with the right status, never a 500."""

from __future__ import annotations

import concurrent.futures
import gzip
import time

import pytest

from manyeyes.app.config import Settings
from tests.api.conftest import metric


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    # Beside code and message, only the fields the schema names (ErrorDetail).
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]) <= {"code", "message", "max_batch_texts"}
    assert body["error"]["message"]
    return body["error"]


def test_body_over_the_limit_is_413_before_parsing(api):
    limit = api.app.state.settings.max_body_bytes
    # Not even valid JSON: a parse would give 422, so 413 proves it was never parsed.
    err = error_of(api.post("/api/v1/attention", content=b"{" * (limit + 1), headers={"content-type": "application/json"}), 413)
    assert err["code"] == "body_too_large" and f"{limit:,}" in err["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    err = error_of(api.post("/api/v1/attention", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert err["code"] == "body_too_large"


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"text": ""}, "text"),
        ({"text": "   \n\t"}, "whitespace"),
        ({"text": "hi", "text_pair": "  "}, "whitespace"),
        ({"texts": ["ok", " "]}, "texts[1]"),
        ({"text": "hi", "layers": [6]}, "layer 6 does not exist: model minilm has layers 0..5"),
        ({"text": "hi", "layers": [-1]}, "layer -1"),
        ({"text": "hi", "heads": [12]}, "head 12 does not exist: model minilm has heads 0..11"),
        ({"text": "hi", "heads": []}, "heads"),
        ({"text": "hi", "format": "png"}, "format"),
        ({"text": "hi", "colour": "red"}, "colour"),
        ({"text": 5}, "text"),
        ({}, "text"),
    ],
)
def test_invalid_input_is_422(api, body, needle):
    path = "/api/v1/attention/batch" if "texts" in body else "/api/v1/attention"
    err = error_of(api.post(path, json=body), 422)
    assert err["code"] == "invalid_request" and needle in err["message"]


def test_too_long_without_truncate_names_both_lengths(api):
    err = error_of(api.post("/api/v1/attention", json={"text": "word " * 600}), 422)
    assert err["code"] == "too_long" and "602" in err["message"] and "512" in err["message"]
    err = error_of(api.post("/api/v1/attention/batch", json={"texts": ["fine", "word " * 600]}), 422)
    assert err["message"].startswith("texts[1]: ") and "602" in err["message"]


def test_a_pair_over_the_character_limit_is_not_blamed_on_its_text_alone(api, monkeypatch):
    # The limit counts text + text_pair; a 6-character text was refused as "text is 12 characters long".
    monkeypatch.setattr(api.app.state.settings, "max_text_chars", 10)
    expected = "text and text_pair are 12 characters long together, over this server's limit of 10"
    err = error_of(api.post("/api/v1/attention", json={"text": "aaaaaa", "text_pair": "bbbbbb"}), 422)
    assert err == {"code": "too_long", "message": expected}
    err = error_of(api.post("/api/v1/experiments/change-token",
                            json={"text": "aaaaaa", "text_pair": "bbbbbb", "index": 1, "change": "unk"}), 422)
    assert err == {"code": "too_long", "message": expected}
    err = error_of(api.post("/api/v1/attention", json={"text": "a" * 11}), 422)
    assert err["message"] == "text is 11 characters long, over this server's limit of 10"


def test_json_over_the_cell_budget_is_413_with_a_hint(api, monkeypatch):
    settings = api.app.state.settings
    monkeypatch.setattr(settings, "max_json_cells", 1000)  # 6*12*8*8 = 4608 cells
    forwards_before = metric(api, "manyeyes_forward_seconds_count")
    err = error_of(api.post("/api/v1/attention", json={"text": "A brand new sentence here."}), 413)
    assert err["code"] == "too_many_cells" and "u8" in err["message"] and "1,000" in err["message"]
    assert metric(api, "manyeyes_forward_seconds_count") == forwards_before  # refused before the forward
    small = api.post("/api/v1/attention", json={"text": "A brand new sentence here.", "layers": [0], "heads": [0]})
    assert small.status_code == 200
    assert api.post("/api/v1/attention", json={"text": "A brand new sentence here.", "format": "u8"}).status_code == 200
    run_id = small.json()["run_id"]
    err = error_of(api.get(f"/api/v1/runs/{run_id}/attention"), 413)
    assert err["code"] == "too_many_cells"


def test_unknown_model_run_and_route_are_404(api):
    err = error_of(api.post("/api/v1/attention", json={"text": "hi", "model": "gpt-9"}), 404)
    assert err["code"] == "unknown_model" and "gpt-9" in err["message"] and "minilm" in err["message"]
    err = error_of(api.get("/api/v1/runs/0123abcd/attention"), 404)
    assert err["code"] == "unknown_run" and "POST /api/v1/attention" in err["message"]
    assert "run 0123abcd is unknown" in err["message"]
    err = error_of(api.get(f"/api/v1/runs/{'f' * 5000}/attention"), 404)  # named, not echoed whole
    assert err["code"] == "unknown_run" and len(err["message"]) < 200, len(err["message"])
    err = error_of(api.get("/api/v1/nothing"), 404)
    assert err["code"] == "not_found"
    err = error_of(api.delete("/api/v1/attention"), 405)
    assert err["code"] == "method_not_allowed"
    # A trailing slash was a bare 307 to an address built from the Host header.
    r = api.post("/api/v1/attention/", json={"text": "hi"}, headers={"host": "elsewhere.example"})
    assert error_of(r, 404)["code"] == "not_found" and "location" not in r.headers


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_that_is_not_sent_as_json_is_415_saying_which_header_to_send(api, content_type):
    """`curl -d '{...}'` sends a form: pydantic's "valid dictionary" message did not say what to change."""
    headers = {"content-type": content_type} if content_type else {}
    err = error_of(api.post("/api/v1/attention", content=b'{"text": "The bank."}', headers=headers), 415)
    assert err["code"] == "unsupported_media_type" and "Content-Type: application/json" in err["message"], err
    assert (repr(content_type) if content_type else "was missing") in err["message"], err
    # JSON sent as JSON that is not an object stays a 422 about the body's shape
    err = error_of(api.post("/api/v1/attention", json=["The bank."]), 422)
    assert err["code"] == "invalid_request"


def test_a_compressed_body_is_415_saying_to_send_it_uncompressed(api):
    """A gzipped body was "not valid JSON (at character 0)", which hid what to change."""
    body = gzip.compress(b'{"text": "The bank."}')
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    err = error_of(api.post("/api/v1/attention", content=body, headers=headers), 415)
    assert err["code"] == "unsupported_media_type" and "send it uncompressed" in err["message"] and "'gzip'" in err["message"]
    # Compressed bytes that happen to be UTF-8 fail as JSON, not as text: the same answer.
    err = error_of(api.post("/api/v1/attention", content=b"(\x05\x00text", headers={**headers, "content-encoding": "br"}), 415)
    assert "send it uncompressed" in err["message"] and "'br'" in err["message"]
    # Broken JSON sent as it is stays the 400 that says where it broke.
    err = error_of(api.post("/api/v1/attention", content=b'{"text": ', headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in err["message"]


def test_query_parameters_an_api_route_does_not_take_are_422(api):
    """`?layer=0` for `?layers=0` was ignored: the answer held every layer and did not say so."""
    run_id = api.post("/api/v1/attention", json={"text": "Typos.", "format": "u8"}).json()["run_id"]
    err = error_of(api.get(f"/api/v1/runs/{run_id}/attention", params={"layer": 0, "format": "u8"}), 422)
    assert err["code"] == "invalid_request"
    assert "'layer'" in err["message"] and "format, heads, layers" in err["message"], err["message"]
    err = error_of(api.get(f"/api/v1/runs/{run_id}/tile", params={"layer": 0, "head": 0, "zoom": 2, "q": "x" * 500}), 422)
    assert "'q'" in err["message"] and "'zoom'" in err["message"] and len(err["message"]) < 300
    err = error_of(api.post("/api/v1/attention", params={"format": "u8"}, json={"text": "Typos."}), 422)
    assert "'format'" in err["message"] and "takes: none" in err["message"]
    error_of(api.get("/api/v1/models", params={"verbose": 1}), 422)
    # What the routes declare still works, and routes outside /api (probes, the page) take anything.
    every = {"layer": 0, "head": 0, "q0": 0, "q1": 3, "k0": 0, "k1": 3, "rows": 3, "cols": 3, "pool": "max", "format": "json"}
    assert api.get(f"/api/v1/runs/{run_id}/tile", params=every).status_code == 200
    assert api.get(f"/api/v1/runs/{run_id}/attention", params={"layers": "0", "heads": "1", "format": "f16"}).status_code == 200
    assert api.get("/healthz", params={"probe": 1}).status_code == 200
    assert api.get("/", params={"text": "hi", "utm_source": "x"}).status_code == 200


def test_bad_slice_parameters_are_422(api):
    run_id = api.post("/api/v1/attention", json={"text": "Slices.", "format": "u8"}).json()["run_id"]
    for query, needle in (("layers=a", "integers"), ("heads=99", "head 99"), ("format=bmp", "format"),
                          # int() alone read these as 1, 10 and 1
                          ("layers=%D9%A1", "integers"), ("layers=1_0", "integers"), ("heads=%2B1", "integers"),
                          # read as every layer, and as layers 1 and 0: a client's bug passed for a choice
                          ("layers=,", "layers is empty"), ("heads=", "heads is empty"), ("layers=1,,0", "empty entry")):
        err = error_of(api.get(f"/api/v1/runs/{run_id}/attention?{query}"), 422)
        assert needle in err["message"], (query, err)
    err = error_of(api.get(f"/api/v1/runs/{run_id}/attention?layers={'9' * 5000}x"), 422)
    assert len(err["message"]) < 200, len(err["message"])  # the 5,000 digits are not echoed
    # Digits alone past Python's 4,300-digit int() limit were a 500, on every route that reads a list.
    for path in ("attention?layers=", "mean?layers=", "measures?names=rollout&heads=", "attention?heads=0,"):
        err = error_of(api.get(f"/api/v1/runs/{run_id}/{path}{'9' * 5000}"), 422)
        assert "does not exist" in err["message"] and len(err["message"]) < 200, (path, err)
    # Counted without leading zeros: 29 digits of layer 1 were "does not exist".
    r = api.get(f"/api/v1/runs/{run_id}/attention?format=json&layers={'0' * 28}1&heads=0000")
    assert r.status_code == 200 and (r.json()["layers"], r.json()["heads"]) == ([1], [0]), r.text


def test_batch_item_count_is_bounded(api):
    limit = api.app.state.settings.max_batch_texts
    err = error_of(api.post("/api/v1/attention/batch", json={"texts": ["x"] * (limit + 1)}), 422)
    assert f"at most {limit}" in err["message"] and err["max_batch_texts"] == limit
    err = error_of(api.post("/api/v1/attention/batch", json={"texts": []}), 422)
    assert err["code"] == "invalid_request"


def many(item: bytes, n: int) -> bytes:
    return b"[" + b",".join([item] * n) + b"]"


def unknown_fields(n: int, prefix: str = "k") -> bytes:
    return b",".join(f'"{prefix}{i}":1'.encode() for i in range(n))


# Each under the 1 MB body limit, each wrong in hundreds of thousands of places (review h54a).
MANY_WRONGS = [
    ("/api/v1/attention/batch", b'{"texts":' + many(b"1", 490_000) + b"}", "at most 4096 items"),
    ("/api/v1/attention/batch", b'{"texts":["a"],"text_pairs":' + many(b"1", 490_000) + b"}", "at most 4096 items"),
    ("/api/v1/attention", b'{"text":"a","layers":' + many(b'""', 330_000) + b"}", "at most 4096 items"),
    ("/api/v1/attention", b'{"text":"a","measures":' + many(b'"x"', 240_000) + b"}", "at most 64 items"),
    ("/api/v1/attention", b'{"text":"a",' + unknown_fields(60_000) + b"}", "60,000 fields this object does not take"),
    ("/api/v1/attention", b'{"text":"a","predictions":{' + unknown_fields(60_000) + b"}}", "predictions: 60,000 fields"),
    ("/api/v1/experiments/compare", b'{"text_a":"a","text_b":"b","difference":{"heads":' + many(b'"1"', 240_000) + b"}}",
     "at most 4096 items"),
    # The most ablations, each with as many unknown fields as the body holds: one error each.
    ("/api/v1/experiments/ablate", b'{"text":"a","ablate":' + many(b'{' + unknown_fields(20, "") + b'}', 4096) + b"}",
     "20 fields this object does not take ('0', '1', '2', '3', ...)"),
    ("/api/v1/generate", b'{"text":"a",' + unknown_fields(60_000) + b"}", "60,000 fields"),
    ("/api/v1/views", b'{"text":"a","model":"minilm",' + unknown_fields(60_000) + b"}", "60,000 fields"),
]


@pytest.mark.parametrize("path, body, needle", MANY_WRONGS, ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, _, _) in enumerate(MANY_WRONGS)])
def test_a_body_wrong_in_a_great_many_places_is_refused_in_few_words(api, path, body, needle):
    """A 1 MB body of 490,000 wrong items had every one described: 2.6 s of the event loop, where
    every other request waited, and a 25 MB answer. Lists are bounded and many unknown fields are
    one error, so the answer is short (and quick, which a test does not time)."""
    assert len(body) <= api.app.state.settings.max_body_bytes
    r = api.post(path, content=body, headers={"content-type": "application/json"})
    err = error_of(r, 422)
    assert err["code"] == "invalid_request" and needle in err["message"], err["message"][:300]
    assert len(r.content) < 2_000, len(r.content)


def test_a_body_with_many_errors_tells_the_first_ten_and_counts_the_rest(api):
    r = api.post("/api/v1/attention", json={"text": "a", "layers": ["0"] * 4096})
    err = error_of(r, 422)
    assert err["message"].count("Input should be a valid integer") == 10, err["message"]
    assert err["message"].endswith("; and 4,086 more") and len(r.content) < 2_000


def test_a_few_unknown_fields_are_each_named(api):
    err = error_of(api.post("/api/v1/attention", json={"text": "a", "txet": "b", "modle": "minilm"}), 422)
    assert err["message"] == "txet: Extra inputs are not permitted; modle: Extra inputs are not permitted"


def test_a_batch_holds_at_most_one_forward_passs_weights(api):
    """32 texts cut to 512 tokens took 2.4 GB of weights and an 807 MB u8 answer; now a batch
    over max_batch_cells is refused after tokenizing, before any forward pass."""
    texts = [f"{i} " + "word " * 600 for i in range(3)]  # 512 tokens each once cut: 3 x 18.9 M cells
    body = {"texts": texts, "format": "u8", "truncate": True}
    forwards = api.app.state.service.metrics.forward.labels("minilm")._sum.get()
    err = error_of(api.post("/api/v1/attention/batch", json=body), 413)
    assert err["code"] == "too_many_cells" and "fewer or shorter texts" in err["message"], err
    assert "56,623,104 cells" in err["message"], err
    assert api.app.state.service.metrics.forward.labels("minilm")._sum.get() == forwards


def test_evicted_run_is_404_and_cache_stays_within_its_bytes(api, monkeypatch):
    cache = api.app.state.service.cache
    # Room for about two 40-token runs, each reckoned with the overview it makes on first use.
    monkeypatch.setattr(cache, "max_bytes", 6 * 12 * 40 * 40 * 4 * 2 * 2)
    ids = [api.post("/api/v1/attention", json={"text": f"word {i} " * 19, "format": "u8", "layers": [0]}).json()["run_id"]
           for i in range(4)]
    assert cache.nbytes <= cache.max_bytes
    err = error_of(api.get(f"/api/v1/runs/{ids[0]}/attention"), 404)
    assert "evicted" in err["message"]
    assert api.get(f"/api/v1/runs/{ids[-1]}/attention?format=u8").status_code == 200


@pytest.fixture(scope="module")
def slow():
    """Slow forwards (0.5 s), a 0.3 s budget, room for two waiting requests, and a slow start."""
    settings = Settings(
        models={"minilm": "minilm"}, device="cpu", warmup=False, max_queue=2, request_timeout_s=0.3,
        debug_forward_delay_s=0.5, debug_load_delay_s=0.5,
    )
    from fastapi.testclient import TestClient

    from manyeyes.app.main import create_app

    client = TestClient(create_app(settings))
    client.__enter__()
    yield client
    client.__exit__(None, None, None)


def test_readyz_is_503_until_models_load_while_healthz_answers(slow):
    r = slow.get("/readyz")
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    body = r.json()  # the error, plus where each model stands
    assert body["error"]["code"] == "not_ready" and "loading" in body["error"]["message"]
    assert body["status"] == "loading" and set(body["models"]) == set(slow.app.state.settings.all_models())
    assert slow.get("/healthz").status_code == 200
    assert error_of(slow.post("/api/v1/attention", json={"text": "early"}), 503)["code"] == "not_ready"
    deadline = time.monotonic() + 30
    while slow.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_full_queue_is_429_with_retry_after_and_slow_work_is_504(slow):
    """N simultaneous requests against room for max_queue: exactly max_queue are admitted and time
    out (each forward outlasts the budget), and exactly N - max_queue are refused at once."""
    while slow.get("/readyz").status_code != 200:
        time.sleep(0.05)
    settings = slow.app.state.settings
    n = 8
    # Long enough that all n arrive while the admitted ones still hold their places, on a busy machine too:
    # an admitted input still waiting for its forward gives its place back at its deadline, and with the
    # fixture's 0.3 s one that arrived later than that under CI's load was admitted (three 504s, once).
    slow.app.state.registry.get(None).batcher.forward_delay_s = 6.0
    budget, settings.request_timeout_s = settings.request_timeout_s, 3.0
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda i: slow.post("/api/v1/attention", json={"text": f"busy {i}"}), range(n)))
    finally:
        slow.app.state.registry.get(None).batcher.forward_delay_s = settings.debug_forward_delay_s
        settings.request_timeout_s = budget
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [429] * (n - settings.max_queue) + [504] * settings.max_queue, statuses
    for r in replies:
        err = error_of(r, r.status_code)
        if r.status_code == 429:
            assert err["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1
        else:
            assert err["code"] == "timeout" and "3 s" in err["message"]
    assert metric(slow, "manyeyes_dropped_total", reason="queue_full") == statuses.count(429)
    # The server recovers: once the backlog drains, requests succeed again.
    slow.app.state.settings.request_timeout_s = 30
    deadline = time.monotonic() + 30
    while (r := slow.post("/api/v1/attention", json={"text": "after"})).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert r.status_code == 200


def test_an_empty_model_is_refused_not_taken_for_the_default(api):
    """"model": "" quietly ran the default model: a client that lost its value never learned it."""
    for method, url, body in (("post", "/api/v1/attention", {"text": "hi", "model": ""}),
                              ("get", "/export?text=hi&model=", None)):
        err = error_of(api.request(method.upper(), url, json=body), 404)
        assert err["code"] == "unknown_model" and "model is empty; omit it for the default (minilm)" in err["message"]
    err = error_of(api.post("/api/v1/attention", json={"text": "hi", "model": "m" * 5000}), 404)
    assert len(err["message"]) < 200, len(err["message"])  # named, not echoed whole


def test_a_body_that_is_not_json_is_a_400_that_says_where(api):
    """It was a 422 whose whole message was "9: JSON decode error"."""
    r = api.post("/api/v1/attention", content=b'{"text": "hi",}', headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["code"] == "bad_request"
    assert err["message"] == "the body is not valid JSON: Expecting property name enclosed in double quotes (at character 14)"


def test_an_empty_body_is_a_400_that_says_so_on_every_json_route(api):
    """No body was a 422 "Field required" that named no field."""
    for route in ("attention", "attention/batch", "generate", "views", "experiments/ablate", "experiments/compare",
                  "experiments/change-token"):
        err = error_of(api.post(f"/api/v1/{route}", headers={"content-type": "application/json"}), 400)
        assert err == {"code": "bad_request", "message": 'the body is empty: send a JSON object, e.g. {"text": "..."}'}, route
    # Without a JSON Content-Type it stays the 415 that says what to send.
    assert error_of(api.post("/api/v1/attention"), 415)["code"] == "unsupported_media_type"


@pytest.mark.parametrize("path", ["/export?text=%FF%FE&model=minilm", "/export?text=caf%C3&model=minilm",
                                  "/api/v1/runs/%FF/attention", "/api/v1/models?x=%80", "/api/v1/runs/ab%E9/topk"])
def test_a_url_whose_escapes_are_not_utf8_is_400(api, path):
    """Read as U+FFFD, such escapes exported a file of "\ufffd\ufffd" and named a run "\ufffd", where the
    same bytes in a JSON body got a 400."""
    error = error_of(api.get(path), 400)
    assert error["code"] == "bad_request" and "not UTF-8" in error["message"]


def test_a_query_of_utf8_escapes_still_exports(api):
    r = api.get("/export?text=caf%C3%A9+%E6%88%91&model=minilm")
    assert r.status_code == 200 and "café 我" in r.text


@pytest.mark.parametrize("path, body, who", [
    ("/api/v1/attention", {"text": "\u200b"}, "text"),
    ("/api/v1/attention", {"text": "\u0301\u0301"}, "text"),
    ("/api/v1/attention", {"text": "Fine.", "text_pair": "\u200b\u200d"}, "text_pair"),
    ("/api/v1/attention/batch", {"texts": ["Fine.", "\x07"]}, "texts[1]: text"),
    ("/api/v1/experiments/ablate", {"text": "\u200b", "ablate": [{"layer": 0, "head": 0}]}, "text"),
    ("/api/v1/experiments/compare", {"text_a": "Fine.", "text_b": "\u200b"}, "text_b: text"),
])
def test_a_text_that_gives_no_tokens_is_422_naming_it(api, path, body, who):
    """Not blank, yet MiniLM drops every character of it: its run of [CLS] and [SEP] alone was
    answered 200 as the text's (a review by use, non-English text)."""
    error = error_of(api.post(path, json=body), 422)
    assert error["message"].startswith(f"{who} gives no tokens on minilm")


def test_a_text_with_one_token_among_dropped_characters_still_runs(api):
    r = api.post("/api/v1/attention", json={"text": "\u200ba\u0301", "format": "json"})
    assert r.status_code == 200 and [t["piece"] for t in r.json()["tokens"]] == ["[CLS]", "a", "[SEP]"]


def test_a_pair_that_truncation_left_no_room_is_not_said_to_give_no_tokens():
    """A tiktoken model cuts a long text at its end, pair and all: "text_pair gives no tokens" blamed
    the tokenizer for what `truncate` did, where the run had been answered, truncated."""
    from manyeyes.app.services.attention import check_some_tokens
    from manyeyes.model.tokenizer import Encoded, Token

    kept = [Token("long", 7, 0, 4, False, 0, "long")]
    check_some_tokens("gpt2", Encoded(kept, [0], truncated=True), has_pair=True)  # no error: it was cut to fit
    with pytest.raises(Exception, match="text_pair gives no tokens on gpt2"):
        check_some_tokens("gpt2", Encoded(kept, [0], truncated=False), has_pair=True)
