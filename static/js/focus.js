// The focus view: one head (or a mean) as a heatmap with token labels and a reading tooltip. The page
// paints the cells into a canvas (canvas_heatmap.js) and draws the title and colorbar (colorbar.js);
// Plotly draws the axes, their labels and the modebar, and handles zoom and pan. So a step to
// another head of the same text calls Plotly only when the axes change: at T=512 a Plotly.react of
// a heatmap took ~220 ms, and even a new title or colorbar range made it lay out every tick again.
//
// What is plotted is readable, for tests and tools, through `focusPlot.plotted()`: { rows, cols,
// zmax, scale } and, unless called as plotted({ z: false }), z: rows of numbers as coloured (the
// log10 position on the log scale), null where masked, as Plotly's heatmap z was.

import { AxisLabels } from "./axis_labels.js";
import { CanvasHeatmap } from "./canvas_heatmap.js";
import { Colorbar } from "./colorbar.js";
import { MODEBAR_PX, NARROW_PX, el, focusOnPress, plotlyText } from "./dom.js";
import { palette, scaled } from "./theme.js";
import { bidiControlsShown, isolate, isolateQuoted } from "./tokens.js";

// Once this many tokens (or fewer) are in view, every one of them is labelled.
export const ALL_LABELS = 64;
const MAX_LABEL = 14;
const ONE_COLUMN = window.matchMedia("(max-width: 1199px)"); // app.css's one-column layout
const SETTLE_MS = 250; // after the last resize event, the viewport a phone's rotation ends in
const PHONE = window.matchMedia("(max-width: 700px)"); // main.js's NARROW: the page scrolls to the views after each run
const SCROLL_MARGIN = 6; // px: app.css's scroll-margin-top of .views
const WINDOW_GAP = 24; // px left under the plot, at the window's foot
const MIN_HEIGHT = 340; // px, app.css's floor of the plot's height, where the window holds it
// A token given 12 px has its label at 10 px (fontFor) and a cell a pointer hits at a glance: a
// sentence (up to 18 tokens at 1366 x 768, 30 at 1440 x 900) then stays under the form, whose text
// box stays in view for the next try. The plot's title and key labels take about 140 px besides.
const READABLE_PX = 12;
const LABEL_ROOM = 140;
export const MAX_FONT = 11; // px, the largest label font (fontFor)

export function shortLabel(text) {
  return text.length > MAX_LABEL ? text.slice(0, MAX_LABEL - 1) + "…" : text;
}

// A weight as a reading gives it: `digits` decimals while those hold two significant digits,
// below that two significant digits (2e-5 is not none), written with an exponent under 1e-4, where
// toPrecision would count zeros down to 1e-6 (0.0000048). No weight reads coarser than a smaller
// one: 3 decimals read 0.00054 as "0.001" beside "0.00049", two cells a factor 2 apart read
// alike. A 0 reads as under `floor`, the largest weight the values shown hold as 0 (a
// threshold's, or the precision's rounding), when that is above 0.
// float16 rounds weights under 2^-25 to 0.
export const F16_ZERO = 2 ** -25;

// An export's caption cut to `px` at its title's font (13 px): a caption cut at 80 characters ran
// off a narrow figure's right edge mid-word. A quoted text keeps its closing quote.
const FONT_FAMILY = "system-ui, -apple-system, Segoe UI, sans-serif"; // the figure's (layout), its title's too
const CAPTION_FONT = `13px ${FONT_FAMILY}`;
let measurer = null;

function fitCaption(caption, px) {
  measurer ??= document.createElement("canvas").getContext("2d");
  measurer.font = CAPTION_FONT;
  if (measurer.measureText(caption).width <= px) return caption;
  const chars = Array.from(caption);
  const close = caption.endsWith("”") ? "…”" : "…";
  const body = caption.endsWith("”") ? chars.slice(0, -1) : chars;
  let low = 0;
  let high = body.length;
  while (low < high) { // the longest start that fits, with its ellipsis
    const mid = Math.ceil((low + high) / 2);
    if (measurer.measureText(body.slice(0, mid).join("").trimEnd() + close).width <= px) low = mid;
    else high = mid - 1;
  }
  const kept = body.slice(0, low).join("");
  const space = kept.lastIndexOf(" ");
  return (space > 0 && space >= kept.length - 12 ? kept.slice(0, space) : kept).trimEnd() + close; // at a word's end when one is near
}

export function weightText(value, floor = 0, digits = 3) {
  if (value === 0 && floor > 0) return `< ${floor.toPrecision(2)}`;
  if (value === 0 || Math.abs(value) >= 10 ** (1 - digits)) return value.toFixed(digits);
  return Math.abs(value) >= 1e-4 ? value.toPrecision(2) : value.toExponential(1);
}

// The index range [lo, hi] an axis shows (the whole axis unless zoomed).
function visibleRange(range, n) {
  if (!range) return [0, n - 1];
  const [a, b] = range[0] <= range[1] ? range : [range[1], range[0]];
  return [Math.max(0, Math.ceil(a)), Math.min(n - 1, Math.floor(b))];
}

// How many cells an axis spans: its range's length, or all n cells unless zoomed.
function rangeLength(range, n) {
  return range ? Math.max(1e-9, Math.abs(range[1] - range[0])) : n;
}

// The pixels of an axis of axisPx that its n cells cover: past the last token (a pan beyond the
// cells) there is nothing to label, and labels sized for the whole axis were crammed 4 px apart
// into the strip the tokens kept.
function occupiedPx(range, n, axisPx) {
  if (!range) return axisPx;
  const [a, b] = range[0] <= range[1] ? range : [range[1], range[0]];
  return (axisPx * Math.max(0, Math.min(b, n - 0.5) - Math.max(a, -0.5))) / rangeLength(range, n);
}

