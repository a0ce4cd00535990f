"""manyeyes.figures on local and client results, and the example notebook run headless."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
import signal
from pathlib import Path

import numpy as np
import pytest

from manyeyes import Client, figures

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Four score and seven years ago our fathers brought forth."


@pytest.fixture(scope="module")
def local(tiny_gpt):
    return tiny_gpt.attend(TEXT)


@pytest.fixture(scope="module")
def remote(server):
    with Client(server) as c:
        yield c.attention(TEXT, format="json")


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_heatmap_shows_the_heads_weights_with_token_labels(request, local, kind):
    result = request.getfixturevalue(kind)
    fig = figures.heatmap(result, layer=1, head=0)
    trace = fig.data[0]
    want = local.attention[1, 0].numpy().copy()
    want[np.triu_indices(len(want), 1)] = np.nan  # tiny-gpt is causal: later keys are masked
    np.testing.assert_allclose(np.asarray(trace.z, dtype=float), want, atol=1e-5)
    texts = [t.text.replace(" ", "␣") for t in local.tokens]  # spaces shown, as the page shows them
    assert list(fig.layout.xaxis.ticktext) == [texts[i] for i in fig.layout.xaxis.tickvals]
    assert list(fig.layout.xaxis.tickvals) == list(range(len(texts)))  # 57 tokens in 720 px: room for each label
    assert trace.customdata[2][5].tolist() == [texts[2], texts[5], 2, 5] and "→" in trace.hovertemplate


def test_grid_has_one_panel_per_head_and_follows_a_slice(local, server):
    assert len(figures.grid(local).data) == 2 * 8
    with Client(server) as c:
        part = c.slice(c.attention(TEXT), layers=[1], heads=[2, 6])
    fig = figures.grid(part)
    assert len(fig.data) == 2
    np.testing.assert_allclose(np.asarray(fig.data[1].z, dtype=float), _later_keys_masked(local.attention[1, 6].numpy()),
                               atol=1e-3)
    with pytest.raises(KeyError, match="layer 0"):
        figures.heatmap(part, layer=0, head=2)


def test_head_view_draws_every_weight_above_the_floor_once(local):
    fig = figures.head_view(local, layer=0, heads=[3, 5])
    lines = [t for t in fig.data if t.mode == "lines" and t.x[0] is not None]
    drawn = sum(np.count_nonzero(~np.isnan(np.asarray(t.x, dtype=float))) // 2 for t in lines)
    a = local.attention[0].numpy()
    assert drawn == int((a[3] >= figures.MIN_DRAWN).sum() + (a[5] >= figures.MIN_DRAWN).sum())
    assert {t.name for t in fig.data if t.name} == {"head 3", "head 5"}


def test_measures_find_the_previous_token_head(local, remote):
    scores = figures.head_measures(local)
    assert scores["previous_token"].shape == (2, 8)
    assert scores["previous_token"][0, 3] > 0.9  # README: tiny-gpt's layer 0 head 3
    np.testing.assert_allclose(figures.head_measures(remote)["entropy"], scores["entropy"], atol=1e-3)
    fig = figures.measures(local, "first_token")
    np.testing.assert_allclose(np.asarray(fig.data[0].z), scores["first_token"])
    assert fig.layout.height >= 320  # two layers: a 40-pixel colour bar had its ticks on each other
    with pytest.raises(ValueError, match="one of"):
        figures.measures(local, "nope")


def test_measures_average_over_many_texts(tiny_gpt, local, remote):
    """The map of a study of many sentences ("which head is previous-token on average?") had to
    be stacked by hand, and figures.measures could not draw a list: an AttributeError."""
    others = [tiny_gpt.attend(t) for t in ("And God said.", "Let there be light.")]
    fig = figures.measures([local, *others], "previous_token")
    want = np.mean([figures.head_measures(r)["previous_token"] for r in (local, *others)], axis=0)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), want)
    assert "mean over 3 texts" in fig.layout.title.text
    np.testing.assert_allclose(np.asarray(figures.measures([remote, local]).data[0].z),
                               (figures.head_measures(remote)["previous_token"] + figures.head_measures(local)["previous_token"]) / 2,
                               atol=1e-6)
    with pytest.raises(ValueError, match="empty"):
        figures.measures([])
    with pytest.raises(ValueError, match="same layers and heads"):
        figures.measures([local, _result(np.full((1, 1, 2, 2), 0.5, np.float32), ["a", "b"], [False, False])])
    other_model = dataclasses.replace(remote, model="gpt-twin")  # the same shape, another model
    with pytest.raises(ValueError, match="one model.*gpt-twin, tiny-gpt"):
        figures.measures([remote, other_model])


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_a_causal_models_later_keys_are_drawn_masked_not_as_weights_of_0(request, kind, tiny_gpt, minilm):
    """The page greys a causal model's later keys; a figure drew them as weights of 0, and their
    hover read "0.0000", a weight the head chose. compare (A, B and A − B, where they read as "no
    difference") and grid did so after heatmap had stopped."""
    result = request.getfixturevalue(kind)
    other = tiny_gpt.attend("Four score and nine years ago.")
    for fig in (figures.heatmap(result, 1, 0), figures.compare(result, other, 1, 0), figures.grid(result)):
        for trace in fig.data:  # every panel: compare's three, grid's 2 x 8
            z = np.asarray(trace.z, dtype=float)
            assert np.isnan(z[np.triu_indices(len(z), 1)]).all() and not np.isnan(z[np.tril_indices(len(z))]).any()
            assert trace.hoverongaps is False
        assert fig.layout.plot_bgcolor == figures.MASKED and "grey: later keys" in fig.layout.title.text
    assert len(fig.data) == 2 * 8
    river = minilm.attend("The bank of the river.")
    for fig in (figures.heatmap(river, 0, 0), figures.compare(river, minilm.attend("The bank of the stream."), 0, 0),
                figures.grid(river)):
        assert not any(np.isnan(np.asarray(trace.z, dtype=float)).any() for trace in fig.data)
        assert "later keys" not in fig.layout.title.text and fig.layout.plot_bgcolor is None


def test_pooled_blocks_right_of_the_diagonal_are_masked_and_the_diagonals_are_not():
    n = 1201
    a = np.tril(np.ones((1, 1, n, n), dtype=np.float32))
    a /= a.sum(-1, keepdims=True)
    z = np.asarray(figures.heatmap(_result(a, ["a"] * n, causal=None), 0, 0).data[0].z, dtype=float)  # 3 x 3 tokens a cell
    assert z.shape == (401, 401)
    assert np.isnan(z[np.triu_indices(401, 1)]).all() and np.allclose(np.diag(z), 1 / np.arange(1, n + 1, 3))
    z = np.asarray(figures.grid(_result(a, ["a"] * n, causal=None)).data[0].z, dtype=float)  # 11 x 11 tokens a cell
    assert z.shape == (110, 110)
    assert np.isnan(z[np.triu_indices(110, 1)]).all() and np.allclose(np.diag(z), 1 / np.arange(1, n + 1, 11))


def test_measures_hide_special_tokens_as_the_page_does():
    """figures.measures had no hide_special: MiniLM's [CLS] and [SEP] take most of many heads'
    weight, and the map could not say what those heads do among the words."""
    rng = np.random.default_rng(0)
    a = rng.random((1, 2, 5, 5)).astype(np.float32)
    a /= a.sum(-1, keepdims=True)
    r = _result(a, ["[CLS]", "a", "b", "c", "[SEP]"], [True, False, False, False, True])
    words = a[..., 1:4, 1:4].astype(np.float64)
    words /= words.sum(-1, keepdims=True)
    got = figures.head_measures(r, hide_special=True)
    np.testing.assert_allclose(got["previous_token"], (words[..., 1, 0] + words[..., 2, 1]) / 2, rtol=1e-6)
    np.testing.assert_allclose(got["first_token"], words[..., :, 0].mean(-1), rtol=1e-6)
    np.testing.assert_allclose(got["diagonal"], np.diagonal(words, axis1=-2, axis2=-1).mean(-1), rtol=1e-6)
    fig = figures.measures([r, r], "first_token", hide_special=True)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), got["first_token"], rtol=1e-6)
    assert "special tokens hidden" in fig.layout.title.text
    no_first = a[..., 1:, 1:].astype(np.float64)
    no_first /= no_first.sum(-1, keepdims=True)
    np.testing.assert_allclose(figures.head_measures(r, hide_first=True)["first_token"], no_first[..., :, 0].mean(-1), rtol=1e-6)
    assert "hidden" not in figures.measures(r).layout.title.text
    with pytest.raises(ValueError, match="leaves no token"):
        figures.measures(_result(a[..., :2, :2], ["[CLS]", "[SEP]"], [True, True]), hide_special=True)


