"""POST /api/v1/experiments/*: the same numbers as the Python API, and a clear 4xx for bad input."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest

from manyeyes.app.config import Settings
from manyeyes.model import load
from manyeyes.model.experiments import Ablation, ablate, change_token, compare
from tests.api.conftest import serve

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory, minilm_dir):
    """A random BERT with its masked-LM head (MiniLM's tokenizer): no download."""
    from tests.test_encoder_families import _mlm_bert

    folder = tmp_path_factory.mktemp("mlm")
    _mlm_bert(folder, minilm_dir)
    return folder


@pytest.fixture(scope="module")
def client(mlm_dir):
    c = serve(Settings(models={"minilm": "minilm", "tiny-gpt": "tiny-gpt", "mlm": str(mlm_dir)}, device="cpu",
                       warmup=False, max_json_cells=20_000))
    yield c
    c.__exit__(None, None, None)


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt", device="cpu")


def decode(t: dict) -> np.ndarray:
    if t["format"] == "json":
        return np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])
    raw = base64.b64decode(t["data"])
    if t["format"] == "f16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(t["shape"])
    return np.frombuffer(raw, dtype=np.uint8).astype(np.float32).reshape(t["shape"]) * t["scale"] + t["offset"]


def assert_error(r, status: int, code: str, words: str):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code and words in body["message"], body


