"""The server's forward pass in two checkouts side by side: this one against a git revision.

Each side is a process of its own, importing its own checkout, that loads MiniLM and runs what
the server's batcher runs for one request (`run([encoded], Capture(hidden=False))`: every layer's
weights, the last block stopped at its softmax). The parent hands both the same new sentence,
alternating which goes first, and waits `--pause` seconds before each forward so that the other
process's OpenMP threads have stopped spinning (a forward right after the other process's took
nearly twice as long on this 2-core machine). Prints median milliseconds per side, the ratio of
medians new/base (below 1.0 is faster) and the spread of the per-pair ratios (p25-p75).

    python bench/ab_forward.py [--base HEAD~1] [--lengths 16,128,256,512] [--rounds 15] [--allocator default]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs inside each checkout (its cwd), so `manyeyes` is that checkout's code.
CHILD = r"""
import sys, time
sys.path.insert(1, "bench")
from serve_bench import sentence
from manyeyes.model import load
from manyeyes.model.attention import Capture
if sys.argv[1] == "server":  # the allocator setting the server starts with (app/memory.py)
    from manyeyes.app.config import Settings
    from manyeyes.app.memory import tune_malloc
    from manyeyes.model import buffers
    settings = Settings()
    # A base checkout older than the trim threshold and the buffer pool runs as it was.
    if hasattr(settings, "malloc_trim_threshold"):
        tune_malloc(settings.malloc_mmap_threshold, settings.malloc_trim_threshold)
    else:
        tune_malloc(settings.malloc_mmap_threshold)
    if hasattr(buffers, "keep_free_mappings"):
        buffers.keep_free_mappings(settings.buffer_pool_bytes)
        buffers.advise_huge_pages(settings.huge_pages)
model = load("minilm", device="cpu")
capture = Capture(hidden=False)
print("ready", flush=True)
for line in sys.stdin:
    tokens, seed = map(int, line.split())
    encoded = model.encode(sentence(tokens, seed, model.encode), truncate=True)
    started = time.perf_counter()
    model.run([encoded], capture)
    print(f"{(time.perf_counter() - started) * 1000:.4f} {len(encoded)}", flush=True)
"""


class Side:
    def __init__(self, checkout: Path, allocator: str):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, allocator], cwd=checkout, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the forward process in {checkout} did not start")

    def forward(self, tokens: int, seed: int) -> float:
        self.proc.stdin.write(f"{tokens} {seed}\n")
        self.proc.stdin.flush()
        ms, length = self.proc.stdout.readline().split()
        assert int(length) == tokens, (length, tokens)
        return float(ms)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare against")
    parser.add_argument("--lengths", default="16,128,256,512")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pause", type=float, default=0.3)
    parser.add_argument("--allocator", choices=("server", "default"), default="server",
                        help="glibc malloc as the server sets it (default), or as a plain script has it")
    args = parser.parse_args()
    revision = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp, "base")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base_dir), revision], cwd=ROOT, check=True)
        try:
            sides = {"new": Side(ROOT, args.allocator), "base": Side(base_dir, args.allocator)}
            print(f"this checkout (new) against {revision} (base); {args.rounds} rounds a length, pause {args.pause} s, "
                  f"{args.allocator} allocator")
            print(f"{'T':>5} {'new ms':>9} {'base ms':>9} {'ratio':>7} {'p25-p75':>11}")
            for tokens in map(int, args.lengths.split(",")):
                times = {name: [] for name in sides}
                for i in range(args.rounds + 1):  # the first round warms both up and is not counted
                    order = list(sides) if i % 2 else list(sides)[::-1]
                    for name in order:
                        time.sleep(args.pause)
                        ms = sides[name].forward(tokens, 10_000 * tokens + i)
                        if i:
                            times[name].append(ms)
                new, base = statistics.median(times["new"]), statistics.median(times["base"])
                pairs = sorted(a / b for a, b in zip(times["new"], times["base"]))
                q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
                print(f"{tokens:>5} {new:>9.2f} {base:>9.2f} {new / base:>7.2f} {q1:>6.2f}-{q3:.2f}", flush=True)
            for side in sides.values():
                side.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
