"""`manyeyes serve --workers N`: copies of the app in processes on one socket, sharing the requests
behind run ids and saved views through a folder, and stopping together on one SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from manyeyes.app.cli import main as cli_main
from manyeyes.app.shared_runs import SharedFiles
from tests.eco.conftest import ROOT
from tests.servers import free_port, wait_ready

TEXT = "The heron waited by the old stone mill."
# A line as app/logs.py writes it: its time in UTC, marked so, the level, the process and the logger.
STAMPED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ .*")


@contextlib.contextmanager
def workers_serving(log: Path, *args: str, **env_more: str):
    """`manyeyes serve --workers 2` (tiny-gpt) with more `args` and MANYEYES_* settings, in a
    session of its own as a terminal would start it; yields (base URL, parent process, shared
    folder's name) once both workers answer ready."""
    port = free_port()
    env = {**os.environ, "MANYEYES_MODELS": json.dumps({"tiny-gpt": "tiny-gpt"}), "MANYEYES_WARMUP": "false", **env_more}
    proc = subprocess.Popen(
        [sys.executable, "-m", "manyeyes", "serve", "--port", str(port), "--device", "cpu", "--workers", "2", "--log-level", "info",
         *args],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        # /readyz answers from whichever worker took the connection: wait for both.
        deadline = time.monotonic() + 120
        while sum(httpx.get(f"{base}/readyz").status_code == 200 for _ in range(20)) < 20:
            assert time.monotonic() < deadline, "a worker never became ready"
            time.sleep(0.2)
        (folder,) = [name for name in os.listdir("/dev/shm") if name.startswith(f"manyeyes-shared-{proc.pid}-")]
        yield base, proc, folder
    finally:
        if proc.poll() is None:  # a test failed before it stopped the server: stop it as SIGTERM does
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log = tmp_path_factory.mktemp("workers") / "server.log"
    with workers_serving(log) as (base, proc, folder):
        yield base, proc, log, folder


def worker_pids(parent: int) -> set[int]:
    """The parent's spawned workers (its other child is multiprocessing's resource tracker)."""
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    pids = set()
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.add(pid)
        except FileNotFoundError:  # exited since
            pass
    return pids


def test_a_run_computed_by_one_worker_is_served_by_every_worker_with_the_same_numbers(workers):
    base, *_ = workers
    posted = httpx.post(f"{base}/api/v1/attention", json={"text": TEXT, "format": "json"}).json()
    want = np.asarray(posted["attention"]["data"], dtype=np.float32)
    run_id, recomputed = posted["run_id"], 0
    # Each call opens a connection of its own, and the kernel hands connections to either worker.
    for _ in range(40):
        r = httpx.get(f"{base}/api/v1/runs/{run_id}/attention", params={"format": "json"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.asarray(r.json()["attention"]["data"], dtype=np.float32), want, atol=1e-6, rtol=0)
        recomputed += r.headers.get("x-manyeyes-recomputed") == "1"
    # The worker that did not compute it recomputed it once, then served it from its own cache.
    assert recomputed == 1


def test_a_run_no_worker_has_seen_is_a_404(workers):
    base, *_ = workers
    for _ in range(6):
        r = httpx.get(f"{base}/api/v1/runs/{'0' * 32}/attention")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_run"


def attention_posts(base: str) -> float:
    """POSTs to /api/v1/attention that /metrics counts, every worker's added up."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "manyeyes_requests_total" and sample.labels["route"] == "/api/v1/attention")


def steady_posts(base: str) -> float:
    """attention_posts once two reads a fifth of a second apart agree (see settled_posts)."""
    seen = attention_posts(base)
    while True:
        time.sleep(0.2)
        if (again := attention_posts(base)) == seen:
            return seen
        seen = again


def settled_posts(base: str, expected: float, scrapes: int) -> list[float]:
    """`scrapes` reads of attention_posts once it has reached `expected`. A worker counts a request
    once its answer is out, so a client that scrapes at once, through the other worker, can come
    first: a few milliseconds on a loaded machine. A count past `expected` is read at once."""
    deadline = time.monotonic() + 10
    while (seen := attention_posts(base)) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return [seen] + [attention_posts(base) for _ in range(scrapes - 1)]


def port_sockets(pids, port: int, state: str) -> dict[int, set[str]]:
    """Each process's sockets on `port` (its local side) in `state` (/proc/net/tcp's: "01"
    established, "0A" listening), by inode: those among its open files that the table lists."""
    listed = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == state and int(fields[1].rsplit(":", 1)[1], 16) == port:
                listed.add(fields[9])  # the socket's inode
    held = {}
    for pid in pids:
        held[pid] = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                inode = os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]")
                if inode in listed:
                    held[pid].add(inode)
    return held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="each worker listens on a socket of its own on Linux")
def test_connections_opened_at_once_are_spread_over_every_worker(workers):
    """128 kept-alive clients arriving together, as a load generator's or a busy page's do, each
    reach a worker the kernel picked by hashing the connection: each worker listens on a socket
    of its own, and the parent, which holds the port, on none. From one shared socket the worker
    that woke first accepted all it could, as the scheduler happened to run them: 113, 7, 6 and
    2 to four idle workers, 64, 58, 5 and 1 (a burst from another process; from this one they
    came out even more often than not, so the spread alone would not tell)."""
    base, proc, _, _ = workers
    # The module's two workers: four more cost 25 s to start, and the spread is the same question.
    port = int(base.rsplit(":", 1)[1])
    listening = port_sockets([proc.pid, *worker_pids(proc.pid)], port, "0A")
    assert listening.pop(proc.pid) == set(), "the parent listens: connections would queue where nobody accepts"
    assert len(listening) == 2 and all(len(held) == 1 for held in listening.values()), listening
    assert len(set.union(*listening.values())) == 2, "workers share a listening socket"

    async def at_once() -> dict[int, int]:
        clients = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(128)))
        try:
            for _, writer in clients:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: manyeyes\r\n\r\n")
            heads = await asyncio.wait_for(asyncio.gather(*(reader.readuntil(b"\r\n") for reader, _ in clients)), 60)
            # Each answered, so accepted by a worker, and kept alive there.
            assert all(head.startswith(b"HTTP/1.1 200") for head in heads), heads
            return {pid: len(held) for pid, held in port_sockets(worker_pids(proc.pid), port, "01").items()}
        finally:
            for _, writer in clients:
                writer.close()

    counts = asyncio.run(at_once())
    print("connections by worker:", sorted(counts.values()))
    # Hashed, each of two holds 64 on average (spread ~6): below 40 is four spreads off.
    assert len(counts) == 2 and sum(counts.values()) == 128 and min(counts.values()) >= 40, counts


def test_metrics_add_up_every_workers_requests(workers):
    base, *_ = workers
    before = attention_posts(base)
    for i in range(20):  # a fresh connection each: both workers take some
        assert httpx.post(f"{base}/api/v1/attention", json={"text": f"Count me, number {i}.", "format": "u8"}).status_code == 200
    # Whichever worker takes the scrape, it counts all 20, not its own share of them.
    scrapes = settled_posts(base, before + 20, 10)
    assert scrapes == [before + 20] * 10, (before, scrapes)


def test_a_view_saved_through_one_worker_opens_through_every_worker(workers):
    base, *_ = workers
    state = {"text": TEXT, "model": "tiny-gpt", "layer": 1, "head": 2}
    view_id = httpx.post(f"{base}/api/v1/views", json=state).json()["id"]
    for _ in range(20):
        r = httpx.get(f"{base}/api/v1/views/{view_id}")
        assert r.status_code == 200, r.text
        assert {k: r.json()[k] for k in state} == state


def test_a_worker_that_dies_is_started_again_in_a_slot_of_its_own(workers):
    base, proc, log, folder = workers
    before = worker_pids(proc.pid)
    for i in range(6):  # fresh connections: both workers count some
        httpx.post(f"{base}/api/v1/attention", json={"text": f"Before the crash, {i}.", "format": "u8"}).raise_for_status()
    # Views saved through both workers (fresh connections again): each is a permalink someone holds.
    view_ids = [httpx.post(f"{base}/api/v1/views", json={"text": f"Saved {i}.", "model": "tiny-gpt"}).json()["id"] for i in range(8)]
    assert len(set(os.listdir(f"/dev/shm/{folder}/views/0"))) and len(set(os.listdir(f"/dev/shm/{folder}/views/1")))
    counted = steady_posts(base)
    os.kill(min(before), signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not (len(after := worker_pids(proc.pid)) == 2 and after != before):
        assert time.monotonic() < deadline, "the dead worker was never replaced"
        time.sleep(0.2)
    (new,) = after - before
    # Until the new worker has answered: the kernel hands connections to whichever worker accepts.
    while f"worker-{new} manyeyes.access" not in log.read_text():
        assert time.monotonic() < deadline, "the new worker never answered"
        httpx.post(f"{base}/api/v1/attention", json={"text": f"Again {time.monotonic()}.", "format": "u8"}).raise_for_status()
        counted += 1
    # Two slots, as before: the new worker writes where the dead one did.
    assert sorted(os.listdir(f"/dev/shm/{folder}/runs")) == ["0", "1"]
    # The dead worker's counts stay in the totals, and its metric files are its slot's, which the new
    # worker writes on: a crash loop no longer leaves a set of files for every process it started.
    assert settled_posts(base, counted, 6) == [counted] * 6
    metric_files = os.listdir(f"/dev/shm/{folder}/metrics")
    assert {name.rpartition("_")[2] for name in metric_files} == {"w0.db", "w1.db"}, metric_files
    # The replacement adopted the dead worker's files: its views opened nowhere ("expired") before.
    for view_id in view_ids:
        for _ in range(4):
            assert httpx.get(f"{base}/api/v1/views/{view_id}").status_code == 200, view_id


def test_one_sigterm_stops_every_worker_and_removes_the_shared_folder(workers):
    base, proc, log, folder = workers
    pids = worker_pids(proc.pid)
    assert len(pids) == 2 and os.path.isdir(f"/dev/shm/{folder}")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)  # reaped by the parent, not left running
    assert log.read_text().count("Application shutdown complete") == 2  # each drained as a single server does
    assert not os.path.exists(f"/dev/shm/{folder}")
    # Every line stamped as app/logs.py stamps them, uvicorn's too (they had no time: "INFO:     Shutting
    # down"), and the drain said so, with its grace: the parent once, each worker as it began.
    text = log.read_text()
    unstamped = [line for line in text.splitlines() if not STAMPED.fullmatch(line)]
    assert not unstamped, unstamped[:10]
    assert re.search(r"Z INFO worker-\d+ uvicorn\.error Shutting down", text), text[-3000:]
    assert text.count("SIGTERM: draining: no new connections; requests in flight get up to 29 s") == 2, text[-3000:]
    assert text.count("manyeyes.workers SIGTERM: stopping 2 workers, each draining for up to 29 s") == 1, text[-3000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/readyz", timeout=2)


def test_every_worker_keeps_the_keys_the_parent_read_and_sighup_drains_them(tmp_path):
    """Each worker read the key file itself, and one started in a dead worker's place read it
    again: after the file changed, a revoked key opened the API through one worker and not the
    other (audit h46b: about 1 request in 3), and the file deleted, the replacement crash-looped.
    SIGHUP killed the parent outright, leaving its shared folder behind."""
    import hashlib

    old, new = "old-key-0123456789", "new-key-9876543210"
    key_file = tmp_path / "keys.txt"
    key_file.write_text(hashlib.sha256(old.encode()).hexdigest() + "\n")
    log = tmp_path / "server.log"
    with workers_serving(log, MANYEYES_API_KEYS_FILE=str(key_file)) as (base, proc, folder):
        before = worker_pids(proc.pid)
        key_file.write_text(hashlib.sha256(new.encode()).hexdigest() + "\n")  # rotated, no restart
        os.kill(min(before), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not (len(after := worker_pids(proc.pid)) == 2 and after != before):
            assert time.monotonic() < deadline, "the dead worker was never replaced"
            time.sleep(0.2)
        (replacement,) = after - before
        while f"worker-{replacement} manyeyes.access" not in log.read_text():
            assert time.monotonic() < deadline, "the new worker never answered"
            httpx.get(f"{base}/healthz")  # a fresh connection each: the kernel spreads them
        # Fresh connections, which the kernel spreads over both workers: one answer from each key.
        answers = {key: {httpx.get(f"{base}/api/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
                         for _ in range(24)} for key in (old, new)}
        assert answers == {old: {200}, new: {401}}, answers  # the keys read at start-up, until a restart
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert text.count("Application shutdown complete") == 2 and "Traceback" not in text, text[-3000:]
    # The parent says what it got; each worker drains on the SIGTERM it passes on.
    assert "SIGHUP: stopping 2 workers" in text and text.count("SIGTERM: draining") == 2, text[-3000:]
    assert not os.path.exists(f"/dev/shm/{folder}")


def test_a_terminals_ctrl_c_drains_every_worker_once(tmp_path):
    """Ctrl-C sends SIGINT to the terminal's whole process group. Workers in it would get SIGINT
    and then the parent's SIGTERM, a second signal, which stops uvicorn at once instead of draining."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    log = tmp_path / "server.log"
    started = threading.Event()

    def generate(base: str) -> list[dict]:
        body = {"text": "The cat sat", "model": "tiny-gpt", "max_new_tokens": 240}
        lines = []
        with httpx.stream("POST", f"{base}/api/v1/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.strip():
                    lines.append(json.loads(line))
                    started.set()
        return lines

    with workers_serving(log) as (base, proc, folder), ThreadPoolExecutor(1) as pool:
        # A generation streams for a while: drained, it ends with its "end" line; stopped at
        # once, it is cut off mid-stream.
        streamed = pool.submit(generate, base)
        assert started.wait(30)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        lines = streamed.result()
    assert lines[-1]["type"] == "end" and lines[-1]["tokens"] == 240, lines[-1]
    text = log.read_text()
    assert text.count("Application shutdown complete") == 2 and "Traceback" not in text, text[-3000:]
    assert not os.path.exists(f"/dev/shm/{folder}")


def test_shared_files_evict_only_their_own_writes_oldest_first(tmp_path):
    mine, theirs = SharedFiles(tmp_path, "0", max_bytes=10), SharedFiles(tmp_path, "1", max_bytes=10)
    theirs.put("t", b"1234")
    for key in "abc":
        mine.put(key, b"1234")
    assert sorted(os.listdir(tmp_path / "0")) == ["b", "c"] and os.listdir(tmp_path / "1") == ["t"]  # a went: mine stay within 10 bytes
    assert mine.read("a") is None and mine.read("t")[0] == b"1234" and theirs.read("b")[0] == b"1234" and mine.nbytes == 8
    assert abs(mine.read("t")[1] - time.time()) < 60  # when it was written: a shared view's age
    mine.put("b", b"12")  # rewriting an entry counts its new size, not both
    assert mine.nbytes == 6 and theirs.read("b")[0] == b"12"


def test_shared_files_of_a_dead_process_are_adopted_by_its_replacement_within_its_share(tmp_path):
    """The parent emptied a dead worker's folder for its replacement, and with it every view
    saved through that worker: permalinks people hold answered "expired" after any crash."""
    dead = SharedFiles(tmp_path, "0", max_bytes=12)
    for key in "abc":
        dead.put(key, b"1234")
        time.sleep(0.01)  # distinct times: the order the replacement evicts in
    (tmp_path / "0" / ".d").write_bytes(b"half")  # a write cut short by the death
    replacement = SharedFiles(tmp_path, "0", max_bytes=12)
    assert replacement.nbytes == 12 and sorted(os.listdir(tmp_path / "0")) == ["a", "b", "c"]
    assert replacement.read("a")[0] == b"1234"
    replacement.put("e", b"1234")  # the oldest adopted entry goes first
    assert sorted(os.listdir(tmp_path / "0")) == ["b", "c", "e"] and replacement.nbytes == 12
    smaller = SharedFiles(tmp_path, "0", max_bytes=5)  # fewer workers' worth of share: still bounded
    assert sorted(os.listdir(tmp_path / "0")) == ["e"] and smaller.nbytes == 4


@pytest.mark.parametrize("key", ["../escape", "a/b", "", ".hidden", "x" * 200, "run-é"])
def test_shared_files_never_turn_a_strange_key_into_a_path(tmp_path, key):
    (tmp_path / "shared").mkdir()
    files = SharedFiles(tmp_path / "shared", "0", max_bytes=100)
    files.put(key, b"data")
    assert files.read(key) is None and os.listdir(tmp_path / "shared" / "0") == [] and sorted(os.listdir(tmp_path)) == ["shared"]


def test_workers_and_replicas_together_are_refused(capsys):
    assert cli_main(["serve", "--workers", "2", "--replicas", "2", "--port", str(free_port())]) == 2
    assert "choose one" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--workers", "0"), ("--workers", "-1"), ("--workers", "two"),
                                         ("--threads", "4294967296"), ("--workers", "5000")])
def test_a_worker_count_below_one_is_refused(capsys, flag, value):
    """--threads 4294967296 was torch's overflow traceback, and under --workers each worker's,
    restarted for ever (h56g)."""
    with pytest.raises(SystemExit):
        cli_main(["serve", flag, value])
    assert "a whole number from 1 to 4096" in capsys.readouterr().err


def test_shared_files_stay_within_their_share_under_concurrent_writers(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    files = SharedFiles(tmp_path, "0", max_bytes=1000)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: files.put(f"k{i % 300}", b"x" * 10), range(3000)))
    on_disk = sum(p.stat().st_size for p in (tmp_path / "0").iterdir())
    assert files.nbytes == on_disk <= 1000 and len(list((tmp_path / "0").iterdir())) == 100


