"""Errors the service raises on purpose; each maps to one HTTP status and a stable code."""

from __future__ import annotations


def brief(value, limit: int = 24) -> str:
    """A client's value as an error message may quote it: never 4,000 digits."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit - 4]}..."


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, headers: dict[str, str] | None = None, fields: dict | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.fields = fields or {}  # beside code and message in the body's `error`, for programs to read


class InvalidInput(ApiError):
    status = 422
    code = "invalid_request"


class TooLong(ApiError):
    status = 422
    code = "too_long"

    @classmethod
    def tokens(cls, exc: Exception, label: str = "") -> "TooLong":
        """The model's TooLongError as the API says it, prefixed with which input (a batch's `texts[i]: `)."""
        return cls(label + str(exc))

    @classmethod
    def chars(cls, size: int, limit: int, label: str = "", pair: bool = False) -> "TooLong":
        """A paste over the server's character limit, refused before the tokenizer sees it. The
        limit counts text and text_pair together; a pair's message says so, or a short text looks blamed."""
        what = f"text and text_pair are {size:,} characters long together" if pair else f"text is {size:,} characters long"
        return cls(f"{label}{what}, over this server's limit of {limit:,}")


class ViewTooLarge(ApiError):
    """A saved view larger than the store of views takes (services/views.py)."""

    status = 413
    code = "view_too_large"


class BodyTooLarge(ApiError):
    """A request body over max_body_bytes: app/middleware.py's BodyLimit answers with its status and code."""

    status = 413
    code = "body_too_large"


class TooManyCells(ApiError):
    status = 413
    code = "too_many_cells"

    @classmethod
    def json(cls, cells: int, limit: int, what: str = "values",
             advice: str = "ask for format=u8 or f16, or fewer layers/heads") -> "TooManyCells":
        """An answer in format=json over MANYEYES_MAX_JSON_CELLS, said the same way by every route."""
        return cls(f"format=json would return {cells:,} {what}, over this server's limit of {limit:,}; {advice}")


class NeedsTiles(ApiError):
    """Whole weights asked for an input over dense_max_tokens: its run keeps queries and keys."""

    status = 413
    code = "needs_tiles"


class KeptQK(ApiError):
    """A route that reads whole weights, asked of a run that kept queries and keys."""

    status = 422
    code = "kept_qk"


class RunTooLarge(ApiError):
    """An input whose run the cache could never hold, refused before its forward pass."""

    status = 413
    code = "run_too_large"


class KeptQuantised(ApiError):
    """A slice more precise than the run's weights crossed from the device (u8 or f16)."""

    status = 422
    code = "kept_quantised"


class UnknownModel(ApiError):
    status = 404
    code = "unknown_model"


class UnknownRun(ApiError):
    status = 404
    code = "unknown_run"


class QueueFull(ApiError):
    status = 429
    code = "queue_full"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class OverBudget(ApiError):
    status = 504
    code = "timeout"


# A request cut off by shutdown is best retried against the restarted server or another replica.
SHUTDOWN_RETRY_AFTER_S = 5


class NotReady(ApiError):
    status = 503
    code = "not_ready"

    @classmethod
    def shutting_down(cls) -> "NotReady":
        """As the answers that uvicorn's end of the drain cuts off say it (middleware.ShutdownAnswer):
        with Retry-After, which the work refused at the shutdown's start had none of."""
        return cls("the server is shutting down", {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


def error_body(code: str, message: str, fields: dict | None = None) -> dict:
    return {"error": {"code": code, "message": message, **(fields or {})}}


class ClientClosed(ApiError):
    status = 499  # nginx's "client closed request": nobody reads it, but logs and metrics show it
    code = "client_closed_request"
