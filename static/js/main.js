// Wires the page: input → API → run data → focus heatmap, model grid and head view, plus the permalink.
// Performance marks (manyeyes:submit, :response, :first-heatmap, :grid-painted) feed bench/ui_bench.py.

import { describeError, fetchSlice, listModels, postAttention } from "./api.js";
import { $, el, fillSelect, nextFrame } from "./dom.js";
import { downloadCsv, downloadJson } from "./download.js";
import { FocusView } from "./focus.js";
import { GridView } from "./grid.js";
import { HeadView } from "./headview.js";
import { readPermalink, writePermalink } from "./permalink.js";
import { AttentionRun } from "./run.js";
import { onThemeChange, palette } from "./theme.js";
import { viewOf } from "./transform.js";

// Above this many bytes of u8 attention, the first request asks only for the focused layer and the
// grid fetches the others as they come into view. Token counts are guessed at ~4 characters each.
const EAGER_BYTES = 4e6;
const guessTokens = (chars) => Math.ceil(chars / 4) + 3;

const state = {
  models: [],
  run: null,
  request: null, // the POST body of the current run, to re-post when the server has evicted it
  controller: null,
  layer: 0,
  head: 0,
  headSet: new Set([0]),
  aggregate: "head",
  hideSpecial: false,
  threshold: 0,
  segments: "all",
  pending: new Set(), // u8 layers and "f16:layer:head" slices being fetched
  marks: new Set(),
  renderToken: 0,
};

const focus = new FocusView($("focus-plot"), $("tooltip"));
const grid = new GridView($("grid"), {
  onSelect: (l, h) => {
    state.aggregate = "head";
    setFocus(l, h);
  },
  onNeedLayers: (layers) => loadLayers(layers),
});
const headView = new HeadView($("headview"));

