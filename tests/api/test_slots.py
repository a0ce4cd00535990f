"""FairSlots: render and tile slots handed out round-robin across clients, never lost to a cancel."""

from __future__ import annotations

import asyncio

from manyeyes.app.services.slots import FairBytes, FairSlots


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def served_order(n: int, holders: list[str], waves: list[list[str]]) -> tuple[list[str], int]:
    """Clients in the order they got one of `n` slots: `holders` take them first, then each wave
    queues up in turn; everyone holds until all have queued. Also the free slots at the end."""

    async def main():
        slots = FairSlots(n)
        order: list[str] = []
        release = asyncio.Event()

        async def job(client: str):
            async with slots.hold(client):
                order.append(client)
                await release.wait()

        tasks = [asyncio.create_task(job(c)) for c in holders]
        for wave in waves:
            await settle()
            tasks += [asyncio.create_task(job(c)) for c in wave]
        await settle()
        release.set()
        await asyncio.gather(*tasks)
        return order, slots.free

    return asyncio.run(main())


def test_a_late_client_is_served_before_a_flooding_clients_backlog():
    """One slot, a client with ten waiting, then another client: the other goes next, not
    eleventh (a plain FIFO semaphore kept it behind all ten)."""
    order, free = served_order(1, ["flood"], [["flood"] * 10, ["other"]])
    assert order[:3] == ["flood", "flood", "other"] and len(order) == 12 and free == 1, order


def test_clients_take_turns_and_every_slot_comes_back():
    order, free = served_order(2, ["x", "x"], [[c for _ in range(3) for c in ("a", "a", "b", "c")]])
    # After the two holders, one of each client per turn while each has some waiting.
    assert order[2:5] == ["a", "b", "c"] and order[5:8] == ["a", "b", "c"], order
    assert free == 2


def test_a_cancelled_waiter_leaves_the_queue_and_a_granted_one_passes_its_slot_on():
    async def main():
        slots = FairSlots(1)
        forever = asyncio.Event()
        entered: list[str] = []

        async def take(client: str):
            async with slots.hold(client):
                entered.append(client)
                await forever.wait()

        mine = slots.hold("a")
        await mine.__aenter__()
        gone = asyncio.create_task(take("b"))
        await settle()
        gone.cancel()  # cancelled while waiting: it must not take a slot later
        await settle()
        assert not slots._waiting and gone.cancelled()

        granted, after = asyncio.create_task(take("c")), asyncio.create_task(take("d"))
        await settle()
        await mine.__aexit__(None, None, None)  # hands the slot to "c", which has not run yet
        granted.cancel()  # cancelled before it could: the slot goes on to "d"
        await settle()
        assert granted.cancelled() and entered == ["d"] and slots.free == 0
        after.cancel()
        await settle()
        return slots.free

    assert asyncio.run(main()) == 1  # every slot back


# ---- FairBytes: the bytes of answers on their way out

def test_bytes_are_granted_in_turns_across_clients_and_never_past_the_budget():
    async def main():
        budget = FairBytes(100)
        order: list[str] = []
        peak = 0
        grants = []

        async def job(client: str, nbytes: int):
            nonlocal peak
            grant = await budget.take(nbytes, client)
            order.append(client)
            peak = max(peak, budget.held)
            grants.append(grant)

        first = await budget.take(50, "flood")  # half the budget: the most one client holds
        tasks = [asyncio.create_task(job("flood", 30)) for _ in range(4)]
        await settle()
        assert order == [] and budget.held == 50  # a second 30 would pass the flood's half
        tasks.append(asyncio.create_task(job("other", 30)))
        await settle()
        # The flood's head waits on its own half, with room in the budget: the other passes it.
        assert order == ["other"] and budget.held == 80, (order, budget.held)
        assert budget.try_take(30, "third") is None  # 80 + 30 would pass the budget
        first.release()  # 30 held: the flood's head (30); the next 30 of the flood would pass its half
        await settle()
        assert order == ["other", "flood"] and budget.held == 60, (order, budget.held)
        while grants:
            grants.pop(0).release()
            await settle()
        await asyncio.gather(*tasks)
        assert order.count("flood") == 4 and peak <= 100 and budget.held == 0 and not budget.held_by
        return True

    assert asyncio.run(main())


