"""Scale-out on Ray Serve: the same FastAPI app (`create_app`) as a deployment of N replicas.

    pip install 'manyeyes[scale]'
    manyeyes serve --replicas 2 [--threads 1]          # local Ray, or the cluster in RAY_ADDRESS
    serve run manyeyes.scale:app_builder replicas=2    # Ray's own CLI; MANYEYES_* settings apply

What Ray adds, and how each promise of the single server is kept behind it:

- Ready means loaded. A replica's start (its ASGI lifespan) finishes only once every model is
  loaded and warmed up, so Ray sends it no traffic before; `check_health` then keeps reporting the
  registry's state, and a failed load fails the replica instead of serving 503s.
- Overload is the app's JSON 429 with Retry-After, never Ray's plain-text 503: Ray's own queue is
  unbounded (max_queued_requests=-1) and each replica accepts more requests at once than the app
  admits (max_ongoing_requests > MANYEYES_MAX_QUEUE), so the app's admission control answers first.
- Threads are set per replica: torch's intra-op pool and OMP/MKL get `threads`, and Ray reserves
  as many CPUs for the replica, so replicas on one machine do not oversubscribe its cores.
- No sticky sessions. A run id is a hash of (model, text, pair, truncate). Every replica records
  the request behind each run id it computes in one small shared actor (texts only, an LRU); a
  replica asked for a slice of a run it does not hold looks the request up and recomputes the run
  (one forward pass) before answering. Answers so made carry `X-Manyeyes-Recomputed: 1`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import OrderedDict
from contextlib import asynccontextmanager

import orjson

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("Ray Serve is not installed: pip install 'manyeyes[scale]'") from exc

from manyeyes.app.config import Settings

log = logging.getLogger("manyeyes.scale")

NAMESPACE = "manyeyes"
DIRECTORY = "manyeyes-run-directory"
DIRECTORY_BYTES = 64 * 2**20  # of request texts: ~650,000 short sentences
LOAD_TIMEOUT_S = 600.0
RUN_PATH = re.compile(r"^/api/v1/runs/([^/]+)/")
POST_PATHS = ("/api/v1/attention", "/api/v1/attention/batch")


@ray.remote(num_cpus=0)
class RunDirectory:
    """run id -> the request that makes it (model, text, pair, truncate), bounded in bytes."""

    def __init__(self, max_bytes: int = DIRECTORY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.requests: OrderedDict[str, tuple] = OrderedDict()

    def remember(self, entries: list[tuple[str, tuple]]) -> None:
        for run_id, request in entries:
            size = len(run_id) + sum(len(s or "") for s in request[:3])
            if run_id in self.requests:
                self.requests.move_to_end(run_id)
                continue
            self.requests[run_id] = request
            self.nbytes += size
            while self.nbytes > self.max_bytes and self.requests:
                old_id, old = self.requests.popitem(last=False)
                self.nbytes -= len(old_id) + sum(len(s or "") for s in old[:3])

    def recall(self, run_id: str) -> tuple | None:
        return self.requests.get(run_id)


def run_directory():
    return RunDirectory.options(name=DIRECTORY, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


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


class SharedRuns:
    """ASGI wrapper: records the requests behind runs, and recomputes a run this replica lacks."""

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
        if scope["method"] == "GET" and match and await self._recompute(match[1], send):
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
                self.directory.remember.remote(entries)  # fire and forget: the answer is already sent

    async def _recompute(self, run_id: str, send) -> bool:
        """True when this replica lacked the run and has now computed it from its recorded request."""
        from manyeyes.app.main import error_response
        from manyeyes.app.schemas import AttentionRequest
        from manyeyes.app.services.errors import ApiError

        service = getattr(self.app.state, "service", None)
        if service is None or service.cache.get(run_id) is not None:
            return False
        request = await self.directory.recall.remote(run_id)
        if request is None:
            return False  # never seen anywhere: the app answers its 404 unknown_run
        model, text, pair, truncate = request
        probe = AttentionRequest(text=text, text_pair=pair, model=model, truncate=truncate, layers=[0], heads=[0], format="u8")
        try:
            await service.attend([(text, pair)], probe, batch=False, started=time.monotonic())
        except ApiError as exc:
            log.warning("recomputing run %s failed: %s %s", run_id, exc.code, exc.message)
            return False  # the app then answers for itself (404 unknown_run)
        return True


def with_header(send, name: bytes, value: bytes):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sending


def build_app(settings: Settings, threads: int):
    """The app one replica serves: create_app's, started only once its models are loaded."""
    import torch

    from manyeyes.app.main import create_app

    torch.set_num_threads(threads)
    app = create_app(settings)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def loaded_lifespan(a):
        async with inner(a):
            registry = a.state.registry
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while not registry.ready.is_set():
                if registry.failure or time.monotonic() > deadline:
                    raise RuntimeError(f"manyeyes replica not ready: {registry.not_ready_reason()}")
                await asyncio.sleep(0.05)
            yield

    app.router.lifespan_context = loaded_lifespan
    return SharedRuns(app, run_directory())


def deployment(settings: Settings | None = None, *, replicas: int = 1, threads: int = 1):
    """A bound Ray Serve application of `replicas` copies of the app, `threads` CPU threads each."""
    settings = settings or Settings()

    def build():
        return build_app(settings, threads)

    @serve.deployment(
        name="manyeyes",
        num_replicas=replicas,
        max_ongoing_requests=settings.max_queue + 32,  # above the app's own admission, so its 429 answers first
        max_queued_requests=-1,  # Ray never answers 503 for back pressure; the app's 429 does
        ray_actor_options={
            "num_cpus": threads,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}},
        },
        health_check_period_s=5,
    )
    @serve.ingress(build)
    class Manyeyes:
        def check_health(self) -> None:
            registry = self.app.app.state.registry
            if not registry.ready.is_set():
                raise RuntimeError(registry.not_ready_reason())

    return Manyeyes.bind()


def serve_replicas(settings: Settings, *, host: str, port: int, replicas: int, threads: int) -> int:
    """`manyeyes serve --replicas N`: start (or join, with RAY_ADDRESS) Ray, deploy, block."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(settings, replicas=replicas, threads=threads), name="manyeyes", route_prefix="/")
    print(f"manyeyes: {replicas} replicas on Ray Serve at http://{host}:{port} ({threads} threads each)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def app_builder(args: dict[str, str]):
    """`serve run manyeyes.scale:app_builder replicas=2 threads=1`; other settings from MANYEYES_*."""
    return deployment(replicas=int(args.get("replicas", 1)), threads=int(args.get("threads", 1)))
