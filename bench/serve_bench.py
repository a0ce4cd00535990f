"""Our API server against a naive reference server, started side by side in one run, like for like.

The reference is what a new user would write: FastAPI + transformers (`output_attentions=True`,
eager attention) + stdlib `json.dumps(attentions.tolist())`, on the same MiniLM weights; it never
compresses. Ours is `manyeyes serve`, asked in every form a client can ask for:

    json, identity        float32 JSON, no compression           lossless, like the reference
    json, gzip            Accept-Encoding: gzip, deflate         what a browser without zstd gets
    json, zstd            httpx's default with zstandard, Chrome  lossless
    f32 frame             format=json as a raw frame (float32)    lossless
    f16 json / frame      base64 in JSON / raw frame              float16: within 1e-3
    u8 json / frame       base64 in JSON / raw frame              LOSSY: within 1/255
    u8 frame, zstd        the page's form                         LOSSY: within 1/255
    u8 frame, httpx       the u8 frame through httpx (below)      LOSSY: within 1/255

For each T every form gets its own new sentence (so our run cache never answers), in rounds that
alternate with the reference request by request, so machine noise hits all alike, with 1 ms of quiet
after every answer (settle(), below). Time is from sending the request to holding the whole
decoded body.

Both servers are timed through the same lean client (bench/lean_http.py: one kept-alive socket,
answers read by Content-Length), so the ratios compare servers, not client libraries. The form
"u8 frame, httpx" goes through httpx, with its own reference requests also through httpx, so what
a common client library adds (about 1 ms a request here up to T=128, on both sides) is printed
beside it. Both servers' forward times are printed (ours from timing_ms, the reference's from its
X-Forward-Ms header), and our server's own time per request from its access log. Then
throughput: 32 clients against each server in turn, and our single-stream rate, to show what
micro-batching adds.

    python bench/serve_bench.py [--quick] [--lengths 16,64,128] [--forms "u8 frame;u8 frame, zstd"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_http import Answer, AsyncConnection, Connection, split_url  # noqa: E402
from live_server import access_ms, free_port, ready_or_exit  # noqa: E402

from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, read_frame  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (16, 64, 128, 256, 512)
ROUNDS = {16: 15, 64: 15, 128: 11, 256: 5, 512: 3}  # the reference needs ~15 s per request at T=512
WORDS = (
    "the river bank was full of fish while a heron waited by the old stone mill and children ran "
    "along the path to see boats go past under green trees in warm summer light"
).split()
FRAME = FRAME_MEDIA_TYPE
# name -> (request format, Accept, Accept-Encoding, note); the lean client unless named in HTTPX_FORMS
FORMS = {
    "json, identity": ("json", "application/json", "identity", "lossless"),
    "json, gzip": ("json", "application/json", "gzip, deflate", "lossless"),
    "json, zstd": ("json", "application/json", "gzip, deflate, zstd", "lossless"),
    "f32 frame": ("json", FRAME, "identity", "lossless"),
    "f16 json": ("f16", "application/json", "identity", "float16"),
    "f16 frame": ("f16", FRAME, "identity", "float16"),
    "u8 json": ("u8", "application/json", "identity", "LOSSY 1/255"),
    "u8 frame": ("u8", FRAME, "identity", "LOSSY 1/255"),
    "u8 frame, zstd": ("u8", FRAME, "zstd", "LOSSY 1/255"),
    "u8 frame, httpx": ("u8", FRAME, "identity", "LOSSY 1/255; both sides through httpx"),
}
HTTPX_FORMS = {"u8 frame, httpx"}

REFERENCE_SERVER = """
import json, sys, time, torch, uvicorn
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
    started = time.perf_counter()
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    forward_ms = (time.perf_counter() - started) * 1000
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    weights = torch.stack(out.attentions)[:, 0]  # (layers, heads, T, T)
    return Response(json.dumps({"tokens": tokens, "attention": weights.tolist()}), media_type="application/json",
                    headers={"X-Forward-Ms": f"{forward_ms:.3f}"})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    # A file, not a pipe: an unread pipe fills up and blocks the server's logging mid-run.
    with log.open("wb") as sink:
        return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=sink, stderr=subprocess.STDOUT)