def test_a_view_from_another_worker_keeps_its_age(tmp_path):
    from manyeyes.app.services.views import TTL_S, ViewStore

    saving, opening = (ViewStore(shared=SharedFiles(tmp_path, slot, max_bytes=10_000)) for slot in ("0", "1"))
    view_id = saving.put({"text": TEXT, "model": "tiny-gpt"})
    assert len(opening) == 0 and opening.get(view_id) == {"text": TEXT, "model": "tiny-gpt"}
    aged = time.time() - TTL_S - 60
    os.utime(tmp_path / "0" / f"view-{view_id}", (aged, aged))
    assert opening.get(view_id) is None  # expired for every worker, not only the one that saved it


class CountingDirectory:
    """A FileDirectory that also keeps what it was asked to remember."""

    def __init__(self, folder: Path, slot: str) -> None:
        from manyeyes.app.shared_runs import FileDirectory

        self.files = FileDirectory(SharedFiles(folder, slot, max_bytes=1 << 20))
        self.remembered: list[list[str]] = []

    def hold_while(self, holds):
        self.files.hold_while(holds)

    async def remember(self, entries):
        self.remembered.append([run_id for run_id, _ in entries])
        await self.files.remember(entries)

    async def recall(self, run_id):
        return await self.files.recall(run_id)


