"""How `manyeyes serve` runs under uvicorn: its config, and an HTTP protocol that bounds how long a
request may take to arrive and how large its head may be.

uvicorn closes a connection that idles between requests (its keep-alive timeout), but never one
that opens and sends nothing, or sends a request's head or body a byte at a time: each such
connection was held for as long as the client liked (measured: still open after minutes), and
enough of them exhaust the process's file descriptors, after which nobody is served. Here a
connection must deliver each request's head within `read_timeout_s` of its first byte (of the
connection's opening, for the first request), or it gets a 408 and the connection is closed; the
body then has as long again (BodyLimit, app/middleware.py, which reads it, answers the 408 there).
A body nobody reads (an answer sent before it was in: a 401, a GET's, any refusal) has no such
deadline, so that answer closes the connection. Idling between requests stays uvicorn's keep-alive
timeout.

Nor does uvicorn bound a request's head (the request line and headers): the parser gathers a
header of any length, and 200 MB of one took the server's RSS up by 207 MB (bodies are bounded by
MANYEYES_MAX_BODY_BYTES, but only once the head is through). Here a head over `max_head_bytes`
gets a 431 and the connection is closed, having held at most that plus one read's worth of bytes.

Nor does uvicorn bound how long an answer may wait for its client to take it: a whole answer is
handed to the transport at once, which keeps what the socket will not take, so a client that
sends requests and never reads held each answer in the server's memory for as long as it kept the
connection (measured: 20 such clients of a 25 MB u8 answer held 500 MB for minutes). Here a
connection whose pending answer makes no progress (not one byte taken) for `read_timeout_s` is
aborted, which frees it; a slow reader that keeps taking bytes is served, as nginx's send_timeout.

Requests that httptools cannot parse (a bad chunk size, Content-Length twice or with
Transfer-Encoding, a NUL in a header, a URL it cannot split) get the JSON 400 every refusal gives,
not uvicorn's plain text.

The service speaks HTTP/1.1 only and has no WebSocket routes, but uvicorn handed WebSocket
handshakes to its WebSocket protocol, which answered 403 or a plain-text 400; and after any request
asking to switch protocols (Upgrade, CONNECT) llhttp parses nothing more on the connection, so a
body sent with it never reached the handler (which answered as if none had been sent), and the
requests after it were never answered. Here such a request is answered as plain HTTP (RFC 9110
7.8 lets a server ignore Upgrade) and its connection closed after it; with a body, which cannot be
read, it gets the JSON 400.

Pipelined requests are answered in order, as uvicorn does; here a head's deadline does not expire
while uvicorn has stopped reading (behind an answer still going out): it starts over. And a client
that goes away is made known to the request being answered, not only to the newest one.

AccessLog (app/middleware.py) needs to know whether an answer left the server whole: uvicorn tells
a handler nothing of what happens to its bytes once handed to the transport, which keeps what the
socket will not take yet. Each request's scope carries the connection's Delivery, which says so.

The refusals above (the 400s, the head's 408, the 431) are of requests the app never sees, so
AccessLog neither counted nor logged them: /metrics missed them and the log had only uvicorn's
"Invalid HTTP request received." (no client, no status, no time). Each is counted in the app's
request metrics (route "other") and logged as an access line with its client, status, error code
and reason (`record_refusal`).

uvicorn's own lines ("Started server process", "Shutting down", "Cancel N running task(s)") went
through its own logging config, without a time; here they go through the process's (app/logs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from email.utils import formatdate

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from manyeyes.app.clients import canonical_address
from manyeyes.app.config import Settings
from manyeyes.app.middleware import CUT_OFF, DELIVERY, SECURITY_HEADERS, counted_method, logged_request
from manyeyes.app.services.errors import brief, error_body
from manyeyes.app.services.metrics import Metrics

# The same logger as AccessLog's lines: a refusal here is a request's line like any other.
access_log = logging.getLogger("manyeyes.access")
log = logging.getLogger("manyeyes.server")


def error_answer(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, with `body` (the JSON error every
    refusal gives) and the headers every other answer carries (they had only type, length, close)."""
    head = (f"HTTP/1.1 {status} {reason}\r\ndate: {formatdate(usegmt=True)}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n").encode("latin-1")
    return head + b"".join(name + b": " + value + b"\r\n" for name, value in SECURITY_HEADERS) + b"\r\n" + body


