"""Slots for heavy work on worker threads (encoding big answers, computing tiles), handed out
round-robin across clients, as the batcher hands out forward passes.

A plain FIFO semaphore let one client's flood of 200 tile requests stand between another client
and its one answer: 12.7 s for an answer that took 0.07 s alone. Here a waiting client is served
at the next free slot after each client ahead of it in the rotation has had one, however many
requests those clients have waiting."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from itertools import islice


def forget(waiting: OrderedDict[str, deque], client: str, entry) -> None:
    """Takes a cancelled waiter's entry out of its client's queue, and the client out of the rotation
    once it has none left."""
    queue = waiting.get(client)
    if queue is None:
        return
    try:
        queue.remove(entry)
    except ValueError:
        return
    if not queue:
        del waiting[client]


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
                forget(self._waiting, client, future)
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


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# An answer of at most 1/SMALL_SHARE of the budget is small: it may pass a head the budget holds
# back, while the small answers that passed one hold at most 1/PASSING_SHARE of it together.
SMALL_SHARE = 32
PASSING_SHARE = 8


class Grant:
    """Bytes taken from a FairBytes, given back once by `release()` (any later call does nothing).
    `passing`: granted past a head the budget held back (FairBytes._may_pass)."""

    __slots__ = ("budget", "nbytes", "client", "passing")

    def __init__(self, budget: FairBytes | None, nbytes: int, client: str, passing: bool = False) -> None:
        self.budget, self.nbytes, self.client, self.passing = budget, nbytes, client, passing

    def release(self) -> None:
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.give_back(self)


class FairBytes:
    """Bytes of answers held at once (runs being answered, answers being encoded and sent), handed
    out in the same rotation across clients as FairSlots. Event loop only (no lock), but for
    `give_back`, which any thread may call.

    `grant = await budget.take(nbytes, client)`, then `grant.release()`. The head of the rotation
    waits until its bytes are free, and those behind it wait too, so a large answer is never passed
    over forever; one larger than the whole budget goes alone, once nothing else is held. A client
    holds at most half the budget (but for that one): answers a client reads slowly, or never, hold
    their bytes until sent, and one client must not hold them all. A head held back only by its own
    client's half (the budget has room) waits for that client's answers to go out and holds nobody
    else back: a flood of large answers from one client kept another client's small one waiting
    for the flood's answer in flight. And a small answer (SMALL_SHARE) that fits passes a head the
    budget holds back, within PASSING_SHARE of it for all those that passed and never so far that
    the head could not fit once the others are given back: three clients that never read a large
    answer each held the budget until their write deadline (30 s), and every other client's 4 KB
    answer waited behind the next large one all that time (review h52c). limit 0: no budget."""

    def __init__(self, limit: int, gauge=None) -> None:
        self.limit = limit
        self.gauge = gauge  # told the bytes held at each change (a Prometheus Gauge), if given
        self.held = 0
        self.held_by: dict[str, int] = {}
        self.held_passing = 0  # of `held`, by grants that passed a head (Grant.passing)
        self._waiting: OrderedDict[str, deque[tuple[int, asyncio.Future]]] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop its grants are taken on

    def _fits(self, nbytes: int, client: str) -> bool:
        if self.held == 0:
            return True
        return self.held + nbytes <= self.limit and self.held_by.get(client, 0) + nbytes <= self.limit // 2

    def _waits_on_itself(self, nbytes: int, client: str) -> bool:
        """Whether a waiter that does not fit is held back by its client's half alone: its own
        answers going out free its room. One holding nothing needs the budget empty instead."""
        return self.held_by.get(client, 0) > 0 and self.held + nbytes <= self.limit

    def _may_pass(self, nbytes: int, head_nbytes: int) -> bool:
        """Whether an answer that fits may pass a head of `head_nbytes` that does not: a small one,
        within the passers' share, leaving the head room once all but the passers are given back
        (so a head that needs the budget empty, one larger than it, is never passed)."""
        passing = self.held_passing + nbytes
        return (nbytes <= self.limit // SMALL_SHARE and passing <= self.limit // PASSING_SHARE
                and head_nbytes + passing <= self.limit)

    def _blocked_head(self) -> int | None:
        """The bytes of the first waiter in the rotation that the budget holds back (not its
        client's half alone); None when there is none."""
        return next((queue[0][0] for client, queue in self._waiting.items()
                     if not self._waits_on_itself(queue[0][0], client)), None)

    def _hold(self, nbytes: int, client: str, passing: bool = False) -> Grant:
        self.held += nbytes
        self.held_by[client] = self.held_by.get(client, 0) + nbytes
        self.held_passing += nbytes if passing else 0
        if self.gauge is not None:
            self.gauge.set(self.held)
        return Grant(self, nbytes, client, passing)

    def try_take(self, nbytes: int, client: str = "") -> Grant | None:
        """The bytes at once, or None where `take` would wait."""
        if self.limit == 0:
            return Grant(None, nbytes, client)
        if client in self._waiting or not self._fits(nbytes, client):
            return None
        head = self._blocked_head()
        if head is not None and not self._may_pass(nbytes, head):
            return None
        self._loop = running_loop() or self._loop  # the latest: an app started again runs a new loop
        return self._hold(nbytes, client, passing=head is not None)

    async def take(self, nbytes: int, client: str = "") -> Grant:
        grant = self.try_take(nbytes, client)
        if grant is not None:
            return grant
        self._loop = asyncio.get_running_loop()
        future = self._loop.create_future()
        entry = (nbytes, future)
        self._waiting.setdefault(client, deque()).append(entry)
        try:
            return await future
        except asyncio.CancelledError:
            if future.cancelled():
                forget(self._waiting, client, entry)
                self._grant_waiting()  # it may have been the head that held the others back
            else:
                future.result().release()  # granted just as this waiter was cancelled: give it back
            raise

    def give_back(self, grant: Grant) -> None:
        """From any thread: a grant whose holder was freed by the garbage collector is given back
        on the thread the collector ran on (the forward thread, say), and the waiters' futures may
        only be resolved on their loop."""
        loop = self._loop
        if loop is None or running_loop() is loop:
            self._give_back(grant)
            return
        try:
            loop.call_soon_threadsafe(self._give_back, grant)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def _give_back(self, grant: Grant) -> None:
        self.held -= grant.nbytes
        self.held_passing -= grant.nbytes if grant.passing else 0
        left = self.held_by[grant.client] - grant.nbytes
        if left:
            self.held_by[grant.client] = left
        else:
            del self.held_by[grant.client]
        if self.gauge is not None:
            self.gauge.set(self.held)
        self._grant_waiting()

    def _grant_waiting(self) -> None:
        passed = 0  # clients at the front of the rotation that wait on their own answers
        while len(self._waiting) > passed:
            client, queue = next(islice(self._waiting.items(), passed, None))
            nbytes, future = queue[0]
            if not future.done() and not self._fits(nbytes, client):
                if self._waits_on_itself(nbytes, client):
                    passed += 1  # it keeps its place at the front for when its own bytes come back
                    continue
                self._let_small_ones_pass(nbytes, passed + 1)
                return
            self._grant_first(client, nbytes)

    def _let_small_ones_pass(self, head_nbytes: int, start: int) -> None:
        """Each client's first waiter behind a held-back head, in the rotation's order, that fits
        and may pass it."""
        for client in list(islice(self._waiting, start, None)):
            nbytes, future = self._waiting[client][0]
            if future.done() or (self._fits(nbytes, client) and self._may_pass(nbytes, head_nbytes)):
                self._grant_first(client, nbytes, passing=True)

    def _grant_first(self, client: str, nbytes: int, passing: bool = False) -> None:
        """The client's first waiter gets its bytes (unless it was cancelled meanwhile), and the
        client goes to the back of the rotation."""
        queue = self._waiting[client]
        _, future = queue.popleft()
        if queue:
            self._waiting.move_to_end(client)
        else:
            del self._waiting[client]
        if not future.done():
            future.set_result(self._hold(nbytes, client, passing))


class CountedSlots:
    """At most `capacity` of one kind of long work at once (generations, experiments, captured
    forwards), never waited for (the caller answers 429), and counted on /metrics as
    manyeyes_work_running{kind}: an operator could not tell whether any was still running, or stuck.

    A caller that names its client holds at most `client_share` of them (half, at least one), so
    that another client finds one free: one client looping 512-token compares on two connections
    kept both experiment slots, and another's tiny compare got 429 59 times in 59 (review h50a)."""

    def __init__(self, capacity: int, gauge) -> None:
        self.capacity = capacity
        self.client_share = max(1, capacity // 2)
        self.running = 0
        self.held_by: dict[str, int] = {}
        self._lock = threading.Lock()
        self._gauge = gauge

    @property
    def free(self) -> int:
        return self.capacity - self.running

    def holds_share(self, client: str) -> bool:
        """Whether `client` holds its share: why its acquire() said False, unless all are taken."""
        return self.held_by.get(client, 0) >= self.client_share

    def acquire(self, client: str | None = None) -> bool:
        with self._lock:
            if self.running >= self.capacity or (client is not None and self.holds_share(client)):
                return False
            self.running += 1
            if client is not None:
                self.held_by[client] = self.held_by.get(client, 0) + 1
        self._gauge.inc()
        return True

    def release(self, client: str | None = None) -> None:
        with self._lock:
            if self.running <= 0 or (client is not None and not self.held_by.get(client)):
                raise ValueError("a slot released more often than taken")
            self.running -= 1
            if client is not None:
                self.held_by[client] -= 1
                if not self.held_by[client]:
                    del self.held_by[client]
        self._gauge.dec()
