"""GET /api/v1/runs/{run_id}/...: a recent run again, with no forward pass. /attention slices a
run's whole weights; the run itself, /tile, /topk and /overview serve any run, long ones
(which keep queries and keys, issue 10) included."""

from collections.abc import Awaitable
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from manyeyes.app.clients import client_of
from manyeyes.app.deps import ServiceDep, TilesDep
from manyeyes.app.disconnect import unless_disconnected
from manyeyes.app.routes.attention import wire_of
from manyeyes.app.routes.responses import PiecesResponse, answer_content, errors
from manyeyes.app.schemas import DIGITS, AttentionResponse, CellResponse, Format, OverviewResponse, RunInfo, TileResponse, TopKResponse
from manyeyes.app.services.attention import Reply, parse_index_list

router = APIRouter(prefix="/api/v1", tags=["runs"])


# The frame's layout for the tile routes: each array's `offset` and `nbytes` into the data section.
def arrays_content(model: type) -> dict:
    return answer_content(
        model, "JSON (application/json for format=json, application/vnd.manyeyes+json for f16/u8), or the binary "
        "frame when Accept asks for it: each array then carries offset/nbytes into the data section (8-byte "
        "aligned) instead of data. Indices are int32.", frame_example=None)


def answered(request: Request, reply: Reply) -> Response:
    request.state.log = reply.log
    return PiecesResponse(reply.body, reply.media_type, reply.headers, reply.hand_over())


async def answered_while_connected(request: Request, work: Awaitable[Reply]) -> Response:
    """The tile routes' answer, and a slice's that waits for a render slot: a client that hangs up
    while its request waits for a slot takes the request out of the queue (and of the 429 count,
    AttentionService.queued), as the POST routes do.
    Abandoned tiles were computed anyway: 40 of them, left by a client that gave up after a
    second, kept the next request of that client waiting 50 s."""
    return answered(request, await unless_disconnected(request, work))


Start = Annotated[int | None, Query(ge=0, description="Inclusive; default 0"), DIGITS]
End = Annotated[int | None, Query(ge=1, description="Exclusive; default the run's length"), DIGITS]


@router.get("/runs/{run_id}/attention", response_model=AttentionResponse, responses={200: answer_content(AttentionResponse), **errors(404, 413, 429, 503, 504)})
async def run_slice(
    run_id: str,
    service: ServiceDep,
    request: Request,
    layers: Annotated[list[str] | None, Query(description="Comma-separated layer indices, e.g. 0,2; default all")] = None,
    heads: Annotated[list[str] | None, Query(description="Comma-separated head indices; default all")] = None,
    format: Annotated[Format, Query()] = "json",
) -> Response:
    """A 404 means the run was evicted (or never existed): POST the text again. A run that kept
    queries and keys (a long input) has no whole weights to slice: 422, use /tile. A slice too large
    to render at once waits for a render slot, counted with the tile requests: 429 beyond
    MANYEYES_MAX_QUEUE of them waiting, or beyond this client's share (MANYEYES_MAX_CLIENT_QUEUE)."""
    reply = service.slice(run_id, parse_index_list(layers, "layer"), parse_index_list(heads, "head"), format, wire_of(request),
                          client_of(request))
    if isinstance(reply, Reply):  # small: rendered already, on the loop
        return answered(request, reply)
    return await answered_while_connected(request, reply)  # waits for a render slot, as a tile does


@router.get("/runs/{run_id}", response_model=RunInfo, responses=errors(404, 429, 503, 504))
async def run_info(run_id: str, tiles: TilesDep) -> Response:
    """What a cached run is: its tokens, what it keeps (weights, or queries and keys), the bytes
    it holds, and the URL templates of the routes that serve it."""
    return Response(await tiles.info_json(run_id), media_type="application/json")


@router.get("/runs/{run_id}/tile", response_model=TileResponse, responses={200: arrays_content(TileResponse), **errors(404, 413, 429, 503, 504)})
async def run_tile(
    run_id: str,
    tiles: TilesDep,
    request: Request,
    layer: Annotated[int, Query(ge=0), DIGITS],
    head: Annotated[str, Query(description="A query head index, or `mean`: the mean over the layer's heads",
                               examples=["3", "mean"], max_length=32)],
    q0: Start = None,
    q1: End = None,
    k0: Start = None,
    k1: End = None,
    rows: Annotated[int | None, Query(ge=1, description="Answer rows; default the window's (full resolution, "
                                                        "at most MANYEYES_MAX_TILE_SIDE a side, 1024 by default: 413 beyond)"), DIGITS] = None,
    cols: Annotated[int | None, Query(ge=1, description="Answer columns; default the window's"), DIGITS] = None,
    pool: Annotated[Literal["max", "mean"], Query(description="How a cell sums up the weights it covers")] = "max",
    format: Annotated[Format, Query()] = "json",
) -> Response:
    """One head (or a layer's mean) over the window [q0, q1) x [k0, k1): every weight, or pooled
    to rows x cols (bins of width ceil(n / size), the last one narrower, edges in the answer).
    Values are computed from the float32 weights, exactly; the answer says which pooling it used
    (`none` at full resolution)."""
    return await answered_while_connected(
        request, tiles.tile(run_id, layer, head, q0, q1, k0, k1, rows, cols, pool, format, wire_of(request), client_of(request))
    )


@router.get("/runs/{run_id}/cell", response_model=CellResponse, responses={200: arrays_content(CellResponse), **errors(404, 429, 503, 504)})
async def run_cell(
    run_id: str,
    tiles: TilesDep,
    request: Request,
    query: Annotated[int, Query(ge=0, description="The attending token's position"), DIGITS],
    key: Annotated[int, Query(ge=0, description="The attended token's position"), DIGITS],
    format: Annotated[Format, Query()] = "json",
) -> Response:
    """One cell in every head: the weight from `query` to `key` in each layer and head, the
    question "which heads link these two tokens?" asks, from any run (long ones computed from
    their queries and keys)."""
    return await answered_while_connected(request, tiles.cell(run_id, query, key, format, wire_of(request), client_of(request)))


@router.get("/runs/{run_id}/topk", response_model=TopKResponse, responses={200: arrays_content(TopKResponse), **errors(404, 413, 429, 503, 504)})
async def run_topk(
    run_id: str,
    tiles: TilesDep,
    request: Request,
    layer: Annotated[int, Query(ge=0), DIGITS],
    head: Annotated[int, Query(ge=0), DIGITS],
    k: Annotated[int, Query(ge=1, description="Weights per query row, at most MANYEYES_MAX_TOPK (64 by default; the run's length, if shorter)"), DIGITS] = 8,
    q0: Start = None,
    q1: End = None,
    format: Annotated[Format, Query(description="Of values and rest; indices are json lists or int32")] = "json",
) -> Response:
    """For each query row in [q0, q1): its k largest weights, their key positions, and `rest`,
    the mass the k leave over (1 - their sum). A whole long head, cheaply."""
    return await answered_while_connected(request, tiles.topk(run_id, layer, head, k, q0, q1, format, wire_of(request), client_of(request)))


@router.get("/runs/{run_id}/overview", response_model=OverviewResponse, responses={200: arrays_content(OverviewResponse), **errors(404, 413, 429, 503, 504)})
async def run_overview(
    run_id: str,
    tiles: TilesDep,
    request: Request,
    format: Annotated[Format, Query()] = "u8",
) -> Response:
    """Every head's thumbnail, (layers, heads, rows, cols), max-pooled over the whole run: made
    during a long run's forward, and on first use for a short one."""
    return await answered_while_connected(request, tiles.overview(run_id, format, wire_of(request), client_of(request)))
