"""`manyeyes train`: it learns, its folder loads with the same logits, it resumes exactly, it refuses bad input."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import stat
from pathlib import Path

import pytest
import torch

from manyeyes.app.cli import main
from manyeyes.model import load
from manyeyes.model.gpt import GPTModel
from manyeyes.model.train import (
    TrainConfig,
    TrainError,
    build_model,
    encode_corpus,
    estimate_loss,
    init_from,
    make_config,
    save_model,
    split_ids,
    train,
)
from tokenizers import Tokenizer

TINY = dict(layers=2, heads=2, emb_dim=32, context=32, vocab_size=320, batch_size=8, lr=3e-3, device="cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 40 KB of English from the standard library's own documentation: on every machine, offline."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:40_000]
    path = tmp_path_factory.mktemp("corpus") / "pydoc.txt"
    path.write_text(text, encoding="utf-8")
    return path


def run(corpus: Path, out: Path, resume: bool = False, **options) -> dict:
    cfg = make_config({"text": [corpus], "out": out, **TINY, **options}, resume=resume)
    return train(cfg, resume=resume, command="test", stream=io.StringIO())


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "model.pth", weights_only=True)


def test_fifty_steps_lower_the_loss(corpus, tmp_path):
    card = run(corpus, tmp_path / "m", steps=50)
    # The same model before training, measured on the same fixed windows.
    cfg = TrainConfig(text=(corpus,), out=tmp_path / "m", steps=50, **TINY)
    tokenizer = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    train_ids, val_ids = split_ids(encode_corpus(tokenizer, [corpus.read_text()]), cfg.context)
    torch.manual_seed(cfg.seed)
    untrained = build_model(cfg, tokenizer.get_vocab_size())
    before = estimate_loss(untrained, train_ids, cfg, torch.device("cpu"))
    assert before == pytest.approx(math.log(tokenizer.get_vocab_size()), abs=0.1)  # init guesses uniformly
    assert card["train_loss"] < before - 1.0
    assert card["val_loss"] < estimate_loss(untrained, val_ids, cfg, torch.device("cpu")) - 1.0
    assert card["steps"] == 50 and card["tokens_seen"] == 50 * TINY["batch_size"] * TINY["context"]
    assert card["val_perplexity"] == pytest.approx(math.exp(card["val_loss"]), rel=1e-3)


def test_saved_folder_round_trips_with_the_same_logits(corpus, tmp_path):
    out = tmp_path / "m"
    run(corpus, out, steps=20)
    config = json.loads((out / "config.json").read_text())
    assert {"vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias"} <= set(config)
    assert "trf_blocks.1.att.W_query.weight" in weights(out) and "out_head.weight" in weights(out)

    # The optimizer's copy of the weights in checkpoint.pt is the model as it left training.
    trained = GPTModel(config).eval()
    trained.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["model"])
    loaded = load(out, device="cpu")
    text = "The function returns a new list."
    ids = torch.tensor([loaded.encode(text).ids])
    with torch.no_grad():
        assert torch.equal(loaded.net(ids), trained(ids))
    # The tokenizer round-trips too, and its offsets tile the original text.
    result = loaded.attend(text)
    assert "".join(t.text for t in result.tokens) == text
    assert loaded.info.causal and loaded.info.family == "gpt"
    assert torch.equal(result.attention.triu(1), torch.zeros_like(result.attention))


def test_float16_storage_holds_the_rounded_weights(corpus, tmp_path):
    out = tmp_path / "m"
    run(corpus, out, steps=5, save_dtype="float16")
    stored = weights(out)
    assert all(v.dtype == torch.float16 for v in stored.values())
    trained = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    loaded = load(out, device="cpu").net.state_dict()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value.half().float()), key


def test_same_seed_same_model_other_seed_other_model(corpus, tmp_path):
    run(corpus, tmp_path / "a", steps=10)
    run(corpus, tmp_path / "b", steps=10)
    run(corpus, tmp_path / "c", steps=10, seed=7)
    a, b, c = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(tmp_path / "c")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


class InterruptAt(io.StringIO):
    """A progress stream that presses Ctrl-C once the bar reports `marker`."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def write(self, text: str) -> int:
        super().write(text)
        if self.marker in text:
            raise KeyboardInterrupt
        return len(text)


def test_resume_continues_from_the_same_step(corpus, tmp_path):
    straight = run(corpus, tmp_path / "straight", steps=20, eval_every=5)
    cfg = make_config({"text": [corpus], "out": tmp_path / "split", **TINY, "steps": 20, "eval_every": 5})
    with pytest.raises(KeyboardInterrupt):
        train(cfg, command="test", stream=InterruptAt("step 12/20"))
    assert torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["step"] == 12

    log = io.StringIO()
    cfg = make_config({"text": [corpus], "out": tmp_path / "split"}, resume=True)
    resumed = train(cfg, resume=True, command="manyeyes train --resume", stream=log)
    assert resumed["command"] == "test" and resumed["resumed_with"] == ["manyeyes train --resume"]
    assert "resuming at step 12" in log.getvalue()
    assert "step 13/20" in log.getvalue() and "step  1/20" not in log.getvalue()
    # Step for step the same run: same batches, same learning rates, same optimizer moments.
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for key in ("steps", "tokens_seen", "train_loss", "val_loss"):
        assert resumed[key] == straight[key], key