// A range moved, its length kept, to lie over the n cells (edges at -0.5 and n - 0.5); null where
// it lies there already or is longer than the cells.
function slidOver(range, n) {
  if (!range) return null;
  const [lo, hi] = [Math.min(...range), Math.max(...range)];
  if (hi - lo > n) return null;
  const shift = lo < -0.5 - 1e-6 ? -0.5 - lo : hi > n - 0.5 + 1e-6 ? n - 0.5 - hi : 0;
  return shift ? range.map((v) => v + shift) : null;
}

// Plotly's doubleClickDelay (its default, which the page keeps): a second press within it is a double click.
const DOUBLE_CLICK_MS = 300;
const MIN_FONT = 7; // px: below it a label cannot be read, so fewer labels are shown instead
const SAMPLED_LABEL_PX = 12; // px a thinned axis gives each label: a 10 px font (fontFor)

// The smallest of 1, 2, 5, 10, 20, 50... at least `step`: positions that read as round numbers.
function roundStep(step) {
  const power = 10 ** Math.floor(Math.log10(Math.max(1, step)));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= step);
}

// Index-based axes: the same word can occur twice, so labels are ticks, never categories. Every
// token in view is labelled with its text when ALL_LABELS or fewer are. Beyond that every k-th,
// counted from 0 (a pan moves the labels with their rows), k a round number, each label its
// position (480) at 10 px: every k-th token's text, at 7 px, told nobody where it was ("e", "␣",
// "a" at 1,000 tokens). A hover then names position and token.
export function ticks(indices, labels, range, most = ALL_LABELS) {
  const [lo, hi] = visibleRange(range, indices.length);
  let step = Math.max(1, Math.ceil((hi - lo + 1) / most));
  if (step > 1) step = roundStep((hi - lo + 1) / Math.max(2, Math.floor(most * MIN_FONT / SAMPLED_LABEL_PX)));
  const values = [];
  for (let i = Math.ceil(lo / step) * step; i <= hi; i += step) values.push(i);
  const texts = values.map((i) => (step > 1 ? String(indices[i]) : shortLabel(labels[indices[i]])));
  return { values, texts, shown: values.length };
}

// Pixels per label decide the font: a label never gets more room than its row.
export function fontFor(axisPx, shown) {
  return Math.max(MIN_FONT, Math.min(MAX_FONT, Math.floor((axisPx / Math.max(1, shown)) * 0.85)));
}

// The labels an axis of axisPx pixels holds at the smallest font, a row of pixels each at least.
export function labelsFit(axisPx) {
  return Math.max(1, Math.min(ALL_LABELS, Math.floor(axisPx / MIN_FONT)));
}

// The Plotly config of every plot on the page. Nothing may leave this machine: no "Share chart"
// (Plotly 7 shows it by default and posts the figure to cloud.plotly.com; the experiments' plots
// had it), no logo link, no server URL, no Chart Studio link. No "Double-click to zoom back out"
// notice either: it sat over the grid at the window's top right, and the page's line says so.
export const OFFLINE_CONFIG = Object.freeze({
  responsive: true,
  displaylogo: false,
  showTips: false,
  showSendToCloud: false,
  showEditInChartStudio: false,
  showLink: false,
  showSources: false,
  plotlyServerURL: "",
  modeBarButtonsToRemove: ["sendChartToCloud", "editInChartStudio", "downloadJson", "select2d", "lasso2d"],
});

// The heatmaps the page draws itself (cells, labels), which Plotly's own image export would miss:
// the camera and disk buttons call download(format) instead.
export function localConfig(download) {
  return {
    ...OFFLINE_CONFIG,
    modeBarButtonsToRemove: [...OFFLINE_CONFIG.modeBarButtonsToRemove, "toImage", "autoScale2d"],
    modeBarButtonsToAdd: [
      { name: "downloadPng", title: "Download plot as PNG", icon: window.Plotly.Icons.camera, click: () => download("png") },
      { name: "downloadSvg", title: "Download plot as SVG", icon: window.Plotly.Icons.disk, click: () => download("svg") },
    ],
  };
}

// Where a Plotly plot's axes are now: their box in the plot's pixels and their data ranges, or
// null before Plotly has laid them out.
export function placementOf(plot) {
  const xa = plot._fullLayout?.xaxis;
  const ya = plot._fullLayout?.yaxis;
  if (!xa || !ya) return null;
  return {
    box: { left: xa._offset, top: ya._offset, width: xa._length, height: ya._length },
    ranges: { x: xa.range, y: ya.range },
  };
}

// Arrow key -> (rows, columns) of a step: heads and layers on the grid, a keyboard cell cursor.
export const ARROW_STEPS = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };

