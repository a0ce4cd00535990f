"""The page's API module in a real browser: it asks for raw frames and decodes them to the same
numbers as the JSON form, and with API keys on it asks for the key once per tab."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.browser.conftest import playwright, profile, profile_folder  # noqa: F401 (fixtures)
from tests.servers import free_port

pytestmark = pytest.mark.browser
KEY = "page-key-0123456789"
KEY_NOT_LATIN1 = "ключ-café"  # fetch takes header values as bytes (Latin-1); the server reads UTF-8
SERVER = """
import json, sys, uvicorn
from manyeyes.app.config import Settings
from manyeyes.app.main import create_app
uvicorn.run(create_app(Settings(**json.loads(sys.argv[2]))), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def spawn(settings: dict):
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), json.dumps(settings)], cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server was not ready within 120 s"
        time.sleep(0.25)


@pytest.fixture(scope="module", params=["open", "keys"])
def served(request):
    settings = {"models": {"minilm": "minilm"}, "device": "cpu", "warmup": False}
    if request.param == "keys":
        settings["api_keys"] = [KEY, KEY_NOT_LATIN1]
    proc, url = spawn(settings)
    yield request.param, url
    proc.terminate()
    proc.wait(30)


CALL = """async ([text, fmt]) => {
  const api = await import("/static/js/api.js");
  const models = await api.listModels();
  const body = await api.postAttention({ text, format: fmt });
  const d = body.attention.decoded;
  return { models: models.map((m) => m.id), shape: d.shape, scale: d.scale ?? null,
           cells: Array.from(d.bytes ?? d.values), runId: body.run_id };
}"""


def test_the_page_fetches_frames_and_decodes_the_same_numbers(profile, served):
    mode, url = served
    page = profile.new_page()
    prompts, accepts = [], []
    page.on("dialog", lambda dialog: (prompts.append(dialog.message), dialog.accept(KEY)))
    page.on("request", lambda req: accepts.append(req.headers.get("accept", "")) if "/api/v1/attention" in req.url else None)
    page.goto(url + "/")
    headers = {"Authorization": f"Bearer {KEY}"} if mode == "keys" else {}
    for fmt, text in (("u8", "The heron waited by the old stone mill."), ("f16", "Boats went past."), ("json", "Quiet.")):
        got = page.evaluate(CALL, [text, fmt])
        assert got["models"] == ["minilm"]
        expected = httpx.post(f"{url}/api/v1/attention", json={"text": text, "format": fmt}, headers=headers, timeout=60).json()
        assert got["runId"] == expected["run_id"] and got["shape"] == expected["attention"]["shape"]
        if fmt == "u8":
            np.testing.assert_array_equal(got["cells"], np.frombuffer(base64.b64decode(expected["attention"]["data"]), np.uint8))
        elif fmt == "f16":
            raw = np.frombuffer(base64.b64decode(expected["attention"]["data"]), "<f2").astype(np.float32)
            np.testing.assert_array_equal(np.float32(got["cells"]), raw)
        else:
            np.testing.assert_array_equal(np.float32(got["cells"]), np.float32(expected["attention"]["data"]).ravel())
    assert accepts and all("application/vnd.manyeyes.frame" in a for a in accepts), accepts
    if mode == "keys":
        # Asked once, on the first refused call; kept for the tab, never asked again.
        assert len(prompts) == 1 and "API key" in prompts[0]
        assert page.evaluate("sessionStorage.getItem('manyeyes.apiKey')") == KEY
        # Never persisted beyond the tab (the page keeps its own preferences in localStorage).
        stored = page.evaluate("Object.values(localStorage)")
        assert all(KEY not in value for value in stored), stored
    else:
        assert prompts == []
    page.close()


DESCRIBED = """async () => {
  const api = await import("/static/js/api.js");
  try { await api.listModels(); return null; } catch (err) { return api.describeError(err); }
}"""


def test_a_refused_key_is_said_once_in_the_pages_words(profile, served):
    """The page put "This server needs an API key:" before the server's own message, which began
    the same way: "...needs an API key: this server needs an API key: send Authorization: ..."."""
    mode, url = served
    page = profile.new_page()
    page.on("dialog", lambda dialog: dialog.dismiss())  # the key prompt, cancelled
    page.goto(url + "/")
    if mode == "open":
        assert page.evaluate(DESCRIBED) is None  # nothing refused, nothing asked
        page.close()
        return
    assert page.evaluate(DESCRIBED) == ("This server needs an API key (send Authorization: Bearer <key>). "
                                        "Reload the page to enter it again.")
    page.close()
    page = profile.new_page()
    page.on("dialog", lambda dialog: dialog.accept("a-wrong-key") if "needs" in dialog.message else dialog.dismiss())
    page.goto(url + "/")
    assert page.evaluate(DESCRIBED) == "This server needs an API key (the API key is not valid). Reload the page to enter it again."
    page.close()


