"""The page at common laptop windows (1280 × 800, 1366 × 768, 1440 × 900, 1536 × 864), where the
form and two rows of view options take about 300 px of the window's height above the views.

The focused heatmap was fitted to what was left of the window under them: at 1280 × 800 its cells
were 273 px of a 651 px wide plot (a 92-token text's labels at 7 px), and a long run's (three
rows of options with its note) plot fell to its 340 px floor, its keys below a 1366 × 768 window.
Now a run the room under the form cannot show readably brings the views to the top of the window
and the heatmap is fitted to the window; a short sentence stays where it is, under its text box."""

from __future__ import annotations

import pytest

from tests.browser.test_long_page import KeptMock, wait_settled
from tests.browser.test_page import SENTENCE, open_page, run, submit

pytestmark = pytest.mark.browser

# About 90 MiniLM tokens: too many for the room under the form at any of these windows.
PARAGRAPH = (
    "The old mill stood by the river for two hundred years, and every spring the water rose to meet its wheel. "
    "Children from the village came to watch the miller grind the grain, and their parents traded stories by the door. "
    "When the railway arrived the mill fell quiet, and the river kept its own counsel, carrying leaves and light past "
    "the empty windows. Now a bakery stands there, and the smell of bread drifts over the bridge each morning."
)

# What the page shows after a run: boxes in the window's coordinates, and the key labels' extent.
LAYOUT = """() => {
  const box = (s) => { const r = document.querySelector(s).getBoundingClientRect();
    return { left: r.left, top: r.top, right: r.right, bottom: r.bottom, width: r.width, height: r.height }; };
  const gd = document.getElementById('focus-plot');
  const labels = [...gd.querySelectorAll('.axis-labels text')].map((t) => t.getBoundingClientRect()).filter((r) => r.width > 0);
  return {
    plot: box('#focus-plot'), cells: box('#focus-plot canvas.heatmap-canvas'), panel: box('.focus-panel'),
    title: box('#focus-title'), grid: box('.grid-panel'), form: box('#text'),
    labelsBottom: Math.max(...labels.map((r) => r.bottom)), labelsTop: Math.min(...labels.map((r) => r.top)),
    fonts: [...gd.querySelectorAll('.axis-labels text')].map((t) => parseFloat(getComputedStyle(t).fontSize)),
    scrollWidth: document.documentElement.scrollWidth, scrollY: window.scrollY,
  };
}"""


def whole_on_screen(seen: dict, height: int) -> bool:
    """The plot, its cells, every axis label and the panel's title inside the window."""
    return (seen["title"]["top"] >= 0 and seen["plot"]["top"] >= 0 and seen["plot"]["bottom"] <= height
            and seen["labelsTop"] >= 0 and seen["labelsBottom"] <= height)


@pytest.mark.parametrize("size", [(1280, 800), (1366, 768), (1440, 900), (1536, 864)])
def test_a_paragraphs_heatmap_is_whole_and_large_at_laptop_windows(server, make_page, artifacts, size):
    """At 1280 × 800 the 92-token heatmap's cells were 273 px wide in a plot 651 px wide (1366 × 768:
    245 of 699; 1440 × 900: 393 of 740), every other token labelled at 7 px. The cells now span the
    plot's width less its labels and colour bar, the whole plot and its panel's title on screen,
    the thumbnails still beside it, nothing wider than the window."""
    width, height = size
    page = make_page(viewport=size)
    open_page(page, server)
    run(page, PARAGRAPH)
    page.wait_for_function("() => !document.querySelector('.thumb.loading') && document.querySelectorAll('.thumb').length === 72")
    seen = page.evaluate(LAYOUT)
    page.screenshot(path=str(artifacts / f"laptop-paragraph-{width}x{height}.png"))
    assert whole_on_screen(seen, height), seen
    assert seen["grid"]["left"] > seen["panel"]["right"], seen  # two columns: the thumbnails beside the heatmap
    assert seen["scrollWidth"] == width, seen
    # Square cells across the plot's width less its colour bar and labels, or its height (720 px at most) less its title and keys.
    assert seen["cells"]["width"] >= min(seen["plot"]["width"] - 200, seen["plot"]["height"] - 130), seen
    assert seen["cells"]["width"] >= 0.37 * width, seen
    assert min(seen["fonts"]) >= 8, seen