// A keyboard cell cursor on a Plotly heatmap's axes, moved by (dRow, dCol) and kept inside the
// cells whose centres are in view (at least the one nearest the middle, when a zoom falls inside
// a single cell; cell i spans [i - 0.5, i + 0.5]); from nowhere (cursor null) it lands on the
// top-left one. `outline`, an absolutely placed box in the plot, is moved over the cell, for
// those who read with their eyes rather than through a live region. Returns the cell and its
// centre in client space, or null before the plot has axes.
export function stepCursor(plot, cursor, dRow, dCol, nRows, nCols, outline) {
  const xa = plot._fullLayout?.xaxis;
  const ya = plot._fullLayout?.yaxis;
  if (!xa || !ya) return null;
  const inView = (axis, n) => {
    const [lo, hi] = [Math.min(...axis.range), Math.max(...axis.range)];
    const [first, last] = [Math.max(0, Math.ceil(lo)), Math.min(n - 1, Math.floor(hi))];
    return first <= last ? [first, last] : Array(2).fill(Math.max(0, Math.min(n - 1, Math.round((lo + hi) / 2))));
  };
  const [r0, r1] = inView(ya, nRows);
  const [c0, c1] = inView(xa, nCols);
  const at = cursor ?? { row: r0 - dRow, col: c0 - dCol };
  const row = Math.max(r0, Math.min(r1, at.row + dRow));
  const col = Math.max(c0, Math.min(c1, at.col + dCol));
  const span = (axis, i) => Math.abs(axis.l2p(i + 0.5) - axis.l2p(i - 0.5));
  const [w, h] = [Math.max(4, span(xa, col)), Math.max(4, span(ya, row))];
  Object.assign(outline.style, {
    left: `${xa._offset + xa.l2p(col) - w / 2}px`, top: `${ya._offset + ya.l2p(row) - h / 2}px`, width: `${w}px`, height: `${h}px`,
  });
  outline.hidden = false;
  const box = plot.getBoundingClientRect();
  return { cell: { row, col }, clientX: box.left + xa._offset + xa.l2p(col), clientY: box.top + ya._offset + ya.l2p(row) };
}

// The keys of a plot's cell cursor (the measures' and the experiments'): the arrows move it
// (onStep(dRow, dCol)), Escape and leaving the plot drop it; not on a modebar button inside the
// plot, whose arrows are its own, nor with a modifier. A press on the plot gives it the keyboard.
export function cursorKeys(plot, onStep, onDrop) {
  plot.addEventListener("keydown", (event) => {
    if (event.target !== plot) return;
    if (event.key === "Escape") {
      onDrop();
      return;
    }
    const step = ARROW_STEPS[event.key];
    if (!step || event.altKey || event.ctrlKey || event.metaKey) return;
    event.preventDefault(); // the arrows read cells here, they do not scroll the page
    onStep(...step);
  });
  plot.addEventListener("blur", onDrop);
  focusOnPress(plot);
}

const LOG_TICKS = { tickvals: [0, 0.25, 0.5, 0.75, 1], ticktext: ["0.0001", "0.001", "0.01", "0.1", "1"] };

export class FocusView {
  constructor(plot, tooltip, reader) {
    this.plot = plot;
    this.tooltip = tooltip;
    this.reader = reader; // a polite live region: what the keyboard's cell cursor reads
    this.cursor = null; // { row, col } of the keyboard's cell cursor (view indices), while in use
    this.readingAt = null; // { x, y }: the client point whose cell the tooltip reads, while it does
    // (query, key) -> the weight in float32, or undefined until it is here (main.js asks for it
    // then, and calls refreshReading): null where the cells drawn are float32 already.
    this.exactReading = null;
    // (query, key) -> nothing: a cell picked (a click or tap, or Enter on the cell cursor) that
    // main.js ranks the heads by (cell_heads.js); null where none is wanted (a long run).
    this.onPick = null;
    this.current = null;
    this.listening = false;
    this.filename = "manyeyes";
    this.exportCaption = "";
    this.ranges = { x: null, y: null };
    this.revision = null;
    this.revealed = false; // whether a run has been brought into view (reveal) yet
    this.pickTimer = null; // a click's pick, waiting to see whether a double click follows (pickUnlessDouble)
    this.presses = 0; // pointer presses on the plot, counted so that one press picks once
    this.handledPress = 0;
    this.pressedAt = 0; // when the last press went down (performance.now())
    this.fitTokens = 0; // the tokens of that run (fitHeight)
    this.heatmap = new CanvasHeatmap(plot);
    this.titleNode = el("div", { className: "gtitle" });
    this.titleNode.hidden = true;
    this.cursorBox = el("div", { className: "cell-cursor", attrs: { "aria-hidden": "true" } });
    this.cursorBox.hidden = true;
    // Said in the plot's own box when there is no plot (clear): an empty box read as a broken page.
    this.emptyNode = el("p", { className: "empty plot-empty" });
    this.emptyNode.hidden = true;
    plot.append(this.titleNode, this.cursorBox, this.emptyNode);
    this.colorbarView = new Colorbar(plot);
    this.labels = new AxisLabels(plot);
    this.labelsKey = "";
    this.figureKey = ""; // what Plotly has on screen, to skip a Plotly.react that would change nothing
    plot.plotted = (options) => this.plotted(options);
    // One config object for the plot's whole life: a changed config makes Plotly.react redraw from scratch.
    this.config = localConfig((format) => this.download(format));
    // Plotly's own resize (config.responsive) stretches the axes it has: the height, the margins
    // and, across the phone width, the side the keys are labelled on would wait for the next step.
    this.refitFrame = 0;
    this.settleTimer = 0;
    window.addEventListener("resize", () => {
      cancelAnimationFrame(this.refitFrame);
      this.refitFrame = requestAnimationFrame(() => this.refit());
      // A phone turned back upright reports, in its resize event, the zoomed-out viewport its wide
      // plot had made (819 x 1773 for 390 x 844), then settles with no further event: fitted to the
      // first, the plot stayed 720 px tall with blank bands until the next head.
      clearTimeout(this.settleTimer);
      this.settleTimer = setTimeout(() => this.refit(), SETTLE_MS);
    });
  }

  refit() {
    if (!this.current || !this.plot._fullLayout) return;
    this.fitHeight();
    this.layOut();
  }

