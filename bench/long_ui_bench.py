"""The page at any length (issue 10): browser timings of a long run, which the page draws from the
server's overview, tiles and top-k rows (static/js/long_focus.js), never from the whole tensor.

For each T, on fresh texts of exactly T tokens, against a real `manyeyes serve` with a random-weight
llama (6 layers, 12 query heads, 4 kv heads, width 384, tiny-gpt's byte tokenizer, as
bench/long_bench.py builds it), in Debian's chromium at 1440 x 900, from the page's own marks:
- first heatmap: the answer → the focused head painted (its overview; targets ≤ 500 ms);
- tiles in view: the answer → every tile of the first view painted (the refinement, no target);
- whole grid: the answer → every layer × head thumbnail painted (target ≤ 1500 ms);
- pan and zoom steps (a fixed walk: zoom in by halves to 64 tokens, pans at each size, zoom out),
  each from Plotly's relayout to the changed heatmap on screen (the tiles at hand, coarser ones
  stretched: target p95 ≤ 100 ms), and to every tile of the new window painted (refined); and the
  page's own work in the step's longest frame (scripts, style, layout, paint: on a loaded 2-core
  machine a frame's wall time mostly counts the renderer waiting for a CPU).
The requests are checked too: none asks for the whole tensor (/attention, /mean, or a tile of
more than 1024 x 1024 cells).

    nice -n 10 python bench/long_ui_bench.py [--reps 2] [--sizes 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import serve  # noqa: E402
from long_bench import random_llama, text_of  # noqa: E402
from ui_bench import FRAME_OBSERVER  # noqa: E402

from manyeyes.model import load  # noqa: E402

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
TARGETS_MS = {"first heatmap": 500, "whole grid": 1500, "step p95": 100}
NAME = "llama-random"

# One pan or zoom: relayout to the window, then the frame that shows it; the refinement is the
# page's manyeyes:long:refined measure that follows (every tile of the window painted).
# The page's own work in the step: the longest animation frame (over 50 ms) that began in it,
# scripts plus style, layout and paint (ui_bench's observer); 0 when none was that long.
STEP = """async ([q0, q1, k0, k1]) => {
  const gd = document.getElementById('focus-plot');
  performance.clearMeasures('manyeyes:long:refined');
  const seen = window.__frames.length;
  const start = performance.now();
  await Plotly.relayout(gd, {'xaxis.range': [k0 - 0.5, k1 - 0.5], 'yaxis.range': [q1 - 0.5, q0 - 0.5]});
  await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
  const shown = performance.now() - start;
  await new Promise((resolve) => setTimeout(resolve, 60));  // the frame's entry is reported late
  const work = Math.max(0, ...window.__frames.slice(seen).map(([_wall, own]) => own));
  return [start, shown, work];
}"""
REFINED = """(start) => {
  const m = performance.getEntriesByName('manyeyes:long:refined').at(-1);
  return m ? m.startTime + m.duration - start : null;
}"""


def walk(T: int) -> list[tuple[int, int, int, int]]:
    """Windows (q0, q1, k0, k1): halving down to 64 tokens around the diagonal, three pans at each
    size (down, left, down-right), then back out."""
    steps, size, centre = [], T, T // 2
    while size > 64:
        size //= 2
        q0 = max(0, min(T - size, centre - size // 2))
        steps.append((q0, q0 + size, q0, q0 + size))
        for dq, dk in ((size // 4, 0), (0, -size // 4), (size // 8, size // 8)):
            q0 = max(0, min(T - size, q0 + dq))
            k0 = max(0, min(T - size, steps[-1][2] + dk))
            steps.append((q0, q0 + size, k0, k0 + size))
    steps += [(0, T // 8, 0, T // 8), (0, T, 0, T)]
    return steps


def whole_tensor_requests(urls: list[str]) -> list[str]:
    bad = []
    for url in urls:
        parts = urlsplit(url)
        if re.search(r"/runs/[^/]+/(attention|mean)$", parts.path):
            bad.append(url)
        elif parts.path.endswith("/tile"):
            q = {k: int(v[0]) for k, v in parse_qs(parts.query).items() if v[0].isdigit()}
            rows = q.get("rows", q["q1"] - q["q0"])
            cols = q.get("cols", q["k1"] - q["k0"])
            if rows > 1024 or cols > 1024:
                bad.append(url)
    return bad


def one_run(page, base: str, text: str) -> dict:
    page.goto(base)
    page.wait_for_selector("body[data-ready=true]")
    page.select_option("#model", NAME)
    page.fill("#text", text)
    page.press("#text", "Enter")
    page.wait_for_function("() => performance.getEntriesByName('manyeyes:grid-painted').length > 0", timeout=900_000)
    page.wait_for_function("() => document.getElementById('focus-plot').dataset.tilesPending === '0'", timeout=300_000)
    marks = page.evaluate("() => Object.fromEntries(performance.getEntriesByType('mark').map(m => [m.name, m.startTime]))")
    refined = page.evaluate("() => { const m = performance.getEntriesByName('manyeyes:long:refined')[0];"
                            " return m.startTime + m.duration; }")
    answer = marks["manyeyes:response"]
    out = {
        "forward": answer - marks["manyeyes:submit"],
        "first heatmap": marks["manyeyes:first-heatmap"] - answer,
        "tiles in view": refined - answer,
        "whole grid": marks["manyeyes:grid-painted"] - answer,
        "shown": [], "refined": [], "work": [],
    }
    T = page.evaluate("() => document.getElementById('focus-plot').plotted().rows")
    for window in walk(T):
        start, shown, work = page.evaluate(STEP, list(window))
        page.wait_for_function("() => document.getElementById('focus-plot').dataset.tilesPending === '0'", timeout=300_000)
        page.wait_for_function("() => performance.getEntriesByName('manyeyes:long:refined').length > 0", timeout=300_000)
        out["shown"].append(shown)
        out["work"].append(work)
        out["refined"].append(page.evaluate(REFINED, start))
    return out


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) >= 2 else values[0]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}..{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--sizes", default="2048,4096,8192")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        spec = str(random_llama(Path(tmp) / "llama", max(sizes), layers=6, heads=12, kv_heads=4, width=384))
        model = load(spec, device="cpu")
        settings = dict(warmup="false", dense_max_tokens=1024, request_timeout_s=900)
        with serve(models=json.dumps({NAME: spec}), **settings) as (url, _pid), sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.add_init_script(FRAME_OBSERVER)
            urls: list[str] = []
            page.on("request", lambda request: urls.append(request.url))
            print(f"random llama 6 x 12 (4 kv heads, width 384), chromium {browser.version}, 1440x900, {args.reps} runs "
                  f"per T, fresh texts; load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            print("ms after the answer: median (min..max); steps: p50 / p95 / max over every step of every run\n")
            print("| T    | forward (s) | first heatmap | tiles in view | whole grid | step shown p50/p95/max | step refined p50/p95/max | step's own work p95/max |")
            print("|------|-------------|---------------|---------------|------------|------------------------|--------------------------|-------------------------|")
            verdicts = []
            for T in sizes:
                runs = [one_run(page, url, text_of(T, 1000 * T + rep, model)) for rep in range(args.reps)]
                pick = lambda key: [r[key] for r in runs]  # noqa: E731
                shown = [v for r in runs for v in r["shown"]]
                refined = [v for r in runs for v in r["refined"]]
                work = [v for r in runs for v in r["work"]]
                forward = [v / 1000 for v in pick("forward")]
                print(f"| {T:<4} | {statistics.median(forward):>11.1f} | {spread(pick('first heatmap')):>13} | "
                      f"{spread(pick('tiles in view')):>13} | {spread(pick('whole grid')):>10} | "
                      f"{statistics.median(shown):>6.0f} / {p95(shown):>4.0f} / {max(shown):>4.0f}       | "
                      f"{statistics.median(refined):>6.0f} / {p95(refined):>5.0f} / {max(refined):>5.0f}       | "
                      f"{p95(work):>10.0f} / {max(work):>4.0f}       |")
                for name, value in (("first heatmap", max(pick("first heatmap"))), ("whole grid", max(pick("whole grid"))),
                                    ("step p95", p95(shown))):
                    verdicts.append(f"T={T} {name} ≤ {TARGETS_MS[name]} ms: {'met' if value <= TARGETS_MS[name] else 'MISSED'} ({value:.0f})")
            browser.close()
        bad = whole_tensor_requests(urls)
        print("\n" + "\n".join(verdicts))
        print(f"requests: {len(urls)}, tiles: {sum('/tile?' in u for u in urls)}, asking for a whole tensor: {len(bad)}")
        if bad:
            print("\n".join(bad[:5]))


if __name__ == "__main__":
    main()
