"""What the server's own HTTP protocol (app/server.py) answers is counted and logged as every other
answer, and every line the server writes is stamped (review h48b: the 400s, 408s and 431s it
writes were in neither /metrics nor the access log, only uvicorn's unstamped "WARNING:  Invalid
HTTP request received.", with no client and no status)."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from manyeyes.app.config import Settings
from manyeyes.app.server import server_config
from tests.reliability.conftest import HOST, free_port, live_server, wait_until

READ_TIMEOUT_S = 1.0
# Each refusal: what is sent, its status, error code, the method it is counted under, and words of
# its logged reason (llhttp's own where the parser refused it).
REFUSALS = [
    (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "header_too_large", "GET",
     "MANYEYES_MAX_HEADER_BYTES"),
    (b"POST /api/v1/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     400, "bad_request", "POST", "Content-Length"),
    (b"FOO / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400, "bad_request", "other", "method"),
    (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX: a\x00b\r\n\r\n", 400, "bad_request", "GET", "header"),
    (b"GET /healthz HTTP/1.1\r\nHost: 127.0", 408, "request_timeout", "GET", "MANYEYES_REQUEST_READ_TIMEOUT_S"),
]
# A log line as app/logs.py writes it: its time in UTC, marked so, then the level and the logger.
STAMPED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ .*")


def first_line(port: int, data: bytes, wait_s: float = 10) -> bytes:
    with socket.create_connection((HOST, port), timeout=wait_s) as sock:
        sock.sendall(data)
        answer = b""
        try:
            while b"\r\n" not in answer and (chunk := sock.recv(4096)):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer.partition(b"\r\n")[0]


def refusal_lines(caplog) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access"]
    return [line for line in lines if line["route"] == "other" and "reason" in line]


def test_refusals_written_by_the_protocol_are_counted_by_status_and_logged_with_client_code_and_reason(caplog):
    caplog.set_level(logging.INFO, logger="manyeyes.access")
    with live_server(request_read_timeout_s=READ_TIMEOUT_S) as server:
        for data, status, *_ in REFUSALS:
            assert first_line(server.port, data).startswith(f"HTTP/1.1 {status} ".encode())
        wait_until(lambda: len(refusal_lines(caplog)) == len(REFUSALS), 10, "a line for each refusal")
        for status, method in {(400, "POST"), (400, "other"), (400, "GET"), (408, "GET"), (431, "GET")}:
            want = sum(1 for _, s, _, m, _ in REFUSALS if (s, m) == (status, method))
            labels = {"route": "other", "method": method, "status": str(status)}
            assert server.metric("manyeyes_requests_total", **labels) == want, labels
            assert server.metric("manyeyes_request_seconds_count", **labels) == want, labels
    lines = refusal_lines(caplog)
    for line, (_, status, code, method, words) in zip(lines, REFUSALS):
        assert (line["status"], line["code"], line["client"], line["answered"]) == (status, code, "addr:127.0.0.1", True), line
        assert words.lower() in line["reason"].lower(), line
        assert line["method"] == (None if method == "other" else method) and line["bytes"] > 0, line
    assert lines[0]["path"] == "/healthz" and lines[-1]["ms"] >= READ_TIMEOUT_S * 1000 * 0.9, lines
    # Not uvicorn's line, which said nothing of who or what.
    assert not [r for r in caplog.records if "Invalid HTTP request received" in r.getMessage()]


def test_a_head_refused_behind_a_request_still_answered_is_counted_once_and_logged_as_unanswered(caplog):
    """Pipelined behind a request being answered, a refused head gets no answer (the connection
    closes after the earlier one's), and its head's deadline may still pass meanwhile: one refusal."""
    caplog.set_level(logging.INFO, logger="manyeyes.access")
    with live_server(request_read_timeout_s=READ_TIMEOUT_S, debug_forward_delay_s=3 * READ_TIMEOUT_S) as server:
        body = json.dumps({"text": "The heron waited."}).encode()
        first = (f"POST /api/v1/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        refused = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
        with socket.create_connection((HOST, server.port), timeout=30) as sock:
            sock.sendall(first + refused)
            answers = b""
            while chunk := sock.recv(65536):
                answers += chunk
        assert answers.startswith(b"HTTP/1.1 200 ") and answers.count(b"HTTP/1.1 ") == 1, answers[:200]
        wait_until(lambda: refusal_lines(caplog), 10, "the refusal's line")
        assert server.metric("manyeyes_requests_total", route="other") == 1
        assert server.metric("manyeyes_requests_total", route="other", method="GET", status="431") == 1
    (line,) = refusal_lines(caplog)
    assert (line["status"], line["answered"], line["bytes"]) == (431, False, 0), line


def test_a_body_that_breaks_its_framing_is_the_apps_request_counted_once_with_what_the_server_sent(caplog):
    """The app has this request (its head was whole): AccessLog counts and logs it, not the protocol too."""
    caplog.set_level(logging.INFO, logger="manyeyes.access")
    with live_server(request_read_timeout_s=READ_TIMEOUT_S) as server:
        broken = (b"POST /api/v1/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"tex\r\nZZZ\r\n")
        assert first_line(server.port, broken).startswith(b"HTTP/1.1 400 ")

        def logged():
            return [json.loads(r.getMessage()) for r in caplog.records
                    if r.name == "manyeyes.access" and "/api/v1/attention" in r.getMessage()]

        (line,) = wait_until(logged, 10, "the request's line")
        assert line["server_refused"]["status"] == 400 and line["server_refused"]["code"] == "bad_request", line
        assert server.metric("manyeyes_requests_total", route="other") == 0
        assert server.metric("manyeyes_requests_total", route="/api/v1/attention") == 1


def test_server_config_leaves_logging_to_the_process():
    """uvicorn's own config wrote its lines without a time ("INFO:     Shutting down")."""
    assert server_config(lambda *a: None, Settings()).log_config is None


# A server of this project's (app/server.py) around an app that needs no model, set up as
# `manyeyes serve` sets it up: its lines, from start to exit, as an operator reads them.
SERVE = textwrap.dedent("""
    import asyncio, sys
    from manyeyes.app.config import Settings
    from manyeyes.app.logs import log_to_stderr
    from manyeyes.app.server import Server, server_config

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        try:
            await asyncio.sleep(3600)  # every request outlasts the grace: uvicorn cancels it
        except asyncio.CancelledError:  # answered as the app's ShutdownAnswer answers it
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    log_to_stderr("info")
    settings = Settings(shutdown_grace_s=2, request_read_timeout_s=5)
    Server(server_config(app, settings, host="127.0.0.1", port=int(sys.argv[1]), log_level="info")).run()
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_every_line_the_server_writes_is_stamped_and_a_drain_says_so_with_its_grace(sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        def listening() -> bool:
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_until(listening, 60, "the server to listen", interval_s=0.1)
        assert first_line(port, b"FOO / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        hung = socket.create_connection((HOST, port), timeout=10)
        hung.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # in flight when the signal comes
        time.sleep(0.3)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        hung.close()
    finally:
        proc.kill()
    lines = out.splitlines()
    assert lines and all(STAMPED.fullmatch(line) for line in lines), out
    said = "\n".join(lines)
    for words in ("uvicorn.error Started server process", "uvicorn.error Shutting down",
                  "WARNING uvicorn.error Cancel 1 running task(s)", f"manyeyes.server {sig.name}: draining",
                  "up to 1 s", '"status":400', '"code":"bad_request"'):
        assert words in said, (words, out)
    assert "Invalid HTTP request received" not in said, out


def test_a_refusal_line_is_bounded_keeps_no_query_and_an_idle_connection_is_no_request(caplog):
    """Review of the diff: a Transfer-Encoding of 60 KB went whole into the 400's message and its log
    line (64 KB of log a request); the line's path held the query (/export?text=... is a user's text);
    and a connection opened and never used (a browser's preconnect) was counted and logged as a 408."""
    caplog.set_level(logging.INFO, logger="manyeyes.access")
    junk = b"x" * 60_000
    with live_server(request_read_timeout_s=READ_TIMEOUT_S, max_header_bytes=128 * 1024) as server:
        sent = (b"POST /api/v1/attention?text=secret HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: " + junk
                + b", chunked\r\n\r\n0\r\n\r\n")
        with socket.create_connection((HOST, server.port), timeout=10) as sock:
            sock.sendall(sent)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 ") and len(answer) < 4096, len(answer)
        with socket.create_connection((HOST, server.port), timeout=10) as idle:
            idle.settimeout(READ_TIMEOUT_S * 5)
            assert idle.recv(4096).startswith(b"HTTP/1.1 408 ")  # still told, and closed
        wait_until(lambda: len(refusal_lines(caplog)) >= 1, 10, "the 400's line")
        time.sleep(0.5)
        assert server.metric("manyeyes_requests_total", route="other", method="GET", status="408") == 0
    lines = refusal_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0]["path"] == "/api/v1/attention" and len(json.dumps(lines[0])) < 2048, lines[0]
    assert not any("secret" in r.getMessage() for r in caplog.records)
