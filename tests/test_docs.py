"""The README names every setting the server reads, so none is a secret."""

from __future__ import annotations

from pathlib import Path

from manyeyes.app.config import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_setting_is_in_the_readmes_table():
    text = README.read_text(encoding="utf-8")
    table = text[text.index("| setting | default | what it does |"):]
    table = table[: table.index("\n\n")]
    missing = [name for name in Settings.model_fields if f"`MANYEYES_{name.upper()}`" not in table]
    assert not missing, f"settings missing from the README's table: {missing}"
