"""What the queue's metrics say (review h48b): a request whose time budget ran out is counted as
expired, not as a client that hung up; and the queue's fill is readable as admission judges it
(manyeyes_queue_depth read 0 while every new request got 429 queue_full)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from manyeyes.app.services.batcher import Batcher
from manyeyes.app.services.errors import OverBudget, QueueFull
from manyeyes.app.services.metrics import Metrics
from tests.reliability.conftest import assert_json_error, live_server, wait_until
from tests.reliability.test_admission import without_its_thread
from tests.reliability.test_overload import ATTENTION, SENTENCES, burst, hang_up, open_request

MODEL = SimpleNamespace(info=SimpleNamespace(n_layers=6, n_heads=12, id="fake"))


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def batcher():
    b = without_its_thread(Batcher("cpu", Metrics(), max_batch_tokens=8192, max_batch_items=2, max_wait_s=0, max_queue=5))
    yield b
    b.close()


def test_expired_answers_count_as_expired_and_a_cancelled_one_as_cancelled(batcher):
    metrics = batcher.metrics

    async def scenario():
        batcher.admit(4, "a")
        futures = batcher.submit(MODEL, [[0] * 8] * 4, time.monotonic() + 60, "a")
        taken = batcher._next_batch()  # two go into a forward (not run yet), two wait
        futures[2].cancel()  # its client hung up
        await asyncio.sleep(0)  # the done callbacks run
        batcher.expire(futures, "out of time")  # the request's deadline: the rest fail with a 504
        batcher._run(taken)  # the worker finds the taken two expired: not run, counted
        return futures, taken

    futures, taken = asyncio.run(scenario())
    assert len(taken) == 2 and futures[2].cancelled()
    for future in (futures[0], futures[1], futures[3]):
        assert isinstance(future.exception(), OverBudget) and str(future.exception()) == "out of time"
    assert sample(metrics, "manyeyes_dropped_total", reason="cancelled") == 1
    assert sample(metrics, "manyeyes_dropped_total", reason="expired") == 3
    assert (batcher._admitted, batcher._running, batcher._n_pending) == (0, 0, 0)
    assert sample(metrics, "manyeyes_queue_depth") == 0
    assert sample(metrics, "manyeyes_queue_admitted", device="cpu") == 0


def test_the_admitted_gauge_counts_what_admission_compares_against_the_limit(batcher):
    metrics = batcher.metrics
    admitted = lambda: sample(metrics, "manyeyes_queue_admitted", device="cpu")  # noqa: E731
    assert sample(metrics, "manyeyes_queue_limit", device="cpu") == 5

    async def scenario():
        batcher.admit(3, "a")  # being tokenized
        assert (admitted(), sample(metrics, "manyeyes_queue_depth")) == (3, 0)
        futures = batcher.submit(MODEL, [[0] * 8] * 3, time.monotonic() + 60, "a")
        assert (admitted(), sample(metrics, "manyeyes_queue_depth")) == (3, 3)
        taken = batcher._next_batch()  # two in the forward
        assert (admitted(), sample(metrics, "manyeyes_queue_depth")) == (3, 1)
        batcher.admit(2, "b")
        assert admitted() == 5
        with pytest.raises(QueueFull) as refused:
            batcher.admit(1, "c")
        assert "(5 waiting, room for 5)" in str(refused.value)
        batcher.release(2, "b")
        for job in taken:
            batcher._settle(job)
        assert admitted() == 1
        futures[2].cancel()
        await asyncio.sleep(0)
        assert (admitted(), sample(metrics, "manyeyes_queue_depth")) == (0, 0)

    asyncio.run(scenario())
    # Units: inputs, as queue_full counts them.
    assert sample(metrics, "manyeyes_dropped_total", reason="queue_full") == 1


def test_504s_for_the_time_spent_in_the_queue_count_as_expired_not_cancelled():
    """repro_expired.sh: 26 x 504 from clients that never hung up were 24 cancelled, 0 expired."""
    budget, delay = 1.0, 3.0
    with live_server(request_timeout_s=budget, debug_forward_delay_s=delay, max_batch_items=1) as server:
        replies = [r for r, _ in asyncio.run(burst(server.url, SENTENCES[:4]))]  # one runs, three wait
        for r in replies:
            assert assert_json_error(r, 504)["code"] == "timeout"
        assert server.metric("manyeyes_dropped_total", reason="expired") == 3  # the one running is not dropped work
        assert server.metric("manyeyes_dropped_total", reason="cancelled") == 0
        assert server.metric("manyeyes_queue_depth") == 0


def test_a_request_whose_time_runs_out_waiting_for_its_answers_bytes_counts_as_expired():
    with live_server(request_timeout_s=1.0, cache_bytes=0) as server:
        answers = server.app.state.service.answers
        hog = answers.try_take(answers.limit, "hog")  # every byte held, as by answers going out (server idle)
        try:
            r = httpx.post(f"{server.url}{ATTENTION}", json={"text": SENTENCES[0]}, timeout=30)
        finally:
            hog.release()
        assert assert_json_error(r, 504)["code"] == "timeout" and "hold the memory" in r.json()["error"]["message"]
        assert server.metric("manyeyes_dropped_total", reason="expired") == 1
        assert server.metric("manyeyes_dropped_total", reason="cancelled") == 0
        assert server.metric("manyeyes_queue_admitted", device="cpu") == 0


def test_a_hang_up_while_queued_still_counts_as_cancelled():
    with live_server(max_queue=8, debug_forward_delay_s=2.0, request_timeout_s=60, max_batch_items=1) as server:
        running = open_request(server.port, {"text": SENTENCES[0]})
        wait_until(lambda: server.batcher._running == 1, 30, "the first request to start its forward")
        queued = open_request(server.port, {"text": SENTENCES[1]})
        wait_until(lambda: server.metric("manyeyes_queue_depth") == 1, 30, "one request to queue")
        hang_up(queued)
        wait_until(lambda: server.metric("manyeyes_dropped_total", reason="cancelled") == 1, 30, "a cancel")
        assert server.metric("manyeyes_dropped_total", reason="expired") == 0
        hang_up(running)


def test_the_queue_reads_full_when_admission_says_it_is():
    """repro_queue_depth.sh: manyeyes_queue_depth read 0.0 for 5 s while 5 of 5 new requests got
    429 "the queue is full (8 waiting, room for 8)": the inputs were in the running forward."""
    with live_server(max_queue=2, debug_forward_delay_s=3.0, request_timeout_s=60, max_batch_items=2) as server:
        batcher = server.batcher
        held = [open_request(server.port, {"text": text}) for text in SENTENCES[:2]]
        try:
            # Both in one forward, or (the second came after the first's forward began) one waiting.
            wait_until(lambda: batcher._running >= 1 and batcher._running + batcher._n_pending == 2, 30,
                       "a forward running and both requests in")
            assert server.metric("manyeyes_queue_depth") == batcher._n_pending < 2  # not full, by this gauge
            assert server.metric("manyeyes_queue_admitted", device="cpu") == 2
            assert server.metric("manyeyes_queue_limit", device="cpu") == 2
            r = httpx.post(f"{server.url}{ATTENTION}", json={"text": SENTENCES[2]}, timeout=30)
            assert assert_json_error(r, 429)["code"] == "queue_full" and "(2 waiting, room for 2)" in r.json()["error"]["message"]
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
            assert "# HELP manyeyes_queue_admitted Inputs" in text and "MANYEYES_MAX_QUEUE" in text
        finally:
            for sock in held:
                sock.close()
        wait_until(lambda: server.metric("manyeyes_queue_admitted", device="cpu") == 0, 30, "the queue to empty")