def record_refusal(metrics: Metrics | None, *, client, method: str | None, path: str | None, status: int, code: str,
                   message: str, elapsed_s: float, nbytes: int, answered: bool) -> None:
    """A refusal of a request the app never saw, as AccessLog records the app's: counted in the
    request metrics (route "other") and one access line with its client, status, error code and
    reason. `client`: the peer (host, port), a proxy's where there is one (the request's
    X-Forwarded-For is not read from bytes that did not parse). `answered`: False where the
    connection was closed without an answer (behind pipelined requests still being answered)."""
    label = counted_method(method)
    if metrics is not None:
        metrics.requests.labels("other", label, str(status)).inc()
        metrics.latency.labels("other", label, str(status)).observe(elapsed_s)
    if access_log.isEnabledFor(logging.INFO):
        line = {
            **logged_request(method, path),
            "route": "other",
            "status": status,
            "ms": round(elapsed_s * 1000, 2),
            "bytes": nbytes,
            "client": "addr:" + canonical_address(client[0]) if client else "",
            "code": code,  # as AccessLog names an error answer's
            "reason": brief(message, 512),
            "answered": answered,
        }
        access_log.info(orjson.dumps(line).decode())


class Delivery:
    """Whether each answer on a connection left the server whole, for AccessLog. The protocol keeps
    the transport's write buffer limits at zero, so it is paused for writing exactly while the
    transport holds bytes the socket has not taken, and resumed exactly when it holds none; and
    uvicorn writes nothing of an answer while paused, so the first drain after an answer's last
    byte was handed over sees that answer out."""

    __slots__ = ("held", "drains", "lost", "ended", "waiting")

    def __init__(self) -> None:
        self.held = False  # the transport holds bytes the socket has not taken
        self.drains = 0
        self.lost = False
        # The client sent its FIN (a half-close, as `nc -N` does): asyncio closes the transport then
        # and drops every later write without a word, before it reports the connection lost.
        self.ended = False
        self.waiting: list = []

    def ticket(self) -> int:
        """Taken just after an answer's last byte was handed over: the drain that sees it out. An
        answer handed over after the client's FIN was dropped: no drain sees it out, the loss
        settles it (it was logged complete and counted 200, never having left)."""
        return self.drains + 1 if self.held or self.lost or self.ended else self.drains

    def settle(self, ticket: int, then) -> None:
        """then(True) once that answer is out whole, then(False) if the connection is lost first
        (uvicorn drops what is sent after that, and the transport what it still held)."""
        if self.drains >= ticket:
            then(True)
        elif self.lost:
            then(False)
        else:
            self.waiting.append((ticket, then))

    def drained(self) -> None:
        self.held = False
        self.drains += 1
        self._settle_waiting()

    def lose(self) -> None:
        self.lost = True
        self._settle_waiting()

    def _settle_waiting(self) -> None:
        waiting, self.waiting = self.waiting, []
        for ticket, then in waiting:
            self.settle(ticket, then)


def has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    # llhttp has checked the framing: Content-Length is digits, and never with Transfer-Encoding.
    return any(name == b"transfer-encoding" or (name == b"content-length" and int(value) > 0) for name, value in headers)


