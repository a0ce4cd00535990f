"""POST /api/v1/views and GET /api/v1/views/{id}: the page's permalinks, short for any text."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from manyeyes.app.clients import client_of, tenant_of
from manyeyes.app.deps import RegistryDep, ServiceDep
from manyeyes.app.routes.responses import errors
from manyeyes.app.schemas import ViewSaved, ViewState
from manyeyes.app.services.attention import resolve_indices
from manyeyes.app.services.cache import run_id_for
from manyeyes.app.services.errors import ApiError, TooLong
from manyeyes.app.services.views import SaveSlots, ViewStore
from manyeyes.model.errors import TooLongError

router = APIRouter(prefix="/api/v1", tags=["views"])


class UnknownView(ApiError):
    status = 404
    code = "unknown_view"


# Both made once, by create_app (app/main.py): made here on first use, check-then-set on the
# thread pool, two first requests at once each made one, and a view saved into the one dropped 404ed.
def get_views(request: Request) -> ViewStore:
    return request.app.state.views


def get_saves(request: Request) -> SaveSlots:
    return request.app.state.view_saves


ViewsDep = Annotated[ViewStore, Depends(get_views)]


def check_focus(info, layer: int, head: int, heads: list[int] = ()) -> None:
    """A view can only focus heads its model has: a link to layer 99 would open on nothing."""
    resolve_indices([layer], info.n_layers, "layer", info.id)
    resolve_indices(sorted({head, *heads}), info.n_heads, "head", info.id)


@router.post("/views", response_model=ViewSaved, responses=errors(404, 413, 415, 429))
def save_view(body: ViewState, views: ViewsDep, saves: Annotated[SaveSlots, Depends(get_saves)], registry: RegistryDep,
              service: ServiceDep, request: Request) -> ViewSaved:
    """Stores a view of the page; `/?view=<id>` opens it again while the server remembers it."""
    served = registry.get(body.model)  # 404: a model it does not serve
    model = served.model
    check_focus(model.info, body.layer, body.head, body.heads)
    # A link to a text this server would refuse could never open.
    service.check_chars([(body.text, body.text_pair)])
    client, tenant = client_of(request), tenant_of(request)
    # The page saves a view of each run it shows, whose run is cached: that text is known to run.
    # Any other is tokenized to check it, a few saves at a time (SaveSlots).
    if service.cache.get(run_id_for(served.id, body.text, body.text_pair, body.truncate, tenant)) is None:
        with saves.hold(client):
            try:
                model.encode(body.text, body.text_pair, body.truncate)
            except TooLongError as exc:
                raise TooLong.tokens(exc) from None
    return ViewSaved(id=views.put(body.model_dump(), owner=client, tenant=tenant))


@router.get("/views/{view_id}", response_model=ViewState, responses=errors(404))
def load_view(view_id: Annotated[str, Path(pattern="^[0-9a-f]{18}$")], views: ViewsDep) -> ViewState:
    state = views.get(view_id)
    if state is None:
        raise UnknownView(
            f"view {view_id} is unknown here: it was never saved, or has been forgotten (a view is kept up to 30 days, "
            "while the server's store of views has room for it)"
        )
    return ViewState(**state)
