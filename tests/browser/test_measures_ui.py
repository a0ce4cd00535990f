"""The measures on the page, in headless Chromium against a real server running tiny-gpt: the head
finder names its known heads and focuses them, the flow graph draws the API's edges and an edge
click focuses its head, the neuron view shows the API's numbers, measures and the word view redraw
the heatmap, and predictions line up under it."""

from __future__ import annotations

import json
import re
import time

import httpx
import numpy as np
import pytest

from tests.browser.conftest import serving
from tests.browser.test_page import (
    api_attention, hover_cell, open_page, plotted, run, wait_focus, wait_grid, wait_plotted_shape, wait_saved,
)
from tests.browser.test_page_ux import label_spacing
from tests.browser.test_strip_and_measures_view import visible

pytestmark = pytest.mark.browser

TEXT = "The cat sat on the mat. The cat sat on"


@pytest.fixture(scope="module")
def tiny_server():
    with serving({"tiny-gpt": "tiny-gpt"}) as base:
        yield base


@pytest.fixture(scope="module")
def tiny_api(tiny_server):
    with httpx.Client(base_url=tiny_server, timeout=60) as client:
        yield client


@pytest.fixture
def ran(page, tiny_server, tiny_api):
    open_page(page, tiny_server)
    run(page, TEXT, model="tiny-gpt")
    page.wait_for_selector("#finder tbody tr", timeout=30_000)
    page.locator("#measures").scroll_into_view_if_needed()  # the panel draws its views once seen
    run_id = page.evaluate("() => document.getElementById('finder').dataset.runId")
    return page, run_id


def flow_edges(api, run_id, threshold) -> list[dict]:
    """The API's edges, as a polite client gets them: one flow graph is computed at a time, and
    the page may be drawing its own right now (429 with Retry-After)."""
    for _ in range(60):
        response = api.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": threshold})
        if response.status_code != 429:
            return response.json()["edges"]
        time.sleep(float(response.headers["retry-after"]) / 4)
    raise AssertionError("the flow route stayed busy")


def row_tags(page, layer, head) -> str:
    return page.locator(f"#finder tr[data-layer='{layer}'][data-head='{head}'] td").first.text_content()


def test_head_finder_names_the_known_heads_and_a_click_focuses(ran, tiny_api, artifacts):
    page, run_id = ran
    assert "previous-token" in row_tags(page, 0, 3)
    assert "induction" in row_tags(page, 1, 0)
    assert "induction" in page.locator(".finder-cell[data-layer='1'][data-head='0']").get_attribute("data-tags")
    api_rows = tiny_api.get(f"/api/v1/runs/{run_id}/measures", params={"names": "heads"}).json()["measures"]["heads"]["rows"]
    assert page.locator("#finder tbody tr").count() == len(api_rows) == 16

    page.select_option("#finder-tag", "induction")
    shown = page.locator("#finder tbody tr")
    inducing = [(r["layer"], r["head"]) for r in api_rows if "induction" in r["tags"]]
    assert [(int(shown.nth(i).get_attribute("data-layer")), int(shown.nth(i).get_attribute("data-head")))
            for i in range(shown.count())] == inducing
    page.select_option("#finder-tag", "")

    page.click("#finder thead button[data-sort='previous']")  # a stat column sorts largest first
    first = page.locator("#finder tbody tr").first
    best = max(api_rows, key=lambda r: r["stats"]["previous"])
    assert (first.get_attribute("data-layer"), first.get_attribute("data-head")) == (str(best["layer"]), str(best["head"]))
    # Sorted from the keyboard, focus stays on the column's button (the header row is drawn anew:
    # it fell to the page's body), and Enter again turns the order round.
    page.focus("#finder thead button[data-sort='previous']")
    page.keyboard.press("Enter")
    assert page.evaluate("() => document.activeElement.dataset.sort") == "previous"
    assert page.get_attribute("#finder thead th:has(button[data-sort='previous'])", "aria-sort") == "ascending"
    page.keyboard.press("Enter")
    assert page.get_attribute("#finder thead th:has(button[data-sort='previous'])", "aria-sort") == "descending"

    page.click("#finder tr[data-layer='1'][data-head='0']")
    wait_focus(page, layer=1, head=0)
    page.wait_for_selector("#neuron[data-layer='1'][data-head='0']")
    assert page.locator("#finder tr.selected").get_attribute("data-head") == "0"
    page.click(".finder-cell[data-layer='0'][data-head='3']")
    wait_focus(page, layer=0, head=3)
    page.locator("#measures").screenshot(path=str(artifacts / "measures-finder.png"))


def test_head_finder_is_one_tab_stop_per_list_with_named_cells(ran):
    """72 grid cells named "B" or "·" and 72 focusable rows once stood between the finder and the rest
    of the page: each list is now one Tab stop, walked with the arrows, and each cell says its head."""
    page, _ = ran
    cells = page.locator(".finder-cell")
    assert cells.count() == 16 and page.locator(".finder-cell[tabindex='0']").count() == 1
    assert page.locator("#finder tbody tr[tabindex='0']").count() == 1
    label = page.locator(".finder-cell[data-layer='1'][data-head='0']").get_attribute("aria-label")
    assert label.startswith("Layer 1 head 0: ") and "induction" in label
    page.focus(".finder-cell[tabindex='0']")
    page.keyboard.press("ArrowDown")  # a layer down, in a grid 8 heads wide
    page.keyboard.press("ArrowRight")
    focused = page.evaluate("() => [document.activeElement.dataset.layer, document.activeElement.dataset.head]")
    assert focused == ["1", "1"]
    assert page.locator("#focus-plot").get_attribute("data-head") == "0"  # the arrows moved within the finder only
    page.keyboard.press("Enter")
    wait_focus(page, layer=1, head=1)
    assert page.locator(".finder-cell[tabindex='0']").get_attribute("aria-pressed") == "true"
    assert page.locator("#finder tbody tr[tabindex='0']").get_attribute("aria-current") == "true"
    # At an edge the arrows keep focus where it is; Home and End go to the ends.
    page.keyboard.press("ArrowDown")  # L1 is the last layer
    assert page.evaluate("() => document.activeElement.dataset.head") == "1"
    page.keyboard.press("End")
    assert page.evaluate("() => [document.activeElement.dataset.layer, document.activeElement.dataset.head]") == ["1", "7"]
    page.keyboard.press("Home")
    assert page.evaluate("() => [document.activeElement.dataset.layer, document.activeElement.dataset.head]") == ["0", "0"]
    # The table: ↓ walks the rows, Space picks one.
    page.focus("#finder tbody tr[tabindex='0']")
    page.keyboard.press("ArrowDown")
    page.keyboard.press(" ")
    wait_focus(page, layer=1, head=2)
    # The focused row's ring lies inside the row, picked or not: the table's scroll box clipped a
    # ring drawn outside the first and last rows.
    ring = """() => { const s = getComputedStyle(document.activeElement);
        return [document.activeElement.tagName, document.activeElement.matches(':focus-visible'),
                parseFloat(s.outlineWidth), parseFloat(s.outlineOffset)]; }"""
    for press in ("", "ArrowDown"):  # the picked row, then the next
        if press:
            page.keyboard.press(press)
        tag, visible, width, offset = page.evaluate(ring)
        assert (tag, visible) == ("TR", True) and width >= 2 and width + offset <= 0, (press, width, offset)


