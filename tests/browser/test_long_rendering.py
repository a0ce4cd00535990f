"""Many tokens on few pixels: the focused heatmap's labels after a wide drag-zoom, and the
experiment heatmaps pooled by their strongest cells where they have more columns than pixels."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.browser.test_long_page import KeptMock, wait_settled
from tests.browser.test_page import SENTENCE, open_page, submit, wait_focus

pytestmark = pytest.mark.browser

MIN_FONT = 7  # focus.js: an unthinned label gets a row of at least this many pixels
SAMPLED_LABEL_PX = 12  # focus.js: a thinned axis gives each label this many pixels

# The y labels on show: each one's pixel position, and the pixels the rows' cells cover.
Y_LABELS = """() => {
    const gd = document.getElementById('focus-plot');
    const ya = gd._fullLayout.yaxis;
    const n = gd.plotted({ z: false }).rows;
    const [lo, hi] = [Math.min(...ya.range), Math.max(...ya.range)];
    const ys = [...gd.querySelectorAll('.ytick')].filter((g) => g.style.display !== 'none')
      .map((g) => Number(g.getAttribute('transform').split(' ')[1].replace(')', '')));
    const occupied = Math.abs(ya.l2p(Math.min(hi, n - 0.5)) - ya.l2p(Math.max(lo, -0.5)));
    const texts = [...gd.querySelectorAll('.ytick')].filter((g) => g.style.display !== 'none').map((g) => g.textContent);
    return { ys, texts, occupied, range: [lo, hi], n };
}"""


def drag(page, q0, q1, k0, k1):
    """A mouse drag on the focused heatmap from cell (q0, k0) to cell (q1, k1), in zoom mode."""
    corners = page.evaluate("""([q0, q1, k0, k1]) => {
        const gd = document.getElementById('focus-plot');
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, box = gd.getBoundingClientRect();
        const at = (q, k) => [box.left + xa._offset + xa.l2p(k), box.top + ya._offset + ya.l2p(q)];
        return [at(q0, k0), at(q1, k1)];
    }""", [q0, q1, k0, k1])
    (x0, y0), (x1, y1) = corners
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, (y0 + y1) / 2, steps=5)
    page.mouse.move(x1, y1, steps=5)
    page.mouse.up()
    page.wait_for_timeout(600)  # the relayout, and the page's own relayout after it


def assert_readable(labels):
    ys = sorted(labels["ys"])
    assert len(ys) >= 2, labels
    gaps = np.diff(ys)
    thinned = not all(t.strip() and not t.strip().isdigit() for t in labels["texts"])
    least = SAMPLED_LABEL_PX if thinned else MIN_FONT
    assert gaps.min() >= least - 0.5, (gaps.min(), labels["texts"])
    # No more labels than the tokens' own pixels hold at that spacing.
    assert len(ys) <= labels["occupied"] / least + 1, (len(ys), labels["occupied"])


def assert_wide_drag_stays_on_the_cells(page, T):
    q0, q1, k0, k1 = int(T * 0.77), int(T * 0.8), int(T * 0.07), int(T * 0.93)
    drag(page, q0, q1, k0, k1)
    labels = page.evaluate(Y_LABELS)
    assert_readable(labels)
    lo, hi = labels["range"]
    # Square cells widen the band's rows to the keys' span; that span now lies over the tokens,
    # and still holds the rows dragged over: no blank past the last token.
    assert lo >= -0.5 - 1e-6 and hi <= T - 0.5 + 1e-6, labels["range"]
    assert lo <= q0 and hi >= q1, labels["range"]
    assert hi - lo == pytest.approx((k1 - k0), rel=0.05)


def run_512(page, server) -> int:
    open_page(page, server)
    page.check("#truncate")
    submit(page, " ".join([SENTENCE] * 60), model="minilm")
    wait_focus(page)
    T = page.evaluate("() => document.getElementById('focus-plot').plotted({ z: false }).rows")
    assert T == 512
    return T


def test_a_wide_drag_zoom_on_512_tokens_keeps_cells_and_readable_labels(server, page, artifacts):
    T = run_512(page, server)
    assert_wide_drag_stays_on_the_cells(page, T)
    page.locator(".focus-panel").screenshot(path=str(artifacts / "wide-drag-512.png"))


def test_a_pan_past_the_last_token_labels_the_rows_left_readably(server, page):
    """A pan past the last token is the user's own move: the rows left get labels spaced for the
    pixels they cover, not for the whole axis."""
    T = run_512(page, server)
    page.evaluate("() => Plotly.relayout('focus-plot', { dragmode: 'pan' })")
    page.evaluate("(T) => Plotly.relayout('focus-plot', { 'yaxis.range': [T + 700, T - 120], 'xaxis.range': [0, 820] })", T)
    page.wait_for_timeout(400)
    labels = page.evaluate(Y_LABELS)
    assert labels["range"][1] > T, labels["range"]  # the pan stays where it was put
    assert labels["occupied"] < 150, labels
    assert_readable(labels)
    assert all(int(t) < T for t in labels["texts"]), labels["texts"]


def test_a_wide_drag_zoom_on_a_short_causal_run_stays_on_its_tokens(server, page):
    open_page(page, server)
    submit(page, "the river bank was muddy after the rain and the water ran fast under the old stone bridge "
                 "where children played on summer evenings", model="tiny-causal")
    wait_focus(page)
    T = page.evaluate("() => document.getElementById('focus-plot').plotted({ z: false }).rows")
    assert 20 <= T <= 64
    assert_wide_drag_stays_on_the_cells(page, T)


def test_a_wide_drag_zoom_on_a_long_run_keeps_cells_and_readable_labels(server, page, artifacts):
    mock = KeptMock()
    mock.serve(page)
    open_page(page, server)
    submit(page, mock.prompt)
    wait_settled(page)
    assert_wide_drag_stays_on_the_cells(page, mock.T)
    wait_settled(page)
    win = page.evaluate("() => document.getElementById('focus-plot').plotted({ z: false }).window")
    assert win["q1"] == mock.T and win["q1"] - win["q0"] > 0.8 * (0.93 - 0.07) * mock.T, win
    page.locator(".focus-panel").screenshot(path=str(artifacts / "wide-drag-long.png"))


def head_of(reply, layer, head):
    """One head of an experiments reply's attention as float32, in its own format."""
    t = reply["attention"]
    if t["format"] == "json":
        return np.asarray(t["data"][layer][head], dtype=np.float32)
    assert t["format"] == "f16", t["format"]
    return np.frombuffer(base64.b64decode(t["data"]), dtype="<f2").astype(np.float32).reshape(t["shape"])[layer, head]