  // The plot's height: as tall as the window holds with the panel's title, caption and hint above
  // it (the page scrolls there after a run, reveal), as tall as square cells across its width can
  // use, and 720 px at most. Fitted instead to what was left of the window under the form and the
  // options (two rows of them at 1280-1440 px, three with a long run's note), a laptop's plot was
  // 340-505 px beside the thumbnails: at 1280 × 800 its cells were 273 px of a 651 px wide box, a
  // 92-token run's labels 7 px, and a long run's keys fell below a 1366 × 768 window. Where the room
  // under the form is nearly that (90%), the plot takes it and the page stays put. In one column:
  // about square, never taller than the window (a phone held sideways, or a page zoomed to 200%).
  fitHeight() {
    const box = this.plot.getBoundingClientRect();
    const views = this.plot.closest(".views");
    const head = views ? box.top - views.getBoundingClientRect().top + SCROLL_MARGIN : 0;
    // Square cells across the plot's width need that width less the colour bar's 90 px, plus the
    // title's 40 (the key labels take as much room below as the query labels take beside).
    const wide = ONE_COLUMN.matches ? window.innerWidth * 1.05 : this.plot.clientWidth - 50;
    const tall = window.innerHeight - (PHONE.matches ? 0 : head) - WINDOW_GAP;
    const best = Math.min(720, wide, tall);
    const below = window.innerHeight - (box.top + window.scrollY) - WINDOW_GAP;
    // Beside the thumbnails, before the first run (the example) nothing scrolls to the plot: it stays
    // under the form; so it does where that room gives each token of the run READABLE_PX (a short
    // sentence, whose text box then stays in view for the next try). In one column the plot keeps
    // its square, as wide as the window (test_long_page.py), and the page scrolls to it.
    const readable = (below - LABEL_ROOM) / Math.max(1, this.fitTokens) >= READABLE_PX;
    const stay = !ONE_COLUMN.matches && (!this.revealed || readable || below >= 0.9 * best);
    const room = stay ? Math.min(best, below) : best;
    // 340 px at least, but never taller than the window: at 568 × 320 (a small phone held sideways)
    // the floor ran the key axis past its foot. app.css's floor is for the plot before this fits it.
    const floor = Math.min(MIN_HEIGHT, window.innerHeight - WINDOW_GAP);
    this.height = Math.round(Math.max(floor, room));
    this.plot.style.minHeight = `${floor}px`;
    if (this.plot.style.height !== `${this.height}px`) this.plot.style.height = `${this.height}px`;
  }

  // After a run of `tokens` tokens: the whole plot on screen, with its panel's title when the window
  // holds both. The page scrolls only when the plot is not whole where it is (the run form is then
  // above the window, a scroll away), or always (a phone's, whose form folds away above the views);
  // the height it is fitted to is the window's (fitHeight).
  reveal(tokens, always = false) {
    this.revealed = true;
    this.fitTokens = tokens;
    this.fitHeight();
    const box = this.plot.getBoundingClientRect();
    if (!always && box.top >= 0 && box.bottom <= window.innerHeight) return;
    const views = this.plot.closest(".views");
    const head = views ? box.top - views.getBoundingClientRect().top + SCROLL_MARGIN : 0;
    const target = views && head + box.height <= window.innerHeight ? views : this.plot;
    target.scrollIntoView({ block: "start" });
  }

  // floor: the largest weight the view's values hold as 0 (weightText).
  async render({ view, labels, title, filename, exportCaption, scale = "head", revision, floor = 0 }) {
    this.fitHeight();
    const nRows = view.rows.length;
    const nCols = view.cols.length;
    let peak = 0;
    for (let i = 0; i < view.values.length; i++) if (view.values[i] > peak) peak = view.values[i];
    const log = scale === "log";
    this.startRevision(revision);
    const zmax = log ? 1 : scale === "fixed" ? 1 : peak > 0 ? peak : 1;
    this.current = { view, labels, nRows, nCols, title, scale, peak, zmax, floor };
    this.emptyNode.hidden = true;
    this.filename = filename;
    this.exportCaption = exportCaption || title;
    this.heatmap.setMatrix(view, scale, peak);
    await this.layOut();
  }

  // A new text or a new shape: the zoom starts afresh, and the cursor goes.
  startRevision(revision) {
    if (revision === this.revision) return;
    this.ranges = { x: null, y: null };
    this.revision = revision;
    this.dropCursor();
    // A pointer's (or a tap's) reading too: on a phone nothing moves away to hide it, and it read
    // the last text's cell over the new one's.
    this.tooltip.hidden = true;
    this.readingAt = null;
    // Plotly.react keeps the last figure's ranges as the reference of the square-cells constraint
    // (only a relayout forgets them): a text shorter than the last got ranges wider than its cells,
    // and the extra room read as bands of masked keys.
    for (const axis of [this.plot._fullLayout?.xaxis, this.plot._fullLayout?.yaxis]) if (axis) axis._inputRange = null;
  }

  // A new text: the cursor's cell, its reading and what the live region last said are the old one's.
  dropCursor() {
    if (!this.cursor) return;
    this.cursor = null;
    this.cursorBox.hidden = true;
    this.tooltip.hidden = true;
    if (this.reader) this.reader.textContent = "";
  }

  // Plotly's axes and labels for the current view: relaid only when they changed (a relayout is the
  // costliest part of a step), then the decorations and, once, the listeners.
  async layOut() {
    const axes = this.axes();
    const { trace, layout } = this.figure(axes);
    const key = JSON.stringify([trace, layout]);
    if (key !== this.figureKey || !this.plot._fullLayout) {
      this.figureKey = key;
      await window.Plotly.react(this.plot, [trace], layout, this.config);
    }
    this.decorate(axes);
    if (!this.listening) this.listen();
  }