def test_html_is_offline(local, tmp_path):
    html = figures.to_html(figures.heatmap(local, 0, 3), str(tmp_path / "h.html"))
    # plotly.js itself (inlined) mentions its CDN for geo maps; what matters is that no script loads from anywhere.
    assert not re.search(r"""src=["']https?://""", html) and len(html) > 3_000_000


@pytest.mark.slow
def test_example_notebook_runs_headless(server):
    import nbclient
    import nbformat

    nb = nbformat.read(ROOT / "examples" / "tour.ipynb", as_version=4)
    os.environ["MANYEYES_URL"] = server  # the kernel inherits it
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        del os.environ["MANYEYES_URL"]
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures_drawn = [o for o in outputs if "Plotly.newPlot" in str(o.get("data", {}).get("text/html", ""))]
    assert len(figures_drawn) == 8  # every figure of manyeyes.figures, compare included
    text = "".join(o.get("text", "") for o in outputs)
    assert "previous-token score of layer 0, head 3: 0.9" in text
    # Offline: plotly.js went into the notebook itself; nothing points at a CDN.
    html = "".join(str(o.get("data", {}).get("text/html", "")) for o in outputs)
    assert "window.Plotly = Plotly" in html and not re.search(r"""src=["']https?://""", html)
    # In offline()'s own cell, once: in the first figure's, running that cell again dropped it from
    # the notebook, and every figure of the saved notebook was blank.
    holding = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
               and "window.Plotly = Plotly" in "".join(str(o.get("data", {}).get("text/html", "")) for o in cell.outputs)]
    assert len(holding) == 1 and "figures.offline()" in nb.cells[holding[0]].source
    assert html.count("window.Plotly = Plotly") == 1
    assert not re.search(r"require\.config\([^)]*https?://", html)


