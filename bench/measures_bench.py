"""What the measures cost next to the forward pass they are computed from.

For MiniLM at each T, interleaved in one run so machine noise hits every side alike, a fresh
text per repeat:
- forward: a plain run (weights only), the baseline;
- capture: one captured forward (q/k/v, the residual stream, out_proj's input and output);
- then, each timed on its own from that capture: rollout, value-weighted norms, head
  contributions, the head table (statistics and tags, as the server computes it for a run;
  the induction probe is per model, run before) and the word view.
All measures = (capture - forward, at least 0) + the five parts. Each part is a median over the repeats, and
so is the forward: a per-repeat difference of two ~40 ms forwards whose noise on this machine is
±5 ms each buried a ~9 ms cost (per-repeat ratios of 11%..51% in one run). The min..max of the
per-repeat ratios is printed beside each median, and the parts' medians under it.
Targets: all measures ≤ 25% at T=128 and ≤ 60% at T=512; stats and tags ≤ 10%. Times are the
process's CPU time (see `timed`); the load average before and after is printed.

    OMP_NUM_THREADS=1 nice -n 10 python bench/measures_bench.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from manyeyes.model import load
from manyeyes.model.analysis import value_weighted_norms
from manyeyes.model.measures import (
    capture_stream,
    contributions,
    head_table,
    induction_scores,
    merge_words,
    rollout,
)

WORDS = "the bank of the river was quiet while money moved through the other bank".split()


def timed(fn):
    """(CPU ms, fn's result). CPU time of this process, not wall time: on a shared machine a wall
    clock mostly measures how long the scheduler kept us waiting (run with OMP_NUM_THREADS=1, so
    CPU time = work)."""
    t0 = time.process_time()
    out = fn()
    return (time.process_time() - t0) * 1000, out


def ms(fn) -> float:
    return timed(fn)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    before = os.getloadavg()
    model = load("minilm", device="cpu")
    induction_scores(model)  # the probe is per model, kept on it: head_table reuses it
    print(f"{'T':>5} {'forward cpu ms':>14} {'all measures':>22} {'stats + tags':>22}")
    for target in (128, 512):
        # A fresh text per repeat: nothing is cached between runs.
        texts = [" ".join(WORDS[(i + r) % len(WORDS)] for i in range(target * 2)) for r in range(args.repeats + 1)]
        encs = []
        for text in texts:
            enc = model.encode(text, truncate=True)
            encs.append(type(enc)(enc.tokens[: target - 1] + enc.tokens[-1:], enc.type_ids[:target], True))

        parts = {
            "rollout": lambda s: rollout(s.result.attention),
            "value norms": lambda s: value_weighted_norms(model, s.result),
            "contributions": lambda s: contributions(model, s.result, s.mixed, s.outputs),
            "stats + tags": lambda s: head_table(model, s.result),
            "words": lambda s: merge_words(s.result.tokens, s.result.attention),
        }
        stream = capture_stream(model, encs[0])  # first calls: compile, caches
        for part in parts.values():
            part(stream)
        times = {name: [] for name in ("forward", "capture", *parts)}
        for enc in encs[1:]:
            times["forward"].append(ms(lambda: model.run([enc])))
            elapsed, stream = timed(lambda: capture_stream(model, enc))
            times["capture"].append(elapsed)
            for name, part in parts.items():
                times[name].append(ms(lambda: part(stream)))
        median = {name: statistics.median(values) for name, values in times.items()}
        # A capture does all a plain forward does and keeps more: a negative median difference is noise.
        capture_extra = max(0.0, median["capture"] - median["forward"])
        extra = capture_extra + sum(median[name] for name in parts)
        per_repeat = sorted(
            (times["capture"][i] - times["forward"][i] + sum(times[name][i] for name in parts)) / times["forward"][i]
            for i in range(args.repeats)
        )
        tag_ratio = sorted(t / b for t, b in zip(times["stats + tags"], times["forward"]))
        print(
            f"{target:>5} {median['forward']:>14.1f} "
            f"{extra / median['forward']:>8.0%} ({per_repeat[0]:.0%}..{per_repeat[-1]:.0%}) "
            f"{median['stats + tags'] / median['forward']:>8.0%} ({tag_ratio[0]:.0%}..{tag_ratio[-1]:.0%})"
        )
        print("      parts, median ms: " + ", ".join(
            f"{name} {capture_extra if name == 'capture' else median[name]:.1f}" for name in ("capture", *parts)))
    print(f"load average before {before[0]:.1f}, after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
