"""Contract v1, endpoint by endpoint, against the running app and the model run directly."""

from __future__ import annotations

import asyncio
import base64
import gzip

import numpy as np
import orjson
import pytest

from manyeyes.app.config import Settings
from tests.api.conftest import decode, metric, serve

TEXT = "The bank of the river."
TOKEN_KEYS = {"text", "id", "start", "end", "special", "segment", "piece"}


def test_models_lists_the_default_minilm(api):
    body = api.get("/api/v1/models").json()
    assert body == {
        "models": [
            {
                "id": "minilm", "family": "bert", "causal": False, "n_layers": 6, "n_heads": 12, "n_kv_heads": 12,
                "d_model": 384, "head_dim": 32, "max_tokens": 512, "device": "cpu", "dtype": "float32",
                "predictions": False, "sliding_windows": [None] * 6, "token_changes": ["mask", "unk", "delete"],
                "eos_ids": [], "default": True,
            }
        ],
        "limits": {"max_json_cells": 2_000_000, "max_new_tokens": 256},
    }


def test_attention_json_matches_the_model(api, minilm):
    r = api.post("/api/v1/attention", json={"text": TEXT})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {
        "run_id", "model", "causal", "n_layers", "n_heads", "tokens", "truncated", "layers", "heads", "kept",
        "precision", "attention", "device", "timing_ms",
    }
    assert body["kept"] == "weights" and body["precision"] == "json"
    expected = minilm.attend(TEXT)
    assert body["model"] == "minilm" and body["causal"] is False and body["truncated"] is False
    assert (body["n_layers"], body["n_heads"], body["device"]) == (6, 12, "cpu")
    assert body["layers"] == list(range(6)) and body["heads"] == list(range(12))
    assert all(set(t) == TOKEN_KEYS for t in body["tokens"])
    assert [(t["text"], t["id"], t["start"], t["end"], t["special"], t["segment"], t["piece"]) for t in body["tokens"]] == [
        (t.text, t.id, t.start, t.end, t.special, t.segment, t.piece) for t in expected.tokens
    ]
    att = body["attention"]
    assert (att["format"], att["dtype"], att["shape"]) == ("json", "float32", [6, 12, 8, 8])
    assert "scale" not in att
    np.testing.assert_allclose(decode(att), expected.attention.numpy(), atol=1e-5, rtol=0)
    assert set(body["timing_ms"]) == {"tokenize", "queue", "forward", "wait", "encode"}
    assert all(v >= 0 for v in body["timing_ms"].values())


def test_the_wait_for_the_answers_memory_is_timed(api, monkeypatch):
    """A request that waited seconds behind other answers said only tokenize, queue and forward."""
    service = api.app.state.service
    reserve = service.reserve

    async def after_a_wait(*args):
        await asyncio.sleep(0.3)
        return await reserve(*args)

    monkeypatch.setattr(service, "reserve", after_a_wait)
    body = api.post("/api/v1/attention", json={"text": "A text of its own for the wait."}).json()
    assert 300 <= body["timing_ms"]["wait"] < 5_000, body["timing_ms"]


def test_layers_and_heads_select_in_the_order_asked(api, minilm):
    body = api.post("/api/v1/attention", json={"text": TEXT, "layers": [4, 1], "heads": [11, 0, 3]}).json()
    assert body["layers"] == [4, 1] and body["heads"] == [11, 0, 3]
    assert body["attention"]["shape"] == [2, 3, 8, 8]
    full = minilm.attend(TEXT).attention.numpy()
    np.testing.assert_allclose(decode(body["attention"]), full[[4, 1]][:, [11, 0, 3]], atol=1e-5, rtol=0)


def test_text_pair_and_truncate(api, minilm):
    body = api.post("/api/v1/attention", json={"text": "Where is it?", "text_pair": "On the bank."}).json()
    assert {t["segment"] for t in body["tokens"]} == {0, 1}
    bank = next(t for t in body["tokens"] if t["text"] == "bank")
    assert (bank["segment"], bank["start"], bank["end"]) == (1, 7, 11)
    long = api.post("/api/v1/attention", json={"text": "word " * 600, "truncate": True, "format": "u8"}).json()
    assert long["truncated"] is True and long["attention"]["shape"] == [6, 12, 512, 512]


