"""Hub ids and caches as a demanding user meets them: odd names, broken cache entries, corrupt
files. Every failure is one `ModelLoadError` that names the file (or the ref, or the key) and
says what to do; what does load agrees with transformers (eager attention) to 1e-5."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from manyeyes.model import ModelLoadError, load
from manyeyes.model.hub import parse_hub_id
from tests.hub_cache import add_to_cache, fake_hub, no_network  # noqa: F401 (fixtures)

TEXT = "Attention heads look at other tokens; some look back, some look ahead. The quick brown fox."


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory, bytelevel_tokenizer):
    from tests.conftest import save_random_gpt2

    folder = tmp_path_factory.mktemp("gpt2")
    save_random_gpt2(folder, bytelevel_tokenizer, 1, n_embd=24, n_layer=2, n_head=3)
    return folder


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory, bytelevel_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(1)
    GPT2LMHeadModel(GPT2Config(vocab_size=bytelevel_tokenizer[1], n_positions=32, n_embd=24, n_layer=2,
                               n_head=3)).save_pretrained(folder, max_shard_size="20KB")
    shutil.copy(bytelevel_tokenizer[0], folder / "tokenizer.json")
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def snapshot(cache: Path, repo: str, commit: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def message_of(spec, **kw) -> str:
    with pytest.raises(ModelLoadError) as raised:
        load(spec, device="cpu", **kw)
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# ---------------------------------------------------------------------------- names


def test_a_trailing_newline_is_no_hub_id(fake_hub, gpt2_folder):
    """`$` matched before a trailing newline: "org/tiny\\n" loaded org/tiny under the id "org/tiny\\n"."""
    add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    assert parse_hub_id("org/tiny\n") is None and parse_hub_id("org/tiny@main\n") is None
    assert "no such model file or folder" in message_of("org/tiny\n")


def test_an_empty_spec_is_refused_not_read_as_the_working_directory(gpt2_folder, monkeypatch):
    """Path("") is ".": an empty --model (an unset variable in a script) loaded whatever model
    folder the process happened to run in, or said "missing file: config.json"."""
    monkeypatch.chdir(gpt2_folder)
    for spec in ("", "   "):
        message = message_of(spec)
        assert "empty model spec" in message and "Hugging Face id" in message


def test_whitespace_around_a_name_is_pointed_out(fake_hub, gpt2_folder):
    add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    assert "leading or trailing whitespace" in message_of(" org/tiny ")


@pytest.mark.parametrize("spec, reason", [
    ("org/x--y", "Cannot have -- or .."),
    ("org/tiny.git", "cannot end by '.git'"),
    ("org/gépt2", "alphanumeric"),
    ("org/" + "x" * 120, "maximum length is 96"),
])
def test_an_invalid_hub_id_is_called_that_not_a_broken_cache(fake_hub, spec, reason):
    """These were "cannot read the Hugging Face cache at ...": the cache was fine, the name was not."""
    message = message_of(spec)
    assert "neither a local file or folder nor a valid Hugging Face id" in message and reason in message
    assert "cannot read the Hugging Face cache" not in message


def test_a_case_mismatch_names_the_cached_spelling(fake_hub, gpt2_folder):
    add_to_cache(fake_hub, "Org/Tiny", gpt2_folder)
    message = message_of("org/tiny")
    assert "org/tiny is not in the Hugging Face cache" in message and "did you mean Org/Tiny?" in message


# ---------------------------------------------------------------------------- broken cache entries


def test_a_missing_shard_is_named_with_its_index(fake_hub, sharded_folder):
    """Was: "lacks weights (model.safetensors, its index and shards, or pytorch_model.bin)"."""
    commit = add_to_cache(fake_hub, "org/sharded", sharded_folder)
    shard = sorted(snapshot(fake_hub, "org/sharded", commit).glob("model-*.safetensors"))[1]
    shard.unlink()
    message = message_of("org/sharded")
    assert f"{shard.name} (named by model.safetensors.index.json)" in message
    assert "hf download org/sharded" in message


def test_a_shard_map_pointing_at_the_wrong_shard_says_so(sharded_folder, tmp_path):
    """A key the index lists under a shard that lacks it was "missing key 'h.1.ln_2.weight'", as if
    the index did not list it."""
    folder = tmp_path / "wrong-map"
    shutil.copytree(sharded_folder, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, shard in index["weight_map"].items() if shard == shards[-1])
    index["weight_map"][key] = shards[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = message_of(str(folder))
    assert f"model.safetensors.index.json names {shards[0]} for '{key}', but that shard does not hold it" in message


def test_a_dangling_link_names_the_missing_blob(fake_hub, sharded_folder, gpt2_folder):
    commit = add_to_cache(fake_hub, "org/dangling", gpt2_folder)
    link = snapshot(fake_hub, "org/dangling", commit) / "config.json"
    blob = link.resolve()
    blob.unlink()
    message = message_of("org/dangling")
    assert f"config.json (a link to the missing blob {blob})" in message

    commit = add_to_cache(fake_hub, "org/sharded-blob", sharded_folder)
    shard = sorted(snapshot(fake_hub, "org/sharded-blob", commit).glob("model-*.safetensors"))[2]
    shard_blob = shard.resolve()
    shard_blob.unlink()
    message = message_of("org/sharded-blob")
    assert f"{shard.name} (named by model.safetensors.index.json; a link to the missing blob {shard_blob})" in message


def test_a_ref_to_a_missing_snapshot_says_so(fake_hub, gpt2_folder):
    """Was: "is not in the Hugging Face cache", with the repo's folder right there."""
    add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    ref = fake_hub / "models--org--tiny" / "refs" / "main"
    ref.write_text("f" * 40)
    message = message_of("org/tiny")
    assert f"refs/main points at commit {'f' * 40}, but its snapshot folder" in message
    assert "hf download org/tiny" in message


