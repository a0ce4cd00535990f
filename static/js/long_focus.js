// The focused heatmap at any length (issue 10). Short runs go through FocusView unchanged. A long
// run (the server kept queries and keys, `kept: "qk"`) is never held whole: the heatmap paints the
// head's overview thumbnail at once, then asks the server for the tiles of the window in view at
// the screen's resolution (full resolution once the window is small), and asks again after each
// zoom or pan, like a map; tiles nobody needs any more are aborted (tiles.js).

import { describeError } from "./api.js";
import { CanvasHeatmap } from "./canvas_heatmap.js";
import { F16_ZERO, FocusView, MAX_FONT, shortLabel, weightText } from "./focus.js";
import { layerMask } from "./run.js";
import { BLOCK, TileLoader, blocksFor, fetchTile, levelFor, paintBins } from "./tiles.js";
import { colorTable, themeName } from "./theme.js";
import { isolate, isolateQuoted } from "./tokens.js";

const EXPORT_SIDE = 2048; // pixels a side of an exported window of a long run, at most
const HOVER_PAUSE_MS = 60; // a resting pointer over a pooled cell asks for that cell's exact value
const EXACT_KEPT = 512;
const UNREAD_MS = 5000; // how long a failed read is said before the cell is asked for again
const F16_NORMAL = 2 ** -14; // float16's smallest normal number: below it, steps of 2^-24

// What draw() needs of a tile: its cell rectangle and the cells one pixel of its image covers.
function placed(tile, w) {
  return Object.assign(tile, {
    w, row0: tile.q0, col0: tile.k0, rows: tile.q1 - tile.q0, cols: tile.k1 - tile.k0,
    rowStep: tile.rowEdges[1] - tile.rowEdges[0], colStep: tile.colEdges[1] - tile.colEdges[0],
  });
}

// The value of cell (q, k) in a tile: its own (float16) at full resolution, a bin's max when pooled.
function valueIn(tile, q, k) {
  const i = Math.min(tile.nr - 1, Math.floor((q - tile.q0) / tile.rowStep));
  const j = Math.min(tile.nc - 1, Math.floor((k - tile.k0) / tile.colStep));
  return tile.values[i * tile.nc + j];
}

const covers = (tile, q, k) => q >= tile.q0 && q < tile.q1 && k >= tile.k0 && k < tile.k1;

// A pooled bin's reading, the largest of its float16 cells as an upper bound. toFixed(3) wrote a
// bin of 4.5e-5 as "≤ 0.000", below the cell's own reading that followed; float16's 0 holds up to 2^-25.
export function boundText(value) {
  return `≤ ${value === 0 ? F16_ZERO.toPrecision(2) : weightText(value)}`;
}

class TiledHeatmap extends CanvasHeatmap {
  // A pooled tile's last bin may be narrower than the others: the image is drawn at its full bin
  // width and clipped to the tile's cells.
  drawTile(ctx, tile, px, py) {
    if (!tile.rowStep) {
      super.drawTile(ctx, tile, px, py);
      return;
    }
    const x0 = px(tile.col0 - 0.5);
    const x1 = px(tile.col0 + tile.cols - 0.5);
    const y0 = py(tile.row0 - 0.5);
    const y1 = py(tile.row0 + tile.rows - 0.5);
    const xe = px(tile.col0 + tile.image.width * tile.colStep - 0.5);
    const ye = py(tile.row0 + tile.image.height * tile.rowStep - 0.5);
    // The clip on whole pixels: two neighbouring tiles then share their edge, with no anti-aliased
    // seam through which the coarser tile under them would show.
    const [left, right] = [Math.round(Math.min(x0, x1)), Math.round(Math.max(x0, x1))];
    const [top, bottom] = [Math.round(Math.min(y0, y1)), Math.round(Math.max(y0, y1))];
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, right - left, bottom - top);
    ctx.clip();
    ctx.drawImage(tile.image, Math.min(x0, xe), Math.min(y0, ye), Math.abs(xe - x0), Math.abs(ye - y0));
    ctx.restore();
  }

  // A long run exports the window in view (exportWindow, set by the focus), from the tiles it has,
  // each cell a whole number of pixels while the window is at most 2048 cells a side, as short runs'
  // exports are: a T × T image at T = 8192 would be 268 MB, and one pixel a cell blurs when zoomed.
  exportImage() {
    if (!this.long) return super.exportImage();
    const { q0, q1, k0, k1 } = this.exportWindow;
    const side = Math.max(q1 - q0, k1 - k0);
    const k = side <= EXPORT_SIDE ? Math.max(1, Math.min(Math.ceil(1200 / side), Math.floor(EXPORT_SIDE / side))) : EXPORT_SIDE / side;
    const out = document.createElement("canvas");
    out.width = Math.round((k1 - k0) * k);
    out.height = Math.round((q1 - q0) * k);
    const ctx = out.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    const [px, py] = [(v) => (v - k0 + 0.5) * k, (v) => (v - q0 + 0.5) * k];
    for (const tile of this.tiles) this.drawTile(ctx, tile, px, py);
    this.hatchRows(ctx, px, py, q0, q1 - 1, 1);
    return { source: out.toDataURL("image/png"), x: k0 - 0.5, y: q0 - 0.5, sizex: k1 - k0, sizey: q1 - q0 };
  }
}

