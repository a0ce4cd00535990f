"""Once its models have loaded, the server leaves its start-up objects out of the garbage
collector's full collections (MANYEYES_GC_FREEZE, on by default), and serves as before.

In a process of its own: the test suite runs with the freeze off (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import gc, json, time
from fastapi.testclient import TestClient
from manyeyes.app.config import Settings
from manyeyes.app.main import create_app

with TestClient(create_app(Settings(models={"minilm": "minilm"}, device="cpu"))) as client:
    deadline = time.monotonic() + 120
    while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    answers = [client.post("/api/v1/attention", json={"text": f"the heron waited {i}"}) for i in range(3)]
    # What a full collection would walk now, against what it no longer walks.
    print(json.dumps({"statuses": [a.status_code for a in answers], "tracked": len(gc.get_objects()),
                      "frozen": gc.get_freeze_count()}))
"""


def census(freeze: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MANYEYES_GC_FREEZE"}
    if freeze is not None:
        env["MANYEYES_GC_FREEZE"] = freeze
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["statuses"] == [200, 200, 200]
    return answer


def test_freeze_is_the_default_and_leaves_full_collections_a_fraction_of_the_objects():
    answer = census(None)
    # MiniLM, torch, pydantic and the app: ~300,000 objects that live as long as the process.
    assert answer["frozen"] > 100_000, answer
    # What requests made since (three runs in the cache, the connections) is all a collection walks.
    assert answer["tracked"] < answer["frozen"] / 20, answer


def test_freeze_off_leaves_every_object_to_the_collector():
    answer = census("false")
    assert answer["frozen"] == 0
    assert answer["tracked"] > 100_000, answer