def test_a_waiter_that_needs_more_than_the_room_left_holds_the_others_back_until_it_fits():
    """Passing waiters that wait on their own half must not starve one that waits on the budget."""
    async def main():
        budget = FairBytes(100)
        a = await budget.take(50, "a")
        b = await budget.take(40, "b")
        a_next = asyncio.create_task(budget.take(20, "a"))  # its half would be 70, and 110 > 100 held
        await settle()
        c = asyncio.create_task(budget.take(5, "c"))  # fits, but behind a head the budget holds back
        await settle()
        assert not a_next.done() and not c.done()
        b.release()  # 50 held: a's 20 would pass its half; c's 5 goes
        await settle()
        assert c.done() and not a_next.done() and budget.held == 55
        a.release()
        await settle()
        assert a_next.done() and budget.held == 25
        a_next.result().release()
        c.result().release()
        return budget.held, budget._waiting

    assert asyncio.run(main()) == (0, {})


def test_small_answers_of_other_clients_pass_a_head_the_budget_holds_back_within_their_share():
    """Three clients that never read a large answer each held the budget until their write deadline,
    and another client's 4 KB answer waited behind the next large one: 27 s (review h52c)."""
    async def main():
        budget = FairBytes(320)  # small: at most 10; those that pass hold at most 40 together
        a, b = await budget.take(110, "a"), await budget.take(110, "b")
        head = asyncio.create_task(budget.take(110, "c"))  # 330 > 320: held back
        await settle()
        probe = budget.try_take(4, "d")  # small, fits: passes at once
        assert probe is not None and probe.passing and not head.done()
        smalls = [asyncio.create_task(budget.take(10, f"e{i}")) for i in range(4)]
        large = asyncio.create_task(budget.take(50, "f"))  # fits, but no small answer: behind the head
        await settle()
        assert [t.done() for t in smalls] == [True, True, True, False] and not large.done()
        assert budget.held_passing == 34 and budget.held == 254
        a.release()  # the head fits now, then the large one, then the last small one, in turn
        await settle()
        assert head.done() and large.done() and smalls[3].done() and budget.held == 314, budget.held
        assert not smalls[3].result().passing and budget.held_passing == 34
        for grant in [b, probe, head.result(), large.result()] + [t.result() for t in smalls]:
            grant.release()
        return budget.held, budget.held_passing, budget.held_by, budget._waiting

    assert asyncio.run(main()) == (0, 0, {}, {})


def test_an_answer_larger_than_the_budget_goes_alone_and_a_grant_goes_back_once():
    async def main():
        budget = FairBytes(100)
        small = await budget.take(10, "a")
        big = asyncio.create_task(budget.take(500, "b"))
        await settle()
        assert not big.done()  # only once nothing else is held
        # Nor does a small answer pass it (3 of 100 would pass a head that could ever fit): one
        # passing now would keep it waiting for ever.
        assert budget.try_take(3, "c") is None
        small.release()
        small.release()  # twice: given back once
        await settle()
        grant = big.result()
        assert budget.held == 500 and budget.held_by == {"b": 500}
        grant.release()
        return budget.held, budget.held_by

    assert asyncio.run(main()) == (0, {})


def test_a_waiter_cancelled_at_the_head_lets_the_others_through():
    async def main():
        budget = FairBytes(100)
        holding = await budget.take(40, "a")
        head = asyncio.create_task(budget.take(90, "b"))  # waits for 40 to come back
        behind = asyncio.create_task(budget.take(20, "c"))  # would fit, but waits behind the head
        await settle()
        assert not behind.done()
        head.cancel()
        await settle()
        assert head.cancelled() and behind.done() and budget.held == 60
        behind.result().release()
        holding.release()
        return budget.held, budget._waiting

    assert asyncio.run(main()) == (0, {})


def test_no_budget_grants_everything_at_once():
    budget = FairBytes(0)
    grants = [budget.try_take(10**12, "a") for _ in range(3)]  # a client's three, each past any half
    assert all(grant is not None for grant in grants) and budget.held == 0 and not budget.held_by
    for grant in grants:
        grant.release()
    assert budget.held == 0


