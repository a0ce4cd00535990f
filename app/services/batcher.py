"""Dynamic micro-batching: one worker thread per device runs requests that arrive together as one
padded, masked forward pass, so the event loop never blocks on inference."""

from __future__ import annotations

import asyncio
import ctypes
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice

from manyeyes.app.services.device import HostCopier, device_to_host, most_precise
from manyeyes.app.services.errors import InvalidInput, NotReady, OverBudget, QueueFull
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.shared_forward import ForwardClient
from manyeyes.model.attention import WEIGHTS_ONLY, Capture
from manyeyes.model.runtime import AttentionModel, AttentionResult
from manyeyes.model.tokenizer import Encoded

# Work of one input of n tokens, in units whose forward time is roughly proportional: n^2 for the
# attention (scores, softmax, the weights kept), 64 n for the rest (projections, feed-forward).
# 64 is where the two met for MiniLM on the CPU (a fit of 16..512-token forwards). Rows shorter
# than 64 tokens count as 64: their cost is the per-row and per-token part, which padding them
# that far hardly changes. The measured rate (WorkRate) and the calibration absorb the rest.
LINEAR_TOKENS = 64
# A job beyond its client's first, or a first that widens the batch, joins only if the batch's
# padded work stays within this factor of the work its rows need: one 512-token row padding
# fifteen short ones to 512 made a forward take ten times its rows' work, and the estimates of
# everything behind it wrong.
PADDING_SLACK = 1.5
# Clients whose last batch the round-robin order remembers (a few bytes each).
SERVED_MEMORY = 10_000


def work_units(n_tokens: int) -> int:
    n = max(n_tokens, LINEAR_TOKENS)
    return n * (n + LINEAR_TOKENS)


