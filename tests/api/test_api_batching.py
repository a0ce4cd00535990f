"""Dynamic micro-batching: concurrent requests share forwards yet each equals its own single run;
cached runs never reach the model."""

from __future__ import annotations

import concurrent.futures

import numpy as np

from tests.api.conftest import decode, metric

WORDS = "the river bank was full of fish while a heron waited by the old stone mill".split()


def sentence(i: int) -> str:
    n = 3 + (i * 7) % 40  # mixed lengths, 5..44 tokens
    return f"request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def test_32_concurrent_requests_are_batched_and_each_equals_its_single_run(api, minilm, monkeypatch):
    # Each forward held 50 ms (the server's debug hook): the requests still on their way queue up
    # behind it and share the next forwards even when a busy machine sends them slowly.
    monkeypatch.setattr(api.app.state.registry.get("minilm").batcher, "forward_delay_s", 0.05)
    batches_before = metric(api, "manyeyes_batch_size_count")
    inputs_before = metric(api, "manyeyes_batch_size_sum")
    texts = [sentence(i) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda t: api.post("/api/v1/attention", json={"text": t, "format": "json"}), texts))
    assert [r.status_code for r in replies] == [200] * 32
    for text, reply in zip(texts, replies):
        expected = minilm.attend(text).attention.numpy()
        got = decode(reply.json()["attention"])
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    forwards = metric(api, "manyeyes_batch_size_count") - batches_before
    inputs = metric(api, "manyeyes_batch_size_sum") - inputs_before
    assert inputs == 32
    assert forwards < 32, "no two requests ever shared a forward pass"
    # And padded batching really happened for some forward with more than one row.
    assert metric(api, "manyeyes_batch_size_bucket", le="1.0") < metric(api, "manyeyes_batch_size_count")


def test_a_cache_hit_does_not_call_the_model(api, monkeypatch):
    served = api.app.state.registry.get("minilm")
    calls = []
    real_run = served.model.run
    monkeypatch.setattr(served.model, "run", lambda batch, *a, **kw: calls.append(len(batch)) or real_run(batch, *a, **kw))
    text = "Caching saves a forward pass."
    first = api.post("/api/v1/attention", json={"text": text, "format": "u8"}).json()
    assert calls == [1]
    second = api.post("/api/v1/attention", json={"text": text, "format": "json", "layers": [3]}).json()
    sliced = api.get(f"/api/v1/runs/{first['run_id']}/attention?format=f16&heads=1").json()
    batch = api.post("/api/v1/attention/batch", json={"texts": [text, text], "format": "u8"}).json()
    assert calls == [1]
    assert second["run_id"] == sliced["run_id"] == first["run_id"] == batch["results"][1]["run_id"]
    assert second["timing_ms"]["forward"] == 0 and second["timing_ms"]["queue"] == 0
    assert np.abs(decode(second["attention"]) - decode(first["attention"])[3:4]).max() <= 0.5 / 255 + 1e-6
    assert metric(api, "manyeyes_cache_lookups_total", result="hit") >= 4