def test_every_route_that_answers_with_weights_or_measures_gives_its_bytes_back(api):
    """A reply's bytes go back once its answer is sent, and where nothing sends it (export reads the
    reply and builds a page) once the reply is dropped: a grant kept by mistake would shrink the
    budget for good, until every request waited on it."""
    from tests.api.conftest import metric

    text = "The bytes of this answer come back."
    answers = [
        api.post("/api/v1/attention", json={"text": text, "format": "u8"}),
        api.post("/api/v1/attention", json={"text": text, "format": "json", "measures": ["value_norms"]}),
        api.post("/api/v1/attention/batch", json={"texts": [text, "And these."], "format": "f16"}),
        api.get("/export", params={"text": text, "model": "minilm"}),
    ]
    run_id = answers[0].json()["run_id"]
    answers.append(api.get(f"/api/v1/runs/{run_id}/attention", params={"format": "json"}))
    answers.append(api.get(f"/api/v1/runs/{run_id}/measures", params={"names": "rollout,words", "format": "u8"}))
    answers.append(api.get(f"/api/v1/runs/{run_id}/mean", params={"format": "json"}))
    for route, params in (("tile", {"layer": 1, "head": 2}), ("topk", {"layer": 1, "head": 2, "k": 3}), ("overview", {})):
        answers.append(api.get(f"/api/v1/runs/{run_id}/{route}", params={"format": "f16", **params}))
    answers.append(api.post("/api/v1/attention", json={"text": "x " * 600, "format": "json"}))  # too long: refused before any bytes
    assert [r.status_code for r in answers] == [200] * 10 + [422], [r.text[:200] for r in answers]
    assert metric(api, "manyeyes_answer_bytes") == 0
    assert api.app.state.service.answers.held == 0 and not api.app.state.service.answers.held_by


def test_a_reply_dropped_unsent_gives_its_bytes_back_and_one_handed_over_keeps_them_until_sent():
    from manyeyes.app.services.attention import Reply

    budget = FairBytes(1000)
    reply = Reply([b"{}"], "application/json", {})
    reply.own(budget.try_take(30, "a"))
    del reply
    dropped = budget.held
    reply = Reply([b"{}"], "application/json", {})
    reply.own(budget.try_take(30, "b"))
    grant = reply.hand_over()
    del reply
    handed = budget.held
    grant.release()
    assert (dropped, handed, budget.held) == (0, 30, 0)


def test_a_grant_given_back_from_another_thread_is_given_back_on_its_loop():
    """A reply or response freed by the garbage collector gives its bytes back on whatever thread
    the collector ran (the forward thread, a render thread): the waiter it lets through must still
    be woken on its own loop, never from that thread."""
    import threading

    async def main():
        budget = FairBytes(100)
        held = await budget.take(50, "a")
        waiter = asyncio.create_task(budget.take(50, "b"))  # 50 held + 50 fits, but waits behind nobody: ...
        await settle()
        assert waiter.done()  # ... it fits at once; now one that must wait
        blocked = asyncio.create_task(budget.take(60, "c"))
        await settle()
        assert not blocked.done()
        woken_on = []
        loop_thread = threading.get_ident()
        original = budget._give_back
        budget._give_back = lambda grant: (woken_on.append(threading.get_ident()), original(grant))
        releasing = threading.Thread(target=lambda: (held.release(), waiter.result().release()))
        releasing.start()
        releasing.join()
        await asyncio.wait_for(blocked, 5)
        blocked.result().release()
        return woken_on == [loop_thread] * 3 and budget.held == 0

    assert asyncio.run(main())


def test_counted_slots_show_the_work_running_and_refuse_beyond_their_bound():
    import pytest
    from prometheus_client import CollectorRegistry, Gauge

    from manyeyes.app.services.slots import CountedSlots

    gauge = Gauge("running", "work running", ["kind"], registry=CollectorRegistry()).labels("experiment")
    slots = CountedSlots(2, gauge)
    assert slots.acquire() and slots.acquire() and gauge._value.get() == 2
    assert not slots.acquire() and gauge._value.get() == 2  # refused: counted once, as taken
    slots.release()
    assert gauge._value.get() == 1 and slots.acquire() and gauge._value.get() == 2
    slots.release()
    slots.release()
    assert gauge._value.get() == 0
    with pytest.raises(ValueError):  # released more often than taken: a bug, said at once
        slots.release()
    assert gauge._value.get() == 0 and slots.free == 2


def test_the_server_trims_the_arenas_once_its_requests_stop_ending(api):
    """Each request's end is told to QuietTrim (app/memory.py), which gives the arenas' free memory
    back a second after the last: only experiments did, and an idle server rested over SECURITY.md's
    bound after a burst of measures (review h52c)."""
    import time

    quiet = api.app.state.quiet_trim
    assert api.post("/api/v1/attention", json={"text": "The arenas are trimmed once it is quiet."}).status_code == 200
    assert quiet.last_end is not None and time.monotonic() - quiet.last_end < 5
    trims = quiet.trims
    deadline = time.monotonic() + 30
    while quiet.trims == trims and time.monotonic() < deadline:
        time.sleep(0.1)
    assert quiet.trims > trims and quiet.last_end is None
