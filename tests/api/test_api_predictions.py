"""Predictions on the API, the richer /api/v1/models, and /readyz while a Hub id downloads or fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from manyeyes.app.config import Settings
from manyeyes.app.main import create_app
from manyeyes.model import load
from tests.api.conftest import serve
from tests.hub_cache import add_to_cache, fake_hub, no_network  # noqa: F401 (fixtures)

TEXT = "In the beginning God created"


@pytest.fixture(scope="module")
def two():
    client = serve(Settings(models={"tiny-gpt": "tiny-gpt", "minilm": "minilm"}, device="cpu", max_wait_ms=5))
    yield client
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt", device="cpu")


def test_models_list_family_kv_heads_dtype_and_predictions(two):
    models = {m["id"]: m for m in two.get("/api/v1/models").json()["models"]}
    assert {k: models["tiny-gpt"][k] for k in ("family", "n_heads", "n_kv_heads", "max_tokens", "dtype", "predictions")} == {
        "family": "gpt", "n_heads": 8, "n_kv_heads": 8, "max_tokens": 256, "dtype": "float32", "predictions": True}
    assert (models["minilm"]["predictions"], models["minilm"]["dtype"]) == (False, "float32")


def test_causal_predictions_are_the_models_own_top_k(two, tiny):
    body = two.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "u8",
                                              "predictions": {"top_k": 3}}).json()
    expected = tiny.predict(TEXT, top_k=3)
    assert list(body["predictions"]) == [str(i) for i in range(len(body["tokens"]))] == [str(i) for i in expected]
    for pos, preds in expected.items():
        got = body["predictions"][str(pos)]
        assert [(p["token"], p["id"]) for p in got] == [(p.token, p.id) for p in preds]
        assert max(abs(p["prob"] - q.prob) for p, q in zip(got, preds)) <= 1e-6
    # The same run again comes from the run cache, predictions included; without asking, no key.
    again = two.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "u8",
                                               "predictions": {"top_k": 1}}).json()
    assert again["run_id"] == body["run_id"]
    assert {k: v[0]["id"] for k, v in again["predictions"].items()} == {k: v[0]["id"] for k, v in body["predictions"].items()}
    plain = two.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "u8"}).json()
    assert "predictions" not in plain
    batch = two.post("/api/v1/attention/batch", json={"texts": [TEXT, "And"], "model": "tiny-gpt", "format": "u8",
                                                      "predictions": {"top_k": 2}}).json()
    assert [len(r["predictions"]) for r in batch["results"]] == [len(r["tokens"]) for r in batch["results"]]


@pytest.mark.parametrize("predictions,message", [
    ({"top_k": 0}, "predictions.top_k: Input should be greater than or equal to 1"),
    ({"top_k": 21}, "predictions.top_k: Input should be less than or equal to 20"),
    ({"top_k": "5"}, "predictions.top_k: Input should be a valid integer"),
    ({"k": 5}, "predictions.k: Extra inputs are not permitted"),
])
def test_bad_predictions_options_are_422(two, predictions, message):
    r = two.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "predictions": predictions})
    assert r.status_code == 422 and message in r.json()["error"]["message"]


def test_predictions_from_a_model_without_a_head_are_422(two):
    r = two.post("/api/v1/attention", json={"text": TEXT, "model": "minilm", "predictions": {"top_k": 5}})
    assert r.status_code == 422
    assert r.json()["error"] == {"code": "invalid_request", "message": "model minilm has no language-model head, so it "
                                 "makes no predictions; GET /api/v1/models says which models do"}


def test_readyz_names_an_offline_missing_id_and_never_500s(fake_hub):
    from fastapi.testclient import TestClient

    with TestClient(create_app(Settings(models={"smol": "HuggingFaceTB/SmolLM2-135M"}, device="cpu"))) as client:
        for _ in range(200):
            r = client.get("/readyz")
            if r.json().get("status") == "failed":
                break
            threading.Event().wait(0.02)
        assert r.status_code == 503
        body = r.json()
        assert body["models"] == {"smol": {"state": "failed"}}
        assert "HuggingFaceTB/SmolLM2-135M is not in the Hugging Face cache" in body["error"]["message"]
        assert "hf download HuggingFaceTB/SmolLM2-135M" in body["error"]["message"]
        assert client.post("/api/v1/attention", json={"text": "x"}).status_code == 503


def test_readyz_reports_download_bytes(fake_hub, monkeypatch, tmp_path):
    """A simulated Hub whose one file stalls half-way: /readyz shows the bytes, then ready."""
    import huggingface_hub
    from huggingface_hub import constants

    release, halfway = threading.Event(), threading.Event()
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.conftest import train_bytelevel_tokenizer

    remote = tmp_path / "remote"
    GPT2LMHeadModel(GPT2Config(vocab_size=train_bytelevel_tokenizer(tmp_path / "tok.json"), n_positions=16, n_embd=12,
                               n_layer=1, n_head=3)).save_pretrained(remote)
    (remote / "tokenizer.json").write_bytes((tmp_path / "tok.json").read_bytes())
    sizes = {p.name: p.stat().st_size for p in remote.iterdir()}
    sha = "a" * 40

    class FakeApi:
        def model_info(self, repo, revision=None, files_metadata=False, timeout=None):
            siblings = [type("S", (), {"rfilename": n, "size": b})() for n, b in sizes.items()]
            return type("I", (), {"sha": sha, "siblings": siblings})()

    def fake_download(repo, filename, revision, cache_dir, tqdm_class):
        bar = tqdm_class(total=sizes[filename])
        if filename == "model.safetensors":
            bar.update(sizes[filename] // 2)
            halfway.set()
            release.wait(10)
            bar.update(sizes[filename] - sizes[filename] // 2)
        else:
            bar.update(sizes[filename])
        single = tmp_path / f"one-{filename}"
        single.mkdir()
        (single / filename).write_bytes((remote / filename).read_bytes())
        add_to_cache(Path(cache_dir), repo, single, commit=sha)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    from fastapi.testclient import TestClient

    with TestClient(create_app(Settings(models={"small": "org/small"}, device="cpu"))) as client:
        assert halfway.wait(10)
        body = client.get("/readyz").json()
        # save_pretrained wrote a generation_config.json, fetched (for its end-of-text ids) before the weights
        assert "generation_config.json" in sizes
        total = sizes["config.json"] + sizes["tokenizer.json"] + sizes["generation_config.json"] + sizes["model.safetensors"]
        done = total - sizes["model.safetensors"] + sizes["model.safetensors"] // 2
        assert body["status"] == "loading"
        assert body["models"] == {"small": {"state": "downloading", "bytes_done": done, "bytes_total": total}}
        release.set()
        for _ in range(500):
            if client.get("/readyz").status_code == 200:
                break
            threading.Event().wait(0.02)
        assert client.get("/readyz").json() == {"status": "ready", "models": ["small"]}
