"""Fair shares under a flood of long texts: the batcher's own scheduling, timed without CPU noise.

The real Batcher serves a stand-in model whose forward sleeps as long as its padded work takes
(rows x work_units(longest row), `--unit-us` microseconds a unit: by default a 512-token row
0.15 s, a 16-token one 4 ms), so what is measured is the batches the scheduler makes, not this
machine's load. A quiet client sends a `--quiet-tokens` text every 0.1 s, alone and then beside
`--flood` clients that each send 300-512-token texts back to back. The bound for the quiet
client (the serving issue's fair shares): within 2x its unloaded latency plus one batch.

    python bench/fair_bench.py [--seconds 15] [--flood 32] [--quiet-tokens 16] [--unit-us 0.5]

Prints the quiet client's latency alone and under the flood (median, p10-p90, max), the longest
forward the flood made, the bound (met when even the slowest answer is within it), and the
flood's answers a second.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from types import SimpleNamespace

from manyeyes.app.services.batcher import Batcher, work_units
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.config import Settings


class SleepingModel:
    info = SimpleNamespace(n_layers=6, n_heads=12, id="stand-in")

    def __init__(self, unit_s: float) -> None:
        self.unit_s = unit_s
        self.forwards: list[float] = []

    def run(self, encoded, capture, to_host=None):
        seconds = self.unit_s * len(encoded) * work_units(max(map(len, encoded)))
        self.forwards.append(seconds)
        time.sleep(seconds)
        return [None] * len(encoded)


async def ask(batcher: Batcher, model: SleepingModel, client: str, n_tokens: int) -> float:
    batcher.admit(1, client)
    started = time.monotonic()
    answer, = batcher.submit(model, [[0] * n_tokens], started + 60, client)
    await answer
    return time.monotonic() - started


async def measure(args, flood: int) -> tuple[list[float], int, SleepingModel]:
    s = Settings()
    batcher = Batcher("cpu", Metrics(), s.max_batch_tokens, s.max_batch_items, s.max_wait_ms / 1000, s.max_queue,
                      max_batch_cells=s.max_batch_cells)
    model = SleepingModel(args.unit_us * 1e-6)
    rnd = random.Random(0)
    quiet: list[float] = []
    answered = 0
    stop = time.monotonic() + args.seconds

    async def flooder() -> None:
        nonlocal answered
        while time.monotonic() < stop:
            await ask(batcher, model, "flood", rnd.choice([300, 400, 512]))
            answered += 1

    async def quiet_client() -> None:
        await asyncio.sleep(1)  # the flood's queue is full by then
        while time.monotonic() < stop:
            quiet.append(await ask(batcher, model, "quiet", args.quiet_tokens))
            await asyncio.sleep(0.1)

    await asyncio.gather(quiet_client(), *(flooder() for _ in range(flood)))
    batcher.close()
    return quiet, answered, model


def spread(values: list[float]) -> str:
    v = sorted(values)
    return (f"{statistics.median(v) * 1e3:.0f} ms (p10-p90 {v[len(v) // 10] * 1e3:.0f}-{v[len(v) * 9 // 10] * 1e3:.0f}, "
            f"max {v[-1] * 1e3:.0f}, n={len(v)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--flood", type=int, default=32)
    p.add_argument("--quiet-tokens", type=int, default=16)
    p.add_argument("--unit-us", type=float, default=0.5)
    args = p.parse_args()
    alone, _, _ = asyncio.run(measure(args, 0))
    flooded, answered, model = asyncio.run(measure(args, args.flood))
    longest = max(model.forwards)
    bound = 2 * statistics.median(alone) + longest
    print(f"quiet client alone:          {spread(alone)}")
    print(f"quiet client under flood:    {spread(flooded)}")
    print(f"longest forward of the flood: {longest * 1e3:.0f} ms; bound 2 x alone + one batch = {bound * 1e3:.0f} ms")
    print(f"flood answered: {answered / args.seconds:.1f} a second ({args.flood} clients)")
    print("bound MET" if max(flooded) <= bound else "bound NOT MET", "(the slowest answer under the flood against the bound)")


if __name__ == "__main__":
    main()