  // Plotly's part: its only trace is one brick spanning the cells' extent (edges at -0.5 … n - 0.5),
  // which gives the axes their autorange; the canvas covers it.
  figure(axes = this.axes()) {
    const { nRows, nCols } = this.current;
    const trace = {
      type: "heatmap", z: [[0]], x: [-0.5, nCols - 0.5], y: [-0.5, nRows - 0.5],
      colorscale: palette().stops, zmin: 0, zmax: 1, showscale: false, hoverinfo: "skip",
    };
    return { trace, layout: this.layout(axes) };
  }

  // The page's part, placed on Plotly's axes as they are now: cells, labels, title and colorbar.
  decorate(axes = this.axes()) {
    if (!this.current) return;
    this.heatmap.draw();
    const place = this.placement();
    if (!place) return;
    const labelsKey = JSON.stringify([axes.x, axes.y, axes.titles, axes.colors]);
    if (labelsKey !== this.labelsKey) {
      this.labelsKey = labelsKey;
      this.labels.render(axes, place.box, place.ranges);
    } else {
      this.labels.move(place.box, place.ranges);
    }
    const pal = palette();
    const narrow = this.plot.clientWidth < NARROW_PX;
    const { title, scale, zmax } = this.current;
    this.titleNode.textContent = title;
    this.titleNode.style.color = pal.text;
    this.titleNode.style.top = `${6 + (narrow ? MODEBAR_PX : 0)}px`;
    this.titleNode.hidden = false;
    this.colorbarView.render({ stops: pal.stops, zmax, log: scale === "log", horizontal: narrow, color: pal.text, box: place.box });
    // The axes may have moved (a zoom, a resize) or the head changed under the keyboard's cursor:
    // it is placed again, inside what is now in view, and reads the cell as it is now.
    if (this.cursor) this.moveCursor(0, 0);
    // A reading the pointer left on screen (a tap's, which no mouse moves on) reads the new head.
    else if (this.readingAt && !this.tooltip.hidden) this.showReading(this.readingAt.x, this.readingAt.y);
  }

  // Where Plotly's axes put the cells now (placementOf).
  placement() {
    return placementOf(this.plot);
  }

  // Mid-pan Plotly moves the axes live: the cells and labels follow (a zoom box leaves them alone).
  follow() {
    this.heatmap.draw();
    const place = this.placement();
    if (place) this.labels.move(place.box, place.ranges);
  }

  // What is plotted, in the terms of Plotly's heatmap z (see the top of this file).
  plotted({ z = true } = {}) {
    if (!this.current) return null;
    const { view, nRows, nCols, scale, peak, zmax } = this.current;
    const out = { rows: nRows, cols: nCols, zmax, scale };
    if (!z) return out;
    out.z = view.rows.map((_, r) => view.cols.map((_k, c) => {
      if (view.masked(r, c)) return null;
      const v = view.values[r * nCols + c];
      return scale === "log" ? scaled(v, "log", peak) : v;
    }));
    return out;
  }

  // No plot at all, with a word in the caption and in the plot's box: used when the first run fails
  // and when every token is hidden.
  clear(message) {
    window.Plotly.purge(this.plot);
    this.listening = false;
    this.current = null;
    this.figureKey = "";
    this.titleNode.hidden = true;
    this.colorbarView.hide();
    this.labels.clear();
    this.labelsKey = "";
    this.dropCursor();
    this.tooltip.hidden = true;
    this.plot.dataset.example = "false";
    this.emptyNode.textContent = message;
    this.emptyNode.hidden = false;
    this.plot.closest(".focus-panel").querySelector(".caption").textContent = message;
  }

  colorbar(log) {
    const narrow = this.plot.clientWidth < NARROW_PX;
    const title = { text: log ? "weight (log)" : "weight", side: narrow ? "top" : "right" };
    const bar = narrow
      ? { orientation: "h", y: -0.03, yanchor: "top", thickness: 10, len: 0.9, outlinewidth: 0, title }
      : { title, thickness: 12, outlinewidth: 0 };
    return log ? { ...bar, tickmode: "array", ...LOG_TICKS } : bar;
  }

  // Which tokens of an axis are labelled for a range (long_focus.js counts them from token 0).
  ticks(indices, labels, range, most) {
    return ticks(indices, labels, range, most);
  }

  // The room labels need, sized from the longest one, not measured: measuring made Plotly slow.
  labelPx(texts, font) {
    return 8 + font * 0.62 * Math.max(1, ...texts.map((s) => s.length));
  }

  // The labels for the ranges in view: which ticks, their fonts and angles, and the margins they
  // need, sized for the figure being drawn (Plotly's axis lengths are the last figure's: after a
  // pair's block, the whole pair's keys were sized for the block's full-width axis and overprinted).
  // The axes' lengths follow from the margins, which follow from the labels: sized first for the
  // longest axes the plot could give, the labels take the widest margins they could need; sized
  // again for the axes those margins leave, they need no more room, so they get at least as much.
  axes() {
    const widest = this.labelsFor(this.axisLengths(this.margins(0, 0)));
    return this.labelsFor(this.axisLengths(widest.margin));
  }

  // The axes' lengths in pixels inside `margin`: with square cells (scaleanchor, see layout) both
  // keep the ranges' ratio, so a zoom to 40 queries × 140 keys leaves the query axis 40/140 of the
  // keys' length.
  axisLengths(margin) {
    const { view } = this.current;
    const width = this.plot.clientWidth - margin.l - margin.r;
    const height = (this.height || this.plot.clientHeight) - margin.t - margin.b;
    if (view.rows.length !== view.cols.length) return { x: width, y: height };
    const spanX = rangeLength(this.ranges.x, view.cols.length);
    const spanY = rangeLength(this.ranges.y, view.rows.length);
    const unit = Math.max(0, Math.min(width / spanX, height / spanY));
    return { x: unit * spanX, y: unit * spanY };
  }