def test_whitespace_tokens_are_labelled_as_the_page_labels_them():
    """A space token (tiny-gpt splits them off) was a blank tick label; the page shows ␣."""
    from types import SimpleNamespace

    from manyeyes.figures import weights_of

    tokens = [SimpleNamespace(text=t) for t in ("a", " ", "\n", "b\tc", "\x00")]
    result = SimpleNamespace(attention=np.full((1, 1, 5, 5), 0.2, dtype=np.float32), layers=[0], heads=[0], tokens=tokens)
    assert weights_of(result).tokens == ["a", "␣", "↵", "b⇥c", "‹00›"]


def test_head_view_gives_each_of_up_to_32_heads_its_own_colour_as_the_page_does():
    """Heads 10 and 11 of a 12-head model (MiniLM) were drawn in the colours of heads 0 and 1;
    the page (static/js/theme.js) extends the ten Tableau colours to 32 distinct ones."""
    from types import SimpleNamespace

    tokens = [SimpleNamespace(text=t) for t in "abc"]
    result = SimpleNamespace(attention=np.full((1, 12, 3, 3), 1 / 3, dtype=np.float32), layers=[0], heads=list(range(12)),
                             tokens=tokens)
    fig = figures.head_view(result, layer=0)
    legend = {t.name: t.line.color for t in fig.data if t.name}
    assert len(set(legend.values())) == 12, legend
    # The page's own colours (theme.js extendHeads, light theme): Tableau 10, then hsl(18 + 360 i / 11, 0.9, 0.28 / 0.6).
    assert (legend["head 0"], legend["head 9"], legend["head 10"], legend["head 11"]) == ("#1f77b4", "#17becf", "#882e07", "#f5d83d")
    assert len(set(figures.HEAD_COLORS)) == 32


def test_a_local_kept_result_is_pointed_at_its_own_kept_views(tiny_gpt):
    """A local run kept with Capture(keep=True) was told to use Client.tile / topk / overview,
    which need a server; the local views are result.kept.block and manyeyes.model.kept."""
    from manyeyes import Capture

    kept = tiny_gpt.run([tiny_gpt.encode("In the beginning")], Capture(keep=True))[0]
    with pytest.raises(ValueError, match=r"kept queries and keys.*result\.kept\.block.*manyeyes\.model\.kept\.pooled"):
        figures.grid(kept)


def _later_keys_masked(matrix: np.ndarray) -> np.ndarray:
    """A causal head as the figures draw it: the keys after each query NaN (gaps), not 0."""
    matrix = matrix.astype(float)
    matrix[np.triu_indices(len(matrix), 1)] = np.nan
    return matrix


def _result(attention: np.ndarray, texts: list[str], special: list[bool] | None = None, causal: bool | None = False):
    """causal=None: not said, as a local result does not say it."""
    from types import SimpleNamespace

    special = special or [False] * len(texts)
    said = {} if causal is None else {"causal": causal}
    return SimpleNamespace(attention=attention, layers=list(range(attention.shape[0])), heads=list(range(attention.shape[1])),
                           tokens=[SimpleNamespace(text=t, special=s) for t, s in zip(texts, special)], **said)