def test_ctrl_c_in_the_final_evaluation_keeps_every_step(corpus, tmp_path, monkeypatch):
    """The last steps were saved only after the final evaluation (80 batches), outside the Ctrl-C
    handler: an interrupt there exited 130 without a word, the checkpoint at the last evaluation
    (step 10 of 12 here)."""
    import manyeyes.model.train as train_module

    evaluate = train_module.estimate_loss
    calls = []

    def interrupted_at_the_end(model, data, cfg, device):
        calls.append(1)
        if len(calls) == 3:  # steps 5 and 10 evaluate once each; the final evaluation's first call
            raise KeyboardInterrupt
        return evaluate(model, data, cfg, device)

    monkeypatch.setattr(train_module, "estimate_loss", interrupted_at_the_end)
    cfg = make_config({"text": [corpus], "out": tmp_path / "m", **TINY, "steps": 12, "eval_every": 5})
    log = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        train(cfg, command="test", stream=log)
    assert torch.load(tmp_path / "m" / "checkpoint.pt", weights_only=True)["step"] == 12
    assert "interrupted in the final evaluation" in log.getvalue() and "holds all 12 steps" in log.getvalue()
    finish = shlex.join(["manyeyes", "train", "--text", str(corpus), "--out", str(tmp_path / "m"), "--resume"])
    assert f"finish it with `{finish}`" in log.getvalue()
    assert not (tmp_path / "m" / "card.json").exists()
    monkeypatch.setattr(train_module, "estimate_loss", evaluate)
    straight = run(corpus, tmp_path / "straight", steps=12, eval_every=5)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "m")
    assert straight["steps"] == 12 and all(torch.equal(a[k], b[k]) for k in a)
    # --resume said "nothing to do: already trained for 12 steps": the run could never get its card.
    finished = run(corpus, tmp_path / "m", resume=True)
    for key in ("steps", "tokens_seen", "train_loss", "val_loss", "val_perplexity"):
        assert finished[key] == straight[key], key
    b = weights(tmp_path / "m")
    assert all(torch.equal(a[k], b[k]) for k in a)  # not a step more


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_real_ctrl_c_lets_the_step_finish_and_saves_it(corpus, tmp_path, signum):
    """SIGINT lands where the process happens to be, nearly always inside a step (the backward, the
    optimizer), where nothing consistent can be saved: the run lost every step since its last
    evaluation, and before the first one said it held step 0 of a checkpoint that did not exist.
    SIGTERM (`timeout`, a process manager) ended the run unsaved and unsaid (h56g)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "cut"
    argv = [sys.executable, "-m", "manyeyes", "train", "--text", str(corpus), "--out", str(out), "--layers", "2",
            "--heads", "2", "--emb-dim", "32", "--context", "32", "--vocab-size", "300", "--batch-size", "4",
            "--steps", "1000000", "--device", "cpu"]  # no evaluation, so no checkpoint, before the signal
    proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline().startswith("training gpt"), "the run did not start"
        time.sleep(2.0)  # some hundreds of steps
        proc.send_signal(getattr(signal, signum))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopping after this step" in err, err
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    resume = shlex.join(["manyeyes", "train", "--text", str(corpus), "--out", str(out), "--resume"])
    assert saved > 0 and f"checkpoint.pt holds step {saved}; continue with `{resume}`" in err, (saved, err)


def test_cli_trains_a_folder_that_loads_and_attends(corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["train", "--text", str(corpus), "--out", str(out), "--layers", "2", "--heads", "2", "--emb-dim", "32",
            "--context", "32", "--vocab-size", "300", "--steps", "30", "--batch-size", "4", "--device", "cpu",
            "--licence", "PSF-2.0", "--corpus-name", "pydoc topics"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tok/s" in err and "ETA" in err and "val loss" in err and "step 30/30" in err
    card = json.loads((out / "card.json").read_text())
    assert card["corpus"] == "pydoc topics" and card["licence"] == "PSF-2.0"
    assert card["command"].startswith("manyeyes train --text ") and "--steps 30" in card["command"]
    for key in ("steps", "tokens_seen", "train_loss", "val_loss", "val_perplexity", "seconds"):
        assert key in card
    assert card["steps"] == 30 and card["tokens_seen"] == 30 * 4 * 32

    assert main(["attend", "Return the value.", "--model", str(out), "--layer", "1", "--head", "1"]) == 0
    assert "causal, 2 layers x 2 heads" in capsys.readouterr().out


def test_resume_refuses_other_settings_and_finished_runs(corpus, tmp_path, capsys):
    out = tmp_path / "m"
    run(corpus, out, steps=5)
    base = ["train", "--text", str(corpus), "--out", str(out)]
    assert main(base + ["--resume", "--layers", "3", "--steps", "9"]) == 2
    assert "--layers 3 differs from the checkpoint's 2" in capsys.readouterr().err
    assert main(base + ["--resume", "--steps", "5"]) == 2
    assert "already trained for 5 steps" in capsys.readouterr().err
    assert main(base + ["--steps", "9"]) == 2
    assert "already holds a model" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text()[::-1], encoding="utf-8")
    assert main(["train", "--text", str(other), "--out", str(out), "--resume", "--steps", "9"]) == 2
    assert "--text files differ" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--emb-dim", "30", "--heads", "4"], "--emb-dim (30) must be divisible by --heads (4)"),
        (["--vocab-size", "100"], "--vocab-size must be at least 257"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--layers", "0"], "--layers must be at least 1"),
        (["--lr", "-0.1"], "--lr must be a positive number"),
        (["--lr", "nan"], "--lr must be a positive number"),
        (["--context", "1"], "--context must be at least 2"),
        (["--context", "100000"], "the text is too short"),
        (["--device", "tpu9"], "--device"),
        (["--save-dtype", "int8"], "--save-dtype must be float32 or float16"),
        (["--pos-init", "rope"], "--pos-init must be random or sinusoidal"),
        (["--weight-init", "xavier"], "--weight-init must be gpt2 or torch"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(corpus, tmp_path, capsys, extra, message):
    argv = ["train", "--text", str(corpus), "--out", str(tmp_path / "m"), "--steps", "2", "--vocab-size", "300"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    # Nothing written: a text too short for --context had left a tokenizer.json in a new folder.
    assert not (tmp_path / "m").exists()


def test_resume_without_a_checkpoint_is_a_clear_error(corpus, tmp_path, capsys):
    assert main(["train", "--text", str(corpus), "--out", str(tmp_path / "none"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "checkpoint.pt does not exist" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read text file"),  # no such file
        (b"", "is empty"),
        (b"  \n\t\n", "is empty"),
        (b"caf\xe9 latin-1", "is not UTF-8"),
        ("dir", "cannot read text file"),
    ],
)
def test_empty_or_unreadable_text_exit_2_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "book.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    assert main(["train", "--text", str(path), "--out", str(tmp_path / "m"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_argparse_rejects_non_numbers(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--text", "a.txt", "--out", "m", "--layers", "two"])
    assert exc.value.code == 2
    assert "--layers" in capsys.readouterr().err


def test_sinusoidal_positions_start_as_the_transformer_table(corpus):
    cfg = make_config({"text": [corpus], "out": Path("unused"), **TINY, "pos_init": "sinusoidal"})
    table = build_model(cfg, vocab_size=320).pos_emb.weight.detach()  # (context, emb_dim)
    assert table.shape == (32, 32)
    assert torch.allclose(table.pow(2).mean().sqrt(), torch.tensor(0.02), rtol=1e-3)  # RMS of token embeddings
    scale = 0.02 * math.sqrt(2.0)
    assert torch.allclose(table[0, 0::2], torch.zeros(16))  # sin(0)
    assert torch.allclose(table[0, 1::2], torch.full((16,), scale))  # cos(0)
    assert torch.isclose(table[5, 2], scale * torch.sin(torch.tensor(5 * 10000 ** (-2 / 32))))
    # The offset "one back" is one fixed rotation per frequency, the property a previous-token head uses.
    random = build_model(make_config({"text": [corpus], "out": Path("unused"), **TINY}), vocab_size=320)
    assert not torch.allclose(random.pos_emb.weight, table)


# ---------------------------------------------------------------------------- --arch llama
LLAMA = dict(TINY, arch="llama", heads=4, kv_heads=2, ff_dim=48)


def feed_forward_layers(net) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(first, last) projection of each block's feed-forward, for either arch."""
    return [(b.ff.gate, b.ff.down) if hasattr(b.ff, "down") else (b.ff.layers[0], b.ff.layers[2]) for b in net.trf_blocks]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_freeze_ff_trains_attention_only_and_a_later_stage_trains_the_rest(corpus, tmp_path, arch):
    options = LLAMA if arch == "llama" else {}
    frozen = tmp_path / "frozen"
    run(corpus, frozen, steps=4, freeze_ff=True, **options)
    trained = load(frozen, device="cpu").net
    torch.manual_seed(TrainConfig.seed)  # train() builds the model right after seeding
    start = build_model(make_config({"text": [corpus], "out": frozen, **TINY, **options, "freeze_ff": True}), 320)
    for (first, last), (first0, _) in zip(feed_forward_layers(trained), feed_forward_layers(start)):
        assert last.weight.abs().max() == 0 and (last.bias is None or last.bias.abs().max() == 0)
        assert torch.equal(first.weight, first0.weight)  # never stepped, not even by weight decay
    assert not torch.equal(trained.trf_blocks[0].att.W_query.weight, start.trf_blocks[0].att.W_query.weight)

    later = tmp_path / "later"
    run(corpus, later, steps=4, init_from=frozen, **options)
    assert all(last.weight.abs().max() > 0 for _, last in feed_forward_layers(load(later, device="cpu").net))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_weight_init_torch_keeps_each_modules_own_default(corpus, arch):
    options = dict(LLAMA, attention_bias=True) if arch == "llama" else TINY  # both with biases
    gpt2 = build_model(make_config({"text": [corpus], "out": Path("unused"), **options}), vocab_size=320)
    torch_init = build_model(make_config({"text": [corpus], "out": Path("unused"), **options, "weight_init": "torch"}), 320)
    # Embedding: N(0, 0.02) against PyTorch's N(0, 1)
    assert abs(float(gpt2.tok_emb.weight.detach().std()) - 0.02) < 0.002
    assert abs(float(torch_init.tok_emb.weight.detach().std()) - 1.0) < 0.05
    # Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std 1/sqrt(3 fan_in), and its bias kept (not zeroed)
    query = torch_init.trf_blocks[0].att.W_query.weight.detach()  # (out, fan_in=32)
    bound = 32**-0.5
    assert float(query.abs().max()) <= bound and abs(float(query.std()) - bound / math.sqrt(3)) < 0.01
    assert float(gpt2.trf_blocks[0].att.W_query.weight.detach().std()) < 0.025
    biased = (lambda net: net.trf_blocks[0].ff.layers[0]) if arch == "gpt" else (lambda net: net.trf_blocks[0].att.W_query)
    assert float(biased(gpt2).bias.detach().abs().max()) == 0  # GPT-2's init zeroes biases
    assert 0 < float(biased(torch_init).bias.detach().abs().max()) <= bound  # PyTorch's draws them like the weight


