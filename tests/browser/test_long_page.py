"""The page at any length (issue 10, item 5): a run answered with `kept: "qk"` is drawn from the
server's tiles, overview and top-k rows, never from the whole tensor.

`KeptMock` computes a long run's answers from known queries and keys (a causal softmax, exactly),
and the page's requests for them are answered through Playwright's page.route(): the tests hold
the page to the values, windows and sizes of the tiles it asks for."""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from tests.browser.test_page import PAIR, SENTENCE, hover_cell, open_page, submit, wait_focus

pytestmark = pytest.mark.browser

MAX_SIDE = 1024


def bins(n: int, size: int) -> np.ndarray:
    """Bin edges of LONG.md's pooled(): width ceil(n / size), the last bin possibly narrower."""
    width = -(-n // size)
    return np.append(np.arange(0, n, width), n)


def array(values: np.ndarray) -> dict:
    """The API's ArrayData in format=json (app/schemas.py)."""
    return {"format": "json", "dtype": str(values.dtype), "shape": list(values.shape), "data": values.tolist()}


class KeptMock:
    """A long causal run: L × H heads over T tokens, weights from random queries and keys, answered
    in the shapes of the API's TileResponse, OverviewResponse and TopKResponse (app/schemas.py)."""

    def __init__(self, T=2048, n_layers=2, n_heads=4, dim=8, seed=0):
        rng = np.random.default_rng(seed)
        self.T, self.n_layers, self.n_heads = T, n_layers, n_heads
        self.q = rng.standard_normal((n_layers, n_heads, T, dim)).astype(np.float32)
        self.k = rng.standard_normal((n_layers, n_heads, T, dim)).astype(np.float32)
        # Head (l, 0) looks at the previous token: a diagonal stripe to see in the pictures.
        self.k[:, 0, :-1] += 3 * self.q[:, 0, 1:]
        self.cache: dict = {}
        words = ("the river ran past the old mill and under the bridge where children played " * 300).split()
        text, self.tokens = "", []
        for i in range(T):
            piece = f"{words[i % len(words)]}{i}"
            start = len(text) + (1 if text else 0)
            text += (" " if text else "") + piece
            self.tokens.append({"text": piece, "piece": piece, "id": i, "start": start, "end": start + len(piece),
                                "special": False, "segment": 0})
        self.text = text
        self.prompt = text[:200]  # what the tests type: its POST is answered with this run
        self.requests: list[str] = []
        self.posts = 0
        self.lost = False  # as if the server's cache dropped the run: its routes answer 404 ...
        self.stays_lost = False  # ... until the text is posted again, unless it never fits again
        self.refused: list[tuple[int, str]] = []  # (index in requests, url) of each 404

    def head(self, layer: int, head) -> np.ndarray:
        key = (layer, head)
        if key not in self.cache:
            if head == "mean":
                weights = np.mean([self.head(layer, h) for h in range(self.n_heads)], axis=0)
            else:
                scores = self.q[layer, head] @ self.k[layer, head].T  # (T, T)
                scores[np.triu_indices(self.T, 1)] = -np.inf
                scores -= scores.max(axis=1, keepdims=True)
                weights = np.exp(scores)
                weights /= weights.sum(axis=1, keepdims=True)
            self.cache[key] = weights.astype(np.float32)
        return self.cache[key]

    def pooled(self, m: np.ndarray, rows: int, cols: int):
        re_, ce = bins(m.shape[0], rows), bins(m.shape[1], cols)
        out = np.maximum.reduceat(np.maximum.reduceat(m, re_[:-1], axis=0), ce[:-1], axis=1)
        return out, re_, ce

    def answer(self) -> dict:
        return {
            "run_id": "long-mock", "model": "tiny-causal", "causal": True, "n_layers": self.n_layers,
            "n_heads": self.n_heads, "tokens": self.tokens, "truncated": False, "kept": "qk", "attention": None,
            "links": {}, "timing_ms": {"forward": 1.0},
        }

    def tile(self, query: dict) -> dict:
        layer = int(query["layer"])
        head = query["head"] if query["head"] == "mean" else int(query["head"])
        q0, q1, k0, k1 = (int(query[f]) for f in ("q0", "q1", "k0", "k1"))
        window = self.head(layer, head)[q0:q1, k0:k1]
        rows, cols = int(query.get("rows", q1 - q0)), int(query.get("cols", k1 - k0))
        assert rows <= MAX_SIDE and cols <= MAX_SIDE, query
        if rows >= q1 - q0 and cols >= k1 - k0:
            assert (q1 - q0) * (k1 - k0) <= MAX_SIDE * MAX_SIDE, query
        values, re_, ce = self.pooled(window, min(rows, q1 - q0), min(cols, k1 - k0))
        if query.get("format") == "f16":  # rounded as the server's float16 tiles are
            values = values.astype(np.float16).astype(np.float32)
        full = len(re_) - 1 == q1 - q0 and len(ce) - 1 == k1 - k0
        return {"run_id": "long-mock", "layer": layer, "head": head, "window": {"q0": q0, "q1": q1, "k0": k0, "k1": k1},
                "shape": list(values.shape), "pool": "none" if full else "max",
                "row_edges": (re_ + q0).tolist(), "col_edges": (ce + k0).tolist(), "attention": array(values)}

    def overview(self) -> dict:
        thumbs = [[self.pooled(self.head(l, h), 64, 64)[0] for h in range(self.n_heads)] for l in range(self.n_layers)]
        edges = bins(self.T, 64).tolist()
        return {"run_id": "long-mock", "n_layers": self.n_layers, "n_heads": self.n_heads, "row_edges": edges,
                "col_edges": edges, "pool": "max", "attention": array(np.array(thumbs))}

    def topk(self, query: dict) -> dict:
        layer, head, k = int(query["layer"]), int(query["head"]), int(query["k"])
        q0, q1 = int(query["q0"]), int(query["q1"])
        rows = self.head(layer, head)[q0:q1]
        order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
        values = np.take_along_axis(rows, order, axis=1)
        return {"run_id": "long-mock", "layer": layer, "head": head, "k": k, "q0": q0, "q1": q1, "values": array(values),
                "indices": array(order.astype(np.int32)), "rest": array(np.maximum(0, 1 - values.sum(1)))}

    def cell(self, query: dict) -> dict:
        q, k = int(query["query"]), int(query["key"])
        values = np.array([[self.head(l, h)[q, k] for h in range(self.n_heads)] for l in range(self.n_layers)])
        return {"run_id": "long-mock", "query": q, "key": k, "shape": list(values.shape),
                "attention": array(values.astype(np.float16).astype(np.float32))}

    def serve(self, page):
        """Answers the page's long-run requests from this run; the rest go to the real server."""

        def reply(route, body, status=200):
            route.fulfill(status=status, content_type="application/json", body=json.dumps(body))

        def on_post(route):
            body = route.request.post_data_json or {}
            if route.request.method != "POST" or body.get("text") != self.prompt:
                route.continue_()  # another text: the real server's (short) run
                return
            if "predictions" in body:  # the strip's ask, which the server answers from the run it keeps
                guesses = {str(i): [{"token": "x", "id": 0, "prob": 0.5}] for i in range(self.T)}
                reply(route, self.answer() | {"predictions": guesses})
                return
            self.posts += 1
            self.lost = self.stays_lost
            reply(route, self.answer())

        def on_run(route):
            url = urlsplit(route.request.url)
            self.requests.append(route.request.url)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            what = url.path.rsplit("/", 1)[-1]
            if self.lost:
                self.refused.append((len(self.requests) - 1, route.request.url))
                message = "run long-mock is unknown or was evicted from the cache; POST /api/v1/attention again to recompute it"
                reply(route, {"error": {"code": "unknown_run", "message": message}}, 404)
                return
            handlers = {"tile": self.tile, "overview": lambda _q: self.overview(), "topk": self.topk, "cell": self.cell}
            if what not in handlers:
                reply(route, {"error": {"code": "dense_only", "message": f"{what} needs the dense weights"}}, 422)
                return
            reply(route, handlers[what](query))

        page.route("**/api/v1/attention", on_post)
        page.route("**/api/v1/runs/long-mock/**", on_run)


def tile_windows(urls):
    """The tile requests among urls as (q0, q1, k0, k1, rows or None)."""
    out = []
    for url in urls:
        parts = urlsplit(url)
        if not parts.path.endswith("/tile"):
            continue
        q = {k: v[0] for k, v in parse_qs(parts.query).items()}
        out.append((int(q["q0"]), int(q["q1"]), int(q["k0"]), int(q["k1"]), int(q["rows"]) if "rows" in q else None))
    return out


def wait_settled(page, timeout=30_000):
    page.wait_for_function(
        "() => { const p = document.getElementById('focus-plot');"
        " return p.dataset.long === 'true' && p.dataset.tilesPending === '0'; }", timeout=timeout)


def zoomed_in(page, server, mock, q0, q1, k0, k1):
    """The mock's run on the page, zoomed to full resolution on queries [q0, q1) × keys [k0, k1)."""
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    zoom(page, q0, q1, k0, k1)
    page.wait_for_function("() => document.getElementById('focus-plot').dataset.level === '1'")
    wait_settled(page)


def zoom(page, q0, q1, k0, k1):
    """Zooms the heatmap to queries [q0, q1) × keys [k0, k1) as a drag would (Plotly relayout)."""
    page.evaluate("([q0, q1, k0, k1]) => Plotly.relayout('focus-plot', {'xaxis.range': [k0 - 0.5, k1 - 0.5],"
                  " 'yaxis.range': [q1 - 0.5, q0 - 0.5]})", [q0, q1, k0, k1])


def shortened(piece: str) -> str:
    """A label as the page shortens it (focus.js shortLabel)."""
    return piece[:13] + "…" if len(piece) > 14 else piece


def visible_labels(page, axis):
    return page.evaluate("(axis) => [...document.querySelectorAll(`#focus-plot .${axis}tick`)]"
                         ".filter(g => g.style.display !== 'none').map(g => g.querySelector('text').textContent)", axis)


# Whether the cell's pixel has the masked colour.
MASKED_PIXEL = """async ([row, col]) => {
    const gd = document.getElementById('focus-plot');
    const drag = gd.querySelector('.nsewdrag').getBoundingClientRect();
    const canvas = gd.querySelector('canvas.heatmap-canvas');
    const box = canvas.getBoundingClientRect();
    const px = Math.floor((drag.left + gd._fullLayout.xaxis.l2p(col) - box.left) * canvas.width / box.width);
    const py = Math.floor((drag.top + gd._fullLayout.yaxis.l2p(row) - box.top) * canvas.height / box.height);
    const [r, g, b, a] = canvas.getContext('2d').getImageData(px, py, 1, 1).data;
    const { colorTable } = await import('/static/js/theme.js');
    const m = colorTable()[256];
    return a === 255 && r === (m & 255) && g === ((m >> 8) & 255) && b === ((m >> 16) & 255);
}"""


def assert_never_whole(urls, T):
    for url in urls:
        path = urlsplit(url).path
        assert not re.search(r"/runs/[^/]+/(attention|mean)$", path), url
    for q0, q1, k0, k1, rows in tile_windows(urls):
        if rows is None:
            assert (q1 - q0) * (k1 - k0) <= MAX_SIDE * MAX_SIDE, (q0, q1, k0, k1)
        else:
            assert rows <= MAX_SIDE


@pytest.fixture
def mock():
    return KeptMock()


def test_long_run_paints_overview_then_tiles_and_refines_on_zoom(server, page, mock, watched, artifacts):
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    page.wait_for_function("() => !document.querySelector('.thumb.loading') && document.querySelectorAll('.thumb').length === 8")
    T = mock.T
    plotted = page.evaluate("() => document.getElementById('focus-plot').plotted()")
    assert plotted["long"] and plotted["rows"] == T and plotted["window"] == {"q0": 0, "q1": T, "k0": 0, "k1": T}
    # The head's peak sets the colour scale; the screen's few hundred pixels set the pooling.
    assert plotted["peak"] == pytest.approx(float(mock.head(0, 0).max()), abs=1e-6)
    level = plotted["level"]
    assert 2 <= level <= 16
    # Settled, the window's own tiles are all there is to draw (the overview under them is hidden).
    assert plotted["tiles"] and all(t["w"] == level and t["pool"] == "max" for t in plotted["tiles"])
    first = tile_windows(mock.requests)
    assert first and all(rows == min(256, (q1 - q0 + level - 1) // level) for q0, q1, _k0, _k1, rows in first)
    page.locator(".focus-panel").screenshot(path=str(artifacts / "long-overview-tiles.png"))

    # Zoomed to 40 × 48 tokens: full resolution, every label, hover reads the exact weight.
    before = len(mock.requests)
    zoom(page, 1000, 1040, 980, 1028)
    page.wait_for_function("() => document.getElementById('focus-plot').dataset.level === '1'")
    wait_settled(page)
    new = tile_windows(mock.requests[before:])
    assert new and all(rows is None for *_w, rows in new)
    # The window straddles a tile edge (k = 1024): the tiles that meet it cover it, above the diagonal excepted.
    for q, k in [(1000, 980), (1039, 980), (1039, 1027), (1024, 1024)]:
        assert any(q0 <= q < q1 and k0 <= k < k1 for q0, q1, k0, k1, _r in new), (q, k)
    assert visible_labels(page, "y") == [shortened(mock.tokens[i]["piece"]) for i in range(1000, 1040)]
    assert len(visible_labels(page, "x")) == 48
    weights = mock.head(0, 0)
    for q, k in [(1020, 1000), (1039, 1027), (1005, 1004), (1030, 985)]:
        text = read_cell(page, q, k)
        assert text.startswith(f"#{q} {mock.tokens[q]['piece']} → #{k} {mock.tokens[k]['piece']}: ")
        assert float(text.rsplit(": ", 1)[1]) == pytest.approx(float(weights[q, k]), abs=6e-4)
    assert hover_cell(page, 1001, 1020).endswith(": masked")
    # The head view names the 40 rows in view, not "the first 64".
    page.wait_for_function("() => (document.querySelector('#headview .hv-window')?.textContent ?? '')"
                           ".startsWith('Queries 1000–1039 of 2048: the 40 rows in view')")
    # (1010, 1026) lies in a tile wholly above the diagonal, never fetched: painted masked all the same.
    assert page.evaluate(MASKED_PIXEL, [1010, 1026])
    page.locator(".focus-panel").screenshot(path=str(artifacts / "long-zoomed.png"))
    # The export embeds what the page has of the matrix, at most 2048 pixels a side.
    with page.expect_download() as download:
        page.click(".modebar-btn[data-title='Download plot as PNG']")
    assert download.value.suggested_filename == "manyeyes-tiny-causal-L0-H0.png"
    assert open(download.value.path(), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    download.value.save_as(artifacts / "long-export.png")

    # Beyond 64 tokens in view the labels thin evenly, every k-th token for a round k, each its
    # position, at a readable size (each k-th token's text, at 7 px, said nothing of where it was).
    zoom(page, 0, 512, 0, 512)
    wait_settled(page)
    shown = visible_labels(page, "y")
    positions = [int(label) for label in shown]
    step = positions[1] - positions[0]
    assert 12 <= len(shown) <= 64 and step in (10, 20, 50) and positions == list(range(0, 512, step))[:len(shown)]
    fonts = page.evaluate("() => [...document.querySelectorAll('#focus-plot .ytick text')].map((t) => parseFloat(getComputedStyle(t).fontSize))")
    assert min(fonts) >= 10, fonts
    # The margin holds the longest position too: the axis title does not run over the numbers.
    title, left = page.evaluate("""() => [document.querySelector('#focus-plot .ytitle').getBoundingClientRect().right,
        Math.min(...[...document.querySelectorAll('#focus-plot .ytick text')].map((t) => t.getBoundingClientRect().left))]""")
    assert title <= left + 1, (title, left)
    # The head view: the rows in view, each joined to its strongest keys from the top-k route.
    page.wait_for_function("() => document.querySelectorAll('#headview .hv-left li').length === 64"
                           " && Number(document.querySelector('#headview canvas').dataset.lines) > 0")
    assert page.locator("#headview .hv-left li").first.text_content() == mock.tokens[0]["piece"]
    topk = [u for u in mock.requests if "/topk" in u]
    assert topk and "q0=0&q1=64" in topk[-1]
    # Every line ends at a listed key: the keys column holds the rows' strongest keys, in order.
    keys = [int(i) for i in page.locator("#headview .hv-right li[data-index]").evaluate_all("els => els.map(e => e.dataset.index)")]
    assert keys == sorted(keys) and 0 in keys
    assert_never_whole(watched.requests, T)


def test_a_long_run_the_server_dropped_is_posted_again_and_redrawn(server, page, mock):
    """Tiles and top-k of an evicted long run 404'd and the page only showed the API's message
    over a stale, stretched tile; a short run's slices already recovered by posting again."""
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    assert mock.posts == 1
    mock.lost = True
    before = len(mock.requests)
    zoom(page, 1000, 1040, 980, 1028)
    page.wait_for_function("() => document.getElementById('focus-plot').dataset.level === '1'")
    wait_settled(page)
    page.wait_for_function("() => document.querySelector('#headview canvas') !== null")
    assert mock.posts == 2 and not mock.lost
    assert page.locator("#error").is_hidden()
    refused_tiles = [(i, url) for i, url in mock.refused if i >= before and "/tile?" in url]
    assert refused_tiles and any(url in mock.requests[i + 1:] for i, url in refused_tiles)  # asked for again
    plotted = page.evaluate("() => document.getElementById('focus-plot').plotted()")
    assert plotted["window"] == {"q0": 1000, "q1": 1040, "k0": 980, "k1": 1028} and plotted["tiles"]
    # A run that is lost again at once (the server cannot keep it) is shown, not posted forever.
    mock.lost = mock.stays_lost = True
    zoom(page, 1500, 1540, 1480, 1528)
    page.wait_for_selector("#error:not([hidden])")
    assert "POST /api/v1/attention again" in page.locator("#error").text_content() and mock.posts == 2


def test_a_long_run_after_a_failed_first_run_takes_the_failures_note_away(server, page, mock):
    """A short run's render hid the note that a failed first run leaves in the plot; a long run's
    did not: "The example is hidden: the run above failed." stayed over its heatmap."""
    mock.serve(page)
    open_page(page, server)
    submit(page, "word " * 600)  # over MiniLM's 512 positions, not cut: refused
    page.wait_for_selector("#error:not([hidden])")
    assert page.locator("#focus-plot .plot-empty").is_visible()
    submit(page, mock.prompt)
    wait_settled(page)
    assert page.locator("#focus-plot .plot-empty").is_hidden()


def test_a_long_runs_picked_cell_ranks_every_head_by_its_weight(server, page, mock):
    """The long run's click did nothing, where /cell reads any cell of a long run from its queries
    and keys (review h55c: the README said both)."""
    zoomed_in(page, server, mock, 1000, 1040, 980, 1028)
    q, k = 1030, 1000
    page.mouse.click(*point_at_unzoomed(page, q, k))
    box = page.locator("#cell-heads")
    box.wait_for(state="visible")
    page.wait_for_function("() => !document.getElementById('cell-heads').textContent.includes('loading')")
    values = {(l, h): float(np.float16(mock.head(l, h)[q, k])) for l in range(mock.n_layers) for h in range(mock.n_heads)}
    ranked = sorted(values, key=lambda lh: (-values[lh], lh))
    buttons = box.locator("li button")
    shown = [(int(b.get_attribute("data-layer")), int(b.get_attribute("data-head"))) for b in buttons.all()]
    assert shown == ranked[:10]
    assert box.locator(".hint").text_content().startswith(f"#{q} {mock.tokens[q]['piece']} → #{k} {mock.tokens[k]['piece']}, the heads by its weight")
    assert any(urlsplit(u).path.endswith("/cell") and f"query={q}" in u and f"key={k}" in u for u in mock.requests)
    # A ranked head's button focuses it, on the run's tiles.
    layer, head = ranked[1]
    buttons.nth(1).click()
    page.wait_for_selector(f"#focus-plot[data-layer='{layer}'][data-head='{head}']")
    assert box.locator(f"button[data-layer='{layer}'][data-head='{head}']").get_attribute("aria-pressed") == "true"
    # A cell whose values cannot be read says so, and is asked again when picked again.
    page.route("**/api/v1/runs/long-mock/cell?*", lambda route: route.abort("connectionrefused"))
    page.mouse.click(*point_at_unzoomed(page, 1035, 1001))
    page.wait_for_function("() => document.getElementById('cell-heads').textContent.includes('could not be read')")
    assert "still loading" not in box.text_content()
    page.unroute("**/api/v1/runs/long-mock/cell?*")
    page.wait_for_timeout(600)  # two clicks at one point within Plotly's double-click time reset the zoom
    page.mouse.click(*point_at_unzoomed(page, 1035, 1001))
    page.wait_for_function("n => document.getElementById('cell-heads').querySelectorAll('li button').length === n",
                           arg=mock.n_layers * mock.n_heads)
    assert box.locator(".hint").text_content().startswith(f"#1035 {mock.tokens[1035]['piece']} → #1001 ")
    # A masked cell (a later key) ranks nothing: 0 in every head.
    page.click("#cell-heads-close")
    page.mouse.click(*point_at_unzoomed(page, 1001, 1020))  # picking is synchronous: nothing to wait for
    assert box.is_hidden()


def test_a_zoomed_long_runs_caption_says_where_in_the_run_the_view_is(server, page, mock):
    """Zoomed to 64 tokens or fewer the axes show tokens and no position: after a pan nothing on
    screen said where in the run the view was (review h55c)."""
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    caption = page.locator("#focus-caption")
    assert caption.text_content().startswith(f"{mock.T} tokens · model ") and "in view:" not in caption.text_content()
    zoom(page, 1000, 1040, 980, 1028)
    page.wait_for_function("() => document.getElementById('focus-caption').textContent.includes('in view: queries 1000–1039 × keys 980–1027')")
    zoom(page, 1500, 1540, 1480, 1528)
    page.wait_for_function("() => document.getElementById('focus-caption').textContent.includes('in view: queries 1500–1539 × keys 1480–1527')")
    # Another head keeps the window, and says so.
    page.focus("#focus-plot")
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#focus-plot[data-head='1'][data-precision='tiles']")
    assert "in view: queries 1500–1539 × keys 1480–1527" in caption.text_content()
    page.dblclick("#focus-plot .nsewdrag")  # back to the whole run
    page.wait_for_function("() => !document.getElementById('focus-caption').textContent.includes('in view:')")


def settled_reading(page) -> str:
    page.wait_for_function("() => !document.getElementById('tooltip').textContent.includes('reading')")
    return page.locator("#tooltip").text_content().split("\n")[0]


def read_cell(page, q, k) -> str:
    """A cell's reading once it is final: a weight under float16's normal range is fetched as float32."""
    hover_cell(page, q, k)
    return settled_reading(page)


def test_a_full_resolution_cell_float16_holds_as_0_reads_under_its_floor(server, page, mock):
    """Weights under 2^-25 are 0 in a float16 tile: the reading said "0.000", as for none at all.
    It says float16's floor while the cell's float32 value comes (0 in float32 too, here)."""
    mock.k[0, 0, 990] = -40 * mock.q[0, 0, 1020]  # (1020, 990): a weight of about e^-300, 0 in float16
    assert mock.head(0, 0)[1020, 990] < 2**-25
    zoomed_in(page, server, mock, 1000, 1040, 980, 1028)
    assert hover_cell(page, 1020, 990).endswith(": < 3.0e-8 (float16; reading this one…)")
    assert settled_reading(page).endswith(": 0.000")


def test_a_full_resolution_cell_under_float16s_normal_range_reads_its_float32_value(server, page, mock):
    """Under 2^-14 float16 keeps steps of 2^-24: a weight of 3.4e-8 read "6.0e-8" at full
    resolution, and one first read zoomed out "3.4e-8" (review h55c)."""
    weights = mock.head(0, 0)
    weights[1020, 990] = 3.4e-8
    assert float(np.float16(weights[1020, 990])) == pytest.approx(5.96e-8, rel=1e-2)
    q = 1021  # its row's strongest key in view: float16 holds it to 3 significant digits
    strong = (q, 980 + int(weights[q, 980:min(q + 1, 1028)].argmax()))
    assert weights[strong] >= 2**-14
    zoomed_in(page, server, mock, 1000, 1040, 980, 1028)
    hover_cell(page, 1020, 990)
    assert settled_reading(page).endswith(": 3.4e-8")
    assert (1020, 1021, 990, 991, None) in tile_windows(mock.requests)
    reading = hover_cell(page, *strong)
    assert float(reading.rsplit(": ", 1)[1]) == pytest.approx(float(np.float16(weights[strong])), abs=5e-4)
    assert (q, q + 1, strong[1], strong[1] + 1, None) not in tile_windows(mock.requests)


def test_a_long_runs_reading_isolates_a_right_to_left_label(server, page, mock):
    """The long run's reading is its own (long_focus.js): a Hebrew label reordered it around itself,
    as the short run's once did (test_page_bidi.py)."""
    mock.tokens[1020].update(text="שלום", piece="שלום")
    zoomed_in(page, server, mock, 1000, 1040, 980, 1028)
    text = read_cell(page, 1020, 1000)
    assert text.startswith(f"#1020 \u2068שלום\u2069 → #1000 {mock.tokens[1000]['piece']}: ")
    assert float(text.rsplit(": ", 1)[1]) == pytest.approx(float(mock.head(0, 0)[1020, 1000]), abs=6e-4)


def point_at_unzoomed(page, q, k) -> list[float]:
    """The pointer over cell (q, k) of the heatmap (unzoomed, a pixel covers several cells)."""
    point = page.evaluate("""([q, k]) => {
        const gd = document.getElementById('focus-plot');
        const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
        return [box.left + gd._fullLayout.xaxis.l2p(k), box.top + gd._fullLayout.yaxis.l2p(q)];
    }""", [q, k])
    page.mouse.move(point[0] - 20, point[1] - 20)
    page.mouse.move(*point, steps=3)
    return point


def test_a_pooled_cells_reading_says_when_its_own_value_cannot_be_read(server, page, mock):
    """With the server gone, a pooled cell's reading said "reading this one…" for as long as the
    pointer stayed on it (review h50d)."""
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    page.route("**/api/v1/runs/long-mock/tile?*format=json*", lambda route: route.abort("connectionrefused"))
    point = point_at_unzoomed(page, 1500, 700)
    page.wait_for_function("() => document.getElementById('tooltip').textContent.includes('could not be read')", timeout=15_000)
    text = page.locator("#tooltip").text_content()
    assert "max of" in text and "reading this one" not in text, text
    # The head view's rows go with the zoom: failing, it said it showed rows it did not.
    page.route("**/api/v1/runs/long-mock/topk?*", lambda route: route.abort("connectionrefused"))
    page.mouse.move(point[0] - 200, point[1] - 200)
    zoom(page, 1200, 1300, 600, 700)
    page.wait_for_function("() => document.getElementById('headview').textContent.includes('could not be read')", timeout=15_000)
    assert "Queries 0–63" not in page.text_content("#headview")


def test_a_cell_read_while_the_run_was_evicted_is_read_again_once_it_is_back(server, page, mock):
    """The exact read of an evicted run's cell 404'd: the page posted the run again, but for 5 s
    the cell still said "POST /api/v1/attention again to recompute it", words for the API."""
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    mock.lost = True
    point = point_at_unzoomed(page, 1500, 700)
    page.wait_for_function("() => document.getElementById('tooltip').textContent.includes('could not be read')", timeout=15_000)
    text = page.locator("#tooltip").text_content()
    assert "the page is running it again" in text and "POST" not in text, text
    for _ in range(100):  # the page posts the run again (the mock's count is on this side)
        if mock.posts == 2:
            break
        page.wait_for_timeout(100)
    assert mock.posts == 2 and not mock.lost
    wait_settled(page)
    page.mouse.move(point[0] - 200, point[1] - 200)
    page.mouse.move(*point, steps=3)  # back on the same cell at once, well within the 5 s a failure is kept
    page.wait_for_function("() => { const t = document.getElementById('tooltip').textContent;"
                           " return !t.includes('reading') && !t.includes('could not be read'); }", timeout=5_000)
    reading = page.locator("#tooltip").text_content().split("\n")[0]
    assert re.fullmatch(r"#1\d{3} .+ → #\d+ .+: [0-9.e+-]+", reading), reading  # the cell's own weight


def test_a_pooled_cell_reads_its_own_value_and_arrow_steps_drop_stale_tiles(server, page, mock, watched):
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    # Unzoomed, a pixel covers several cells: hovering asks for the cell's own weight.
    point = point_at_unzoomed(page, 1500, 700)
    page.wait_for_function("() => { const t = document.getElementById('tooltip');"
                           " return !t.hidden && t.dataset.query && !t.textContent.includes('reading'); }")
    q, k = (int(page.locator("#tooltip").get_attribute(f"data-{a}")) for a in ("query", "key"))
    assert abs(q - 1500) <= 8 and abs(k - 700) <= 8
    text = page.locator("#tooltip").text_content().split("\n")[0]
    assert float(text.rsplit(": ", 1)[1]) == pytest.approx(float(mock.head(0, 0)[q, k]), abs=6e-4)
    assert (q, q + 1, k, k + 1, None) in tile_windows(mock.requests)
    # The cell's own reading is float32: float16 read weights under 3e-8 as 0.000.
    asked = [parse_qs(urlsplit(u).query) for u in mock.requests if urlsplit(u).path.endswith("/tile")]
    cell = [a for a in asked if (a["q0"], a["q1"], a["k0"], a["k1"]) == ([str(q)], [str(q + 1)], [str(k)], [str(k + 1)])]
    assert cell and all(a["format"] == ["json"] for a in cell)
    # Beyond 64 tokens in view not every row is labelled: pointing at the labels' margin names the one there.
    point = page.evaluate("""() => {
        const gd = document.getElementById('focus-plot');
        const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
        return [box.left - 12, box.top + gd._fullLayout.yaxis.l2p(777)];
    }""")
    page.mouse.move(*point)
    page.wait_for_function("() => document.getElementById('tooltip').textContent.startsWith('query ')")
    row = int(page.locator("#tooltip").text_content().split(":")[0].split()[1])
    assert abs(row - 777) <= 4
    assert page.locator("#tooltip").text_content().split("\n")[0] == f"query {row}: {mock.tokens[row]['piece']}"
    # A step to the next head paints its overview and asks for its own tiles.
    page.focus("#focus-plot")
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#focus-plot[data-head='1']")
    wait_settled(page)
    assert any("head=1" in url for url in mock.requests if "/tile" in url)
    # The layer's mean: no overview, its coarsest tile first and the peak from it.
    page.select_option("#aggregate", "layer")
    wait_settled(page)
    plotted = page.evaluate("() => document.getElementById('focus-plot').plotted()")
    assert plotted["peak"] == pytest.approx(float(mock.head(0, "mean").max()), abs=1e-3)
    # Back to the head and to the mean again: the mean's tiles come from the cache, its peak too.
    page.select_option("#aggregate", "head")
    wait_settled(page)
    tiles_before = len(tile_windows(mock.requests))
    page.select_option("#aggregate", "layer")
    wait_settled(page)
    assert page.evaluate("() => document.getElementById('focus-plot').plotted().peak") == plotted["peak"]
    assert len(tile_windows(mock.requests)) == tiles_before
    assert_never_whole(watched.requests, mock.T)


def test_dense_controls_say_why_they_are_off_for_a_long_run(server, page, mock):
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    for control in ["hide-special", "hide-first", "threshold", "download-csv", "download-json", "export-page"]:
        assert page.locator(f"#{control}").is_disabled(), control
    assert page.locator("#aggregate option[value=all]").is_disabled()
    note = page.locator("#long-note").text_content()
    assert "2048 tokens" in note and "queries and keys" in note
    assert "need every weight" in page.locator("#measures-long-note").text_content()
    assert page.locator("#measures-long-note").is_visible()
    assert not page.locator("#finder").is_visible()
    hint = page.locator("#keys-hint").inner_text()
    assert "Drag to zoom" in hint and "Click a cell (or Enter) to rank every head by it." in hint, hint
    # Alt-click on the grid reached the ablation, off as its panel is: it posted the whole text for
    # weights the run does not keep, then failed in the page.
    posts = mock.posts
    page.click("#grid .thumb[data-layer='0'][data-head='1']", modifiers=["Alt"])
    page.wait_for_function("() => document.getElementById('ablate-status').textContent.length > 0")
    assert page.locator("#ablate-status").text_content() == "Ablation is off for long runs (see above)."
    assert mock.posts == posts and page.locator("#ablate-plot").get_attribute("data-depth") == "0"
    # A short text next: everything is back as it was.
    submit(page, "The bank of the river.", model="minilm")
    page.wait_for_selector("#focus-plot[data-precision=f16]:not([data-long])", timeout=30_000)
    assert page.locator("#focus-plot").get_attribute("data-level") is None  # the long run's pooling went with it
    for control in ["hide-special", "hide-first", "threshold", "download-csv", "download-json", "export-page"]:
        assert page.locator(f"#{control}").is_enabled(), control
    assert page.locator("#export-page").get_attribute("title") == "One HTML file with this run that opens without a server"
    assert page.locator("#download-csv").get_attribute("title") is None
    assert page.locator("#aggregate option[value=all]").is_enabled()
    assert "Click a cell (or Enter) to rank every head by it." in page.locator("#keys-hint").inner_text()
    assert not page.locator("#long-note").is_visible() and not page.locator("#measures-long-note").is_visible()
    page.wait_for_function("() => document.getElementById('finder').dataset.runId")
    assert page.locator("#finder").is_visible()
    assert page.locator("#ablate-box").get_attribute("inert") is None


def test_tile_loader_aborts_what_the_screen_no_longer_needs(server, page):
    open_page(page, server)
    result = page.evaluate("""async () => {
        const { TileLoader, blocksFor, levelFor } = await import('/static/js/tiles.js');
        const { maskRule } = await import('/static/js/run.js');
        const started = [], aborted = [], arrived = [];
        const loader = new TileLoader({
            concurrent: 2,
            fetch: (spec, signal) => new Promise((resolve, reject) => {
                started.push(spec.key);
                signal.addEventListener('abort', () => { aborted.push(spec.key); reject(new DOMException('x', 'AbortError')); });
                setTimeout(() => resolve({ key: spec.key }), 50);
            }),
            onTile: (spec) => arrived.push(spec.key),
        });
        loader.want(['a', 'b', 'c'].map((key) => ({ key })));
        loader.want(['c', 'd'].map((key) => ({ key })));
        await new Promise((r) => setTimeout(r, 300));
        loader.want(['c', 'd'].map((key) => ({ key })));
        return { started, aborted, arrived, cached: [...loader.cache.keys()], requested: loader.requested,
                 level: [levelFor(8192, 700), levelFor(40, 700)],
                 blocks: blocksFor({ q0: 0, q1: 2048, k0: 0, k1: 2048 }, 4, 2048, maskRule(true)).map((b) => [b.q0, b.k0, b.rows ?? null, Boolean(b.masked)]),
                 windowed: blocksFor({ q0: 0, q1: 1024, k0: 0, k1: 1024 }, 1, 1024, maskRule(true, 300)).filter((b) => b.masked).map((b) => [b.q0, b.k0]) };
    }""")
    assert result["started"] == ["a", "b", "c", "d"]
    assert sorted(result["aborted"]) == ["a", "b"]
    assert sorted(result["arrived"]) == ["c", "d"] and result["requested"] == 4  # the cache answers the second want
    assert result["level"] == [16, 1]
    # Causal: the block above the diagonal is masked, never asked for (the page paints it masked).
    assert sorted(result["blocks"]) == [[0, 0, 256, False], [0, 1024, None, True], [1024, 0, 256, False], [1024, 1024, 256, False]]
    # A sliding window of 300: also the block whose every key lies 300 or more behind its every query.
    above = [[q, k] for q in range(0, 1024, 256) for k in range(0, 1024, 256) if k > q]
    assert sorted(result["windowed"]) == sorted(above + [[768, 0]])


# ---- against the real server: a random llama whose inputs above dense_max_tokens keep q and k ----

LONG_T = 1500


@pytest.fixture(scope="module")
def llama_spec(tmp_path_factory) -> str:
    """A small random-weight llama (2 layers, 4 query heads, 2 kv heads) with 2048 positions and
    tiny-gpt's byte tokenizer; transformers only writes the folder, manyeyes loads it."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from manyeyes.model.loading import builtin_path

    folder = tmp_path_factory.mktemp("long-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=2048, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    shutil.copy(builtin_path("tiny-gpt") / "tokenizer.json", folder / "tokenizer.json")
    return str(folder)


@pytest.fixture(scope="module")
def long_server(llama_spec):
    from tests.browser.conftest import serving

    with serving({"llama-long": llama_spec}) as base:
        yield base


def long_text(n_chars: int) -> str:
    words = "the mill stood by the river and the river ran under the bridge to the sea".split()
    out = []
    while len(" ".join(out)) < n_chars:
        out.append(words[len(out) % len(words)] + ("." if len(out) % 11 == 10 else ""))
    return " ".join(out)[:n_chars]


PIXEL = """async ([row, col]) => {
    const gd = document.getElementById('focus-plot');
    const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
    const drag = gd.querySelector('.nsewdrag').getBoundingClientRect();
    const canvas = gd.querySelector('canvas.heatmap-canvas');
    const box = canvas.getBoundingClientRect();
    const px = Math.floor((drag.left + xa.l2p(col) - box.left) * canvas.width / box.width);
    const py = Math.floor((drag.top + ya.l2p(row) - box.top) * canvas.height / box.height);
    const [r, g, b] = canvas.getContext('2d').getImageData(px, py, 1, 1).data;
    const { colorTable } = await import('/static/js/theme.js');
    const table = [...colorTable()].map((p) => [p & 255, (p >> 8) & 255, (p >> 16) & 255]);
    return [[r, g, b], table];
}"""


@pytest.mark.slow
def test_real_long_run_tiles_hold_the_models_weights(long_server, llama_spec, page, watched, artifacts):
    from manyeyes.model import load

    text = long_text(LONG_T)
    dense = load(llama_spec, device="cpu").attend(text).attention.numpy()  # (L, H, T, T), the Python model's
    T = dense.shape[-1]
    assert T > 1024  # above dense_max_tokens: the server keeps queries and keys
    open_page(page, long_server)
    submit(page, text, model="llama-long")
    wait_settled(page, timeout=120_000)
    page.wait_for_function("() => document.querySelectorAll('.thumb').length === 8 && !document.querySelector('.thumb.loading')")
    plotted = page.evaluate("() => document.getElementById('focus-plot').plotted()")
    assert plotted["long"] and plotted["rows"] == T
    # The overview's max is the head's max (f16 on the wire).
    assert plotted["peak"] == pytest.approx(float(dense[0, 0].max()), rel=1e-3)
    assert plotted["level"] >= 2 and all(t["pool"] == "max" for t in plotted["tiles"])
    page.locator(".focus-panel").screenshot(path=str(artifacts / "long-real-overview.png"))
    # The next-token guesses under it, as the API gives them for the run (a long run dropped them).
    page.wait_for_function("() => document.querySelectorAll('#focus-predictions .pred').length === 1024")
    assert page.inner_text("#focus-predictions .hint:last-child") == (  # as shown: "tap" on a touch screen
        f"… and {T - 1024} more tokens past these: hover their rows in the heatmap to read their guesses.")
    # The line above said "scroll for the rest" of the same strip: the two contradicted.
    page.wait_for_function("() => document.querySelector('#focus-predictions .pred-more').textContent !== ''")
    assert page.text_content("#focus-predictions .pred-more") == (
        "the first 1024 tokens, scroll through them; the heatmap row read is outlined.")
    asked = httpx.post(f"{long_server}/api/v1/attention", timeout=60, json={
        "text": text, "model": "llama-long", "format": "u8", "layers": [0], "heads": [0], "predictions": {"top_k": 5}}).json()
    guesses = page.locator("#focus-predictions .pred-guess").evaluate_all("els => els.map(e => e.dataset.token)")
    assert guesses == [asked["predictions"][str(i)][0]["token"] for i in range(1024)]

    # Zoom to 40 × 48 tokens: tiles at full resolution for that window, every label, exact readings.
    before = len(watched.requests)
    q0, k0 = 1100, 1070
    zoom(page, q0, q0 + 40, k0, k0 + 48)
    page.wait_for_function("() => document.getElementById('focus-plot').dataset.level === '1'")
    wait_settled(page)
    new = tile_windows(watched.requests[before:])
    assert new and all(rows is None for *_w, rows in new)
    assert any(a <= q0 < b and c <= k0 < d for a, b, c, d, _r in new)
    assert len(visible_labels(page, "y")) == 40 and len(visible_labels(page, "x")) == 48
    weights = dense[0, 0]
    peak = float(weights.max())
    for q, k in [(q0 + 20, k0 + 5), (q0 + 39, k0 + 47), (q0 + 3, k0 + 33), (q0 + 31, k0 + 30)]:
        text_shown = read_cell(page, q, k)
        assert float(text_shown.rsplit(": ", 1)[1]) == pytest.approx(float(weights[q, k]), abs=1e-3)
        got, table = page.evaluate(PIXEL, [q, k])
        index = round(255 * min(1.0, float(weights[q, k]) / peak))
        assert got in table[max(0, index - 1): index + 2], (q, k, got, index)
    assert hover_cell(page, q0, k0 + 47).endswith(": masked")
    page.locator(".focus-panel").screenshot(path=str(artifacts / "long-real-zoomed.png"))

    # The next head: its own tiles; the head view's lines come from the top-k route.
    page.focus("#focus-plot")
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#focus-plot[data-head='1']")
    wait_settled(page)
    reading = float(read_cell(page, q0 + 20, k0 + 5).rsplit(": ", 1)[1])
    assert reading == pytest.approx(float(dense[0, 1, q0 + 20, k0 + 5]), abs=1e-3)
    page.wait_for_function("() => Number(document.querySelector('#headview canvas')?.dataset.lines) > 0")
    assert any("/topk?" in url for url in watched.requests)
    assert_never_whole(watched.requests, T)


def test_labels_of_a_wide_zoom_do_not_overprint(server, page, mock, artifacts):
    """Zoomed to 40 queries × 140 keys the query axis is 40/140 of the side (square cells), and its
    40 labels at the smallest font overprinted one another."""
    zoomed_in(page, server, mock, 1000, 1040, 980, 1120)
    boxes = page.evaluate("""() => [...document.querySelectorAll('#focus-plot .ytick')]
        .filter(g => g.style.display !== 'none')
        .map(g => g.getBoundingClientRect()).map(r => [r.top, r.bottom]).sort((a, b) => a[0] - b[0])""")
    assert 3 <= len(boxes) < 40
    overlaps = [(a, b) for a, b in zip(boxes, boxes[1:]) if b[0] < a[1] - 1]  # a 7 px font's box is 8 px
    page.locator(".focus-panel").screenshot(path=str(artifacts / "long-wide-zoom-labels.png"))
    assert not overlaps, overlaps


def test_shift_arrows_read_a_long_runs_cells_as_hovering_does(server, page, mock):
    """The keyboard's cell cursor on a tiled heatmap: a cell under a pooled bin reads "reading…"
    until its own weight arrives, and the live region then says the exact value; a step to the
    next head reads the same cell of it."""
    h0, h1 = mock.head(0, 0), mock.head(0, 1)
    # A cell whose weight reads differently in the two heads (most of a long row reads 0.000).
    q, k = next((q, k) for q in range(1500, 1600) for k in range(q - 60, q)
                if h0[q, k] > 0.01 and abs(h0[q, k] - h1[q, k]) > 0.01)
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    zoom(page, q, q + 100, k, k + 100)
    wait_settled(page)
    page.focus("#focus-plot")
    page.keyboard.press("Shift+ArrowRight")  # the first press lands on the window's top-left cell
    page.wait_for_function("() => { const r = document.getElementById('cell-reading').textContent;"
                           " return r.includes('→') && !r.includes('reading'); }")
    tooltip = page.locator("#tooltip")
    assert (int(tooltip.get_attribute("data-query")), int(tooltip.get_attribute("data-key"))) == (q, k)
    spoken = page.locator("#cell-reading").text_content()
    assert float(spoken.rsplit(": ", 1)[1]) == pytest.approx(float(h0[q, k]), abs=6e-4)
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#focus-plot[data-head='1']")
    page.wait_for_function("(before) => { const r = document.getElementById('cell-reading').textContent;"
                           " return r !== before && r.includes('→') && !r.includes('reading'); }", arg=spoken)
    spoken = page.locator("#cell-reading").text_content()
    assert float(spoken.rsplit(": ", 1)[1]) == pytest.approx(float(h1[q, k]), abs=6e-4)


def test_a_long_runs_heatmap_takes_the_width_of_an_800_px_window(server, make_page, mock, artifacts):
    """At 800 px the page is one column, and the options (with the long run's note) stand 250 px
    tall above the heatmap: fitted to what was left of the window, the plot was 340 px tall and its
    square cells 195 px wide, a quarter of the window. At 1280 px (two columns) the plot is still
    fitted to the window beside the thumbnails, not made square."""
    layout = """() => { const box = (s) => document.querySelector(s).getBoundingClientRect();
        return [box('#focus-plot').height, box('.focus-panel').right, box('.grid-panel').left]; }"""
    for width in (800, 1280):
        page = make_page(viewport=(width, 900))
        mock.serve(page)
        open_page(page, server)
        submit(page, mock.prompt)
        wait_settled(page)
        cells = page.locator("#focus-plot canvas.heatmap-canvas").bounding_box()
        page.locator(".focus-panel").screenshot(path=str(artifacts / f"long-{width}.png"))
        if width == 800:
            assert cells["width"] >= 0.6 * width, cells
        else:
            height, focus_right, grid_left = page.evaluate(layout)
            assert grid_left > focus_right and height < 720, (height, focus_right, grid_left)


def test_the_heatmap_keeps_a_column_of_its_own_until_two_leave_it_room(server, make_page, mock, artifacts):
    """From 901 px the page went to two columns, and the heatmap, fitted beside the thumbnails under
    three or four rows of options, drew a 2048-token run's cells 118 px wide at 901 px (215 at
    1100) and a 22-token pair's 199. Under 1200 px they now take at least 45% of the window; at
    1280 px, two columns still, no less than before (282 and 366 px; 364 since the sentence box
    shows the whole of SENTENCE, a second line at that width)."""
    layout = """() => { const box = (s) => document.querySelector(s).getBoundingClientRect();
        return [box('.focus-panel').right, box('.grid-panel').left, document.documentElement.scrollWidth]; }"""
    at_1280 = {"long": 282, "short": 364}
    for run_kind in ("long", "short"):
        # One run a kind, its window resized through the widths as a user drags it: what it
        # draws at each must be what a page opened at that width draws (the first width is one).
        page = make_page(viewport=(901, 900))
        mock.serve(page)
        open_page(page, server)
        if run_kind == "long":
            submit(page, mock.prompt)
            wait_settled(page)
        else:
            submit(page, SENTENCE, PAIR)
            wait_focus(page)
        for width in (901, 1100, 1199, 1280):
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_function(  # the heatmap refits on the next frames after a resize
                "(w) => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => done(innerWidth === w))))",
                arg=width)
            if run_kind == "long":
                wait_settled(page)
            cells = page.locator("#focus-plot canvas.heatmap-canvas").bounding_box()
            focus_right, grid_left, scroll_width = page.evaluate(layout)
            page.screenshot(path=str(artifacts / f"heatmap-{run_kind}-{width}.png"))
            seen = (run_kind, width, cells, focus_right, grid_left)
            assert scroll_width == width, seen
            if width < 1200:
                assert cells["width"] >= 0.45 * width and grid_left < focus_right, seen
            else:
                assert grid_left > focus_right and cells["width"] >= at_1280[run_kind], seen
        page.close()
