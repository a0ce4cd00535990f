"""POST /api/v1/generate: step through generation, streamed as JSON lines."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from manyeyes.app.clients import client_of
from manyeyes.app.deps import GenerationDep
from manyeyes.app.routes.responses import errors
from manyeyes.app.schemas import GenerateEnd, GenerateRequest, GenerateStart, GenerateStep

router = APIRouter(prefix="/api/v1", tags=["generation"])

NDJSON = "application/x-ndjson"


class ClosingStream(StreamingResponse):
    """A streamed answer that closes its body however the sending ended: Starlette abandons the
    body iterator of a client that hung up, and a generation's slot is freed only when it closes."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def inline_schema(model) -> dict:
    """A model's JSON schema with its $defs substituted in place: a response's own schema has no
    document-level $defs for a $ref to point at."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


@router.post(
    "/generate",
    responses={
        200: {
            "description": "One JSON object per line: a `start`, one `step` per new token as soon as it is made, "
            "then an `end`: reason `length` after max_new_tokens steps, `eos` after a step whose token ends the text "
            "(unless stop_at_eos is false). Hang up to stop: the server stops within one step.",
            "content": {
                NDJSON: {
                    "schema": {"oneOf": [inline_schema(m) for m in (GenerateStart, GenerateStep, GenerateEnd)]},
                    "example": '{"type":"start","model":"tiny-gpt","n_layers":2,"n_heads":8,"prompt":[...]}\n'
                    '{"type":"step","index":0,"position":16,"token":{"id":32,"text":" ","prob":0.91},"alternatives":[...],"attention":[[[...]]]}\n'
                    '{"type":"end","reason":"length","tokens":20}\n',
                }
            },
        },
        **errors(404, 413, 415, 429, 503),
    },
)
async def generate(body: GenerateRequest, service: GenerationDep, request: Request) -> ClosingStream:
    """Generate up to `max_new_tokens` tokens (greedy, or sampled with a temperature, top-k and seed),
    each with its probability, the alternatives and its attention row in every head; it stops after
    the model's end-of-text token (`stop_at_eos`, true by default)."""
    stream = await service.start(body, client_of(request))
    # No buffering proxies: each line should reach the client as it is made.
    return ClosingStream(stream, media_type=NDJSON, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
