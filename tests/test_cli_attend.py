"""`manyeyes attend` prints tokens and one head's matrix, and fails in words."""

import re

import pytest

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


def test_every_row_of_a_long_head_lines_up_under_the_key_numbers():
    """Rows 10 and up were shifted one column right of the header and of rows 0-9."""
    import torch

    from manyeyes.app.cli import _format_head

    tokens = [f"t{i}" for i in range(12)]
    lines = _format_head(tokens, torch.full((12, 12), 0.25)).splitlines()
    header, rows = lines[0], lines[1:]
    last_key = header.rindex("11") + 2  # where the header's last column ends
    assert {row.index("  |") for row in rows} == {last_key}, lines
    assert rows[9].split()[1] == "9" and rows[11].split()[1] == "11"


def test_keys_a_query_cannot_see_are_dots_not_zero_weights(capsys):
    """A causal model's later keys printed 0.00, like a weight the head gave nothing; the figures
    and the page grey them out."""
    from manyeyes.model import load

    assert main(["attend", "The cat", "--model", "tiny-gpt", "--layer", "1", "--head", "2"]) == 0
    rows = [line.split("|")[0].split()[2:] for line in capsys.readouterr().out.splitlines()
            if re.match(r"^\s*\S+ +\d+ ", line) and "|" in line]
    expected = load("tiny-gpt", device="cpu").attend("The cat").attention[1, 2]
    assert len(rows) == 7 and all(len(row) == 7 for row in rows)
    for q, row in enumerate(rows):
        assert row[q + 1:] == ["·"] * (6 - q)
        assert [float(v) for v in row[: q + 1]] == [round(v, 2) for v in expected[q, : q + 1].tolist()]


def test_a_nan_weight_prints_as_a_question_mark_not_a_traceback():
    """int(nan) raised ValueError: a run that overflowed in float16 crashed the terminal view."""
    import torch

    from manyeyes.app.cli import _format_head

    lines = _format_head(["a", "b"], torch.tensor([[1.0, 0.0], [float("nan"), 0.5]])).splitlines()
    assert lines[2].endswith("  nan  0.50  |?+|"), lines


def test_attend_errors_are_words_not_tracebacks(capsys):
    assert main(["attend", "hi", "--layer", "9"]) == 2
    assert "layer must be in 0..5" in capsys.readouterr().err
    assert main(["attend", "word " * 600]) == 2
    assert "602 tokens" in capsys.readouterr().err
    assert main(["attend", "hi", "--model", "/no/such/model"]) == 2
    assert "no such model file or folder" in capsys.readouterr().err


def test_json_only_options_without_json_are_refused_not_ignored(capsys):
    # `--layers 0` without --json printed layer 0 head 0's table as if the option had been read.
    for extra in (["--layers", "2"], ["--heads", "1,3"], ["--format", "u8"]):
        assert main(["attend", "The bank.", *extra]) == 2
        assert capsys.readouterr().err == (f"error: {extra[0]} only shapes the --json answer; add --json, or choose the "
                                           "table's head with --layer and --head\n")
    assert main(["attend", "The bank.", "--layers", "2", "--format", "u8"]) == 2
    assert capsys.readouterr().err.startswith("error: --layers, --format only shape the --json answer; add --json")


