"""Lifecycle: the real `manyeyes serve` drains on SIGTERM; a broken model file never serves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import HOST, assert_json_error, free_port, live_server, wait_ready, wait_until
from tests.reliability.test_overload import SENTENCES, check_against_single_run


def serve_command(port: int) -> list[str]:
    script = Path(sys.executable).with_name("manyeyes")  # the console script pip installed
    base = [str(script)] if script.exists() else [sys.executable, "-m", "manyeyes.app.cli"]
    return [*base, "serve", "--host", HOST, "--port", str(port), "--device", "cpu", "--log-level", "warning"]


def start_server(port: int, args: tuple[str, ...] = (), **env) -> subprocess.Popen:
    """`manyeyes serve` with MANYEYES_* settings `env` and more command-line `args` (--workers 2)."""
    environment = {**os.environ, "MANYEYES_MODELS": '{"minilm": "minilm"}', **{f"MANYEYES_{k.upper()}": str(v) for k, v in env.items()}}
    return subprocess.Popen([*serve_command(port), *args], env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_within_grace(minilm):
    grace, delay = 15.0, 3.0
    port = free_port()
    proc = start_server(port, debug_forward_delay_s=delay, shutdown_grace_s=grace, max_wait_ms=200)
    try:
        wait_ready(f"http://{HOST}:{port}")
        replies: dict[int, httpx.Response] = {}

        def post(i):
            replies[i] = httpx.post(f"http://{HOST}:{port}/api/v1/attention", json={"text": SENTENCES[i]}, timeout=60)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()

        def admitted():
            text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text
            return 'manyeyes_cache_lookups_total{result="miss"} 4.0' in text

        wait_until(admitted, 30, "all four requests to reach the server")
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: refuses_connections(port), 5, "the listening socket to close")
        assert not replies, "the in-flight requests should still be running when new connections are refused"
        for t in threads:
            t.join(grace + 30)
        for i in range(4):
            assert replies[i].status_code == 200, replies[i].text
            check_against_single_run(minilm, SENTENCES[i], replies[i].json())
        proc.wait(grace + 30)
        assert time.monotonic() - signalled < grace
        assert proc.returncode in (0, -signal.SIGTERM), proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_sigterm_exits_within_the_grace_period_even_when_work_would_outlast_it():
    """The grace period bounds the exit: the process ends cleanly in time, and the client whose
    work outlasted it is told so at once with a JSON 503 and Retry-After, never left waiting for
    its own timeout and never handed a 200 (or a bare 500) for work that did not finish."""
    grace, delay, client_timeout = 2.0, 20.0, 60.0
    port = free_port()
    proc = start_server(port, debug_forward_delay_s=delay, shutdown_grace_s=grace, warmup="false")
    outcome: dict[str, object] = {}
    try:
        wait_ready(f"http://{HOST}:{port}")

        def post():
            started = time.monotonic()
            try:
                outcome["reply"] = httpx.post(f"http://{HOST}:{port}/api/v1/attention", json={"text": "slow"},
                                              timeout=client_timeout)
            except httpx.TransportError as exc:
                outcome["error"] = exc
            outcome["ended"] = time.monotonic()
            outcome["waited"] = outcome["ended"] - started

        ablate_sent = threading.Event()

        def sent(event: str, info: dict) -> None:  # httpcore's trace: the whole request is on the socket
            if event == "http11.send_request_body.complete":
                ablate_sent.set()

        def ablate():  # its work runs on a worker thread, whose wait anyio shields from cancellation
            try:
                with httpx.Client(timeout=client_timeout) as client:
                    outcome["ablate"] = client.post(f"http://{HOST}:{port}/api/v1/experiments/ablate",
                                                    json={"text": "slow", "ablate": [{"layer": 0, "head": 0}]},
                                                    extensions={"trace": sent})
            except httpx.TransportError as exc:
                outcome["ablate_error"] = exc

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        experiment = threading.Thread(target=ablate, daemon=True)
        experiment.start()
        wait_until(
            lambda: "manyeyes_queue_depth 0.0" in httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text
            and 'result="miss"} 1.0' in httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text,
            30,
            "the slow request to start",
        )
        # The metrics above say nothing of the experiment: on a busy machine its thread had not
        # even connected when the signal went (a refused connection, not the 503 under test).
        assert ablate_sent.wait(30), "the experiment was never sent"
        # Until the server runs it (a 0.5 s sleep for it to be read raced a loaded machine).
        wait_until(lambda: 'manyeyes_work_running{kind="experiment"} 1.0' in httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text,
                   30, "the experiment to run")
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        proc.wait(grace + 30)
        exited = time.monotonic() - signalled
        output = proc.stdout.read()
        assert exited < grace, f"exit took {exited:.1f} s"
        assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, output)
        thread.join(10)
        assert not thread.is_alive(), "the client was left waiting after the server exited"
        assert outcome["ended"] - signalled < grace + 1.0, outcome
        # uvicorn cancels the request at the end of the grace period; it is answered as what it is.
        assert "reply" in outcome, outcome
        err = assert_json_error(outcome["reply"], 503)
        assert err["code"] == "not_ready" and "shut down" in err["message"], err
        assert int(outcome["reply"].headers["Retry-After"]) >= 1
        # The same for work on a worker thread: it was a dropped connection, with no answer at all.
        experiment.join(10)
        assert "ablate" in outcome, outcome
        assert assert_json_error(outcome["ablate"], 503)["code"] == "not_ready"
        assert "Traceback" not in output, output[-2000:]
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def generation_signalled(sig, grace: float, step_delay: float, max_new_tokens: int, args=()):
    """A server streaming a generation, sent `sig` once the first step has come: yields (the
    process, the lines after that step, the seconds from the signal to the stream's end)."""
    port = free_port()
    proc = subprocess.Popen(
        [*serve_command(port), *args],
        env={**os.environ, "MANYEYES_MODELS": '{"tiny-gpt": "tiny-gpt"}', "MANYEYES_DEBUG_FORWARD_DELAY_S": str(step_delay),
             "MANYEYES_SHUTDOWN_GRACE_S": str(grace), "MANYEYES_WARMUP": "false"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_ready(f"http://{HOST}:{port}")
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"http://{HOST}:{port}/api/v1/generate",
                               json={"text": "In the beginning", "max_new_tokens": max_new_tokens}) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert json.loads(next(lines))["type"] == "start" and json.loads(next(lines))["type"] == "step"
                proc.send_signal(sig)
                signalled = time.monotonic()
                rest = [json.loads(line) for line in lines if line]
        yield proc, rest, time.monotonic() - signalled
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
@pytest.mark.parametrize("args", [(), ("--workers", "2")], ids=["one-process", "workers"])
def test_sigterm_or_sighup_ends_a_generation_stream_with_a_shutdown_line_within_the_grace(args, sig):
    """A stream that would outlast the grace was cut off by uvicorn at its end (no end line, an
    incomplete chunked body) and a CancelledError traceback was logged per stream. It goes on
    while the grace allows (a shorter one finishes: test_workers), then ends with a shutdown line.
    SIGHUP (a closed terminal, an operator's "reload") is a SIGTERM: it killed the server at once."""
    grace = 8.0
    # 200 steps at 0.2 s each: 40 s, far past the grace
    with generation_signalled(sig, grace, 0.2, 200, args) as (proc, rest, ended):
        signalled = time.monotonic() - ended
        assert rest and rest[-1]["type"] == "end" and rest[-1]["reason"] == "shutdown", rest[-3:]
        assert "shutting down" in rest[-1]["error"] and rest[-1]["tokens"] == 1 + len(rest) - 1
        assert grace - 3 < ended < grace - 1, f"the stream took {ended:.1f} s to end"
        proc.wait(grace + 10)
        output = proc.stdout.read()
        assert time.monotonic() - signalled < grace, output[-2000:]
        assert "Traceback" not in output and "ERROR" not in output, output[-3000:]


def test_a_slow_generation_step_that_would_end_past_the_grace_is_not_begun():
    """The grace was checked before each step only: a step begun just inside it (2.5 s here, a big
    model on a CPU) ran into uvicorn's cut-off, and the stream ended with no end line and a
    CancelledError traceback in the log."""
    grace = 6.0  # streams stop by 4 s after the signal, uvicorn cancels at 5 s
    # The signal comes as the 2.5 s pause after the first step begins.
    with generation_signalled(signal.SIGTERM, grace, 2.5, 20) as (proc, rest, ended):
        assert rest and rest[-1]["type"] == "end" and rest[-1]["reason"] == "shutdown", rest[-3:]
        assert ended < grace - 2, f"the stream took {ended:.1f} s to end"
        proc.wait(grace + 10)
        output = proc.stdout.read()
        assert "Traceback" not in output and "ERROR" not in output, output[-3000:]


def test_a_stream_read_too_slowly_to_end_within_the_grace_is_one_warning_not_a_traceback():
    """Its end line waits in the socket's buffers behind the steps its client has not read: the
    drain runs out and uvicorn closes the connection. That logged a CancelledError traceback and
    uvicorn's ERROR line; it is one warning saying why."""
    port = free_port()
    proc = subprocess.Popen(
        serve_command(port),
        env={**os.environ, "MANYEYES_MODELS": '{"tiny-gpt": "tiny-gpt"}', "MANYEYES_SHUTDOWN_GRACE_S": "4",
             "MANYEYES_WARMUP": "false"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_ready(f"http://{HOST}:{port}")
        with httpx.Client(timeout=60) as client, pytest.raises(httpx.RemoteProtocolError):
            with client.stream("POST", f"http://{HOST}:{port}/api/v1/generate",
                               json={"text": "In the beginning", "max_new_tokens": 200}) as response:
                began = time.monotonic()
                signalled = False
                for _ in response.iter_lines():
                    if not signalled and time.monotonic() - began > 2:
                        proc.send_signal(signal.SIGTERM)
                        signalled = True
                    time.sleep(0.1)  # 10 lines a second: far slower than tiny-gpt makes them
        proc.wait(20)
        output = proc.stdout.read()
        assert "Traceback" not in output and "ERROR" not in output, output[-3000:]
        assert "WARNING manyeyes.server the shutdown grace ran out while POST /api/v1/generate was still sending" in output
    finally:
        proc.kill()
        proc.wait()


def not_ready_for_good(server, needle: str) -> None:
    """/readyz reports the failure naming the file, and nothing is ever served."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        err = wait_until(
            lambda: (r := client.get("/readyz")).status_code == 503 and "failed" in r.json()["error"]["message"] and r.json()["error"],
            60,
            "the load failure to be reported",
        )
        assert needle in err["message"], err
        for _ in range(3):
            assert_json_error(client.get("/readyz"), 503)
            assert_json_error(client.post("/api/v1/attention", json={"text": "The bank."}), 503)
            assert_json_error(client.post("/api/v1/attention", json={"text": "The bank.", "model": "broken"}), 503)
            assert_json_error(client.get("/api/v1/models"), 503)
            assert client.get("/healthz").status_code == 200
            time.sleep(0.2)


def test_missing_model_file_keeps_readyz_503_naming_the_file(tmp_path):
    missing = tmp_path / "no-such-model"
    with live_server(models={"minilm": "minilm", "broken": str(missing)}, wait=False) as server:
        not_ready_for_good(server, str(missing))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights_keep_readyz_503_naming_the_file(tmp_path, minilm_dir, damage):
    folder = tmp_path / "minilm-copy"
    shutil.copytree(minilm_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(os.urandom(4096) if damage == "garbage" else data[: len(data) // 2])
    with live_server(models={"minilm": "minilm", "broken": str(folder)}, wait=False) as server:
        not_ready_for_good(server, "model.safetensors")


def test_ctrl_c_stops_the_server_without_a_traceback():
    """uvicorn raises Ctrl-C again once it has shut down; `manyeyes serve` let it out, and every
    stop ended in a KeyboardInterrupt traceback (a review by use)."""
    port = free_port()
    proc = start_server(port)
    try:
        wait_ready(f"http://{HOST}:{port}")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert proc.returncode == 0, out
    finally:
        proc.kill()
        proc.wait()


def test_a_failure_that_is_not_a_load_error_names_the_model_it_came_from(monkeypatch):
    """A warm-up forward's IndexError reached /readyz as "model loading failed: IndexError: index
    out of range in self", naming neither the model nor its spec."""
    from manyeyes.app.config import Settings
    from manyeyes.app.services import registry as registry_module
    from manyeyes.app.services.metrics import Metrics

    def broken(model, dense_max_tokens):
        raise IndexError("index out of range in self")

    monkeypatch.setattr(registry_module, "warm_up", broken)
    registry = registry_module.Registry(Settings(models={"tiny": "tiny-gpt"}, device="cpu"), Metrics())
    registry.load_all()
    assert not registry.ready.is_set()
    assert registry.failure == "model tiny (tiny-gpt): IndexError: index out of range in self"
    assert registry.progress["tiny"] == {"state": "failed"}


def test_a_failure_after_every_model_loaded_is_not_charged_to_the_last_one(monkeypatch):
    """What runs once the models are in (before_ready) failing was counted as a load failure of the
    last model loaded, which had loaded fine, and named it in /readyz's reason."""
    from manyeyes.app.config import Settings
    from manyeyes.app.services import registry as registry_module
    from manyeyes.app.services.metrics import Metrics

    def failing():
        raise OSError("the shared store could not be opened")

    metrics = Metrics()
    registry = registry_module.Registry(Settings(models={"tiny": "tiny-gpt", "other": "tiny-gpt"}, default_model="tiny",
                                                 device="cpu", warmup=False), metrics)
    registry.load_all(before_ready=failing)
    assert registry.failure == "OSError: the shared store could not be opened"
    assert metrics.model_load_failures.labels("other")._value.get() == 0


@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["terminal", "background job"])
def test_ctrl_c_while_a_model_loads_inside_torch_ends_cleanly(sigint):
    """Ctrl-C while the loader thread was inside torch: Python's finalisation aborted the process
    ("terminate called without an active exception", status 134, a core file; an operator review).
    Started as a background job (SIGINT ignored: `cmd &` in a script, as CI starts the suite)
    uvicorn still drains on SIGINT, then returns instead of raising it again."""
    port = free_port()
    # The load is kept inside torch's kernels (its intra-op threads busy) for as long as it takes.
    script = (
        "import sys, torch\n"
        "from manyeyes.app.services import registry\n"
        "def busy(*args, **kwargs):\n"
        "    a = torch.randn(600, 600)\n"
        "    while True:\n"
        "        a = torch.tanh(a @ a)\n"
        "registry.load_configured = busy\n"
        "from manyeyes.app.cli import main\n"
        f"sys.exit(main(['serve', '--port', '{port}']))\n"
    )
    env = {**os.environ, "MANYEYES_MODELS": '{"minilm": "minilm"}'}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    try:
        wait_ready(f"http://{HOST}:{port}", timeout_s=60, route="/healthz")  # up, the model loading
        time.sleep(1.0)  # the loader is in its matmuls
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "terminate called" not in out and "Traceback" not in out, (proc.returncode, out[-2000:])
        assert "Finished server process" in out
    finally:
        proc.kill()
        proc.wait()
