"""The focused heatmap's cells are painted by the page (static/js/canvas_heatmap.js): its pixels must
be the values' colours, where Plotly's axes say the cells are, also zoomed, panned, stepped through
heads (issue 13, item 8); test_page_ux.py checks that exports embed them."""

from __future__ import annotations

import re

import pytest

from tests.browser.test_page import SENTENCE, open_page, plotted, plotted_zmax, run, submit, wait_focus, wait_plotted_shape

pytestmark = pytest.mark.browser

# Colour of cell (row, col) as painted, and the colour the page's table gives its value.
PIXEL_AND_EXPECTED = """async ([row, col]) => {
    const gd = document.getElementById('focus-plot');
    const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
    const drag = gd.querySelector('.nsewdrag').getBoundingClientRect();
    const x = drag.left + xa.l2p(col), y = drag.top + ya.l2p(row);
    const canvas = gd.querySelector('canvas.heatmap-canvas');
    const box = canvas.getBoundingClientRect();
    const px = Math.floor((x - box.left) * canvas.width / box.width);
    const py = Math.floor((y - box.top) * canvas.height / box.height);
    const [r, g, b] = canvas.getContext('2d').getImageData(px, py, 1, 1).data;
    const { colorTable } = await import('/static/js/theme.js');
    const p = gd.plotted();
    const v = p.z[row][col];
    const packed = colorTable()[v === null ? 256 : Math.round(255 * Math.min(1, v / p.zmax))];
    return [[r, g, b], [packed & 255, (packed >> 8) & 255, (packed >> 16) & 255], v];
}"""


# How many pixels of the hatch canvas inside cell (row, col) are drawn (a pixel in from its edges,
# where a neighbour's hatch may bleed); -1 for the whole canvas.
HATCHED = """([row, col]) => {
    const gd = document.getElementById('focus-plot');
    const hatch = gd.querySelector('canvas.heatmap-hatch');
    const box = hatch.getBoundingClientRect();
    let x0 = 0, y0 = 0, x1 = hatch.width, y1 = hatch.height;
    if (row >= 0) {
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const drag = gd.querySelector('.nsewdrag').getBoundingClientRect();
        const sx = hatch.width / box.width, sy = hatch.height / box.height;
        const xs = [col - 0.5, col + 0.5].map((c) => (drag.left + xa.l2p(c) - box.left) * sx);
        const ys = [row - 0.5, row + 0.5].map((r) => (drag.top + ya.l2p(r) - box.top) * sy);
        [x0, x1] = [Math.ceil(Math.min(...xs)) + 1, Math.floor(Math.max(...xs)) - 1];
        [y0, y1] = [Math.ceil(Math.min(...ys)) + 1, Math.floor(Math.max(...ys)) - 1];
    }
    const px = hatch.getContext('2d').getImageData(x0, y0, x1 - x0, y1 - y0).data;
    let drawn = 0;
    for (let i = 3; i < px.length; i += 4) drawn += px[i] > 0;
    return drawn;
}"""


def hatched(page, row: int = -1, col: int = -1) -> int:
    return page.evaluate(HATCHED, [row, col])


def assert_cells_painted(page, cells):
    for row, col in cells:
        got, want, value = page.evaluate(PIXEL_AND_EXPECTED, [row, col])
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1, (row, col, value, got, want)


