"""Two names for one model (MANYEYES_MODELS like a=org/gpt2,b=org/gpt2, or one local folder written
two ways) share one loaded copy of the weights, and each name still answers as itself: its own
model id, run ids, runs in the cache and metrics."""

from __future__ import annotations

import numpy as np
import pytest

import manyeyes.app.services.registry as registry_module
from manyeyes.app.config import Settings
from tests.api.conftest import metric, serve
from tests.conftest import save_random_gpt2
from tests.hub_cache import add_to_cache, fake_hub, no_network  # noqa: F401 (fixtures)

TEXT = "Attention heads look at other tokens."


@pytest.fixture
def loads(monkeypatch):
    """The specs the registry really loaded, in order."""
    loaded = []
    real = registry_module.load

    def counting(spec, **kwargs):
        loaded.append(str(spec))
        return real(spec, **kwargs)

    monkeypatch.setattr(registry_module, "load", counting)
    return loaded


@pytest.fixture
def gpt2_folder(tmp_path, bytelevel_tokenizer):
    folder = tmp_path / "gpt2"
    save_random_gpt2(folder, bytelevel_tokenizer, 5, n_embd=24, n_layer=2, n_head=3)
    return folder


def started(models: dict[str, str]):
    return serve(Settings(models=models, device="cpu", warmup=False, max_wait_ms=1))


def assert_shared(client, a: str, b: str) -> None:
    registry = client.app.state.registry
    first, second = registry.get(a).model, registry.get(b).model
    assert first is not second and (first.info.id, second.info.id) == (a, b)
    assert second.net is first.net and second.tokenizer is first.tokenizer
    for (name, p), (_, q) in zip(first.net.named_parameters(), second.net.named_parameters(), strict=True):
        assert p is q and p.data_ptr() == q.data_ptr(), name


def assert_answers_as_itself(client, a: str, b: str) -> None:
    """Both names answer the same text with the same weights, each under its own id and run."""
    bodies = {}
    for name in (a, b):
        r = client.post("/api/v1/attention", json={"text": TEXT, "model": name, "format": "json"})
        assert r.status_code == 200, r.text
        bodies[name] = r.json()
        assert bodies[name]["model"] == name
    assert bodies[a]["run_id"] != bodies[b]["run_id"]
    assert [t["id"] for t in bodies[a]["tokens"]] == [t["id"] for t in bodies[b]["tokens"]]
    weights = {name: np.asarray(body["attention"]["data"], dtype=np.float32) for name, body in bodies.items()}
    assert weights[a].shape[0] == 2 and np.array_equal(weights[a], weights[b])
    assert np.allclose(weights[a].sum(-1), 1, atol=1e-5)
    for name in (a, b):  # each run is cached under its own name, and was a forward of that name's
        run = client.get(f"/api/v1/runs/{bodies[name]['run_id']}").json()
        assert run["model"] == name
        assert metric(client, "manyeyes_forward_seconds_count", model=name) >= 1
    models = {m["id"] for m in client.get("/api/v1/models").json()["models"]}
    assert {a, b} <= models


def test_one_local_folder_under_two_names_is_loaded_once(gpt2_folder, loads):
    """The same folder, once as written and once as `folder/.`, and a third, other model."""
    client = started({"a": str(gpt2_folder), "b": f"{gpt2_folder}/.", "tiny": "tiny-gpt"})
    try:
        assert loads == [str(gpt2_folder), "tiny-gpt"]
        assert_shared(client, "a", "b")
        assert client.app.state.registry.get("tiny").model.net is not client.app.state.registry.get("a").model.net
        assert_answers_as_itself(client, "a", "b")
    finally:
        client.__exit__(None, None, None)


def test_one_hub_id_under_two_names_is_loaded_once(fake_hub, gpt2_folder, loads):
    add_to_cache(fake_hub, "org/gpt2", gpt2_folder)
    client = started({"a": "org/gpt2", "b": "org/gpt2"})
    try:
        assert loads == ["org/gpt2"]
        assert_shared(client, "a", "b")
        assert_answers_as_itself(client, "a", "b")
    finally:
        client.__exit__(None, None, None)


def test_the_keys_that_decide_sharing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    key = registry_module.weights_key
    assert key("m") == key("./m") == key(str(tmp_path / "m")) == key("m/.") == str(tmp_path / "m")
    assert key("m?tokenizer=t.json") == str(tmp_path / "m") + "?tokenizer=t.json" != key("m")
    assert key("org/gpt2") == "org/gpt2" != key("org/gpt2@v1")  # Hub ids as written
    (tmp_path / "tiny-gpt").mkdir()
    assert key("tiny-gpt") == "tiny-gpt"  # a built-in name wins over a folder of that name, as in load()
