"""`manyeyes attend` prints tokens and one head's matrix, and fails in words."""

import re

from manyeyes.app.cli import main


def test_attend_prints_tokens_and_the_chosen_head(capsys, minilm):
    assert main(["attend", "The bank of the river.", "--layer", "2", "--head", "3"]) == 0
    out = capsys.readouterr().out
    assert "[2]bank" in out and "layer 2, head 3" in out
    rows = [line for line in out.splitlines() if re.match(r"^\s*\S+ \d+ ", line) and "|" in line]
    assert len(rows) == 8
    expected = minilm.attend("The bank of the river.").attention[2, 3]
    first = [float(v) for v in rows[1].split("|")[0].split()[2:]]
    assert first == [round(v, 2) for v in expected[1].tolist()]


def test_attend_errors_are_words_not_tracebacks(capsys):
    assert main(["attend", "hi", "--layer", "9"]) == 2
    assert "layer must be in 0..5" in capsys.readouterr().err
    assert main(["attend", "word " * 600]) == 2
    assert "602 tokens" in capsys.readouterr().err
    assert main(["attend", "hi", "--model", "/no/such/model"]) == 2
    assert "no such model file or folder" in capsys.readouterr().err


def test_python_dash_m_exits_with_the_commands_status():
    """`python -m manyeyes` dropped main()'s return value: every error exited 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "manyeyes", "attend", "hi", "--layer", "9"], capture_output=True, text=True)
    assert done.returncode == 2 and "layer must be in 0..5" in done.stderr, (done.returncode, done.stderr)
