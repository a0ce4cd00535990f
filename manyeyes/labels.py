"""How a token is labelled for people: the page's labels (static/js/tokens.js) written in Python,
for the notebook figures and `manyeyes attend`, and how two runs' tokens line up (the compare
experiment and its figure). Apart from the model code, so that the figures import no torch
(`import manyeyes; manyeyes.figures` is torch-free)."""

from __future__ import annotations

import difflib


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each of the 256 bytes written as one printable character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


BYTE_OF_CHAR = _byte_alphabet()


def piece_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for ("Ġthe": b" the", "å": b"\xe5"); None for a piece
    with a character outside that alphabet. Any ASCII piece also reads as its own bytes."""
    if not piece or any(ch not in BYTE_OF_CHAR for ch in piece):
        return None
    return bytes(BYTE_OF_CHAR[ch] for ch in piece)


def bytes_label(raw: bytes, shown=str) -> str:
    """Bytes as the page labels a byte-level piece (bytesLabel, static/js/tokens.js): each whole
    UTF-8 character through `shown`, each byte of a character split across pieces as ‹E5›."""
    label, i = "", 0
    while i < len(raw):
        for size in (1, 2, 3, 4):  # the one length at which a whole character decodes, if any
            try:
                label += shown(raw[i:i + size].decode("utf-8"))
                i += size
                break
            except UnicodeDecodeError:
                pass
        else:
            label += f"‹{raw[i]:02X}›"
            i += 1
    return label


VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible_spaces(text: str) -> str:
    """As the page labels tokens (visibleSpaces, static/js/tokens.js): a space token was a blank label. Every
    other character that draws as nothing (a control, a zero-width joiner, a bidi override) as ‹200D›."""
    return "".join(VISIBLE.get(ch) or (ch if ch.isprintable() else f"‹{ord(ch):02X}›") for ch in text)


def token_label(token) -> str:
    """A token as the page's default labels ("Model pieces", pieceLabel in static/js/tokens.js)
    show it: a byte-level piece by its whole characters, and a byte of a character split across
    tokens as ‹F0› (each of 👩's four byte tokens had been labelled 👩); any other token by its
    piece, so that a WordPiece model's [UNK] and ##-continuations show (labelled by their text, 我
    爱 hid that MiniLM knew neither); spaces and invisible characters made visible."""
    piece = getattr(token, "piece", "") or ""
    raw = None if getattr(token, "special", False) else piece_bytes(piece)
    # Bytes only when they really come from the token's own text: "naive" for "naïve" is no byte piece.
    if raw is not None and raw in token.text.encode("utf-8", "replace"):
        return bytes_label(raw, visible_spaces)
    return visible_spaces(piece or token.text)


def align(a, b) -> list[tuple[int, int]]:
    """Index pairs of two token lists' tokens that difflib matches on their model pieces (then
    ids): what a comparison of two texts sets side by side. Tokens: anything with .piece and .id."""
    matcher = difflib.SequenceMatcher(a=[(t.piece, t.id) for t in a], b=[(t.piece, t.id) for t in b], autojunk=False)
    return [(block.a + k, block.b + k) for block in matcher.get_matching_blocks() for k in range(block.size)]
