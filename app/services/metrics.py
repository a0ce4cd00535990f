"""Prometheus metrics, one registry per app so several apps (tests) never share counters.

Worker processes (`manyeyes serve --workers N`) are started with PROMETHEUS_MULTIPROC_DIR set, so
prometheus_client keeps each value in a file there; any worker's /metrics then adds up every
worker's, instead of answering for whichever took the scrape (counters that jumped back and forth
between scrapes)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "manyeyes_requests", "HTTP requests by route template, method and status", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "manyeyes_request_seconds", "HTTP request latency", ["route", "method", "status"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # Summed over the workers that are alive (a dead one's share leaves with it).
        self.queue_depth = Gauge("manyeyes_queue_depth", "Requests waiting for a forward pass", registry=r,
                                 multiprocess_mode="livesum")
        self.batch_size = Histogram("manyeyes_batch_size", "Inputs per forward pass", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "manyeyes_batch_tokens", "Padded tokens per forward pass", ["model"], buckets=(16, 64, 256, 1024, 4096, 16384), registry=r
        )
        self.forward = Histogram("manyeyes_forward_seconds", "Forward pass time", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.dropped = Counter(
            "manyeyes_dropped", "Work refused or abandoned: queue_full, client_share, work, expired, cancelled, shutdown, "
            "render_queue_full, render_client_share", ["reason"], registry=r
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

    def exposition(self) -> bytes:
        """The text format: this app's metrics, or every worker's added up."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        gathered = CollectorRegistry()
        MultiProcessCollector(gathered, self.multiprocess_dir)
        return generate_latest(gathered)
