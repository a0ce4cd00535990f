"""How `manyeyes serve` runs under uvicorn: its config, and an HTTP protocol that bounds how long a
request may take to arrive and how large its head may be.

uvicorn closes a connection that idles between requests (its keep-alive timeout), but never one
that opens and sends nothing, or sends a request's head or body a byte at a time: each such
connection was held for as long as the client liked (measured: still open after minutes), and
enough of them exhaust the process's file descriptors, after which nobody is served. Here a
connection must deliver each request's head within `read_timeout_s` of its first byte (of the
connection's opening, for the first request), or it gets a 408 and the connection is closed; the
body then has as long again (BodyLimit, app/middleware.py, which reads it, answers the 408 there).
Idling between requests stays uvicorn's keep-alive timeout.

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
Transfer-Encoding, a NUL in a header) get the JSON 400 every refusal gives, not uvicorn's plain text.
"""

from __future__ import annotations

import asyncio

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from manyeyes.app.config import Settings
from manyeyes.app.services.errors import error_body


def error_answer(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection: the JSON error every refusal gives."""
    body = orjson.dumps(error_body(code, message))
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class GuardedProtocol(HttpToolsProtocol):
    read_timeout_s: float = 30.0  # both set by guarded_protocol()
    max_head_bytes: int = 64 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._head_done = False  # of the request being read
        self._head_bytes = 0  # of that request's head, counted a read at a time
        self._refused = False
        self._write_deadline: asyncio.TimerHandle | None = None
        self._write_left = 0  # bytes the transport held at the last check

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        # Still inside a head after this read: all of it counts as head (a read that ended one
        # request and began the next counts whole towards the next: at most a read too much).
        if not self._head_done and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, "Request Header Fields Too Large", "header_too_large",
                             f"the request line and headers are over {self.max_head_bytes:,} bytes (MANYEYES_MAX_HEADER_BYTES)")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_done = False
        self._head_bytes = 0
        self._arm()

    def on_headers_complete(self) -> None:
        # The head is in: from here the app has the request, and BodyLimit times its body (the
        # parser may not report a pipelined request's end until the answers before it are out).
        self._head_done = True
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._stop_write_deadline()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes its parser refuses, as text/plain; msg is always its generic one.
        self._refuse(400, "Bad Request", "bad_request",
                     "the request is not valid HTTP/1.1 (malformed request line, header, Content-Length, "
                     "Transfer-Encoding or chunk)")

    # The transport calls these when what it holds for the client crosses its high-water mark
    # (the client is not taking the answer as fast as it is written), and falls back below the low.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_left = self.transport.get_write_buffer_size()
            self._write_deadline = self.loop.call_later(self.read_timeout_s, self._write_check)

    def resume_writing(self) -> None:
        self._stop_write_deadline()
        super().resume_writing()

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
        if not self.transport.is_closing():
            self._refuse(408, "Request Timeout", "request_timeout",
                         f"the request was not sent within {self.read_timeout_s:g} s (MANYEYES_REQUEST_READ_TIMEOUT_S)")

    def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
        """Reads no more from the connection and closes it, first answering the request being read
        (unless its handler has begun an answer). Behind earlier (pipelined) requests still being
        answered, it closes once their answers are out instead: closing at once cut them off, and
        their handlers' next write raised."""
        self._refused = True
        cycle = self.cycle  # the request being read once its head is in; else the one before it
        earlier_in_flight = bool(self.pipeline) or (not self._head_done and cycle is not None and not cycle.response_complete)
        if earlier_in_flight:
            cycle.keep_alive = False  # uvicorn closes the connection after that answer
            return
        if not (self._head_done and cycle.response_started):
            self.transport.write(error_answer(status, reason, code, message))
        self.transport.close()


def guarded_protocol(read_timeout_s: float, max_head_bytes: int) -> type[GuardedProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these bounds."""
    return type("GuardedProtocol", (GuardedProtocol,), {"read_timeout_s": read_timeout_s, "max_head_bytes": max_head_bytes})


def server_config(app, settings: Settings, **options) -> uvicorn.Config:
    """uvicorn's config for the app (host, port, log level and the like in `options`)."""
    return uvicorn.Config(
        app,
        # Our own middleware writes one structured line per request.
        access_log=False,
        # uvicorn would believe X-Forwarded-For from loopback by default; the app decides whom
        # to believe (MANYEYES_TRUSTED_PROXIES), so uvicorn must pass the real peer through.
        proxy_headers=False,
        # On SIGTERM uvicorn stops accepting at once and lets in-flight requests finish, then
        # cancels what is left and runs the lifespan's shutdown. The grace period bounds the whole
        # exit, so the drain gets all of it but a second kept for that shutdown and the exit.
        timeout_graceful_shutdown=max(settings.shutdown_grace_s - 1.0, 0.0),
        http=guarded_protocol(settings.request_read_timeout_s, settings.max_header_bytes),
        **options,
    )
