"""Mutation check: plant small deliberate bugs, one at a time, and make sure the tests catch each.

Every mutant names a file, an exact piece of text that must occur in it exactly once, its
replacement, and the test subset that must fail with it. Each runs in its own temporary copy of
the repository (tracked and untracked-but-not-ignored files), with PYTHONPATH pointing at that
copy, so the working tree is never touched and two mutants can run side by side.

    python bench/mutants.py                 # every mutant, 2 at a time, after a clean baseline
    python bench/mutants.py -k gelu -k grid # only mutants whose name contains one of these
    python bench/mutants.py --list
    python bench/mutants.py --no-baseline   # skip the unmutated run (the suite itself runs it in CI)

Prints caught/missed per mutant and the time each took. Exits non-zero when any mutant is
missed, when its old text is not found exactly once (the code moved: refresh the mutant, never
skip it), when a subset errors instead of failing (collection errors, nothing selected), or when
the unmutated baseline does not pass.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: paths, node ids, -k expressions


PARITY = "tests/test_parity.py"
TRUTH = "tests/browser/test_page_truth.py"

MUTANTS = [
    # ---- the three bugs that once passed the whole suite (issue 16)
    Mutant("bert-positions-clamped-at-40", "model/bert.py",
           "return torch.arange(in_idx.shape[1], device=in_idx.device)",
           "return torch.arange(in_idx.shape[1], device=in_idx.device).clamp(max=40)",
           (PARITY, "-k", "512_positions or pair or random_bert")),
    Mutant("gelu-new-read-as-exact-gelu", "model/keymap.py",
           '"gelu_new": "tanh"', '"gelu_new": "erf"',
           (PARITY, "-k", "sharpened")),
    Mutant("grid-thumbnails-all-layer0-head0", "static/js/grid.js",
           "run.headBytes(layer, h)", "run.headBytes(0, 0)",
           (TRUTH, "-k", "thumbnail")),
    # ---- model/
    Mutant("gpt-positions-clamped-at-200", "model/gpt.py",
           "positions = torch.arange(offset, offset + num_tokens, device=in_idx.device)",
           "positions = torch.arange(offset, offset + num_tokens, device=in_idx.device).clamp(max=200)",
           ("tests/test_loading.py", "-k", "every_position")),
    Mutant("softmax-over-queries", "model/attention.py",
           "dim=-1, out=capture.weights_out", "dim=-2, out=capture.weights_out",
           (PARITY, "-k", "minilm_matches")),
    Mutant("causal-mask-off-by-one", "model/attention.py",
           "torch.ones(context_length, context_length), diagonal=1)",
           "torch.ones(context_length, context_length), diagonal=2)",
           ("tests/test_attention.py", PARITY, "-k", "causal or gpt2")),
    Mutant("key-padding-mask-ignored", "model/attention.py",
           "blocked = padded if blocked is None else (blocked | padded)", "pass",
           ("tests/test_attention.py", "tests/test_batch.py")),
    Mutant("heads-interleaved-before-out-proj", "model/attention.py",
           "context = context.view(b, heads, num_tokens, head_dim).transpose(1, 2)",
           "context = context.view(b, heads, num_tokens, head_dim)",
           (PARITY, "-k", "minilm_matches")),
    Mutant("pair-offsets-read-from-first-text", "model/tokenizer.py",
           "span = sources[segment][start:end]", "span = sources[0][start:end]",
           ("tests/test_tokenizer.py",)),
    Mutant("packed-copy-blind-to-in-place-edits", "model/packed.py",
           "key = (weight.data_ptr(), weight._version, tuple(weight.shape))",
           "key = (weight.data_ptr(), tuple(weight.shape))",
           ("tests/test_packed.py",)),
    Mutant("heads-reported-under-the-wrong-numbers", "model/runtime.py",
           "attention = (to_host or torch.Tensor.cpu)(weights).transpose(0, 1)",
           "attention = (to_host or torch.Tensor.cpu)(weights).transpose(0, 1).roll(1, dims=2)",
           ("tests/test_tiny_gpt.py", "-k", "previous_token")),
    # ---- app/
    Mutant("u8-scaled-by-256", "app/services/payload.py",
           "np.rint(weights[i] * np.float32(255.0))", "np.rint(weights[i] * np.float32(256.0))",
           ("tests/api/test_api_formats.py",)),
    Mutant("f16-column-major", "app/services/payload.py",
           ".copy_(attention).numpy()",
           ".copy_(attention.transpose(-1, -2)).numpy()",
           ("tests/api/test_api_formats.py", "-k", "row_major")),
    Mutant("slice-ignores-the-asked-order", "app/services/payload.py",
           "attention.index_select(0, torch.tensor(layers))",
           "attention.index_select(0, torch.tensor(sorted(layers)))",
           ("tests/api/test_api_contract.py", "-k", "order")),
    Mutant("run-id-ignores-truncate", "app/services/cache.py",
           "[model, text, text_pair, truncate]", "[model, text, text_pair, False]",
           ("tests/api/test_api_contract.py", "-k", "run_id")),
    Mutant("heap-top-trimmed-at-twice-the-mmap-threshold", "app/memory.py",
           "trim = 2 * mmap_threshold if trim_threshold is None else trim_threshold",
           "trim = 2 * mmap_threshold",
           ("tests/test_buffers.py", "-k", "trim_threshold")),
    Mutant("body-limit-doubled-while-reading", "app/middleware.py",
           "if size > self.max_bytes:", "if size > 2 * self.max_bytes:",
           ("tests/api/test_api_errors.py", "-k", "body_over_the_limit")),
    Mutant("queue-admits-one-more", "app/services/batcher.py",
           "if waiting + n > self.max_queue:", "if waiting + n > self.max_queue + 1:",
           ("tests/api/test_api_errors.py", "-k", "full_queue")),
    Mutant("lean-route-skips-the-routers-own-dependencies", "app/routes/lean.py",
           "value = await call(request)\n                if name:\n                    arguments[name] = value",
           "if name:\n                    arguments[name] = await call(request)",
           ("tests/api/test_lean_route.py", "-k", "skips_dependency_solving")),
    Mutant("answer-budget-lets-a-client-take-it-all", "app/services/slots.py",
           "and self.held_by.get(client, 0) + nbytes <= self.limit // 2", "",
           ("tests/api/test_slots.py", "-k", "bytes")),
    Mutant("measures-outside-the-answer-budget", "app/services/measures.py",
           "measures_bytes(asked_cells, fmt, tokens, names, per_head)", "0",
           ("tests/api/test_budget_routes.py", "-k", "holds_its_bytes")),
    Mutant("shared-forward-rows-of-another-worker", "app/services/shared_forward.py",
           "table[:, row : row + b, :w] = request.table", "table[:, :b, :w] = request.table",
           ("tests/api/test_shared_forward.py", "-k", "one_forward")),
    Mutant("workers-accept-from-one-shared-socket", "app/workers.py",
           "    own_socket = spread_by_kernel()\n", "    own_socket = False\n",
           ("tests/api/test_workers.py", "-k", "spread")),
    # ---- static/
    Mutant("thumbnail-colour-scale-fixed-not-per-head", "static/js/grid.js",
           "Math.min(1, scaled(v, scale, peak))", "Math.min(1, scaled(v, scale, 1))",
           (TRUTH, "-k", "thumbnail")),
    Mutant("pair-block-renormalised-over-its-own-keys", "static/js/transform.js",
           "for (let k = 0; k < visibleKeys.length; k++) total += matrix[base + visibleKeys[k]];",
           "for (let k = 0; k < nCols; k++) total += matrix[base + cols[k]];",
           (TRUTH, "-k", "pair_block")),
    Mutant("causal-diagonal-masked", "static/js/run.js",
           "(causal && k > q)", "(causal && k >= q)",
           (TRUTH, "-k", "causal")),
    Mutant("sliding-window-one-key-short", "static/js/run.js",
           "(far && k <= q - window)", "(far && k <= q - window + 1)",
           ("tests/browser/test_sliding_window.py", "-k", "short_run")),
    Mutant("long-hatch-misses-the-first-later-key", "static/js/run.js",
           "causal ? Math.min(T, q + 1) : T", "causal ? Math.min(T, q + 2) : T",
           ("tests/browser/test_sliding_window.py", "-k", "long_run")),
    Mutant("permalink-saves-the-layer-as-the-head", "static/js/main.js",
           "layer: state.layer, head: state.head, aggregate: state.aggregate,",
           "layer: state.layer, head: state.layer, aggregate: state.aggregate,",
           (TRUTH, "-k", "permalink")),
    Mutant("head-view-hover-isolates-nothing", "static/js/headview.js",
           'if (focus && (focus.axis === "row" ? r : c) !== focus.index) continue;', "",
           (TRUTH, "-k", "head_view")),
]


def misplaced(root: Path, mutants: list[Mutant]) -> list[str]:
    """Mutants whose old text is not in their file exactly once: the code moved, refresh them."""
    problems = []
    for m in mutants:
        path = root / m.file
        count = path.read_text(encoding="utf-8").count(m.old) if path.is_file() else -1
        if count != 1:
            problems.append(f"{m.name}: {m.file}: old text found {count if count >= 0 else 'no file, so 0'} times: {m.old!r}")
    return problems


def repository_files(root: Path) -> list[str]:
    """What a clone plus the uncommitted work holds: tracked and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and (root / p).is_file()]