def test_flow_graph_draws_the_api_edges_and_an_edge_click_focuses_its_head(ran, tiny_api, artifacts):
    page, run_id = ran
    page.wait_for_selector("#flow line.flow-edge", state="attached")
    threshold = float(page.locator("#flow").get_attribute("data-threshold"))
    edges = flow_edges(tiny_api, run_id, threshold)
    assert page.locator("#flow line.flow-edge").count() == len(edges)
    # the heaviest slanted layer-1 head edge, clicked like a person would
    target = max((e for e in edges if e["head"] is not None and e["layer"] == 1 and e["source"] != e["target"]),
                 key=lambda e: e["weight"])
    line = page.locator(f"#flow line[data-layer='1'][data-source='{target['source']}'][data-target='{target['target']}']"
                        f"[data-head='{target['head']}']")
    line.click()
    wait_focus(page, layer=1, head=target["head"])
    assert "focused" in line.get_attribute("class")
    # The strongest head routes as a list of buttons: the graph's words, and its keyboard way in.
    strongest = sorted((e for e in edges if e["head"] is not None), key=lambda e: -e["weight"])[:20]
    routes = page.locator("#flow .flow-route")
    assert routes.count() == len(strongest)
    assert [(int(r.get_attribute("data-layer")), int(r.get_attribute("data-head"))) for r in routes.all()] == \
        [(e["layer"], e["head"]) for e in strongest]
    assert routes.first.text_content().endswith(f"{strongest[0]['weight'] * 100:.1f}% via layer {strongest[0]['layer']} head {strongest[0]['head']}")
    # With the positions of its tokens, so that a repeated token's routes are told apart.
    assert f"(#{strongest[0]['source']}) → " in routes.first.text_content()
    assert routes.first.text_content().split(": ")[0].endswith(f"(#{strongest[0]['target']})")
    assert page.locator("#flow .flow-legend").text_content().startswith("Red: a head's route")
    page.click("#flow .flow-routes summary")
    other = next(i for i, e in enumerate(strongest) if (e["layer"], e["head"]) != (1, target["head"]))
    routes.nth(other).focus()
    page.keyboard.press("Enter")
    wait_focus(page, layer=strongest[other]["layer"], head=strongest[other]["head"])
    # The list stays open, with focus on the route used, which is marked as the focused head's.
    assert page.locator("#flow .flow-routes").get_attribute("open") is not None
    assert page.evaluate("() => document.activeElement.classList.contains('flow-route')")
    assert routes.nth(other).get_attribute("aria-current") == "true"
    # a higher threshold prunes edges, and the drawing follows
    page.fill("#flow-threshold", "0.4")  # a range input: fill fires input and change
    page.wait_for_selector("#flow[data-threshold='0.4']", state="attached")
    fewer = flow_edges(tiny_api, run_id, 0.4)
    assert page.locator("#flow line.flow-edge").count() == len(fewer) < len(edges)
    page.locator("#flow").screenshot(path=str(artifacts / "measures-flow.png"))


def wait_held(page, held: list) -> None:
    """Until a route that holds its requests (appends them to `held`) has one (up to 5 s)."""
    for _ in range(100):
        if held:
            return
        page.wait_for_timeout(50)


def test_an_older_thresholds_flow_graph_come_last_is_not_drawn(ran, tiny_api):
    """Only the wait to ask again was aborted, not the request: 0.05's graph, come after 0.3's,
    was drawn under a slider that read 0.3 (612 elements for 282)."""
    page, run_id = ran
    page.wait_for_selector("#flow[data-threshold]", state="attached")
    held = []
    page.route(re.compile(r".*/flow\?threshold=0\.05$"), lambda route: held.append(route))
    page.fill("#flow-threshold", "0.05")
    wait_held(page, held)
    assert held
    page.fill("#flow-threshold", "0.3")
    page.wait_for_selector("#flow[data-threshold='0.3']", state="attached")
    with page.expect_response(lambda r: "threshold=0.05" in r.url):
        held[0].continue_()
    page.wait_for_timeout(500)  # the older answer is here: time for it to be drawn, as it was
    assert page.get_attribute("#flow", "data-threshold") == "0.3"
    assert page.locator("#flow line.flow-edge").count() == len(flow_edges(tiny_api, run_id, 0.3))
    page.unroute(re.compile(r".*/flow\?threshold=0\.05$"))


def test_a_newline_tokens_original_characters_read_as_a_mark_on_one_line(page, tiny_server, tiny_api):
    """The hover's second line quoted the raw "\n": the tooltip (pre-wrap) broke it over three
    lines, “ on one, ” → “ on the next."""
    text = "line one\nline two"
    open_page(page, tiny_server)
    run(page, text, model="tiny-gpt")
    tokens, _ = api_attention(tiny_api, text, model="tiny-gpt", layers=[0], heads=[0])
    newline = next(i for i, t in enumerate(tokens) if t["text"] == "\n")
    hover_cell(page, newline, newline)
    assert page.locator("#tooltip").text_content().split("\n")[1] == "“↵” → “↵”"  # then the predictions
    before = next(i for i, t in enumerate(tokens) if t["text"].startswith(" "))
    hover_cell(page, before, before)  # a plain space stays a space inside the quotes
    assert page.locator("#tooltip").text_content().split("\n")[1] == f"“{tokens[before]['text']}” → “{tokens[before]['text']}”"


@pytest.mark.parametrize("quantised", [False, True], ids=["float32-runs", "runs-kept-quantised"])
def test_a_server_with_a_lower_json_budget_is_read_in_float16_not_refused(page, quantised):
    """MANYEYES_MAX_JSON_CELLS under a run's T x T: the page asked float32 anyway, got 413 and said
    the view "could not be loaded (see above)" over an error that was gone (review h57g). A run kept
    quantised (a GPU server's) is posted again for a cell's ranking: in float16 (review h57h)."""
    refused, cells = [], []
    page.on("response", lambda r: refused.append(r.url) if r.status == 413 else None)
    page.on("response", lambda r: cells.append(r.url) if "/cell?" in r.url else None)
    env = {"MANYEYES_MAX_JSON_CELLS": "100", **({"MANYEYES_DEVICE_QUANTISE": "true"} if quantised else {})}
    with serving({"tiny-gpt": "tiny-gpt"}, env) as base:
        open_page(page, base)
        run(page, TEXT, model="tiny-gpt")  # 38 tokens: 1,444 weights a head
        page.check("#hide-first")  # renormalised: read from the server's exact values
        page.wait_for_function("() => document.getElementById('focus-caption').textContent.includes('hidden')"
                               " || !document.getElementById('focus-plot').hasAttribute('data-stale')", timeout=30_000)
        hover_cell(page, 5, 3, 6, 4)
        page.mouse.down()  # the cell's ranking: 16 heads, within the budget
        page.mouse.up()
        page.wait_for_selector("#cell-heads:not([hidden]) .cell-heads-list button")
        # The ranking's own values came (16 heads: float32 from a float32 run, float16 from one kept
        # quantised), not a 413 that left it on the run's 8-bit values.
        page.wait_for_function("() => [...document.querySelectorAll('#cell-heads .cell-heads-list button')]"
                               ".every((b) => b.dataset.exact === 'true')", timeout=30_000)
        assert len(cells) == 1 and f"format={'f16' if quantised else 'json'}" in cells[0], cells
        page.locator("#measures").scroll_into_view_if_needed()
        page.select_option("#measure", "raw")
        page.wait_for_selector("#measure-plot[data-measure='raw']", timeout=30_000)
        assert refused == [] and page.locator("#error").is_hidden()
        assert "could not be loaded" not in page.text_content("#focus-caption")


