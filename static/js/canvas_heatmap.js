// The focused matrix drawn by the page itself into a <canvas> laid over Plotly's plot area.
// Plotly keeps the axes, labels, title, colorbar, modebar and zoom/pan; re-rendering a 512 × 512
// heatmap through Plotly costs ~220 ms a step, colouring an ImageData from the 256-entry colour
// table and one drawImage costs a few ms.
//
// The matrix is held as a list of tiles, each an image of a rectangle of cells; today one tile
// holds every cell. Long runs (issue 10, long_focus.js) fill `tiles` from the server's tiles per
// zoom level: draw() maps each tile's cell rectangle to pixels through the axes' ranges.

import { MASKED, colorTable, palette, scaled } from "./theme.js";


// Each cell's colour from the 256-entry table (the masked colour where the model could not look),
// packed RGBA into out (one Uint32 per cell, row-major).
export function paintCells(view, scale, peak, out) {
  const table = colorTable();
  const nRows = view.rows.length;
  const nCols = view.cols.length;
  const unit = scale === "head" ? (peak > 0 ? 1 / peak : 0) : 1;
  for (let r = 0; r < nRows; r++) {
    const base = r * nCols;
    for (let c = 0; c < nCols; c++) {
      if (view.masked(r, c)) {
        out[base + c] = table[MASKED];
        continue;
      }
      const v = view.values[base + c];
      const x = scale === "log" ? scaled(v, "log", peak) : v * unit;
      out[base + c] = table[Math.round(255 * Math.min(1, Math.max(0, x)))];
    }
  }
  return out;
}

// Which of an nRows × nCols view's cells are masked, row by row: a query's masked keys are a
// prefix (behind a sliding window) and a suffix (later keys, when causal), never cells between.
// at(r) gives [a, b): the row's cells before a and from b on are masked. Null: none is.
export function maskRunsOf(masked, nRows, nCols) {
  const runs = new Int32Array(2 * nRows);
  let any = false;
  for (let r = 0; r < nRows; r++) {
    let a = 0;
    while (a < nCols && masked(r, a)) a++;
    let b = nCols;
    while (b > a && masked(r, b - 1)) b--;
    runs[2 * r] = a;
    runs[2 * r + 1] = b;
    any ||= a > 0 || b < nCols;
  }
  return any ? { at: (r) => [runs[2 * r], runs[2 * r + 1]] } : null;
}

// Diagonal lines in the theme's muted text colour, one pattern tile (6 CSS pixels) at a time; the
// tile is kept while the colour and pixel ratio stay (a pan draws every frame).
let hatchTile = { key: "", canvas: null };
function hatchPattern(ctx, ratio) {
  const colour = palette().muted;
  const size = Math.max(4, Math.round(6 * ratio));
  const key = `${colour}|${size}`;
  if (hatchTile.key !== key) {
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = size;
    const t = canvas.getContext("2d");
    t.strokeStyle = colour;
    t.lineWidth = Math.max(1, ratio);
    t.beginPath();
    for (const shift of [-size, 0, size]) { // the corners too, so neighbouring tiles join into lines
      t.moveTo(shift, size);
      t.lineTo(shift + size, 0);
    }
    t.stroke();
    hatchTile = { key, canvas };
  }
  return ctx.createPattern(hatchTile.canvas, "repeat");
}

// One tile: cells [row0, row0 + rows) × [col0, col0 + cols) as an image, one pixel per cell; the
// previous tile's canvas is reused when it has the same size (no new allocation per head step).
function tileOf(pixels, nRows, nCols, previous, row0 = 0, col0 = 0) {
  let image = previous?.image;
  if (!image || image.width !== nCols || image.height !== nRows) {
    image = document.createElement("canvas");
    image.width = nCols;
    image.height = nRows;
  }
  image.getContext("2d").putImageData(new ImageData(new Uint8ClampedArray(pixels.buffer, 0, nRows * nCols * 4), nCols, nRows), 0, 0);
  return { row0, col0, rows: nRows, cols: nCols, image };
}

