// Pieces the experiment panels share: JSON posts, tensor decoding, ranking tables, heatmaps.

import { listModels, preciseFormat, requestJson, whenNotBusy } from "./api.js";
import { $, MODEBAR_PX, NARROW_PX, el, plotlyText } from "./dom.js";
import { OFFLINE_CONFIG, cursorKeys, stepCursor, weightText } from "./focus.js";
import { peakOf, signedStops } from "./measures_colours.js";
import { onThemeChange, palette } from "./theme.js";
import { levelFor } from "./tiles.js";
import { pieceLabel } from "./tokens.js";

// onWait: see whenNotBusy (api.js).
export function postJson(url, body, signal, onWait) {
  const init = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal };
  return whenNotBusy(() => requestJson(url, init), signal, onWait);
}

// What a panel's status line says while it waits to ask again.
export function busyWait(node, what) {
  return (seconds) => status(node, `The server is busy with other ${what}: asking again in ${seconds} s…`, "busy");
}

// The run on screen, as main.js announces it ("manyeyes:run"): the experiments act on what the
// page shows, never on what the form holds now (a model picked but not run, a failed run's text).
let shown = null;
const runListeners = [];

document.addEventListener("manyeyes:run", (event) => {
  const { text, text_pair: pair, model, truncate } = event.detail.request;
  shown = { text, ...(pair ? { text_pair: pair } : {}), model, truncate };
  runListeners.forEach((fn) => fn(shown, event.detail));
});

// What a panel's empty text box stands for once a run is on screen: that run's text. Said first:
// after the text, a box narrower than it cut "(the run's t" off.
export function runTextPlaceholder(input) {
  const text = input.text.length > 60 ? `${input.text.slice(0, 59)}…` : input.text;
  return `The run's text: ${text}`;
}

// The input of the run on screen, or null before the first run.
export function currentInput() {
  return shown;
}

// The model (and truncate setting) for the panels with their own texts (compare, generation):
// the run on screen's, or before any run the one picked in the form.
export function currentModel() {
  return shown ? { model: shown.model, truncate: shown.truncate } : { model: $("model").value || undefined, truncate: $("truncate").checked };
}

// A line in a panel with its own texts (compare, generation) that names the model it uses: the run
// on screen's, which the form's menu may no longer hold. With tiny-llama picked and not run, a
// generation went to tiny-gpt and no line on the panel named either. Hidden before the first
// run, when the panel uses the model picked (and its results name it).
export function mountModelLine(node) {
  const update = () => {
    const used = shown?.model;
    const picked = $("model").value;
    const differs = Boolean(used && picked && picked !== used);
    node.hidden = !used;
    node.dataset.differs = String(differs);
    node.textContent = !used ? ""
      : differs ? `Uses ${used}, the model of the run on screen, not ${picked} picked above: press Run to use ${picked}.`
      : `Uses ${used}, the model of the run on screen.`;
  };
  runListeners.push(update);
  $("model").addEventListener("change", update);
  update();
}

// Called with the new run's input (and { long, causal }) whenever the page shows another run.
export function onRun(callback) {
  runListeners.push(callback);
}

// A (layers, heads, R, C) tensor of the experiments API as Float32Array and shape.
export function decodeTensor(t) {
  const [L, H, R, C] = t.shape;
  const out = new Float32Array(L * H * R * C);
  if (t.format === "json") {
    let i = 0;
    for (const layer of t.data) for (const head of layer) for (const row of head) for (const v of row) out[i++] = v;
  } else {
    const bytes = Uint8Array.from(atob(t.data), (c) => c.charCodeAt(0));
    if (t.format === "f16") {
      const view = new DataView(bytes.buffer);
      for (let i = 0; i < out.length; i++) out[i] = halfToFloat(view.getUint16(2 * i, true));
    } else {
      for (let i = 0; i < out.length; i++) out[i] = bytes[i] * t.scale + t.offset;
    }
  }
  return { values: out, shape: t.shape };
}

function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * 2 ** -14 * (frac / 1024);
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * 2 ** (exp - 15) * (1 + frac / 1024);
}