  // The plot's margins around labels that need xLabels and yLabels pixels.
  margins(xLabels, yLabels) {
    const narrow = this.plot.clientWidth < NARROW_PX;
    const keysSpace = xLabels + (narrow ? 8 : 30);
    // On a phone the modebar takes the top line: the title (see decorate) goes on the next one.
    const titleTop = narrow ? MODEBAR_PX : 0;
    return {
      t: narrow ? 30 + titleTop + keysSpace : 40,
      r: narrow ? 10 : 90, // the page's colorbar goes there
      b: narrow ? 60 : keysSpace,
      l: yLabels + (narrow ? 4 : 30),
    };
  }

  // The labels for axes of the given lengths (px).
  labelsFor(lengths) {
    const pal = palette();
    const { view, labels } = this.current;
    const narrow = this.plot.clientWidth < NARROW_PX;
    // Labels share the pixels their tokens cover, not the whole axis (occupiedPx).
    const xPx = occupiedPx(this.ranges.x, view.cols.length, lengths.x);
    const yPx = occupiedPx(this.ranges.y, view.rows.length, lengths.y);
    const xTicks = this.ticks(view.cols, labels, this.ranges.x, labelsFit(xPx));
    const yTicks = this.ticks(view.rows, labels, this.ranges.y, labelsFit(yPx));
    const xFont = fontFor(xPx, xTicks.shown);
    const yFont = fontFor(yPx, yTicks.shown);
    const xLabels = this.labelPx(xTicks.texts, xFont);
    const yLabels = this.labelPx(yTicks.texts, yFont);
    return {
      x: { values: xTicks.values, texts: xTicks.texts, font: xFont, angle: xTicks.shown > 24 ? -90 : -60, top: narrow },
      y: { values: yTicks.values, texts: yTicks.texts, font: yFont },
      titles: {
        x: { text: narrow ? "" : "key (attended to)", offset: xLabels + 14 },
        y: { text: narrow ? "" : "query (attending)", offset: yLabels + 12 },
      },
      colors: { text: pal.text, muted: pal.muted },
      margin: this.margins(xLabels, yLabels),
    };
  }

  // Plotly's part of the layout: bare axes (the page draws their labels), the margins, the zoom.
  layout(axes = this.axes()) {
    const pal = palette();
    const { nRows, nCols } = this.current;
    const bare = { showticklabels: false, ticks: "", showgrid: false, zeroline: false, constrain: "domain" };
    return {
      // Given, not measured: Plotly.react keeps its old size when only the container changed.
      height: this.height,
      paper_bgcolor: pal.paper,
      plot_bgcolor: pal.paper, // past the cells (a pan) is no key at all, not a masked one
      hovermode: false, // the page reads cells itself (showReading)
      font: { color: pal.text, family: FONT_FAMILY },
      margin: axes.margin,
      // The same revision keeps the user's zoom while stepping through heads of the same text.
      uirevision: this.revision,
      xaxis: { ...bare, side: axes.x.top ? "top" : "bottom", ...(this.ranges.x ? { range: this.ranges.x } : { autorange: true }) },
      yaxis: {
        ...bare, scaleanchor: nRows === nCols ? "x" : undefined,
        ...(this.ranges.y ? { range: this.ranges.y } : { autorange: "reversed" }),
      },
    };
  }

  // The same axes with Plotly drawing the labels, for exported images (no hurry there).
  labelledLayout(axes = this.axes()) {
    const layout = this.layout(axes);
    const pal = palette();
    const labelled = (spec, title) => ({
      showticklabels: true, ticks: "outside", ticklen: 5, tickmode: "array", tickvals: spec.values,
      ticktext: spec.texts.map(plotlyText), tickfont: { size: spec.font, color: pal.text },
      title: { text: title.text, font: { color: pal.muted, size: 12 }, standoff: 6 },
    });
    layout.xaxis = { ...layout.xaxis, ...labelled(axes.x, axes.titles.x), tickangle: axes.x.angle };
    layout.yaxis = { ...layout.yaxis, ...labelled(axes.y, axes.titles.y) };
    return layout;
  }

  // A zoom or pan: keep its ranges (for the next head) and label every token now in view.
  onRelayout(event) {
    if (!this.current) return;
    if (this.relabelling) return;
    const read = (axis) => {
      if (event[`${axis}axis.autorange`]) return null;
      const a = event[`${axis}axis.range[0]`] ?? event[`${axis}axis.range`]?.[0];
      const b = event[`${axis}axis.range[1]`] ?? event[`${axis}axis.range`]?.[1];
      return a === undefined || b === undefined ? undefined : [a, b];
    };
    const x = read("x");
    const y = read("y");
    if (x === undefined && y === undefined) {
      this.decorate(); // a resize: the same labels, somewhere else
      return;
    }
    if (x !== undefined) this.ranges.x = x;
    if (y !== undefined) this.ranges.y = y;
    // Square cells make Plotly widen a zoom box's shorter side to the longer one's length: a band
    // of 50 rows by 1,300 keys near the end of 1,500 tokens ran 940 rows past the last, a blank
    // like weights of 0 that took most of the plot. The widened side slides back over the cells,
    // still holding the band drawn and filling the plot with cells, which is what a zoom is
    // for; a pan is the user's own move and may still go past the cells (paper there, layout).
    if (this.plot._fullLayout?.dragmode === "zoom") {
      const { nRows, nCols } = this.current;
      const [slidX, slidY] = [slidOver(this.ranges.x, nCols), slidOver(this.ranges.y, nRows)];
      if (slidX || slidY) {
        window.Plotly.relayout(this.plot, { ...(slidX && { "xaxis.range": slidX }), ...(slidY && { "yaxis.range": slidY }) });
        return; // its relayout event labels the window
      }
    }
    // Labels for what is now in view; Plotly is asked again only if their margins changed.
    const axes = this.axes();
    const margin = this.plot.layout.margin || {};
    if (["t", "r", "b", "l"].every((k) => Math.abs((margin[k] ?? 0) - axes.margin[k]) < 1)) {
      this.decorate(axes);
      return;
    }
    this.relabelling = true;
    window.Plotly.relayout(this.plot, { margin: axes.margin }).finally(() => {
      this.relabelling = false;
      this.figureKey = ""; // Plotly's figure is now the relayout's, not the last react's
      this.decorate(axes);
    });
  }

