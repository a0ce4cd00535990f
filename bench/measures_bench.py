"""What the measures cost next to the forward pass they are computed from.

For MiniLM at each T, interleaved in one run so machine noise hits every side alike:
- forward: a plain run (weights only), the baseline;
- all measures: one captured forward (q/k/v, the residual stream, out_proj's input and output,
  the row entropies) then rollout, value-weighted norms, head contributions, head statistics
  with tags, and the word view; its extra over the baseline;
- stats + tags: what the served path pays for the head table: a forward that also hands back
  each row's entropy (as the server's batcher runs it), then the statistics and tags from that
  run; its extra over the baseline (the induction probe is per model, run before).
Prints medians and min..max of the ratio extra/forward (targets: all measures ≤ 25% at T=128,
≤ 60% at T=512; stats and tags ≤ 10%), and the load average before and after.

    OMP_NUM_THREADS=1 nice -n 10 python bench/measures_bench.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from manyeyes.model import Capture, load
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
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    before = os.getloadavg()
    model = load("minilm", device="cpu")
    scores = induction_scores(model)
    print(f"{'T':>5} {'forward ms':>11} {'all measures':>22} {'stats + tags':>22}")
    for target in (128, 512):
        # A fresh text per repeat: nothing is cached between runs.
        texts = [" ".join(WORDS[(i + r) % len(WORDS)] for i in range(target * 2)) for r in range(args.repeats + 1)]
        encs = []
        for text in texts:
            enc = model.encode(text, truncate=True)
            encs.append(type(enc)(enc.tokens[: target - 1] + enc.tokens[-1:], enc.type_ids[:target], True))

        def everything(enc):
            stream = capture_stream(model, enc, Capture(qkv=True, entropy=True))
            r = stream.result
            rollout(r.attention)
            value_weighted_norms(model, r)
            contributions(model, r, stream.mixed, stream.outputs)
            table(r)
            merge_words(r.tokens, r.attention)

        def table(r):
            stats = head_stats(r.attention, r.tokens, model.info.causal, r.entropy)
            stats["induction"] = scores
            tag_heads(stats, r.attention)

        def served_table(enc):
            table(model.run([enc], Capture(entropy=True))[0])

        everything(encs[0])
        served_table(encs[0])
        base, full, tags = [], [], []
        for enc in encs[1:]:
            base.append(ms(lambda: model.run([enc])))
            full.append(ms(lambda: everything(enc)))
            tags.append(ms(lambda: served_table(enc)))
        extra = sorted((f - b) / b for f, b in zip(full, base))
        tag_ratio = sorted((t - b) / b for t, b in zip(tags, base))
        print(
            f"{target:>5} {statistics.median(base):>11.1f} "
            f"{statistics.median(extra):>8.0%} ({extra[0]:.0%}..{extra[-1]:.0%}) "
            f"{statistics.median(tag_ratio):>8.0%} ({tag_ratio[0]:.0%}..{tag_ratio[-1]:.0%})"
        )
    print(f"load average before {before[0]:.1f}, after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
