"""The focused heatmap's cells are painted by the page (static/js/canvas_heatmap.js): its pixels must
be the values' colours, where Plotly's axes say the cells are, also zoomed, panned, stepped through
heads (issue 13, item 8); test_page_ux.py checks that exports embed them."""

from __future__ import annotations

import pytest

from tests.browser.test_page import SENTENCE, open_page, plotted, plotted_zmax, run, wait_focus

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


def test_causal_masked_cells_are_painted_masked(server, page):
    open_page(page, server)
    run(page, "The bank of the river.", model="tiny-causal")
    n = len(plotted(page))
    assert_cells_painted(page, [(0, n - 1), (1, 2), (n - 1, 0), (n - 1, n - 1)])
