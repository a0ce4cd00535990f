"""The experiment panels in headless chromium against the real server: what the page shows equals the API."""

from __future__ import annotations

import base64
import json
import re
import time

import httpx
import numpy as np
import pytest

from tests.browser.conftest import serving

pytestmark = pytest.mark.browser

SENTENCE = "The bank of the river was muddy after the rain."
PROMPT = "the river bank"


def open_page(page, base):
    page.goto(f"{base}/")
    page.wait_for_selector("body[data-ready=true]")


def run(page, text, model=None):
    # The run's own announcement: the plot and thumbnails of the run before match the selectors
    # below too, so a second run could be asserted on before the page had shown it.
    page.evaluate("""() => {
      window.announced = null;
      document.addEventListener("manyeyes:run", (event) => { window.announced = event.detail.request.text; });
    }""")
    page.fill("#text", text)
    if model is not None:
        page.select_option("#model", model)
    page.press("#text", "Enter")
    page.wait_for_function("(text) => window.announced === text", arg=text, timeout=30_000)
    page.wait_for_selector("#focus-plot[data-precision=f16]", timeout=30_000)
    page.wait_for_selector("#grid .thumb[data-layer='0'][data-head='0']:not(.loading)", timeout=30_000)


def shown(page, plot_id):
    """The plotted cells as float32: the page keeps the API's float32 values (a Float32Array)."""
    return np.asarray(page.evaluate(f"document.getElementById('{plot_id}').data[0].z"), dtype=np.float32)


def f32(values):
    return np.asarray(values, dtype=np.float32)


def same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a, b)


def ranking_rows(page, container):
    rows = page.locator(f"#{container} table.ranking tbody tr")
    return [(int(r.get_attribute("data-layer")), int(r.get_attribute("data-head")), r.locator("td").nth(2).inner_text())
            for r in rows.all()]


def weight_text(value: float, digits: int = 4) -> str:
    """focus.js weightText(value, 0, digits): `digits` decimals while those hold two significant
    digits, else two significant digits (fixed from 1e-4 up, else 3.0e-7)."""
    if value == 0 or abs(value) >= 10 ** (1 - digits):
        return f"{value:.{digits}f}"
    mantissa, exponent = f"{value:.1e}".split("e")
    exponent = int(exponent)
    return f"{value:.{1 - exponent}f}" if abs(value) >= 1e-4 else f"{mantissa}e{exponent}"


NOISE_BITS = 1e-12  # experiment_parts.js: a divergence under it is float rounding, and reads 0


def divergence_text(bits: float) -> str:
    return "0" if abs(bits) < NOISE_BITS else weight_text(bits)


def api_ranking(ranking, limit=12):
    return [(c["layer"], c["head"], divergence_text(c["divergence"])) for c in ranking[:limit]]


def alt_click(page, layer, head):
    page.click(f"#grid .thumb[data-layer='{layer}'][data-head='{head}']", modifiers=["Alt"])


def alt_ablate(page, api, text, model, layer, head):
    """Alt-clicks a head's thumbnail (ablate it, zero) and waits for the page's ablated heatmap;
    returns the API's answer to the same ablation, float32 attention included."""
    alt_click(page, layer, head)
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    return api.post("/api/v1/experiments/ablate", json={
        "text": text, "model": model, "truncate": False, "ablate": [{"layer": layer, "head": head, "mode": "zero"}],
        "top_k": 5, "attention": {"format": "json"}}).json()


def test_ablate_from_the_grid_then_undo_restores_exactly(server, api, page, artifacts):
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    first = alt_ablate(page, api, SENTENCE, "minilm", 1, 4)
    assert ranking_rows(page, "ablate-ranking") == api_ranking(first["ranking"])
    layer, head = first["ranking"][0]["layer"], first["ranking"][0]["head"]
    plot = page.locator("#ablate-plot")
    assert (int(plot.get_attribute("data-layer")), int(plot.get_attribute("data-head"))) == (layer, head)
    assert same(shown(page, "ablate-plot"), f32(first["attention"]["data"][layer][head]))
    assert "no language-model head" in page.inner_text("#ablate-predictions")

    # A second, mean ablation of the focused head, then undo twice: each state comes back exactly.
    page.select_option("#ablate-mode", "mean")
    page.select_option("#layer", "0")
    page.select_option("#head", "7")
    page.click("#ablate-add")
    page.wait_for_selector("#ablate-plot[data-depth='2']", timeout=30_000)
    assert page.inner_text("#ablate-list").split("\n") == ["L1 H4 · zero", "L0 H7 · mean"]
    assert page.text_content("#ablate-status") == "Done on minilm: L0 H7 ablated (mean); 2 heads ablated in all."
    page.locator("#experiments").screenshot(path=str(artifacts / "experiments-ablate.png"))
    # Undone from the keyboard: the button stays in focus while it has more to undo; disabled, it
    # hands focus to the panel's first control rather than dropping it to the page's body.
    page.focus("#ablate-undo")
    page.keyboard.press("Enter")
    page.wait_for_selector("#ablate-plot[data-depth='1']")
    assert page.text_content("#ablate-status") == "Undone: 1 still ablated."
    assert page.evaluate("() => document.activeElement.id") == "ablate-undo"
    assert same(shown(page, "ablate-plot"), f32(first["attention"]["data"][layer][head]))
    page.keyboard.press("Enter")
    page.wait_for_selector("#ablate-plot[data-depth='0'][data-state='clean']")
    assert page.text_content("#ablate-status") == "Undone: no head ablated."
    assert page.evaluate("() => document.activeElement.id") == "ablate-mode"
    clean = api.post("/api/v1/attention", json={"text": SENTENCE, "model": "minilm", "layers": [layer], "heads": [head],
                                                 "format": "json"}).json()
    assert same(shown(page, "ablate-plot"), f32(clean["attention"]["data"][0][0]))
    assert not same(shown(page, "ablate-plot"), f32(first["attention"]["data"][layer][head]))
    assert page.is_disabled("#ablate-undo")


def test_the_grid_marks_the_heads_ablated_until_undone_or_a_new_run(server, page):
    """The heads ablated were named only in the chips under the Experiments panel, far below the grid."""
    def marked():
        return page.evaluate("""() => [...document.querySelectorAll('#grid .thumb.ablated')]
            .map((t) => [t.dataset.layer, t.dataset.head, t.getAttribute('aria-label')])""")

    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    assert marked() == []
    alt_click(page, 0, 2)
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    alt_click(page, 1, 3)
    page.wait_for_selector("#ablate-plot[data-depth='2']", timeout=30_000)
    assert marked() == [["0", "2", "Layer 0, head 2, ablated (zero)"], ["1", "3", "Layer 1, head 3, ablated (zero)"]]
    assert page.get_attribute("#grid .thumb[data-layer='0'][data-head='3']", "aria-label") == "Layer 0, head 3"
    page.click("#ablate-undo")
    page.wait_for_selector("#ablate-plot[data-depth='1']")
    assert marked() == [["0", "2", "Layer 0, head 2, ablated (zero)"]]
    run(page, SENTENCE, "tiny-causal")
    assert marked() == []


def test_undo_and_restore_all_while_an_ablation_runs_drop_it(server, page):
    """The answer of an ablation under way, built on the list before Undo or Restore all was
    pressed, put the heads just restored back when it came (review h55g)."""
    def marked():
        return page.evaluate("() => [...document.querySelectorAll('#grid .thumb.ablated')].map((t) => [t.dataset.layer, t.dataset.head])")

    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    # The page's ablate requests wait, while window.hold is set, until the test releases them.
    page.evaluate("""() => {
        const real = window.fetch;
        window.held = [];
        window.fetch = (url, options) => String(url).includes('experiments/ablate') && window.hold
            ? new Promise((resolve) => window.held.push(() => resolve(real(url, options))))
            : real(url, options);
    }""")
    for press, left in (("#ablate-undo", [["0", "2"], ["0", "3"]]), ("#ablate-clear", [["0", "3"]])):
        if page.is_enabled("#ablate-clear"):
            page.click("#ablate-clear")
        alt_click(page, 0, 2)
        page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
        page.evaluate("() => { window.hold = true; }")
        alt_click(page, 1, 3)
        page.wait_for_function("() => window.held.length === 1", timeout=30_000)
        assert page.is_enabled("#ablate-undo") and page.is_enabled("#ablate-clear")
        page.click(press)
        said = page.locator("#ablate-status").text_content()
        assert said == ("Undone: L1 H3 is not ablated (its answer is dropped)." if press == "#ablate-undo"
                        else "Restored: no head ablated."), said
        alt_click(page, 0, 3)  # waits its turn behind the dropped one, then goes on the list as it is now
        page.evaluate("() => { window.hold = false; window.held.shift()(); }")
        page.wait_for_function("(n) => document.getElementById('ablate-plot').dataset.depth === String(n)", arg=len(left),
                               timeout=30_000)
        page.wait_for_function("() => document.getElementById('ablate-status').textContent.startsWith('Done on')")
        assert marked() == left, (press, marked())
        assert page.locator("#ablate-list li").all_text_contents() == [f"L{l} H{h} · zero" for l, h in left]


