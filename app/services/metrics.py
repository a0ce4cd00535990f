"""Prometheus metrics, one registry per app so several apps (tests) never share counters.

Worker processes (`manyeyes serve --workers N`) are started with PROMETHEUS_MULTIPROC_DIR set, so
prometheus_client keeps each value in a file there; any worker's /metrics then adds up every
worker's, instead of answering for whichever took the scrape (counters that jumped back and forth
between scrapes).

Process metrics (process_resident_memory_bytes and the rest of prometheus_client's
ProcessCollector): a single server's are its process's, read at each scrape. Under --workers a
scrape is answered by one worker, which cannot read the others' at that moment: each worker
writes its own every PROCESS_REFRESH_S (and at a scrape it answers) into gauges labelled with its
slot (`pid="w0"`, `pid="w1"`: the identity its metric files go by, app/workers.py), which leave
/metrics when the worker dies; `process_cpu_seconds_total` is the workers' sum, as a counter
that a replacement continues from its dead predecessor's total."""

from __future__ import annotations

import os
import platform
import threading
import time
import weakref
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# 15, 20 and 25 s: with nothing between 10 s and the default request budget (MANYEYES_REQUEST_TIMEOUT_S,
# 30 s), where a loaded server's p99 lies, the histogram read a p99 of 29.5 s that the log's ms put
# at 15.9 s. The budget stays a bucket bound of its own (Metrics(budget_s=...) adds one that is not
# 30), so requests that ran their whole budget (the 504s) stand apart from those just under it.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 25, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# How often each worker writes its process metrics under --workers (a single server reads its own at each scrape).
PROCESS_REFRESH_S = 5.0


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "0+unknown"


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; elsewhere None: no such reading)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class WorkerProcess:
    """A worker's process metrics, written as gauges (and a counter) that MultiProcessCollector adds
    to every worker's /metrics; ProcessCollector reads /proc/self, which in the worker that answers
    a scrape is that worker alone."""

    GAUGES = ("process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
              "process_open_fds", "process_max_fds")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reader = ProcessCollector(registry=None)
        self.gauges: dict[str, Gauge] = {}
        self.cpu = None
        self.cpu_seen = 0.0
        self.lock = threading.Lock()
        for family in self.reader.collect():
            if family.name in self.GAUGES:
                self.gauges[family.name] = Gauge(family.name, family.documentation + " Per worker (pid: its slot).",
                                                 registry=registry, multiprocess_mode="liveall")
            elif family.name == "process_cpu_seconds":
                self.cpu = Counter(family.name, family.documentation + " Summed over the workers.", registry=registry)

    def refresh(self) -> None:
        with self.lock:
            for family in self.reader.collect():
                for sample in family.samples:
                    if sample.name in self.gauges:
                        self.gauges[sample.name].set(sample.value)
                    elif sample.name == "process_cpu_seconds_total" and self.cpu is not None:
                        if sample.value > self.cpu_seen:
                            self.cpu.inc(sample.value - self.cpu_seen)
                            self.cpu_seen = sample.value


def keep_refreshing(process: weakref.ref) -> None:
    """Every PROCESS_REFRESH_S, until the worker's metrics are gone (the thread holds no reference)."""
    while True:
        time.sleep(PROCESS_REFRESH_S)
        current = process()
        if current is None:
            return
        try:
            current.refresh()
        except Exception:  # a /proc hiccup must not end the readings for good
            pass
        del current


def latency_buckets(budget_s: float | None) -> tuple[float, ...]:
    """LATENCY_BUCKETS with the request budget among them."""
    if budget_s is None or budget_s in LATENCY_BUCKETS:
        return LATENCY_BUCKETS
    return tuple(sorted((*LATENCY_BUCKETS, float(budget_s))))


