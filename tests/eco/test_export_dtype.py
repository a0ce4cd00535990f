"""`manyeyes export --dtype`: the weights' dtype, as `attend --dtype` and `serve --dtype` take it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from manyeyes.app.cli import DTYPE_CHOICES
from manyeyes.app.cli import main as cli
from manyeyes.client import decode_attention

TEXT = "In the beginning was the Word."


def embedded_run(path) -> dict:
    html = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="manyeyes-export">(.*?)</script>', html, re.S)[1])["run"]


def test_export_dtype_loads_the_weights_in_that_dtype(tmp_path, monkeypatch):
    """`export` had no --dtype: the file always held the float32 model's run on the CPU."""
    import manyeyes.model as model_pkg

    real_load, loaded = model_pkg.load, []

    def spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loaded.append((kwargs.get("dtype"), model))
        return model

    monkeypatch.setattr(model_pkg, "load", spy)
    out = tmp_path / "f16.html"
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--device", "cpu", "--dtype", "float16",
                "--format", "f16"]) == 0
    [(asked, model)] = loaded
    assert asked == "float16" and model.info.dtype == "float16"
    assert {p.dtype for p in model.net.parameters()} == {torch.float16}
    # The file holds the float16 model's weights (stored as f16), not the float32 model's.
    shown = decode_attention(embedded_run(out)["attention"])
    narrow = real_load("tiny-gpt", device="cpu", dtype="float16").attend(TEXT).attention.numpy()
    wide = real_load("tiny-gpt", device="cpu").attend(TEXT).attention.numpy()
    np.testing.assert_array_equal(shown, narrow.astype(np.float16).astype(np.float32))
    assert not np.array_equal(shown, wide.astype(np.float16).astype(np.float32))

    # The default is attend's: None, which load() reads as auto (float32 on the CPU).
    loaded.clear()
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(tmp_path / "auto.html"), "--device", "cpu"]) == 0
    [(asked, model)] = loaded
    assert asked is None and model.info.dtype == "float32"


def test_export_dtype_refuses_what_attend_refuses(tmp_path, capsys):
    out = tmp_path / "never.html"
    with pytest.raises(SystemExit) as raised:
        cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--dtype", "int8"])
    assert raised.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "argument --dtype: invalid choice: 'int8'" in err and all(c in err for c in DTYPE_CHOICES), err
    assert "Traceback" not in err


def test_export_reads_the_servers_device_and_dtype_settings_unless_flags_say_otherwise(tmp_path, monkeypatch, capsys):
    """export read MANYEYES_DENSE_MAX_TOKENS but not MANYEYES_DEVICE or MANYEYES_DTYPE."""
    import manyeyes.model as model_pkg

    real_load, loaded = model_pkg.load, []

    def spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(model_pkg, "load", spy)
    monkeypatch.setenv("MANYEYES_DTYPE", "float16")
    monkeypatch.setenv("MANYEYES_DEVICE", "cpu")
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(tmp_path / "env.html")]) == 0
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(tmp_path / "flag.html"), "--dtype", "float32"]) == 0
    assert [m.info.dtype for m in loaded] == ["float16", "float32"]
    # A device this machine lacks, from the setting alone: refused by name, no file written.
    monkeypatch.setenv("MANYEYES_DEVICE", "cuda:7")
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(tmp_path / "never.html")]) == 2
    assert "'cuda:7' was asked for" in capsys.readouterr().err and not (tmp_path / "never.html").exists()