  // Exports carry a caption: the model, the (shortened) text and the head or measure. The cells go
  // in as an image placed on the axes (in an SVG, an embedded PNG, as Plotly's heatmaps were).
  download(format) {
    const { nRows, nCols, scale, zmax } = this.current;
    const pal = palette();
    const cells = {
      ...this.heatmap.exportImage(), xref: "x", yref: "y", xanchor: "left", yanchor: "top", sizing: "stretch", layer: "above",
    };
    const log = scale === "log";
    const trace = { ...this.figure().trace, zmax, showscale: true, colorbar: this.colorbar(log) };
    const layout = { ...this.labelledLayout(), images: [cells] };
    layout.margin = { ...layout.margin, t: (layout.margin?.t || 40) + 40, r: 10 };
    const width = this.plot.clientWidth;
    // The text's bidi controls are made visible before the fit, which measures what is drawn, and
    // it is isolated after, so that no cut drops the isolate's end (isolateQuoted).
    const caption = isolateQuoted(fitCaption(bidiControlsShown(this.exportCaption), 0.98 * width - 8));
    layout.title = {
      // from 2% of the width to 8 px short of the right edge
      text: plotlyText(caption), font: { size: 13, color: pal.text }, x: 0.02, xanchor: "left",
      yref: "container", y: 1, yanchor: "top", pad: { t: 8 },
    };
    const height = this.plot.clientHeight + 40;
    return window.Plotly.downloadImage({ data: [trace], layout }, { format, filename: this.filename, width, height, scale: format === "png" ? 2 : 1 });
  }

  // The reading of the cell under a client-space point: "query → key: 0.123" and the original spans.
  showReading(clientX, clientY) {
    this.readingAt = { x: clientX, y: clientY };
    const cell = this.current && this.heatmap.cellAt(clientX, clientY);
    if (!cell) {
      this.tooltip.hidden = true;
      return;
    }
    const { view, labels, floor } = this.current;
    const { row: r, col: c } = cell;
    const q = view.rows[r];
    const k = view.cols[c];
    // The cells are drawn from float16 (or 8-bit) values, which a reading's third decimal, or a
    // tiny weight's digits (float16 holds 1.2e-7 for 9.2e-8), would show: it reads float32.
    const exact = view.masked(r, c) ? undefined : this.exactReading?.(q, k);
    const reading = view.masked(r, c) ? "masked"
      : exact !== undefined ? weightText(exact) : weightText(view.values[r * view.cols.length + c], floor);
    // Each label and span is isolated (tokens.js isolate): an RTL one reordered the whole reading.
    const spans = this.spans ? `\n${isolateQuoted(this.spans(q))} → ${isolateQuoted(this.spans(k))}` : "";
    this.tooltip.dataset.query = q;
    this.tooltip.dataset.key = k;
    this.tooltip.dataset.reads = exact !== undefined ? "float32" : "drawn"; // which values it read
    // Beyond ALL_LABELS tokens the axes are positions: so is the reading ("d → o" named no "d");
    // and a label the text holds twice says which ("the → the" was any of three "the").
    const repeated = (i) => labels.indexOf(labels[i]) !== labels.lastIndexOf(labels[i]);
    const named = (i) => (labels.length > ALL_LABELS || repeated(i) ? `#${i} ${isolate(labels[i])}` : isolate(labels[i]));
    this.showTooltip(`${named(q)} → ${named(k)}: ${reading}${spans}`, clientX, clientY);
  }

  // A cell picked by a click or tap, or by Enter on the cursor: its query and key, if it is drawn
  // and not masked (masked, it is 0 in every head: nothing to rank).
  pick(cell) {
    const picked = this.picked(cell);
    if (picked) this.onPick(...picked);
  }

  // [query, key] of a cell that can be picked, else null.
  picked(cell) {
    if (!cell || !this.current || !this.onPick) return null;
    const { view } = this.current;
    return view.masked(cell.row, cell.col) ? null : [view.rows[cell.row], view.cols[cell.col]];
  }

  // A click or tap picks its cell once Plotly's double-click window has passed without a second
  // press: a double click resets the zoom, and its first click, picked at once, ranked the cell
  // that was under the pointer in the zoomed view (another cell once reset). A press is handled
  // once, told by its pointerup (a tap) or its click or both. The cell is the one under the
  // press, and the pick is dropped if another run's ranking (onPick) has come meanwhile.
  pickUnlessDouble(clientX, clientY) {
    const press = this.presses;
    if (press === this.handledPress) return;
    this.handledPress = press;
    if (this.pickTimer) {
      clearTimeout(this.pickTimer);
      this.pickTimer = null;
      return;
    }
    const picked = this.picked(this.current && this.heatmap.cellAt(clientX, clientY));
    const onPick = this.onPick;
    // Plotly's window runs from the first press down, not from its release: a second click ending
    // after it is two clicks to Plotly (the zoom stays), so the first pick must have come by then.
    const left = Math.max(0, DOUBLE_CLICK_MS - (performance.now() - this.pressedAt));
    this.pickTimer = setTimeout(() => {
      this.pickTimer = null;
      if (picked && this.onPick === onPick) onPick(...picked);
    }, left);
  }

