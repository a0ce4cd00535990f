"""GET /api/v1/runs/{run_id}/attention (a slice of a cached run) under clients that misbehave, as
tests/api/test_long_tiles_hostile.py does for the tile routes: slices queued on runs that are then
evicted, and clients that hang up while their slices wait.

One render slot, held by a gate inside the rendering (on its worker thread), so what waits behind it
is deterministic rather than a matter of timing. The app runs in-process (TestClient's event loop); a
client that hangs up is a raw ASGI request whose `receive` says `http.disconnect` when told to.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest

from manyeyes.app.config import Settings
from tests.api.conftest import serve
from tests.reliability.conftest import wait_until

# 109 tiny-gpt tokens: its 2 layers x 8 heads of weights are 190,096 cells, over INLINE_CELLS, so a
# whole slice waits for a render slot; one head of one layer (11,881 cells) renders on the loop.
WORDS = 20
WHOLE = {"format": "json"}
SMALL = {"layers": "0", "heads": "0", "format": "json"}


def text_of(seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(WORDS))


@pytest.fixture
def app():
    # Room for about three runs (each about 0.8 MB), so a few more posts evict one.
    client = serve(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False, max_concurrent_renders=1,
                            cache_bytes=4_000_000, max_wait_ms=1))
    yield client
    client.__exit__(None, None, None)


@pytest.fixture
def gate(app, monkeypatch):
    """Renders on a worker thread (never the inline ones, on the loop) wait at the gate until it
    opens; `entered` counts those that started."""
    yield from gated(app, monkeypatch)


def gated(app, monkeypatch):
    service = app.app.state.service
    opened, entered = threading.Event(), []
    real = service._render

    def gated(*args, **kwargs):
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a worker thread
            entered.append(args[1][0].run_id)
            assert opened.wait(60), "the gate was never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "_render", gated)
    yield opened, entered
    opened.set()


def post(client, text: str) -> str:
    """The run keeps every head; the answer is one head's (small: rendered on the loop, past the gate)."""
    r = client.post("/api/v1/attention", json={"text": text, "model": "tiny-gpt", "layers": [0], "heads": [0]})
    assert r.status_code == 200, r.text
    answers[r.json()["run_id"]] = np.asarray(r.json()["attention"]["data"], dtype=np.float32)[0, 0]
    return r.json()["run_id"]


answers: dict[str, np.ndarray] = {}  # run id -> layer 0, head 0 of its weights, as POST answered them


def waiting(client) -> int:
    """Requests queued for a render slot."""
    return sum(len(queue) for queue in client.app.state.service.renders._waiting.values())


def in_loop(client, fn, *args):
    async def call():
        return fn(*args)

    return client.portal.call(call)


def settle(client, turns: int = 20) -> None:
    """Lets the server's event loop run everything that is ready (no wall-clock wait)."""

    async def turn():
        for _ in range(turns):
            await asyncio.sleep(0)

    client.portal.call(turn)


