"""What bench/load.py and bench/soak.py share: a real `manyeyes serve` on a free loopback port,
its resident memory, and the check of a response against a single unbatched run."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # the bench scripts run with only bench/ on the path
from tests.servers import HOST, free_port, wait_ready  # noqa: E402  loopback only, as in the tests


def ready_or_exit(base: str, proc: subprocess.Popen, log_tail, timeout_s: float = 300, route: str = "/readyz") -> None:
    """wait_ready, a bench's way: it ends the script with the server's log_tail() when it fails."""
    try:
        wait_ready(base, proc, timeout_s=timeout_s, route=route)
    except AssertionError as failed:
        raise SystemExit(f"{failed}:\n{log_tail()[-3000:]}") from None


@contextmanager
def serve(log_level: str = "warning", log_path: Path | None = None, ready_timeout_s: float = 300, on_spawn=None,
          args: tuple[str, ...] = (), preamble: str = "", **settings):
    """`manyeyes serve` with MANYEYES_* settings and more command-line `args`; yields (base URL,
    pid) once /readyz says 200. log_level="info" writes the access log (one JSON line per request,
    with the server's own ms) to log_path. `preamble`: Python run in the server's process before
    the CLI, for a bench's A/B against a variant of the code."""
    port = free_port()
    script = Path(sys.executable).with_name("manyeyes")
    if preamble:
        argv = [sys.executable, "-c", f"{preamble}\nfrom manyeyes.app.cli import main\nmain()"]
    else:
        argv = [str(script)] if script.exists() else [sys.executable, "-m", "manyeyes.app.cli"]
    argv += ["serve", "--host", HOST, "--port", str(port), "--log-level", log_level, *args]
    env = {**os.environ, "MANYEYES_MODELS": json.dumps({"minilm": "minilm"}), "MANYEYES_DEVICE": "cpu"}
    env.update({f"MANYEYES_{k.upper()}": str(v) for k, v in settings.items()})
    url = f"http://{HOST}:{port}"
    with (open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")) as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if on_spawn is not None:  # e.g. start polling its memory from the first moment
            on_spawn(proc.pid)
        try:
            ready_or_exit(url, proc, lambda: log.seek(0) or log.read(), ready_timeout_s)
            yield url, proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def children(pid: int) -> list[int]:
    """A process's children (with --workers: the workers, and multiprocessing's resource tracker)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory now (VmRSS) or at its peak so far (VmHWM), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        total += sum(s.value for s in family.samples if s.name == name)
    return total


def decode(attention: dict) -> np.ndarray:
    shape = attention["shape"]
    if attention["format"] == "json":
        return np.asarray(attention["data"], dtype=np.float32).reshape(shape)
    raw = base64.b64decode(attention["data"])
    if attention["format"] == "f16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.uint8).astype(np.float32).reshape(shape) * attention["scale"]


# A batched row equals its single run within 1e-5 (tests/test_batch.py; 3.4e-6 measured): the
# padded batch's matmuls sum in another order. A quantised answer rounds the batched weight, so
# against a single run it is within half a step plus that.
BATCH_PARITY = 1e-5
TOLERANCE = {"json": BATCH_PARITY, "f16": 1e-3, "u8": 0.5 / 255 + BATCH_PARITY}


def matches(body: dict, reference) -> bool:
    """Same tokens, and the returned slice equals the single run's weights within the format's precision."""
    if [(t["id"], t["start"], t["end"]) for t in body["tokens"]] != [(t.id, t.start, t.end) for t in reference.tokens]:
        return False
    expected = reference.attention.numpy()[body["layers"]][:, body["heads"]]
    got = decode(body["attention"])
    return got.shape == expected.shape and float(np.abs(got - expected).max()) <= TOLERANCE[body["attention"]["format"]]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def access_ms(log_path: Path) -> dict[str, float]:
    """run_id -> the server's own milliseconds for that request (request in to last byte out)."""
    import orjson

    out = {}
    for line in Path(log_path).read_text().splitlines():
        if " manyeyes.access " in line:
            entry = orjson.loads(line.split(" manyeyes.access ", 1)[1])
            if isinstance(entry.get("run_id"), str):
                out[entry["run_id"]] = entry["ms"]
    return out