// One head's (R, C) matrix as rows of plain numbers (Plotly's z), from a decoded tensor.
export function headRows({ values, shape }, layerIndex, headIndex) {
  const [, H, R, C] = shape;
  const base = (layerIndex * H + headIndex) * R * C;
  return Array.from({ length: R }, (_, r) => Array.from(values.subarray(base + r * C, base + (r + 1) * C)));
}

// A causal row's later keys as null: the API sends 0 there, which would colour and read as a weight
// of 0; null draws them in the masked grey, as the focused heatmap and the thumbnails do.
export function maskLater(rows, causal) {
  return causal ? rows.map((row, r) => row.map((v, c) => (c > r ? null : v))) : rows;
}

// Posts withFormat("json") (the body with its weights as float32 JSON), or withFormat("f16") where
// `cells`, the weights the answer holds at least, is over the server's format=json budget (GET
// /models' limits) or the server says it is: plenty for a picture. The refused json request of
// every ablation and comparison of a few hundred tokens was an error in the console each time;
// one the page cannot reckon in full (Compare's sentence B) may still be refused, and is asked for
// again in float16.
export async function postPrecise(path, withFormat, cells, onWait, signal) {
  const format = await preciseFormat(cells);
  try {
    return await postJson(path, withFormat(format), signal, onWait);
  } catch (err) {
    if (format === "f16" || err.status !== 413 || err.code !== "too_many_cells") throw err;
    return postJson(path, withFormat("f16"), signal, onWait);
  }
}

// The weights of every layer and head of `model` (undefined: the server's default) over `rows`
// tokens; 0 while the model is not known (then json is asked for, and the server decides).
export async function cellsOf(model, rows) {
  const info = (await listModels().catch(() => [])).find((m) => (model ? m.id === model : m.default));
  return info ? info.n_layers * info.n_heads * Math.min(rows, info.max_tokens) ** 2 : 0;
}

// A comparison (or a changed token) with every head's A − B; `rows`: the fewest tokens the server
// reckons its size on.
export async function postWithDifference(path, body, rows, onWait) {
  const cells = await cellsOf(body.model, rows);
  return postPrecise(path, (format) => ({ ...body, difference: { format } }), cells, onWait);
}

// One head's A − B on the aligned cells of a comparison (or a changed token): labelled by both
// sides' pieces ("bank|shore" where they differ) and numbered by their positions in A (and B).
// Aligned pairs keep their order, so a later aligned key is later in A and in B alike.
export function alignedDifference(div, reply, difference, layer, head, causal, [a, b] = ["A", "B"]) {
  const aligned = reply.pairs.map(([i, j]) => {
    const [ta, tb] = [pieceLabel(reply.tokens_a[i]), pieceLabel(reply.tokens_b[j])];
    return ta === tb ? ta : `${ta}|${tb}`;
  });
  const positions = reply.pairs.map(([i, j]) => (i === j ? `${i}` : `${i}|${j}`));
  const z = maskLater(headRows(difference, layer, head), causal);
  heatmap(div, z, { x: aligned, y: aligned, positions, signed: true, title: `${a} − ${b} on aligned cells · L${layer} H${head}` });
  Object.assign(div.dataset, { layer, head, ready: "true" });
}

// A divergence under this many bits reads 0: rows the change leaves alone (a causal model's rows
// before the changed token) come out of two forward passes with float32 rounding between them,
// ~1e-7 of each weight, worth ~1e-16 to 1e-14 bits, and "1.2e-16" read as a tiny real effect.
// Under 1e-12 bits a change is smaller than any reading shows: in one row of a hundred, a weight
// moved by less than ~5e-6.
const NOISE_BITS = 1e-12;