class RawSlice:
    """A slice request sent straight to the app, which hangs up when told to. `peer` is the
    client's address (its identity for fair shares); `route` and `query` ask for another route."""

    def __init__(self, client, run_id: str, peer: str = "127.0.0.1", route: str = "attention",
                 query: bytes = b"format=json") -> None:
        self.client, self.messages = client, []
        self.gone = client.portal.call(asyncio.Event)
        self.done = client.portal.start_task_soon(self._run, run_id, peer, route, query)

    async def _run(self, run_id: str, peer: str, route: str, query: bytes) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": f"/api/v1/runs/{run_id}/{route}", "raw_path": f"/api/v1/runs/{run_id}/{route}".encode(),
            "query_string": query, "root_path": "", "headers": [(b"host", b"testserver")],
            "client": (peer, 50000), "server": ("testserver", 80), "state": {},
        }
        asked = False

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            self.messages.append(message)

        await self.client.app(scope, receive, send)

    def hang_up(self) -> None:
        self.client.portal.call(self.gone.set)

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.messages if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    @property
    def headers(self) -> dict[str, str]:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return {k.decode().lower(): v.decode() for k, v in starts[0]["headers"]} if starts else {}

    def json(self) -> dict:
        return orjson.loads(b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"))


def evict(client, run_id: str, seed: int = 2) -> int:
    """Posts new texts until run_id leaves the LRU (cache.get would keep it the newest); returns
    the next unused seed."""
    cache = client.app.state.service.cache
    while run_id in cache._runs:
        post(client, text_of(seed))
        seed += 1
        assert seed < 50, "the run was never evicted"
    return seed


def queue_behind_a_held_slice(app, pool, entered):
    """One slice rendering (held at the gate), then another, on a second run, waiting for the slot.
    Returns the two run ids and the two requests' futures."""
    holder = post(app, text_of(0))
    running = pool.submit(app.get, f"/api/v1/runs/{holder}/attention", params=WHOLE)
    wait_until(lambda: len(entered) == 1, 30, "the first slice to take the render slot")
    victim = post(app, text_of(1))
    queued = pool.submit(app.get, f"/api/v1/runs/{victim}/attention", params=WHOLE)
    wait_until(lambda: waiting(app) == 1, 30, "the victim's slice to wait for the slot")
    return holder, running, victim, queued


def test_a_slice_waiting_for_its_turn_does_not_keep_an_evicted_run_alive(app, gate):
    """A slice that waited for a render slot held its run (through the Item it would render), so
    every evicted run with a slice queued on it stayed alive outside the cache's byte bound. It now
    holds the run's id and reads the run once it has the slot: evicted meanwhile, it answers 404."""
    opened, entered = gate
    cache = app.app.state.service.cache
    with ThreadPoolExecutor(2) as pool:
        holder, running, victim, queued = queue_behind_a_held_slice(app, pool, entered)
        kept = weakref.ref(cache.get(victim).attention)
        seed = evict(app, victim)
        gc.collect()
        assert kept() is None, "an evicted run stayed alive for the slice waiting on it"
        # While the slot is taken, a small slice still answers at once: it renders on the loop.
        latest = post(app, text_of(seed))
        small = app.get(f"/api/v1/runs/{latest}/attention", params=SMALL)
        assert small.status_code == 200, small.text
        assert np.array_equal(np.asarray(small.json()["attention"]["data"], dtype=np.float32)[0, 0], answers[latest])
        assert waiting(app) == 1 and entered == [holder]
        opened.set()
        whole = running.result()  # its run was read before the wait: evicted since, it is still answered
        assert whole.status_code == 200, whole.text
        weights = np.asarray(whole.json()["attention"]["data"], dtype=np.float32)
        assert weights.shape[:2] == (2, 8) and np.array_equal(weights[0, 0], answers[holder])
        assert np.allclose(weights.sum(-1), 1, atol=1e-5)
        r = queued.result()
    assert r.status_code == 404 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["code"] == "unknown_run" and "evicted" in error["message"] and victim in error["message"]
    assert entered == [holder]  # the evicted run's slice was never rendered


def test_a_run_recomputed_while_its_slice_waited_is_the_one_answered(app, gate):
    """The same id is the same text: a run evicted and posted again meanwhile serves the slice."""
    opened, entered = gate
    with ThreadPoolExecutor(2) as pool:
        holder, running, victim, queued = queue_behind_a_held_slice(app, pool, entered)
        evict(app, victim)
        again = app.post("/api/v1/attention", json={"text": text_of(1), "model": "tiny-gpt", "layers": [1], "heads": [5]})
        assert again.status_code == 200 and again.json()["run_id"] == victim
        opened.set()
        assert running.result().status_code == 200
        r = queued.result()
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["attention"]["data"], dtype=np.float32)
    assert np.array_equal(got[1, 5], np.asarray(again.json()["attention"]["data"], dtype=np.float32)[0, 0])
    assert entered == [holder, victim]