def test_run_id_is_stable_and_depends_on_what_changes_the_forward(api):
    post = lambda **kw: api.post("/api/v1/attention", json={"text": TEXT, "layers": [0], "heads": [0], **kw}).json()  # noqa: E731
    first = post()["run_id"]
    assert post(format="u8", layers=[3])["run_id"] == first  # a different view of the same run
    assert post(text_pair="Yes.")["run_id"] != first
    assert post(truncate=True)["run_id"] != first
    assert api.post("/api/v1/attention", json={"text": TEXT + " "}).json()["run_id"] != first


def test_texts_that_join_alike_are_different_runs(api):
    # The run id once joined its fields with \x1f and wrote "no pair" as \x00, both characters a
    # client may send: these pairs shared one run, and the second was answered with the first's tokens.
    for first, second in (
        ({"text": "x\x1fy", "text_pair": "z"}, {"text": "x", "text_pair": "y\x1fz"}),
        ({"text": "hi"}, {"text": "hi", "text_pair": "\x00a"}),
    ):
        answers = [api.post("/api/v1/attention", json={**body, "format": "u8", "layers": [0], "heads": [0]}).json()
                   for body in (first, second)]
        assert answers[0]["run_id"] != answers[1]["run_id"]
        pieces = [[(t["text"], t["segment"]) for t in a["tokens"]] for a in answers]
        assert pieces[0] != pieces[1], pieces  # each answer is its own input's tokens
    # A pair of "\x00" alone, MiniLM keeps nothing of: refused, never the run of "hi" alone.
    alone = api.post("/api/v1/attention", json={"text": "hi", "text_pair": "\x00", "format": "u8"})
    assert alone.status_code == 422 and alone.json()["error"]["message"].startswith("text_pair gives no tokens")


def test_runs_serves_any_slice_of_a_recent_run(api, minilm):
    run_id = api.post("/api/v1/attention", json={"text": TEXT, "format": "u8", "layers": [0], "heads": [0]}).json()["run_id"]
    full = minilm.attend(TEXT).attention.numpy()
    r = api.get(f"/api/v1/runs/{run_id}/attention", params={"layers": "5,2", "heads": "7", "format": "json"})
    assert r.status_code == 200
    body = r.json()
    assert body["run_id"] == run_id and body["layers"] == [5, 2] and body["heads"] == [7]
    np.testing.assert_allclose(decode(body["attention"]), full[[5, 2]][:, [7]], atol=1e-5, rtol=0)
    assert body["timing_ms"]["forward"] == 0
    # Repeated parameters work too, and the default is everything.
    r = api.get(f"/api/v1/runs/{run_id}/attention?layers=1&layers=3&format=f16")
    assert r.json()["attention"]["shape"] == [2, 12, 8, 8]


def test_batch_returns_one_result_per_text(api, minilm):
    texts = ["Short.", "A somewhat longer sentence about a river bank.", TEXT]
    r = api.post("/api/v1/attention/batch", json={"texts": texts, "format": "u8", "heads": [2]})
    assert r.status_code == 200
    results = r.json()["results"]
    assert len(results) == 3
    for text, result in zip(texts, results):
        expected = minilm.attend(text).attention.numpy()[:, [2]]
        assert result["attention"]["shape"] == list(expected.shape)
        assert np.abs(decode(result["attention"]) - expected).max() <= 0.5 / 255 + 1e-6


