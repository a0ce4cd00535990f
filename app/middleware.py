"""Pure ASGI middleware: the request body limit, one log line plus metrics per request, the
answer to requests cut off by shutdown, HEAD as GET, and the security headers."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Iterable

import orjson
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware, IdentityResponder
from starlette.responses import Response
from starlette.routing import Route, compile_path

from manyeyes.app.memory import QuietTrim
from manyeyes.app.services.errors import SHUTDOWN_RETRY_AFTER_S, BodyTooLarge, ClientClosed, NotReady, brief, error_body
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.wire import coding_q, header_list

access_log = logging.getLogger("manyeyes.access")

# The scope extension through which the server's protocol (app/server.py, Delivery) says whether an
# answer left the server whole; absent under other servers, where every answer counts as whole.
DELIVERY = "manyeyes.delivery"


# Where an error answer's code is kept for the access log: scope["state"][ERROR_CODE].
ERROR_CODE = "error_code"


class ErrorResponse(Response):
    """error_response's answer, which leaves its code where AccessLog finds it (scope["state"]):
    the log line of a 429 then says queue_full, client_share or work, which its status alone did not."""

    def __init__(self, code: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.code = code

    async def __call__(self, scope, receive, send) -> None:
        scope.setdefault("state", {})[ERROR_CODE] = self.code
        await super().__call__(scope, receive, send)


def error_response(status: int, code: str, message: str, headers: dict | None = None, fields: dict | None = None) -> Response:
    """The JSON error every refusal gives, as a Response (send_error writes the same to an ASGI send)."""
    return ErrorResponse(code, orjson.dumps(error_body(code, message, fields)), status_code=status, media_type="application/json",
                         headers=headers)


async def send_error(send, status: int, code: str, message: str, headers: list | None = None) -> None:
    body = orjson.dumps(error_body(code, message))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuses bodies over `max_bytes` with 413 before any of it is parsed: by Content-Length when
    given, else while reading; and bodies not whole within `read_timeout_s` of the head with 408
    (a client that sent half a body and stopped held its connection and handler for ever). The
    body is buffered (the routes need it whole anyway) and replayed."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        # No route of these methods reads a body: one sent anyway is never read, and the server's
        # protocol closes the connection after the answer (app/server.py), rather than time it here.
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        message = f"the request body is larger than this server's limit of {self.max_bytes:,} bytes"
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await send_error(send, BodyTooLarge.status, BodyTooLarge.code, message, [(b"connection", b"close")])
                    return
        chunks, size = [], 0
        try:
            # One deadline for the whole body, not each read: a byte every few seconds would
            # otherwise hold the connection and its handler for ever.
            async with asyncio.timeout(self.read_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        # Nobody reads it (uvicorn drops writes to a closed connection), but the
                        # access log and metrics then say what happened, not a 500.
                        await send_error(send, ClientClosed.status, ClientClosed.code, "the client closed the connection mid-body")
                        return
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        await send_error(send, BodyTooLarge.status, BodyTooLarge.code, message, [(b"connection", b"close")])
                        return
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            await send_error(send, 408, "request_timeout",
                             f"the request body was not sent within {self.read_timeout_s:g} s (MANYEYES_REQUEST_READ_TIMEOUT_S)",
                             [(b"connection", b"close")])
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# host [":" port] (RFC 9110, 7.2): a name or IPv4 address, or an IPv6 address in brackets.
HOST_AND_PORT = re.compile(r"(\[[0-9a-f:.]+\]|[^\[\]@:/\\?#\s]*)(?::[0-9]*)?")


def host_name(value: str) -> str:
    """A Host header's (or an allowed host's) name, as compared: lower case, without its port or a
    trailing dot, an IPv6 address in brackets; "" for a value that is no host and port (such as
    `[::1]evil.example` or `localhost:80@evil.example`, which read as loopback names)."""
    value = value.strip().lower()
    if value.count(":") > 1 and not value.startswith("["):  # an IPv6 address, as MANYEYES_ALLOWED_HOSTS may give it
        return f"[{value}]"
    parsed = HOST_AND_PORT.fullmatch(value)
    return parsed[1].rstrip(".") if parsed else ""


# This machine's own names, as a local client (a health check, a Prometheus scrape) addresses it.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class AllowedHosts:
    """Refuses requests addressed (Host header) to a name not in `hosts` with 421: on loopback a
    web page that points its own name at 127.0.0.1 (DNS rebinding) is, to the browser, the page's
    own origin, and could use a keyless local server. /healthz, which says only "ok", stays open
    to every name, so that a probe of any kind reaches it.

    LOOPBACK_HOSTS are answered whatever `hosts` lists: a rebinding page's requests carry its own
    name, never a loopback literal, and a server listing only its public name answered the
    Dockerfile's HEALTHCHECK (127.0.0.1/readyz) and a local scrape of /metrics 421."""

    OPEN = frozenset({"/healthz"})

    def __init__(self, app, hosts: list[str]) -> None:
        self.app = app
        names = {host_name(h) for h in (*hosts, *LOOPBACK_HOSTS)}
        self.names = frozenset(n for n in names if not n.startswith("*."))
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # ".example.org"
        self.listed = ", ".join(hosts)

    def allowed(self, host: str) -> bool:
        name = host_name(host)
        return "*" in self.names or name in self.names or (bool(self.suffixes) and name.endswith(self.suffixes))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            await self.app(scope, receive, send)
            return
        hosts = [value.decode("latin-1") for name, value in scope["headers"] if name == b"host"]
        if len(hosts) > 1:
            # Only the first was checked, and a proxy or the app may read another (RFC 9112: a 400).
            await send_error(send, 400, "bad_host", f"this request has {len(hosts)} Host headers: send one")
            return
        if not hosts:
            # The client's fault, which no setting mends (RFC 9112, 3.2: a 400): it was told to add
            # "the name you reach it by" to MANYEYES_ALLOWED_HOSTS.
            await send_error(send, 400, "bad_host", "this request has no Host header: send one naming this server as you "
                                                    f"reach it (one of {self.listed}, any port)")
            return
        if self.allowed(hosts[0]):
            await self.app(scope, receive, send)
            return
        await send_error(send, 421, "host_not_allowed",
                         f"this server answers requests addressed to {self.listed} (MANYEYES_ALLOWED_HOSTS), and this "
                         f"one came to {brief(hosts[0], 100)!r}: add the name you reach it by to MANYEYES_ALLOWED_HOSTS")