def test_slices_whose_clients_hung_up_leave_the_queue_and_are_not_rendered(app, gate):
    """A slice waiting for a render slot was not watched for a hang-up: it stayed queued and was
    rendered once its turn came, for nobody. Now it leaves the queue at once, answered 499."""
    opened, entered = gate
    with ThreadPoolExecutor(1) as pool:
        run_id = post(app, text_of(0))
        running = pool.submit(app.get, f"/api/v1/runs/{run_id}/attention", params=WHOLE)
        wait_until(lambda: len(entered) == 1, 30, "the first slice to take the render slot")
        abandoned = [RawSlice(app, run_id) for _ in range(3)]
        wait_until(lambda: waiting(app) == 3, 30, "three slices to wait for the slot")
        for request in abandoned:
            request.hang_up()
        for request in abandoned:
            request.done.result(30)
        assert [request.status for request in abandoned] == [499] * 3
        assert waiting(app) == 0 and entered == [run_id]  # out of the queue before the slot was free
        opened.set()
        assert running.result().status_code == 200
    assert app.get(f"/api/v1/runs/{run_id}/attention", params=WHOLE).status_code == 200
    assert len(entered) == 2, f"{len(entered) - 2} abandoned slices were rendered"


def test_a_client_that_hangs_up_mid_render_keeps_its_slot_until_the_render_ends(app, gate):
    """The worker thread of a slice whose client left cannot be stopped: its render slot stays taken
    until it ends, so hanging up and asking again never renders more at once than the slots."""
    opened, entered = gate
    with ThreadPoolExecutor(1) as pool:
        run_id = post(app, text_of(0))
        abandoned = RawSlice(app, run_id)
        wait_until(lambda: len(entered) == 1, 30, "the slice to start rendering")
        later = pool.submit(app.get, f"/api/v1/runs/{run_id}/attention", params=WHOLE)
        wait_until(lambda: waiting(app) == 1, 30, "the next slice to wait for the slot")
        abandoned.hang_up()
        settle(app)  # the hang-up is seen and the abandoned request cancelled
        assert waiting(app) == 1 and len(entered) == 1, "the slot was handed on while the abandoned render ran"
        assert not abandoned.done.done()
        opened.set()
        abandoned.done.result(30)
        assert abandoned.status == 499
        assert later.result().status_code == 200
    assert len(entered) == 2 and in_loop(app, lambda: app.app.state.service.renders.free) == 1


# ---------------------------------------------------------------------------- the render queue's bound
# Tiles, top-k and overviews waiting for a render slot were bounded (429 beyond MANYEYES_MAX_QUEUE, or
# a client's share MANYEYES_MAX_CLIENT_QUEUE); slices too large to render on the loop were not: one
# client could leave any number of them waiting. Both now go through one count (RenderQueue).
SHARE, QUEUE = 2, 4
A, B = "127.0.0.1", "127.0.0.2"  # two clients, told apart by address


@pytest.fixture
def tight():
    client = serve(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False, max_concurrent_renders=1,
                            cache_bytes=4_000_000, max_wait_ms=1, max_queue=QUEUE, max_client_queue=SHARE))
    yield client
    client.__exit__(None, None, None)


@pytest.fixture
def tight_gate(tight, monkeypatch):
    yield from gated(tight, monkeypatch)


def counts(client) -> tuple[int, dict[str, int]]:
    """The render queue's count, in all and per client (read on the server's loop)."""
    queue = client.app.state.service.queued
    return in_loop(client, lambda: (queue.waiting, dict(queue.waiting_of)))


def admitted(client, n: int, what: str) -> None:
    """Waits until n slices wait for the render slot (the slot's own queue, not the count under test)."""
    wait_until(lambda: in_loop(client, waiting, client) == n, 30, what)


def refused(request: RawSlice, queued: int, *words: str) -> None:
    """`request` answered 429 at once (naming `words`), not queued behind the `queued` slices waiting."""
    client = request.client
    wait_until(lambda: request.done.done() or in_loop(client, waiting, client) > queued, 30,
               "the request to be answered or queued")
    assert request.done.done(), "admitted to wait for a render slot beyond the bound, not answered 429"
    assert request.status == 429, request.messages
    assert request.headers["retry-after"] == "1" and request.headers["content-type"] == "application/json"
    error = request.json()["error"]
    assert error["code"] == "queue_full", error
    for word in words:
        assert word in error["message"], (word, error["message"])


