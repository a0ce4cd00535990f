"""Error responses shared by the API routes, so /docs lists every status a route can give."""

from fastapi import Response

from manyeyes.app.schemas import ErrorResponse


def errors(*statuses: int) -> dict:
    descriptions = {
        404: "Unknown model or run",
        413: "Body over the byte limit, or a json response over the cell budget",
        422: "Invalid input: blank text, bad index or format, text too long without truncate",
        429: "Queue full; see Retry-After",
        503: "Models still loading",
        504: "Over the per-request time budget",
    }
    return {s: {"model": ErrorResponse, "description": descriptions[s]} for s in statuses}


class PiecesResponse(Response):
    """A body sent as the pieces it was built from (a 25 MB base64 string stays one piece):
    one Content-Length, several writes, no join."""

    def __init__(self, pieces: list[bytes], media_type: str) -> None:
        super().__init__(b"", media_type=media_type)
        self.pieces = pieces
        self.headers["content-length"] = str(sum(len(p) for p in pieces))

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if scope.get("method") == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        for i, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(self.pieces) - 1})
