"""`serve --workers N --shared-forward`: one process runs every worker's batches of short inputs
as shared forwards (app/services/shared_forward.py). Its answers are the worker's own forward's,
several workers' batches run as one forward, and a worker that cannot reach it runs its own."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Listener

import httpx
import numpy as np
import pytest
import torch

from manyeyes.app.config import Settings
from manyeyes.app.services.device import HostCopier, device_to_host
from manyeyes.app.services.errors import OverBudget
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.shared_forward import ForwardClient, ForwardHost, ForwardLink, Request, read_array, rows_bytes
from manyeyes.model import Capture, load
from manyeyes.model.runtime import padded_inputs
from tests.api.test_workers import worker_pids, workers_serving

TEXTS = ["The heron waited by the old stone mill.", "Rain.", "A longer sentence, with a comma, and more words in it than the rest."]
KEY = b"k" * 32


@pytest.fixture(scope="module")
def models():
    return {"tiny-gpt": load("tiny-gpt", device="cpu", name="tiny-gpt"), "minilm": load("minilm", device="cpu", name="minilm")}


@contextlib.contextmanager
def hosting(models, path, quantise=False, **settings):
    host = ForwardHost(models, Settings(**settings), quantise)
    listener = Listener(str(path), family="AF_UNIX", authkey=KEY)
    thread = threading.Thread(target=host.serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield host
    finally:
        host.close()
        thread.join(5)
        # close() from another thread must end serve(): its accept() slept on, 5 s a test here
        assert not thread.is_alive(), "serve() did not return after close()"


def connected(client: ForwardClient, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while client._connected() is None:
        assert time.monotonic() < deadline, "the client never connected"
        time.sleep(0.02)


def open_buffers() -> set[tuple[int, int]]:
    """This process's open descriptors of forward buffers, as (descriptor, inode): by inode, so
    that a number another test's buffer left and this one took again counts as new."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            if "memfd:manyeyes-forward" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add((int(fd), os.stat(f"/proc/self/fd/{fd}").st_ino))
    return found


def shared_count(metrics: Metrics, where: str) -> float:
    return metrics.registry.get_sample_value("manyeyes_shared_forward_batches_total", {"where": where}) or 0.0


@pytest.mark.parametrize("model_id", ["tiny-gpt", "minilm"])
def test_the_shared_forward_answers_as_the_workers_own_forward(models, tmp_path, model_id):
    model = models[model_id]
    encoded = [model.encode(t) for t in TEXTS]
    metrics = Metrics()
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), metrics)
    with hosting(models, tmp_path / "f.sock"):
        connected(client)
        got = client.run(model, encoded, "json", time.monotonic() + 30)
    want = model.run(encoded, Capture(hidden=False))
    assert got is not None and shared_count(metrics, "shared") == 1
    for g, w, enc in zip(got, want, encoded):
        assert g.tokens == enc.tokens and g.attention.shape == w.attention.shape == (model.info.n_layers, model.info.n_heads, len(enc), len(enc))
        torch.testing.assert_close(g.attention, w.attention, atol=1e-6, rtol=0)
        if model.info.predictions:  # tiny-gpt's next-token top-k rides along
            assert torch.equal(g.top_ids, w.top_ids)
            torch.testing.assert_close(g.top_probs, w.top_probs, atol=1e-6, rtol=0)
        else:
            assert g.top_ids is None and w.top_ids is None


def test_quantised_on_the_device_as_the_worker_would(models, tmp_path):
    """Where the device quantises, rows come back at the batch's format: u8 bytes equal to the
    worker's own path through the same quantiser."""
    model = models["minilm"]
    encoded = [model.encode(t) for t in TEXTS]
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), Metrics())
    with hosting(models, tmp_path / "f.sock", quantise=True):
        connected(client)
        got = client.run(model, encoded, "u8", time.monotonic() + 30)
    want = model.run(encoded, Capture(hidden=False), to_host=device_to_host(HostCopier(always_stage=True), "u8"))
    for g, w in zip(got, want):
        assert g.attention.dtype == torch.uint8
        assert (g.attention.int() - w.attention.int()).abs().max() <= 1  # one rounding step at most


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_call.sh runs it on a GPU)")
def test_on_cuda_the_shared_forward_answers_as_the_cpu(models, tmp_path):
    """On a GPU, quantised on the device and copied through pinned memory, as the workers' own."""
    cuda = {"minilm": load("minilm", device="cuda", name="minilm")}
    encoded = [cuda["minilm"].encode(t) for t in TEXTS]
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), Metrics())
    with hosting(cuda, tmp_path / "f.sock", quantise=True):
        connected(client)
        got = client.run(cuda["minilm"], encoded, "f16", time.monotonic() + 30)
    want = models["minilm"].run(encoded, Capture(hidden=False))
    for g, w in zip(got, want):
        assert g.attention.dtype == torch.float16 and g.attention.device.type == "cpu"
        torch.testing.assert_close(g.attention.float(), w.attention, atol=2e-3, rtol=0)


