"""Runs and views shared between copies of the app (worker processes, Ray Serve replicas).

Each copy keeps its own run cache, and a client's requests may reach any copy. So every copy
records the request behind each run id it computes (model, texts and truncation; small) in a
directory the copies share; a copy asked for a slice of a run it does not hold looks the request
up and recomputes the run (one forward pass) before answering, and says so with
`X-Manyeyes-Recomputed: 1`. A run id is a hash of (model, text, pair, truncate, and on a server
with API keys the key's secret digest), all recorded, so the recomputed run is the same run.

Two directories: `FileDirectory`, files in one folder, for worker processes on one machine
(`manyeyes serve --workers N`), and the Ray actor of manyeyes.scale for replicas anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
import zlib
from collections import OrderedDict
from contextlib import asynccontextmanager
from itertools import islice
from pathlib import Path

import orjson
from starlette.concurrency import run_in_threadpool

from manyeyes.app.middleware import send_error
from manyeyes.app.services.errors import ApiError

log = logging.getLogger("manyeyes.shared")

RUN_PATH = re.compile(r"^/api/v1/runs/([^/]+)(?:/|$)")  # the run itself and every route under it
# An owner (a client saving views) holds at most this fraction of a store: beyond it, its own
# oldest entries go first. One client's 45 saves of 400 KB had forgotten every other client's views.
OWNER_SHARE = 4


def hold_to_share(keys, owner_of, owner: str, newest: str, over_share, drop) -> None:
    """Drops `owner`'s oldest entries (in `keys`' order, oldest first), never `newest`, while
    over_share() says it holds more than its share: the saved views' stores each call it."""
    for key in [k for k in keys if k != newest and owner_of(k) == owner]:
        if not over_share():
            return
        drop(key)


class SharedUnreachable(Exception):
    """A store the copies share could not be reached (the Ray actor, say): a copy falls back on its own."""