def flow_fit(page) -> dict:
    return page.evaluate("""() => {
        const panel = document.getElementById('flow');
        const drawing = panel.querySelector(':scope > svg');
        return { panel: panel.clientWidth, drawing: drawing.getBoundingClientRect().width,
                 labels: drawing.querySelectorAll('text.flow-token').length };
    }""")


def test_a_busy_flow_graph_is_asked_again_after_its_wait_and_can_be_asked_by_hand(page, tiny_server):
    """One flow graph is made at a time on the whole server: a short run's graph (drawn by itself,
    with no button) that got a 429 stayed "Try again in 1 s" with nothing to press (a classroom)."""
    asked = []

    def busy_once(route):
        asked.append(route.request.url)
        if len(asked) == 1:
            route.fulfill(status=429, content_type="application/json", headers={"Retry-After": "1"},
                          body=json.dumps({"error": {"code": "queue_full", "message": "one flow graph is made at a time"}}))
        else:
            route.continue_()

    page.route("**/flow?*", busy_once)
    open_page(page, tiny_server)
    run(page, TEXT, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_function("() => document.getElementById('flow-status').textContent.startsWith("
                           "'The server is busy: asking again in ')")
    assert page.locator("#flow-draw").is_visible()
    page.wait_for_selector("#flow[data-threshold]", timeout=30_000)  # asked again by itself, and drawn
    assert len(asked) == 2 and page.text_content("#flow-status") == ""
    assert page.locator("#flow .flow-route").count() > 0
    assert page.locator("#flow-draw").is_hidden()  # a short run's graph needs no button once drawn


def test_flow_graph_fits_its_panel_and_follows_its_width(page, tiny_server):
    """A graph of 14 tokens was drawn 896 px wide whatever its panel, and cut off in a narrower one."""
    open_page(page, tiny_server)
    run(page, "A cat sat here", model="tiny-gpt")  # 14 tokens: tiny-gpt's are characters
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#flow > svg", state="attached", timeout=30_000)
    wide = flow_fit(page)
    assert wide["labels"] == 14 and wide["drawing"] <= wide["panel"], wide
    # One column of panels at 1000 px (wider than two at 1440), a narrow one at 640: the graph
    # follows, filling its panel up to 60 px a token (896 px for 14).
    for width in (1000, 640):
        page.set_viewport_size({"width": width, "height": 900})
        page.wait_for_function("""() => {
            const panel = document.getElementById('flow').clientWidth;
            const drawing = document.querySelector('#flow > svg').getBoundingClientRect().width;
            return drawing <= panel && drawing >= Math.min(panel, 896) - 2;
        }""", timeout=10_000)
    assert flow_fit(page)["panel"] < wide["panel"]


def test_neuron_view_shows_the_apis_numbers(ran, tiny_api, artifacts):
    page, run_id = ran
    page.click("#finder tr[data-layer='1'][data-head='0']")
    page.select_option("#neuron-query", "12")
    page.wait_for_selector("#neuron[data-layer='1'][data-head='0'][data-query='12']")
    view = tiny_api.get(f"/api/v1/runs/{run_id}/neuron", params={"layer": 1, "head": 0, "query": 12}).json()
    scores = page.locator("#neuron-table td.score").all_text_contents()
    weights = page.locator("#neuron-table td.weight").all_text_contents()
    assert len(scores) == len(view["scores"]) == len(weights)
    for shown, want in zip(scores, view["scores"]):
        assert shown == "masked" if want is None else abs(float(shown) - want) <= 5e-5
    for shown, want in zip(weights, view["weights"]):
        assert abs(float(shown) - want) <= 5e-5
    assert "own keys and values" in page.locator("#neuron-note").text_content()
    # Both tables are named for a screen reader (an unnamed table of numbers was announced as such).
    assert page.get_by_role("table", name="Each key's vector, score, weight and value for the chosen query").count() == 1
    assert page.get_by_role("table", name="Every head's statistics and tags; a column's heading sorts by it").count() == 1
    page.locator("#neuron").screenshot(path=str(artifacts / "measures-neuron.png"))


def attribution_shown(page) -> tuple[dict, list[float]]:
    heads = page.evaluate("""() => [...document.querySelectorAll('#attribution button[data-head]')]
        .map((b) => [Number(b.dataset.layer), Number(b.dataset.head), Number(b.dataset.value)])""")
    mlps = page.evaluate("() => [...document.querySelectorAll('#attribution .attribution-mlp')].map((m) => Number(m.dataset.value))")
    return {(layer, head): value for layer, head, value in heads}, mlps


def test_why_this_guess_draws_the_apis_logit_attribution_and_a_click_focuses(ran, tiny_api, artifacts):
    """Direct logit attribution was in the API and the client only: the page had no way to ask
    which heads push a guess up or down."""
    page, run_id = ran
    page.wait_for_selector("#attribution[data-position]", timeout=30_000)
    n_tokens = page.locator("#attribution-position option").count()
    assert page.get_attribute("#attribution", "data-position") == str(n_tokens - 1)  # the last token's guess first
    want = tiny_api.get(f"/api/v1/runs/{run_id}/logit-attribution", params={"position": n_tokens - 1, "top": 16}).json()
    assert page.get_attribute("#attribution", "data-target") == str(want["target"])
    heads, mlps = attribution_shown(page)
    assert heads == {(h["layer"], h["head"]): h["contribution"] for h in want["heads"]} and len(heads) == 16
    assert mlps == want["mlps"]
    assert f"{want['logit']:.3f}" in page.text_content("#attribution-sum")
    strongest = max(want["heads"], key=lambda h: abs(h["contribution"]))
    cell = page.locator(f"#attribution button[data-layer='{strongest['layer']}'][data-head='{strongest['head']}']")
    assert cell.text_content() == f"{'+' if strongest['contribution'] > 0 else '−'}{abs(strongest['contribution']):.2f}"
    # A push under 0.005 has a third decimal: "0.00" read as no push for -0.0016.
    shown = page.evaluate("""() => [...document.querySelectorAll('#attribution button[data-head]')]
        .map((b) => [Number(b.dataset.value), b.textContent])""")
    assert any(abs(value) < 0.005 for value, _ in shown)
    for value, text in shown:
        digits = 3 if abs(value) < 0.005 else 2
        assert text == (f"{abs(value):.{digits}f}" if round(abs(value), digits) == 0
                        else f"{'+' if value > 0 else '−'}{abs(value):.{digits}f}"), (value, text)
    # One Tab stop for the grid, as the finder's.
    assert page.locator("#attribution button[tabindex='0']").count() == 1

    # Another position offers its own guesses; the second of them is split as the API splits it.
    body = tiny_api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "u8", "predictions": {"top_k": 5}}).json()
    top = body["predictions"]["5"]
    page.select_option("#attribution-position", "5")
    # Its own top guess, not the last position's guess asked for at this one.
    page.wait_for_selector(f"#attribution[data-position='5'][data-target='{top[0]['id']}']", timeout=30_000)
    offered = page.locator("#attribution-target option")
    # The top 5, and the text's own next token where the model did not guess it.
    following = body["tokens"][6]["id"]
    want_ids = [p["id"] for p in top] + ([] if following in [p["id"] for p in top] else [following])
    assert [offered.nth(i).get_attribute("value") for i in range(offered.count())] == [str(i) for i in want_ids]
    assert "the text's next token" in offered.nth(want_ids.index(following)).text_content()
    page.select_option("#attribution-target", str(top[1]["id"]))
    page.wait_for_selector(f"#attribution[data-target='{top[1]['id']}']", timeout=30_000)
    want = tiny_api.get(f"/api/v1/runs/{run_id}/logit-attribution",
                        params={"position": 5, "target": top[1]["id"], "top": 16}).json()
    heads, mlps = attribution_shown(page)
    assert heads == {(h["layer"], h["head"]): h["contribution"] for h in want["heads"]} and mlps == want["mlps"]

    page.click("#attribution button[data-layer='1'][data-head='0']")
    wait_focus(page, layer=1, head=0)
    assert page.get_attribute("#attribution button[data-layer='1'][data-head='0']", "aria-pressed") == "true"
    page.locator("#attribution").locator("xpath=..").screenshot(path=str(artifacts / "measures-attribution.png"))


