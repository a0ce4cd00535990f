"""Hostile input: every request below gets a 4xx JSON error, and the server stays healthy."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from tests.reliability.conftest import HOST, assert_json_error, live_server

ATTENTION = "/api/v1/attention"


@pytest.fixture(scope="module")
def server():
    with live_server() as s:  # the default limits: 1,000,000-byte bodies, 100,000-character texts
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def still_healthy(server, client):
    """After every hostile request the server still answers a real one correctly."""
    yield
    assert client.get("/healthz").status_code == 200
    r = client.post(ATTENTION, json={"text": "Still here.", "layers": [1], "heads": [2]})
    assert r.status_code == 200, r.text
    assert [t["text"] for t in r.json()["tokens"]] == ["[CLS]", "Still", "here", ".", "[SEP]"]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def read_response(sock: socket.socket, timeout_s: float = 30) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response read off a raw socket: status, headers, body."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def send_until_answered(server, head: bytes, chunks, limit_bytes: int) -> tuple[int, dict, bytes, int]:
    """Sends the head, then body chunks until the server answers (or `limit_bytes` went out);
    returns the response and how many body bytes had been sent when it came."""
    with socket.create_connection((HOST, server.port), timeout=30) as sock:
        sock.sendall(head)
        sent = 0
        for chunk in chunks:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable or sent >= limit_bytes:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        status, headers, body = read_response(sock)
        return status, headers, body, sent


def body_error(status: int, headers: dict, body: bytes, expected: int) -> dict:
    assert status == expected, (status, body[:300])
    assert headers["content-type"].startswith("application/json")
    return json.loads(body)["error"]


@pytest.mark.parametrize("size", [1_048_576, 50 * 2**20], ids=["1MB", "50MB"])
def test_declared_big_body_is_413_before_any_of_it_is_sent(server, size):
    head = (
        f"POST {ATTENTION} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()
    # Not one byte of the body goes out: the answer can only come from the declared length.
    status, headers, body, sent = send_until_answered(server, head, iter(()), size)
    assert sent == 0
    err = body_error(status, headers, body, 413)
    assert err["code"] == "body_too_large" and "1,000,000" in err["message"]
    assert headers.get("connection") == "close"


def test_streamed_50mb_body_is_413_at_the_limit_with_flat_memory(server):
    """No Content-Length (chunked): the server reads up to the limit, refuses, and holds no more."""
    head = f"POST {ATTENTION} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    piece = b"a" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    total = 50 * 2**20
    before = rss_bytes()
    status, headers, body, sent = send_until_answered(server, head, (chunk for _ in range(total // len(piece))), total)
    grown = rss_bytes() - before
    err = body_error(status, headers, body, 413)
    assert err["code"] == "body_too_large"
    assert sent < total // 2, f"the server read {sent} of {total} bytes before refusing"
    # Server and client share this process: 50 MB streamed, a few MB at most kept.
    assert grown < 20 * 2**20, f"RSS grew by {grown / 2**20:.1f} MB"


def test_five_million_characters_is_refused_before_tokenizing(server, client, monkeypatch):
    served = server.app.state.registry.get(None)
    calls = []
    monkeypatch.setattr(served.model, "encode", lambda *a, **k: calls.append(a) or pytest.fail("tokenized"))
    text = "word " * 1_000_000
    # Over the body limit: refused by size before the JSON is parsed.
    err = assert_json_error(client.post(ATTENTION, json={"text": text, "truncate": True}), 413)
    assert err["code"] == "body_too_large"
    assert calls == []


def test_long_text_under_a_raised_body_limit_is_refused_by_characters_before_tokenizing():
    with live_server(max_body_bytes=60_000_000) as big:
        served = big.app.state.registry.get(None)
        real_encode, calls = served.model.encode, []
        served.model.encode = lambda *a, **k: calls.append(len(a[0])) or real_encode(*a, **k)
        text = "word " * 1_000_000
        with httpx.Client(base_url=big.url, timeout=60) as c:
            started = time.monotonic()
            err = assert_json_error(c.post(ATTENTION, json={"text": text, "truncate": True}), 422)
            assert err["code"] == "too_long" and "5,000,000 characters" in err["message"] and "100,000" in err["message"]
            err = assert_json_error(c.post(f"{ATTENTION}/batch", json={"texts": ["ok", text]}), 422)
            assert err["message"].startswith("texts[1]: ")
            assert calls == [], "the tokenizer saw a text over the limit"
            # Just under the limit, with truncate: tokenized, cut to the model's 512 positions.
            r = c.post(ATTENTION, json={"text": "w " * 49_999, "truncate": True, "format": "u8", "layers": [0], "heads": [0]})
            assert r.status_code == 200, r.text
            assert r.json()["truncated"] is True and len(r.json()["tokens"]) == 512
            assert calls == [99_998]
            assert time.monotonic() - started < 60


JSON = {"content-type": "application/json"}
HOSTILE_BODIES = {
    "invalid utf-8": (b'{"text": "caf\xc3\x28 \xff\xfe"}', JSON, 400),
    "utf-8 encoded surrogate": (b'{"text": "a\xed\xa0\x80b"}', JSON, 422),
    "lone surrogate escape": (b'{"text": "a\\ud800b"}', JSON, 422),
    "lone low surrogate in a pair": (b'{"text": "ok", "text_pair": "\\udc00"}', JSON, 422),
    "broken json": (b'{"text": "The bank', JSON, 400),  # as the README's table says: unparseable is 400
    "trailing comma": (b'{"text": "The bank",}', JSON, 400),
    "not an object": (b'["The bank"]', JSON, 422),
    "empty body": (b"", JSON, 400),  # no body is no JSON: a 400 that says so (it was a 422 "Field required")
    "wrong content type": (b'{"text": "The bank"}', {"content-type": "text/plain"}, 415),  # names the header to send
    "form post": (b"text=The+bank", {"content-type": "application/x-www-form-urlencoded"}, 415),
    "NaN text": (b'{"text": NaN}', JSON, 422),
    "NaN layer": (b'{"text": "hi", "layers": [NaN]}', JSON, 422),
    "Infinity head": (b'{"text": "hi", "heads": [Infinity]}', JSON, 422),
    "-Infinity truncate": (b'{"text": "hi", "truncate": -Infinity}', JSON, 422),
    "float layer": (b'{"text": "hi", "layers": [1.0]}', JSON, 422),
    "string layer": (b'{"text": "hi", "layers": ["1"]}', JSON, 422),
    "negative layer": (b'{"text": "hi", "layers": [-1]}', JSON, 422),
    "layer out of range": (b'{"text": "hi", "layers": [6]}', JSON, 422),
    "negative head": (b'{"text": "hi", "heads": [-12]}', JSON, 422),
    "head out of range": (b'{"text": "hi", "heads": [12]}', JSON, 422),
    "huge head index": (b'{"text": "hi", "heads": [' + b"9" * 4000 + b"]}", JSON, 422),
    "integer too long to parse": (b'{"text": "hi", "heads": [' + b"9" * 5000 + b"]}", JSON, 400),
    "huge repeated layer list": (json.dumps({"text": "hi", "format": "u8", "layers": [0] * 200_000}).encode(), JSON, 422),
    "huge head list": (json.dumps({"text": "hi", "heads": list(range(100_000))}).encode(), JSON, 422),
    "unknown field": (b'{"text": "hi", "temperature": 2}', JSON, 422),
    "unknown nested field": (b'{"text": "hi", "options": {"x": 1}}', JSON, 422),
    "unknown format": (b'{"text": "hi", "format": "pickle"}', JSON, 422),
    "truncate as a number": (b'{"text": "hi", "truncate": 0}', JSON, 422),
    "blank text": (b'{"text": " \\n\\t "}', JSON, 422),
    "null text": (b'{"text": null}', JSON, 422),
    "deeply nested": (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON, 400),
}


@pytest.mark.parametrize("body,headers,status", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_hostile_body_is_a_4xx_json_error(client, body, headers, status):
    err = assert_json_error(client.post(ATTENTION, content=body, headers=headers), status)
    assert len(err["message"]) < 2000


@pytest.mark.parametrize("name, why", [
    ("integer too long to parse", "Exceeds the limit (4300 digits) for integer string conversion"),
    ("deeply nested", ": the JSON is nested too deeply to read"),  # not Python's "maximum recursion depth exceeded"
    ("invalid utf-8", ": the body is not UTF-8 (byte 0xc3 at offset 13): send JSON encoded as UTF-8"),  # not the codec's words
])
def test_a_body_that_cannot_be_parsed_says_why(client, name, why):
    # FastAPI's own words were "There was an error parsing the body", and no more.
    body, headers, _ = HOSTILE_BODIES[name]
    message = assert_json_error(client.post(ATTENTION, content=body, headers=headers), 400)["message"]
    assert message.startswith("There was an error parsing the body: ") and why in message, message


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
@pytest.mark.parametrize("route", [ATTENTION, "/api/v1/views", "/api/v1/generate"])
def test_a_body_in_another_unicode_encoding_is_refused_as_json_must_be_utf8(client, route, encoding):
    """json.loads (FastAPI's parser) read UTF-16 and UTF-32 bodies, and they were answered."""
    fields = {"layer": 0, "head": 0} if route.endswith("views") else {}
    raw = json.dumps({"text": "The bank.", "model": "minilm", **fields}).encode(encoding)
    message = assert_json_error(client.post(route, content=raw, headers=JSON), 400)["message"]
    assert message == "the body is not valid JSON: JSON is UTF-8, and these bytes are UTF-16 or UTF-32", message


@pytest.mark.parametrize(
    "body",
    [
        {"texts": []},
        {"texts": ["ok", " "]},
        {"texts": ["ok"] * 1000},
        {"texts": "not a list"},
        {"texts": ["ok"], "layers": [0, 0]},
        {"texts": ["ok"], "heads": [99]},
        {"texts": ["ok"], "unknown": True},
    ],
    ids=["empty", "blank item", "too many", "not a list", "repeated layer", "bad head", "unknown field"],
)
def test_hostile_batch_is_a_4xx_json_error(client, body):
    assert_json_error(client.post(f"{ATTENTION}/batch", json=body), 422)


def test_a_lone_surrogate_in_a_batch_is_a_422(client):
    # `texts` items were plain str, which pydantic does not check for valid Unicode: a 500 from the tokenizer.
    for body, where in ((b'{"texts": ["ok", "a\\ud800b"]}', "texts.1"), (b'{"texts": ["a\xed\xa0\x80b"]}', "texts.0")):
        err = assert_json_error(client.post(f"{ATTENTION}/batch", content=body, headers=JSON), 422)
        assert err["message"].startswith(where), err


RUN_IDS = [
    "..%2F..%2F..%2Fetc%2Fpasswd",
    "..",
    "%2e%2e",
    "%2Fetc%2Fpasswd",
    "..%5C..%5Cwindows",
    "a%00b",
    "x" * 5000,
    "%F0%9F%99%82",
    "00000000000000000000000000000000",
]


@pytest.mark.parametrize("run_id", RUN_IDS, ids=range(len(RUN_IDS)))
def test_path_tricks_in_run_ids_find_nothing(server, run_id):
    # A raw request line: HTTP clients would resolve the dot segments before sending.
    head = f"GET /api/v1/runs/{run_id}/attention?format=u8 HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    status, headers, body, _ = send_until_answered(server, head, iter(()), 0)
    assert body_error(status, headers, body, 404)["code"] in ("unknown_run", "not_found")


def test_model_ids_never_load_anything(server, client, monkeypatch, minilm_dir):
    """Models come only from server settings: even a path to a real, loadable model folder, a
    spec the loader understands, or a built-in not configured here is just an unknown id."""
    import manyeyes.app.services.registry as registry_module

    loads = []
    monkeypatch.setattr(registry_module, "load", lambda *a, **k: loads.append(a) or pytest.fail("load() called"))
    tricks = [
        str(minilm_dir),
        f"{minilm_dir}/../{minilm_dir.name}",
        "../minilm",
        "minilm/../minilm",
        "/etc/passwd",
        "gpt.pth?config=gpt2-small",
        "tiny-gpt",
        "MINILM",
        "minilm\x00",
        "file:///etc/passwd",
    ]
    for model in tricks:
        for path, body in ((ATTENTION, {"text": "hi", "model": model}), (f"{ATTENTION}/batch", {"texts": ["hi"], "model": model})):
            err = assert_json_error(client.post(path, json=body), 404)
            assert err["code"] == "unknown_model"
    assert loads == []
    assert [m["id"] for m in client.get("/api/v1/models").json()["models"]] == ["minilm"]