def test_ablating_a_causal_model_shows_the_prediction_change(server, api, page):
    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    page.click("#grid .thumb[data-layer='0'][data-head='2']", modifiers=["Alt"])
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    reply = api.post("/api/v1/experiments/ablate", json={
        "text": PROMPT, "model": "tiny-causal", "truncate": False, "ablate": [{"layer": 0, "head": 2, "mode": "zero"}]}).json()
    mean = sum(c["change"] for c in reply["logprob_change"]) / len(reply["logprob_change"])
    assert f"mean {mean:.3f}" in page.inner_text("#ablate-predictions caption")
    biggest = max(reply["logprob_change"], key=lambda c: abs(c["change"]))
    first_row = page.locator("#ablate-predictions tbody tr").first
    assert int(first_row.get_attribute("data-position")) == biggest["position"]
    assert ranking_rows(page, "ablate-ranking") == api_ranking(reply["ranking"])


def test_the_ablated_plots_title_names_three_heads_by_their_count(server, page):
    """Every ablated head in the title: at four or more it was wider than the plot, and cut at both
    ends, the shown head's name with them."""
    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    for depth, head in enumerate((0, 1, 3), start=1):
        page.click(f"#grid .thumb[data-layer='0'][data-head='{head}']", modifiers=["Alt"])
        page.wait_for_selector(f"#ablate-plot[data-depth='{depth}'][data-state='ablated']", timeout=30_000)
    (layer, head), title = ablate_shown(page)
    assert title == f"L{layer} H{head}, after ablating 3 heads"
    assert page.locator("#ablate-list").inner_text().count("L0 H") == 3


def test_ablating_a_head_of_the_last_layer_shows_its_prediction_change(server, api, page):
    """No later head to rank: the page drew nothing at all, though the answer held 53 changes."""
    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    page.click("#grid .thumb[data-layer='1'][data-head='2']", modifiers=["Alt"])
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated'][data-layer='1'][data-head='2']", timeout=30_000)
    assert "No later layer" in page.inner_text("#ablate-ranking")
    assert page.locator("#ablate-predictions tbody tr").count() > 0
    # Its own weights are the clean ones (an ablation silences what a head writes): the title says so.
    title = page.evaluate("() => document.getElementById('ablate-plot').layout.title.text")
    assert title == "L1 H2, after ablating L1 H2 (zero): weights unchanged", title
    # A new run clears the plot, and the hooks that said what it showed.
    run(page, SENTENCE, "tiny-causal")
    page.wait_for_function("() => document.getElementById('ablate-plot').dataset.depth === '0'")
    assert page.evaluate("() => ({ ...document.getElementById('ablate-plot').dataset })") == {"depth": "0"}


def test_clicking_a_token_masks_it_and_ranks_the_heads(server, api, page, artifacts):
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    page.click("#token-load")
    page.wait_for_selector("#token-chips button[data-index='2']")
    page.click("#token-chips button[data-index='2']")
    page.wait_for_selector("#token-result[data-index='2'] table.ranking")
    reply = api.post("/api/v1/experiments/change-token", json={
        "text": SENTENCE, "model": "minilm", "truncate": False, "index": 2, "change": "mask"}).json()
    assert ranking_rows(page, "token-result") == api_ranking(reply["ranking"])
    # Its own width, not the column's: stretched, each number stood 400 px from its head.
    table, column = page.evaluate("""() => {
      const t = document.querySelector('#token-result table.ranking');
      return [t.getBoundingClientRect().width, t.parentElement.getBoundingClientRect().width / 2];
    }""")
    assert table < 0.8 * column, (table, column)
    page.locator("#token-box").screenshot(path=str(artifacts / "experiments-change-token.png"))
    # Said in words as well as by the red border (a hidden "(unaligned)" for screen readers).
    assert page.locator("#token-result .aligned-line").nth(1).locator(".chip.unaligned").text_content() == "[MASK] (unaligned)"


def test_a_changed_tokens_ranked_head_opens_its_difference(server, api, page):
    """The ranking named the heads that moved and showed nothing of what moved in them: now the
    top head's before − after on the aligned cells is drawn, and a row or its button opens another."""
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    page.click("#token-load")
    page.wait_for_selector("#token-chips button[data-index='2']")
    page.click("#token-chips button[data-index='2']")
    page.wait_for_selector("#token-plot-diff[data-ready='true']")
    reply = api.post("/api/v1/experiments/change-token", json={
        "text": SENTENCE, "model": "minilm", "truncate": False, "index": 2, "change": "mask",
        "difference": {"format": "json"}}).json()
    top, third = reply["ranking"][0], reply["ranking"][2]
    assert page.locator("#token-plot-diff").get_attribute("data-layer") == str(top["layer"])
    assert page.locator("#token-plot-diff").get_attribute("data-head") == str(top["head"])
    assert same(shown(page, "token-plot-diff"), f32(reply["difference"]["data"][top["layer"]][top["head"]]))
    page.click("#token-result tbody tr:nth-child(3)")
    page.wait_for_selector(f"#token-plot-diff[data-layer='{third['layer']}'][data-head='{third['head']}']")
    assert same(shown(page, "token-plot-diff"), f32(reply["difference"]["data"][third["layer"]][third["head"]]))
    title = page.evaluate("() => document.getElementById('token-plot-diff').layout.title.text")
    assert title.startswith("before − after on aligned cells · L"), title


def hold_the_first(page, url: str, click, holds=lambda route: True):
    """Routes `url` so that the first request `holds` accepts is held, does `click`, and returns
    that request's route once it has been held (the test answers it with continue_())."""
    held = []
    page.route(url, lambda route: held.append(route) if not held and holds(route) else route.continue_())
    click()
    while not held:
        page.wait_for_timeout(50)
    return held[0]


def test_the_last_token_clicked_is_the_one_shown(server, page):
    """An earlier click's slower answer came after the last one's and replaced it, and the first
    answer back cleared the status while the other still ran."""
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    page.click("#token-load")
    page.wait_for_selector("#token-chips button[data-index='4']")
    held = hold_the_first(page, "**/api/v1/experiments/change-token", lambda: page.click("#token-chips button[data-index='2']"),
                          holds=lambda route: route.request.post_data_json["index"] == 2)  # answered after index 4's
    page.click("#token-chips button[data-index='4']")
    page.wait_for_selector("#token-result[data-index='4'] table.ranking")
    held.continue_()
    page.wait_for_timeout(1_500)  # index 2's answer has come back by now (tens of ms)
    assert page.locator("#token-result").get_attribute("data-index") == "4"
    # The result is said, as drawn (a cleared line told a screen reader nothing), and it is index 4's
    assert re.fullmatch(r"Done on [\w-]+: token 4 (deleted|as \w+); L\d+ H\d+ moved most\.", page.locator("#token-status").text_content())


def test_heads_alt_clicked_during_an_ablation_are_ablated_next(server, page):
    """A second Alt-click while the first ran was dropped without a word."""
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    held = hold_the_first(page, "**/api/v1/experiments/ablate", lambda: alt_click(page, 0, 1))
    alt_click(page, 1, 2)
    assert page.locator("#ablate-status").text_content() == "Ablating… then L1 H2 (1 waiting)."
    held.continue_()
    page.wait_for_selector("#ablate-plot[data-depth='2']", timeout=30_000)
    assert page.locator("#ablate-list li").all_text_contents() == ["L0 H1 · zero", "L1 H2 · zero"]


def test_an_ablation_in_flight_does_not_hold_up_the_next_runs(server, page):
    """Alt-clicks on a new run did nothing until the last run's ablation came back."""
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    held = hold_the_first(page, "**/api/v1/experiments/ablate", lambda: alt_click(page, 0, 1))
    run(page, "The dog ran.", "minilm")
    alt_click(page, 1, 2)
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    assert page.locator("#ablate-list li").all_text_contents() == ["L1 H2 · zero"]
    held.continue_()
    page.wait_for_timeout(500)  # the last run's answer is dropped
    assert page.locator("#ablate-list li").all_text_contents() == ["L1 H2 · zero"]


