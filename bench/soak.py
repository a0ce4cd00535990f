"""Soak: concurrent mixed-length load against a real `manyeyes serve`, with its memory bound checked.

100 clients (default) send texts of 16 to 512 tokens, all layers and heads, in the forms real
clients use (u8 and f16 as JSON and as raw frames, repeats the cache answers, slices of the
client's last run, batches), against the default 512 MB run cache. A slice of a run the cache has
evicted meanwhile is a 404 `unknown_run` (with --workers, recomputed), which the summary counts
apart: the cache holds about twenty of this mix's runs, so at 100 clients (17 answers a second
here) a run is evicted before its client's next request, while at 10 clients every slice is
answered. The server's RSS is polled every 50 ms from
the moment the process starts. The bound (SECURITY.md, "Memory"):

    peak RSS  <=  RSS after warm-up  +  cache_bytes x 1.1  +  100 MB

Every answer is checked (status, shape against its tokens, every row of weights summing to 1);
every 50th fresh text is also compared, after the load, with a single run in this process.

    python bench/soak.py [--requests 10000] [--clients 100] [--warmup 300] [--malloc-mmap-threshold 0] [--malloc-trim-threshold N]
                         [--workers N [--shared-forward]]

With --workers N the RSS is the parent's and its workers' together, and the bound N times the
per-worker terms: each worker keeps its own cache.

--malloc-mmap-threshold 0 runs the server with glibc's allocator defaults, to see the problem
the start-up setting fixes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import TOLERANCE, children, decode, rss_mb, serve  # noqa: E402

from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, read_frame  # noqa: E402

WORDS = (
    "the a river bank money water heron boat mill stone bridge field winter summer quiet loud teacher "
    "student paper window garden market village forest mountain valley morning evening walked saw "
    "under over near slowly quickly old new"
).split()
FRAME = {"Accept": FRAME_MEDIA_TYPE}


class RssPoller(threading.Thread):
    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.pid: int | None = None
        self.samples: list[tuple[float, float]] = []  # (monotonic time, MB)
        self.stop = threading.Event()

    def watch(self, pid: int) -> None:
        self.pid = pid
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), rss_of_tree(self.pid)))
            except (OSError, RuntimeError):
                return  # the process has gone
            time.sleep(self.interval_s)

    def peak(self, since: float = 0.0) -> float:
        return max((mb for t, mb in self.samples if t >= since), default=float("nan"))

    def now(self) -> float:
        return self.samples[-1][1] if self.samples else float("nan")


def rss_of_tree(pid: int) -> float:
    """The server's resident memory: its process's, and with --workers its workers' too."""
    total = rss_mb(pid)
    for child in children(pid):
        try:
            total += rss_mb(child)
        except (OSError, RuntimeError):  # exited between the listing and the read
            pass
    return total


def text_of(rng: random.Random, i: int) -> str:
    # Mostly one token a word: 14 to 510 words gives 16 to 512 tokens with [CLS] and [SEP].
    n = rng.choice((rng.randint(14, 60), rng.randint(60, 250), rng.randint(250, 510)))
    return f"soak{i} " + " ".join(rng.choice(WORDS) for _ in range(n - 1))


def error_code(r: httpx.Response) -> str:
    """The JSON error's code ({"error": {"code": ...}}), else the start of the body."""
    try:
        return orjson.loads(r.content)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return repr(r.content[:60])


def check(attention: dict, values: np.ndarray, n_tokens: int, n_layers: int) -> str | None:
    """What is wrong with one answer's weights (all heads of `n_layers` layers), or None."""
    if attention["shape"] != [n_layers, 12, n_tokens, n_tokens]:
        return f"shape {attention['shape']} for {n_tokens} tokens"
    rows = values.sum(-1)
    slack = {"u8": n_tokens * 0.5 / 255, "f16": n_tokens * 1e-3, "json": 1e-4}[attention["format"]]
    if np.abs(rows - 1).max() > slack + 1e-6:
        return f"rows sum to {rows.min():.4f}..{rows.max():.4f}"
    return None


