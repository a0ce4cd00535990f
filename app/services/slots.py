"""Slots for heavy work on worker threads (encoding big answers, computing tiles), handed out
round-robin across clients, as the batcher hands out forward passes.

A plain FIFO semaphore let one client's flood of 200 tile requests stand between another client
and its one answer: 12.7 s for an answer that took 0.07 s alone. Here a waiting client is served
at the next free slot after each client ahead of it in the rotation has had one, however many
requests those clients have waiting."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from contextlib import asynccontextmanager


class FairSlots:
    """`async with slots.hold(client):` at most `n` holders at once. Event loop only (no lock)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiting: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()

    @asynccontextmanager
    async def hold(self, client: str = ""):
        await self._acquire(client)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, client: str) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.cancelled():
                self._forget(client, future)
            else:
                self._release()  # handed a slot just as this waiter was cancelled: pass it on
            raise

    def _release(self) -> None:
        """Hands the slot to the next client in the rotation, which then goes to the back."""
        while self._waiting:
            client, queue = next(iter(self._waiting.items()))
            future = queue.popleft()
            if queue:
                self._waiting.move_to_end(client)
            else:
                del self._waiting[client]
            if not future.done():
                future.set_result(None)
                return
        self.free += 1

    def _forget(self, client: str, future: asyncio.Future) -> None:
        queue = self._waiting.get(client)
        if queue is None:
            return
        try:
            queue.remove(future)
        except ValueError:
            return
        if not queue:
            del self._waiting[client]
