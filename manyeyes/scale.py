"""Scale-out on Ray Serve: the same FastAPI app (`create_app`) as a deployment of N replicas.

    pip install '.[scale]'                   # in a checkout: ray[serve]
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
- No sticky sessions (manyeyes.app.shared_runs): every replica records the request behind each run
  id it computes in one small shared actor (texts only, an LRU); a replica asked for a slice of a
  run it does not hold recomputes it from there. Answers so made carry `X-Manyeyes-Recomputed: 1`.
  Saved views (the page's permalinks) are kept in another small actor, so a link saved through
  one replica opens through any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import OrderedDict

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("Ray Serve is not installed: pip install 'ray[serve]>=2.40' (the scale extra: "
                      "pip install '.[scale]' in a checkout)") from exc

from manyeyes.app.config import Settings
from manyeyes.app.shared_runs import OWNER_SHARE, SharedUnreachable, hold_to_share, serve_once_loaded

NAMESPACE = "manyeyes"
DIRECTORY = "manyeyes-run-directory"
VIEWS = "manyeyes-views"
SHELF_TIMEOUT_S = 10.0
DIRECTORY_BYTES = 64 * 2**20  # of request texts: ~650,000 short sentences
LOAD_TIMEOUT_S = 600.0
APP = "manyeyes"  # the application's name on Serve: what stopping takes off it
log = logging.getLogger("manyeyes.scale")


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


@ray.remote(num_cpus=0)
class ViewShelf:
    """Saved views' bytes under their ids, with when each was saved, bounded in bytes (oldest
    out first), an owner's within its share (OWNER_SHARE): what SharedFiles is to worker
    processes, for replicas anywhere."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.entries: OrderedDict[str, tuple[bytes, float, str]] = OrderedDict()

    def put(self, key: str, data: bytes, owner: str = "") -> None:
        old = self.entries.pop(key, None)
        self.nbytes += len(data) - (len(old[0]) if old else 0)
        self.entries[key] = (data, time.time(), owner)
        if owner:  # saves are rare and the shelf small: its owner's bytes are counted when asked
            held = [sum(len(entry[0]) for entry in self.entries.values() if entry[2] == owner)]

            def drop(old: str) -> None:
                dropped = self.entries.pop(old)[0]
                self.nbytes -= len(dropped)
                held[0] -= len(dropped)

            hold_to_share(self.entries, lambda k: self.entries[k][2], owner, key,
                          lambda: held[0] > self.max_bytes // OWNER_SHARE, drop)
        while self.nbytes > self.max_bytes and self.entries:
            _, (dropped, *_) = self.entries.popitem(last=False)
            self.nbytes -= len(dropped)

    def read(self, key: str) -> tuple[bytes, float] | None:
        entry = self.entries.get(key)
        return entry[:2] if entry is not None else None


class RayShelf:
    """ViewStore's shared store over the ViewShelf actor. Both calls wait for the actor (the view
    routes run on the thread pool, not the event loop): a saved view's id is handed out only once
    every replica can open it. An actor that cannot be reached is SharedUnreachable: the replica
    keeps views itself until it answers again."""

    def __init__(self, actor, max_bytes: int) -> None:
        self.actor = actor
        self.max_bytes = max_bytes  # the actor's bound: ViewStore refuses a view it would not take

    def put(self, key: str, data: bytes, owner: str = "") -> None:
        try:
            ray.get(self.actor.put.remote(key, data, owner), timeout=SHELF_TIMEOUT_S)
        except ray.exceptions.RayError as exc:  # a timeout too (GetTimeoutError)
            raise SharedUnreachable(f"the replicas' view shelf: {exc}") from None

    def read(self, key: str) -> tuple[bytes, float] | None:
        try:
            return ray.get(self.actor.read.remote(key), timeout=SHELF_TIMEOUT_S)
        except ray.exceptions.RayError as exc:  # a timeout too (GetTimeoutError)
            raise SharedUnreachable(f"the replicas' view shelf: {exc}") from None


def view_shelf() -> RayShelf:
    """The replicas' one shelf of views, made by the first replica to ask, under its bound."""
    from manyeyes.app.services.views import MAX_VIEW_BYTES

    actor = ViewShelf.options(name=VIEWS, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote(MAX_VIEW_BYTES)
    return RayShelf(actor, MAX_VIEW_BYTES)


def run_directory():
    return RunDirectory.options(name=DIRECTORY, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


class RayDirectory:
    """SharedRuns' directory over the RunDirectory actor."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def hold_while(self, holds) -> None:
        """Nothing: the actor is one LRU for replicas anywhere, and cannot ask their caches."""

    async def remember(self, entries: list[tuple[str, tuple]]) -> None:
        try:
            async with asyncio.timeout(SHELF_TIMEOUT_S):
                await self.actor.remember.remote(entries)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # the other replicas recompute nothing, they answer 404
            log.warning("could not record runs for the other replicas: %s", exc)

    async def recall(self, run_id: str) -> tuple | None:
        return await self.actor.recall.remote(run_id)


class ForRayProxy:
    """What Ray Serve's HTTP proxy, between the client and every replica, asks of the app's answers.

    - Bodies as bytes, as the ASGI spec says: Ray pickles every message between the replica and its
      proxy, and the app sends large answers as memoryview pieces (no copy under uvicorn), which do
      not pickle: every answer over 256 KiB was a plain-text 500.
    - No X-Request-ID of the app's: the proxy puts one on every answer itself (the request's own, or
      one it makes and hands the app as the request's), so each answer carried two.
      The app logs that same id; only one it would not use (over 64 characters, odd ones: see
      app/middleware.py) is answered as sent while the log line gets one of the app's making.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def send_to_proxy(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(name, value) for name, value in message.get("headers", [])
                                                   if name.lower() != b"x-request-id"]}
            body = message.get("body")
            if body is not None and not isinstance(body, bytes):
                message = {**message, "body": bytes(body)}
            await send(message)

        await self.app(scope, receive, send_to_proxy if scope["type"] == "http" else send)


def build_app(settings: Settings, threads: int):
    """The app one replica serves: create_app's, started only once its models are loaded."""
    import torch

    from manyeyes.app.main import create_app
    from manyeyes.app.services.views import ViewStore

    torch.set_num_threads(threads)
    directory = RayDirectory(run_directory())
    app = create_app(settings, run_directory=directory)
    serve_once_loaded(app, LOAD_TIMEOUT_S, on_failure=record_failure)
    app.state.views = ViewStore(shared=view_shelf())
    app.add_middleware(ForRayProxy)
    return app


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
            registry = self.app.state.registry
            if not registry.ready.is_set():
                raise RuntimeError(registry.not_ready_reason())

    return Manyeyes.bind()


# Where a replica whose models failed to load leaves its reason for the driver: Ray Serve keeps
# only "ASGI lifespan startup failed. Check replica logs for details.", and the driver's exception
# says "Failed to update the deployments ['manyeyes']".
FAILURE_KEY = b"manyeyes:start-failure"


def record_failure(reason: str) -> None:
    try:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(FAILURE_KEY, reason.encode(), overwrite=True, namespace=NAMESPACE)
    except Exception as exc:  # noqa: BLE001 (the replica's own log still says why)
        log.warning("could not leave the reason for the driver: %s", exc)


def recorded_failure() -> str | None:
    """The reason a replica left, if one did."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        found = _internal_kv_get(FAILURE_KEY, namespace=NAMESPACE)
        return found.decode() if found else None
    except Exception:  # noqa: BLE001 (Ray's private KV moved: the generic line is said instead)
        return None


def forget_failure() -> None:
    """Before a deployment: a reason left by the last one is not this one's."""
    with contextlib.suppress(Exception):
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(FAILURE_KEY, namespace=NAMESPACE)


def running_serve() -> tuple[str, int] | None:
    """Where the Serve already running on the cluster takes HTTP (host, port); None where none runs."""
    # Ray has no public call for it: serve.status() names no address, and serve.start() on a running
    # Serve keeps its address and drops the one asked for with a log line. Both read it so.
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else (client.http_config.host, client.http_config.port)


def stop(started_serve: bool) -> None:
    """Take manyeyes' application off Serve; and Serve itself, if this process started it and no
    other application runs on it now."""
    # Serve belongs to the cluster, not to this process: serve.shutdown() here took every other
    # application on a shared cluster down with it. A Serve this process started goes
    # too, once nothing else runs on it: on a cluster joined through RAY_ADDRESS its actors outlive
    # this process and would hold the port asked for with nothing behind it.
    if local_cluster_gone():
        # A SIGTERM to the whole process group (`timeout`, `kill -- -PGID`) or cgroup (systemd) took
        # the local Ray's own processes with this one: serve.delete waited 60 s on the dead GCS, then
        # Ray ended the process with status 1. The replicas went with them; nothing is left to stop.
        print("manyeyes: Ray's own processes were stopped by the same signal; the replicas went with them",
              file=sys.stderr)
        return
    serve.delete(APP)
    if not serve.status().applications:
        # Only then: a `serve run` of app_builder beside it (another application name) shares the
        # replicas' directory and shelf, and its saved views went with a failed start of this one.
        drop_shared()
        if started_serve:
            serve.shutdown()


# Ray's processes without which nothing can be asked of the cluster.
CLUSTER_CORE = ("gcs_server", "raylet")


def local_cluster_gone(wait_s: float = 1.0) -> bool:
    """Whether the Ray this process started (not one joined through RAY_ADDRESS) lost its GCS or
    raylet. Waited for up to wait_s: they get a group's signal at the same moment as this process,
    and take a few milliseconds to go. Ray names no public call for it; where its node is not
    where it was (another Ray version), the answer is no, and stopping goes on as it did."""
    try:
        processes = ray._private.worker._global_node.all_processes or {}
    except AttributeError:  # no node of this process's (None), or not where it was
        return False
    core = [info.process for kind in CLUSTER_CORE for info in processes.get(kind, [])]
    if not core:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        if any(process.poll() is not None for process in core):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def drop_shared() -> None:
    """The replicas' run directory and view shelf, detached so that every replica finds them: they
    outlived the application, holding up to 64 MB of users' texts and 16 MiB of views on a shared
    cluster until `ray stop`."""
    for name in (DIRECTORY, VIEWS):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # none made yet: no replica asked
            pass


# SIGHUP where there is one (not on Windows), as server.py and workers.py take it.
STOP_SIGNALS = (signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


def interrupt(signum, _frame) -> None:
    """SIGTERM and SIGHUP end `serve --replicas` as Ctrl-C does: Ray's driver printed a crash dump
    for a supervisor's SIGTERM and took every replica down at once, unsettled. A second one while
    it stops is ignored (it raised in the middle of stopping: a traceback, half stopped)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt


def serve_replicas(settings: Settings, *, host: str, port: int, replicas: int, threads: int) -> int:
    """`manyeyes serve --replicas N`: start (or join, with RAY_ADDRESS) Ray, deploy, block. A
    deployment that fails is one line and status 2, as every other start-up failure of the CLI."""
    if not ray.is_initialized():
        # ray.init sets the driver's SIGTERM handler (sys.exit): set before it, ours was replaced,
        # and a supervisor's SIGTERM aborted the driver with a crash dump, the replicas left running.
        ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, include_dashboard=False)
    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        return _serve_replicas(settings, host=host, port=port, replicas=replicas, threads=threads)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve_replicas(settings: Settings, *, host: str, port: int, replicas: int, threads: int) -> int:
    running = running_serve()
    # A running Serve cannot move: serving on it anyway answered on its port while the banner named
    # the one asked for, where nothing listened.
    if running is not None and running != (host, port):
        on, at = running
        print(f"error: Ray Serve already runs on this Ray cluster and takes HTTP on {on}:{at}, not {host}:{port}: "
              f"run with --host {on} --port {at} to serve there", file=sys.stderr)
        return 2
    # Deploying under a name taken replaced that application, and stopping then removed it.
    if running is not None and APP in serve.status().applications:
        print(f"error: an application named {APP} already runs on this Ray Serve: stop it first (Ctrl-C the "
              f"manyeyes serve that started it; one left behind goes with ray.serve.delete({APP!r}))", file=sys.stderr)
        return 2
    started_serve = running is None
    forget_failure()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(settings, replicas=replicas, threads=threads), name=APP, route_prefix="/")
    except KeyboardInterrupt:  # while the replicas start: a traceback of Ray's wait loop said nothing
        stop(started_serve)
        return 130
    except Exception as exc:  # noqa: BLE001 (Ray raises RuntimeError, or its own errors)
        reason = recorded_failure() or f"{str(exc).strip().splitlines()[0]} (the replicas' logs say why)"
        print(f"error: the replicas did not start: {reason}", file=sys.stderr)
        stop(started_serve)
        return 2
    each = "1 thread" if threads == 1 else f"{threads} threads"
    print(f"manyeyes: {replicas} replicas on Ray Serve at http://{host}:{port} ({each} each)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop(started_serve)
    return 0


# What `serve run manyeyes.scale:app_builder key=value ...` takes; every other setting is MANYEYES_*'s.
BUILDER_ARGS = ("replicas", "threads")


def app_builder(args: dict[str, str]):
    """`serve run manyeyes.scale:app_builder replicas=2 threads=1`; other settings from MANYEYES_*.
    Serve's address is not one of them: Serve's own (`serve start --http-port`, a config file's
    http_options)."""
    # An argument not read was dropped without a word: `port=8869` served on Serve's port instead.
    unknown = sorted(set(args) - set(BUILDER_ARGS))
    if unknown:
        raise ValueError(f"app_builder takes {' and '.join(BUILDER_ARGS)}, not {', '.join(unknown)} (other settings are "
                         "MANYEYES_* variables; Serve's port is `serve start --http-port` or a config file's http_options)")
    counts = {}
    for name in BUILDER_ARGS:
        value = str(args.get(name, 1))
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"app_builder's {name} is a whole number of at least 1, not {value!r}")
        counts[name] = int(value)
    return deployment(**counts)
