"""The API reference at /docs: Swagger UI 5 from the installed swagger-ui-bundle-v2 package.

FastAPI's own /docs pulls Swagger UI from a CDN and boots it with an inline script; that breaks
offline and needs a looser Content-Security-Policy. Here every asset comes from this server and
the bootstrap is a static module, so /docs lives under the same 'self'-only policy as the page.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

from manyeyes.app.routes.page import templates

SWAGGER_DIR = Path(swagger_ui_path)
# Only these files are served: the route never maps a client path onto the filesystem.
SWAGGER_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}

router = APIRouter(include_in_schema=False)


@router.get("/docs", response_class=HTMLResponse)
def docs(request: Request) -> HTMLResponse:
    # Relative, as every URL the pages use: a proxy may serve this server under a path of its own.
    return templates.TemplateResponse(request, "docs.html", {"openapi_url": request.app.openapi_url.lstrip("/")})


@router.get("/vendor/swagger-ui/{name}")
def swagger_asset(name: str) -> FileResponse:
    if name not in SWAGGER_ASSETS:
        raise HTTPException(404, "no such Swagger UI asset")
    return FileResponse(
        SWAGGER_DIR / name, media_type=SWAGGER_ASSETS[name], headers={"Cache-Control": "public, max-age=604800"}
    )
