"""GET /api/v1/runs/{run_id}/attention: another slice of a recent run, with no forward pass."""

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from manyeyes.app.deps import ServiceDep
from manyeyes.app.routes.attention import wire_of
from manyeyes.app.routes.responses import ANSWER_CONTENT, PiecesResponse, errors
from manyeyes.app.schemas import AttentionResponse, Format
from manyeyes.app.services.attention import parse_index_list

router = APIRouter(prefix="/api/v1", tags=["runs"])


@router.get("/runs/{run_id}/attention", response_model=AttentionResponse, responses={200: ANSWER_CONTENT, **errors(401, 404, 413, 422, 503)})
async def run_slice(
    run_id: str,
    service: ServiceDep,
    request: Request,
    layers: Annotated[list[str] | None, Query(description="Comma-separated layer indices, e.g. 0,2; default all")] = None,
    heads: Annotated[list[str] | None, Query(description="Comma-separated head indices; default all")] = None,
    format: Annotated[Format, Query()] = "json",
) -> Response:
    """A 404 means the run was evicted (or never existed): POST the text again."""
    reply = await service.slice(run_id, parse_index_list(layers, "layer"), parse_index_list(heads, "head"), format, wire_of(request))
    request.state.log = reply.log
    return PiecesResponse(reply.body, reply.media_type, reply.headers)
