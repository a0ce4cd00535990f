"""What the measures cost next to the forward pass they are computed from.

For MiniLM at each T, interleaved in one run so machine noise hits every side alike:
- forward: a plain run (weights only), the baseline;
- all measures: one captured forward (q/k/v, the residual stream, out_proj's input and output)
  then rollout, value-weighted norms, head contributions, head statistics with tags, and the
  word view; its extra over the baseline;
- stats + tags: head statistics and tags alone, from a run's weights, as the server computes
  the head table of a cached run (the induction probe is per model, run before).
Prints medians and min..max of the ratio extra/forward (targets: all measures ≤ 25% at T=128,
≤ 60% at T=512; stats and tags ≤ 10%), and the load average before and after. Times are
the process's CPU time (see `ms`).

    OMP_NUM_THREADS=1 nice -n 10 python bench/measures_bench.py [--repeats 9]
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
    head_stats,
    induction_scores,
    merge_words,
    rollout,
    tag_heads,
)

WORDS = "the bank of the river was quiet while money moved through the other bank".split()


def ms(fn) -> float:
    # CPU time of this process, not wall time: on a shared machine a wall clock mostly measures
    # how long the scheduler kept us waiting (run with OMP_NUM_THREADS=1, so CPU time = work).
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    before = os.getloadavg()
    model = load("minilm", device="cpu")
    scores = induction_scores(model)
    print(f"{'T':>5} {'forward cpu ms':>14} {'all measures':>22} {'stats + tags':>22}")
    for target in (128, 512):
        # A fresh text per repeat: nothing is cached between runs.
        texts = [" ".join(WORDS[(i + r) % len(WORDS)] for i in range(target * 2)) for r in range(args.repeats + 1)]
        encs = []
        for text in texts:
            enc = model.encode(text, truncate=True)
            encs.append(type(enc)(enc.tokens[: target - 1] + enc.tokens[-1:], enc.type_ids[:target], True))

        def everything(enc):
            stream = capture_stream(model, enc)
            r = stream.result
            rollout(r.attention)
            value_weighted_norms(model, r)
            contributions(model, r, stream.mixed, stream.outputs)
            table(r)
            merge_words(r.tokens, r.attention)

        def table(r):
            stats = head_stats(r.attention, r.tokens, model.info.causal)
            stats["induction"] = scores
            tag_heads(stats, r.attention)

        everything(encs[0])
        base, full, tags = [], [], []
        for enc in encs[1:]:
            base.append(ms(lambda: model.run([enc])))
            full.append(ms(lambda: everything(enc)))
            r = model.run([enc])[0]
            tags.append(ms(lambda: table(r)))
        extra = sorted((f - b) / b for f, b in zip(full, base))
        tag_ratio = sorted(t / b for t, b in zip(tags, base))
        print(
            f"{target:>5} {statistics.median(base):>14.1f} "
            f"{statistics.median(extra):>8.0%} ({extra[0]:.0%}..{extra[-1]:.0%}) "
            f"{statistics.median(tag_ratio):>8.0%} ({tag_ratio[0]:.0%}..{tag_ratio[-1]:.0%})"
        )
    print(f"load average before {before[0]:.1f}, after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
