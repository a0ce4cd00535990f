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


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated heading numbered (#speed, #speed-1)."""
    import re

    seen: dict[str, int] = {}
    anchors = set()
    for title in re.findall(r"(?m)^#{1,6} (.+)$", text):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_link_inside_the_readme_lands_on_a_heading():
    """The README is 2,400 lines: its contents and cross-references are how a reader finds a
    section, and a renamed heading left them pointing nowhere."""
    import re

    text = README.read_text(encoding="utf-8")
    outside_code = re.sub(r"(?s)```.*?```", "", text)
    links = re.findall(r"\]\(#([^)]+)\)", outside_code)
    assert len(links) > 30  # the contents list and the cross-references
    broken = sorted(set(links) - github_anchors(outside_code))  # a "# comment" in a code block is no heading
    assert not broken, f"links to no heading: {broken}"