def test_a_batch_takes_a_pair_per_text(api, minilm):
    """A study of sentence pairs (premise, hypothesis) had to post them one at a time."""
    texts, pairs = ["Where is it?", "Who said it?", TEXT], ["On the bank.", None, "Yes, it is."]
    r = api.post("/api/v1/attention/batch", json={"texts": texts, "text_pairs": pairs, "format": "json", "heads": [2]})
    assert r.status_code == 200
    for text, pair, result in zip(texts, pairs, r.json()["results"]):
        expected = minilm.attend(text, pair).attention.numpy()[:, [2]]
        np.testing.assert_allclose(np.asarray(result["attention"]["data"]), expected, atol=1e-5)
        assert {t["segment"] for t in result["tokens"]} == ({0, 1} if pair else {0})
        alone = api.post("/api/v1/attention", json={"text": text, **({"text_pair": pair} if pair else {})}).json()
        assert alone["run_id"] == result["run_id"]  # one run, however it was asked for
    for bad, words in (({"text_pairs": ["x"]}, "text_pairs holds 1 entries for 2 texts"),
                       ({"text_pairs": ["x", " "]}, "text_pairs[1] must contain something"),
                       ({"text_pairs": "x"}, "text_pairs")):
        r = api.post("/api/v1/attention/batch", json={"texts": ["a", "b"], **bad})
        assert r.status_code == 422 and words in r.json()["error"]["message"], r.json()


def test_health_ready_and_metrics(api):
    assert api.get("/healthz").json() == {"status": "ok"}
    assert api.get("/readyz").json() == {"status": "ready", "models": ["minilm"]}
    api.post("/api/v1/attention", json={"text": TEXT})
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("manyeyes_requests_total", "manyeyes_request_seconds_bucket", "manyeyes_queue_depth",
                 "manyeyes_batch_size_bucket", "manyeyes_forward_seconds_bucket", "manyeyes_cache_lookups_total"):
        assert name in r.text
    assert metric(api, "manyeyes_requests_total", route="/api/v1/attention", method="POST", status="200") >= 1


@pytest.mark.parametrize("path", ["/", "/healthz", "/readyz", "/api/v1/models", "/static/js/api.js", "/api/v1/runs/" + "0" * 32])
def test_head_answers_as_get_without_the_body(api, path):
    """`curl -I` and health checks that send HEAD got 405 from every GET route."""
    plain = {"Accept-Encoding": "identity"}
    got, head = api.get(path, headers=plain), api.head(path, headers=plain)
    assert head.status_code == got.status_code and head.content == b""
    for name in ("content-type", "content-length", "x-content-type-options"):
        assert head.headers.get(name) == got.headers.get(name), name
    assert int(head.headers["content-length"]) == len(got.content) > 0


def test_head_is_counted_under_its_route(api):
    before = metric(api, "manyeyes_requests_total", route="/healthz", method="HEAD", status="200")
    api.head("/healthz")
    assert metric(api, "manyeyes_requests_total", route="/healthz", method="HEAD", status="200") == before + 1


def test_head_on_a_post_route_is_405_naming_post(api):
    r = api.head("/api/v1/attention")
    assert r.status_code == 405 and "POST" in r.headers["allow"] and r.content == b""


def test_a_405_on_a_get_route_allows_head_too(api):
    """The 405 said `Allow: GET` on routes that answer HEAD as well."""
    for method, path in (("PUT", "/api/v1/models"), ("DELETE", "/healthz"), ("POST", "/api/v1/runs/" + "0" * 32)):
        r = api.request(method, path)
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD", (path, r.headers.get("allow"))
    assert api.get("/api/v1/attention").headers["allow"] == "POST"


@pytest.mark.parametrize("path", ["/static/js/api.js", "/vendor/plotly.min.js", "/vendor/swagger-ui/swagger-ui.css"])
def test_ranges_on_files_are_honoured_ignored_when_malformed_and_refused_in_json(api, path):
    """A Range that is no bytes range set was a plain-text 400 (HTTP says ignore it and send the
    file); one past the end a plain-text 416."""
    whole = api.get(path, headers={"Accept-Encoding": "identity"}).content
    part = api.get(path, headers={"Range": "bytes=0-9", "Accept-Encoding": "identity"})
    assert part.status_code == 206 and part.content == whole[:10]
    # Numbers of thousands of digits, which int() refuses: a 500 and Starlette's plain-text 400.
    huge = "9" * 5000
    for malformed in ("items=0-1", "bytes=", "bytes=5-2", "bytes=abc", "bytes=0-1;x", f"bytes=5-{huge}", f"bytes={huge}-",
                      f"bytes=-{huge}"):
        r = api.get(path, headers={"Range": malformed, "Accept-Encoding": "identity"})
        assert r.status_code == 200 and r.content == whole, malformed[:20]
    for past_the_end in (f"bytes={len(whole) + 10}-", "bytes=-0"):
        r = api.get(path, headers={"Range": past_the_end, "Accept-Encoding": "identity"})
        assert r.status_code == 416 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "range_not_satisfiable" and r.headers["content-range"] == f"bytes */{len(whole)}"
        assert r.json()["error"]["message"] == "no byte of the file lies in the Range asked for"


