"""The FastAPI app: `create_app(settings)` wires settings, services, routers and middleware."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.gzip import DEFAULT_EXCLUDED_CONTENT_TYPES

from manyeyes.app.clients import ClientIdentity, KeyRing, TrustedProxies, configured_keys
from manyeyes.app.config import Settings
from manyeyes.app.deps import known_query, utf8_json, utf8_url
from manyeyes.app.memory import QuietTrim, freeze_long_lived, prepare_serving_process
from manyeyes.app.middleware import (
    AccessLog, AllowedHosts, BodyLimit, Gzip, HeadAsGet, JsonCors, Ranges, SecurityHeaders, ShutdownAnswer, error_response,
)
from manyeyes.app.routes import aggregates, attention, docs, experiments, export, generate, measures, models, ops, page, runs, views
from manyeyes.app.services.attention import COMPACT_MEDIA_TYPE, AttentionService
from manyeyes.app.services.tiles import TileService
from manyeyes.app.services.cache import RunCache
from manyeyes.app.services.measures import CAPTURE_SHARE, MeasuresService
from manyeyes.app.services.errors import ApiError, brief
from manyeyes.app.services.experiments import ExperimentService
from manyeyes.app.services.generation import GenerationService, ShutdownClock
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.registry import Registry
from manyeyes.app.services.views import SaveSlots, ViewStore
from manyeyes.app.services.wire import FRAME_MEDIA_TYPE
from manyeyes.app.shared_runs import SharedRuns

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
log = logging.getLogger("manyeyes")

HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 415: "unsupported_media_type"}


# Errors of one request told; the rest counted. 4,096 wrong layers answered a 200 KB message.
ERRORS_TOLD = 10


def describe_validation(exc: RequestValidationError) -> str:
    errors = exc.errors()
    parts = []
    for err in errors[:ERRORS_TOLD]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    if len(errors) > ERRORS_TOLD:
        parts.append(f"and {len(errors) - ERRORS_TOLD:,} more")
    return "; ".join(parts) or "invalid request"


def compressed(request: Request) -> Response | None:
    """The 415 for a body sent with a Content-Encoding, which is read as sent: gzip read as JSON
    was "not valid JSON (at character 0)" or "'utf-8' codec can't decode byte 0x8b", which hid
    what to change."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    return error_response(
        415, "unsupported_media_type",
        f"request bodies are read as sent: send it uncompressed, without Content-Encoding {brief(encoding, 40)!r}",
    )


