"""Abandons a request's work when its client goes away, so queued forwards are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from manyeyes.app.services.errors import ApiError

T = TypeVar("T")


class ClientClosed(ApiError):
    status = 499  # nginx's "client closed request": nobody reads it, but logs and metrics show it
    code = "client_closed_request"


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server has for us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; if the client disconnects first, cancels it (its queued forwards are then
    dropped by the batcher and counted as cancelled) and raises ClientClosed."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left, or this handler itself is being cancelled
            task.cancel()
        watcher.cancel()
    if not task.done():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientClosed("the client closed the connection before the answer was ready")
    return task.result()