def test_workers_batches_queued_together_run_as_one_forward(models):
    """Two workers' batches of the same model, of different widths, run as one padded forward; a
    third model's waits for a forward of its own. Each worker gets its own rows back."""
    model = models["tiny-gpt"]
    host = ForwardHost(models, Settings(), quantise=False)
    batches = [[model.encode(t) for t in TEXTS[:2]], [model.encode(TEXTS[2])]]
    pipes = [Pipe() for _ in range(3)]
    for seq, (batch, (_, there)) in enumerate(zip(batches, pipes)):
        lengths = [len(e) for e in batch]
        host._pending.append(Request(there, seq, "tiny-gpt", "json", padded_inputs(batch, lengths, max(lengths)).numpy(), lengths))
    other = models["minilm"].encode(TEXTS[0])
    host._pending.append(Request(pipes[2][1], 9, "minilm", "json", padded_inputs([other], [len(other)], len(other)).numpy(), [len(other)]))
    chosen = host._take()
    assert [r.seq for r in chosen] == [0, 1] and [r.seq for r in host._pending] == [9]
    answers = host.forward(chosen)  # one forward, both workers' rows
    for batch, rows in zip(batches, answers):
        want = model.run(batch, Capture(hidden=False))
        assert len(rows) == len(batch)
        for (weights, top_ids, _), w in zip(rows, want):
            np.testing.assert_allclose(weights, w.attention.numpy(), atol=1e-6, rtol=0)
            np.testing.assert_array_equal(top_ids, w.top_ids.numpy())


def test_many_workers_at_once_each_get_their_own_rows(models, tmp_path):
    """Four workers' forward threads sending batches at the same time, of both models and of mixed
    lengths: the shared process merges what is queued together, and every row still comes back
    to the worker that sent it, equal to that worker's own forward."""
    texts = [f"{t} {i}" * (1 + i % 3) for i, t in enumerate(TEXTS * 4)]
    errors, answered = [], []

    def worker(n: int) -> None:
        client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), Metrics())
        connected(client)
        for k in range(8):
            model = models["tiny-gpt" if (n + k) % 2 else "minilm"]
            batch = [model.encode(t) for t in texts[(n + k) % 4::3][:1 + (n + k) % 4]]
            got = client.run(model, batch, "json", time.monotonic() + 60)
            want = model.run(batch, Capture(hidden=False))
            try:
                assert got is not None
                for g, w in zip(got, want, strict=True):
                    # Merged with other workers' rows, padded wider: equal to 1e-5, as any batch's
                    # rows are to their own runs (README, "API").
                    torch.testing.assert_close(g.attention, w.attention, atol=1e-5, rtol=0)
                answered.append(len(batch))
            except AssertionError as exc:
                errors.append(exc)
        client.close()

    rows_run = []
    with hosting(models, tmp_path / "f.sock") as host:
        forward = host.forward
        host.forward = lambda chosen: (rows_run.append(sum(len(r.lengths) for r in chosen)), forward(chosen))[1]
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert not errors and len(answered) == 32, errors[:1]
    # Every row sent ran once, in as many forwards as batches or fewer (merged).
    assert sum(rows_run) == sum(answered) and len(rows_run) <= 32


