"""The page behind a proxy that serves the server under a path of its own, as nginx's
`location /manyeyes/ { proxy_pass http://127.0.0.1:8000/; }` and jupyter-server-proxy do: the
proxy strips the prefix, so the server never sees it, and every URL the page and /docs use must be
relative to where the page was loaded. With absolute ones (/api/v1/..., /static/...), the page
under a prefix loaded no script at all."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from tests.servers import free_port, wait_ready
from tests.browser.test_page import run, wait_saved

pytestmark = pytest.mark.browser

PREFIX = "/manyeyes"

# A prefix-stripping reverse proxy in one file: what is under PREFIX goes upstream without it,
# bytes as sent (compressed answers and streams included); anything else is a 404 naming the path.
PROXY_SCRIPT = """
import sys, httpx, uvicorn
upstream, prefix, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"host", b"te", b"upgrade"}

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if not path.startswith(prefix + "/"):
        body = ('{"outside the prefix": "%s"}' % path).encode()
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    url = path[len(prefix):] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
    async with httpx.AsyncClient(base_url=upstream, timeout=60) as client:
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        response = await client.send(request, stream=True)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP]})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


@contextlib.contextmanager
def proxying(upstream: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", PROXY_SCRIPT, upstream, PREFIX, str(port)])
    base = f"http://127.0.0.1:{port}{PREFIX}"
    try:
        wait_ready(base, proc, timeout_s=30, route="/healthz", what="the proxy")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def proxied(server):
    with proxying(server) as base:
        yield base


def outside(requests: list[str]) -> list[str]:
    paths = [urlsplit(u).path for u in requests if urlsplit(u).scheme in ("http", "https")]
    return [p for p in paths if not p.startswith(PREFIX + "/")]


def test_the_proxy_answers_only_under_its_prefix(proxied):
    assert httpx.get(f"{proxied}/readyz").status_code == 200
    assert httpx.get(proxied.removesuffix(PREFIX) + "/readyz").status_code == 404


def test_the_page_runs_saves_generates_and_exports_under_a_path_prefix(proxied, page, watched):
    page.goto(f"{proxied}/")
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#model option").count() == 2  # GET api/v1/models went through
    run(page, "The bank of the river was muddy.")
    wait_saved(page)  # POST api/v1/views
    link = page.url
    assert urlsplit(link).path == PREFIX + "/"

    # A stream through the proxy: the generation's lines arrive as the server sends them.
    run(page, "the river bank", model="tiny-causal")
    page.fill("#gen-n", "3")
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='finished']", timeout=30_000)
    assert page.text_content("#gen-status") == "Finished: 3 new tokens from tiny-causal."

    with page.expect_download() as download:
        page.click("#export-page")
    assert download.value.suggested_filename.endswith(".html")

    # The saved link opens its view under the prefix too.
    page.goto(link)
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_selector("#focus-plot[data-precision=f16]", timeout=30_000)
    assert page.input_value("#text") == "The bank of the river was muddy."

    watched.settle(page)
    assert any(urlsplit(u).path == f"{PREFIX}/api/v1/generate" for u in watched.requests)
    assert any(urlsplit(u).path == f"{PREFIX}/vendor/plotly.min.js" for u in watched.requests)
    assert outside(watched.requests) == []


def test_the_api_docs_try_it_out_under_a_path_prefix(proxied, page, watched):
    page.goto(f"{proxied}/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=30_000)
    assert page.locator(".servers select option").all_inner_texts() == [PREFIX]
    operation = page.locator(".opblock-get", has=page.locator(".opblock-summary-path[data-path='/api/v1/models']"))
    operation.locator(".opblock-summary").click()
    operation.locator(".try-out__btn").click()
    operation.locator(".execute").click()
    status = operation.locator(".live-responses-table tbody .response-col_status").first
    status.wait_for(timeout=30_000)
    assert status.inner_text().strip() == "200"
    watched.settle(page)
    assert any(urlsplit(u).path == f"{PREFIX}/api/v1/models" for u in watched.requests)
    assert outside(watched.requests) == []


def test_the_python_client_works_under_a_path_prefix(proxied, api):
    """Client("https://host/manyeyes") sends its paths under the base URL's own (httpx joins them)."""
    from manyeyes.client import Client

    with Client(proxied) as client:
        assert {m.id for m in client.models()} == {"minilm", "tiny-causal"}
        result = client.attention("The bank of the river.", model="minilm", format="f16")
        direct = api.post("/api/v1/attention", json={"text": "The bank of the river.", "model": "minilm", "format": "json"}).json()
        assert abs(result.attention - np.asarray(direct["attention"]["data"])).max() < 1e-3
        part = client.slice(result.run_id, layers=[1], heads=[2])
        assert abs(part.attention[0, 0] - result.attention[1, 2]).max() < 1e-6
        steps = list(client.generate("the river bank", 3, model="tiny-causal", stop_at_eos=False))
        assert len(steps) == 3
