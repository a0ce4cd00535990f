// The head view, in the spirit of BertViz: each query token (left) joined to the keys it attends to
// (right), one colour per head, line weight and opacity by attention.
//
// At T=512 the two token lists are ten thousand pixels tall. Only what the scroll box shows is
// built: the lists hold the tokens in view (plus a margin), the canvas is one screen tall and
// sticks to the view, and a scroll redraws the lines that cross it. Each head's lines are picked
// in a slice of their own (slices.js), so a change of options never holds the page for long.

import { el } from "./dom.js";
import { inSlices } from "./slices.js";
import { palette } from "./theme.js";
import { selectionOf, viewOf } from "./transform.js";

const ROW = 20;
export const BUCKETS = 10; // line weights are drawn in this many widths and opacities, one path each

// Each bucket's lines in one stroke. A hovered token's few lines are drawn stronger, so that even
// small weights can be read.
export function strokeBuckets(ctx, paths, focus) {
  const floor = focus ? 0.45 : 0.15;
  paths.forEach((path, b) => {
    const w = (b + 0.5) / BUCKETS;
    ctx.globalAlpha = Math.min(1, floor + w);
    ctx.lineWidth = (focus ? 1 : 0.5) + 3.5 * w;
    ctx.stroke(path);
  });
}
const MIN_DRAWN = 0.02; // fainter lines only add noise...
const TOP_PER_TOKEN = 3; // ...but each token keeps its strongest lines, so broad heads at long T still show
const MARGIN_ROWS = 30; // tokens built beyond each edge of the view, so a short scroll shows no gap
const MAX_LABEL_CH = 16;

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

// The lines of one head's view: flat [row, col, bucket, …] of every weight worth drawing.
function linesOf(view) {
  const nCols = view.cols.length;
  const lines = [];
  for (let r = 0; r < view.rows.length; r++) {
    const floor = Math.min(MIN_DRAWN, topWeight(view, r, TOP_PER_TOKEN));
    for (let c = 0; c < nCols; c++) {
      const w = view.values[r * nCols + c];
      if (w < floor || w <= 0 || view.masked(r, c)) continue;
      lines.push(r, c, Math.min(BUCKETS - 1, Math.floor(w * BUCKETS)));
    }
  }
  return lines;
}

// One side's token list, built for a window of its items only; the list keeps its full height so
// that the scroll box scrolls as if every item were there.
class TokenList {
  constructor(side, onHover) {
    this.side = side;
    this.node = el("ol", { className: `hv-tokens hv-${side}`, attrs: { "aria-label": side === "left" ? "Query tokens" : "Key tokens" } });
    this.node.addEventListener("mouseover", (event) => {
      const item = event.target.closest("li");
      if (item) onHover(Number(item.dataset.index));
    });
    this.node.addEventListener("mouseleave", () => onHover(null));
    // The keyboard's hover: one Tab stop per list (the last token focused), ↑ ↓ to walk it; a
    // focused token isolates its lines as a hovered one does.
    this.stop = 0;
    this.node.addEventListener("focusin", (event) => {
      const item = event.target.closest("li");
      if (!item) return;
      this.stop = Number(item.dataset.index);
      onHover(this.stop);
    });
    this.node.addEventListener("focusout", (event) => {
      if (!this.node.contains(event.relatedTarget)) onHover(null);
    });
    this.node.addEventListener("keydown", (event) => {
      const item = event.target.closest("li");
      const step = { ArrowDown: 1, ArrowUp: -1, PageDown: 10, PageUp: -10 }[event.key];
      if (!item || !step) return;
      event.preventDefault();
      // Built items reach MARGIN_ROWS beyond the view, so a step of 10 always lands on one.
      const next = Math.max(0, Math.min(this.indices.length - 1, Number(item.dataset.index) + step));
      this.node.querySelector(`li[data-index="${next}"]`)?.focus();
    });
    this.window = [0, 0];
  }