def test_a_batch_the_shared_process_fails_is_run_by_the_worker(models, tmp_path, monkeypatch):
    model = models["tiny-gpt"]
    metrics = Metrics()
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), metrics)
    with hosting(models, tmp_path / "f.sock") as host:
        connected(client)

        def out_of_memory(chosen):
            raise RuntimeError("CUDA out of memory (a stand-in)")

        monkeypatch.setattr(host, "forward", out_of_memory)
        assert client.run(model, [model.encode(TEXTS[0])], "json", time.monotonic() + 30) is None
        assert shared_count(metrics, "own") == 1 and client._conn is not None  # the link stays
        monkeypatch.undo()
        assert client.run(model, [model.encode(TEXTS[0])], "json", time.monotonic() + 30) is not None


def test_the_batch_limits_hold_across_workers(models):
    model = models["tiny-gpt"]
    host = ForwardHost(models, Settings(max_batch_items=3), quantise=False)
    for seq in range(3):
        batch = [model.encode(t) for t in TEXTS[:2]]
        host._pending.append(Request(Pipe()[1], seq, "tiny-gpt", "json", padded_inputs(batch, [len(e) for e in batch], max(len(e) for e in batch)).numpy(),
                                     [len(e) for e in batch]))
    # 2 + 2 rows would be 4, over max_batch_items=3: one worker's batch a forward.
    assert [r.seq for r in host._take()] == [0]
    assert [r.seq for r in host._take()] == [1]


def test_what_no_worker_sends_is_refused_not_run(models):
    host = ForwardHost(models, Settings(shared_forward_max_tokens=16), quantise=False)
    conn = object()  # a worker's connection, as the host keys its buffer
    table = np.zeros((3, 1, 17), dtype=np.int64)
    assert "lengths" in host._check(Request(conn, 1, "tiny-gpt", "json", table, [17]))  # wider than it takes
    assert "unknown model" in host._check(Request(conn, 1, "nope", "json", table[:, :, :4], [4]))
    assert "int64" in host._check(Request(conn, 1, "tiny-gpt", "json", table.astype(np.int32)[:, :, :4], [4]))
    assert "lengths" in host._check(Request(conn, 1, "tiny-gpt", "json", table[:, :, :4], [4, 4]))
    # Rows are written only into a buffer the worker passed, and only one large enough for them.
    assert "buffer" in host._check(Request(conn, 1, "tiny-gpt", "json", table[:, :, :4], [4]))
    host._maps[conn] = mmap.mmap(-1, 100)
    assert "buffer" in host._check(Request(conn, 1, "tiny-gpt", "json", table[:, :, :4], [4]))
    info = models["tiny-gpt"].info
    host._maps[conn] = mmap.mmap(-1, rows_bytes(info.n_layers, info.n_heads, [4]))
    assert host._check(Request(conn, 1, "tiny-gpt", "json", table[:, :, :4], [4])) is None


def test_a_worker_that_cannot_reach_it_runs_its_own_then_finds_it_again(models, tmp_path):
    model = models["tiny-gpt"]
    encoded = [model.encode(TEXTS[0])]
    metrics = Metrics()
    path = tmp_path / "f.sock"
    client = ForwardClient(ForwardLink(str(path), KEY, 128), metrics)
    # Nothing listens yet: the caller runs the batch itself, at once.
    started = time.monotonic()
    assert client.run(model, encoded, "json", time.monotonic() + 30) is None
    assert time.monotonic() - started < 0.5 and shared_count(metrics, "own") == 1
    with hosting(models, path) as host:
        connected(client)
        assert client.run(model, encoded, "json", time.monotonic() + 30) is not None
        # The process goes away (its end of every connection closed): own forwards again.
        host.close()
        for conn in list(host._maps):  # each connection that brought a buffer: this client's
            conn.close()
    assert client.run(model, encoded, "json", time.monotonic() + 30) is None
    assert not path.exists()  # Listener.close() removed it, as a process that exits does
    with hosting(models, path):  # a replacement on the same socket: found within a second or so
        connected(client, timeout_s=10)
        assert client.run(model, encoded, "json", time.monotonic() + 30) is not None
    assert shared_count(metrics, "shared") == 2 and shared_count(metrics, "own") == 2


