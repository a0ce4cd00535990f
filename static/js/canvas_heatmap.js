// The focused matrix drawn by the page itself into a <canvas> laid over Plotly's plot area.
// Plotly keeps the axes, labels, title, colorbar, modebar and zoom/pan; re-rendering a 512 × 512
// heatmap through Plotly costs ~220 ms a step, colouring an ImageData from the 256-entry colour
// table and one drawImage costs a few ms.
//
// The matrix is held as a list of tiles, each an image of a rectangle of cells; today one tile
// holds every cell. Long runs (issue 10, long_focus.js) fill `tiles` from the server's tiles per
// zoom level: draw() maps each tile's cell rectangle to pixels through the axes' ranges.

import { MASKED, colorTable, scaled } from "./theme.js";


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
      return;
    }
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
    const style = canvas.style;
    style.left = `${xa._offset}px`;
    style.top = `${ya._offset}px`;
    style.width = `${width}px`;
    style.height = `${height}px`;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
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
    return out.toDataURL("image/png");
  }
}
