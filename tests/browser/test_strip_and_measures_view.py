"""The prediction strips and the measures panel, as a user sees them after a run (tiny-gpt and
tiny-llama, headless Chromium).

Before:
- the strip's heading and its count were two flex items a .5rem gap apart: on screen
  "Next token:  1000 tokens, scroll…", as text "Next token:1000 tokens, scroll…";
- a guess that is a space (tiny-gpt's top guess after "on" is " ") printed as nothing, in the strip,
  in the focused heatmap's "next after" line and in the measure's reading;
- the measures panel stood 1rem in from the views above it and the experiments below;
- the measure heatmap stretched its cells to the panel's width: 1148 × 581 px for 1,000 tokens;
- after a new run the panel kept the last run's heatmap until it was scrolled to."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.browser.conftest import serving
from tests.browser.test_long_strip import T, long_text
from tests.browser.test_page import hover_cell, open_page, run

pytestmark = pytest.mark.browser

TEXT = "The cat sat on the mat. The cat sat on"
# About 200 tiny-gpt tokens (a character each): a strip that scrolls beside the heatmap at 1280 px.
PARAGRAPH = long_text(200)

VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(token: str) -> str:
    """How the page writes a token's spaces and control characters (static/js/tokens.js visibleSpaces)."""
    return "".join(VISIBLE.get(ch, f"‹{ord(ch):02X}›") if ch.isspace() or ord(ch) < 32 or ord(ch) == 127 else ch
                   for ch in token)


@pytest.fixture(scope="module")
def base():
    with serving({"tiny-gpt": "tiny-gpt", "tiny-llama": "tiny-llama"}) as url:
        yield url


def predictions(base: str, text: str, model: str = "tiny-gpt") -> dict:
    body = httpx.post(f"{base}/api/v1/attention", timeout=60, json={
        "text": text, "model": model, "format": "u8", "layers": [0], "heads": [0], "predictions": {"top_k": 5}})
    return body.json()["predictions"]


def as_masked_lm(page, model: str) -> None:
    """GET /models says `model` is a masked LM (causal false): the strips' wording for MLM heads,
    which no built-in model has."""
    def handle(route):
        reply = route.fetch()
        body = reply.json()
        for info in body["models"]:
            if info["id"] == model:
                info["causal"] = False
        route.fulfill(response=reply, body=json.dumps(body))

    page.route("**/api/v1/models", handle)


# The strip's first line as laid out (innerText), and the room between the heading's colon and
# the count after it, against the width of one space in the heading's font.
HEADING = """() => {
  const strip = document.getElementById('focus-predictions');
  const more = strip.querySelector('.pred-more');
  const walker = document.createTreeWalker(strip, NodeFilter.SHOW_TEXT);
  let colon = null;
  while (walker.nextNode()) if (walker.currentNode.textContent.includes(':')) { colon = walker.currentNode; break; }
  const range = document.createRange();
  const at = colon.textContent.indexOf(':');
  range.setStart(colon, at); range.setEnd(colon, at + 1);
  const probe = document.createElement('span');
  probe.style.whiteSpace = 'pre'; probe.textContent = ' ';
  more.parentElement.append(probe);
  const space = probe.getBoundingClientRect().width;
  probe.remove();
  return { line: strip.innerText.split('\\n')[0], gap: more.getClientRects()[0].left - range.getBoundingClientRect().right,
           space, sameLine: Math.abs(more.getClientRects()[0].top - range.getBoundingClientRect().top) < 4,
           list: strip.querySelector('[role=list]').getAttribute('aria-label') };
}"""


