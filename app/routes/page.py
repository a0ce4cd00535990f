"""The browser visualizer: the HTML page and the vendored plotly.js it needs, so it works offline."""

from __future__ import annotations

from pathlib import Path

import plotly
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES_DIR = ROOT / "templates"
# The plotly Python package ships the full plotly.js bundle; serving it avoids any CDN.
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"

router = APIRouter(tags=["page"])
templates = Jinja2Templates(directory=str(TEMPLATES_DIR))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def index(request: Request) -> HTMLResponse:
    return templates.TemplateResponse(request, "index.html", {"plotly_version": plotly.__version__})


@router.get("/vendor/plotly.min.js", include_in_schema=False)
def plotly_js() -> FileResponse:
    # A week of caching: the file only changes when the plotly package is upgraded.
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers={"Cache-Control": "public, max-age=604800"})
