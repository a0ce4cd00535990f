// Long runs (issue 10): the server keeps queries and keys, not the (L, H, T, T) weights, and serves
// any window of a head as a tile. This module asks for tiles, overviews and top-k rows, decodes
// them, and keeps a few tiles: the page never holds more of a long run than what is on screen.
//
// Tiles line up like a map's: at level w each pixel is the max of w × w cells (w a power of two,
// chosen so that the window in view fits the screen's pixels), and a tile is BLOCK × BLOCK pixels
// at a multiple of BLOCK × w cells. A pan then only asks for the tiles it uncovers, and a zoom back
// finds the previous level's tiles in the cache.

import { requestJson } from "./api.js";
import { paintCells } from "./canvas_heatmap.js";
import { decodeAttention } from "./payload.js";

export const BLOCK = 256; // bins per side of one tile (the server allows up to 1024)
const CONCURRENT = 3; // tile requests on the wire at once (the server has two cores to share)
const CACHED = 48; // tiles kept: ~256 kB of floats and a 256 kB image each, ~25 MB at most

const runUrl = (runId, route, params) => `api/v1/runs/${encodeURIComponent(runId)}/${route}?${new URLSearchParams(params)}`;

// Where an answer keeps its encoded numbers: an `attention`-like object ({format, shape, data}) or
// the answer's own top-level fields.
function payloadOf(body) {
  for (const field of ["attention", "tile", "data", "values"]) {
    const candidate = body[field];
    if (candidate && typeof candidate === "object" && !Array.isArray(candidate) && candidate.format) return candidate;
  }
  return body;
}

// Any of the API's encodings (json lists, f16 base64, u8 base64 with scale and offset) as float32.
function floatsOf(payload) {
  if (Array.isArray(payload)) return Float32Array.from(payload.flat(3));
  const decoded = decodeAttention(payload);
  if (decoded.values) return decoded.values;
  const offset = payload.offset ?? 0;
  const out = new Float32Array(decoded.bytes.length);
  for (let i = 0; i < out.length; i++) out[i] = decoded.bytes[i] * decoded.scale + offset;
  return out;
}

// Bin edges as absolute token indices: accepted relative to the window's start too.
function absoluteEdges(edges, start, end) {
  if (!edges) return Array.from({ length: end - start + 1 }, (_, i) => start + i);
  return edges[0] === start ? edges : edges.map((e) => e + start);
}

// One window of one head (or of a layer's mean, head "mean"): { q0, q1, k0, k1, nr, nc, values
// (nr × nc), rowEdges (nr + 1), colEdges (nc + 1), pool }. rows/cols omitted: full resolution.
// format: "f16" for pictures, "json" (float32) for a cell's reading.
export async function fetchTile(runId, { layer, head, q0, q1, k0, k1, rows, cols }, signal, format = "f16") {
  const params = { layer, head, q0, q1, k0, k1, format };
  if (rows) Object.assign(params, { rows, cols, pool: "max" });
  const body = await requestJson(runUrl(runId, "tile", params), { signal });
  const payload = payloadOf(body);
  const [nr, nc] = body.shape ?? payload.shape.slice(-2);
  return {
    q0, q1, k0, k1, nr, nc, values: floatsOf(payload), pool: body.pool ?? (rows ? "max" : "none"),
    rowEdges: absoluteEdges(body.row_edges, q0, q1), colEdges: absoluteEdges(body.col_edges, k0, k1),
  };
}

// Every head's pooled thumbnail: { nLayers, nHeads, nr, nc, values (L × H × nr × nc), rowEdges, colEdges }.
export async function fetchOverview(runId, T, signal) {
  const body = await requestJson(runUrl(runId, "overview", { format: "f16" }), { signal });
  const payload = payloadOf(body);
  const [nLayers, nHeads, nr, nc] = body.shape ?? payload.shape;
  return {
    nLayers, nHeads, nr, nc, values: floatsOf(payload),
    rowEdges: absoluteEdges(body.row_edges, 0, T), colEdges: absoluteEdges(body.col_edges, 0, T),
  };
}

// The k largest weights of each query row q0..q1-1 of one head: { n, k, values (n × k), indices (n × k), rest (n) }.
export async function fetchTopk(runId, { layer, head, k, q0, q1 }, signal) {
  const body = await requestJson(runUrl(runId, "topk", { layer, head, k, q0, q1, format: "json" }), { signal });
  const values = floatsOf(body.values);
  const indices = Array.isArray(body.indices) ? Int32Array.from(body.indices.flat()) : Int32Array.from(floatsOf(body.indices));
  return { n: q1 - q0, k: values.length / (q1 - q0), values, indices, rest: floatsOf(body.rest) };
}