def test_large_json_is_gzipped_at_level_6_or_less_and_compact_formats_from_their_threshold(api):
    from starlette.middleware.gzip import GZipMiddleware

    headers = {"Accept-Encoding": "gzip"}
    request = {"text": "word " * 100}
    with api.stream("POST", "/api/v1/attention", json=request, headers=headers) as r:
        assert r.headers["content-encoding"] == "gzip"
        raw = b"".join(r.iter_raw())
    # A gzip stream's XFL byte is 2 only for level 9; the configured level is what bounds it.
    assert raw[:2] == b"\x1f\x8b" and raw[8] != 2
    assert np.asarray(orjson.loads(gzip.decompress(raw))["attention"]["data"]).shape == (6, 12, 102, 102)
    levels = [m.kwargs["compresslevel"] for m in api.app.user_middleware if issubclass(m.cls, GZipMiddleware)]
    assert levels and all(1 <= level <= 6 for level in levels)
    # Compact answers too, from the compact threshold (64 KiB) on; under it, as they are.
    r = api.post("/api/v1/attention", json={**request, "format": "u8"}, headers=headers)
    assert r.headers["content-encoding"] == "gzip" and r.headers["content-type"] == "application/vnd.manyeyes+json"
    small = api.post("/api/v1/attention", json={**request, "format": "u8", "layers": [0], "heads": [0]}, headers=headers)
    assert "content-encoding" not in small.headers and small.json()["attention"]["shape"] == [1, 1, 102, 102]


def test_openapi_documents_the_contract_with_examples(api):
    spec = api.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/api/v1/models", "/api/v1/attention", "/api/v1/attention/batch", "/api/v1/runs/{run_id}/attention",
                 "/healthz", "/readyz"):
        assert path in paths
    schemas = spec["components"]["schemas"]
    assert schemas["AttentionRequest"]["examples"] and schemas["AttentionResponse"]["examples"]
    assert set(paths["/api/v1/attention"]["post"]["responses"]) >= {"200", "404", "413", "422", "429", "504"}
    assert api.get("/docs").status_code == 200


def test_openapi_response_examples_hold_real_numbers_and_ids(api):
    """The attention example's u8 rows summed to 1.36, 0.83 and 0.78, and the tiny models'
    examples gave "I" and "n" their ASCII codes (73, 110) for ids (the tokenizers say 41, 78)."""
    from manyeyes.model import load

    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    attention = schemas["AttentionResponse"]["examples"][0]["attention"]
    rows = np.frombuffer(base64.b64decode(attention["data"]), np.uint8).reshape(attention["shape"]) * attention["scale"]
    assert np.abs(rows.sum(-1) - 1).max() <= 3 / 255, rows.sum(-1)
    tokenizers = {}
    for name in ("AblateResponse", "RunInfo"):
        example = schemas[name]["examples"][0]
        model = example["model"]
        tokenizers.setdefault(model, load(model).tokenizer)
        for token in example["tokens"]:
            assert tokenizers[model].encode(token["text"]).ids == [token["id"]], (name, token)


