"""Long inputs (issue 10): what a run that keeps queries and keys costs next to the forward pass.

For each model and T, against a real `manyeyes serve` (CPU, warm-up off, one server per case):
- POST to answer: wall time of POST /api/v1/attention (keep=auto, so qk above dense_max_tokens),
  a fresh text each time, interleaved with the same forward run here, in this process, on the same
  tokens: `model.run([enc], Capture(keep=True))`. Prints the median ratio and its min..max, and
  the server's own forward time from the answer's timing_ms (what of the POST is not the forward).
  Beside them the bare forward the issue measures against: the network's own call, logits only
  (`model.net(ids)`, which captures nothing), so the ratio to it shows what keeping costs.
- memory: the run's bytes as the cache counts them (GET /api/v1/runs/{id}), and the server's RSS
  growth per cached run (slope over the POSTs), each over the run's query + key bytes.
- peak RSS: the server's VmHWM after its first long forward, minus its RSS when ready.

Models: a random-weight llama (6 layers, 12 query heads, 4 key/value heads, width 384) at
T = 4096 and 8192, and at T = 2048 `tiny-llama` when it is built in, else a random llama of
tiny-gpt's shape with rotary positions (4 layers, 8 heads, 4 kv heads, width 256), said so in
the output. Both use tiny-gpt's byte-level tokenizer (one token per byte, as tiny-llama's).

    nice -n 10 python bench/long_bench.py [--repeats 3] [--sizes 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import rss_mb, serve  # noqa: E402

from manyeyes.model import Capture, load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river bank was quiet while money moved through the other bank and a fox looked back at the dog "
         "who had seen it all before in the long summer of that year").split()


def random_llama(folder: Path, positions: int, layers: int, heads: int, kv_heads: int, width: int) -> Path:
    """A random-weight llama folder with tiny-gpt's byte tokenizer. transformers only writes the
    folder (save_pretrained), as the tests do; manyeyes loads it with its own llama family."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = ROOT / "model" / "data" / "tiny-gpt" / "tokenizer.json"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=4 * width, max_position_embeddings=positions,
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer, folder / "tokenizer.json")
    return folder


def text_of(n_tokens: int, seed: int, model) -> str:
    """Fresh words, cut to exactly n_tokens tokens."""
    rng = random.Random(seed)
    text = ""
    while len(model.encode(text, truncate=True)) < n_tokens and len(text) < 8 * n_tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(n_tokens // 4)) + ". "
    lo, hi = 1, len(text)
    while lo < hi:  # the shortest prefix that has n_tokens tokens
        mid = (lo + hi) // 2
        if len(model.encode(text[:mid], truncate=True)) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return text[:lo]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def bench_case(name: str, spec: str, n_tokens: int, repeats: int, untimed: int = 1) -> dict:
    model = load(spec, device="cpu")
    texts = [text_of(n_tokens, seed, model) for seed in range(repeats + untimed)]
    post_s, server_s, bare_s, net_s, rss, nbytes, qk_bytes = [], [], [], [], [], [], 0
    settings = dict(warmup="false", dense_max_tokens=1024, request_timeout_s=900)
    with serve(models=json.dumps({name: spec}), **settings) as (url, pid):
        ready_rss = rss_mb(pid)
        with httpx.Client(base_url=url, timeout=600) as http:
            for i, text in enumerate(texts):
                encoded = model.encode(text, truncate=True)
                assert len(encoded) == n_tokens, len(encoded)
                # Interleaved: the server's forward and this one see the same machine, one after the other.
                started = time.perf_counter()
                r = http.post("/api/v1/attention", json={"text": text, "model": name, "truncate": True})
                took = time.perf_counter() - started
                r.raise_for_status()
                body = r.json()
                assert body["kept"] == "qk" and body["attention"] is None, body.get("kept")
                started = time.perf_counter()
                result = model.run([encoded], Capture(keep=True))[0]
                bare = time.perf_counter() - started
                ids = torch.tensor([encoded.ids])
                started = time.perf_counter()
                with torch.inference_mode():
                    model.net(ids)
                net_forward = time.perf_counter() - started
                kept = result.kept
                qk_bytes = kept.queries.numel() * kept.queries.element_size() + kept.keys.numel() * kept.keys.element_size()
                del result, kept
                info = http.get(f"/api/v1/runs/{body['run_id']}").json()
                nbytes.append(info["nbytes"])
                rss.append(rss_mb(pid))
                if i == 0:  # after one forward and nothing else: the forward's peak
                    peak = rss_mb(pid, "VmHWM") - ready_rss
                if i < untimed:  # the first of each side pays one-time costs
                    continue
                post_s.append(took)
                server_s.append(body["timing_ms"]["forward"] / 1000)  # the server's own forward, within the POST
                bare_s.append(bare)
                net_s.append(net_forward)
    # The slope over the cached runs; from one run, its growth over the ready server (one-time
    # allocations included: an upper bound).
    per_run_mb = (rss[-1] - rss[0]) / (len(rss) - 1) if len(rss) > 1 else rss[0] - ready_rss
    return {
        "name": name, "T": n_tokens, "post_s": post_s, "server_s": server_s, "bare_s": bare_s,
        "ratio": [p / b for p, b in zip(post_s, bare_s)], "net_s": net_s,
        "net_ratio": [p / b for p, b in zip(post_s, net_s)], "qk_mb": qk_bytes / 2**20,
        "cache_ratio": statistics.median(nbytes) / qk_bytes, "rss_per_run_ratio": per_run_mb * 2**20 / qk_bytes,
        "peak_mb": peak, "ready_mb": ready_rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="2048,4096,8192")
    # 0 on a crowded machine: at T=8192 a forward is minutes of CPU there, and one-time costs are noise.
    parser.add_argument("--untimed", type=int, default=1, help="pairs run first and not timed")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        if 2048 in sizes:
            cases.append(("tiny-llama", "tiny-llama", 2048))
        big = [n for n in sizes if n != 2048]
        if big:
            folder = random_llama(Path(tmp) / "big", max(big), layers=6, heads=12, kv_heads=4, width=384)
            cases += [("llama-6x12", str(folder), n) for n in big]
        print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores); {args.repeats} timed pairs after {args.untimed} untimed")
        print(f"{'model':>12} {'T':>5} {'POST s':>16} {'its forward s':>16} {'forward s':>16} {'POST/forward':>18} "
              f"{'bare net s':>16} {'POST/bare':>18} {'q+k MB':>7} "
              f"{'cache/qk':>8} {'RSS/run/qk':>10} {'peak MB':>8}")
        for name, spec, n in cases:
            row = bench_case(name, spec, n, args.repeats, args.untimed)
            print(f"{row['name']:>12} {row['T']:>5} {spread(row['post_s']):>16} {spread(row['server_s']):>16} "
                  f"{spread(row['bare_s']):>16} "
                  f"{spread(row['ratio']):>18} {spread(row['net_s']):>16} {spread(row['net_ratio']):>18} {row['qk_mb']:>7.1f} {row['cache_ratio']:>8.2f} "
                  f"{row['rss_per_run_ratio']:>10.2f} {row['peak_mb']:>8.0f}", flush=True)
        print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
