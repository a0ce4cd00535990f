"""Sliding windows on the page: a layer whose queries see only their last W positions draws the
keys further back as masked, as a causal model's later keys are, not as weights of 0. Against a
real server running a random qwen2 whose second layer alone has a window (its first attends to
every earlier token), short (dense) and long (tiled) runs alike."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest

from tests.browser.conftest import serving
from tests.browser.test_focus_canvas import hatched
from tests.browser.test_long_page import MASKED_PIXEL, long_text, tile_windows, wait_settled, zoom
from tests.browser.test_measures_ui import measure_pixels
from tests.browser.test_page import hover_cell, plotted
from tests.browser.test_page_truth import api_json, open_view, wait_focus

pytestmark = pytest.mark.browser

MODEL = "qwen-window"
WINDOW = 3  # layer 1 only: query q sees keys q - 2 … q
DENSE_MAX = 256
TEXT = "the mill stood by the river"
MASKED_RGB = [0xD6, 0xD2, 0xCB]  # the light theme's masked colour


@pytest.fixture(scope="module")
def qwen_spec(tmp_path_factory) -> str:
    """Random weights, 2 layers (a window on layer 1 only), 4 query and 2 kv heads, tiny-gpt's byte
    tokenizer: one token a character."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from manyeyes.model.loading import builtin_path

    folder = tmp_path_factory.mktemp("qwen-window")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=2048, initializer_range=0.2,
                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    shutil.copy(builtin_path("tiny-gpt") / "tokenizer.json", folder / "tokenizer.json")
    return str(folder)


@pytest.fixture(scope="module")
def window_server(qwen_spec):
    with serving({MODEL: qwen_spec}, env={"MANYEYES_DENSE_MAX_TOKENS": str(DENSE_MAX)}) as base:
        yield base


@pytest.fixture(scope="module")
def window_api(window_server):
    with httpx.Client(base_url=window_server, timeout=60) as client:
        yield client


def blocked(n: int, layer: int) -> np.ndarray:
    """(n, n) bool: the keys each query of `layer` cannot see."""
    q, k = np.indices((n, n))
    return (k > q) | ((k <= q - WINDOW) if layer == 1 else False)


def masked_thumbnails(page) -> dict[tuple[int, int], np.ndarray]:
    """For every thumbnail, which of its pixels have the masked colour."""
    raw = page.evaluate("""async () => {
        const { colorTable } = await import('/static/js/theme.js');
        const m = colorTable()[256];
        return [...document.querySelectorAll('.thumb')].map((button) => {
            const c = button.querySelector('canvas');
            const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const masked = [];
            for (let i = 0; i < px.length; i += 4) {
                masked.push(px[i] === (m & 255) && px[i + 1] === ((m >> 8) & 255) && px[i + 2] === ((m >> 16) & 255));
            }
            return { layer: Number(button.dataset.layer), head: Number(button.dataset.head), width: c.width, masked };
        });
    }""")
    return {(t["layer"], t["head"]): np.asarray(t["masked"]).reshape(-1, t["width"]) for t in raw}


def test_models_and_the_client_name_each_layers_window(window_server, window_api):
    from manyeyes.client import Client

    [listed] = window_api.get("/api/v1/models").json()["models"]
    assert listed["sliding_windows"] == [None, WINDOW]
    [model] = Client(window_server).models()
    assert model.sliding_windows == (None, WINDOW)
    assert isinstance(hash(model), int)  # a frozen dataclass stays hashable


def test_the_neuron_view_masks_the_keys_behind_a_layers_window(window_api):
    run_id = window_api.post("/api/v1/attention", json={"text": TEXT, "model": MODEL, "format": "u8"}).json()["run_id"]
    q = len(TEXT) - 1
    for layer in (0, 1):
        view = window_api.get(f"/api/v1/runs/{run_id}/neuron", params={"layer": layer, "head": 0, "query": q}).json()
        masked = [k for k, score in enumerate(view["scores"]) if score is None]
        assert masked == ([] if layer == 0 else list(range(q - WINDOW + 1))), layer
        assert all(view["weights"][k] == 0 for k in masked)