def name_os_thread(name: str) -> None:
    """Names the calling thread for the OS (top -H, /proc/<pid>/task/*/comm, py-spy), which
    Python before 3.14 does not: otherwise every thread of a server reads "python3", and a CPU
    profile cannot tell the forward thread from the event loop or torch's pool. Linux only."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME, 15 bytes at most
    except (OSError, AttributeError):
        pass


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
    client: str = ""  # whose share of the queue it counts against (API key, else address)
    fmt: str = "json"  # the precision its answer needs, when attention is quantised on the device
    keep: bool = False  # keep queries and keys (a long input), not the weights: runs in a forward of its own
    enqueued: float = field(default_factory=time.monotonic)
    # Made by submit() on the event loop, resolved there by call_soon_threadsafe from the worker.
    # Not a concurrent.futures.Future through asyncio.wrap_future: that bridge's locks, callbacks
    # and state copies cost 0.03 ms of every answer's hand-back (measured side by side).
    answer: asyncio.Future | None = None
    estimate_s: float | None = None  # uncalibrated wait for its answer, estimated when it was queued
    # Set where held_back judged it before it waited for its answer's bytes: when it did, and the
    # estimate then (estimate_s), calibrated apart (that wait is for answers going out, not forwards).
    held_since: float | None = None
    units: int = field(init=False)  # its work, in work_units

    def __post_init__(self) -> None:
        self.units = work_units(len(self.encoded))

    @property
    def wanted(self) -> bool:
        """Whether a request still waits for it: its answer is neither cancelled (the client went
        away) nor failed by Batcher.expire (its time ran out)."""
        return self.answer is not None and not self.answer.done()


class HeldBack:
    """Admission by work for a request's inputs about to wait for their answers' bytes
    (slots.FairBytes), judged when entered (QueueFull, 429, at once), and their work counted as
    their client's backlog while it waits. `since` and `estimate_s` (what was judged, before
    calibration) go to submit, which then neither judges again nor answers 429 late. Inputs of
    one client that each need most of its share of those bytes wait for them one after another:
    counted nowhere, the 30th of 50 long requests saw a short queue, waited out its budget for
    its bytes, and got its 429 thirty seconds late."""

    def __init__(self, batcher: Batcher, jobs: list[Job], deadline: float) -> None:
        self.batcher, self.jobs, self.deadline = batcher, jobs, deadline
        self.since: float | None = None  # set once entered
        self.estimate_s: float | None = None

    def __enter__(self) -> HeldBack:
        self.since = self.batcher._hold_back(self.jobs, self.deadline)
        self.estimate_s = self.jobs[0].estimate_s
        return self

    def __exit__(self, *exc) -> None:
        self.batcher._let_go(self.jobs)


class ClientQueue:
    """One client's waiting jobs, oldest first, with their work units summed by model: the
    estimate made for every request then costs a step per client instead of one per queued job,
    however long one client's backlog grows (cProfile put the walk at 5% of the event loop with 32
    requests in flight from one client; unprofiled, 4% at 128)."""

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()
        self.units: Counter[str] = Counter()  # model id -> work units of its jobs here

    def append(self, job: Job) -> None:
        self._jobs.append(job)
        self.units[job.model.info.id] += job.units

    def remove(self, job: Job) -> None:
        self._jobs.remove(job)
        self.units[job.model.info.id] -= job.units

    def __iter__(self):
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def __getitem__(self, i: int) -> Job:
        return self._jobs[i]


class WorkRate:
    """Work units a model's forwards get through per second, from its recent batches (sums that
    decay by a fifth every forward, so long batches weigh as much as their time)."""

    DECAY = 0.8

    def __init__(self) -> None:
        self.units = 0.0
        self.seconds = 0.0

    def observe(self, units: int, seconds: float) -> None:
        self.units = self.DECAY * self.units + units
        self.seconds = self.DECAY * self.seconds + seconds

    def seconds_for(self, units: float) -> float | None:
        return units * self.seconds / self.units if self.units > 0 and self.seconds > 0 else None


class Batcher:
    """Owns one device. Admission is counted from the moment a request is accepted (before it is
    tokenized) until its forward pass ends, so at most `max_queue` inputs are ever in the system
    (tokenizing, waiting or running) and the N+1st of N simultaneous arrivals gets 429, however
    the worker's timing falls. The worker also knows more is coming.

    Fair shares: each client (API key, else address) has its own queue and at most
    `max_client_queue` inputs in the system; batches are filled round-robin across clients, so
    one client's flood delays another's request by at most the batch already running.

    Admission by work: inputs are queued only if the work ahead of them (in round-robin order,
    so only their own client's backlog counts in full) plus their own can be done, at the
    model's recent forward rate, within `work_fraction` of the request's remaining budget;
    otherwise 429 at once, rather than a 504 once the budget is spent. Estimates are calibrated
    by how long answers really took against what was estimated for them (contention from other
    processes, padding). Inputs with nothing ahead are always queued."""

    def __init__(
        self,
        device: str,
        metrics: Metrics,
        max_batch_tokens: int,
        max_batch_items: int,
        max_wait_s: float,
        max_queue: int,
        forward_delay_s: float = 0.0,
        max_client_queue: int | None = None,
        device_quantise: bool = False,
        copier: HostCopier | None = None,
        max_batch_cells: int | None = None,
        work_fraction: float = 0.0,
        shared: ForwardClient | None = None,
    ) -> None:
        self.device = device
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.forward_delay_s = forward_delay_s
        self.max_client_queue = max_client_queue or max_queue
        self.device_quantise = device_quantise
        self.max_batch_cells = max_batch_cells
        self.work_fraction = work_fraction  # 0: admission by count only
        self.copier = copier or HostCopier()
        self.shared = shared  # the shared forward process, for batches of short inputs (--shared-forward)
        # client -> its waiting jobs; the dict's order is the round-robin order: by when each
        # client was last served, the least recently first.
        self._pending: OrderedDict[str, ClientQueue] = OrderedDict()
        # client -> the number of the batch that last served it, least recent first (bounded).
        self._served: OrderedDict[str, int] = OrderedDict()
        self._batches = 0
        self._n_pending = 0
        self._per_client: Counter[str] = Counter()  # admitted + pending + running, by client
        self._admitted = 0  # accepted, not yet submitted (being tokenized)
        # client -> model id -> work units of its inputs tokenized and waiting for their answers'
        # bytes (slots.FairBytes) before submit: its own backlog, not yet in its queue.
        self._held_back: dict[str, Counter[str]] = {}
        self._running = 0  # taken by the worker, forward pass not finished
        self._cond = threading.Condition()
        self._closed = False
        self._forward_ewma_s = 0.05
        self._last_batch = 0
        self._rates: dict[str, WorkRate] = {}  # model id -> its recent forward rate
        self._running_batch: tuple[float, float] | None = None  # (started, expected seconds) of the forward under way
        self._calibration = 1.0  # recent answers' real wait over their estimate
        self._held_calibration = 1.0  # the same, for those that waited for their answers' bytes first
        self._admitted_gauge = metrics.queue_admitted.labels(device)
        metrics.queue_limit.labels(device).set(max_queue)
        self._admitted_gauge.set(0)
        self._thread = threading.Thread(target=self._loop, name=f"manyeyes-forward-{device}", daemon=True)
        self._thread.start()

    def seed_rate(self, model_id: str, units: int, seconds: float) -> None:
        """A first rate from a forward timed outside the batcher (the warm-up's), weighed as one
        short input's: the warm-up's long forward would otherwise outweigh the first real batches
        for a dozen forwards, and it is not timed as the batcher times (quantising, copies)."""
        light = work_units(LINEAR_TOKENS)
        with self._cond:
            self._rates.setdefault(model_id, WorkRate()).observe(light, seconds * light / units)

    # ------------------------------------------------------------------ event-loop side
    def admit(self, n: int = 1, client: str = "") -> None:
        """Reserve room for n inputs or refuse with 429; pair with submit() or release()."""
        # More inputs than a client may ever have in the queue: no retry would fit, so not a 429.
        ceiling = min(self.max_client_queue, self.max_queue)
        if n > ceiling:
            raise InvalidInput(
                f"this request holds {n} inputs, and this server queues at most {ceiling} for one client; "
                "send them in smaller batches"
            )
        with self._cond:
            if self._closed:
                raise NotReady.shutting_down()
            waiting = self._admitted + self._n_pending + self._running
            if waiting + n > self.max_queue:
                self.metrics.dropped.labels("queue_full").inc(n)
                raise QueueFull(
                    f"the queue is full ({waiting} waiting, room for {self.max_queue}); retry shortly",
                    self._retry_after(waiting),
                )
            mine = self._per_client[client]
            if mine + n > self.max_client_queue:
                self.metrics.dropped.labels("client_share").inc(n)
                raise QueueFull(
                    f"this client already has {mine} inputs in the queue, its share is {self.max_client_queue}; "
                    "retry shortly",
                    self._retry_after(mine),
                )
            self._admitted += n
            self._per_client[client] += n
            self._count_admitted()

    def _count_admitted(self) -> None:
        """manyeyes_queue_admitted: what admit() compares against max_queue. Under self._cond."""
        self._admitted_gauge.set(self._admitted + self._n_pending + self._running)

    def release(self, n: int = 1, client: str = "") -> None:
        if n == 0:  # all submitted: nothing to give back, and no reason to wake the worker
            return
        with self._cond:
            self._admitted -= n
            self._leave(client, n)
            self._count_admitted()
            self._cond.notify_all()

    def _leave(self, client: str, n: int = 1) -> None:
        self._per_client[client] -= n
        if self._per_client[client] <= 0:
            del self._per_client[client]

    def held_back(self, model: AttentionModel, encoded: list[Encoded], deadline: float, client: str = "") -> HeldBack:
        """For inputs that may have to wait for their answers' bytes: entered only if they do."""
        return HeldBack(self, [Job(model, e, deadline, client) for e in encoded], deadline)

    def _hold_back(self, jobs: list[Job], deadline: float) -> float:
        client = jobs[0].client
        with self._cond:
            self._check_work(jobs, deadline, self._held_calibration)
            mine = self._held_back.setdefault(client, Counter())
            for job in jobs:
                mine[job.model.info.id] += job.units
        return time.monotonic()

    def _let_go(self, jobs: list[Job]) -> None:
        client = jobs[0].client
        with self._cond:
            mine = self._held_back[client]
            for job in jobs:
                mine[job.model.info.id] -= job.units
            if not +mine:
                del self._held_back[client]

    def submit(
        self, model: AttentionModel, encoded: list[Encoded], deadline: float, client: str = "", fmt: str = "json",
        keep: list[bool] | None = None, held: HeldBack | None = None,
    ) -> list[asyncio.Future]:
        """Hand admitted inputs of one request to the worker, all or none; called on the event
        loop, whose futures it returns: each resolves to a Done. `keep[i]`: input i keeps
        queries and keys (a long input), not the weights.
        QueueFull (429) when the work ahead would not let them finish before the deadline, unless
        `held` (held_back admitted them before their wait: a 429 after it would come late, and
        what is left of the budget ends in a 504 if it must); NotReady (503) when shutting down.
        Either way the caller releases them."""
        keep = keep or [False] * len(encoded)
        loop = asyncio.get_running_loop()
        jobs = [Job(model, e, deadline, client, fmt, k, answer=loop.create_future()) for e, k in zip(encoded, keep)]
        with self._cond:
            if self._closed:
                raise NotReady.shutting_down()
            if held is None or held.since is None:
                self._check_work(jobs, deadline, self._calibration)
            else:
                for job in jobs:
                    job.held_since, job.estimate_s = held.since, held.estimate_s
            self._admitted -= len(jobs)
            self._enqueue(jobs)
            self.metrics.queue_depth.inc(len(jobs))
            self._cond.notify_all()
        # A client that goes away cancels its future: free its place in the queue at once. The
        # callback takes the future, not the job: job -> future -> callback -> job would be a
        # cycle while the future waits.
        for job in jobs:
            job.answer.add_done_callback(self._forget_cancelled)
        return [job.answer for job in jobs]

    def wait_ahead_s(self, jobs: list[Job]) -> float | None:
        """Seconds until these jobs (all of one client and model) would be done, at the recent
        forward rates and before calibration; None while the model has no measured forward yet.
        Round-robin serves each client's i-th job in turn i, so of another client's queue only
        as many jobs count as this client will have queued, counting the new ones."""
        client = jobs[0].client
        own_rate = self._rates.get(jobs[0].model.info.id)
        if own_rate is None:
            return None
        turns = len(self._pending.get(client, ())) + len(jobs)
        seconds = own_rate.seconds_for(sum(job.units for job in jobs)) or 0.0
        # Its inputs waiting for their answers' bytes go before these, whatever the rotation.
        seconds += sum(self._seconds_for(model_id, units) for model_id, units in self._held_back.get(client, {}).items())
        for other, queue in self._pending.items():
            if other == client or len(queue) <= turns:
                seconds += sum(self._seconds_for(model_id, units) for model_id, units in queue.units.items())
            else:
                seconds += sum(self._seconds_for(job.model.info.id, job.units) for job in islice(queue, turns))
        if self._running_batch is not None:
            started, expected = self._running_batch
            seconds += max(0.0, expected - (time.monotonic() - started))
        return seconds

    def _seconds_for(self, model_id: str, units: int) -> float:
        rate = self._rates.get(model_id)
        return (rate.seconds_for(units) or 0.0) if rate else 0.0

    def _check_work(self, jobs: list[Job], deadline: float, calibration: float) -> float | None:
        """The jobs' uncalibrated estimate (also set on them), or QueueFull where `calibration` times
        it passes their share of the budget."""
        if not self.work_fraction:
            return None  # admission by count only: no estimate, so nothing to calibrate either
        estimate = self.wait_ahead_s(jobs)
        for job in jobs:
            job.estimate_s = estimate
        if estimate is None or not (self._pending or self._running_batch or self._held_back.get(jobs[0].client)):
            return estimate  # no rate measured yet, or nothing ahead: it runs next
        needed = estimate * calibration
        allowed = self.work_fraction * (deadline - time.monotonic())
        if needed > allowed:
            self.metrics.dropped.labels("work").inc(len(jobs))
            raise QueueFull(
                f"the server has about {needed:.1f} s of work queued for this request, more than its "
                f"{allowed:.1f} s budget allows; retry shortly",
                max(1, math.ceil(needed - allowed)),
            )
        return estimate

    def _calibrate(self, jobs: list[Job], now: float) -> None:
        """Fold how long these answers took, against their estimates, into the calibration. A ratio
        of sums, so that a job estimated at a few milliseconds (nothing ahead of it when it came)
        that then waited for a long forward cannot swing it by itself. Jobs that waited for their
        answers' bytes first have one of their own: that wait is as long as the answers ahead take
        to go out (a 500-token u8 answer took 0.3 s to encode and send after a 0.13 s forward), and
        would otherwise make every other estimate as pessimistic."""
        self._calibration = self._calibrated(self._calibration, [j for j in jobs if j.held_since is None], now)
        self._held_calibration = self._calibrated(self._held_calibration, [j for j in jobs if j.held_since is not None], now)

    @staticmethod
    def _calibrated(calibration: float, jobs: list[Job], now: float) -> float:
        timed = [job for job in jobs if job.estimate_s]
        estimated = sum(job.estimate_s for job in timed)
        if estimated <= 0.05:
            return calibration
        observed = sum(now - (job.enqueued if job.held_since is None else job.held_since) for job in timed) / estimated
        return min(max(0.7 * calibration + 0.3 * min(observed, 10.0), 0.5), 10.0)

    def _forget_cancelled(self, future: asyncio.Future) -> None:
        # Cancelled: its request's task was (the client went away, or the server's shutdown ended
        # it). A request whose time runs out fails its answers through expire() instead.
        if not future.cancelled():
            return
        with self._cond:
            # Not found: the worker already took it, and _run counts it.
            job = next((j for queue in self._pending.values() for j in queue if j.answer is future), None)
            if job is not None:
                self._drop_waiting([job], "cancelled")

    def expire(self, futures: list[asyncio.Future], message: str) -> None:
        """The request's time budget ran out before these answers came: its inputs still waiting
        leave the queue, counted as dropped{reason="expired"}, and each answer not yet given fails
        with OverBudget(message), a 504. Not a cancel: the request's own deadline cancelling its
        futures (asyncio.timeout) made _forget_cancelled count every 504 as a client that hung up.
        An input already in a forward runs on, as a hang-up's does, its result for nobody (one
        taken but not yet run, _run counts as expired). Event loop only."""
        with self._cond:
            mine = {id(future) for future in futures}
            jobs = [job for queue in self._pending.values() for job in queue if id(job.answer) in mine]
            if jobs:
                self._drop_waiting(jobs, "expired")
        for future in futures:
            if not future.done():
                future.set_exception(OverBudget(message))

    def _drop_waiting(self, jobs: list[Job], reason: str) -> None:
        """Takes waiting jobs out of the queue, counted as dropped for `reason`. Under self._cond."""
        for job in jobs:
            self._take(job)
            self._leave(job.client)
        self.metrics.queue_depth.dec(len(jobs))
        self.metrics.dropped.labels(reason).inc(len(jobs))
        self._count_admitted()
        self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            busy = self._running_batch is not None
        # A forward under way cannot be stopped and the thread is a daemon: at a shutdown the
        # process exits without it, and waiting for it only took its timeout out of the second
        # the grace keeps for the exit. An idle thread ends at once, settling what was queued.
        # With a shared forward link the bounded wait stays: the link is closed just below, and
        # a forward that ends within the timeout should not meet it closed.
        self._thread.join(0 if busy and self.shared is None else timeout_s)
        if self.shared is not None:
            self.shared.close()

    def _retry_after(self, waiting: int) -> int:
        # Seconds until the queue ahead would drain, at the recent forward rate of full batches.
        return max(1, math.ceil(self._forward_ewma_s * (waiting / self.max_batch_items + 1)))

    def _enqueue(self, jobs: list[Job]) -> None:
        for job in jobs:
            queue = self._pending.get(job.client)
            if queue is None:
                queue = self._pending[job.client] = ClientQueue()
                self._take_turn(job.client)
            queue.append(job)
        self._n_pending += len(jobs)

    def _take_turn(self, client: str) -> None:
        """Place a client whose queue was empty by when it was last served, not at the back: a
        client that sends one request at a time empties its queue each time, and went behind the
        flooding client just served, so its next request waited for one more of the flood's
        batches, padded to the flood's length (1.7 s against 42 ms unloaded). It goes before
        those served in its last batch too: they have had as much, and their jobs still waiting
        are the ones that batch left out."""
        last = self._served.get(client, -1)  # -1: never served (or forgotten)

        def behind(other: str) -> bool:  # clients never served keep their order of arrival
            since = self._served.get(other, -1)
            return since > last or since == last >= 0

        for other in [c for c in self._pending if c != client and behind(c)]:
            self._pending.move_to_end(other)

    # ------------------------------------------------------------------ worker side
    def _take(self, job: Job) -> None:
        queue = self._pending[job.client]
        queue.remove(job)
        self._n_pending -= 1
        if not queue:
            del self._pending[job.client]

    def _lead(self) -> Job:
        """The next batch's first job: the oldest of the client whose turn it is. The globally
        oldest job led every batch, so one client's long inputs, each a forward of its own, queued
        before another's short one all ran first (3.4 s of waiting for 0.01 s of work)."""
        return next(iter(self._pending.values()))[0]

    def _select(self, model: AttentionModel, keep: bool = False) -> tuple[list[Job], bool]:
        """Jobs of one model that fit the token budget, one per client in turn (each client's
        oldest first); True when some had to be left out. A long input that keeps its queries
        and keys runs alone: its forward is compute-bound, a batch would only pad it."""
        if keep:
            first = next((j for queue in self._pending.values() for j in queue if j.model is model and j.keep), None)
            return ([first] if first else []), True
        chosen: list[Job] = []
        width = 0
        needed = 0  # work units of the chosen rows, unpadded
        left_out = False
        # Attention weights a row of width w holds: layers x heads x w x w (float32 on the device).
        per_pair = model.info.n_layers * model.info.n_heads
        queues = [[j for j in queue if j.model is model and not j.keep] for queue in self._pending.values()]
        for turn in range(max(map(len, queues), default=0)):
            for queue in queues:
                if turn >= len(queue):
                    continue
                job = queue[turn]
                wider = max(width, len(job.encoded))
                rows = len(chosen) + 1
                over_cells = self.max_batch_cells is not None and rows * per_pair * wider * wider > self.max_batch_cells
                # A client's later jobs join only where the batch does not become mostly padding.
                # Its first joins as long as it is no wider than the batch (the fair-share bound:
                # it is served by the next forward); one that widens the batch that much leads a
                # batch of its own next instead, so a short lead is never padded to a flood's
                # 512 tokens (another client's 16-token request waited 1.7 s for 42 ms of work).
                wasteful = (turn > 0 or wider > width) and rows * work_units(wider) > PADDING_SLACK * (needed + job.units)
                if chosen and (wider * rows > self.max_batch_tokens or len(chosen) >= self.max_batch_items or over_cells or wasteful):
                    left_out = True
                    continue
                chosen.append(job)
                needed += job.units
                width = wider
        return chosen, left_out

    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            lead = self._lead()
            model = lead.model
            # Under load (the last forward was shared) the next requests are on their way, so
            # wait up to max_wait from now for them; a lone client never waits, and requests
            # already admitted (still tokenizing) are always worth waiting for.
            loaded = self._last_batch > 1
            until = max(lead.enqueued, time.monotonic() if loaded else 0.0) + self.max_wait_s
            while True:
                batch, full = self._select(model, lead.keep)
                remaining = until - time.monotonic()
                if full or self._closed or remaining <= 0 or (self._admitted <= 0 and not loaded):
                    break
                self._cond.wait(remaining)
            self._last_batch = len(batch)
            for job in batch:
                self._take(job)
            # Whoever was served goes to the back of the round-robin order.
            self._batches += 1
            for client in dict.fromkeys(job.client for job in batch):
                self._served[client] = self._batches
                self._served.move_to_end(client)
                if client in self._pending:
                    self._pending.move_to_end(client)
            # Forgetting a client only moves its next request forward, as if it were new.
            while len(self._served) > SERVED_MEMORY:
                self._served.popitem(last=False)
            self.metrics.queue_depth.dec(len(batch))
            self._running += len(batch)
            rate = self._rates.get(model.info.id)
            expected = rate.seconds_for(sum(job.units for job in batch)) if rate else None
            self._running_batch = (time.monotonic(), expected or 0.0)
            return batch

    def _loop(self) -> None:
        name_os_thread(f"me-forward-{self.device}")
        while True:
            batch = self._next_batch()
            if batch is None:
                break
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._running_batch = None
        with self._cond:
            leftovers = [job for queue in self._pending.values() for job in queue]
            self._pending.clear()
            self._n_pending = 0
            for job in leftovers:
                self._leave(job.client)
            self._count_admitted()
        for job in leftovers:
            if job.wanted:
                self.metrics.dropped.labels("shutdown").inc()
                _deliver(job.answer, error=NotReady.shutting_down())

    def _settle(self, job: Job, result: Done | None = None, error: BaseException | None = None) -> None:
        """Free the job's place before its request can see the answer, so a client that sends its
        next request at once is never refused for room its last one still held."""
        with self._cond:
            self._running -= 1
            self._leave(job.client)
            self._count_admitted()
            self._cond.notify_all()
        if error is not None or result is not None:
            _deliver(job.answer, result, error)

    def _run(self, batch: list[Job]) -> None:
        now = time.monotonic()
        live: list[Job] = []
        for job in batch:
            if not job.wanted:  # its client went away (cancelled), or its time ran out (expire), after the job was taken
                self.metrics.dropped.labels("cancelled" if job.answer.cancelled() else "expired").inc()
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
            if live[0].keep:
                results = model.run([job.encoded for job in live], Capture(keep=True))
            else:
                fmt, encoded, results = most_precise(job.fmt for job in live), [job.encoded for job in live], None
                if self.shared is not None and self.shared.takes(encoded):
                    results = self.shared.run(model, encoded, fmt, max(job.deadline for job in live), self.device_quantise)
                if results is None:
                    to_host = device_to_host(self.copier, fmt) if self.device_quantise else None
                    # Answers and the run cache keep the weights only: the last block can stop at its softmax.
                    results = model.run(encoded, WEIGHTS_ONLY, to_host=to_host)
        except Exception as exc:  # handed to each waiting request, which reports it
            for job in live:
                self._settle(job, error=exc)
            return
        forward_s = time.monotonic() - started
        self._forward_ewma_s = 0.8 * self._forward_ewma_s + 0.2 * forward_s
        with self._cond:
            self._rates.setdefault(model.info.id, WorkRate()).observe(sum(job.units for job in live), forward_s)
            self._calibrate(live, started + forward_s)
        name = model.info.id
        self.metrics.forward.labels(name).observe(forward_s)
        self.metrics.batch_size.labels(name).observe(len(live))
        self.metrics.batch_tokens.labels(name).observe(len(live) * max(len(j.encoded) for j in live))
        # After the bookkeeping: a client that reads /metrics once answered sees its forward there.
        for job, result in zip(live, results):
            self._settle(job, Done(result, started - job.enqueued, forward_s, len(live)))


def _deliver(answer: asyncio.Future, result: Done | None = None, error: BaseException | None = None) -> None:
    """From the worker: resolve `answer` on its loop, unless the request gave up on it meanwhile."""

    def resolve() -> None:
        if answer.done():  # cancelled: the client went away, or its time ran out
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)

    try:
        answer.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop has closed: nobody is waiting any more
        pass