def sentence(n_tokens: int, seed: int, encode) -> str:
    """A new sentence of exactly n_tokens tokens ([CLS] and [SEP] included)."""
    words = [WORDS[(seed * 7 + i * (1 + seed % 5)) % len(WORDS)] for i in range(n_tokens)]
    words[0] = f"s{seed}"
    while True:
        encoded = encode(" ".join(words), truncate=True)
        if not encoded.truncated and len(encoded) <= n_tokens:
            return " ".join(words)
        words.pop()


def post(lean: Connection, client: httpx.Client, url: str, path: str, payload: dict, headers: dict | None,
         through_httpx: bool) -> tuple[Answer, float]:
    """One timed POST, through httpx or the lean client: the decoded answer and the ms it took,
    from sending the request to holding the whole decoded body (nothing parsed yet, on either side)."""
    t0 = time.perf_counter()
    if through_httpx:
        r = client.post(f"{url}{path}", json=payload, headers=headers)
        answer = Answer(r.status_code, dict(r.headers), r.content, r.num_bytes_downloaded)
    else:
        answer = lean.post_json(path, payload, headers)
    return answer, (time.perf_counter() - t0) * 1000


def ours_request(lean: Connection, client: httpx.Client, url: str, text: str, form: str) -> dict:
    fmt, accept, encoding, _ = FORMS[form]
    answer, ms = post(lean, client, url, "/api/v1/attention", {"text": text, "format": fmt},
                      {"Accept": accept, "Accept-Encoding": encoding}, form in HTTPX_FORMS)
    assert answer.status == 200, (form, answer.status, answer.body[:200])
    header = read_frame(answer.body)[0] if accept == FRAME else orjson.loads(answer.body)
    n = len(header["tokens"])
    assert header["attention"]["shape"] == [6, 12, n, n], header["attention"]["shape"]
    expected_encoding = {"identity": None, "gzip, deflate": "gzip"}.get(encoding, "zstd")
    if expected_encoding == "zstd" and fmt != "json" and answer.wire_bytes < 64 * 1024:
        expected_encoding = None  # compact answers under 64 KiB are not worth compressing
    assert answer.headers.get("content-encoding") == expected_encoding, (form, answer.headers.get("content-encoding"))
    return {"ms": ms, "bytes": answer.wire_bytes, "forward": header["timing_ms"]["forward"], "run_id": header["run_id"]}


def reference_request(lean: Connection, client: httpx.Client, url: str, text: str, through_httpx: bool) -> dict:
    answer, ms = post(lean, client, url, "/attention", {"text": text}, None, through_httpx)
    assert answer.status == 200 and len(answer.body) > 0
    return {"ms": ms, "bytes": answer.wire_bytes, "forward": float(answer.headers["x-forward-ms"])}


SETTLE_S = 0.001


def settle() -> None:
    """A pause after each answer (either server's), before the client does anything else.

    The client holds the whole answer while the server's last write is still returning: loopback
    delivers the bytes inside that syscall. When the client's next step (the reference's forward,
    its two threads on both cores) ran at once, it preempted our server there, and our access
    log's last-byte stamp came 1.5-2.8 ms late in a quarter of the T=64 answers, at 0.07 ms of CPU
    in the write (traced: the server's stamp then fell 1.5 ms after the client's; normally 0.5-1
    ms before it). 1 ms of quiet took those from 7 of 30 to 0 of 30, and it is too short for the
    cores to go cold (libgomp's threads still spin for ~8 ms after a forward)."""
    time.sleep(SETTLE_S)


