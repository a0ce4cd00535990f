// Light and dark palettes: the system preference unless the page's toggle picks one; heatmap and
// thumbnails share one colour scale, read through the chosen scaling (per head, fixed 0–1, log).

const HEAD_COLOURS = {
  // Tableau 10 first (well known), then 22 more, spread in hue and alternating in lightness so
  // that heads 10..31 never repeat the first ten.
  light: ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"],
  dark: ["#58a6ff", "#ffa657", "#7ee787", "#ff7b72", "#d2a8ff", "#e3b341", "#f778ba", "#a5d6ff", "#c9d1d9", "#56d4dd"],
};

function hsl(h, s, l) {
  const k = (n) => (n + h / 30) % 12;
  const a = s * Math.min(l, 1 - l);
  const f = (n) => Math.round(255 * (l - a * Math.max(-1, Math.min(k(n) - 3, 9 - k(n), 1))));
  return `#${[f(0), f(8), f(4)].map((v) => v.toString(16).padStart(2, "0")).join("")}`;
}

function extendHeads(base, lightness) {
  const out = [...base];
  for (let i = 0; out.length < 32; i++) {
    out.push(hsl((i * 360) / 11 + 18, 0.9, lightness[i % lightness.length]));
  }
  return out;
}

const PALETTES = {
  light: {
    stops: [[0, "#ffffff"], [0.12, "#deebf7"], [0.35, "#9ecae1"], [0.6, "#4292c6"], [0.82, "#2171b5"], [1, "#08306b"]],
    masked: "#d6d2cb",
    text: "#1f2328",
    muted: "#59636e",
    paper: "#ffffff",
    grid: "#d0d7de",
    heads: extendHeads(HEAD_COLOURS.light, [0.28, 0.6]),
  },
  dark: {
    stops: [[0, "#161b22"], [0.15, "#1d3557"], [0.4, "#2a6f97"], [0.65, "#2a9d8f"], [0.85, "#e9c46a"], [1, "#fff3b0"]],
    masked: "#3b4048",
    text: "#e6edf3",
    muted: "#9198a1",
    paper: "#161b22",
    grid: "#30363d",
    heads: extendHeads(HEAD_COLOURS.dark, [0.42, 0.72]),
  },
};

const query = window.matchMedia("(prefers-color-scheme: dark)");
const STORAGE_KEY = "manyeyes-theme";
const listeners = [];
const lutCache = {};
let chosen = "system";
try {
  chosen = localStorage.getItem(STORAGE_KEY) || "system";
} catch {
  // Storage may be off (private mode): the toggle still works for this page.
}

export function themeName() {
  if (chosen === "light" || chosen === "dark") return chosen;
  return query.matches ? "dark" : "light";
}

export function themeChoice() {
  return chosen;
}

// "system", "light" or "dark"; the CSS reads the same choice from <html data-theme>.
export function setTheme(choice) {
  chosen = choice;
  if (choice === "system") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = choice;
  try {
    localStorage.setItem(STORAGE_KEY, choice);
  } catch {
    // see above
  }
  listeners.forEach((fn) => fn());
}

export function palette() {
  return PALETTES[themeName()];
}

export function onThemeChange(callback) {
  listeners.push(callback);
  query.addEventListener("change", () => chosen === "system" && callback());
}

// Colour scales: "head" stretches each head's own peak to full colour (today's default),
// "fixed" maps 0..1, so a weak head looks weak; "log" shows 1e-4..1 in decades.
const LOG_FLOOR = -4;

export function scaled(value, mode, peak) {
  if (mode === "log") return (Math.log10(Math.max(value, 1e-4)) - LOG_FLOOR) / -LOG_FLOOR;
  if (mode === "fixed") return value;
  return peak > 0 ? value / peak : 0;
}

export function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

// One opaque colour as canvas ImageData reads it from a Uint32Array (RGBA bytes, little-endian).
export const packRgb = ([r, g, b]) => ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;

export const MASKED = 256; // index of the masked colour in colorTable()

// 256 packed RGBA colours (little-endian, as canvas ImageData reads a Uint32Array) along the scale,
// then the masked colour.
export function colorTable() {
  const name = themeName();
  if (lutCache[name]) return lutCache[name];
  const { stops, masked } = PALETTES[name];
  const table = new Uint32Array(MASKED + 1);
  for (let i = 0; i < 256; i++) {
    const x = i / 255;
    let s = 1;
    while (s < stops.length - 1 && stops[s][0] < x) s++;
    const [x0, c0] = stops[s - 1];
    const [x1, c1] = stops[s];
    const t = (x - x0) / (x1 - x0);
    const a = hexToRgb(c0);
    const b = hexToRgb(c1);
    table[i] = packRgb(a.map((v, k) => Math.round(v + (b[k] - v) * t)));
  }
  table[MASKED] = packRgb(hexToRgb(masked));
  lutCache[name] = table;
  return table;
}
