"""The accelerator path, end to end: `manyeyes serve --device cuda` against the bare forward.

Prints
  - the server's own time for one request at T=128, batch 1 (goal: <= 10 ms on an H200), from its
    access log (request in to last byte out), with the forward beside it;
  - batched throughput at T=16, 128 and 512 (64 concurrent clients, fresh texts, format=u8 as raw
    frames) against the bare batch-64 forward of the same model, in inputs per second
    (goal: >= 50% of the bare rate).
Every text is new, so the run cache never answers. Runs on the CPU too (--device cpu), where the
figures only prove the script; the goals are for a GPU.

    python bench/gpu_bench.py [--device cuda] [--autocast off|float16|bfloat16] [--seconds 10]
                              [--workers N] [--threads T] [--configs "1;8;8x1"] [--load-procs P]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import access_ms, children, serve  # noqa: E402
from serve_bench import throughput  # noqa: E402

from manyeyes.app.services.device import HostCopier, device_to_host, quantises_on_device  # noqa: E402
from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, read_frame  # noqa: E402
from manyeyes.model.attention import Capture  # noqa: E402

FRAME = {"Accept": FRAME_MEDIA_TYPE, "Accept-Encoding": "identity"}
WORDS = "river bank heron mill stone boat path tree summer light water field".split()


def text_of(n_tokens: int, seed: int) -> str:
    """n_tokens exactly ([CLS] and [SEP] included), new for every seed: the seed is spelled in
    words, each one MiniLM token (a number like s1000000 is several), after a word saying how many."""
    digits = []
    while True:
        seed, digit = divmod(seed, len(WORDS))
        digits.append(WORDS[digit])
        if not seed:
            break
    words = [WORDS[len(digits)]] + digits
    return " ".join(words + [WORDS[i % len(WORDS)] for i in range(n_tokens - 2 - len(words))])


def bare_rate(model, n_tokens: int, batch: int, repeats: int) -> float:
    """Inputs a second through the forward exactly as the server's batcher calls it for u8
    answers: the last block stops at its softmax, and off the CPU the weights are quantised on
    the device and copied through pinned memory (the server's default there)."""
    encoded = [model.encode(text_of(n_tokens, 10_000 + i), truncate=True) for i in range(batch)]
    to_host = device_to_host(HostCopier(), "u8") if quantises_on_device(model.device.type) else None

    def forward():
        model.run(encoded, Capture(hidden=False), to_host=to_host)

    forward()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        forward()
        times.append(time.perf_counter() - started)
    return batch / statistics.median(times)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process and its children (workers) have used so far."""
    total = 0.0
    for task in [pid, *children(pid)]:
        try:
            with open(f"/proc/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def generate_load(url: str, n_tokens: int, clients: int, seconds: float, offset: int) -> tuple[float, int, float]:
    """One load-generator process: (answers/s, errors, CPU seconds the load took in it)."""
    before = time.process_time()
    rate, errors = asyncio.run(throughput(f"{url}/api/v1/attention",
                                          lambda s: {"text": text_of(n_tokens, offset + s), "format": "u8"}, clients, seconds, FRAME))
    return rate, errors, time.process_time() - before


def loaded(url: str, pid: int, n_tokens: int, clients: int, seconds: float, procs: int) -> tuple[float, int, float, float]:
    """(inputs/s, errors, server cores busy, load generator cores busy) under `clients` at once,
    sent from `procs` processes (one reads ~0.6 GB/s of answers: T=512 needs several): the cores
    say whether the server's Python or the load generator, not the GPU, set the rate."""
    server_before = cpu_seconds(pid)
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        shares = [clients // procs + (i < clients % procs) for i in range(procs)]
        # Seeds 10^8 apart: a process's clients use fewer (throughput() gives each 100,000), so no
        # two processes ever send the same text.
        parts = list(pool.map(generate_load, [url] * procs, [n_tokens] * procs, shares, [seconds] * procs,
                              [10**8 * (i + 1) for i in range(procs)]))
    # Over the load's seconds: the server idles while the pool starts.
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), (cpu_seconds(pid) - server_before) / seconds,
            sum(p[2] for p in parts) / seconds)


def parse_configs(text: str) -> list[tuple[int, int | None]]:
    """"1;8;8x1" -> [(1, None), (8, None), (8, 1)]: server processes, and torch threads in each."""
    configs = []
    try:
        for entry in filter(None, (part.strip() for part in text.split(";"))):
            workers, _, threads = entry.partition("x")
            configs.append((int(workers), int(threads) if threads else None))
    except ValueError:
        configs = []
    if not configs or any(w < 1 or (t is not None and t < 1) for w, t in configs):
        raise argparse.ArgumentTypeError(f"expected entries like 1;8;8x1 (workers, optionally x threads), got {text!r}")
    return configs