def documented_openapi(build, keyed: bool, metrics_closed: bool):
    """The schema FastAPI builds, with what it does not say:
    - the examples as written: it drops every null from them, and FlowResponse's residual edge
      ("head": null) then failed its own schema;
    - on a server with API keys, a bearer scheme on every route that needs a key, so that /docs
      asks for one ("Authorize") and a client generated from the schema sends it;
    - /metrics's 401 where MANYEYES_CLOSE_METRICS closes it (its key too, on a server with keys)."""
    from pydantic import BaseModel

    from manyeyes.app import schemas

    done = []

    def schema() -> dict:
        document = build()  # built once: FastAPI keeps it, and the changes below with it
        if done:
            return document
        done.append(True)
        components = document.setdefault("components", {})
        for name, model in vars(schemas).items():
            extra = model.model_config.get("json_schema_extra") if isinstance(model, type) and issubclass(model, BaseModel) else None
            if isinstance(extra, dict) and "examples" in extra and name in components.get("schemas", {}):
                components["schemas"][name]["examples"] = extra["examples"]
        metrics = document["paths"]["/metrics"]["get"]
        if metrics_closed:
            metrics["responses"]["401"] = {"description": "MANYEYES_CLOSE_METRICS is set and the request has no valid API key"}
        if keyed:
            components.setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer", "description": "One of MANYEYES_API_KEYS"}
            for path, operations in document["paths"].items():
                if path.startswith("/api/") or path == "/export":
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
            if metrics_closed:
                metrics["security"] = [{"bearer": []}]
        return document

    return schema


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, exc.message, exc.headers, exc.fields)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        broken = next((e for e in exc.errors() if e.get("type") == "json_invalid"), None)
        if broken is not None and (refused := compressed(request)):
            return refused
        if broken is not None:  # a body that does not parse is a 400, as invalid bytes are
            where = broken.get("loc", ())[-1]
            reason = (broken.get("ctx") or {}).get("error", "JSON decode error")
            return error_response(400, "bad_request", f"the body is not valid JSON: {reason} (at character {where})")
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if not (media == "application/json" or media.endswith("+json")) and any(
            tuple(e.get("loc", ())) == ("body",) for e in exc.errors()
        ):
            # curl -d sends a form: pydantic's "a valid dictionary" did not say what to change.
            said = f"was {brief(media, 40)!r}" if media else "was missing"
            return error_response(
                415, "unsupported_media_type",
                f"the body must be JSON, sent with Content-Type: application/json (this request's Content-Type {said})",
            )
        if any(tuple(e.get("loc", ())) == ("body",) and e.get("type") == "missing" for e in exc.errors()):
            # No body at all is no JSON either (README: a body that does not parse is a 400); pydantic's
            # "Field required" named no field.
            return error_response(400, "bad_request", "the body is empty: send a JSON object, e.g. {\"text\": \"...\"}")
        return error_response(422, "invalid_request", describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}"
        elif exc.status_code == 400 and exc.__cause__ is not None and (refused := compressed(request)):
            return refused
        elif exc.status_code == 400 and exc.__cause__ is not None:
            # FastAPI's "There was an error parsing the body" says nothing of why (a 5,000-digit
            # number, JSON nested past Python's recursion limit); the exception it wraps does.
            message = f"{message}: {brief(parse_failure(exc.__cause__), 200)}"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405 and headers:
            # HeadAsGet answers HEAD wherever GET is answered: the router's Allow named GET alone.
            allowed = headers.get("Allow", "").split(", ")
            if "GET" in allowed and "HEAD" not in allowed:
                headers = {**headers, "Allow": ", ".join([*allowed, "HEAD"])}
        return error_response(exc.status_code, code, message, headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal server error; the server log has the details")


class RevalidatedFiles(StaticFiles):
    """The page's modules and styles, asked again at every load and answered 304 while unchanged.
    With no Cache-Control, a browser keeps a file with a Last-Modified fresh for a tenth of its age
    unasked: after an upgrade a page could run the new main.js with last month's modules."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def parse_failure(cause: BaseException) -> str:
    """Why a body did not parse, in the client's terms rather than the parser's."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start}): send JSON encoded as UTF-8"
    if isinstance(cause, RecursionError):
        return "the JSON is nested too deeply to read"
    # Python's advice to whoever runs it ("use sys.set_int_max_str_digits()") is not the client's.
    return str(cause).removesuffix("; use sys.set_int_max_str_digits() to increase the limit") or type(cause).__name__


def create_app(settings: Settings | None = None, run_directory=None, forward_link=None,
               keys: KeyRing | None = None) -> FastAPI:
    """The app. `run_directory` is given where several copies of it serve together (workers,
    Ray replicas): each records there the request behind every run it computes (shared_runs.py).
    `forward_link`: where workers' shared forward process listens (services/shared_forward.py).
    `keys`: the keys as `manyeyes serve` read them at its start; else read from `settings` here."""
    settings = settings or Settings()
    metrics = Metrics(budget_s=settings.request_timeout_s)  # the budget is a latency bucket bound
    if keys is None:
        keys = configured_keys(settings.api_keys, settings.api_keys_file)  # a bad key file fails here, at start-up
    # Started by the server when a shutdown begins (server.Server), so that a generation stream
    # ends itself within the grace period rather than being cut off at its end.
    shutdown = ShutdownClock()
    quiet_trim = QuietTrim()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        prepare_serving_process(settings)
        registry = Registry(settings, metrics, forward_link)
        # The captures' LRU (MeasuresService) takes its share out of the same budget, so that
        # cache_bytes bounds all cached runs, as SECURITY.md's memory bound counts them.
        run_bytes = settings.cache_bytes - settings.cache_bytes // CAPTURE_SHARE
        cache = RunCache(run_bytes, on_size=metrics.cache_bytes.set)
        app.state.registry = registry
        app.state.service = AttentionService(settings, registry, cache, metrics, run_directory)
        app.state.tiles = TileService(app.state.service)
        app.state.generation = GenerationService(settings, registry, metrics, shutdown)
        app.state.measures = MeasuresService(app.state.service)
        app.state.experiments = ExperimentService(settings, registry, app.state.service)
        # Loading runs beside the server so /healthz answers and /readyz says 503 meanwhile.
        loader = threading.Thread(target=registry.load_all, args=(freeze_long_lived if settings.gc_freeze else None,),
                                  name="manyeyes-load", daemon=True)
        loader.start()
        app.state.quiet_trim = quiet_trim
        trimming = asyncio.create_task(quiet_trim.run(), name="manyeyes-quiet-trim")
        try:
            yield
        finally:
            trimming.cancel()
            # uvicorn has already let requests finish for up to shutdown_grace_s; whatever still
            # runs (a load, an abandoned forward) is on daemon threads: waiting would only
            # stretch the exit past the grace period.
            # One budget for both waits, out of the second the grace keeps for the exit.
            deadline = time.monotonic() + 0.25
            loader.join(timeout=0.25)
            registry.close(timeout_s=max(deadline - time.monotonic(), 0.0))

    app = FastAPI(
        title="manyeyes",
        version="1",
        summary="Attention weights of every layer and head, fast: compact payloads, slices of cached runs, micro-batching.",
        lifespan=lifespan,
        # /docs is served by app.routes.docs from local assets; ReDoc would need a CDN.
        docs_url=None,
        redoc_url=None,
        # "/api/v1/attention/" was a bare 307 to an address built from the Host header, which a
        # POST through httpx or requests never follows; it is a 404 JSON error like any unknown path.
        redirect_slashes=False,
        telemetry={"tracing": settings.opentelemetry, "metrics": settings.opentelemetry, "logs": settings.opentelemetry},
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.shutdown = shutdown
    app.state.keys = keys
    # Here, not on first use: the routes' dependencies run on the thread pool, where two first
    # requests at once built two stores, and a view saved into the one dropped opened nowhere.
    # Not in the lifespan, which would replace the shared store workers.py and scale.py put here.
    app.state.views = ViewStore()
    app.state.view_saves = SaveSlots()
    app.openapi = documented_openapi(app.openapi, bool(keys), settings.close_metrics)
    add_error_handlers(app)
    # The hot route first: routing tries the routers in this order.
    for module in (attention, models, generate, runs, aggregates, views, ops, page, docs, export, measures, experiments):
        # Routes outside /api check their own (/export its query, as the API does: routes/export.py).
        api = module.router.prefix.startswith("/api/")
        app.include_router(module.router, dependencies=[Depends(utf8_url), Depends(known_query), Depends(utf8_json)] if api else None)
    if STATIC_DIR.is_dir() and not any(getattr(r, "path", None) == "/static" for r in app.routes):
        app.mount("/static", RevalidatedFiles(directory=STATIC_DIR), name="static")

    # Added innermost first: AccessLog sees everything, BodyLimit refuses before parsing.
    app.add_middleware(
        Gzip,
        # The routes that choose zstd or gzip themselves (README "Compression"): the attention
        # routes, and a run's slices, mean and long-run routes; its info is gzipped as other JSON is.
        encodes_itself=[route.path for module in (attention, runs, aggregates) for route in module.router.routes
                        if route.endpoint is not runs.run_info],
        minimum_size=settings.gzip_min_bytes,
        compresslevel=settings.gzip_level,
        exclude_content_types=(*DEFAULT_EXCLUDED_CONTENT_TYPES, COMPACT_MEDIA_TYPE, FRAME_MEDIA_TYPE),
    )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.request_read_timeout_s)
    if run_directory is not None:  # copies share runs: a run another copy computed is computed here when asked for
        app.add_middleware(SharedRuns, directory=run_directory)
    # Outside BodyLimit: a request without a valid key is refused before its body is read.
    proxies = TrustedProxies(settings.trusted_proxies)
    app.add_middleware(
        ClientIdentity, keys=keys, proxies=proxies, close_metrics=settings.close_metrics,
        compress_loopback=settings.compress_loopback,
    )
    if settings.cors_origins:  # off by default: only the page this server serves may call the API
        app.add_middleware(
            JsonCors, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
            allow_headers=["Content-Type", "Authorization"], expose_headers=["Retry-After"], max_age=600,
        )
    # Outside the keys and CORS: a request addressed to a name not listed gets nothing else, whatever
    # its key or origin. None (create_app called without `manyeyes serve`'s default) checks no name.
    if settings.allowed_hosts and "*" not in settings.allowed_hosts:
        app.add_middleware(AllowedHosts, hosts=settings.allowed_hosts)
    # Inside AccessLog, which logs the method as sent and the bytes as sent (none for HEAD).
    app.add_middleware(HeadAsGet)
    app.add_middleware(Ranges)
    # Inside AccessLog, so the 503s it writes at shutdown are logged and counted.
    app.add_middleware(ShutdownAnswer)
    app.add_middleware(AccessLog, metrics=metrics, identify=proxies.address_id, quiet=quiet_trim)
    # Outermost, so every answer carries the headers, the 413s BodyLimit writes included.
    app.add_middleware(SecurityHeaders)
    return app
