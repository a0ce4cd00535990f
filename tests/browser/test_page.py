"""The visualizer in a real chromium against the real server and MiniLM (issue 4)."""

from __future__ import annotations

import csv
import io
import json
import re
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

pytestmark = pytest.mark.browser

SENTENCE = "The bank of the river was muddy after the rain."
PAIR = "It flowed slowly to the sea."
XSS = "<img src=x onerror=alert(1)>"


def open_page(page, server, query=""):
    page.goto(f"{server}/{query}")
    page.wait_for_selector("body[data-ready=true]")


def submit(page, text, pair=None, model=None):
    """Types the sentence(s), picks the model and presses Enter, without waiting for the plot."""
    page.fill("#text", text)
    if pair is not None:
        page.fill("#pair", pair)
    if model is not None:
        page.select_option("#model", model)
    page.press("#text", "Enter")


def run(page, text, pair=None, model=None):
    submit(page, text, pair, model)
    # The last run's heatmap is f16 too: wait_focus alone could return before this run's answer
    # came. Enter sets #run-form's aria-busy="true" at once (setBusy); it is "false" once the run is shown.
    page.wait_for_selector("#run-form[aria-busy=false]", timeout=30_000)
    wait_focus(page)


def wait_focus(page, **state):
    """Waits for the focused heatmap with exact (f16) values, at the given layer/head if named."""
    selector = "#focus-plot[data-precision=f16]" + "".join(f"[data-{k}='{v}']" for k, v in state.items())
    page.wait_for_selector(selector, timeout=30_000)


def wait_grid(page):
    # Arrow functions, not expression strings: the page's CSP forbids the eval those would need.
    page.wait_for_function("() => document.querySelectorAll('.thumb').length > 0 && !document.querySelector('.thumb.loading')",
                           timeout=30_000)


def wait_saved(page):
    """Waits until the address bar holds the saved id of the view on screen."""
    page.wait_for_function("() => !document.body.dataset.viewPending && document.body.dataset.view"
                           " && new URLSearchParams(location.search).get('view') === document.body.dataset.view")


def focus_title(page) -> str:
    return page.locator("#focus-plot .gtitle").text_content()


def plotted(page):
    """The focused heatmap's values as coloured (null = masked; log10 positions on the log scale).

    The page paints the cells itself (static/js/canvas_heatmap.js); `focusPlot.plotted()` gives what
    it painted in the terms of Plotly's heatmap z, which is what these tests used to read."""
    return page.evaluate("() => document.getElementById('focus-plot').plotted().z")


def plotted_zmax(page) -> float:
    """The value drawn in the darkest colour (the colorbar's top)."""
    return page.evaluate("() => document.getElementById('focus-plot').plotted({ z: false }).zmax")


def wait_plotted_shape(page, rows: int, cols: int | None = None, timeout: int = 30_000):
    """Waits until the focused heatmap shows rows × cols cells (cols: any, when not given)."""
    page.wait_for_function(
        "([r, c]) => { const p = document.getElementById('focus-plot').plotted?.({ z: false });"
        " return !!p && p.rows === r && (c === null || p.cols === c); }",
        arg=[rows, cols], timeout=timeout,
    )


def hover_cell(page, row, col, query=None, key=None) -> str:
    """The reading of view cell (row, col), which shows tokens (query, key): (row, col) unless
    tokens are hidden."""
    point = page.evaluate(
        """([row, col]) => {
            const gd = document.getElementById('focus-plot');
            const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
            const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
            return [box.left + xa.l2p(col), box.top + ya.l2p(row)];
        }""",
        [row, col],
    )
    page.mouse.move(point[0] - 30, point[1] - 30)
    page.mouse.move(*point, steps=3)
    # Plotly throttles hover events: wait for the reading of this very cell (by its tokens' indices).
    query, key = (row if query is None else query), (col if key is None else key)
    tooltip = page.locator(f"#tooltip[data-query='{query}'][data-key='{key}']")
    tooltip.wait_for(state="visible")
    return tooltip.text_content().split("\n")[0]  # the second line gives the original spans


