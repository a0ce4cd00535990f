"""What the server does with clients below the app, at the HTTP layer: one that never takes its
answer cannot make the server hold it, an answer that does not reach its client whole is logged as
such, bytes that are not HTTP get the JSON 400 every refusal gives, and a request to switch
protocols is answered as plain HTTP."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time

import httpx
import orjson
from starlette.responses import Response

from tests.reliability.conftest import HOST, live_server, read_all, wait_until

TIMEOUT_S = 1.0
# A MiniLM run of 512 tokens as u8: 6 x 12 x 512² bytes, base64 in JSON, about 25 MB: far more
# than the kernel's socket buffers take, so the rest waits in the server's transport.
TEXT = " ".join(["bank river water"] * 200)


def attention_request(close: bool = False) -> bytes:
    """close: the server closes the connection after the answer (rather than at its keep-alive
    timeout, 5 s later), which ends read_all."""
    body = orjson.dumps({"text": TEXT, "format": "u8", "truncate": True})
    return (b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + b"Accept-Encoding: identity\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def answer_size(said: bytes) -> tuple[bytes, int, int]:
    head, _, body = said.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return head, length, len(body)


def test_an_answer_the_client_never_takes_is_dropped_and_a_slow_reader_is_served():
    with live_server(request_read_timeout_s=TIMEOUT_S) as server:
        # Computed once, so the sockets below wait for no forward pass.
        with httpx.Client(base_url=server.url, timeout=120) as client:
            full = client.post("/api/v1/attention", content=attention_request().partition(b"\r\n\r\n")[2],
                               headers={"content-type": "application/json", "accept-encoding": "identity"})
            assert full.status_code == 200 and len(full.content) > 20_000_000, (full.status_code, len(full.content))

        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(attention_request())
            time.sleep(TIMEOUT_S * 4)  # reads nothing: the server aborts the connection meanwhile
            head, length, got = answer_size(read_all(sock))
        assert head.startswith(b"HTTP/1.1 200 ") and length > 20_000_000
        # uvicorn kept the rest for as long as the client kept the connection: all of it came.
        assert got < length, "the server held the whole answer for a client that took none of it"

        # A reader that pauses now and then, each time for less than the deadline, gets it whole.
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(attention_request(close=True))
            head, length, got = answer_size(read_all(sock, pause_every=4 * 2**20, pause_s=TIMEOUT_S / 2))
        assert head.startswith(b"HTTP/1.1 200 ") and got == length > 20_000_000

        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200


def test_an_answer_not_delivered_whole_is_logged_and_counted_as_such(caplog):
    """The access log said 200 with the answer's size for an answer the write deadline dropped, or
    the client cut off by resetting the connection: nothing told it what became of the bytes."""

    def attention_lines() -> list[dict]:
        return [line for line in (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access")
                if line["path"] == "/api/v1/attention"]

    with caplog.at_level(logging.INFO, logger="manyeyes.access"), live_server(request_read_timeout_s=TIMEOUT_S) as server:
        # Taken whole, as is every answer a client reads.
        with httpx.Client(base_url=server.url, timeout=120) as client:
            full = client.post("/api/v1/attention", content=attention_request().partition(b"\r\n\r\n")[2],
                               headers={"content-type": "application/json", "accept-encoding": "identity"})
            assert full.status_code == 200 and len(full.content) > 20_000_000
            assert client.get("/healthz").status_code == 200
        (line,) = wait_until(attention_lines, 10, "the whole answer's line")
        assert line["status"] == 200 and line["bytes"] == len(full.content) and line["complete"] is True, line
        lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access"]
        assert all(line["complete"] is True for line in lines), lines  # /readyz and /healthz too

        # Never read: the write deadline drops the connection with most of the answer unsent.
        with socket.create_connection((HOST, server.port)) as sock:
            sock.sendall(attention_request())
            wait_until(lambda: len(attention_lines()) == 2, 10 * TIMEOUT_S, "the dropped answer's line")
        # Read in part, then reset (SO_LINGER 0: close sends RST).
        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(attention_request())
            got = 0
            while got < 2**20 and (chunk := sock.recv(2**16)):
                got += len(chunk)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        wait_until(lambda: len(attention_lines()) == 3, 10 * TIMEOUT_S, "the reset answer's line")
        for line in attention_lines()[1:]:
            # The answer's size, of which the client had less.
            assert line["status"] == 200 and line["bytes"] > 20_000_000 and line["complete"] is False, line
        assert server.metric("manyeyes_requests_total", route="/api/v1/attention", status="499") == 2
        assert server.metric("manyeyes_requests_total", route="/api/v1/attention", status="200") == 1

        # Half-closed after the request (shutdown(SHUT_WR), as `nc -N` does): asyncio closed the
        # connection at the FIN and dropped an answer made after it, which was logged complete and
        # counted 200. (A slower one, a forward's, is cancelled as the client's leaving: a 499.)
        # Made a moment after the request, so that the FIN has come first however loaded the
        # machine (/api/v1/models answered before it once in CI, rightly whole).
        async def after_the_fin() -> dict:
            await asyncio.sleep(0.5)
            return {"answered": True}

        server.app.add_api_route("/test/after-fin", after_the_fin)

        def after_fin_lines() -> list[dict]:
            return [line for line in (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access")
                    if line["path"] == "/test/after-fin"]

        with socket.create_connection((HOST, server.port)) as sock:
            sock.settimeout(30)
            sock.sendall(f"GET /test/after-fin HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(2**16) == b""
        (line,) = wait_until(after_fin_lines, 30, "the half-closed request's line")
        assert line["status"] == 200 and line["complete"] is False, line
        assert server.metric("manyeyes_requests_total", route="/test/after-fin", status="499") == 1

        # An answer in one piece, most of which the transport still holds when its handler ends:
        # logged once the client has taken it, or the connection is lost.
        server.app.add_api_route("/test/one-piece", lambda: Response(b"x" * 20_000_000, media_type="text/plain"))

        def one_piece_lines() -> list[dict]:
            return [line for line in (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "manyeyes.access")
                    if line["path"] == "/test/one-piece"]

        for reads in (True, False):
            before = len(one_piece_lines())
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(30)
                sock.sendall(b"GET /test/one-piece HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                time.sleep(TIMEOUT_S / 2)
                assert len(one_piece_lines()) == before, "logged while the transport still held the answer"
                if reads:
                    assert answer_size(read_all(sock))[1:] == (20_000_000, 20_000_000)
                (line,) = wait_until(lambda: one_piece_lines()[before:], 10 * TIMEOUT_S, "the one-piece answer's line")
            assert line["status"] == 200 and line["complete"] is reads, line


def test_bytes_that_are_not_http_get_a_json_400():
    with live_server() as server:
        for sent in (
            # Content-Length twice, and with Transfer-Encoding (request smuggling): refused, not guessed.
            b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 30\r\n\r\n{}",
            b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n0\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
            b"GET /h\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
            b"BREW /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            # URLs httptools cannot split, as a connection's first request: the protocol's refusal
            # raised (no request before it to look at) and the connection dropped unanswered.
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
            b"GET http://[::1 HTTP/1.1\r\nHost: x\r\n\r\n",
        ):
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(10)
                sock.sendall(sent)
                said = read_all(sock)
            head, _, body = said.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), (sent, said[:200])
            assert b"content-type: application/json" in head.lower(), (sent, head)
            assert orjson.loads(body)["error"]["code"] == "bad_request", (sent, body)
            # SECURITY.md's headers are on every answer: these had only their type, length and close.
            for name in (b"content-security-policy: ", b"x-content-type-options: nosniff", b"x-frame-options: DENY",
                         b"referrer-policy: no-referrer", b"date: "):
                assert b"\r\n" + name in head, (sent, head)
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200


def test_a_transfer_coding_other_than_chunked_is_a_json_400():
    """`Transfer-Encoding: gzip, chunked` was framed by its chunks and the body read as if not
    gzipped (a plain one was answered 200). A 400, as every refusal of what a client sent."""
    body = b'{"text": "The bank."}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with live_server() as server:
        for coding in (b"gzip, chunked", b"deflate,chunked", b"x-custom, chunked"):
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(10)
                sock.sendall(b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Transfer-Encoding: " + coding + b"\r\n\r\n" + chunked)
                said = read_all(sock)
            head, _, answer = said.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), (coding, said[:200])
            error = orjson.loads(answer)["error"]
            assert error["code"] == "bad_request" and "no transfer coding but chunked" in error["message"], error
        with socket.create_connection((HOST, server.port)) as sock:  # chunked alone is read as ever
            sock.settimeout(30)
            sock.sendall(b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked)
            assert read_all(sock).startswith(b"HTTP/1.1 200 ")


WS_HANDSHAKE = (b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")


def test_a_request_to_switch_protocols_is_answered_as_plain_http():
    """uvicorn's WebSocket protocol answered a handshake 403 or a plain-text 400, and after any
    Upgrade head its parser read nothing more: a body sent with it never reached the handler (a 422
    for a POST that had one), and the requests after it were never answered."""
    healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    body = orjson.dumps({"text": "The bank of the river."})
    with live_server() as server:
        for sent, status, payload in (
            (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + WS_HANDSHAKE + b"\r\n", b"200 OK", {"status": "ok"}),
            (b"GET /ws HTTP/1.1\r\nHost: x\r\n" + WS_HANDSHAKE + b"\r\n", b"404 Not Found", None),
            (b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", b"200 OK", {"status": "ok"}),
            (b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
             b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n", b"200 OK", {"status": "ok"}),
            (b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + WS_HANDSHAKE
             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, b"400 Bad Request", None),
        ):
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(10)
                started = time.monotonic()
                # The request behind it is the other protocol's bytes: unanswered, and the
                # connection closed after the first answer (not kept alive, then timed out).
                sock.sendall(sent + healthz)
                said = read_all(sock)
                assert time.monotonic() - started < 3, (sent, said[:200])
            head, _, answer = said.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 " + status), (sent, said[:300])
            assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower(), (sent, head)
            assert said.count(b"\r\n\r\n") == 1, (sent, said[:600])
            answer = orjson.loads(answer)
            if payload is not None:
                assert answer == payload, (sent, answer)
            else:
                assert set(answer["error"]) == {"code", "message"}, (sent, answer)
        assert answer["error"]["code"] == "bad_request" and "Upgrade" in answer["error"]["message"], answer
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
