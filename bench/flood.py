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
                          [--route attention|measures|slice|mean|tile]

`--route measures|slice|mean|tile` floods a GET of one cached run (of `--tokens` tokens, made
first) instead: each request still encodes an answer of its own.

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


# GET routes that answer from one cached run (made once, before the flood): each request still
# encodes an answer of its own. `names` for /measures: the largest (L, H, T, T) matrices.
RUN_ROUTES = {
    "measures": "/api/v1/runs/{run}/measures?names=value_norms,words&format={fmt}",
    "slice": "/api/v1/runs/{run}/attention?format={fmt}",
    "mean": "/api/v1/runs/{run}/mean?format={fmt}",
    "tile": "/api/v1/runs/{run}/tile?layer=0&head=mean&format={fmt}",
}


def request_of(args, url: str, run_id: str | None, seed: int, sent: int) -> tuple[str, str, dict | None]:
    if args.route == "attention":
        return "POST", f"{url}/api/v1/attention", {"text": text_of(args.tokens, seed + sent), "format": args.format}
    return "GET", url + RUN_ROUTES[args.route].format(run=run_id, fmt=args.format), None


async def client(http: httpx.AsyncClient, args, url: str, run_id: str | None, seed: int, stop: float,
                 answers: Counter) -> None:
    sent, slow = 0, args.slow
    while time.monotonic() < stop:
        sent += 1
        method, address, body = request_of(args, url, run_id, seed, sent)
        try:
            async with http.stream(method, address, json=body) as r:
                async for _ in r.aiter_raw(1 << 20):
                    if slow:
                        await asyncio.sleep(0.05)
                answers[r.status_code] += 1
        except httpx.HTTPError as exc:
            answers[type(exc).__name__] += 1


def one_run(url: str, tokens: int) -> str:
    """The cached run the GET routes read (float32 weights: a CPU server keeps them so)."""
    r = httpx.post(f"{url}/api/v1/attention", json={"text": text_of(tokens, 1), "format": "u8", "layers": [0], "heads": [0]},
                   timeout=120)
    r.raise_for_status()
    return r.json()["run_id"]


async def flood(url: str, args, run_id: str | None) -> Counter:
    answers: Counter = Counter()
    stop = time.monotonic() + args.seconds
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http, args, url, run_id, 10**6 * (i + 1), stop, answers)
                               for i in range(args.connections)))
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--format", default="json", choices=("json", "f16", "u8"))
    parser.add_argument("--route", default="attention", choices=("attention", *RUN_ROUTES),
                        help="POST /attention with fresh texts, or a GET of one cached run's measures, slice, mean or tile")
    parser.add_argument("--slow", action="store_true", help="read each MiB of an answer, then pause 50 ms")
    parser.add_argument("--answer-bytes", type=int, default=None, help="MANYEYES_ANSWER_BYTES (default: the server's, 256 MiB)")
    args = parser.parse_args()
    settings = {} if args.answer_bytes is None else {"answer_bytes": args.answer_bytes}
    defaults = Settings()
    budget = defaults.answer_bytes if args.answer_bytes is None else args.answer_bytes
    poller = RssPoller()  # soak.py's: every 50 ms from the moment the server's process starts
    with serve(on_spawn=poller.watch, **settings) as (url, pid):
        run_id = None if args.route == "attention" else one_run(url, args.tokens)
        warm = poller.now()
        started = time.monotonic()
        try:
            answers = asyncio.run(flood(url, args, run_id))
        finally:
            poller.stop.set()
            poller.join()
        peak, end = poller.peak(started), rss_of_tree(pid)
        alive = httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    bound = warm + defaults.cache_bytes * 1.1 / 2**20 + budget / 2**20 + 100  # MiB, as rss_mb reads them
    server_errors = sum(n for status, n in answers.items() if isinstance(status, int) and status >= 500 and status != 504)
    broken = sum(n for status, n in answers.items() if not isinstance(status, int))
    print(f"flood: {args.route}, {args.connections} connections, {args.seconds:g} s, {args.tokens} tokens, format={args.format}"
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
