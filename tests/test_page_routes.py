"""The page and its assets are served by the app itself, with nothing fetched from elsewhere."""

import re
from pathlib import Path

import plotly
import pytest
from fastapi.testclient import TestClient

from manyeyes.app.config import Settings
from manyeyes.app.main import create_app

STATIC = Path(__file__).resolve().parents[1] / "static"


@pytest.fixture(scope="module")
def client():
    # No lifespan: the page needs no model, so none is loaded.
    return TestClient(create_app(Settings(models={"minilm": "minilm"})))


def test_index_renders_the_template_with_local_assets_only(client):
    reply = client.get("/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    html = reply.text
    assert '<script type="module" src="static/js/main.js">' in html
    assert f'src="vendor/plotly.min.js?v={plotly.__version__}"' in html
    assert re.findall(r'(?:src|href)="(https?:)?//', html) == []
    # Relative to the page: a proxy may serve it under a path of its own (test_page_prefix.py).
    assert re.findall(r'(?:src|href)="/', html) == []
    assert re.findall(r'(?:src|href|data-openapi-url)="/', client.get("/docs").text) == []


def test_plotly_comes_from_the_installed_package(client):
    reply = client.get(f"/vendor/plotly.min.js?v={plotly.__version__}")
    assert reply.status_code == 200 and "javascript" in reply.headers["content-type"]
    bundled = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    assert reply.content == bundled.read_bytes()


def test_plotly_is_gzipped_once_not_at_every_load(client):
    """Gzipped by the middleware at each request, its 4.8 MB took 0.14 s of the event loop a page."""
    from manyeyes.app.routes.page import plotly_gzipped

    plotly_gzipped.cache_clear()
    bundled = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    for _ in range(3):
        reply = client.get(f"/vendor/plotly.min.js?v={plotly.__version__}", headers={"Accept-Encoding": "gzip, br"})
        assert reply.headers["content-encoding"] == "gzip" and reply.content == bundled  # httpx decodes it, once
        assert "accept-encoding" in reply.headers["vary"].lower()
    assert plotly_gzipped.cache_info().misses == 1
    # A client that takes no gzip, or asks for a range, gets the file itself.
    plain = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.content == bundled
    part = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "gzip", "Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == bundled[:10]


def test_every_module_is_served_and_imports_only_local_files(client):
    modules = sorted(STATIC.glob("js/*.js"))
    assert modules
    for path in modules:
        assert client.get(f"/static/js/{path.name}").status_code == 200
        source = path.read_text()
        for target in re.findall(r'from\s+"([^"]+)"', source):
            assert target.startswith("./") and (path.parent / target).exists(), (path.name, target)
        # User text reaches the DOM as text only (textContent); see the XSS browser test.
        assert not re.search(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write", source), path.name
    assert client.get("/static/css/app.css").status_code == 200


def test_the_pages_modules_are_revalidated_at_every_load(client):
    """Without a Cache-Control a browser kept them fresh, unasked, for a tenth of their age: after
    an upgrade, the new main.js could run with the old modules it imports."""
    reply = client.get("/static/js/main.js")
    assert reply.status_code == 200 and reply.headers["cache-control"] == "no-cache"
    again = client.get("/static/js/main.js", headers={"If-None-Match": reply.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert client.get("/static/css/app.css").headers["cache-control"] == "no-cache"