def api_attention(api, text, pair=None, model="minilm", layers=None, heads=None):
    body = {"text": text, "model": model, "format": "json"}
    if pair is not None:
        body["text_pair"] = pair
    if layers is not None:
        body["layers"], body["heads"] = layers, heads
    reply = api.post("/api/v1/attention", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["tokens"], np.asarray(data["attention"]["data"], dtype=np.float64)


def test_sentence_renders_every_head_and_a_titled_focus(server, api, page, artifacts):
    info = api.get("/api/v1/models").json()["models"][0]
    open_page(page, server)
    run(page, SENTENCE, PAIR)
    wait_grid(page)
    assert page.locator(".thumb").count() == info["n_layers"] * info["n_heads"]
    assert page.locator(".grid .row-label").all_text_contents() == [f"L{i}" for i in range(info["n_layers"])]
    assert page.locator(".grid .col-label").all_text_contents() == [f"H{i}" for i in range(info["n_heads"])]
    assert focus_title(page) == "Layer 0, head 0"
    tokens, _ = api_attention(api, SENTENCE, PAIR, layers=[0], heads=[0])
    assert len(plotted(page)) == len(tokens)
    assert page.locator("#busy").is_hidden()
    # The model's own pieces by default (this sentence has no "##" pieces, bytes or [UNK]). The
    # head view draws HEAD_VIEW_PAUSE_MS after the heatmap, so its list is waited for.
    page.wait_for_function("n => document.querySelectorAll('.hv-left li').length === n", arg=len(tokens))
    assert page.locator(".hv-left li").all_text_contents() == [t["piece"] for t in tokens]
    page.screenshot(path=str(artifacts / "main-view.png"), full_page=True)


def test_hover_reads_the_api_value(server, api, page):
    open_page(page, server, "?text=" + SENTENCE.replace(" ", "+") + "&model=minilm&layer=2&head=3")
    wait_focus(page, layer=2, head=3)
    tokens, weights = api_attention(api, SENTENCE, layers=[2], heads=[3])
    head = weights[0, 0]
    inner = head[1:-1, 1:-1]  # the strongest cell between words, away from [CLS]/[SEP]
    peak = [int(i) + 1 for i in np.unravel_index(np.argmax(inner), inner.shape)]
    for row, col in [(2, 5), (5, 2), peak]:
        text = hover_cell(page, row, col)
        match = re.fullmatch(r"(.+) → (.+): (\d\.\d{3}|0\.0*[1-9]\d)", text)  # 2 significant digits under 0.01
        assert match, text
        assert match.group(1) == tokens[row]["piece"] and match.group(2) == tokens[col]["piece"]
        # Three decimals of a float16 reading: within rounding (5e-4) plus float16 error.
        assert abs(float(match.group(3)) - head[row, col]) <= 1.1e-3, (text, head[row, col])


def test_clicking_a_thumbnail_and_arrow_keys_move_the_focus(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    page.click(".thumb[data-layer='4'][data-head='7']")
    wait_focus(page, layer=4, head=7)
    assert focus_title(page) == "Layer 4, head 7"
    assert page.locator(".thumb[aria-pressed=true]").get_attribute("aria-label") == "Layer 4, head 7"
    assert page.locator("#layer").input_value() == "4" and page.locator("#head").input_value() == "7"
    page.focus("#focus-plot")
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=4, head=8)
    page.keyboard.press("ArrowDown")
    wait_focus(page, layer=5, head=8)
    page.keyboard.press("ArrowLeft")
    wait_focus(page, layer=5, head=7)
    assert focus_title(page) == "Layer 5, head 7"
    page.select_option("#layer", "1")
    wait_focus(page, layer=1, head=7)
    # From a thumbnail, keyboard focus moves with the head: Enter then keeps the new head.
    page.focus(".thumb[data-layer='2'][data-head='3']")
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=2, head=4)
    assert page.evaluate("() => document.activeElement.getAttribute('aria-label')") == "Layer 2, head 4"
    page.keyboard.press("Enter")
    wait_focus(page, layer=2, head=4)
    assert focus_title(page) == "Layer 2, head 4"
    # The grid is one Tab stop, the focused head's thumbnail: Tab leaves it for what follows.
    tabbable = page.locator(".thumb:not([tabindex='-1'])")
    assert tabbable.count() == 1 and tabbable.get_attribute("aria-label") == "Layer 2, head 4"
    page.keyboard.press("Tab")
    assert page.evaluate("() => !document.activeElement.classList.contains('thumb')")