class Metrics:
    def __init__(self, budget_s: float | None = None) -> None:
        """`budget_s`: the request budget (MANYEYES_REQUEST_TIMEOUT_S), made a latency bucket bound."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "manyeyes_requests", "HTTP requests by route template, method and status", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "manyeyes_request_seconds", "HTTP request latency", ["route", "method", "status"],
            buckets=latency_buckets(budget_s), registry=r
        )
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # Summed over the workers that are alive (a dead one's share leaves with it).
        self.queue_depth = Gauge("manyeyes_queue_depth", "Inputs (a request's texts each count) waiting for a forward pass",
                                 registry=r, multiprocess_mode="livesum")
        # What admission compares against MANYEYES_MAX_QUEUE: queue_depth alone read 0 while every
        # new request got 429 queue_full (8 waiting, room for 8), the rest being tokenized or run.
        self.queue_admitted = Gauge(
            "manyeyes_queue_admitted", "Inputs held against MANYEYES_MAX_QUEUE, by device: being tokenized, waiting for "
            "a forward pass (manyeyes_queue_depth) or in the one under way. At manyeyes_queue_limit the next is refused "
            "429 queue_full (manyeyes_dropped_total{reason=\"queue_full\"}, also in inputs)", ["device"], registry=r,
            multiprocess_mode="livesum")
        self.queue_limit = Gauge(
            "manyeyes_queue_limit", "Inputs a device's queue holds at most (MANYEYES_MAX_QUEUE), summed over the live "
            "workers as manyeyes_queue_admitted is: their ratio is the queue's saturation", ["device"], registry=r,
            multiprocess_mode="livesum")
        self.batch_size = Histogram("manyeyes_batch_size", "Inputs per forward pass", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "manyeyes_batch_tokens", "Padded tokens per forward pass", ["model"], buckets=(16, 64, 256, 1024, 4096, 16384), registry=r
        )
        self.forward = Histogram("manyeyes_forward_seconds", "Forward pass time", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.dropped = Counter(
            "manyeyes_dropped", "Work refused or abandoned, in inputs (a request's texts each count): queue_full, "
            "client_share, work, expired, cancelled, shutdown; in answers: render_queue_full, render_client_share",
            ["reason"], registry=r
        )
        self.cache = Counter("manyeyes_cache_lookups", "Run cache lookups", ["result"], registry=r)
        self.cache_bytes = Gauge("manyeyes_cache_bytes", "Bytes held by the run caches", registry=r, multiprocess_mode="livesum")
        self.answer_bytes = Gauge("manyeyes_answer_bytes", "Bytes held by answers on their way out: their runs and encoded "
                                  "bytes, as reckoned for MANYEYES_ANSWER_BYTES", registry=r, multiprocess_mode="livesum")
        self.shared_forward = Counter(
            "manyeyes_shared_forward_batches", "Batches of short inputs a worker sent to the shared forward process "
            "(shared) or ran itself, not reaching it (own); --shared-forward", ["where"], registry=r
        )
        self.work_running = Gauge(
            "manyeyes_work_running", "Long work running now, by kind: generation, experiment, capture (the measures' "
            "captured forwards) and flow (information-flow graphs)", ["kind"], registry=r, multiprocess_mode="livesum"
        )
        self.generation_steps = Counter("manyeyes_generation_steps", "Tokens generated, by model", ["model"], registry=r)
        self.generations = Counter(
            "manyeyes_generations", "Generations by outcome: finished, failed, or cancelled by a client that hung up", ["outcome"], registry=r
        )
        # Readiness and the memory bound's terms (SECURITY.md, "Memory"), set by the Registry.
        # Under --workers: a model is ready where every live worker has it ready (the least);
        # failures add up; the baseline is each worker's (pid: its slot), the limit each one's own.
        self.model_ready = Gauge("manyeyes_model_ready", "1 when the model is loaded, warmed up and served; 0 while "
                                 "loading or after a failed load (the least over live workers)", ["model"], registry=r,
                                 multiprocess_mode="livemin")
        self.model_load_failures = Counter("manyeyes_model_load_failures", "Model loads that failed (/readyz says why)",
                                           ["model"], registry=r)
        self.rss_after_warmup = Gauge("manyeyes_rss_after_warmup_bytes", "Resident memory once every model was loaded and "
                                      "warmed up: the base of the memory bound (per worker under --workers, pid: its slot)",
                                      registry=r, multiprocess_mode="liveall")
        self.cache_bytes_limit = Gauge("manyeyes_cache_bytes_limit", "MANYEYES_CACHE_BYTES: the run caches' bound, in "
                                       "each process (manyeyes_cache_bytes sums the workers')", registry=r,
                                       multiprocess_mode="livemax")
        self.build_info = Gauge("manyeyes_build_info", "1, labelled with the versions of manyeyes, Python and torch",
                                ["version", "python", "torch"], registry=r, multiprocess_mode="livemax")
        self.build_info.labels(package_version("manyeyes"), platform.python_version(), package_version("torch")).set(1)
        self.process = None
        if self.multiprocess_dir is None:
            ProcessCollector(registry=r)
        else:
            self.process = WorkerProcess(r)
            self.process.refresh()
            threading.Thread(target=keep_refreshing, args=(weakref.ref(self.process),),
                             name="manyeyes-process-metrics", daemon=True).start()

    def exposition(self) -> bytes:
        """The text format: this app's metrics, or every worker's added up."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        if self.process is not None:
            self.process.refresh()  # this worker's, as of this scrape
        gathered = CollectorRegistry()
        MultiProcessCollector(gathered, self.multiprocess_dir)
        return generate_latest(gathered)
