"""`manyeyes attend --json` prints what the API returns; `manyeyes serve` runs the contract."""

from __future__ import annotations

import calendar
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import nullcontext

import httpx
import orjson
import pytest

from manyeyes.app.cli import main
from tests.servers import free_port

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


def test_attend_too_long_names_the_flag_that_cuts_it(capsys):
    # The model's words ("ask for truncation") name the API's option; a terminal user has a flag.
    assert main(["attend", "word " * 600]) == 2
    assert capsys.readouterr().err == ("error: input is 602 tokens long but the model takes at most 512; "
                                       "shorten it or pass --truncate\n")


def test_serve_adds_model_flags_to_the_builtin_default(monkeypatch):
    import uvicorn

    seen = {}

    def run(server, sockets):
        seen.update(config=server.config, bound=[sock.getsockname() for sock in sockets])
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setenv("MANYEYES_EXTRA_MODELS", "env-one=/models/a")
    port = free_port()
    assert main(["serve", "--port", str(port), "--model", "mine=/models/b.pth?config=gpt2-small", "--model", "minilm2=minilm"]) == 0
    settings = seen["config"].app.state.settings
    assert settings.all_models() == {
        "minilm": "minilm", "tiny-gpt": "tiny-gpt", "tiny-llama": "tiny-llama",
        "env-one": "/models/a", "mine": "/models/b.pth?config=gpt2-small", "minilm2": "minilm",
    }
    assert settings.default_model_id() == "minilm"
    assert seen["bound"] == [("127.0.0.1", port)] and not seen["config"].proxy_headers
    with pytest.raises(SystemExit):
        main(["serve", "--model", "=nothing"])


def test_serve_threads_sets_torchs_threads_in_one_process(monkeypatch):
    """--threads was read by workers and Ray replicas only; one process ignored it without a word."""
    import torch
    import uvicorn

    asked = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    assert main(["serve", "--port", str(free_port()), "--threads", "3"]) == 0
    assert main(["serve", "--port", str(free_port())]) == 0
    assert asked == [3]  # and without the flag, torch keeps its own choice


