"""`manyeyes serve --workers N`: N copies of the app in N processes on one listening socket.

One process answers at most about 1,200 fresh requests a second whatever the device, because its
HTTP handling, tokenizer and forward launches share one interpreter lock (measured on an H200,
where the forward itself would take 14,500 inputs a second at T=16; README, "GPU"). More processes
multiply that. The kernel spreads connections over the workers; every worker loads the models
(each its own copy on the GPU) and keeps its own run cache, fair shares and limits, and they share
two things through files in one folder (/dev/shm where there is one): the requests behind run ids,
so a slice of a run another worker computed is recomputed here (app/shared_runs.py), and saved
views, so a permalink opens through any worker.

The parent binds the socket, starts the workers with the spawn method (nothing of torch or CUDA is
inherited), restarts one that dies, and on SIGTERM or SIGINT passes the signal on, so that each
worker drains its requests as a single server does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from manyeyes.app.config import Settings

log = logging.getLogger("manyeyes.workers")

# Each worker's share of the shared folder: request texts for run ids, and saved views.
RUN_DIRECTORY_BYTES = 64 * 2**20
RESTART_PAUSE_S = 1.0


def default_threads(workers: int) -> int:
    """Torch's CPU threads per worker: the cores shared out, so workers do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // workers)


def worker_app(settings: Settings, folder: Path, workers: int):
    """One worker's ASGI app: create_app's, sharing runs and views with the other workers."""
    from manyeyes.app.main import create_app
    from manyeyes.app.services.views import MAX_VIEW_BYTES, ViewStore
    from manyeyes.app.shared_runs import FileDirectory, SharedFiles, SharedRuns

    app = create_app(settings)
    app.state.views = ViewStore(shared=SharedFiles(folder, MAX_VIEW_BYTES // workers))
    return SharedRuns(app, FileDirectory(SharedFiles(folder, RUN_DIRECTORY_BYTES // workers)))


def _detach_from_terminal() -> None:
    """A terminal's Ctrl-C reaches the parent alone, which passes one SIGTERM on (a worker given
    SIGINT and SIGTERM both would stop at once instead of draining); and a worker whose parent is
    killed outright is told to stop (Linux), instead of serving on unsupervised."""
    os.setpgrp()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _work(settings: Settings, sock, folder: str, workers: int, threads: int, log_level: str) -> None:
    _detach_from_terminal()
    import torch
    import uvicorn

    from manyeyes.app.server import server_config

    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s worker-{os.getpid()} %(name)s %(message)s")
    torch.set_num_threads(threads)
    config = server_config(worker_app(settings, Path(folder), workers), settings, log_level=log_level)
    uvicorn.Server(config).run(sockets=[sock])


def serve_workers(settings: Settings, sock, *, workers: int, threads: int, log_level: str) -> int:
    """Run `workers` processes on the bound `sock` until SIGTERM or SIGINT; the exit status."""
    spawn = multiprocessing.get_context("spawn")
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="manyeyes-shared-", dir=shm if shm.is_dir() else None))
    stopping = []

    def start():
        process = spawn.Process(target=_work, args=(settings, sock, str(folder), workers, threads, log_level),
                                name="manyeyes-worker", daemon=False)
        process.start()
        return process

    def stop(signum, _frame):
        stopping.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    processes = [start() for _ in range(workers)]
    try:
        while not stopping:
            for i, process in enumerate(processes):
                if process.exitcode is not None:
                    log.warning("worker %d exited with %s; starting another", process.pid, process.exitcode)
                    time.sleep(RESTART_PAUSE_S)  # a worker that dies at once must not spin the parent
                    processes[i] = start()
            time.sleep(0.2)
        for process in processes:
            if process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)  # each worker drains as a single server does
        deadline = time.monotonic() + settings.shutdown_grace_s + 5
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.exitcode is None:
                process.kill()
                process.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(folder, ignore_errors=True)
    return 0