@pytest.mark.parametrize("causal", [True, False], ids=["next-token", "masked-token"])
def test_the_strip_heading_reads_as_one_line_with_one_space(base, make_page, artifacts, causal):
    page = make_page(viewport=(1280, 800))
    if not causal:
        as_masked_lm(page, "tiny-gpt")
    open_page(page, base)
    run(page, PARAGRAPH, model="tiny-gpt")
    page.wait_for_function("() => document.querySelector('#focus-predictions .pred-more')?.textContent.includes('scroll')")
    seen = page.evaluate(HEADING)
    name = "Next-token guesses" if causal else "Masked-token guesses"
    assert seen["line"] == f"{name}: 200 tokens, scroll for the rest; the heatmap row read is outlined.", seen
    assert "  " not in seen["line"], seen
    # One space on screen too: the count follows the colon on its line, a space's width after it.
    assert seen["sameLine"] and 0 <= seen["gap"] <= seen["space"] + 1, seen
    assert seen["list"] == f"{name}, 200 tokens", seen
    page.locator("#focus-predictions").screenshot(path=str(artifacts / f"strip-heading-{'causal' if causal else 'masked'}.png"))


def test_guessed_spaces_are_visible_in_the_strip_and_the_readings(base, page, artifacts):
    top = predictions(base, TEXT)
    spaced = [int(i) for i, guesses in top.items() if guesses[0]["token"] != guesses[0]["token"].lstrip()]
    assert spaced, "tiny-gpt guesses a space after some token of TEXT"  # " " after "The" and after "on"
    open_page(page, base)
    run(page, TEXT, model="tiny-gpt")
    page.wait_for_selector("#focus-predictions .pred")
    cells = page.locator("#focus-predictions .pred")
    for i in spaced:
        guess = cells.nth(i).locator(".pred-guess")
        token = top[str(i)][0]["token"]
        assert guess.text_content() == visible(token) and guess.text_content().strip() == guess.text_content(), i
        assert guess.get_attribute("data-token") == token  # the real text, kept
        assert guess.bounding_box()["width"] >= 4, i  # something on screen, not an empty slot
    # The focused heatmap's hover: every guess of the row named visibly.
    row = spaced[0]
    hover_cell(page, row, 0)
    line = page.locator("#tooltip").text_content().split("\n")[-1]
    assert line.startswith("next after"), line
    for guess in top[str(row)]:
        assert f"{visible(guess['token'])} {guess['prob'] * 100:.1f}%" in line, line
    assert ":  " not in line and ",  " not in line, line
    page.locator(".plot-wrap").screenshot(path=str(artifacts / "strip-space-hover.png"))
    # The measure heatmap's reading line: "· next: ␣ 49%", not "· next:  49%".
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg", timeout=30_000)
    page.focus("#measure-plot")
    for _ in range(row + 1):  # the first press lands on the top-left cell
        page.keyboard.press("ArrowDown")
    reading = page.locator("#measure-reading")
    assert reading.get_attribute("data-row") == str(row)
    first = top[str(row)][0]
    assert f"· next: {visible(first['token'])} {first['prob'] * 100:.0f}%" in reading.text_content(), reading.text_content()
    page.locator("#predictions").screenshot(path=str(artifacts / "strip-space-measures.png"))


EDGES = """() => {
  const box = (s) => { const r = document.querySelector(s).getBoundingClientRect(); return { left: r.left, right: r.right }; };
  return { views: box('#views'), measures: box('#measures'), experiments: box('#experiments'),
           scrollWidth: document.documentElement.scrollWidth };
}"""


