"""FairSlots: render and tile slots handed out round-robin across clients, never lost to a cancel."""

from __future__ import annotations

import asyncio

from manyeyes.app.services.slots import FairSlots


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_late_client_is_served_before_a_flooding_clients_backlog():
    """One slot, a client with ten waiting, then another client: the other goes next, not
    eleventh (a plain FIFO semaphore kept it behind all ten)."""

    async def main():
        slots = FairSlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def job(client: str, name: str):
            async with slots.hold(client):
                order.append(name)
                await release.wait()

        first = asyncio.create_task(job("flood", "flood-0"))
        await settle()
        flood = [asyncio.create_task(job("flood", f"flood-{i}")) for i in range(1, 11)]
        await settle()
        other = asyncio.create_task(job("other", "other"))
        await settle()
        release.set()
        await asyncio.gather(first, *flood, other)
        return order

    order = asyncio.run(main())
    assert order[:3] == ["flood-0", "flood-1", "other"], order
    assert sorted(order) == sorted(["other", *(f"flood-{i}" for i in range(11))])


def test_clients_take_turns_and_every_slot_comes_back():
    async def main():
        slots = FairSlots(2)
        order: list[str] = []
        gate = asyncio.Event()

        async def job(client: str, i: int):
            async with slots.hold(client):
                order.append(client)
                await gate.wait()

        holders = [asyncio.create_task(job("x", -1)), asyncio.create_task(job("x", -2))]
        await settle()
        waiting = [asyncio.create_task(job(c, i)) for i in range(3) for c in ("a", "a", "b", "c")]
        await settle()
        gate.set()
        await asyncio.gather(*holders, *waiting)
        return order, slots.free

    order, free = asyncio.run(main())
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