def test_llama_learns_and_saves_a_hugging_face_llama_folder(corpus, tmp_path):
    out = tmp_path / "llama"
    card = run(corpus, out, steps=40, **LLAMA)
    assert card["train_loss"] < math.log(320) - 1.0 and card["model"].startswith("RotaryDecoder (llama family)")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == 32
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (4, 2, 48)
    assert card["config"] == config and card["init_from"] is None
    assert not (out / "model.pth").exists()

    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # 2 kv heads of 8
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight"} <= set(stored)

    # load() reads it through the llama family, and gives the logits of the model as it left training.
    loaded = load(out, device="cpu")
    assert loaded.info.family == "llama" and loaded.info.causal and loaded.info.n_kv_heads == 2
    assert loaded.info.max_tokens == 32
    # Its end of text named in config.json, for transformers' generate too (it was the tokenizer's only)
    assert config["eos_token_id"] == 0 and loaded.tokenizer.token_text(0) == "<|endoftext|>"
    assert loaded.info.eos_ids == frozenset({0})
    trained = build_model(make_config({"text": [corpus], "out": out, **LLAMA}), vocab_size=320).eval()
    trained.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["model"])
    ids = torch.tensor([loaded.encode("The function returns a new list.").ids])
    with torch.no_grad():
        assert torch.equal(loaded.net(ids), trained(ids))


