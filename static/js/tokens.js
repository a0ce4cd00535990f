// How a token is labelled: the model's own piece by default ("##bel", "[UNK]", "␣the", ‹E2›), or
// the original characters it covers. The original span is always offered on hover.

// GPT-2's byte-level alphabet: each of the 256 bytes is written as one printable character.
const BYTE_OF_CHAR = (() => {
  const printable = [];
  const range = (a, b) => { for (let i = a; i <= b; i++) printable.push(i); };
  range(0x21, 0x7e);
  range(0xa1, 0xac);
  range(0xae, 0xff);
  const map = new Map();
  printable.forEach((b) => map.set(String.fromCodePoint(b), b));
  let extra = 0;
  for (let b = 0; b < 256; b++) {
    if (!printable.includes(b)) map.set(String.fromCodePoint(256 + extra++), b);
  }
  return map;
})();

// "1 token", "12 tokens": a one-token text is a case the page meets (a word, a character).
export function tokenCount(n) {
  return `${n} token${n === 1 ? "" : "s"}`;
}

const VISIBLE = { " ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍" };
const encoder = new TextEncoder();

export const hex = (b) => `‹${b.toString(16).toUpperCase().padStart(2, "0")}›`;

// Every character that draws as nothing or moves its neighbours (a control, a zero-width joiner,
// a soft hyphen, a bidi override, a space other than U+0020) is written as ‹200D›: the categories
// Other and Separator, which are what Python's str.isprintable() refuses, so that a label here
// reads as the same token's label in an exported figure (manyeyes/labels.py visible_spaces).
export function visibleSpaces(s) {
  return s.replace(/[\p{C}\p{Z}]/gu, (ch) => VISIBLE[ch] ?? hex(ch.codePointAt(0)));
}

// A token's original characters between quotes (a hover's second line): as visibleSpaces, but a
// plain space stays one, the quotes showing where it is. A raw "\n" broke the line in the tooltip
// (“ on one line, ” → “ on the next).
export function quotedSpan(s) {
  return `“${s.replace(/[\p{C}\p{Z}]/gu, (ch) => (ch === " " ? ch : visibleSpaces(ch)))}”`;
}

// Bidi controls (embeddings, overrides, isolates, marks), and the letters and digits that run
// right to left: Hebrew, Arabic, Syriac, Thaana, N'Ko… and their presentation forms and
// supplementary blocks, the ranges where Unicode's R, AL and AN characters lie.
const BIDI_CONTROL = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/gu;
const RIGHT_TO_LEFT = /[\u0590-\u08ff\ufb1d-\ufdff\ufe70-\ufefe\u{10800}-\u{10fff}\u{1e800}-\u{1efff}]/u;
export const LRI = "\u2066"; // LEFT-TO-RIGHT ISOLATE

export function bidiControlsShown(s) {
  return s.replace(BIDI_CONTROL, (ch) => hex(ch.codePointAt(0)));
}

// A token's label or text as one part of a longer string ("#2 ל → #8 ו: 0.045"): an RTL label
// made the bidi algorithm reorder the arrows, positions and weight around it ("#2 0.045 :ו #8 → ל").
// It goes between FIRST STRONG ISOLATE and POP DIRECTIONAL ISOLATE, laid out on its own and one
// neutral character to its neighbours, in HTML, SVG and canvas text alike. Its own bidi controls
// are written as ‹202E›: an override in the text reversed the rest of the reading, and a PDI
// would close the isolate early. A label with no RTL character reads the same without isolates,
// and stays plain text to copy or compare. open: FIRST STRONG ISOLATE, which gives an RTL label
// its own direction, or LRI for a string of the page's own order ("#2 ל", position then label).
export function isolate(s, open = "\u2068") {
  const shown = bidiControlsShown(s);
  return RIGHT_TO_LEFT.test(shown) ? `${open}${shown}\u2069` : shown;
}

