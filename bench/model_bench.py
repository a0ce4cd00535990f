"""Our forward-with-weights against transformers' eager forward with output_attentions=True.

Same weights, same token ids, measured interleaved in one run so machine noise hits both sides
alike. Two models: MiniLM (BERT, the built-in) and a llama-family decoder of MiniLM's size with
grouped-query attention (6 layers, 12 query heads, 4 key/value heads, width 384, random weights,
a 4096-token vocabulary so the lm head does not drown the attention; both sides compute the
top-20 predictions our runtime returns). Prints median milliseconds,
the ratio of medians ours/theirs (target: <= 1.0) and the spread of the per-pair ratios (p25-p75).

    python bench/model_bench.py [--repeats 15] [--threads N] [--only minilm|llama] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


# perf_counter: wall time. process_time: CPU time of this process only, which other people's jobs on
# a shared machine disturb far less (both sides are measured alike, so the ratio stays like for like).
CLOCK = time.perf_counter


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        out.append((CLOCK() - t0) * 1000)
    return out


def side_by_side(run_ours, run_theirs, repeats: int) -> tuple[list[float], list[float]]:
    for fn in (run_ours, run_theirs):  # warm-up
        fn()
    mine, refs = [], []
    for _ in range(repeats):  # interleaved, so drift affects both alike
        mine += timed(run_ours, 1)
        refs += timed(run_theirs, 1)
    return mine, refs


def report(target: int, mine: list[float], refs: list[float]) -> None:
    a, b = statistics.median(mine), statistics.median(refs)
    pairs = sorted(m / r for m, r in zip(mine, refs))
    q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
    print(f"{target:>5} {a:>9.2f} {b:>10.2f} {a / b:>7.2f} {q1:>6.2f}-{q3:.2f}")


HEADER = f"{'T':>5} {'ours ms':>9} {'theirs ms':>10} {'ratio':>7} {'p25-p75':>11}"


def bench_minilm(repeats: int) -> None:
    from transformers import BertModel

    from manyeyes.model import load
    from manyeyes.model.loading import builtin_path

    ours = load("minilm", device="cpu")
    theirs = BertModel.from_pretrained(str(builtin_path("minilm")), attn_implementation="eager").eval()
    words = "the bank of the river was quiet while money moved through the other bank".split()

    print("\nMiniLM (bert, 6 layers x 12 heads, width 384)")
    print(HEADER)
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

        report(target, *side_by_side(run_ours, run_theirs, repeats))


def llama_folder(folder: Path, words: list[str]) -> None:
    """A random-weight llama with GQA (12 query heads over 4 key/value heads) and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *sorted(set(words))])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=4096, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def bench_llama(repeats: int) -> None:
    from transformers import LlamaForCausalLM

    from manyeyes.model import load

    words = "the bank of the river was quiet while money moved through the other bank".split()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        llama_folder(folder, words)
        ours = load(folder, device="cpu")
        theirs = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()

    print("\nllama-family (6 layers, 12 query heads / 4 kv heads, width 384, vocab 4096, logits on both sides)")
    print(HEADER)
    for target in (128, 512):
        enc = ours.encode(" ".join(words[i % len(words)] for i in range(target)))
        ids = torch.tensor([enc.ids])
        assert ids.shape[1] == target

        def run_ours():
            ours.run([enc])

        def run_theirs():
            with torch.inference_mode():
                logits = theirs(ids, output_attentions=True).logits
                # Our run() also hands back the top-20 next tokens; theirs does the same work here.
                top = logits.topk(20, dim=-1)
                (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()

        report(target, *side_by_side(run_ours, run_theirs, repeats))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    parser.add_argument("--only", choices=("minilm", "llama"), help="run one model only")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time (loaded machines)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock")
    if args.only in (None, "minilm"):
        bench_minilm(args.repeats)
    if args.only in (None, "llama"):
        bench_llama(args.repeats)


if __name__ == "__main__":
    main()
