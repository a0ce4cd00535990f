"""manyeyes.figures on local and client results, and the example notebook run headless."""

from __future__ import annotations

import os
import re
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
    np.testing.assert_allclose(np.asarray(trace.z), local.attention[1, 0].numpy(), atol=1e-5)
    texts = [t.text.replace(" ", "␣") for t in local.tokens]  # spaces shown, as the page shows them
    assert list(fig.layout.xaxis.ticktext) == [texts[i] for i in fig.layout.xaxis.tickvals]
    assert len(fig.layout.xaxis.tickvals) <= 48
    assert trace.customdata[2][5].tolist() == [texts[2], texts[5]] and "→" in trace.hovertemplate


def test_grid_has_one_panel_per_head_and_follows_a_slice(local, server):
    assert len(figures.grid(local).data) == 2 * 8
    with Client(server) as c:
        part = c.slice(c.attention(TEXT), layers=[1], heads=[2, 6])
    fig = figures.grid(part)
    assert len(fig.data) == 2
    np.testing.assert_allclose(np.asarray(fig.data[1].z), local.attention[1, 6].numpy(), atol=1e-3)
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
    with pytest.raises(ValueError, match="one of"):
        figures.measures(local, "nope")


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
    assert len(figures_drawn) == 7
    text = "".join(o.get("text", "") for o in outputs)
    assert "previous-token score of layer 0, head 3: 0.9" in text
    # Offline: plotly.js went into the notebook itself; nothing points at a CDN.
    html = "".join(str(o.get("data", {}).get("text/html", "")) for o in outputs)
    assert "window.Plotly = Plotly" in html and not re.search(r"""src=["']https?://""", html)
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