class Soak:
    def __init__(self, url: str, total: int, clients: int, seed: int) -> None:
        self.url = url
        self.total = total
        self.clients = clients
        self.rng = random.Random(seed)
        self.statuses: Counter = Counter()
        self.wrong: list[str] = []
        self.failures: Counter = Counter()  # exceptions: timeouts, resets, refused connections
        self.refusals: Counter = Counter()  # (method, the path's last part, status, error code) of answers not 200
        self.sampled: list[tuple[str, dict, np.ndarray]] = []  # (text, header, weights) checked later
        self.recent: list[str] = []
        self.done = 0

    def request_for(self, i: int, own_last: str | None = None) -> tuple[str, str, dict | None, dict, str | None]:
        """(method, path, body, headers, fresh text or None) of the i-th request, from a client
        whose last answer was of run `own_last`."""
        kind = i % 20
        if kind < 8:
            text = text_of(self.rng, i)
            return "POST", "/api/v1/attention", {"text": text, "format": "u8", "truncate": True}, FRAME, text
        if kind < 12:
            text = text_of(self.rng, i)
            return "POST", "/api/v1/attention", {"text": text, "format": "u8", "truncate": True}, {}, text
        if kind < 15:
            text = text_of(self.rng, i)
            return "POST", "/api/v1/attention", {"text": text, "format": "f16", "truncate": True}, FRAME, text
        if kind < 17 and self.recent:  # a repeat: the cache answers
            text = self.rng.choice(self.recent)
            return "POST", "/api/v1/attention", {"text": text, "format": "u8", "truncate": True}, FRAME, None
        if kind < 19 and own_last:
            # The run this client was last answered: the 512 MB cache holds about twenty of this
            # mix's runs (its long ones are 40-75 MB), so with 100 clients in flight a run picked
            # from all clients' recent answers had always been evicted (404 unknown_run).
            run_id = own_last
            return "GET", f"/api/v1/runs/{run_id}/attention?format=f16&layers=0,5", None, FRAME, None
        texts = [text_of(self.rng, i), text_of(self.rng, i + 1)]
        return "POST", "/api/v1/attention/batch", {"texts": texts, "format": "u8", "truncate": True}, FRAME, None

    def verify(self, r: httpx.Response, text: str | None, i: int) -> str:
        """Checks one answer; the run id of its last result."""
        if r.headers["content-type"] == FRAME_MEDIA_TYPE:
            header, data = read_frame(r.content)
            results = header.get("results", [header])
            arrays = []
            for res in results:
                att = res["attention"]
                dtype = {"u8": np.uint8, "f16": "<f2", "json": "<f4"}[att["format"]]
                raw = np.frombuffer(data[att["offset"] : att["offset"] + att["nbytes"]], dtype=dtype).astype(np.float32)
                arrays.append(raw.reshape(att["shape"]) * (att.get("scale") or 1.0))
        else:
            header = orjson.loads(r.content)
            results = header.get("results", [header])
            arrays = [decode(res["attention"]) for res in results]
        for res, values in zip(results, arrays):
            problem = check(res["attention"], values, len(res["tokens"]), len(res["layers"]))
            if problem:
                self.wrong.append(f"request {i}: {problem}")
        if text is not None:
            self.recent = (self.recent + [text])[-100:]
            if len(self.sampled) * 50 <= i:
                self.sampled.append((text, results[0], arrays[0]))
        return results[-1]["run_id"]

    async def run(self, poller: RssPoller, every: int) -> float:
        counter = iter(range(self.total))
        started = time.monotonic()
        limits = httpx.Limits(max_connections=self.clients, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:

            async def worker() -> None:
                own_last = None
                for i in counter:
                    method, path, body, headers, text = self.request_for(i, own_last)
                    try:
                        r = await client.request(method, path, json=body, headers=headers)
                    except httpx.HTTPError as exc:  # every exception is a failure, never a success
                        self.failures[type(exc).__name__] += 1
                        continue
                    finally:
                        self.done += 1
                        if self.done % every == 0:
                            rate = self.done / (time.monotonic() - started)
                            print(f"  {self.done:>6} requests  RSS {poller.now():7.0f} MB  peak {poller.peak():7.0f} MB  "
                                  f"{rate:5.1f} req/s  load {os.getloadavg()[0]:.1f}", flush=True)
                    self.statuses[r.status_code] += 1
                    if r.status_code == 200:
                        own_last = self.verify(r, text, i)
                    else:
                        self.refusals[(method, path.split("?")[0].rsplit("/", 1)[-1], r.status_code, error_code(r))] += 1

            await asyncio.gather(*(worker() for _ in range(self.clients)))
        return time.monotonic() - started


def compare_samples(sampled) -> int:
    """Sampled answers against single unbatched runs in this process; returns how many differ,
    and prints what differs in each."""
    from manyeyes.model import load

    model = load("minilm", device="cpu")
    wrong = 0
    for text, result, values in sampled:
        reference = model.attend(text, truncate=True)
        expected = reference.attention.numpy()
        fmt = result["attention"]["format"]
        if [t["id"] for t in result["tokens"]] != [t.id for t in reference.tokens] or values.shape != expected.shape:
            wrong += 1
            print(f"  sample {result['run_id']}: tokens or shape differ ({values.shape} against {expected.shape})")
            continue
        worst = float(np.abs(values - expected).max())
        if worst > TOLERANCE[fmt]:
            wrong += 1
            print(f"  sample {result['run_id']} ({fmt}, T={len(result['tokens'])}): off by {worst:.3g}, "
                  f"over the tolerance of {TOLERANCE[fmt]:.3g}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=300, help="requests before the baseline RSS is taken")
    parser.add_argument("--cache-mb", type=int, default=512, help="the run cache's bound (default: the server's default)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, help="0: glibc defaults (the server's own setting otherwise)")
    parser.add_argument("--malloc-trim-threshold", type=int, default=None, help="the heap top kept (the server's own setting otherwise)")
    parser.add_argument("--buffer-pool-bytes", type=int, default=None, help="finished buffers kept (the server's own setting otherwise)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=1, help="manyeyes serve --workers N: the bound is per worker, summed")
    parser.add_argument("--shared-forward", action="store_true", help="with --workers: manyeyes serve --shared-forward")
    args = parser.parse_args()

    poller = RssPoller()
    settings = {"cache_bytes": args.cache_mb * 2**20, "max_queue": 4 * args.clients, "max_client_queue": 4 * args.clients,
                "request_timeout_s": 300}
    if args.malloc_mmap_threshold is not None:
        settings["malloc_mmap_threshold"] = args.malloc_mmap_threshold
    if args.malloc_trim_threshold is not None:
        settings["malloc_trim_threshold"] = args.malloc_trim_threshold
    if args.buffer_pool_bytes is not None:
        settings["buffer_pool_bytes"] = args.buffer_pool_bytes
    cpus = os.cpu_count()
    print(f"soak: {args.requests} requests ({args.warmup} warm-up), {args.clients} clients, 16-512 tokens, {args.workers} worker(s)"
          f"{' sharing forwards' if args.shared_forward else ''}, "
          f"run cache {args.cache_mb} MB, minilm on {cpus} CPUs, load {os.getloadavg()[0]:.1f}")
    serve_args = ("--workers", str(args.workers), *(("--shared-forward",) if args.shared_forward else ()))
    with serve(on_spawn=poller.watch, args=serve_args, **settings) as (url, pid):
        ready_rss = poller.now()
        warm = Soak(url, args.warmup, args.clients, args.seed)
        asyncio.run(warm.run(poller, max(args.warmup, 1)))
        baseline = rss_of_tree(pid)
        baseline_at = time.monotonic()
        soak = Soak(url, args.requests, args.clients, args.seed + 1)
        soak.recent = warm.recent
        elapsed = asyncio.run(soak.run(poller, max(args.requests // 20, 1)))
        end_rss = rss_of_tree(pid)
    poller.stop.set()
    peak = poller.peak(baseline_at)
    # Each worker has its own cache and its own 100 MB (SECURITY.md, "Memory").
    bound = baseline + args.workers * (args.cache_mb * 1.048576 * 1.1 + 100)
    sample_wrong = compare_samples(soak.sampled)
    server_errors = sum(n for s, n in soak.statuses.items() if s >= 500)
    failures = sum(soak.failures.values()) + server_errors
    print(f"  statuses      {dict(sorted(soak.statuses.items()))}; exceptions {dict(soak.failures) or 0}")
    if soak.refusals:
        print("  not 200       " + "; ".join(f"{method} .../{last} {status} {code}: {n}"
                                             for (method, last, status, code), n in soak.refusals.most_common()))
    print(f"  throughput    {args.requests / elapsed:.1f} req/s over {elapsed:.0f} s; load average {os.getloadavg()[0]:.1f} on {cpus} CPUs")
    print(f"  answers       {len(soak.wrong)} wrong of those checked in full; {sample_wrong} of {len(soak.sampled)} "
          "sampled texts differ from a single run")
    print(f"  RSS           ready {ready_rss:.0f} MB, after warm-up {baseline:.0f} MB, end {end_rss:.0f} MB, "
          f"peak {peak:.0f} MB (polled every 50 ms, {len(poller.samples)} samples, p50 {statistics.median(mb for _, mb in poller.samples):.0f} MB)")
    per_worker = f"{args.workers} x ({args.cache_mb} MiB x 1.1 + 100)" if args.workers > 1 else f"{args.cache_mb} MiB x 1.1 + 100"
    print(f"  bound         {baseline:.0f} + {per_worker} = {bound:.0f} MB; peak is {peak - baseline:.0f} MB over warm-up")
    for problem in soak.wrong[:5]:
        print("   ", problem)
    ok = peak <= bound and failures == 0 and not soak.wrong and sample_wrong == 0
    print("target (peak within the bound, no failures, every answer right):", "MET" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