// The cell (row, col) of an nRows × nCols matrix on a Plotly plot's axes (edges at index ± 0.5)
// under a client-space point, or null outside the plot area or the matrix.
export function cellUnder(plot, clientX, clientY, nRows, nCols) {
  const xa = plot._fullLayout?.xaxis;
  const ya = plot._fullLayout?.yaxis;
  if (!xa || !ya || !nRows) return null;
  const box = plot.getBoundingClientRect();
  const x = clientX - box.left - xa._offset;
  const y = clientY - box.top - ya._offset;
  if (x < 0 || y < 0 || x > xa._length || y > ya._length) return null;
  const col = Math.round(xa.p2l(x));
  const row = Math.round(ya.p2l(y));
  if (row < 0 || col < 0 || row >= nRows || col >= nCols) return null;
  return { row, col };
}

export class CanvasHeatmap {
  constructor(plot) {
    this.plot = plot; // the Plotly graph div whose axes place the cells
    this.canvas = document.createElement("canvas");
    this.canvas.className = "heatmap-canvas";
    this.canvas.setAttribute("aria-hidden", "true");
    // Masked cells are hatched on a canvas of their own, above the cells: their grey alone told
    // them from zero weights by colour only (1.5:1 against the light scale's white).
    this.hatch = document.createElement("canvas");
    this.hatch.className = "heatmap-hatch";
    this.hatch.setAttribute("aria-hidden", "true");
    this.maskRuns = null; // maskRunsOf's answer for the cells drawn
    this.tiles = [];
    this.nRows = 0;
    this.nCols = 0;
  }

  setMatrix(view, scale, peak) {
    this.nRows = view.rows.length;
    this.nCols = view.cols.length;
    const cells = this.nRows * this.nCols;
    if (!cells) {
      this.tiles = [];
      this.maskRuns = null;
      return;
    }
    this.maskRuns = maskRunsOf(view.masked, this.nRows, this.nCols);
    if (!this.pixels || this.pixels.length < cells) this.pixels = new Uint32Array(cells);
    paintCells(view, scale, peak, this.pixels);
    this.tiles = [tileOf(this.pixels, this.nRows, this.nCols, this.tiles[0])];
  }

  // Between Plotly's lower SVG (background, ticks, drag layer) and its upper one (title, colorbar,
  // zoom box), as Plotly places its own WebGL canvases: the zoom box stays visible above the cells,
  // and pointer events fall through to Plotly's drag layer.
  attach() {
    const container = this.plot.querySelector(".svg-container");
    const lower = container?.querySelector(".main-svg");
    if (!lower) return false;
    if (this.canvas.previousSibling !== lower) lower.after(this.canvas);
    if (this.hatch.previousSibling !== this.canvas) this.canvas.after(this.hatch);
    return true;
  }

  // Repaints the cells for the axes' current ranges (also mid-pan, when Plotly moves them live).
  draw() {
    const layout = this.plot._fullLayout;
    const xa = layout?.xaxis;
    const ya = layout?.yaxis;
    if (!xa || !ya || !this.attach()) return;
    const width = Math.max(1, Math.round(xa._length));
    const height = Math.max(1, Math.round(ya._length));
    const ratio = window.devicePixelRatio || 1;
    const canvas = this.canvas;
    for (const layer of [canvas, this.hatch]) {
      const style = layer.style;
      style.left = `${xa._offset}px`;
      style.top = `${ya._offset}px`;
      style.width = `${width}px`;
      style.height = `${height}px`;
      if (layer.width !== Math.round(width * ratio) || layer.height !== Math.round(height * ratio)) {
        layer.width = Math.round(width * ratio);
        layer.height = Math.round(height * ratio);
      }
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.imageSmoothingEnabled = false; // a cell is a crisp block, however far zoomed in
    const [x0, x1] = xa.range;
    const [y0, y1] = ya.range;
    // Cell edges sit at index ± 0.5; y grows downward on screen, so y's range reads top = range[1].
    const px = (v) => ((v - x0) / (x1 - x0)) * canvas.width;
    const py = (v) => ((y1 - v) / (y1 - y0)) * canvas.height;
    for (const tile of this.tiles) this.drawTile(ctx, tile, px, py);
    this.drawHatch(px, py, [Math.min(y0, y1), Math.max(y0, y1)], ratio);
  }

  // The masked cells of the rows in view (yRange, in row units), hatched.
  drawHatch(px, py, [yLow, yHigh], ratio) {
    const ctx = this.hatch.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, this.hatch.width, this.hatch.height);
    const first = Math.max(0, Math.floor(yLow + 0.5));
    const last = Math.min(this.nRows - 1, Math.ceil(yHigh - 0.5));
    this.hatchRows(ctx, px, py, first, last, ratio);
  }