def test_canvas_pixels_are_the_values_colours_zoomed_and_stepped(server, page, artifacts):
    open_page(page, server)
    run(page, SENTENCE)
    z = plotted(page)
    n = len(z)
    peak = max((v, r, c) for r, row in enumerate(z) for c, v in enumerate(row))
    assert plotted_zmax(page) == pytest.approx(peak[0], rel=1e-6)
    # The darkest cell is the head's peak, the rest spread over the table.
    assert_cells_painted(page, [(peak[1], peak[2]), (0, 0), (n - 1, n - 1), (3, 7), (7, 3)])
    assert hatched(page) == 0  # a bidirectional model masks nothing

    page.evaluate("() => Plotly.relayout('focus-plot', {'xaxis.range': [3.5, 8.5], 'yaxis.range': [8.5, 3.5]})")
    page.wait_for_function("() => document.querySelectorAll('#focus-plot .ytick text').length === 5")
    assert_cells_painted(page, [(4, 4), (5, 8), (8, 4)])
    page.focus("#focus-plot")
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=1)
    assert page.evaluate("() => document.getElementById('focus-plot').layout.xaxis.range") == [3.5, 8.5]
    assert_cells_painted(page, [(4, 4), (6, 7), (8, 8)])
    page.locator(".focus-panel").screenshot(path=str(artifacts / "canvas-zoomed-step.png"))

    # A pan moves the cells with the axes (Plotly updates the ranges live; the canvas follows).
    page.evaluate("() => Plotly.relayout('focus-plot', {'xaxis.range': [5.5, 10.5]})")
    page.wait_for_function("() => [...document.querySelectorAll('#focus-plot .xtick text')].some(t => t.textContent === 'muddy')")
    assert_cells_painted(page, [(4, 6), (5, 10), (8, 9)])


def test_a_short_text_after_a_longer_one_is_cells_edge_to_edge(server, page, artifacts):
    """Plotly.react kept the longer text's ranges as its square constraint's reference: "Hi" (3
    tokens) got keys from -0.97 to 2.97, and the room beside the cells was painted masked grey."""
    open_page(page, server)
    run(page, SENTENCE)
    submit(page, "Hi")
    wait_plotted_shape(page, 3, 3)
    ranges = page.evaluate("() => { const l = document.getElementById('focus-plot')._fullLayout; return [l.xaxis.range, l.yaxis.range]; }")
    assert ranges[0] == pytest.approx([-0.5, 2.5]) and ranges[1] == pytest.approx([2.5, -0.5])
    # The plot area's left and right edges, half-way down, are cells (1, 0) and (1, 2), not background.
    edges = page.evaluate("""() => {
        const canvas = document.querySelector('#focus-plot canvas.heatmap-canvas');
        const px = (x) => [...canvas.getContext('2d').getImageData(x, canvas.height >> 1, 1, 1).data];
        return [px(1), px(canvas.width - 2)];
    }""")
    want = [page.evaluate(PIXEL_AND_EXPECTED, [1, col])[1] for col in (0, 2)]
    assert [e[:3] for e in edges] == want and all(e[3] == 255 for e in edges), (edges, want)
    page.locator(".focus-panel").screenshot(path=str(artifacts / "canvas-short-text.png"))


def test_causal_masked_cells_are_painted_masked(server, page):
    open_page(page, server)
    run(page, "The bank of the river.", model="tiny-causal")
    n = len(plotted(page))
    assert_cells_painted(page, [(0, n - 1), (1, 2), (n - 1, 0), (n - 1, n - 1)])
    # Masked is told from a zero weight by more than colour: later keys are hatched, the rest not.
    assert hatched(page, 0, n - 1) > 0 and hatched(page, 1, 2) > 0
    assert hatched(page, n - 1, 0) == 0 and hatched(page, n - 1, n - 1) == 0 and hatched(page, 2, 1) == 0
    # The exported image carries the hatch too: a masked cell holds two colours, a seen one one.
    page.hover("#focus-plot")
    with page.expect_download() as download:
        page.click(".modebar-btn[data-title='Download plot as SVG']")
    svg = open(download.value.path(), encoding="utf-8").read()
    cells = max(re.findall(r'href="data:image/png;base64,([^"]+)"', svg), key=len)
    colours = page.evaluate("""async ([source, n]) => {
        const image = new Image();
        image.src = 'data:image/png;base64,' + source;
        await image.decode();
        const canvas = document.createElement('canvas');
        [canvas.width, canvas.height] = [image.width, image.height];
        const ctx = canvas.getContext('2d');
        ctx.drawImage(image, 0, 0);
        const k = image.width / n;
        const count = (row, col) => {
            const px = ctx.getImageData(col * k + 1, row * k + 1, k - 2, k - 2).data;
            const seen = new Set();
            for (let i = 0; i < px.length; i += 4) seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
            return seen.size;
        };
        return [count(0, n - 1), count(n - 1, 0)];
    }""", [cells, n])
    assert colours[0] >= 2 and colours[1] == 1, colours
