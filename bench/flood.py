"""Flood: many connections at once asking for large answers, the server's peak RSS against its bound.

soak.py's 100 clients read their answers as they come. Here `--connections` of them (default 300)
each POST fresh texts of `--tokens` tokens (default 160) for `--seconds`, all layers and heads, in
`--format` (default json: 2 M cells, about 27 MB of text an answer), reading each answer 1 MiB at
a time (`--slow`: with a pause of 50 ms after each, as a slow link would). Before answers held a
budget (MANYEYES_ANSWER_BYTES, SECURITY.md "Memory"), the runs waiting for a render slot and the
answers waiting for their readers took the server past its bound (json, 300 connections: 3.5 GB
against 1.3 GB). Refusals (429) and deadlines (504) are the expected answers to such a crowd, and
so is a connection dropped because its answer was not read for MANYEYES_REQUEST_READ_TIMEOUT_S;
another 5xx, or a server that no longer answers, is a failure.

    python bench/flood.py [--connections 300] [--seconds 40] [--tokens 160] [--format json] [--slow] [--answer-bytes N]

Bound: RSS once ready + cache_bytes x 1.1 + MANYEYES_ANSWER_BYTES + 100 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import httpx

from gpu_bench import text_of
from live_server import serve
from soak import RssPoller, rss_of_tree

from manyeyes.app.config import Settings


async def client(http: httpx.AsyncClient, url: str, seed: int, tokens: int, fmt: str, slow: bool, stop: float,
                 answers: Counter) -> None:
    sent = 0
    while time.monotonic() < stop:
        sent += 1
        try:
            async with http.stream("POST", url, json={"text": text_of(tokens, seed + sent), "format": fmt}) as r:
                async for _ in r.aiter_raw(1 << 20):
                    if slow:
                        await asyncio.sleep(0.05)
                answers[r.status_code] += 1
        except httpx.HTTPError as exc:
            answers[type(exc).__name__] += 1


async def flood(url: str, args) -> Counter:
    answers: Counter = Counter()
    stop = time.monotonic() + args.seconds
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http, f"{url}/api/v1/attention", 10**6 * (i + 1), args.tokens, args.format, args.slow,
                                      stop, answers) for i in range(args.connections)))
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--format", default="json", choices=("json", "f16", "u8"))
    parser.add_argument("--slow", action="store_true", help="read each MiB of an answer, then pause 50 ms")
    parser.add_argument("--answer-bytes", type=int, default=None, help="MANYEYES_ANSWER_BYTES (default: the server's, 256 MiB)")
    args = parser.parse_args()
    settings = {} if args.answer_bytes is None else {"answer_bytes": args.answer_bytes}
    defaults = Settings()
    budget = defaults.answer_bytes if args.answer_bytes is None else args.answer_bytes
    poller = RssPoller()  # soak.py's: every 50 ms from the moment the server's process starts
    with serve(on_spawn=poller.watch, **settings) as (url, pid):
        warm = poller.now()
        started = time.monotonic()
        try:
            answers = asyncio.run(flood(url, args))
        finally:
            poller.stop.set()
            poller.join()
        peak, end = poller.peak(started), rss_of_tree(pid)
        alive = httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    bound = warm + defaults.cache_bytes * 1.1 / 2**20 + budget / 2**20 + 100  # MiB, as rss_mb reads them
    server_errors = sum(n for status, n in answers.items() if isinstance(status, int) and status >= 500 and status != 504)
    broken = sum(n for status, n in answers.items() if not isinstance(status, int))
    print(f"flood: {args.connections} connections, {args.seconds:g} s, {args.tokens} tokens, format={args.format}"
          f"{', slow readers' if args.slow else ''}, answer budget {budget / 2**20:.0f} MiB")
    print(f"  answers  {dict(answers)}")
    print(f"  RSS      ready {warm:.0f} MiB, peak {peak:.0f} MiB, end {end:.0f} MiB; bound {bound:.0f} MiB")
    # A connection the server dropped is an answer its reader took nothing of for
    # MANYEYES_REQUEST_READ_TIMEOUT_S (this one process reads them all): counted, not a failure.
    print(f"  server   {'answers /healthz' if alive else 'GONE'}; {server_errors} 5xx besides 504; {broken} connections broken")
    met = peak <= bound and server_errors == 0 and alive
    print(f"target (peak within the bound, no 5xx but 504, the server alive): {'MET' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
