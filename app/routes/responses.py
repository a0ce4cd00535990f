"""Error responses shared by the API routes, so /docs lists every status a route can give."""

from app.schemas import ErrorResponse

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
