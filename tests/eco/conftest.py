"""Fixtures for the ecosystem suites: a real `manyeyes serve` on a loopback port, tiny-gpt only."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser.conftest import browser, playwright  # noqa: F401  chromium for the export's and the figures' files
from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def live_server(models: dict[str, str] | None = None, cwd: Path = ROOT, python: str = sys.executable, **settings):
    """`python -m manyeyes serve` in a subprocess with MANYEYES_* settings; yields its base URL."""
    port = free_port()
    env = {**os.environ, "MANYEYES_MODELS": json.dumps(models or {"tiny-gpt": "tiny-gpt"})}
    env.update({f"MANYEYES_{k.upper()}": str(v) for k, v in settings.items()})
    proc = subprocess.Popen(
        [python, "-m", "manyeyes", "serve", "--port", str(port), "--device", "cpu", "--log-level", "warning"],
        cwd=cwd, env=env, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def server():
    with live_server() as base:
        yield base


@pytest.fixture(scope="session")
def tiny_gpt():
    from manyeyes.model import load

    return load("tiny-gpt", device="cpu")