def test_python_dash_m_exits_with_the_commands_status():
    """`python -m manyeyes` dropped main()'s return value: every error exited 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "manyeyes", "attend", "hi", "--layer", "9"], capture_output=True, text=True)
    assert done.returncode == 2 and "layer must be in 0..5" in done.stderr, (done.returncode, done.stderr)


def test_cli_mistakes_are_one_line_and_status_2(capsys, tmp_path):
    """Each of these was a traceback (or, for the export's head, a silently different file)."""
    import pytest

    cases = [
        (["attend", "hi", "--device", "bogus"], "unknown device 'bogus'"),
        (["attend", "hi", "--device", "cuda:7"], "'cuda:7' was asked for"),
        (["attend", "hi", "--device", "meta"], "unknown device 'meta'"),  # torch knows it; it cannot run a model
        (["attend", "hi", "--device", "xpu"], "unknown device 'xpu'"),
        (["attend", "caf\udce9", "--model", "tiny-gpt"], "text is not UTF-8 text (character 3"),  # argv of b"caf\xe9"
        (["attend", "hi", "--pair", "\udcff"], "pair is not UTF-8 text"),
        (["attend", " ", "--model", "tiny-gpt"], "text must contain something other than whitespace"),
        (["attend", "hi", "--pair", "  "], "pair must contain something other than whitespace"),
        (["export", "", "--model", "tiny-gpt", "-o", str(tmp_path / "v.html")], "text must contain"),
        (["export", "hi", "--model", "tiny-gpt", "-o", str(tmp_path / "no" / "v.html")], "cannot write"),
        (["export", "hi", "--model", "tiny-gpt", "-o", str(tmp_path)], "cannot write"),
        (["export", "hi", "--model", "tiny-gpt", "-o", str(tmp_path / "v.html"), "--head", "99"], "head in 0..7"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "v.html").exists()
    for argv in (["serve", "--port", "99999"], ["serve", "--port", "-1"], ["serve", "--model", ""]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and "error: argument" in capsys.readouterr().err, argv


def test_attend_json_carries_the_predictions_asked_for(capsys):
    import json

    assert main(["attend", "In the", "--model", "tiny-gpt", "--top-k", "2", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert len(body["predictions"]) == len(body["tokens"]) and all(len(p) == 2 for p in body["predictions"].values())


def test_a_reader_that_goes_away_stops_attend_quietly():
    """`manyeyes attend ... | head -1` ended in a BrokenPipeError traceback and status 1. The pipe's
    reading end is closed before the model has loaded, so the first print meets it every time."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "manyeyes", "attend", "The bank of the river.", "--model", "tiny-gpt"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and stderr.strip() == "", (proc.returncode, stderr)


def test_every_argument_of_attend_and_export_says_what_it_is(capsys):
    """`manyeyes export --help` listed the positional `text` with no word about it (nor did attend)."""
    import pytest

    for command in ("attend", "export"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        positional = out.split("positional arguments:")[1].split("options:")[0]
        assert positional.split() [:6] == ["text", "the", "sentence", "to", "run", "(quote"], out


def test_a_terminal_that_cannot_show_a_character_gets_its_escape_not_a_traceback():
    """Under an ASCII locale `attend "naïve"` died in a UnicodeEncodeError half-way through."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "manyeyes", "attend", "a naïve 🏦 bank", "--model", "tiny-gpt"],
                          capture_output=True, env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-500:]
    out = done.stdout.decode("ascii")
    # tiny-gpt's bytes of ï labelled as the page labels them (‹C3›‹AF›), the labels' marks escaped
    assert "layer 0, head 0" in out and "[4]\\u2039C3\\u203a [5]\\u2039AF\\u203a" in out


def test_control_characters_in_tokens_are_shown_escaped(capsys):
    """A newline token split its row label over two lines; ESC and CR went to the terminal raw.
    They are labelled as the page labels them (↵, ‹1B›, the override's bytes ‹E2› ‹80› ‹AE›)."""
    assert main(["attend", "ab\r\ncd\x1b[31mred\u202eevil", "--model", "tiny-gpt"]) == 0
    out = capsys.readouterr().out
    assert not any(ch in out for ch in "\r\x1b\u202e")
    assert "[2]␍ [3]↵" in out and "[6]‹1B›" in out and "[14]‹E2› [15]‹80› [16]‹AE›" in out
    table = out.split("(rows: queries, columns: keys)\n")[1].splitlines()
    widths = {len(line) for line in table[1:]}
    assert len(widths) == 1, table  # every row on one line, under the header's columns


def test_layer_and_head_with_json_are_refused_not_ignored(capsys):
    """--json printed all 72 heads with --layer 2 --head 3 given, as if they had not been (h56g)."""
    for extra, named in ((["--layer", "2"], "--layer chooses"), (["--head", "0"], "--head chooses"),
                         (["--layer", "2", "--head", "3"], "--layer and --head choose")):
        assert main(["attend", "The bank.", "--json", *extra]) == 2
        assert capsys.readouterr().err == f"error: {named} the table's head; with --json choose heads with --layers and --heads\n"


def test_output_that_cannot_be_written_is_one_line_and_a_long_json_answer_is_written_whole(tmp_path):
    """`> /dev/full` and a closed stdout were tracebacks; a --json answer to a slow pipe was cut
    at 65,536 bytes with status 0 (h56g)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        for extra in ([], ["--json"]):
            done = subprocess.run([sys.executable, "-m", "manyeyes", "attend", "The bank.", *extra], stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=120)
            assert (done.returncode, done.stderr) == (1, "error: cannot write the output: No space left on device\n"), done.stderr
    for extra in ("", "--json"):  # the table printed nothing with status 0
        closed = subprocess.run(f"{sys.executable} -m manyeyes attend 'The bank.' {extra} >&-", shell=True,
                                stderr=subprocess.PIPE, text=True, timeout=120)  # Python starts with no stdout
        assert closed.returncode == 1 and closed.stderr.endswith("error: cannot write the output: standard output is closed\n"), closed.stderr
    # A stdout left non-blocking takes 64 KiB and refuses the rest, which was dropped (review h56h).
    unblocked = ("import os, sys; os.set_blocking(1, False); from manyeyes.app.cli import main; "
                 f"sys.exit(main(['attend', {'ab ' * 80!r}, '--model', 'tiny-gpt', '--json']))")
    slow = subprocess.Popen(f"{sys.executable} -c \"{unblocked}\" | (sleep 2; cat) > {tmp_path / 'out.json'}", shell=True)
    assert slow.wait(120) == 0
    import json
    answer = json.loads((tmp_path / "out.json").read_text())
    assert answer["attention"]["shape"][2] == 240, answer["attention"]["shape"]


def test_the_long_table_keeps_wide_characters_in_their_columns():
    """The strongest-keys table padded labels by len(): rows of 東, 京 and 大 stood a column off (h56g)."""
    import torch

    from manyeyes.app.cli import _columns, _format_top_keys
    from manyeyes.model.kept import TopK

    tokens = ["[CLS]", "東", "京", "is", "big"]
    n = len(tokens)
    top = TopK(torch.full((n, 2), 0.25), torch.tensor([[0, 1]] * n), torch.full((n,), 0.5))
    arrows = {_columns(line[: line.index(" -> ")]) for line in _format_top_keys(tokens, top).splitlines()}
    assert len(arrows) == 1, _format_top_keys(tokens, top)


def test_the_table_labels_tokens_as_the_page_does_and_wide_characters_keep_their_columns(capsys):
    """Each of tiny-gpt's three byte tokens of 東 was labelled 東, a space token was blank, and a
    row labelled by a wide character stood a column right of the others (a review by use)."""
    assert main(["attend", "東京 tower", "--model", "tiny-gpt"]) == 0
    out = capsys.readouterr().out
    assert "[0]‹E6› [1]‹9D› [2]‹B1›" in out and "[6]␣" in out
    assert main(["attend", "東京は高い river", "--model", "minilm"]) == 0
    table = capsys.readouterr().out.split("(rows: queries, columns: keys)\n")[1].splitlines()
    # Where each row's first weight ends, counting a wide character as two columns.
    wide = lambda line: sum(2 if "\u3040" <= ch <= "\u9fff" else 1 for ch in line[: line.index(".") + 3])
    assert len({wide(line) for line in table[1:]}) == 1, table


LONG_TEXT = "The quick brown fox jumps over the lazy dog, and the dog looks back at the fox. " * 2


def top_key_rows(out: str) -> list[list[tuple[int, float]]]:
    """Each `row token -> [key]token weight ...` line's (key, weight) pairs."""
    keys = [line.split(" -> ", 1)[1].rsplit("  (rest ", 1)[0] for line in out.splitlines() if " -> " in line]
    return [[(int(key), float(w)) for key, w in re.findall(r"\[(\d+)\].*? (\d\.\d\d)(?:  |$)", row)] for row in keys]


@pytest.mark.parametrize("dense_max", ["1024", "16"])
def test_a_head_too_wide_for_a_terminal_lists_each_querys_strongest_keys(capsys, monkeypatch, dense_max):
    """Past 64 keys the table was 6 characters a key wide (2,048 lines of 12 KB at 2,048 tokens).
    Under MANYEYES_DENSE_MAX_TOKENS (16) the run keeps queries and keys, as the server's, and the
    keys are read from them; both agree with the dense weights."""
    import torch

    from manyeyes.model import load
    from manyeyes.model.runtime import AttentionModel

    kept = []
    run_kept = AttentionModel._run_kept
    monkeypatch.setattr(AttentionModel, "_run_kept", lambda self, *a: kept.append(1) or run_kept(self, *a))
    monkeypatch.setenv("MANYEYES_DENSE_MAX_TOKENS", dense_max)
    assert main(["attend", LONG_TEXT, "--model", "tiny-gpt", "--layer", "1", "--head", "3"]) == 0
    assert len(kept) == (dense_max == "16")
    out = capsys.readouterr().out
    weights = load("tiny-gpt", device="cpu").attend(LONG_TEXT).attention[1, 3]
    n = weights.shape[0]
    assert n > 64 and "each query's 5 strongest keys" in out
    rows = top_key_rows(out)
    assert len(rows) == n
    for i, row in enumerate(rows):
        top = weights[i].topk(min(5, i + 1))  # a causal row sees keys 0..i only
        assert [k for k, _ in row] == top.indices.tolist(), i
        assert [w for _, w in row] == [round(v, 2) for v in top.values.tolist()], i
    assert main(["attend", LONG_TEXT, "--model", "tiny-gpt", "--layer", "1", "--head", "3", "--matrix"]) == 0
    matrix = [line for line in capsys.readouterr().out.splitlines() if line.endswith("|") and " -> " not in line]
    assert len(matrix) == n
    assert [float(v) for v in matrix[-1].split("|")[0].split()[-n:]] == [round(v, 2) for v in weights[-1].tolist()]
    assert torch.allclose(weights.sum(-1), torch.ones(n), atol=1e-5)


# `manyeyes` held at a line on stdout while torch imports or the model loads, for a Ctrl-C to land there.
HELD = """
import sys, time

def hold(*args, **kwargs):
    print("held", flush=True)
    time.sleep(60)

class HoldTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            hold()

if sys.argv[1] == "import":
    sys.meta_path.insert(0, HoldTorch())
else:
    import manyeyes.model
    manyeyes.model.load = hold
from manyeyes.app.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("phase", ["import", "load"])
@pytest.mark.parametrize("command", [["attend", "In the beginning"], ["export", "In the beginning", "-o", "view.html"]])
def test_ctrl_c_stops_attend_and_export_quietly_with_status_130(command, phase, tmp_path):
    """Ctrl-C during `manyeyes attend` or `export` printed a KeyboardInterrupt traceback, where
    `train` returns 130 quietly; the second or two torch takes to import is part of every run."""
    import signal
    import subprocess
    import sys

    # As a terminal starts it: a suite run in the background (`nohup ... &`) passes SIGINT on
    # ignored, and Python then installs no KeyboardInterrupt for it (the test waited 60 s).
    proc = subprocess.Popen([sys.executable, "-c", HELD, phase, *command, "--model", "tiny-gpt"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "held\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "" and out == "", (proc.returncode, err)
    assert not list(tmp_path.iterdir())


def test_export_help_says_the_settings_its_device_and_dtype_default_to(capsys):
    """--help said the device defaults to "best available" while MANYEYES_DEVICE (and
    MANYEYES_DTYPE for --dtype) are used where set."""
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    options = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE cpu, cuda, cuda:N, mps or auto (default: MANYEYES_DEVICE if set, else auto)" in options
    assert "(default: MANYEYES_DTYPE if set, else auto: as stored on CUDA, float32 elsewhere)" in options


def test_serve_help_says_the_settings_its_device_and_dtype_default_to(capsys):
    """As export's: without the flag, serve uses MANYEYES_DEVICE and MANYEYES_DTYPE where set."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    options = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE cpu, cuda, cuda:N, mps or auto (default: MANYEYES_DEVICE if set, else best available)" in options
    assert "(default: MANYEYES_DTYPE if set, else auto: as stored on CUDA, float32 elsewhere)" in options
    assert "--log-level {debug,info,warning,error} the server's logging level (default info)" in options


def test_attend_reads_no_server_setting_but_its_own(capsys, monkeypatch):
    """`manyeyes attend` takes arguments, not the server's settings (README), yet validated every
    MANYEYES_* variable: MANYEYES_MAX_TOPK=100, meant for a server, stopped it with status 2 (audit
    h46c). The one setting it reads, MANYEYES_DENSE_MAX_TOKENS, is still refused in one line."""
    monkeypatch.setenv("MANYEYES_MAX_TOPK", "100")
    monkeypatch.setenv("MANYEYES_MODELS", '{"a": ')
    monkeypatch.setenv("MANYEYES_HALF", "maybe")
    assert main(["attend", "In the beginning", "--model", "tiny-gpt"]) == 0
    captured = capsys.readouterr()
    assert "layer 0, head 0" in captured.out and "error" not in captured.err, captured.err
    monkeypatch.setenv("MANYEYES_DENSE_MAX_TOKENS", "0")
    assert main(["attend", "In the beginning", "--model", "tiny-gpt"]) == 2
    assert capsys.readouterr().err == ("error: a MANYEYES_* setting in the environment is malformed: "
                                       "MANYEYES_DENSE_MAX_TOKENS='0': Input should be greater than or equal to 1\n")