def latency_table(client: httpx.Client, ours: str, ref: str, encode, lengths, rounds, forms) -> dict:
    table = {}
    with Connection(ours) as ours_lean, Connection(ref) as ref_lean:
        for n in lengths:
            samples = {form: [] for form in forms}
            samples["reference"], samples["reference, httpx"] = [], []
            for i in range(rounds[n] + 1):  # the first round warms both up and is not counted
                # The reference between every third of ours, so noise hits both alike; each httpx
                # form gets its own reference request through httpx.
                referenced = [k % 3 == 0 or form in HTTPX_FORMS for k, form in enumerate(forms)]
                # Made before the round: the client's tokenizer must not run in the gaps (below).
                texts = {(k, side): sentence(n, 1000 * n + 50 * i + side + k, encode)
                         for k in range(len(forms)) for side in ((0, 40) if referenced[k] else (0,))}
                for k, form in enumerate(forms):
                    result = ours_request(ours_lean, client, ours, texts[k, 0], form)
                    settle()
                    through_httpx = form in HTTPX_FORMS
                    if referenced[k]:
                        ref_result = reference_request(ref_lean, client, ref, texts[k, 40], through_httpx)
                        settle()
                        if i:
                            samples["reference, httpx" if through_httpx else "reference"].append(ref_result)
                    if i:
                        samples[form].append(result)
            table[n] = samples
            ref_p50 = statistics.median(s["ms"] for s in samples["reference"])
            print(f"  T={n}: reference {ref_p50:.0f} ms; " + ", ".join(
                f"{f} {statistics.median(s['ms'] for s in samples[f]):.1f}" for f in forms), file=sys.stderr)
    return table


async def throughput(url: str, body_for, clients: int, seconds: float, headers: dict | None = None) -> tuple[float, int]:
    """Answers a second from `clients` concurrent clients, each on its own kept-alive connection
    (the lean client: 32 httpx clients took 45% of a core from the server under test)."""
    done = errors = 0
    stop = time.perf_counter() + seconds
    host, port, path = split_url(url)
    base = f"http://{host}:{port}"

    async def worker(w: int) -> None:
        nonlocal done, errors
        i = 0
        connection = await AsyncConnection.open(base)
        try:
            while time.perf_counter() < stop:
                try:
                    ok = (await connection.post_json(path, body_for(w * 100_000 + i), headers)).status == 200
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    ok = False
                    await connection.close()
                    connection = await AsyncConnection.open(base)
                i += 1
                done += ok
                errors += not ok
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    elapsed = time.perf_counter() - started
    return done / elapsed, errors


def short(seed: int) -> str:
    return f"s{seed} " + " ".join(WORDS[(seed + k * 3) % len(WORDS)] for k in range(6 + seed % 7))


def p50(values) -> float:
    return statistics.median(values)


def reference_for(samples: dict, form: str) -> list[dict]:
    """The reference requests timed through the same client as `form`."""
    return samples["reference, httpx" if form in HTTPX_FORMS else "reference"]


