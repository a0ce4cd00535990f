// Light and dark palettes, following the system preference; heatmap and thumbnails share one scale.

const PALETTES = {
  light: {
    stops: [[0, "#ffffff"], [0.12, "#deebf7"], [0.35, "#9ecae1"], [0.6, "#4292c6"], [0.82, "#2171b5"], [1, "#08306b"]],
    masked: "#d6d2cb",
    text: "#1f2328",
    muted: "#59636e",
    paper: "#ffffff",
    grid: "#d0d7de",
    heads: ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"],
  },
  dark: {
    stops: [[0, "#161b22"], [0.15, "#1d3557"], [0.4, "#2a6f97"], [0.65, "#2a9d8f"], [0.85, "#e9c46a"], [1, "#fff3b0"]],
    masked: "#3b4048",
    text: "#e6edf3",
    muted: "#9198a1",
    paper: "#161b22",
    grid: "#30363d",
    heads: ["#58a6ff", "#ffa657", "#7ee787", "#ff7b72", "#d2a8ff", "#e3b341", "#f778ba", "#a5d6ff", "#c9d1d9", "#56d4dd"],
  },
};

const query = window.matchMedia("(prefers-color-scheme: dark)");
const lutCache = {};

export function palette() {
  return PALETTES[query.matches ? "dark" : "light"];
}

export function onThemeChange(callback) {
  query.addEventListener("change", callback);
}

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

// 256 packed RGBA colours (little-endian, as canvas ImageData reads a Uint32Array) along the scale.
export function colorTable() {
  const name = query.matches ? "dark" : "light";
  if (lutCache[name]) return lutCache[name];
  const { stops, masked } = PALETTES[name];
  const table = new Uint32Array(257); // index 256 is the masked colour
  const pack = ([r, g, b]) => ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
  for (let i = 0; i < 256; i++) {
    const x = i / 255;
    let s = 1;
    while (s < stops.length - 1 && stops[s][0] < x) s++;
    const [x0, c0] = stops[s - 1];
    const [x1, c1] = stops[s];
    const t = (x - x0) / (x1 - x0);
    const a = hexToRgb(c0);
    const b = hexToRgb(c1);
    table[i] = pack(a.map((v, k) => Math.round(v + (b[k] - v) * t)));
  }
  table[256] = pack(hexToRgb(masked));
  lutCache[name] = table;
  return table;
}
