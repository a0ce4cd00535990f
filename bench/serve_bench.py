"""Our API server against a naive reference server, started side by side in one run.

The reference is what a new user would write: FastAPI + transformers (`output_attentions=True`,
eager attention) + stdlib `json.dumps(attentions.tolist())`, on the same MiniLM weights.
Ours is `manyeyes serve` asked for `format=u8`, all layers and heads.

For T = 16, 64, 128, 256, 512 tokens it sends the same sentences to both, alternating request by
request so machine noise hits both alike, and prints p50 end-to-end latency, response bytes, the
ratios, and our server's time beside the forward pass. Every request text is new, so our run
cache never answers. Then 32 concurrent clients send short sentences to each server in turn.

    python bench/serve_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (16, 64, 128, 256, 512)
ROUNDS = {16: 15, 64: 9, 128: 7, 256: 3, 512: 2}  # the reference needs ~17 s per request at T=512
WORDS = (
    "the river bank was full of fish while a heron waited by the old stone mill and children ran "
    "along the path to see boats go past under green trees in warm summer light"
).split()

REFERENCE_SERVER = """
import json, sys, torch, uvicorn
from fastapi import FastAPI, Response
from pydantic import BaseModel
from transformers import AutoTokenizer, BertModel
from manyeyes.model.loading import builtin_path

path = str(builtin_path("minilm"))
tokenizer = AutoTokenizer.from_pretrained(path)
model = BertModel.from_pretrained(path, attn_implementation="eager").eval()
app = FastAPI()

class Req(BaseModel):
    text: str

@app.post("/attention")
def attention(req: Req):
    enc = tokenizer(req.text, return_tensors="pt", truncation=True, max_length=512)
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    weights = torch.stack(out.attentions)[:, 0]  # (layers, heads, T, T)
    return Response(json.dumps({"tokens": tokens, "attention": weights.tolist()}), media_type="application/json")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    # A file, not a pipe: an unread pipe fills up and blocks the server's logging mid-run.
    with log.open("wb") as sink:
        return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=sink, stderr=subprocess.STDOUT)


def wait_up(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} never became ready")


def sentence(n_tokens: int, seed: int, encode) -> str:
    """A new sentence of exactly n_tokens tokens ([CLS] and [SEP] included)."""
    words = [WORDS[(seed * 7 + i * (1 + seed % 5)) % len(WORDS)] for i in range(n_tokens)]
    words[0] = f"s{seed}"
    while True:
        encoded = encode(" ".join(words), truncate=True)
        if not encoded.truncated and len(encoded) <= n_tokens:
            return " ".join(words)
        words.pop()


def p50(values: list[float]) -> float:
    return statistics.median(values)


def latency_table(client: httpx.Client, ours: str, ref: str, encode, lengths, rounds) -> list[dict]:
    rows = []
    for n in lengths:
        stats = {k: [] for k in ("ours_ms", "ref_ms", "forward_ms", "run_ids", "ours_bytes", "ref_bytes")}
        for i in range(rounds[n] + 1):  # the first pair warms both up and is not counted
            text = sentence(n, 1000 * n + i, encode)
            t0 = time.perf_counter()
            r = client.post(f"{ours}/api/v1/attention", json={"text": text, "format": "u8"})
            ours_ms = (time.perf_counter() - t0) * 1000
            wire = r.num_bytes_downloaded
            body = orjson.loads(r.content)
            assert r.status_code == 200 and body["attention"]["shape"] == [6, 12, n, n], (r.status_code, r.text[:200])
            t0 = time.perf_counter()
            r = client.post(f"{ref}/attention", json={"text": text})
            ref_ms = (time.perf_counter() - t0) * 1000
            assert r.status_code == 200
            if i == 0:
                continue
            timing = body["timing_ms"]
            stats["ours_ms"].append(ours_ms)
            stats["ref_ms"].append(ref_ms)
            stats["forward_ms"].append(timing["forward"])
            stats["run_ids"].append(body["run_id"])
            stats["ours_bytes"].append(wire)
            stats["ref_bytes"].append(r.num_bytes_downloaded)
        row = {"T": n, "run_ids": stats.pop("run_ids"), **{k: p50(v) for k, v in stats.items()}}
        rows.append(row)
        print(f"  T={n}: ours {row['ours_ms']:.1f} ms, reference {row['ref_ms']:.1f} ms", file=sys.stderr)
    return rows


def add_server_times(rows: list[dict], log: Path) -> None:
    """Our server's own time per request, from its access log (request in to last byte handed
    to the socket), and how much of it is not the forward pass."""
    served_ms = {}
    for line in log.read_text().splitlines():
        if " manyeyes.access " in line:
            entry = orjson.loads(line.split(" manyeyes.access ", 1)[1])
            served_ms[entry.get("run_id")] = entry["ms"]
    for row in rows:
        row["server_ms"] = p50([served_ms[run_id] for run_id in row["run_ids"]])
        row["beyond_forward"] = (row["server_ms"] - row["forward_ms"]) / row["forward_ms"]


