"""Browser fixtures: the real server on a loopback port (MiniLM plus a tiny causal GPT) and Debian's chromium."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.servers import free_port, wait_ready

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}

SERVER_SCRIPT = """
import json, sys, uvicorn
from manyeyes.app.config import Settings
from manyeyes.app.main import create_app
uvicorn.run(create_app(Settings(models=json.loads(sys.argv[2]))), host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning")
"""


@pytest.fixture(scope="session")
def causal_model_spec(tmp_path_factory) -> str:
    """A small random book GPTModel checkpoint (causal) that reuses MiniLM's tokenizer.json: no download."""
    import torch

    from manyeyes.model.gpt import GPTModel
    from manyeyes.model.loading import builtin_path

    folder = tmp_path_factory.mktemp("tiny-causal")
    cfg = {"vocab_size": 30522, "context_length": 64, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "qkv_bias": True}
    torch.manual_seed(0)
    torch.save(GPTModel(cfg).state_dict(), folder / "model.pth")
    (folder / "config.json").write_text(json.dumps(cfg))
    return f"{folder / 'model.pth'}?tokenizer={builtin_path('minilm') / 'tokenizer.json'}"


@contextlib.contextmanager
def serving(models: dict[str, str], env: dict[str, str] | None = None):
    """`create_app` under uvicorn in a subprocess, as `manyeyes serve` runs it; yields its base URL.
    env: MANYEYES_* settings beyond the models."""
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(port), json.dumps(models)], cwd=root,
                            env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout_s=120)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def server(causal_model_spec):
    with serving({"minilm": "minilm", "tiny-causal": causal_model_spec}) as base:
        yield base


@pytest.fixture(scope="session")
def api(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


def chromium_or_skip() -> None:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: apt-get install -y chromium"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)


# Module scope, not session: sync Playwright keeps an asyncio loop running on this thread while
# it is open, and later suites that call asyncio.run() (tests/reliability) must not inherit it.
@pytest.fixture(scope="module")
def playwright():
    chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright):
    chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    yield chromium
    chromium.close()


@pytest.fixture(scope="session")
def profile_folder(tmp_path_factory) -> Path:
    """Where the profile lives, kept by every file this process runs: a new folder per file paid
    the cold loads again (the first two of a profile take 1.7 and 1.4 s, the next 0.35 s) in each
    of the 20-odd files; a profile opened again from disk starts at 0.6 s."""
    return tmp_path_factory.mktemp("chromium-profile")


@pytest.fixture(scope="module")
def profile(playwright, profile_folder):
    """One Chromium profile on disk for a file's pages (make_page). Its HTTP cache keeps the code
    V8 compiled from plotly.min.js: a fresh context compiled the 4.8 MB again at every page, 1.6 s
    a load on this machine, where a warm profile takes 0.35 s. A test's pages are still its own:
    its storage goes with it (see make_page)."""
    context = playwright.chromium.launch_persistent_context(
        profile_folder, executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
        viewport={"width": 1440, "height": 900}, accept_downloads=True,
    )
    yield context
    context.close()


class Watched:
    """Everything a page did that a test may want to hold it to."""

    def __init__(self):
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.in_flight: set = set()  # requests sent and not yet finished or failed

    def settle(self, page, quiet_ms: int = 500, timeout_ms: int = 30_000) -> None:
        """Waits until no request has been in flight for quiet_ms. Playwright's "networkidle" is no
        such wait: reached once by a document, it answers at once ever after."""
        quiet = waited = 0
        while quiet < quiet_ms:
            if waited >= timeout_ms:
                raise AssertionError(f"requests still in flight after {timeout_ms} ms: {[r.url for r in self.in_flight]}")
            page.wait_for_timeout(50)  # Playwright delivers the request events while it waits
            waited += 50
            quiet = quiet + 50 if not self.in_flight else 0

    def off_loopback(self) -> list[str]:
        return [u for u in self.requests if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).hostname not in LOOPBACK]


@pytest.fixture
def watched():
    return Watched()


# Every kind of storage a page can write to, but not the HTTP cache the profile is kept for.
STORAGE = "cookies,local_storage,session_storage,indexeddb,cache_storage,service_workers,file_systems"


@pytest.fixture
def make_page(profile, watched):
    """New pages (of the file's profile) with every request, script error and dialog recorded."""
    def on_request(request):
        watched.requests.append(request.url)
        watched.in_flight.add(request)

    def on_end(request):
        watched.in_flight.discard(request)

    listeners = {"request": on_request, "requestfinished": on_end, "requestfailed": on_end}
    for event, listener in listeners.items():
        profile.on(event, listener)

    def make(viewport=(1440, 900), color_scheme="light"):
        page = profile.new_page()
        page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
        page.emulate_media(color_scheme=color_scheme)
        page.on("pageerror", lambda exc: watched.errors.append(str(exc)))
        # Chromium logs every 4xx as "Failed to load resource"; tests check statuses themselves.
        page.on("console", lambda msg: msg.type == "error" and not msg.text.startswith("Failed to load resource")
                and watched.errors.append(msg.text))

        def on_dialog(dialog):
            watched.dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", on_dialog)
        return page

    yield make
    for event, listener in listeners.items():
        profile.remove_listener(event, listener)
    # What a test stored (a chosen theme, a key for the tab) must not reach the next test's pages.
    # Cleared through a page the test left open where there is one (a fresh page for it cost a
    # renderer's start, 0.2-0.4 s a test); the storage is the profile's, whichever page asks.
    origins = {f"{u.scheme}://{u.netloc}" for u in map(urlsplit, watched.requests) if u.scheme in ("http", "https")}
    if origins:
        asking = profile.pages[0] if profile.pages else profile.new_page()
        cdp = profile.new_cdp_session(asking)
        for origin in origins:
            cdp.send("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": STORAGE})
        cdp.detach()
    for page in profile.pages:  # a test's pages and any popup they opened
        page.close()
    profile.unroute_all()
    # Every browser test also holds the page to the offline promise and to a clean console.
    assert watched.off_loopback() == []
    assert watched.errors == []


@pytest.fixture
def page(make_page):
    return make_page()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
