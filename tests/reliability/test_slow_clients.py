"""A client that sends its request slowly, or not at all, cannot hold a connection for ever: each
whole request must arrive within MANYEYES_REQUEST_READ_TIMEOUT_S of its first byte. Nor can it send
a request head of any size: beyond MANYEYES_MAX_HEADER_BYTES it gets a 431."""

from __future__ import annotations

import socket
import time

import httpx
import orjson

from tests.reliability.conftest import HOST, live_server, wait_until

TIMEOUT_S = 1.0


def held_for(port: int, sent: bytes, patience_s: float = 10.0) -> tuple[float, bytes]:
    """Sends `sent`, then nothing: how long until the server closes the connection, and what it said."""
    with socket.create_connection((HOST, port)) as sock:
        sock.settimeout(patience_s)
        started = time.monotonic()
        if sent:
            sock.sendall(sent)
        said = b""
        while chunk := sock.recv(4096):
            said += chunk
        return time.monotonic() - started, said


def test_silent_and_trickling_requests_are_cut_off_and_the_server_answers_others():
    with live_server(request_read_timeout_s=TIMEOUT_S) as server:
        # Nothing at all, half a head, a whole head and half its body: each closed after the deadline.
        silent = held_for(server.port, b"")
        half_head = held_for(server.port, b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Ty")
        body = b'{"text": "The bank of the river."}'
        half_body = held_for(server.port, b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        for seconds, _ in (silent, half_head, half_body):
            assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + 3, seconds
        # Where no handler has the request, the answer says why, as JSON; a body cut off midway
        # is the handler's client gone away (no answer: it can no longer be sent a complete one).
        for _, said in (silent, half_head):
            head, _, payload = said.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), said[:80]
            assert orjson.loads(payload)["error"]["code"] == "request_timeout"
        assert half_body[1] == b""
        wait_until(lambda: server.metric("manyeyes_requests_total", status="499") >= 1, 10, "the cut-off body's 499")

        # A request sent in pieces, each well within the deadline, is answered; so is a kept-alive
        # connection's second request sent after more than the deadline of idling (uvicorn's
        # keep-alive timeout, 5 s, governs that wait, not the read deadline).
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            request = (b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            for k in range(0, len(request), 40):
                sock.sendall(request[k:k + 40])
                time.sleep(TIMEOUT_S / 10)
            assert sock.recv(12) == b"HTTP/1.1 200"
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.post("/api/v1/attention", json={"text": "The bank."}).status_code == 200
            time.sleep(TIMEOUT_S * 1.5)
            assert client.post("/api/v1/attention", json={"text": "The mill."}).status_code == 200
            assert client.get("/healthz").status_code == 200


def test_a_long_forward_is_not_a_slow_client():
    """The deadline covers reading the request, never the answer's making: a request whose forward
    takes longer than the deadline is answered."""
    with live_server(request_read_timeout_s=TIMEOUT_S, debug_forward_delay_s=TIMEOUT_S * 2) as server:
        r = httpx.post(f"{server.url}/api/v1/attention", json={"text": "The heron waited."}, timeout=60)
        assert r.status_code == 200 and r.json()["timing_ms"]["forward"] >= TIMEOUT_S * 2000


def rss_mb(pid: int = None) -> float:
    import os

    with open(f"/proc/{pid or os.getpid()}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_request_head_over_the_limit_is_refused_without_being_held():
    """uvicorn gathered a header of any length: 200 MB of one took the server 207 MB of memory."""
    limit = 16 * 1024
    with live_server(max_header_bytes=limit) as server:
        before = rss_mb()
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            sent = 0
            try:
                for _ in range(64):  # 64 MB, a megabyte a write, unless the server closes first
                    sock.sendall(b"X-Big: " + b"a" * 2**20 + b"\r\n")
                    sent += 1
            except (BrokenPipeError, ConnectionResetError):
                pass
            said = b""
            try:
                while chunk := sock.recv(4096):
                    said += chunk
            except ConnectionResetError:
                pass
        assert sent < 64, "the server read the whole 64 MB head"
        head, _, payload = said.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), said[:80]
        assert orjson.loads(payload)["error"] == {
            "code": "header_too_large",
            "message": "the request line and headers are over 16,384 bytes (MANYEYES_MAX_HEADER_BYTES)"}
        assert rss_mb() - before < 32  # the server runs in this process

        # Heads up to the limit are read as ever, a long URL and many headers included, and so is
        # a body of any size the body limit allows, sent in one write with its head.
        with httpx.Client(base_url=server.url, timeout=30) as client:
            padding = {f"x-pad-{i}": "p" * 100 for i in range(100)}  # ~11 KB of headers
            assert client.get("/healthz", headers=padding).status_code == 200
            assert client.get("/api/v1/models?" + "a" * 200).status_code == 422  # unknown query: the app's answer
            text = "The heron waited by the old stone mill. " * 2000  # an 80 KB body
            r = client.post("/api/v1/attention", json={"text": text, "truncate": True, "format": "u8"})
            assert r.status_code == 200 and r.json()["truncated"] is True