export class TiledFocusView extends FocusView {
  constructor(plot, tooltip, reader) {
    super(plot, tooltip, reader);
    this.heatmap = new TiledHeatmap(plot);
    this.long = null;
    this.onTileError = null; // (err) => void, set by the page
    this.loader = new TileLoader({
      fetch: (spec, signal) => fetchTile(spec.runId, spec, signal).then((tile) => placed(tile, spec.w)),
      onTile: (spec) => this.tileArrived(spec),
      onError: (err) => this.onTileError?.(err),
    });
    this.exact = new Map(); // "run|layer:head|q|k" -> the cell's float32 weight (as f16), from hovering
    this.unread = new Map(); // the same keys -> why the cell's own weight could not be read, and until when
    this.hoverTimer = 0;
    this.hoverController = null;
    this.refineStart = null;
    this.onWindow = null; // (window) => void after each refine: the head view follows the rows in view
  }

  render(args) {
    if (this.long) this.leaveLong();
    return super.render(args);
  }

  clear(message) {
    if (this.long) this.leaveLong();
    super.clear(message);
  }

  leaveLong() {
    this.long = null;
    this.heatmap.long = false;
    this.loader.clear();
    this.exact.clear();
    this.unread.clear();
    delete this.plot.dataset.long;
    delete this.plot.dataset.level; // a long run's pooling: a short run after it is not pooled
  }

  // run: { runId, T, causal, slidingWindows }; head: a head's index or "mean" (the layer's mean); base: the
  // overview tile of that head ({ q0: 0, q1: T, k0: 0, k1: T, nr, nc, values, rowEdges, colEdges })
  // and its peak, or null for a mean, whose coarsest tile is asked for first and gives the peak.
  async renderLong({ run, layer, head, base = null, peak = 0, labels, title, filename, exportCaption, scale = "head", revision }) {
    this.fitHeight();
    this.startRevision(revision);
    const { T } = run;
    const mask = layerMask(run, layer);
    if (this.long?.runId !== run.runId) {
      this.loader.clear(); // another run's tiles: never drawn again
      this.exact.clear();
      this.unread.clear();
    }
    if (!this.identity || this.identity.length !== T) this.identity = Int32Array.from({ length: T }, (_, i) => i);
    const view = { rows: this.identity, cols: this.identity, values: null, masked: mask.none ? () => false : mask.cell };
    this.long = {
      runId: run.runId, T, mask, layer, head, prefix: `${run.runId}|${layer}:${head}|`,
      base: base && placed(base, Infinity), peak, level: null, coarsest: levelFor(T, BLOCK),
    };
    this.heatmap.long = true;
    this.heatmap.nRows = this.heatmap.nCols = T;
    // The rule's own spans: scanning T × T cells for them (maskRunsOf) is what tiles avoid.
    this.heatmap.maskRuns = mask.none ? null : { at: (q) => mask.span(q, T) };
    this.plot.dataset.long = "true";
    this.emptyNode.hidden = true; // a failed first run's note ("the run above failed"), as render() hides it
    this.current = { view, labels, nRows: T, nCols: T, title, scale, peak, zmax: 1 };
    this.setPeak(base ? peak : this.peakOf(this.coarsestTile()));
    this.filename = filename;
    this.exportCaption = exportCaption || title;
    this.heatmap.tiles = this.drawnTiles();
    await this.layOut();
    this.refine();
  }

  setPeak(peak) {
    const { scale } = this.current;
    this.long.peak = peak;
    this.current.peak = peak;
    this.current.zmax = scale === "log" || scale === "fixed" ? 1 : peak > 0 ? peak : 1;
  }

