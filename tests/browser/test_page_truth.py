"""What the page draws is the model's attention: pixels, plotted values and the URL against the API.

Each check reads something stable (canvas pixels, the plotted values, the address bar) and compares it
with the API's answer for the same text, never with another part of the page, so a page that
draws the wrong head everywhere, or restores a link to the wrong view, fails.
"""

from __future__ import annotations

import base64
import math
import re
from urllib.parse import parse_qs, urlencode, urlsplit

import numpy as np
import pytest

from tests.browser.test_page import hover_cell, open_page, plotted, submit, wait_plotted_shape

pytestmark = pytest.mark.browser

SENTENCE = "The bank of the river was muddy after the rain."
PAIR = "It flowed slowly to the sea."


# ---------------------------------------------------------------------------- page helpers
def open_view(page, server, **query):
    open_page(page, server, f"?{urlencode(query)}" if query else "")


def wait_focus(page, layer, head):
    """The focused heatmap of this head, with its exact (f16) values."""
    page.wait_for_selector(f"#focus-plot[data-precision=f16][data-layer='{layer}'][data-head='{head}']", timeout=30_000)


def wait_grid(page):
    page.wait_for_function(
        "() => document.querySelectorAll('.thumb').length > 0 && !document.querySelector('.thumb.loading')",
        timeout=30_000,
    )