def test_large_slices_beyond_a_clients_share_get_429_while_another_clients_are_admitted(tight, tight_gate):
    opened, entered = tight_gate
    run_id = post(tight, text_of(0))
    first = RawSlice(tight, run_id, A)  # renders (held at the gate)
    wait_until(lambda: len(entered) == 1, 30, "the first slice to take the render slot")
    second = RawSlice(tight, run_id, A)  # waits for the slot
    admitted(tight, 1, "client A's second slice to wait")
    over = RawSlice(tight, run_id, A)
    refused(over, 1, "this client", "2 tile requests and slices", "waiting for a render slot", "its share", "full")
    assert counts(tight) == (2, {f"addr:{A}": 2})
    # A small slice renders on the loop: neither counted nor refused, even with the client's share full.
    small = RawSlice(tight, run_id, A, query=b"layers=0&heads=0&format=json")
    small.done.result(30)
    assert small.status == 200 and np.array_equal(np.asarray(small.json()["attention"]["data"], dtype=np.float32)[0, 0],
                                                   answers[run_id])
    # Another client is still admitted, up to the server's queue.
    others = [RawSlice(tight, run_id, B) for _ in range(QUEUE - SHARE)]
    admitted(tight, QUEUE - 1, "client B's slices to wait")
    assert counts(tight) == (QUEUE, {f"addr:{A}": 2, f"addr:{B}": 2}) and waiting(tight) == QUEUE - 1
    # Now the server's queue is full: a third client's slice, and its tile (the same count), get 429.
    full = tight.get(f"/api/v1/runs/{run_id}/attention", params=WHOLE)
    assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
    assert full.json()["error"]["code"] == "queue_full"
    assert f"{QUEUE} tile requests and slices are already waiting for a render slot" in full.json()["error"]["message"]
    assert "server's queue" in full.json()["error"]["message"]
    tile = tight.get(f"/api/v1/runs/{run_id}/tile", params={"layer": 0, "head": 0, "rows": 4, "cols": 4})
    assert tile.status_code == 429 and tile.headers["retry-after"] == "1", tile.text
    assert tight.get(f"/api/v1/runs/{run_id}/attention", params=SMALL).status_code == 200  # inline: still answered
    # Counted by reason for the operator, as the batcher's refusals are.
    registry = tight.app.state.service.metrics.registry
    assert registry.get_sample_value("manyeyes_dropped_total", {"reason": "render_client_share"}) == 1
    assert registry.get_sample_value("manyeyes_dropped_total", {"reason": "render_queue_full"}) == 2
    # A client that hangs up leaves the count at once, and its share has room again.
    second.hang_up()
    second.done.result(30)
    assert second.status == 499
    assert counts(tight) == (QUEUE - 1, {f"addr:{A}": 1, f"addr:{B}": 2})
    again = RawSlice(tight, run_id, A)
    admitted(tight, QUEUE - 1, "client A's next slice to wait")
    opened.set()
    for request in (first, *others, again):
        request.done.result(30)
        assert request.status == 200, request.messages
    assert counts(tight) == (0, {})
    assert len(entered) == 1 + len(others) + 1  # the refused and abandoned slices were never rendered
    assert in_loop(tight, lambda: tight.app.state.service.renders.free) == 1


def test_a_queued_slice_whose_run_is_evicted_answers_404_and_leaves_the_count(tight, tight_gate):
    opened, entered = tight_gate
    holder = post(tight, text_of(0))
    first = RawSlice(tight, holder, A)
    wait_until(lambda: len(entered) == 1, 30, "the first slice to take the render slot")
    victim = post(tight, text_of(1))
    queued = RawSlice(tight, victim, A)
    admitted(tight, 1, "the victim's slice to wait")
    refused(RawSlice(tight, victim, A), 1, "its share")
    seed = evict(tight, victim)
    opened.set()
    first.done.result(30)
    queued.done.result(30)
    assert first.status == 200 and queued.status == 404, queued.messages
    assert queued.json()["error"]["code"] == "unknown_run"
    assert counts(tight) == (0, {}) and entered == [holder]
    # The share is whole again: two more large slices of this client are admitted and answered.
    latest = post(tight, text_of(seed))
    for r in [RawSlice(tight, latest, A) for _ in range(SHARE)]:
        r.done.result(30)
        assert r.status == 200, r.messages
    assert counts(tight) == (0, {})