def test_copies_record_each_run_they_compute_once_and_recompute_the_others_runs(tmp_path, monkeypatch):
    """Two copies of the app in one process, sharing a folder as workers do: the service records
    each run it computes (a single text, every text of a batch), never a cache hit or a refused
    request, before the request answers, and the other copy answers a slice of that run by
    computing it again."""
    from fastapi.testclient import TestClient

    from manyeyes.app.config import Settings
    from manyeyes.app.main import create_app
    from tests.api.conftest import wait_ready

    # A slow folder (a loaded machine): a record written after the answer went out was a 404
    # for a slice asked of the other copy at once.
    put = SharedFiles.put
    monkeypatch.setattr(SharedFiles, "put", lambda *args, **kwargs: (time.sleep(0.3), put(*args, **kwargs))[1])
    settings = Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False)
    directories = [CountingDirectory(tmp_path, slot) for slot in ("0", "1")]
    first, second = (TestClient(create_app(settings, run_directory=d)) for d in directories)
    with first, second:
        wait_ready(first), wait_ready(second)
        single = first.post("/api/v1/attention", json={"text": TEXT, "format": "json"}).json()
        batch = first.post("/api/v1/attention/batch", json={"texts": ["One more line.", "And a last one."]}).json()
        assert first.post("/api/v1/attention", json={"text": TEXT, "format": "json"}).status_code == 200  # a hit
        assert first.post("/api/v1/attention", json={"text": TEXT, "layers": [99]}).status_code == 422
        assert directories[0].remembered == [[single["run_id"]], [r["run_id"] for r in batch["results"]]]
        assert sorted(p.name for p in (tmp_path / "0").iterdir()) == sorted(
            f"run-{run_id}" for run_id in [single["run_id"], *(r["run_id"] for r in batch["results"])])

        r = second.get(f"/api/v1/runs/{single['run_id']}/attention", params={"format": "json"})
        assert r.status_code == 200 and r.headers["x-manyeyes-recomputed"] == "1"
        np.testing.assert_allclose(r.json()["attention"]["data"], single["attention"]["data"], atol=1e-6, rtol=0)
        again = second.get(f"/api/v1/runs/{single['run_id']}/attention", params={"format": "json"})
        assert again.status_code == 200 and "x-manyeyes-recomputed" not in again.headers
        # The recomputed run is recorded by the copy that recomputed it, so it outlives the first's record.
        assert directories[1].remembered == [[single["run_id"]]]


