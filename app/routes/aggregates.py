"""GET /api/v1/runs/{run_id}/mean: the mean over heads of a cached run, computed in float32.

The page's "mean of a layer" and "mean of all heads" used to average 8-bit weights in the browser;
at T≈500 most cells round to 0 there and rows lost up to 18% of their mass. The server holds the
float32 run (for a run quantised on the device, its measures' captured forward does), so it
averages once and sends a single T×T matrix (f16: 0.5 MB at T=512)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from manyeyes.app.clients import client_of
from manyeyes.app.deps import MeasuresDep, ServiceDep
from manyeyes.app.routes.attention import wire_of
from manyeyes.app.routes.responses import answer_content, errors
from manyeyes.app.routes.runs import answered_while_connected
from manyeyes.app.schemas import AttentionResponse, Format
from manyeyes.app.services.attention import AttentionService, Reply, answer_bytes, negotiated, parse_index_list, resolve_indices
from manyeyes.app.services.cache import Run
from manyeyes.app.services.measures import float_weights, replied
from manyeyes.app.services.payload import View, render_frame, render_result

router = APIRouter(prefix="/api/v1", tags=["runs"])
MEAN_ROUTE = "GET /api/v1/runs/{run_id}/mean (tile?head=mean serves any run)"


def planned(service: AttentionService, run_id: str, layers: list[str] | None, fmt: str, frame: bool) -> tuple[list[int], int]:
    """(the layers averaged, the answer's bytes) of a request checked against its run, which it does
    not return: the awaiting route never holds the run (MeasuresService.in_turn)."""
    run = service.cached(run_id, MEAN_ROUTE)
    info = service.registry.get(run.model).model.info
    chosen = resolve_indices(parse_index_list(layers, "layer"), info.n_layers, "layer", info.id)
    # The answer's bytes: json at T=1,024 is 15 MB, held until its reader takes it.
    return chosen, answer_bytes(run.n_tokens**2, fmt, frame, run.tokens)


@router.get("/runs/{run_id}/mean", response_model=AttentionResponse,
            responses={200: answer_content(AttentionResponse), **errors(404, 429, 503, 504)})
async def run_mean(
    run_id: str,
    service: ServiceDep,
    measures: MeasuresDep,
    request: Request,
    layers: Annotated[list[str] | None, Query(description="Comma-separated layers to average over; default all")] = None,
    format: Annotated[Format, Query()] = "f16",
) -> Response:
    """Shape [1, 1, T, T]: the mean over every head of the chosen layers (the reply's
    n_layers, n_heads, layers and heads describe that one matrix; `mean_of` names the model's
    layers and heads it averages). A 404 means the run was evicted: POST the text again. It waits
    for a render slot as a tile does: 429 beyond the same bounds, and a run evicted while it
    waited answers 404."""
    wire = wire_of(request)
    chosen, nbytes = planned(service, run_id, layers, format, wire.frame)
    started = time.perf_counter()

    def render(run: Run, served, captured) -> tuple[list[bytes], str | None]:
        info = served.model.info
        weights = float_weights(run, captured)[chosen]  # (len(chosen), n_heads, T, T) float32
        mean = weights.mean(dim=(0, 1), keepdim=True)  # (1, 1, T, T)
        averaged = Run(run.run_id, run.model, run.tokens, run.truncated, mean)
        timing = {"tokenize": 0.0, "queue": 0.0, "forward": time.perf_counter() - started}
        # Its layers and heads say [0], the one matrix's indices: mean_of says what it averages.
        view, mean_of = View([0], [0], format), {"layers": chosen, "heads": list(range(info.n_heads))}
        if wire.frame:
            pieces = render_frame([(averaged, timing, None)], info, view, False, mean_of)
        else:
            pieces = render_result(averaged, info, view, timing, mean_of=mean_of)
        return service.compression.encode(wire.accept_encoding, pieces, not wire.frame and format == "json")

    async def averaged() -> Reply:
        # A render slot for the T×T float32 mean, like an answer's encoding.
        (pieces, encoding), grant = await measures.in_turn(run_id, nbytes, client_of(request), False, render,
                                                           needs_weights=MEAN_ROUTE)
        media_type, headers = negotiated(wire, format, encoding)
        reply = replied(pieces, {"run_id": run_id, "mean_of_layers": len(chosen)}, grant, media_type)
        reply.headers.update(headers)
        return reply

    return await answered_while_connected(request, averaged())
