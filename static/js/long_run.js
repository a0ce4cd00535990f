// A long run (issue 10) as the page sees it: the answer said `kept: "qk"`, so there is no tensor to
// hold. The grid paints the server's per-head overview thumbnails, the focus asks for tiles
// (long_focus.js), the head view for top-k rows (long_headview.js), and every control that needs
// the dense weights says on screen why it is off.

import { $, el } from "./dom.js";
import { layerMask, maskWords, runHeader } from "./run.js";
import { fetchOverview, paintBins } from "./tiles.js";

// The run object main.js passes around, with no layers to fetch.
export class LongRun {
  constructor(response, slidingWindows = []) {
    Object.assign(this, runHeader(response, slidingWindows));
    this.long = true;
    this.layerBytes = [];
    this.overview = null; // a promise of fetchOverview's answer
  }

  hasLayer() {
    return false;
  }

  isPrecise() {
    return false;
  }

  // A cell of a head: none is held (a picked cell's ranking waits for the server's /cell).
  weightAt() {
    return null;
  }

  // One head's overview as a tile over the whole run, and its peak (max pooling keeps the head's max).
  async base(layer, head) {
    const o = await this.overview;
    const cells = o.nr * o.nc;
    const start = (layer * o.nHeads + head) * cells;
    const values = o.values.subarray(start, start + cells);
    let peak = 0;
    for (const v of values) if (v > peak) peak = v;
    const tile = { q0: 0, q1: this.T, k0: 0, k1: this.T, nr: o.nr, nc: o.nc, values, rowEdges: o.rowEdges, colEdges: o.colEdges, pool: "max" };
    return { tile, peak };
  }
}

export function openLongRun(run, signal) {
  run.overview = fetchOverview(run.runId, run.T, signal);
  run.overview.catch(() => {}); // the views that await it report the failure
  return run.overview;
}

// Every thumbnail of the grid from the overview, each head on its own peak (or the page's scale).
export async function paintOverview(grid, run, scale) {
  const o = await run.overview;
  if (grid.run !== run) return;
  const cells = o.nr * o.nc;
  for (let l = 0; l < run.nLayers; l++) {
    for (let h = 0; h < run.nHeads; h++) {
      const start = (l * o.nHeads + h) * cells;
      const values = o.values.subarray(start, start + cells);
      let peak = 0;
      for (const v of values) if (v > peak) peak = v;
      const button = grid.cells[l][h];
      paintBins(button.firstChild, { ...o, values }, scale, peak, layerMask(run, l));
      button.classList.remove("loading");
    }
    grid.painted.add(l);
  }
}

// What needs the dense weights, and the words that say so.
const NEEDS_WEIGHTS = ["hide-special", "hide-first", "threshold", "segments", "download-csv", "download-json", "export-page"];

function note(id, parent, text) {
  let node = $(id);
  if (!node && !text) return; // a short run: nothing to say, nothing added
  if (!node) {
    node = el("p", { className: "hint long-note", attrs: { id, role: "note" } });
    const heading = parent.querySelector(":scope > h2");
    if (heading) heading.after(node);
    else parent.prepend(node);
  }
  node.textContent = text;
  node.hidden = !text;
}

// Switches the controls for a long run (run.long) or back for a short one; returns the aggregate
// to show (the mean of all heads has no tile route, so a long run shows its layer's mean instead).
export function longControls(run, aggregate) {
  const long = Boolean(run.long);
  const why = long
    ? `This run has ${run.T} tokens: the server keeps its queries and keys, not its ${run.nLayers} × ${run.nHeads} × ${run.T} × ${run.T} weights, and computes what is on screen.`
    : "";
  for (const id of NEEDS_WEIGHTS) {
    const control = $(id);
    if (!control) continue;
    if (long) {
      if (control.dataset.longOff === undefined) control.dataset.longOff = control.getAttribute("title") ?? "";
      control.disabled = true;
      control.title = "Off for long runs: it needs every weight of the run.";
    } else if (control.dataset.longOff !== undefined) {
      const title = control.dataset.longOff; // the control's own title, kept while it was off
      delete control.dataset.longOff;
      control.disabled = id === "segments" ? !run.hasPair : false;
      if (title) control.title = title;
      else control.removeAttribute("title");
    }
  }
  const all = $("aggregate").querySelector('option[value="all"]');
  all.disabled = long;
  all.textContent = long ? "Mean of all heads (off for long runs)" : "Mean of all heads";
  note("long-note", $("controls").querySelector(".controls-body"), long
    ? `${why} Hiding special or first tokens, the threshold, pair blocks, the mean of all heads and the CSV, JSON and page exports need every weight and are off. Zoom into the heatmap for single cells.`
    : "");
  // Measures and experiments need every weight of the run: not at this length. Their panels stay,
  // with the reason in place of their contents.
  const measures = $("measures");
  if (long) measures.hidden = false;
  for (const child of measures.children) {
    if (child.tagName === "H2" || child.id === "measures-long-note") continue;
    // A style, not `hidden`: the stylesheet's display rules would win over the attribute.
    if (long) {
      child.style.display = "none";
      child.dataset.longOff = "true";
    } else if (child.dataset.longOff) {
      child.style.display = "";
      delete child.dataset.longOff;
    }
  }
  note("measures-long-note", measures, long
    ? `${why} Rollout, value norms, contributions, the head finder, information flow, the neuron view and logit attribution need every weight: off for this run.`
    : "");
  const experiments = ["ablate-box", "token-box", "compare-box"].map($).filter(Boolean);
  experiments.forEach((box) => {
    box.toggleAttribute("inert", long);
    box.style.opacity = long ? "0.5" : "";
  });
  note("experiments-long-note", $("experiments"), long
    ? `${why} Ablation, token masking and comparison need the dense weights: off for this run. Generation still works.`
    : "");
  return long && aggregate === "all" ? "layer" : aggregate;
}

// `win`, the window in view ({ q0, q1, k0, k1 }): zoomed in, the axes show tokens and no
// position, and after a pan nothing on screen said where in the run the view was.
export function longCaption(run, layer, scale, win = null) {
  const parts = [`${run.T} tokens${run.truncated ? " (cut to fit)" : ""}`, `model ${run.model}`];
  if (win && (win.q1 - win.q0 < run.T || win.k1 - win.k0 < run.T)) {
    parts.push(`in view: queries ${win.q0}–${win.q1 - 1} × keys ${win.k0}–${win.k1 - 1}`);
  }
  parts.push(maskWords(run, layerMask(run, layer)));
  parts.push("long run: the server computes the cells in view; zoomed out, a pixel shows the largest weight of the cells it covers");
  if (scale === "fixed") parts.push("colour: fixed 0–1");
  if (scale === "log") parts.push("colour: log scale");
  return parts.join(" · ");
}