def test_llama_folder_matches_transformers(corpus, tmp_path):
    """transformers' own LlamaForCausalLM reads the folder and computes what we compute.

    Forty steps leave attention near uniform, where a wrong rotation or mask could hide; so the
    writer also saves the same architecture, with attention biases, with weights ten times the
    init's (peaked rows) and random biases.
    """
    import transformers  # a test dependency: never a silent skip in CI
    trained = tmp_path / "trained"
    run(corpus, trained, steps=40, **LLAMA)
    sharp = tmp_path / "sharp"
    sharp.mkdir()
    model = build_model(make_config({"text": [corpus], "out": sharp, **LLAMA, "attention_bias": True}), vocab_size=320)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif not name.endswith("scale"):
                param.mul_(10)
    save_model(model, sharp, "float32")
    (sharp / "tokenizer.json").write_text((trained / "tokenizer.json").read_text())

    text = "The function returns a new list, and the list holds the values."
    for folder, peaked in ((trained, False), (sharp, True)):
        ours = load(folder, device="cpu")
        reference = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        result = ours.attend(text, truncate=True)
        ids = torch.tensor([[t.id for t in result.tokens]])
        with torch.no_grad():
            expected = reference(ids, output_attentions=True)
        attention = torch.stack([a[0] for a in expected.attentions])  # (layers, heads, T, T)
        assert attention.shape == result.attention.shape == (2, 4, 32, 32)
        if peaked:
            # Each row's top weight against a uniform row's 1/(keys it sees): several times above it.
            assert (attention[..., 4:, :].amax(-1) * torch.arange(5, 33)).median() > 3
        assert (attention - result.attention).abs().max().item() <= 1e-5
        assert (expected.logits[0] - result.logits).abs().max().item() <= 1e-4