  setTokens(indices, labels, titles, special) {
    Object.assign(this, { indices, labels, titles, special });
    this.window = [0, 0];
    this.stop = 0;
    this.node.replaceChildren();
    this.node.style.height = `${indices.length * ROW}px`;
    // A fixed width from the longest label: the built window changes while scrolling, the column must not.
    const longest = indices.reduce((n, t) => Math.max(n, [...labels[t]].length), 1);
    this.node.style.minWidth = `calc(${Math.min(MAX_LABEL_CH, longest) + 1}ch + 12px)`;
  }

  // Builds items [from, to) (clamped), reusing those already built; `from` is MARGIN_ROWS above
  // the first row in view.
  show(from, to, active) {
    const firstInView = from + MARGIN_ROWS;
    from = Math.max(0, from);
    to = Math.min(this.indices.length, to);
    if (from !== this.window[0] || to !== this.window[1]) {
      // Re-inserting an item detaches it, which drops keyboard focus: it is given back below.
      const focused = this.node.contains(document.activeElement) ? document.activeElement : null;
      const built = new Map([...this.node.children].map((item) => [Number(item.dataset.index), item]));
      const items = [];
      for (let i = from; i < to; i++) items.push(built.get(i) ?? this.item(i));
      this.node.style.paddingTop = `${from * ROW}px`;
      this.node.replaceChildren(...items);
      this.window = [from, to];
      if (focused?.isConnected) focused.focus({ preventScroll: true });
    }
    // The Tab stop is the last token focused while it is built, else the first one in view.
    const stop = this.stop >= from && this.stop < to ? this.stop : Math.max(from, Math.min(to - 1, firstInView));
    for (const item of this.node.children) {
      const index = Number(item.dataset.index);
      item.classList.toggle("active", index === active);
      item.tabIndex = index === stop ? 0 : -1;
    }
  }

  item(i) {
    const t = this.indices[i];
    const item = el("li", { text: this.labels[t], attrs: { "data-index": i, title: this.titles[t], "aria-posinset": i + 1, "aria-setsize": this.indices.length } });
    if (this.special[t]) item.classList.add("special");
    return item;
  }
}

export class HeadView {
  constructor(container) {
    this.container = container;
    this.key = null;
    this.drawings = []; // [{ lines, color }], one per head drawn, once its lines are picked
    this.focus = null; // { axis: "row" | "col", index } while a token is hovered
    this.left = new TokenList("left", (index) => this.hover("row", index));
    this.right = new TokenList("right", (index) => this.hover("col", index));
    this.canvas = el("canvas", { className: "hv-canvas", attrs: { "aria-hidden": "true" } });
    this.lines = el("div", { className: "hv-lines" }, [this.canvas]);
    this.body = el("div", { className: "hv-body" }, [this.left.node, this.lines, this.right.node]);
    this.frame = 0;
    container.addEventListener("scroll", () => this.soon(), { passive: true });
  }

  // tokens and options as for viewOf; heads: [{ matrix, color }]; labels: what each token is
  // called; titles: what a hover says about it (its original span). key: the same key as the last
  // call's means nothing changed, and nothing is done.
  render({ key, tokens, options, heads, labels, titles, special }) {
    if (key === this.key && this.container.contains(this.body)) return Promise.resolve(false);
    this.key = key;
    this.container.style.minHeight = "";
    const { rows, cols } = selectionOf(tokens, options);
    const same = (a, b) => a && a.length === b.length && a.every((v, i) => v === b[i]);
    if (!this.container.contains(this.body) || this.labels !== labels || !same(this.left.indices, rows) || !same(this.right.indices, cols)) {
      this.labels = labels;
      this.left.setTokens(rows, labels, titles, special);
      this.right.setTokens(cols, labels, titles, special);
      this.height = Math.max(rows.length, cols.length) * ROW;
      this.lines.style.height = `${this.height}px`;
      if (!this.container.contains(this.body)) this.container.replaceChildren(this.body);
      this.showTokens();
    }
    // Each head's view and lines in a slice of its own; what is on screen stays until all are picked.
    const drawings = [];
    const jobs = heads.map(({ matrix, color }) => () => drawings.push({ lines: linesOf(viewOf(matrix, tokens, options)), color }));
    return inSlices(jobs, () => this.key !== key).then((done) => {
      if (!done) return false;
      this.drawings = drawings;
      this.canvas.dataset.lines = drawings.reduce((n, d) => n + d.lines.length / 3, 0); // read by the tests: a blank head view is a bug
      this.draw();
      return true;
    });
  }

