"""A client that sends its request slowly, or not at all, cannot hold a connection for ever: a
request's head must arrive within MANYEYES_REQUEST_READ_TIMEOUT_S of its first byte, and its body
within as long again. Nor can it send
a request head of any size: beyond MANYEYES_MAX_HEADER_BYTES it gets a 431."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import orjson

from tests.reliability.conftest import HOST, live_server, read_all, wait_until
from tests.reliability.test_hostile_input import rss_bytes

TIMEOUT_S = 1.0


def held_for(port: int, sent: bytes, patience_s: float = 10.0) -> tuple[float, bytes]:
    """Sends `sent`, then nothing: how long until the server closes the connection, and what it said."""
    with socket.create_connection((HOST, port)) as sock:
        sock.settimeout(patience_s)
        started = time.monotonic()
        if sent:
            sock.sendall(sent)
        said = read_all(sock)
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
        # Each is answered, saying why, as JSON: the head's deadline by the protocol (no handler
        # has the request yet), the body's by BodyLimit, which reads it.
        for (_, said), what in ((silent, "request"), (half_head, "request"), (half_body, "request body")):
            head, _, payload = said.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), said[:80]
            assert orjson.loads(payload)["error"] == {
                "code": "request_timeout",
                "message": f"the {what} was not sent within 1 s (MANYEYES_REQUEST_READ_TIMEOUT_S)"}
        wait_until(lambda: server.metric("manyeyes_requests_total", status="408") >= 1, 10, "the body's 408 in the metrics")

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


def test_a_request_head_over_the_limit_is_refused_without_being_held():
    """uvicorn gathered a header of any length: 200 MB of one took the server 207 MB of memory."""
    limit = 16 * 1024
    with live_server(max_header_bytes=limit) as server:
        before = rss_bytes()
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
            said = read_all(sock)
        assert sent < 64, "the server read the whole 64 MB head"
        head, _, payload = said.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), said[:80]
        assert orjson.loads(payload)["error"] == {
            "code": "header_too_large",
            "message": "the request line and headers are over 16,384 bytes (MANYEYES_MAX_HEADER_BYTES)"}
        assert rss_bytes() - before < 32 * 2**20  # the server runs in this process

        # A head over the limit that arrives whole in one read (as any up to a read's size does)
        # was parsed, never counted, and answered 200.
        for head in (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (limit + 100) + b"\r\n\r\n",
                     b"GET /healthz?" + b"q" * (limit + 100) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"p" * 200) for i in range(90))
                     + b"\r\n"):
            _, said = held_for(server.port, head)
            status, _, payload = said.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 431 ") and b"header_too_large" in payload, said[:80]

        # Heads up to the limit are read as ever, a long URL and many headers included, and so is
        # a body of any size the body limit allows, sent in one write with its head.
        with httpx.Client(base_url=server.url, timeout=30) as client:
            padding = {f"x-pad-{i}": "p" * 100 for i in range(100)}  # ~11 KB of headers
            assert client.get("/healthz", headers=padding).status_code == 200
            assert client.get("/api/v1/models?" + "a" * 200).status_code == 422  # unknown query: the app's answer
            text = "The heron waited by the old stone mill. " * 2000  # an 80 KB body
            r = client.post("/api/v1/attention", json={"text": text, "truncate": True, "format": "u8"})
            assert r.status_code == 200 and r.json()["truncated"] is True


def post_bytes(text: str, close: bool = False) -> bytes:
    """close: the last request on its connection, which the server then closes (rather than at
    its keep-alive timeout, 5 s later)."""
    body = orjson.dumps({"text": text})
    return (b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"") + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def test_a_pipelined_request_behind_a_long_forward_is_answered_and_the_first_answer_not_cut():
    """uvicorn reads no further while an earlier request on the connection is answered: that wait
    is the server's. The first version's read deadline then closed the connection, cutting off the
    earlier answer (and its handler's next write raised: a 500 in the log); now the connection
    closes, if it must, only once the answers before are out."""
    with live_server(request_read_timeout_s=TIMEOUT_S, debug_forward_delay_s=TIMEOUT_S * 2.5) as server:
        cases = [
            (post_bytes("The bank of the river, first.") + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
             {b"200 OK"}),
            # The body of a POST pipelined behind another reaches its handler once the answer before
            # it is out (uvicorn resumes reading, then starts it).
            (post_bytes("The bank of the river, second.") + post_bytes("The bank of the river, third.", close=True), {b"200 OK"}),
        ]
        for sent, second_answers in cases:
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(30)
                sock.sendall(sent)
                said = read_all(sock)  # until the server closes it, after the second answer
            # A status line follows the answer before it directly (no line break after a JSON body).
            statuses = [line.split(b"\r\n", 1)[0] for line in said.split(b"HTTP/1.1 ")[1:]]
            assert statuses[0] == b"200 OK" and b'"run_id"' in said, said[:300]  # whole, not cut off
            assert len(statuses) == 2 and statuses[1] in second_answers, statuses
        assert server.metric("manyeyes_requests_total", status="500") == 0


def test_a_pipelined_request_whose_head_comes_while_the_server_is_not_reading_is_answered():
    """Behind a request being answered, uvicorn reads a pipelined request's head and then stops
    reading until that answer is out. A third request whose head had begun in the same read had its
    head's deadline run meanwhile: the connection was closed after the second answer, the third
    never answered."""
    with live_server(request_read_timeout_s=TIMEOUT_S, debug_forward_delay_s=TIMEOUT_S * 2.5) as server:
        third = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(post_bytes("The mill by the river, first."))
            time.sleep(TIMEOUT_S / 4)  # its handler has the request and runs
            sock.sendall(post_bytes("The mill by the river, second.") + third[:5])
            time.sleep(TIMEOUT_S / 4)
            sock.sendall(third[5:])
            said = read_all(sock)
        statuses = [line.split(b"\r\n", 1)[0] for line in said.split(b"HTTP/1.1 ")[1:]]
        assert statuses == [b"200 OK"] * 3, statuses
        assert said.endswith(b'{"status":"ok"}'), said[-200:]


def test_a_client_gone_with_a_request_pipelined_behind_the_one_answered_drops_its_work(caplog):
    """uvicorn told only the newest request of a connection that its client had gone: with one
    pipelined behind the request being answered, that request's work went on, and its answer's
    write raised (an unhandled error logged for a client that only hung up)."""
    with live_server(request_read_timeout_s=TIMEOUT_S, debug_forward_delay_s=TIMEOUT_S * 2.5) as server:
        with caplog.at_level(logging.INFO, logger="manyeyes.access"):
            with socket.create_connection((HOST, server.port)) as sock:
                sock.sendall(post_bytes("The heron by the pond.") + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                time.sleep(TIMEOUT_S / 2)  # its handler waits on the forward
            (line,) = wait_until(lambda: [r.getMessage() for r in caplog.records if r.name == "manyeyes.access"
                                          and "/api/v1/attention" in r.getMessage()], 10, "the attention line")
        assert orjson.loads(line)["status"] == 499, line
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert server.metric("manyeyes_requests_total", status="500") == 0


def trickled(port: int, head: bytes, drip: bytes, for_s: float = TIMEOUT_S * 4) -> tuple[float | None, bytes]:
    """Sends `head`, then `drip` every TIMEOUT_S / 4 (each restarted uvicorn's keep-alive timer)
    for up to `for_s`, reading meanwhile: seconds until the server closed the connection (None: it
    was still open when the client stopped), and what it said."""
    with socket.create_connection((HOST, port)) as sock:
        sock.settimeout(TIMEOUT_S / 4)
        started, said = time.monotonic(), b""
        sock.sendall(head)
        while time.monotonic() - started < for_s:
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    return time.monotonic() - started, said
                said += chunk
            except TimeoutError:
                try:
                    sock.sendall(drip)
                except (BrokenPipeError, ConnectionResetError):
                    return time.monotonic() - started, said
            except ConnectionResetError:
                return time.monotonic() - started, said
        return None, said


SENT_BEFORE_THE_BODY = [
    # Methods BodyLimit leaves alone (their routes read no body), with a body that trickles in.
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{", b" ", b"200"),
    (b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{", b" ", b"200"),
    (b"OPTIONS /api/v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{", b" ", b"405"),
    (b"DELETE /api/v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{", b" ", b"405"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\nx\r\n", b"200"),
]


def one_answer(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body) off a kept-alive connection."""
    said = b""
    while b"\r\n\r\n" not in said:
        said += sock.recv(65536)
    head, _, body = said.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    assert len(body) == length, "more than one answer came"
    return head + b"\r\n\r\n" + body


def test_an_answer_sent_before_its_requests_body_is_in_closes_the_connection():
    """uvicorn answered such a request and kept its connection, reading the rest of the body with
    no deadline: each byte restarted its keep-alive timer, and a client sending one every 4 s held
    the connection (and a file descriptor) for minutes (audit h46b: 153 s against a 5 s deadline)."""
    with live_server(request_read_timeout_s=TIMEOUT_S) as server:
        for head, drip, status in SENT_BEFORE_THE_BODY:
            seconds, said = trickled(server.port, head, drip)
            assert seconds is not None and seconds < TIMEOUT_S, (head, seconds, said[:200])
            answer = said.partition(b"\r\n\r\n")[0].lower()
            assert answer.startswith(b"http/1.1 " + status) and b"connection: close" in answer, (head, said[:300])
        # A body that is in before the answer keeps the connection alive, as ever: two requests on one.
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert one_answer(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(post_bytes("The bank of the river.", close=True))
            assert read_all(sock).startswith(b"HTTP/1.1 200")


def test_a_request_refused_for_its_key_before_its_body_is_in_closes_the_connection():
    """ClientIdentity answers 401 before the body is read (it may be 1 MB of junk from anyone);
    its connection stayed open for as long as the client trickled the rest of the body."""
    with live_server(request_read_timeout_s=TIMEOUT_S, api_keys=["the-key"]) as server:
        head = (b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n{")
        seconds, said = trickled(server.port, head, b" ")
        assert seconds is not None and seconds < TIMEOUT_S, (seconds, said[:200])
        answer, _, payload = said.partition(b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), said[:300]
        assert orjson.loads(payload)["error"]["code"] == "unauthorized"
        # With the key, the same body sent whole is read and answered, the connection kept.
        body = orjson.dumps({"text": "The bank."})
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            for _ in range(2):
                sock.sendall(b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer the-key\r\n"
                             b"Content-Type: application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                reply = one_answer(sock)
                assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" not in reply.lower(), reply[:300]
