"""What the server does with clients below the app, at the HTTP layer: one that never takes its
answer cannot make the server hold it, and bytes that are not HTTP get the JSON 400 every
refusal gives."""

from __future__ import annotations

import socket
import time

import httpx
import orjson

from tests.reliability.conftest import HOST, live_server, read_all

TIMEOUT_S = 1.0
# A MiniLM run of 512 tokens as u8: 6 x 12 x 512² bytes, base64 in JSON, about 25 MB: far more
# than the kernel's socket buffers take, so the rest waits in the server's transport.
TEXT = " ".join(["bank river water"] * 200)


def attention_request() -> bytes:
    body = orjson.dumps({"text": TEXT, "format": "u8", "truncate": True})
    return (b"POST /api/v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Accept-Encoding: identity\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


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
            sock.sendall(attention_request())
            head, length, got = answer_size(read_all(sock, pause_every=4 * 2**20, pause_s=TIMEOUT_S / 2))
        assert head.startswith(b"HTTP/1.1 200 ") and got == length > 20_000_000

        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200


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
        ):
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(10)
                sock.sendall(sent)
                said = read_all(sock)
            head, _, body = said.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), (sent, said[:200])
            assert b"content-type: application/json" in head.lower(), (sent, head)
            assert orjson.loads(body)["error"]["code"] == "bad_request", (sent, body)
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
