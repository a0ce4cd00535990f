"""GET /export: the page's "Export page" button; one self-contained HTML file of one run."""

from __future__ import annotations

import re
import time
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from manyeyes.app.clients import client_of, tenant_of
from manyeyes.app.deps import RegistryDep, ServiceDep, known_query, utf8_url
from manyeyes.app.routes.responses import PiecesResponse, errors
from manyeyes.app.schemas import DIGITS, AttentionRequest
from manyeyes.app.routes.views import UnknownView, ViewsDep, check_focus
from manyeyes.app.services.attention import answer_bytes, finished_off_loop, tokens_bytes
from manyeyes.app.services.errors import InvalidInput, NeedsTiles

router = APIRouter(tags=["page"])


# Its parameters checked as the API's are: `text_pair` (the API's name; here `pair`) or `layers=3`
# was dropped without a word, and the file held a run of the text alone, or layer 0.
@router.get("/export", response_class=Response, dependencies=[Depends(utf8_url), Depends(known_query)],
            responses={200: {"content": {"text/html": {}}}, **errors(404, 413, 429, 503, 504)})
async def export_page(
    request: Request,
    service: ServiceDep,
    registry: RegistryDep,
    views: ViewsDep,
    text: Annotated[str | None, Query(min_length=1)] = None,
    view: Annotated[str | None, Query(pattern="^[0-9a-f]{18}$", description="A saved view's id (the page's ?view=)")] = None,
    pair: Annotated[str | None, Query(description="Second segment, for sentence-pair models")] = None,
    model: Annotated[str | None, Query()] = None,
    layer: Annotated[int, Query(ge=0, description="Layer focused when the file opens"), DIGITS] = 0,
    head: Annotated[int, Query(ge=0, description="Head focused when the file opens"), DIGITS] = 0,
    truncate: Annotated[bool, Query(description="Cut input longer than the model's positions (as the page's option); "
                                                "off, as there and on the API, a too-long text is a 422 too_long")] = False,
) -> Response:
    """The viewer with this run's attention inside, as a download that opens from disk with no
    server and no network. The query is the page's permalink: a saved `view` id, or `text`, `pair`,
    `model`, `layer`, `head`."""
    from manyeyes.export import build_pieces, embed, model_entry, page_bytes, pick_format, render_page

    state = None
    if view is not None:
        # A view names its whole run: text=, model= or head= beside it were dropped without a word,
        # and the file held the view's run, not the one asked for.
        beside = [name for name in ("text", "pair", "model", "layer", "head", "truncate") if name in request.query_params]
        if beside:
            raise InvalidInput(f"?view= names the whole run to export; leave out {', '.join(beside)}, or drop view "
                               "and name the run with text, pair, model, layer and head")
        state = await run_in_threadpool(views.get, view)  # with workers or Ray, a read of the shared store
        if state is None:
            raise UnknownView(f"view {view} is unknown or has expired; the server keeps views for 30 days")
        text, pair, model = state["text"], state["text_pair"], state["model"]
        layer, head, truncate = state["layer"], state["head"], state["truncate"]
    if text is None:
        raise InvalidInput("name the run to export: ?view=<id> or ?text=...")

    client, tenant = client_of(request), tenant_of(request)  # its fair share, as for the API's own requests
    served = registry.get(model)
    check_focus(served.model.info, layer, head)
    try:
        probe = AttentionRequest(text=text, text_pair=pair or None, model=served.id, layers=[0], heads=[0], format="u8",
                                 truncate=truncate, keep="weights")
    except ValidationError as exc:
        # Reported as the query's own errors: the request model calls `pair` text_pair.
        raise RequestValidationError(
            [{**e, "loc": ("query", *("pair" if p == "text_pair" else p for p in e["loc"]))} for e in exc.errors()]
        ) from None
    try:
        reply = await service.attend([(probe.text, probe.text_pair)], probe, batch=False, started=time.monotonic(),
                                     client=client, tenant=tenant)
    except NeedsTiles:
        raise NeedsTiles(
            f"an exported page holds every weight of its run, up to {service.settings.dense_max_tokens:,} tokens on this "
            "server, and this text is longer: export a shorter one (the page reads longer runs from the server)"
        ) from None
    n_tokens = reply.runs[0].n_tokens
    # The probe's bytes (its run's among them: 75 MB at T=512) go back before the full answer asks
    # for its own: held, they and the full answer passed a client's half of the answers' budget
    # from about 420 MiniLM tokens, and the export waited for its own bytes until its 504.
    reply.release()
    info = served.model.info
    # The same run again, all of it: the run cache answers, no second forward pass.
    full = probe.model_copy(update={"layers": None, "heads": None, "format": pick_format(info.n_layers, info.n_heads, n_tokens)})
    # Off the loop: its first call in a process walks static/ and renders the page.
    page = await finished_off_loop(page_bytes)

    def page_around(tokens) -> int:
        """The file's bytes, reckoned with the answer's own in its grant: the page, the answer
        again inside it (each `<` escaped) and the text, twice, each character escaped at worst."""
        cells = info.n_layers * info.n_heads * len(tokens) ** 2
        chars = len(full.text) + len(full.text_pair or "")
        return page + answer_bytes(cells, full.format, False, tokens) + tokens_bytes(tokens) + 12 * chars

    reply = await service.attend([(full.text, full.text_pair)], full, batch=False, started=time.monotonic(), client=client,
                                 extra_bytes=page_around, tenant=tenant)

    def build() -> list[bytes]:
        answer = b"".join(reply.body)
        reply.body = []  # its pieces go as soon as they are one: each copy of the run's weights is MBs
        body = orjson.loads(answer)
        del answer
        entry = model_entry(info, default=served.default)
        # A saved view keeps its options (extra heads, segments, threshold, scale...) in the file.
        return build_pieces(render_page(), embed(body, entry, text, full.text_pair, layer, head, full.truncate, view=state))

    # In a render slot, as an answer's encoding.
    async with service.renders.hold(client):
        html = await finished_off_loop(build)
    name = re.sub(r"[^\w.-]", "_", served.id)
    return PiecesResponse(html, "text/html; charset=utf-8",
                          {"Content-Disposition": f'attachment; filename="manyeyes-{name}.html"'}, reply.hand_over())
