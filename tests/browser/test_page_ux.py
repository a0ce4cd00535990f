"""Issue 13: the page tried as a new user would. One test (or more) per numbered defect; each fails
on the page as it was before the fix. Screenshots go to test-artifacts/ to be looked at."""

from __future__ import annotations

import base64
import re
from urllib.parse import urlsplit

import numpy as np
import pytest

from tests.browser.conftest import LOOPBACK, serving
from tests.browser.test_page import (
    PAIR, SENTENCE, focus_title, hover_cell, open_page, plotted, plotted_zmax, run, submit, wait_focus, wait_grid, wait_plotted_shape,
    wait_saved,
)

pytestmark = pytest.mark.browser

WORDS = "the river bank was muddy after heavy rain and every boat stayed close to the shore".split()


def text_of_tokens(api, n: int, model: str = "minilm") -> str:
    """A text that the model splits into exactly n tokens, specials included."""
    words = list(WORDS)
    while True:
        text = " ".join(words)
        count = len(api.post("/api/v1/attention", json={"text": text, "model": model, "layers": [0], "heads": [0], "format": "u8"}).json()["tokens"])
        if count == n:
            return text
        if count < n:
            words += WORDS[: max(1, (n - count) // 2)] if n - count > 2 else [WORDS[len(words) % len(WORDS)]]
        else:
            words.pop()


def f16_attention(api, text, layers, heads=None, pair=None):
    body = {"text": text, "model": "minilm", "format": "f16", "layers": layers}
    if heads is not None:
        body["heads"] = heads
    if pair:
        body["text_pair"] = pair
    data = api.post("/api/v1/attention", json=body).json()
    raw = np.frombuffer(base64.b64decode(data["attention"]["data"]), dtype="<f2").astype(np.float64)
    return data["tokens"], raw.reshape(data["attention"]["shape"])


def tick_texts(page, axis="y"):
    return page.locator(f"#focus-plot .{axis}tick text").all_text_contents()


def label_spacing(page, plot: str, axis: str) -> tuple[float, float]:
    """The closest two neighbouring labels of an axis (px between their anchors) and the largest
    label font (px) of the page-drawn labels (axis_labels.js) in `plot`."""
    return tuple(page.evaluate(
        """([plot, axis]) => {
            const groups = [...document.querySelectorAll(`${plot} .axis-labels .${axis}tick`)].filter((g) => g.style.display !== 'none');
            const at = groups.map((g) => Number(g.getAttribute('transform').match(/translate\\(([-\\d.e]+) ([-\\d.e]+)\\)/)[axis === 'x' ? 1 : 2]))
                .sort((a, b) => a - b);
            const gaps = at.slice(1).map((v, i) => v - at[i]);
            return [Math.min(...gaps), Math.max(...groups.map((g) => parseFloat(g.querySelector('text').style.fontSize)))];
        }""",
        [plot, axis],
    ))


# ---- 1. privacy ---------------------------------------------------------------------------------


def test_no_modebar_button_or_link_leaves_this_machine(server, page, watched, artifacts):
    popups = []
    page.context.on("page", lambda p: popups.append(p.url))
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    titles = []
    page.hover("#focus-plot")
    buttons = page.locator("#focus-plot .modebar-btn")
    page.locator("#focus-plot").screenshot(path=str(artifacts / "modebar.png"))
    for i in range(buttons.count()):
        button = buttons.nth(i)
        titles.append(button.get_attribute("data-title"))
        page.hover("#focus-plot")
        button.click()
        page.wait_for_timeout(150)
    assert not any("share" in (t or "").lower() or "cloud" in (t or "").lower() for t in titles), titles
    assert page.locator("#focus-plot a[href*='plotly']").count() == 0
    links = page.locator("a[href]")
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    for href in hrefs:
        open_page(page, server)
        link = page.locator(f"a[href='{href}']").first
        link.focus()  # the skip link is drawn only while it has focus
        link.click()
        page.wait_for_load_state()
        assert urlsplit(page.url).hostname in LOOPBACK, page.url
    page.wait_for_timeout(300)
    assert popups == []
    assert watched.off_loopback() == []


# ---- 2. labels and zoom -------------------------------------------------------------------------


def test_every_label_is_shown_up_to_64_tokens_and_zoom_survives_arrow_keys(server, api, page, artifacts):
    text = text_of_tokens(api, 57)
    open_page(page, server)
    run(page, text)
    assert len(tick_texts(page, "y")) == 57 and len(tick_texts(page, "x")) == 57
    page.evaluate("() => Plotly.relayout('focus-plot', {'xaxis.range': [9.5, 39.5], 'yaxis.range': [39.5, 9.5]})")
    page.wait_for_function("() => document.querySelectorAll('#focus-plot .ytick text').length === 30")
    page.focus("#focus-plot")
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=1)
    assert page.evaluate("() => document.getElementById('focus-plot').layout.xaxis.range") == [9.5, 39.5]
    ticks = page.locator("#focus-plot .ytick text")
    assert ticks.count() == 30
    boxes = [ticks.nth(i).bounding_box() for i in range(30)]
    sizes = page.evaluate("() => [...document.querySelectorAll('#focus-plot .ytick text')].map(t => parseFloat(getComputedStyle(t).fontSize))")
    assert min(sizes) >= 9, sizes  # readable, not shrunk to fit
    tops = sorted(b["y"] for b in boxes)
    heights = max(b["height"] for b in boxes)
    assert all(b - a >= heights * 0.9 for a, b in zip(tops, tops[1:])), "labels overlap"
    page.locator(".focus-panel").screenshot(path=str(artifacts / "zoomed-labels.png"))


def test_past_64_tokens_a_dense_run_is_labelled_and_read_by_position(server, api, page, artifacts):
    """At 297 tokens the axes labelled every 5th token with its text at 7 px ("in", "in", "the"...)
    and a hover read "in → in: 0.007": nobody could tell which "in"."""
    text = text_of_tokens(api, 297)
    tokens = [t["text"] for t in api.post("/api/v1/attention", json={"text": text, "layers": [0], "heads": [0], "format": "u8"}).json()["tokens"]]
    open_page(page, server)
    run(page, text)
    for axis in ("x", "y"):
        positions = [int(t) for t in tick_texts(page, axis)]  # numbers, not tokens
        step = positions[1] - positions[0]
        assert step in (10, 20, 50) and positions == list(range(0, 297, step)), positions
        assert label_spacing(page, "#focus-plot", axis)[1] >= 9  # read at 10 px, not squeezed to 7
    assert hover_cell(page, 120, 37).startswith(f"#120 {tokens[120]} → #37 {tokens[37]}: ")
    page.locator(".focus-panel").screenshot(path=str(artifacts / "dense-297-positions.png"))
    # Zoomed to 64 tokens or fewer, every token's text is back.
    page.evaluate("() => Plotly.relayout('focus-plot', {'xaxis.range': [99.5, 129.5], 'yaxis.range': [129.5, 99.5]})")
    page.wait_for_function("() => document.querySelectorAll('#focus-plot .ytick text').length === 30")
    assert tick_texts(page, "y") == [t[:13] + "…" if len(t) > 14 else t for t in tokens[100:130]]


def test_labels_are_sized_for_the_axes_drawn_not_the_last_ones(server, page, artifacts):
    """The labels' fonts came from Plotly's axis lengths, which are the last figure's: after a
    pair's A → B block (its 93 keys' axis the plot's full width) the whole pair's square keys' axis
    was 2/3 of that, and its 47 labels at 10 px stood 8.4 px apart."""
    open_page(page, server)
    run(page, " ".join(["alpha"] * 30), " ".join(["be"] * 60))
    page.select_option("#segments", "AB")
    wait_plotted_shape(page, 32, 61)
    page.select_option("#segments", "all")
    wait_plotted_shape(page, 93, 93)
    page.wait_for_timeout(100)  # the labels are placed once Plotly has laid the new axes out
    for axis in "xy":  # the keys' labels stand upright (-90°) beyond 24: across them too, a font's height apart at least
        gap, font = label_spacing(page, "#focus-plot", axis)
        assert gap >= font, (axis, gap, font)
    page.locator("#focus-plot").screenshot(path=str(artifacts / "labels-after-a-block.png"))


# ---- 3. tokens as the model saw them ------------------------------------------------------------


def test_labels_are_the_models_pieces_with_the_original_span_on_hover(server, api, page):
    text = "unbelievably naïve 🏦"
    reply = api.post("/api/v1/attention", json={"text": text, "format": "u8"}).json()
    assert [t["piece"] for t in reply["tokens"]] == ["[CLS]", "un", "##bel", "##ie", "##va", "##bly", "naive", "[UNK]", "[SEP]"]
    open_page(page, server)
    run(page, text)
    # The head view draws a pause (HEAD_VIEW_PAUSE_MS) after the heatmap: read it once it is there.
    page.wait_for_function("() => document.querySelectorAll('.hv-left li').length === 9")
    left = page.locator(".hv-left li").all_text_contents()
    assert left == ["[CLS]", "un", "##bel", "##ie", "##va", "##bly", "naive", "[UNK]", "[SEP]"]
    assert tick_texts(page, "y") == left
    assert page.locator(".hv-left li").nth(7).get_attribute("title").startswith("[UNK] from “🏦”")
    full = page.locator("#tooltip")
    hover_cell(page, 6, 7)
    assert full.text_content() == f"naive → [UNK]: {full.text_content().split(': ')[1].splitlines()[0]}\n“naïve” → “🏦”"
    page.select_option("#labels", "text")
    page.wait_for_function("() => document.querySelectorAll('.hv-left li')[7]?.textContent === '🏦'")


def test_byte_level_pieces_show_bytes_and_visible_spaces(server, page):
    """tiny-gpt's real tokens (byte-level BPE), labelled by the page's own tokens.js."""
    from manyeyes.model import load

    tokens = [
        {"text": t.text, "piece": t.piece, "special": t.special, "start": t.start, "end": t.end}
        for t in load("tiny-gpt", device="cpu").tokenizer.encode("a naïve 🏦 bank", None).tokens
    ]
    open_page(page, server)
    labels = page.evaluate("async (tokens) => (await import('/static/js/tokens.js')).tokenLabels(tokens, 'pieces')", tokens)
    assert labels == ["a", "␣", "n", "a", "‹C3›", "‹AF›", "v", "e", "␣", "‹F0›", "‹9F›", "‹8F›", "‹A6›", "␣", "b", "a", "n", "k"]


# ---- 4. aggregates from float32 -----------------------------------------------------------------


def test_means_and_renormalised_rows_hold_their_mass_at_512_tokens(server, api, page):
    text = text_of_tokens(api, 512)
    open_page(page, server)
    run(page, text)
    page.select_option("#aggregate", "layer")
    page.wait_for_selector("#focus-plot[data-aggregate=layer][data-precision=f16]", timeout=60_000)
    z = np.array(plotted(page), dtype=np.float64)
    assert z.shape == (512, 512)
    sums = z.sum(axis=1)
    assert np.abs(sums - 1).max() <= 0.01, (sums.min(), sums.max())
    tokens, exact = f16_attention(api, text, [0])
    assert np.abs(z - exact[0].mean(axis=0)).max() <= 2e-3

    page.select_option("#aggregate", "head")
    wait_focus(page, layer=0, head=0)
    page.check("#hide-special")
    wait_plotted_shape(page, 510, 510, timeout=60_000)
    z = np.array(plotted(page), dtype=np.float64)
    assert np.abs(z.sum(axis=1) - 1).max() <= 0.01
    kept = exact[0, 0][1:-1, 1:-1]
    assert np.abs(z - kept / kept.sum(axis=1, keepdims=True)).max() <= 2e-3


# ---- 5. head view in step with the focus --------------------------------------------------------


def test_head_view_follows_the_focus_and_names_its_layer(server, page, artifacts):
    open_page(page, server)
    run(page, SENTENCE)
    page.wait_for_selector(".hv-left li")
    for h in (2, 5, 9):
        page.check(f"#hv-head-{h}")
    page.click(".thumb[data-layer='4'][data-head='7']")
    wait_focus(page, layer=4, head=7)
    page.wait_for_function("() => document.getElementById('headview').dataset.layer === '4'")
    assert page.locator("#headview").get_attribute("data-heads") == "2,5,7,9"
    assert page.locator("#headview-title").text_content() == "Head view: layer 4, heads 2, 5, 7, 9"
    colours = page.evaluate("async () => (await import('/static/js/theme.js')).palette().heads")
    assert len(colours) >= 32
    rgb = np.array([[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in colours[:32]], dtype=float)
    distance = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1) + np.eye(32) * 1e9
    assert distance.min() >= 25, distance.min()
    page.locator(".head-panel").screenshot(path=str(artifacts / "head-view.png"))


def test_head_view_draws_every_tokens_top_lines_at_long_t(server, api, page):
    text = text_of_tokens(api, 400)
    open_page(page, server)
    run(page, text)
    page.select_option("#aggregate", "all")  # the broadest weights there are
    page.wait_for_selector("#focus-plot[data-aggregate=all]", timeout=60_000)
    page.wait_for_function("() => Number(document.querySelector('.hv-canvas')?.dataset.lines) >= 3 * 400", timeout=30_000)


def test_head_view_draws_each_new_run_while_tokens_are_hidden(server, api, page, artifacts):
    """Under "Hide special tokens" (or "Hide first token") the head view drew only heads with
    exact values, and a new run's were asked for by nothing: the last run's tokens and lines
    stayed on screen (and after a run with no token left, its "No token is left")."""
    def shown(text):
        tokens = api.post("/api/v1/attention", json={"text": text, "layers": [0], "heads": [0], "format": "u8"}).json()["tokens"]
        return [t["piece"] for t in tokens if not t["special"]]  # the labels (no "##" pieces in these texts)

    open_page(page, server)
    run(page, SENTENCE)
    page.check("#hide-special")
    for text in (SENTENCE, "Hi there.", "The dog ran to the old mill by the river."):
        if text != SENTENCE:
            submit(page, text)
        expected = shown(text)
        page.wait_for_function(
            """(expected) => {
                const items = [...document.querySelectorAll('#headview .hv-left li')].map((li) => li.textContent);
                return JSON.stringify(items) === JSON.stringify(expected) && Number(document.querySelector('.hv-canvas').dataset.lines) > 0;
            }""", arg=expected, timeout=30_000)
    page.locator(".head-panel").screenshot(path=str(artifacts / "head-view-new-run-hidden.png"))


# ---- 6. permalink -------------------------------------------------------------------------------


def test_a_short_link_restores_every_control(server, make_page, artifacts):
    long_text = " ".join(f"Sentence {i} is about rivers and banks." for i in range(80))
    first = make_page()
    open_page(first, server)
    first.check("#truncate")
    first.fill("#pair", PAIR)
    run(first, long_text)
    first.click(".thumb[data-layer='2'][data-head='3']")
    wait_focus(first, layer=2, head=3)
    first.check("#hv-head-6")
    first.check("#hide-special")
    first.check("#hide-first")
    first.locator("#threshold").fill("0.05")
    first.select_option("#segments", "AB")
    first.select_option("#scale", "log")
    first.select_option("#labels", "text")
    first.select_option("#measure", "rollout")
    first.check("#word-view")
    first.select_option("#aggregate", "layer")
    first.wait_for_selector("#focus-plot[data-aggregate=layer]")
    wait_saved(first)
    assert len(first.url) < 100, first.url
    controls = ["#text", "#pair", "#model", "#layer", "#head", "#aggregate", "#segments", "#scale", "#labels",
                "#threshold", "#measure"]
    checks = ["#truncate", "#hide-special", "#hide-first", "#word-view"]
    before = {c: first.locator(c).input_value() for c in controls} | {c: first.locator(c).is_checked() for c in checks}
    z = plotted(first)

    second = make_page()
    second.goto(first.url)
    second.wait_for_selector("#focus-plot[data-aggregate=layer][data-layer='2']", timeout=30_000)
    wait_plotted_shape(second, len(z))
    after = {c: second.locator(c).input_value() for c in controls} | {c: second.locator(c).is_checked() for c in checks}
    assert after == before
    assert second.locator("#hv-head-6").is_checked() and second.locator("#hv-head-3").is_checked()
    assert plotted(second) == z
    assert "(cut to fit)" in second.locator("#focus-caption").text_content()
    second.locator("#measures").scroll_into_view_if_needed()
    second.wait_for_selector("#measure-plot[data-measure='rollout'][data-words='true']", timeout=30_000)


def test_back_to_the_bare_page_is_the_start_state_and_forward_the_run(server, page):
    """Back to `/` from a run kept the run on screen (popstate found no view to restore and did
    nothing): the start state is what a fresh visit shows."""
    start = """() => ({
        example: document.getElementById('focus-plot').dataset.example, text: document.getElementById('text').value,
        controls: document.getElementById('controls').hidden, measures: document.getElementById('measures').hidden,
        grid: document.getElementById('grid').textContent, headview: document.getElementById('headview').textContent,
        title: document.getElementById('focus-title').textContent, search: location.search,
    })"""
    open_page(page, server)
    fresh = page.evaluate(start)
    assert fresh["example"] == "true" and fresh["controls"] and fresh["search"] == ""
    run(page, SENTENCE)
    wait_saved(page)
    page.go_back()
    page.wait_for_function("() => document.body.dataset.ready === 'true' && !location.search"
                           " && document.getElementById('focus-plot').dataset.example === 'true'", timeout=10_000)
    assert page.evaluate(start) == fresh
    page.go_forward()
    wait_focus(page, layer=0, head=0)
    assert page.locator("#text").input_value() == SENTENCE


def test_an_expired_or_broken_link_says_so_and_leaves_the_example(server, page):
    """An expired link said "Run the text again" over an empty text box (the text went with the
    view), and the example was hidden as if "the run above failed"; a broken id opened a plain
    page without a word."""
    open_page(page, server, "?view=" + "0" * 18)
    page.locator("#error").wait_for(state="visible")
    said = page.locator("#error").text_content()
    assert said.startswith("This link has expired") and "nor the text it showed" in said and "Run the text again" not in said
    assert page.locator("#focus-plot").get_attribute("data-example") == "true"
    assert "failed" not in page.locator("#focus-caption").text_content()
    open_page(page, server, "?view=3f2a9c")
    page.locator("#error").wait_for(state="visible")
    assert page.locator("#error").text_content() == (
        "This link is broken: “3f2a9c” is no view id (those are 18 characters, 0–9 and a–f); it may have been cut short "
        "when it was copied.")
    assert page.locator("#focus-plot").get_attribute("data-example") == "true"


# ---- 7. laptop and phone ------------------------------------------------------------------------


def test_the_focused_heatmap_fits_a_laptop_screen(server, make_page, artifacts):
    page = make_page(viewport=(1366, 768))
    open_page(page, server)
    run(page, SENTENCE, PAIR)
    # A pair's 21 tokens are more than the room under the form shows readably: the page brings the
    # views to the top of the window (test_laptop_windows.py), the panel's title included.
    assert page.locator("#focus-title").bounding_box()["y"] >= 0
    plot = page.locator("#focus-plot .nsewdrag").bounding_box()
    keys = [b for b in (t.bounding_box() for t in page.locator("#focus-plot .xtick text").all()) if b]
    page.screenshot(path=str(artifacts / "laptop-1366x768.png"))
    assert plot["y"] >= 0 and plot["y"] + plot["height"] <= 768
    assert max(b["y"] + b["height"] for b in keys) <= 768
    page.screenshot(path=str(artifacts / "laptop-1366x768.png"))


def test_a_window_resized_to_a_phone_lays_the_heatmap_out_as_a_phone_does(server, make_page, artifacts):
    """Plotly's own resize kept the desktop margins (the keys' 40 px at the top, 90 px kept for the
    colorbar beside the cells, now under them) until the next arrow key or option."""
    layout = """() => { const gd = document.getElementById('focus-plot'); const m = gd._fullLayout.margin;
        return { margin: [m.t, m.r, m.b, m.l].map(Math.round), height: gd._fullLayout.height, side: gd._fullLayout.xaxis.side }; }"""
    phone = make_page(viewport=(400, 800))
    open_page(phone, server)
    run(phone, SENTENCE)
    want = phone.evaluate(layout)
    assert want["side"] == "top"

    page = make_page(viewport=(1440, 900))
    open_page(page, server)
    run(page, SENTENCE)
    assert page.evaluate(layout)["side"] == "bottom"
    page.set_viewport_size({"width": 400, "height": 800})
    page.wait_for_function(f"(want) => JSON.stringify(({layout})()) === JSON.stringify(want)", arg=want, timeout=5_000)
    page.locator("#focus-plot").screenshot(path=str(artifacts / "resized-to-400.png"))


def test_a_tapped_thumbnail_on_a_phone_brings_its_heatmap_into_view(server, browser):
    """The grid sits under the heatmap on a phone: a tap focused a head whose plot was off screen,
    so nothing seemed to happen (a review by use)."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True)
    try:
        page = context.new_page()
        open_page(page, server)
        run(page, SENTENCE)
        wait_grid(page)
        thumb = page.locator("#grid .thumb[data-layer='2'][data-head='5']")
        thumb.evaluate("t => t.scrollIntoView({ block: 'start' })")  # as a thumb scrolled to, to tap it
        assert page.locator(".focus-panel").bounding_box()["y"] < 0  # scrolled past the heatmap
        thumb.tap()
        wait_focus(page, layer=2, head=5)
        page.wait_for_timeout(200)
        assert -1 <= page.locator(".focus-panel").bounding_box()["y"] < 844 / 3
    finally:
        context.close()


def test_phone_tap_shows_the_value_and_controls_fold_away(server, browser, artifacts):
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True, device_scale_factor=2)
    requests = []
    context.on("request", lambda r: requests.append(r.url))
    try:
        page = context.new_page()
        open_page(page, server)
        run(page, SENTENCE)
        assert not page.locator("#controls").evaluate("d => d.open")
        plot_box = page.locator("#focus-plot").bounding_box()
        assert 0 <= plot_box["y"] < 844 / 3, plot_box  # the heatmap starts on the first screen
        page.wait_for_timeout(300)
        title = page.locator("#focus-plot .gtitle").bounding_box()
        bar = page.locator("#focus-plot .modebar").bounding_box()
        if bar:
            assert title["y"] >= bar["y"] + bar["height"] or title["x"] + title["width"] <= bar["x"], (title, bar)
        cell = page.evaluate("""() => { const gd = document.getElementById('focus-plot');
            const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
            return [box.left + gd._fullLayout.xaxis.l2p(3), box.top + gd._fullLayout.yaxis.l2p(2)]; }""")
        page.touchscreen.tap(*cell)
        page.locator("#tooltip[data-query='2'][data-key='3']").wait_for(state="visible", timeout=5000)
        page.screenshot(path=str(artifacts / "phone-tap.png"))
        # The hint says what a tap does, not which arrow keys to press or where to drag.
        assert page.locator("#keys-hint .for-touch").is_visible() and page.locator("#keys-hint .for-keys").is_hidden()
        # And every view's hint (the grid's, the head view's and the tapped cell's ranking said click or hover).
        page.locator("#cell-heads .hint").wait_for(state="visible", timeout=30_000)
        hints = [page.locator(s).inner_text() for s in (".grid-panel .caption", ".head-panel .caption", "#cell-heads .hint")]
        assert "Tap one to focus it." in hints[0] and "Tap a token to isolate it." in hints[1] and "; tap one to focus it:" in hints[2], hints
        assert not any(word in hint.lower() for hint in hints for word in ("click", "hover")), hints
        # No pointer moves away on a phone: the tapped reading stayed over the next text's heatmap.
        submit(page, "A dog ran.")  # (wait_focus could match the last text's heatmap, still on screen)
        page.locator("#tooltip").wait_for(state="hidden", timeout=30_000)
    finally:
        context.close()
    assert all(urlsplit(u).hostname in LOOPBACK for u in requests if u.startswith("http"))


def test_a_phone_turned_sideways_and_back_refits_and_its_readings_stay_on_screen(server, browser):
    """Turned back upright, the plot stayed 720 px tall with blank bands (the resize event reports
    the zoomed-out viewport the wide plot had made, 819 x 1773, then settles with no other event);
    and a causal model's predictions line ran off the right edge, widening the page."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True, device_scale_factor=2)
    try:
        page = context.new_page()
        open_page(page, server)
        run(page, "The cat sat on the mat and looked at the dog.", model="tiny-causal")
        page.wait_for_timeout(500)
        height = page.evaluate("() => document.getElementById('focus-plot').getBoundingClientRect().height")
        assert height < 500, height
        page.set_viewport_size({"width": 844, "height": 390})
        page.wait_for_timeout(800)
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_function("(h) => document.getElementById('focus-plot').getBoundingClientRect().height === h",
                               arg=height, timeout=5_000)
        for row, col in ((5, 2), (12, 0)):
            cell = page.evaluate("""([r, c]) => { const gd = document.getElementById('focus-plot');
                const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
                return [box.left + gd._fullLayout.xaxis.l2p(c), box.top + gd._fullLayout.yaxis.l2p(r)]; }""", [row, col])
            page.touchscreen.tap(*cell)
            tip = page.locator(f"#tooltip[data-query='{row}'][data-key='{col}']")
            tip.wait_for(state="visible", timeout=5000)
            assert "next after" in tip.text_content()
            box = tip.bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
            assert page.evaluate("() => [innerWidth, document.documentElement.scrollWidth]") == [390, 390]
    finally:
        context.close()


# ---- 9. smaller things ----------------------------------------------------------------------------


def test_arrow_keys_work_right_after_enter_and_say_so(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    assert "step through heads" in page.locator("#keys-hint .for-keys").text_content()
    # A run that is not long offers the head ranking (a toggle once hid it on the first run).
    assert "Click a cell (or Enter) to rank every head by it." in page.locator("#keys-hint .for-keys").inner_text()
    assert page.locator("#keys-hint .for-keys").is_visible() and page.locator("#keys-hint .for-touch").is_hidden()
    assert page.locator("#keys-hint").is_visible()
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=1)


def test_too_long_gives_its_advice_once_and_hides_the_example(server, page):
    open_page(page, server)
    assert page.locator("#focus-plot .main-svg").count() > 0  # the made-up example
    page.fill("#text", "word " * 700)
    page.press("#text", "Enter")
    page.locator("#error").wait_for(state="visible")
    message = page.locator("#error").text_content()
    assert len(re.findall("shorten", message, re.I)) == 1, message
    assert page.locator("#focus-plot .main-svg").count() == 0
    assert page.get_attribute("#text", "aria-invalid") == "true"  # the box's mistake, as an empty text is
    run(page, SENTENCE)
    assert page.get_attribute("#text", "aria-invalid") is None


def test_docs_give_each_error_status_its_own_example(api):
    responses = api.get("/openapi.json").json()["paths"]["/api/v1/attention"]["post"]["responses"]
    codes = {s: r["content"]["application/json"]["example"]["error"]["code"] for s, r in responses.items() if s != "200"}
    assert len(set(codes.values())) == len(codes) >= 5, codes


def test_caption_counts_shown_tokens_and_mean_mode_says_what_it_shows(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    page.check("#hide-special")
    page.wait_for_function("() => document.getElementById('focus-caption').textContent.startsWith('11 × 11 of 13 tokens shown')")
    page.select_option("#aggregate", "layer")
    page.wait_for_selector("#focus-plot[data-aggregate=layer]")
    assert page.locator("#focus-title").text_content() == "Mean of layer 0"
    assert page.locator(".thumb[aria-pressed=true]").count() == 0
    assert page.locator(".thumb.in-mean").count() == 12
    assert page.locator(".thumb[data-layer='1'][data-head='2']").get_attribute("title") == "Layer 1, head 2"


def test_exported_images_carry_a_caption(server, page, artifacts):
    open_page(page, server)
    run(page, SENTENCE)
    page.hover("#focus-plot")
    with page.expect_download() as download:
        page.click(".modebar-btn[data-title='Download plot as SVG']")
    svg = open(download.value.path(), encoding="utf-8").read()
    assert "minilm · Layer 0, head 0 · “The bank of the river was muddy after the rain.”" in svg
    # The page paints the cells itself (issue 13, item 8): exports embed them as an image, crisp,
    # with Plotly's labelled axes and colorbar around them.
    images = re.findall(r'href="data:image/png;base64,([^"]+)"', svg)
    sizes = [(int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) for png in map(base64.b64decode, images)]
    width, height = max(sizes)  # the cells (Plotly's placeholder brick under them is 1 × 1)
    assert width == height and width % 13 == 0 and width >= 13 * 8  # 13 tokens, whole pixels a cell
    assert "muddy" in svg and "colorbar" in svg and "query (attending)" in svg
    with page.expect_download() as download:
        page.click(".modebar-btn[data-title='Download plot as PNG']")
    data = open(download.value.path(), "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (artifacts / "export.png").write_bytes(data)


# ---- 10. colour, sinks and theme ----------------------------------------------------------------


def test_colour_scales_hide_first_token_and_theme_toggle(server, page, artifacts):
    open_page(page, server)
    run(page, "The bank of the river.", model="tiny-causal")
    page.select_option("#scale", "fixed")
    page.wait_for_selector("#focus-plot[data-scale=fixed]")
    assert plotted_zmax(page) == 1
    page.select_option("#scale", "log")
    page.wait_for_selector("#focus-plot[data-scale=log]")
    assert "0.0001" in page.locator("#focus-plot .colorbar").text_content()
    z_log = np.array(plotted(page), dtype=float)
    page.select_option("#scale", "head")
    page.wait_for_selector("#focus-plot[data-scale=head]")
    z = np.array(plotted(page), dtype=float)
    seen = ~np.isnan(z)
    assert np.allclose(z_log[seen], (np.log10(np.maximum(z[seen], 1e-4)) + 4) / 4, atol=1e-6)

    page.check("#hide-first")
    n = len(z) - 1
    wait_plotted_shape(page, n)
    kept = np.nan_to_num(np.array(plotted(page), dtype=float))
    assert np.allclose(kept.sum(axis=1), 1, atol=5e-3)

    page.select_option("#theme", "dark")
    page.wait_for_function("() => getComputedStyle(document.body).backgroundColor === 'rgb(13, 17, 23)'")
    page.wait_for_function("() => document.getElementById('focus-plot').layout.paper_bgcolor === '#161b22'")
    page.screenshot(path=str(artifacts / "dark-toggle-log.png"), full_page=True)
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#theme").input_value() == "dark"  # remembered
    page.select_option("#theme", "system")


# ---- found since ------------------------------------------------------------------------------------


def shown_though_hidden(page) -> list[str]:
    """Elements with the `hidden` attribute that still take up room on screen."""
    return page.evaluate("""() => [...document.querySelectorAll('[hidden]')]
        .filter((e) => e.getClientRects().length > 0).map((e) => e.id || e.className || e.tagName)""")


def test_a_model_without_predictions_leaves_no_strip_from_the_last_run(server, page, artifacts):
    # `.predictions { display: flex }` beat the browser's own [hidden] rule: after a causal run, a
    # MiniLM run kept the causal model's "Next token" strip, for other tokens, under its heatmap.
    open_page(page, server)
    run(page, "The cat sat on the mat.", model="tiny-causal")
    page.wait_for_selector("#focus-predictions .pred")
    assert page.locator("#focus-predictions").is_visible()
    run(page, "The bank of the river was muddy.", model="minilm")
    page.wait_for_function("() => document.getElementById('focus-predictions').hidden")
    assert not page.locator("#focus-predictions").is_visible()
    assert shown_though_hidden(page) == []
    page.locator(".focus-panel").screenshot(path=str(artifacts / "no-stale-predictions.png"))


def test_head_view_chips_keep_their_own_layout(server, page, artifacts):
    # experiments.css styled every .chip as a bordered inline block, the head view's too: the
    # checkbox sat above its swatch and touched it.
    open_page(page, server)
    run(page, SENTENCE)
    chip = page.locator("#headview-heads .chip").nth(1)
    chip.wait_for()
    assert chip.evaluate("(e) => getComputedStyle(e).display") in ("flex", "inline-flex")  # a flex item is blockified
    box, swatch = chip.locator("input").bounding_box(), chip.locator(".swatch").bounding_box()
    centre = lambda b: b["y"] + b["height"] / 2  # noqa: E731
    assert abs(centre(box) - centre(swatch)) <= 1.5 and swatch["x"] >= box["x"] + box["width"] + 2
    page.locator("#headview-heads").screenshot(path=str(artifacts / "head-chips.png"))


def contrast(a: list[float], b: list[float]) -> float:
    """WCAG contrast ratio of two sRGB colours given as [r, g, b] in 0-255."""
    def luminance(rgb):
        c = [v / 255 for v in rgb]
        c = [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
    hi, lo = sorted([luminance(a), luminance(b)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_number_and_search_boxes_look_like_the_text_boxes(server, make_page, scheme):
    """Only input[type=text] was styled: in the dark theme the number and search boxes were grey
    boxes in a smaller font, their placeholders at 2.43:1."""
    page = make_page(color_scheme=scheme)
    open_page(page, server)
    looks = """(id) => {
        const s = getComputedStyle(document.getElementById(id));
        return [s.fontSize, s.fontFamily, s.color, s.backgroundColor, s.borderTopColor, s.borderTopLeftRadius];
    }"""
    text = page.evaluate(looks, "text")
    for box in ["gen-n", "gen-temp", "gen-seed", "finder-filter"]:
        assert page.evaluate(looks, box) == text, box
    rgb = "(c) => c.match(/[\\d.]+/g).slice(0, 3).map(Number)"
    for box in ["text", "gen-seed", "finder-filter"]:
        ink, ground = page.evaluate(f"""(id) => {{
            const node = document.getElementById(id);
            const rgb = {rgb};
            return [rgb(getComputedStyle(node, '::placeholder').color), rgb(getComputedStyle(node).backgroundColor)];
        }}""", box)
        assert contrast(ink, ground) >= 4.5, (box, ink, ground)


def test_run_waits_for_the_pages_scripts(server, page):
    """Before the scripts came (plotly.js is 1.5 MB gzipped) the page looked ready, and Run sent
    the form as a plain GET: the page loaded again from the start (review h50d)."""
    page.route("**/static/js/main.js", lambda route: route.abort())  # scripts that never come
    page.goto(f"{server}/", wait_until="domcontentloaded")
    assert page.locator("#run").is_disabled()
    page.fill("#text", "The bank of the river.")
    page.locator("#run").click(force=True)
    page.wait_for_timeout(300)
    assert page.url == f"{server}/"  # no plain GET of the form
    page.unroute("**/static/js/main.js")
    open_page(page, server)
    assert page.locator("#run").is_enabled()


def test_a_text_run_while_another_runs_goes_next_and_is_what_is_shown(make_page):
    """Run was disabled while a run was under way, which also blocked Enter in the text box: the
    second text was dropped without a word, and the first text's result came up under it."""
    with serving({"minilm": "minilm"}, env={"MANYEYES_DEBUG_FORWARD_DELAY_S": "1.0"}) as base:
        page = make_page()
        open_page(page, base)
        run(page, "A cat.")  # a run on screen: the note speaks of it while the next ones go
        page.evaluate("""() => { window.shown = [];
            document.addEventListener("manyeyes:run", (event) => window.shown.push(event.detail.request.text)); }""")
        submit(page, "The bank of the river was muddy after the heavy rain fell all night.")
        page.wait_for_selector("#busy:not([hidden])")
        submit(page, "The dog ran.")
        assert "runs next" in page.locator("#run-status").text_content()
        # Said at once, while the run before it still goes ("press Run to see it" of a run already
        # on its way, until that run landed), and still when it lands under the queued text.
        assert page.text_content("#stale-note") == "Below is the last run, not the sentence above: it runs next."
        page.wait_for_function("() => window.shown.length === 1", timeout=60_000)  # the long sentence's run landed
        # ... and the queued text's run, going now: "press Run to see it" of the run under way.
        page.wait_for_function("() => document.getElementById('stale-note').textContent.endsWith('it is running.')")
        page.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('Done: 6 tokens')",
                               timeout=60_000)
        page.wait_for_function("() => document.querySelectorAll('#headview .hv-left li').length === 6", timeout=30_000)
        assert page.locator("#stale-note").is_hidden()



def test_the_form_says_when_it_no_longer_holds_the_run_on_screen(server, page):
    """Another sentence typed, or another model picked, left the last run's grid and heatmap on
    screen with nothing to say so, and "Ablate" answered for the old sentence."""
    open_page(page, server)
    note = page.locator("#stale-note")
    assert note.is_hidden()  # nothing on screen to be stale yet
    run(page, SENTENCE)
    assert note.is_hidden()
    page.fill("#text", SENTENCE + " More.")
    assert note.text_content() == "Below is the last run, not the sentence above: press Run to see it." and note.is_visible()
    page.fill("#text", SENTENCE)  # back to what was run
    assert note.is_hidden()
    page.select_option("#model", "tiny-causal")
    assert note.text_content() == "Below is the last run, not the model above: press Run to see it."
    page.fill("#pair", "A second one.")
    page.fill("#text", "Another.")
    assert note.text_content() == "Below is the last run, not the sentence, second sentence and model above: press Run to see them."
    page.fill("#pair", "")
    run(page, "Another.", model="tiny-causal")
    page.wait_for_function("() => document.getElementById('stale-note').hidden")


def test_the_made_up_example_says_so_and_its_rows_add_up_to_one(server, page):
    open_page(page, server)
    assert page.locator("#focus-plot").get_attribute("data-example") == "true"
    assert focus_title(page) == "Made-up example, not a model's output"
    rows = np.asarray(plotted(page), dtype=np.float64)
    assert rows.shape == (8, 8) and np.allclose(rows.sum(axis=1), 1, atol=1e-5)  # they summed to 1.6


def test_a_cell_clicked_ranks_every_head_by_its_weight_and_a_head_picked_is_focused(server, api, page):
    """'Which head links "it" to "animal"?' could be answered only by stepping through every head."""
    from tests.browser.test_page import api_attention

    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    q, k = 5, 2  # "river" -> "bank"
    hover_cell(page, q, k)
    page.mouse.down()
    page.mouse.up()
    page.wait_for_selector("#cell-heads:not([hidden]) .cell-heads-list button")
    weights = api_attention(api, SENTENCE)[1][:, :, q, k]  # (L, H)
    order = sorted(((float(weights[l, h]), l, h) for l in range(weights.shape[0]) for h in range(weights.shape[1])),
                   key=lambda t: (-t[0], t[1], t[2]))
    buttons = page.locator("#cell-heads .cell-heads-list button")
    shown = buttons.evaluate_all("bs => bs.map((b) => [+b.dataset.layer, +b.dataset.head, b.textContent])")
    assert len(shown) == 10
    for (layer, head, text), (weight, l, h) in zip(shown, order):
        # 8-bit values until a layer's exact ones come: the ranking may swap heads within a step
        assert abs(float(weights[layer, head]) - weight) <= 1 / 255 and text.startswith(f"L{layer} H{head} · ")
        assert abs(float(text.split(" · ")[1]) - weights[layer, head]) <= 1 / 255 + 0.005
    assert page.locator("#cell-heads .hint").text_content().startswith("#5 river → #2 bank, the heads by its weight")
    top_layer, top_head = shown[0][0], shown[0][1]
    buttons.first.click()
    wait_focus(page, layer=top_layer, head=top_head)
    assert page.get_attribute(f"#cell-heads button[data-layer='{top_layer}'][data-head='{top_head}']", "aria-pressed") == "true"
    # Enter on the keyboard's cell cursor picks its cell too; a new run forgets the ranking.
    page.click("#cell-heads-close")
    assert page.locator("#cell-heads").is_hidden()
    page.focus("#focus-plot")
    page.keyboard.press("Shift+ArrowRight")
    page.keyboard.press("Enter")
    page.wait_for_selector("#cell-heads:not([hidden])")
    assert page.locator("#cell-heads .hint").text_content().startswith("#0 [CLS] → #")
    submit(page, "Another sentence.")  # run()'s wait can be met by the last run's plot
    page.wait_for_function("() => document.getElementById('cell-heads').hidden")
