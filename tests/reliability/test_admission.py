"""Admission by work: a request that cannot finish within its budget, given the work queued
ahead of it, gets 429 with Retry-After at once instead of a 504 when the budget runs out, and
the estimate keeps fair shares (only a client's own backlog counts in full against it)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from manyeyes.app.services.batcher import Batcher, Job, WorkRate, work_units
from manyeyes.app.services.errors import QueueFull
from manyeyes.app.services.metrics import Metrics
from tests.reliability.conftest import assert_json_error, live_server
from tests.reliability.test_overload import burst, check_against_single_run

MODEL = SimpleNamespace(info=SimpleNamespace(n_layers=6, n_heads=12, id="fake"))


def job(client: str, n_tokens: int, deadline_s: float = 60) -> Job:
    return Job(MODEL, [0] * n_tokens, time.monotonic() + deadline_s, client)


def without_its_thread(b: Batcher) -> Batcher:
    """`b` with its forward thread stopped: these tests put jobs straight into its queues and call
    its methods themselves. A thread that first ran after a test had begun (the interpreter lock
    gives a new thread its turn within 5 ms) found jobs queued and took them from under the test:
    "OrderedDict mutated during iteration", once in CI."""
    b.close()
    b._closed = False  # admit() still takes requests
    return b


@pytest.fixture
def batcher():
    b = without_its_thread(Batcher("cpu", Metrics(), max_batch_tokens=8192, max_batch_items=8, max_wait_s=0, max_queue=1000,
                                   work_fraction=0.8))
    b._rates["fake"] = WorkRate()
    b._rates["fake"].observe(work_units(16), 1.0)  # one 16-token input: one second
    yield b
    b.close()


def backlog(batcher: Batcher, jobs: list[Job]) -> None:
    batcher._enqueue(jobs)


def test_only_the_clients_own_backlog_counts_in_full(batcher):
    backlog(batcher, [job("flood", 16) for _ in range(10)] + [job("other", 16) for _ in range(3)])
    # The quiet client rides in the next round: one job of each other client, then its own.
    assert batcher.wait_ahead_s([job("quiet", 16)]) == pytest.approx(3.0)
    # The flooder waits for its ten, and for the other client's three served in the same rounds.
    assert batcher.wait_ahead_s([job("flood", 16)]) == pytest.approx(14.0)
    # Work grows with the square of the length: a 512-token input is worth 36 short ones.
    assert batcher.wait_ahead_s([job("quiet", 512)]) == pytest.approx(2.0 + work_units(512) / work_units(16))


def test_work_beyond_the_budget_is_refused_with_retry_after_and_others_still_get_in(batcher):
    backlog(batcher, [job("flood", 16) for _ in range(10)])
    with pytest.raises(QueueFull) as refused:
        batcher._check_work([job("flood", 16)], time.monotonic() + 10.5, batcher._calibration)
    # 11 s of work against 0.8 x 10.5 s allowed: retry in 3 s, when enough has drained.
    assert refused.value.headers["Retry-After"] == "3"
    assert "work queued" in refused.value.message
    batcher._check_work([job("quiet", 16)], time.monotonic() + 10, batcher._calibration)  # 2 s: admitted
    # Nothing ahead: admitted whatever its size, as one input always fits a batch.
    batcher._pending.clear()
    batcher._check_work([job("quiet", 512)], time.monotonic() + 10, batcher._calibration)


def test_the_running_forward_counts_for_what_is_left_of_it(batcher):
    batcher._running_batch = (time.monotonic() - 0.25, 1.0)
    assert batcher.wait_ahead_s([job("quiet", 16)]) == pytest.approx(1.75, abs=0.05)
    batcher._running_batch = (time.monotonic() - 5.0, 1.0)  # overran its estimate: nothing more is assumed
    assert batcher.wait_ahead_s([job("quiet", 16)]) == pytest.approx(1.0)


def test_no_estimate_until_the_model_has_run(batcher):
    backlog(batcher, [job("flood", 16) for _ in range(100)])
    batcher._rates.clear()
    batcher._check_work([job("flood", 16)], time.monotonic() + 1, batcher._calibration)  # admitted: no rate to judge by yet


SAME_LENGTH = [f"The heron number {n} waited on the bank." for n in range(10, 16)]


def burst_against(budget_s: float, delay_s: float, fraction: float):
    # Warmed up as `manyeyes serve` is, so the first forward does not pay one-time costs.
    with live_server(debug_forward_delay_s=delay_s, request_timeout_s=budget_s, max_batch_items=1, cache_bytes=0,
                     work_budget_fraction=fraction, warmup=True) as server:
        for text in ("The heron number 8 waited on the bank.", "The heron number 9 waited on the bank."):
            assert asyncio.run(burst(server.url, [text]))[0][0].status_code == 200  # measures the forward rate
        replies = asyncio.run(burst(server.url, SAME_LENGTH))
        server.batcher.forward_delay_s = 0
        return server, replies, server.metric("manyeyes_dropped_total", reason="work")


@pytest.mark.slow
def test_a_burst_beyond_the_budget_gets_early_429s_instead_of_504s():
    # Each forward takes 2 s (one input each), the budget is 7 s: of 6 simultaneous requests two
    # or three can finish in time (0.8 x 7 s is the estimate's allowance). Without admission by
    # work the rest wait out their budget. The delay dwarfs the real forward (milliseconds), so
    # the outcome does not hang on the machine's load, up to a second of jitter per forward.
    budget, delay = 7.0, 2.0
    server, replies, dropped = burst_against(budget, delay, 0.8)
    statuses = [r.status_code for r, _ in replies]
    print("admission by work:", statuses, [round(t, 2) for _, t in replies], "calibration", server.batcher._calibration)
    assert set(statuses) <= {200, 429}, statuses
    served = [(r, t, text) for (r, t), text in zip(replies, SAME_LENGTH) if r.status_code == 200]
    refused = [(r, t) for r, t in replies if r.status_code == 429]
    assert 1 <= len(served) <= 3 and refused, statuses
    for r, t in refused:
        err = assert_json_error(r, 429)
        assert err["code"] == "queue_full" and "work queued" in err["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 10
    # Refused at once: before the first admitted request's forward could end.
    assert max(t for _, t in refused) < delay <= min(t for _, t, _ in served)
    assert max(t for _, t, _ in served) < budget
    assert dropped == len(refused)
    for r, _, text in served:
        check_against_single_run(server.model, text, r.json())

    _, replies, dropped = burst_against(budget, delay, 0.0)  # admission by count only: late 504s
    statuses = [r.status_code for r, _ in replies]
    print("admission by count:", statuses, [round(t, 2) for _, t in replies])
    assert 504 in statuses and 429 not in statuses and dropped == 0, statuses


def test_inputs_waiting_for_their_answers_bytes_count_as_their_clients_backlog(batcher):
    deadline = time.monotonic() + 10
    with batcher.held_back(MODEL, [[0] * 16] * 3, deadline, "flood"):  # 3 s of the flood's work
        assert batcher.wait_ahead_s([job("flood", 16)]) == pytest.approx(4.0)
        assert batcher.wait_ahead_s([job("quiet", 16)]) == pytest.approx(1.0)  # waits for bytes of its own
        with batcher.held_back(MODEL, [[0] * 16] * 4, deadline, "flood"):
            with pytest.raises(QueueFull) as refused:  # 3 + 4 + 2 s against 0.8 x 10 s: at once
                with batcher.held_back(MODEL, [[0] * 16] * 2, deadline, "flood"):
                    pass
            assert "work queued" in refused.value.message
            batcher._check_work([job("quiet", 16)], deadline, batcher._calibration)
    assert batcher._held_back == {} and batcher.wait_ahead_s([job("flood", 16)]) == pytest.approx(1.0)


@pytest.mark.slow
def test_a_clients_burst_that_waits_for_answer_bytes_is_refused_at_once_not_after_its_budget():
    # Each answer needs more than half the answers' budget, so one client's requests take their
    # bytes one after another. Each forward takes 1 s, the budget is 5 s: of 8 simultaneous
    # requests about four can finish; the rest must get their 429 at once. Before, they waited
    # for bytes unseen by the estimate and got a 429 ("0.0 s budget") or a 504 at 4-5 s.
    budget, delay = 5.0, 1.0
    texts = [f"The heron number {n} waited on the bank." for n in range(20, 28)]
    # No warm-up: its forward's rate (milliseconds, without the delay) would weigh in the estimate.
    with live_server(debug_forward_delay_s=delay, request_timeout_s=budget, cache_bytes=0, answer_bytes=20_000,
                     work_budget_fraction=0.8) as server:
        for text in ("The heron number 8 waited on the bank.", "The heron number 9 waited on the bank."):
            assert asyncio.run(burst(server.url, [text]))[0][0].status_code == 200  # measures the forward rate
        replies = asyncio.run(burst(server.url, texts))
        server.batcher.forward_delay_s = 0
    statuses = [r.status_code for r, _ in replies]
    print("waiting for bytes:", statuses, [round(t, 2) for _, t in replies])
    assert set(statuses) <= {200, 429}, statuses
    refused = [t for r, t in replies if r.status_code == 429]
    served = [t for r, t in replies if r.status_code == 200]
    assert 2 <= len(served) <= 5 and refused, statuses
    assert max(refused) < delay <= min(served) and max(served) < budget, replies


def test_no_job_pads_a_batch_to_waste_but_a_first_one_that_does_leads_the_next(batcher):
    backlog(batcher, [job("flood", 20), job("flood", 512), job("flood", 30), job("flood", 400), job("quiet", 500)])
    chosen, left_out = batcher._select(MODEL)
    # flood's 512 and 400 would pad the short ones up, and so would quiet's 500, its first: that
    # one leads the next batch instead (it rode this one, which took twice as long for it).
    assert [len(j.encoded) for j in chosen] == [20, 30] and left_out
    for j in chosen:
        batcher._take(j)
    batcher._pending.move_to_end("flood")
    assert [len(j.encoded) for j in batcher._select(MODEL)[0]] == [500, 512, 400]
    batcher._pending.clear()
    backlog(batcher, [job("flood", n) for n in (300, 400, 20, 350)])
    assert [len(j.encoded) for j in batcher._select(MODEL)[0]] == [300, 400, 350]


def test_estimates_are_calibrated_by_how_long_answers_really_took(batcher):
    backlog(batcher, [job("flood", 16) for _ in range(4)])
    late = [job("quiet", 16) for _ in range(3)]
    for j in late:
        j.estimate_s, j.enqueued = 1.0, time.monotonic() - 4.0  # estimated 1 s, took 4
    for _ in range(10):
        batcher._calibrate(late, time.monotonic())
    assert batcher._calibration == pytest.approx(4.0, rel=0.05)
    # 2 s of raw estimate now reads as 8 s: over 0.8 x 9 s.
    with pytest.raises(QueueFull):
        batcher._check_work([job("quiet", 16)], time.monotonic() + 9, batcher._calibration)
    batcher._calibration = 1.0
    batcher._check_work([job("quiet", 16)], time.monotonic() + 9, batcher._calibration)
    # Jobs that first waited for their answers' bytes (from held_since) move their own calibration only.
    waited = [job("flood", 16) for _ in range(3)]
    for j in waited:
        j.estimate_s, j.held_since = 1.0, time.monotonic() - 3.0
    for _ in range(10):
        batcher._calibrate(waited, time.monotonic())
    assert batcher._held_calibration == pytest.approx(3.0, rel=0.05) and batcher._calibration == 1.0


def test_the_summed_estimate_equals_a_walk_of_the_queues_as_jobs_come_and_go(batcher):
    # Each client's queue keeps its work summed by model, so that an estimate does not walk every
    # job: after any sequence of arrivals and departures it must say what a walk would.
    other_model = SimpleNamespace(info=SimpleNamespace(n_layers=2, n_heads=4, id="other"))
    batcher._rates["other"] = WorkRate()
    batcher._rates["other"].observe(work_units(16), 0.25)
    rng = random.Random(7)

    def walked(new: list[Job]) -> float:
        client = new[0].client
        turns = len(batcher._pending.get(client, ())) + len(new)
        ahead = [j for c, queue in batcher._pending.items() for j in (list(queue) if c == client else list(queue)[:turns])]
        return sum(batcher._rates[j.model.info.id].seconds_for(j.units) for j in ahead + new)

    checked = 0
    for _ in range(400):
        if batcher._n_pending and rng.random() < 0.45:
            gone = rng.choice([j for queue in batcher._pending.values() for j in queue])
            batcher._take(gone)
        else:
            j = job(rng.choice("abcd"), rng.choice((3, 16, 70, 300)))
            j.model = rng.choice((MODEL, other_model))
            batcher._enqueue([j])
        for client in "abcde":
            asked = [job(client, rng.choice((16, 200)))]
            assert batcher.wait_ahead_s(asked) == pytest.approx(walked(asked), rel=1e-9)
            checked += 1
    assert checked == 2000 and max(len(q) for q in batcher._pending.values()) > 3