@pytest.mark.parametrize("held", ["", "../../../models--org--other/snapshots/x"])
def test_an_empty_or_odd_ref_is_named_not_followed(fake_hub, gpt2_folder, held):
    """An empty refs/main resolved to the snapshots/ folder itself, reported as lacking every file."""
    add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    commit = add_to_cache(fake_hub, "org/other", gpt2_folder)
    (fake_hub / "models--org--tiny" / "refs" / "main").write_text(held.replace("/x", f"/{commit}"))
    message = message_of("org/tiny")
    assert "refs/main holds '" in message and "not a commit hash" in message and "lacks" not in message


def test_a_ref_with_a_trailing_newline_says_so(fake_hub, gpt2_folder):
    """huggingface_hub reads a ref as it is: "abc\\n" names no snapshot. The message read the ref
    stripped and said the snapshot folder of that commit was missing, with the folder right there."""
    commit = add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    (fake_hub / "models--org--tiny" / "refs" / "main").write_text(commit + "\n")
    message = message_of("org/tiny")
    assert f"refs/main holds '{commit}\\n': the commit with white space around it" in message
    assert "is missing" not in message


@pytest.mark.parametrize("reached", ["symlink", "relative", "dotdot"])
def test_a_cache_reached_through_a_symlink_or_a_relative_path_loads(fake_hub, gpt2_folder, tmp_path, monkeypatch, reached):
    """huggingface_hub answers the snapshot's resolved path, which the check compared with the
    cache's path as given: a cached model was "not in the cache" ("its snapshot folder is missing")."""
    from huggingface_hub import constants

    add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    want = load("org/tiny", device="cpu").attend("The fox.").attention
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").symlink_to(fake_hub, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    named = {"symlink": str(tmp_path / "linked"), "relative": fake_hub.name,
             "dotdot": str(tmp_path / "elsewhere" / ".." / fake_hub.name)}[reached]
    monkeypatch.setenv("HF_HUB_CACHE", named)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", named)
    assert torch.equal(load("org/tiny", device="cpu").attend("The fox.").attention, want)


def test_a_cache_entry_without_its_ref_lists_its_snapshots(fake_hub, gpt2_folder):
    commit = add_to_cache(fake_hub, "org/tiny", gpt2_folder)
    (fake_hub / "models--org--tiny" / "refs" / "main").unlink()
    message = message_of("org/tiny")
    assert "has no refs/main" in message and f"org/tiny@{commit}" in message
    # The advice works: the commit loads.
    assert load(f"org/tiny@{commit}", device="cpu").info.family == "gpt2"