def test_init_from_starts_from_a_folder_at_a_longer_context(corpus, tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    first = run(corpus, short, steps=10, **LLAMA)
    cfg = make_config({"text": [corpus], "out": long, **LLAMA, "context": 64, "steps": 1, "init_from": short})
    model = build_model(cfg, vocab_size=320)
    started = init_from(model, cfg)
    source = load(short, device="cpu").net.state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
    assert started["folder"] == str(short) and started["steps"] == first["steps"] == 10

    card = run(corpus, long, steps=3, **{**LLAMA, "context": 64, "init_from": str(short)})
    assert card["init_from"] == started and card["steps"] == 3
    assert json.loads((long / "config.json").read_text())["max_position_embeddings"] == 64
    assert (long / "tokenizer.json").read_text() == (short / "tokenizer.json").read_text()
    assert load(long, device="cpu").info.max_tokens == 64


def test_init_from_refuses_a_folder_of_another_shape_or_arch(corpus, tmp_path, capsys):
    run(corpus, tmp_path / "llama", steps=2, **LLAMA)
    run(corpus, tmp_path / "gpt", steps=2)
    base = ["train", "--text", str(corpus), "--out", str(tmp_path / "m"), "--steps", "2", "--vocab-size", "320",
            "--context", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ff-dim", "48", "--arch", "llama"]
    assert main(base + ["--emb-dim", "64", "--init-from", str(tmp_path / "llama")]) == 2
    assert f"--emb-dim 64 differs from the 32 of --init-from {tmp_path / 'llama'}" in capsys.readouterr().err
    # Another RoPE base fits the same tensors: it trained on, each head's positions silently re-read.
    assert main(base + ["--emb-dim", "32", "--rope-theta", "500", "--init-from", str(tmp_path / "llama")]) == 2
    assert "--rope-theta 500.0 differs from the 10000.0 of --init-from" in capsys.readouterr().err
    assert main(base + ["--emb-dim", "32", "--init-from", str(tmp_path / "gpt")]) == 2
    assert "holds no model.safetensors, the weights of an --arch llama run: it is an --arch gpt run" in capsys.readouterr().err
    assert main(base + ["--emb-dim", "32", "--init-from", str(tmp_path / "nowhere")]) == 2
    assert f"--init-from {tmp_path / 'nowhere'} is no folder" in capsys.readouterr().err  # "holds no card.json" (h56g)
    (tmp_path / "empty").mkdir()
    assert main(base + ["--emb-dim", "32", "--init-from", str(tmp_path / "empty")]) == 2
    assert "holds no card.json" in capsys.readouterr().err
    # A run stopped with Ctrl-C holds its checkpoint and no card yet: it is told how to finish it.
    (tmp_path / "llama" / "card.json").unlink()
    assert (tmp_path / "llama" / "checkpoint.pt").exists()
    assert main(base + ["--emb-dim", "32", "--init-from", str(tmp_path / "llama")]) == 2
    finish = shlex.join(["manyeyes", "train", "--text", str(corpus), "--out", str(tmp_path / "llama"), "--resume"])
    assert f"was stopped before it finished (its checkpoint.pt is at step 2, which no card.json reports): finish it first " \
           f"with `{finish}`" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_init_from_takes_the_folders_arch_and_shape(corpus, tmp_path, arch):
    """--init-from DIR needed every shape option restated (else 'does not fit this model'), though
    the folder's card holds them; options given still win, and a llama may change --context."""
    options = dict(LLAMA, attention_bias=True, rope_theta=5000.0) if arch == "llama" else dict(TINY, heads=4)
    first = tmp_path / "first"
    run(corpus, first, steps=2, **options)
    base = ["train", "--text", str(corpus), "--steps", "2", "--device", "cpu", "--init-from", str(first)]
    assert main(base + ["--out", str(tmp_path / "same")]) == 0
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    source, started = load(first, device="cpu").net, load(tmp_path / "same", device="cpu").net
    assert type(started) is type(source) and started.state_dict().keys() == source.state_dict().keys()
    if arch == "llama":
        assert main(base + ["--out", str(tmp_path / "longer"), "--context", "64"]) == 0
        assert load(tmp_path / "longer", device="cpu").info.max_tokens == 64
    else:  # a learned position table: another --context does not fit, and the loader says where
        assert main(base + ["--out", str(tmp_path / "longer"), "--context", "64"]) == 2
        assert not (tmp_path / "longer").exists()


def test_damaged_training_folders_are_one_line_naming_the_file(corpus, tmp_path, capsys):
    """A missing or broken tokenizer.json was a Rust traceback (status 1), a broken card.json a
    JSONDecodeError, and a folder without its model.pth 'config.json has no model_type'."""
    import shutil

    run(corpus, tmp_path / "done", steps=2)
    base = ["train", "--text", str(corpus), "--steps", "2", "--vocab-size", "320", "--context", "32", "--layers", "2",
            "--heads", "2", "--emb-dim", "32", "--device", "cpu"]
    cases = [
        ("model.pth", None, "holds no model.pth, the weights of an --arch gpt run"),
        ("tokenizer.json", "{", "tokenizer.json is not a tokenizer file `manyeyes train` wrote"),
        ("card.json", "{", "card.json cannot be read as JSON"),
    ]
    for k, (name, content, message) in enumerate(cases):
        damaged = tmp_path / f"damaged{k}"
        shutil.copytree(tmp_path / "done", damaged)
        if content is None:
            (damaged / name).unlink()
        else:
            (damaged / name).write_text(content)
        assert main(base + ["--out", str(tmp_path / f"m{k}"), "--init-from", str(damaged)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    resumable = tmp_path / "cut"
    run(corpus, resumable, steps=2)
    (resumable / "tokenizer.json").unlink()
    assert main(["train", "--text", str(corpus), "--out", str(resumable), "--resume", "--steps", "4"]) == 2
    assert f"cannot resume: {resumable / 'tokenizer.json'} is missing" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--arch", "bert"], "--arch must be gpt or llama"),
        (["--kv-heads", "2"], "--kv-heads applies to --arch llama only"),
        (["--attention-bias"], "--attention-bias applies to --arch llama only"),
        (["--arch", "llama", "--heads", "4", "--emb-dim", "32", "--kv-heads", "3"], "must be a multiple of --kv-heads (3)"),
        # Said "must be a multiple of --kv-heads (0)", as if 0 divided anything.
        (["--arch", "llama", "--heads", "4", "--emb-dim", "32", "--kv-heads", "0"], "--kv-heads must be at least 1, not 0"),
        (["--arch", "llama", "--heads", "4", "--emb-dim", "12"], "must be even: RoPE rotates pairs"),
        (["--arch", "llama", "--pos-init", "sinusoidal"], "--pos-init applies to --arch gpt only"),
        (["--arch", "llama", "--rope-theta", "0"], "--rope-theta must be a positive number"),
    ],
)
def test_bad_llama_arguments_exit_2_naming_the_problem(corpus, tmp_path, capsys, extra, message):
    argv = ["train", "--text", str(corpus), "--out", str(tmp_path / "m"), "--steps", "2", "--vocab-size", "300"]
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m" / "model.safetensors").exists()


def test_resume_finishes_a_run_stopped_after_its_last_step(corpus, tmp_path, capsys):
    """Ctrl-C in the last step leaves checkpoint.pt at --steps and no card: --resume said "nothing to
    do", and --init-from advised `manyeyes train --out DIR --resume`, which argparse refuses (no --text)."""
    out = tmp_path / "m"
    run(corpus, out, steps=4)
    cfg = make_config({"text": [corpus], "out": out, "steps": 6}, resume=True)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, resume=True, command="test", stream=InterruptAt("step 6/6"))
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 6
    assert json.loads((out / "card.json").read_text())["steps"] == 4  # the shorter run's card, not this one's
    stopped = weights(out)

    assert main(["train", "--text", str(corpus), "--out", str(tmp_path / "next"), "--init-from", str(out)]) == 2
    suggested = re.search(r"finish it first with `(.+)`", capsys.readouterr().err)[1]
    assert suggested == shlex.join(["manyeyes", "train", "--text", str(corpus), "--out", str(out), "--resume"])
    assert main(shlex.split(suggested)[1:]) == 0
    assert "all 6 steps are trained, finishing the run" in capsys.readouterr().err
    card = json.loads((out / "card.json").read_text())
    assert card["steps"] == 6 and card["tokens_seen"] == 6 * TINY["batch_size"] * TINY["context"]
    assert card["resumed_with"] == ["test", suggested]
    assert all(torch.equal(stopped[k], v) for k, v in weights(out).items())  # evaluated, not trained on
    assert main(shlex.split(suggested)[1:]) == 2
    assert "nothing to do" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                  "weights.pt", "config.json", "tokenizer.json"])