READ_RUN = """async ([text]) => {
  const api = await import("/static/js/api.js");
  const run = await api.postAttention({ text, format: "u8", layers: [0], heads: [0] });
  const slice = await api.fetchSlice(run.run_id, [1], [2, 3], "f16");
  const mean = await api.fetchMean(run.run_id, [0, 1]);
  return [slice.attention.decoded.shape, mean.attention.decoded.shape];
}"""


def test_every_read_of_a_run_carries_the_tabs_key(profile, served):
    """fetchMean alone went out without the key: "Mean of all heads" was a 401 whose banner said
    to reload the page, under the old head's heatmap."""
    mode, url = served
    page = profile.new_page()
    page.on("dialog", lambda dialog: dialog.accept(KEY))
    page.goto(url + "/")
    slice_shape, mean_shape = page.evaluate(READ_RUN, ["The heron waited by the mill."])
    assert slice_shape[:2] == [1, 2] and mean_shape[:2] == [1, 1] and mean_shape[2:] == slice_shape[2:], (slice_shape, mean_shape)
    page.close()


@pytest.mark.parametrize("served", ["keys"], indirect=True)
def test_a_key_beyond_latin1_is_sent_as_its_utf8_bytes(profile, served):
    """The page put the key into the header as it was typed: fetch threw on "ключ" (read as "the
    server could not be reached", for good in that tab) and sent "é" as one Latin-1 byte, which
    the server, reading UTF-8 as curl sends it, refused."""
    _, url = served
    page = profile.new_page()
    prompts = []
    page.on("dialog", lambda dialog: (prompts.append(dialog.message), dialog.accept(KEY_NOT_LATIN1)))
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]", timeout=30_000)
    slice_shape, mean_shape = page.evaluate(READ_RUN, ["The heron waited by the mill."])
    assert slice_shape[:2] == [1, 2] and mean_shape[:2] == [1, 1], (slice_shape, mean_shape)
    assert len(prompts) == 1 and page.locator("#error").text_content().strip() == "", prompts
    page.close()


@pytest.mark.parametrize("served", ["keys"], indirect=True)
def test_a_refused_key_is_asked_for_again_and_a_run_without_models_says_why(profile, served):
    """A mistyped key at the first question left the page with no models and no second question:
    a run then crashed on the missing model ("reading 'n_layers'") and spun for good."""
    _, url = served
    page = profile.new_page()
    prompts, answers = [], iter(["mistyped", KEY])
    page.on("dialog", lambda dialog: (prompts.append(dialog.message), dialog.accept(next(answers))))
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]", timeout=30_000)
    assert len(prompts) == 2 and "refused that API key" in prompts[1], prompts
    page.close()

    page = profile.new_page()
    page.on("dialog", lambda dialog: dialog.dismiss())  # no key given: no model list
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('Cannot list the models')")
    page.fill("#text", "The heron waited.")
    page.press("#text", "Enter")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('no model list')")
    assert page.locator("#run").is_enabled() and errors == [], errors
    page.close()


def test_the_export_button_downloads_the_page_with_the_tabs_key(profile, served, tmp_path):
    """/export runs the model, so a server with keys guards it; the button fetches it with the
    key the tab was given (a plain navigation could not send one) and saves what comes back."""
    mode, url = served
    page = profile.new_page()
    try:
        page.on("dialog", lambda dialog: dialog.accept(KEY))
        page.goto(url + "/?text=The+heron+waited.")
        page.wait_for_selector("#grid canvas", timeout=60_000)
        page.wait_for_function("() => document.body.dataset.view && !document.body.dataset.viewPending")
        with page.expect_download() as download:
            page.locator("#export-page").click()
        path = tmp_path / download.value.suggested_filename
        download.value.save_as(path)
    finally:
        page.close()
    assert path.name == "manyeyes-minilm.html"
    html = path.read_text()
    assert "The heron waited." in html and len(html) > 100_000  # the viewer, plotly and the run
    without_key = httpx.get(f"{url}/export", params={"text": "The heron waited."}, timeout=60)
    assert without_key.status_code == (401 if mode == "keys" else 200)