def test_a_link_keeps_the_guess_explained(ran, tiny_api):
    """The position and guess of "Why this guess?" were not in the permalink: a reload or a shared
    link went back to the last token's top guess."""
    page, run_id = ran
    page.wait_for_selector("#attribution[data-position]", timeout=30_000)
    page.select_option("#attribution-position", "5")
    page.wait_for_selector("#attribution[data-position='5']", timeout=30_000)
    second = page.locator("#attribution-target option").nth(1).get_attribute("value")
    page.select_option("#attribution-target", second)
    page.wait_for_selector(f"#attribution[data-target='{second}']", timeout=30_000)
    wait_saved(page)
    view = page.evaluate("() => document.body.dataset.view")
    saved = tiny_api.get(f"/api/v1/views/{view}").json()
    assert (saved["guess_position"], saved["guess_target"]) == (5, int(second))
    page.reload()
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector(f"#attribution[data-position='5'][data-target='{second}']", timeout=30_000)
    assert page.input_value("#attribution-target") == second
    wait_saved(page)  # the restored view is saved as it was, the guess with it
    assert page.evaluate("() => document.body.dataset.view") == view


def test_a_new_runs_link_holds_no_guess_of_the_run_before(ran, tiny_api):
    """The link saved with a run held the last run's position (30 in a 9-token run), and the same
    view came back under another id once the panel had clamped it (review h50d)."""
    page, _ = ran
    page.wait_for_selector("#attribution[data-position]", timeout=30_000)
    page.select_option("#attribution-position", "30")
    page.wait_for_selector("#attribution[data-position='30']", timeout=30_000)
    wait_saved(page)
    run(page, "Hi there.", model="tiny-gpt")
    wait_saved(page)
    view = page.evaluate("() => document.body.dataset.view")
    saved = tiny_api.get(f"/api/v1/views/{view}").json()
    assert saved["text"] == "Hi there." and saved["guess_position"] in (None, 8), saved
    page.reload()
    page.wait_for_selector("#finder tbody tr", timeout=30_000)
    wait_saved(page)
    assert page.evaluate("() => document.body.dataset.view") == view  # one view, one link


def test_why_this_guess_says_a_bidirectional_model_has_no_next_token_to_explain(page, server):
    open_page(page, server)
    run(page, "The bank of the river.")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_function("() => document.getElementById('attribution-sum').textContent.includes('reads both ways')", timeout=30_000)
    assert page.locator("#attribution-position").is_hidden()
    assert page.locator("#attribution button").count() == 0


def test_measures_redraw_the_heatmap_and_predictions_line_up(ran, tiny_api, artifacts):
    page, run_id = ran
    page.wait_for_selector("#measure-plot[data-measure='raw']")
    page.select_option("#measure", "rollout")
    page.wait_for_selector("#measure-plot[data-measure='rollout']")
    z = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
    want = tiny_api.get(f"/api/v1/runs/{run_id}/measures", params={"names": "rollout"}).json()["measures"]["rollout"]["data"]
    assert max(abs(a - b) for zr, wr in zip(z, want) for a, b in zip(zr, wr)) < 1e-6
    page.check("#word-view")
    page.wait_for_selector("#measure-plot[data-words='true']")
    words = tiny_api.get(f"/api/v1/runs/{run_id}/measures", params={"names": "words", "layers": "0", "heads": "0"}).json()
    n_words = len(words["measures"]["words"]["words"])
    z = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
    assert len(z) == n_words < len(want)
    assert all(abs(sum(row) - 1) < 1e-5 for row in z)  # rollout rows stay distributions over words
    page.select_option("#measure", "contributions")
    page.wait_for_selector("#measure-plot[data-measure='contributions']")

    body = tiny_api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "u8",
                                                    "predictions": {"top_k": 5}}).json()
    page.wait_for_selector("#predictions .pred")
    cells = page.locator("#predictions .pred")
    assert cells.count() == len(body["tokens"])
    for i in (0, 5, len(body["tokens"]) - 1):
        top = body["predictions"][str(i)][0]
        # The real token (tiny-gpt's last guess is " "), its spaces written as the labels write them (␣).
        guess = cells.nth(i).locator(".pred-guess")
        assert guess.get_attribute("data-token") == top["token"] and guess.text_content() == visible(top["token"])
        assert f"{top['prob'] * 100:.1f}%" in cells.nth(i).get_attribute("title")
    page.locator("#measures").screenshot(path=str(artifacts / "measures-contributions.png"))


def test_predictions_beside_the_focused_heatmap_on_hover_and_in_a_strip(ran, tiny_api, artifacts):
    page, run_id = ran
    body = tiny_api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "u8",
                                                    "predictions": {"top_k": 5}}).json()
    n = len(body["tokens"])
    page.locator("#focus-plot").scroll_into_view_if_needed()  # `ran` left the measures panel in view
    page.wait_for_selector("#focus-predictions .pred")
    cells = page.locator("#focus-predictions .pred")
    assert cells.count() == n
    for i in (0, 5, n - 1):
        top = body["predictions"][str(i)][0]
        # The real token (tiny-gpt's last guess is " "), its spaces written as the labels write them (␣).
        guess = cells.nth(i).locator(".pred-guess")
        assert guess.get_attribute("data-token") == top["token"] and guess.text_content() == visible(top["token"])
        assert f"{top['prob'] * 100:.1f}%" in cells.nth(i).get_attribute("title")
        # A screen reader hears each token's guesses as one list item, not token and guess run together.
        assert cells.nth(i).get_attribute("aria-label") == cells.nth(i).get_attribute("title")
        assert cells.nth(i).get_attribute("role") == "listitem"
    assert page.locator("#focus-predictions [role=list] > .pred").count() == n
    for row, col in ((3, 1), (n - 1, 2)):
        hover_cell(page, row, col)
        text = page.locator("#tooltip").text_content()
        reading, *_, line = text.split("\n")
        assert "→" in reading  # focus.js's own reading stays first
        assert line.startswith("next after"), text
        for guess in body["predictions"][str(row)]:
            assert f"{visible(guess['token'])} {guess['prob'] * 100:.1f}%" in line
    # Another row's reading never keeps this row's predictions: one line per hover, not appended twice.
    hover_cell(page, 4, 0)
    text = page.locator("#tooltip").text_content()
    assert text.count("next after") == 1 and f"{visible(body['predictions']['4'][0]['token'])} " in text
    page.locator(".focus-panel").screenshot(path=str(artifacts / "focus-predictions.png"))