# Run and view ids are short hex digests; nothing else ever becomes a file name.
KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class SharedFiles:
    """Small entries as files that several processes share: each writes into a folder of its own
    inside `folder` and evicts only what it wrote, oldest first, within its own share of the bytes,
    so no process needs a lock on another's bookkeeping; a reader looks in every process's folder.
    Writes are atomic (a temporary file, then a rename). A process started in a dead one's place
    adopts what it wrote, oldest first, within the same share: the saved views among it are
    permalinks people hold, and emptying the folder lost them ("expired") on any worker crash."""

    # How many of the oldest entries eviction looks through for one keep_first does not hold.
    EVICTION_LOOKS = 64

    def __init__(self, folder: Path, own: str, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.own = self.folder / own
        self.own.mkdir(exist_ok=True)
        self.max_bytes = max_bytes
        # key -> True for an entry to evict only after the others (among the oldest
        # EVICTION_LOOKS): the run records of runs this process still holds (FileDirectory).
        self.keep_first = lambda key: False
        self.nbytes = 0
        self._mine: OrderedDict[str, int] = OrderedDict()
        self._owners: dict[str, str] = {}  # key -> who wrote it, where put named one
        self._owned: dict[str, int] = {}  # owner -> bytes
        # Writers are threads (the executor's, the sync routes'): one at a time per process.
        self._lock = threading.Lock()
        self._adopt()

    def _adopt(self) -> None:
        found = []
        for path in self.own.iterdir():
            if path.name.startswith("."):  # a write its writer died in the middle of
                path.unlink(missing_ok=True)
            elif KEY.match(path.name):
                stat = path.stat()
                found.append((stat.st_mtime, path.name, stat.st_size))
        for _, key, size in sorted(found):
            self._mine[key] = size
            self.nbytes += size
        self._evict()

    def _evict(self) -> None:
        if self.nbytes <= self.max_bytes:
            return
        # A bounded look, so a put costs the same however many entries are held.
        for key in [key for key in islice(self._mine, self.EVICTION_LOOKS) if not self.keep_first(key)]:
            if self.nbytes <= self.max_bytes:
                return
            self._remove(key)
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._mine)))

    def _remove(self, key: str) -> None:
        size = self._mine.pop(key)
        self.nbytes -= size
        owner = self._owners.pop(key, None)
        if owner is not None:
            self._owned[owner] -= size
            if not self._owned[owner]:
                del self._owned[owner]
        (self.own / key).unlink(missing_ok=True)

    def put(self, key: str, data: bytes, owner: str = "") -> None:
        """owner: who saves it, held to its share (OWNER_SHARE) of the bytes; "" for no one."""
        if not KEY.match(key) or len(data) > self.max_bytes:
            return
        with self._lock:
            temporary = self.own / f".{key}"
            temporary.write_bytes(data)
            if key in self._mine:
                self._remove(key)
            os.replace(temporary, self.own / key)
            self.nbytes += len(data)
            self._mine[key] = len(data)
            if owner:
                self._owners[key] = owner
                self._owned[owner] = self._owned.get(owner, 0) + len(data)
                hold_to_share(self._mine, self._owners.get, owner, key,
                              lambda: self._owned[owner] > self.max_bytes // OWNER_SHARE, self._remove)
            self._evict()

    def read(self, key: str) -> tuple[bytes, float] | None:
        """The entry and when it was last written (seconds since the epoch), from whichever
        process's folder holds it; None if none does."""
        if not KEY.match(key):
            return None
        for entry in [self.own, *(p for p in self.folder.iterdir() if p != self.own)]:
            try:
                with open(entry / key, "rb") as f:
                    return f.read(), os.fstat(f.fileno()).st_mtime
            except FileNotFoundError:  # not there, or evicted between the listing and the open
                continue
        return None


class FileDirectory:
    """run id -> the request that makes it, for worker processes on one machine. Each request is
    kept compressed (a 100,000-character text cut to the model's length is kept whole: its run's
    id hashes all of it), and a record whose run this worker still holds goes after the others,
    so another worker can recompute a run while the worker that made it still serves it."""

    def __init__(self, files: SharedFiles) -> None:
        self.files = files

    def hold_while(self, holds) -> None:
        """holds(run_id) -> whether this process's cache holds the run."""
        self.files.keep_first = lambda key: holds(key.removeprefix("run-"))

    async def remember(self, entries: list[tuple[str, tuple]]) -> None:
        # Off the event loop: the folder is memory (/dev/shm) where there is one, but need not be.
        def write() -> None:
            try:
                for run_id, request in entries:
                    self.files.put(f"run-{run_id}", zlib.compress(orjson.dumps(request), 1))
            except OSError as exc:  # a full folder: other workers recompute nothing, they answer 404
                log.warning("could not record runs for the other workers: %s", exc)

        await run_in_threadpool(write)

    async def recall(self, run_id: str) -> tuple | None:
        found = await run_in_threadpool(self.files.read, f"run-{run_id}")
        return tuple(orjson.loads(zlib.decompress(found[0]))) if found is not None else None


class SharedRuns:
    """ASGI middleware: recomputes a run this copy lacks from the request another copy recorded.

    create_app adds it where copies share runs: inside ClientIdentity, so a request without a
    valid key never starts a forward (nor learns whether a text was ever run: its id is a hash of
    it), and its client's fair share pays for the forward; inside HeadAsGet, so HEAD is answered
    as GET; inside AccessLog, so the request's logged time includes the recompute.
    The recording itself is done by the app's AttentionService, for each run it computes
    (create_app's `run_directory`), so a POST is neither buffered nor parsed twice here.
    `directory` has async remember(entries), recall(run_id) and hold_while(holds). The service
    awaits remember before the request that computed the runs answers: its client's next request
    (a slice of the run) may reach another copy at once, which found nothing when the record was
    still being written, and answered 404 unknown_run."""

    # A recompute the service refused for now (busy, not ready, out of time) is answered as such,
    # with its Retry-After: the 404 "POST it again" of a run never seen would send the client
    # to repeat its POST into the same refusal.
    TRANSIENT = frozenset({429, 503, 504})

    def __init__(self, app, directory) -> None:
        self.app = app
        self.directory = directory
        # run id -> the one recompute of it under way: requests that need the same run at once
        # (a page's tiles, a script's slices) wait for it rather than each running a forward.
        self._under_way: dict[str, asyncio.Task] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            match = RUN_PATH.match(scope["path"])
            if match:
                try:
                    recomputed = await self._recomputed(scope, match[1])
                except ApiError as exc:
                    await send_error(send, exc.status, exc.code, exc.message,
                                     [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()])
                    return
                if recomputed:
                    send = with_header(send, b"x-manyeyes-recomputed", b"1")
        return await self.app(scope, receive, send)

    async def _recomputed(self, scope, run_id: str) -> bool:
        """True when this copy lacked the run and has now computed it (or waited for the request
        that did); raises the service's error where it refused for now."""
        service = getattr(scope["app"].state, "service", None)
        if service is None or service.cache.get(run_id) is not None:
            return False
        task = self._under_way.get(run_id)
        if task is None:
            client = scope.get("state", {}).get("client", "")
            task = self._under_way[run_id] = asyncio.ensure_future(self._recompute(service, run_id, client))
            task.add_done_callback(lambda done: self._finished(run_id, done))
        # Shielded: a client that hangs up leaves the forward to those still waiting for it.
        return await asyncio.shield(task)

    def _finished(self, run_id: str, task: asyncio.Task) -> None:
        self._under_way.pop(run_id, None)
        if not task.cancelled():
            task.exception()  # retrieved, though every waiter may have hung up: no "never retrieved" warning

    async def _recompute(self, service, run_id: str, client: str) -> bool:
        from manyeyes.app.schemas import AttentionRequest

        request = await self.directory.recall(run_id)
        if request is None:
            return False  # never seen anywhere: the app answers its 404 unknown_run
        # Made under the key it was made under (its id says so), charged to this request's client,
        # and kept as the copy that made it keeps it (queries and keys or weights; on a GPU, its
        # precision): the same id answered 200 from one copy and 422 kept_qk from the other.
        # A record of five is an older version's, left in Ray's detached actor across an upgrade.
        model, text, pair, truncate, owner, *kept = request
        keep, precision = kept or ("auto", "json")
        probe = AttentionRequest(text=text, text_pair=pair, model=model, truncate=truncate, keep=keep,
                                 layers=[0], heads=[0], format=precision)
        try:
            await service.attend([(text, pair)], probe, batch=False, started=time.monotonic(), client=client, tenant=owner)
        except ApiError as exc:
            log.warning("recomputing run %s failed: %s %s", run_id, exc.code, exc.message)
            if exc.status in self.TRANSIENT:
                raise
            return False  # the app then answers for itself (404 unknown_run)
        return True


class ReadyMarks:
    """Which workers have loaded their models: one empty file per worker slot (and one holding the
    reason where a worker's load failed), so that any worker's /readyz can say whether all have.
    Each answered for itself before, so a load balancer that saw one worker's 200 sent requests
    to workers still loading, which answered 503. A slot's mark stays when its worker is replaced:
    a replacement takes connections only once loaded."""

    def __init__(self, folder: Path, slot: int, workers: int) -> None:
        self.folder = Path(folder)
        self.slot = slot
        self.workers = workers

    def mark(self, failure: str | None = None) -> None:
        if failure is None:
            (self.folder / str(self.slot)).touch()
            (self.folder / f"{self.slot}.failed").unlink(missing_ok=True)  # a replacement that loaded
        else:
            (self.folder / f"{self.slot}.failed").write_text(failure)

    def waiting(self) -> list[int]:
        return [slot for slot in range(self.workers) if not (self.folder / str(slot)).exists()]

    def failed(self, waiting: list[int]) -> dict[int, str]:
        """Of the slots `waiting()` named: slot -> why its worker could not load (a GPU out of
        memory for the eighth copy, say)."""
        found = {}
        for slot in waiting:
            try:
                found[slot] = (self.folder / f"{slot}.failed").read_text()
            except FileNotFoundError:
                pass
        return found

    def marking_once_loaded(self, app) -> None:
        """Mark this worker's slot once the app's models are loaded, or say why they could not be."""
        inner = app.router.lifespan_context

        async def mark_when_loaded(registry) -> None:
            await loaded_or_failed(registry)
            await run_in_threadpool(self.mark, registry.failure)

        @asynccontextmanager
        async def marking_lifespan(a):
            async with inner(a):
                waiter = asyncio.create_task(mark_when_loaded(a.state.registry))
                try:
                    yield
                finally:
                    waiter.cancel()

        app.router.lifespan_context = marking_lifespan


async def loaded_or_failed(registry, timeout_s: float | None = None) -> bool:
    """Wait until the registry's models are loaded (True), or their load failed or `timeout_s`
    passed (False). The load runs on a thread of its own, so this looks every 50 ms."""
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    while not registry.ready.is_set():
        if registry.failure or (deadline is not None and time.monotonic() > deadline):
            return False
        await asyncio.sleep(0.05)
    return True


def serve_once_loaded(app, timeout_s: float = 600.0, on_failure=None) -> None:
    """Hold the app's start-up (its ASGI lifespan) until every model is loaded, so that a copy
    takes no requests it would answer 503 while others are ready; a failed load fails the start.
    on_failure(reason) first hears why: the host may drop the exception's words (Ray Serve does)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def loaded_lifespan(a):
        async with inner(a):
            registry = a.state.registry
            if not await loaded_or_failed(registry, timeout_s):
                reason = registry.not_ready_reason()
                if on_failure is not None:
                    on_failure(reason)
                raise RuntimeError(f"manyeyes: not ready: {reason}")
            yield

    app.router.lifespan_context = loaded_lifespan


def with_header(send, name: bytes, value: bytes):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sending
