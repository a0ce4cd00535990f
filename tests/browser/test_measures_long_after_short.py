"""The measures panel ("Beyond raw weights") after a long run that follows a short one (tiny-gpt,
headless Chromium; a server whose dense_max_tokens is 64, so a 200-token text is a long run: it
keeps queries and keys and gets no measures).

A long run keeps the panel with a note in place of its views (long_run.js longControls). Before:
- the head finder's grid and table and the flow graph kept the short run's heads and routes under
  the long run (out of sight there, still in the page);
- the next short run showed them again, another text's tags, statistics and tokens, until its own
  answers came.
Each test holds the finder's and the graph's requests (page.route) where it looks before them."""

from __future__ import annotations

import pytest

from tests.browser.conftest import serving
from tests.browser.test_long_strip import long_text
from tests.browser.test_page import open_page, run, submit

pytestmark = pytest.mark.browser

TEXT = "The cat sat on the mat. The cat sat on"  # 38 tiny-gpt tokens, a character each
OTHER = "A dog ran in the park."  # 22
DENSE_MAX = 64
LONG = long_text(200)  # 200 tokens: over DENSE_MAX, a long run


@pytest.fixture(scope="module")
def base():
    with serving({"tiny-gpt": "tiny-gpt"}, env={"MANYEYES_DENSE_MAX_TOKENS": str(DENSE_MAX)}) as url:
        yield url


SEEN = """() => {
  const shown = (n) => !!n && n.getClientRects().length > 0 && getComputedStyle(n).visibility !== 'hidden';
  const all = (selector) => [...document.querySelectorAll(selector)];
  return {
    panel: shown(document.getElementById('measures')),
    finderRows: all('#finder tbody tr').length, finderRowsShown: all('#finder tbody tr').filter(shown).length,
    finderCells: all('#finder .finder-cell').length, finderCellsShown: all('#finder .finder-cell').filter(shown).length,
    finderRun: document.getElementById('finder').dataset.runId ?? null,
    flow: all('#flow svg').length, flowShown: all('#flow svg').filter(shown).length,
    plot: all('#measure-plot .main-svg').filter(shown).length,
    note: shown(document.getElementById('measures-long-note')),
  };
}"""


def short_run_drawn(page, base, text=TEXT):
    run(page, text, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'] .main-svg", timeout=30_000)
    page.wait_for_selector("#finder tbody tr", timeout=30_000)
    page.wait_for_selector("#flow svg", timeout=30_000)


def long_run(page):
    submit(page, LONG, model="tiny-gpt")
    page.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('Done: 200 tokens')",
                           timeout=60_000)


def holds_heads_or_flow(url: str) -> bool:
    path = url.split("?")[0]
    return "/runs/" in path and (path.endswith("/measures") or path.endswith("/flow"))


def test_a_long_run_keeps_nothing_of_the_last_short_runs_finder_and_graph(base, make_page, artifacts):
    page = make_page(viewport=(1366, 768))
    open_page(page, base)
    short_run_drawn(page, base)
    seen = page.evaluate(SEEN)
    assert seen["finderRowsShown"] == 16 and seen["flowShown"] == 1 and seen["plot"] > 0, seen
    long_run(page)
    page.locator("#measures").scroll_into_view_if_needed()
    seen = page.evaluate(SEEN)
    # The panel says why it is empty; nothing of the 38-token run is on screen or left in the page.
    assert seen["panel"] and seen["note"], seen
    assert seen["finderRowsShown"] == seen["finderCellsShown"] == seen["flowShown"] == seen["plot"] == 0, seen
    assert seen["finderRows"] == seen["finderCells"] == seen["flow"] == 0 and seen["finderRun"] is None, seen
    page.screenshot(path=str(artifacts / "measures-after-long-run.png"), full_page=True)


def test_a_short_run_after_a_long_one_never_shows_the_first_runs_heads(base, make_page, artifacts):
    page = make_page(viewport=(1366, 768))
    open_page(page, base)
    short_run_drawn(page, base)
    first = page.evaluate("() => document.getElementById('finder').dataset.runId")
    long_run(page)
    held = []
    page.route(holds_heads_or_flow, lambda route: held.append(route))
    run(page, OTHER, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('Done: 22 tokens')")
    for _ in range(200):  # the page asks for this run's heads and graph; their answers wait
        if len(held) >= 2:
            break
        page.wait_for_timeout(50)
    assert len(held) >= 2, [r.request.url for r in held]
    seen = page.evaluate(SEEN)
    # The views are back (no long-run note) and hold nothing of the first text until this run's answers.
    assert seen["panel"] and not seen["note"], seen
    assert seen["finderRowsShown"] == seen["finderCellsShown"] == seen["flowShown"] == 0, seen
    assert seen["finderRun"] is None, seen
    page.screenshot(path=str(artifacts / "measures-short-after-long.png"), full_page=True)
    for route in held:
        route.continue_()
    page.unroute(holds_heads_or_flow)
    page.wait_for_selector("#finder tbody tr", timeout=30_000)
    page.wait_for_selector("#flow svg", timeout=30_000)
    now = page.evaluate("() => document.getElementById('finder').dataset.runId")
    assert now and now != first