def measure_pixels(page, cells) -> tuple[list, list[list[int]], tuple[int, int]]:
    """What the measure plot shows: its values, the RGB painted for each (row, col) of `cells`, and
    the image's (width, height)."""
    return page.evaluate("""async (cells) => {
        const plot = document.getElementById('measure-plot');
        const image = new Image();
        image.src = plot.layout.images[0].source;
        await image.decode();
        const canvas = document.createElement('canvas');
        canvas.width = image.width; canvas.height = image.height;
        const ctx = canvas.getContext('2d');
        ctx.drawImage(image, 0, 0);
        const rgb = ([i, j]) => [...ctx.getImageData(j, i, 1, 1).data.slice(0, 3)];
        return [plot.measured.matrix, cells.map(rgb), [image.width, image.height]];
    }""", cells)


def test_a_causal_models_measure_draws_later_keys_masked(ran):
    """Keys after their query are masked, as the focused heatmap draws them, not a weight of 0;
    the values (what hover and exports read) stay the numbers."""
    page, _ = ran
    for kind in ("raw", "rollout"):
        page.select_option("#measure", kind)
        page.wait_for_selector(f"#measure-plot[data-measure='{kind}']")
        n = page.evaluate("() => document.getElementById('measure-plot').measured.matrix.length")
        matrix, (above, next_key, lower_left), _ = measure_pixels(page, [(0, n - 1), (0, 1), (n - 1, 0)])
        assert above == next_key == [0xD6, 0xD2, 0xCB], kind  # the light theme's masked colour
        assert lower_left != above and matrix[0][n - 1] == 0, kind


def test_the_measure_heatmap_reads_cell_by_cell_from_the_keyboard(ran, artifacts):
    """No hover needed: arrows on the focused measure heatmap walk a cell cursor, outline the
    cell and read "query → key: value" out through a polite live region; masked cells say so."""
    page, _ = ran
    page.wait_for_selector("#measure-plot[data-measure='raw']")
    matrix = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
    page.focus("#measure-plot")
    scrolled = page.evaluate("() => window.scrollY")
    spoken = page.locator("#measure-cell-reading")
    assert spoken.get_attribute("aria-live") == "polite"
    page.keyboard.press("ArrowDown")  # lands on the top-left cell
    for key in ("ArrowDown", "ArrowDown", "ArrowRight"):
        page.keyboard.press(key)
    line = page.locator("#measure-reading")
    assert (line.get_attribute("data-row"), line.get_attribute("data-col")) == ("2", "1")
    assert spoken.text_content() == line.text_content()
    assert f": {matrix[2][1]:.4f}" in spoken.text_content()
    assert page.locator("#measure-plot .cell-cursor").is_visible()
    assert page.evaluate("() => window.scrollY") == scrolled  # the arrows read cells, they did not scroll
    page.locator("#measures").screenshot(path=str(artifacts / "measures-keyboard.png"))
    # A causal model: the key after the query is masked, and is read so, not as 0.
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert line.get_attribute("data-col") == "3" and ": masked" in spoken.text_content()
    # A zoom keeps the outline on its cell (placed again inside what is now in view).
    centres = """() => {
        const plot = document.getElementById('measure-plot');
        const r = plot.querySelector('.cell-cursor').getBoundingClientRect();
        const xa = plot._fullLayout.xaxis, ya = plot._fullLayout.yaxis, box = plot.getBoundingClientRect();
        const line = document.getElementById('measure-reading').dataset;
        return [[r.left + r.width / 2, r.top + r.height / 2],
                [box.left + xa._offset + xa.l2p(Number(line.col)), box.top + ya._offset + ya.l2p(Number(line.row))]];
    }"""
    page.evaluate("() => Plotly.relayout('measure-plot', {'xaxis.range': [0.5, 6.5], 'yaxis.range': [6.5, 0.5]})")
    outline, cell = page.evaluate(centres)
    assert abs(outline[0] - cell[0]) <= 1 and abs(outline[1] - cell[1]) <= 1
    # Another measure: the old reading is neither shown nor spoken.
    page.select_option("#measure", "rollout")
    page.wait_for_selector("#measure-plot[data-measure='rollout']")
    assert spoken.text_content() == "" and line.get_attribute("data-row") is None
    assert line.text_content().startswith("Hover a cell")
    # Leaving the heatmap drops the cursor.
    page.focus("#measure-plot")
    page.keyboard.press("ArrowDown")
    assert page.locator("#measure-plot .cell-cursor").is_visible()
    page.locator("#measure-plot").blur()
    assert not page.locator("#measure-plot .cell-cursor").is_visible() and spoken.text_content() == ""
    # An arrow on a modebar button inside the plot is the button's own: no cursor comes.
    page.evaluate("""() => document.querySelector('#measure-plot .modebar-btn').dispatchEvent(
        new KeyboardEvent('keydown', {key: 'ArrowDown', bubbles: true}))""")
    assert not page.locator("#measure-plot .cell-cursor").is_visible() and spoken.text_content() == ""


def test_a_measure_answered_after_the_focus_moved_is_labelled_with_its_own_layer(ran):
    """The focus moves on while a measure is on its way (off screen, the panel only notes that it
    is stale): what arrives is drawn as the head it was asked for, not as the new one."""
    page, _ = ran
    page.wait_for_selector("#measure-plot[data-measure='raw'][data-layer='0']")
    held = []
    page.route(re.compile(r".*/measures\?names=value_norms.*"), lambda route: held.append(route))
    page.select_option("#measure", "value_norms")
    wait_held(page, held)
    assert held and "layers=0" in held[0].request.url
    page.evaluate("() => window.scrollTo(0, 0)")
    page.select_option("#layer", "1")
    page.wait_for_selector("#focus-plot[data-layer='1']")
    held[0].continue_()
    page.wait_for_selector("#measure-plot[data-measure='value_norms']")
    plot = page.locator("#measure-plot")
    assert plot.get_attribute("data-layer") == "0"
    assert "layer 0 head 0" in page.evaluate("() => document.getElementById('measure-plot').layout.title.text")
    page.unroute(re.compile(r".*/measures\?names=value_norms.*"))