def test_xss_input_is_inert_and_literal(server, page, watched):
    open_page(page, server)
    run(page, XSS, XSS)
    wait_grid(page)
    page.wait_for_timeout(300)  # time for any injected handler to have fired
    assert watched.dialogs == []
    assert page.locator("img").count() == 0
    assert page.evaluate("() => document.querySelectorAll('[onerror]').length") == 0
    assert page.locator("#text").input_value() == XSS
    page.wait_for_function("() => document.querySelectorAll('.hv-left li').length > 0")  # drawn after a pause
    left = "".join(page.locator(".hv-left li").all_text_contents())
    assert "[CLS]<imgsrc=xonerror=alert(1)>[SEP]" in left.replace("##", "")
    ticks = page.locator("#focus-plot .ytick text").all_text_contents()
    assert "<" in ticks and ">" in ticks
    text = hover_cell(page, 1, 1)
    assert text.startswith("#1 < → #1 <: ")  # "<" is in the text and the pair: the reading says which


def test_over_long_input_shows_the_error_in_words(server, page):
    open_page(page, server)
    page.fill("#text", "word " * 700)
    page.press("#text", "Enter")
    error = page.locator("#error")
    error.wait_for(state="visible")
    message = error.text_content()
    assert "Text too long" in message and "512" in message and "Cut to fit" in message
    assert page.locator("#busy").is_hidden()
    assert not page.locator("#run").is_disabled()
    page.check("#truncate")
    page.press("#text", "Enter")
    wait_focus(page)
    assert error.is_hidden()
    assert "(cut to fit)" in page.locator("#focus-caption").text_content()


def test_permalink_with_unknown_model_and_indices_falls_back(server, page):
    open_page(page, server, "?text=Hello+there.&model=nope&layer=99&head=99")
    wait_focus(page)
    assert page.locator("#model").input_value() == "minilm"
    # Not silently: the user learns that the run is not of the model the link named.
    page.wait_for_function("() => document.getElementById('link-status').textContent.length > 0")
    assert page.locator("#link-status").text_content() == (
        "This link named the model “nope”, which this server does not serve; it ran on minilm.")
    # Out-of-range indices are clamped to the model's last layer and head.
    assert focus_title(page) == "Layer 5, head 11"
    # And said so, on a model the server has (they were clamped without a word).
    open_page(page, server, "?text=Hello+there.&model=minilm&layer=9&head=99")
    wait_focus(page, layer=5, head=11)
    page.wait_for_function("() => document.getElementById('link-status').textContent.startsWith('This link named layer')")
    assert page.locator("#link-status").text_content() == (
        "This link named layer 9, head 99; minilm has layers 0–5 and heads 0–11, so it shows layer 5, head 11.")


def test_long_input_fetches_further_layers_lazily(server, page, watched):
    text = " ".join(f"Sentence number {i} talks about rivers and banks." for i in range(40))
    open_page(page, server)
    run(page, text)
    wait_grid(page)
    posts = [u for u in watched.requests if u.endswith("/api/v1/attention")]
    slices = [u for u in watched.requests if "/attention?" in u and "format=u8" in u]
    assert len(posts) == 1
    assert slices, "the other layers should come from the runs slice endpoint"
    fetched = sorted(int(x) for u in slices for x in parse_qs(urlsplit(u).query)["layers"][0].split(","))
    assert fetched == [1, 2, 3, 4, 5]
    assert page.locator(".thumb").count() == 72


