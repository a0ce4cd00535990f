// The model view: every layer × head as a small canvas, drawn straight from the u8 payload.
// Rows that scroll into view ask for their layers, so long inputs only fetch what is seen.

import { el } from "./dom.js";
import { layerMask } from "./run.js";
import { inSlices } from "./slices.js";
import { colorTable, scaled } from "./theme.js";
import { isIdentity, selectionOf } from "./transform.js";

const MAX_THUMB_PIXELS = 128;
const KEPT_SELECTIONS = 3;

// How a view's cells fall into thumbnail pixels: at most MAX_THUMB_PIXELS per side, each pixel the
// max of a k × k block (peaks stay visible). Shared by every head of a run for the same hidden
// tokens and pair block. The matrix is nRows × nCols with rows `stride` apart; rows/cols: the token
// indices a view keeps (null: all); keys: what rows renormalise over (null: none);
// maskedBlock(br, bc, k): whether a pixel's block lies where the model could not look.
function layoutOf({ nRows, nCols, stride = nCols, rows = null, cols = null, keys = null, maskedBlock = null }) {
  const k = Math.max(1, Math.ceil(Math.max(nRows, nCols) / MAX_THUMB_PIXELS));
  const width = Math.ceil(nCols / k);
  const height = Math.ceil(nRows / k);
  const slot = new Int32Array(nCols);
  for (let c = 0; c < nCols; c++) slot[c] = Math.floor(c / k);
  const masked = new Uint8Array(width * height);
  if (maskedBlock) {
    for (let br = 0; br < height; br++) for (let bc = 0; bc < width; bc++) masked[br * width + bc] = maskedBlock(br, bc, k) ? 1 : 0;
  }
  return {
    nRows, nCols, stride, k, width, height, slot, masked,
    rows: rows && Int32Array.from(rows), cols: cols && Int32Array.from(cols), keys: keys && Int32Array.from(keys),
  };
}

// A run's layout for a selection (undefined: every token), masking each block whose every cell
// `mask` (run.js maskRule) masks.
function runLayout(T, mask, { rows = null, cols = null, visibleKeys = null } = {}) {
  const nRows = rows ? rows.length : T;
  const nCols = cols ? cols.length : T;
  const rowAt = (r) => (rows ? rows[r] : r);
  const colAt = (c) => (cols ? cols[c] : c);
  const last = (i, k, n) => Math.min((i + 1) * k - 1, n - 1);
  const maskedBlock = mask.none ? null
    : (br, bc, k) => mask.block(rowAt(br * k), rowAt(last(br, k, nRows)) + 1, colAt(bc * k), colAt(last(bc, k, nCols)) + 1);
  return layoutOf({ nRows, nCols, stride: T, rows, cols, keys: visibleKeys, maskedBlock });
}

// The pooled maxima of one head's T × T weights (value × unit), rows renormalised over layout.keys,
// in one pass without building the view: at T=512 a filtered head used to allocate two 1 MB
// arrays, and 72 of them kept the garbage collector busy.
function pool(values, unit, layout) {
  const { stride, nRows, nCols, width, height, k, slot, rows, cols, keys } = layout;
  const pooled = new Float32Array(width * height);
  for (let r = 0; r < nRows; r++) {
    const base = (rows ? rows[r] : r) * stride;
    let norm = unit;
    if (keys) {
      let total = 0;
      for (let i = 0; i < keys.length; i++) total += values[base + keys[i]];
      norm = total > 0 ? 1 / total : 0; // the unit cancels out of a renormalised row
    }
    const out = Math.floor(r / k) * width;
    if (cols) {
      for (let c = 0; c < nCols; c++) {
        const v = values[base + cols[c]] * norm;
        const s = out + slot[c];
        if (v > pooled[s]) pooled[s] = v;
      }
    } else {
      for (let c = 0; c < nCols; c++) {
        const v = values[base + c] * norm;
        const s = out + slot[c];
        if (v > pooled[s]) pooled[s] = v;
      }
    }
  }
  return pooled;
}

