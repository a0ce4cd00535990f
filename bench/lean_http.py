"""The benches' HTTP/1.1 client: one kept-alive connection, requests written as ready bytes,
answers read by Content-Length, compressed bodies decoded. Nothing more.

Why not httpx: a bench measures servers, and on a 2-core machine its client shares the cores with
them. httpx spends about 1 ms more per request than this (on both servers alike, so it squeezes
every ratio towards 1), and 32 httpx clients took 45% of a core, which the server under test
then lacked.
serve_bench still times one form through httpx, so what a client library costs stays in view.
"""

from __future__ import annotations

import asyncio
import gzip
import select
import socket
from dataclasses import dataclass

from urllib.parse import urlsplit

import orjson
import zstandard

HEAD_END = b"\r\n\r\n"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes  # decoded: what Content-Encoding compressed is decompressed
    wire_bytes: int  # the body as it crossed the wire


def split_url(url: str) -> tuple[str, int, str]:
    """http://host:port/path -> (host, port, "/path")."""
    parts = urlsplit(url)
    return parts.hostname, parts.port, parts.path or "/"


def request_bytes(host: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_post(host: str, path: str, payload: dict, headers: dict | None) -> bytes:
    body = orjson.dumps(payload)
    return request_bytes(host, "POST", path, body, {"Content-Type": "application/json", **(headers or {})})


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" not in headers:
        # Every answer these benches read (ours and the reference's) says its length.
        raise ValueError(f"answer without Content-Length: {status_line} {headers}")
    return int(status_line.split(" ", 2)[1]), headers


def decoded(headers: dict[str, str], raw: bytes) -> bytes:
    encoding = headers.get("content-encoding")
    if encoding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    if encoding == "gzip":
        return gzip.decompress(raw)
    if encoding not in (None, "identity"):
        raise ValueError(f"unexpected Content-Encoding {encoding}")
    return raw


class Connection:
    """Blocking: for latency, one request at a time."""

    def __init__(self, url: str, timeout: float = 300):
        host, port, _ = split_url(url)
        self.host, self.address, self.timeout = f"{host}:{port}", (host, port), timeout
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(self.address, timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # C-level buffered reads, as http.client does: a body is read into one bytes object of
        # its final size, with no growing buffer and no extra copy (4.7 MB at T=256).
        self.reader = self.sock.makefile("rb")

    def post_json(self, path: str, payload: dict, headers: dict | None = None) -> Answer:
        # A server closes a connection left idle past its keep-alive (uvicorn: 5 s, and the
        # reference takes 13 s at T=512): readable with nothing to read means closed. httpx's
        # pool makes the same check when it hands out a kept-alive connection.
        if select.select([self.sock], [], [], 0)[0] and not self.sock.recv(1, socket.MSG_PEEK):
            self.close()
            self._connect()
        self.sock.sendall(json_post(self.host, path, payload, headers))
        lines = []
        while (line := self.reader.readline(65537)) not in (b"\r\n", b""):
            lines.append(line)
        if not lines:
            raise ConnectionError("the server closed the connection")
        status, response_headers = parse_head(b"".join(lines).rstrip(b"\r\n"))
        length = int(response_headers["content-length"])
        raw = self.reader.read(length)
        if len(raw) != length:
            raise ConnectionError("the server closed the connection mid-answer")
        return Answer(status, response_headers, decoded(response_headers, raw), length)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncConnection:
    """asyncio streams: for the load test, one per simulated client."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> "AsyncConnection":
        host, port, _ = split_url(url)
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, f"{host}:{port}")

    async def post_json(self, path: str, payload: dict, headers: dict | None = None) -> Answer:
        self.writer.write(json_post(self.host, path, payload, headers))
        head = await self.reader.readuntil(HEAD_END)
        status, response_headers = parse_head(head[: -len(HEAD_END)])
        length = int(response_headers["content-length"])
        raw = await self.reader.readexactly(length)
        return Answer(status, response_headers, decoded(response_headers, raw), length)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass
