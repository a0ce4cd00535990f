"""POST /api/v1/views and GET /api/v1/views/{id}: the page's permalinks, short for any text."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from manyeyes.app.clients import client_of, tenant_of
from manyeyes.app.deps import RegistryDep, ServiceDep
from manyeyes.app.routes.responses import errors
from manyeyes.app.schemas import ViewSaved, ViewState
from manyeyes.app.services.attention import check_some_tokens, resolve_indices
from manyeyes.app.services.cache import run_id_for
from manyeyes.app.services.errors import ApiError, InvalidInput, TooLong
from manyeyes.app.services.views import SaveSlots, ViewStore
from manyeyes.model.errors import TooLongError
from manyeyes.model.measures import check_attributable

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
    resolve_indices([head], info.n_heads, "head", info.id)
    resolve_indices(heads, info.n_heads, "head", info.id)  # each once, as every route that takes heads asks


MAX_THRESHOLD = 0.5  # the page's threshold slider's end (templates/index.html)

# The states below are refused when saved, not by ViewState: GET /views/{id} builds a ViewState
# of each view it opens, and one saved before these checks would then fail there, a 500.
def check_view(body: ViewState, model) -> None:
    """What a view's page could never show, known without its text's tokens."""
    info = model.info
    check_focus(info, body.layer, body.head, body.heads)
    if body.threshold > MAX_THRESHOLD:  # a view at 0.9 opened with the slider at 0.5 and its label at 0.90
        raise InvalidInput(f"threshold {body.threshold} is past the page's slider, 0 to {MAX_THRESHOLD}")
    if body.segments != "all" and body.text_pair is None:
        raise InvalidInput(f"segments {body.segments!r} picks rows and columns by text (A) and text_pair (B), and this "
                           "view has no text_pair: leave segments at 'all', or give the text_pair")
    if body.guess_position is None and body.guess_target is None:
        return
    # The page's "Why this guess?" asks GET .../logit-attribution for them, which checks the same.
    try:
        check_attributable(model)
    except ValueError as exc:
        raise InvalidInput(f"guess_position and guess_target are for \"Why this guess?\", which model {info.id} has not: "
                           f"{exc}; leave them out") from None
    vocab = model.net.out_head.weight.shape[0]
    if body.guess_target is not None and body.guess_target >= vocab:
        raise InvalidInput(f"guess_target {body.guess_target:,} is no token id of model {info.id}: its ids are 0..{vocab - 1:,}")


def check_guess_position(body: ViewState, n_tokens: int) -> None:
    if body.guess_position is not None and body.guess_position >= n_tokens:
        raise InvalidInput(f"guess_position {body.guess_position:,} is past the text, which runs as {n_tokens:,} tokens "
                           f"(positions 0..{n_tokens - 1:,})")


@router.post("/views", response_model=ViewSaved, responses=errors(404, 413, 415, 429))
def save_view(body: ViewState, views: ViewsDep, saves: Annotated[SaveSlots, Depends(get_saves)], registry: RegistryDep,
              service: ServiceDep, request: Request) -> ViewSaved:
    """Stores a view of the page; `/?view=<id>` opens it again while the server remembers it."""
    served = registry.get(body.model)  # 404: a model it does not serve
    body = body.model_copy(update={"model": served.id})  # the default by name: the link opens the same model
    model = served.model
    check_view(body, model)
    # A link to a text this server would refuse could never open.
    service.check_chars([(body.text, body.text_pair)])
    client, tenant = client_of(request), tenant_of(request)
    # The page saves a view of each run it shows, whose run is cached: that text is known to run.
    # Any other is tokenized to check it, a few saves at a time (SaveSlots).
    run = service.cache.get(run_id_for(served.id, body.text, body.text_pair, body.truncate, tenant))
    if run is not None:
        n_tokens = run.n_tokens
    else:
        with saves.hold(client):
            try:
                encoded = model.encode(body.text, body.text_pair, body.truncate)
            except TooLongError as exc:
                raise TooLong.tokens(exc) from None
            # A text of zero-width or combining characters alone is not blank, yet never runs.
            check_some_tokens(served.id, encoded, body.text_pair is not None)
            n_tokens = len(encoded)
    check_guess_position(body, n_tokens)
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
