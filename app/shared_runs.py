"""Runs and views shared between copies of the app (worker processes, Ray Serve replicas).

Each copy keeps its own run cache, and a client's requests may reach any copy. So every copy
records the request behind each run id it computes (texts only, small) in a directory the copies
share; a copy asked for a slice of a run it does not hold looks the request up and recomputes the
run (one forward pass) before answering, and says so with `X-Manyeyes-Recomputed: 1`. A run id is
a hash of (model, text, pair, truncate), so the recomputed run is the same run.

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
from collections import OrderedDict
from contextlib import asynccontextmanager
from pathlib import Path

import orjson

log = logging.getLogger("manyeyes.shared")

RUN_PATH = re.compile(r"^/api/v1/runs/([^/]+)/")
POST_PATHS = ("/api/v1/attention", "/api/v1/attention/batch")
# Run and view ids are short hex digests; nothing else ever becomes a file name.
KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def requests_in(path: str, body: bytes, default_model: str) -> list[tuple[str, tuple]]:
    """(run id, request) for every text a successful POST ran; nothing for a body the app refused."""
    from manyeyes.app.services.cache import run_id_for

    try:
        data = orjson.loads(body)
        model = data.get("model") or default_model
        truncate = bool(data.get("truncate", False))
        pairs = [(data["text"], data.get("text_pair"))] if path == POST_PATHS[0] else [(t, None) for t in data["texts"]]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        return []
    return [(run_id_for(model, text, pair, truncate), (model, text, pair, truncate)) for text, pair in pairs]


class SharedFiles:
    """Small entries as files that several processes share: each writes into a folder of its own
    inside `folder` and evicts only what it wrote, oldest first, within its own share of the bytes,
    so no process needs a lock on another's bookkeeping; a reader looks in every process's folder.
    Writes are atomic (a temporary file, then a rename). A process started in a dead one's place
    gets its folder emptied first (the parent does that), so the bytes stay bounded across restarts."""

    def __init__(self, folder: Path, own: str, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.own = self.folder / own
        self.own.mkdir(exist_ok=True)
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._mine: OrderedDict[str, int] = OrderedDict()
        # Writers are threads (the executor's, the sync routes'): one at a time per process.
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        if not KEY.match(key) or len(data) > self.max_bytes:
            return
        with self._lock:
            temporary = self.own / f".{key}"
            temporary.write_bytes(data)
            os.replace(temporary, self.own / key)
            self.nbytes += len(data) - self._mine.pop(key, 0)
            self._mine[key] = len(data)
            while self.nbytes > self.max_bytes:
                old, size = self._mine.popitem(last=False)
                self.nbytes -= size
                (self.own / old).unlink(missing_ok=True)

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
    """run id -> the request that makes it, for worker processes on one machine."""

    def __init__(self, files: SharedFiles) -> None:
        self.files = files

    def remember(self, entries: list[tuple[str, tuple]]) -> None:
        # Off the event loop: the folder is memory (/dev/shm) where there is one, but need not be.
        def write() -> None:
            try:
                for run_id, request in entries:
                    self.files.put(f"run-{run_id}", orjson.dumps(request))
            except OSError as exc:  # a full folder: other workers recompute nothing, they answer 404
                log.warning("could not record runs for the other workers: %s", exc)

        asyncio.get_running_loop().run_in_executor(None, write)

    async def recall(self, run_id: str) -> tuple | None:
        found = await asyncio.get_running_loop().run_in_executor(None, self.files.read, f"run-{run_id}")
        return tuple(orjson.loads(found[0])) if found is not None else None


class SharedRuns:
    """ASGI wrapper: records the requests behind runs, and recomputes a run this copy lacks.

    `directory` has remember(entries) (fire and forget) and async recall(run_id)."""

    def __init__(self, app, directory) -> None:
        self.app = app
        self.directory = directory

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if scope["method"] == "POST" and path in POST_PATHS:
            return await self._remembering(scope, receive, send)
        match = RUN_PATH.match(path)
        if scope["method"] == "GET" and match and await self._recompute(match[1]):
            send = with_header(send, b"x-manyeyes-recomputed", b"1")
        return await self.app(scope, receive, send)

    async def _remembering(self, scope, receive, send) -> None:
        state = self.app.state
        limit = state.settings.max_body_bytes
        chunks, size, more = [], 0, True
        while more and size <= limit:  # a body over the limit streams on and the app refuses it
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message)
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        buffered = list(chunks)

        async def replay():
            return buffered.pop(0) if buffered else await receive()

        status = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, replay, watch)
        if status.get("code") == 200 and not more:
            body = b"".join(m.get("body", b"") for m in chunks)
            entries = requests_in(scope["path"], body, state.settings.default_model_id())
            if entries:
                self.directory.remember(entries)  # the answer is already sent

    async def _recompute(self, run_id: str) -> bool:
        """True when this copy lacked the run and has now computed it from its recorded request."""
        from manyeyes.app.schemas import AttentionRequest
        from manyeyes.app.services.errors import ApiError

        service = getattr(self.app.state, "service", None)
        if service is None or service.cache.get(run_id) is not None:
            return False
        request = await self.directory.recall(run_id)
        if request is None:
            return False  # never seen anywhere: the app answers its 404 unknown_run
        model, text, pair, truncate = request
        probe = AttentionRequest(text=text, text_pair=pair, model=model, truncate=truncate, layers=[0], heads=[0], format="json")
        try:
            await service.attend([(text, pair)], probe, batch=False, started=time.monotonic())
        except ApiError as exc:
            log.warning("recomputing run %s failed: %s %s", run_id, exc.code, exc.message)
            return False  # the app then answers for itself (404 unknown_run)
        return True


def serve_once_loaded(app, timeout_s: float = 600.0) -> None:
    """Hold the app's start-up (its ASGI lifespan) until every model is loaded, so that a copy
    takes no requests it would answer 503 while others are ready; a failed load fails the start."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def loaded_lifespan(a):
        async with inner(a):
            registry = a.state.registry
            deadline = time.monotonic() + timeout_s
            while not registry.ready.is_set():
                if registry.failure or time.monotonic() > deadline:
                    raise RuntimeError(f"manyeyes: not ready: {registry.not_ready_reason()}")
                await asyncio.sleep(0.05)
            yield

    app.router.lifespan_context = loaded_lifespan


def with_header(send, name: bytes, value: bytes):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sending
