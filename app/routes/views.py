"""POST /api/v1/views and GET /api/v1/views/{id}: the page's permalinks, short for any text."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from manyeyes.app.routes.responses import errors
from manyeyes.app.schemas import ViewSaved, ViewState
from manyeyes.app.services.errors import ApiError
from manyeyes.app.services.views import ViewStore

router = APIRouter(prefix="/api/v1", tags=["views"])


class UnknownView(ApiError):
    status = 404
    code = "unknown_view"


def get_views(request: Request) -> ViewStore:
    # Built on first use: the store needs nothing from the lifespan and lives as long as the app.
    store = getattr(request.app.state, "views", None)
    if store is None:
        store = request.app.state.views = ViewStore()
    return store


ViewsDep = Annotated[ViewStore, Depends(get_views)]


@router.post("/views", response_model=ViewSaved, responses=errors(413, 422))
def save_view(body: ViewState, views: ViewsDep) -> ViewSaved:
    """Stores a view of the page; `/?view=<id>` opens it again while the server remembers it."""
    return ViewSaved(id=views.put(body.model_dump()))


@router.get("/views/{view_id}", response_model=ViewState, responses=errors(404))
def load_view(view_id: Annotated[str, Path(pattern="^[0-9a-f]{18}$")], views: ViewsDep) -> ViewState:
    state = views.get(view_id)
    if state is None:
        raise UnknownView(f"view {view_id} is unknown or has expired; the server keeps views for 30 days")
    return ViewState(**state)