def test_no_answer_before_the_deadline_is_over_budget_and_drops_the_link(models, tmp_path, monkeypatch):
    model = models["tiny-gpt"]
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), Metrics())
    release = threading.Event()
    with hosting(models, tmp_path / "f.sock") as host:
        connected(client)
        assert client.run(model, [model.encode(TEXTS[0])], "json", time.monotonic() + 30) is not None
        slow = host.forward
        monkeypatch.setattr(host, "forward", lambda chosen: (release.wait(10), slow(chosen))[1])
        started = time.monotonic()
        with pytest.raises(OverBudget):
            client.run(model, [model.encode(TEXTS[0])], "json", time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - started < 2
        # The late answer must not be read as the next batch's, nor written over it: the link is
        # dropped with its buffer, and the next connection brings a new one.
        assert client._conn is None and client._buffer.map is None
        release.set()
        connected(client)
        got = client.run(model, [model.encode(TEXTS[1])], "json", time.monotonic() + 30)
        assert got is not None
        torch.testing.assert_close(got[0].attention, model.run([model.encode(TEXTS[1])], Capture(hidden=False))[0].attention,
                                   atol=1e-6, rtol=0)


def test_an_answer_the_host_cannot_send_hangs_up_at_once_and_its_buffer_goes(models, tmp_path):
    """When the shared process cannot send an answer (the worker stopped reading past the send
    timeout), the link goes at once on both sides: the worker runs the batch itself instead of
    waiting out its deadline, and only the connection's reader closes it (a close from the
    forward thread too raced the reader's own and could close a descriptor reused meanwhile)."""
    model = models["tiny-gpt"]
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), Metrics())
    with hosting(models, tmp_path / "f.sock") as host:
        connected(client)
        assert client.run(model, [model.encode(TEXTS[0])], "json", time.monotonic() + 30) is not None
        (conn,) = host._maps

        def send_times_out(message):
            raise OSError("timed out (a stand-in)")

        conn.send = send_times_out
        started = time.monotonic()
        assert client.run(model, [model.encode(TEXTS[1])], "json", time.monotonic() + 20) is None
        assert time.monotonic() - started < 5 and client._conn is None
        deadline = time.monotonic() + 5
        while host._maps or not conn.closed:
            assert time.monotonic() < deadline, "the host kept the connection or its buffer"
            time.sleep(0.05)


def test_answers_larger_than_the_buffer_grow_it_and_a_dead_workers_buffer_goes(models, tmp_path):
    model = models["minilm"]
    encoded = [model.encode(" ".join(["word"] * 120)) for _ in range(4)]  # 4 x 6 x 12 x 122^2 float32: 17 MB
    client = ForwardClient(ForwardLink(str(tmp_path / "f.sock"), KEY, 128), Metrics())
    before = open_buffers()  # earlier tests' buffers, let go of as their links' readers end
    with hosting(models, tmp_path / "f.sock") as host:
        connected(client)
        small = client.run(model, [model.encode("Rain.")], "json", time.monotonic() + 30)
        assert small is not None and len(client._buffer.map) == 1 << 20
        got = client.run(model, encoded, "json", time.monotonic() + 30)
        assert len(client._buffer.map) >= 17_000_000
        # Each buffer's descriptor went with the first request that used it and is closed on both
        # sides: what stays open is the duplicate each mapping keeps (Python's mmap does), the
        # worker's and the shared process's, and the first buffer's went with it.
        assert len(open_buffers() - before) == 2
        want = model.run(encoded, Capture(hidden=False))
        for g, w in zip(got, want):
            torch.testing.assert_close(g.attention, w.attention, atol=1e-6, rtol=0)
        (mapped,) = host._maps.values()
        assert len(mapped) == len(client._buffer.map)  # the grown buffer replaced the first
        client._conn.close()  # as a worker that dies: the shared process lets go of its buffer
        deadline = time.monotonic() + 5
        while host._maps:
            assert time.monotonic() < deadline, "a dead worker's buffer stayed mapped"
            time.sleep(0.05)


