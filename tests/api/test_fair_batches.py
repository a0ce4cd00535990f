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


def test_a_flood_of_long_inputs_does_not_pad_another_clients_short_batch(batcher):
    """A client's first input rode the next batch whatever its length, so a quiet client's short
    lead was padded to the flood's 400 tokens (1.7 s against 42 ms unloaded, two workers)."""
    queue(batcher, [job("quiet", 8, "q0"), job("other", 12, "o0")])
    queue(batcher, [job("flood", 400, f"L{i}") for i in range(3)])
    order = [[j.tag for j in batcher._next_batch()] for _ in range(2)]
    assert order == [["q0", "o0"], ["L0", "L1", "L2"]], order


def test_a_short_input_still_rides_a_long_lead(batcher):
    """The fair-share bound: a first input no wider than the batch is served by the next forward."""
    queue(batcher, [job("flood", 400, f"L{i}") for i in range(3)])
    queue(batcher, [job("quiet", 8, "q0")])
    chosen, _ = batcher._select(MODEL)
    assert [j.tag for j in chosen] == ["L0", "q0", "L1"]


def test_a_client_whose_queue_emptied_goes_before_those_served_since(batcher):
    """A client that sends one request at a time empties its queue each time: it went behind the
    flood just served, and each of its requests rode one more of the flood's padded batches."""
    queue(batcher, [job("flood", 400, f"L{i}") for i in range(6)])
    queue(batcher, [job("quiet", 8, "q0")])
    assert [j.tag for j in batcher._next_batch()] == ["L0", "q0", "L1"]
    queue(batcher, [job("quiet", 8, "q1")])  # its next request, while that batch runs
    assert [j.tag for j in batcher._next_batch()] == ["q1"]
    queue(batcher, [job("quiet", 8, "q2")])  # flood's turn now: quiet rides it
    assert [j.tag for j in batcher._next_batch()] == ["L2", "q2", "L3"]
    queue(batcher, [job("new", 8, "n0")])  # never served: before the flood
    assert [j.tag for j in batcher._next_batch()] == ["n0"]


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


def test_the_fair_bench_runs():
    """bench/fair_bench.py, small, so that it keeps up with the Batcher it drives. Its verdict is
    a timing (sleeps standing in for forwards) and is the bench's to print, not this test's."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "fair_bench.py"
    done = subprocess.run([sys.executable, str(bench), "--seconds", "2", "--flood", "4"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answered = [int(n) for n in re.findall(r"n=(\d+)\)", done.stdout)]
    assert len(answered) == 2 and min(answered) > 0, done.stdout
    assert re.search(r"flood answered: [1-9][\d.]* a second", done.stdout) and "bound " in done.stdout, done.stdout
