"""Load: 200 concurrent clients for a bounded time against a real `manyeyes serve` on loopback.

Prints p50/p99 latency, throughput, answers by status and the count of wrong results (each
answer is checked against a single unbatched run). Texts run from 3 words to 512 tokens. Every
exception (timeout, reset, refused connection) counts as a failure, as does every 5xx.
Target: zero failures and zero wrong results.

    python bench/load.py [--clients 200] [--seconds 30] [--format u8] [--cache]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter

import httpx

from live_server import matches, metric, percentile, rss_mb, serve

WORDS = (
    "the a river bank money water heron boat mill stone bridge field winter summer quiet loud teacher "
    "student paper window garden market village forest mountain valley morning evening walked saw "
    "under over near slowly quickly old new"
).split()


def sentences(n: int, seed: int = 1, longest: int = 24) -> list[str]:
    """n distinct sentences; one in four is long (up to `longest` words, about as many tokens)."""
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        words = rng.randint(3, 24) if rng.random() < 0.75 or longest <= 24 else rng.randint(25, longest)
        out.add(" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + ".")
    return sorted(out)


async def client_loop(client, texts, references, fmt, stop_at, offset, stats) -> None:
    i = offset
    while time.monotonic() < stop_at:
        text = texts[i % len(texts)]
        i += 7
        started = time.monotonic()
        try:
            r = await client.post("/api/v1/attention", json={"text": text, "format": fmt, "truncate": True})
        except Exception as exc:  # noqa: BLE001  every exception is a failure: an OOM-killed server must not read as MET
            stats["failures"][type(exc).__name__] += 1
            continue
        stats["latency"].append(time.monotonic() - started)
        stats["status"][r.status_code] += 1
        if r.status_code == 200 and not matches(r.json(), references[text]):
            stats["wrong"] += 1


async def run_load(url: str, texts, references, clients: int, seconds: float, fmt: str) -> dict:
    stats = {"latency": [], "status": Counter(), "failures": Counter(), "wrong": 0}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        started = time.monotonic()
        stop_at = started + seconds
        await asyncio.gather(*(client_loop(client, texts, references, fmt, stop_at, k, stats) for k in range(clients)))
        stats["elapsed"] = time.monotonic() - started
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--texts", type=int, default=400, help="distinct sentences, 3 to --longest words")
    parser.add_argument("--longest", type=int, default=510, help="words in the longest texts (510: 512 tokens)")
    parser.add_argument("--format", choices=("json", "f16", "u8"), default="u8")
    parser.add_argument("--cache", action="store_true", help="keep the run cache on (default off: every request runs a forward)")
    args = parser.parse_args()

    from manyeyes.model import load

    texts = sentences(args.texts, longest=args.longest)
    model = load("minilm", device="cpu")
    references = {t: model.attend(t, truncate=True) for t in texts}
    del model
    settings = {} if args.cache else {"cache_bytes": 0}
    with serve(**settings) as (url, pid):
        asyncio.run(run_load(url, texts[:8], references, 8, 3.0, args.format))  # warm-up
        names = ("manyeyes_batch_size_count", "manyeyes_batch_size_sum", "manyeyes_forward_seconds_sum")
        before = [metric(url, n) for n in names]
        stats = asyncio.run(run_load(url, texts, references, args.clients, args.seconds, args.format))
        forwards, inputs, forward_s = (metric(url, n) - b for n, b in zip(names, before))
        rss = rss_mb(pid)

    lat = [x * 1000 for x in stats["latency"]]
    done = sum(stats["status"].values())
    server_errors = sum(n for s, n in stats["status"].items() if s >= 500)
    failures = server_errors + sum(stats["failures"].values())
    print(f"load: {args.clients} clients, {stats['elapsed']:.1f} s, format={args.format}, "
          f"run cache {'on' if args.cache else 'off'}, {len(texts)} distinct sentences of up to {args.longest} words, minilm on cpu")
    print(f"  requests      {done} answered, {sum(stats['failures'].values())} failed with an exception")
    print(f"  throughput    {done / stats['elapsed']:.1f} req/s")
    print(f"  latency       p50 {percentile(lat, 50):.0f} ms   p99 {percentile(lat, 99):.0f} ms   max {max(lat, default=0):.0f} ms")
    print(f"  by status     {dict(sorted(stats['status'].items(), key=str))}")
    print(f"  5xx           {server_errors}")
    print(f"  exceptions    {dict(stats['failures']) or 0}")
    print(f"  wrong results {stats['wrong']}")
    print(f"  batching      {inputs:.0f} inputs in {forwards:.0f} forwards ({inputs / max(forwards, 1):.1f} per forward)")
    print(f"  forward busy  {100 * forward_s / stats['elapsed']:.0f}% of the wall time")
    print(f"  server RSS    {rss:.0f} MB at the end; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    ok = failures == 0 and stats["wrong"] == 0 and done > 0
    print("target (zero failures: no exception, no 5xx; zero wrong results):", "MET" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
