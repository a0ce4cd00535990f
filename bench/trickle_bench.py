"""Resident memory through a steady trickle of requests after a burst, with the server's trim of
its malloc arenas as shipped (QuietTrim, app/memory.py: after 1 s of quiet, and between requests
once 30 s have passed since the last trim) and as it was before the trickle case (after 1 s of
quiet only), one after the other in one run.

The burst: 4 concurrent clients POST /attention with measures (rollout, value_norms, contributions) at 300-500
tokens and GET the run's mean, for --burst-s; then one 12-token request every 0.5 s for
--trickle-s, the server's RSS read after each. A trickle never leaves a second of quiet.
"warm" is the RSS after five short requests, not soak.py's warm-up at every length, so the bound
printed is tighter than soak's: what it shows is whether the trickle keeps the burst's arenas.

    python bench/trickle_bench.py [--burst-s 20] [--trickle-s 75]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import rss_mb, serve  # noqa: E402

WORDS = "the river bank was full of fish while a heron waited by the old stone mill".split()
# The variant before the trickle case: every_s (QuietTrim's second default) past any run's length.
QUIET_ONLY = ("import manyeyes.app.memory as m; d = list(m.QuietTrim.__init__.__defaults__); d[1] = float('inf'); "
              "m.QuietTrim.__init__.__defaults__ = tuple(d)")
CACHE_BYTES = 512 * 2**20


def text(n: int, seed: int) -> str:
    pick = random.Random(seed)
    return f"t{seed} " + " ".join(pick.choice(WORDS) for _ in range(n))


async def drive(url: str, pid: int, burst_s: float, trickle_s: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for i in range(5):
            await client.post("/api/v1/attention", json={"text": text(20, i), "format": "u8"})
        await asyncio.sleep(3)  # the warm-up's own trim (1 s of quiet) is done
        warm = rss_mb(pid)
        stop = time.monotonic() + burst_s

        async def heavy(worker: int) -> None:
            i = 0
            while time.monotonic() < stop:
                i += 1
                r = await client.post("/api/v1/attention", json={
                    "text": text(300 + (i * 37) % 200, worker * 10_000 + i), "format": "u8",
                    "measures": ["rollout", "value_norms", "contributions"]})
                if r.status_code == 200:
                    await client.get(f"/api/v1/runs/{r.json()['run_id']}/mean?format=u8")

        await asyncio.gather(*(heavy(w) for w in range(4)))
        burst = rss_mb(pid)
        trickle = []
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < trickle_s:
            i += 1
            r = await client.post("/api/v1/attention", json={"text": text(12, 900_000 + i), "format": "u8"})
            assert r.status_code == 200, r.text[:300]
            trickle.append((time.monotonic() - started, rss_mb(pid)))
            await asyncio.sleep(0.5)
    return {"warm": warm, "burst": burst, "trickle": trickle}


def run(variant: str, burst_s: float, trickle_s: float) -> dict:
    with serve(preamble=QUIET_ONLY if variant == "quiet only" else "", cache_bytes=CACHE_BYTES) as (url, pid):
        return asyncio.run(drive(url, pid, burst_s, trickle_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst-s", type=float, default=20.0)
    parser.add_argument("--trickle-s", type=float, default=75.0)
    args = parser.parse_args()
    print("| trim | warm MB | after the burst | trickle: first 5 s | last 10 s | bound (warm + cache x 1.1 + 100) |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant in ("quiet only", "as shipped"):
        got = run(variant, args.burst_s, args.trickle_s)
        first = max(m for t, m in got["trickle"] if t < 5)
        end = args.trickle_s - 10
        last = max(m for t, m in got["trickle"] if t >= end)
        bound = got["warm"] + CACHE_BYTES * 1.1 / 2**20 + 100
        print(f"| {variant} | {got['warm']:,.0f} | {got['burst']:,.0f} | {first:,.0f} | {last:,.0f} | {bound:,.0f}: "
              f"{'within' if last <= bound else 'OVER'} |", flush=True)


if __name__ == "__main__":
    main()
