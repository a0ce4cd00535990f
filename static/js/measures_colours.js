// One colour language for every measure, the focused heatmap's own: unsigned values (weights,
// rollout, value-weighted norms) on the theme's sequential scale (palette().stops: light blue to
// dark blue in the light theme, the same as the heatmap above); signed values (head contribution
// shares, the neuron view's vectors) on a diverging scale that is the paper colour at 0, that same
// sequential scale's strongest colour for positive values and red for negative ones. Every
// measure plot carries its colorbar as the legend.

import { colorTable, hexToRgb, packRgb, palette } from "./theme.js";

const NEGATIVE = [203, 45, 62]; // red: a share that cancels other heads, a negative component
const positives = new Map(); // palette -> its strongest colour as [r, g, b]: the neuron strips ask per component

export function sequentialStops() {
  return palette().stops;
}

function positive() {
  const theme = palette();
  if (!positives.has(theme)) positives.set(theme, hexToRgb(theme.stops[theme.stops.length - 1][1]));
  return positives.get(theme);
}

// The largest |value| of a matrix (rows of numbers), at least `floor`, for a colour range. A loop:
// Math.max(...cells) spreads T × T arguments and overflows the stack at a few hundred tokens.
export function peakOf(matrix, floor) {
  let peak = floor;
  for (const row of matrix) for (const v of row) if (Math.abs(v) > peak) peak = Math.abs(v);
  return peak;
}

// A Plotly colorscale for values in [-peak, peak] (zmin -peak, zmax peak).
export function signedStops() {
  return [[0, `rgb(${NEGATIVE.join(",")})`], [0.5, palette().paper], [1, `rgb(${positive().join(",")})`]];
}

// A canvas fill for one signed value: its side's colour, as opaque as |value| / peak.
export function signedFill(value, peak) {
  const alpha = Math.min(1, Math.abs(value) / (peak || 1));
  const [r, g, b] = value >= 0 ? positive() : NEGATIVE;
  return `rgba(${r}, ${g}, ${b}, ${alpha})`;
}

// 256 packed RGBA colours for a measure's cells, the same scale as its colorbar: sequential for
// [0, peak] (the focused heatmap's own table) or signed for [-peak, peak], index 127.5 at 0.
export function cellColours(signed) {
  if (!signed) return colorTable().subarray(0, 256);
  const paper = hexToRgb(palette().paper);
  const strongest = positive();
  const table = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    const t = (i - 127.5) / 127.5; // -1 … 1
    const end = t < 0 ? NEGATIVE : strongest;
    const k = Math.abs(t);
    table[i] = packRgb(paper.map((v, c) => Math.round(v + (end[c] - v) * k)));
  }
  return table;
}
