"""The GET routes that compute from a cached run (/mean, /measures, /flow, /neuron,
/logit-attribution) wait their turn as a tile does: in the render queue (429 beyond a client's
share), holding the run's id and not the run, and out of the queue when their client hangs up.

A real server (uvicorn on a loopback port) with one render slot, held by a gate inside the work
that runs in it, so what waits behind it is deterministic rather than a matter of timing. Raw
sockets bound to 127.0.0.x are clients with addresses of their own.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import manyeyes.app.routes.aggregates as aggregates_module
import manyeyes.app.services.measures as measures_module
import manyeyes.app.services.tiles as tiles_module
from manyeyes.app.services.errors import NotReady
from manyeyes.app.services.measures import MeasuresService
from tests.reliability.conftest import HOST, live_server, read_all, wait_until

A, B = "127.0.0.1", "127.0.0.2"
SERVER = dict(models={"tiny-gpt": "tiny-gpt"}, max_concurrent_renders=1)
# Each route's query, and the name its work has at the gate.
ROUTES = {
    "mean": ("mean?format=f16", "mean"),
    "measures": ("measures?names=rollout,value_norms&format=f16", "measures"),
    "neuron": ("neuron?layer=1&head=2&query=5", "neuron"),
    "flow": ("flow?threshold=0.2", "flow"),
    "logit-attribution": ("logit-attribution?position=5&top=4", "logit-attribution"),
}


def text_of(seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(12))  # about 60 tiny-gpt tokens, its own run id


def post(url: str, text: str) -> str:
    r = httpx.post(f"{url}/api/v1/attention", json={"text": text, "model": "tiny-gpt", "format": "u8", "layers": [0],
                                                     "heads": [0]}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["run_id"]


def route_path(run_id: str, route: str, variant: int = 0) -> str:
    """variant: another graph of the flow route (its threshold): requests for one graph at once
    wait for the one making it, not in the queue."""
    path = ROUTES[route][0]
    if route == "flow" and variant:
        path = f"flow?threshold={0.2 + variant / 100:.2f}"
    return f"/api/v1/runs/{run_id}/{path}"


def get(url: str, path: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", timeout=60)


def tile_path(run_id: str) -> str:
    return f"/api/v1/runs/{run_id}/tile?layer=0&head=0&rows=4&cols=4"


@pytest.fixture
def gate(monkeypatch):
    """The work each route does in its render slot waits at the gate (on its worker thread) until it
    opens; `entered` names the work that started, in order."""
    opened, entered = threading.Event(), []

    def gated(name: str, real):
        def waiting(*args, **kwargs):
            entered.append(name)
            assert opened.wait(60), "the gate was never opened"
            return real(*args, **kwargs)

        return waiting

    monkeypatch.setattr(tiles_module, "pooled", gated("tile", tiles_module.pooled))
    monkeypatch.setattr(aggregates_module, "render_result", gated("mean", aggregates_module.render_result))
    monkeypatch.setattr(MeasuresService, "_matrices", gated("measures", MeasuresService._matrices))
    for name, function in (("neuron", "neuron_view"), ("flow", "flow_edges"), ("logit-attribution", "attribute_logit")):
        monkeypatch.setattr(measures_module.m, function, gated(name, getattr(measures_module.m, function)))
    yield opened, entered
    opened.set()


class Raw:
    """A GET (a POST of `body`) sent on a raw socket from `address`, so the test can hang up at will."""

    def __init__(self, port: int, path: str, address: str = A, body: dict | None = None) -> None:
        self.sock = socket.socket()
        self.sock.settimeout(60)
        self.sock.bind((address, 0))
        self.sock.connect((HOST, port))
        head = f"{'GET' if body is None else 'POST'} {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
        content = b"" if body is None else json.dumps(body).encode()
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n"
        self.sock.sendall(f"{head}\r\n".encode() + content)

    def status(self) -> int:
        said = read_all(self.sock)
        self.sock.close()
        return int(said.split(b" ", 2)[1])

    def hang_up(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        self.sock.close()


def hold_the_slot(server, pool, gate) -> str:
    """A tile of a run of its own takes the one render slot and stays at the gate."""
    entered = gate[1]
    holder = post(server.url, text_of(0))
    running = pool.submit(get, server.url, tile_path(holder))
    wait_until(lambda: entered == ["tile"], 30, "the first tile to take the render slot")
    return running


def idle(server) -> None:
    service = server.app.state.service
    wait_until(lambda: service.queued.waiting == 0 and service.answers.held == 0, 30, "the queue and the bytes to be free")
    assert server.metric("manyeyes_answer_bytes") == 0
    assert server.metric("manyeyes_work_running", kind="capture") == server.metric("manyeyes_work_running", kind="flow") == 0


@pytest.mark.parametrize("route", ["mean", "measures", "neuron"])
def test_a_request_waiting_for_its_turn_does_not_keep_an_evicted_run_alive(gate, route):
    """/mean and /measures held their run while they waited for bytes and a slot: 30 of them on runs
    the cache then evicted held 500 MB beyond a 72 MiB cache. Now they hold its id; a run evicted
    meanwhile is freed, and the request answers 404 when its turn comes, its work never done."""
    opened, entered = gate
    with live_server(**SERVER, cache_bytes=1_000_000) as server, ThreadPoolExecutor(2) as pool:
        service = server.app.state.service
        running = hold_the_slot(server, pool, gate)
        victim = post(server.url, text_of(1))
        waiting = pool.submit(get, server.url, route_path(victim, route))
        wait_until(lambda: service.renders._waiting or len(entered) > 1, 30, "the request to wait for the render slot")
        kept = weakref.ref(service.cache.get(victim))
        nbytes = httpx.get(f"{server.url}/api/v1/runs/{victim}").json()["nbytes"]
        for seed in range(2, 3 + service.cache.max_bytes // nbytes):  # push it out of the LRU
            post(server.url, text_of(seed))
        assert httpx.get(f"{server.url}/api/v1/runs/{victim}").status_code == 404
        gc.collect()
        assert kept() is None, f"an evicted run stayed alive for the {route} request waiting on it"
        opened.set()
        assert running.result().status_code == 200
        r = waiting.result()
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert error["code"] == "unknown_run" and "evicted from the cache while this request waited" in error["message"]
        assert entered == ["tile"], "the evicted run's work was done"
        idle(server)


@pytest.mark.parametrize("route", list(ROUTES))
def test_requests_whose_clients_hung_up_leave_the_queue_and_are_not_computed(gate, route):
    """Abandoned requests waited on, then were computed and encoded for nobody (each a 200 with
    `"complete": false`), in render slots and bytes that other clients needed."""
    opened, entered = gate
    with live_server(**SERVER) as server, ThreadPoolExecutor(1) as pool:
        service = server.app.state.service
        running = hold_the_slot(server, pool, gate)
        run_id = post(server.url, text_of(1))
        abandoned = [Raw(server.port, route_path(run_id, route, i)) for i in range(5)]
        wait_until(lambda: service.queued.waiting == 6, 30, "five requests to wait for the slot")
        for request in abandoned:
            request.hang_up()
        # Out of the queue (and of the 429 count) as soon as the server notices, not when the slot frees.
        wait_until(lambda: service.queued.waiting == 1, 30, "the abandoned requests to leave the queue")
        opened.set()
        assert running.result().status_code == 200
        assert get(server.url, route_path(run_id, route)).status_code == 200
        assert entered == ["tile", ROUTES[route][1]], f"{len(entered) - 2} abandoned requests were computed"
        assert server.metric("manyeyes_requests_total", route=f"/api/v1/runs/{{run_id}}/{route}", status="499") == 5
        idle(server)


def test_a_post_whose_client_hangs_up_while_its_measures_wait_for_a_slot_is_not_computed(gate):
    """POST /attention's `measures` waited for a render slot after the forward, then were computed
    for a client long gone."""
    opened, entered = gate
    with live_server(**SERVER) as server, ThreadPoolExecutor(1) as pool:
        service = server.app.state.service
        running = hold_the_slot(server, pool, gate)
        body = {"text": text_of(1), "model": "tiny-gpt", "format": "u8", "layers": [0], "heads": [0],
                "measures": ["rollout", "value_norms"]}
        abandoned = Raw(server.port, "/api/v1/attention", body=body)
        wait_until(lambda: service.renders._waiting, 30, "the measures to wait for the render slot")
        abandoned.hang_up()
        wait_until(lambda: not service.renders._waiting, 30, "the abandoned measures to stop waiting")
        opened.set()
        assert running.result().status_code == 200
        assert entered == ["tile"], "the abandoned request's measures were computed"
        assert server.metric("manyeyes_requests_total", route="/api/v1/attention", status="499") == 1
        idle(server)


def test_a_flow_graph_too_large_to_keep_is_made_once_for_the_requests_waiting_on_it(gate, monkeypatch):
    """A graph larger than FLOW_CACHE_BYTES is not kept: each request that waited for its making
    made it again, one after another."""
    opened, entered = gate
    monkeypatch.setattr(measures_module, "FLOW_CACHE_BYTES", 0)
    waiting, outlived = [], measures_module.outlived

    async def counted(making):
        waiting.append(making)
        await outlived(making)

    monkeypatch.setattr(measures_module, "outlived", counted)
    with live_server(**SERVER) as server, ThreadPoolExecutor(4) as pool:
        service, reserved = server.app.state.service, []
        reserve = service.reserve

        async def recorded(nbytes, *args, **kwargs):
            reserved.append(nbytes)
            return await reserve(nbytes, *args, **kwargs)

        monkeypatch.setattr(service, "reserve", recorded)
        path = route_path(post(server.url, text_of(1)), "flow")
        first = pool.submit(get, server.url, path)
        wait_until(lambda: entered == ["flow"], 30, "the first request to make the graph")
        others = [pool.submit(get, server.url, path) for _ in range(3)]
        wait_until(lambda: len(waiting) == 3, 30, "three more requests to wait for it")
        opened.set()
        answers = [request.result() for request in [first, *others]]
        assert [r.status_code for r in answers] == [200] * 4 and len({r.content for r in answers}) == 1
        assert entered == ["flow"], "a waiter made the graph again"
        # Each answer held its bytes in the answers' budget until sent, the handed-over ones too.
        assert reserved.count(len(answers[0].content)) == 3, reserved
        assert get(server.url, path).status_code == 200 and entered == ["flow", "flow"]  # and it was not kept
        idle(server)


def test_a_clients_requests_beyond_its_share_of_the_queue_get_429_and_another_client_still_waits(gate):
    opened, entered = gate
    with live_server(**SERVER, max_queue=8, max_client_queue=2) as server, ThreadPoolExecutor(2) as pool:
        service = server.app.state.service
        running = hold_the_slot(server, pool, gate)  # client A's first place in the queue
        run_id = post(server.url, text_of(1))
        second = pool.submit(get, server.url, route_path(run_id, "mean"))  # its second
        wait_until(lambda: service.queued.waiting == 2, 30, "client A's /mean to wait")
        for route in ["neuron", "flow", "logit-attribution", "measures", "mean"]:
            r = httpx.get(f"{server.url}{route_path(run_id, route)}", timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "1", (route, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert error["code"] == "queue_full" and "its share" in error["message"], (route, error)
        other = Raw(server.port, route_path(run_id, "neuron"), B)  # another client is still admitted
        wait_until(lambda: service.queued.waiting == 3, 30, "client B's /neuron to wait")
        opened.set()
        assert running.result().status_code == second.result().status_code == other.status() == 200
        assert entered == ["tile", "mean", "neuron"]
        assert server.metric("manyeyes_dropped_total", reason="render_client_share") == 5
        idle(server)


def test_one_clients_flood_of_neuron_requests_delays_anothers_tile_by_one_turn_at_most(gate):
    """The views took a thread of the pool each, at once, with no slot and no turn: 80 /neuron
    requests of one client held another client's POST up from 0.3 s to 7.6 s. They now take turns
    with every other client's work in the render slots."""
    opened, entered = gate
    with live_server(**SERVER) as server, ThreadPoolExecutor(9) as pool:
        service = server.app.state.service
        run_id = post(server.url, text_of(0))
        first = pool.submit(get, server.url, route_path(run_id, "neuron"))
        wait_until(lambda: entered == ["neuron"], 30, "client A's first /neuron to take the render slot")
        flood = [Raw(server.port, f"/api/v1/runs/{run_id}/neuron?layer=0&head=0&query={q}") for q in range(8)]
        wait_until(lambda: service.queued.waiting == 9 or len(entered) > 1, 30, "client A's flood to wait its turn")
        tile = Raw(server.port, tile_path(run_id), B)
        wait_until(lambda: service.queued.waiting == 10, 30, "client B's tile to wait")
        opened.set()
        statuses = list(pool.map(Raw.status, [*flood, tile]))
        assert first.result().status_code == 200 and statuses == [200] * 9
        # A turn each: one more of A's (at the front of the rotation, as it waited first), then B's
        # tile, ahead of A's other seven.
        assert entered[:3] == ["neuron", "neuron", "tile"], entered
        idle(server)


