"""The measures panel ("Beyond raw weights") after a new run and after a resize (tiny-gpt, headless
Chromium). Each test holds the request that would draw the new run's part (page.route), so what
it checks is what the panel shows before that answer, whatever the machine's speed.

Before:
- the neuron view kept the last run's table (its tokens, its query) after a new run until the
  panel was scrolled to and this run's view came;
- the measures' prediction strip (#predictions) and the one under the focused heatmap
  (#focus-predictions) showed the last run's tokens and guesses until this run's predictions came;
- the measure heatmap's colour bar was placed beside its square cells once, at a fraction of the
  plot's width: after a window resize the cells kept their place and the bar drifted away from them
  (or over them) until the next draw."""

from __future__ import annotations

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.browser.conftest import serving
from tests.browser.test_page import open_page, run, submit

pytestmark = pytest.mark.browser

TEXT = "The cat sat on the mat. The cat sat on"  # 38 tiny-gpt tokens, a character each
OTHER = "A dog ran in the park."  # 22


@pytest.fixture(scope="module")
def base():
    with serving({"tiny-gpt": "tiny-gpt"}) as url:
        yield url


def first_run(page, base):
    """TEXT run and the measures panel drawn, scrolled to."""
    open_page(page, base)
    run(page, TEXT, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg", timeout=30_000)


NEURON = """() => {
  const root = document.getElementById('neuron');
  return { rows: document.querySelectorAll('#neuron-table tbody tr').length, query: root.dataset.query ?? null,
           note: document.getElementById('neuron-note').textContent, options: document.querySelectorAll('#neuron-query option').length,
           queryRow: document.querySelector('#neuron-table .neuron-query-row th')?.textContent ?? null };
}"""


def run_other_holding(page, held_urls):
    """Runs OTHER with the requests `held_urls` matches held; returns what lets them go. Returns
    once the panel has been told of the new run (its query tokens are OTHER's): that happens in the
    same task as the panel forgets the last run, and nothing held can have come by then."""
    held = []

    def hold(route):
        held.append(route)

    page.route(held_urls, hold)
    run(page, OTHER, model="tiny-gpt")
    page.wait_for_function(f"() => document.querySelectorAll('#neuron-query option').length === {len(OTHER)}", timeout=30_000)

    def release():
        for route in held:
            route.continue_()
        page.unroute(held_urls, hold)

    return release


def neuron_view(url: str) -> bool:
    """GET …/runs/{id}/neuron?layer=…&head=…&query=…: the neuron view's one request."""
    return "/neuron?" in url


def test_a_new_run_never_shows_the_last_runs_neuron_table(base, page, artifacts):
    first_run(page, base)
    page.wait_for_selector(f"#neuron[data-query='{len(TEXT) - 1}'] #neuron-table tbody tr", timeout=30_000)
    assert page.evaluate(NEURON)["rows"] == len(TEXT) + 1  # the query's row and one per key
    page.wait_for_selector(f"#attribution[data-position='{len(TEXT) - 1}'] button[data-head]", timeout=30_000)
    page.evaluate("() => window.scrollTo(0, 0)")
    release = run_other_holding(page, neuron_view)
    seen = page.evaluate(NEURON)
    # It showed TEXT's 39 rows, query "n", under OTHER's query tokens.
    assert seen["rows"] == 0 and seen["query"] is None and seen["queryRow"] is None, seen
    assert seen["note"] == "This run's neuron view is drawn when this panel is in view.", seen
    # Nor the last run's logit attribution, whose position list is this run's now.
    assert page.locator("#attribution button").count() == 0
    assert page.locator("#attribution-position option").count() == len(OTHER)
    assert page.text_content("#attribution-sum") == "This run's attribution is drawn when this panel is in view."
    page.locator("#neuron").screenshot(path=str(artifacts / "neuron-after-new-run.png"))
    release()
    # Scrolled to, it draws this run's.
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector(f"#neuron[data-query='{len(OTHER) - 1}'] #neuron-table tbody tr", timeout=30_000)
    seen = page.evaluate(NEURON)
    assert seen["rows"] == len(OTHER) + 1 and seen["queryRow"] == "query: .", seen
    assert not page.locator("#neuron-note").text_content().startswith("This run's")
    page.wait_for_selector(f"#attribution[data-position='{len(OTHER) - 1}'] button[data-head]", timeout=30_000)


STRIPS = """() => {
  const read = (id) => {
    const strip = document.getElementById(id);
    return { items: strip.querySelectorAll('.pred').length, text: strip.innerText, hidden: strip.hidden,
             runId: strip.dataset.runId ?? null };
  };
  return { measures: read('predictions'), focus: read('focus-predictions') };
}"""


def asks_predictions(request) -> bool:
    """The predictions' POST (predictions.js load): the text again, with a "predictions" field."""
    return request.method == "POST" and request.url.endswith("/api/v1/attention") and '"predictions"' in (request.post_data or "")


def test_a_new_run_never_shows_the_last_runs_predictions(base, page, artifacts):
    first_run(page, base)
    page.wait_for_function(f"() => document.querySelectorAll('#predictions .pred').length === {len(TEXT)}"
                           f" && document.querySelectorAll('#focus-predictions .pred').length === {len(TEXT)}", timeout=30_000)
    before = page.evaluate(STRIPS)
    assert before["focus"]["runId"] and not before["focus"]["hidden"], before
    held = []

    def hold(route):
        if asks_predictions(route.request):
            held.append(route)
        else:
            route.continue_()

    page.route("**/api/v1/attention", hold)
    with page.expect_request(asks_predictions, timeout=30_000):
        submit(page, OTHER, model="tiny-gpt")
    # The new run is on screen (its predictions are asked for once it is) and they are held.
    seen = page.evaluate(STRIPS)
    # Each strip showed TEXT's 38 tokens and guesses under OTHER's heatmaps.
    stale = {name: strip["items"] for name, strip in seen.items() if strip["items"] or "cat" in strip["text"]}
    assert stale == {}, seen
    assert seen["focus"]["runId"] != before["focus"]["runId"], seen
    assert seen["measures"]["text"] == "Loading this run's predictions…", seen
    page.locator("#views").screenshot(path=str(artifacts / "predictions-after-new-run.png"))
    for route in held:
        route.continue_()
    page.unroute("**/api/v1/attention", hold)
    page.wait_for_function(f"() => document.querySelectorAll('#predictions .pred').length === {len(OTHER)}"
                           f" && document.querySelectorAll('#focus-predictions .pred').length === {len(OTHER)}", timeout=30_000)
    seen = page.evaluate(STRIPS)
    assert seen["focus"]["runId"] and seen["focus"]["runId"] != before["focus"]["runId"], seen
    assert page.locator("#focus-predictions .pred-token").first.text_content() == "A"


# The cells' right edge (the image Plotly lays on the axes) and the colour bar's left edge, in the
# page's pixels, and whether Plotly has laid the plot out at its box's width yet.
BAR = """() => {
  const plot = document.getElementById('measure-plot');
  const cells = plot.querySelector('.layer-above image').getBoundingClientRect();
  const bar = plot.querySelector('.colorbar').getBoundingClientRect();
  const xa = plot._fullLayout.xaxis, ya = plot._fullLayout.yaxis;
  return { gap: bar.left - cells.right, cellsRight: cells.right, barLeft: bar.left, barRight: bar.right,
           plotRight: plot.getBoundingClientRect().right, square: Math.abs(xa._length - ya._length) < 1,
           laidOut: Number(plot.querySelector('.main-svg').getAttribute('width')) === plot.clientWidth,
           width: plot.clientWidth };
}"""


@pytest.mark.parametrize("sizes", [((1366, 768), (1900, 768)), ((1366, 768), (1000, 768))], ids=["wider", "narrower"])
def test_the_colour_bar_follows_square_cells_through_a_resize(base, make_page, artifacts, sizes):
    drawn, resized = sizes
    page = make_page(viewport=drawn)
    first_run(page, base)
    start = page.evaluate(BAR)
    assert start["square"] and 0 <= start["gap"] <= 20, start
    page.set_viewport_size({"width": resized[0], "height": resized[1]})
    # Plotly lays the plot out at its new width (its responsive resize), and the bar is to be put
    # back beside the cells: waited for as DOM state, then read; a bar that never comes back is
    # read as it stands.
    settled = f"""() => {{
      const seen = ({BAR})();
      return seen.laidOut && seen.width !== {start['width']} && Math.abs(seen.gap - {start['gap']}) <= 3;
    }}"""
    try:
        page.wait_for_function(settled, timeout=10_000)
    except PlaywrightTimeout:
        pass
    seen = page.evaluate(BAR)
    page.locator("#measures").screenshot(path=str(artifacts / f"measures-colourbar-{resized[0]}.png"))
    assert seen["laidOut"] and seen["width"] != start["width"], seen
    assert seen["square"], seen
    # Beside the cells, as drawn: a few px right of them, inside the plot.
    assert 0 <= seen["gap"] <= 20 and abs(seen["gap"] - start["gap"]) <= 3, (start, seen)
    assert seen["barRight"] <= seen["plotRight"] + 1, seen


FLOW_AND_FINDER = """() => ({
  flow: document.getElementById('flow').innerText.trim(), drawn: !!document.querySelector('#flow svg'),
  tags: [...document.querySelectorAll('#finder-tag option')].map((o) => o.value), chosen: document.getElementById('finder-tag').value,
  heads: document.querySelectorAll('#finder [data-layer][data-head]').length,
  finderNote: document.querySelector('#finder .empty')?.textContent ?? null,
})"""


def flow_or_heads(url: str) -> bool:
    """GET …/flow?threshold=… and …/measures?names=heads: the graph's and the finder's requests."""
    return "/flow?" in url or "names=heads" in url


def test_while_a_new_runs_routes_and_heads_load_the_panel_says_so_and_offers_none_of_the_last_runs_tags(base, page, artifacts):
    first_run(page, base)
    page.wait_for_selector("#flow svg", timeout=30_000)
    page.wait_for_function("() => document.querySelectorAll('#finder-tag option').length > 2", timeout=30_000)
    first = page.evaluate(FLOW_AND_FINDER)
    chosen = first["tags"][1]
    page.select_option("#finder-tag", chosen)
    release = run_other_holding(page, flow_or_heads)
    seen = page.evaluate(FLOW_AND_FINDER)
    # The graph's box was blank while its routes came; the tag list offered TEXT's tags.
    assert seen["flow"] == "Computing the routes through the layers…" and not seen["drawn"], seen
    assert seen["tags"] == ["", chosen] and seen["chosen"] == chosen and seen["heads"] == 0, seen
    assert seen["finderNote"] == "Finding this run's heads…", seen
    page.locator(".measures-grid").screenshot(path=str(artifacts / "flow-and-finder-loading.png"))
    release()
    page.wait_for_selector("#flow svg", timeout=30_000)
    page.wait_for_function("() => document.querySelectorAll('#finder [data-layer][data-head]').length > 0", timeout=30_000)
    after = page.evaluate(FLOW_AND_FINDER)
    assert after["flow"] != seen["flow"] and after["tags"][0] == "" and len(after["tags"]) >= 2, after
    assert after["finderNote"] is None, after


def test_failed_routes_and_heads_requests_leave_no_loading_note_behind(base, page):
    first_run(page, base)

    def fail(route):
        route.fulfill(status=500, content_type="application/json", body='{"error":{"code":"internal","message":"boom"}}')

    page.route(flow_or_heads, fail)
    run(page, OTHER, model="tiny-gpt")
    page.wait_for_function("() => document.getElementById('flow-status').textContent.length > 0"
                           " && document.getElementById('finder-status').textContent.length > 0", timeout=30_000)
    assert page.locator("#flow").inner_text().strip() == "" and page.locator("#finder .empty").count() == 0
    assert "boom" in page.locator("#flow-status").text_content() and "boom" in page.locator("#finder-status").text_content()


def test_the_focus_strip_drops_the_last_runs_guesses_when_the_new_run_is_announced(base, page):
    """main.js announces a new run (manyeyes:run), draws its heatmaps, and only then asks for its
    predictions: the strip under the new heatmap kept the last run's guesses in between, for a drawn
    frame or more. Read as the run is announced and at the next frame."""
    first_run(page, base)
    page.wait_for_function(f"() => document.querySelectorAll('#focus-predictions .pred').length === {len(TEXT)}", timeout=30_000)
    page.evaluate("""() => {
      const read = () => { const strip = document.getElementById('focus-predictions');
        return { items: strip.querySelectorAll('.pred').length, text: strip.innerText, runId: strip.dataset.runId ?? null }; };
      window.stripSeen = null;
      document.addEventListener('manyeyes:run', () => {
        const announced = read();
        requestAnimationFrame(() => { window.stripSeen = { announced, nextFrame: read() }; });
      }, { once: true });
    }""")
    submit(page, OTHER, model="tiny-gpt")
    page.wait_for_function("() => window.stripSeen !== null", timeout=30_000)
    seen = page.evaluate("window.stripSeen")
    for moment in ("announced", "nextFrame"):
        strip = seen[moment]
        # TEXT's 38 tokens and guesses under OTHER's heatmap, or OTHER's own once they came
        assert strip["items"] in (0, len(OTHER)) and "cat" not in strip["text"], seen
    assert seen["announced"] == {"items": 0, "text": "Loading this run's predictions…", "runId": None}, seen


def test_the_head_chips_hold_their_room_before_the_head_view_draws(base, make_page):
    """The head view's chips (which heads it draws) came with its lines, after a pause: they pushed
    the measures panel down by their height once the page had laid it out. The panel's place when
    the page says "Done" is its place with the head view drawn."""
    page = make_page(viewport=(1280, 800))
    open_page(page, base)
    page.evaluate("""() => { window.atDone = null;
      new MutationObserver(() => {
        if (window.atDone === null && document.getElementById('run-status').textContent.startsWith('Done'))
          window.atDone = { measuresTop: document.getElementById('measures').getBoundingClientRect().top + window.scrollY,
                            drawn: !!document.querySelector('#headview .hv-canvas[data-lines]') };
      }).observe(document.getElementById('run-status'), { childList: true, characterData: true, subtree: true }); }""")
    run(page, TEXT, model="tiny-gpt")
    page.wait_for_selector("#headview .hv-canvas[data-lines]", timeout=30_000)
    at_done = page.evaluate("window.atDone")
    drawn = page.evaluate("""() => ({ measuresTop: document.getElementById('measures').getBoundingClientRect().top + window.scrollY,
                                      chips: document.querySelectorAll('#headview-heads .chip').length,
                                      chipsHeight: document.getElementById('headview-heads').getBoundingClientRect().height })""")
    assert at_done is not None and not at_done["drawn"], at_done  # read before the lines were drawn
    assert drawn["chips"] > 0 and drawn["chipsHeight"] > 10, drawn
    assert abs(at_done["measuresTop"] - drawn["measuresTop"]) <= 1, (at_done, drawn)
