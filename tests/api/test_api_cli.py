"""`manyeyes attend --json` prints what the API returns; `manyeyes serve` runs the contract."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from manyeyes.app.cli import main

TEXT = "The bank of the river."


def without_timing(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "timing_ms"}


@pytest.mark.parametrize("fmt", ["json", "u8"])
def test_attend_json_prints_the_api_body(api, capsysbinary, fmt):
    assert main(["attend", TEXT, "--json", "--format", fmt, "--layers", "1,4", "--heads", "0"]) == 0
    printed = orjson.loads(capsysbinary.readouterr().out)
    served = api.post("/api/v1/attention", json={"text": TEXT, "format": fmt, "layers": [1, 4], "heads": [0]}).json()
    assert without_timing(printed) == without_timing(served)
    assert set(printed["timing_ms"]) == set(served["timing_ms"])


def test_attend_json_bad_layer_is_an_error_in_words(capsys):
    assert main(["attend", TEXT, "--json", "--layers", "7"]) == 2
    assert "layer 7 does not exist" in capsys.readouterr().err


def test_serve_adds_model_flags_to_the_builtin_default(monkeypatch):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    monkeypatch.setenv("MANYEYES_EXTRA_MODELS", "env-one=/models/a")
    assert main(["serve", "--port", "8123", "--model", "mine=/models/b.pth?config=gpt2-small", "--model", "minilm2=minilm"]) == 0
    settings = seen["app"].state.settings
    assert settings.all_models() == {
        "minilm": "minilm", "tiny-gpt": "tiny-gpt", "tiny-llama": "tiny-llama",
        "env-one": "/models/a", "mine": "/models/b.pth?config=gpt2-small", "minilm2": "minilm",
    }
    assert settings.default_model_id() == "minilm"
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "=nothing"])


@pytest.mark.slow
def test_manyeyes_serve_answers_the_contract():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MANYEYES_MODELS": '{"minilm": "minilm"}', "MANYEYES_DEVICE": "cpu"}
    cmd = [sys.executable, "-c", "from manyeyes.app.cli import main; main()", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "manyeyes serve never became ready"
            time.sleep(0.2)
        assert httpx.get(f"{base}/api/v1/models").json()["models"][0]["id"] == "minilm"
        body = httpx.post(f"{base}/api/v1/attention", json={"text": TEXT, "format": "u8"}).json()
        assert body["attention"]["shape"] == [6, 12, 8, 8]
        assert httpx.get(f"{base}/api/v1/runs/{body['run_id']}/attention?layers=0").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    log = proc.stdout.read().decode()
    assert '"route":"/api/v1/attention"' in log and body["run_id"] in log  # one structured line per request
