"""Short commit SHAs (`org/x@dfc58f4`, as `git log --oneline` and the Hub's pages show them) resolve
against the cached snapshots' folder names; huggingface_hub resolves only refs and full SHAs, so
these were all "not in the Hugging Face cache"."""

from __future__ import annotations

import sys

import pytest
import torch

from manyeyes.model import ModelLoadError, load
from tests.hub_cache import add_to_cache, fake_hub, no_network  # noqa: F401 (fixtures)
from tests.test_hub import save_gpt2

TEXT = "The quick brown fox."
FIRST = "dfc58f4" + "a1" * 16 + "9"  # 40 hex digits
SECOND = "0123abc" + "b2" * 16 + "8"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bytelevel_tokenizer):
    """Two different random GPT-2s, so a prefix that picks the wrong snapshot is caught."""
    return [save_gpt2(tmp_path_factory.mktemp(f"short-{seed}"), bytelevel_tokenizer, seed) for seed in (1, 2)]


def attention(spec) -> torch.Tensor:
    return load(spec, device="cpu").attend(TEXT).attention


def message_of(spec) -> str:
    with pytest.raises(ModelLoadError) as raised:
        load(spec, device="cpu")
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_short_commit_loads_the_one_snapshot_it_starts(fake_hub, folders):
    assert len(FIRST) == len(SECOND) == 40
    add_to_cache(fake_hub, "org/x", folders[0], refs=(), commit=FIRST)
    add_to_cache(fake_hub, "org/x", folders[1], refs=("main",), commit=SECOND)
    first, second = (attention(f) for f in folders)
    assert not torch.equal(first, second)
    # The full SHA in capitals too: 39 of its digits were found, all 40 "not in the cache" (review h55a).
    for spec in ("org/x@dfc58f4", "org/x@dfc58f4a1a1", "org/x@DFC58F4", f"org/x@{FIRST[:39]}", f"org/x@{FIRST.upper()}"):
        assert torch.equal(attention(spec), first), spec
    assert torch.equal(attention("org/x@0123abc"), second)
    model = load("org/x@dfc58f4", device="cpu")
    assert model.info.id == "org/x@dfc58f4"  # the id as it was asked for
    # Six digits are too few to be read as a commit (git's shortest is seven): still not cached,
    # and the error says why a snapshot that starts with them was not taken.
    message = message_of("org/x@dfc58f")
    assert "org/x@dfc58f is not in the Hugging Face cache" in message
    assert "a cached snapshot's commit starts with dfc58f, but a short commit takes 7 hex digits or more" in message
    assert "7 hex digits" not in message_of("org/x@abcdef")  # none starts with it: nothing to explain


def test_a_short_commit_that_starts_several_snapshots_lists_them(fake_hub, folders):
    one, two = "dfc58f4" + "1" * 33, "dfc58f4" + "2" * 33
    add_to_cache(fake_hub, "org/x", folders[0], commit=one)
    add_to_cache(fake_hub, "org/x", folders[1], commit=two)
    message = message_of("org/x@dfc58f4")
    assert "the short commit dfc58f4 matches 2 snapshots in the Hugging Face cache" in message
    assert f"{one}, {two}" in message and "give more of the SHA" in message
    assert str(fake_hub / "models--org--x" / "snapshots") in message
    # One more digit chooses.
    assert torch.equal(attention("org/x@dfc58f41"), attention(folders[0]))
    assert torch.equal(attention("org/x@dfc58f42"), attention(folders[1]))


def test_a_short_commit_no_snapshot_starts_is_the_not_cached_error(fake_hub, folders):
    add_to_cache(fake_hub, "org/x", folders[0], commit=FIRST)
    message = message_of("org/x@1234567")
    assert "model org/x@1234567 is not in the Hugging Face cache" in message and "revision 1234567" in message
    assert "no cached snapshot's commit starts with 1234567" in message
    assert "HF_HUB_OFFLINE is set" in message


def test_a_ref_named_like_a_short_commit_wins_as_in_git(fake_hub, folders):
    add_to_cache(fake_hub, "org/x", folders[0], refs=(), commit="cafef00d" + "0" * 32)
    add_to_cache(fake_hub, "org/x", folders[1], refs=("cafef00d",), commit=SECOND)
    assert torch.equal(attention("org/x@cafef00d"), attention(folders[1]))
    assert torch.equal(attention("org/x@cafef00d0"), attention(folders[0]))


def test_a_corrupt_file_reached_by_a_short_commit_is_fetched_again_by_the_full_one(fake_hub, folders, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folders[0], broken)
    (broken / "tokenizer.json").write_text("{}")
    add_to_cache(fake_hub, "org/x", broken, commit=FIRST)
    message = message_of("org/x@dfc58f4")
    # `hf download --revision dfc58f4` would ask the Hub for a prefix; the full SHA is what it knows.
    assert f"`hf download org/x --revision {FIRST} --force-download`" in message


def _revision_not_found(revision: str):
    from huggingface_hub import errors

    httpx_module = sys.modules[errors.Response.__module__]
    url = f"https://huggingface.co/api/models/org/x/revision/{revision}"
    response = errors.Response(404, request=httpx_module.Request("GET", url))
    return errors.RevisionNotFoundError(f"404 Client Error. Invalid rev id: {revision}", response=response)


@pytest.fixture()
def online(monkeypatch):
    """Downloads allowed, with a fake Hub that knows no revision and records what it was asked."""
    import huggingface_hub
    from huggingface_hub import constants

    asked = []

    class FakeApi:
        def model_info(self, repo, revision=None, files_metadata=False, timeout=None):
            asked.append((repo, revision))
            raise _revision_not_found(revision)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return asked


def test_online_a_cached_short_commit_asks_the_hub_nothing(fake_hub, folders, online):
    add_to_cache(fake_hub, "org/x", folders[0], refs=(), commit=FIRST)
    assert torch.equal(attention("org/x@dfc58f4"), attention(folders[0]))
    assert online == []


def test_online_a_short_commit_the_hub_does_not_know_asks_for_the_full_sha(fake_hub, folders, online):
    add_to_cache(fake_hub, "org/x", folders[0], refs=(), commit=FIRST)
    message = message_of("org/x@1234567")
    assert online == [("org/x", "1234567")]
    assert "model org/x has no revision '1234567'" in message
    assert f"no snapshot in the Hugging Face cache at {fake_hub} has a commit that starts with it" in message
    assert "knows no branch, tag or commit by that name; give the full 40-character SHA" in message
    # A revision that is not a short SHA keeps its own message.
    assert message_of("org/x@v9") == "model org/x has no revision 'v9'"