  // The token window [q0, q1) × [k0, k1) the axes show now (also mid-pan).
  window() {
    const T = this.long.T;
    const ranges = this.placement()?.ranges ?? this.ranges;
    const span = (range) => {
      if (!range) return [0, T];
      const [a, b] = range[0] <= range[1] ? range : [range[1], range[0]];
      const lo = Math.min(T - 1, Math.max(0, Math.floor(a + 0.5)));
      return [lo, Math.max(lo + 1, Math.min(T, Math.ceil(b + 0.5)))];
    };
    const [q0, q1] = span(ranges.y);
    const [k0, k1] = span(ranges.x);
    return { q0, q1, k0, k1 };
  }

  tileKey(block) {
    return `${this.long.prefix}${block.w}|${block.q0}|${block.k0}`;
  }

  // The level (cells a pixel) at which the window fits the plot's device pixels.
  levelOf(win) {
    const box = this.placement()?.box;
    if (!box) return this.long.coarsest;
    const ratio = window.devicePixelRatio || 1;
    return Math.max(levelFor(win.q1 - win.q0, box.height * ratio), levelFor(win.k1 - win.k0, box.width * ratio));
  }

  // The tiles to paint, coarse under fine: the overview, then whatever cached tiles of this head
  // meet the window, recoloured if the scale, the peak or the theme changed since. Once the
  // window's own tiles are all here, only they are drawn (the rest would be painted over).
  drawnTiles() {
    const L = this.long;
    const win = this.window();
    const { q0, q1, k0, k1 } = win;
    const colourKey = `${this.current.scale}|${L.peak}|${themeName()}`;
    const own = blocksFor(win, this.levelOf(win), L.T, L.mask).map((b) => (b.masked ? this.maskedTile(b) : this.loader.cache.get(this.tileKey(b))));
    let tiles = [];
    if (own.every(Boolean)) {
      tiles = own;
    } else {
      if (L.base) tiles.push(L.base);
      for (const [key, tile] of this.loader.cache) {
        if (key.startsWith(L.prefix) && tile.q0 < q1 && tile.q1 > q0 && tile.k0 < k1 && tile.k1 > k0) tiles.push(tile);
      }
      tiles.sort((a, b) => b.w - a.w);
    }
    for (const tile of tiles) {
      if (tile.masked || tile.colourKey === colourKey) continue;
      tile.image = paintBins(tile.image ?? document.createElement("canvas"), tile, this.current.scale, L.peak, L.mask);
      tile.colourKey = colourKey;
    }
    return tiles;
  }

  // A block wholly masked (above a causal diagonal, or behind a sliding window), in the masked colour (under the tiles Plotly's own
  // background is the colour of weight 0).
  maskedTile(block) {
    const colour = colorTable()[256];
    if (this.maskImage?.colour !== colour) {
      const image = document.createElement("canvas");
      image.width = image.height = 1;
      image.getContext("2d").putImageData(new ImageData(new Uint8ClampedArray(Uint32Array.of(colour).buffer), 1, 1), 0, 0);
      this.maskImage = { colour, image };
    }
    return { row0: block.q0, col0: block.k0, rows: block.q1 - block.q0, cols: block.k1 - block.k0, image: this.maskImage.image, w: block.w, masked: true };
  }

  // Asks for the tiles of the window in view at the screen's resolution; the rest are aborted.
  refine() {
    const L = this.long;
    const place = this.placement();
    if (!L || !place) return;
    const win = this.window();
    const w = this.levelOf(win);
    L.level = w;
    const spec = (block) => ({ ...block, key: this.tileKey(block), runId: L.runId, layer: L.layer, head: L.head });
    const specs = [];
    // A mean has no overview: its coarsest tile (the whole run in one) comes first and sets the peak.
    if (!L.base) specs.push(...blocksFor({ q0: 0, q1: L.T, k0: 0, k1: L.T }, L.coarsest, L.T).map(spec));
    for (const block of blocksFor(win, w, L.T, L.mask)) {
      if (!block.masked && !specs.some((s) => s.key === this.tileKey(block))) specs.push(spec(block));
    }
    this.refineStart ??= performance.now(); // from the first of several refines before the tiles settle
    this.loader.want(specs);
    this.plot.dataset.level = String(w);
    this.settled();
    this.onWindow?.(win);
  }

  // A mean's coarsest tile: the whole run in one, pooled by max, so its max is the mean's peak.
  coarsestTile() {
    const L = this.long;
    return this.loader.cache.get(this.tileKey({ w: L.coarsest, q0: 0, k0: 0 })) ?? null;
  }

