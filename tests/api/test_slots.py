"""FairSlots: render and tile slots handed out round-robin across clients, never lost to a cancel."""

from __future__ import annotations

import asyncio

from manyeyes.app.services.slots import FairSlots


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