def test_requests_waiting_on_one_runs_capture_hold_no_thread_of_the_pool(monkeypatch):
    """Requests for a run whose captured forward was being made each blocked a pool thread on a lock
    until it was: with 40 of them, nothing else could run on the pool (long texts' tokenizing,
    large answers' encoding). They now wait their turn, and the one in a slot waits on the event
    loop; the capture is still made once for all of them."""
    opened, captures = threading.Event(), []
    real = measures_module.m.capture_stream

    def gated(*args):
        captures.append(1)
        assert opened.wait(60), "the gate was never opened"
        return real(*args)

    monkeypatch.setattr(measures_module.m, "capture_stream", gated)
    arrived = []
    real_neuron = MeasuresService.neuron

    async def counted(self, *args):
        arrived.append(1)
        return await real_neuron(self, *args)

    monkeypatch.setattr(MeasuresService, "neuron", counted)
    with live_server(models={"tiny-gpt": "tiny-gpt"}) as server, ThreadPoolExecutor(45) as pool:
        run_id = post(server.url, text_of(0))
        waiting = [Raw(server.port, f"/api/v1/runs/{run_id}/neuron?layer=1&head=3&query={q % 60}") for q in range(45)]
        wait_until(lambda: len(arrived) == 45 and captures, 30, "every request to reach the service")
        try:
            # Over 2,000 characters: tokenized on the pool.
            r = httpx.post(f"{server.url}/api/v1/attention", json={"text": "lorem ipsum dolor " * 150, "truncate": True,
                                                                   "model": "tiny-gpt", "format": "u8", "layers": [0],
                                                                   "heads": [0]}, timeout=15)
            assert r.status_code == 200, r.text
        finally:
            opened.set()
        assert list(pool.map(Raw.status, waiting)) == [200] * 45
        assert len(captures) == 1 and server.app.state.measures._capturing == {}
        idle(server)


