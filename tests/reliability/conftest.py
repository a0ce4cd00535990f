"""A real uvicorn server on a free loopback port, in a thread of the test process, so tests
can speak raw HTTP to it (streamed bodies, dropped connections) and still reach its internals."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from manyeyes.app.config import Settings
from manyeyes.app.main import create_app
from manyeyes.app.server import server_config
from tests.api.conftest import decode  # noqa: F401  (one decoder for every suite)
from tests.servers import HOST, free_port, wait_ready, wait_until  # noqa: F401  (the suites import them from here)


class LiveServer:
    def __init__(self, app, server: uvicorn.Server, port: int) -> None:
        self.app = app
        self.server = server
        self.port = port
        self.url = f"http://{HOST}:{port}"

    @property
    def batcher(self):
        return self.app.state.registry.get(None).batcher

    @property
    def model(self):
        return self.app.state.registry.get(None).model

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total


@contextmanager
def live_server(wait: bool = True, **overrides):
    """Serves only the built-in minilm on the CPU, skipping the warm-up forward (the lifecycle
    tests run the real `manyeyes serve` with it). wait=False: return once it listens, ready or not."""
    settings = Settings(**{"models": {"minilm": "minilm"}, "device": "cpu", "warmup": False, **overrides})
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(server_config(app, settings, host=HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="live-server", daemon=True)
    thread.start()
    try:
        if wait:
            wait_ready(f"http://{HOST}:{port}")
        else:
            wait_until(lambda: server.started, 60, "the server to listen")
        yield LiveServer(app, server, port)
    finally:
        server.should_exit = True
        thread.join(30)


def read_all(sock: socket.socket, pause_every: int = 0, pause_s: float = 0.0) -> bytes:
    """Everything until the server closes, or resets, the connection."""
    said, since_pause = b"", 0
    try:
        while chunk := sock.recv(2**20):
            said += chunk
            since_pause += len(chunk)
            if pause_every and since_pause >= pause_every:
                time.sleep(pause_s)
                since_pause = 0
    except ConnectionResetError:
        pass
    return said


def assert_json_error(response: httpx.Response, status: int) -> dict:
    """A 4xx of ours: the stated status and a JSON body {"error": {"code", "message"}}, beside
    them only the fields the schema names (ErrorDetail: a batch's max_batch_texts)."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    err = response.json()["error"]
    assert {"code", "message"} <= set(err) <= {"code", "message", "max_batch_texts"} and err["code"] and err["message"], err
    return err
