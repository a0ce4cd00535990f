"""How `manyeyes serve` runs under uvicorn: its config, and an HTTP protocol that bounds how long a
request may take to arrive and how large its head may be.

uvicorn closes a connection that idles between requests (its keep-alive timeout), but never one
that opens and sends nothing, or sends a request's head or body a byte at a time: each such
connection was held for as long as the client liked (measured: still open after minutes), and
enough of them exhaust the process's file descriptors, after which nobody is served. Here a
connection must deliver each whole request, head and body, within `read_timeout_s` of its first
byte (of the connection's opening, for the first request). Past it, a request whose head never
arrived gets a 408 and the connection is closed; one whose body is still arriving is cut off,
which its handler sees as the client going away (and the access log as a 499). Idling between
requests stays uvicorn's keep-alive timeout.

Nor does uvicorn bound a request's head (the request line and headers): the parser gathers a
header of any length, and 200 MB of one took the server's RSS up by 207 MB (bodies are bounded by
MANYEYES_MAX_BODY_BYTES, but only once the head is through). Here a head over `max_head_bytes`
gets a 431 and the connection is closed, having held at most that plus one read's worth of bytes.
"""

from __future__ import annotations

import asyncio

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from manyeyes.app.config import Settings


def error_answer(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection: the JSON error every refusal gives."""
    body = orjson.dumps({"error": {"code": code, "message": message}})
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
        self._head_done = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        """Closes the connection, first answering the request being read if nothing else will:
        not one whose handler is running (its body was cut off), nor while an earlier (pipelined)
        request's answer is still going out on the same connection."""
        self._refused = True
        idle = self.cycle is None or self.cycle.response_complete
        if not self._head_done and idle:
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
