"""Hugging Face ids resolve through the local cache (a fake one in the real layout), offline."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from manyeyes.model import ModelLoadError, load
from manyeyes.model.hub import HubId, choose_files, parse_hub_id
from tests.hub_cache import add_to_cache, fake_hub, no_network  # noqa: F401 (fixtures)

TEXT = "The quick brown fox."


def save_gpt2(folder: Path, tokenizer: tuple[Path, int], seed: int, **saved) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok_path, vocab = tokenizer
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=24, n_layer=2, n_head=3)
    GPT2LMHeadModel(config).save_pretrained(folder, **saved)
    shutil.copy(tok_path, folder / "tokenizer.json")
    return folder


def save_bert(folder: Path, minilm_dir: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(3)
    config = BertConfig(vocab_size=30522, hidden_size=20, num_hidden_layers=1, num_attention_heads=5,
                        intermediate_size=40, max_position_embeddings=40)
    BertModel(config).save_pretrained(folder)
    shutil.copy(minilm_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def gpt2_folders(tmp_path_factory, bytelevel_tokenizer):
    """Two different random GPT-2s, so a revision that picks the wrong one is caught."""
    return [save_gpt2(tmp_path_factory.mktemp(f"gpt2-{seed}"), bytelevel_tokenizer, seed) for seed in (1, 2)]


def attention(spec, **kw) -> torch.Tensor:
    return load(spec, device="cpu", **kw).attend(TEXT).attention


def test_ids_parse_and_paths_never_do():
    assert parse_hub_id("gpt2") == HubId("gpt2", None)
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M") == HubId("HuggingFaceTB/SmolLM2-135M", None)
    assert parse_hub_id("org/name@v1.0") == HubId("org/name", "v1.0")
    assert parse_hub_id("org/name@refs/pr/3") == HubId("org/name", "refs/pr/3")
    for path in ("/abs/folder", "./rel", "~/x", "weights.pth", "a/b/c", "org/../x", "x.safetensors", "bad id"):
        assert parse_hub_id(path) is None, path


def test_ids_load_from_the_cache_like_their_folders(fake_hub, gpt2_folders, minilm_dir, tmp_path):
    add_to_cache(fake_hub, "gpt2", gpt2_folders[0])
    add_to_cache(fake_hub, "openai-community/gpt2", gpt2_folders[1])
    add_to_cache(fake_hub, "google-bert/bert-base-uncased", save_bert(tmp_path, minilm_dir))

    m = load("gpt2", device="cpu")
    assert (m.info.id, m.info.family, m.info.causal) == ("gpt2", "gpt2", True)
    assert torch.equal(m.attend(TEXT).attention, attention(gpt2_folders[0]))
    assert torch.equal(attention("openai-community/gpt2"), attention(gpt2_folders[1]))
    bert = load("google-bert/bert-base-uncased", device="cpu", name="bert")
    assert (bert.info.id, bert.info.family, bert.info.n_heads) == ("bert", "bert", 5)
    assert torch.equal(bert.attend(TEXT).attention, attention(tmp_path))


def test_revision_picks_its_commit(fake_hub, gpt2_folders):
    old = add_to_cache(fake_hub, "org/tiny", gpt2_folders[0], refs=("v1",))
    new = add_to_cache(fake_hub, "org/tiny", gpt2_folders[1], refs=("main",))
    assert old != new
    first, second = (attention(f) for f in gpt2_folders)
    assert not torch.equal(first, second)
    assert torch.equal(attention("org/tiny"), second)
    assert torch.equal(attention("org/tiny@main"), second)
    assert torch.equal(attention("org/tiny@v1"), first)
    assert torch.equal(attention(f"org/tiny@{old}"), first)  # a commit hash needs no ref
    with pytest.raises(ModelLoadError, match=r"org/tiny@v9 is not in the Hugging Face cache .*revision v9"):
        load("org/tiny@v9")


def test_offline_and_not_cached_says_where_it_looked_and_how_to_fetch(fake_hub):
    with pytest.raises(ModelLoadError) as err:
        load("HuggingFaceTB/SmolLM2-135M")
    message = str(err.value)
    assert "HuggingFaceTB/SmolLM2-135M is not in the Hugging Face cache" in message
    assert f"{fake_hub}/models--HuggingFaceTB--SmolLM2-135M" in message
    assert "`hf download HuggingFaceTB/SmolLM2-135M`" in message and "unset HF_HUB_OFFLINE" in message


@pytest.mark.parametrize("spec, builtin", [("tiny_gpt", "tiny-gpt"), ("MiniLM", "minilm"), ("tiny-lama", "tiny-llama"),
                                           ("tiny llama", "tiny-llama")])
def test_a_slip_of_a_builtin_name_suggests_it(fake_hub, spec, builtin):
    """'tiny_gpt' was looked up as a Hub id, and the answer was only how to download it."""
    with pytest.raises(ModelLoadError) as err:
        load(spec)
    assert str(err.value).endswith(f". Did you mean the built-in '{builtin}'?")


def test_a_hub_id_far_from_the_builtin_names_gets_no_suggestion(fake_hub):
    with pytest.raises(ModelLoadError) as err:
        load("gpt2x")
    assert "Did you mean" not in str(err.value) and "gpt2x is not in the Hugging Face cache" in str(err.value)


def test_incomplete_cache_entry_names_what_it_lacks(fake_hub, gpt2_folders, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(gpt2_folders[0] / "config.json", partial / "config.json")
    add_to_cache(fake_hub, "org/partial", partial)
    with pytest.raises(ModelLoadError, match=r"org/partial is incomplete \(lacks tokenizer.json, weights"):
        load("org/partial")


@pytest.mark.parametrize("failure", [OSError("[Errno -2] Name or service not known"), RuntimeError("ConnectError")])
def test_an_unreachable_hub_names_the_revision_and_what_the_cache_holds(fake_hub, gpt2_folders, tmp_path, monkeypatch,
                                                                         failure):
    """Online with no network, the advice dropped the revision (`hf download org/x`, where the
    offline message said `--revision v2`) and an incomplete cache entry read "not in the cache"."""
    import huggingface_hub
    from huggingface_hub import constants

    class Unreachable:
        def model_info(self, *args, **kwargs):
            raise failure

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    with pytest.raises(ModelLoadError) as err:
        load("org/absent@v2")
    assert "model org/absent@v2 is not in the Hugging Face cache" in str(err.value)
    assert "`hf download org/absent --revision v2`" in str(err.value)
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(gpt2_folders[0] / "config.json", partial / "config.json")
    add_to_cache(fake_hub, "org/partial", partial)
    with pytest.raises(ModelLoadError) as err:
        load("org/partial")
    assert "model org/partial is incomplete (lacks tokenizer.json, weights" in str(err.value)
    assert "`hf download org/partial`" in str(err.value)


def test_builtins_and_local_folders_keep_precedence(fake_hub, gpt2_folders, monkeypatch, tmp_path):
    # A cache entry named like a built-in is never consulted for it.
    add_to_cache(fake_hub, "tiny-gpt", gpt2_folders[0])
    assert load("tiny-gpt", device="cpu").info.family == "gpt"
    # A folder in the working directory wins over a cached id of the same name.
    add_to_cache(fake_hub, "org/same", gpt2_folders[0])
    shutil.copytree(gpt2_folders[1], tmp_path / "org" / "same")
    monkeypatch.chdir(tmp_path)
    assert torch.equal(attention("org/same"), attention(gpt2_folders[1]))


def test_sharded_safetensors_load_from_folder_and_cache(fake_hub, bytelevel_tokenizer, gpt2_folders, tmp_path):
    sharded = save_gpt2(tmp_path / "sharded", bytelevel_tokenizer, 1, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists() and not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    whole = attention(gpt2_folders[0])  # the same seed, saved in one file
    assert torch.equal(attention(sharded), whole)
    add_to_cache(fake_hub, "org/sharded", sharded)
    assert torch.equal(attention("org/sharded"), whole)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match=r"index.json names shards that are missing: model-00002"):
        load(sharded)


def test_choose_files_prefers_safetensors_and_never_fetches_bin_beside_them():
    base = ["config.json", "tokenizer.json", "README.md", "tokenizer_config.json", "merges.txt"]
    assert choose_files(base + ["model.safetensors", "pytorch_model.bin", "tf_model.h5", "onnx/model.onnx"]) == (
        ["config.json", "tokenizer.json", "model.safetensors"], None)
    assert choose_files(base + ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                "pytorch_model.bin.index.json"]) == (
        ["config.json", "tokenizer.json", "model.safetensors.index.json"], "model.safetensors.index.json")
    assert choose_files(base + ["pytorch_model.bin"]) == (["config.json", "tokenizer.json", "pytorch_model.bin"], None)
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        choose_files(base + ["tf_model.h5"])
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        choose_files(["config.json", "model.safetensors"])


def test_online_download_fetches_only_needed_files_and_reports_bytes(fake_hub, monkeypatch, bytelevel_tokenizer, tmp_path):
    """The Hub is simulated (listing + per-file fetch), never reached: what we ask for is checked."""
    import huggingface_hub
    from huggingface_hub import constants

    remote = save_gpt2(tmp_path / "remote", bytelevel_tokenizer, 1, max_shard_size="20KB")
    (remote / "pytorch_model.bin").write_bytes(b"never fetched")
    (remote / "README.md").write_text("not needed")
    sha = "0123456789abcdef0123456789abcdef01234567"
    sizes = {p.name: p.stat().st_size for p in remote.iterdir()}

    class Sibling:
        def __init__(self, name):
            self.rfilename, self.size = name, sizes[name]

    class Info:
        siblings = [Sibling(n) for n in sizes]

    class FakeApi:
        def model_info(self, repo, revision=None, files_metadata=False, timeout=None):
            assert (repo, revision, files_metadata, timeout) == ("org/remote", None, True, 30.0)
            return type("I", (Info,), {"sha": sha})()

    fetched = []

    def fake_download(repo, filename, revision, cache_dir, tqdm_class):
        assert revision == sha
        fetched.append(filename)
        data = (remote / filename).read_bytes()
        bar = tqdm_class(total=len(data))
        for start in range(0, len(data), 4096):
            bar.update(len(data[start:start + 4096]))
        bar.close()
        one = tmp_path / "one" / filename
        one.parent.mkdir(exist_ok=True)
        one.write_bytes(data)
        single = tmp_path / f"single-{filename}"
        single.mkdir()
        shutil.copy(one, single / filename)
        add_to_cache(Path(cache_dir), repo, single, refs=(), commit=sha)  # as hf_hub_download at a commit: no ref

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    reports = []
    m = load("org/remote", device="cpu", progress=lambda done, total: reports.append((done, total)))
    shards = sorted(n for n in sizes if n.startswith("model-"))
    assert fetched == ["model.safetensors.index.json", "config.json", "tokenizer.json", "generation_config.json", *shards]
    total = sum(sizes[n] for n in fetched if n != "model.safetensors.index.json")
    assert reports[-1] == (total, total) and all(t == total for _, t in reports)
    assert [d for d, _ in reports] == sorted(d for d, _ in reports) and len(reports) > len(fetched)
    assert torch.equal(m.attend(TEXT).attention, attention(remote))
    assert (fake_hub / "models--org--remote" / "refs" / "main").read_text() == sha  # written once all came
    # Cached now: a second load asks the (fake) Hub for nothing.
    fetched.clear()
    load("org/remote", device="cpu")
    assert fetched == []


def _cli(args, cache: Path | None = None, home: Path | None = None):
    """The CLI in a fresh process, offline, with the cache named by HF_HUB_CACHE or by HF_HOME."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE")}
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    env |= {"HF_HUB_CACHE": str(cache)} if cache else {"HF_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "manyeyes.app.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_reads_the_cache_the_environment_names(tmp_path, gpt2_folders):
    """A fresh process: HF_HUB_CACHE and HF_HUB_OFFLINE are honoured as huggingface_hub reads them."""
    cache = tmp_path / "cache"
    add_to_cache(cache, "org/tiny", gpt2_folders[0])
    done = _cli(["attend", TEXT, "--model", "org/tiny", "--layer", "1", "--head", "2"], cache)
    assert done.returncode == 0, done.stderr
    assert "model org/tiny (gpt2, causal, 2 layers x 3 heads)" in done.stdout
    # HF_HOME alone puts the cache in HF_HOME/hub, as for every Hugging Face tool.
    missing = _cli(["attend", TEXT, "--model", "org/absent"], home=tmp_path / "home")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("error: model org/absent is not in")
    assert f"{tmp_path / 'home' / 'hub'}/models--org--absent" in missing.stderr


def test_cli_dtype_and_top_k_on_a_cached_id(tmp_path, gpt2_folders):
    cache = tmp_path / "cache"
    add_to_cache(cache, "org/tiny", gpt2_folders[0])
    done = _cli(["attend", TEXT, "--model", "org/tiny", "--dtype", "bfloat16", "--top-k", "2"], cache)
    assert done.returncode == 0, done.stderr
    assert "predictions (next token after each position, top 2):" in done.stdout
    n_tokens = int(re.search(r"^(\d+) tokens", done.stdout, re.M)[1])
    assert len([line for line in done.stdout.splitlines() if " -> " in line]) == n_tokens  # one per position
    refused = _cli(["attend", TEXT, "--model", "minilm", "--top-k", "2"], cache)
    assert refused.returncode == 2 and refused.stderr == (
        "error: model minilm has no language-model head, so --top-k has nothing to show\n")
