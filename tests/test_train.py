"""`manyeyes train`: it learns, its folder loads with the same logits, it resumes exactly, it refuses bad input."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from manyeyes.app.cli import main
from manyeyes.model import load
from manyeyes.model.gpt import GPTModel
from manyeyes.model.train import TrainConfig, build_model, encode_corpus, estimate_loss, make_config, split_ids, train
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
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(corpus, tmp_path, capsys, extra, message):
    argv = ["train", "--text", str(corpus), "--out", str(tmp_path / "m"), "--steps", "2", "--vocab-size", "300"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "m" / "model.pth").exists()


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