def test_measures_use_the_focused_heatmaps_colours(ran, artifacts):
    page, _ = ran
    page.wait_for_selector("#measure-plot[data-measure='raw']")
    colours = page.evaluate("""() => [document.getElementById('measure-plot').data[0].colorscale,
                                      document.getElementById('focus-plot').data[0].colorscale]""")
    assert colours[0] == colours[1]
    page.select_option("#measure", "contributions")
    page.wait_for_selector("#measure-plot[data-measure='contributions']")
    signed = page.evaluate("() => document.getElementById('measure-plot').data[0].colorscale")
    darkest = colours[1][-1][1].lstrip("#")
    assert signed[-1][1] == "rgb({},{},{})".format(*(int(darkest[k:k + 2], 16) for k in (0, 2, 4)))
    assert signed[0][1] != signed[-1][1]  # negative and positive shares read apart
    # The painted cells read as the colorbar does: the largest share in the positive end's colour,
    # the most negative one towards red.
    matrix = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
    cells = [(i, j) for i, row in enumerate(matrix) for j in range(len(row))]
    top = max(cells, key=lambda c: matrix[c[0]][c[1]])
    low = min(cells, key=lambda c: matrix[c[0]][c[1]])
    _, (top_rgb, low_rgb), size = measure_pixels(page, [top, low])
    assert size == [len(matrix[0]), len(matrix)]  # one pixel per cell
    assert "rgb({},{},{})".format(*top_rgb) == signed[-1][1] and matrix[top[0]][top[1]] > 0
    assert matrix[low[0]][low[1]] < 0 and low_rgb[0] > low_rgb[2], low_rgb  # the most negative share: red side
    page.locator("#measure-plot").screenshot(path=str(artifacts / "measures-signed-colours.png"))


def test_measure_labels_are_thinned_and_a_zoom_labels_every_token_in_view(page, tiny_server):
    """A label per token made Plotly measure each one (0.7 s of main thread at T=128, 16 s at
    T=512): the measure heatmap labels as the focused one does, thinned to ≤ 64, all once zoomed."""
    open_page(page, tiny_server)
    text = "abcdefghij" * 10  # tiny-gpt is byte-level: 100 tokens
    run(page, text, model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw']", timeout=30_000)
    # The page's own labels (axis_labels.js), each token's text, over bare Plotly axes.
    labels = """() => ['xtick', 'ytick'].map((axis) => [...document.querySelectorAll(`#measure-plot .axis-labels .${axis}`)]
                      .filter((g) => g.style.display !== 'none').map((g) => g.textContent))"""
    x, y = page.evaluate(labels)
    # Thinned, the labels are positions (focus.js's ticks), every k-th from 0, k a round number.
    step = int(x[1])
    assert step in (2, 5, 10) and x == y == [str(i) for i in range(0, 100, step)], x
    assert page.evaluate("() => document.getElementById('measure-plot').layout.xaxis.showticklabels") is False
    page.evaluate("() => Plotly.relayout(document.getElementById('measure-plot'), {'xaxis.range': [9.5, 30.5], 'yaxis.range': [30.5, 9.5]})")
    page.wait_for_function("() => document.querySelectorAll('#measure-plot .axis-labels .xtick').length === 21")
    x, y = page.evaluate(labels)
    assert x == y == list(text[10:31])
    # Hovering a cell reads it in the line under the plot (no Plotly hover text per cell).
    page.locator("#measure-plot").scroll_into_view_if_needed()
    point = page.evaluate(
        """() => {
            const gd = document.getElementById('measure-plot');
            const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
            return [box.left + gd._fullLayout.xaxis.l2p(12), box.top + gd._fullLayout.yaxis.l2p(20)];
        }"""
    )
    page.mouse.move(point[0] - 20, point[1] - 20)
    page.mouse.move(*point, steps=3)
    reading = page.locator("#measure-reading[data-row='20'][data-col='12']")
    reading.wait_for()
    z = page.evaluate("() => document.getElementById('measure-plot').measured.matrix[20][12]")
    assert reading.text_content().startswith(f"#20 {text[20]} → #12 {text[12]}: {z:.4f}"), reading.text_content()


def test_hiding_the_only_token_says_so_and_unticking_brings_it_back(page, tiny_server):
    """tiny-gpt's `a` is one token and no special one: "Hide first token" leaves none. The grid threw
    building a 0-wide image and the focus drew a grey box captioned "0 × 0 of 1 tokens shown"."""
    open_page(page, tiny_server)
    run(page, "a", model="tiny-gpt")
    wait_grid(page)
    page.check("#hide-first")
    said = "No token is left to show: untick “Hide first token” to see them."
    page.locator("#focus-plot .plot-empty").wait_for(state="visible")
    assert page.locator("#focus-plot .plot-empty").text_content() == said
    assert page.locator("#focus-caption").text_content() == said
    assert page.locator("#focus-plot canvas.heatmap-canvas").count() == 0
    page.wait_for_function("() => document.getElementById('grid').nextElementSibling.matches('p.empty:not([hidden])')")
    assert page.locator("#headview").text_content() == said
    page.uncheck("#hide-first")
    wait_plotted_shape(page, 1, 1)
    page.wait_for_function("() => document.getElementById('grid').nextElementSibling.hidden")
    assert page.locator("#focus-plot .plot-empty").is_hidden()
    assert page.locator("#focus-caption").text_content().startswith("1 token · model tiny-gpt")
    page.wait_for_selector("#headview .hv-left li")
    # The make_page fixture holds the page to a clean console: no uncaught ImageData error.


def test_the_predictions_strip_goes_with_the_heatmap_while_every_token_is_hidden(page, tiny_server):
    """With every token hidden the heatmap gave way to "No token is left to show", and the strip of
    every token's guess stayed under that line."""
    open_page(page, tiny_server)
    run(page, "a", model="tiny-gpt")
    strip = page.locator("#focus-predictions")
    page.wait_for_selector("#focus-predictions .pred")
    assert strip.is_visible()
    page.check("#hide-first")
    page.locator("#focus-plot .plot-empty").wait_for(state="visible")
    assert strip.is_hidden()
    page.uncheck("#hide-first")
    wait_plotted_shape(page, 1, 1)
    strip.wait_for(state="visible")
    assert strip.locator(".pred-token").all_text_contents() == ["a"]


def measures_at(make_page, base, width, height=900):
    page = make_page(viewport=(width, height))
    open_page(page, base)
    run(page, TEXT, model="tiny-gpt")
    page.wait_for_selector("#finder tbody tr", timeout=30_000)
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw']", timeout=30_000)
    return page


def test_measure_labels_fit_a_phones_axes(make_page, tiny_server, artifacts):
    """The measure's labels were every token at 10 px whatever the axis: at 400 px wide the 38 keys
    stood 5.7 px apart and printed over one another."""
    page = measures_at(make_page, tiny_server, 400, 800)
    page.wait_for_function("() => document.querySelectorAll('#measure-plot .axis-labels .xtick').length > 0")
    gap, font = label_spacing(page, "#measure-plot", "x")
    assert gap * 0.5 ** 0.5 >= font, (gap, font)  # at -45°, neighbours stand √½ of their gap apart across the slant
    gap, font = label_spacing(page, "#measure-plot", "y")
    assert gap >= font, (gap, font)
    # The title, which names the layer and head, sits under the modebar (a phone has no hover to
    # hide it): it was drawn over it, "layer 0 head 0" under its buttons.
    title, modebar = (page.locator(f"#measure-plot {part}").bounding_box() for part in (".gtitle", ".modebar"))
    assert title["y"] >= modebar["y"] + modebar["height"] - 1, (title, modebar)
    page.locator("#measure-plot").screenshot(path=str(artifacts / "measure-labels-400.png"))


def test_the_measures_grid_gives_each_view_its_width_at_1280(make_page, tiny_server, artifacts):
    """Three columns of 383 px at 1280 px wide cut the head finder's table (544 px) and the neuron
    view's (411 px) off behind scroll bars."""
    page = measures_at(make_page, tiny_server, 1280)
    page.wait_for_selector("#neuron table", timeout=30_000)
    room = page.evaluate("""() => ['finder', 'neuron'].map((id) => {
        const section = document.getElementById(id).closest('section');
        return [id, Math.round(document.getElementById(id).querySelector('table').getBoundingClientRect().width), section.clientWidth];
    })""")
    assert all(table <= width for _, table, width in room), room
    page.locator("#measures").screenshot(path=str(artifacts / "measures-1280.png"))


def test_measures_name_tokens_as_the_labels_control_says(page, server):
    """The measures named tokens by their text whatever the Labels control said: with "Model
    pieces" the heatmap above said `the` where the measure, neuron view and flow graph said `The`."""
    open_page(page, server)
    run(page, "The bank of the river.", model="tiny-causal")  # a GPT on MiniLM's lowercasing pieces
    page.locator("#measures").scroll_into_view_if_needed()
    shown = """() => [
        [...document.querySelectorAll('#measure-plot .axis-labels .xtick')].map((g) => g.textContent)[1],
        document.querySelector('#neuron-query option[value="1"]')?.textContent,
        [...document.querySelectorAll('#flow .flow-token')].map((t) => t.textContent)[1],
        [...document.querySelectorAll('#predictions .pred-token')].map((t) => t.textContent)[1],
    ]"""
    page.wait_for_function(f"() => ({shown})().every((label) => label !== undefined)", timeout=30_000)
    page.wait_for_function(f"() => ({shown})().join('|') === 'the|1: the|the|the'", timeout=30_000)
    page.select_option("#labels", "text")
    page.wait_for_function(f"() => ({shown})().join('|') === 'The|1: The|The|The'", timeout=30_000)
    page.select_option("#labels", "pieces")
    page.wait_for_function(f"() => ({shown})().join('|') === 'the|1: the|the|the'", timeout=30_000)


def test_the_finder_filter_matches_a_head_by_its_whole_name(page, server):
    """"L1H1" also listed L1 H10 and L1 H11 (a substring of their names)."""
    open_page(page, server)
    run(page, "The bank of the river.")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_function("() => document.querySelectorAll('#finder tbody tr').length === 72", timeout=30_000)
    page.fill("#finder-filter", "L1H1")
    rows = page.locator("#finder tbody tr")
    assert [(r.get_attribute("data-layer"), r.get_attribute("data-head")) for r in rows.all()] == [("1", "1")]
    page.fill("#finder-filter", "L1H1,")  # as the placeholder writes a list
    assert rows.count() == 1


def test_measure_export_carries_its_labels_cells_and_caption(ran):
    """The page draws the measure's labels, which Plotly's own export would drop: the modebar's
    camera and disk export with Plotly-drawn labels, the painted cells and a caption."""
    page, _ = ran
    page.wait_for_selector("#measure-plot[data-measure='raw']")
    page.hover("#measure-plot")
    with page.expect_download() as download:
        page.click("#measure-plot .modebar-btn[data-title='Download plot as SVG']")
    assert download.value.suggested_filename == "manyeyes-tiny-gpt-raw-L0-H0.svg"
    svg = open(download.value.path(), encoding="utf-8").read()
    assert "Raw weights, layer 0 head 0 · tiny-gpt · “The cat sat on the mat. The cat sat on”" in svg
    ticks = re.findall(r'class="xtick"[^>]*>.*?<text[^>]*>([^<]*)</text>', svg)
    assert len(ticks) == len(TEXT) and "".join(ticks).replace("␣", " ").replace("\u00a0", " ") == TEXT, ticks[:12]
    assert "data:image/png;base64," in svg  # the cells, as painted on the page


def test_measures_on_a_server_that_quantises_on_the_device(page, tiny_api):
    """A GPU server keeps the page's u8 runs as bytes: the exact (f16) focus and the raw measure
    (float32) were refused with 422s shown as errors, and the other measures read bytes as weights.
    Then each was asked first and refused before the page posted the text again: the answer's
    `precision` now says what the run can serve, and the page asks for nothing it cannot."""
    failed = []
    page.on("response", lambda r: failed.append((r.status, r.url)) if r.status >= 400 else None)
    with serving({"tiny-gpt": "tiny-gpt"}, env={"MANYEYES_DEVICE_QUANTISE": "true"}) as base:
        open_page(page, base)
        with httpx.Client(base_url=base, timeout=60) as quantised:
            first = quantised.post("/api/v1/attention", json={"text": "Kept as bytes.", "model": "tiny-gpt", "format": "u8"})
            refused = quantised.get(f"/api/v1/runs/{first.json()['run_id']}/attention", params={"format": "f16"})
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "kept_quantised"
        run(page, TEXT, model="tiny-gpt")  # waits for the exact (f16) focus
        page.wait_for_selector("#finder tbody tr", timeout=30_000)
        page.locator("#measures").scroll_into_view_if_needed()
        page.wait_for_selector("#measure-plot[data-measure='raw']")
        float_run = tiny_api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "json",
                                                             "layers": [0], "heads": [0]}).json()
        z = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
        want = float_run["attention"]["data"][0][0]
        assert max(abs(a - b) for zr, wr in zip(z, want) for a, b in zip(zr, wr)) < 1e-6
        page.select_option("#measure", "rollout")
        page.wait_for_selector("#measure-plot[data-measure='rollout']")
        z = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
        # The float32 server's rollout of the same text: the model's weights, not the bytes'.
        float_run = tiny_api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "json"}).json()
        want = tiny_api.get(f"/api/v1/runs/{float_run['run_id']}/measures", params={"names": "rollout"}).json()
        want = want["measures"]["rollout"]["data"]
        assert max(abs(a - b) for zr, wr in zip(z, want) for a, b in zip(zr, wr)) < 1e-5
        assert page.locator("#measure-status").text_content() == ""
        assert page.locator("#error").is_hidden()
        assert failed == []