def test_openapi_lists_the_401_and_422_every_api_route_can_give_in_their_real_shape(api):
    # With API keys every /api route and /export answer 401, and every one refuses an unknown query
    # parameter with a 422 {"error": ...}; the schema had 401 on six of them and showed FastAPI's
    # {"detail": [...]} for the 422 of GET /runs/{run_id} and /views/{view_id}.
    spec = api.get("/openapi.json").json()
    undocumented = []
    for path, methods in spec["paths"].items():
        if not (path.startswith("/api/") or path == "/export"):
            continue
        for method, operation in methods.items():
            # A body over MANYEYES_MAX_BODY_BYTES is a 413 on any POST (POST /generate's was not listed).
            for status in ("400", "401", "422") + (("413", "415") if method == "post" else ()):
                schema = operation["responses"].get(status, {}).get("content", {}).get("application/json", {}).get("schema")
                if schema != {"$ref": "#/components/schemas/ErrorResponse"}:
                    undocumented.append(f"{method.upper()} {path} {status}: {schema}")
    assert undocumented == []
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    r = api.get("/api/v1/models", params={"foo": 1})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


def test_openapi_declares_the_compact_media_type_and_the_key_scheme_of_a_keyed_server(api):
    """Every u8/f16 answer is application/vnd.manyeyes+json, which the schema did not name; and on
    a server with keys /docs could not send one (no security scheme)."""
    spec = api.get("/openapi.json").json()
    for path, method in (("/api/v1/attention", "post"), ("/api/v1/attention/batch", "post"), ("/api/v1/runs/{run_id}/attention", "get"),
                         ("/api/v1/runs/{run_id}/mean", "get"), ("/api/v1/runs/{run_id}/tile", "get"),
                         ("/api/v1/runs/{run_id}/topk", "get"), ("/api/v1/runs/{run_id}/overview", "get")):
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        assert content["application/vnd.manyeyes+json"]["schema"] == content["application/json"]["schema"], path
    assert "securitySchemes" not in spec.get("components", {})  # no keys here: nothing to send
    keyed = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, api_keys=["k"]))
    try:
        spec = keyed.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert spec["components"]["securitySchemes"] == {
            "bearer": {"type": "http", "scheme": "bearer", "description": "One of MANYEYES_API_KEYS"}}
        for path, methods in spec["paths"].items():
            for operation in methods.values():
                needs = path.startswith("/api/") or path == "/export"
                assert (operation.get("security") == [{"bearer": []}]) == needs, path
    finally:
        keyed.__exit__(None, None, None)


def test_openapi_examples_keep_their_nulls_and_every_status_a_route_answers_is_listed(api):
    """FastAPI drops nulls from examples: FlowResponse's residual edge lost its "head": null and
    failed its own schema. GET /runs/{id} answered 429 (a run recomputed under --workers) with
    only 404 listed, and a closed /metrics 401 with only 200 (h56d)."""
    from pydantic import BaseModel

    from manyeyes.app import schemas

    spec = api.get("/openapi.json").json()
    checked = 0
    for name, shown in spec["components"]["schemas"].items():
        model = getattr(schemas, name, None)
        if isinstance(model, type) and issubclass(model, BaseModel) and "examples" in shown:
            for example in shown["examples"]:
                model.model_validate(example)
                checked += 1
    assert checked >= 5 and spec["components"]["schemas"]["FlowResponse"]["examples"][0]["edges"][1]["head"] is None
    for path in ("/api/v1/runs/{run_id}", "/api/v1/runs/{run_id}/tile", "/api/v1/runs/{run_id}/cell",
                 "/api/v1/runs/{run_id}/topk", "/api/v1/runs/{run_id}/overview", "/api/v1/runs/{run_id}/attention"):
        assert {"404", "429", "503", "504"} <= set(spec["paths"][path]["get"]["responses"]), path
    assert set(spec["paths"]["/metrics"]["get"]["responses"]) == {"200"}  # open here: it answers
    closed = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, api_keys=["k"], close_metrics=True))
    try:
        metrics = closed.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]["/metrics"]["get"]
        assert "401" in metrics["responses"] and metrics["security"] == [{"bearer": []}], metrics
        assert closed.get("/metrics").status_code == 401
    finally:
        closed.__exit__(None, None, None)


