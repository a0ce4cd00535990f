"""The download path itself: huggingface_hub's own client against a Hub on loopback
(tests/fake_hub_server.py), where test_hub.py stands a fake in for the client."""

from __future__ import annotations

import threading

import pytest
import torch

from manyeyes.model import ModelLoadError, load
from manyeyes.model import hub as hub_module
from tests.fake_hub_server import FakeHub
from tests.test_hub import TEXT, attention, save_gpt2


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """The Hub at a loopback address (huggingface_hub reads HF_ENDPOINT once, at import: its
    constants are pointed there), an empty cache, downloads allowed."""
    from huggingface_hub import constants

    server = FakeHub()
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if hasattr(constants, "AGENT_HARNESSES_PATH"):  # a registry huggingface_hub caches under HF_HOME
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "harnesses.json"))
    yield server, cache
    server.close()


@pytest.fixture(scope="module")
def remote(tmp_path_factory, bytelevel_tokenizer):
    return save_gpt2(tmp_path_factory.mktemp("remote"), bytelevel_tokenizer, 1)


def test_a_downloaded_model_loads_again_offline_and_with_the_hub_down(hub, remote, monkeypatch):
    """Each file was fetched at the listing's commit, so huggingface_hub wrote no refs/main: the
    model on disk was "not in the cache" offline, and needed the Hub at every start."""
    from huggingface_hub import constants

    server, cache = hub
    sha = server.add("org/tiny", remote)
    assert torch.equal(attention("org/tiny"), attention(remote))
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == sha
    asked = len(server.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert torch.equal(attention("org/tiny"), attention(remote))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    server.close()  # the Hub down, downloads still allowed: the cache answers
    assert torch.equal(attention("org/tiny"), attention(remote))
    assert len(server.requests) == asked


def test_a_listing_that_never_comes_is_given_up(hub, remote, monkeypatch):
    """huggingface_hub waits for ever by default: `serve` stayed "loading" and the CLI silent."""
    server, _ = hub
    server.add("org/hang", remote, hang_listing=True)
    monkeypatch.setattr(hub_module, "INFO_TIMEOUT_S", 1.0)
    failed = []
    loading = threading.Thread(target=lambda: failed.append(pytest.raises(ModelLoadError, load, "org/hang")), daemon=True)
    loading.start()
    loading.join(60)
    assert not loading.is_alive(), "still waiting for the listing"
    message = str(failed[0].value)
    assert "the Hub could not be reached, or broke off (ReadTimeout" in message and "\n" not in message, message


def test_a_file_the_hub_refuses_is_said_to_be_refused(hub, remote):
    """A 403 read "An error happened while trying to locate the file on the Hub ... make sure your
    Internet connection is on.. Check the network"."""
    server, cache = hub
    server.add("org/closed", remote, forbidden={"tokenizer.json"})
    with pytest.raises(ModelLoadError) as raised:
        load("org/closed")
    message = str(raised.value)
    assert message.startswith(f"model org/closed is not in the Hugging Face cache at {cache} and the Hub refused a file "
                              "of it: 403 Forbidden for tokenizer.json."), message
    assert "\n" not in message and "Internet connection" not in message and "Check the network" not in message


def test_a_weight_file_damaged_on_its_way_is_refused_and_fetched_anew(hub, remote):
    """The same length, other bytes: the weights loaded as they came, though the listing names the
    file's SHA-256."""
    server, cache = hub
    server.add("org/damaged", remote, damaged={"model.safetensors"})
    from manyeyes.model import CorruptFileError

    with pytest.raises(CorruptFileError, match="the downloaded model.safetensors does not match the SHA-256 the Hub lists"):
        load("org/damaged")
    assert not list((cache / "models--org--damaged" / "blobs").glob("*")) or all(
        p.stat().st_size != (remote / "model.safetensors").stat().st_size for p in (cache / "models--org--damaged" / "blobs").iterdir())
    server.repos["org/damaged"].damaged.clear()  # the next try comes through whole
    assert torch.equal(attention("org/damaged"), attention(remote))


def test_progress_ends_at_its_total_when_some_files_were_kept(hub, bytelevel_tokenizer, tmp_path):
    """Files kept from an earlier try counted in the total, never in what was done: /readyz stayed
    at "downloading 51%" once the rest had come."""
    server, cache = hub
    sharded = save_gpt2(tmp_path / "sharded", bytelevel_tokenizer, 2, max_shard_size="20KB")
    sha = server.add("org/sharded", sharded)
    load("org/sharded")
    snapshot = cache / "models--org--sharded" / "snapshots" / sha
    shards = sorted(snapshot.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[0].unlink()  # an earlier try that stopped short: one shard lost, no ref yet
    (cache / "models--org--sharded" / "refs" / "main").unlink()
    reports = []
    load("org/sharded", progress=lambda done, total: reports.append((done, total)))
    assert reports and reports[-1][0] == reports[-1][1] > 0, reports
    assert (snapshot / shards[0].name).exists()


def test_a_cache_that_takes_no_ref_still_loads_and_says_why_offline_will_not(hub, remote, monkeypatch, caplog):
    """A cache filled before refs were written, then read-only: the ref's write escaped as a
    PermissionError traceback, where the files were all in (review h56h)."""
    server, cache = hub
    server.add("org/kept", remote)
    load("org/kept")
    (cache / "models--org--kept" / "refs" / "main").unlink()

    def refused(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(hub_module, "_write_ref", refused)
    with caplog.at_level("WARNING", logger="manyeyes.model.hub"):
        assert torch.equal(attention("org/kept"), attention(remote))
    assert any("could not write main's ref" in r.getMessage() and "Read-only file system" in r.getMessage()
               for r in caplog.records), caplog.records