def test_a_request_for_less_precision_than_its_batch_mates_gets_its_own(models, tmp_path):
    """On a device that quantises, a u8 request merged with a json one is answered in u8 (its
    buffer was sized for bytes), equal to the worker's own u8."""
    model = models["minilm"]
    host = ForwardHost(models, Settings(), quantise=True)
    copier = HostCopier(always_stage=True)
    batches = {"json": [model.encode(TEXTS[0])], "u8": [model.encode(TEXTS[2])]}
    requests = []
    for seq, (fmt, batch) in enumerate(batches.items()):
        ours, theirs = Pipe()
        lengths = [len(e) for e in batch]
        requests.append(Request(theirs, seq, "minilm", fmt, padded_inputs(batch, lengths, max(lengths)).numpy(), lengths))
        info = model.info
        host._maps[theirs] = mmap.mmap(-1, rows_bytes(info.n_layers, info.n_heads, lengths, 1 if fmt == "u8" else 4))
    host._pending.extend(requests)
    chosen = host._take()
    assert len(chosen) == 2
    for request, rows in zip(chosen, host.forward(chosen)):
        specs = host._written(request, rows)
        got = read_array(host._maps[request.conn], specs[0][0])
        want = model.run(batches[request.fmt], Capture(hidden=False), to_host=device_to_host(copier, request.fmt))[0].attention
        assert got.dtype == want.dtype == (torch.uint8 if request.fmt == "u8" else torch.float32)
        torch.testing.assert_close(got.float(), want.float(), atol=1 if request.fmt == "u8" else 1e-5, rtol=0)


def test_only_inputs_up_to_its_length_go_to_it(models):
    client = ForwardClient(ForwardLink("/nonexistent", KEY, 8), Metrics())
    model = models["tiny-gpt"]
    assert client.takes([model.encode("one two")])
    assert not client.takes([model.encode("one two"), model.encode(" ".join(["word"] * 20))])


@pytest.mark.slow
def test_workers_serve_through_the_shared_forward(tmp_path):
    """`manyeyes serve --workers 2 --shared-forward`: answers equal a single server's, /metrics
    counts the shared batches, a long input runs in its worker, and SIGTERM stops them all."""
    log = tmp_path / "server.log"
    model = load("tiny-gpt", device="cpu")
    with workers_serving(log, "--shared-forward", MANYEYES_SHARED_FORWARD_MAX_TOKENS="64") as (base, proc, _):
        deadline = time.monotonic() + 120
        while "shared forward process: tiny-gpt" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        for i in range(12):
            text = f"{TEXTS[0]} Number {i}."
            r = httpx.post(f"{base}/api/v1/attention", json={"text": text, "format": "json"}, timeout=30)
            assert r.status_code == 200, r.text
            want = model.attend(text, capture=Capture(hidden=False)).attention.numpy()
            got = np.asarray(r.json()["attention"]["data"], dtype=np.float32).reshape(want.shape)
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)

        def counted(where: str) -> float:
            metrics = httpx.get(f"{base}/metrics").text
            return sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith(f'manyeyes_shared_forward_batches_total{{where="{where}"}}'))

        # One batch a request, one at a time. Each worker's first may run at home while its link
        # connects; the rest are shared.
        assert counted("shared") + counted("own") == 12 and counted("shared") >= 10
        long_text = " ".join(["word"] * 25)  # over 64 tokens (characters, for tiny-gpt): its worker's own forward
        assert httpx.post(f"{base}/api/v1/attention", json={"text": long_text, "format": "u8"}, timeout=30).status_code == 200
        assert counted("shared") + counted("own") == 12
        # The shared process dies: the workers answer on their own forwards meanwhile, and the
        # parent starts another, which they find.
        (shared_pid,) = [pid for pid in worker_pids(proc.pid) if "me-shared-fwd" in thread_names(pid)]
        os.kill(shared_pid, signal.SIGKILL)
        for i in range(4):
            assert httpx.post(f"{base}/api/v1/attention", json={"text": f"Alone {i}.", "format": "u8"}, timeout=30).status_code == 200
        deadline = time.monotonic() + 120
        while log.read_text().count("shared forward process: tiny-gpt") < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        before, deadline = counted("shared"), time.monotonic() + 30
        while counted("shared") == before:  # each worker's link finds the new one within a second or so
            assert time.monotonic() < deadline, log.read_text()
            assert httpx.post(f"{base}/api/v1/attention", json={"text": f"Again {time.monotonic()}.", "format": "u8"},
                              timeout=30).status_code == 200
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()


def thread_names(pid: int) -> set[str]:
    names = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names.add(f.read().strip())
    return names
