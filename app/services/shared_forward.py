"""One process that runs the short inputs' forward passes of every worker (`manyeyes serve
--workers N --shared-forward`).

Why: on an H200 the forward of a batch of short inputs is the CPU launching a few hundred small
kernels, whatever the batch's size, and with --workers 8 each worker launched them for its own
eight to sixteen inputs: about 0.9 ms of its forward thread an input, beside 1.2 ms of event loop,
in a process bound by its interpreter lock, while eight CUDA contexts took turns on the GPU
(bench/LOG.md, "GPU (H200)"). Here the workers still parse, tokenize, cache and answer, but send
their batches of inputs up to `shared_forward_max_tokens` tokens to this process, which runs
every worker's batches queued together as one forward, as long as it fits the batch limits, and
sends each worker its rows back: a batch's launches are paid once for up to 64 inputs, in one
context. Longer inputs (whose forwards are compute-bound, where each worker already keeps the GPU
busy) and every other route's forwards stay in the worker, on its own copy of the model.

The shared process is only ever a faster way: a worker that cannot reach it (still loading,
restarting, gone) runs the batch on its own model, and tries again a second later. Nothing blocks
a worker on it but the wait for an answer it was promised, bounded by its requests' deadline.
Workers and the process speak small pickled messages over a Unix socket in the workers' private
folder, with a key made at start-up (multiprocessing's challenge), and with send and receive
timeouts so that a peer that stops reading cannot hold the other. The rows themselves go through
a buffer of the worker's, anonymous shared memory (memfd) whose descriptor the worker passes over
the socket with the first request that uses it; the shared process writes the rows there and the
worker copies them out. Through the socket, an answer of 64 rows was five copies (pickled,
written, read, unpickled) and the shared process's send waited, worker by worker, for each one's
forward thread to read it. Not a file in /dev/shm: a container's is 64 MB by default, and a
write past a full tmpfs is a SIGBUS, not an error. A connection's buffer is its own, so an answer
that comes too late (its connection dropped) lands in memory nobody reads again.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np
import torch

from manyeyes.app.config import Settings
from manyeyes.app.services.device import KEPT_DTYPE, HostCopier, device_to_host, most_precise, quantise
from manyeyes.app.services.errors import OverBudget
from manyeyes.app.services.metrics import Metrics
from manyeyes.model.attention import WEIGHTS_ONLY
from manyeyes.model.runtime import MAX_TOP_K, AttentionModel, AttentionResult, padded_inputs
from manyeyes.model.tokenizer import Encoded

log = logging.getLogger("manyeyes.shared_forward")

# A peer that takes longer than this to take or give one message's bytes is dropped.
IO_TIMEOUT_S = 5.0
# How soon a worker tries the shared process again after it could not reach it.
RECONNECT_S = 1.0
# Each array of an answer starts on a cache line of the buffer.
ALIGN = 64


def rows_bytes(n_layers: int, n_heads: int, lengths: list[int], weight_bytes: int = 4) -> int:
    """The most an answer for inputs of these lengths can take in the buffer: their weights at
    `weight_bytes` each and, for a model with a head, its top-k ids and probabilities, each array
    aligned."""
    return sum(n_layers * n_heads * n * n * weight_bytes + n * MAX_TOP_K * (8 + 4) + 3 * ALIGN for n in lengths)


def available() -> bool:
    """Shared forwards pass memory descriptors (memfd, SCM_RIGHTS): Linux only."""
    return hasattr(os, "memfd_create")


class Buffer:
    """A worker's anonymous shared memory, grown as needed. Its descriptor (`fd`) is kept only
    until it is passed to the shared process, which maps it itself."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.map: mmap.mmap | None = None

    def at_least(self, nbytes: int) -> mmap.mmap:
        if self.map is None or len(self.map) < nbytes:
            size = max(nbytes, 2 * len(self.map) if self.map is not None else 0, 1 << 20)
            fd = os.memfd_create("manyeyes-forward", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mapped = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self.release()
            self.fd, self.map = fd, mapped
        return self.map

    def release(self) -> None:
        """Gone from this side; the shared process's mapping, if any, goes with its connection."""
        if self.map is not None:
            self.map.close()
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.map = None, None

    def passed(self) -> None:
        """The shared process has the descriptor: the mapping is all this side needs."""
        os.close(self.fd)
        self.fd = None


def read_array(buffer: mmap.mmap, spec) -> torch.Tensor | None:
    """A copy of the array `spec` (offset, dtype, shape) names in `buffer`, as a tensor of its own."""
    if spec is None:
        return None
    offset, dtype, shape = spec
    return torch.from_numpy(np.ndarray(shape, np.dtype(dtype), buffer=buffer, offset=offset).copy())


@dataclass(frozen=True)
class ForwardLink:
    """Where a worker finds the shared forward process, and which inputs it sends there."""

    address: str  # a Unix socket's path
    authkey: bytes
    max_tokens: int


@contextlib.contextmanager
def socket_of(conn: Connection):
    """The connection's socket, through a duplicate of its descriptor (closed after), which
    shares the socket: its options and its shutdown are the connection's."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        yield sock
    finally:
        sock.close()


def hang_up(conn: Connection) -> None:
    """Shuts the connection's socket both ways without closing it: a thread blocked reading it
    wakes with EOFError and closes it itself. Closing it from here instead raced that thread's
    own close (the second one closed a descriptor number that may already name another file),
    and on Linux a close does not wake a blocked read."""
    with socket_of(conn) as sock, contextlib.suppress(OSError):  # OSError: the peer has gone already
        sock.shutdown(socket.SHUT_RDWR)


def set_io_timeouts(conn: Connection, send_s: float | None, recv_s: float | None = None) -> None:
    """SO_SNDTIMEO / SO_RCVTIMEO on the connection's socket: a blocked read or write then fails
    (OSError) instead of waiting for ever."""
    with socket_of(conn) as sock:
        for option, seconds in ((socket.SO_SNDTIMEO, send_s), (socket.SO_RCVTIMEO, recv_s)):
            if seconds is not None:
                sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))


# ---------------------------------------------------------------------------------- the worker side
class ForwardClient:
    """A worker's forward thread's way to the shared process. Used by one thread (the batcher's);
    connecting happens on a thread of its own, so the forward thread never waits for it."""

    def __init__(self, link: ForwardLink, metrics: Metrics) -> None:
        self.link = link
        self._shared = metrics.shared_forward.labels("shared")
        self._own = metrics.shared_forward.labels("own")
        self._conn: Connection | None = None
        self._connecting = False
        self._retry_at = 0.0
        self._seq = 0
        self._lock = threading.Lock()
        self._buffer = Buffer()

    def takes(self, encoded: list[Encoded]) -> bool:
        return max(map(len, encoded)) <= self.link.max_tokens

    def run(self, model: AttentionModel, encoded: list[Encoded], fmt: str, deadline: float,
            quantised: bool = False) -> list[AttentionResult] | None:
        """These inputs' results from the shared process, kept at `fmt` where the device
        quantises (`quantised`: the same setting on both sides); None when it cannot be reached
        (the caller runs them itself). OverBudget when it took them and gave nothing back before
        `deadline`."""
        conn = self._connected()
        if conn is None:
            return self._ran_own()
        lengths = [len(e) for e in encoded]
        # (3, b, width) int64: token ids, segment ids, real tokens
        table = padded_inputs(encoded, lengths, max(lengths)).numpy()
        self._seq += 1
        try:
            weight_bytes = KEPT_DTYPE[fmt].itemsize if quantised else 4
            buffer = self._buffer.at_least(rows_bytes(model.info.n_layers, model.info.n_heads, lengths, weight_bytes))
            new_buffer = self._buffer.fd is not None
            conn.send((self._seq, model.info.id, fmt, table, lengths, new_buffer))
            if new_buffer:  # its descriptor follows the request that first needs it
                send_handle(conn, self._buffer.fd, 0)
                self._buffer.passed()
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                self._drop("no answer before the requests' deadline")  # a late answer would answer the next batch
                raise OverBudget("the request spent its time budget waiting for the shared forward process")
            seq, answer = conn.recv()
        except (OSError, EOFError) as exc:
            self._drop(f"{type(exc).__name__}: {exc}")
            return self._ran_own()
        if seq != self._seq:
            self._drop(f"answer {seq} to request {self._seq}")
            return self._ran_own()
        if isinstance(answer, str):
            log.warning("the shared forward process failed a batch (%s); running it here", answer)
            return self._ran_own()
        self._shared.inc()
        return [
            AttentionResult(
                tokens=enc.tokens, truncated=enc.truncated, attention=read_array(buffer, weights), hidden=None, logits=None,
                top_ids=read_array(buffer, top_ids), top_probs=read_array(buffer, top_probs),
            )
            for enc, (weights, top_ids, top_probs) in zip(encoded, answer)
        ]

    def _ran_own(self) -> None:
        """None: the caller runs the batch on its own model (and it is counted so)."""
        self._own.inc()

    def _connected(self) -> Connection | None:
        conn = self._conn
        if conn is not None:
            return conn
        with self._lock:
            if not self._connecting and time.monotonic() >= self._retry_at:
                self._connecting = True
                threading.Thread(target=self._connect, name="me-forward-link", daemon=True).start()
        return None

    def _connect(self) -> None:
        try:
            conn = Client(self.link.address, family="AF_UNIX", authkey=self.link.authkey)
            set_io_timeouts(conn, IO_TIMEOUT_S, IO_TIMEOUT_S)
            self._conn = conn
            log.info("sending inputs of up to %d tokens to the shared forward process", self.link.max_tokens)
        except Exception:  # not listening yet, restarting, gone: this worker runs its own forwards meanwhile
            self._retry_at = time.monotonic() + RECONNECT_S
        finally:
            self._connecting = False

    def _drop(self, why: str) -> None:
        log.warning("lost the shared forward process (%s); running forwards here, trying again in %.0f s", why, RECONNECT_S)
        conn, self._conn = self._conn, None
        self._retry_at = time.monotonic() + RECONNECT_S
        self._buffer.release()  # the shared process may still write a late answer into the old one
        if conn is not None:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self._buffer.release()
        if conn is not None:
            conn.close()


# ---------------------------------------------------------------------------------- the shared side
@dataclass(eq=False)
class Request:
    conn: Connection
    seq: int
    model_id: str
    fmt: str
    table: np.ndarray  # (3, b, width) int64, as padded_inputs made it
    lengths: list[int]
    new_buffer: bool = False  # the worker's buffer's descriptor follows this request


class ForwardHost:
    """Runs the workers' batches: every queued batch of the oldest one's model that fits the
    batch limits, as one forward. One reader thread a worker queues its batches; one forward
    thread runs them, in arrival order."""

    def __init__(self, models: dict[str, AttentionModel], settings: Settings, quantise: bool) -> None:
        self.models = models
        self.max_items = settings.max_batch_items
        self.max_tokens = settings.max_batch_tokens
        self.max_cells = settings.max_batch_cells
        self.max_width = settings.shared_forward_max_tokens
        self.quantise = quantise
        self.copier = HostCopier()
        self._pending: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._maps: dict[Connection, mmap.mmap] = {}  # each worker's buffer, mapped

    def serve(self, listener: Listener) -> None:
        """Accepts workers until close(); starts the forward thread."""
        threading.Thread(target=self._forward_loop, name="me-shared-fwd", daemon=True).start()
        self._listener = listener
        while not self._closed.is_set():
            try:
                conn = listener.accept()
            except Exception:  # a peer without the key, one that hung up during the challenge, or closed
                continue
            set_io_timeouts(conn, IO_TIMEOUT_S)  # a worker that stops reading must not hold every other
            threading.Thread(target=self._read, args=(conn,), name="me-forward-reader", daemon=True).start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # Closing the socket does not wake an accept() blocked on another thread (the process's
        # SIGTERM handler runs on serve()'s own, which is why it stopped there): a connection does,
        # and serve() then sees it is closed.
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.settimeout(1)
            wake.connect(self._listener.address)
        self._listener.close()

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                request = Request(conn, *conn.recv())
                if request.new_buffer:
                    fd = recv_handle(conn)
                    try:
                        buffer = mmap.mmap(fd, 0)  # all of it, however large the worker says it is
                    finally:
                        os.close(fd)
                    with self._cond:
                        self._maps[conn] = buffer
                problem = self._check(request)
                if problem:
                    self._answer(request, problem)
                    continue
                with self._cond:
                    self._pending.append(request)
                    self._cond.notify()
        except (EOFError, OSError, ValueError, TypeError, RuntimeError):  # gone (or sent what no worker sends)
            with self._cond:
                # This thread alone closes the connection (others hang it up, under this lock).
                # Its buffer is unmapped once the forward thread, which may be writing it, lets go.
                self._maps.pop(conn, None)
                conn.close()

    def _check(self, request: Request) -> str | None:
        table, lengths = request.table, request.lengths
        if request.model_id not in self.models:
            return f"unknown model {request.model_id!r}"
        if request.fmt not in ("json", "f16", "u8"):
            return f"unknown format {request.fmt!r}"
        if not (isinstance(table, np.ndarray) and table.dtype == np.int64 and table.ndim == 3 and table.shape[0] == 3):
            return "the inputs are not a (3, b, width) int64 table"
        width = table.shape[2]
        if not (0 < width <= self.max_width and len(lengths) == table.shape[1] and all(0 < n <= width for n in lengths)):
            return "the inputs' lengths do not match their table"
        info = self.models[request.model_id].info
        with self._cond:
            buffer = self._maps.get(request.conn)
        weight_bytes = KEPT_DTYPE[request.fmt].itemsize if self.quantise else 4
        if buffer is None or len(buffer) < rows_bytes(info.n_layers, info.n_heads, lengths, weight_bytes):
            return "no buffer large enough for the answer"
        return None

    def _take(self) -> list[Request]:
        with self._cond:
            while not self._pending:
                self._cond.wait()
            first = self._pending.popleft()
            chosen, rows, width = [first], len(first.lengths), first.table.shape[2]
            info = self.models[first.model_id].info
            per_pair = info.n_layers * info.n_heads
            for request in list(self._pending):
                if request.model_id != first.model_id:
                    continue
                wider, more = max(width, request.table.shape[2]), rows + len(request.lengths)
                if more <= self.max_items and more * wider <= self.max_tokens and more * per_pair * wider * wider <= self.max_cells:
                    self._pending.remove(request)
                    chosen.append(request)
                    rows, width = more, wider
            return chosen

    def _forward_loop(self) -> None:
        from manyeyes.app.services.batcher import name_os_thread  # the batcher imports this module

        name_os_thread("me-shared-fwd")
        while True:
            chosen = self._take()
            try:
                answers = self.forward(chosen)
            except Exception as exc:  # each worker runs its batch itself, and reports what fails there
                log.exception("shared forward failed")
                answers = [f"{type(exc).__name__}: {exc}"] * len(chosen)
            for request, answer in zip(chosen, answers):
                if not isinstance(answer, str):
                    try:
                        answer = self._written(request, answer)
                    except (OSError, ValueError) as exc:  # its worker has gone
                        answer = f"{type(exc).__name__}: {exc}"
                self._answer(request, answer)

    def _answer(self, request: Request, answer) -> None:
        try:
            request.conn.send((request.seq, answer))
        except (OSError, ValueError):  # gone, or not reading: its reader ends with it
            with self._cond:
                if not request.conn.closed:
                    hang_up(request.conn)

    def _written(self, request: Request, rows: list[tuple]) -> list[tuple]:
        """The rows written into the worker's buffer; what says where each array lies. Weights
        kept more precisely than this request asked (a batch-mate asked for more) are quantised
        to its own format here, as its buffer was sized for it: the arithmetic of the device's,
        so from float32 the same bytes (u8 from a batch-mate's float16, within one step)."""
        with self._cond:
            buffer = self._maps.get(request.conn)
        if buffer is None or request.conn.closed:  # its worker went while it ran: nothing to write
            raise OSError("the worker has gone")
        offset, specs = 0, []
        own_dtype = KEPT_DTYPE[request.fmt] if self.quantise else None
        for arrays in rows:
            spec = []
            for index, array in enumerate(arrays):
                if array is None:
                    spec.append(None)
                    continue
                if index == 0 and own_dtype is not None and array.dtype != own_dtype:
                    array = quantise(array.float(), request.fmt)
                offset = -(-offset // ALIGN) * ALIGN
                source = array.numpy()
                np.ndarray(source.shape, source.dtype, buffer=buffer, offset=offset)[...] = source
                spec.append((offset, source.dtype.str, source.shape))
                offset += source.nbytes
            specs.append(tuple(spec))
        return specs

    def forward(self, chosen: list[Request]) -> list[list[tuple]]:
        """One forward over the requests' rows; each request's rows back, each (weights, top_ids,
        top_probs) of its own tokens only: views of the batch's outputs."""
        model = self.models[chosen[0].model_id]
        lengths = [n for request in chosen for n in request.lengths]
        width = max(request.table.shape[2] for request in chosen)
        table = np.zeros((3, len(lengths), width), dtype=np.int64)
        row = 0
        for request in chosen:
            b, w = request.table.shape[1:]
            table[:, row : row + b, :w] = request.table  # (3, b, w) into (3, rows, width)
            row += b
        to_host = device_to_host(self.copier, most_precise(r.fmt for r in chosen)) if self.quantise else None
        out = model.forward_table(torch.from_numpy(table), lengths, WEIGHTS_ONLY, to_host)
        answers, row = [], 0
        for request in chosen:
            rows = []
            for n in request.lengths:
                # (b, layers, heads, width, width) -> (layers, heads, n, n)
                weights = out.attention[row, :, :, :n, :n]
                top_ids = None if out.top_ids is None else out.top_ids[row, :n]
                top_probs = None if out.top_probs is None else out.top_probs[row, :n]
                rows.append((weights, top_ids, top_probs))
                row += 1
            answers.append(rows)
        return answers
