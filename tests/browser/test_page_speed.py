"""Issue 13, item 8 (speed at long T), checked by what the page builds and asks for, never by a
clock: the timings themselves are bench/ui_bench.py's. Each test fails on the page before the fix:
it built all 2 × 510 head-view items and a 10 000-pixel canvas after hide-special at T=512, asked
the server for every layer mean and, on every arrow step, for the measures panel's T × T JSON
heatmap and neuron view even while that panel was off screen."""

from __future__ import annotations

import numpy as np
import pytest

from tests.browser.test_page import PAIR, SENTENCE, open_page, run, wait_focus, wait_grid
from tests.browser.test_page_truth import read_thumbnails
from tests.browser.test_page_ux import f16_attention, text_of_tokens

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def long_text(api):
    return text_of_tokens(api, 512)


def test_head_view_builds_only_the_tokens_in_view_at_512(server, api, page, long_text, artifacts):
    open_page(page, server)
    run(page, long_text)
    page.click("#hide-special")
    page.wait_for_function("() => document.querySelector('.hv-canvas')?.dataset.lines > 0"
                           " && document.querySelectorAll('.hv-left li').length > 0"
                           " && document.querySelectorAll('.hv-left li.special').length === 0", timeout=60_000)
    built = page.evaluate("""() => ({
        items: document.querySelectorAll('.hv-left li').length + document.querySelectorAll('.hv-right li').length,
        listHeight: document.querySelector('.hv-left').getBoundingClientRect().height,
        canvasHeight: document.querySelector('.hv-canvas').getBoundingClientRect().height,
        boxHeight: document.getElementById('headview').clientHeight,
    })""")
    assert built["items"] <= 2 * 120, built  # the view's ~28 rows and a margin, of 2 × 510
    assert built["listHeight"] == pytest.approx(510 * 20, abs=1), built  # the scroll box still spans every token
    assert built["canvasHeight"] <= built["boxHeight"], built

    # Scrolled to the end, the last tokens are built and their lines drawn beside them.
    page.evaluate("() => { const box = document.getElementById('headview'); box.scrollTop = box.scrollHeight; }")
    page.wait_for_function("() => document.querySelector('.hv-left li:last-child')?.dataset.index === '509'")
    drawn = page.evaluate("""() => {
        const canvas = document.querySelector('.hv-canvas');
        const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let painted = 0;
        for (let i = 3; i < px.length; i += 4) if (px[i] > 0) painted++;
        return painted;
    }""")
    assert drawn > 1000, drawn
    page.locator(".head-panel").screenshot(path=str(artifacts / "head-view-512-scrolled.png"))


def test_steps_and_layer_means_at_512_ask_only_for_what_the_heatmap_shows(server, page, watched, long_text):
    open_page(page, server)
    run(page, long_text)
    wait_grid(page)
    watched.requests.clear()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=3)
    page.select_option("#aggregate", "layer")
    page.wait_for_selector("#focus-plot[data-aggregate=layer][data-precision=f16]", timeout=60_000)
    page.wait_for_timeout(500)  # time for a stray request to leave
    api_calls = [u for u in watched.requests if "/api/" in u and "/views" not in u]
    # The layer mean is averaged from the f16 heads already here; the measures panel is off screen.
    assert api_calls == [], api_calls

    # Scrolled to, the measures panel catches up with the focused head (at T=512 its raw heatmap
    # used to fail outright: Math.max(...cells) overflowed the stack).
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-head='3'][data-measure='raw']", timeout=60_000)
    assert any("/neuron?" in u and "head=3" in u for u in watched.requests)


def test_thumbnails_after_hide_special_threshold_and_fixed_scale_are_the_apis(server, api, page):
    """Threshold and scale now recolour pooled maxima instead of pooling again: the pixels must still
    be each head's renormalised, thresholded weights (exact f16 in every layer: hiding tokens has the
    grid fetch them), and the same after toggling hide-special off and on."""
    open_page(page, server)
    run(page, SENTENCE, PAIR)
    wait_grid(page)
    tokens, exact = f16_attention(api, SENTENCE, list(range(6)), pair=PAIR)
    keep = ~np.array([t["special"] for t in tokens])
    threshold = 0.1
    page.select_option("#scale", "fixed")
    page.locator("#threshold").fill(str(threshold))
    page.click("#hide-special")
    page.click("#hide-special")
    page.click("#hide-special")

    def wrong_pixels():
        wrong = []
        for (layer, head), possible in read_thumbnails(page).items():
            weights = exact[layer, head][keep][:, keep]
            view = weights / weights.sum(axis=1, keepdims=True)
            want = np.rint(np.where(view < threshold, 0, np.minimum(view, 1)) * 255).astype(int)
            if possible.shape[:2] != want.shape:
                wrong.append((layer, head, "shape"))
                continue
            near = np.abs(view - threshold) < 1e-3  # float32 on the page, float64 here: either side is right
            for shift in (-1, 0, 1):
                near |= np.take_along_axis(possible, np.clip(want + shift, 0, 255)[..., None], axis=-1)[..., 0]
            if not near.all():
                wrong.append((layer, head, int((~near).sum())))
        return wrong

    # The repaint runs in slices after the heatmap: read until it has caught up (or give up).
    for _ in range(30):
        wrong = wrong_pixels()
        if not wrong:
            break
        page.wait_for_timeout(300)
    assert wrong == [], f"(layer, head, wrong pixels): {wrong}"
    assert page.is_checked("#hide-special")