  peakOf(tile) {
    let peak = 0;
    if (tile) for (const v of tile.values) if (v > peak) peak = v;
    return peak;
  }

  tileArrived(spec) {
    const L = this.long;
    if (!L || !spec.key.startsWith(L.prefix)) return;
    if (!L.base && spec.key === this.tileKey({ w: L.coarsest, q0: 0, k0: 0 })) {
      this.setPeak(this.peakOf(this.loader.get(spec.key)));
      this.decorate();
    }
    this.heatmap.tiles = this.drawnTiles();
    this.heatmap.draw();
    this.settled();
  }

  // Once every tile asked for is painted: a mark for the bench, a flag for the tests.
  settled() {
    const pending = this.loader.pending;
    this.plot.dataset.tilesPending = String(pending);
    if (pending === 0 && this.refineStart !== null) {
      performance.measure("manyeyes:long:refined", { start: this.refineStart, end: performance.now() });
      this.refineStart = null;
    }
  }

  follow() {
    if (this.long) this.heatmap.tiles = this.drawnTiles(); // panning uncovers cached tiles
    super.follow();
  }

  onRelayout(event) {
    if (this.long) this.heatmap.tiles = this.drawnTiles(); // drawn by the decorate in super's
    super.onRelayout(event);
    if (this.long) this.refine();
  }

  // A long run's margins hold its longest label at the largest font, whatever is in view: they
  // stay put through zooms and pans, which then never pay for a second Plotly relayout.
  labelPx(texts, font) {
    if (!this.long) return super.labelPx(texts, font);
    const { labels } = this.current;
    if (this.longestLabel?.labels !== labels) {  // a token's text, or a thinned axis's last position (ticks)
      this.longestLabel = { labels, px: super.labelPx([...labels.map(shortLabel), String(labels.length - 1)], MAX_FONT) };
    }
    return this.longestLabel.px;
  }

  download(format) {
    if (this.long) this.heatmap.exportWindow = this.window();
    return super.download(format);
  }

  plotted(options) {
    if (!this.long) return super.plotted(options);
    const { nRows, nCols, zmax, scale, peak } = this.current;
    const tiles = this.heatmap.tiles.filter((t) => !t.masked)
      .map(({ q0, q1, k0, k1, w, nr, nc, pool }) => ({ q0, q1, k0, k1, w: Number.isFinite(w) ? w : null, nr, nc, pool }));
    return { rows: nRows, cols: nCols, zmax, scale, peak, long: true, level: this.long.level, window: this.window(), tiles, pending: this.loader.pending };
  }

  // A long run's cells are its own positions, none hidden: a picked one ranks every head by it
  // (the server reads the cell from the queries and keys it keeps).
  pick(cell) {
    if (!this.long) {
      super.pick(cell);
      return;
    }
    if (!cell || !this.onPick || this.long.mask.cell(cell.row, cell.col)) return;
    this.onPick(cell.row, cell.col);
  }

  // The reading under the pointer: a full-resolution tile's float16 where it holds the weight, else
  // what the tile says while the cell's own float32 value is fetched. Over the axes' labels: that token, since
  // beyond 64 tokens in view only every k-th is labelled.
  showReading(clientX, clientY) {
    if (!this.long) {
      super.showReading(clientX, clientY);
      return;
    }
    const { labels } = this.current;
    const cell = this.heatmap.cellAt(clientX, clientY);
    let text;
    if (cell) {
      const { row: q, col: k } = cell;
      // Positions too: past 64 tokens in view not every row is labelled, and a keyboard user
      // panning with the cell cursor could not tell where it was.
      // Each label and span isolated, as the short run's reading (focus.js): an RTL one reordered it.
      text = `#${q} ${isolate(labels[q])} → #${k} ${isolate(labels[k])}: ${this.reading(q, k, clientX, clientY)}`;
      if (this.spans) text += `\n${isolateQuoted(this.spans(q))} → ${isolateQuoted(this.spans(k))}`;
      this.tooltip.dataset.query = q;
      this.tooltip.dataset.key = k;
    } else {
      const token = this.axisTokenAt(clientX, clientY);
      if (!token) {
        this.tooltip.hidden = true;
        return;
      }
      text = `${token.axis} ${token.index}: ${isolate(labels[token.index])}${this.spans ? `\n${isolateQuoted(this.spans(token.index))}` : ""}`;
      delete this.tooltip.dataset.query;
      delete this.tooltip.dataset.key;
    }
    this.showTooltip(text, clientX, clientY);
  }