def copy_repository(root: Path, files: list[str], into: Path) -> None:
    for rel in files:
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def apply(mutant: Mutant, copy: Path) -> None:
    path = copy / mutant.file
    if not path.is_file():
        raise LookupError(f"{mutant.file} does not exist")
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.old)
    if count != 1:
        raise LookupError(f"{mutant.file}: old text found {count} times, expected exactly once: {mutant.old!r}")
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def pytest_in(copy: Path, args: tuple[str, ...], timeout_s: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout_s:.0f} s\n{(exc.stdout or '')[-2000:]}"
    return done.returncode, done.stdout[-3000:] + done.stderr[-2000:]


def imports_from(copy: Path) -> bool:
    """The copy's own code is what runs there, not an installed manyeyes or the working tree."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run([sys.executable, "-c", "import manyeyes.model.attention as m; print(m.__file__)"],
                         cwd=copy, env=env, capture_output=True, text=True)
    return out.returncode == 0 and Path(out.stdout.strip()).resolve().is_relative_to(copy.resolve())


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # caught, MISSED, ERROR
    seconds: float
    detail: str = ""


def run_mutant(mutant: Mutant, files: list[str], timeout_s: float) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = Path(tmp)
        copy_repository(ROOT, files, copy)
        try:
            apply(mutant, copy)
        except LookupError as exc:
            return Outcome(mutant, "ERROR", time.monotonic() - started, str(exc))
        if not imports_from(copy):
            return Outcome(mutant, "ERROR", time.monotonic() - started, "the copy does not import its own manyeyes")
        rc, output = pytest_in(copy, mutant.tests, timeout_s)
    seconds = time.monotonic() - started
    if rc == 1:  # some test failed: the mutant was caught
        return Outcome(mutant, "caught", seconds, last_failure(output))
    if rc == 0:
        return Outcome(mutant, "MISSED", seconds, output.strip().splitlines()[-1] if output.strip() else "")
    # 2: interrupted or collection error, 4: usage error, 5: nothing selected, 124: timeout.
    return Outcome(mutant, "ERROR", seconds, f"pytest exit status {rc}\n{output[-1500:]}")


def last_failure(output: str) -> str:
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return failed[0][:160] if failed else ""


def baseline(files: list[str], mutants: list[Mutant], timeout_s: float) -> Outcome:
    """Every selected subset passes unmutated, or a 'caught' would mean nothing."""
    started = time.monotonic()
    clean = Mutant("baseline (no mutation)", "", "", "", ())
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        copy = Path(tmp)
        copy_repository(ROOT, files, copy)
        failures = []
        for args in dict.fromkeys(m.tests for m in mutants):
            rc, output = pytest_in(copy, args, timeout_s)
            if rc != 0:
                failures.append(f"{' '.join(args)}: exit {rc}\n{output[-1500:]}")
    seconds = time.monotonic() - started
    return Outcome(clean, "ERROR" if failures else "passes", seconds, "\n".join(failures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", action="append", default=[], help="only mutants whose name contains this (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test subset (default 300)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of every subset")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    args = parser.parse_args(argv)

    mutants = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in mutants:
            print(f"{m.name:45} {m.file:30} {' '.join(m.tests)}")
        return 0
    if not mutants:
        print(f"no mutant matches {args.k}", file=sys.stderr)
        return 2
    started = time.monotonic()
    problems = misplaced(ROOT, mutants)
    if problems:  # loudly, before spending minutes on the others
        print("mutants that no longer apply (refresh their old text):\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    files = repository_files(ROOT)
    status = 0
    if not args.no_baseline:
        base = baseline(files, mutants, args.timeout)
        print(f"{'baseline':45} {base.verdict:7} {base.seconds:6.1f} s", flush=True)
        if base.verdict != "passes":
            print(base.detail)
            return 1
    print(f"{len(mutants)} mutants, {args.jobs} at a time", flush=True)
    if args.jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Each subset's torch would start a thread per core, and the subsets' spinning OpenMP
        # threads would wait on each other (six model mutants: 52-55 s wall, 47-49 s with this).
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(run_mutant, m, files, args.timeout) for m in mutants]
        for future in futures:
            o = future.result()
            print(f"{o.mutant.name:45} {o.verdict:7} {o.seconds:6.1f} s  {o.mutant.file}", flush=True)
            if o.verdict == "caught" and o.detail:
                print(f"    by {o.detail}", flush=True)
            elif o.verdict != "caught":
                status = 1
                print("    " + o.detail.replace("\n", "\n    "), flush=True)
    outcomes = [f.result() for f in futures]
    caught = sum(o.verdict == "caught" for o in outcomes)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"caught {caught} of {len(outcomes)} in {time.monotonic() - started:.0f} s wall "
          f"({os.cpu_count()} CPUs, load average {load:.1f} at the end)")
    return status


if __name__ == "__main__":
    sys.exit(main())