def test_serve_on_a_port_in_use_says_so_in_one_line_and_exits_1():
    """It announced the server, then aborted (exit 134, "terminate called without an active
    exception") with the model loader's thread inside torch."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "MANYEYES_MODELS": '{"tiny-gpt": "tiny-gpt"}', "MANYEYES_DEVICE": "cpu"}
        done = subprocess.run([sys.executable, "-m", "manyeyes", "serve", "--port", str(port)], env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", done.stderr


def test_serve_on_an_address_it_cannot_bind_says_only_that(monkeypatch, capsys):
    """It first warned "serving on 10.255.255.1 without API keys: anyone who can reach this
    address can use the API", then said it could not listen there."""
    monkeypatch.setenv("MANYEYES_MODELS", '{"tiny-gpt": "tiny-gpt"}')
    monkeypatch.delenv("MANYEYES_API_KEYS", raising=False)
    assert main(["serve", "--host", "10.255.255.1", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot listen on 10.255.255.1:") and "\n" not in err, err


@pytest.mark.slow
def test_manyeyes_serve_answers_the_contract():
    port = free_port()
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


def test_serve_replicas_without_the_scale_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "manyeyes.scale", raising=False)
    assert main(["serve", "--replicas", "2", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err == ("error: Ray Serve is not installed: pip install 'ray[serve]>=2.40' (the scale extra: "
                   "pip install '.[scale]' in a checkout)\n"), err
    from pathlib import Path

    assert 'scale = ["ray[serve]>=2.40"]' in (Path(__file__).parents[2] / "pyproject.toml").read_text()  # the pin said


def test_version_names_the_installed_package(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and re.fullmatch(r"manyeyes \d+\.\d+\.\d+\n", capsys.readouterr().out)


def test_serve_refuses_an_id_given_two_models_and_says_so_in_one_line(monkeypatch, capsys):
    """`--model minilm=DIR` replaced the built-in MiniLM without a word (the page listed a 2-layer
    GPT as minilm), and of `--model a=X --model a=Y` only Y was served."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    for flags in (["--model", "minilm=tiny-gpt"], ["--model", "a=tiny-gpt", "--model", "a=minilm"]):
        assert main(["serve", "--port", str(free_port()), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: model id ") and "names two models" in err and err.count("\n") == 1, err
    monkeypatch.setenv("MANYEYES_EXTRA_MODELS", "minilm=tiny-gpt")
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "model id 'minilm' names two models (minilm and tiny-gpt)" in capsys.readouterr().err
    monkeypatch.setenv("MANYEYES_EXTRA_MODELS", "x=tiny-gpt")  # a flag still wins over the variable's model of its id
    assert main(["serve", "--port", str(free_port()), "--model", "x=minilm", "--model", "minilm=minilm"]) == 0


def test_a_bare_book_spec_keeps_its_query_whole():
    """README's `--model` takes "a book `.pth?config=...`": split at its first "=", it became the
    model `.../model.pth?config` of the spec `gpt2-small&tokenizer=...`."""
    from manyeyes.app.config import parse_model_specs

    spec = "/m/model.pth?config=gpt2-small&tokenizer=/m/tokenizer.json"
    assert parse_model_specs([spec]) == {spec: spec}
    assert parse_model_specs([f"book={spec}"]) == {"book": spec}
    assert parse_model_specs(f"a=tiny-gpt,{spec}") == {"a": "tiny-gpt", spec: spec}


def test_a_folder_whose_path_holds_an_equals_sign_is_taken_whole(tmp_path):
    """`--model runs/lr=0.001/model` served "runs/lr" from the Hub id "0.001/model", whose error
    named neither the folder nor the split (review h55a). ID=SPEC still splits where no such path is."""
    from manyeyes.app.config import parse_model_specs

    folder = tmp_path / "lr=0.001" / "model"
    folder.mkdir(parents=True)
    assert parse_model_specs([str(folder)]) == {str(folder): str(folder)}
    assert parse_model_specs([f"mine={folder}"]) == {"mine": str(folder)}
    assert parse_model_specs([f"{tmp_path}/none=tiny-gpt"]) == {f"{tmp_path}/none": "tiny-gpt"}
    (folder / "model.pth").touch()
    book = f"{folder}/model.pth?config=gpt2-small"  # a book spec in such a folder: its path before the "?"
    assert parse_model_specs([book]) == {book: book}


@pytest.mark.parametrize("models, words", [
    ('{"": "tiny-gpt"}', "has an empty model id (for 'tiny-gpt'): each model needs an id to be asked for by"),
    ('{"a": " "}', "gives model 'a' an empty spec: a built-in name, a folder, a file or a Hub id"),
])
def test_models_with_an_empty_id_or_spec_stop_start_up_as_model_flags_do(monkeypatch, capsys, models, words):
    """{"": ...} served a model listed as "" that no request could name; {"a": ""} started, then
    /readyz said it failed: `--model =x` and `--model a=` are refused before anything starts."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    monkeypatch.setenv("MANYEYES_MODELS", models)
    assert main(["serve", "--port", str(free_port())]) == 2
    assert capsys.readouterr().err.strip().endswith(words)


def test_a_malformed_json_setting_is_one_line_and_a_mistyped_name_is_warned_of(monkeypatch, capsys):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    monkeypatch.setenv("MANYEYES_MODELS", '{"a": ')  # was a pydantic_settings.SettingsError traceback
    assert main(["serve", "--port", str(free_port())]) == 2
    assert capsys.readouterr().err.startswith("error: MANYEYES_MODELS in the environment is not valid JSON (Expecting value")
    monkeypatch.delenv("MANYEYES_MODELS")
    monkeypatch.setenv("MANYEYES_CACHE_BYTE", "1000")  # ignored without a word: the server ran on the default
    assert main(["serve", "--port", str(free_port())]) == 0
    assert ("warning: MANYEYES_CACHE_BYTE is not a setting manyeyes reads (did you mean MANYEYES_CACHE_BYTES?)"
            in capsys.readouterr().err)


@pytest.mark.parametrize("env, said", [
    ({"MANYEYES_CLOSE_METRICS": "true"}, "MANYEYES_CLOSE_METRICS without API keys: no key can open /metrics"),
    ({"MANYEYES_MAX_CLIENT_QUEUE": "1000", "MANYEYES_MAX_QUEUE": "10"},
     "MANYEYES_MAX_CLIENT_QUEUE=1000 is not below MANYEYES_MAX_QUEUE=10: one client can still fill the whole queue"),
    # Any web page could read a keyless server's API, a loopback one's too (SECURITY.md's threat model; h56a).
    ({"MANYEYES_CORS_ORIGINS": "*"}, "MANYEYES_CORS_ORIGINS='*' without API keys: any web page open in a browser that "
     "reaches this server can call its API"),
])
def test_settings_that_together_do_nothing_are_said_at_start_up(monkeypatch, capsys, env, said):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--port", str(free_port())]) == 0
    assert said in capsys.readouterr().err


def test_a_trusted_proxy_that_is_no_address_is_one_line_before_serving(monkeypatch, capsys):
    """"proxy.local" was a 23-line traceback from building the app, after "serving on" was printed."""
    monkeypatch.setenv("MANYEYES_TRUSTED_PROXIES", "10.0.0.0/8,proxy.local")
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err == ("error: a MANYEYES_* setting in the environment is malformed: MANYEYES_TRUSTED_PROXIES="
                   "'10.0.0.0/8,proxy.local': 'proxy.local' is no IP address or network (such as 10.0.0.1 or "
                   "10.0.0.0/8): name proxies by address\n"), err


def test_keys_and_proxies_are_read_as_a_json_list_too_and_a_broken_one_is_one_line_that_keeps_the_keys_secret(monkeypatch, capsys):
    """MANYEYES_CORS_ORIGINS is a JSON list; written so, MANYEYES_API_KEYS='["k1"]' was one key,
    brackets and quotes included, and no intended key worked, without a word."""
    from manyeyes.app.config import Settings

    monkeypatch.setenv("MANYEYES_API_KEYS", '["k1", " k2 "]')
    monkeypatch.setenv("MANYEYES_TRUSTED_PROXIES", '["10.0.0.1", "10.0.0.0/8"]')
    assert Settings().api_keys == ["k1", "k2"] and Settings().trusted_proxies == ["10.0.0.1", "10.0.0.0/8"]
    monkeypatch.setenv("MANYEYES_API_KEYS", "k1, k2")
    assert Settings().api_keys == ["k1", "k2"]
    monkeypatch.setenv("MANYEYES_API_KEYS", '["s3cret", 7')
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err == ("error: a MANYEYES_* setting in the environment is malformed: MANYEYES_API_KEYS=(the keys, not shown): "
                   "starts with '[' but is no JSON list of strings: write a JSON list such as '[\"a\", \"b\"]', or the "
                   "values separated by commas\n"), err


@pytest.mark.parametrize("args, says", [
    (["--device", "tpu"], "error: unknown device 'tpu': use cpu, cuda, cuda:N, mps or auto\n"),
    (["--replicas", "-3"], "a whole number from 1 to 4096"),
    (["--replicas", "0"], "a whole number from 1 to 4096"),
])
def test_serve_refuses_a_device_or_replica_count_it_cannot_use_in_one_line(args, says, capsys, monkeypatch):
    """--device tpu started a server that answered 503 for good; --replicas -3 was a pydantic
    traceback and --replicas 0 started one plain server without a word (a review by use)."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: pytest.fail("it served"))
    with pytest.raises(SystemExit) if "--replicas" in args else nullcontext() as refused:
        assert main(["serve", "--port", str(free_port()), *args]) == 2
    assert refused is None or refused.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_attend_json_refuses_an_empty_layer_list_as_the_api_does(capsys):
    """`--layers ""` printed every layer, where the API refuses an empty list (422)."""
    assert main(["attend", TEXT, "--json", "--layers", ""]) == 2
    assert "layers is empty" in capsys.readouterr().err


@pytest.mark.parametrize("env, args, says", [
    ({"MANYEYES_HALF": "true"}, ["--device", "cpu"],
     "error: MANYEYES_HALF is float16 autocast on CUDA, and this server's device is cpu: unset it, or use "
     "MANYEYES_AUTOCAST=float16, which works on any device\n"),
    ({"MANYEYES_DEFAULT_MODEL": "nope"}, [],
     "error: MANYEYES_DEFAULT_MODEL='nope' is not a served model: use one of minilm, tiny-gpt, tiny-llama\n"),
    ({"MANYEYES_DEFAULT_MODEL": "nope"}, ["--model", "mine=tiny-gpt"],
     "error: MANYEYES_DEFAULT_MODEL='nope' is not a served model: use one of minilm, tiny-gpt, tiny-llama, mine\n"),
    ({"MANYEYES_MODELS": "{}"}, [],
     "error: no model to serve: MANYEYES_MODELS is empty and no --model or MANYEYES_EXTRA_MODELS adds one\n"),
], ids=["half-on-cpu", "unknown-default", "unknown-default-with-model-flag", "no-models"])
def test_serve_refuses_settings_no_model_could_load_under_in_one_line(env, args, says, capsys, monkeypatch):
    """MANYEYES_HALF on a CPU and a MANYEYES_DEFAULT_MODEL that names no served model each started a
    server that said "serving", loaded no model and answered every request 503 `not_ready` for
    good (audit h46c); MANYEYES_MODELS={} was a StopIteration traceback."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: pytest.fail("it served"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--port", str(free_port()), *args]) == 2
    assert capsys.readouterr().err == says


def test_a_default_model_that_a_model_flag_adds_is_served(monkeypatch):
    import uvicorn

    seen = {}

    def run(server, sockets):
        seen["settings"] = server.config.app.state.settings
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setenv("MANYEYES_DEFAULT_MODEL", "mine")
    assert main(["serve", "--port", str(free_port()), "--model", "mine=tiny-gpt"]) == 0
    assert seen["settings"].default_model_id() == "mine"


def served_app(monkeypatch, *args):
    """The app `manyeyes serve --port P *args` builds, its sockets closed instead of served."""
    import uvicorn

    seen = {}

    def run(server, sockets):
        seen["app"] = server.config.app
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["serve", "--port", str(free_port()), *args]) == 0
    return seen["app"]


@pytest.mark.parametrize("args, env, allowed", [
    ([], {}, ["localhost", "127.0.0.1", "[::1]"]),
    (["--host", "localhost"], {}, ["localhost", "127.0.0.1", "[::1]"]),
    ([], {"MANYEYES_TRUSTED_PROXIES": "127.0.0.1"}, ["*"]),  # behind a proxy: reached by the proxy's names
    (["--host", "0.0.0.0"], {}, ["*"]),
    ([], {"MANYEYES_ALLOWED_HOSTS": "viz.example.org, *.example.net"}, ["viz.example.org", "*.example.net"]),
], ids=["loopback", "localhost", "proxied", "every-interface", "set"])
def test_serve_on_loopback_answers_only_requests_addressed_to_this_machine(monkeypatch, args, env, allowed):
    """DNS rebinding (audit h46b): a page whose name then resolves to 127.0.0.1 could use a keyless
    local server as its own origin. Its requests name it in Host, which loopback's default refuses."""
    from fastapi.testclient import TestClient

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = served_app(monkeypatch, *args)
    assert app.state.settings.allowed_hosts == allowed
    # The lifespan is not run, so no model is loaded: a request let through gets a 500 from its route.
    client = TestClient(app, base_url="http://rebound.example", raise_server_exceptions=False)
    assert client.get("/healthz").json() == {"status": "ok"}  # every probe reaches it
    refused = client.get("/api/v1/models")
    if allowed == ["*"]:
        assert refused.status_code == 500
    else:
        assert refused.status_code == 421 and refused.json()["error"]["code"] == "host_not_allowed", refused.text
    wildcard = client.get("/api/v1/models", headers={"host": "a.example.net:8000"}).status_code
    assert wildcard == (421 if allowed[0] == "localhost" else 500)


def test_an_allowed_hosts_variable_that_names_no_host_is_one_line(monkeypatch, capsys):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("it served"))
    monkeypatch.setenv("MANYEYES_ALLOWED_HOSTS", ",")
    assert main(["serve", "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == (
        "error: a MANYEYES_* setting in the environment is malformed: MANYEYES_ALLOWED_HOSTS=',': names no host: list "
        "host names (any port), '*' for any, or unset it for the default\n")


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_serve_on_ipv6_says_its_address_as_a_url(monkeypatch, capsys):
    """The banner said http://::1:8000, which no browser or curl takes."""
    import uvicorn

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    port = free_port()
    assert main(["serve", "--host", "::1", "--port", str(port)]) == 0
    assert f"on http://[::1]:{port} (GET /readyz" in capsys.readouterr().err


def test_a_server_that_lists_its_public_name_still_answers_probes_addressed_to_loopback(monkeypatch):
    """MANYEYES_ALLOWED_HOSTS=viz.example.org, as SECURITY.md suggests behind a proxy, answered the
    Dockerfile's HEALTHCHECK (127.0.0.1:8000/readyz) and a local /metrics scrape 421 (review h47b).
    A loopback literal is no DNS rebinding, whose requests carry the attacker's name."""
    from fastapi.testclient import TestClient

    monkeypatch.setenv("MANYEYES_ALLOWED_HOSTS", "viz.example.org")
    client = TestClient(served_app(monkeypatch), raise_server_exceptions=False)
    for host in ("127.0.0.1:8000", "127.0.0.1", "localhost", "LOCALHOST:8000", "[::1]:8000", "viz.example.org"):
        assert client.get("/metrics", headers={"host": host}).status_code == 200, host
    for host in ("rebound.example", "127.0.0.2", "localhost.example.org", "example.org"):
        r = client.get("/metrics", headers={"host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", host


@pytest.mark.parametrize("value, entry", [
    ("http://viz.example.org", "http://viz.example.org"),
    ("viz.example.org/app", "viz.example.org/app"),
    ("viz.example.org other.example.org", "viz.example.org other.example.org"),
    ("viz.example.org, .example.org", ".example.org"),
    ('["viz.example.org", "example.org:http"]', "example.org:http"),
    ("localhost, [::1", "[::1"),
    # A zone id never reaches a Host header (curl sends [fe80::1]); digits alone read as IPv4 (h47i).
    ("localhost, [fe80::1%eth0]:8000", "[fe80::1%eth0]:8000"),
    ("fe80::1%eth0", "fe80::1%eth0"),
    ("999.999.999.999", "999.999.999.999"),
])
def test_an_allowed_host_that_no_host_header_can_match_is_one_line_naming_it(monkeypatch, capsys, value, entry):
    """'http://viz.example.org' was taken, and then every request got 421 (review h47b)."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("it served"))
    monkeypatch.setenv("MANYEYES_ALLOWED_HOSTS", value)
    assert main(["serve", "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == (
        f"error: a MANYEYES_* setting in the environment is malformed: MANYEYES_ALLOWED_HOSTS={value!r}: {entry!r} "
        "is no host name: list names as a Host header gives them (viz.example.org, 10.0.0.5 or [::1], any port), "
        "'*.example.org' for its subdomains, or '*' for any; no scheme, path or spaces\n")


@pytest.mark.parametrize("name, value, words", [
    # A browser's Origin is scheme://host[:port]: a bare name or a trailing slash matched no preflight (h49f).
    ("MANYEYES_CORS_ORIGINS", '["viz.example.org"]', "'viz.example.org' is no origin: write it as a browser sends it"),
    ("MANYEYES_CORS_ORIGINS", "https://a.example.org, https://b.example.org/", "'https://b.example.org/' is no origin"),
    # "inf" drained for ever behind a client that never finished its request.
    ("MANYEYES_SHUTDOWN_GRACE_S", "inf", "MANYEYES_SHUTDOWN_GRACE_S='inf': Input should be a finite number"),
    ("MANYEYES_REQUEST_TIMEOUT_S", "Infinity", "Input should be a finite number"),
    ("MANYEYES_SWITCH_INTERVAL_MS", "inf", "Input should be a finite number"),
    ("MANYEYES_REQUEST_READ_TIMEOUT_S", "1e308", "less than or equal to 86400"),  # for ever, as inf
    ("MANYEYES_CORS_ORIGINS", "HTTPS://A.EXAMPLE.ORG", "is no origin"),  # a browser sends it in lower case
    ("MANYEYES_CORS_ORIGINS", "https://user@a.example.org", "is no origin"),
    ("MANYEYES_CORS_ORIGINS", "https://*.example.org", "is no origin"),
    ("MANYEYES_CORS_ORIGINS", "https://a.example.org:99999", "is no origin"),
    # A browser's Origin leaves the scheme's own port out: ":443" matched no preflight (h56a).
    ("MANYEYES_CORS_ORIGINS", "https://viz.example.org:443", "'https://viz.example.org:443' names its scheme's own port, "
     "which a browser leaves out of the Origin it sends: write https://viz.example.org"),
    ("MANYEYES_CORS_ORIGINS", "http://a.example.org:80", "write http://a.example.org"),
    # mallopt takes a C int: 4 GiB wrapped to 0.
    ("MANYEYES_MALLOC_MMAP_THRESHOLD", "4294967296", "less than or equal to 33554432"),
    ("MANYEYES_MALLOC_TRIM_THRESHOLD", "99999999999", "less than or equal to 2147483647"),
    # MANYEYES_MODELS's JSON here was split on its commas into broken specs, found after "serving".
    ("MANYEYES_EXTRA_MODELS", '{"mine": "tiny-gpt"}', "takes ID=PATH_OR_SPEC pairs separated by commas"),
])
def test_settings_that_cannot_work_are_one_line_before_serving(monkeypatch, capsys, name, value, words):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("it served"))
    monkeypatch.setenv(name, value)
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: a MANYEYES_* setting in the environment is malformed: {name}=") and words in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("host", ["http://0.0.0.0", "0.0.0.0/24", " ", " 127.0.0.1", "127.0.0.1:8762", "[::1]"])
def test_a_host_that_is_a_url_is_refused_by_the_flag(capsys, host):
    """'http://0.0.0.0' printed "WARNING: serving on http://0.0.0.0", then failed to resolve it (h49f)."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--host", host])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --host: {host!r}: give an address or a host name to listen on" in err and "WARNING" not in err


def test_serve_help_says_where_the_settings_are(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "MANYEYES_* environment variable" in out and 'README.md, "Settings"' in out and "SECURITY.md" in out


def test_cors_origins_are_read_as_a_list_separated_by_commas_too(monkeypatch):
    from manyeyes.app.config import Settings

    monkeypatch.setenv("MANYEYES_CORS_ORIGINS", "https://a.example.org, http://b.example.org:8080")
    assert Settings().cors_origins == ["https://a.example.org", "http://b.example.org:8080"]
    monkeypatch.setenv("MANYEYES_CORS_ORIGINS", '["https://a.example.org"]')
    assert Settings().cors_origins == ["https://a.example.org"]
    assert Settings(cors_origins=["*"]).cors_origins == ["*"]
    assert Settings(cors_origins=["https://a.example.org:8443", "http://b.example.org:443"]).cors_origins[1] == "http://b.example.org:443"
    assert Settings(cors_origins=["http://[::1]:8000", "http://127.0.0.1:8000"]).cors_origins[0] == "http://[::1]:8000"


def test_every_form_of_host_the_comparison_reads_is_taken():
    from manyeyes.app.config import Settings

    hosts = ["viz.example.org", "VIZ.example.org.", "*.example.net", "viz.example.org:8443", "10.0.0.5", "[::1]",
             "[2001:db8::1]:8000", "2001:db8::2", "my_host", "*", "10.0.0.5:8000", "3com.example", "1.2.3.4."]
    assert Settings(allowed_hosts=hosts).allowed_hosts == hosts


@pytest.mark.parametrize("value", ["1000", "512", str(64 * 1024 - 1)])
def test_a_cache_too_small_for_any_run_is_one_line_saying_it_is_in_bytes(monkeypatch, capsys, value):
    """MANYEYES_CACHE_BYTES=1000 (a unit mistake) served, and answered every request 413 run_too_large."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("it served"))
    monkeypatch.setenv("MANYEYES_CACHE_BYTES", value)
    assert main(["serve", "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == (
        f"error: MANYEYES_CACHE_BYTES={value} is in bytes, too few for a cache of runs: give at least 65536 "
        "(536870912 is 512 MiB), or 0 to turn the cache off\n")


@pytest.mark.parametrize("value", ["0", str(64 * 1024), "200000"])
def test_no_cache_and_a_small_one_are_still_served(monkeypatch, value):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    monkeypatch.setenv("MANYEYES_CACHE_BYTES", value)
    assert main(["serve", "--port", str(free_port())]) == 0


def test_a_setting_in_another_case_is_read_and_not_warned_of(monkeypatch, capsys):
    """The settings read MANYEYES_* in any case, but the warning compared them as written:
    MANYEYES_Gzip_Level was applied and warned "not a setting manyeyes reads"; a refused
    MANYEYES_cache_bytes=-1 was followed by that warning too (review h47b)."""
    import uvicorn

    from manyeyes.app.config import Settings

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: [sock.close() for sock in sockets])
    monkeypatch.setenv("MANYEYES_Gzip_Level", "3")
    assert Settings().gzip_level == 3
    assert main(["serve", "--port", str(free_port())]) == 0
    assert "not a setting" not in capsys.readouterr().err
    monkeypatch.setenv("manyeyes_cache_bytes", "-1")
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: a MANYEYES_* setting in the environment is malformed: MANYEYES_CACHE_BYTES='-1'")
    assert "not a setting" not in err, err
    monkeypatch.setenv("MANYEYES_Cache_Byte", "1")  # mistyped in any case: still warned of, by the name given
    assert main(["serve", "--port", str(free_port())]) == 2
    assert ("warning: MANYEYES_Cache_Byte is not a setting manyeyes reads (did you mean MANYEYES_CACHE_BYTES?)"
            in capsys.readouterr().err)


def test_serve_logs_its_times_in_utc_marked_so(monkeypatch):
    """The log's times were local, without a zone. Nine hours east of UTC here, so that local time
    would read otherwise (this machine's own zone is UTC)."""
    import logging

    from manyeyes.app.logs import UtcFormatter

    monkeypatch.setenv("TZ", "JST-9")
    time.tzset()
    try:
        record = logging.LogRecord("manyeyes", logging.INFO, __file__, 1, "ready", None, None)
        record.created, record.msecs = 86400 * 366 + 3723.25, 250.0
        assert time.localtime(record.created).tm_hour == 10  # the zone took
        assert UtcFormatter("%(asctime)s %(message)s").format(record) == "1971-01-02T01:02:03.250Z ready"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_workers_and_the_shared_forward_process_log_in_utc_too():
    """`--workers` processes set their logging up themselves, in local time without a zone: they
    now share serve's (app/logs.py)."""
    before = time.time()
    line = subprocess.run(
        [sys.executable, "-c", "import logging; from manyeyes.app.logs import log_to_stderr; "
         "log_to_stderr('info', 'worker-7'); logging.getLogger('manyeyes.x').info('up')"],
        capture_output=True, text=True, env={**os.environ, "TZ": "JST-9"}, timeout=60).stderr
    stamp = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.\d{3}Z INFO worker-7 manyeyes\.x up\n", line)
    assert stamp, line
    # UTC, not the process's zone nine hours east: within the seconds the process took
    logged = calendar.timegm(time.strptime(stamp[1], "%Y-%m-%dT%H:%M:%S"))
    assert before - 1 <= logged <= time.time() + 1, (line, before)