def test_a_batch_whose_input_fails_leaves_none_of_its_other_inputs_queued(monkeypatch):
    """gather left the other inputs' futures pending when one failed: they stayed queued, in their
    client's share, and were run for nobody."""
    with live_server(models={"tiny-gpt": "tiny-gpt"}, max_batch_items=1) as server:
        opened, forwards = threading.Event(), []
        real = server.model.run

        def failing_first(*args, **kwargs):
            forwards.append(1)
            if len(forwards) == 1:
                raise NotReady("this forward failed")
            assert opened.wait(60), "the gate was never opened"
            return real(*args, **kwargs)

        monkeypatch.setattr(server.model, "run", failing_first)
        try:
            r = httpx.post(f"{server.url}/api/v1/attention/batch",
                           json={"texts": [text_of(seed) for seed in range(3)], "model": "tiny-gpt"}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["message"] == "this forward failed", r.text
            # The second input is in the forward (held at the gate); the third must not wait behind it.
            wait_until(lambda: server.metric("manyeyes_queue_depth") == 0, 10, "the batch's last input to leave the queue")
            assert server.metric("manyeyes_dropped_total", reason="cancelled") == 1
        finally:
            opened.set()
        wait_until(lambda: server.metric("manyeyes_queue_admitted") == 0, 30, "the forward thread to finish")
        assert len(forwards) == 2, "an input of the failed request was run for nobody"


def test_the_views_bytes_reckoned_cover_what_they_send(monkeypatch):
    """/flow, /neuron and /logit-attribution hold their answer's bytes in the answers' budget until
    sent, as the other GET routes of a cached run do: reckoned before the work, they must cover it."""
    with live_server(models={"tiny-gpt": "tiny-gpt"}) as server:
        service = server.app.state.service
        run_id = post(server.url, text_of(0))
        asked = []
        reserve = service.reserve

        async def recorded(nbytes, *args):
            asked.append(nbytes)
            return await reserve(nbytes, *args)

        monkeypatch.setattr(service, "reserve", recorded)
        for query in ("flow?threshold=0.01", "neuron?layer=1&head=7&query=60", "logit-attribution?position=60&top=4096"):
            r = httpx.get(f"{server.url}/api/v1/runs/{run_id}/{query}", headers={"Accept-Encoding": "identity"}, timeout=60)
            assert r.status_code == 200, r.text
            assert len(asked) == 1 and asked.pop() >= len(r.content), (query, len(r.content))
        idle(server)