class CutOff:
    """Answers ShutdownAnswer closed unfinished, each said in its own warning: uvicorn's ERROR line
    that follows each ("ASGI callable returned without completing response") is then dropped
    (server.DrainRanOut), one per answer said. Event loop only."""

    def __init__(self) -> None:
        self.unsaid = 0

    def said(self) -> None:
        self.unsaid += 1

    def take(self) -> bool:
        """Whether an answer's cut-off was said already (and so uvicorn's line for it goes)."""
        if self.unsaid == 0:
            return False
        self.unsaid -= 1
        return True


CUT_OFF = CutOff()


class ShutdownAnswer:
    """Past the shutdown grace period uvicorn cancels the requests still running, and would answer
    those that had not begun their response with a plain-text 500 (logging a traceback). The only
    thing that cancels a whole request's task is that shutdown, so this answers them as what it
    is: 503 JSON with Retry-After, and the connection closed."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        # The request runs as its own task: work awaited on a worker thread (an experiment, a
        # measure) is shielded from cancellation until the thread ends, so the 503 waited for it,
        # and the process exited first, leaving the client a dropped connection.
        task = asyncio.ensure_future(self.app(scope, receive, watch))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()  # it unwinds when its thread returns; nothing waits for that
            if started:
                # Half an answer cannot be replaced (a stream its client read slower than it was
                # made, its end line still in the socket's buffers): uvicorn closes the
                # connection. Said in one line, where re-raising logged a traceback per request.
                logging.getLogger("manyeyes.server").warning(
                    "the shutdown grace ran out while %s %s was still sending its answer (its client reads slower "
                    "than it was made): the connection is closed unfinished", scope.get("method"), scope.get("path"))
                CUT_OFF.said()
                return
            # The task ends here, answered; uvicorn has stopped waiting for it and exits.
            await send_error(
                send, 503, NotReady.code, "the server shut down before this request finished; retry shortly",
                [(b"retry-after", str(SHUTDOWN_RETRY_AFTER_S).encode()), (b"connection", b"close")],
            )


class HeadAsGet:
    """Answers HEAD as the same GET without its body (RFC 9110, 9.3.2). FastAPI's GET routes
    answered HEAD with 405, so `curl -I` and health checks that send HEAD took the page, /healthz
    and the API for broken."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        # A copy: the server reads the method from its own scope, and sends no body for HEAD.
        as_get = {**scope, "method": "GET"}
        try:
            await self.app(as_get, receive, without_body)
        finally:
            if "route" in as_get:  # for AccessLog's label
                scope["route"] = as_get["route"]