def test_a_failed_comparison_takes_the_last_ones_pictures_with_it(server, page):
    compare(page, server, "The bank of the river.", "The bank of the old river.")
    assert page.locator("#compare-ranking table").count() == 1
    # The server's answer for texts with no token in common (the served models all add [CLS] and [SEP]).
    page.route("**/api/v1/experiments/compare", lambda route: route.fulfill(
        status=422, content_type="application/json",
        body=json.dumps({"error": {"code": "invalid_input", "message": "the two inputs share no token to align"}})))
    page.fill("#compare-a", "abc")
    page.fill("#compare-b", "xyz")
    page.click("#compare-run")
    page.wait_for_selector("#compare-status[data-kind='error']")
    assert "share no token" in page.locator("#compare-status").text_content()
    assert page.locator("#compare-ranking table").count() == 0
    assert page.evaluate("() => ['a', 'b', 'diff'].every((p) => !document.getElementById(`compare-plot-${p}`).data)")


def test_a_sentence_too_long_to_compare_is_named_and_told_what_cuts_it(server, page):
    """The message quoted the API's field ("text_b: ...") and said to tick "Cut to fit", which alone
    did nothing: a comparison is cut as the run on screen was."""
    open_page(page, server)
    run(page, SENTENCE)
    page.fill("#compare-b", "word " * 600)
    page.click("#compare-run")
    page.wait_for_selector("#compare-status[data-kind='error']")
    said = page.locator("#compare-status").text_content()
    assert said.startswith("Sentence B too long: input is 602 tokens long") and "text_b" not in said, said
    assert said.endswith("tick “Cut to fit” and press Run: a comparison is cut as the run on screen was."), said


def test_empty_compare_a_and_prompt_say_they_are_the_runs_text(server, page):
    open_page(page, server)
    assert page.locator("#compare-a").get_attribute("placeholder") == "Sentence A (or run one: its text)"
    assert page.locator("#gen-text").get_attribute("placeholder") == "A prompt (or run a sentence: its text)"
    run(page, SENTENCE, "minilm")
    # said first: after the text, a narrow box cut "(the run's t" off
    assert page.locator("#compare-a").get_attribute("placeholder") == f"The run's text: {SENTENCE}"
    assert page.locator("#gen-text").get_attribute("placeholder") == f"The run's text: {SENTENCE}"


def compare(page, server, a, b, timeout=30_000):
    """Opens the page and compares a with b on minilm, waiting for the difference heatmap."""
    open_page(page, server)
    page.select_option("#model", "minilm")
    page.fill("#compare-a", a)
    page.fill("#compare-b", b)
    page.click("#compare-run")
    page.wait_for_selector("#compare-plot-diff[data-ready='true']", timeout=timeout)


def test_experiment_plots_offer_nothing_that_leaves_this_machine(server, page, watched):
    """The experiments' heatmaps kept Plotly's default config: a "Share chart..." button that posts
    the figure to cloud.plotly.com, on a page that promises no request leaves loopback."""
    compare(page, server, "The bank of the river.", "The bank of the old river.")
    plots = page.locator(".js-plotly-plot")
    assert plots.count() >= 4  # the focused heatmap and measures, and compare's three
    titles = page.evaluate("() => [...document.querySelectorAll('.modebar-btn')].map((b) => b.dataset.title)")
    assert titles and not [t for t in titles if "Share" in t or "Chart Studio" in t or "cloud" in t.lower()], titles
    assert page.locator("#compare-plot-diff .modebar-btn").count() > 0
    for button in page.locator("#compare-plot-diff .modebar-btn").all():
        page.hover("#compare-plot-diff")
        button.click()
    page.wait_for_timeout(500)
    assert watched.off_loopback() == []


def compared(page, server, api, a: str, b: str) -> dict:
    """Compares a with b on the page (minilm) and returns the API's answer, with every difference."""
    compare(page, server, a, b)
    return api.post("/api/v1/experiments/compare", json={"text_a": a, "text_b": b, "model": "minilm", "truncate": False,
                                                        "difference": {"format": "json"}}).json()


def test_compare_two_sentences_shows_the_api_difference(server, api, page, artifacts):
    reply = compared(page, server, api, "The bank of the river.", "The bank of the old river.")
    assert ranking_rows(page, "compare-ranking") == api_ranking(reply["ranking"])
    top = reply["ranking"][0]
    assert same(shown(page, "compare-plot-diff"), f32(reply["difference"]["data"][top["layer"]][top["head"]]))
    # Its rows are numbered by their positions in A and B, as the A and B plots beside it number
    # theirs (by the aligned pair's index, "6: ." was A's token 6 but B's token 7).
    rows = page.evaluate("() => document.getElementById('compare-plot-diff').data[0].y")
    assert rows[4:] == ["4: the", "5|6: river", "6|7: .", "7|8: [SEP]"], rows
    # Another head from the ranking: its cells, again exactly the API's.
    page.click("#compare-ranking tbody tr:nth-child(3)")
    third = reply["ranking"][2]
    page.wait_for_selector(f"#compare-plot-diff[data-layer='{third['layer']}'][data-head='{third['head']}']")
    assert same(shown(page, "compare-plot-diff"), f32(reply["difference"]["data"][third["layer"]][third["head"]]))
    # Each ranked head is a button for the keyboard: Space shows it, as Enter and a click on the row do.
    second = reply["ranking"][1]
    button = page.locator("#compare-ranking tbody tr:nth-child(2) button")
    assert button.get_attribute("aria-label") == f"Show layer {second['layer']} head {second['head']} in the difference heatmap"
    button.focus()
    page.keyboard.press(" ")
    page.wait_for_selector(f"#compare-plot-diff[data-layer='{second['layer']}'][data-head='{second['head']}']")
    page.locator("#compare-box").screenshot(path=str(artifacts / "experiments-compare.png"))
    # B emptied: the refusal no longer stands over the last comparison's heatmaps and ranking (review h55g).
    page.fill("#compare-b", "")
    page.click("#compare-run")
    page.wait_for_function("() => document.getElementById('compare-status').textContent === 'Write sentence B to compare with A.'")
    assert page.locator("#compare-ranking tbody tr").count() == 0
    assert page.get_attribute("#compare-plot-diff", "data-ready") == "false"


def compare_on_the_page(page, server, a: str, b: str, model: str = "tiny-causal") -> None:
    """A fresh page compares a with b on `model` and waits for the difference plot."""
    open_page(page, server)
    page.select_option("#model", model)
    page.fill("#compare-a", a)
    page.fill("#compare-b", b)
    page.click("#compare-run")
    page.wait_for_selector("#compare-plot-diff[data-ready='true']", timeout=30_000)


def test_compare_ranks_a_random_models_tiny_differences_without_printing_zeros(server, api, page):
    """tiny-causal's random weights barely tell two sentences apart: every head's divergence is
    under 5e-5, and each printed as 0.0000, a ranking of equal zeros."""
    a, b = "the river bank", "the river bend"
    compare_on_the_page(page, server, a, b)
    reply = api.post("/api/v1/experiments/compare", json={"text_a": a, "text_b": b, "model": "tiny-causal", "truncate": False,
                                                         "difference": {"format": "json"}}).json()
    shown = ranking_rows(page, "compare-ranking")
    assert shown and all(0 < c["divergence"] < 5e-5 for c in reply["ranking"][:len(shown)])
    assert all(text != "0.0000" for *_head, text in shown), shown
    assert shown == api_ranking(reply["ranking"])
    for (_l, _h, text), c in zip(shown, reply["ranking"]):
        assert float(text) == pytest.approx(c["divergence"], rel=0.05)


def test_compare_difference_speaks_the_pages_diverging_colours(server, page):
    """A − B had its own red-positive scale with #f7f7f7 at 0 in either theme (a glare on the dark
    one): it is the measures' scale, the theme's paper colour at 0, its strongest colour for
    positive values and red for negative ones."""
    compare(page, server, "The bank of the river.", "The bank of the old river.")
    scale = "() => { const t = document.getElementById('compare-plot-diff').data[0]; return [t.colorscale, t.zmin, t.zmax]; }"
    stops, zmin, zmax = page.evaluate(scale)
    assert zmin == -zmax
    assert stops == [[0, "rgb(203,45,62)"], [0.5, "#ffffff"], [1, "rgb(8,48,107)"]]  # red, white paper, the heatmap's darkest blue
    page.select_option("#theme", "dark")
    page.wait_for_function(f"() => ({scale})()[0][1][1] !== '#ffffff'")
    assert page.evaluate(scale)[0] == [[0, "rgb(203,45,62)"], [0.5, "#161b22"], [1, "rgb(255,243,176)"]]