# ---------------------------------------------------------------------------- API helpers
def api_json(api, text, pair=None, model="minilm", **extra):
    body = {"text": text, "model": model, "format": "json", **extra}
    if pair is not None:
        body["text_pair"] = pair
    reply = api.post("/api/v1/attention", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["tokens"], np.asarray(data["attention"]["data"], dtype=np.float64)  # (L, H, T, T)


def api_u8(api, text, pair=None, model="minilm") -> np.ndarray:
    """The bytes the grid draws from: (L, H, T, T) uint8."""
    body = {"text": text, "model": model, "format": "u8"}
    if pair is not None:
        body["text_pair"] = pair
    att = api.post("/api/v1/attention", json=body).json()["attention"]
    return np.frombuffer(base64.b64decode(att["data"]), dtype=np.uint8).reshape(att["shape"])


# ---------------------------------------------------------------------------- thumbnails
def max_pool(matrix: np.ndarray, k: int) -> np.ndarray:
    rows, cols = matrix.shape
    padded = np.zeros((math.ceil(rows / k) * k, math.ceil(cols / k) * k), dtype=matrix.dtype)
    padded[:rows, :cols] = matrix
    return padded.reshape(padded.shape[0] // k, k, padded.shape[1] // k, k).max(axis=(1, 3))


def read_thumbnails(page) -> dict[tuple[int, int], np.ndarray]:
    """Every thumbnail's pixels, each mapped back through the page's own colour table to colour
    indices (-1 where a pixel is no colour of the scale). A colour that several indices share
    maps to all of them: the value is the set of possible indices, as a (h, w, 256) bool array."""
    raw = page.evaluate(
        """async () => {
            const { colorTable } = await import('/static/js/theme.js');
            const table = Array.from(colorTable());
            const thumbs = [...document.querySelectorAll('.thumb')].map((button) => {
                const c = button.querySelector('canvas');
                const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                return { layer: Number(button.dataset.layer), head: Number(button.dataset.head),
                         width: c.width, height: c.height, rgba: Array.from(px) };
            });
            return { table, thumbs };
        }"""
    )
    table = np.asarray(raw["table"], dtype=np.uint32)[:256]  # packed little-endian RGBA; 256 is "masked"
    out = {}
    for t in raw["thumbs"]:
        rgba = np.asarray(t["rgba"], dtype=np.uint32).reshape(t["height"], t["width"], 4)
        packed = rgba[..., 0] | (rgba[..., 1] << 8) | (rgba[..., 2] << 16) | (rgba[..., 3] << 24)
        out[(t["layer"], t["head"])] = packed[..., None] == table[None, None, :]
    return out


def test_every_thumbnail_shows_its_own_heads_pooled_values(server, api, page):
    """Pixels -> colour-table index -> compared with round(pooled * 255 / peak) of that very head."""
    open_view(page, server)
    submit(page, SENTENCE, PAIR)
    wait_grid(page)
    weights = api_u8(api, SENTENCE, PAIR).astype(np.float64)  # (L, H, T, T)
    n_layers, n_heads, T, _ = weights.shape
    thumbs = read_thumbnails(page)
    assert set(thumbs) == {(l, h) for l in range(n_layers) for h in range(n_heads)}
    k = math.ceil(T / 128)
    wrong = []
    for (layer, head), possible in thumbs.items():
        pooled = max_pool(weights[layer, head], k)
        assert possible.shape[:2] == pooled.shape, (layer, head, possible.shape, pooled.shape)
        assert possible.any(axis=-1).all(), f"L{layer}H{head}: pixels that are no colour of the scale"
        expected = np.rint(pooled * 255 / pooled.max()).astype(int)
        # A pixel is right when one of the indices its colour stands for is within 1 of the expected one.
        near = np.zeros(expected.shape, dtype=bool)
        for shift in (-1, 0, 1):
            index = np.clip(expected + shift, 0, 255)
            near |= np.take_along_axis(possible, index[..., None], axis=-1)[..., 0]
        if not near.all():
            wrong.append((layer, head, int((~near).sum())))
    assert wrong == [], f"thumbnails whose pixels are not their head's values (layer, head, bad pixels): {wrong}"
    # The check has power: the heads really differ, so a grid of one head repeated could not pass.
    assert np.abs(weights[0, 0] - weights[3, 7]).max() > 50


# ---------------------------------------------------------------------------- permalink
def test_permalink_restores_the_linked_head_as_the_api_computes_it(server, api, make_page):
    first = make_page()
    open_view(first, server)
    submit(first, SENTENCE, PAIR)
    wait_focus(first, 0, 0)
    first.click(".thumb[data-layer='3'][data-head='9']")
    wait_focus(first, 3, 9)
    # The address bar holds only the id of the view saved on the server (short for any text).
    first.wait_for_function("() => !document.body.dataset.viewPending && document.body.dataset.view"
                            " && new URLSearchParams(location.search).get('view') === document.body.dataset.view")
    query = parse_qs(urlsplit(first.url).query)
    assert list(query) == ["view"] and re.fullmatch(r"[0-9a-f]{18}", query["view"][0])

    tokens, weights = api_json(api, SENTENCE, PAIR)
    second = make_page()
    second.goto(first.url)  # a fresh context: nothing but the URL carries the view
    wait_focus(second, 3, 9)
    z = np.asarray(plotted(second), dtype=np.float64)
    assert z.shape == (len(tokens), len(tokens))
    assert np.abs(z - weights[3, 9]).max() <= 1e-3  # float16 readings of the linked head
    assert np.abs(weights[3, 9] - weights[0, 0]).max() > 0.1  # ... which a default view would not show
    assert second.locator("#text").input_value() == SENTENCE
    assert second.locator("#pair").input_value() == PAIR


def test_a_saved_views_thumbnails_under_hiding_options_are_those_its_page_drew(server, make_page, watched):
    """Renormalised from 8-bit bytes, a row that gave the hidden tokens nearly all its weight was
    lost: a thumbnail was drawn from its layer's exact values only if the focus had fetched them,
    so the page that saved a view (its focus had been on layer 0) and the same view reopened drew
    L0 H2 as one dark cell and as a blank (review h55d). Under hiding options the grid fetches
    every layer's exact values."""
    first = make_page()
    open_view(first, server)
    submit(first, "The bank of the river was muddy.", "I sat on it.")
    wait_focus(first, 0, 0)
    first.click(".thumb[data-layer='2'][data-head='5']")
    wait_focus(first, 2, 5)
    first.check("#hide-special")
    first.select_option("#scale", "fixed")
    first.select_option("#segments", "AB")
    watched.settle(first)
    first.wait_for_function("() => !document.body.dataset.viewPending && document.body.dataset.view"
                            " && new URLSearchParams(location.search).get('view') === document.body.dataset.view")
    second = make_page()
    second.goto(first.url)
    second.wait_for_selector("#focus-plot[data-layer='2'][data-head='5']:not([data-stale])", timeout=30_000)
    watched.settle(second)
    drawn, reopened = read_thumbnails(first), read_thumbnails(second)
    differ = sorted(k for k in drawn if not np.array_equal(drawn[k], reopened[k]))
    assert differ == [], f"thumbnails the reopened view draws otherwise: {differ}"
    for page in (first, second):
        values = page.locator(".thumb").evaluate_all("cells => cells.map((c) => c.dataset.values)")
        assert set(values) == {"f16"}, values
        assert page.locator("#hide-special").is_checked()


def test_a_run_kept_as_8_bit_bytes_is_posted_again_once_for_the_grids_exact_values(server, page, watched):
    """A GPU server keeps a u8 answer's run as its bytes (precision "u8"): asking every layer's
    float16 for the grid posted the whole text again once per layer, all at once (review h55e)."""
    import json

    posts = []

    def as_gpu_server(route):
        body = route.request.post_data_json or {}
        posts.append(body.get("format"))
        answer = route.fetch(headers={**route.request.headers, "accept": "application/json"})  # not a frame: JSON to edit
        data = answer.json()
        if body.get("format") == "u8":
            data["precision"] = "u8"  # as a GPU server answers: its run holds the u8 bytes
        route.fulfill(response=answer, body=json.dumps(data))

    open_view(page, server)
    submit(page, "A first text.")
    page.wait_for_selector("#run-form[aria-busy=false]", timeout=30_000)
    page.check("#hide-special")
    watched.settle(page)
    page.route("**/api/v1/attention", as_gpu_server)
    submit(page, SENTENCE, PAIR)  # its run under hidden tokens from the start
    page.wait_for_function("() => [...document.querySelectorAll('.thumb')].every((c) => c.dataset.values === 'f16')",
                           timeout=30_000)
    watched.settle(page)
    assert posts[0] == "u8" and 1 <= posts.count("f16") <= 2, posts  # the grid's, and the focus's own
    n_layers = len({c for c in page.locator(".thumb").evaluate_all("cells => cells.map((c) => c.dataset.layer)")})
    assert n_layers == 6 and posts.count("f16") < n_layers


# ---------------------------------------------------------------------------- pair blocks
def test_pair_block_a_to_b_shows_each_rows_share_of_all_its_words(server, api, page):
    open_view(page, server, text=SENTENCE, pair=PAIR, model="minilm", layer=2, head=3)
    wait_focus(page, 2, 3)
    tokens, weights = api_json(api, SENTENCE, PAIR, layers=[2], heads=[3])
    head = weights[0, 0]
    special = np.array([t["special"] for t in tokens])
    segment = np.array([t["segment"] for t in tokens])
    a, b = segment == 0, segment == 1

    page.select_option("#segments", "AB")
    wait_plotted_shape(page, int(a.sum()), int(b.sum()))
    z = np.asarray(plotted(page), dtype=np.float64)
    assert np.abs(z - head[a][:, b]).max() <= 1e-3  # the raw block: A's queries, B's keys

    page.check("#hide-special")
    rows, cols = a & ~special, b & ~special
    wait_plotted_shape(page, int(rows.sum()), int(cols.sum()))
    z = np.asarray(plotted(page), dtype=np.float64)
    # Renormalised over every word of the row (both sentences), not over the block's own keys:
    # the block then shows how much of its attention a word of A gives to B.
    shares = head[rows][:, cols] / head[rows][:, ~special].sum(axis=1, keepdims=True)
    assert np.abs(z - shares).max() <= 2e-3
    assert np.all(z.sum(axis=1) < 0.999)  # a share, never a whole


# ---------------------------------------------------------------------------- renormalised rows
def test_a_sink_row_renormalised_holds_the_weights_float16_lost(server, api, page):
    """MiniLM's L0 H2 gives [CLS] and [SEP] all but 5e-6 of the first word's attention: in float16
    the rest of that row was 0 or coarse, and renormalised it read 0 where the model's weights run
    up to 0.003. Weights under float16's range read 0.000 too, though none of them is 0."""
    open_view(page, server, text=SENTENCE, model="minilm", layer=0, head=2)
    wait_focus(page, 0, 2)
    tokens, weights = api_json(api, SENTENCE, layers=[0], heads=[2])
    head = weights[0, 0]
    # A weight float16 rounds to 0 is drawn as 0, and reads as itself: readings are float32.
    q, k = (int(i) for i in np.unravel_index(np.argmin(head), head.shape))
    assert head[q, k] < 2 ** -25
    hover_cell(page, q, k)
    page.wait_for_function("(want) => document.getElementById('tooltip').textContent.split('\\n')[0].endsWith(want)",
                           arg=f": {float(head[q, k]):.2g}", timeout=10_000)

    words = np.flatnonzero(~np.array([t["special"] for t in tokens]))
    kept = head[np.ix_(words, words)]
    assert kept.sum(axis=1).min() < 1e-5  # the sink row
    shares = kept / kept.sum(axis=1, keepdims=True)
    page.check("#hide-special")
    wait_plotted_shape(page, len(words), len(words))
    z = np.asarray(plotted(page), dtype=np.float64)
    assert np.abs(z - shares).max() <= 1e-6
    # The smallest renormalised weight (1e-19) reads as itself.
    r, c = (int(i) for i in np.unravel_index(np.argmin(shares), shares.shape))
    reading = float(hover_cell(page, r, c, int(words[r]), int(words[c])).rsplit(": ", 1)[1])
    assert reading == pytest.approx(shares[r, c], rel=0.05)


# ---------------------------------------------------------------------------- causal models
@pytest.mark.parametrize("layer, head", [(0, 0), (1, 2)])
def test_causal_lower_triangle_is_the_api_and_the_upper_is_masked(server, api, page, layer, head):
    text = "The bank of the river was muddy."
    open_view(page, server, text=text, model="tiny-causal", layer=layer, head=head)
    wait_focus(page, layer, head)
    tokens, weights = api_json(api, text, model="tiny-causal")
    expected = weights[layer, head]
    z = plotted(page)
    n = len(tokens)
    assert len(z) == n
    lower = np.array([[z[r][c] for c in range(r + 1)] + [0.0] * (n - r - 1) for r in range(n)], dtype=np.float64)
    assert all(z[r][c] is None for r in range(n) for c in range(r + 1, n))
    assert np.abs(lower - expected).max() <= 1e-3
    # The heads differ, so this compares one head, not any causal pattern.
    other = weights[1 - layer, (head + 1) % weights.shape[1]]
    assert np.abs(other - expected).max() > 0.02


# ---------------------------------------------------------------------------- head view
def line_ends(page, side: str) -> list[bool]:
    """For each token on one side, whether any line ends beside it at that edge of the canvas."""
    return page.evaluate(
        """(side) => {
            const canvas = document.querySelector('.hv-canvas');
            const box = canvas.getBoundingClientRect();
            const sx = canvas.width / box.width, sy = canvas.height / box.height;
            const ctx = canvas.getContext('2d');
            const x = side === 'left' ? 0 : Math.floor(canvas.width - 3 * sx);
            return [...document.querySelectorAll(`.hv-${side} li`)].map((li) => {
                const r = li.getBoundingClientRect();
                const y = Math.round(((r.top + r.bottom) / 2 - box.top) * sy);
                const px = ctx.getImageData(x, Math.max(0, y - Math.ceil(3 * sy)), Math.ceil(3 * sx), Math.ceil(6 * sy)).data;
                for (let i = 3; i < px.length; i += 4) if (px[i] > 0) return true;
                return false;
            });
        }""",
        side,
    )


def test_head_view_hover_draws_only_that_tokens_lines_to_the_keys_it_attends(server, api, page):
    open_view(page, server, text=SENTENCE, model="minilm", layer=4, head=1)
    wait_focus(page, 4, 1)
    page.wait_for_selector(".hv-left li")
    tokens, weights = api_json(api, SENTENCE, layers=[4], heads=[1])
    head = weights[0, 0]
    page.mouse.move(0, 0)
    assert sum(line_ends(page, "left")) > len(tokens) // 2  # unhovered: many tokens' lines

    query = 3
    page.hover(f".hv-left li[data-index='{query}']")
    left = line_ends(page, "left")
    assert left == [i == query for i in range(len(tokens))], left
    right = line_ends(page, "right")
    for key, drawn in enumerate(right):
        if head[query, key] >= 0.05:
            assert drawn, (key, head[query, key])
        elif head[query, key] < 0.015:
            assert not drawn, (key, head[query, key])


def test_a_faint_view_under_per_head_colour_says_how_faint(server, api, page):
    """A pair's A → B block of at most 0.003 was drawn as dark as a sharp head: only the
    colorbar's top said otherwise (a review by use)."""
    tokens, weights = api_json(api, SENTENCE, PAIR, layers=[0], heads=[2])
    segment = np.array([t["segment"] for t in tokens])
    peak = float(weights[0, 0][segment == 0][:, segment == 1].max())
    assert peak < 0.01
    open_view(page, server, text=SENTENCE, pair=PAIR, model="minilm", layer=0, head=2)
    wait_focus(page, 0, 2)
    assert "faint" not in page.text_content("#focus-caption")  # all tokens: its largest weight is large
    page.select_option("#segments", "AB")
    page.wait_for_function("() => document.querySelector('#focus-caption').textContent.includes('faint')")
    said = re.search(r"faint: the darkest cell is ([0-9.e-]+) \(Fixed 0–1 puts it on one scale\)", page.text_content("#focus-caption"))
    assert said and abs(float(said[1]) - peak) <= 0.01 * peak + 1e-4, (said, peak)
    page.select_option("#scale", "fixed")
    page.wait_for_function("() => !document.querySelector('#focus-caption').textContent.includes('faint')")
