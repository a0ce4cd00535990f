"""The page under conditions a review tried it in (h50d): a phone turned and turned back, a phone
held sideways or a page zoomed to 200 %, and a slow link. Each test failed on the page before its
fix; screenshots go to test-artifacts/ to be looked at."""

from __future__ import annotations

import re

import pytest

from tests.browser.test_laptop_windows import LAYOUT
from tests.browser.test_page import SENTENCE, open_page, run

pytestmark = pytest.mark.browser

# The measure heatmap's box and the width its Plotly SVG is drawn at, and what the window shows.
MEASURE_WIDTHS = """() => {
  const plot = document.getElementById('measure-plot');
  return { box: plot.clientWidth, svg: Math.round(plot.querySelector('.main-svg').getBoundingClientRect().width),
           page: document.documentElement.scrollWidth, window: innerWidth, scale: visualViewport.scale };
}"""


def test_the_measure_heatmap_follows_a_phone_turned_and_turned_back(server, browser, artifacts):
    """After its first resize the measure heatmap kept that width for good: turned sideways and
    back, a phone's plot stayed 617 px wide, the page 642 px, and the whole page was zoomed out to 58 %."""
    context = browser.new_context(viewport={"width": 375, "height": 667}, has_touch=True, is_mobile=True, device_scale_factor=2)
    try:
        page = context.new_page()
        open_page(page, server)
        run(page, SENTENCE)
        page.locator("#measures").scroll_into_view_if_needed()  # the panel draws its views once seen
        page.wait_for_selector("#measure-plot[data-measure='raw']")
        for width, height in ((375, 667), (667, 375), (375, 667), (667, 375), (375, 667)):
            page.set_viewport_size({"width": width, "height": height})
            want = {"box": width - 50, "svg": width - 50, "page": width, "window": width, "scale": 1}
            try:
                page.wait_for_function(f"(want) => JSON.stringify(({MEASURE_WIDTHS})()) === JSON.stringify(want)",
                                       arg=want, timeout=5_000)
            except Exception:
                assert page.evaluate(MEASURE_WIDTHS) == want, (width, height)
        page.locator("#measure-plot").scroll_into_view_if_needed()
        page.wait_for_timeout(300)  # a screenshot at once caught the page half painted
        page.screenshot(path=str(artifacts / "measure-phone-turned-back.png"))
    finally:
        context.close()


@pytest.mark.parametrize("size, phone", [((667, 375), True), ((568, 320), True), ((683, 384), False)],
                         ids=["phone-sideways", "small-phone-sideways", "zoom-200"])
def test_a_short_window_shows_the_whole_heatmap_after_a_run(server, browser, artifacts, size, phone):
    """In one column under 700 px the page scrolled to the panel's title after a run, and the plot,
    as tall as the window (340 px at least), ran past its foot with the key axis: 57 px on a phone
    held sideways (667 × 375), 72 px at 1366 × 768 zoomed to 200 % (683 × 384)."""
    width, height = size
    context = browser.new_context(viewport={"width": width, "height": height}, has_touch=phone, is_mobile=phone,
                                  device_scale_factor=2)
    try:
        page = context.new_page()
        open_page(page, server)
        run(page, SENTENCE)
        page.wait_for_timeout(300)  # the reveal's scroll
        seen = page.evaluate(LAYOUT)
        page.screenshot(path=str(artifacts / f"short-window-{width}x{height}.png"))
        assert seen["plot"]["top"] >= -1 and seen["plot"]["bottom"] <= height, seen  # -1: a scroll to a fractional top
        assert seen["labelsTop"] >= 0 and seen["labelsBottom"] <= height, seen
        assert seen["cells"]["width"] >= 0.5 * (height - 130), seen
        assert seen["scrollWidth"] == width, seen
    finally:
        context.close()


def test_a_measure_on_its_way_fades_the_last_one_and_says_so(server, page, artifacts):
    """On a slow link the menu read "Value-weighted norms" while the raw weights stayed drawn, their
    caption above them, with no word of the wait: read as value norms."""
    open_page(page, server)
    run(page, SENTENCE)
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw']")
    held = []
    norms = re.compile(r".*/measures\?names=value_norms.*")
    page.route(norms, lambda route: held.append(route))
    page.select_option("#measure", "value_norms")
    page.wait_for_selector("#measure-plot[data-stale]", timeout=3_000)
    assert page.locator("#measure-caption").text_content() == "Loading value-weighted norms…"
    assert page.locator("#measure-plot").evaluate("p => getComputedStyle(p).opacity") == "0.35"
    page.locator("#measures").screenshot(path=str(artifacts / "measure-loading.png"))
    held[0].continue_()
    page.wait_for_selector("#measure-plot[data-measure='value_norms']:not([data-stale])")
    assert "Loading" not in page.locator("#measure-caption").text_content()
    # One that fails leaves the last measure faded under its own caption, the error said.
    page.route(norms, lambda route: route.fulfill(status=503, json={"detail": "busy"}))
    page.select_option("#measure", "raw")
    page.wait_for_selector("#measure-plot[data-measure='raw']:not([data-stale])")
    page.select_option("#measure", "value_norms")
    page.wait_for_function("() => document.getElementById('measure-status').textContent !== ''")
    assert page.locator("#measure-plot").get_attribute("data-measure") == "raw"
    assert page.locator("#measure-plot").get_attribute("data-stale") is not None
    assert not page.locator("#measure-caption").text_content().startswith("Loading")
    page.unroute(norms)