  // The float32 values came: the reading on screen, if any, reads them.
  refreshReading() {
    if (this.readingAt && !this.tooltip.hidden) this.showReading(this.readingAt.x, this.readingAt.y);
  }

  // The heads the arrows step through are said with the next reading (main.js): a reading alone,
  // after a step, did not say whose weight it was.
  announceHead(title) {
    this.headToSay = this.cursor ? title : null; // the cursor's next reading says it, after its redraw
    if (this.reader) this.reader.textContent = title;
  }

  // The tooltip beside a client-space point; under the keyboard's cursor, its first line is read out.
  showTooltip(text, clientX, clientY) {
    this.tooltip.textContent = text;
    this.tooltip.hidden = false;
    const box = this.plot.getBoundingClientRect();
    this.tooltip.style.left = `${Math.max(4, Math.min(clientX - box.left + 14, box.width - this.tooltip.offsetWidth - 4))}px`;
    this.tooltip.style.top = `${clientY - box.top + 16}px`;
    if (this.cursor && this.reader) {
      this.reader.textContent = [this.headToSay, text.split("\n")[0]].filter(Boolean).join(": ");
      this.headToSay = null;
    }
  }

  // Shift+arrows (main.js): a cell cursor for those who cannot hover, kept inside the zoomed
  // window (a step past its edge pans it, panTo); it starts at the window's top-left cell and
  // reads each cell as hovering would.
  moveCursor(dRow, dCol) {
    // A step, not a re-placing (dRow = dCol = 0 after a zoom, which brings the cursor into view instead).
    if ((dRow || dCol) && this.current && this.cursor && this.panTo(this.cursor.row + dRow, this.cursor.col + dCol)) return;
    const step = this.current && stepCursor(this.plot, this.cursor, dRow, dCol, this.current.nRows, this.current.nCols, this.cursorBox);
    if (!step) return;
    this.cursor = step.cell;
    this.showReading(step.clientX, step.clientY);
  }

  // A cursor stepped past the edge of a zoomed window pans the window along, as a map does: the
  // modebar's + and − zoom only around the centre, so a keyboard could not reach the rest of a
  // long run. Returns whether it panned; the relayout's decorate() then places and reads the cursor.
  panTo(row, col) {
    const xa = this.plot._fullLayout?.xaxis;
    const ya = this.plot._fullLayout?.yaxis;
    if (!xa || !ya) return false;
    const { nRows, nCols } = this.current;
    // Cells whose centres are in view are ceil(lo)..floor(hi) (stepCursor); a whole-cell shift keeps that.
    const shift = (axis, i, n) => {
      if (i < 0 || i >= n) return 0;
      const [lo, hi] = [Math.min(...axis.range), Math.max(...axis.range)];
      return i < Math.ceil(lo) ? i - Math.ceil(lo) : i > Math.floor(hi) ? i - Math.floor(hi) : 0;
    };
    const dx = shift(xa, col, nCols);
    const dy = shift(ya, row, nRows);
    if (!dx && !dy) return false;
    this.cursor = { row: Math.max(0, Math.min(nRows - 1, row)), col: Math.max(0, Math.min(nCols - 1, col)) };
    window.Plotly.relayout(this.plot, { "xaxis.range": xa.range.map((v) => v + dx), "yaxis.range": ya.range.map((v) => v + dy) });
    return true;
  }

  listen() {
    this.listening = true;
    const plot = this.plot;
    plot.on("plotly_relayout", (event) => this.onRelayout(event));
    plot.on("plotly_relayouting", () => this.follow());
    // A purge (clear) drops Plotly's listeners but not the element's: those are added once.
    if (this.listeningToDom) return;
    this.listeningToDom = true;
    plot.addEventListener("mousemove", (event) => {
      this.cursor = null; // the pointer reads now; the live region stays quiet while it moves
      this.cursorBox.hidden = true;
      this.showReading(event.clientX, event.clientY);
    });
    plot.addEventListener("mouseleave", () => {
      this.tooltip.hidden = true;
    });
    plot.addEventListener("blur", () => this.dropCursor());
    // Escape dismisses the reading (WCAG 1.4.13): it covered the cells around it until focus left.
    plot.addEventListener("keydown", (event) => {
      if (event.target !== plot) return;
      if (event.key === "Enter" && this.cursor) this.pick(this.cursor);
      if (event.key !== "Escape") return;
      this.dropCursor();
      this.tooltip.hidden = true;
    });
    focusOnPress(plot);
    // A tap on a phone never hovers: a press released where it began shows the same reading.
    // Pointer events, because Plotly's drag layer cancels the touch's click.
    let down = null;
    plot.addEventListener("pointerdown", (event) => {
      down = { x: event.clientX, y: event.clientY };
      this.presses += 1;
      this.pressedAt = performance.now();
    });
    // A mouse's press ends on Plotly's drag cover, not here: the click it sends after a press
    // that did not drag picks the cell.
    plot.addEventListener("click", (event) => this.pickUnlessDouble(event.clientX, event.clientY));
    plot.addEventListener("pointerup", (event) => {
      if (down && Math.hypot(event.clientX - down.x, event.clientY - down.y) < 8) {
        this.showReading(event.clientX, event.clientY);
        this.pickUnlessDouble(event.clientX, event.clientY);
      }
      down = null;
    });
  }
}
