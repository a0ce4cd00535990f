"""`manyeyes serve --workers N`: N copies of the app in N processes on one port.

On an H200 one process answered about 1,200 fresh T=16 requests a second, where the forward
itself would take 14,500 inputs a second: its HTTP handling, tokenizer and forward launches share
one interpreter lock (README, "GPU"). More processes multiply that. The kernel spreads
connections over the workers (on Linux each listens on a socket of its own: spread_by_kernel);
every worker loads the models (each its own copy on the GPU) and keeps its own run cache, fair
shares and limits. They share four things through files in one folder (/dev/shm where there is
one): the requests behind run ids, so a slice of a run another worker computed is recomputed here
(app/shared_runs.py); saved views, so a permalink opens through any worker; which workers have
loaded, so /readyz says 200 only once all have; and Prometheus values, so /metrics adds up every
worker's. With --shared-forward one more process runs their forwards of short inputs
(services/shared_forward.py), supervised as they are.

The parent holds the port, starts the workers with the spawn method (nothing of torch or CUDA is
inherited), starts another in place of one that dies, and on SIGTERM, SIGINT or SIGHUP sends each
worker one SIGTERM, so that it drains its requests as a single server does. It reads the API keys
once, at its start, and hands them to every worker it starts, a replacement included.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import values
from prometheus_client.multiprocess import mark_process_dead

from manyeyes.app.config import Settings
from manyeyes.app.logs import log_to_stderr
from manyeyes.app.server import bound_socket

log = logging.getLogger("manyeyes.workers")

# Each worker's share of the shared folder: request texts for run ids, and saved views.
RUN_DIRECTORY_BYTES = 64 * 2**20
# A replacement that dies soon after its start is started again after a pause that doubles each
# time (a model that cannot load must not become a process a second); a first death, or one after
# a long life, after one second.
RESTART_PAUSE_S = 1.0
MAX_RESTART_PAUSE_S = 60.0
LIVED_LONG_S = 60.0
# Of the grace, what a stop keeps for after its deadline: the kills, the joins, the shared
# folder's removal and the exit (0.05-0.26 s measured under load).
EXIT_MARGIN_S = 0.3
# The parent's pid follows: a folder left by a parent that was killed outright says whose it was.
FOLDER_PREFIX = "manyeyes-shared-"


def restart_pause(last: float, replacement: bool, lived_s: float) -> float:
    """The pause before a dead process's slot is started again: it doubles (up to a minute) while
    replacements die young, a crash loop; a first death, or one after a long life, waits a second."""
    return min(2 * last, MAX_RESTART_PAUSE_S) if replacement and lived_s <= LIVED_LONG_S else RESTART_PAUSE_S


def spread_by_kernel() -> bool:
    """Whether each worker listens on a socket of its own on the port (SO_REUSEPORT, as Linux
    has it: the kernel hashes each new connection to one of the listening sockets), rather than
    all of them accepting from one shared socket. From one socket, whichever worker woke first
    took every connection queued: 128 connections opened at once went 64, 58, 5 and 1 to four
    workers, and a worker holding one kept-alive client serves a fraction of what it can while
    the others queue. Hashed, the same 128 went 38, 34, 30 and 26. Not on macOS or the BSDs, whose
    SO_REUSEPORT hands every connection to the last socket bound."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def default_threads(workers: int) -> int:
    """Torch's CPU threads per worker: the cores shared out, so workers do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // workers)


def worker_app(settings: Settings, folder: Path, slot: int, workers: int, replacement: bool = False, forward_link=None,
               keys=None):
    """One worker's ASGI app: create_app's, sharing runs and views with the other workers; what
    it writes goes in folder/<slot>. A replacement for a dead worker takes connections only once
    its models are loaded (the others are serving); the first workers take them at once, so that
    /healthz answers while the models load, as a single server's does. `keys`: the parent's
    KeyRing, read once at its start, so that every worker, a replacement too, opens the API to
    the same keys (None: read from `settings`)."""
    from manyeyes.app.main import create_app
    from manyeyes.app.services.views import MAX_VIEW_BYTES, ViewStore
    from manyeyes.app.shared_runs import FileDirectory, ReadyMarks, SharedFiles, serve_once_loaded

    directory = FileDirectory(SharedFiles(folder / "runs", str(slot), RUN_DIRECTORY_BYTES // workers))
    app = create_app(settings, run_directory=directory, forward_link=forward_link, keys=keys)
    if replacement:
        serve_once_loaded(app)
    app.state.ready_marks = ReadyMarks(folder / "ready", slot, workers)
    app.state.ready_marks.marking_once_loaded(app)
    app.state.views = ViewStore(shared=SharedFiles(folder / "views", str(slot), MAX_VIEW_BYTES // workers))
    return app


def _detach_from_terminal() -> None:
    """A terminal's Ctrl-C reaches the parent alone, which passes one SIGTERM on (a worker given
    SIGINT and SIGTERM both would stop at once instead of draining); and a worker whose parent is
    killed outright is told to stop (Linux), instead of serving on unsupervised."""
    if hasattr(os, "setpgrp"):  # POSIX; elsewhere a Ctrl-C reaches the workers too, and they stop at once
        os.setpgrp()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def metrics_identity(slot: int) -> str:
    """What names the metric files of the worker in `slot` (prometheus_client's process identifier).
    One worker runs in a slot at a time, which is all prometheus_client asks of it; no underscore,
    which its file names use as the separator."""
    return f"w{slot}"


def _work(settings: Settings, sock, folder: str, slot: int, workers: int, replacement: bool, threads: int, log_level: str,
          forward_link=None, own_socket: bool = False, keys=None) -> None:
    _detach_from_terminal()
    if own_socket:  # the parent's only holds the port: this worker listens on one of its own
        own = bound_socket(sock.family, sock.getsockname(), share_port=True)
        sock.close()
        sock = own
    import torch

    from manyeyes.app.server import Server, server_config

    # The slot, not the pid, names this worker's metric files: a replacement goes on adding to the
    # counts its dead predecessor left (the totals stay right), and the folder holds one set of
    # files a slot, where a crash loop had left a set for every process it ever started.
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: metrics_identity(slot))
    log_to_stderr(log_level, f"worker-{os.getpid()}")
    torch.set_num_threads(threads)
    app = worker_app(settings, Path(folder), slot, workers, replacement, forward_link, keys)
    config = server_config(app, settings, log_level=log_level)
    Server(config, on_exit=app.state.shutdown.begin).run(sockets=[sock])


def shared_models(settings: Settings) -> dict:
    """The configured models, loaded as a worker loads them (names that share weights share
    them here too), warmed up by one forward at the longest input the shared process takes."""
    from manyeyes.app.services.registry import load_configured, named, weights_key
    from manyeyes.model.attention import WEIGHTS_ONLY

    models, by_weights = {}, {}
    for model_id, spec in settings.all_models().items():
        first = by_weights.get(weights_key(spec))
        if first is not None:
            models[model_id] = named(first, model_id)
            continue
        model = load_configured(settings, model_id, spec)
        model.run([model.encode("hello " * settings.shared_forward_max_tokens, truncate=True)], WEIGHTS_ONLY)
        models[model_id] = by_weights[weights_key(spec)] = model
    return models


def _share_forwards(settings: Settings, link, threads: int, log_level: str) -> None:
    """The shared forward process: loads the models, then listens on link.address."""
    _detach_from_terminal()
    import torch
    from multiprocessing.connection import Listener

    from manyeyes.app.memory import prepare_serving_process
    from manyeyes.app.services.device import quantises_on_device
    from manyeyes.app.services.shared_forward import ForwardHost

    log_to_stderr(log_level, f"forwards-{os.getpid()}")
    torch.set_num_threads(threads)
    prepare_serving_process(settings)  # as a worker's: the same forwards, the same memory
    models = shared_models(settings)
    device = next(iter(models.values())).info.device
    host = ForwardHost(models, settings, quantises_on_device(device, settings.device_quantise))
    signal.signal(signal.SIGTERM, lambda *_: host.close())
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link.address)  # a predecessor's, if it died
    listener = Listener(link.address, family="AF_UNIX", authkey=link.authkey)
    log.info("shared forward process: %s on %s, inputs of up to %d tokens", ", ".join(models), device, link.max_tokens)
    host.serve(listener)


def remove_orphaned_folders(home: Path) -> None:
    """Remove shared folders whose parent is gone: one killed outright (SIGKILL, the OOM killer)
    never removed its own, and /dev/shm is memory. The parent's pid is in each folder's name."""
    for folder in home.glob(f"{FOLDER_PREFIX}*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).partition("-")[0]
        try:
            if not pid.isdigit() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except FileNotFoundError:  # another server starting at the same moment removed it first
            continue
        except ProcessLookupError:
            log.warning("removing %s, left by a server that is gone", folder)
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def serve_workers(settings: Settings, sock, *, workers: int, threads: int, log_level: str, keys=None) -> int:
    """Run `workers` processes on the port of the bound `sock` until SIGTERM, SIGINT or SIGHUP; the
    exit status. `keys`: the KeyRing every worker serves with (None: each reads `settings`'s).
    `sock` is bound without SO_REUSEPORT, so a port another server listens on, even one of ours,
    was refused; where the kernel spreads connections it is swapped for a socket of the port's
    group, which the parent holds and never listens on: it keeps the port for the workers (a
    replacement binds beside it) and no connection is ever queued on it."""
    own_socket = spread_by_kernel()
    if own_socket:
        address, family = sock.getsockname(), sock.family
        sock.close()
        sock = bound_socket(family, address, share_port=True)
    spawn = multiprocessing.get_context("spawn")
    shm = Path("/dev/shm")
    home = shm if shm.is_dir() else Path(tempfile.gettempdir())
    remove_orphaned_folders(home)
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=home))
    (folder / "ready").mkdir()
    # Set before any worker starts, so each one's prometheus_client keeps its values in files
    # there and every worker's /metrics adds them all up (services/metrics.py).
    (folder / "metrics").mkdir()
    own_metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder / "metrics")
    stopping = []
    link = None
    if settings.shared_forward:
        from manyeyes.app.services.shared_forward import ForwardLink, available

        if available():
            link = ForwardLink(str(folder / "forward.sock"), secrets.token_bytes(32), settings.shared_forward_max_tokens)
        else:
            log.warning("--shared-forward passes shared memory between processes as Linux does; here each worker "
                        "runs its own forwards")

    def start(slot: int, replacement: bool = False):
        if slot == workers:  # the slot after the workers': the shared forward process
            process = spawn.Process(target=_share_forwards, args=(settings, link, threads, log_level),
                                    name="manyeyes-forwards", daemon=False)
            process.start()
            return process
        for kind in ("runs", "views"):  # a replacement adopts what the dead worker in its slot wrote (SharedFiles)
            (folder / kind / str(slot)).mkdir(parents=True, exist_ok=True)
        process = spawn.Process(target=_work, args=(settings, sock, str(folder), slot, workers, replacement, threads, log_level,
                                                    link, own_socket, keys),
                                name="manyeyes-worker", daemon=False)
        process.start()
        return process

    def stop(signum, _frame):
        stopping.append((signum, time.monotonic()))

    # SIGHUP as SIGTERM (a closed terminal, or a "reload", which manyeyes has not): it killed the
    # parent outright, which left its shared folder behind.
    stop_signals = (signal.SIGTERM, signal.SIGINT, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))
    previous = {s: signal.signal(s, stop) for s in stop_signals}
    # The shared forward process, where there is one, is supervised as the slot after the workers'.
    slots = workers + (1 if link else 0)
    processes = [start(slot) for slot in range(slots)]
    started = [time.monotonic()] * slots
    replaced = [False] * slots  # only a replacement that dies young doubles the pause (README, Workers)
    pauses = [RESTART_PAUSE_S] * slots
    due: dict[int, float] = {}  # slot -> when its replacement starts
    try:
        while not stopping:
            now = time.monotonic()
            for i, process in enumerate(processes):
                if process.exitcode is not None and i not in due:
                    pauses[i] = restart_pause(pauses[i], replaced[i], now - started[i])
                    what = "the shared forward process" if i == workers else "worker"
                    log.warning("%s %d exited with %s; another starts in %.0f s", what, process.pid, process.exitcode, pauses[i])
                    if i < workers:
                        mark_process_dead(metrics_identity(i), str(folder / "metrics"))  # its gauges stop counting; its counters stay
                    due[i] = now + pauses[i]
            for i, when in list(due.items()):
                if now >= when:
                    del due[i]
                    processes[i], started[i], replaced[i] = start(i, replacement=True), now, True
            time.sleep(0.2)
        # Logged here, not in the signal handler; each worker logs its own drain as it begins.
        log.info("%s: stopping %d workers, each draining for up to %g s (MANYEYES_SHUTDOWN_GRACE_S)",
                 signal.Signals(stopping[0][0]).name, workers, settings.drain_s())
        # The workers first: while they drain, their last batches may still go to the shared forwards.
        # One deadline for both, the grace from the signal itself: each had the grace and 5 s more
        # of its own, so that with a shared forward process an exit took up to twice that (6.2 s
        # for a grace of 3 under load, review h51i). Its work is the workers': once they are gone,
        # it has nothing left to finish. Counted from when the loop noticed the signal, and with
        # nothing kept for what follows it (kills, joins, the folder's removal), an exit still
        # overran the grace by up to 0.26 s (review h54c).
        deadline = stopping[0][1] + settings.shutdown_grace_s - EXIT_MARGIN_S
        for group in (processes[:workers], processes[workers:]):
            for process in group:
                if process.exitcode is None:
                    os.kill(process.pid, signal.SIGTERM)  # each worker drains as a single server does
            for process in group:
                process.join(max(deadline - time.monotonic(), 0.0))
                if process.exitcode is None:
                    process.kill()
                    process.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if own_metrics_dir is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_metrics_dir
        shutil.rmtree(folder, ignore_errors=True)
    return 0
