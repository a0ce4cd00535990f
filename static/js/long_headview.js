// The head view of a long run (issue 10): the rows in view on the heatmap (at most QUERIES of them)
// joined to their strongest keys, which may lie thousands of tokens away. Each row's lines come
// from the server's top-k route, never from the weights: the keys column lists only the keys some
// line reaches, in order, with the gaps between them counted.

import { el } from "./dom.js";
import { BUCKETS, strokeBuckets } from "./headview.js";
import { palette } from "./theme.js";
import { fetchTopk } from "./tiles.js";

export const QUERIES = 64;
const K = 8; // asked per row; drawn: the 3 strongest, and the others at 0.02 or more (as HeadView)
const TOP_PER_TOKEN = 3;
const MIN_DRAWN = 0.02;
const ROW = 20;

export class LongHeadView {
  constructor(container) {
    this.container = container;
    this.controller = null;
  }

  // heads: [{ head, color }]; q0..q1: the query rows shown; labels/titles/special: per token.
  async render({ run, layer, heads, q0, q1, labels, titles, special }) {
    // A pan along the keys keeps the rows: the lines stay as they are.
    const key = JSON.stringify([run.runId, layer, heads, q0, q1]);
    if (key === this.key && labels === this.labels && this.container.contains(this.canvas)) {
      this.draw(null);
      return true;
    }
    this.key = null;
    this.controller?.abort();
    const controller = (this.controller = new AbortController());
    let rows;
    try {
      rows = await Promise.all(heads.map(({ head }) => fetchTopk(run.runId, { layer, head, k: Math.min(K, run.T), q0, q1 }, controller.signal)));
    } catch (err) {
      if (err.name === "AbortError") return false;
      // The last rows' lines and caption stayed, describing rows the heatmap no longer showed (the
      // server gone): say these could not be read. The page's banner says why.
      this.key = null;
      this.container.replaceChildren(el("p", { className: "empty", text: `The strongest keys of queries ${q0}–${q1 - 1} could not be read.` }));
      throw err;
    }
    if (controller !== this.controller) return false;
    // The lines each head draws: [query row, key, weight].
    this.lines = rows.map((topk) => {
      const lines = [];
      for (let i = 0; i < topk.n; i++) {
        for (let j = 0; j < topk.k; j++) {
          const w = topk.values[i * topk.k + j];
          if (w > 0 && (j < TOP_PER_TOKEN || w >= MIN_DRAWN)) lines.push([i, topk.indices[i * topk.k + j], w]);
        }
      }
      return lines;
    });
    this.colors = heads.map((h) => h.color);
    const keys = [...new Set(this.lines.flatMap((lines) => lines.map((l) => l[1])))].sort((a, b) => a - b);
    // The keys' column: each key reached, and a marker for each run of tokens skipped between them.
    this.keyRow = new Map();
    const right = [];
    keys.forEach((key, i) => {
      const skipped = key - (i ? keys[i - 1] + 1 : 0);
      if (skipped > 0) right.push(el("li", { className: "hv-gap", text: `⋯ ${skipped} token${skipped > 1 ? "s" : ""}` }));
      this.keyRow.set(key, right.length);
      const item = el("li", { text: labels[key], attrs: { "data-index": key, title: `${key}: ${titles[key]}` } });
      if (special[key]) item.classList.add("special");
      right.push(item);
    });
    const left = [];
    for (let q = q0; q < q1; q++) {
      const item = el("li", { text: labels[q], attrs: { "data-index": q, title: `${q}: ${titles[q]}` } });
      if (special[q]) item.classList.add("special");
      left.push(item);
    }
    this.q0 = q0;
    this.left = el("ol", { className: "hv-tokens hv-left", attrs: { "aria-label": "Query tokens" } }, left);
    this.right = el("ol", { className: "hv-tokens hv-right", attrs: { "aria-label": "Key tokens" } }, right);
    this.canvas = el("canvas", { className: "hv-canvas", attrs: { "aria-hidden": "true" } });
    this.height = Math.max(left.length, right.length) * ROW;
    const note = el("p", {
      className: "hint hv-window",
      text: `Queries ${q0}–${q1 - 1} of ${run.T}: ${q1 - q0 < QUERIES ? `the ${q1 - q0} rows` : `the first ${QUERIES} rows`} in view on the heatmap (zoom there to choose others). Each row's strongest keys, any distance away.`,
    });
    this.container.replaceChildren(note, el("div", { className: "hv-body" }, [this.left, this.canvas, this.right]));
    this.hook(this.left, "query");
    this.hook(this.right, "key");
    this.draw(null);
    this.key = key;
    this.labels = labels;
    return true;
  }

  hook(list, axis) {
    list.addEventListener("mouseover", (event) => {
      const item = event.target.closest("li[data-index]");
      if (item) this.draw({ axis, index: Number(item.dataset.index) });
    });
    list.addEventListener("mouseleave", () => this.draw(null));
    // The keyboard's hover, as the short head view's (headview.js): one Tab stop a list (the last
    // token focused), ↑ ↓ (PageUp, PageDown by 10) to walk its tokens, not its gap markers.
    const tokens = [...list.querySelectorAll("li[data-index]")];
    tokens.forEach((item, i) => { item.tabIndex = i ? -1 : 0; });
    list.addEventListener("focusin", (event) => {
      const item = event.target.closest("li[data-index]");
      if (!item) return;
      for (const other of tokens) other.tabIndex = other === item ? 0 : -1;
      this.draw({ axis, index: Number(item.dataset.index) });
    });
    list.addEventListener("focusout", (event) => {
      if (!list.contains(event.relatedTarget)) this.draw(null);
    });
    list.addEventListener("keydown", (event) => {
      const at = tokens.indexOf(event.target.closest("li[data-index]"));
      const step = { ArrowDown: 1, ArrowUp: -1, PageDown: 10, PageUp: -10 }[event.key];
      if (at < 0 || !step) return;
      event.preventDefault();
      tokens[Math.max(0, Math.min(tokens.length - 1, at + step))].focus();
    });
  }

  draw(focus) {
    const pal = palette();
    const width = this.canvas.clientWidth || 240;
    const ratio = window.devicePixelRatio || 1;
    this.canvas.width = width * ratio;
    this.canvas.height = this.height * ratio;
    this.canvas.style.height = `${this.height}px`;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.lineCap = "round";
    for (const item of this.left.children) item.classList.toggle("active", focus?.axis === "query" && Number(item.dataset.index) === focus.index);
    for (const item of this.right.children) item.classList.toggle("active", focus?.axis === "key" && Number(item.dataset.index) === focus.index);
    let count = 0;
    this.lines.forEach((lines, h) => {
      const paths = Array.from({ length: BUCKETS }, () => new Path2D());
      for (const [i, key, w] of lines) {
        if (focus?.axis === "query" && focus.index !== this.q0 + i) continue;
        if (focus?.axis === "key" && focus.index !== key) continue;
        count++;
        const path = paths[Math.min(BUCKETS - 1, Math.floor(w * BUCKETS))];
        path.moveTo(0, i * ROW + ROW / 2);
        path.lineTo(width, this.keyRow.get(key) * ROW + ROW / 2);
      }
      ctx.strokeStyle = this.colors[h] || pal.heads[0];
      strokeBuckets(ctx, paths, focus);
    });
    this.canvas.dataset.lines = count;
  }

  cancel() {
    this.controller?.abort();
    this.controller = null;
  }
}
