"""A Hugging Face Hub on loopback, for huggingface_hub's own client: each repo is a folder served at
one commit (its listing at /api/models/..., its files at /{repo}/resolve/{revision}/{file} with the
headers the client reads), and a repo can misbehave as real Hubs and networks do."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS = (".safetensors", ".bin")  # what the Hub keeps in LFS: named by its SHA-256


@dataclass
class Repo:
    folder: Path
    sha: str
    hang_listing: bool = False  # takes the listing's request and never answers (until the server closes)
    forbidden: set[str] = field(default_factory=set)  # files answered 403 with no error code
    damaged: set[str] = field(default_factory=set)  # files sent with their last bytes flipped, same length


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.closing = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self)

            def do_GET(self) -> None:
                hub.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, folder: Path, **behaviour) -> str:
        sha = hashlib.sha1(repo.encode() + b"".join(p.read_bytes() for p in sorted(folder.iterdir()))).hexdigest()
        self.repos[repo] = Repo(folder, sha, **behaviour)
        return sha

    @staticmethod
    def send(handler, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def answer(self, handler) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        listing = re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+))?", path)
        resolve = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
        repo = self.repos.get(listing[1] if listing else resolve[1] if resolve else "")
        if repo is None:
            return self.send(handler, 404, b'{"error": "Repository not found"}',
                             {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"})
        if listing:
            if repo.hang_listing:
                self.closing.wait(120)
                return None
            siblings = []
            for p in sorted(repo.folder.iterdir()):
                data = p.read_bytes()
                sibling = {"rfilename": p.name, "size": len(data)}
                if p.name.endswith(LFS):
                    sibling["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                siblings.append(sibling)
            body = json.dumps({"id": listing[1], "modelId": listing[1], "sha": repo.sha, "siblings": siblings}).encode()
            return self.send(handler, 200, body, {"Content-Type": "application/json"})
        name = resolve[3]
        if name in repo.forbidden:
            return self.send(handler, 403, b"Forbidden", {"Content-Type": "text/plain"})
        file = repo.folder / name
        if not file.is_file():
            return self.send(handler, 404, b'{"error": "Entry not found"}',
                             {"Content-Type": "application/json", "X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
        data = file.read_bytes()
        lfs = name.endswith(LFS)
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        if name in repo.damaged:
            data = data[:-64] + bytes(b ^ 0xFF for b in data[-64:])
        self.send(handler, 200, data, headers)