  // Hatches the masked cells of rows [first, last] onto ctx, cells mapped to pixels by px and py.
  hatchRows(ctx, px, py, first, last, ratio) {
    if (!this.maskRuns) return;
    const left = px(-0.5);
    const right = px(this.nCols - 0.5);
    // Zoomed out, rows thinner than a pixel go in pixel-high groups, each hatched as its first row:
    // 8192 rows took 5-7 ms a frame one by one.
    const step = Math.max(1, Math.floor(1 / Math.abs(py(1) - py(0))));
    ctx.beginPath();
    for (let r = first; r <= last; r += step) {
      const [a, b] = this.maskRuns.at(r);
      const end = Math.min(last, r + step - 1);
      const top = Math.min(py(r - 0.5), py(end + 0.5));
      const height = Math.abs(py(end + 0.5) - py(r - 0.5));
      if (a > 0) ctx.rect(left, top, px(a - 0.5) - left, height);
      if (b < this.nCols) ctx.rect(px(b - 0.5), top, right - px(b - 0.5), height);
    }
    ctx.fillStyle = hatchPattern(ctx, ratio);
    ctx.fill();
  }

  // One tile, its cells mapped to canvas pixels by px (columns) and py (rows).
  drawTile(ctx, tile, px, py) {
    const left = px(tile.col0 - 0.5);
    const right = px(tile.col0 + tile.cols - 0.5);
    const top = py(tile.row0 - 0.5);
    const bottom = py(tile.row0 + tile.rows - 0.5);
    ctx.drawImage(tile.image, Math.min(left, right), Math.min(top, bottom), Math.abs(right - left), Math.abs(bottom - top));
  }

  // The cell (row, col) under a client-space point, or null outside the matrix.
  cellAt(clientX, clientY) {
    return cellUnder(this.plot, clientX, clientY, this.nRows, this.nCols);
  }

  // What exports embed: the image and the cells it covers (edges at index ± 0.5), here all of them.
  exportImage() {
    return { source: this.dataUrl(), x: -0.5, y: -0.5, sizex: this.nCols, sizey: this.nRows };
  }

  // The whole matrix as a PNG data URL for exports, each cell at least a few pixels wide so that
  // the exporter's scaling keeps blocks crisp (at most 2048 pixels a side).
  dataUrl() {
    const side = Math.max(this.nRows, this.nCols, 1);
    const k = Math.max(1, Math.min(Math.ceil(1200 / side), Math.floor(2048 / side)));
    const out = document.createElement("canvas");
    out.width = this.nCols * k;
    out.height = this.nRows * k;
    const ctx = out.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    for (const tile of this.tiles) ctx.drawImage(tile.image, tile.col0 * k, tile.row0 * k, tile.cols * k, tile.rows * k);
    const at = (v) => (v + 0.5) * k;
    this.hatchRows(ctx, at, at, 0, this.nRows - 1, 1);
    return out.toDataURL("image/png");
  }
}
