"""Browser timings of the visualizer: submit → first focused heatmap painted, and → full grid painted.

Starts `manyeyes serve` on a loopback port, drives Debian's chromium with Playwright at a laptop
viewport, and reads the page's own performance marks (manyeyes:submit, manyeyes:first-heatmap,
manyeyes:grid-painted). Every run uses a fresh text, so each pays a real forward pass.

    python bench/ui_bench.py [--reps 5] [--lengths 16,128,512]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
TARGETS = {128: ("first heatmap", 500), 512: ("full grid", 2000)}
WORDS = "the river bank was muddy after heavy rain and every boat stayed close to the shore".split()


def text_of_length(tokenizer, n_tokens: int, rep: int) -> str:
    """A sentence that MiniLM splits into exactly n_tokens (specials included); rep makes it new."""
    words = [f"run{rep}"]
    while len(tokenizer.encode(" ".join(words)).tokens) < n_tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    while len(tokenizer.encode(" ".join(words)).tokens) > n_tokens:
        words.pop()
    text = " ".join(words)
    assert len(tokenizer.encode(text).tokens) == n_tokens, n_tokens
    return text


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "manyeyes.app.cli", "serve", "--port", str(port), "--log-level", "warning"],
        cwd=Path(__file__).resolve().parents[1],
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not become ready")


def measure(page, base: str, text: str) -> tuple[float, float, float]:
    page.goto(base)
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#text", text)
    page.press("#text", "Enter")
    page.wait_for_function("() => performance.getEntriesByName('manyeyes:grid-painted').length > 0", timeout=60_000)
    marks = page.evaluate("() => Object.fromEntries(performance.getEntriesByType('mark').map(m => [m.name, m.startTime]))")
    submit = marks["manyeyes:submit"]
    return tuple(marks[f"manyeyes:{name}"] - submit for name in ("response", "first-heatmap", "grid-painted"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lengths", default="16,128,512")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    from manyeyes.model import load

    tokenizer = load("minilm", device="cpu").tokenizer
    proc, base = start_server()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            measure(page, base, text_of_length(tokenizer, 16, -1))  # warm the server's and browser's caches
            print(f"MiniLM (6 layers x 12 heads), chromium {browser.version}, 1440x900, median of {args.reps} runs;")
            print("times from submit; the first response is the server's forward pass plus the network;")
            print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
            print("| T   | first response (ms) | first heatmap (ms) | full grid (ms) | target |")
            print("|-----|---------------------|--------------------|----------------|--------|")
            for n in lengths:
                timings = [measure(page, base, text_of_length(tokenizer, n, rep)) for rep in range(args.reps)]
                response, first, full = (statistics.median(t[i] for t in timings) for i in range(3))
                target = ""
                if n in TARGETS:
                    what, limit = TARGETS[n]
                    got = first if what == "first heatmap" else full
                    target = f"{what} ≤ {limit} ms: {'met' if got <= limit else 'MISSED'}"
                print(f"| {n:<3} | {response:>19.0f} | {first:>18.0f} | {full:>14.0f} | {target} |")
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