// The ranking as a table; clicking a row calls onPick(layer, head), and so does its head's button,
// which is the keyboard's way in (one Tab stop a row, Enter or Space). `shows` says where the
// picked head is shown, for the button's name. Text only, never HTML.
export function rankingTable(ranking, { limit = 12, onPick, caption, shows = "" } = {}) {
  const rows = ranking.slice(0, limit).map((c, i) => {
    const name = `L${c.layer} H${c.head}`;
    const headCell = onPick
      ? el("td", {}, [el("button", { className: "pick plain-button", text: name, attrs: { type: "button", "aria-label": `Show layer ${c.layer} head ${c.head}${shows ? ` in ${shows}` : ""}` } })])
      : el("td", { text: name });
    const tr = el("tr", { attrs: { "data-layer": c.layer, "data-head": c.head } }, [
      el("td", { text: String(i + 1) }),
      headCell,
      // Two significant digits under 1e-3 (weightText): a random model's heads differ by less than
      // 5e-5, and all read 0.0000; under NOISE_BITS, 0.
      Math.abs(c.divergence) < NOISE_BITS
        ? el("td", { text: "0", className: "num", attrs: { title: `Under ${NOISE_BITS} bits: float rounding, not a change` } })
        : el("td", { text: weightText(c.divergence, 0, 4), className: "num" }),
    ]);
    if (onPick) tr.addEventListener("click", () => onPick(c.layer, c.head));
    return tr;
  });
  const head = el("tr", {}, [el("th", { text: "#" }), el("th", { text: "Head" }), el("th", { text: "JS divergence (bits)" })]);
  return el("table", { className: "exp-table ranking" }, [
    ...(caption ? [el("caption", { text: caption })] : []),
    el("thead", {}, [head]),
    el("tbody", {}, rows),
  ]);
}

// Every drawn experiment heatmap, so a theme change redraws it in the new theme's text colour.
const drawn = new Map();
onThemeChange(() => {
  for (const [div, args] of drawn) {
    if (div.isConnected && div.data) heatmap(div, ...args);
    else drawn.delete(div);
  }
});

// The panel width each plot was drawn for: its figure's width and its pooling were worked out from
// it, and stayed as they were when a window was widened or a phone turned (bins for 169 px on a
// 900 px screen). A plot whose panel changed width is drawn again, once the resizing pauses.
const drawnWidth = new WeakMap();
let resizing = 0;
window.addEventListener("resize", () => {
  clearTimeout(resizing);
  resizing = setTimeout(() => {
    for (const [div, args] of drawn) {
      if (!div.isConnected || !div.data) drawn.delete(div);
      else if (div.clientWidth !== drawnWidth.get(div)) heatmap(div, ...args);
    }
  }, 200);
});

// Leaves the plot empty (a new run on screen: the last run's picture would mislead).
export function clearPlot(div) {
  drawn.delete(div);
  window.Plotly.purge(div);
  div.replaceChildren();
  keyboards.get(div)?.drop();
  div.removeAttribute("tabindex"); // no Tab stop on an empty box
  div.removeAttribute("aria-label");
}

// Bins of w consecutive positions over n: [start, end) each, the last one possibly narrower.
function binsOf(n, w) {
  return Array.from({ length: Math.ceil(n / w) }, (_, i) => [i * w, Math.min(n, (i + 1) * w)]);
}

// Each bin's strongest cell (on a signed scale the largest |value|, sign kept) and where it is, as
// the focused heatmap's tiles keep each bin's max: left to the browser, a 2,048-column image shrunk
// to 480 px was averaged, and a head's 0.6 peak among its keys drew as a faint line. A bin is null
// (masked) only where every one of its cells is.
function poolCells(z, rowBins, colBins, signed) {
  const strength = signed ? Math.abs : (v) => v;
  const values = [];
  const at = [];
  for (const [r0, r1] of rowBins) {
    const valueRow = [];
    const atRow = [];
    for (const [c0, c1] of colBins) {
      let best = null;
      let where = null;
      for (let r = r0; r < r1; r++) {
        for (let c = c0; c < c1; c++) {
          const v = z[r][c];
          // NaN is no weight: compared, it is never stronger, and first in a bin it hid the peak
          if (v != null && !Number.isNaN(v) && (best === null || strength(v) > strength(best))) {
            best = v;
            where = [r, c];
          }
        }
      }
      valueRow.push(best);
      atRow.push(where);
    }
    values.push(valueRow);
    at.push(atRow);
  }
  return { values, at };
}

const counted = (i) => i.toLocaleString("en-US");
const spanText = ([a, b], name) => (b - a > 1 ? `${name(a)}–${name(b - 1)}` : name(a));

// A heatmap through the vendored Plotly; labels are escaped (Plotly reads a little HTML).
const COLORBAR_PX = 120; // a Plotly colour bar with its tick labels, and the gap before it
const TITLE_CHAR_PX = 7.5; // a 13 px title's characters, about
const HEAD_ROW_PX = 12; // a row of heads named at 11 px