def test_head_view_labels_sit_outside_the_lines_they_name(local):
    """The query labels (x=0) were drawn to the right of x=0 and the key labels (x=1) to the left
    of x=1: every label lay across the lines between the columns."""
    fig = figures.head_view(local, layer=0, heads=[3])
    columns = {t.x[0]: t for t in fig.data if t.mode == "text"}
    assert columns[0.0].textposition == "middle left" and columns[1.0].textposition == "middle right"
    assert list(columns[0.0].text) == list(columns[1.0].text) == [t.text.replace(" ", "␣") for t in local.tokens]


def test_a_byte_level_sentence_gets_every_token_labelled_and_a_long_one_positions(local):
    """At 57 tokens (tiny-gpt reads bytes) every other character was a tick label, so the axis
    read "F u ␣ c r ..."; and the square plot padded its axes with grey bands that read as cells."""
    fig = figures.heatmap(local, 0, 3)
    texts = [t.text.replace(" ", "␣") for t in local.tokens]
    assert list(fig.layout.xaxis.ticktext) == list(fig.layout.yaxis.ticktext) == texts
    assert fig.layout.xaxis.constrain == fig.layout.yaxis.constrain == "domain"
    n = 300
    fig = figures.heatmap(_result(np.full((1, 1, n, n), 1 / n, dtype=np.float32), [chr(97 + i % 26) for i in range(n)]), 0, 0)
    values, text = list(fig.layout.xaxis.tickvals), list(fig.layout.xaxis.ticktext)
    assert 10 <= len(values) < n and values[0] == 0 and len(set(np.diff(values))) == 1
    assert text == [f"{i} {chr(97 + i % 26)}" for i in values]  # a label every k tokens says which token it is


def test_a_thousand_token_head_is_max_pooled_so_sharp_weights_stay_visible():
    """At 1,201 tokens heatmap() sent 1.44M cells (22 MB of figure, most of it hover strings) into a
    720-pixel square, where the weights of a sharp head fell between pixels; grid() sent 63 MB."""
    n = 1201
    a = np.zeros((2, 3, n, n), dtype=np.float32)
    a[..., np.arange(n), np.arange(n)] = 0.5  # a diagonal
    a[1, 2, 1000, 7] = 0.9  # one sharp weight far from it
    result = _result(a, [chr(97 + i % 26) for i in range(n)])
    fig = figures.heatmap(result, 1, 2)
    z = np.asarray(fig.data[0].z)
    assert z.shape == (401, 401)  # 3 x 3 tokens a cell
    assert z[1000 // 3, 7 // 3] == np.float32(0.9) and np.all(np.diag(z) == np.float32(0.5)) and z[0, 5] == 0
    assert "1,201 tokens, max over 3×3 a cell" in fig.layout.title.text
    assert fig.data[0].customdata[333][2].tolist() == ["999–1001", "6–8"]
    assert len(fig.to_json()) < 8e6
    grid = figures.grid(result)
    assert all(np.asarray(t.z).shape == (110, 110) for t in grid.data) and len(grid.to_json()) < 2e6
    assert np.asarray(grid.data[5].z)[1000 // 11, 0] == np.float32(0.9) and list(grid.data[5].x[:2]) == [0, 11]
    short = figures.heatmap(_result(a[:, :, :40, :40], [chr(97 + i % 26) for i in range(40)]), 0, 0)
    np.testing.assert_array_equal(np.asarray(short.data[0].z), a[0, 0, :40, :40])  # whole below max_side


def test_special_tokens_can_be_hidden_as_on_the_page():
    """MiniLM's [CLS] and [SEP] take most of many heads' weight and wash the rest of the colour
    scale out; the page has "Hide special tokens" (rows renormalised), the figures had no way."""
    a = np.array([[[[0.7, 0.1, 0.1, 0.1],
                    [0.5, 0.3, 0.1, 0.1],
                    [0.6, 0.1, 0.1, 0.2],
                    [0.4, 0.2, 0.2, 0.2]]]], dtype=np.float32)
    result = _result(a, ["[CLS]", "bank", "river", "[SEP]"], [True, False, False, True])
    fig = figures.heatmap(result, 0, 0, hide_special=True)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), [[0.75, 0.25], [0.5, 0.5]], rtol=1e-6)
    assert list(fig.layout.xaxis.ticktext) == ["bank", "river"]
    assert fig.data[0].customdata[1][0].tolist() == ["river", "bank", 2, 1]  # positions in the run, not in the view
    assert "special tokens hidden, rows renormalised" in fig.layout.title.text
    first = figures.heatmap(result, 0, 0, hide_first=True)
    np.testing.assert_allclose(np.asarray(first.data[0].z)[0], [0.6, 0.2, 0.2], rtol=1e-6)
    grid = figures.grid(result, hide_special=True)
    np.testing.assert_allclose(np.asarray(grid.data[0].z), [[0.75, 0.25], [0.5, 0.5]], rtol=1e-6)
    # Hidden tokens leave gaps in the positions; a number axis drew the cells beside a gap wider.
    pair = _result(np.full((1, 1, 6, 6), 1 / 6, np.float32), ["[CLS]", "a", "b", "[SEP]", "c", "[SEP]"],
                   [True, False, False, True, False, True])
    hidden = figures.grid(pair, hide_special=True)
    assert list(hidden.data[0].x) == [1, 2, 4] and list(hidden.data[0].y) == [1, 2, 4]
    for axis in [*hidden.select_xaxes(), *hidden.select_yaxes()]:
        assert axis.type == "category", "a number axis draws the cells either side of a gap wider than the rest"
    hv = figures.head_view(result, 0, hide_special=True)
    assert [list(t.text) for t in hv.data if t.mode == "text"] == [["bank", "river"]] * 2
    np.testing.assert_allclose(np.asarray(figures.heatmap(result, 0, 0).data[0].z), a[0, 0])  # off by default


