"""One app per suite, lifespan running, shared by module/session so MiniLM loads once."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from manyeyes.app.config import Settings
from manyeyes.app.main import create_app


def wait_ready(client: TestClient, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"never ready: {client.get('/readyz').json()}")


def serve(settings: Settings):
    """A started app (lifespan entered) and its client, ready to answer."""
    client = TestClient(create_app(settings))
    client.__enter__()
    wait_ready(client)
    return client


@pytest.fixture(scope="session")
def api():
    client = serve(Settings(models={"minilm": "minilm"}, device="cpu", max_wait_ms=20))
    yield client
    client.__exit__(None, None, None)


def decode(attention: dict) -> np.ndarray:
    """Any of the three formats to a float32 array of its shape, as a client would decode it."""
    shape = attention["shape"]
    if attention["format"] == "json":
        return np.asarray(attention["data"], dtype=np.float32).reshape(shape)
    raw = base64.b64decode(attention["data"])
    if attention["format"] == "f16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.uint8).astype(np.float32).reshape(shape) * attention["scale"]


def metric(client: TestClient, name: str, **labels) -> float:
    """The value of one sample in /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
