"""What an on-call's alerts need from /metrics (review h48b, item 5): the process's memory, CPU and
descriptors, each model's readiness and failed loads, the build, and the memory bound's terms:
under one process and summed sensibly across `--workers`."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from manyeyes.app.config import Settings
from manyeyes.app.main import create_app
from tests.api.conftest import metric


def samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_process_metrics_build_info_and_the_memory_bound(api):
    text = api.get("/metrics").text
    (rss,) = samples(text, "process_resident_memory_bytes")
    assert rss.value > 50e6  # a loaded MiniLM
    for name in ("process_cpu_seconds_total", "process_open_fds", "process_start_time_seconds", "process_virtual_memory_bytes"):
        assert samples(text, name), name
    (build,) = samples(text, "manyeyes_build_info")
    assert build.value == 1
    assert build.labels == {"version": version("manyeyes"), "python": platform.python_version(), "torch": version("torch")}
    assert metric(api, "manyeyes_model_ready", model="minilm") == 1
    (after_warmup,) = samples(text, "manyeyes_rss_after_warmup_bytes")
    assert 50e6 < after_warmup.value <= rss.value * 1.5
    assert metric(api, "manyeyes_cache_bytes_limit") == Settings().cache_bytes
    assert metric(api, "manyeyes_model_load_failures_total") == 0


def test_a_model_is_not_ready_while_it_loads():
    settings = Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, debug_load_delay_s=1.5)
    with TestClient(create_app(settings)) as client:
        text = client.get("/metrics").text
        assert client.get("/readyz").status_code == 503
        assert [(s.labels, s.value) for s in samples(text, "manyeyes_model_ready")] == [({"model": "minilm"}, 0.0)]
        assert [s.value for s in samples(text, "manyeyes_rss_after_warmup_bytes")] == [0]  # not yet measured
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(client, "manyeyes_model_ready", model="minilm") == 1


def test_a_failed_load_shows_in_the_metrics():
    """/readyz said so, but no metric did: an alert needed a blackbox probe."""
    settings = Settings(models={"minilm": "minilm", "broken": "/nonexistent/model-dir"}, device="cpu", warmup=False)
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").json().get("status") != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(client, "manyeyes_model_load_failures_total", model="broken") == 1
        assert metric(client, "manyeyes_model_ready", model="broken") == 0
        assert metric(client, "manyeyes_model_ready", model="minilm") == 0  # nothing is served after a failed load


# A worker's Metrics as `manyeyes serve --workers N` makes them (app/workers.py): its values in files
# named by its slot in PROMETHEUS_MULTIPROC_DIR, which MultiProcessCollector reads back at a scrape.
# A process per step: prometheus_client takes one identity per process.
WORKER_STEP = """
import json, sys
from prometheus_client import values
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.parser import text_string_to_metric_families
slot, ready, dead = sys.argv[1], sys.argv[2], sys.argv[3:]
values.ValueClass = values.MultiProcessValue(process_identifier=lambda: slot)
from manyeyes.app.services.metrics import Metrics
m = Metrics()
m.cache_bytes_limit.set(1000)
if ready != "-":
    m.model_ready.labels("tiny-gpt").set(int(ready))
for name in dead:
    mark_process_dead(name)
text = m.exposition().decode()
print(json.dumps([(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]))
"""


def test_process_metrics_per_worker_under_workers(tmp_path):
    def step(slot: str, ready: str = "-", *dead: str) -> list:
        done = subprocess.run([sys.executable, "-c", WORKER_STEP, slot, ready, *dead], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def values(scrape, name):
        return sorted((labels.get("pid"), value) for sample, labels, value in scrape if sample == name)

    step("w1", "0")  # still loading
    first = step("w0", "1")
    # Each worker's own, labelled with its slot, whichever worker answers the scrape.
    rss = values(first, "process_resident_memory_bytes")
    assert [pid for pid, _ in rss] == ["w0", "w1"] and all(v > 10e6 for _, v in rss), rss
    assert [pid for pid, _ in values(first, "process_open_fds")] == ["w0", "w1"]
    # CPU adds up, as a counter; the build and the limit are each worker's, not their sum.
    assert len(values(first, "process_cpu_seconds_total")) == 1
    assert values(first, "manyeyes_build_info")[0][1] == 1 and len(values(first, "manyeyes_build_info")) == 1
    assert values(first, "manyeyes_cache_bytes_limit") == [(None, 1000)]
    # Ready where every live worker has it ready.
    assert values(first, "manyeyes_model_ready") == [(None, 0)]
    step("w1", "1")
    assert values(step("w0"), "manyeyes_model_ready") == [(None, 1)]
    # A dead worker's process metrics leave with it (app/workers.py marks it dead).
    assert [pid for pid, _ in values(step("w0", "-", "w1"), "process_resident_memory_bytes")] == ["w0"]


@pytest.mark.slow
def test_process_metrics_of_each_worker_of_a_served_pool(tmp_path):
    """`manyeyes serve --workers 2`: whichever worker takes the scrape, both workers' memory is there."""
    from tests.api.test_workers import workers_serving

    with workers_serving(tmp_path / "serve.log") as (base, _proc, _folder):
        for _ in range(6):  # fresh connections: both workers answer some scrapes
            text = httpx.get(f"{base}/metrics").text
            assert sorted(s.labels["pid"] for s in samples(text, "process_resident_memory_bytes")) == ["w0", "w1"]
            assert [s.value for s in samples(text, "manyeyes_model_ready")] == [1]
            assert [s.value for s in samples(text, "manyeyes_build_info")] == [1]
            assert sorted(s.labels["pid"] for s in samples(text, "manyeyes_rss_after_warmup_bytes")) == ["w0", "w1"]