def strongest(m, w, signed=False):
    """Each w × w bin's strongest cell, as the page pools (the largest |value| when signed)."""
    n_r, n_c = -(-m.shape[0] // w), -(-m.shape[1] // w)
    out = np.empty((n_r, n_c), dtype=m.dtype)
    for i in range(n_r):
        for j in range(n_c):
            block = m[i * w:(i + 1) * w, j * w:(j + 1) * w].ravel()
            out[i, j] = block[np.argmax(np.abs(block) if signed else block)]
    return out


PLOT = """(id) => { const gd = document.getElementById(id); const t = gd.data[0];
    return { z: t.z, x: t.x, y: t.y, text: t.text, xPx: gd._fullLayout.xaxis._length * devicePixelRatio,
             yPx: gd._fullLayout.yaxis._length * devicePixelRatio }; }"""


def test_an_ablation_of_512_tokens_is_pooled_by_its_strongest_cells(server, api, page, artifacts):
    text = " ".join([SENTENCE] * 60)
    open_page(page, server)
    page.check("#truncate")
    submit(page, text, model="minilm")
    wait_focus(page)
    page.wait_for_selector("#grid .thumb[data-layer='1'][data-head='4']:not(.loading)", timeout=30_000)
    page.click("#grid .thumb[data-layer='1'][data-head='4']", modifiers=["Alt"])
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=60_000)
    page.wait_for_function("() => document.getElementById('ablate-plot-diff').data?.[0]?.z", timeout=30_000)
    layer, head = (int(page.get_attribute("#ablate-plot", f"data-{k}")) for k in ("layer", "head"))
    fmt = page.evaluate("() => window.manyeyesExperiments.ablation.format")
    body = {"text": text, "model": "minilm", "truncate": True}
    ablated = head_of(api.post("/api/v1/experiments/ablate", json={
        **body, "ablate": [{"layer": 1, "head": 4, "mode": "zero"}], "top_k": 5, "attention": {"format": fmt}}).json(), layer, head)
    clean = head_of(api.post("/api/v1/attention", json={**body, "format": fmt}).json(), layer, head)
    assert ablated.shape == (512, 512)

    shown = page.evaluate(PLOT, "ablate-plot")
    z = np.asarray(shown["z"], dtype=np.float64)
    # No more bins than the axis has device pixels, each the exact float32 maximum of its cells.
    assert z.shape[1] <= shown["xPx"] and z.shape[0] <= shown["yPx"], (z.shape, shown["xPx"], shown["yPx"])
    w = 512 // z.shape[1]
    assert w > 1 and z.shape == (512 // w, 512 // w)
    assert z.max() == float(ablated.max())
    assert np.array_equal(z, strongest(ablated, w).astype(np.float64))
    # Labels and hover name the real positions a bin spans, and its strongest cell.
    assert shown["x"][1] == f"{w}–{2 * w - 1}"
    i, j = np.unravel_index(np.argmax(z), z.shape)
    r, c = np.unravel_index(np.argmax(ablated), ablated.shape)
    assert shown["text"][i][j] == (f"queries {i * w:,}–{(i + 1) * w - 1:,} → keys {j * w:,}–{(j + 1) * w - 1:,}: "
                                   f"strongest {z[i, j]:.4f} at {r:,} → {c:,}")

    # The signed difference keeps each bin's largest change with its sign.
    diff = np.asarray(page.evaluate(PLOT, "ablate-plot-diff")["z"], dtype=np.float64)
    change = ablated.astype(np.float64) - clean.astype(np.float64)
    assert np.array_equal(diff, strongest(change, w, signed=True))
    page.locator("#experiments").screenshot(path=str(artifacts / "ablate-512-pooled.png"))


def test_a_pooled_strip_keeps_each_rows_peak_and_masks_only_whole_bins(server, page):
    """The generation panel's pictures: a strip of head rows over 2,048 keys, and a causal square
    whose bins are masked only where all of their cells are."""
    open_page(page, server)
    out = page.evaluate("""async () => {
        const { heatmap } = await import('/static/js/experiment_parts.js');
        const strip = document.createElement('div');
        strip.style.width = '600px';
        document.body.append(strip);
        const C = 2048;
        const rows = [0, 1, 2].map((h) => Array.from({ length: C }, (_, c) => Math.fround(1e-4 * ((c * 7 + h) % 13))));
        rows[1][1027] = Math.fround(0.599);
        rows[2][1024] = NaN;  // a NaN first in its bin hid the bin's peak (review h47i)
        rows[2][1025] = Math.fround(0.5);
        await heatmap(strip, rows, { x: Array(C).fill('a'), y: ['L0 H0', 'L0 H1', 'L0 H2'], yHeads: true, title: 'Row' });
        const square = document.createElement('div');
        square.style.width = '600px';
        document.body.append(square);
        const T = 600;
        const causal = Array.from({ length: T }, (_, r) => Array.from({ length: T }, (_, c) => (c > r ? null : 1 / (r + 1))));
        await heatmap(square, causal, { x: Array(T).fill('b'), y: Array(T).fill('b') });
        const s = strip.data[0], q = square.data[0];
        return { strip: { z: s.z, x: s.x, text: s.text, px: strip._fullLayout.xaxis._length * devicePixelRatio },
                 square: { z: q.z, px: square._fullLayout.xaxis._length * devicePixelRatio } };
    }""")
    strip = out["strip"]
    assert len(strip["z"]) == 3 and len(strip["z"][0]) <= strip["px"]
    w = 2048 // len(strip["z"][0])
    assert w > 1
    assert max(strip["z"][1]) == float(np.float32(0.599))
    assert strip["z"][2][1024 // w] == float(np.float32(0.5)) and not any(v != v for v in strip["z"][2])
    j = 1027 // w
    assert strip["x"][j] == f"{j * w:,}–{(j + 1) * w - 1:,}"
    assert strip["text"][1][j] == f"L0 H1 → keys {j * w:,}–{(j + 1) * w - 1:,}: strongest 0.5990 at 1,027"

    z = out["square"]["z"]
    assert len(z[0]) <= out["square"]["px"]
    w = -(-600 // len(z))
    assert w > 1
    for i, row in enumerate(z):
        for j, v in enumerate(row):
            first_row_last = min(600, (i + 1) * w) - 1
            whole = j * w > first_row_last  # every key of the bin is after every query of it
            assert (v is None) == whole, (i, j, v)
            if not whole:
                assert v == 1 / (max(i, j) * w + 1), (i, j, v)  # the bin's first row with a key in it


def test_a_pooled_plot_is_drawn_again_for_its_new_width(server, page):
    """A plot's figure width and bins were worked out once, from its panel's width: a phone turned
    or a window narrowed kept bins for the old width, more of them than the pixels now there."""
    open_page(page, server)
    counts = page.evaluate("""async () => {
        const { heatmap } = await import('/static/js/experiment_parts.js');
        const strip = document.createElement('div');
        strip.id = 'resized-strip';
        strip.style.width = '1200px';
        document.body.append(strip);
        const rows = [0, 1].map((h) => Array.from({ length: 4096 }, (_, c) => ((c * 7 + h) % 13) / 13));
        await heatmap(strip, rows, { x: Array(4096).fill('a'), y: ['L0 H0', 'L0 H1'], yHeads: true, title: 'Row' });
        const wide = { bins: strip.data[0].z[0].length, px: strip._fullLayout.xaxis._length * devicePixelRatio };
        strip.style.width = '400px';
        window.dispatchEvent(new Event('resize'));
        await new Promise((done) => setTimeout(done, 600));
        return { wide, narrow: { bins: strip.data[0].z[0].length, px: strip._fullLayout.xaxis._length * devicePixelRatio } };
    }""")
    wide, narrow = counts["wide"], counts["narrow"]
    assert wide["bins"] <= wide["px"] and narrow["bins"] <= narrow["px"], counts
    assert narrow["px"] < wide["px"] / 2 and narrow["bins"] < wide["bins"], counts