def report(table: dict, served_ms: dict, forms, rounds) -> list[dict]:
    """Prints the tables; returns the T=128 (or largest) figures for the targets."""
    via_httpx = any(f in HTTPX_FORMS for f in forms)
    print("\n### Latency, p50 ms (time to the whole decoded body), and bytes on the wire\n")
    print("| T | reference | ref forward | " + ("reference, httpx | " if via_httpx else "") + " | ".join(forms)
          + " | our forward |")
    print("|---:|---:|---:|" + "---:|" * (len(forms) + via_httpx) + "---:|")
    for n, samples in table.items():
        ref = samples["reference"]
        cells = [f"{p50(s['ms'] for s in samples[f]):.1f}" for f in forms]
        our_forward = p50(s["forward"] for f in forms for s in samples[f])
        httpx_cell = f"{p50(s['ms'] for s in samples['reference, httpx']):.1f} | " if via_httpx else ""
        print(f"| {n} | {p50(s['ms'] for s in ref):.1f} | {p50(s['forward'] for s in ref):.1f} | " + httpx_cell
              + " | ".join(cells) + f" | {our_forward:.1f} |")
    print("\n### Against the reference (through the same client), per form: speed-up (p50 over p50) and smaller by\n")
    print("| T | " + " | ".join(forms) + " |")
    print("|---:|" + "---:|" * len(forms))
    for n, samples in table.items():
        cells = []
        for f in forms:
            ref = reference_for(samples, f)
            ref_ms, ref_bytes = p50(s["ms"] for s in ref), p50(s["bytes"] for s in ref)
            cells.append(f"{ref_ms / p50(s['ms'] for s in samples[f]):.1f}x / {ref_bytes / p50(s['bytes'] for s in samples[f]):.1f}x")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n(" + "; ".join(f"{f}: {FORMS[f][3]}" for f in forms) + ")")
    print("\n### Our server's own time (access log: request in to last byte out) beyond its forward pass\n")
    # The spread says how near a verdict is to the noise: at T=16 the p50 of 15 requests moved
    # between 27% and 33% of the forward from one run to the next (session 53).
    print("| T | form | server ms | forward ms | beyond forward | beyond, p25-p75 |")
    print("|---:|---|---:|---:|---:|---:|")
    overhead = {}
    for n, samples in table.items():
        for form in ("u8 frame", "f32 frame", "json, gzip"):
            if form not in forms:
                continue
            server = [served_ms[s["run_id"]] for s in samples[form] if s["run_id"] in served_ms]
            forward = [s["forward"] for s in samples[form]]
            beyond = [served_ms[s["run_id"]] - s["forward"] for s in samples[form] if s["run_id"] in served_ms]
            overhead[(n, form)] = (p50(server), p50(forward), p50(beyond))
            low, _, high = statistics.quantiles(beyond, n=4) if len(beyond) > 1 else (beyond[0],) * 3
            print(f"| {n} | {form} | {p50(server):.1f} | {p50(forward):.1f} | {p50(beyond):.1f} ms "
                  f"({100 * p50(beyond) / p50(forward):.1f}%) | {low:.1f}-{high:.1f} ms |")
    return overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T up to 128, fewer rounds, shorter load test")
    parser.add_argument("--lengths", default=None, help="comma-separated T (default 16,64,128,256,512)")
    parser.add_argument("--forms", default=";".join(FORMS), help="which of our forms, by name, separated by ;")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="load-test duration per server")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else list(LENGTHS[:3] if args.quick else LENGTHS)
    rounds = {n: max(2, ROUNDS.get(n, 3) // 2) if args.quick else ROUNDS.get(n, 3) for n in lengths}
    seconds = min(args.seconds, 5.0) if args.quick else args.seconds
    forms = [f.strip() for f in args.forms.split(";")]

    from manyeyes.model import load

    encode = load("minilm", device="cpu").encode
    ours_port, ref_port = free_port(), free_port()
    # The bench's client is on loopback, which the server answers uncompressed by default; its
    # compressed forms stand for a remote client's answers, so it compresses for loopback here.
    env = {"MANYEYES_MODELS": '{"minilm": "minilm"}', "MANYEYES_DEVICE": "cpu", "MANYEYES_CACHE_BYTES": str(256 * 2**20),
           "MANYEYES_COMPRESS_LOOPBACK": "true"}
    logs = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    load_before = os.getloadavg()
    servers = [
        start([sys.executable, "-c", "from manyeyes.app.cli import main; main()", "serve", "--port", str(ours_port)],
              env, logs / "ours.log"),
        start([sys.executable, "-c", REFERENCE_SERVER, str(ref_port)], {}, logs / "reference.log"),
    ]
    ours, ref = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{ref_port}"
    try:
        ready_or_exit(ours, servers[0], (logs / "ours.log").read_text)
        ready_or_exit(ref, servers[1], (logs / "reference.log").read_text, route="/docs")
        with httpx.Client(timeout=300) as client:
            table = latency_table(client, ours, ref, encode, lengths, rounds, forms)
        print(f"  load test: {args.clients} clients x {seconds:g} s per server, then 1 client on ours", file=sys.stderr)
        # Two alternating halves each, so a burst of outside load cannot favour one side.
        u8 = {"Accept": FRAME}
        ours_runs, ref_runs, single_runs = [], [], []
        for half in range(2):
            ours_runs.append(asyncio.run(throughput(
                f"{ours}/api/v1/attention", lambda s: {"text": short(s + 50_000 * half), "format": "u8"}, args.clients, seconds / 2, u8)))
            ref_runs.append(asyncio.run(throughput(
                f"{ref}/attention", lambda s: {"text": short(s + 50_000 * half)}, args.clients, seconds / 2)))
            single_runs.append(asyncio.run(throughput(
                f"{ours}/api/v1/attention", lambda s: {"text": short(s + 70_000 + 50_000 * half), "format": "u8"}, 1, seconds / 2, u8)))
        time.sleep(0.5)  # the log line follows the last byte
        served_ms = access_ms(logs / "ours.log")
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            proc.wait(timeout=30)

    load_after = os.getloadavg()
    print(f"\nMiniLM on {os.cpu_count()} CPU cores, all 6 layers x 12 heads, p50 of "
          f"{', '.join(f'{rounds[n]}' for n in lengths)} new sentences per T and form; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    overhead = report(table, served_ms, forms, rounds)
    ours_rps, ours_err = sum(r for r, _ in ours_runs) / 2, sum(e for _, e in ours_runs)
    ref_rps, ref_err = sum(r for r, _ in ref_runs) / 2, sum(e for _, e in ref_runs)
    single_rps = sum(r for r, _ in single_runs) / 2
    print(f"\nThroughput, short sentences (8-14 tokens), u8 frames: ours {ours_rps:.1f} req/s at {args.clients} clients "
          f"({ours_err} errors), {single_rps:.1f} req/s single-stream ({ours_rps / single_rps:.1f}x from batching); "
          f"reference {ref_rps:.1f} req/s ({ref_err} errors): {ours_rps / ref_rps:.1f}x")

    checks = [("throughput at 32 clients >= 2x single-stream", ours_rps >= 2 * single_rps)]
    if 128 in table:
        t = table[128]
        ref_ms, ref_bytes = p50(s["ms"] for s in t["reference"]), p50(s["bytes"] for s in t["reference"])

        def ratio(form, key):
            return (ref_ms if key == "ms" else ref_bytes) / p50(s[key] for s in t[form])

        # Only the forms this run measured: a form not asked for is no miss.
        checks += [(name, ratio(form, key) >= goal) for name, form, key, goal in (
            ("T=128 json with gzip >= 5x faster like for like", "json, gzip", "ms", 5),
            ("T=128 u8 frame >= 30x faster", "u8 frame", "ms", 30),
            ("T=128 u8 frame >= 22x smaller", "u8 frame", "bytes", 22),
            ("T=128 u8 frame with zstd >= 40x smaller", "u8 frame, zstd", "bytes", 40),
        ) if form in t]
    if any(form == "u8 frame" for _, form in overhead):
        checks.append(("server time beyond forward <= 30% at every T (u8 frame)",
                       all(b <= 0.3 * f for (n, form), (_, f, b) in overhead.items() if form == "u8 frame")))
    if (16, "u8 frame") in overhead:
        checks.append(("<= 2 ms beyond forward at T=16", overhead[(16, "u8 frame")][2] <= 2))
    print("\nTargets: " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in checks))
    if 128 in table and "u8 frame, httpx" in table[128]:
        t = table[128]
        ref, ours_ms = p50(s["ms"] for s in reference_for(t, "u8 frame, httpx")), p50(s["ms"] for s in t["u8 frame, httpx"])
        print(f"(Both servers through httpx instead, T=128 u8 frame: reference {ref:.0f} ms, ours {ours_ms:.1f} ms, "
              f"{ref / ours_ms:.1f}x)")


if __name__ == "__main__":
    main()