def test_corrupt_cached_files_say_how_to_fetch_them_again(fake_hub, gpt2_folder):
    """A truncated blob said "corrupt weights file ...: incomplete metadata" and nothing more."""
    commit = add_to_cache(fake_hub, "org/trunc", gpt2_folder)
    weights = (snapshot(fake_hub, "org/trunc", commit) / "model.safetensors").resolve()
    weights.write_bytes(weights.read_bytes()[:-100])
    message = message_of("org/trunc")
    assert "corrupt weights file" in message and "model.safetensors" in message
    assert "`hf download org/trunc --force-download`" in message

    commit = add_to_cache(fake_hub, "org/badconfig", gpt2_folder)
    (snapshot(fake_hub, "org/badconfig", commit) / "config.json").resolve().write_text("{not json")
    message = message_of("org/badconfig")
    assert "cannot read JSON" in message and "`hf download org/badconfig --force-download`" in message

    commit = add_to_cache(fake_hub, "org/badtok", gpt2_folder)
    (snapshot(fake_hub, "org/badtok", commit) / "tokenizer.json").resolve().write_text("{}")
    message = message_of("org/badtok@" + commit)
    assert "tokenizer.json" in message and f"`hf download org/badtok --revision {commit} --force-download`" in message


def test_a_config_without_model_type_says_it_lacks_one(fake_hub, gpt2_folder, tmp_path):
    folder = tmp_path / "typeless"
    shutil.copytree(gpt2_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    message = message_of(folder)
    assert "config.json has no model_type" in message and "gpt2" in message


def test_the_cli_reports_a_broken_cache_in_one_line(tmp_path, gpt2_folder):
    cache = tmp_path / "cache"
    add_to_cache(cache, "org/tiny", gpt2_folder)
    (cache / "models--org--tiny" / "refs" / "main").write_text("e" * 40)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "manyeyes.app.cli", "attend", TEXT, "--model", "org/tiny"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"refs/main points at commit {'e' * 40}" in done.stderr


# ---------------------------------------------------------------------------- parity through Hub ids


def _family_cases(vocab: int):
    import transformers as tf

    base = dict(vocab_size=vocab + 5, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                intermediate_size=80, max_position_embeddings=96, initializer_range=0.2)
    return {
        "org/llama-gqa-head-dim": (tf.LlamaConfig, tf.LlamaForCausalLM,
                                   base | dict(num_key_value_heads=3, head_dim=10, attention_bias=True,
                                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 24})),
        "org/mistral-window": (tf.MistralConfig, tf.MistralForCausalLM,
                               base | dict(num_key_value_heads=2, sliding_window=7)),
        "org/qwen2-layer-types": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                                  base | dict(num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=True,
                                              sliding_window=4,
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        "org/neox-tied": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                          base | dict(rotary_pct=0.5, tie_word_embeddings=True, use_parallel_residual=False)),
        "org/gpt2-untied": (tf.GPT2Config, tf.GPT2LMHeadModel,
                            dict(vocab_size=vocab + 3, n_positions=64, n_embd=35, n_layer=2, n_head=5,
                                 initializer_range=0.2, tie_word_embeddings=False)),
    }


def test_every_decoder_family_by_hub_id_matches_transformers(fake_hub, bytelevel_tokenizer, tmp_path):
    """Config variants (GQA, head_dim not hidden/heads, yarn, windows, layer_types, tied and untied
    heads, odd vocabularies), each saved in the cache and loaded by its id."""
    from tests.test_parity_decoders import assert_parity

    for repo, (config_cls, model_cls, settings) in _family_cases(bytelevel_tokenizer[1]).items():
        folder = tmp_path / repo.replace("/", "__")
        torch.manual_seed(len(repo))
        model_cls(config_cls(**settings)).save_pretrained(folder)
        shutil.copy(bytelevel_tokenizer[0], folder / "tokenizer.json")
        add_to_cache(fake_hub, repo, folder)
        reference = model_cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
        ours = load(repo, device="cpu")
        assert ours.info.id == repo
        assert_parity(ours, reference, TEXT, min_tokens=20)