def test_aggregates_hide_special_threshold_and_pair_filters(server, api, page):
    open_page(page, server, f"?text={SENTENCE}&pair={PAIR}&model=minilm&layer=1&head=4")
    wait_focus(page, layer=1, head=4)
    tokens, weights = api_attention(api, SENTENCE, PAIR, layers=[1], heads=list(range(12)))
    special = np.array([t["special"] for t in tokens])

    page.select_option("#aggregate", "layer")
    page.wait_for_selector("#focus-plot[data-aggregate=layer]")
    assert focus_title(page) == "Layer 1, mean of its 12 heads"
    assert np.allclose(np.array(plotted(page)), weights[0].mean(axis=0), atol=1 / 255)

    page.select_option("#aggregate", "all")
    page.wait_for_selector("#focus-plot[data-aggregate=all]")
    _, everything = api_attention(api, SENTENCE, PAIR)
    assert np.allclose(np.array(plotted(page)), everything.mean(axis=(0, 1)), atol=1 / 255)

    page.select_option("#aggregate", "head")
    wait_focus(page, layer=1, head=4)
    page.check("#hide-special")
    wait_plotted_shape(page, int((~special).sum()))
    z = np.array(plotted(page))
    kept = weights[0, 4][~special][:, ~special]
    assert np.allclose(z.sum(axis=1), 1, atol=5e-3)
    assert np.allclose(z, kept / kept.sum(axis=1, keepdims=True), atol=2e-3)
    # The head view redraws after a short pause in the steps (so stepping stays fast): wait for it.
    page.wait_for_function("() => document.querySelectorAll('.hv-left li').length > 0"
                           " && document.querySelectorAll('.hv-left li.special').length === 0")

    page.uncheck("#hide-special")
    page.select_option("#segments", "all")
    page.locator("#threshold").fill("0.2")
    page.wait_for_function("() => document.getElementById('threshold-value').textContent === '0.20'")
    # Three option changes in a row each redraw; wait for the last one to reach the plot, not just the label.
    page.wait_for_function(
        "(n) => { const z = document.getElementById('focus-plot').plotted().z;"
        " return z.length === n && z.every((row) => row.every((v) => v === 0 || v >= 0.2)); }",
        arg=len(tokens),
    )
    z = np.array(plotted(page))
    head = weights[0, 4]
    assert np.all((z == 0) | (z >= 0.2))
    assert np.allclose(z[head >= 0.201], head[head >= 0.201], atol=1e-3)


def test_causal_model_shows_the_upper_triangle_as_masked(server, api, page, artifacts):
    open_page(page, server)
    run(page, "The bank of the river.", model="tiny-causal")
    page.locator(".focus-panel").screenshot(path=str(artifacts / "causal-focus.png"))
    n = len(plotted(page))
    assert "masked" in page.locator("#focus-caption").text_content()
    assert hover_cell(page, 0, n - 1).endswith(": masked")
    assert page.locator(".thumb").count() == 2 * 4


def test_download_csv_and_json_hold_the_exact_head(server, api, page):
    open_page(page, server, f"?text={SENTENCE}&model=minilm&layer=2&head=5")
    wait_focus(page, layer=2, head=5)
    tokens, weights = api_attention(api, SENTENCE, layers=[2], heads=[5])
    with page.expect_download() as download:
        page.click("#download-csv")
    assert download.value.suggested_filename == "manyeyes-minilm-L2-H5.csv"
    rows = list(csv.reader(io.StringIO(open(download.value.path(), encoding="utf-8").read())))
    assert rows[0][:2] == ["query_index", "query_token"] and len(rows) == len(tokens) + 1
    assert [r[1] for r in rows[1:]] == [t["piece"] for t in tokens]  # the labels on screen: MiniLM's own pieces
    assert np.allclose(np.array([[float(v) for v in r[2:]] for r in rows[1:]]), weights[0, 0], atol=1e-6)

    with page.expect_download() as download:
        page.click("#download-json")
    body = json.loads(open(download.value.path(), encoding="utf-8").read())
    assert (body["layer"], body["head"], body["precision"]) == (2, 5, "float32")
    assert [q["text"] for q in body["queries"]] == [t["text"] for t in tokens]
    assert [(q["piece"], q["start"], q["end"]) for q in body["keys"]] == [(t["piece"], t["start"], t["end"]) for t in tokens]
    assert np.allclose(np.array(body["attention"]), weights[0, 0], atol=1e-6)


def test_downloads_name_each_token_as_the_heatmap_labels_it(server, api, page):
    """The CSV's columns were each token's text: MiniLM's [UNK] for a character it cannot read was
    headed by that character, as if the model had read it (a review by use, non-English text)."""
    text = "我爱 the river ⅶ"
    tokens, _ = api_attention(api, text, layers=[0], heads=[0])
    assert any(t["piece"] == "[UNK]" and not t["special"] for t in tokens)
    open_page(page, server)
    run(page, text, model="minilm")

    def downloaded() -> list[list[str]]:
        with page.expect_download() as download:
            page.click("#download-csv")
        return list(csv.reader(io.StringIO(open(download.value.path(), encoding="utf-8").read())))

    rows = downloaded()
    assert rows[0][2:] == [f"{i}:{t['piece']}" for i, t in enumerate(tokens)]
    assert [r[1] for r in rows[1:]] == [t["piece"] for t in tokens]
    page.select_option("#labels", "text")
    rows = downloaded()
    assert rows[0][2:] == [f"{i}:{t['text']}" for i, t in enumerate(tokens)]


