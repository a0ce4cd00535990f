// The model view: every layer × head as a small canvas, drawn straight from the u8 payload.
// Rows that scroll into view ask for their layers, so long inputs only fetch what is seen.

import { el } from "./dom.js";
import { colorTable, scaled } from "./theme.js";
import { isIdentity, viewOf } from "./transform.js";

const MAX_THUMB_PIXELS = 128;
const SLICE_MS = 8; // the longest a background repaint holds the page before letting input in

// Max-pools a rows × cols matrix into at most MAX_THUMB_PIXELS per side (peaks stay visible);
// weight = value × unit (1/255 for the u8 bytes), coloured on the page's chosen scale.
function drawThumb(canvas, values, nRows, nCols, maskedBlock, scale = "head", unit = 1) {
  const k = Math.ceil(Math.max(nRows, nCols) / MAX_THUMB_PIXELS);
  const width = Math.ceil(nCols / k);
  const height = Math.ceil(nRows / k);
  const pooled = new Float32Array(width * height);
  for (let r = 0; r < nRows; r++) {
    const out = Math.floor(r / k) * width;
    const base = r * nCols;
    for (let c = 0; c < nCols; c++) {
      const v = values[base + c];
      const slot = out + Math.floor(c / k);
      if (v > pooled[slot]) pooled[slot] = v;
    }
  }
  let peak = 0;
  for (let i = 0; i < pooled.length; i++) if (pooled[i] > peak) peak = pooled[i];
  const table = colorTable();
  const pixels = new Uint32Array(width * height);
  const peakWeight = peak * unit;
  for (let br = 0; br < height; br++) {
    for (let bc = 0; bc < width; bc++) {
      const i = br * width + bc;
      const index = Math.round(255 * Math.min(1, scaled(pooled[i] * unit, scale, peakWeight)));
      pixels[i] = maskedBlock(br, bc, k) ? table[256] : table[index];
    }
  }
  canvas.width = width;
  canvas.height = height;
  canvas.getContext("2d").putImageData(new ImageData(new Uint8ClampedArray(pixels.buffer), width, height), 0, 0);
}

export class GridView {
  constructor(container, { onSelect, onNeedLayers }) {
    this.container = container;
    this.onSelect = onSelect;
    this.onNeedLayers = onNeedLayers;
    this.observer = null;
    this.cells = [];
    this.painted = new Set();
  }

  build(run) {
    this.run = run;
    this.painted = new Set();
    this.observer?.disconnect();
    const { nLayers, nHeads } = run;
    this.container.style.setProperty("--heads", nHeads);
    const header = [el("span", { className: "corner", text: "" })];
    for (let h = 0; h < nHeads; h++) header.push(el("span", { className: "col-label", text: `H${h}`, attrs: { "aria-hidden": "true" } }));
    const rows = [el("div", { className: "grid-row grid-header" }, header)];
    this.cells = [];
    for (let l = 0; l < nLayers; l++) {
      const row = el("div", { className: "grid-row", attrs: { "data-layer": l } }, [
        el("span", { className: "row-label", text: `L${l}`, attrs: { "aria-hidden": "true" } }),
      ]);
      const cellsOfLayer = [];
      for (let h = 0; h < nHeads; h++) {
        const canvas = el("canvas", { attrs: { width: 1, height: 1 } });
        const button = el("button", {
          className: "thumb loading",
          attrs: { type: "button", "aria-label": `Layer ${l}, head ${h}`, title: `Layer ${l}, head ${h}`, "data-layer": l, "data-head": h },
        }, [canvas]);
        button.addEventListener("click", () => this.onSelect(l, h));
        cellsOfLayer.push(button);
        row.append(button);
      }
      this.cells.push(cellsOfLayer);
      rows.push(row);
    }
    this.container.replaceChildren(...rows);
    this.observeRows(rows.slice(1));
    // Rows already on screen are asked for now, not a frame later, so their fetches overlap the
    // first heatmap's drawing; the observer takes care of rows scrolled to later.
    const onScreen = rows.slice(1).filter((row) => row.getBoundingClientRect().top < window.innerHeight + 300);
    onScreen.forEach((row) => this.requested(Number(row.dataset.layer)));
  }

  requested(layer) {
    if (!this.run.hasLayer(layer)) this.onNeedLayers([layer]);
  }

  observeRows(rows) {
    // One request per layer: each is painted while the next is still on the wire.
    this.observer = new IntersectionObserver((entries) => {
      for (const entry of entries) if (entry.isIntersecting) this.requested(Number(entry.target.dataset.layer));
    }, { rootMargin: "300px 0px" });
    rows.forEach((row) => this.observer.observe(row));
  }

  paintLayer(layer, options) {
    if (!this.run.hasLayer(layer)) return;
    for (let h = 0; h < this.run.nHeads; h++) this.paintHead(layer, h, options);
    this.painted.add(layer);
  }

  paintHead(layer, h, options) {
    const run = this.run;
    const T = run.T;
    const canvas = this.cells[layer][h].firstChild;
    if (isIdentity(options, run.hasPair)) {
      const masked = run.causal ? (br, bc, k) => bc * k > Math.min((br + 1) * k - 1, T - 1) : () => false;
      drawThumb(canvas, run.headBytes(layer, h), T, T, masked, options.scale, run.scale);
    } else {
      const view = viewOf(run.head(layer, h), run.tokens, { ...options, causal: run.causal });
      const nR = view.rows.length;
      const masked = run.causal
        ? (br, bc, k) => view.cols[bc * k] > view.rows[Math.min((br + 1) * k - 1, nR - 1)]
        : () => false;
      drawThumb(canvas, view.values, nR, view.cols.length, masked, options.scale);
    }
    this.cells[layer][h].classList.remove("loading");
  }

  paintAll(options) {
    for (let l = 0; l < this.run.nLayers; l++) this.paintLayer(l, options);
  }

  // The same in slices of a few ms between other tasks: at T=512 a filtered head costs several ms,
  // all 72 together would freeze the page (and the next arrow key) for a second. A newer call
  // replaces an unfinished one.
  paintAllSoon(options) {
    const schedule = (this.schedule = {});
    const queue = [];
    for (let l = 0; l < this.run.nLayers; l++) {
      if (this.run.hasLayer(l)) for (let h = 0; h < this.run.nHeads; h++) queue.push([l, h]);
    }
    const step = () => {
      if (this.schedule !== schedule) return;
      const start = performance.now();
      while (queue.length && performance.now() - start < SLICE_MS) this.paintHead(...queue.shift(), options);
      if (queue.length) setTimeout(step, 0);
    };
    setTimeout(step, 0);
  }

  get complete() {
    return this.run && this.painted.size === this.run.nLayers;
  }

  // In head mode one cell is pressed; a mean marks the heads it averages instead.
  select(layer, head, aggregate = "head") {
    this.cells.forEach((row, l) => row.forEach((cell, h) => {
      cell.setAttribute("aria-pressed", String(aggregate === "head" && l === layer && h === head));
      cell.classList.toggle("in-mean", aggregate === "all" || (aggregate === "layer" && l === layer));
    }));
  }
}