# The methods counted under their own name in the metrics, where the route serves them; any other
# is counted as "other". The label took the method as sent: httptools parses some 35 (PROPFIND,
# MKCOL, ...), and one client without a key took /metrics from 60 series to 17,019 (1.76 MB a
# scrape) in seconds; the standard ones alone on every route, answered 405 or 401,
# still made 4,573.
STANDARD_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
# The longest path (and method) a log line holds; a longer one is cut there, marked "...", and its
# length given as path_length: 2,000 GETs of 60 KB paths had written 120 MB of log in 31 s.
LOGGED_PATH_CHARS = 512
LOGGED_METHOD_CHARS = 32
# An incoming X-Request-ID is used as sent when it is 1 to 64 of these characters; else one is made.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
# A refusal's path longer than this is not matched against the routes (its label stays "other").
MATCHED_PATH_CHARS = 2048
# An error answer's body read for its code (when the app left none in scope["state"]): at most this.
SNIFFED_ERROR_BYTES = 16384


def logged_request(method: str | None, path: str | None) -> dict:
    """A request's method and path as a log line holds them (None: not read), each cut to its
    bound, a cut path's full length beside it. AccessLog's lines and the server's refusals'."""
    fields = {"method": brief(method, LOGGED_METHOD_CHARS) if method is not None else None,
              "path": brief(path, LOGGED_PATH_CHARS) if path is not None else None}
    if path is not None and len(path) > LOGGED_PATH_CHARS:
        fields["path_length"] = len(path)
    return fields


def counted_method(method: str | None, served: frozenset[str] | None = None) -> str:
    """The method as the metrics count it: one of the standard seven, where the route serves it
    (`served`: its methods; None where unknown), else "other"."""
    if method not in STANDARD_METHODS or (served is not None and method not in served):
        return "other"
    return method


def request_id_of(headers) -> str:
    """The request's X-Request-ID when it is a usable one, else a new one (16 hex digits)."""
    for name, value in headers:
        if name == b"x-request-id":
            sent = value.decode("latin-1").strip()
            if REQUEST_ID.fullmatch(sent):
                return sent
            break
    return os.urandom(8).hex()


def error_code_in(body: bytes) -> str | None:
    """The code of a JSON error body ({"error": {"code": ...}}), or None."""
    if len(body) > SNIFFED_ERROR_BYTES or not body.startswith(b'{"error"'):
        return None
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return brief(code, 64) if isinstance(code, str) else None


def routed_path(scope) -> str:
    """The path the routes match: without the root_path the app is served under."""
    path = scope["path"]
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def route_templates(routes) -> list[Route]:
    """The app's routes (FastAPI's included routers opened up), whose templates label the metrics.
    Mounts (the static files) are left out: they are "other"."""
    found = []
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's wrapper of an included router
        if inner is not None:
            if not getattr(getattr(route, "include_context", None), "prefix", ""):  # else its routes' paths lack it
                found.extend(route_templates(inner.routes))
        elif isinstance(route, Route):
            found.append(route)
    return found