// Bins ({ nr, nc, values, rowEdges, colEdges }: a tile, or a head's overview) coloured into
// canvas, one pixel a bin, on the page's scale; a bin whose every cell `mask` (run.js maskRule)
// masks is drawn masked.
export function paintBins(canvas, { nr, nc, values, rowEdges: re, colEdges: ce }, scale, peak, mask) {
  const view = {
    rows: { length: nr }, cols: { length: nc }, values,
    masked: mask.none ? () => false : (i, j) => mask.block(re[i], re[i + 1], ce[j], ce[j + 1]),
  };
  const pixels = paintCells(view, scale, peak, new Uint32Array(nr * nc));
  if (canvas.width !== nc || canvas.height !== nr) {
    canvas.width = nc;
    canvas.height = nr;
  }
  canvas.getContext("2d").putImageData(new ImageData(new Uint8ClampedArray(pixels.buffer), nc, nr), 0, 0);
  return canvas;
}

// The smallest power of two w such that `cells` cells fit `pixels` pixels at w cells a pixel.
export function levelFor(cells, pixels) {
  let w = 1;
  while (cells / w > Math.max(1, pixels)) w *= 2;
  return w;
}

// The tiles of level w that cover the window, nearest the window's centre first (so they arrive in
// that order); those `mask` (run.js maskRule, or null) wholly masks are `masked`, never asked for:
// above a causal diagonal, or wholly behind a sliding window.
export function blocksFor({ q0, q1, k0, k1 }, w, T, mask = null) {
  const span = BLOCK * w;
  const blocks = [];
  for (let bi = Math.floor(q0 / span); bi * span < q1; bi++) {
    for (let bj = Math.floor(k0 / span); bj * span < k1; bj++) {
      const block = { w, q0: bi * span, q1: Math.min(T, (bi + 1) * span), k0: bj * span, k1: Math.min(T, (bj + 1) * span) };
      if (mask?.block(block.q0, block.q1, block.k0, block.k1)) block.masked = true;
      else if (w > 1) Object.assign(block, { rows: Math.ceil((block.q1 - block.q0) / w), cols: Math.ceil((block.k1 - block.k0) / w) });
      blocks.push(block);
    }
  }
  const cq = (q0 + q1) / 2;
  const ck = (k0 + k1) / 2;
  const distance = (b) => Math.abs((b.q0 + b.q1) / 2 - cq) + Math.abs((b.k0 + b.k1) / 2 - ck);
  return blocks.sort((a, b) => distance(a) - distance(b));
}

// Tiles on their way and a small cache of those that came. want() says what the screen needs now:
// requests nobody needs any more are aborted, the rest are queued a few at a time.
export class TileLoader {
  constructor({ fetch, onTile, onError, concurrent = CONCURRENT, cached = CACHED }) {
    this.fetch = fetch; // (spec, signal) -> Promise<tile>
    this.onTile = onTile; // (spec, tile) once a tile is cached
    this.onError = onError;
    this.concurrent = concurrent;
    this.cached = cached;
    this.cache = new Map(); // key -> tile, oldest first
    this.inflight = new Map(); // key -> AbortController
    this.queue = [];
    this.requested = 0; // how many requests left, for the tests and the bench
  }

  get(key) {
    const tile = this.cache.get(key);
    if (tile) {
      this.cache.delete(key);
      this.cache.set(key, tile); // the most recently used last
    }
    return tile;
  }

  get pending() {
    return this.inflight.size + this.queue.length;
  }

  // specs: [{ key, ... }] in the order they are wanted.
  want(specs) {
    const wanted = new Set(specs.map((s) => s.key));
    for (const [key, controller] of this.inflight) {
      if (!wanted.has(key)) {
        controller.abort();
        this.inflight.delete(key);
      }
    }
    this.queue = specs.filter((s) => !this.cache.has(s.key) && !this.inflight.has(s.key));
    this.pump();
  }

  pump() {
    while (this.inflight.size < this.concurrent && this.queue.length) this.start(this.queue.shift());
  }

  start(spec) {
    const controller = new AbortController();
    this.inflight.set(spec.key, controller);
    this.requested++;
    this.fetch(spec, controller.signal).then((tile) => {
      if (this.inflight.get(spec.key) !== controller) return; // aborted meanwhile
      this.inflight.delete(spec.key);
      this.cache.set(spec.key, tile);
      while (this.cache.size > this.cached) this.cache.delete(this.cache.keys().next().value);
      this.onTile(spec, tile);
    }).catch((err) => {
      if (this.inflight.get(spec.key) === controller) this.inflight.delete(spec.key);
      if (err.name !== "AbortError") this.onError?.(err);
    }).finally(() => this.pump());
  }

  clear() {
    for (const controller of this.inflight.values()) controller.abort();
    this.inflight.clear();
    this.queue = [];
    this.cache.clear();
  }
}