def test_a_short_run_masks_the_keys_behind_a_layers_window(window_server, window_api, page, artifacts):
    tokens, weights = api_json(window_api, TEXT, model=MODEL)  # (L, H, T, T)
    n = len(tokens)
    assert n > 2 * WINDOW
    open_view(page, window_server, text=TEXT, model=MODEL, layer=1, head=0)
    wait_focus(page, 1, 0)
    # Layer 1: the cells behind the window are masked (the model's weights there are exactly 0),
    # the rest are the API's.
    z = np.array(plotted(page), dtype=object)
    hidden = blocked(n, 1)
    assert np.all(weights[1, 0][hidden & ~blocked(n, 0)] == 0)
    assert all(z[q, k] is None for q, k in zip(*np.nonzero(hidden)))
    seen = np.array([[0.0 if z[q, k] is None else z[q, k] for k in range(n)] for q in range(n)], dtype=np.float64)
    assert np.abs(seen[~hidden] - weights[1, 0][~hidden]).max() <= 1e-3
    assert hover_cell(page, n - 1, 0).endswith(": masked")
    assert not hover_cell(page, n - 1, n - WINDOW).endswith(": masked")
    assert hatched(page, n - 1, 0) > 0 and hatched(page, n - 1, n - WINDOW) == 0  # hatched as masked
    caption = page.locator("#focus-caption").text_content()
    assert f"nor more than {WINDOW - 1} tokens back (sliding window)" in caption
    page.locator(".focus-panel").screenshot(path=str(artifacts / "window-focus.png"))

    # Every thumbnail masks what its own layer cannot see (T < 128: a pixel a cell).
    page.wait_for_function("() => document.querySelectorAll('.thumb').length === 8 && !document.querySelector('.thumb.loading')")
    thumbs = masked_thumbnails(page)
    for (layer, head), masked in thumbs.items():
        assert np.array_equal(masked, blocked(n, layer)), (layer, head)

    # Layer 0 has no window: only later keys are masked, and the caption says no more than that.
    page.select_option("#layer", "0")
    wait_focus(page, 0, 0)
    z0 = plotted(page)
    assert z0[n - 1][0] is not None and z0[0][1] is None
    assert hatched(page, n - 1, 0) == 0 and hatched(page, 0, n - 1) > 0
    assert "sliding window" not in page.locator("#focus-caption").text_content()
    # The mean of all heads: layer 0 reaches every earlier key, so only causality masks it.
    page.select_option("#aggregate", "all")
    page.wait_for_selector("#focus-plot[data-aggregate='all']")
    page.wait_for_function("() => document.getElementById('focus-plot').plotted()?.rows > 0")
    mean = plotted(page)
    assert mean[n - 1][0] is not None and mean[0][1] is None


def test_a_layers_measure_masks_behind_its_window_and_the_rollout_does_not(window_server, page):
    open_view(page, window_server, text=TEXT, model=MODEL, layer=1, head=0)
    wait_focus(page, 1, 0)
    page.locator("#measures").scroll_into_view_if_needed()
    page.wait_for_selector("#measure-plot[data-measure='raw'][data-layer='1']", timeout=30_000)
    matrix, (far, near), _ = measure_pixels(page, [(len(TEXT) - 1, 0), (len(TEXT) - 1, len(TEXT) - WINDOW)])
    assert len(matrix) == len(TEXT)
    assert far == MASKED_RGB and near != MASKED_RGB
    page.select_option("#measure", "rollout")
    page.wait_for_selector("#measure-plot[data-measure='rollout']")
    _, (far, above), _ = measure_pixels(page, [(len(TEXT) - 1, 0), (0, 1)])
    assert far != MASKED_RGB and above == MASKED_RGB


@pytest.mark.slow
def test_a_long_run_never_asks_for_tiles_behind_the_window(window_server, qwen_spec, page, watched, artifacts):
    from manyeyes.model import load

    text = long_text(700)
    dense = load(qwen_spec, device="cpu").attend(text).attention.numpy()  # (L, H, T, T)
    T = dense.shape[-1]
    assert T > DENSE_MAX  # the server keeps queries and keys: the page draws tiles
    open_view(page, window_server, text=text, model=MODEL, layer=1, head=0)
    page.wait_for_selector("#focus-plot[data-long='true'][data-layer='1']", timeout=60_000)
    wait_settled(page, timeout=60_000)
    assert "sliding window" in page.locator("#focus-caption").text_content()
    # Zoomed out, a pixel pools many cells: those wholly behind the window are masked.
    assert page.evaluate(MASKED_PIXEL, [T - 10, 10])
    # The overview thumbnails: layer 1's far corner is masked, layer 0's is a weight.
    page.wait_for_function("() => document.querySelectorAll('.thumb').length === 8 && !document.querySelector('.thumb.loading')")
    thumbs = masked_thumbnails(page)
    assert all(thumbs[(1, h)][-1, 0] and not thumbs[(0, h)][-1, 0] for h in range(4))

    # Zoomed in where every key is behind the window: no tile is asked for, the cells read masked.
    before = len(watched.requests)
    q0, k0 = 600, 100
    zoom(page, q0, q0 + 40, k0, k0 + 48)
    page.wait_for_function("() => document.getElementById('focus-plot').dataset.level === '1'")
    wait_settled(page)
    assert not any(a < q0 + 40 and b > q0 and c < k0 + 48 and d > k0 for a, b, c, d, _r in tile_windows(watched.requests[before:]))
    assert page.evaluate(MASKED_PIXEL, [q0 + 20, k0 + 20])
    assert hover_cell(page, q0 + 20, k0 + 20).endswith(": masked")
    assert hatched(page, q0 + 20, k0 + 20) > 0
    page.locator(".focus-panel").screenshot(path=str(artifacts / "window-long-far.png"))

    # By the diagonal the tiles come, and a cell just behind the window reads masked, not 0.
    zoom(page, q0, q0 + 40, q0 - 8, q0 + 40)
    wait_settled(page)
    q = q0 + 20
    assert hover_cell(page, q, q - WINDOW).endswith(": masked")
    assert hatched(page, q, q - WINDOW) > 0 and hatched(page, q, q - 1) == 0 and hatched(page, q, q + 1) > 0
    reading = float(hover_cell(page, q, q - 1).rsplit(": ", 1)[1])
    assert reading == pytest.approx(float(dense[1, 0, q, q - 1]), abs=1e-3)
    page.locator(".focus-panel").screenshot(path=str(artifacts / "window-long-diagonal.png"))
