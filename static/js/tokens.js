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

export function visibleSpaces(s) {
  return s.replace(/[\s\u0000-\u001f\u007f]/gu, (ch) => VISIBLE[ch] ?? hex(ch.codePointAt(0)));
}

// The piece's bytes when it is written in the byte-level alphabet and those bytes really come from
// its own text (so a WordPiece "##bel" or "naive" for "naïve" is never mistaken for bytes).
function byteLevelBytes(token) {
  const bytes = [];
  for (const ch of token.piece) {
    const b = BYTE_OF_CHAR.get(ch);
    if (b === undefined) return null;
    bytes.push(b);
  }
  const source = encoder.encode(token.text);
  outer: for (let i = 0; i + bytes.length <= source.length; i++) {
    for (let k = 0; k < bytes.length; k++) if (source[i + k] !== bytes[k]) continue outer;
    return bytes;
  }
  return null;
}

// Whole UTF-8 characters as text, spaces made visible; a byte that is part of a character split
// across tokens is shown as ‹E2›.
function bytesLabel(bytes) {
  let out = "";
  for (let i = 0; i < bytes.length;) {
    const b = bytes[i];
    const size = b < 0x80 ? 1 : b >= 0xf0 && b < 0xf8 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 0;
    const whole = size > 0 && i + size <= bytes.length && bytes.slice(i + 1, i + size).every((c) => (c & 0xc0) === 0x80);
    if (whole) {
      out += visibleSpaces(new TextDecoder().decode(new Uint8Array(bytes.slice(i, i + size))));
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

// Labels for every token of a run, in the chosen mode ("pieces" or "text").
export function tokenLabels(tokens, mode) {
  return tokens.map((t) => (mode === "text" ? visibleSpaces(t.text) : pieceLabel(t)));
}

// What a hover says about a token: its piece and the characters it came from.
export function describeToken(token) {
  const piece = pieceLabel(token);
  if (token.special) return `${piece} (special token)`;
  return `${piece} from “${token.text}” (characters ${token.start}–${token.end})`;
}
