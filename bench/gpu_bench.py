"""The accelerator path, end to end: `manyeyes serve --device cuda` against the bare forward.

Prints
  - the server's own time for one request at T=128, batch 1 (goal: <= 10 ms on an H200), from its
    access log (request in to last byte out), with the forward beside it;
  - batched throughput at T=16, 128 and 512 (64 concurrent clients, fresh texts, format=u8 as raw
    frames) against the bare batch-64 forward of the same model, in inputs per second
    (goal: >= 50% of the bare rate). The bare forward is timed in this process just before and
    just after each server configuration, with its spread; the ratio is to the faster of the two.
Every text is new, so the run cache never answers. Runs on the CPU too (--device cpu), where the
figures only prove the script; the goals are for a GPU.

    python bench/gpu_bench.py [--device cuda] [--autocast off|float16|bfloat16] [--seconds 10]
                              [--workers N] [--threads T] [--configs "1;8;8x1;8x1s"] [--load-procs P]
                              [--cuda-wait block|spin|yield|auto] [--clients 64] [--lengths 16,128,512]
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
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import access_ms, children, serve  # noqa: E402
from serve_bench import throughput  # noqa: E402

from manyeyes.app.services.device import HostCopier, device_to_host, quantises_on_device  # noqa: E402
from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, read_frame  # noqa: E402
from manyeyes.model.attention import Capture  # noqa: E402

FRAME = {"Accept": FRAME_MEDIA_TYPE, "Accept-Encoding": "identity"}
READY_S = 150  # seconds; a server not up by then on a borrowed GPU is not worth its minutes
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


@dataclass
class Bare:
    """Inputs a second through the bare forward, over many timed passes: median and p10..p90."""

    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.0f} ({self.low:.0f}-{self.high:.0f})"


def bare_rate(model, n_tokens: int, batch: int, seconds: float) -> Bare:
    """The forward exactly as the server's batcher calls it for u8 answers: the last block stops
    at its softmax, and off the CPU the weights are quantised on the device and copied through
    pinned memory (the server's default there). Half of `seconds` warms up first (an idle H200
    clocks down to 345 MHz). Five passes straight after loading read 7,400 to 13,200 inputs/s at
    T=16 in one session's calls, and two seconds of passes spread about as wide (at T=16 the
    forward is the CPU launching small kernels): hence a median over many, beside each server."""
    encoded = [model.encode(text_of(n_tokens, 10_000 + i), truncate=True) for i in range(batch)]
    to_host = device_to_host(HostCopier(), "u8") if quantises_on_device(model.device.type) else None

    def forward():
        model.run(encoded, Capture(hidden=False), to_host=to_host)

    warm_until = time.perf_counter() + seconds / 2
    forward()
    while time.perf_counter() < warm_until:
        forward()
    times = []
    stop = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < stop:
        started = time.perf_counter()
        forward()
        times.append(time.perf_counter() - started)
    rates = sorted(batch / t for t in times)
    tenth = len(rates) // 10
    return Bare(statistics.median(rates), rates[tenth], rates[-1 - tenth])


def stat_cpu(stat_path: str) -> float | None:
    """User plus system CPU seconds from a /proc .../stat file (None: the process or thread is gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> dict[int, float]:
    """process -> user plus system CPU seconds so far, for a server and each of its workers."""
    return {process: cpu for process in [pid, *children(pid)] if (cpu := stat_cpu(f"/proc/{process}/stat")) is not None}


def thread_cpu(pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(process, thread) -> (the thread's name, CPU seconds so far), over a server and its workers."""
    threads = {}
    for process in [pid, *children(pid)]:
        try:
            tids = os.listdir(f"/proc/{process}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{process}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except FileNotFoundError:
                continue
            cpu = stat_cpu(f"/proc/{process}/task/{tid}/stat")
            if cpu is not None:
                threads[process, int(tid)] = (name, cpu)
    return threads


def busiest_threads(before: dict, after: dict, seconds: float) -> str:
    """Cores busy by thread name over an interval ("me-forward-cuda x16: 2.10 cores (0.31 0.30 0.29
    ...)"): which of the server's threads spent its CPU. Every worker's are summed. A thread is
    named by the thread that started it: the event loop and the anyio pool carry the process's
    name, torch's CPU pool the forward thread's, and CUDA names its own."""
    by_name: dict[str, list[float]] = {}
    for key, (name, cpu) in after.items():
        by_name.setdefault(name, []).append((cpu - before.get(key, (name, 0.0))[1]) / seconds)
    rows = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    return "; ".join(f"{name} x{len(busy)}: {sum(busy):.2f} cores ({' '.join(f'{b:.2f}' for b in sorted(busy)[::-1][:4])}"
                     f"{' ...' if len(busy) > 4 else ''})" for name, busy in rows if sum(busy) >= 0.05)


def generate_load(url: str, n_tokens: int, clients: int, seconds: float, offset: int) -> tuple[float, int, float]:
    """One load-generator process: (answers/s, errors, CPU seconds the load took in it)."""
    before = time.process_time()
    rate, errors = asyncio.run(throughput(f"{url}/api/v1/attention",
                                          lambda s: {"text": text_of(n_tokens, offset + s), "format": "u8"}, clients, seconds, FRAME))
    return rate, errors, time.process_time() - before


def loaded(url: str, pid: int, n_tokens: int, clients: int, seconds: float, procs: int) -> tuple[float, int, float, float, str]:
    """(inputs/s, errors, server cores busy, load generator cores busy, the server's busiest
    threads) under `clients` at once, sent from `procs` processes (one reads ~0.6 GB/s of answers:
    T=512 needs several): the cores say whether the server's Python or the load generator, not the
    GPU, set the rate."""
    threads_before, processes_before = thread_cpu(pid), process_cpu(pid)
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        shares = [clients // procs + (i < clients % procs) for i in range(procs)]
        # Seeds 10^8 apart: a process's clients use fewer (throughput() gives each 100,000), so no
        # two processes ever send the same text.
        parts = list(pool.map(generate_load, [url] * procs, [n_tokens] * procs, shares, [seconds] * procs,
                              [10**8 * (i + 1) for i in range(procs)]))
    # Each process's cores, busiest first: workers left idle by an uneven spread of connections
    # show as a long tail. Over the load's seconds: the server idles while the pool starts.
    processes_after = process_cpu(pid)
    by_process = sorted(((cpu - processes_before.get(p, 0.0)) / seconds for p, cpu in processes_after.items()), reverse=True)
    spread = "; cores by server process: " + " ".join(f"{busy:.2f}" for busy in by_process if busy >= 0.01)
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), (sum(processes_after.values()) - sum(processes_before.values())) / seconds,
            sum(p[2] for p in parts) / seconds, busiest_threads(threads_before, thread_cpu(pid), seconds) + spread)


def parse_configs(text: str) -> list[tuple[int, int | None, bool]]:
    """"1;8;8x1;8x1s" -> [(1, None, False), (8, None, False), (8, 1, False), (8, 1, True)]: server
    processes, torch threads in each, and whether they share forwards (--shared-forward)."""
    configs = []
    try:
        for entry in filter(None, (part.strip() for part in text.split(";"))):
            shared = entry.endswith("s")
            workers, _, threads = entry.removesuffix("s").partition("x")
            configs.append((int(workers), int(threads) if threads else None, shared))
    except ValueError:
        configs = []
    if not configs or any(w < 1 or (t is not None and t < 1) or (s and w < 2) for w, t, s in configs):
        raise argparse.ArgumentTypeError(
            f"expected entries like 1;8;8x1;8x1s (workers, optionally x threads, s: shared forwards, 2 workers or more), got {text!r}"
        )
    return configs


def measure(args, lengths: list[int], workers: int, threads: int | None, shared: bool) -> tuple[list[float], list[dict], dict]:
    """One server configuration: (server ms of the sequential T=128 requests, their steps, served rates per T)."""
    log = Path(tempfile.mkdtemp(prefix="gpu-bench-")) / "server.log"
    settings = {"device": args.device, "autocast": args.autocast, "max_batch_items": args.batch, "max_batch_tokens": args.batch * 512,
                "max_queue": 4 * args.clients, "max_client_queue": 4 * args.clients, "cache_bytes": 0,
                "cuda_wait": args.cuda_wait}
    serve_args = ("--workers", str(workers), *(("--threads", str(threads)) if threads else ()), *(("--shared-forward",) if shared else ()))
    # Minutes count on a borrowed GPU: a server that is not up in READY_S will not be.
    with serve(log_level="info", log_path=log, ready_timeout_s=READY_S, args=serve_args, **settings) as (url, pid):
        # /readyz waits for the workers, not for the shared process (they run their own forwards
        # meanwhile): measure once it serves.
        deadline = time.monotonic() + READY_S
        while shared and "shared forward process:" not in log.read_text():
            if time.monotonic() > deadline:
                raise SystemExit(f"the shared forward process never started; the server's log: {log}")
            time.sleep(0.2)
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


def report(args, lengths: list[int], bare: dict, workers: int, threads: int | None, shared: bool, server_ms, steps, served) -> bool:
    """Prints one configuration's figures; True when it met both goals. bare: T -> the bare
    forward measured just before and just after this configuration's load; its ratio is to the
    faster of the two, the harder goal."""
    threads_said = (f"{threads} CPU thread(s) each" if threads else "default CPU threads") + (", shared forwards" if shared else "")
    print(f"\nMiniLM on {args.device}, autocast {args.autocast}, {workers} server worker(s), {threads_said}, CUDA waits "
          f"{args.cuda_wait}, format=u8 as raw frames, fresh texts\n")
    # Where the server's time went, so that one run on a borrowed GPU says what to fix.
    parts = ", ".join(f"{name} {statistics.median(s[name] for s in steps):.2f}" for name in steps[0])
    print(f"T=128, batch 1, {len(server_ms)} sequential requests: server time p50 {statistics.median(server_ms):.1f} ms "
          f"(min {min(server_ms):.1f}, max {max(server_ms):.1f}); p50 of its steps in ms: {parts} "
          f"(goal: server time <= 10 ms on an H200)\n")
    print(f"| T | served inputs/s ({args.clients} clients) | bare batch-{args.batch} forward inputs/s before, after: "
          "median (p10-p90) | served / bare | errors | server cores busy | server CPU ms an input | load generator cores busy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        rate, errors, server_cores, client_cores, _ = served[n]
        before, after = bare[n]
        print(f"| {n} | {rate:.0f} | {before}, {after} | {100 * rate / max(before.median, after.median):.0f}% | {errors} "
              f"| {server_cores:.2f} | {1000 * server_cores / max(rate, 1e-9):.2f} | {client_cores:.2f} |")
    for n in lengths:
        print(f"\nT={n}, the server's threads by name: {served[n][4]}")
    ok = statistics.median(server_ms) <= 10 and all(served[n][0] >= 0.5 * max(b.median for b in bare[n]) for n in lengths)
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
                        help='several server configurations in one run: "1;8;8x1;8x1s" is one process, 8 workers, '
                             "8 workers of 1 thread each, then those 8 sharing forwards (--shared-forward; overrides "
                             "--workers and --threads)")
    parser.add_argument("--cuda-wait", default="block", choices=("block", "spin", "yield", "auto"),
                        help="how the server's threads wait for the GPU (MANYEYES_CUDA_WAIT; auto is CUDA's default, a spin)")
    parser.add_argument("--bare-seconds", type=float, default=2.0,
                        help="the bare forward's timing per length (after as long again / 2 of warm-up), before and after each configuration")
    parser.add_argument("--load-procs", type=int, default=1, help="processes the load generator's clients are spread over")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # through `tee` on a borrowed machine: each line as it comes
    lengths = [int(n) for n in args.lengths.split(",")]
    configs = args.configs or [(args.workers, args.threads, False)]

    from manyeyes.model import load

    model = load("minilm", device=args.device)
    if args.autocast != "off":
        from manyeyes.app.services.device import AUTOCAST

        model.autocast_dtype = AUTOCAST[args.autocast]
    # The model stays loaded here (its context idle) so that the bare forward is measured again
    # between configurations, beside each one, rather than once at the start.
    bares = [{n: bare_rate(model, n, args.batch, args.bare_seconds) for n in lengths}]
    met = []
    # Each configuration's figures are printed as soon as they are measured, and one that fails
    # leaves the others': a borrowed GPU's call that ran out of time kept none of them.
    for i, (workers, threads, shared) in enumerate(configs):
        try:
            figures = measure(args, lengths, workers, threads, shared)
        except (Exception, SystemExit) as failed:
            print(f"\n{workers} server worker(s), threads {threads or 'default'}, shared {shared}: FAILED: {failed}", flush=True)
            figures = None
        bares.append({n: bare_rate(model, n, args.batch, args.bare_seconds) for n in lengths})
        if figures is not None:
            met.append(report(args, lengths, {n: (bares[i][n], bares[i + 1][n]) for n in lengths}, workers, threads, shared,
                              *figures))
    return 0 if any(met) else 1


if __name__ == "__main__":
    raise SystemExit(main())
