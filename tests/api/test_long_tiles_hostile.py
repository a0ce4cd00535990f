"""The long-run routes (/tile, /topk, /overview) under clients that misbehave: a flood of tile
requests queued on runs that are then evicted, and clients that hang up while their tiles wait.

Each test runs a real server (uvicorn on a loopback port, as tests/reliability does) with one render
slot, and holds that slot with a gate inside the tile computation, so what waits behind it is
deterministic rather than a matter of timing.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import manyeyes.app.services.tiles as tiles_module
from tests.reliability.conftest import HOST, live_server, wait_until


def text_of(seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(12))  # about 60 tiny-gpt tokens, its own run id


@pytest.fixture
def gate(monkeypatch):
    """Tile computations wait at the gate (on their worker thread) until it opens; `entered`
    counts the ones that started."""
    opened, entered = threading.Event(), []
    real = tiles_module.pooled

    def gated(*args, **kwargs):
        entered.append(time.monotonic())
        assert opened.wait(60), "the gate was never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(tiles_module, "pooled", gated)
    yield opened, entered
    opened.set()


def post(url: str, text: str) -> str:
    r = httpx.post(f"{url}/api/v1/attention", json={"text": text, "model": "tiny-gpt", "keep": "qk"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["run_id"]


def get_tile(url: str, run_id: str) -> httpx.Response:
    return httpx.get(f"{url}/api/v1/runs/{run_id}/tile", params={"layer": 0, "head": 0, "rows": 4, "cols": 4}, timeout=60)


def get_cell(url: str, run_id: str) -> httpx.Response:
    return httpx.get(f"{url}/api/v1/runs/{run_id}/cell", params={"query": 5, "key": 2}, timeout=60)


def open_tile(port: int, run_id: str) -> socket.socket:
    """A tile request sent on a raw socket and left waiting, so the test can hang up at will."""
    sock = socket.create_connection((HOST, port), timeout=30)
    sock.sendall(f"GET /api/v1/runs/{run_id}/tile?layer=0&head=1&rows=4&cols=4 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    return sock


def hang_up(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, like a killed client
    sock.close()


SERVER = dict(models={"tiny-gpt": "tiny-gpt"}, dense_max_tokens=8, max_concurrent_renders=1)


@pytest.mark.parametrize("waiting_route", [get_tile, get_cell])
def test_a_tile_request_waiting_for_its_turn_does_not_keep_an_evicted_run_alive(gate, waiting_route):
    """Each waiting request held its run: 150 tile requests queued on 150 runs, each evicted as the
    next was posted, took a server with a 40 MB cache from 449 MB to 1 GB resident. A waiting
    request now holds the run id; a run evicted meanwhile is freed, and its request answers 404.
    So does a waiting /cell (which the page asks at each click on a cell)."""
    opened, entered = gate
    with live_server(**SERVER, cache_bytes=1_000_000) as server, ThreadPoolExecutor(2) as pool:
        tiles, cache = server.app.state.tiles, server.app.state.service.cache
        holder = post(server.url, text_of(0))
        running = pool.submit(get_tile, server.url, holder)
        wait_until(lambda: len(entered) == 1, 30, "the first tile to take the render slot")
        victim = post(server.url, text_of(1))
        waiting = pool.submit(waiting_route, server.url, victim)
        wait_until(lambda: tiles.attention.queued.waiting == 2, 30, "the second tile to wait for the slot")
        kept = weakref.ref(cache.get(victim).kept)
        nbytes = httpx.get(f"{server.url}/api/v1/runs/{victim}").json()["nbytes"]
        for seed in range(2, 3 + cache.max_bytes // nbytes):  # push it out of the LRU
            post(server.url, text_of(seed))
        assert httpx.get(f"{server.url}/api/v1/runs/{victim}").status_code == 404
        gc.collect()
        assert kept() is None, "an evicted run stayed alive for the tile request waiting on it"
        opened.set()
        assert running.result().status_code == 200
        r = waiting.result()
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "unknown_run" and "evicted" in r.json()["error"]["message"]
        assert tiles.attention.queued.waiting == 0 and len(entered) == 1  # the evicted run's tile was never computed


def test_tiles_whose_clients_hung_up_leave_the_queue_and_are_not_computed(gate):
    """40 tiles abandoned by a client that gave up after a second were computed anyway, one after
    another, and that client's next request waited 50 s behind them (tiny-llama, 2,040 tokens)."""
    opened, entered = gate
    with live_server(**SERVER) as server, ThreadPoolExecutor(1) as pool:
        tiles = server.app.state.tiles
        run_id = post(server.url, text_of(0))
        running = pool.submit(get_tile, server.url, run_id)
        wait_until(lambda: len(entered) == 1, 30, "the first tile to take the render slot")
        abandoned = [open_tile(server.port, run_id) for _ in range(5)]
        wait_until(lambda: tiles.attention.queued.waiting == 6, 30, "five tiles to wait for the slot")
        for sock in abandoned:
            hang_up(sock)
        # Out of the queue (and of the 429 count) as soon as the server notices, not when the slot frees.
        wait_until(lambda: tiles.attention.queued.waiting == 1, 30, "the abandoned tiles to leave the queue")
        opened.set()
        assert running.result().status_code == 200
        assert get_tile(server.url, run_id).status_code == 200
        assert len(entered) == 2, f"{len(entered) - 2} abandoned tiles were computed"
        assert server.metric("manyeyes_requests_total", route="/api/v1/runs/{run_id}/tile", status="499") == 5


def test_a_client_that_hangs_up_mid_tile_keeps_its_slot_until_the_work_ends(gate):
    """The worker thread of a tile whose client left cannot be stopped: its render slot stays taken
    until it ends, so hanging up and asking again never runs more tiles at once than the slots."""
    opened, entered = gate
    with live_server(**SERVER) as server, ThreadPoolExecutor(1) as pool:
        tiles = server.app.state.tiles
        run_id = post(server.url, text_of(0))
        sock = open_tile(server.port, run_id)
        wait_until(lambda: len(entered) == 1, 30, "the tile to start computing")
        hang_up(sock)
        time.sleep(0.3)  # the server notices at once; its 499 is logged once the work has ended
        later = pool.submit(get_tile, server.url, run_id)
        wait_until(lambda: tiles.attention.queued.waiting == 2 or len(entered) == 2, 30, "the next tile to wait, or start")
        time.sleep(0.3)
        assert len(entered) == 1, "a second tile started while the abandoned one still computed"
        opened.set()
        assert later.result().status_code == 200
        assert len(entered) == 2 and tiles.attention.queued.waiting == 0
        assert server.metric("manyeyes_requests_total", route="/api/v1/runs/{run_id}/tile", status="499") == 1
