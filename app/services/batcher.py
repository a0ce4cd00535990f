"""Dynamic micro-batching: one worker thread per device runs requests that arrive together as one
padded, masked forward pass, so the event loop never blocks on inference."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from manyeyes.app.services.errors import NotReady, OverBudget, QueueFull
from manyeyes.app.services.metrics import Metrics
from manyeyes.model.runtime import AttentionModel, AttentionResult
from manyeyes.model.tokenizer import Encoded


@dataclass
class Done:
    result: AttentionResult
    queue_s: float
    forward_s: float
    batch_size: int


@dataclass(eq=False)
class Job:
    model: AttentionModel
    encoded: Encoded
    deadline: float  # time.monotonic() after which the work is no longer wanted
    enqueued: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


class Batcher:
    """Owns one device. Admission is counted from the moment a request is accepted (before it is
    tokenized) until its forward pass ends, so at most `max_queue` inputs are ever in the system
    (tokenizing, waiting or running) and the N+1st of N simultaneous arrivals gets 429, however
    the worker's timing falls. The worker also knows more is coming."""

    def __init__(
        self,
        device: str,
        metrics: Metrics,
        max_batch_tokens: int,
        max_batch_items: int,
        max_wait_s: float,
        max_queue: int,
        forward_delay_s: float = 0.0,
    ) -> None:
        self.device = device
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.forward_delay_s = forward_delay_s
        self._pending: deque[Job] = deque()
        self._admitted = 0  # accepted, not yet submitted (being tokenized)
        self._running = 0  # taken by the worker, forward pass not finished
        self._cond = threading.Condition()
        self._closed = False
        self._forward_ewma_s = 0.05
        self._last_batch = 0
        self._thread = threading.Thread(target=self._loop, name=f"manyeyes-forward-{device}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side
    def admit(self, n: int = 1) -> None:
        """Reserve room for n inputs or refuse with 429; pair with submit() or release()."""
        with self._cond:
            if self._closed:
                raise NotReady("the server is shutting down")
            waiting = self._admitted + len(self._pending) + self._running
            if waiting + n > self.max_queue:
                self.metrics.dropped.labels("queue_full").inc(n)
                raise QueueFull(
                    f"the queue is full ({waiting} waiting, room for {self.max_queue}); retry shortly",
                    self._retry_after(waiting),
                )
            self._admitted += n

    def release(self, n: int = 1) -> None:
        with self._cond:
            self._admitted -= n
            self._cond.notify_all()

    def submit(self, model: AttentionModel, encoded: Encoded, deadline: float) -> Future:
        """Hand one admitted input to the worker; the future resolves to a Done."""
        job = Job(model, encoded, deadline)
        with self._cond:
            self._admitted -= 1
            if self._closed:
                job.future.set_exception(NotReady("the server is shutting down"))
                return job.future
            self._pending.append(job)
            self.metrics.queue_depth.inc()
            self._cond.notify_all()
        # A client that goes away cancels its future: free its place in the queue at once. The
        # callback takes the future, not the job: job -> future -> callback -> job would be a
        # cycle that keeps every finished result's attention alive until a full gc.
        job.future.add_done_callback(self._forget_cancelled)
        return job.future

    def _forget_cancelled(self, future: Future) -> None:
        if not future.cancelled():
            return
        with self._cond:
            # Not found: the worker already took it, and _run counts it.
            job = next((j for j in self._pending if j.future is future), None)
            if job is not None:
                self._pending.remove(job)
                self.metrics.queue_depth.dec()
                self.metrics.dropped.labels("cancelled").inc()
                self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _retry_after(self, waiting: int) -> int:
        # Seconds until the queue ahead would drain, at the recent forward rate of full batches.
        return max(1, math.ceil(self._forward_ewma_s * (waiting / self.max_batch_items + 1)))

    # ------------------------------------------------------------------ worker side
    def _select(self, model: AttentionModel) -> tuple[list[Job], bool]:
        """FIFO jobs of one model that fit the token budget; True when some had to be left out."""
        chosen: list[Job] = []
        width = 0
        left_out = False
        for job in self._pending:
            if job.model is not model:
                continue
            wider = max(width, len(job.encoded))
            if chosen and (wider * (len(chosen) + 1) > self.max_batch_tokens or len(chosen) >= self.max_batch_items):
                left_out = True
                continue
            chosen.append(job)
            width = wider
        return chosen, left_out

    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            model = self._pending[0].model
            # Under load (the last forward was shared) the next requests are on their way, so
            # wait up to max_wait from now for them; a lone client never waits, and requests
            # already admitted (still tokenizing) are always worth waiting for.
            loaded = self._last_batch > 1
            until = max(self._pending[0].enqueued, time.monotonic() if loaded else 0.0) + self.max_wait_s
            while True:
                batch, full = self._select(model)
                remaining = until - time.monotonic()
                if full or self._closed or remaining <= 0 or (self._admitted <= 0 and not loaded):
                    break
                self._cond.wait(remaining)
            self._last_batch = len(batch)
            for job in batch:
                self._pending.remove(job)
            self.metrics.queue_depth.dec(len(batch))
            self._running += len(batch)
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                break
            self._run(batch)
        with self._cond:
            leftovers = list(self._pending)
            self._pending.clear()
        for job in leftovers:
            if job.future.set_running_or_notify_cancel():
                self.metrics.dropped.labels("shutdown").inc()
                job.future.set_exception(NotReady("the server is shutting down"))

    def _settle(self, job: Job, result: Done | None = None, error: BaseException | None = None) -> None:
        """Free the job's place before its request can see the answer, so a client that sends its
        next request at once is never refused for room its last one still held."""
        with self._cond:
            self._running -= 1
            self._cond.notify_all()
        if error is not None:
            job.future.set_exception(error)
        elif result is not None:
            job.future.set_result(result)

    def _run(self, batch: list[Job]) -> None:
        now = time.monotonic()
        live: list[Job] = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                self.metrics.dropped.labels("cancelled").inc()
                self._settle(job)
            elif job.deadline <= now:
                self.metrics.dropped.labels("expired").inc()
                self._settle(job, error=OverBudget("the request spent its time budget waiting in the queue"))
            else:
                live.append(job)
        if not live:
            return
        model = live[0].model
        started = time.monotonic()
        try:
            if self.forward_delay_s:
                time.sleep(self.forward_delay_s)
            results = model.run([job.encoded for job in live])
        except Exception as exc:  # handed to each waiting request, which reports it
            for job in live:
                self._settle(job, error=exc)
            return
        forward_s = time.monotonic() - started
        self._forward_ewma_s = 0.8 * self._forward_ewma_s + 0.2 * forward_s
        name = model.info.id
        self.metrics.forward.labels(name).observe(forward_s)
        self.metrics.batch_size.labels(name).observe(len(live))
        self.metrics.batch_tokens.labels(name).observe(len(live) * max(len(j.encoded) for j in live))
        for job, result in zip(live, results):
            self._settle(job, Done(result, started - job.enqueued, forward_s, len(live)))