// "prefix “text”" with the text isolated inside its quotes: isolated with them, an RTL text
// turned them around (”ל“).
export function isolateQuoted(s) {
  const open = s.indexOf("“");
  if (open < 0 || !s.endsWith("”")) return isolate(s);
  return `${s.slice(0, open + 1)}${isolate(s.slice(open + 1, -1))}”`;
}

// The bytes a piece written in the byte-level alphabet stands for ("Ġthe", "å" for 0xE5); null for
// a piece with a character outside it (as manyeyes/labels.py piece_bytes).
function pieceBytes(piece) {
  const bytes = [];
  for (const ch of piece) {
    const b = BYTE_OF_CHAR.get(ch);
    if (b === undefined) return null;
    bytes.push(b);
  }
  return bytes;
}

// The piece's bytes when it is written in the byte-level alphabet and those bytes really come from
// its own text (so a WordPiece "##bel" or "naive" for "naïve" is never mistaken for bytes).
function byteLevelBytes(token) {
  const bytes = pieceBytes(token.piece);
  if (!bytes) return null;
  const source = encoder.encode(token.text);
  outer: for (let i = 0; i + bytes.length <= source.length; i++) {
    for (let k = 0; k < bytes.length; k++) if (source[i + k] !== bytes[k]) continue outer;
    return bytes;
  }
  return null;
}

// Strict, as Python's bytes.decode is (manyeyes/labels.py bytes_label, the figures' and the CLI's
// labels): an overlong form or a surrogate's bytes are bytes, not a replacement character.
const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

function wholeCharacter(bytes) {
  try {
    return strictUtf8.decode(new Uint8Array(bytes));
  } catch {
    return null;
  }
}

// Whole UTF-8 characters as text, spaces made visible; a byte that is part of a character split
// across tokens is shown as ‹E2›.
function bytesLabel(bytes) {
  let out = "";
  for (let i = 0; i < bytes.length;) {
    const b = bytes[i];
    const size = b < 0x80 ? 1 : b >= 0xf8 ? 0 : b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 0;
    const character = size > 0 && i + size <= bytes.length ? wholeCharacter(bytes.slice(i, i + size)) : null;
    if (character !== null) {
      out += visibleSpaces(character);
      i += size;
    } else {
      out += hex(b);
      i += 1;
    }
  }
  return out;
}

export function pieceLabel(token) {
  const piece = token.piece ?? token.text;
  if (token.special || token.piece === undefined) return visibleSpaces(piece);
  const bytes = byteLevelBytes(token);
  return bytes ? bytesLabel(bytes) : visibleSpaces(piece);
}

// A guess or a generated token ({token | text, piece}) read on its own: its text, spaces made
// visible, where that is whole characters. A byte-level piece of part of a character reads "\ufffd"
// whichever byte it is (ids 161, 159 and 102 alike): it is labelled from its piece, as pieceLabel
// labels a prompt token's (‹E5›), where the piece's bytes are what the text was read from; a
// piece in no byte alphabet as it is ("<0xE5>"). A server without `piece`: the text.
export function guessLabel(guess) {
  const text = guess.token ?? guess.text ?? "";
  const piece = guess.piece;
  if (!piece || !text.includes("\ufffd")) return visibleSpaces(text);
  const bytes = pieceBytes(piece);
  // Decoded leniently, as the server decodes an id on its own into its text.
  return bytes && new TextDecoder().decode(new Uint8Array(bytes)) === text ? bytesLabel(bytes) : visibleSpaces(piece);
}

// Labels for every token of a run, in the chosen mode ("pieces" or "text").
export function tokenLabels(tokens, mode) {
  return tokens.map((t) => (mode === "text" ? visibleSpaces(t.text) : pieceLabel(t)));
}

// What a hover says about a token: its piece and the characters it came from.
export function describeToken(token) {
  const piece = pieceLabel(token);
  if (token.special) return `${piece} (special token)`;
  return `${piece} from ${quotedSpan(token.text)} (characters ${token.start}–${token.end})`;
}