  // A word in place of the lines (none to draw, or not yet); the next render builds the view again.
  clear(message) {
    this.key = null;
    this.drawings = [];
    this.container.replaceChildren(el("p", { className: "empty", text: message }));
  }

  // A new run's room, held from the moment it is shown: the view is drawn after a pause
  // (main.js), and growing then from its last size (a one-line placeholder, a short run) pushed
  // everything under it down by up to 510 px, the measures panel too, which had already judged
  // from the old layout whether it was on screen. Given back by render().
  reserve(tokens, options) {
    const { rows, cols } = selectionOf(tokens, options);
    const style = getComputedStyle(this.container);
    const frame = this.container.offsetHeight - this.container.clientHeight + parseFloat(style.paddingTop);
    const cap = parseFloat(style.maxHeight) || Infinity; // min-height would win over max-height
    this.container.style.minHeight = `${Math.min(cap, Math.max(rows.length, cols.length) * ROW + frame)}px`;
  }

  // The rows (in content pixels) the scroll box shows now.
  band() {
    const view = this.container.clientHeight || 560;
    const top = Math.max(0, this.container.getBoundingClientRect().top - this.body.getBoundingClientRect().top);
    return [top, Math.min(this.height, top + view)];
  }

  showTokens() {
    const [top, bottom] = this.band();
    const from = Math.floor(top / ROW) - MARGIN_ROWS;
    const to = Math.ceil(bottom / ROW) + MARGIN_ROWS;
    this.left.show(from, to, this.focus?.axis === "row" ? this.focus.index : -1);
    this.right.show(from, to, this.focus?.axis === "col" ? this.focus.index : -1);
  }

  soon() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      if (!this.container.contains(this.body)) return;
      this.showTokens();
      this.draw();
    });
  }

  hover(axis, index) {
    this.focus = index === null ? null : { axis, index };
    this.showTokens();
    this.draw();
  }

  // The lines that cross the rows in view, on a canvas one view tall that sticks to it.
  draw() {
    const pal = palette();
    const focus = this.focus;
    const [top, bottom] = this.band();
    const height = Math.max(1, bottom - top);
    const width = this.lines.clientWidth || 240;
    const ratio = window.devicePixelRatio || 1;
    const canvas = this.canvas;
    // Resizing a canvas reallocates it: only when the size changes.
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
      canvas.style.height = `${height}px`;
    }
    // Where the sticky canvas really sits (the scroll box's padding and the list's end move it).
    const offset = canvas.getBoundingClientRect().top - this.body.getBoundingClientRect().top;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.setTransform(ratio, 0, 0, ratio, 0, -offset * ratio);
    ctx.lineCap = "round";
    const y = (i) => i * ROW + ROW / 2;
    for (const { lines, color } of this.drawings) {
      // Bucketed by weight: ten paths per head instead of one stroke per line.
      const paths = Array.from({ length: BUCKETS }, () => new Path2D());
      for (let i = 0; i < lines.length; i += 3) {
        const r = lines[i];
        const c = lines[i + 1];
        if (focus && (focus.axis === "row" ? r : c) !== focus.index) continue;
        const y0 = y(r);
        const y1 = y(c);
        if (Math.max(y0, y1) < offset - ROW || Math.min(y0, y1) > offset + height + ROW) continue;
        const path = paths[lines[i + 2]];
        path.moveTo(0, y0);
        path.lineTo(width, y1);
      }
      ctx.strokeStyle = color || pal.heads[0];
      strokeBuckets(ctx, paths, focus);
    }
  }
}
