"""The mutation list in bench/mutants.py still applies to this tree.

Running every mutant takes minutes, so CI does it once after the suite (`.ci/run`). This fast
check fails the suite as soon as code moves under a mutant: its old text must be found exactly
once, or the harness would be testing nothing there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_harness():
    spec = importlib.util.spec_from_file_location("bench_mutants", ROOT / "bench" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_every_mutant_still_applies_exactly_once():
    harness = load_harness()
    assert harness.misplaced(ROOT, harness.MUTANTS) == []


def test_the_list_covers_the_issue_bugs_and_every_layer_of_the_project():
    harness = load_harness()
    names = [m.name for m in harness.MUTANTS]
    assert len(names) == len(set(names))
    assert {"bert-positions-clamped-at-40", "gelu-new-read-as-exact-gelu", "grid-thumbnails-all-layer0-head0"} <= set(names)
    assert len(names) >= 13
    for top in ("model/", "app/", "static/"):
        assert any(m.file.startswith(top) for m in harness.MUTANTS), top
    for m in harness.MUTANTS:
        assert m.old != m.new and m.tests, m.name
        paths = [a.split("::")[0] for a in m.tests if a.startswith("tests/")]
        assert paths and all((ROOT / p).is_file() for p in paths), m.name


def test_the_readme_counts_the_mutants_there_are():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"It plants {len(load_harness().MUTANTS)} small bugs" in text