def test_readyz_waits_for_every_worker(tmp_path):
    from fastapi.testclient import TestClient

    from manyeyes.app.config import Settings
    from manyeyes.app.main import create_app
    from manyeyes.app.shared_runs import ReadyMarks

    app = create_app(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False))
    app.state.ready_marks = ReadyMarks(tmp_path, slot=0, workers=2)
    app.state.ready_marks.marking_once_loaded(app)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while not (tmp_path / "0").exists():  # this worker marks itself once loaded
            assert time.monotonic() < deadline, "the worker never marked itself ready"
            time.sleep(0.02)
        waiting = client.get("/readyz")
        assert waiting.status_code == 503 and waiting.json()["status"] == "loading"
        assert waiting.json()["error"]["message"] == "workers [1] are still loading their models"
        # The other worker could not load (its copy of the model did not fit, say): said, not "loading".
        ReadyMarks(tmp_path, slot=1, workers=2).mark("OutOfMemoryError: CUDA out of memory")
        failed = client.get("/readyz")
        assert failed.status_code == 503 and failed.json()["status"] == "failed"
        assert failed.json()["error"]["message"] == "worker 1 could not load its models: OutOfMemoryError: CUDA out of memory"
        ReadyMarks(tmp_path, slot=1, workers=2).mark()  # its replacement has loaded
        assert client.get("/readyz").json() == {"status": "ready", "models": ["tiny-gpt"]}
        assert not (tmp_path / "1.failed").exists()