def test_compare_at_hundreds_of_tokens_draws(server, page):
    """Math.max(...cells) over the difference's T² cells overflowed the stack at 403 tokens."""
    a = " ".join(f"word{i % 50} river bank" for i in range(110))  # about 440 tokens
    compare(page, server, a, a.replace("word7 river", "word7 stream", 1), timeout=60_000)
    z = shown(page, "compare-plot-diff")
    # More positions than the plot's device pixels: pooled, at most a bin a pixel (test_long_rendering.py)
    pixels = page.evaluate("() => document.getElementById('compare-plot-diff')._fullLayout.xaxis._length * devicePixelRatio")
    assert z.shape[0] == z.shape[1] and 50 <= z.shape[1] <= pixels, (z.shape, pixels)
    zmax = page.evaluate("document.getElementById('compare-plot-diff').data[0].zmax")
    assert zmax == pytest.approx(float(np.abs(z).max()), rel=1e-6)
    # Its "i: token" labels stand apart (Plotly's own spacing overprinted them): each slanted x label
    # starts past the middle of the one before, each y label below the one above.
    for axis, along in (("xtick", 0), ("ytick", 1)):
        boxes = page.evaluate(f"""() => [...document.querySelectorAll('#compare-plot-diff .{axis} text')]
            .map((t) => t.getBoundingClientRect()).map((r) => [r.left, r.top, r.right, r.bottom])""")
        boxes.sort(key=lambda box: box[along])
        assert len(boxes) >= 5, boxes
        for before, after in zip(boxes, boxes[1:]):
            apart = after[0] - before[0] >= (before[2] - before[0]) / 2 if along == 0 else after[1] >= before[3] - 1
            assert apart, (axis, before, after)


def test_experiment_titles_sit_under_the_modebar_on_a_phone(server, browser):
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True, device_scale_factor=2)
    try:
        page = context.new_page()
        compare(page, server, "The bank of the river.", "The bank of the old river.")
        for plot in page.locator("#compare-box .js-plotly-plot").all():
            title, modebar = plot.locator(".gtitle").bounding_box(), plot.locator(".modebar").bounding_box()
            assert title["y"] >= modebar["y"] + modebar["height"] - 1, (title, modebar)
    finally:
        context.close()


def stream(base, body):
    with httpx.stream("POST", f"{base}/api/v1/generate", json=body, timeout=60) as r:
        return [json.loads(line) for line in r.iter_lines() if line]


def cell_pixel(page, plot_id, row, col) -> list[int]:
    """The colour on screen at the centre of a Plotly heatmap's cell (row, col), as [r, g, b]."""
    x, y = page.evaluate("""([id, row, col]) => {
        const gd = document.getElementById(id);
        const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
        return [box.left + gd._fullLayout.xaxis.l2p(col), box.top + gd._fullLayout.yaxis.l2p(row)];
    }""", [plot_id, row, col])
    png = page.screenshot(clip={"x": int(x), "y": int(y), "width": 1, "height": 1})
    return page.evaluate("""async (source) => {
        const image = new Image();
        image.src = 'data:image/png;base64,' + source;
        await image.decode();
        const canvas = document.createElement('canvas');
        canvas.width = canvas.height = 1;
        canvas.getContext('2d').drawImage(image, 0, 0);
        return [...canvas.getContext('2d').getImageData(0, 0, 1, 1).data].slice(0, 3);
    }""", base64.b64encode(png).decode())


def generate_on(page, base: str, model: str, n: int) -> None:
    """Opens the page, picks `model` and generates n tokens from PROMPT, to the end of the stream."""
    open_page(page, base)
    page.select_option("#model", model)
    page.fill("#gen-text", PROMPT)
    page.fill("#gen-n", str(n))
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='finished']", timeout=30_000)


def test_one_new_token_is_said_in_the_singular(server, page):
    generate_on(page, server, "tiny-causal", 1)
    assert page.locator("#gen-status").text_content() == "Finished: 1 new token from tiny-causal."


def test_a_refused_generation_takes_the_last_ones_picture_and_0_tokens_is_not_20(server, page):
    generate_on(page, server, "tiny-causal", 3)
    assert page.locator("#gen-position").text_content().startswith("Token 3 of 3")
    page.fill("#gen-n", "0")
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='failed']")
    # refused as the server's 422 is, not 20 tokens, in the form's words (it quoted the API's
    # "max_new_tokens: Input should be greater than or equal to 1")
    assert page.locator("#gen-status").text_content() == "Tokens: a whole number, 1 or more."
    assert page.locator("#gen-position").text_content() == ""
    assert page.evaluate("() => ['row', 'grow'].every((p) => !document.getElementById(`gen-${p}-plot`).data)")
    sent = []
    page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/api/v1/generate") else None)
    # 1000 too: over the box's max, the server's default bound (test_page_review_h52.py).
    for value, said in (("2.5", "Tokens: a whole number"), ("1000", "Tokens: at most 256 new tokens")):
        page.fill("#gen-n", value)
        page.click("#gen-start")
        page.wait_for_function("(said) => document.querySelector('#gen-status').textContent.includes(said)", arg=said)
    page.fill("#gen-n", "3")
    for value in ("-1", "100"):
        page.fill("#gen-temp", value)
        page.click("#gen-start")
        page.wait_for_function("() => document.querySelector('#gen-status').textContent === 'Temperature: a number from 0 (greedy) to 10.'")
        page.fill("#gen-temp", "0")
    assert sent == []


def test_a_seed_reaches_the_server_as_typed(server, page):
    """Number() rounded seeds past 2^53: 9007199254740993 went as ...992 (another sample than the
    API's for the typed seed) and the API's largest, 2^64 - 1, as a number it refuses."""
    sent = []
    page.on("request", lambda r: sent.append(r.post_data) if r.url.endswith("/api/v1/generate") else None)
    open_page(page, server)
    page.select_option("#model", "tiny-causal")
    page.fill("#gen-text", PROMPT)
    page.fill("#gen-n", "6")
    page.fill("#gen-temp", "1.5")
    for typed, seed in (("9007199254740993", 9007199254740993), ("18446744073709551615", 2**64 - 1), ("007", 7)):
        page.fill("#gen-seed", typed)
        page.click("#gen-start")
        # This generation's end: the box still said the last one's "finished" while this one ran.
        page.wait_for_function("() => !window.manyeyesGeneration.running && window.manyeyesGeneration.outcome === 'finished'",
                               timeout=30_000)
        assert json.loads(sent[-1])["seed"] == seed
        body = {"text": PROMPT, "model": "tiny-causal", "max_new_tokens": 6, "temperature": 1.5, "seed": seed}
        want = [e["token"]["id"] for e in stream(server, body) if e["type"] == "step"]
        assert page.evaluate("() => window.manyeyesGeneration.steps.map((s) => s.token.id)") == want
    page.fill("#gen-seed", "1.5")
    page.click("#gen-start")
    page.wait_for_function("() => document.getElementById('gen-status').textContent.startsWith('A seed')")
    assert page.locator("#gen-status").text_content() == "A seed is a whole number, 0 or more (empty: a random sample)."
    assert len(sent) == 3


def test_a_generation_the_model_ended_says_so_and_stop_at_end_of_text_is_sent(server, page):
    """An end line with reason "eos" (the model ended the text, fewer tokens than asked) is said in
    words, and "Stop at end of text", on by default, goes as stop_at_eos. tiny-causal's vocabulary
    has no end of text: the server's stream is cut to its first two steps and ended "eos"."""
    sent = []

    def ended_by_the_model(route):
        body = json.loads(route.request.post_data)
        sent.append(body)
        if not body["stop_at_eos"]:
            return route.continue_()
        reply = route.fetch()
        lines = [json.loads(line) for line in reply.text().splitlines() if line][:3]
        lines.append({"type": "end", "reason": "eos", "tokens": 2})
        route.fulfill(response=reply, body="".join(json.dumps(line) + "\n" for line in lines))

    page.route("**/api/v1/generate", ended_by_the_model)
    generate_on(page, server, "tiny-causal", 3)
    assert page.locator("#gen-status").text_content() == (
        "Finished: 2 new tokens from tiny-causal. Stopped: the model ended the text (end-of-text token) "
        "after 2 of the 3 tokens asked for.")
    assert page.evaluate("() => window.manyeyesGeneration.reason") == "eos"
    page.uncheck("#gen-eos")
    page.click("#gen-start")
    page.wait_for_function("() => !window.manyeyesGeneration.running && window.manyeyesGeneration.reason === 'length'")
    assert page.locator("#gen-status").text_content() == "Finished: 3 new tokens from tiny-causal."
    assert [body["stop_at_eos"] for body in sent] == [True, False]


