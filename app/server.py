"""How `manyeyes serve` runs under uvicorn: its config, and an HTTP protocol with a deadline for
reading each request.

uvicorn closes a connection that idles between requests (its keep-alive timeout), but never one
that opens and sends nothing, or sends a request's head or body a byte at a time: each such
connection was held for as long as the client liked (measured: still open after minutes), and
enough of them exhaust the process's file descriptors, after which nobody is served. Here a
connection must deliver each whole request, head and body, within `read_timeout_s` of its first
byte (of the connection's opening, for the first request). Past it, a request whose head never
arrived gets a 408 and the connection is closed; one whose body is still arriving is cut off,
which its handler sees as the client going away (and the access log as a 499). Idling between
requests stays uvicorn's keep-alive timeout.
"""

from __future__ import annotations

import asyncio

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from manyeyes.app.config import Settings


def timeout_answer(timeout_s: float) -> bytes:
    body = orjson.dumps({"error": {
        "code": "request_timeout",
        "message": f"the request was not sent within {timeout_s:g} s (MANYEYES_REQUEST_READ_TIMEOUT_S)",
    }})
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class ReadDeadlineProtocol(HttpToolsProtocol):
    read_timeout_s: float = 30.0  # set by with_read_deadline

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._head_done = False  # of the request being read

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_done = False
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
        if self.transport.is_closing():
            return
        # No handler has this request, so the answer is ours to write, unless an earlier
        # (pipelined) request's answer is still going out on the same connection.
        idle = self.cycle is None or self.cycle.response_complete
        if not self._head_done and idle:
            self.transport.write(timeout_answer(self.read_timeout_s))
        self.transport.close()


def with_read_deadline(timeout_s: float) -> type[ReadDeadlineProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), {"read_timeout_s": timeout_s})


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
        http=with_read_deadline(settings.request_read_timeout_s),
        **options,
    )
