"""A long run from the keyboard only: the cell cursor pans a zoomed heatmap past its edge (the
modebar's + and − zoom around the centre, and nothing else moved the window), and the long head
view's token lists are Tab stops walked with the arrows, as the short head view's are.

The long run is KeptMock's (test_long_page.py): its tiles and top-k rows come from known queries
and keys, so the readings are checked against exact weights."""

from __future__ import annotations

import pytest

from tests.browser.test_long_page import KeptMock, wait_settled, zoom
from tests.browser.test_page import open_page, submit

pytestmark = pytest.mark.browser


@pytest.fixture
def mock():
    return KeptMock()


def cursor_cell(page) -> tuple[int, int]:
    tooltip = page.locator("#tooltip")
    return int(tooltip.get_attribute("data-query")), int(tooltip.get_attribute("data-key"))


def cursor_reaches(page, query: int, key: int) -> tuple[int, int]:
    """The cursor's cell once it is (query, key), or where it stayed after 5 s."""
    try:
        page.wait_for_function("([q, k]) => { const t = document.getElementById('tooltip');"
                               " return t.dataset.query === String(q) && t.dataset.key === String(k); }",
                               arg=[query, key], timeout=5_000)
    except Exception:
        pass
    return cursor_cell(page)


def spoken_value(page) -> float:
    page.wait_for_function("() => { const r = document.getElementById('cell-reading').textContent;"
                           " return r.includes('→') && !r.includes('reading'); }")
    return float(page.locator("#cell-reading").text_content().rsplit(": ", 1)[1])


def test_the_cell_cursor_pans_a_zoomed_long_heatmap_past_its_edge(server, page, mock):
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    zoom(page, 1000, 1040, 980, 1020)
    wait_settled(page)
    page.focus("#focus-plot")
    page.keyboard.press("Shift+ArrowRight")  # lands on the window's top-left cell
    assert cursor_cell(page) == (1000, 980)
    for _ in range(39):
        page.keyboard.press("Shift+ArrowDown")
    assert cursor_cell(page) == (1039, 980)  # the window's last row
    # One more: the window follows the cursor one row down, as a map would.
    page.keyboard.press("Shift+ArrowDown")
    assert cursor_reaches(page, 1040, 980) == (1040, 980)
    window = page.evaluate("() => document.getElementById('focus-plot').plotted().window")
    assert (window["q0"], window["q1"], window["k0"], window["k1"]) == (1001, 1041, 980, 1020)
    assert spoken_value(page) == pytest.approx(float(mock.head(0, 0)[1040, 980]), abs=6e-4)
    # And left past the first key: the keys pan too; keyboard focus stays on the heatmap.
    page.keyboard.press("Shift+ArrowLeft")
    assert cursor_reaches(page, 1040, 979) == (1040, 979)
    window = page.evaluate("() => document.getElementById('focus-plot').plotted().window")
    assert (window["k0"], window["k1"]) == (979, 1019)
    assert spoken_value(page) == pytest.approx(float(mock.head(0, 0)[1040, 979]), abs=6e-4)
    assert page.evaluate("() => document.activeElement.id") == "focus-plot"
    wait_settled(page)


def test_a_long_runs_head_view_is_walked_from_the_keyboard(server, page, mock):
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    page.wait_for_function("() => Number(document.querySelector('#headview canvas')?.dataset.lines) > 0")
    every = int(page.locator("#headview canvas").get_attribute("data-lines"))
    # One Tab stop a list, as the short head view has.
    assert page.locator(".hv-left li[tabindex='0']").count() == 1 == page.locator(".hv-right li[tabindex='0']").count()
    page.focus(".hv-left li[tabindex='0']")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    assert page.evaluate("() => document.activeElement.dataset.index") == "2"
    assert page.locator(".hv-left li.active").get_attribute("data-index") == "2"
    assert page.locator(".hv-left li[tabindex='0']").get_attribute("data-index") == "2"  # Tab comes back here
    # Row 2's lines alone: its 3 strongest keys, and any others at 0.02 or more.
    row = mock.head(0, 0)[2]
    strongest = sorted(row, reverse=True)[:8]
    drawn = sum(1 for j, w in enumerate(strongest) if w > 0 and (j < 3 or w >= 0.02))
    assert int(page.locator("#headview canvas").get_attribute("data-lines")) == drawn < every
    # The keys' list skips its gap markers: every step lands on a token.
    page.focus(".hv-right li[tabindex='0']")
    page.keyboard.press("ArrowDown")
    assert page.evaluate("() => document.activeElement.matches('.hv-right li[data-index]')")
    assert page.locator(".hv-right li.active").count() == 1
    # Leaving the lists lets every line back.
    page.focus("#text")
    page.wait_for_function("(every) => Number(document.querySelector('#headview canvas').dataset.lines) === every", arg=every)
    assert page.locator(".hv-tokens li.active").count() == 0