def test_ablate_matches_the_python_api_on_a_causal_lm(client, tiny):
    body = {"text": PROMPT, "model": "tiny-gpt", "ablate": [{"layer": 0, "head": 3, "mode": "mean"}], "top_k": 3,
            "attention": {"format": "json", "layers": [1], "heads": [0, 5]}}
    r = client.post("/api/v1/experiments/ablate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    want = ablate(tiny, tiny.encode(PROMPT), [Ablation(0, 3, "mean")], top=3)
    assert [(c["layer"], c["head"]) for c in got["ranking"]] == [(c.layer, c.head) for c in want.ranking]
    assert [c["divergence"] for c in got["ranking"]] == pytest.approx([c.divergence for c in want.ranking], abs=1e-6)
    assert got["ranking"][0]["layer"] == 1 and len(got["ranking"]) == 8
    changes = got["logprob_change"]
    assert [(c["position"], c["id"]) for c in changes] == want.targets
    assert [c["change"] for c in changes] == pytest.approx(want.logprob_change.tolist(), abs=1e-5)
    # the change is the difference of the two numbers shown, to the last bit (it was float32's)
    assert all(c["after"] - c["before"] == c["change"] for c in changes)
    assert got["predictions"]["positions"] == list(range(len(got["tokens"])))
    assert [g["id"] for g in got["predictions"]["after"][5]] == [g.id for g in want.top_after[5]]
    attention = decode(got["attention"])
    assert attention.shape == (1, 2, len(got["tokens"]), len(got["tokens"]))
    assert np.abs(attention - want.after.attention[[1]][:, [0, 5]].numpy()).max() == 0


def test_ablate_an_encoder_without_a_head_ranks_but_predicts_nothing(client, minilm):
    r = client.post("/api/v1/experiments/ablate", json={"text": "The bank of the river.", "model": "minilm",
                                                        "ablate": [{"layer": 4, "head": 1}], "attention": {"format": "u8"}})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["predictions"] is None and got["logprob_change"] is None
    assert {c["layer"] for c in got["ranking"]} == {5} and len(got["ranking"]) == 12
    want = ablate(minilm, minilm.encode("The bank of the river."), [Ablation(4, 1)])
    assert np.abs(decode(got["attention"]) - want.after.attention.numpy()).max() <= 0.5 / 255 + 1e-6


def test_ablate_a_masked_lm_scores_the_masks(client, mlm_dir):
    text = "The [MASK] of the river was [MASK] and wide."
    r = client.post("/api/v1/experiments/ablate", json={"text": text, "model": "mlm", "top_k": 2,
                                                        "ablate": [{"layer": 0, "head": 2}, {"layer": 0, "head": 4, "mode": "mean"}]})
    assert r.status_code == 200, r.text
    got = r.json()
    model = load(mlm_dir, device="cpu")
    want = ablate(model, model.encode(text), [Ablation(0, 2, "zero"), Ablation(0, 4, "mean")], top=2)
    masks = [i for i, t in enumerate(got["tokens"]) if t["piece"] == "[MASK]"]
    assert got["predictions"]["positions"] == masks == want.predicted
    assert [(c["position"], c["id"]) for c in got["logprob_change"]] == want.targets
    assert [c["change"] for c in got["logprob_change"]] == pytest.approx(want.logprob_change.tolist(), abs=1e-5)
    assert [len(row) for row in got["predictions"]["after"]] == [2, 2]


def test_change_token_and_compare_match_the_python_api(client, minilm):
    r = client.post("/api/v1/experiments/change-token",
                    json={"text": "The bank of the river.", "model": "minilm", "index": 2, "change": "mask",
                          "difference": {"format": "f16", "layers": [0, 3]}})
    assert r.status_code == 200, r.text
    got = r.json()
    want = change_token(minilm, minilm.encode("The bank of the river."), 2, "mask")
    assert got["tokens_b"][2]["piece"] == "[MASK]" and [tuple(p) for p in got["pairs"]] == want.pairs
    assert [(c["layer"], c["head"]) for c in got["ranking"]] == [(c.layer, c.head) for c in want.ranking]
    assert np.abs(decode(got["difference"]) - want.difference[[0, 3]].numpy()).max() <= 1e-3

    a, b = "The bank of the river.", "The bank of the old river."
    r = client.post("/api/v1/experiments/compare",
                    json={"text_a": a, "text_b": b, "model": "minilm",
                          "difference": {"format": "json", "layers": [2], "heads": [3, 4]}})
    assert r.status_code == 200, r.text
    got = r.json()
    want = compare(minilm, a, b)
    assert [tuple(p) for p in got["pairs"]] == want.pairs
    assert got["ranking"][0]["divergence"] == pytest.approx(want.ranking[0].divergence, abs=1e-6)
    assert np.abs(decode(got["difference"]) - want.difference[[2]][:, [3, 4]].numpy()).max() == 0
    # u8 differences are signed: byte * 2/254 - 1, so that no difference reads as 0 exactly
    r = client.post("/api/v1/experiments/compare", json={"text_a": a, "text_b": b, "model": "minilm",
                                                         "difference": {"format": "u8"}})
    diff = decode(r.json()["difference"])
    assert diff.min() < -0.01 and np.abs(diff - want.difference.numpy()).max() <= 1 / 254 + 1e-6
    same = client.post("/api/v1/experiments/compare", json={"text_a": a, "text_b": a, "model": "minilm",
                                                            "difference": {"format": "u8"}})
    assert not decode(same.json()["difference"]).any()  # byte 127 everywhere read -0.0039
    assert r.json()["truncated_a"] is r.json()["truncated_b"] is False


def test_compare_and_change_token_say_which_text_was_cut_to_fit(client):
    """Only the ablation said so: a client had to count A's 512 tokens to learn it was cut."""
    long = " ".join(["river"] * 600)
    r = client.post("/api/v1/experiments/compare", json={"text_a": long, "text_b": "The river.", "model": "minilm", "truncate": True})
    assert r.status_code == 200, r.text
    assert (r.json()["truncated_a"], r.json()["truncated_b"]) == (True, False) and len(r.json()["tokens_a"]) == 512
    r = client.post("/api/v1/experiments/change-token", json={"text": long, "model": "minilm", "truncate": True, "index": 3, "change": "delete"})
    assert r.status_code == 200, r.text
    assert (r.json()["truncated_a"], r.json()["truncated_b"]) == (True, True)


@pytest.mark.parametrize(
    "path, body, status, code, words",
    [
        ("ablate", {"text": "hi", "ablate": [{"layer": 6, "head": 0}]}, 422, "invalid_request", "no head L6 H0"),
        ("ablate", {"text": "hi", "ablate": [{"layer": 0, "head": 1}, {"layer": 0, "head": 1, "mode": "mean"}]},
         422, "invalid_request", "named twice"),
        ("ablate", {"text": "hi", "ablate": [{"layer": 0, "head": 1, "mode": "noise"}]}, 422, "invalid_request", "mode"),
        ("ablate", {"text": "hi", "ablate": []}, 422, "invalid_request", "ablate"),
        ("ablate", {"text": "hi", "ablate": [{"layer": 0, "head": 0}], "model": "nope"}, 404, "unknown_model", "nope"),
        ("ablate", {"text": "hi", "ablate": [{"layer": 0, "head": 0}], "attention": {"format": "json"}},
         200, "", ""),
        ("ablate", {"text": "hi " * 200, "ablate": [{"layer": 0, "head": 0}], "attention": {"format": "json"}},
         413, "too_many_cells", "format=u8"),
        ("ablate", {"text": "hi " * 600, "ablate": [{"layer": 0, "head": 0}]}, 422, "too_long", "512"),
        ("ablate", {"text": "   ", "ablate": [{"layer": 0, "head": 0}]}, 422, "invalid_request", "whitespace"),
        ("ablate", {"text": "hi", "ablate": [{"layer": 0, "head": 0}], "attention": {"layers": [0, 0]}},
         422, "invalid_request", "once"),
        ("change-token", {"text": "The bank.", "index": 9, "change": "mask"}, 422, "invalid_request", "token index"),
        ("change-token", {"text": "The bank.", "index": 0, "change": "unk"}, 422, "invalid_request", "special"),
        ("change-token", {"text": "The bank.", "index": 1, "change": "swap"}, 422, "invalid_request", "change"),
        ("change-token", {"text": "ab", "model": "tiny-gpt", "index": 1, "change": "mask"}, 422, "invalid_request",
         "no mask token"),
        ("compare", {"text_a": "abc", "text_b": "xyz", "model": "tiny-gpt"}, 422, "invalid_request", "share no token"),
        ("compare", {"text_a": "a", "text_b": "b", "difference": {"heads": [12]}}, 422, "invalid_request", "head 12"),
        ("compare", {"text_a": "a", "text_b": "x" * 100_001}, 422, "too_long", "text_b"),
    ],
)
def test_bad_input_gets_a_clear_4xx(client, path, body, status, code, words):
    r = client.post(f"/api/v1/experiments/{path}", json=body)
    if status == 200:
        assert r.status_code == 200, r.text
        return
    assert_error(r, status, code, words)


def test_experiments_beyond_the_limit_get_429(client):
    service = client.app.state.experiments
    taken = [service._slots.acquire() for _ in range(client.app.state.settings.max_experiments)]
    try:
        assert all(taken)
        r = client.post("/api/v1/experiments/compare", json={"text_a": "a b", "text_b": "a c"})
        assert_error(r, 429, "queue_full", "experiments are running")
        assert r.headers["retry-after"] == "1"
    finally:
        for _ in taken:
            service._slots.release()
    assert client.post("/api/v1/experiments/compare", json={"text_a": "a b", "text_b": "a c"}).status_code == 200


def test_one_client_holds_at_most_half_the_experiments(client):
    """One client looping 512-token compares on two connections kept both slots, and another
    client's tiny compare got 429 59 times in 59 (review h50a)."""
    assert client.post("/api/v1/experiments/compare", json={"text_a": "a b", "text_b": "a c"}).status_code == 200
    service = client.app.state.experiments
    here = "addr:testclient"  # the address TestClient's requests come from
    share = service._slots.client_share
    assert share == client.app.state.settings.max_experiments // 2 >= 1
    taken = [service._slots.acquire(here) for _ in range(share)]
    try:
        assert all(taken) and not service._slots.acquire(here)  # its share is all it gets
        r = client.post("/api/v1/experiments/compare", json={"text_a": "a b", "text_b": "a c"})
        assert_error(r, 429, "queue_full", "its share")
        assert service._slots.acquire("addr:10.0.0.7")  # another client still finds a slot free
        service._slots.release("addr:10.0.0.7")
    finally:
        for _ in taken:
            service._slots.release(here)
    assert service._slots.held_by == {} and service._slots.running == 0
    assert client.post("/api/v1/experiments/compare", json={"text_a": "a b", "text_b": "a c"}).status_code == 200


def test_an_experiments_buffers_past_the_pool_are_let_go_when_it_ends(client):
    """Its finished buffers stayed mapped until the next buffer was made: after bursts of 512-token
    experiments the server sat 400 MB above its warm-up with an empty run cache, for good, past
    SECURITY.md's bound once the cache filled (review h50a)."""
    from manyeyes.model import buffers

    pool, limit = buffers._pool, buffers._pool.limit_bytes
    assert limit > 0  # the server's lifespan keeps finished mappings (MANYEYES_BUFFER_POOL_BYTES)
    buffers.keep_free_mappings(1)  # keep nothing finished: an experiment's must go once it ends
    try:
        body = {"text_a": "a b " * 110, "text_b": "a c " * 110, "model": "minilm"}  # 12 MB of weights a run
        assert client.post("/api/v1/experiments/compare", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while pool.kept_bytes() > 0 and time.monotonic() < deadline:  # unmapped on the pool's thread
            time.sleep(0.01)
        assert pool.kept_bytes() == 0
    finally:
        buffers.keep_free_mappings(limit)


def test_openapi_documents_the_experiments_with_examples(client):
    spec = client.get("/openapi.json").json()
    for path in ("ablate", "change-token", "compare"):
        op = spec["paths"][f"/api/v1/experiments/{path}"]["post"]
        assert {"200", "404", "422", "429"} <= set(op["responses"])
    schemas = spec["components"]["schemas"]
    assert schemas["AblateRequest"]["examples"] and schemas["CompareRequest"]["examples"]


def test_an_experiment_abandoned_before_it_got_a_thread_frees_its_slot(monkeypatch):
    """Cancelled (a 504, a hang-up) while waiting for a worker thread, the experiment never ran and
    never released its slot: two such and every experiment was a 429 until a restart."""
    import asyncio

    import manyeyes.app.services.experiments as experiments

    api = serve(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False, max_experiments=1,
                         request_timeout_s=0.3))
    try:
        real = experiments.run_in_threadpool

        async def no_thread_free(fn, *args):  # every worker thread busy for longer than the budget
            await asyncio.sleep(3600)

        body = {"text": "In the beginning", "model": "tiny-gpt", "ablate": [{"layer": 0, "head": 0}]}
        monkeypatch.setattr(experiments, "run_in_threadpool", no_thread_free)
        for _ in range(2):
            assert api.post("/api/v1/experiments/ablate", json=body).status_code == 504
        monkeypatch.setattr(experiments, "run_in_threadpool", real)
        # The slot is what is tested, not the machine's speed: a busy CI machine took over 0.3 s.
        monkeypatch.setattr(api.app.state.experiments.settings, "request_timeout_s", 60.0)
        r = api.post("/api/v1/experiments/ablate", json=body)
        assert r.status_code == 200, r.text
    finally:
        api.__exit__(None, None, None)
