// The head view, in the spirit of BertViz: each query token (left) joined to the keys it attends to
// (right), one colour per head, line weight and opacity by attention.

import { el } from "./dom.js";
import { palette } from "./theme.js";

const ROW = 20;
const BUCKETS = 10;
const MIN_DRAWN = 0.02; // fainter lines only add noise...
const TOP_PER_TOKEN = 3; // ...but each token keeps its strongest lines, so broad heads at long T still show

// The k-th largest unmasked weight of row r (0 when the row has fewer).
function topWeight(view, r, k) {
  const nCols = view.cols.length;
  const best = new Array(k).fill(0);
  for (let c = 0; c < nCols; c++) {
    const w = view.values[r * nCols + c];
    if (w <= best[k - 1] || view.masked(r, c)) continue;
    let i = k - 1;
    while (i > 0 && best[i - 1] < w) {
      best[i] = best[i - 1];
      i--;
    }
    best[i] = w;
  }
  return best[k - 1];
}

export class HeadView {
  constructor(container) {
    this.container = container;
    this.drawings = null; // [{ view, color }], one per head drawn
  }

  // labels: what each token is called; titles: what a hover says about it (its original span).
  render(labels, titles, special, drawings) {
    this.drawings = drawings;
    const { rows, cols } = drawings[0].view;
    // Stepping through heads keeps the tokens: only the lines are drawn again (at T=512 the two
    // lists hold a thousand items).
    const same = (a, b) => a && a.length === b.length && a.every((v, i) => v === b[i]);
    if (this.tokens && this.tokens.labels === labels && this.container.contains(this.canvas) && same(this.tokens.rows, rows) && same(this.tokens.cols, cols)) {
      this.draw(null);
      return;
    }
    this.tokens = { labels, rows, cols };
    const tokenList = (indices, side) => el("ol", { className: `hv-tokens hv-${side}`, attrs: { "aria-label": side === "left" ? "Query tokens" : "Key tokens" } },
      indices.map((t, i) => {
        const item = el("li", { text: labels[t], attrs: { "data-index": i, title: titles[t] } });
        if (special[t]) item.classList.add("special");
        return item;
      }));
    this.left = tokenList(rows, "left");
    this.right = tokenList(cols, "right");
    this.canvas = el("canvas", { className: "hv-canvas", attrs: { "aria-hidden": "true" } });
    const body = el("div", { className: "hv-body" }, [this.left, this.canvas, this.right]);
    this.container.replaceChildren(body);
    this.height = Math.max(rows.length, cols.length) * ROW;
    this.hook(this.left, "row");
    this.hook(this.right, "col");
    // The lines in the next frame: at T=512 the lists and the lines are two long pieces of work,
    // and one frame holding both would freeze the page for longer.
    const drawings0 = drawings;
    requestAnimationFrame(() => this.drawings === drawings0 && this.draw(null));
  }

  hook(list, axis) {
    list.addEventListener("mouseover", (event) => {
      const item = event.target.closest("li");
      if (item) this.draw({ axis, index: Number(item.dataset.index) });
    });
    list.addEventListener("mouseleave", () => this.draw(null));
  }

  draw(focus) {
    const pal = palette();
    const width = this.canvas.clientWidth || 240;
    const ratio = window.devicePixelRatio || 1;
    const ctx = this.canvas.getContext("2d");
    // Resizing a canvas reallocates it (at T=512 ten thousand pixels tall): only when the size changes.
    if (this.canvas.width !== width * ratio || this.canvas.height !== this.height * ratio) {
      this.canvas.width = width * ratio;
      this.canvas.height = this.height * ratio;
      this.canvas.style.height = `${this.height}px`;
    } else {
      ctx.setTransform(1, 0, 0, 1, 0, 0);
      ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    }
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.lineCap = "round";
    for (const item of this.left.children) item.classList.toggle("active", focus?.axis === "row" && Number(item.dataset.index) === focus.index);
    for (const item of this.right.children) item.classList.toggle("active", focus?.axis === "col" && Number(item.dataset.index) === focus.index);
    let lines = 0;
    for (const { view, color } of this.drawings) {
      const nCols = view.cols.length;
      // Bucketed by weight: ten paths per head instead of one stroke per line.
      const paths = Array.from({ length: BUCKETS }, () => new Path2D());
      for (let r = 0; r < view.rows.length; r++) {
        if (focus?.axis === "row" && focus.index !== r) continue;
        const floor = Math.min(MIN_DRAWN, topWeight(view, r, TOP_PER_TOKEN));
        for (let c = 0; c < nCols; c++) {
          if (focus?.axis === "col" && focus.index !== c) continue;
          const w = view.values[r * nCols + c];
          if (w < floor || w <= 0 || view.masked(r, c)) continue;
          const path = paths[Math.min(BUCKETS - 1, Math.floor(w * BUCKETS))];
          lines++;
          path.moveTo(0, r * ROW + ROW / 2);
          path.lineTo(width, c * ROW + ROW / 2);
        }
      }
      ctx.strokeStyle = color || pal.heads[0];
      // A hovered token's few lines are drawn stronger, so that even small weights can be read.
      const floor = focus ? 0.45 : 0.15;
      paths.forEach((path, b) => {
        const w = (b + 0.5) / BUCKETS;
        ctx.globalAlpha = Math.min(1, floor + w);
        ctx.lineWidth = (focus ? 1 : 0.5) + 3.5 * w;
        ctx.stroke(path);
      });
    }
    this.canvas.dataset.lines = lines; // read by the tests: a blank head view is a bug
  }
}