export function heatmap(div, z, options = {}) {
  drawn.set(div, [z, options]);
  drawnWidth.set(div, div.clientWidth);
  // yFirst: the position of the first row, when the rows do not start at the first token.
  // positions: each label's position, when they are not consecutive (aligned pairs: "3|5").
  // yHeads: the rows are heads ("L0 H3"), not tokens, so no position before them. A matrix of
  // tokens about as tall as wide gets square cells: stretched to the panel's width at a fixed
  // height, a 54-token ablation's cells were 5 times as wide as tall, its causal triangle a flat
  // wedge. A strip (a few generated rows over a long prompt's keys) is stretched: square, its
  // 8 rows of 1,328 keys were under a pixel tall.
  const { x, y, title, signed = false, zmax, yFirst = 0, yHeads = false, positions } = options;
  const limit = zmax ?? (signed ? peakOf(z, 1e-6) : 1);
  const columns = z[0]?.length || 0;
  const stretched = yHeads || 2 * z.length < columns;
  // Square cells: the x axis is no longer than the y axis (the ~210 px the margins leave). The
  // figure is then only as wide as its cells, labels and colour bar (at the panel's width the bar
  // stood half a screen from the cells it keys), or its title.
  const margin = { l: 90, r: 10, t: title ? 30 : 8, b: 80 };
  const height = 320;
  const down = height - margin.t - margin.b;
  const across = Math.min(div.clientWidth - 100, stretched ? Infinity : down);
  const width = stretched ? div.clientWidth
    : Math.min(div.clientWidth, Math.max(margin.l + across + margin.r + COLORBAR_PX, (title?.length ?? 0) * TITLE_CHAR_PX + 40));
  // More cells than device pixels are pooled, w positions a bin (a power of two, as the tiles'
  // levels are); square cells keep one w for both axes. The colour bar takes its share of the
  // width: on a phone the square's cells had 169 px of the 210 across.
  const ratio = window.devicePixelRatio || 1;
  let wRows = levelFor(z.length, down * ratio);
  let wCols = levelFor(columns, Math.min(across, width - margin.l - margin.r - COLORBAR_PX) * ratio);
  if (!stretched) wRows = wCols = Math.max(wRows, wCols);
  const rowBins = binsOf(z.length, wRows);
  const colBins = binsOf(columns, wCols);
  const position = (first) => (i) => (positions ? positions[first + i] : counted(first + i));
  const headName = (i) => plotlyText(y[i]);
  const rowName = yHeads ? headName : position(yFirst);
  // A bin is named by the positions (or heads) it spans: its tokens' texts would not fit.
  const names = (labels, n, first, bins) => (bins.length < n ? bins.map((bin) => spanText(bin, position(first)))
    : (labels || [...Array(n).keys()].map(String)).map((s, i) => `${positions ? positions[first + i] : first + i}: ${plotlyText(s)}`));
  const trace = {
    type: "heatmap", z, x: names(x, columns, 0, colBins),
    y: yHeads ? rowBins.map((bin) => spanText(bin, headName)) : names(y, z.length, yFirst, rowBins),
    // Signed: the measures' diverging scale (paper colour at 0), one colour language for the page.
    colorscale: signed ? signedStops() : palette().stops, zmin: signed ? -limit : 0, zmax: limit,
    hovertemplate: "%{y} → %{x}: %{z:.4f}<extra></extra>", hoverongaps: false,
  };
  if (wRows > 1 || wCols > 1) {
    const { values, at } = poolCells(z, rowBins, colBins, signed);
    trace.z = values;
    trace.text = values.map((row, i) => row.map((v, j) => {
      if (v === null) return "";
      const [r, c] = at[i][j];
      const rows = wRows === 1 ? trace.y[i] : `${yHeads ? "heads" : "queries"} ${spanText(rowBins[i], rowName)}`;
      const where = wRows === 1 ? position(0)(c) : `${rowName(r)} → ${position(0)(c)}`;
      return `${rows} → keys ${spanText(colBins[j], position(0))}: strongest ${v.toFixed(4)} at ${where}`;
    }));
    trace.hovertemplate = "%{text}<extra></extra>";
  }
  // Rows of heads ("L0 H3") are each named while a row has HEAD_ROW_PX for its label: Plotly's own
  // choice (at most 12) named tiny-gpt's 16 heads every other one, L0 H0, L0 H2… A model with
  // more heads than fit is named every k-th head, evenly.
  const headStep = Math.ceil(trace.y.length / Math.max(1, Math.floor(down / HEAD_ROW_PX)));
  const named = trace.y.filter((_, i) => i % headStep === 0);
  const yTicks = yHeads ? { tickmode: "array", tickvals: named, ticktext: named, tickfont: { size: 11 } } : { nticks: 12 };
  // On a narrow figure Plotly's modebar stays on show over the top of the plot: the title goes
  // under it, as the focused heatmap's does (the cells keep their size: both margins grow).
  const under = title && width < NARROW_PX ? MODEBAR_PX : 0;
  margin.t += under;
  const layout = {
    title: title ? { text: plotlyText(title), font: { size: 13 }, yref: "container", y: 1, yanchor: "top", pad: { t: 8 + under } } : undefined,
    margin, height: height + under, width: stretched ? undefined : width,
    // No gridlines: over the cells they drew white lines through the dark theme's heatmaps.
    // At most a label every 36 px across and 12 of them down the ~210 px of cells: Plotly's own
    // choice for a category axis put slanted "6: ␣" and "9: g" over each other.
    yaxis: { autorange: "reversed", automargin: true, showgrid: false, zeroline: false, ...yTicks,
             ...(stretched ? {} : { scaleanchor: "x", constrain: "domain" }) },
    xaxis: { automargin: true, tickangle: -45, showgrid: false, zeroline: false, constrain: "domain",
             nticks: Math.max(2, Math.floor(across / 36)) },
    // A null cell is a key the model could not see, in the focused heatmap's masked colour.
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: palette().masked,
    font: { color: palette().text }, // Plotly's default dark grey is unreadable on the dark theme
  };
  readByKeyboard(div, trace, title);
  return window.Plotly.react(div, [trace], layout, OFFLINE_CONFIG);
}