def test_an_out_holding_another_model_is_refused_untouched(corpus, tmp_path, capsys, name):
    """Only model.pth, model.safetensors and checkpoint.pt counted: a Hugging Face folder with
    pytorch_model.bin lost its config.json and tokenizer.json to the run's, and loaded as another model."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / name).write_text("theirs")
    assert main(["train", "--text", str(corpus), "--out", str(out), "--steps", "2", "--vocab-size", "300"]) == 2
    assert f"error: {out} already holds a model ({name}); choose another --out" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == "theirs"


@pytest.mark.parametrize(("loss", "perplexity"), [(800.0, None), (400.0, round(math.exp(400.0), 2))])
def test_a_huge_final_loss_is_carded_without_overflow(corpus, tmp_path, monkeypatch, loss, perplexity):
    """A diverging run (--lr 5 --weight-init torch) ended in `OverflowError: math range error` at
    exp(val_loss), after the whole run and without a card; a little lower, a 174-digit perplexity."""
    import manyeyes.model.train as train_module

    monkeypatch.setattr(train_module, "estimate_loss", lambda *args: loss)
    log = io.StringIO()
    train(make_config({"text": [corpus], "out": tmp_path / "m", **TINY, "steps": 2}), command="test", stream=log)
    card = json.loads((tmp_path / "m" / "card.json").read_text())
    assert card["val_loss"] == loss and card["val_perplexity"] == perplexity
    done = log.getvalue().splitlines()[-1]
    assert done.startswith("done:") and not re.search(r"\d{20}", done), done


def nan_free(folder: Path) -> bool:
    saved = torch.load(folder / "checkpoint.pt", weights_only=True)["model"]
    return all(torch.isfinite(t).all() for t in [*saved.values(), *weights(folder).values()])


def test_a_diverging_run_stops_at_its_first_nan_keeping_the_last_good_checkpoint(corpus, tmp_path, capsys):
    """--lr 100 went NaN and trained on: "val loss nan", NaN weights over the last good checkpoint at
    each evaluation, a card.json of invalid JSON, exit status 0, and a folder load() called damaged."""
    out = tmp_path / "m"
    argv = ["train", "--text", str(corpus), "--out", str(out), "--layers", "2", "--heads", "2", "--emb-dim", "32",
            "--context", "32", "--vocab-size", "320", "--batch-size", "8", "--device", "cpu", "--steps", "20",
            "--warmup", "0", "--lr", "100"]
    assert main(argv + ["--eval-every", "2"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    diverged = re.fullmatch(r"error: the (training|validation) loss \(nan\) diverged at step (\d+): training stopped, "
                            rf"{re.escape(str(out / 'checkpoint.pt'))} keeps step (\d+); train again with a lower --lr "
                            r"than 100\.0 in another --out", err)
    assert diverged, err
    kept = int(diverged[3])
    assert 0 < kept < int(diverged[2]) < 20
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == kept and nan_free(out)
    assert not (out / "card.json").exists()
    load(out, device="cpu")  # the last good weights, not a "damaged" folder

    # Diverged before anything was saved: --out is left empty, so the same command with a lower --lr works.
    fresh = tmp_path / "fresh"
    argv[argv.index(str(out))] = str(fresh)
    assert main(argv + ["--eval-every", "20"]) == 2
    assert "nothing was saved; train again with a lower --lr than 100.0" in capsys.readouterr().err
    assert list(fresh.iterdir()) == []
    assert main(argv[:-1] + ["0.003", "--steps", "2"]) == 0


def test_weights_gone_non_finite_after_a_finite_loss_are_never_saved(corpus, tmp_path, monkeypatch):
    """The last step's loss is measured before its update: an update to NaN weights was saved as the
    final checkpoint, over the last good one."""
    import manyeyes.model.train as train_module

    make_optimizer = train_module.make_optimizer

    def poisoned_at_step_4(model, lr):
        optimizer = make_optimizer(model, lr)
        step, calls = optimizer.step, []

        def poisoned(*args, **kwargs):
            step(*args, **kwargs)
            calls.append(1)
            if len(calls) == 4:
                next(model.parameters()).data.fill_(float("nan"))

        optimizer.step = poisoned
        return optimizer

    monkeypatch.setattr(train_module, "make_optimizer", poisoned_at_step_4)
    out = tmp_path / "m"
    with pytest.raises(TrainError, match=re.escape(f"the weights diverged at step 4: training stopped, {out / 'checkpoint.pt'} keeps step 2")):
        run(corpus, out, steps=4, eval_every=2)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2 and nan_free(out)


class Hostile:
    """Unpickling it runs a shell command; manyeyes must refuse it unrun."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_resume_refuses_a_hostile_checkpoint_unrun_and_without_torchs_advice(corpus, tmp_path, capsys):
    """The message quoted torch's whole refusal: "Re-running `torch.load` with `weights_only` set to
    `False` will likely succeed, but it can result in arbitrary code execution", on several lines."""
    out, marker = tmp_path / "m", tmp_path / "pwned"
    run(corpus, out, steps=2)
    torch.save({"train_config": Hostile(marker)}, out / "checkpoint.pt")
    assert main(["train", "--text", str(corpus), "--out", str(out), "--resume", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot resume: {out / 'checkpoint.pt'} is not a checkpoint `manyeyes train` wrote "
                          f"(it holds a pickled {os.system.__module__}.system,"), err
    assert "weights_only" not in err and "arbitrary code" not in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists()


@pytest.mark.parametrize(("content", "reason"), [
    (b"", "the file is empty"),
    ({"model_state_dict": {}, "optimizer_state_dict": {}}, "it has no 'model', 'optimizer', 'batch_rng', 'step'"),
    ([1, 2], "it holds a list, not a dict"),
], ids=["empty", "book-checkpoint", "list"])
def test_resume_refuses_a_checkpoint_manyeyes_did_not_write(corpus, tmp_path, capsys, content, reason):
    """The book's training checkpoint was `KeyError: 'train_config'` (status 1), a list a TypeError,
    an empty file "is unreadable: " and no reason."""
    out = tmp_path / "m"
    out.mkdir()
    if isinstance(content, bytes):
        (out / "checkpoint.pt").write_bytes(content)
    else:
        torch.save(content, out / "checkpoint.pt")
    assert main(["train", "--text", str(corpus), "--out", str(out), "--resume", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot resume: {out / 'checkpoint.pt'} is not a checkpoint `manyeyes train` wrote "
                          f"({reason}"), err
    assert len(err.strip().splitlines()) == 1, err


def test_written_files_follow_the_umask(corpus, tmp_path):
    """safetensors writes model.safetensors 0600 whatever the umask: a folder mounted into the
    container, which runs as another user, could not be read."""
    previous = os.umask(0o027)
    try:
        run(corpus, tmp_path / "m", steps=2, **LLAMA)
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, 0o640), modes


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused(corpus, tmp_path, capsys, monkeypatch, out):
    """Path("") is ".": --out "" trained into the folder the command ran in."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--text", str(corpus), "--out", out, "--steps", "2", "--layers", "1", "--heads", "2",
            "--emb-dim", "16", "--context", "8", "--vocab-size", "260", "--batch-size", "2", "--device", "cpu"]
    assert main(argv) == 2
    assert f"error: empty --out {out!r}: give the folder to train into" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_init_from_refuses_other_heads_naming_the_option(corpus, tmp_path, capsys):
    """--heads 4 on a 2-head GPT's weights fits the same tensors: it trained on, the heads silently re-split."""
    run(corpus, tmp_path / "two", steps=2)
    argv = ["train", "--text", str(corpus), "--out", str(tmp_path / "four"), "--init-from", str(tmp_path / "two"),
            "--heads", "4", "--steps", "2", "--device", "cpu"]
    assert main(argv) == 2
    assert f"error: --heads 4 differs from the 2 of --init-from {tmp_path / 'two'}, whose weights hold that shape; " \
           "leave --heads out (only a llama's --context may change)" in capsys.readouterr().err
    assert not (tmp_path / "four").exists()


def test_resume_refuses_a_checkpoint_whose_weights_do_not_fit(corpus, tmp_path, capsys):
    """A checkpoint with every key but other weights was load_state_dict's RuntimeError traceback."""
    out = tmp_path / "m"
    run(corpus, out, steps=2)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    torch.save({**ckpt, "model": {"tok_emb.weight": torch.zeros(3, 2)}}, out / "checkpoint.pt")
    assert main(["train", "--text", str(corpus), "--out", str(out), "--resume", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot resume: {out / 'checkpoint.pt'} does not fit the model of its own train_config: "
                          "Error(s) in loading state_dict for GPTModel: Missing key(s)"), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("options, message", [
    ({"lr": 4e37}, "--lr must be a positive number of at most 1e+06, not 4e+37"),  # AdamW's overflow traceback
    ({"rope_theta": float("nan")}, "--rope-theta applies to --arch llama only"),  # kept, unused, in the card's command
    ({"init_from": "no-such-folder"}, "--init-from no-such-folder is no folder: name a folder `manyeyes train` wrote"),
    ({"device": "meta"}, "--device meta cannot train: use auto, cpu, cuda, cuda:N or mps"),
])
def test_options_that_cannot_train_are_refused_in_words(corpus, tmp_path, monkeypatch, options, message):
    """Each was a traceback, ignored, or a message that named the wrong thing (h56g)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainError, match=re.escape(message)):
        run(corpus, tmp_path / "m", steps=2, **options)


def test_a_resumed_run_keeps_its_warm_up_and_refuses_fewer_steps_than_it_has(corpus, tmp_path):
    """--steps 50 for 50000 on a stopped run ended it and rewrote its plan, and another --steps
    recounted the warm-up from it: the learning rate warmed up again mid-run (h56g)."""
    out = tmp_path / "m"
    run(corpus, out, steps=20)
    (out / "card.json").unlink()  # as a run stopped after its last step, before its card
    with pytest.raises(TrainError, match=re.escape(f"--steps 12 is below the 20 steps {out} has trained (its plan was 20)")):
        run(corpus, out, resume=True, steps=12)
    cfg = make_config({"text": [corpus], "out": out, "steps": 400}, resume=True)
    assert (cfg.steps, cfg.warmup_steps, cfg.eval_interval) == (400, 2, 2)  # the first plan's: 20 // 10 each
