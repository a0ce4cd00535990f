"""Where compressing an answer makes it faster end to end: u8 frames as they are, with zstd and with
gzip, side by side, on loopback and through links of a given bandwidth.

A link is a pacing proxy in a process of its own (`--proxy`): it forwards each direction no faster
than the rate, as a link of that bandwidth would deliver the bytes (no added latency, no loss). The
server compresses for loopback clients here (`MANYEYES_COMPRESS_LOOPBACK=true`), since the proxy
reaches it from loopback; by default it does not (README, "Compression"), and the loopback rows
show why. For each link and T, every request gets a new sentence (the run cache never answers),
the codings alternate request by request (which goes first turns by round), and the ratio printed
is identity's p50 over the coding's: above 1, the coding is faster. The spread is p25-p75 of the
per-round ratios. gzip is what a browser gets over plain http (it offers zstd only over https).

    python bench/link_bench.py [--rates-mbit 1000,100] [--lengths 64,128,512] [--rounds 9] [--codings zstd,gzip]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_http import Connection  # noqa: E402
from live_server import free_port, ready_or_exit  # noqa: E402
from serve_bench import FRAME, sentence, settle, start  # noqa: E402

from manyeyes.app.services.wire import read_frame  # noqa: E402

CHUNK = 128 * 1024


async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bytes_per_s: float) -> None:
    """Copies reader to writer as a link of that rate would: a chunk is let out when its last byte
    would have arrived, max(when it came in, when the chunk before it was through) + its size /
    rate. The chunks are read as they come (a task of their own), so a late timer wake-up does
    not add up: each chunk's time comes from the model, not from the clock after a sleep."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        while chunk := await reader.read(CHUNK):
            arrived.put_nowait((loop.time(), chunk))
        arrived.put_nowait((loop.time(), b""))

    reading = asyncio.create_task(read())
    through = 0.0
    try:
        while True:
            at, chunk = await arrived.get()
            if not chunk:
                break
            through = max(at, through) + len(chunk) / bytes_per_s
            delay = through - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            writer.write(chunk)
            await writer.drain()
    finally:
        reading.cancel()
        writer.close()


def run_proxy(listen_port: int, upstream_port: int, mbit: float) -> None:
    rate = mbit * 1e6 / 8

    async def serve() -> None:
        async def handle(client_r, client_w) -> None:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
            # Paced writes are small and spaced: with Nagle's algorithm each waited for the
            # client's delayed ACK (tens of ms), which no real link of this rate would add.
            for writer in (client_w, server_w):
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(paced(client_r, server_w, rate), paced(server_r, client_w, rate), return_exceptions=True)

        server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
        print("proxy ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def timed(conn: Connection, text: str, encoding: str) -> tuple[float, int, str | None]:
    t0 = time.perf_counter()
    answer = conn.post_json("/api/v1/attention", {"text": text, "format": "u8"}, {"Accept": FRAME, "Accept-Encoding": encoding})
    ms = (time.perf_counter() - t0) * 1000
    assert answer.status == 200, answer.body[:200]
    header = read_frame(answer.body)[0]
    n = len(header["tokens"])
    assert header["attention"]["shape"] == [6, 12, n, n]
    return ms, answer.wire_bytes, answer.headers.get("content-encoding")


def measure(url: str, lengths: list[int], rounds: int, codings: list[str], encode, seed: int) -> dict:
    out = {}
    order = ["identity", *codings]
    with Connection(url, timeout=600) as conn:
        for n in lengths:
            rows = {e: [] for e in order}
            sent_as = {e: [] for e in codings}
            for i in range(rounds + 1):  # the first round warms up and is not counted
                texts = {e: sentence(n, seed + 1000 * n + 10 * i + k, encode) for k, e in enumerate(order)}
                turn = i % len(order)
                for e in order[turn:] + order[:turn]:
                    ms, nbytes, got = timed(conn, texts[e], e)
                    settle()
                    if i:
                        rows[e].append((ms, nbytes))
                        if e in sent_as:
                            sent_as[e].append(got)
            out[n] = (rows, sent_as)
    return out


def report(name: str, table: dict) -> None:
    for n, (rows, sent_as) in table.items():
        ident = [ms for ms, _ in rows["identity"]]
        for coding, encodings in sent_as.items():
            coded = [ms for ms, _ in rows[coding]]
            paired = sorted(a / b for a, b in zip(ident, coded))
            q = lambda f: paired[round(f * (len(paired) - 1))]  # noqa: E731
            sizes = (statistics.median(b for _, b in rows["identity"]), statistics.median(b for _, b in rows[coding]))
            as_asked = coding if all(e == coding for e in encodings) else f"NOT {coding} ({set(encodings)})"
            print(f"| {name} | {n} | {coding} | {statistics.median(ident):.1f} ms | {statistics.median(coded):.1f} ms ({as_asked}) | "
                  f"{sizes[0] / 1e6:.2f} / {sizes[1] / 1e6:.2f} MB | {statistics.median(ident) / statistics.median(coded):.2f}x "
                  f"({q(0.25):.2f}-{q(0.75):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates-mbit", default="1000,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--lengths", default="64,128,512")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--codings", default="zstd,gzip", help="content codings to compare with identity, comma-separated")
    parser.add_argument("--proxy", nargs=3, metavar=("LISTEN", "UPSTREAM", "MBIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy:
        run_proxy(int(args.proxy[0]), int(args.proxy[1]), float(args.proxy[2]))
        return

    from manyeyes.model import load

    encode = load("minilm", device="cpu").encode
    lengths = [int(n) for n in args.lengths.split(",")]
    rates = [float(r) for r in args.rates_mbit.split(",") if r]
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="link-bench-"))
    env = {"MANYEYES_MODELS": '{"minilm": "minilm"}', "MANYEYES_DEVICE": "cpu", "MANYEYES_COMPRESS_LOOPBACK": "true"}
    procs = [start([sys.executable, "-c", "from manyeyes.app.cli import main; main()", "serve", "--port", str(port)],
                   env, logs / "server.log")]
    try:
        ready_or_exit(f"http://127.0.0.1:{port}", procs[0], (logs / "server.log").read_text)
        links = [("loopback", f"http://127.0.0.1:{port}")]
        for mbit in rates:
            proxy_port = free_port()
            procs.append(start([sys.executable, __file__, "--proxy", str(proxy_port), str(port), str(mbit)], {},
                               logs / f"proxy-{mbit:g}.log"))
            links.append((f"{mbit:g} Mbit/s", f"http://127.0.0.1:{proxy_port}"))
        time.sleep(1.0)  # the proxies bind within a fraction of that
        print(f"MiniLM u8 frames, all 6 layers x 12 heads, p50 of {args.rounds} new sentences per link, T and encoding\n")
        print("| link | T | coding | identity | coded | bytes on the wire (identity / coded) | identity / coded (p25-p75) |")
        print("|---|---:|---|---:|---:|---:|---:|")
        codings = [c for c in args.codings.split(",") if c]
        for k, (name, url) in enumerate(links):
            report(name, measure(url, lengths, args.rounds, codings, encode, 7_000 * (k + 1)))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
