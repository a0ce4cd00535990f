"""Error responses shared by the API routes, so /docs lists every status a route can give."""

import weakref

from fastapi import Response

from manyeyes.app.schemas import ErrorResponse
from manyeyes.app.services.attention import COMPACT_MEDIA_TYPE
from manyeyes.app.services.slots import Grant


def errors(*statuses: int) -> dict:
    """The error statuses of an /api route (or /export): the ones named, plus the 400 of bytes that
    are no HTTP or JSON, the 401 of a server with API keys and the 422 of an unknown query
    parameter, which every such route can give."""
    descriptions = {
        400: "The body is missing or not UTF-8 JSON, the query's %-escapes are not UTF-8, or the request is not HTTP/1.1 the server can read",
        401: "An API key is required (Authorization: Bearer <key>) and was missing or wrong",
        404: "Unknown model or run",
        413: "Body over the byte limit, or a json response over the cell budget",
        415: "A JSON body sent without Content-Type: application/json, or compressed",
        422: "Invalid input: blank text, bad index or format, text too long without truncate",
        429: "Queue full, or this client's share of it is; see Retry-After",
        503: "Models still loading",
        504: "Over the per-request time budget",
    }
    # One example per status: /docs otherwise showed the schema's single too_long example for all.
    examples = {
        400: ("bad_request", "the body is not valid JSON: Expecting value (at character 0)"),
        401: ("unauthorized", "this server needs an API key: send Authorization: Bearer <key>"),
        404: ("unknown_run", "run 5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f is unknown or was evicted from the cache; POST /api/v1/attention again"),
        413: ("body_too_large", "request body is over the 1048576-byte limit"),
        415: ("unsupported_media_type", "the body must be JSON, sent with Content-Type: application/json"),
        422: ("too_long", "input is 700 tokens long but the model takes at most 512; shorten it or ask for truncation"),
        429: ("queue_full", "the queue is full; retry after the Retry-After delay"),
        503: ("not_ready", "models are still loading; retry shortly"),
        504: ("timeout", "the request took longer than its 30 s budget"),
    }
    return {
        s: {
            "model": ErrorResponse,
            "description": descriptions[s],
            "content": {"application/json": {"example": {"error": {"code": examples[s][0], "message": examples[s][1]}}}},
        }
        for s in sorted({400, 401, 422, *statuses})
    }


def compact_content(model: type) -> dict:
    """The compact (u8/f16) answers' media type, with the same schema as their JSON."""
    return {COMPACT_MEDIA_TYPE: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


ANSWER_DESCRIPTION = (
    "JSON (application/json for format=json, application/vnd.manyeyes+json for f16/u8), or the binary frame "
    "when Accept ranks it at least as high as JSON. With Accept-Encoding: zstd (json text of 1 KiB or more, "
    "compact answers of 64 KiB or more) or gzip (json text), the body is compressed."
)
FRAME_EXAMPLE = "MEF1 | u32 LE header length | JSON header (attention.offset, attention.nbytes) | raw weights"


# The 200 answer's other forms: application/vnd.manyeyes+json for f16/u8, and with `Accept:
# application/vnd.manyeyes.frame` the same object as a JSON header followed by the raw weights
# (layout in app/services/wire.py and README).
def answer_content(model: type, description: str = ANSWER_DESCRIPTION, frame_example: str | None = FRAME_EXAMPLE) -> dict:
    frame = {"schema": {"type": "string", "format": "binary"}, **({"example": frame_example} if frame_example else {})}
    return {"description": description, "content": {**compact_content(model), "application/vnd.manyeyes.frame": frame}}


JOIN_BELOW_BYTES = 256 * 1024


class PiecesResponse(Response):
    """A body sent as the pieces it was built from (a 25 MB base64 string stays one piece):
    one Content-Length, several writes, no join, unless the answer is small."""

    def __init__(self, pieces: list[bytes], media_type: str, headers: dict | None = None, grant: Grant | None = None) -> None:
        super().__init__(b"", media_type=media_type, headers=headers)
        size = sum(len(p) for p in pieces)
        # Small answers go in one write: each piece is a trip through every middleware's send
        # and a socket write of its own, which costs more than copying a few hundred KB.
        self.pieces = [b"".join(pieces)] if size <= JOIN_BELOW_BYTES and len(pieces) > 1 else pieces
        self.headers["content-length"] = str(size)
        # The answer's bytes in the service's budget go back once it is sent (or its client hung
        # up), and in any case once this response, which holds them, is freed unsent.
        self.grant = grant
        if grant is not None:
            weakref.finalize(self, grant.release)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for i, piece in enumerate(self.pieces):
                await send({"type": "http.response.body", "body": piece, "more_body": i < len(self.pieces) - 1})
        finally:
            self.pieces = []
            if self.grant is not None:
                self.grant.release()