async def throughput(url: str, body_for, clients: int, seconds: float) -> tuple[float, int]:
    done = 0
    errors = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:

        async def worker(w: int) -> None:
            nonlocal done, errors
            i = 0
            while time.perf_counter() < stop:
                r = await client.post(url, json=body_for(w * 100_000 + i))
                i += 1
                if r.status_code == 200:
                    done += 1
                else:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(clients)))
        elapsed = time.perf_counter() - started
    return done / elapsed, errors


def short(seed: int) -> str:
    return f"s{seed} " + " ".join(WORDS[(seed + k * 3) % len(WORDS)] for k in range(6 + seed % 7))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T up to 128, fewer rounds, shorter load test")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="load-test duration per server")
    args = parser.parse_args()
    lengths = LENGTHS[:3] if args.quick else LENGTHS
    rounds = {n: max(2, r // 2) for n, r in ROUNDS.items()} if args.quick else ROUNDS
    seconds = min(args.seconds, 5.0) if args.quick else args.seconds

    from manyeyes.model import load

    encode = load("minilm", device="cpu").encode
    ours_port, ref_port = free_port(), free_port()
    env = {"MANYEYES_MODELS": '{"minilm": "minilm"}', "MANYEYES_DEVICE": "cpu", "MANYEYES_CACHE_BYTES": str(256 * 2**20)}
    logs = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    servers = [
        start([sys.executable, "-c", "from manyeyes.app.cli import main; main()", "serve", "--port", str(ours_port)],
              env, logs / "ours.log"),
        start([sys.executable, "-c", REFERENCE_SERVER, str(ref_port)], {}, logs / "reference.log"),
    ]
    ours, ref = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{ref_port}"
    try:
        wait_up(servers[0], f"{ours}/readyz", logs / "ours.log")
        wait_up(servers[1], f"{ref}/docs", logs / "reference.log")
        with httpx.Client(timeout=300) as client:
            rows = latency_table(client, ours, ref, encode, lengths, rounds)
        time.sleep(0.5)  # the log line follows the last byte
        add_server_times(rows, logs / "ours.log")
        print(f"  load test: {args.clients} clients x {seconds:g} s per server", file=sys.stderr)
        # Two alternating halves each, so a burst of outside load cannot favour one side.
        ours_runs, ref_runs = [], []
        for half in range(2):
            ours_runs.append(asyncio.run(throughput(
                f"{ours}/api/v1/attention", lambda s: {"text": short(s + 50_000 * half), "format": "u8"}, args.clients, seconds / 2)))
            ref_runs.append(asyncio.run(throughput(
                f"{ref}/attention", lambda s: {"text": short(s + 50_000 * half)}, args.clients, seconds / 2)))
        ours_rps, ours_err = sum(r for r, _ in ours_runs) / 2, sum(e for _, e in ours_runs)
        ref_rps, ref_err = sum(r for r, _ in ref_runs) / 2, sum(e for _, e in ref_runs)
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            proc.wait(timeout=30)

    print(f"\nMiniLM on {os.cpu_count()} CPU cores; ours: format=u8, all 6 layers x 12 heads; p50 of "
          f"{', '.join(f'{rounds[n]}' for n in lengths)} new sentences per T\n")
    print("| T | ours p50 ms | reference p50 ms | speed-up | ours bytes | reference bytes | smaller by | "
          "ours forward ms | ours server ms | server time beyond forward |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['ours_ms']:.1f} | {r['ref_ms']:.1f} | {r['ref_ms'] / r['ours_ms']:.1f}x | "
              f"{r['ours_bytes']:,.0f} | {r['ref_bytes']:,.0f} | {r['ref_bytes'] / r['ours_bytes']:.1f}x | "
              f"{r['forward_ms']:.1f} | {r['server_ms']:.1f} | {100 * r['beyond_forward']:.0f}% |")
    print(f"\nThroughput, {args.clients} concurrent clients, short sentences (8-14 tokens): ours {ours_rps:.1f} req/s "
          f"({ours_err} errors), reference {ref_rps:.1f} req/s ({ref_err} errors): {ours_rps / ref_rps:.1f}x")

    at128 = next((r for r in rows if r["T"] == 128), None)
    checks = [("throughput >= 2x", ours_rps / ref_rps >= 2)]
    if at128:
        checks += [("T=128 >= 10x faster", at128["ref_ms"] / at128["ours_ms"] >= 10),
                   ("T=128 >= 15x smaller", at128["ref_bytes"] / at128["ours_bytes"] >= 15)]
    checks.append(("server time beyond forward <= 50% at every T", all(r["beyond_forward"] <= 0.5 for r in rows)))
    print("\nTargets: " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in checks))


if __name__ == "__main__":
    main()