def test_a_long_prompt_without_weights_draws_the_generated_rows_at_their_positions(server, page):
    """A long prompt's run keeps queries and keys (its answer has no weights): the page said
    "Something went wrong in the page" and numbered the generated rows from 0."""
    def as_a_long_run(route):
        reply = route.fetch()
        body = reply.json()
        body.update(attention=None, kept="qk")
        route.fulfill(response=reply, body=json.dumps(body))

    page.route("**/api/v1/attention", as_a_long_run)
    generate_on(page, server, "tiny-causal", 3)
    assert page.locator("#gen-status").text_content() == "Finished: 3 new tokens from tiny-causal."
    prompt_length = page.evaluate("() => window.manyeyesGeneration.start.prompt.length")
    grown = page.evaluate("() => { const d = document.getElementById('gen-grow-plot'); return [d.layout.title.text, d.data[0].y]; }")
    assert grown[0].endswith("the generated tokens' rows (the prompt's are not shown)")
    assert [label.split(":")[0] for label in grown[1]] == [str(prompt_length + i) for i in range(3)]
    # 3 rows under more keys: stretched over the plot's height, not square cells (1,320 keys made
    # 8 rows under a pixel tall).
    assert prompt_length + 3 > 2 * 3
    tall = page.evaluate("() => document.getElementById('gen-grow-plot')._fullLayout.yaxis._length")
    assert tall > 150, tall


def test_generate_then_step_back_shows_the_streamed_row(server, api, page, artifacts):
    generate_on(page, server, "tiny-causal", 12)
    steps = [e for e in stream(server, {"text": PROMPT, "model": "tiny-causal", "max_new_tokens": 12}) if e["type"] == "step"]
    assert len(steps) == 12
    assert page.get_attribute("#gen-row-plot", "data-index") == "11"
    for _ in range(3):
        page.click("#gen-back")
    page.wait_for_selector("#gen-row-plot[data-index='8']")
    want = f32(steps[8]["attention"]).reshape(-1, steps[8]["position"] + 1)
    assert same(shown(page, "gen-row-plot"), want)
    # The full heatmap so far: the prompt's rows (from /attention) over the 9 generated rows.
    page.wait_for_function("() => window.manyeyesGeneration.prompt !== null")
    prompt = api.post("/api/v1/attention", json={"text": PROMPT, "model": "tiny-causal", "layers": [0], "heads": [0],
                                                  "format": "json"}).json()["attention"]["data"][0][0]
    grown = page.evaluate("document.getElementById('gen-grow-plot').data[0].z")
    width = steps[8]["position"] + 1
    assert len(grown) == len(prompt) + 9 and all(len(row) == width for row in grown)
    # Each row's keys after its own token are null: masked, one way, for the prompt's rows (whose
    # zeros there drew as weights of 0) as for the generated ones.
    for r, (got, want) in enumerate(zip(grown, prompt)):
        assert same(f32(got[: r + 1]), f32(want[: r + 1])) and got[r + 1:] == [None] * (width - r - 1)
    for k, row in enumerate(grown[len(prompt):]):
        position = len(prompt) + k
        assert None not in row[: position + 1] and row[position + 1:] == [None] * (width - position - 1)
    assert same(f32(grown[-1]), f32(steps[8]["attention"][0][0]))
    # Drawn as the focused heatmap draws masked cells, in the theme's masked colour, with no gridlines.
    masked = page.evaluate("async () => (await import('/static/js/theme.js')).palette().masked")
    want = [int(masked[i:i + 2], 16) for i in (1, 3, 5)]
    assert cell_pixel(page, "gen-grow-plot", 0, 1) == want  # a prompt row's later key
    assert cell_pixel(page, "gen-grow-plot", 0, width - 1) == want  # a generated token's column
    assert page.evaluate("() => { const l = document.getElementById('gen-grow-plot')._fullLayout;"
                         " return [l.xaxis.showgrid, l.yaxis.showgrid]; }") == [False, False]
    assert page.inner_text("#gen-tokens .chip.current") == steps[8]["token"]["text"]
    page.locator("#generate-box").screenshot(path=str(artifacts / "experiments-generate.png"))
    page.click("#gen-play")
    page.wait_for_selector("#gen-row-plot[data-index='11']", timeout=10_000)
    assert page.inner_text("#gen-play") == "Play"  # it paused itself at the last token


def test_generate_is_off_with_the_reason_while_the_model_reads_both_ways(server, page, watched):
    """With MiniLM shown, Generate stayed enabled: a click cost a 422 and a console error."""
    refused = []
    page.on("response", lambda r: r.status >= 400 and refused.append(r.url))
    open_page(page, server)
    page.select_option("#model", "minilm")
    start, why = page.locator("#gen-start"), page.locator("#gen-why")
    page.wait_for_function("() => document.getElementById('gen-start').disabled")
    assert why.inner_text() == "Off: minilm is not a causal model (it reads both ways), so it does not generate. Pick a causal model to use it."
    assert start.get_attribute("title") == why.inner_text() and start.get_attribute("aria-describedby") == "gen-why"
    page.select_option("#model", "tiny-causal")
    page.wait_for_function("() => !document.getElementById('gen-start').disabled")
    assert why.is_hidden()
    # A shown run decides, not the form: MiniLM on screen keeps it off whatever the form holds now.
    run(page, SENTENCE, "minilm")
    page.select_option("#model", "tiny-causal")
    page.wait_for_function("() => document.getElementById('gen-start').disabled")
    assert why.inner_text().startswith("Off: minilm is not a causal model") and why.inner_text().endswith("Run a causal model to use it.")
    page.fill("#gen-text", PROMPT)
    page.press("#gen-text", "Enter")  # Enter in the prompt is refused too
    run(page, PROMPT, "tiny-causal")
    page.wait_for_function("() => !document.getElementById('gen-start').disabled")
    assert not any("/generate" in url for url in refused) and watched.errors == []


@pytest.fixture(scope="module")
def slow_server(causal_model_spec):
    """A server whose generation waits 0.2 s after each step, so that Stop lands mid-stream."""
    with serving({"tiny-causal": causal_model_spec}, env={"MANYEYES_DEBUG_FORWARD_DELAY_S": "0.2", "MANYEYES_WARMUP": "false"}) as base:
        yield base


def metric(base, name, **labels):
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
               for s in f.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def generating(page, base: str, n: int, steps: int) -> None:
    """A fresh page generates n tokens from PROMPT on the slow server; back once `steps` have come.
    Several lines can arrive in one read, so it waits on the count, not on one particular index."""
    page.goto(f"{base}/")
    page.wait_for_selector("#gen-start")
    page.fill("#gen-text", PROMPT)
    page.fill("#gen-n", str(n))
    page.click("#gen-start")
    page.wait_for_function(f"() => window.manyeyesGeneration.steps.length >= {steps}", timeout=30_000)


def test_stop_aborts_the_stream_and_the_server_stops(slow_server, page):
    generating(page, slow_server, 55, steps=2)
    page.click("#gen-stop")
    page.wait_for_selector("#generate-box[data-outcome='stopped']", timeout=10_000)
    shown_steps = page.evaluate("window.manyeyesGeneration.steps.length")
    assert 2 <= shown_steps < 55
    deadline = time.monotonic() + 20
    while metric(slow_server, "manyeyes_generations_total", outcome="cancelled") < 1:
        assert time.monotonic() < deadline, "the server never recorded the cancelled generation"
        time.sleep(0.1)
    made = metric(slow_server, "manyeyes_generation_steps_total")
    time.sleep(1.0)  # five more step delays: a generation still running would have made more
    # The server may be a few steps ahead of what a busy page has drawn, never near the 55 asked for.
    assert metric(slow_server, "manyeyes_generation_steps_total") == made < min(shown_steps + 15, 55)
    assert "Stopped after" in page.inner_text("#gen-status")


@pytest.mark.parametrize("reason, error", [("error", "generation stopped: out of memory"),
                                           ("shutdown", "the server is shutting down; generate again shortly")])
def test_a_stream_that_ends_early_says_so(server, page, reason, error):
    """The server's last line names a failed step, or its shutdown: the page says so rather than
    'Finished' (a shutdown's line read as a finished generation)."""
    real = [json.dumps(line) for line in stream(server, {"text": PROMPT, "model": "tiny-causal", "max_new_tokens": 1})]
    assert [line["type"] for line in map(json.loads, real)] == ["start", "step", "end"]
    failed = json.dumps({"type": "end", "reason": reason, "tokens": 1, "error": error})
    page.route("**/api/v1/generate", lambda route: route.fulfill(
        status=200, content_type="application/x-ndjson", body="\n".join([*real[:2], failed]) + "\n"))
    open_page(page, server)
    page.select_option("#model", "tiny-causal")  # the default, MiniLM, does not generate
    page.fill("#gen-text", PROMPT)
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='failed']", timeout=30_000)
    assert page.inner_text("#gen-status") == f"The server stopped after 1 token: {error}"
    assert page.get_attribute("#gen-status", "data-kind") == "error"



