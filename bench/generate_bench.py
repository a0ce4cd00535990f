"""Generation on tiny-gpt: milliseconds per new token with the key/value cache against a full
recompute of the sequence each step, interleaved in one run (target: ≤ 5 ms per token with the
cache, on CPU). Each repeat uses a fresh prompt. Prints median and min..max.

Then, against a live `manyeyes serve` (tiny-gpt only), the time from sending POST /api/v1/generate
to reading its first `step` line (target: ≤ 150 ms), and ms per token as the client reads them.
The machine's load average is printed before and after: on a shared machine it explains the spread.

    python bench/generate_bench.py [--tokens 64] [--repeats 5] [--no-live]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx

from manyeyes.model import load
from manyeyes.model.generate import generate

PROMPTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
    "And God called the light Day, and the darkness he called Night.",
    "And the evening and the morning were the first day.",
]


def per_token_ms(model, prompt: str, tokens: int, use_cache: bool) -> tuple[float, float]:
    """(ms per token after the first, ms to the first token)."""
    t0 = time.perf_counter()
    first = None
    for step in generate(model, prompt, tokens, use_cache=use_cache):
        if first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (total - first) * 1000 / (tokens - 1), first * 1000


def show(xs):
    return f"{statistics.median(xs):7.2f} ({min(xs):.2f}..{max(xs):.2f})"


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def live(tokens: int, repeats: int) -> None:
    """Time to the first streamed step, and ms per streamed token, through a real server."""
    from bench.live_server import serve

    with serve(models=json.dumps({"tiny-gpt": "tiny-gpt"}), max_new_tokens=max(tokens, 1)) as (url, _pid):
        with httpx.Client(timeout=60) as client:

            def one(prompt: str) -> tuple[float, float]:
                body = {"text": prompt, "model": "tiny-gpt", "max_new_tokens": tokens}
                t0 = time.perf_counter()
                first = None
                count = 0
                with client.stream("POST", f"{url}/api/v1/generate", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line and json.loads(line)["type"] == "step":
                            count += 1
                            if first is None:
                                first = time.perf_counter() - t0
                total = time.perf_counter() - t0
                assert count == tokens, count
                return first * 1000, (total - first) * 1000 / max(tokens - 1, 1)

            one(PROMPTS[0])  # warm-up: connection, first forward
            firsts, per_token = [], []
            for r in range(repeats):
                first, ms = one(PROMPTS[(r + 1) % len(PROMPTS)] + f" [{r}]")
                firsts.append(first)
                per_token.append(ms)
    print(f"live server, POST /api/v1/generate, {tokens} new tokens, {repeats} prompts")
    print(f"  first step     ms       {show(firsts)}   (target ≤ 150)")
    print(f"  streamed       ms/token {show(per_token)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-live", action="store_true", help="skip the live-server measurement")
    args = parser.parse_args()
    print(load_average())
    model = load("tiny-gpt", device="cpu")
    per_token_ms(model, PROMPTS[0], 4, True)  # warm-up
    cached, recomputed, firsts = [], [], []
    for r in range(args.repeats):
        prompt = PROMPTS[r % len(PROMPTS)] + f" ({r})"
        ms, first = per_token_ms(model, prompt, args.tokens, True)
        cached.append(ms)
        firsts.append(first)
        recomputed.append(per_token_ms(model, prompt, args.tokens, False)[0])

    print(f"tiny-gpt, {args.tokens} new tokens, {args.repeats} prompts")
    print(f"  with cache     ms/token {show(cached)}")
    print(f"  recompute      ms/token {show(recomputed)}")
    print(f"  speed-up       {statistics.median(r / c for r, c in zip(recomputed, cached)):.1f}x")
    print(f"  first token    ms       {show(firsts)}")
    if not args.no_live:
        live(args.tokens, args.repeats)
    print(load_average())


if __name__ == "__main__":
    main()