@pytest.mark.parametrize("size", [(1366, 768), (1280, 800)])
def test_the_measures_panel_lines_up_with_the_views(base, make_page, artifacts, size):
    page = make_page(viewport=size)
    open_page(page, base)
    run(page, TEXT, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg", timeout=30_000)
    seen = page.evaluate(EDGES)
    for panel in ("measures", "experiments"):
        assert abs(seen[panel]["left"] - seen["views"]["left"]) <= 1, seen
        assert abs(seen[panel]["right"] - seen["views"]["right"]) <= 1, seen
    assert seen["scrollWidth"] == size[0], seen
    page.screenshot(path=str(artifacts / f"measures-edges-{size[0]}x{size[1]}.png"), full_page=True)


@pytest.fixture
def long_ran(base, make_page):
    page = make_page(viewport=(1366, 768))
    open_page(page, base)
    run(page, long_text(), model="tiny-llama")
    page.wait_for_function(f"() => document.querySelectorAll('#focus-predictions .pred').length === {T}", timeout=60_000)
    return page


CELLS = """() => {
  const plot = document.getElementById('measure-plot');
  const xa = plot._fullLayout.xaxis, ya = plot._fullLayout.yaxis;
  const n = plot.measured.matrix.length, m = plot.measured.matrix[0].length;
  const image = plot.querySelector('.layer-above image').getBoundingClientRect();
  const panel = document.getElementById('measures').getBoundingClientRect();
  return { n, m, cellX: xa._length / m, cellY: ya._length / n, image: { width: image.width, height: image.height, right: image.right },
           panelRight: panel.right, scrollWidth: document.documentElement.scrollWidth };
}"""


def test_the_measure_heatmap_keeps_square_cells_at_1000_tokens(long_ran, artifacts):
    page = long_ran
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg", timeout=60_000)
    seen = page.evaluate(CELLS)
    assert seen["n"] == seen["m"] == T, seen
    # Square cells, the whole square drawn (at 1366 px they were 1148 × 581 px of a 1000 × 1000 matrix).
    assert abs(seen["cellX"] - seen["cellY"]) < 0.01, seen
    assert abs(seen["image"]["width"] - seen["image"]["height"]) <= 1, seen
    assert seen["image"]["width"] >= 500, seen  # not squared by shrinking to a stamp
    # Within the page's width.
    assert seen["image"]["right"] <= seen["panelRight"] and seen["scrollWidth"] == 1366, seen
    page.locator("#measures").screenshot(path=str(artifacts / "measures-square-1000.png"))


SHOWN = """() => {
  const plot = document.getElementById('measure-plot');
  const r = plot.getBoundingClientRect();
  return { visible: !plot.hidden && r.height > 0 && !!plot.querySelector('.main-svg'), rows: plot.measured?.matrix?.length ?? null,
           top: document.getElementById('measures').getBoundingClientRect().top, window: innerHeight };
}"""


def measure_weights(url: str) -> bool:
    """The measure heatmap's raw weights: GET …/runs/{id}/attention?…format=json, or the text posted
    again (POST …/attention, format json, told apart by its body)."""
    path = url.split("?")[0]
    return (path.endswith("/attention") and "/runs/" in path and "format=json" in url) or path.endswith("/api/v1/attention")


def hold_measure_weights(page) -> list:
    """Holds the measure heatmap's JSON weights until the test lets them go: whether or not the
    panel is scrolled to, nothing of the new run can be drawn before the test has looked. Returns
    the held routes."""
    held = []

    def handle(route):
        request = route.request
        body = request.post_data_json if request.method == "POST" else None
        if request.method == "GET" or (isinstance(body, dict) and body.get("format") == "json"):
            held.append(route)
        else:
            route.continue_()

    page.route(measure_weights, handle)
    return held


def test_a_new_run_never_shows_the_last_runs_measure_heatmap(base, make_page, artifacts):
    page = make_page(viewport=(1366, 768))
    open_page(page, base)
    run(page, TEXT, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg", timeout=30_000)
    seen = page.evaluate(SHOWN)
    assert seen["visible"] and seen["rows"] == 38, seen
    page.evaluate("() => window.scrollTo(0, 0)")
    held = hold_measure_weights(page)
    # A 1,000-token run: the views come to the top of the window, the measures panel below it,
    # where it is drawn only once scrolled to.
    run(page, long_text(), model="tiny-llama")
    page.wait_for_function(f"() => document.querySelectorAll('#focus-predictions .pred').length === {T}", timeout=60_000)
    seen = page.evaluate(SHOWN)
    # Nothing of this run's measure can be drawn yet: what the panel shows of a heatmap is nothing,
    # where it showed the 38-token heatmap under the 1,000-token views (to a full-page picture, or
    # to a scroll that had not yet reached it).
    assert not seen["visible"] and seen["rows"] is None, seen
    assert page.locator("#measure-reading").is_hidden()
    page.screenshot(path=str(artifacts / "measures-after-new-run.png"), full_page=True)
    page.unroute(measure_weights)
    for route in held:
        route.continue_()
    # Scrolled to, it draws this run's.
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_function(f"() => document.getElementById('measure-plot').measured?.matrix.length === {T}", timeout=60_000)
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg")
    assert page.evaluate(SHOWN)["visible"]