class AccessLog:
    """Counts and times every request (from its start to its answer's last byte handed to the server)
    by route template (not raw path, which clients control) and method (those of the standard seven
    that the route serves, HEAD where it serves GET; any other is "other"), and writes one JSON log line with whatever the route put in scope["state"]["log"].

    A request refused before routing (a 401 for its key, BodyLimit's 413) is counted under the
    template of the route its path and method match, found by the routes' own patterns without
    running them; one that matches none (a 404, a static file) is "other".

    Each request has an id: its X-Request-ID when that is 1 to 64 letters, digits or ``._:-``, else
    a new one; the answer carries it as X-Request-ID, and the log line as request_id. An error
    answer's line carries its code: error_response leaves it in scope["state"], and an answer
    written straight to the ASGI send (send_error, /readyz's) has it read from its JSON body.

    The line says whether the answer left the server whole ("complete"): one the client stopped
    taking (the write deadline dropped it) or cut off by closing or resetting the connection is
    not, and counts in the metrics under status 499, as a client gone before its answer does.
    An answer the transport still holds part of when the handler ends (a large one, to a client
    slower than the server) is logged once that part is out, or the connection lost.

    "client" is who asked, as fair shares count clients (app/clients.py, ClientIdentity): a key's
    id, else the address. `identify` names the client of a request refused before ClientIdentity
    saw it."""

    def __init__(self, app, metrics: Metrics, identify=lambda scope: "", quiet: QuietTrim | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.identify = identify
        self.quiet = quiet or QuietTrim()  # told of each request's start and end (app/memory.py)
        self.templates: list[Route] | None = None  # the app's routes, gathered at the first request
        self.served: dict[str, frozenset[str]] = {}  # template -> the methods its routes serve

    def gather(self, scope) -> None:
        self.templates = route_templates(getattr(getattr(scope.get("app"), "router", None), "routes", ()))
        if not self.templates:  # route_templates reads FastAPI's included routers, which a new FastAPI may change
            logging.getLogger("manyeyes.server").warning(
                "no route templates found: every request refused before routing is labelled route=\"other\"")
        served: dict[str, set[str]] = {}
        for route in self.templates:
            methods = served.setdefault(route.path, set())
            methods.update(route.methods or STANDARD_METHODS)
            if "GET" in methods:
                methods.add("HEAD")  # HeadAsGet
        self.served = {path: frozenset(methods) for path, methods in served.items()}

    def addressed(self, scope) -> str | None:
        """The template of the route a request refused before routing was addressed to: the first
        whose pattern and method match, else the first whose pattern does (a 405 had it been routed)."""
        path = routed_path(scope)
        if len(path) > MATCHED_PATH_CHARS:
            return None
        method = scope["method"]
        other = None
        for route in self.templates:
            if route.path_regex.match(path):
                if not route.methods or method in route.methods:
                    return route.path
                other = other or route.path
        return other

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        if self.templates is None:
            self.gather(scope)
        status = None
        sent = 0
        last_byte_out = None
        delivery = scope.get("extensions", {}).get(DELIVERY)
        ticket = 0
        # Made here, not by the middleware inside: a copy of the scope made on the way in (HeadAsGet,
        # Ranges) shares this dict, so what ClientIdentity and the routes record in it is seen here.
        state = scope.setdefault("state", {})
        request_id = state["request_id"] = request_id_of(scope["headers"])
        sniff = False  # whether the next body message is an error's JSON, to read its code from

        async def watch(message):
            nonlocal status, sent, last_byte_out, ticket, sniff
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if status >= 400 and ERROR_CODE not in state:
                    sniff = any(name.lower() == b"content-type" and value.startswith(b"application/json")
                                for name, value in headers) and not any(name.lower() == b"content-encoding" for name, _ in headers)
                message["headers"] = [*headers, (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                sent += len(body)
                if sniff:
                    sniff = False
                    if not message.get("more_body", False) and (code := error_code_in(body)):
                        state[ERROR_CODE] = code
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                last_byte_out = time.perf_counter()
                if delivery is not None:
                    ticket = delivery.ticket()

        self.quiet.began()
        try:
            await self.app(scope, receive, watch)
        finally:
            self.quiet.ended()
            # What the client waited for ends at the answer's last byte; the tasks and middleware
            # that wind down after it (0.2 ms at T=16) are not part of it.
            elapsed = (last_byte_out or time.perf_counter()) - started
            route = getattr(scope.get("route"), "path", None)
            if route is None and (status or 500) >= 400:  # refused before routing, or no such route
                route = self.addressed(scope)
            path = scope["path"]
            line = {
                **logged_request(scope["method"], path),
                "route": route or "other",  # docs, static files, 404s: not worth a label each
                "status": status or 500,  # none sent: the server answers 500
                "ms": round(elapsed * 1000, 2),
                "bytes": sent,
                "client": state.get("client") or self.identify(scope),
                "request_id": request_id,
                **state.get("log", {}),
            }
            if (status or 500) >= 400 and (code := state.get(ERROR_CODE)):
                line["code"] = code
            if delivery is None or status is None:
                self.record(line, elapsed, True, False)
            elif last_byte_out is None:  # the handler stopped mid-answer: the server closes the connection
                self.record(line, elapsed, False, delivery.lost)
            else:
                delivery.settle(ticket, lambda whole: self.record(line, elapsed, whole, not whole))

    def record(self, line: dict, elapsed: float, complete: bool, client_gone: bool) -> None:
        line["complete"] = complete
        route = line["route"]
        # One the route does not serve (a 405, or a 401 before routing) is "other" with the rest.
        method = counted_method(line["method"], self.served.get(route))
        status = "499" if client_gone else str(line["status"])
        self.metrics.requests.labels(route, method, status).inc()
        self.metrics.latency.labels(route, method, status).observe(elapsed)
        access_log.info(orjson.dumps(line).decode())


# Everything the page loads comes from this server: its own scripts (ES modules and the vendored
# plotly.js), styles and API. 'unsafe-inline' is allowed for styles only: plotly.js (through d3)
# writes style attributes and a <style> element while it draws, and styles cannot run code.
# No 'unsafe-eval': the heatmaps plotly draws (SVG/canvas traces) need none.
CSP_SELF = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "font-src 'self'; connect-src 'self'; worker-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# On every response (SECURITY.md): the app's through SecurityHeaders, and app/server.py's answers
# to bytes the HTTP parser refused, which no middleware sees.
SECURITY_HEADERS = (
    (b"content-security-policy", CSP_SELF.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


class SecurityHeaders:
    """Adds the security headers to every response, the API's errors and the static files included."""

    def __init__(self, app) -> None:
        self.app = app
        self.headers = SECURITY_HEADERS

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = self.headers

        async def with_headers(message):
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in extra if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, with_headers)


# One byte range of a Range header: "first-[last]" with first <= last, or a suffix "-length".
# At most 18 digits, which int() reads in any Python and which are past the end of every file
# served here: 5,000 digits were a ValueError (a 500), or Starlette's plain-text 400.
BYTE_RANGE = re.compile(r"(\d{1,18})-(\d{0,18})|-\d{1,18}")


def usable_range(value: str) -> bool:
    """Whether a Range header is a well-formed bytes range set (RFC 9110, 14.1.1)."""
    unit, _, ranges = value.partition("=")
    if unit.strip().lower() != "bytes":
        return False
    for part in ranges.split(","):
        found = BYTE_RANGE.fullmatch(part.strip())
        if found is None or (found[2] and int(found[1]) > int(found[2])):
            return False
    return True


class Ranges:
    """Range requests on the files the server sends (Starlette's FileResponse: the page, its
    scripts, plotly.js, the docs' assets). A Range that is not a well-formed bytes range set was a
    plain-text 400; HTTP says to ignore it, and the whole file is sent. One that starts past the
    file's end is still 416, in JSON as every refusal is."""

    def __init__(self, app) -> None:
        self.app = app

    FILES = ("/static/", "/vendor/")  # where FileResponse answers; no other route reads a Range

    async def __call__(self, scope, receive, send) -> None:
        files = scope["type"] == "http" and scope["path"].startswith(self.FILES)
        ranges = [value for name, value in scope["headers"] if name == b"range"] if files else []
        if not ranges:
            await self.app(scope, receive, send)
            return
        if len(ranges) > 1 or not usable_range(ranges[0].decode("latin-1")):
            scope = {**scope, "headers": [(name, value) for name, value in scope["headers"] if name != b"range"]}
            await self.app(scope, receive, send)
            return
        refused = False

        async def json_416(message):
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 416:
                refused = True
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in (b"content-type", b"content-length")]
                await send_error(send, 416, "range_not_satisfiable", "no byte of the file lies in the Range asked for", kept)
                return
            if not refused:
                await send(message)

        await self.app(scope, receive, json_416)


class JsonCors(CORSMiddleware):
    """Starlette's CORS, whose refused preflights were plain text ("Disallowed CORS origin"): JSON,
    as every other refusal is, with the same CORS headers."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = response.body.decode().removeprefix("Disallowed CORS ")
        # "origin", "method" or "headers", or several of them ("method, headers"): "is" read wrong for some
        message = (f"this cross-origin request is refused for its {refused} (allowed here: methods GET and POST, headers "
                   "Content-Type and Authorization, from the origins in MANYEYES_CORS_ORIGINS)")
        headers = {k: v for k, v in response.headers.items() if k not in ("content-type", "content-length")}
        return error_response(400, "cors_refused", message, headers)


class Gzip(GZipMiddleware):
    """Starlette's gzip for the answers the service does not compress itself, except that
    `gzip;q=0` means no: Starlette looks only for the substring "gzip" in Accept-Encoding.
    Requests to the route templates in `encodes_itself` (the routes that choose zstd or gzip per
    answer) pass straight through: the responder that waits to see each answer's type and size
    before sending it was ~0.1 ms of a T=16 answer for nothing, and the Accept-Encoding it is
    handed below is not the client's, which those routes must read."""

    def __init__(self, app, encodes_itself: Iterable[str] = (), **options) -> None:
        super().__init__(app, **options)
        # Compared with the concrete path: a template with a parameter ({run_id}) never equals
        # one, so those are matched by their pattern, the others (POST /attention's) by a lookup.
        templates = list(encodes_itself)
        self.exact = frozenset(t for t in templates if "{" not in t)
        self.patterns = tuple(compile_path(t)[0] for t in templates if "{" in t)

    def encodes_itself(self, scope) -> bool:
        path = routed_path(scope)
        return path in self.exact or any(pattern.match(path) for pattern in self.patterns)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.encodes_itself(scope):
            await self.app(scope, receive, send)
            return

        async def send_one_vary(message) -> None:
            # Starlette appends "Accept-Encoding" to a Vary that the attention answers already
            # give as "Accept, Accept-Encoding": each name once is enough.
            if message["type"] == "http.response.start":
                message["headers"] = unique_vary(message.get("headers", []))
            await send(message)

        accept_encoding = header_list(Headers(scope=scope), "accept-encoding")
        if coding_q(accept_encoding, "gzip") <= 0:
            # Starlette's own answer for such a client: uncompressed, with Vary where it matters.
            responder = IdentityResponder(self.app, self.minimum_size, exclude_content_types=self.exclude_content_types)
            await responder(scope, receive, send_one_vary)
            return
        if "gzip" not in Headers(scope=scope).get("accept-encoding", ""):
            # Accepted by `*` (RFC 9110, 12.5.3), or spelt GZIP: Starlette looks for the word "gzip"
            # in the first line, so it is told so plainly.
            headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"accept-encoding"]
            scope = {**scope, "headers": [*headers, (b"accept-encoding", b"gzip")]}
        await super().__call__(scope, receive, send_one_vary)


def unique_vary(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The raw headers with each name in Vary once (first spelling kept, order kept)."""
    out, seen = [], set()
    for name, value in headers:
        if name.lower() == b"vary":
            names = []
            for part in (v.strip() for v in value.split(b",")):
                if part and part.lower() not in seen:
                    seen.add(part.lower())
                    names.append(part)
            if not names:
                continue
            value = b", ".join(names)
        out.append((name, value))
    return out
