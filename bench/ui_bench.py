"""Browser timings of the visualizer: submit → first focused heatmap painted, → full grid painted,
and every interaction (arrow step, hide-special, threshold step, colour scale, hide-first,
layer mean) from input to the changed heatmap on screen, with the longest frame seen meanwhile.

Starts `manyeyes serve` on a loopback port, drives Debian's chromium with Playwright at a laptop
viewport, and reads the page's own performance marks and measures (manyeyes:submit,
:first-heatmap, :grid-painted, manyeyes:interaction:<name>) and Chromium's long-animation-frame
entries. Every run uses a fresh text, so each pays a real forward pass.

    python bench/ui_bench.py [--reps 5] [--lengths 16,128,512] [--steps 20]
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
INTERACTION_P95_MS = 100  # at T=512
FRAME_MS = 200
# Records every long animation frame (Chromium ≥ 123) so a freeze between measures is seen too:
# its wall time, and the page's own work in it (scripts plus style, layout and paint). On a
# loaded machine the two differ: the wall time also counts the renderer waiting for a CPU.
FRAME_OBSERVER = """
window.__frames = [];
new PerformanceObserver((list) => { for (const e of list.getEntries()) {
  const scripts = e.scripts.reduce((sum, s) => sum + s.duration, 0);
  const rendering = e.renderStart ? e.startTime + e.duration - e.renderStart : 0;
  // Scripts that overlap rendering (a forced layout) would count twice: never more than the frame.
  window.__frames.push([e.duration, Math.min(e.duration, scripts + rendering)]);
} }).observe({ type: "long-animation-frame", buffered: true });
"""
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


def interactions(page, steps: int) -> dict[str, list[float]]:
    """Each interaction `steps` times on the run on screen; returns ms per interaction name."""
    page.evaluate("() => performance.clearMeasures()")

    def wait_measures(name: str, count: int) -> None:
        page.wait_for_function(
            "([n, c]) => performance.getEntriesByName('manyeyes:interaction:' + n).length >= c", arg=[name, count], timeout=60_000
        )

    page.focus("#focus-plot")
    for i in range(steps):  # arrow steps, all within one layer and across layers
        page.keyboard.press("ArrowRight" if i % 4 else "ArrowDown")
        wait_measures("arrow", i + 1)
    page.wait_for_selector("#focus-plot[data-precision=f16]", timeout=60_000)
    for i in range(steps):
        page.click("#hide-special")
        wait_measures("hide-special", i + 1)
    if page.is_checked("#hide-special"):
        page.click("#hide-special")
    for i in range(steps):
        page.locator("#threshold").fill(f"{0.01 * (1 + i % 10):.2f}")
        wait_measures("threshold", i + 1)
    page.locator("#threshold").fill("0")
    for i in range(steps):
        page.select_option("#scale", ["fixed", "log", "head"][i % 3])
        wait_measures("scale", i + 1)
    for i in range(steps):
        page.click("#hide-first")
        wait_measures("hide-first", i + 1)
    for i in range(min(steps, 6)):  # each layer mean is a server request (float32 mean, f16 reply)
        page.select_option("#aggregate", "layer" if i % 2 == 0 else "head")
        wait_measures("aggregate", i + 1)
        page.wait_for_selector("#focus-plot[data-precision=f16]", timeout=60_000)
    measures = page.evaluate(
        "() => performance.getEntriesByType('measure').filter(m => m.name.startsWith('manyeyes:interaction:'))"
        ".map(m => [m.name.slice(21), m.duration])"
    )
    out: dict[str, list[float]] = {}
    for name, ms in measures:
        out.setdefault(name, []).append(ms)
    return out


def p95(values: list[float]) -> float:
    # "inclusive": with few samples the default method extrapolates past the largest one.
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) >= 2 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lengths", default="16,128,512")
    parser.add_argument("--steps", type=int, default=20, help="repetitions of each interaction")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    from manyeyes.model import load

    tokenizer = load("minilm", device="cpu").tokenizer
    proc, base = start_server()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.add_init_script(FRAME_OBSERVER)
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
            print(f"\nInteractions, input → changed heatmap on screen ({args.steps} of each; ms), and the longest frame:")
            print("| T   | interaction  | median | p95 | max | longest frame (wall) | its longest work | target (T=512) |")
            print("|-----|--------------|--------|-----|-----|----------------------|------------------|----------------|")
            for n in (n for n in lengths if n >= 128):
                measure(page, base, text_of_length(tokenizer, n, 100 + n))
                page.evaluate("() => { window.__frames = []; }")
                timings = interactions(page, args.steps)
                frames = page.evaluate("() => window.__frames") or [[0, 0]]
                longest = max(wall for wall, _ in frames)
                work = max(busy for _, busy in frames)
                for name, values in timings.items():
                    target = ""
                    if n == 512:
                        ok = p95(values) <= INTERACTION_P95_MS and longest <= FRAME_MS
                        target = f"p95 ≤ {INTERACTION_P95_MS}, frames ≤ {FRAME_MS}: {'met' if ok else 'MISSED'}"
                    print(f"| {n:<3} | {name:<12} | {statistics.median(values):>6.0f} | {p95(values):>3.0f} | "
                          f"{max(values):>3.0f} | {longest:>20.0f} | {work:>16.0f} | {target} |")
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