def test_the_readme_figures_example_runs_as_written(tmp_path, monkeypatch):
    """README's "Notebook figures" block, executed as it stands: its last line drew layer 2 of
    tiny-gpt, which has two layers (KeyError), while the text around it said it ran."""
    readme = (ROOT / "README.md").read_text()
    [block] = re.findall(r"### Notebook figures\n\n```python\n(.*?)```", readme, re.S)
    monkeypatch.chdir(tmp_path)
    ran = {}
    exec(compile(block, "README.md (Notebook figures)", "exec"), ran)
    page = (tmp_path / "fig.html").read_text()
    assert "Plotly.newPlot" in page and 'src="http' not in page  # standalone, as the comment says
    # Its example hover, as the figure draws that cell: it named "e" and "h", tokens 5 and 4 of the byte-level run.
    [(query, query_token, key, key_token, weight)] = re.findall(r'hover "query (\d+) “(.*?)” → key (\d+) “(.*?)”: (.*?)"', block)
    trace = ran["fig"].data[0]
    cell = trace.customdata[int(query)][int(key)]
    assert (cell[2], cell[0], cell[3], cell[1]) == (int(query), query_token, int(key), key_token)
    assert f"{trace.z[int(query)][int(key)]:.4f}" == weight


@pytest.mark.browser
def test_tokens_that_look_like_markup_are_drawn_as_written(browser, tmp_path):
    """Plotly reads a small HTML subset in labels and hovers: every Llama's and RoBERTa's `<s>`
    drew as an empty label, `<b>x</b>` as a bold x and `a&amp;b` as `a&b`. Drawn in chromium."""
    texts = ["<s>", "<b>bold</b>", "a&amp;b", "x<br>y", "</s>"]
    n = len(texts)
    result = _result(np.full((1, 1, n, n), 1 / n, dtype=np.float32), texts)
    path = tmp_path / "markup.html"
    figures.to_html(figures.heatmap(result, 0, 0), str(path))
    page = browser.new_page()
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".xtick text", state="attached")
        for axis in ("xtick", "ytick"):
            drawn = page.eval_on_selector_all(f".{axis} text", "els => els.map(e => e.textContent)")
            assert drawn == texts, (axis, drawn)
        assert page.eval_on_selector_all(".xtick text b, .xtick text tspan[style*=line-through]", "els => els.length") == 0
        figures.to_html(figures.head_view(result, 0), str(path))
        page.goto(path.as_uri())
        page.wait_for_selector(".textpoint text", state="attached")
        drawn = page.eval_on_selector_all(".textpoint text", "els => els.map(e => e.textContent)")
        assert drawn == texts * 2, drawn
    finally:
        page.close()


def test_a_short_run_is_not_drawn_tiny_and_long_labels_are_cut_outside_their_escapes():
    """Six tokens made a 344-pixel figure whose matrix was about 60 pixels inside its margins, and
    25-character labels squeezed it further; the hover keeps each whole token."""
    texts = ["<|begin_of_text|>", "a" * 30, "x" * 18 + "&<>", "ok"]
    n = len(texts)
    fig = figures.heatmap(_result(np.full((1, 1, n, n), 1 / n, dtype=np.float32), texts), 0, 0)
    assert fig.layout.height >= 460 and fig.layout.width >= 460
    assert list(fig.layout.xaxis.ticktext) == ["&lt;|begin_of_text|&gt;", "a" * 19 + "…", "x" * 18 + "&amp;…", "ok"]
    assert fig.data[0].customdata[0][1].tolist() == ["&lt;|begin_of_text|&gt;", "a" * 30, 0, 1]


