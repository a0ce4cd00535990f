"""The browser visualizer: the HTML page and the vendored plotly.js it needs, so it works offline."""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import plotly
from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates

from manyeyes.app.services.wire import coding_q, header_list

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES_DIR = ROOT / "templates"
# The plotly Python package ships the full plotly.js bundle; serving it avoids any CDN.
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"

router = APIRouter(tags=["page"])
templates = Jinja2Templates(directory=str(TEMPLATES_DIR))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def index(request: Request) -> HTMLResponse:
    return templates.TemplateResponse(request, "index.html", {"plotly_version": plotly.__version__})


@functools.cache
def plotly_gzipped() -> bytes:
    """plotly.js gzipped once, here on the thread pool: compressed by the gzip middleware at each
    load, its 4.8 MB took 0.14 s of the event loop's CPU a page, and a class of 25 opening the page
    at once held every other request for seconds (a review by use)."""
    return gzip.compress(PLOTLY_JS.read_bytes(), compresslevel=9, mtime=0)


@router.get("/vendor/plotly.min.js", include_in_schema=False)
def plotly_js(request: Request) -> Response:
    # A week of caching: the file only changes when the plotly package is upgraded.
    headers = {"Cache-Control": "public, max-age=604800", "Vary": "Accept-Encoding"}
    if "range" not in request.headers and coding_q(header_list(request.headers, "accept-encoding"), "gzip") > 0:
        return Response(plotly_gzipped(), media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"})
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers=headers)