def test_a_stream_cut_off_without_its_end_line_is_not_finished(server, page):
    """A body that ends after its steps with no end line (a proxy's timeout, a server that
    stopped) read "Finished: 1 new tokens", as if every token asked for had come."""
    real = [json.dumps(line) for line in stream(server, {"text": PROMPT, "model": "tiny-causal", "max_new_tokens": 1})]
    page.route("**/api/v1/generate", lambda route: route.fulfill(
        status=200, content_type="application/x-ndjson", body="\n".join(real[:2]) + "\n"))
    open_page(page, server)
    page.select_option("#model", "tiny-causal")
    page.fill("#gen-text", PROMPT)
    page.fill("#gen-n", "5")
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='failed']", timeout=30_000)
    assert page.inner_text("#gen-status") == "The stream was cut off after 1 token of 5, before the server's end line: generate again."
    assert page.get_attribute("#gen-status", "data-kind") == "error"
    assert page.inner_text("#gen-position").startswith("Token 1 of 1")  # the step that came is shown


def test_the_last_generations_late_prompt_rows_are_not_drawn_under_the_next(server, api, page):
    """The prompt's rows come from /attention after the stream starts. One that came back after
    the next generation began (same token count, another prompt) replaced that one's rows."""
    first, second = "the river bank", "the money bank"
    held = []
    page.route("**/api/v1/attention", lambda route: held.append(route) if json.loads(route.request.post_data)["text"] == first
               else route.continue_())
    open_page(page, server)
    page.select_option("#model", "tiny-causal")
    page.fill("#gen-n", "3")
    page.fill("#gen-text", first)
    page.click("#gen-start")
    page.wait_for_function("() => window.manyeyesGeneration.outcome === 'finished'", timeout=30_000)
    assert len(held) == 1
    page.fill("#gen-text", second)
    page.click("#gen-start")
    page.wait_for_function("() => !window.manyeyesGeneration.running && window.manyeyesGeneration.outcome === 'finished'"
                           " && window.manyeyesGeneration.prompt !== null", timeout=30_000)
    try:
        held[0].continue_()  # the first generation's rows come back now (if it still wants them)
    except Exception:  # noqa: BLE001  its request was given up: nothing to answer
        pass
    page.wait_for_timeout(1000)

    def rows(text):
        return api.post("/api/v1/attention", json={"text": text, "model": "tiny-causal", "layers": [0], "heads": [0],
                                                   "format": "json"}).json()["attention"]["data"][0][0]

    want, other = rows(second), rows(first)
    assert len(want) == len(other) and not same(f32(want[-1]), f32(other[-1]))
    grown = page.evaluate("document.getElementById('gen-grow-plot').data[0].z")
    for r, row in enumerate(want):
        assert same(f32(grown[r][: r + 1]), f32(row[: r + 1])), r


def test_stepping_back_mid_stream_keeps_counting_the_tokens_that_come(slow_server, page):
    """Stepped back while the stream ran, the line said "Token 6 of 7" while 12 had come."""
    generating(page, slow_server, 12, steps=3)
    page.click("#gen-back")
    shown = page.evaluate("window.manyeyesGeneration.current")
    page.wait_for_selector("#generate-box[data-outcome='finished']", timeout=30_000)
    assert page.evaluate("window.manyeyesGeneration.current") == shown  # it stays where it was stepped back to
    assert page.inner_text("#gen-position").startswith(f"Token {shown + 1} of 12:")

# ---- found by trying the page as a user ----------------------------------------------------------


def test_the_panels_follow_the_run_on_screen_not_the_form(server, api, page):
    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    page.click("#grid .thumb[data-layer='0'][data-head='2']", modifiers=["Alt"])
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    # The Δ log p table is a table (it shared the prediction strip's class and was laid out as a flex row).
    assert page.evaluate("getComputedStyle(document.querySelector('#ablate-predictions table')).display") == "table"
    page.click("#token-load")
    page.wait_for_selector("#token-chips button[data-index='1']")
    assert page.input_value("#token-change") == "delete"  # a causal model has no mask token

    # Another run: nothing of the causal model's experiments stays on screen.
    run(page, SENTENCE, "minilm")
    assert page.input_value("#token-change") == "mask"
    page.wait_for_selector("#ablate-plot[data-depth='0']")
    assert page.locator("#ablate-plot .main-svg").count() == 0
    assert page.inner_text("#ablate-list") == "" and page.locator("#token-chips button").count() == 0
    assert page.inner_text("#ablate-predictions") == "" and page.inner_text("#ablate-ranking") == ""

    # A model picked in the form but not run: the panels still act on the run shown (MiniLM, L5 H11).
    page.select_option("#layer", "5")
    page.select_option("#head", "11")
    page.select_option("#model", "tiny-causal")
    page.click("#ablate-add")
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    assert page.inner_text("#ablate-list") == "L5 H11 · zero"
    assert page.evaluate("window.manyeyesExperiments.ablation.input.model") == "minilm"
    # The same head again is no new undo step (it was one that undid nothing).
    page.click("#ablate-add")
    page.wait_for_function("() => document.getElementById('ablate-status').textContent.includes('already ablated')")
    assert page.get_attribute("#ablate-plot", "data-depth") == "1"
    page.click("#token-load")
    page.wait_for_selector("#token-chips button[data-index='1']")
    reply = api.post("/api/v1/attention", json={"text": SENTENCE, "model": "minilm", "layers": [0], "heads": [0], "format": "u8"}).json()
    assert page.locator("#token-chips button").count() == len(reply["tokens"])


def test_experiment_heatmaps_read_in_the_dark_theme(server, page, artifacts):
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    page.click("#grid .thumb[data-layer='1'][data-head='4']", modifiers=["Alt"])
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    font = "() => document.getElementById('ablate-plot').layout.font.color"
    light = page.evaluate(font)
    page.select_option("#theme", "dark")
    # Redrawn in the dark theme's text colour (Plotly's default dark grey was unreadable there).
    page.wait_for_function(f"() => ({font})() !== {json.dumps(light)}")
    assert page.evaluate(font) == "#e6edf3"
    page.locator("#ablate-box").screenshot(path=str(artifacts / "experiments-dark.png"))


def test_enter_twice_in_the_prompt_runs_one_generation(slow_server, page):
    # 0.2 s a step: the second Enter lands while the first stream runs (a fast model may finish between them).
    open_page(page, slow_server)
    page.fill("#gen-text", PROMPT)
    page.fill("#gen-n", "8")
    asked = []
    page.on("request", lambda r: r.url.endswith("/api/v1/generate") and asked.append(r.url))
    page.press("#gen-text", "Enter")
    page.press("#gen-text", "Enter")  # a second stream once interleaved its steps with the first's
    page.wait_for_selector("#generate-box[data-outcome='finished']", timeout=30_000)
    positions = page.evaluate("window.manyeyesGeneration.steps.map((s) => s.position)")
    assert len(positions) == 8 and positions == sorted(positions) and len(set(positions)) == 8, positions
    assert page.inner_text("#gen-status") == "Finished: 8 new tokens from tiny-causal." and len(asked) == 1


def test_generate_and_stop_hand_keyboard_focus_to_each_other(slow_server, page):
    open_page(page, slow_server)
    page.fill("#gen-text", PROMPT)
    page.fill("#gen-n", "4")
    page.focus("#gen-start")
    page.keyboard.press("Enter")
    page.wait_for_function("() => window.manyeyesGeneration.running")
    assert page.evaluate("() => document.activeElement.id") == "gen-stop"
    page.wait_for_selector("#generate-box[data-outcome='finished']", timeout=30_000)
    assert page.evaluate("() => document.activeElement.id") == "gen-start"
    # At the first token ◀ disables itself: focus moves on to ▶.
    page.focus("#gen-back")
    while not page.locator("#gen-back").is_disabled():
        page.keyboard.press("Enter")
    assert page.evaluate("() => document.activeElement.id") == "gen-forward"
    assert page.locator("#gen-back").get_attribute("aria-label") == "Step back"


def test_causal_experiment_heatmaps_draw_later_keys_masked_not_as_zeros(server, api, page, artifacts):
    """The ablation and compare heatmaps of a causal model drew the keys after each row's token
    (the API's zeros) as weights of 0, white in the light theme, and read them as 0.0000 on hover;
    every other view of the page (the focus, the thumbnails, the generation heatmap) greys them."""
    open_page(page, server)
    run(page, PROMPT, "tiny-causal")
    reply = alt_ablate(page, api, PROMPT, "tiny-causal", 0, 2)
    layer, head = int(page.get_attribute("#ablate-plot", "data-layer")), int(page.get_attribute("#ablate-plot", "data-head"))
    z = shown(page, "ablate-plot")
    later = np.triu(np.ones(z.shape, dtype=bool), k=1)
    assert np.isnan(z[later]).all(), "keys after the query's token are drawn as weights"
    assert same(z[~later], f32(reply["attention"]["data"][layer][head])[~later])

    page.fill("#compare-a", PROMPT)
    page.fill("#compare-b", "the river bend")
    page.click("#compare-run")
    page.wait_for_selector("#compare-plot-diff[data-ready='true']", timeout=30_000)
    for plot in ("compare-plot-a", "compare-plot-b", "compare-plot-diff"):
        z = shown(page, plot)
        later = np.triu(np.ones(z.shape, dtype=bool), k=1)
        assert np.isnan(z[later]).all(), plot
        assert not np.isnan(z[~later]).any(), plot
    page.locator("#experiments").screenshot(path=str(artifacts / "experiments-causal-masked.png"))


