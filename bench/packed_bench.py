"""The forward with oneDNN-packed linears (model/packed.py, the default on CPU) against the same
model with plain F.linear (MKL), both ours, same weights and token ids, interleaved in one run.

Two measures per length: the whole `run()` (what a request waits for) and the model's linears
alone (the part packing changes). Prints median milliseconds, the ratio of medians packed/plain
(below 1.0 is faster) and the spread of the per-pair ratios (p25-p75).

    python bench/packed_bench.py [--repeats 30] [--lengths 16,64,128,512]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_bench import HEADER, report, side_by_side  # noqa: E402

from manyeyes.model import load  # noqa: E402
from manyeyes.model.attention import Capture  # noqa: E402

WORDS = "the bank of the river was quiet while money moved through the other bank".split()


def linears_alone(model, tokens: int):
    """Every linear of the stack once, on inputs of the width it takes: the linears' share of a forward."""
    linears = [m for block in model.net.trf_blocks for m in block.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(tokens, m.in_features) for m in linears]

    def run():
        with torch.inference_mode():
            for linear, x in zip(linears, inputs):
                linear(x)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--lengths", default="16,64,128,512")
    args = parser.parse_args()

    packed, plain = load("minilm", device="cpu"), load("minilm", device="cpu", pack=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; MiniLM, packed vs plain linears")
    for title, measure in (("whole run()", "run"), ("linears alone", "linears")):
        print(f"\n{title}: 'ours' is packed, 'theirs' is plain")
        print(HEADER)
        for target in (int(t) for t in args.lengths.split(",")):
            if measure == "linears":
                report(target, *side_by_side(linears_alone(packed, target), linears_alone(plain, target), args.repeats))
                continue
            rng = random.Random(target)
            enc = packed.encode(" ".join(rng.choice(WORDS) for _ in range(target)), truncate=True)
            enc = type(enc)(enc.tokens[: target - 1] + enc.tokens[-1:], enc.type_ids[:target], True)
            assert len(enc.tokens) == target
            report(target, *side_by_side(lambda: packed.run([enc], Capture(hidden=False)),
                                         lambda: plain.run([enc], Capture(hidden=False)), args.repeats))


if __name__ == "__main__":
    main()
