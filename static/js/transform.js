// What the views show of a T×T matrix: which tokens stay, renormalised rows, the threshold, the mask.

const SEGMENT_FILTERS = { all: [null, null], AA: [0, 0], AB: [0, 1], BA: [1, 0], BB: [1, 1] };

export function isIdentity(options, hasPair) {
  return !options.hideSpecial && options.threshold <= 0 && (!hasPair || options.segments === "all");
}

// Returns { rows, cols, values (rows.length × cols.length), masked(r, c) }; rows and cols hold token indices.
export function viewOf(matrix, tokens, { hideSpecial, threshold, segments, causal }) {
  const T = tokens.length;
  const [rowSegment, colSegment] = SEGMENT_FILTERS[segments] || SEGMENT_FILTERS.all;
  const keep = (t, segment) => !(hideSpecial && t.special) && (segment === null || t.segment === segment);
  const rows = [];
  const cols = [];
  tokens.forEach((t, i) => {
    if (keep(t, rowSegment)) rows.push(i);
    if (keep(t, colSegment)) cols.push(i);
  });

  // Renormalise over every non-special key, so a pair block shows each row's real share.
  const nonSpecial = hideSpecial ? tokens.map((t, i) => (t.special ? -1 : i)).filter((i) => i >= 0) : null;
  const values = new Float32Array(rows.length * cols.length);
  rows.forEach((q, r) => {
    const base = q * T;
    let norm = 1;
    if (nonSpecial) {
      let total = 0;
      for (const k of nonSpecial) total += matrix[base + k];
      norm = total > 0 ? 1 / total : 0;
    }
    const out = r * cols.length;
    for (let c = 0; c < cols.length; c++) {
      const w = matrix[base + cols[c]] * norm;
      values[out + c] = w < threshold ? 0 : w;
    }
  });
  const masked = causal ? (r, c) => cols[c] > rows[r] : () => false;
  return { rows, cols, values, masked };
}