function mark(name) {
  if (state.marks.has(name)) return;
  state.marks.add(name);
  performance.mark(`manyeyes:${name}`);
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function setBusy(busy) {
  $("busy").hidden = !busy;
  $("run").disabled = busy;
  $("run-form").setAttribute("aria-busy", String(busy));
}

function viewOptions() {
  return { hideSpecial: state.hideSpecial, threshold: state.threshold, segments: state.segments, causal: state.run.causal };
}

function modelInfo(id) {
  return state.models.find((m) => m.id === id) || state.models.find((m) => m.default) || state.models[0];
}

function clamp(n, max) {
  return Math.min(Math.max(n ?? 0, 0), max - 1);
}

// ---- data -------------------------------------------------------------------------------------

async function loadLayers(layers, heads = null, format = "u8") {
  const run = state.run;
  const pending = state.pending; // this run's own: a newer run gets a fresh set
  const keys = format === "u8" ? layers : layers.flatMap((l) => heads.map((h) => `${format}:${l}:${h}`));
  const wanted = format === "u8" ? layers.filter((l) => !run.hasLayer(l) && !pending.has(l)) : layers;
  if (!wanted.length || keys.some((k) => format !== "u8" && pending.has(k))) return;
  keys.forEach((k) => pending.add(k));
  try {
    let slice;
    try {
      slice = await fetchSlice(run.runId, wanted, heads, format, state.controller.signal);
    } catch (err) {
      if (err.status !== 404) throw err;
      // The server's cache dropped this run: the same request recomputes it.
      slice = await postAttention({ ...state.request, layers: wanted, heads: heads ?? undefined, format }, state.controller.signal);
      run.runId = slice.run_id;
    }
    if (state.run !== run) return;
    run.ingest(slice);
  } catch (err) {
    if (err.name !== "AbortError" && state.run === run) showError(describeError(err));
    return;
  } finally {
    keys.forEach((k) => pending.delete(k));
  }
  if (format === "u8") afterLayersArrived(wanted);
  else if (state.aggregate === "head" && wanted.includes(state.layer) && heads.includes(state.head)) {
    renderViews({ headView: false });
  } else {
    refineFocus(); // the focus moved on while these values were on their way
  }
}

// Exact (float16) values for the focused head, once no layer is on its way: until then the u8
// heatmap is as good to look at, and the grid's layers matter more.
function refineFocus() {
  const run = state.run;
  if (!run || state.aggregate !== "head" || run.isPrecise(state.layer, state.head) || state.pending.size) return;
  loadLayers([state.layer], [state.head], "f16");
}

function afterLayersArrived(layers) {
  const options = viewOptions();
  layers.forEach((l) => grid.paintLayer(l, options));
  if (grid.complete) nextFrame().then(() => mark("grid-painted"));
  if (state.aggregate === "all" || layers.includes(state.layer)) renderViews();
  else refineFocus();
}

// ---- rendering --------------------------------------------------------------------------------

function focusMatrix() {
  const run = state.run;
  if (state.aggregate === "all") return run.mean([...Array(run.nLayers).keys()]);
  if (state.aggregate === "layer") return run.mean([state.layer]);
  return run.head(state.layer, state.head);
}

function focusTitle() {
  const run = state.run;
  if (state.aggregate === "all") return `Mean of all ${run.nLayers * run.nHeads} heads`;
  if (state.aggregate === "layer") return `Layer ${state.layer}, mean of its ${run.nHeads} heads`;
  return `Layer ${state.layer}, head ${state.head}`;
}

function fileStem() {
  const what = state.aggregate === "all" ? "mean-all" : state.aggregate === "layer" ? `L${state.layer}-mean` : `L${state.layer}-H${state.head}`;
  return `manyeyes-${state.run.model}-${what}`;
}

async function renderViews({ headView = true } = {}) {
  const run = state.run;
  const token = ++state.renderToken;
  const plot = $("focus-plot");
  const matrix = focusMatrix();
  if (!matrix) {
    $("focus-caption").textContent = "Loading these layers…";
    const missing = state.aggregate === "all" ? run.missingLayers() : [state.layer];
    loadLayers(missing);
    return;
  }
  const view = viewOf(matrix, run.tokens, viewOptions());
  const precise = state.aggregate === "head" && run.isPrecise(state.layer, state.head);
  await focus.render({ view, tokens: run.tokens, title: focusTitle(), filename: fileStem() });
  if (token !== state.renderToken) return;
  plot.dataset.layer = state.layer;
  plot.dataset.head = state.head;
  plot.dataset.aggregate = state.aggregate;
  plot.dataset.precision = precise ? "f16" : "u8";
  plot.setAttribute("aria-label", `${focusTitle()}: attention heatmap, queries on rows, keys on columns. Arrow keys step through heads and layers.`);
  $("focus-caption").textContent = caption(run);
  await nextFrame();
  mark("first-heatmap");
  // The head view is secondary: draw it after the heatmap has reached the screen.
  if (headView) setTimeout(() => token === state.renderToken && renderHeadView(), 0);
  if (!precise) refineFocus();
}

function caption(run) {
  const parts = [`${run.T} tokens${run.truncated ? " (cut to fit)" : ""}`, `model ${run.model}`];
  parts.push(run.causal ? "causal: grey cells are masked, a token cannot see ahead" : "bidirectional");
  if (state.hideSpecial) parts.push("special tokens hidden, rows renormalised");
  if (state.threshold > 0) parts.push(`weights under ${state.threshold.toFixed(2)} shown as 0`);
  return parts.join(" · ");
}

function renderHeadView() {
  const run = state.run;
  const options = viewOptions();
  const pal = palette();
  const matrices = state.aggregate === "head"
    ? [...state.headSet].sort((a, b) => a - b).map((h) => ({ matrix: run.head(state.layer, h), color: pal.heads[h % pal.heads.length] }))
    : [{ matrix: focusMatrix(), color: pal.heads[0] }];
  const drawings = matrices.filter((m) => m.matrix).map(({ matrix, color }) => ({ view: viewOf(matrix, run.tokens, options), color }));
  if (!drawings.length) return;
  headView.render(run.tokens, drawings);
  renderHeadChips();
}

function renderHeadChips() {
  const run = state.run;
  const fieldset = $("headview-heads");
  const pal = palette();
  const chips = [el("legend", { text: "Heads drawn" })];
  for (let h = 0; h < run.nHeads; h++) {
    const box = el("input", { attrs: { type: "checkbox", id: `hv-head-${h}` } });
    box.checked = state.headSet.has(h);
    box.disabled = state.aggregate !== "head";
    box.addEventListener("change", () => {
      if (box.checked) state.headSet.add(h);
      else if (state.headSet.size > 1) state.headSet.delete(h);
      else box.checked = true; // at least one head stays drawn
      renderHeadView();
    });
    const swatch = el("span", { className: "swatch", attrs: { "aria-hidden": "true" } });
    swatch.style.background = pal.heads[h % pal.heads.length];
    chips.push(el("label", { className: "chip", attrs: { for: `hv-head-${h}` } }, [box, swatch, el("span", { text: `H${h}` })]));
  }
  fieldset.replaceChildren(...chips);
  fieldset.hidden = false;
}

function setFocus(layer, head) {
  const run = state.run;
  if (!run) return;
  layer = clamp(layer, run.nLayers);
  head = clamp(head, run.nHeads);
  const sameHeadSet = state.headSet.size <= 1;
  state.layer = layer;
  state.head = head;
  if (sameHeadSet) state.headSet = new Set([head]);
  if (state.aggregate === "all") state.aggregate = "head";
  $("layer").value = String(layer);
  $("head").value = String(head);
  $("aggregate").value = state.aggregate;
  grid.select(layer, head);
  updatePermalink();
  renderViews();
}

function updatePermalink(push = false) {
  if (!state.request) return;
  writePermalink({
    text: state.request.text,
    pair: state.request.text_pair || "",
    model: state.run.model,
    layer: state.layer,
    head: state.head,
  }, push);
}

// ---- running ----------------------------------------------------------------------------------

async function submit({ layer = 0, head = 0, push = true } = {}) {
  const text = $("text").value;
  const pair = $("pair").value;
  if (!text.trim()) {
    showError("Type a sentence first.");
    $("text").focus();
    return;
  }
  state.controller?.abort();
  state.controller = new AbortController();
  state.marks = new Set();
  performance.clearMarks();
  mark("submit");
  showError("");
  setBusy(true);

  const info = modelInfo($("model").value);
  layer = clamp(layer, info.n_layers);
  const request = { text, model: info.id, format: "u8", truncate: $("truncate").checked };
  if (pair.trim()) request.text_pair = pair;
  const lazy = info.n_layers > 1 && info.n_layers * info.n_heads * guessTokens(text.length + pair.length) ** 2 > EAGER_BYTES;
  let response;
  try {
    response = await postAttention(lazy ? { ...request, layers: [layer] } : request, state.controller.signal);
  } catch (err) {
    if (err.name !== "AbortError") {
      showError(describeError(err));
      setBusy(false);
    }
    return;
  }
  mark("response");
  const run = new AttentionRun(response);
  state.run = run;
  state.request = request;
  state.pending = new Set();
  state.layer = layer;
  state.head = clamp(head, run.nHeads);
  state.headSet = new Set([state.head]);
  setupControls(run);
  $("controls").hidden = false;
  updatePermalink(push);
  grid.build(run);
  grid.select(state.layer, state.head);
  await renderViews();
  setBusy(false);
  const options = viewOptions();
  run.layerBytes.forEach((bytes, l) => bytes && grid.paintLayer(l, options));
  if (grid.complete) nextFrame().then(() => mark("grid-painted"));
}

function setupControls(run) {
  const range = (n) => [...Array(n).keys()].map((i) => ({ value: i, label: String(i) }));
  fillSelect($("layer"), range(run.nLayers), state.layer);
  fillSelect($("head"), range(run.nHeads), state.head);
  $("segments").disabled = !run.hasPair;
  if (!run.hasPair) state.segments = "all";
  $("segments").value = state.segments;
  $("aggregate").value = state.aggregate;
}

let optionsFrame = 0;

function optionsChanged() {
  state.hideSpecial = $("hide-special").checked;
  state.threshold = Number($("threshold").value);
  state.segments = $("segments").value;
  $("threshold-value").textContent = state.threshold.toFixed(2);
  if (!state.run || optionsFrame) return;
  // A dragged slider fires many events; repainting 72 thumbnails once per frame is plenty.
  optionsFrame = requestAnimationFrame(() => {
    optionsFrame = 0;
    grid.paintAll(viewOptions());
    renderViews();
  });
}

// ---- wiring -----------------------------------------------------------------------------------

function onKey(event) {
  if (!state.run || event.altKey || event.ctrlKey || event.metaKey) return;
  if (event.target.closest("input, select, textarea")) return;
  const steps = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
  const step = steps[event.key];
  if (!step) return;
  event.preventDefault();
  const { nLayers, nHeads } = state.run;
  // Heads wrap into the neighbouring layer, so the arrows walk through every head in order.
  const flat = (state.layer + step[0]) * nHeads + state.head + step[1];
  const wrapped = (flat + nLayers * nHeads) % (nLayers * nHeads);
  setFocus(Math.floor(wrapped / nHeads), wrapped % nHeads);
}

async function download(kind) {
  const run = state.run;
  if (!run) return;
  let matrix = focusMatrix();
  let precision = state.aggregate === "head" && run.isPrecise(state.layer, state.head) ? "float16" : "uint8";
  if (state.aggregate === "head") {
    // A single head is worth its exact float32 values: the cached run serves them without a new forward.
    try {
      const slice = await fetchSlice(run.runId, [state.layer], [state.head], "json", state.controller.signal);
      matrix = slice.attention.decoded.values;
      precision = "float32";
    } catch {
      // Evicted or offline: the values on screen are still worth saving.
    }
  }
  if (!matrix) return;
  const data = { view: viewOf(matrix, run.tokens, viewOptions()), tokens: run.tokens };
  if (kind === "csv") {
    downloadCsv(fileStem(), data);
  } else {
    downloadJson(fileStem(), data, {
      model: run.model, run_id: run.runId, text: state.request.text, text_pair: state.request.text_pair ?? null,
      layer: state.aggregate === "all" ? null : state.layer, head: state.aggregate === "head" ? state.head : null,
      aggregate: state.aggregate, hide_special: state.hideSpecial, threshold: state.threshold,
      segments: state.segments, precision,
    });
  }
}

async function copyLink() {
  const status = $("link-status");
  try {
    await navigator.clipboard.writeText(window.location.href);
    status.textContent = "Link copied.";
  } catch {
    status.textContent = "The address bar holds this view: copy it from there.";
  }
}

async function restoreFromUrl(push) {
  const link = readPermalink();
  if (!link.text) return;
  $("text").value = link.text;
  $("pair").value = link.pair;
  if (link.model && state.models.some((m) => m.id === link.model)) $("model").value = link.model;
  await submit({ layer: link.layer ?? 0, head: link.head ?? 0, push });
}

// Until the first run the focus view shows a made-up example: the plot then exists and Plotly's
// heatmap code is warm, so the first real heatmap is only an update.
function renderExample() {
  const words = "manyeyes shows what every attention head does .".split(" ");
  const tokens = words.map((text) => ({ text, special: false, segment: 0 }));
  const n = words.length;
  const matrix = new Float32Array(n * n).map((_, i) => 1 / (1 + Math.abs(Math.floor(i / n) - (i % n)) * 3));
  const view = viewOf(matrix, tokens, { hideSpecial: false, threshold: 0, segments: "all", causal: false });
  return focus.render({ view, tokens, title: "Example: type a sentence above and press Enter", filename: "manyeyes-example" });
}

async function init() {
  renderExample();
  $("run-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  $("layer").addEventListener("change", () => setFocus(Number($("layer").value), state.head));
  $("head").addEventListener("change", () => setFocus(state.layer, Number($("head").value)));
  $("aggregate").addEventListener("change", () => {
    state.aggregate = $("aggregate").value;
    renderViews();
  });
  for (const id of ["hide-special", "threshold", "segments"]) $(id).addEventListener("input", optionsChanged);
  $("download-csv").addEventListener("click", () => download("csv"));
  $("download-json").addEventListener("click", () => download("json"));
  $("copy-link").addEventListener("click", copyLink);
  // The address bar is the permalink; /export turns the same view into one downloadable file.
  $("export-page").addEventListener("click", () => window.location.assign("/export" + window.location.search));
  document.addEventListener("keydown", onKey);
  window.addEventListener("popstate", () => restoreFromUrl(false));
  onThemeChange(() => {
    if (!state.run) return;
    grid.paintAll(viewOptions());
    renderViews();
  });

  try {
    state.models = await listModels();
  } catch (err) {
    showError(`Cannot list the models: ${describeError(err)}`);
    return;
  }
  const label = (m) => `${m.id} (${m.family}, ${m.n_layers}×${m.n_heads}${m.causal ? ", causal" : ""})`;
  fillSelect($("model"), state.models.map((m) => ({ value: m.id, label: label(m) })), modelInfo("").id);
  document.body.dataset.ready = "true";
  await restoreFromUrl(false);
}

init();