@contextlib.contextmanager
def file_size_limit(limit: int = 2**20):
    """Writes past `limit` bytes fail with EFBIG, as on a full disk or over a quota (`ulimit -f`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_to_html_that_cannot_finish_leaves_the_file_that_was_there(local, tmp_path):
    """Written in place, a write that failed part-way (a full disk) left 1 MiB of a 4.6 MB page
    where the good one had been."""
    path = tmp_path / "fig.html"
    path.write_text("the good one", encoding="utf-8")
    fig = figures.heatmap(local, 0, 3)
    with file_size_limit(), pytest.raises(OSError, match="File too large"):
        figures.to_html(fig, str(path))
    assert path.read_text(encoding="utf-8") == "the good one"
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it
    figures.to_html(fig, str(path))
    assert "Plotly.newPlot" in path.read_text(encoding="utf-8") and list(tmp_path.iterdir()) == [path]


def test_byte_pieces_of_a_split_character_are_labelled_by_their_bytes_and_none_is_blank(tiny_gpt):
    """Each byte token of 👩 was labelled 👩 (four ticks alike), and the zero-width joiner's and the
    bidi override's bytes drew as blank labels; the page labels such pieces ‹F0› (tokens.js)."""
    from types import SimpleNamespace

    fig = figures.heatmap(tiny_gpt.attend("a\u200db\u202ec 👩 é"), 0, 0)
    assert list(fig.layout.xaxis.ticktext) == ["a", "‹E2›", "‹80›", "‹8D›", "b", "‹E2›", "‹80›", "‹AE›", "c", "␣",
                                               "‹F0›", "‹9F›", "‹91›", "‹A9›", "␣", "‹C3›", "‹A9›"]
    # Whole characters in one piece stay characters; an invisible one is escaped, not blank. A
    # WordPiece model's pieces show as the page's default labels show them: 爱 was labelled 爱 where
    # MiniLM read [UNK], and a continuation hid its ##.
    tokens = [SimpleNamespace(text=t, piece=p) for t, p in (("é", "Ã©"), (" the", "Ġthe"), ("\u200d", "âĢį"),
                                                             ("\u202e", None), ("ing", "##ing"), ("爱", "[UNK]"))]
    result = SimpleNamespace(attention=np.full((1, 1, 6, 6), 1 / 6, dtype=np.float32), layers=[0], heads=[0], tokens=tokens)
    assert figures.weights_of(result).tokens == ["é", "␣the", "‹200D›", "‹202E›", "##ing", "[UNK]"]


def test_a_result_with_no_tokens_is_refused_in_words(tiny_gpt):
    """A causal model's attend("") is a (2, 8, 0, 0) result: heatmap and head_view raised ValueError
    and IndexError from deep inside numpy and plotly, measures an IndexError."""
    empty = tiny_gpt.attend("")
    for draw in (lambda: figures.heatmap(empty, 0, 0), lambda: figures.grid(empty), lambda: figures.head_view(empty, 0),
                 lambda: figures.measures(empty), lambda: figures.head_measures(empty)):
        with pytest.raises(ValueError, match=r"^this result has no tokens \(its text was empty\): there is nothing to draw$"):
            draw()


def test_layer_head_and_max_side_must_be_whole_numbers(local):
    """heatmap(r, "0", 0) said "layer 0, head 0 is not in this result"; max_side=0 was a
    ZeroDivisionError; numpy's integers (np.argmax's) are whole numbers and are taken."""
    best = np.unravel_index(np.argmax(local.attention.numpy().mean((-1, -2))), local.attention.shape[:2])
    fig = figures.heatmap(local, best[0], best[1])
    shown = np.asarray(fig.data[0].z)
    np.testing.assert_allclose(np.tril(shown), local.attention[best].numpy(), atol=1e-6)  # later keys: NaN, masked
    assert fig.layout.title.text.startswith(f"Layer {best[0]}, head {best[1]}<br>")
    assert {t.name for t in figures.head_view(local, np.int64(1), heads=[np.int32(2)]).data if t.name} == {"head 2"}
    for call, says in ((lambda: figures.heatmap(local, "0", 0), "layer must be a whole number (an int), got '0'"),
                       (lambda: figures.heatmap(local, 0, 2.7), "head must be a whole number (an int), got 2.7"),
                       (lambda: figures.heatmap(local, True, 0), "layer must be a whole number (an int), got True"),
                       (lambda: figures.head_view(local, 0.5), "layer must be a whole number (an int), got 0.5"),
                       (lambda: figures.head_view(local, 0, heads=[1, 1.5]), "heads must be a whole number (an int), got 1.5"),
                       (lambda: figures.heatmap(local, 0, 0, max_side=0), "max_side must be at least 1"),
                       (lambda: figures.grid(local, max_side=0), "max_side must be at least 1"),
                       (lambda: figures.grid(local, max_side=2.5), "max_side must be a whole number")):
        with pytest.raises(ValueError, match=re.escape(says)):
            call()