def test_measure_and_neuron_readings_never_say_zero_for_a_weight_that_is_not(ran, tiny_api):
    """The line under the measure heatmap and the neuron view's softmax gave four decimals: a weight
    of 3e-6 read 0.0000 there while the focused heatmap's hover read it as 3.0e-6."""
    page, run_id = ran
    page.wait_for_selector("#measure-plot[data-measure='raw'][data-layer='0'][data-head='0']")
    matrix = page.evaluate("() => document.getElementById('measure-plot').measured.matrix")
    tiny = [(i, j) for i, row in enumerate(matrix) for j, v in enumerate(row[: i + 1]) if 0 < v < 5e-5]
    assert tiny, "the head has no weight under 5e-5 to read"
    row, col = tiny[0]
    page.focus("#measure-plot")
    page.keyboard.press("ArrowDown")  # the cursor lands on the top-left cell
    for _ in range(row):
        page.keyboard.press("ArrowDown")
    for _ in range(col):
        page.keyboard.press("ArrowRight")
    line = page.locator("#measure-reading")
    assert (line.get_attribute("data-row"), line.get_attribute("data-col")) == (str(row), str(col))
    value = line.text_content().split(": ", 1)[1].split(" ·")[0]
    assert float(value) == pytest.approx(matrix[row][col], rel=0.05), line.text_content()

    page.select_option("#neuron-query", str(row))
    page.wait_for_selector(f"#neuron[data-layer='0'][data-head='0'][data-query='{row}']")
    view = tiny_api.get(f"/api/v1/runs/{run_id}/neuron", params={"layer": 0, "head": 0, "query": row}).json()
    weights = page.locator("#neuron-table td.weight").all_text_contents()
    for shown, want in zip(weights, view["weights"]):
        assert shown != "0.0000" or want == 0, (shown, want)