@pytest.fixture(scope="module")
def two_causal_server(causal_model_spec):
    """Two causal models of different widths: tiny-causal (2 layers × 4 heads), tiny-gpt (2 × 8)."""
    with serving({"tiny-causal": causal_model_spec, "tiny-gpt": "tiny-gpt"}) as base:
        yield base


def gen_menus(page, heads=None) -> tuple[int, int, str, str]:
    """Generate's layer and head menus: (layers, heads, chosen layer, chosen head), once the head
    menu has `heads` entries if given (or as they stayed after 5 s)."""
    if heads is not None:
        try:
            page.wait_for_function("(n) => document.getElementById('gen-head').options.length === n", arg=heads, timeout=5_000)
        except Exception:
            pass  # the caller's assertion says what the menus held
    return tuple(page.evaluate("""() => { const [l, h] = ['gen-layer', 'gen-head'].map((id) => document.getElementById(id));
        return [l.options.length, h.options.length, l.value, h.value]; }"""))


def test_generate_menus_hold_the_layers_and_heads_of_the_model_in_use(two_causal_server, make_page, artifacts):
    """The menus kept the last generation's model: switched from tiny-gpt (8 heads) to tiny-causal
    (4), they offered H4-H7 until Generate was pressed again, and before any generation they were empty."""
    page = make_page()
    generate_on(page, two_causal_server, "tiny-gpt", 3)
    page.select_option("#gen-layer", "1")
    page.select_option("#gen-head", "6")
    assert gen_menus(page) == (2, 8, "1", "6")

    # No run on screen: the form's model is the one Generate uses. H6 is gone, L1 stays.
    page.select_option("#model", "tiny-causal")
    assert gen_menus(page, heads=4) == (2, 4, "1", "0"), "the menus kept tiny-gpt's heads"
    # The last model's generation went with it (its rows were 8 heads wide).
    assert page.locator("#gen-grow-plot .main-svg").count() == 0 and page.inner_text("#gen-tokens") == ""
    page.select_option("#gen-head", "3")
    page.select_option("#model", "tiny-gpt")
    assert gen_menus(page, heads=8) == (2, 8, "1", "3")
    page.locator("#generate-box").screenshot(path=str(artifacts / "generate-menus.png"))

    # A run on screen decides, not the form (currentModel).
    run(page, PROMPT, "tiny-causal")
    assert gen_menus(page, heads=4) == (2, 4, "1", "3")
    page.select_option("#model", "tiny-gpt")
    page.wait_for_timeout(300)
    assert gen_menus(page) == (2, 4, "1", "3")
    run(page, PROMPT, "tiny-gpt")
    assert gen_menus(page, heads=8) == (2, 8, "1", "3")

    # Before any generation: the model's menus, not empty ones.
    fresh = make_page()
    open_page(fresh, two_causal_server)
    fresh.select_option("#model", "tiny-gpt")
    assert gen_menus(fresh, heads=8) == (2, 8, "0", "0")


def test_generate_after_a_run_cut_to_fit_starts_from_the_kept_tokens(server, api, page, artifacts):
    """An empty prompt after a run cut to fit posted the whole uncut text, and the 422 said "shorten
    it. Shorten it, or tick “Cut to fit”", a box already ticked that generation does not read."""
    text = " ".join([SENTENCE] * 8)  # about 100 tokens; tiny-causal takes 64
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/api/v1/generate") else None)
    open_page(page, server)
    page.check("#truncate")
    run(page, text, "tiny-causal")
    assert "(cut to fit)" in page.text_content("#focus-caption")
    page.fill("#gen-n", "10")
    page.click("#gen-start")
    page.wait_for_function("() => !window.manyeyesGeneration.running && window.manyeyesGeneration.outcome", timeout=30_000)

    # The kept tokens that leave room for 10 new ones ([CLS] and [SEP] come again with the prompt).
    cut = api.post("/api/v1/attention", json={"text": text, "model": "tiny-causal", "truncate": True,
                                              "layers": [0], "heads": [0], "format": "u8"}).json()
    words = [t for t in cut["tokens"] if not t["special"]]
    assert len(cut["tokens"]) == 64 and cut["truncated"]
    prompt = text[:words[64 - 10 - 2 - 1]["end"]]
    assert sent[-1]["text"] == prompt and sent[-1]["max_new_tokens"] == 10
    assert "truncate" not in sent[-1]  # the API's generate takes none
    assert page.get_attribute("#generate-box", "data-outcome") == "finished"
    prompt_tokens = page.evaluate("() => window.manyeyesGeneration.start.prompt.length")
    assert prompt_tokens == 54
    assert page.text_content("#gen-status") == (
        "Finished: 10 new tokens from tiny-causal, after the start of the run's text (54 tokens): "
        "the whole run and the new tokens would not fit in tiny-causal's 64 positions.")
    assert page.locator("#gen-tokens .chip").count() == 64
    page.locator("#generate-box").screenshot(path=str(artifacts / "generate-after-cut-run.png"))

    # A typed prompt over the context: the server's count once, advice that fits generation.
    page.fill("#gen-text", text)
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='failed']")
    message = page.text_content("#gen-status")
    assert sent[-1]["text"] == text
    assert message.startswith("Prompt too long: the prompt is ") and "tiny-causal takes at most 64" in message
    assert message.endswith(". Write a shorter prompt, leaving room for the new tokens.")
    assert "Cut to fit" not in message and "shorten it" not in message.lower()

    # No room at all for a prompt: said before anything is posted.
    page.fill("#gen-text", "")
    page.fill("#gen-n", "63")
    page.click("#gen-start")
    page.wait_for_function("() => document.getElementById('gen-status').textContent.startsWith('63 new tokens')")
    assert page.text_content("#gen-status") == "63 new tokens leave no room for a prompt in tiny-causal's 64 positions: ask for at most 61."
    assert len(sent) == 2


