// What the views show of a T×T matrix: which tokens stay, renormalised rows, the threshold, the mask.

const SEGMENT_FILTERS = { all: [null, null], AA: [0, 0], AB: [0, 1], BA: [1, 0], BB: [1, 1] };

export function isIdentity(options, hasPair) {
  return !renormalises(options) && options.threshold <= 0 && (!hasPair || options.segments === "all");
}

// Whether a view renormalises its rows: hiding tokens leaves each row the share the rest got.
export function renormalises({ hideSpecial, hideFirst = false }) {
  return hideSpecial || hideFirst;
}

// The options that hide tokens, as the page labels them, for the words that say what is hidden.
export function hidingOptions({ hideSpecial, hideFirst = false }) {
  return [hideSpecial && "“Hide special tokens”", hideFirst && "“Hide first token”"].filter(Boolean);
}

// Hidden tokens: special ones, and/or the first token (the "attention sink" of causal models).
function hiddenOf(tokens, { hideSpecial, hideFirst }) {
  return tokens.map((t, i) => (hideSpecial && t.special) || (hideFirst && i === 0));
}

// Which tokens a view keeps: rows and cols (token indices) and, when rows are renormalised, the
// keys each row is renormalised over (every key not hidden; null when rows stay as they are).
export function selectionOf(tokens, { hideSpecial, hideFirst = false, segments }) {
  const [rowSegment, colSegment] = SEGMENT_FILTERS[segments] || SEGMENT_FILTERS.all;
  const hidden = hiddenOf(tokens, { hideSpecial, hideFirst });
  const keep = (t, i, segment) => !hidden[i] && (segment === null || t.segment === segment);
  const rows = [];
  const cols = [];
  tokens.forEach((t, i) => {
    if (keep(t, i, rowSegment)) rows.push(i);
    if (keep(t, i, colSegment)) cols.push(i);
  });
  const visibleKeys = renormalises({ hideSpecial, hideFirst }) ? hidden.map((h, i) => (h ? -1 : i)).filter((i) => i >= 0) : null;
  return { rows, cols, visibleKeys };
}

// Returns { rows, cols, values (rows.length × cols.length), masked(r, c) }; rows and cols hold
// token indices. Rows are renormalised over every key that is not hidden, so a pair block shows
// each row's real share. mask: what the model cannot see (run.js maskRule), or none.
export function viewOf(matrix, tokens, { hideSpecial, hideFirst = false, threshold, segments, mask = null }) {
  const T = tokens.length;
  const { rows, cols, visibleKeys } = selectionOf(tokens, { hideSpecial, hideFirst, segments });
  const nCols = cols.length;
  const values = new Float32Array(rows.length * nCols);
  for (let r = 0; r < rows.length; r++) {
    const base = rows[r] * T;
    let norm = 1;
    if (visibleKeys) {
      let total = 0;
      for (let k = 0; k < visibleKeys.length; k++) total += matrix[base + visibleKeys[k]];
      norm = total > 0 ? 1 / total : 0;
    }
    const out = r * nCols;
    for (let c = 0; c < nCols; c++) {
      const w = matrix[base + cols[c]] * norm;
      values[out + c] = w < threshold ? 0 : w;
    }
  }
  const masked = !mask || mask.none ? () => false : (r, c) => mask.cell(rows[r], cols[c]);
  return { rows, cols, values, masked };
}