@pytest.mark.parametrize("size", [(1280, 800), (1366, 768)])
def test_a_long_runs_heatmap_is_not_cut_by_a_laptop_window(server, make_page, artifacts, size):
    """A 2048-token run adds a note to the options (a third row of them): the plot fell to its 340 px
    floor, and at 1366 × 768 it ran 42 px past the window's foot with its key labels, its cells 255 px."""
    width, height = size
    mock = KeptMock()
    page = make_page(viewport=size)
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    seen = page.evaluate(LAYOUT)
    page.screenshot(path=str(artifacts / f"laptop-long-{width}x{height}.png"))
    assert whole_on_screen(seen, height), seen
    assert seen["cells"]["width"] >= 0.33 * width, seen  # its labels ("children123") are longer than the paragraph's
    assert seen["scrollWidth"] == width, seen


def test_a_short_sentence_stays_under_its_text_box(server, make_page, artifacts):
    """A 13-token sentence is readable in the room under the form (every label at full size): the
    page does not move, so the text box is there for the next try, and the heatmap is whole."""
    page = make_page(viewport=(1366, 768))
    open_page(page, server)
    run(page, SENTENCE)
    seen = page.evaluate(LAYOUT)
    page.screenshot(path=str(artifacts / "laptop-short-1366x768.png"))
    assert seen["scrollY"] == 0 and seen["form"]["top"] >= 0, seen
    assert whole_on_screen(seen, 768), seen
    assert min(seen["fonts"]) >= 11, seen


def test_a_run_after_an_edit_is_laid_out_as_on_a_fresh_page(server, make_page):
    """The "last run" note under the form was still shown when the page chose whether to scroll
    (it went with the run's announcement, after that choice): at 1366 × 768 a 19-token run after an
    edit scrolled the form away and then, the note gone, fitted the plot to the room under the form,
    13 px rows in the window's top half. It is laid out now as the same run on a fresh page."""
    text = "a b c d e f g h i j k l m n o p q"  # 19 tokens with [CLS] and [SEP]
    settled = "() => !document.querySelector('.thumb.loading') && document.querySelectorAll('.thumb').length === 72"
    seen = []
    for edited in (False, True):
        page = make_page(viewport=(1366, 768))
        open_page(page, server)
        if edited:
            run(page, SENTENCE)
            page.fill("#text", text)
            assert page.locator("#stale-note").is_visible()
        run(page, text)
        page.wait_for_function(settled)
        page.wait_for_timeout(400)  # the plot's refit once the layout settles
        seen.append(page.evaluate(LAYOUT))
        page.close()
    fresh, edited = seen
    assert edited["scrollY"] == fresh["scrollY"] and abs(edited["plot"]["height"] - fresh["plot"]["height"]) <= 1, (fresh, edited)
    assert whole_on_screen(edited, 768), edited


@pytest.mark.parametrize("size", [(1100, 800), (844, 390)])
def test_in_one_column_the_page_brings_the_heatmap_whole_into_view(server, make_page, artifacts, size):
    """Under 1200 px the heatmap takes the window's width and about as much height (720 px at most),
    and it started under the form: at 1100 × 800 it ran 340 px past the window's foot after a run,
    and on a phone held sideways (844 × 390) below the window altogether. The page now scrolls to it."""
    width, height = size
    page = make_page(viewport=size)
    open_page(page, server)
    run(page, SENTENCE)
    seen = page.evaluate(LAYOUT)
    page.screenshot(path=str(artifacts / f"one-column-{width}x{height}.png"))
    assert seen["plot"]["top"] >= 0 and seen["plot"]["bottom"] <= height, seen
    assert seen["labelsTop"] >= 0 and seen["labelsBottom"] <= height, seen
    assert seen["cells"]["width"] >= min(0.45 * width, height - 170), seen
    assert seen["scrollWidth"] == width, seen
