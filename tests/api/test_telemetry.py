"""FastAPI's own OpenTelemetry: off unless MANYEYES_OPENTELEMETRY asks for it, and then it works.

Each case runs in a process of its own: an OpenTelemetry tracer provider is process-wide and
can be set once, and the other suites' apps must not see it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, time
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# What a deployment's OpenTelemetry SDK does: a global provider that records every span.
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

from fastapi.testclient import TestClient
from manyeyes.app.config import Settings
from manyeyes.app.main import create_app

settings = Settings(models={"minilm": "minilm"}, device="cpu")
with TestClient(create_app(settings)) as client:
    assert client.get("/healthz").status_code == 200
    deadline = time.monotonic() + 120
    while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    exporter.clear()  # only the request below
    status = client.post("/api/v1/attention", json={"text": "the heron waited"}).status_code
print(json.dumps({"status": status, "spans": [span.name for span in exporter.get_finished_spans()]}))
"""


def spans_with(env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["status"] == 200
    return answer["spans"]


@pytest.mark.parametrize("value", [None, "false"])
def test_no_spans_unless_asked_for(value):
    env = {} if value is None else {"MANYEYES_OPENTELEMETRY": value}
    assert spans_with(env) == []


def test_spans_for_each_request_when_asked_for():
    spans = spans_with({"MANYEYES_OPENTELEMETRY": "true"})
    # FastAPI names the request's server span by method and route template.
    assert "POST /api/v1/attention" in spans, spans