// "Layer 4", "Layers 4 and 5", "Layers 1, 2 and 5".
function layerList(layers) {
  return layers.length === 1 ? `Layer ${layers[0]}` : `Layers ${layers.slice(0, -1).join(", ")} and ${layers.at(-1)}`;
}

let pixelBuffer = null;

// Colours pooled weights on the page's scale. A threshold acts here, on the maxima: a block's max
// survives it exactly when some cell of the block does, so a threshold or scale change only recolours.
function colour(canvas, pooled, layout, scale = "head", threshold = 0) {
  const { width, height, masked } = layout;
  if (!width || !height) { // every token hidden: nothing to colour (GridView says so)
    canvas.width = canvas.height = 1;
    canvas.getContext("2d").clearRect(0, 0, 1, 1);
    return;
  }
  let peak = 0;
  for (let i = 0; i < pooled.length; i++) if (pooled[i] > peak) peak = pooled[i];
  if (peak < threshold) peak = 0;
  const table = colorTable();
  // One buffer for every thumbnail (putImageData copies it): 72 fresh ones per repaint fed the GC.
  if (!pixelBuffer || pixelBuffer.length < width * height) pixelBuffer = new Uint32Array(width * height);
  const pixels = pixelBuffer.subarray(0, width * height);
  for (let i = 0; i < pixels.length; i++) {
    const v = pooled[i] < threshold ? 0 : pooled[i];
    pixels[i] = masked[i] ? table[256] : table[Math.round(255 * Math.min(1, scaled(v, scale, peak)))];
  }
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  canvas.getContext("2d").putImageData(new ImageData(new Uint8ClampedArray(pixels.buffer, 0, width * height * 4), width, height), 0, 0);
}

export class GridView {
  constructor(container, { onSelect, onNeedLayers }) {
    this.container = container;
    this.onSelect = onSelect;
    this.onNeedLayers = onNeedLayers;
    this.observer = null;
    this.cells = [];
    this.painted = new Set();
    this.thumbs = []; // [layer][head]: Map of pooling key → pooled maxima, so recolouring needs no pooling
    this.layouts = new Map();
    this.note = el("p", { className: "empty", text: "No token is left to show: the thumbnails are blank until one is." });
    this.note.hidden = true;
    // Layers whose slices failed (the server stopped, say) are said here, under the grid: the only
    // word of it was the banner above the views, scrolled out of sight by then, over a grid that
    // looked finished but for rows of blank boxes.
    this.failed = new Set();
    this.reason = "";
    this.failedText = el("span");
    const retry = el("button", { text: "Try again", attrs: { type: "button" } });
    retry.addEventListener("click", () => this.retryFailed());
    this.failedNote = el("p", { className: "grid-failed", attrs: { id: "grid-failed" } }, [this.failedText, " ", retry]);
    this.failedNote.hidden = true;
    container.after(this.note, this.failedNote);
  }

  build(run) {
    this.run = run;
    this.painted = new Set();
    this.thumbs = Array.from({ length: run.nLayers }, () => Array.from({ length: run.nHeads }, () => new Map()));
    this.layouts = new Map();
    this.failed = new Set();
    this.failedNote.hidden = true;
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
        // Alt-click ablates the head (experiments.js) and only that: it focused the head too, and
        // the next "Ablate focused head" then hit the head just ablated, not the one studied.
        button.addEventListener("click", (event) => {
          if (!event.altKey) this.onSelect(l, h);
        });
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
    if (this.failed.delete(layer)) this.sayFailed();
  }

  // The boxes of layers that could not be loaded say so (title and a dashed box, not a pulse that
  // never ends), and the line under the grid says why. `reason`: the error as the page words it.
  failLayers(layers, reason) {
    for (const l of layers) {
      if (this.run.hasLayer(l)) continue;
      this.failed.add(l);
      this.cells[l].forEach((cell, h) => {
        cell.classList.replace("loading", "failed");
        cell.title = `Layer ${l}, head ${h}: not loaded`;
      });
    }
    this.reason = reason;
    this.sayFailed();
  }