def test_generate_after_a_cut_run_of_many_byte_characters_fits_its_room(two_causal_server, make_page):
    """Two bytes a character on tiny-gpt: the prompt was cut after the last kept token, whose
    character spans both of its bytes, so it kept one byte more than the room: a 422 "236 prompt
    tokens + 21 new tokens exceed tiny-gpt's context of 256"."""
    page = make_page()
    open_page(page, two_causal_server)
    page.check("#truncate")
    run(page, "é" * 200, "tiny-gpt")  # 400 byte tokens, cut to 256
    for n in (21, 20):  # the room ends inside a character, then after one
        page.fill("#gen-n", str(n))
        page.click("#gen-start")
        page.wait_for_function("() => !window.manyeyesGeneration.running && window.manyeyesGeneration.outcome", timeout=60_000)
        assert page.get_attribute("#generate-box", "data-outcome") == "finished", page.text_content("#gen-status")
        prompt = page.evaluate("() => window.manyeyesGeneration.start.prompt.length")
        assert prompt == 2 * ((256 - n) // 2), prompt  # whole characters only, as many as fit

    # Room for one token, and the first character is two: the page posted an empty prompt, and the
    # server's "text: String should have at least 1 character" answered it.
    sent = []
    page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/api/v1/generate") else None)
    page.fill("#gen-n", "255")
    page.click("#gen-start")
    page.wait_for_function("() => document.getElementById('gen-status').textContent.startsWith('255 new tokens')")
    assert page.text_content("#gen-status") == ("255 new tokens leave no room for the prompt's first character "
                                                "(2 tokens) in tiny-gpt's 256 positions: ask for at most 254.")
    assert sent == []


def ablate_focused(page, layer, head, depth):
    page.select_option("#layer", str(layer))
    page.select_option("#head", str(head))
    page.click("#ablate-add")
    page.wait_for_selector(f"#ablate-plot[data-depth='{depth}'][data-state='ablated']", timeout=30_000)
    page.wait_for_function("(n) => window.manyeyesExperiments.ablation.stack.length === n && !window.manyeyesExperiments.ablation.busy",
                           arg=depth)


def ablate_shown(page) -> tuple[tuple[int, int], str]:
    plot = page.locator("#ablate-plot")
    title = page.evaluate("() => document.getElementById('ablate-plot').layout.title.text")
    return (int(plot.get_attribute("data-layer")), int(plot.get_attribute("data-head"))), title


def test_each_new_ablation_shows_a_head_it_changes(server, api, page, artifacts):
    """The first ablation's head stayed shown for good: after Restore all, ablating L4 H0 showed
    "L3 H1, after ablating L4 H0", a head before the ablated layer, with its clean weights."""
    def top(ablate):
        reply = api.post("/api/v1/experiments/ablate", json={"text": SENTENCE, "model": "minilm", "ablate": ablate}).json()
        return (reply["ranking"][0]["layer"], reply["ranking"][0]["head"])

    zero = lambda layer, head: {"layer": layer, "head": head, "mode": "zero"}  # noqa: E731
    open_page(page, server)
    run(page, SENTENCE, "minilm")
    ablate_focused(page, 2, 5, 1)
    assert ablate_shown(page)[0] == top([zero(2, 5)])
    # Square cells, in a figure no wider than its cells, bar and title need: at the panel's width
    # and a fixed height a sentence's cells were drawn about 5 times as wide as tall.
    cell_w, cell_h, figure, panel = page.evaluate("""() => {
        const gd = document.getElementById('ablate-plot'), n = gd.data[0].z.length;
        return [gd._fullLayout.xaxis._length / n, gd._fullLayout.yaxis._length / n, gd._fullLayout.width, gd.clientWidth];
    }""")
    assert cell_w == pytest.approx(cell_h, rel=0.02) and figure < panel, (cell_w, cell_h, figure, panel)
    page.focus("#ablate-clear")
    page.keyboard.press("Enter")
    page.wait_for_selector("#ablate-plot[data-depth='0'][data-state='clean']")
    assert page.text_content("#ablate-status") == "Restored: no head ablated."
    assert page.evaluate("() => document.activeElement.id") == "ablate-mode"  # not the page's body

    ablate_focused(page, 4, 0, 1)
    want = top([zero(4, 0)])
    assert want[0] == 5
    assert ablate_shown(page) == (want, f"L{want[0]} H{want[1]}, after ablating L4 H0 (zero)")
    page.locator("#ablate-box").screenshot(path=str(artifacts / "ablate-after-restore-all.png"))

    # A head added to the stack: the shown head stays while the ablation still changes it...
    ablate_focused(page, 1, 2, 2)
    assert ablate_shown(page)[0] == want
    # ...a head picked in the ranking too, until an undo leaves an ablation that cannot change it.
    page.click("#ablate-ranking tr[data-layer='2'][data-head='3'] button")
    assert ablate_shown(page)[0] == (2, 3)
    page.click("#ablate-undo")
    page.wait_for_selector("#ablate-plot[data-depth='1']")
    assert ablate_shown(page) == (want, f"L{want[0]} H{want[1]}, after ablating L4 H0 (zero)")

    # Undo back to the clean run, then a head of the last layer: no later head, so that head.
    page.click("#ablate-undo")
    page.wait_for_selector("#ablate-plot[data-depth='0'][data-state='clean']")
    ablate_focused(page, 5, 11, 1)
    assert ablate_shown(page) == ((5, 11), "L5 H11, after ablating L5 H11 (zero): weights unchanged")


@pytest.fixture(scope="module")
def gpt_server():
    """MiniLM (a mask and an unknown token) and tiny-gpt (neither)."""
    with serving({"minilm": "minilm", "tiny-gpt": "tiny-gpt"}) as base:
        yield base


def token_menu(page) -> list[tuple[str, str, bool]]:
    return [tuple(o) for o in page.evaluate(
        "() => [...document.getElementById('token-change').options].map((o) => [o.value, o.textContent, o.disabled])")]


def test_change_a_token_offers_only_what_the_model_has(gpt_server, page, artifacts):
    """"unknown token" picked on a MiniLM run stayed picked on tiny-gpt, which has none, and every
    click failed with "tiny-gpt has no unk token"; mask and unknown were offered on it throughout."""
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/experiments/change-token") else None)
    open_page(page, gpt_server)
    run(page, SENTENCE, "minilm")
    page.select_option("#token-change", "unk")
    run(page, PROMPT, "tiny-gpt")
    page.wait_for_function("() => document.querySelector('#token-change option[value=unk]').disabled", timeout=10_000)
    assert page.input_value("#token-change") == "delete"
    assert token_menu(page) == [("mask", "mask (tiny-gpt has none)", True), ("unk", "unknown token (tiny-gpt has none)", True),
                                ("delete", "delete", False)]
    page.click("#token-load")
    page.wait_for_selector("#token-chips button[data-index='3']")
    page.click("#token-chips button[data-index='3']")
    page.wait_for_selector("#token-result[data-index='3'] table.ranking", timeout=30_000)
    assert [b["change"] for b in sent if b["text"] == PROMPT] == ["delete"]
    assert page.text_content("#token-status").startswith("Done on tiny-gpt: token 3 deleted; L")
    page.evaluate("() => document.getElementById('token-change').size = 3")  # the options on show, for the picture
    page.locator("#token-box").screenshot(path=str(artifacts / "token-change-tiny-gpt.png"))
    page.evaluate("() => document.getElementById('token-change').removeAttribute('size')")

    # Back on MiniLM, the pick comes back with the options it has.
    run(page, SENTENCE, "minilm")
    assert page.input_value("#token-change") == "unk"
    assert token_menu(page) == [("mask", "mask", False), ("unk", "unknown token", False), ("delete", "delete", False)]


def test_a_refused_change_turns_its_option_off(gpt_server, page):
    """Where the models list does not say what a model has (a server from before `token_changes`),
    the refusal of a click says what it lacks, and the menu follows it."""
    def older(route):
        body = route.fetch().json()
        for model in body["models"]:
            del model["token_changes"]
        route.fulfill(json=body)

    page.route("**/api/v1/models", older)
    open_page(page, gpt_server)
    run(page, PROMPT, "tiny-gpt")
    page.wait_for_timeout(300)
    assert not page.is_disabled("#token-change option[value=unk]")  # unknown: offered
    page.select_option("#token-change", "unk")
    page.click("#token-load")
    page.click("#token-chips button[data-index='3']")
    page.wait_for_function("() => document.getElementById('token-status').dataset.kind === 'error'", timeout=30_000)
    assert page.text_content("#token-status") == "Cannot run this input: tiny-gpt has no unk token."
    assert page.input_value("#token-change") == "delete"
    assert ("unk", "unknown token (tiny-gpt has none)", True) in token_menu(page)


def test_an_experiments_heatmap_is_read_cell_by_cell_with_the_arrows(server, api, page):
    """Only a mouse could read the ablation, compare and generation heatmaps (a review by keyboard)."""
    reply = compared(page, server, api, "The bank of the river.", "The bank of the old river.")
    top = reply["ranking"][0]
    diff = f32(reply["difference"]["data"][top["layer"]][top["head"]])
    plot = page.locator("#compare-plot-diff")
    assert plot.get_attribute("tabindex") == "0" and "arrow keys read its cells" in plot.get_attribute("aria-label")
    plot.focus()
    said = lambda: page.evaluate("() => document.getElementById('compare-plot-diff').nextElementSibling.textContent")  # noqa: E731
    page.keyboard.press("ArrowRight")  # from nowhere: the top-left cell
    shown = lambda v: f"{0.0 if abs(v) < 5e-5 else v:.4f}"  # noqa: E731  (never "-0.0000")
    assert said() == f"0: [CLS] → 0: [CLS]: {shown(diff[0, 0])}", said()
    for key in ("ArrowRight", "ArrowDown", "ArrowDown"):
        page.keyboard.press(key)
    rows = page.evaluate("() => document.getElementById('compare-plot-diff').data[0].y")
    cols = page.evaluate("() => document.getElementById('compare-plot-diff').data[0].x")
    assert said() == f"{rows[2]} → {cols[1]}: {shown(diff[2, 1])}", said()
    # Outlined over the cell it reads, within the plot: placed from the page's origin it stood
    # 1,000 px above the page, "visible" all the same.
    outline, at = page.evaluate("""() => {
      const d = document.getElementById('compare-plot-diff'), o = d.querySelector('.cell-cursor');
      const xa = d._fullLayout.xaxis, ya = d._fullLayout.yaxis, box = d.getBoundingClientRect(), r = o.getBoundingClientRect();
      return [[r.left + r.width / 2, r.top + r.height / 2], [box.left + xa._offset + xa.l2p(1), box.top + ya._offset + ya.l2p(2)]];
    }""")
    assert abs(outline[0] - at[0]) < 1 and abs(outline[1] - at[1]) < 1, (outline, at)
    page.keyboard.press("Escape")
    assert said() == "" and not page.locator("#compare-plot-diff .cell-cursor").is_visible()