// Arrow keys read an experiment's heatmap cell by cell, as the focused heatmap's and the measures'
// do: the cell outlined (stepCursor) and its hover text said through a polite live region;
// Escape drops the cursor. Only a mouse could read these (a review by keyboard).
const keyboards = new WeakMap(); // div -> { trace, cursor, outline, reader }

function readByKeyboard(div, trace, title) {
  div.tabIndex = 0;
  div.setAttribute("aria-label", `${title || "Heatmap"}: arrow keys read its cells`);
  let keys = keyboards.get(div);
  if (!keys) {
    const outline = el("div", { className: "cell-cursor", attrs: { "aria-hidden": "true" } });
    const reader = el("p", { className: "visually-hidden", attrs: { "aria-live": "polite" } });
    keys = { trace, cursor: null, outline, reader };
    keyboards.set(div, keys);
    keys.drop = () => {
      keys.cursor = null;
      keys.outline.hidden = true;
      keys.reader.textContent = "";
    };
    cursorKeys(div, (dRow, dCol) => {
      if (!keys.outline.isConnected) div.append(keys.outline);
      if (!keys.reader.isConnected) div.after(keys.reader);
      const { z } = keys.trace;
      const moved = stepCursor(div, keys.cursor, dRow, dCol, z.length, z[0]?.length ?? 0, keys.outline);
      if (!moved) return;
      keys.cursor = moved.cell;
      keys.reader.textContent = cellText(keys.trace, moved.cell.row, moved.cell.col);
    }, keys.drop);
  }
  keys.trace = trace;
  keys.drop(); // its cell may not exist in the new matrix
}

// What a cell's hover says, as plain text (the labels are escaped for Plotly's little HTML).
function cellText(trace, row, col) {
  const plain = (s) => String(s).replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&");
  const v = trace.z[row][col];
  if (trace.text) return plain(trace.text[row][col] || `${trace.y[row]} → ${trace.x[col]}: masked`);
  // + 0 reads float rounding below the fourth decimal's half as "0.0000", not "-0.0000".
  const value = v == null || Number.isNaN(v) ? "masked" : (Math.abs(v) < 5e-5 ? 0 : v).toFixed(4);
  return plain(`${trace.y[row]} → ${trace.x[col]}: ${value}`);
}

export function status(node, text, kind = "") {
  node.textContent = text;
  node.dataset.kind = kind;
}