def measure(args, lengths: list[int], workers: int, threads: int | None) -> tuple[list[float], list[dict], dict]:
    """One server configuration: (server ms of the sequential T=128 requests, their steps, served rates per T)."""
    log = Path(tempfile.mkdtemp(prefix="gpu-bench-")) / "server.log"
    settings = {"device": args.device, "autocast": args.autocast, "max_batch_items": args.batch, "max_batch_tokens": args.batch * 512,
                "max_queue": 4 * args.clients, "max_client_queue": 4 * args.clients, "cache_bytes": 0}
    serve_args = ("--workers", str(workers), *(("--threads", str(threads)) if threads else ()))
    with serve(log_level="info", log_path=log, args=serve_args, **settings) as (url, pid):
        with httpx.Client(base_url=url, timeout=60) as client:
            run_ids, steps = [], []
            for i in range(args.single + 3):
                r = client.post("/api/v1/attention", json={"text": text_of(128, i), "format": "u8"}, headers=FRAME)
                header, _ = read_frame(r.content)
                if i >= 3:  # the first few pay one-time costs
                    run_ids.append(header["run_id"])
                    steps.append(header["timing_ms"])
        served = {n: loaded(url, pid, n, args.clients, args.seconds, args.load_procs) for n in lengths}
        time.sleep(0.5)
        server_ms = [access_ms(log)[r] for r in run_ids]
    return server_ms, steps, served


def report(args, lengths: list[int], bare: dict, workers: int, threads: int | None, server_ms, steps, served) -> bool:
    """Prints one configuration's figures; True when it met both goals."""
    threads_said = f"{threads} CPU thread(s) each" if threads else "default CPU threads"
    print(f"\nMiniLM on {args.device}, autocast {args.autocast}, {workers} server worker(s), {threads_said}, format=u8 as raw frames, "
          f"fresh texts\n")
    # Where the server's time went, so that one run on a borrowed GPU says what to fix.
    parts = ", ".join(f"{name} {statistics.median(s[name] for s in steps):.2f}" for name in steps[0])
    print(f"T=128, batch 1, {len(server_ms)} sequential requests: server time p50 {statistics.median(server_ms):.1f} ms "
          f"(min {min(server_ms):.1f}, max {max(server_ms):.1f}); p50 of its steps in ms: {parts} "
          f"(goal: server time <= 10 ms on an H200)\n")
    print(f"| T | served inputs/s ({args.clients} clients) | bare batch-{args.batch} forward inputs/s | served / bare | errors "
          "| server cores busy | load generator cores busy |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        rate, errors, server_cores, client_cores = served[n]
        print(f"| {n} | {rate:.0f} | {bare[n]:.0f} | {100 * rate / bare[n]:.0f}% | {errors} | {server_cores:.2f} | {client_cores:.2f} |")
    ok = statistics.median(server_ms) <= 10 and all(served[n][0] >= 0.5 * bare[n] for n in lengths)
    print("\ngoals (<= 10 ms; >= 50% of bare):", "MET" if ok else "MISSED")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--autocast", default="off", choices=("off", "float16", "bfloat16"))
    parser.add_argument("--seconds", type=float, default=10.0, help="load per length")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--lengths", default="16,128,512")
    parser.add_argument("--single", type=int, default=30, help="sequential requests at T=128")
    parser.add_argument("--batch", type=int, default=64, help="the bare forward's batch, and the server's largest")
    parser.add_argument("--workers", type=int, default=1, help="manyeyes serve --workers N")
    parser.add_argument("--threads", type=int, default=None,
                        help="manyeyes serve --threads T: torch's CPU threads per process (default: the server's own)")
    parser.add_argument("--configs", type=parse_configs, default=None,
                        help='several server configurations in one run, against one bare measurement: "1;8;8x1" is one '
                             "process, 8 workers, then 8 workers of 1 thread each (overrides --workers and --threads)")
    parser.add_argument("--load-procs", type=int, default=1, help="processes the load generator's clients are spread over")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    configs = args.configs or [(args.workers, args.threads)]

    from manyeyes.model import load

    model = load("minilm", device=args.device)
    if args.autocast != "off":
        from manyeyes.app.services.device import AUTOCAST

        model.autocast_dtype = AUTOCAST[args.autocast]
    bare = {n: bare_rate(model, n, args.batch, 5) for n in lengths}
    del model

    met = [report(args, lengths, bare, workers, threads, *measure(args, lengths, workers, threads)) for workers, threads in configs]
    return 0 if any(met) else 1


if __name__ == "__main__":
    raise SystemExit(main())