def test_raw_weights_hide_special_tokens_as_the_focused_heatmap_does(page, server, api, artifacts):
    """Under "Hide special tokens" the focused heatmap, the thumbnails and the head view left [CLS]
    and [SEP] out and renormalised each row over the rest; the raw weights below kept them all."""
    text = "The bank of the river."
    open_page(page, server)
    run(page, text, model="minilm")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'][data-layer='0'][data-head='0']", timeout=30_000)
    tokens, attention = api_attention(api, text, layers=[0], heads=[0])
    keep = [i for i, t in enumerate(tokens) if not t["special"]]
    assert 0 < len(keep) < len(tokens)
    shape = "() => document.getElementById('measure-plot').measured.matrix.length"
    measured = "() => document.getElementById('measure-plot').measured.matrix"
    labels = "() => [...document.querySelectorAll('#measure-plot .axis-labels .xtick')].map((g) => g.textContent)"
    assert page.evaluate(shape) == len(tokens)

    page.check("#hide-special")
    wait_plotted_shape(page, len(keep), len(keep))
    try:
        page.wait_for_function(f"(n) => ({shape})() === n", arg=len(keep), timeout=10_000)
    except Exception:
        pass  # the assertion below says what stayed
    assert page.evaluate(shape) == len(keep), "the raw weights kept the special tokens"
    want = attention[0, 0][np.ix_(keep, keep)]
    want /= want.sum(axis=1, keepdims=True)
    matrix = np.asarray(page.evaluate(measured))
    assert np.abs(matrix - want).max() < 1e-6
    assert np.abs(matrix - np.asarray(plotted(page), dtype=np.float64)).max() < 1e-6  # the focused heatmap's cells
    shown = page.evaluate(labels)
    assert shown == page.locator("#focus-plot .xtick text").all_text_contents() and "[CLS]" not in shown
    assert "hidden by “Hide special tokens”" in page.locator("#measure-caption").text_content()
    page.locator("#measures").screenshot(path=str(artifacts / "measures-hide-special.png"))
    # The word view's special tokens are words of their own, and go the same way.
    page.check("#word-view")
    page.wait_for_selector("#measure-plot[data-words='true']")
    assert page.evaluate(shape) == len(keep) and "[CLS]" not in page.evaluate(labels)
    page.uncheck("#word-view")
    # The other measures are not softmax rows: they keep every token, and say so (they said nothing).
    page.select_option("#measure", "rollout")
    page.wait_for_selector("#measure-plot[data-measure='rollout']")
    assert page.evaluate(shape) == len(tokens)
    assert page.locator("#measure-caption").text_content().endswith(
        " “Hide special tokens” applies to the raw weights only: every token is shown here.")
    page.select_option("#measure", "raw")
    page.wait_for_selector("#measure-plot[data-measure='raw']")

    page.uncheck("#hide-special")
    page.wait_for_function(f"(n) => ({shape})() === n", arg=len(tokens), timeout=10_000)
    assert np.abs(np.asarray(page.evaluate(measured)) - attention[0, 0]).max() < 1e-6


def test_the_caption_names_the_focused_heatmaps_own_options_and_the_word_views_merge(page, server):
    """With a pair, "Pairs" and "Threshold" changed the focused heatmap but not the raw weights
    below, whose caption said they were shown "as in the focused heatmap"; and the word view said
    nothing of how it merged pieces (review h55f)."""
    open_page(page, server)
    run(page, "The bank raised rates.", "She sat on the river bank.", model="minilm")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw']", timeout=30_000)
    caption = page.locator("#measure-caption")
    assert "focused heatmap only" not in caption.text_content()
    page.select_option("#segments", "AB")
    page.wait_for_function("() => document.getElementById('measure-caption').textContent.endsWith("
                           "' “Pairs” applies to the focused heatmap only: every weight and pair block is shown here.')")
    page.locator("#threshold").fill("0.3")
    page.wait_for_function("() => document.getElementById('measure-caption').textContent.endsWith("
                           "' “Threshold” and “Pairs” apply to the focused heatmap only: every weight and pair block is shown here.')")
    page.select_option("#segments", "all")
    page.locator("#threshold").fill("0")
    page.wait_for_function("() => !document.getElementById('measure-caption').textContent.includes('focused heatmap only')")
    page.check("#word-view")
    page.wait_for_selector("#measure-plot[data-words='true']")
    assert caption.text_content().endswith(
        " Words: each word's key pieces are summed and its query pieces averaged, so rows still sum to 1.")
    page.select_option("#measure", "value_norms")
    page.wait_for_selector("#measure-plot[data-measure='value_norms'][data-words='true']")
    assert "Words: each word's key pieces are summed and its query pieces averaged." in caption.text_content()


def test_raw_weights_say_so_when_every_token_is_hidden(page, tiny_server):
    """tiny-gpt's `a` is one token: under "Hide first token" the raw weights have no cell left."""
    open_page(page, tiny_server)
    run(page, "a", model="tiny-gpt")
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw']", timeout=30_000)
    page.check("#hide-first")
    said = "No token is left to show: untick “Hide first token” to see them."
    page.wait_for_function("(said) => document.getElementById('measure-caption').textContent.endsWith(said)", arg=said)
    assert page.locator("#measure-plot").is_hidden() and page.locator("#measure-reading").is_hidden()
    page.uncheck("#hide-first")
    page.wait_for_function("() => document.getElementById('measure-plot').measured.matrix.length === 1")
    assert page.locator("#measure-plot").is_visible() and page.locator("#measure-reading").is_visible()


def test_pointing_off_the_cells_of_a_small_square_drops_the_last_reading(ran):
    """A few words' square sits in a wider plot: pointing at the space beside it left the last
    cell's reading up, as if it were the cell pointed at."""
    page, _ = ran
    page.check("#word-view")
    page.wait_for_selector("#measure-plot[data-measure='raw']")
    page.wait_for_function("() => document.getElementById('measure-plot').measured.matrix.length < 12")
    points = page.evaluate("""() => {
        const plot = document.getElementById('measure-plot'), box = plot.getBoundingClientRect();
        const xa = plot._fullLayout.xaxis, ya = plot._fullLayout.yaxis;
        const y = box.top + ya._offset + ya.l2p(1);
        return [[box.left + xa._offset + xa.l2p(0), y], [box.left + xa._offset + xa._length + 40, y], box.right];
    }""")
    (cell_x, y), (beside_x, _), right = points
    assert beside_x < right - 20  # the plot really is wider than its cells
    line = page.locator("#measure-reading")
    page.mouse.move(cell_x, y)
    page.wait_for_function("() => document.getElementById('measure-reading').dataset.row === '1'")
    page.mouse.move(beside_x, y, steps=3)
    page.wait_for_function("() => document.getElementById('measure-reading').dataset.row === undefined")
    assert line.text_content().startswith("Hover a cell")