  reading(q, k, clientX, clientY) {
    const L = this.long;
    if (L.mask.cell(q, k)) return "masked";
    const key = `${L.prefix}${q}|${k}`;
    if (this.exact.has(key)) return weightText(this.exact.get(key));
    const tiles = this.heatmap.tiles;
    for (let i = tiles.length - 1; i >= 0; i--) {
      const tile = tiles[i];
      if (!covers(tile, q, k)) continue;
      const value = valueIn(tile, q, k);
      // A float16 tile's cell is its weight from float16's smallest normal number on. Below it
      // float16 keeps steps of 2^-24 (a weight of 3.4e-8 read "6.0e-8", and under 2^-25 is 0): the
      // cell's own float32 value is asked for, as a pooled cell's is.
      const full = tile.rowStep === 1 && tile.colStep === 1;
      if (full && value >= F16_NORMAL) return weightText(value);
      const shown = full ? `${weightText(value, F16_ZERO)} (float16` : `${boundText(value)} (max of ${tile.rowStep} × ${tile.colStep} cells`;
      // A read that failed said "reading this one…" for as long as the pointer stayed (the server gone).
      const failed = this.unreadNow(key);
      if (failed) return `${shown}; this one could not be read: ${failed})`;
      this.askExact(q, k, key, clientX, clientY);
      return `${shown}; reading this one…)`;
    }
    const failed = this.unreadNow(key);
    if (failed) return `could not be read: ${failed}`;
    this.askExact(q, k, key, clientX, clientY);
    return "reading…";
  }

  // The run was posted again after the server let it go: the failures its loss caused are over.
  runRevived() {
    this.unread.clear();
  }

  // Why the cell's weight could not be read, for a few seconds: then it is asked again (a 429 of a
  // busy server, or one back up, was "could not be read" until the run changed).
  unreadNow(key) {
    const failed = this.unread.get(key);
    return failed && performance.now() < failed.until ? failed.why : null;
  }

  askExact(q, k, key, clientX, clientY) {
    clearTimeout(this.hoverTimer);
    this.hoverController?.abort();
    const L = this.long;
    this.hoverTimer = setTimeout(() => {
      const controller = (this.hoverController = new AbortController());
      const block = { runId: L.runId, layer: L.layer, head: L.head, q0: q, q1: q + 1, k0: k, k1: k + 1 };
      // The weight, or why it could not be read, kept (the oldest dropped) and shown if still hovered.
      const keep = (map, value) => {
        if (map.size >= EXACT_KEPT) map.delete(map.keys().next().value);
        map.set(key, value);
        const still = !this.tooltip.hidden && this.tooltip.dataset.query === String(q) && this.tooltip.dataset.key === String(k);
        if (still && this.long === L) this.showReading(clientX, clientY);
      };
      fetchTile(L.runId, block, controller.signal, "json").then((tile) => { // one cell: float32 costs nothing
        keep(this.exact, tile.values[0]);
      }).catch((err) => {
        if (err.name === "AbortError") return;
        this.onTileError?.(err);
        // An evicted run is posted again by the page (onTileError): the API's "POST again" is not
        // for a person, and once the run is back (runRevived) the cell is asked for again at once.
        const lost = err.status === 404 && err.code === "unknown_run";
        const why = lost ? "the server had let this run go; the page is running it again" : describeError(err);
        keep(this.unread, { why, until: performance.now() + UNREAD_MS });
      });
    }, HOVER_PAUSE_MS);
  }

  // The token whose label sits under a point left of the rows or beside the keys' axis.
  axisTokenAt(clientX, clientY) {
    const xa = this.plot._fullLayout?.xaxis;
    const ya = this.plot._fullLayout?.yaxis;
    if (!xa || !ya) return null;
    const box = this.plot.getBoundingClientRect();
    const x = clientX - box.left - xa._offset;
    const y = clientY - box.top - ya._offset;
    const T = this.long.T;
    const inside = (v, n) => v >= 0 && v < n;
    if (x < 0 && y >= 0 && y <= ya._length) {
      const index = Math.round(ya.p2l(y));
      return inside(index, T) ? { axis: "query", index } : null;
    }
    if ((y < 0 || y > ya._length) && x >= 0 && x <= xa._length) {
      const index = Math.round(xa.p2l(x));
      return inside(index, T) ? { axis: "key", index } : null;
    }
    return null;
  }
}
