"""Soak: 20,000 requests against a real `manyeyes serve` on loopback; prints the server's RSS
as it goes and its growth after warm-up. Target: under 100 MB.

The mix exercises every path that could leak: new sentences (forward + cache insert + eviction
once the bounded cache is full), repeats (cache hits), all three formats, slices of cached runs,
batches, and refused requests (422, 404).

    python bench/soak.py [--requests 20000] [--concurrency 16] [--cache-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import httpx

from live_server import rss_mb, serve
from load import sentences


def request_for(i: int, texts: list[str], run_ids: list[str]) -> tuple[str, str, dict | None]:
    """The i-th request of the mix: (method, path, json body)."""
    kind = i % 10
    text = texts[(i * 7919) % len(texts)]
    if kind < 4:
        return "POST", "/api/v1/attention", {"text": text, "format": ("u8", "f16", "u8", "json")[kind], "layers": [kind % 6]}
    if kind < 6:
        return "POST", "/api/v1/attention", {"text": f"{text} ({i})", "format": "u8"}  # never seen: a forward
    if kind == 6 and run_ids:
        return "GET", f"/api/v1/runs/{run_ids[i % len(run_ids)]}/attention?format=f16&heads=1,2", None
    if kind == 7:
        return "POST", "/api/v1/attention/batch", {"texts": [text, texts[(i * 31) % len(texts)]], "format": "u8"}
    if kind == 8:
        return "POST", "/api/v1/attention", {"text": text, "layers": [99]}  # 422
    return "GET", f"/api/v1/runs/{i:032x}/attention", None  # 404


async def soak(url: str, pid: int, total: int, concurrency: int, every: int) -> dict:
    texts = sentences(3000, seed=2)
    statuses: Counter = Counter()
    samples: list[tuple[int, float]] = [(0, rss_mb(pid))]
    run_ids: list[str] = []
    counter = iter(range(total))
    done = 0
    started = time.monotonic()

    async def worker(client):
        nonlocal done
        for i in counter:
            method, path, body = request_for(i, texts, run_ids)
            r = await client.request(method, path, json=body)
            statuses[r.status_code] += 1
            if r.status_code == 200 and path == "/api/v1/attention" and len(run_ids) < 500:
                run_ids.append(r.json()["run_id"])
            done += 1
            if done % every == 0:
                samples.append((done, rss_mb(pid)))
                print(f"  {done:>6} requests  RSS {samples[-1][1]:7.1f} MB  {done / (time.monotonic() - started):6.1f} req/s", flush=True)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"statuses": statuses, "samples": samples, "elapsed": time.monotonic() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cache-mb", type=int, default=64, help="run cache bound; it fills during warm-up")
    parser.add_argument("--warmup", type=int, default=4_000, help="requests before the baseline RSS is taken")
    args = parser.parse_args()
    every = max(args.requests // 20, 1)
    with serve(cache_bytes=args.cache_mb * 2**20) as (url, pid):
        print(f"soak: {args.requests} requests, {args.concurrency} at a time, run cache {args.cache_mb} MB, minilm on cpu")
        result = asyncio.run(soak(url, pid, args.requests, args.concurrency, every))
    samples = result["samples"]
    baseline = next(rss for n, rss in samples if n >= args.warmup)
    after = [rss for n, rss in samples if n >= args.warmup]
    growth = max(after) - baseline
    server_errors = sum(n for s, n in result["statuses"].items() if s >= 500)
    print(f"  statuses      {dict(sorted(result['statuses'].items()))}")
    print(f"  throughput    {args.requests / result['elapsed']:.1f} req/s over {result['elapsed']:.0f} s")
    print(f"  RSS           start {samples[0][1]:.0f} MB, after {args.warmup} warm-up requests {baseline:.0f} MB, "
          f"end {samples[-1][1]:.0f} MB, peak after warm-up {max(after):.0f} MB")
    print(f"  growth after warm-up {growth:.1f} MB (target < 100 MB); 5xx {server_errors}")
    ok = growth < 100 and server_errors == 0
    print("target:", "MET" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
