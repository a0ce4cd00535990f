"""How the batcher fills a forward: round-robin across clients, within the token and cell budgets."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from manyeyes.app.services.batcher import Batcher, Job, _deliver
from manyeyes.app.services.errors import InvalidInput, QueueFull
from manyeyes.app.services.metrics import Metrics
from tests.reliability.test_admission import without_its_thread

MODEL = SimpleNamespace(info=SimpleNamespace(n_layers=6, n_heads=12, id="fake"))


class Encoded(list):
    pass


def job(client: str, n_tokens: int, tag: str) -> Job:
    j = Job(MODEL, Encoded([0] * n_tokens), time.monotonic() + 60, client)
    j.tag = tag
    return j


@pytest.fixture
def batcher():
    b = without_its_thread(Batcher("cpu", Metrics(), max_batch_tokens=8192, max_batch_items=6, max_wait_s=0, max_queue=100,
                                   max_client_queue=10, max_batch_cells=72 * 512 * 512 * 2))
    yield b
    b.close()


def queue(batcher: Batcher, jobs: list[Job]) -> None:
    batcher._enqueue(jobs)


def test_one_job_per_client_in_turn(batcher):
    queue(batcher, [job("flood", 8, f"f{i}") for i in range(10)] + [job("quiet", 8, "q0")] + [job("other", 8, f"o{i}") for i in range(2)])
    chosen, left_out = batcher._select(MODEL)
    assert [j.tag for j in chosen] == ["f0", "q0", "o0", "f1", "o1", "f2"]
    assert left_out


def test_each_client_leads_a_batch_in_turn_not_the_oldest_job(batcher):
    """Long inputs run a forward each. The oldest job led every batch, so a client's four long
    inputs queued before another's short one all ran first (that one waited 3.4 s for 0.01 s)."""
    long = [job("flood", 2000, f"L{i}") for i in range(4)]
    for j in long:
        j.keep = True
    queue(batcher, long)
    queue(batcher, [job("quiet", 8, "q0"), job("quiet", 8, "q1")])
    queue(batcher, [job("other", 8, "o0")])
    order = [[j.tag for j in batcher._next_batch()] for _ in range(5)]
    # after the flood's first, the short ones go together, then each client in turn
    assert order == [["L0"], ["q0", "o0", "q1"], ["L1"], ["L2"], ["L3"]], order


def test_the_cell_budget_limits_long_rows_but_one_always_fits(batcher):
    queue(batcher, [job("a", 512, f"a{i}") for i in range(4)])
    chosen, left_out = batcher._select(MODEL)
    assert len(chosen) == 2 and left_out  # 2 x 72 x 512^2 cells is the budget
    tight = without_its_thread(Batcher("cpu", Metrics(), 8192, 64, 0, 100, max_batch_cells=1))
    try:
        queue(tight, [job("a", 512, "only")])
        assert [j.tag for j in tight._select(MODEL)[0]] == ["only"]
    finally:
        tight.close()


def test_share_is_per_client_and_released(batcher):
    batcher.admit(10, "flood")
    with pytest.raises(QueueFull) as refused:
        batcher.admit(1, "flood")
    assert "this client" in refused.value.message and int(refused.value.headers["Retry-After"]) >= 1
    batcher.admit(1, "quiet")  # another client still gets in
    batcher.release(10, "flood")
    batcher.release(1, "quiet")
    assert not batcher._per_client
    batcher.admit(10, "flood")
    batcher.release(10, "flood")


def test_more_inputs_than_a_client_may_ever_queue_is_no_429(batcher):
    """A 429 says "retry"; a batch bigger than the client's share would be refused for ever."""
    with pytest.raises(InvalidInput) as refused:
        batcher.admit(11, "big")
    assert refused.value.status == 422 and "at most 10" in refused.value.message
    assert not batcher._per_client and batcher._admitted == 0
    batcher.admit(10, "big")  # the share itself still fits
    batcher.release(10, "big")


def test_answers_are_resolved_on_their_own_loop_and_a_request_that_left_is_left_alone():
    """The worker hands results back with call_soon_threadsafe: set from the worker's thread, an
    asyncio future would wake nobody; set after its request was cancelled, it would raise."""

    async def main():
        loop = asyncio.get_running_loop()
        ok, failed, gone = loop.create_future(), loop.create_future(), loop.create_future()
        gone.cancel()
        where = []
        ok.add_done_callback(lambda f: where.append(threading.current_thread()))
        worker = threading.Thread(target=lambda: [_deliver(ok, "done"), _deliver(failed, error=QueueFull("full", 1)),
                                                  _deliver(gone, "late")])
        worker.start()
        worker.join()
        assert await ok == "done" and where == [threading.main_thread()]
        with pytest.raises(QueueFull):
            await failed
        await asyncio.sleep(0)
        assert gone.cancelled()

    asyncio.run(main())
    closed = asyncio.new_event_loop()
    orphan = closed.create_future()
    closed.close()
    _deliver(orphan, "after shutdown")  # nobody waits: no error either
    assert not orphan.done()
