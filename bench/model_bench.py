"""Our forward-with-weights against transformers' eager forward with output_attentions=True.

Same MiniLM weights, same token ids, measured interleaved in one run so machine noise hits
both sides alike. Prints median milliseconds and the ratio ours/theirs (target: <= 1.0).

    python bench/model_bench.py [--repeats 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import BertModel

    from manyeyes.model import load
    from manyeyes.model.loading import builtin_path

    ours = load("minilm", device="cpu")
    theirs = BertModel.from_pretrained(str(builtin_path("minilm")), attn_implementation="eager").eval()
    words = "the bank of the river was quiet while money moved through the other bank".split()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'T':>5} {'ours ms':>9} {'theirs ms':>10} {'ratio':>7}")
    for target in (16, 64, 128, 512):
        enc = ours.encode(" ".join(words[i % len(words)] for i in range(target * 2)), truncate=True)
        enc = type(enc)(enc.tokens[: target - 1] + enc.tokens[-1:], enc.type_ids[:target], True)
        ids = torch.tensor([enc.ids])
        assert ids.shape[1] == target

        def run_ours():
            ours.run([enc])

        def run_theirs():
            with torch.inference_mode():
                theirs(ids, output_attentions=True)

        for fn in (run_ours, run_theirs):  # warm-up
            fn()
        mine, refs = [], []
        for _ in range(args.repeats):  # interleaved, so drift affects both alike
            mine += timed(run_ours, 1)
            refs += timed(run_theirs, 1)
        a, b = statistics.median(mine), statistics.median(refs)
        print(f"{target:>5} {a:>9.2f} {b:>10.2f} {a / b:>7.2f}")


if __name__ == "__main__":
    main()