  sayFailed() {
    const layers = [...this.failed].sort((a, b) => a - b);
    if (!layers.length) {
      // Its button under the keyboard would drop focus to the page: the grid's Tab stop takes it.
      if (this.failedNote.contains(document.activeElement)) this.container.querySelector('.thumb[tabindex="0"]')?.focus();
      this.failedNote.hidden = true;
      return;
    }
    this.failedNote.hidden = false;
    this.failedText.textContent = `${layerList(layers)} not loaded: ${this.reason}`;
  }

  // The failed layers pulse again while they are asked for (a row scrolled back into view, or a
  // layer focused, asks again too).
  retryFailed() {
    const layers = [...this.failed].sort((a, b) => a - b);
    for (const l of layers) this.cells[l].forEach((cell) => cell.classList.replace("failed", "loading"));
    this.failedText.textContent = `Asking again for ${layerList(layers).toLowerCase()}…`;
    this.onNeedLayers(layers);
  }

  // The thumbnail layout of a layer for these options (hidden tokens and pair block, and the
  // layer's sliding window; threshold and colour scale only recolour).
  layoutFor(options, layer) {
    const mask = layerMask(this.run, layer);
    const key = `${options.hideSpecial}|${options.hideFirst}|${options.segments}|${mask.window}`;
    let layout = this.layouts.get(key);
    if (!layout) {
      const selected = isIdentity({ ...options, threshold: 0 }, this.run.hasPair) ? undefined : selectionOf(this.run.tokens, options);
      layout = runLayout(this.run.T, mask, selected);
      layout.key = key;
      this.layouts.set(key, layout);
    }
    return layout;
  }

  paintHead(layer, h, options) {
    const run = this.run;
    const layout = this.layoutFor(options, layer);
    // The 8-bit bytes as they came, unless rows are renormalised or thresholded: then the head's
    // exact values once they are here.
    const exact = !isIdentity(options, run.hasPair) && run.isPrecise(layer, h);
    const key = `${layout.key}|${exact ? "f16" : "u8"}`;
    const kept = this.thumbs[layer][h];
    let pooled = kept.get(key);
    if (!pooled) {
      pooled = exact ? pool(run.head(layer, h), 1, layout) : pool(run.headBytes(layer, h), run.scale, layout);
      // A few selections per head (64 KB each at T ≥ 128), so toggling an option back costs no pooling.
      if (kept.size >= KEPT_SELECTIONS) kept.delete(kept.keys().next().value);
    }
    kept.delete(key);
    kept.set(key, pooled); // the most recent last
    colour(this.cells[layer][h].firstChild, pooled, layout, options.scale, options.threshold);
    this.note.hidden = layout.width > 0 && layout.height > 0;
    this.cells[layer][h].classList.remove("loading", "failed");
    this.cells[layer][h].title = `Layer ${layer}, head ${h}`;
    this.cells[layer][h].dataset.values = exact ? "f16" : "u8"; // what it was drawn from
  }

  paintAll(options) {
    for (let l = 0; l < this.run.nLayers; l++) this.paintLayer(l, options);
  }

  // The same in slices of a few ms between other tasks: all 72 heads at T=512 in one task would
  // freeze the page (and the next arrow key). A newer call replaces an unfinished one.
  paintAllSoon(options) {
    const schedule = (this.schedule = {});
    const jobs = [];
    for (let l = 0; l < this.run.nLayers; l++) {
      if (this.run.hasLayer(l)) for (let h = 0; h < this.run.nHeads; h++) jobs.push(() => this.paintHead(l, h, options));
    }
    return inSlices(jobs, () => this.schedule !== schedule);
  }

  get complete() {
    return this.run && this.painted.size === this.run.nLayers;
  }

  // In head mode one cell is pressed; a mean marks the heads it averages instead.
  select(layer, head, aggregate = "head") {
    this.cells.forEach((row, l) => row.forEach((cell, h) => {
      cell.setAttribute("aria-pressed", String(aggregate === "head" && l === layer && h === head));
      cell.classList.toggle("in-mean", aggregate === "all" || (aggregate === "layer" && l === layer));
      // One Tab stop for the whole grid (the focused head's thumbnail), the arrows move within it
      // (main.js): 72 stops, or 1,024 on a larger model, stood between the controls and the head view.
      cell.tabIndex = l === layer && h === head ? 0 : -1;
    }));
  }
}
