"""Right-to-left tokens and invisible characters on the page (static/js/tokens.js isolate and
visibleSpaces): a Hebrew or Arabic label reordered the reading around it ("#2 ל → #8 ו: 0.045" read
"#2 0.045 :ו #8 → ל"), a text's RIGHT-TO-LEFT OVERRIDE reversed the rest of the reading, and a
zero-width joiner or a bidi control was a blank label where the exported figures wrote ‹200D›."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests.browser.conftest import serving
from tests.browser.test_page import CAPTURE_EXPORT, api_attention, hover_cell, open_page, run, wait_grid

pytestmark = pytest.mark.browser

FSI, LRI, PDI = "\u2068", "\u2066", "\u2069"
BIDI_CONTROLS = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
HEBREW = "שלום world 123 עולם"  # MiniLM: [CLS] ש ##ל ##ו ##ם world 123 ע ##ו ##ל ##ם [SEP]
RLO_TEXT = "abc\u202edef ghi\u200dx"  # tiny-gpt: U+202E is tokens 3-5, U+200D tokens 13-15
WEIGHT = r"\d\.\d{3}|0\.0*[1-9]\d"  # weightText: three decimals, or two significant digits under 0.01

# Where each of `parts` is drawn, found in that order in the element's text: the left and right
# edges (px) of its first box and that box's top, so that a test reads the order the eye does.
DRAWN_AT = """([selector, parts]) => {
  const node = document.querySelector(selector);
  const text = node.firstChild;
  let from = 0;
  return parts.map((part) => {
    const at = text.data.indexOf(part, from);
    if (at < 0) return null;
    from = at + part.length;
    const range = document.createRange();
    range.setStart(text, at);
    range.setEnd(text, at + part.length);
    const box = range.getClientRects()[0];
    return [box.left, box.right, Math.round(box.top)];
  });
}"""


def assert_left_to_right(page, selector: str, parts: list[str]) -> None:
    """The parts, in their logical order, are drawn left to right on one line."""
    boxes = page.evaluate(DRAWN_AT, [selector, parts])
    assert None not in boxes, (parts, boxes)
    assert len({top for _, _, top in boxes}) == 1, (parts, boxes)
    for (part, (_, right, _top)), (after, (left, _, _)) in zip(zip(parts, boxes), zip(parts[1:], boxes[1:])):
        assert left >= right - 0.5, f"{after!r} is drawn left of {part!r}: {list(zip(parts, boxes))}"


def hebrew_in_text_labels(page, server):
    open_page(page, server)
    run(page, HEBREW)
    page.select_option("#labels", "text")
    page.wait_for_function("() => document.querySelectorAll('.hv-left li')[2]?.textContent === 'ל'")


@pytest.fixture(scope="module")
def gpt():
    """tiny-gpt's byte-level tokens keep U+202E and U+200D as tokens (MiniLM's tokenizer drops them)."""
    with serving({"tiny-gpt": "tiny-gpt"}) as url:
        yield url


def test_labels_write_invisible_characters_as_the_exported_figures_do(server, page):
    from manyeyes.labels import visible_spaces

    samples = ["a\u200db", "\u200b", "\u200e\u200f", "x\u202ey\u202c", "\u2066\u2069", "\ufeff", "soft\u00adhyphen",
               "\u061c", "\u00a0\u3000\u2028", "\x85\x1b\x7f", "\ue000", "👩\u200d💻", "e\u0301", "שלום", "नमस्ते",
               " \n\t\r", "🇯🇵"]
    open_page(page, server)
    shown = page.evaluate("async (s) => { const t = await import('/static/js/tokens.js'); return s.map(t.visibleSpaces); }",
                          samples)
    assert shown == [visible_spaces(s) for s in samples]
    assert shown[0] == "a‹200D›b" and shown[3] == "x‹202E›y‹202C›" and shown[6] == "soft‹AD›hyphen"
    tokens = [{"text": "\u202e", "piece": "â", "start": 3, "end": 4}, {"text": "\u200d", "piece": "â", "start": 11, "end": 12}]
    labels = page.evaluate("async (tokens) => (await import('/static/js/tokens.js')).tokenLabels(tokens, 'text')", tokens)
    assert labels == ["‹202E›", "‹200D›"]


def test_piece_labels_are_the_figures_and_the_clis(server, page):
    """The page (tokens.js pieceLabel, guessLabel) and Python (model/tokenizer.py token_label,
    bytes_label: the figures and `manyeyes attend`) label a piece alike, bytes that are no UTF-8
    (an overlong form, a surrogate's, 0xF8) included: the page had decoded those leniently."""
    from manyeyes.model import load
    from manyeyes.labels import BYTE_OF_CHAR, bytes_label, token_label, visible_spaces

    char_of = {b: ch for ch, b in BYTE_OF_CHAR.items()}
    tiny = load("tiny-gpt", device="cpu")
    tokens = [t._asdict() for t in tiny.attend("naïve 👩\u200d💻 נ\u202e x").tokens]
    odd = [bytes([0xC0, 0xAF]), bytes([0xED, 0xA0, 0x80]), bytes([0xF8, 0x41]), bytes([0xE6, 0x88]), bytes([0xE6, 0x88, 0x91])]
    guesses = [{"token": raw.decode("utf-8", "replace"), "piece": "".join(char_of[b] for b in raw)} for raw in odd]
    open_page(page, server)
    got = page.evaluate("""async ([tokens, guesses]) => {
      const t = await import('/static/js/tokens.js');
      return [tokens.map(t.pieceLabel), guesses.map(t.guessLabel)];
    }""", [tokens, guesses])
    assert got[0] == [token_label(SimpleNamespace(**t)) for t in tokens]
    assert got[1] == [bytes_label(raw, visible_spaces) for raw in odd]
    assert got[1][:3] == ["‹C0›‹AF›", "‹ED›‹A0›‹80›", "‹F8›A"]


def test_isolate_keeps_a_label_and_its_bidi_controls_to_itself(server, page):
    open_page(page, server)
    got = page.evaluate("""async () => {
      const { isolate, isolateQuoted, LRI } = await import('/static/js/tokens.js');
      return [isolate('ל'), isolate('abc'), isolate('a\u2069ל\u202e'), isolate('abc\u202edef'), isolate('#2 ל', LRI),
              isolateQuoted('“שלום”'), isolateQuoted('m · t · “ab\u202ec”'), isolateQuoted('“قال 3”')];
    }""")
    assert got == [
        f"{FSI}ל{PDI}", "abc",
        f"{FSI}a‹2069›ל‹202E›{PDI}",  # a PDI of the text's own would have closed the isolate early
        "abc‹202E›def", f"{LRI}#2 ל{PDI}",
        f"“{FSI}שלום{PDI}”", "m · t · “ab‹202E›c”", f"“{FSI}قال 3{PDI}”",
    ]


def test_a_hebrew_reading_keeps_its_order(server, api, page):
    hebrew_in_text_labels(page, server)
    tokens, weights = api_attention(api, HEBREW, layers=[0], heads=[0])
    assert [t["text"] for t in tokens][2:4] == ["ל", "ו"] and tokens[8]["text"] == "ו"
    hover_cell(page, 2, 8)
    text = page.locator("#tooltip").text_content()
    match = re.fullmatch(f"#2 {FSI}ל{PDI} → #8 {FSI}ו{PDI}: ({WEIGHT})\n“{FSI}ל{PDI}” → “{FSI}ו{PDI}”", text)
    assert match, text
    assert abs(float(match.group(1)) - weights[0, 0, 2, 8]) <= 1.1e-3, (text, weights[0, 0, 2, 8])
    # Drawn as read: it was "#2 0.045 :ו #8 → ל" over “ו” → ”ל“.
    assert_left_to_right(page, "#tooltip", ["#2", "ל", "→", "#8", "ו", ":", match.group(1)])
    assert_left_to_right(page, "#tooltip", ["“", "ל", "”", "→", "“", "ו", "”"])
    # The live region's line for the cell cursor is the same first line.
    assert text.split("\n")[0].endswith(f": {match.group(1)}")


def test_a_hebrew_cell_ranking_heading_keeps_its_order(server, page):
    hebrew_in_text_labels(page, server)
    wait_grid(page)
    hover_cell(page, 2, 8)
    page.mouse.down()
    page.mouse.up()
    page.wait_for_selector("#cell-heads:not([hidden]) .cell-heads-list button")
    heading = page.locator("#cell-heads .hint").text_content()
    assert heading.startswith(f"{LRI}#2 ל{PDI} → {LRI}#8 ו{PDI}, the heads by its weight"), heading
    assert_left_to_right(page, "#cell-heads .hint", ["#2", "ל", "→", "#8", "ו", ", the heads"])


def test_an_exported_hebrew_caption_isolates_the_text(server, page):
    hebrew_in_text_labels(page, server)
    page.evaluate(CAPTURE_EXPORT)
    page.hover("#focus-plot")
    with page.expect_download():
        page.click(".modebar-btn[data-title='Download plot as PNG']")
    assert page.evaluate("() => window.exported.caption") == f"minilm · Layer 0, head 0 · “{FSI}{HEBREW}{PDI}”"


def test_a_right_to_left_override_in_the_text_shows_and_stays_put(gpt, page):
    """The reviewer's "abc<RLO>def ghi<ZWJ>x": the reading of a weight of 0.162 drew as "#4 261.0 : 3# →"."""
    open_page(page, gpt)
    run(page, RLO_TEXT)
    page.select_option("#labels", "text")
    page.wait_for_function("() => document.querySelectorAll('.hv-left li')[3]?.textContent === '‹202E›'")
    assert page.locator(".hv-left li").all_text_contents()[13:16] == ["‹200D›"] * 3  # blank labels before
    hover_cell(page, 4, 3)
    text = page.locator("#tooltip").text_content()
    assert not BIDI_CONTROLS & set(text), ascii(text)
    # A causal model's reading goes on with a line of predictions (predictions.js).
    match = re.match(f"#4 ‹202E› → #3 ‹202E›: ({WEIGHT})\n“‹202E›” → “‹202E›”(\n|$)", text)
    assert match, ascii(text)
    assert_left_to_right(page, "#tooltip", ["#4", "‹202E›", "→", "#3", "‹202E›", ":", match.group(1)])

    page.evaluate(CAPTURE_EXPORT)
    page.hover("#focus-plot")
    with page.expect_download():
        page.click(".modebar-btn[data-title='Download plot as SVG']")
    # The override reversed the caption's tail: “abc”xihg fed.
    assert page.evaluate("() => window.exported.caption") == "tiny-gpt · Layer 0, head 0 · “abc‹202E›def ghi\u200dx”"