def test_hiding_every_token_says_which_option_hid_them():
    """Only hide_special asked, the error still blamed "special tokens and the first token"."""
    specials = _result(np.full((1, 1, 2, 2), 0.5, dtype=np.float32), ["[CLS]", "[SEP]"], [True, True])
    with pytest.raises(ValueError, match=r"^hiding the special tokens leaves no token to draw$"):
        figures.heatmap(specials, 0, 0, hide_special=True)
    one = _result(np.ones((1, 1, 1, 1), dtype=np.float32), ["a"])
    with pytest.raises(ValueError, match=r"^hiding the first token leaves no token to draw$"):
        figures.grid(one, hide_first=True)
    with pytest.raises(ValueError, match=r"^hiding the special tokens and the first token leaves no token to draw$"):
        figures.head_view(specials, 0, hide_special=True, hide_first=True)


def test_heatmap_hover_names_each_cells_positions(local):
    """The hover's second label read "query e, key h": %{y} and %{x} give the tick labels, and in a
    byte-level run (tiny-gpt) the same letter is many rows. The positions come from customdata."""
    fig = figures.heatmap(local, 0, 3)
    trace = fig.data[0]
    texts = [t.text.replace(" ", "␣") for t in local.tokens]
    assert texts.count(texts[5]) > 1  # the letter on its own does not say which row
    assert trace.customdata[5][4].tolist() == [texts[5], texts[4], 5, 4]
    assert trace.hovertemplate == ("query %{customdata[2]} “%{customdata[0]}” → key %{customdata[3]} "
                                   "“%{customdata[1]}”: %{z:.4f}<extra></extra>")
    # Hidden tokens: still the positions in the run, not in the view.
    a = np.full((1, 1, 4, 4), 0.25, dtype=np.float32)
    hidden = figures.heatmap(_result(a, ["[CLS]", "e", "e", "[SEP]"], [True, False, False, True]), 0, 0, hide_special=True)
    assert hidden.data[0].customdata[1][0].tolist() == ["e", "e", 2, 1]


@pytest.mark.browser
def test_heatmap_hover_reads_positions_and_tokens_in_chromium(browser, local, tmp_path):
    path = tmp_path / "hover.html"
    figures.to_html(figures.heatmap(local, 0, 3), str(path))
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nsewdrag", state="attached")
        box = page.query_selector(".nsewdrag").bounding_box()
        n = len(local.tokens)
        page.mouse.move(box["x"] + box["width"] * 4.5 / n, box["y"] + box["height"] * 5.5 / n)  # query 5, key 4
        page.wait_for_selector(".hoverlayer text", state="attached")
        hover = " ".join(page.eval_on_selector_all(".hoverlayer text", "els => els.map(e => e.textContent)"))
    finally:
        page.close()
    texts = [t.text.replace(" ", "␣") for t in local.tokens]
    weight = float(local.attention[0, 3, 5, 4])
    assert hover == f"query 5 “{texts[5]}” → key 4 “{texts[4]}”: {weight:.4f}", hover


def test_to_html_into_a_missing_folder_names_that_path(local, tmp_path):
    """The FileNotFoundError named the hidden temporary file (.x.html.1710e27b.tmp), not the target."""
    path = tmp_path / "no" / "such" / "x.html"
    with pytest.raises(FileNotFoundError) as caught:
        figures.to_html(figures.heatmap(local, 0, 3), str(path))
    assert caught.value.filename == str(path) and ".tmp" not in str(caught.value), caught.value
    assert str(path) in str(caught.value) and caught.value.__cause__ is None


def test_heatmap_colours_reach_the_heads_max_unless_zmax_fixes_them(local):
    """Side by side in a paper, two heads each scaled to its own max looked equally strong."""
    own = figures.heatmap(local, 1, 0).data[0]
    assert own.zmin == 0 and own.zmax == pytest.approx(float(local.attention[1, 0].max()))
    fixed = figures.heatmap(local, 1, 0, zmax=1).data[0]
    assert fixed.zmax == 1.0 and np.array_equal(np.asarray(fixed.z), np.asarray(own.z), equal_nan=True)
    for bad in (0, -1, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="zmax"):
            figures.heatmap(local, 1, 0, zmax=bad)