def unknown_codings(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """Transfer codings other than chunked: llhttp frames the body by its final `chunked` and
    passes the bytes on still coded (`gzip, chunked` was read as plain JSON)."""
    codings = [c.strip().lower() for name, value in headers if name == b"transfer-encoding"
               for c in value.decode("latin-1").split(",")]
    return [c for c in codings if c != "chunked"]


class GuardedProtocol(HttpToolsProtocol):
    read_timeout_s: float = 30.0  # all three set by guarded_protocol()
    max_head_bytes: int = 64 * 1024
    metrics: Metrics | None = None  # the app's, where its refusals are counted (record_refusal)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._head_done = False  # of the request being read
        self._head_bytes = 0  # of that request's head, counted a read at a time
        self._head_parsed = 0  # of that request's URL and headers, as the parser hands them over
        self._head_too_large = False
        self._read_no_more = False
        self._bad_request = ""  # the 400's message where the request is well formed but cannot be read
        self._write_deadline: asyncio.TimerHandle | None = None
        self._write_left = 0  # bytes the transport held at the last check
        self._answering = None  # the cycle whose handler runs: behind it, pipelined ones wait
        self._body_pending = None  # the cycle whose body is still arriving, kept alive once it is in
        self.delivery = Delivery()
        self._began = time.perf_counter()  # the request being read: its first byte (the connection's opening, for the first)
        self._method: str | None = None  # that request's, once the parser has read it
        self._refused = False  # a refusal recorded: a connection's is once (nothing is read after it)
        self._parser_said = ""  # why the parser refused the bytes, where it did

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # Paused for writing whenever the transport holds a byte, resumed once it holds none: what
        # Delivery reads. An answer the socket takes at once (any small one) never pauses.
        transport.set_write_buffer_limits(high=0)
        self._arm()

    def eof_received(self) -> bool | None:
        # asyncio's own answer (close the transport) stands: a FIN is how a browser leaves too, and
        # the work of a client gone is cancelled. Only what is answered after it counts as lost.
        self.delivery.ended = True
        return super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._read_no_more:
            return
        # uvicorn's, less its "Invalid HTTP request received." (no client, no status, no time):
        # send_400_response's refusal logs its own line, and counts it.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # one of our callbacks refused it; the URL unsplit
            self._parser_said = str(exc.__context__ or "")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserError as exc:
            self._parser_said = str(exc)  # llhttp's words ("Invalid method encountered"), for the log line
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            # ws="none" (server_config): never a WebSocket; on_headers_complete has answered it.
            self._unsupported_upgrade_warning()
        # Still inside a head after this read: all of it counts as head (a read that ended one
        # request and began the next counts whole towards the next: at most a read too much).
        if not self._head_done and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()

    def _refuse_head(self) -> None:
        self._refuse(431, "Request Header Fields Too Large", "header_too_large",
                     f"the request line and headers are over {self.max_head_bytes:,} bytes (MANYEYES_MAX_HEADER_BYTES)")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {DELIVERY: self.delivery}
        self._began = time.perf_counter()
        self._method = None
        self._head_done = False
        self._head_bytes = 0
        self._head_parsed = 0
        self._arm()

    # A head that ends within the read it began in is never counted by data_received (70 or 100
    # KB of headers in one read were answered 200): the parser's pieces of it are, each as it comes.
    def on_url(self, url: bytes) -> None:
        if self._method is None:  # read before the URL; after a bad method the parser's is not the request's
            self._method = self.parser.get_method().decode("latin-1")
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_parsed(self, nbytes: int) -> None:
        self._head_parsed += nbytes
        if self._head_parsed > self.max_head_bytes:
            self._head_too_large = True
            raise ValueError("request head too large")  # the parser stops; send_400_response answers 431

    def on_headers_complete(self) -> None:
        # The head is in: from here BodyLimit times the body (the parser may not report a
        # pipelined request's end until the answers before it are out).
        self._disarm()
        upgrade = self.parser.should_upgrade()
        if upgrade and has_body(self.headers):
            # Refused as bytes the parser cannot take are (send_400_response).
            self._bad_request = ("this server speaks HTTP/1.1 only: a request asking to switch protocols (Upgrade) "
                                 "is answered as plain HTTP when it has no body, but a body sent with it cannot be read")
            raise ValueError(self._bad_request)
        codings = unknown_codings(self.headers)
        if codings:
            # A 400, as every refusal of what a client sent (RFC 9112 suggests 501, a server's error).
            self._bad_request = (f"this server decodes no transfer coding but chunked (this request's body is "
                                 f"{brief(', '.join(codings), 64)}): send the body as it is, with Content-Length or chunked")
            raise ValueError(self._bad_request)
        self._host_from_absolute_target()
        super().on_headers_complete()  # raises on a URL httptools cannot split: a 400, as no cycle has the request
        self._head_done = True  # and self.cycle is this request's
        if upgrade:
            self._read_no_more = True
            self.cycle.keep_alive = False
        elif self.cycle.keep_alive and has_body(self.headers):
            # Kept alive only once the body is in (on_message_complete): an answer sent before it
            # (a 401, a GET's, any refusal) closes the connection. Kept open, the rest of the body
            # had no deadline (BodyLimit times only bodies it reads), and each byte restarted
            # uvicorn's keep-alive timer: a byte every 4 s held a connection for minutes.
            self.cycle.keep_alive = False
            self._body_pending = self.cycle

    def _host_from_absolute_target(self) -> None:
        """A request target in absolute form (`GET http://name/path`, any scheme) names the host,
        and Host is ignored (RFC 9112, 3.2.2): AllowedHosts checked a Host of `localhost` and
        answered a request for another name. The target's host takes the Host header's place; a
        request with no Host stays without one (AllowedHosts refuses it)."""
        if self.url[:1] in (b"/", b"*", b"") or not any(name == b"host" for name, _ in self.headers):
            return  # origin form (or asterisk form), or no Host to stand in for
        try:
            target = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return  # super() refuses it (400)
        host = target.host or b""
        host = b"[" + host + b"]" if b":" in host else host
        self.headers[:] = [(name, value) for name, value in self.headers if name != b"host"]
        self.headers.append((b"host", host + (b":%d" % target.port if target.port else b"")))

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if self._body_pending is cycle and cycle is not None and not cycle.response_started:
            cycle.keep_alive = True
        self._body_pending = None
        super().on_message_complete()

    def shutdown(self) -> None:
        self._body_pending = None  # a shutdown closes each connection after its answer: nothing to restore
        super().shutdown()

    def _unsupported_upgrade_warning(self) -> None:
        """Not uvicorn's two warnings for each request asking to switch protocols, one of them
        telling the operator to install a WebSocket library: on_headers_complete has answered it."""

    def _start_asgi_task(self, cycle, app) -> None:
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._stop_write_deadline()
        self.delivery.lose()
        answering = self._answering
        if answering is not None and answering is not self.cycle and not answering.response_complete:
            # uvicorn tells only the newest request (self.cycle), which waits, unstarted, behind
            # this one: its handler's work went on, and its next write raised (a 500 logged).
            answering.disconnected = True
            answering.message_event.set()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes its parser refuses, as text/plain; msg is always its generic one.
        if self._head_too_large:
            self._refuse_head()
            return
        self._refuse(400, "Bad Request", "bad_request", self._bad_request or
                     "the request is not valid HTTP/1.1 (malformed request line, header, Content-Length, "
                     "Transfer-Encoding or chunk)")

    # The transport calls these when it begins to hold bytes the socket will not take yet (the
    # client is not taking the answer as fast as it is written), and when it holds none again.
    def pause_writing(self) -> None:
        super().pause_writing()
        self.delivery.held = True
        if self._write_deadline is None:
            self._write_left = self.transport.get_write_buffer_size()
            self._write_deadline = self.loop.call_later(self.read_timeout_s, self._write_check)

    def resume_writing(self) -> None:
        self._stop_write_deadline()
        super().resume_writing()
        self.delivery.drained()

    def _stop_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_check(self) -> None:
        left = self.transport.get_write_buffer_size()
        if left and left >= self._write_left:
            # Nothing taken in a whole period: abort() drops the buffer (close() would wait for it
            # to drain, for ever); connection_lost then tells a handler still sending.
            self._write_deadline = None
            self.transport.abort()
            return
        self._write_left = left
        self._write_deadline = self.loop.call_later(self.read_timeout_s, self._write_check)

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.flow.read_paused:
            # uvicorn has stopped reading until the answers before this request are out: the
            # wait is the server's (refusing here dropped a pipelined request whose head straddled
            # two reads), and those answers are bounded by the request and write deadlines.
            self._arm()
        elif not self.transport.is_closing():
            self._refuse(408, "Request Timeout", "request_timeout",
                         f"the request was not sent within {self.read_timeout_s:g} s (MANYEYES_REQUEST_READ_TIMEOUT_S)")

    def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
        """Reads no more from the connection and closes it, first answering the request being read
        (unless its handler has begun an answer). Behind earlier (pipelined) requests still being
        answered, it closes once their answers are out instead: closing at once cut them off, and
        their handlers' next write raised."""
        self._read_no_more = True
        cycle = self.cycle  # the request being read once its head is in; else the one before it
        earlier_in_flight = bool(self.pipeline) or (not self._head_done and cycle is not None and not cycle.response_complete)
        body = b""
        if earlier_in_flight:
            cycle.keep_alive = False  # uvicorn closes the connection after that answer
        else:
            if not (self._head_done and cycle.response_started):
                body = orjson.dumps(error_body(code, message))
                self.transport.write(error_answer(status, reason, body))
            self.transport.close()
        if self._refused:  # a second deadline or limit, before the connection closed: one refusal
            return
        self._refused = True
        if self._head_done:
            # The app has this request (a body that broke its framing): AccessLog counts and logs
            # it (as 499 where its own answer could not go out); its line says what the server sent.
            state = cycle.scope.setdefault("state", {})
            state.setdefault("log", {})["server_refused"] = {"status": status, "code": code, "reason": message}
            return
        if status == 408 and self._method is None and self._head_bytes == 0:
            # A connection opened and never used (a browser's preconnect, a balancer's pool): no
            # request to count, and a line each made 4xx alerts fire on idle sockets.
            log.debug("closed a connection that sent no request within %g s", self.read_timeout_s)
            return
        # Its path without the query, which holds what clients send (/export?text=...): never logged.
        path = self.url.split(b"?", 1)[0].decode("latin-1") if self._method is not None else None
        if self._parser_said and not self._bad_request and not self._head_too_large:
            message = f"{message}: {brief(self._parser_said, 200)}"  # which of them, for whoever reads the log
        record_refusal(self.metrics, client=self.client, method=self._method, path=path, status=status, code=code,
                       message=message, elapsed_s=time.perf_counter() - self._began, nbytes=len(body),
                       answered=not earlier_in_flight)


def guarded_protocol(read_timeout_s: float, max_head_bytes: int, metrics: Metrics | None = None) -> type[GuardedProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these bounds; its refusals are counted
    in `metrics` (the app's), and logged either way."""
    return type("GuardedProtocol", (GuardedProtocol,),
                {"read_timeout_s": read_timeout_s, "max_head_bytes": max_head_bytes, "metrics": metrics})


# uvicorn's Server.shutdown sleeps this long after asking connections to close, before the
# graceful-shutdown timer starts.
UVICORN_PAUSE_S = 0.1


class DrainRanOut(logging.Filter):
    """uvicorn logs a drain that ran out of its grace at ERROR ("Cancel N running task(s), timeout
    graceful shutdown exceeded"); it is the outcome shutdown() announced, each of those requests
    answered 503 where no answer had begun, and an ERROR line paged operators for nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        # An answer still being sent when the drain ran out: middleware.ShutdownAnswer said so.
        if record.msg == "ASGI callable returned without completing response." and CUT_OFF.take():
            return False
        return True


DRAIN_RAN_OUT = DrainRanOut()  # one instance: addFilter keeps a filter once however many servers start


class Server(uvicorn.Server):
    """uvicorn's server, which also tells the app (`on_exit`) when a shutdown begins: requests it
    waits for end on their own, but a generation stream runs to its last token, and the app must
    end it within the grace period."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        logging.getLogger("uvicorn.error").addFilter(DRAIN_RAN_OUT)
        self.on_exit = on_exit
        self.exit_signal: int | None = None  # the first signal that asked for the exit
        self.exit_asked: float | None = None  # when it came (time.monotonic())

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self.exit_signal is None:
            self.exit_signal = sig  # logged by shutdown(), on the loop: not from a signal handler
            self.exit_asked = time.monotonic()
        if self.on_exit is not None:
            self.on_exit()  # it only notes the time: safe in a signal handler

    async def shutdown(self, sockets=None) -> None:
        # uvicorn says "Shutting down", not that requests are let finish, nor for how long.
        said = f"{signal.Signals(self.exit_signal).name}: " if self.exit_signal is not None else ""
        log.info("%sdraining: no new connections; requests in flight get up to %g s to finish "
                 "(MANYEYES_SHUTDOWN_GRACE_S less a second for the exit), then those still running are cancelled "
                 "(answered 503 where no answer has begun)", said, self.config.timeout_graceful_shutdown or 0)
        drain = self.config.timeout_graceful_shutdown
        if drain is not None and self.exit_asked is not None:
            # The drain counts from the signal, as the grace does: uvicorn noticed it at its next
            # tick (up to 0.1 s, more on a loaded machine) and sleeps 0.1 s more before its timer
            # starts; both came out of the second kept for the exit (a 2 s grace left 0.3 s of it).
            self.config.timeout_graceful_shutdown = max(drain - (time.monotonic() - self.exit_asked) - UVICORN_PAUSE_S, 0.0)
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's SIGINT and SIGTERM, and SIGHUP as SIGTERM: a drain, then the exit. The keys
        and settings are read at start-up only, so there is nothing to reload; and SIGHUP's own
        action (a closed terminal, an operator's "reload") killed the server with requests in flight."""
        hup = getattr(signal, "SIGHUP", None)
        if hup is None or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        original = signal.signal(hup, self.handle_exit)
        with super().capture_signals():
            try:
                yield
            finally:
                # Before uvicorn raises the signals it caught again, so that SIGHUP then ends the
                # process as SIGTERM does, by its own action.
                signal.signal(hup, original)


def server_config(app, settings: Settings, **options) -> uvicorn.Config:
    """uvicorn's config for the app (host, port, log level and the like in `options`)."""
    return uvicorn.Config(
        app,
        # Our own middleware writes one structured line per request.
        access_log=False,
        # uvicorn's loggers log through the process's handler (app/logs.py, set up by `manyeyes
        # serve` and each worker), stamped as every other line: its own config wrote them without
        # a time ("INFO:     Shutting down").
        log_config=None,
        # No WebSocket routes: GuardedProtocol answers a handshake as plain HTTP (uvicorn's
        # WebSocket protocol answered it 403, or a plain-text 400).
        ws="none",
        # uvicorn would believe X-Forwarded-For from loopback by default; the app decides whom
        # to believe (MANYEYES_TRUSTED_PROXIES), so uvicorn must pass the real peer through.
        proxy_headers=False,
        # On SIGTERM uvicorn stops accepting at once and lets in-flight requests finish, then
        # cancels what is left and runs the lifespan's shutdown. The grace period bounds the whole
        # exit, so the drain gets all of it but a second kept for that shutdown and the exit.
        timeout_graceful_shutdown=settings.drain_s(),
        # Counted in the app's metrics, as AccessLog counts the requests the app sees.
        http=guarded_protocol(settings.request_read_timeout_s, settings.max_header_bytes,
                              getattr(getattr(app, "state", None), "metrics", None)),
        **options,
    )


def bound_socket(family: int, address, share_port: bool = False) -> socket.socket:
    """A socket bound to `address`, not yet listening: uvicorn calls listen() on it after the
    app's start-up. SO_REUSEADDR as uvicorn binds (a restart reuses the port); `share_port` adds
    SO_REUSEPORT, which puts it in the port's group with the other workers' (app/workers.py)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if share_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
