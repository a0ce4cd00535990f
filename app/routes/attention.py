"""POST /api/v1/attention and /api/v1/attention/batch: run texts, return their attention."""

import time

from fastapi import APIRouter, Request, Response

from manyeyes.app.clients import client_of, tenant_of
from manyeyes.app.deps import MeasuresDep, ServiceDep
from manyeyes.app.disconnect import unless_disconnected
from manyeyes.app.routes.lean import LeanRoute
from manyeyes.app.routes.responses import PiecesResponse, answer_content, errors
from manyeyes.app.schemas import AttentionRequest, AttentionResponse, BatchRequest, BatchResponse
from manyeyes.app.services.attention import Wire
from manyeyes.app.services.errors import InvalidInput
from manyeyes.app.services.wire import header_list

router = APIRouter(prefix="/api/v1", tags=["attention"], route_class=LeanRoute)
ERRORS = errors(404, 413, 415, 429, 503, 504)


def wire_of(request: Request) -> Wire:
    return Wire.from_headers(header_list(request.headers, "accept"), header_list(request.headers, "accept-encoding"))


@router.post("/attention", response_model=AttentionResponse, responses={200: answer_content(AttentionResponse), **ERRORS})
async def attention(body: AttentionRequest, service: ServiceDep, measures: MeasuresDep, request: Request) -> Response:
    """Attention weights of every (or the chosen) layer and head for one text.

    Repeating a request is served from the run cache. Large inputs: use `format=u8`, and
    `Accept: application/vnd.manyeyes.frame` for raw bytes instead of base64."""
    started = time.monotonic()
    wire, client = wire_of(request), client_of(request)
    # With measures the answer is JSON text (no frame) that they join, and compressed once they have.
    extra = measures.reckoner(body.model, body.measures, body.layers, body.heads, body.format) if body.measures else None
    work = service.attend([(body.text, body.text_pair)], body, False, started, Wire() if body.measures else wire, client,
                          extra, tenant_of(request))
    reply = await unless_disconnected(request, work)
    request.state.log = reply.log
    if body.measures:

        async def measured():
            joined = await measures.attach(reply.body, reply.runs[0], body.measures, body, client)
            return await service.compress_text(joined, wire.accept_encoding, client)

        try:
            # Seconds of work in a render slot: dropped, as the forward is, when the client hangs up.
            reply.body, encoding = await unless_disconnected(request, measured())
        except BaseException:
            reply.release()
            raise
        if encoding:
            reply.headers["Content-Encoding"] = encoding
    # Returned as bytes: the body is already serialised by orjson, no re-validation of big data.
    return PiecesResponse(reply.body, reply.media_type, reply.headers, reply.hand_over())


@router.post("/attention/batch", response_model=BatchResponse, responses={200: answer_content(BatchResponse), **ERRORS})
async def attention_batch(body: BatchRequest, service: ServiceDep, request: Request) -> Response:
    """Several texts with the same options; they share forward passes."""
    started = time.monotonic()
    limit = service.settings.max_batch_texts
    if len(body.texts) > limit:
        # The limit as a number too: a client splits its texts by it instead of parsing the words.
        raise InvalidInput(f"a batch holds at most {limit} texts, got {len(body.texts)}", fields={"max_batch_texts": limit})
    work = service.attend(body.inputs(), body, True, started, wire_of(request), client_of(request),
                          tenant=tenant_of(request))
    reply = await unless_disconnected(request, work)
    request.state.log = reply.log
    return PiecesResponse(reply.body, reply.media_type, reply.headers, reply.hand_over())