def test_measures_say_their_unit_and_weights_keep_0_to_1(local):
    fig = figures.measures(local, "first_token")
    trace = fig.data[0]
    assert (trace.zmin, trace.zmax) == (0, 1)  # Plotly's own range drew the lowest head as none
    assert trace.colorbar.title.text == "mean weight"
    assert (fig.layout.xaxis.title.text, fig.layout.yaxis.title.text) == ("head", "layer")
    entropy = figures.measures(local, "entropy").data[0]
    assert entropy.zmin is None and entropy.zmax is None and entropy.colorbar.title.text == "entropy (nats)"


def test_head_view_names_its_query_and_key_sides(local):
    fig = figures.head_view(local, 1, [0])
    sides = {a.text: a.x for a in fig.layout.annotations}
    assert sides == {"query (attending)": 0.0, "key (attended to)": 1.0}


def test_compare_draws_both_runs_on_one_scale_and_their_difference_on_shared_tokens(tiny_gpt, local, remote):
    """Two heatmaps put into one subplot figure by hand lost their token labels and turned upside down."""
    from manyeyes.model.experiments import compare as compare_runs

    other = tiny_gpt.attend("Four score and nine years ago our mothers brought forth.")
    fig = figures.compare(local, other, 1, 0, names=("seven", "nine"))
    a, b, diff = fig.data
    np.testing.assert_allclose(np.asarray(a.z, dtype=float), _later_keys_masked(local.attention[1, 0].numpy()))
    np.testing.assert_allclose(np.asarray(b.z, dtype=float), _later_keys_masked(other.attention[1, 0].numpy()))
    assert fig.layout.coloraxis.cmax == pytest.approx(max(float(local.attention[1, 0].max()), float(other.attention[1, 0].max())))
    # The difference on the pairs the compare experiment aligns, A − B, labelled by A's tokens.
    pairs = compare_runs(tiny_gpt, TEXT, "Four score and nine years ago our mothers brought forth.").pairs
    rows_a, rows_b = [i for i, _ in pairs], [j for _, j in pairs]
    want = local.attention[1, 0].numpy()[np.ix_(rows_a, rows_a)] - other.attention[1, 0].numpy()[np.ix_(rows_b, rows_b)]
    want = _later_keys_masked(want)  # a key later than its query in either run is no difference
    np.testing.assert_allclose(np.asarray(diff.z, dtype=float), want, atol=1e-6)
    assert diff.zmid == 0 and diff.zmax == pytest.approx(float(np.nanmax(np.abs(want))))
    for axis in ("yaxis", "yaxis2", "yaxis3"):
        assert fig.layout[axis].autorange == "reversed" and fig.layout[axis].ticktext, axis
    shown = [t.text.replace(" ", "␣") for t in local.tokens]
    for value, label in zip(fig.layout.xaxis3.tickvals, fig.layout.xaxis3.ticktext):  # thinned: "position token"
        assert label in (shown[rows_a[value]], f"{rows_a[value]} {shown[rows_a[value]]}"), (value, label)
    assert "nine" in fig.layout.annotations[1].text and f"on the {len(pairs)} tokens" in fig.layout.annotations[2].text
    # A client's result compares with a local one.
    from_remote = figures.compare(remote, other, 1, 0).data[0]
    np.testing.assert_allclose(np.asarray(from_remote.z, dtype=float), np.asarray(a.z, dtype=float), atol=1e-5)


def test_compare_refuses_what_it_cannot_draw(tiny_gpt, local):
    with pytest.raises(ValueError, match="share no token"):
        figures.compare(local, tiny_gpt.attend("%%%%"), 0, 0)
    with pytest.raises(ValueError, match="B has 601 tokens"):
        figures.compare(local, _result(np.full((2, 8, 601, 601), 1 / 601, np.float32), ["a"] * 601), 0, 0)
    for zmax in (0, True):
        with pytest.raises(ValueError, match="zmax"):
            figures.compare(local, local, 0, 0, zmax=zmax)
    for names in (("A",), "AB", ("A", 2)):
        with pytest.raises(ValueError, match="names must be two texts"):
            figures.compare(local, local, 0, 0, names=names)


def test_compare_hovers_name_tokens_by_their_positions_in_the_runs(tiny_gpt, local):
    """With the first token hidden the hover said the cell's index, one less than the token's position."""
    other = tiny_gpt.attend("Four score and nine years ago.")
    fig = figures.compare(local, other, 1, 0, hide_first=True, names=("<seven>", "nine"))
    a, b, diff = fig.data
    assert tuple(a.customdata[0][1]) == ("o", "u", 1, 2)  # query "o" at 1 → key "u" at 2: position 0 is hidden
    assert tuple(diff.customdata[0][0][2:]) == ("1|1", "1|1")
    assert "&lt;seven&gt;" in a.hovertemplate and "<seven>" not in fig.layout.annotations[0].text
