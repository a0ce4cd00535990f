"""Generation on tiny-gpt: milliseconds per new token with the key/value cache against a full
recompute of the sequence each step, interleaved in one run (target: ≤ 5 ms per token with the
cache, on CPU). Each repeat uses a fresh prompt. Prints median and min..max.

    python bench/generate_bench.py [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = load("tiny-gpt", device="cpu")
    per_token_ms(model, PROMPTS[0], 4, True)  # warm-up
    cached, recomputed, firsts = [], [], []
    for r in range(args.repeats):
        prompt = PROMPTS[r % len(PROMPTS)] + f" ({r})"
        ms, first = per_token_ms(model, prompt, args.tokens, True)
        cached.append(ms)
        firsts.append(first)
        recomputed.append(per_token_ms(model, prompt, args.tokens, False)[0])

    def show(xs):
        return f"{statistics.median(xs):7.2f} ({min(xs):.2f}..{max(xs):.2f})"

    print(f"tiny-gpt, {args.tokens} new tokens, {args.repeats} prompts")
    print(f"  with cache     ms/token {show(cached)}")
    print(f"  recompute      ms/token {show(recomputed)}")
    print(f"  speed-up       {statistics.median(r / c for r, c in zip(recomputed, cached)):.1f}x")
    print(f"  first token    ms       {show(firsts)}")


if __name__ == "__main__":
    main()