def test_a_single_value_query_parameter_given_twice_is_refused_and_lists_still_repeat(api):
    """`?layer=0&layer=3` answered layer 3 alone (the framework keeps the last), and `format=u8&format=json`
    JSON: a client's bug, or a proxy that appended its own, answered as if nothing were wrong."""
    run_id = api.post("/api/v1/attention", json={"text": "Rivers have banks."}).json()["run_id"]
    for path, params in ((f"/api/v1/runs/{run_id}/topk", [("layer", 0), ("layer", 3), ("head", 1), ("k", 2)]),
                         (f"/api/v1/runs/{run_id}/attention", [("layers", 1), ("format", "u8"), ("format", "json")])):
        r = api.get(path, params=params)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        repeated = params[1][0] if params[1][0] == params[0][0] else "format"
        assert f"query parameter '{repeated}' given more than once" in r.json()["error"]["message"], r.text
    r = api.get(f"/api/v1/runs/{run_id}/attention", params=[("layers", 1), ("layers", 4), ("heads", 0), ("format", "u8")])
    assert r.status_code == 200 and r.json()["layers"] == [1, 4], r.text
    assert api.get(f"/api/v1/runs/{run_id}/topk", params={"layer": 0, "head": 1, "k": 2}).status_code == 200


# How far each format may be from the float32 weights: u8 rounds to the nearest 1/255, f16 keeps 11 bits.
FORMAT_TOLERANCE = {"json": 1e-6, "u8": 0.5 / 255 + 1e-6, "f16": 1e-3}


@pytest.mark.parametrize("fmt", ["json", "u8", "f16"])
def test_every_format_round_trips_the_same_run(api, fmt, minilm):
    """The POST's weights are the model's, and the cached run's slice in the same format is the same bytes' worth."""
    text = "Rivers have banks."
    body = api.post("/api/v1/attention", json={"text": text, "format": fmt, "layers": [1]}).json()
    assert body["attention"]["format"] == fmt
    posted = decode(body["attention"])
    assert posted.shape == (1, 12, 6, 6)
    expected = minilm.attend(text).attention.numpy()[[1]]
    assert np.abs(posted - expected).max() <= FORMAT_TOLERANCE[fmt]
    # Not a constant or a copy of one head: the heads differ from each other as the model's do.
    assert np.abs(expected[0, 0] - expected[0, 1]).max() > 10 * FORMAT_TOLERANCE[fmt]

    again = api.get(f"/api/v1/runs/{body['run_id']}/attention", params={"layers": "1", "format": fmt}).json()
    assert again["run_id"] == body["run_id"] and again["timing_ms"]["forward"] == 0
    np.testing.assert_array_equal(decode(again["attention"]), posted)


def test_a_mean_says_which_layers_and_heads_it_averages(api):
    """GET /mean?layers=1 answered layers [0], n_layers 1, n_heads 1 (its one matrix's) and
    nothing said what it averaged: read as layer 0 (review h47a)."""
    text = "The mean of one layer of the bank."
    run = api.post("/api/v1/attention", json={"text": text, "format": "json", "layers": [1]}).json()
    mean = api.get(f"/api/v1/runs/{run['run_id']}/mean", params={"layers": "1", "format": "json"}).json()
    assert mean["mean_of"] == {"layers": [1], "heads": list(range(12))}
    assert (mean["layers"], mean["heads"], mean["n_layers"], mean["n_heads"]) == ([0], [0], 1, 1)  # the one matrix
    heads = np.asarray(run["attention"]["data"][0], dtype=np.float32)  # (12, T, T) of layer 1
    np.testing.assert_allclose(np.asarray(mean["attention"]["data"][0][0]), heads.mean(0), atol=1e-6)
    every = api.get(f"/api/v1/runs/{run['run_id']}/mean", params={"format": "json"}).json()
    assert every["mean_of"] == {"layers": list(range(6)), "heads": list(range(12))}
    plain = api.post("/api/v1/attention", json={"text": text, "format": "u8"}).json()
    assert "mean_of" not in plain  # only the mean route's answer