def test_a_folder_left_by_a_parent_that_is_gone_is_removed_at_the_next_start(tmp_path):
    from manyeyes.app.workers import remove_orphaned_folders

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"manyeyes-shared-{gone.pid}-abc"
    (orphan / "runs" / "0").mkdir(parents=True)
    (orphan / "runs" / "0" / "run-x").write_bytes(b"{}")
    alive = tmp_path / f"manyeyes-shared-{os.getpid()}-def"
    alive.mkdir()
    unrelated = tmp_path / "manyeyes-shared-notapid"
    unrelated.mkdir()
    remove_orphaned_folders(tmp_path)
    assert not orphan.exists() and alive.is_dir() and unrelated.is_dir()


def test_a_worker_whose_models_fail_to_load_says_why_to_the_others(tmp_path):
    from fastapi.testclient import TestClient

    from manyeyes.app.config import Settings
    from manyeyes.app.main import create_app
    from manyeyes.app.shared_runs import ReadyMarks

    app = create_app(Settings(models={"broken": str(tmp_path / "missing.pth")}, device="cpu", warmup=False))
    app.state.ready_marks = ReadyMarks(tmp_path / "ready", slot=1, workers=2)
    (tmp_path / "ready").mkdir()
    app.state.ready_marks.marking_once_loaded(app)
    with TestClient(app):
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready" / "1.failed").exists():
            assert time.monotonic() < deadline, "the failed load was never marked"
            time.sleep(0.02)
    assert "missing.pth" in (tmp_path / "ready" / "1.failed").read_text()
    marks = ReadyMarks(tmp_path / "ready", slot=0, workers=2)
    assert marks.waiting() == [0, 1] and marks.failed(marks.waiting()).keys() == {1}


def test_the_restart_pause_doubles_only_while_replacements_die_young():
    """An original worker dead at 14 s doubled the pause as a crash loop does (review h51i); the
    README says only replacements that die young count."""
    from manyeyes.app.workers import restart_pause

    assert restart_pause(1.0, replacement=False, lived_s=14) == 1.0  # a first death, however young
    assert restart_pause(1.0, replacement=True, lived_s=14) == 2.0
    assert restart_pause(32.0, replacement=True, lived_s=1) == 60.0  # at most a minute
    assert restart_pause(32.0, replacement=True, lived_s=61) == 1.0  # a long life starts over