def test_head_view_chips_add_heads(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    page.wait_for_selector(".hv-left li")
    page.check("#hv-head-5")
    assert page.locator(".head-chips input:checked").count() == 2


def test_phone_width_and_dark_mode_lay_out_cleanly(server, make_page, artifacts):
    page = make_page(viewport=(390, 844), color_scheme="dark")
    open_page(page, server, f"?text={SENTENCE}&model=minilm&layer=0&head=1")
    wait_focus(page, layer=0, head=1)
    wait_grid(page)
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    background = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(13, 17, 23)"
    page.screenshot(path=str(artifacts / "phone-dark.png"), full_page=True)


@pytest.mark.parametrize("width", [1366, 1000])
def test_the_forms_boxes_line_up(server, make_page, width):
    """The Sentence box's hint, once below it, lifted it 18 px above the other two at 1366 px."""
    page = make_page(viewport=(width, 768))
    open_page(page, server)
    tops = page.evaluate("""() => ['#text', '#pair', '#model'].map((s) =>
        document.querySelector(s).getBoundingClientRect()).map((r) => [r.top, r.bottom])""")
    assert max(top for top, _ in tops) - min(top for top, _ in tops) <= 1.5, tops
    assert max(bottom for _, bottom in tops) - min(bottom for _, bottom in tops) <= 1.5, tops
    assert page.is_visible("#text-hint")


def test_a_link_runs_its_own_text_with_its_carriage_returns(server, api, page):
    """A text area gives "\r\n" back as "\n": a link to a view of "a\r\nb" ran "a\nb", another text
    (a byte-level model's tokens differ) than the run the link was saved from (a review by use)."""
    text, pair = "First line.\r\nSecond line.\rThird.", "A pair\r\nof lines."
    view = api.post("/api/v1/views", json={"text": text, "text_pair": pair, "model": "minilm"}).json()["id"]
    with page.expect_request(lambda r: r.url.endswith("/api/v1/attention") and r.method == "POST") as request:
        open_page(page, server, f"?view={view}")
    sent = json.loads(request.value.post_data)
    assert (sent["text"], sent["text_pair"]) == (text, pair)
    wait_focus(page)
    # Edited, the box's own text is what runs.
    page.fill("#text", "First line.\nSecond line, edited.")
    with page.expect_request(lambda r: r.url.endswith("/api/v1/attention") and r.method == "POST") as request:
        page.press("#text", "Enter")
    assert json.loads(request.value.post_data)["text"] == "First line.\nSecond line, edited."


def test_a_pasted_document_keeps_its_lines_and_enter_still_runs(server, page):
    """A one-line box sent a pasted document's newlines as spaces: other tokens, and other weights
    than the API's for the same text (a review by use)."""
    sent = []
    page.on("request", lambda r: sent.append(r.post_data) if r.url.endswith("/api/v1/attention") and r.method == "POST" else None)
    open_page(page, server)
    one_line = page.evaluate("() => document.getElementById('text').getBoundingClientRect().height")
    document = "First line of a document.\nSecond line.\n\nA paragraph later.\n"
    page.focus("#text")
    page.keyboard.insert_text(document)  # as a paste does
    page.keyboard.press("Shift+Enter")  # starts a line, runs nothing
    page.keyboard.type("The end.")
    grown = page.evaluate("() => document.getElementById('text').getBoundingClientRect().height")
    assert grown > 3 * one_line and not sent
    page.keyboard.press("Enter")
    wait_grid(page)
    assert json.loads(sent[-1])["text"] == document + "\nThe end."
    assert page.locator("#text").input_value() == document + "\nThe end."  # Enter ran; it added no line
    # The pair's box too (it was a one-line input that made a pasted pair's lines spaces).
    page.focus("#pair")
    page.keyboard.insert_text("Its second text.\nOn two lines.")
    assert page.evaluate("() => document.getElementById('pair').getBoundingClientRect().height") > 1.5 * one_line
    with page.expect_request(lambda r: r.url.endswith("/api/v1/attention") and r.method == "POST") as request:
        page.keyboard.press("Enter")
    assert json.loads(request.value.post_data)["text_pair"] == "Its second text.\nOn two lines."
    assert page.locator("#pair").input_value() == "Its second text.\nOn two lines."


def test_no_request_leaves_loopback_and_modebar_exports_png_and_svg(server, page, watched):
    open_page(page, server)
    run(page, SENTENCE, PAIR)
    wait_grid(page)
    for kind in ("PNG", "SVG"):
        page.hover("#focus-plot")
        with page.expect_download() as download:
            page.click(f".modebar-btn[data-title='Download plot as {kind}']")
        assert download.value.suggested_filename == f"manyeyes-minilm-L0-H0.{kind.lower()}"
        head = open(download.value.path(), "rb").read(512)
        assert head.startswith(b"\x89PNG") if kind == "PNG" else b"<svg" in head
    hosts = {urlsplit(u).hostname for u in watched.requests if urlsplit(u).scheme.startswith("http")}
    assert hosts == {"127.0.0.1"}
    assert any("/vendor/plotly.min.js" in u for u in watched.requests)  # plotly.js itself came from us
    assert watched.off_loopback() == []


CAPTURE_EXPORT = """() => {
  const real = window.Plotly.downloadImage;
  window.Plotly.downloadImage = (figure, options) => {
    window.exported = { caption: figure.layout.title.text, width: options.width };
    return real(figure, options);
  };
}"""
CAPTION_PX = """(text) => {
  const context = document.createElement('canvas').getContext('2d');
  context.font = '13px system-ui, -apple-system, Segoe UI, sans-serif';
  return context.measureText(text).width;
}"""


def test_an_exported_caption_fits_the_figures_width(server, make_page):
    """The caption was cut at 80 characters whatever the figure's width: on a laptop's narrow
    figure it ran off the image's right edge, cut mid-word."""
    page = make_page(viewport=(760, 900))
    open_page(page, server)
    text = "The bank of the river was muddy after the rain, and the heron waited by the old mill for the fish."
    run(page, text)
    page.evaluate(CAPTURE_EXPORT)
    page.hover("#focus-plot")
    with page.expect_download():
        page.click(".modebar-btn[data-title='Download plot as PNG']")
    exported = page.evaluate("() => window.exported")
    caption = exported["caption"]
    assert caption.startswith("minilm · Layer 0, head 0 · “The bank of the river") and caption.endswith("…”"), caption
    assert page.evaluate(CAPTION_PX, caption) <= 0.98 * exported["width"] - 8, exported


def test_an_evicted_run_is_posted_again(server, page, watched):
    """The server answers 404 for a run its cache dropped; the page re-posts and carries on."""
    evicted = []

    def evict_once(route):
        if evicted:
            route.continue_()
            return
        evicted.append(route.request.url)
        # The server's own reply for a run its cache does not hold.
        reply = route.fetch(url=route.request.url.replace("/runs/", "/runs/evicted"))
        assert reply.status == 404
        route.fulfill(response=reply)

    page.route(re.compile(r".*/api/v1/runs/.*format=u8.*"), evict_once)
    text = " ".join(f"Sentence number {i} talks about rivers and banks." for i in range(40))
    open_page(page, server)
    run(page, text)
    wait_grid(page)
    posts = [u for u in watched.requests if u.endswith("/api/v1/attention")]
    assert len(evicted) == 1 and len(posts) == 2
    assert page.locator("#error").is_hidden()


def test_api_docs_render_offline_under_the_csp(server, page, artifacts):
    """/docs is Swagger UI from local files: it must draw every operation with no CDN and no CSP error."""
    page.goto(f"{server}/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=30_000)
    paths = page.locator(".opblock-summary-path").all_inner_texts()
    for path in ("/api/v1/models", "/api/v1/attention", "/api/v1/attention/batch", "/api/v1/runs/{run_id}/attention"):
        assert any(p.replace("\u200b", "") == path for p in paths), (path, paths)
    page.screenshot(path=str(artifacts / "api-docs.png"))


def test_the_pair_box_says_how_a_causal_model_reads_it(server, page):
    """A causal model has no [SEP] pairs: its tokenizer glued "it?" to "On the bank" and nothing on
    the page said so; the box's grey example text read as part of the run (a review by use)."""
    open_page(page, server)
    assert page.locator("#pair-note").text_content() == "(optional, for pairs)"
    assert page.locator("#pair").get_attribute("placeholder") == "(none)"
    page.select_option("#model", "tiny-causal")
    assert page.locator("#pair-note").text_content() == "(optional: read after the first)"
    page.select_option("#model", "minilm")
    assert page.locator("#pair-note").text_content() == "(optional, for pairs)"
