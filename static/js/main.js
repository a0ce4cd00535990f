// Wires the page: input → API → run data → focus heatmap, model grid and head view, plus the permalink.
// Performance marks (manyeyes:submit, :response, :first-heatmap, :grid-painted) and measures
// (manyeyes:interaction:<name>, input → the changed heatmap on screen) feed bench/ui_bench.py.

import { ApiError, FLOAT32_READINGS, describeError, fetchCell, fetchMean, fetchSlice, listModels, postAttention, preciseFormat, readiness, requestFile } from "./api.js";
import { $, asTyped, el, fillSelect, nextFrame, oneStopModebars } from "./dom.js";
import { downloadCsv, downloadJson, saveFile } from "./download.js";
import { ARROW_STEPS, F16_ZERO, weightText } from "./focus.js";
import { GridView } from "./grid.js";
import { HeadView } from "./headview.js";
import { TiledFocusView } from "./long_focus.js";
import { LongHeadView, QUERIES } from "./long_headview.js";
import { LongRun, longCaption, longControls, openLongRun, paintOverview } from "./long_run.js";
import { mountMeasures } from "./measures.js";
import { loadView, readPermalink, rememberedView, saveView, writePermalink } from "./permalink.js";
import { mountStaleNote } from "./stale_note.js";
import { CellHeads } from "./cell_heads.js";
import { AttentionRun, holdsFor, layerMask, maskWords } from "./run.js";
import { onThemeChange, palette, setTheme, themeChoice } from "./theme.js";
import { describeToken, quotedSpan, tokenCount, tokenLabels } from "./tokens.js";
import { hidingOptions, isIdentity, renormalises, viewOf } from "./transform.js";
import "./experiments.js";

// Above this many bytes of u8 attention, the first request asks only for the focused layer and the
// grid fetches the others as they come into view. Token counts are guessed at ~4 characters each.
const EAGER_BYTES = 4e6;
const guessTokens = (chars) => Math.ceil(chars / 4) + 3;
const NARROW = window.matchMedia("(max-width: 700px)");
const HEAD_VIEW_PAUSE_MS = 120;
// Exact values (float32 once decoded) of every layer the grid asks for when a view is not the
// plain one, at most: MiniLM's 72 heads at 512 tokens, its longest, are 75 MB; beyond, its
// thumbnails stay on the 8-bit bytes.
const GRID_EXACT_BYTES = 96 * 2 ** 20;
const REVIVE_GAP_MS = 5000; // a run lost again this soon after it was posted again is shown as an error

const state = {
  models: [],
  run: null,
  request: null, // the POST body of the current run, to re-post when the server has evicted it
  controller: null,
  layer: 0,
  head: 0,
  extraHeads: new Set(), // heads ticked for the head view besides the focused one
  aggregate: "head",
  hideSpecial: false,
  hideFirst: false,
  threshold: 0,
  segments: "all",
  scale: "head",
  labels: "pieces",
  pending: new Set(), // requests on their way: u8 layer numbers, "f16:<layer>", "mean:<key>"
  marks: new Set(),
  renderToken: 0,
  interaction: null, // { name, start } of the input whose result is not on screen yet
  labelCache: null,
  headViewTimer: 0,
  busy: false, // a run is under way (setBusy)
  runAgain: false, // ...and Run was asked for again meanwhile
};

oneStopModebars();
const focus = new TiledFocusView($("focus-plot"), $("tooltip"), $("cell-reading"));
const cellHeads = new CellHeads($("cell-heads"), (layer, head) => {
  state.aggregate = "head";
  setFocus(layer, head, "cell");
}, exactCell);
const grid = new GridView($("grid"), {
  onSelect: (l, h) => {
    state.aggregate = "head";
    setFocus(l, h, "grid");
    // On a phone the grid sits under the heatmap: a tap changed a plot off screen, unseen.
    const panel = $("focus-plot").closest(".panel");
    if (NARROW.matches && panel.getBoundingClientRect().top < 0) panel.scrollIntoView({ block: "start" });
  },
  onNeedLayers: (layers) => loadU8(layers),
});
const headView = new HeadView($("headview"));
const longHeadView = new LongHeadView($("headview"));
focus.onTileError = (err) => state.run?.long && longRunError(state.run, err);
// The head view of a long run follows the rows in view on the heatmap.
focus.onWindow = (win) => {
  if (!state.run?.long) return;
  if ($("focus-plot").dataset.precision === "tiles") $("focus-caption").textContent = longCaption(state.run, state.layer, state.scale, win);
  clearTimeout(state.headViewTimer);
  state.headViewTimer = setTimeout(renderHeadView, HEAD_VIEW_PAUSE_MS);
};
const measures = mountMeasures((l, h) => { state.aggregate = "head"; setFocus(l, h, "finder"); });

function mark(name) {
  if (state.marks.has(name)) return;
  state.marks.add(name);
  performance.mark(`manyeyes:${name}`);
}

function viewsLoaded() {
  if ($("error").dataset.source === "views") showError("");
}

function startInteraction(name) {
  state.interaction = { name, start: performance.now() };
}

// Said after a message where a run has not replaced the results on screen.
const LAST_RUN_SHOWN = " The results below are still those of the last run.";

// `source` is what failed: "run" (the text's own request, cleared by the next run), "views"
// (a slice, tile or overview of the run on screen, cleared as soon as one such request succeeds:
// a 429's "busy" stayed up over every view that loaded after it), "form" (nothing was sent) or
// "link" (the address's view could not be opened; nothing ran).
// A page opened while the server loads its models waited on nothing: "Cannot list the models: The
// server failed (503)" stayed when the models were in. It says how loading goes and carries on
// once they are ready; a load that failed is said as the server says it.
const LOADING_POLL_MS = 1000;

function loadingLine(models) {
  const states = Object.entries(models).map(([id, p]) => {
    const share = p.bytes_total ? ` ${Math.floor((100 * p.bytes_done) / p.bytes_total)}%` : "";
    return `${id} ${p.state}${share}`;
  });
  return `The server is still loading its models${states.length ? ` (${states.join(", ")})` : ""}. The page goes on when they are ready.`;
}

async function modelsOnceLoaded() {
  for (;;) {
    try {
      return await listModels();
    } catch (err) {
      if (err.status !== 503 || err.code !== "not_ready") throw err;
      const ready = await readiness().catch(() => ({ status: "loading", models: {} }));
      if (ready.status === "failed") throw new ApiError(503, "load_failed", ready.message);
      if (ready.status === "loading") showError(loadingLine(ready.models), "loading");
      await new Promise((resolve) => setTimeout(resolve, LOADING_POLL_MS));
    }
  }
}

function showError(message, source = "run") {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
  box.dataset.source = source;
  // The loading line is news, rewritten every second as the models come in: an alert interrupted
  // a screen reader at each rewrite; a status waits its turn.
  box.setAttribute("role", source === "loading" ? "status" : "alert");
  // With no run behind it, the made-up example must not look like a result of the failed input
  // (a mistake in the form ran nothing: source "form").
  if (message && !state.run && source === "run") focus.clear("The example is hidden: the run above failed.");
}

// The spinner is for the eye; screen readers hear the always-present status line, which a region
// that only appears as it speaks would not reliably be. Run stays enabled meanwhile (disabled, it
// also blocked Enter, and a text typed meanwhile was dropped without a word): a run asked for
// meanwhile goes next, with the text and options as they are then.
function setBusy(busy) {
  state.busy = busy;
  $("busy").hidden = !busy;
  if (busy) $("run-status").textContent = "Running…";
  $("run-form").setAttribute("aria-busy", String(busy));
  if (!busy) delete $("run-form").dataset.running;
  if (!busy && state.runAgain) {
    state.runAgain = false;
    $("run-form").removeAttribute("data-queued");
    setTimeout(() => submit(), 0);
  }
}

function viewOptions() {
  return {
    hideSpecial: state.hideSpecial, hideFirst: state.hideFirst, threshold: state.threshold,
    segments: state.segments, mask: focusMask(), scale: state.scale,
  };
}

// What the focused heatmap masks: its layer's rule, or every layer's at once for the mean of all.
function focusMask() {
  return layerMask(state.run, state.aggregate === "all" ? null : state.layer);
}

function modelInfo(id) {
  return state.models.find((m) => m.id === id) || state.models.find((m) => m.default) || state.models[0];
}

// A causal model has no pairs as an encoder's [SEP] makes them: its tokenizer reads the second
// text after the first (tiny-gpt's straight after: "it?On the bank"), which the label says.
function notePairing() {
  $("pair-note").textContent = modelInfo($("model").value).causal
    ? "(optional: read after the first)" : "(optional, for pairs)";
}

function clamp(n, max) {
  return Math.min(Math.max(n ?? 0, 0), max - 1);
}

function labels() {
  const run = state.run;
  if (state.labelCache?.run !== run || state.labelCache.mode !== state.labels) {
    state.labelCache = { run, mode: state.labels, labels: tokenLabels(run.tokens, state.labels), titles: run.tokens.map(describeToken) };
  }
  return state.labelCache;
}

// ---- data -------------------------------------------------------------------------------------

// One request for this run; if the server's cache dropped the run, the same text is posted again
// (cheaply: one head of one layer) and the request repeated. A GPU server keeps a u8 run as the
// bytes that crossed from the device (its answer's `precision` says so) and refuses more precise
// slices of it (422 kept_quantised): then `reposted.post` asks for the same by posting the text in
// the format it needs, `reposted.format`, and the run the server keeps from then on holds it.
// onFailed(said): a view of the request's own that says it failed where it would have shown.
async function fromRun(run, key, fetcher, reposted = null, onFailed = null) {
  const pending = state.pending; // this run's own: a newer run gets a fresh set
  if (pending.has(key)) return null;
  pending.add(key);
  const repost = async () => {
    const answer = await reposted.post();
    run.precision = answer.precision;
    return answer;
  };
  const fetched = async () => {
    if (reposted && !holdsFor(run.precision, reposted.format)) return await repost();
    try {
      return await fetcher(run.runId);
    } catch (err) {
      // Evicted meanwhile, and posted again as u8 by another client of the same text.
      if (reposted && err.code === "kept_quantised") return await repost();
      if (err.status !== 404) throw err;
      const again = await postAttention({ ...state.request, layers: [0], heads: [0], format: "u8" }, state.controller.signal);
      run.runId = again.run_id;
      run.precision = again.precision;
      if (reposted && !holdsFor(run.precision, reposted.format)) return await repost();
      return await fetcher(run.runId);
    }
  };
  try {
    const answer = await fetched();
    if (state.run === run) viewsLoaded();
    return answer;
  } catch (err) {
    if (err.name !== "AbortError" && state.run === run) {
      showError(describeError(err), "views");
      onFailed?.(describeError(err));
      if ($("focus-plot").hasAttribute("data-stale")) {
        $("focus-caption").textContent = "This view's values could not be loaded (see above): the faded heatmap is the last view's.";
      }
    }
    return null;
  } finally {
    pending.delete(key);
  }
}

async function loadU8(layers) {
  const run = state.run;
  if (run.long) return; // a long run's grid paints its overview instead
  const wanted = layers.filter((l) => !run.hasLayer(l) && !state.pending.has(String(l)));
  if (!wanted.length) return;
  const slice = await fromRun(run, wanted.join(","), (id) => fetchSlice(id, wanted, null, "u8", state.controller.signal),
    null, (said) => grid.failLayers(wanted, said));
  if (!slice || state.run !== run) return;
  run.ingest(slice);
  const options = viewOptions();
  wanted.forEach((l) => grid.paintLayer(l, options));
  if (grid.complete) nextFrame().then(() => mark("grid-painted"));
  exactForGrid(run);
  if (state.aggregate === "head" && wanted.includes(state.layer)) renderViews();
  else if (state.aggregate === "head" && !u8Pending() && !run.isPrecise(state.layer, state.head)) loadExact(state.layer);
}

function u8Pending() {
  return [...state.pending].some((key) => !String(key).includes(":"));
}

// Exact (float16) values for every head of a layer: arrow steps within it then need no request,
// and hide-special, hide-first and the threshold work on exact weights.
async function loadExact(layer) {
  const run = state.run;
  const slice = await fromRun(run, `f16:${layer}`, (id) => fetchSlice(id, [layer], null, "f16", state.controller.signal),
    { format: "f16", post: () => postAttention({ ...state.request, layers: [layer], format: "f16" }, state.controller.signal) },
    () => exactFailed(run, layer));
  if (!slice || state.run !== run) return;
  run.exactFailed.delete(layer);
  run.ingest(slice);
  // In slices, as an option change repaints: a layer of MiniLM at 512 tokens pools 3 M cells.
  if (!isIdentity(viewOptions(), run.hasPair)) grid.paintAllSoon(viewOptions());
  if (state.aggregate !== "all" && state.layer === layer) renderViews();
}

// With the server gone, the heatmap stayed on the 8-bit values it had, and only the banner at the
// top said anything: the caption says which values these are.
function exactFailed(run, layer) {
  run.exactFailed.add(layer);
  const plot = $("focus-plot");
  if (plot.dataset.precision === "u8" && plot.dataset.aggregate === "head" && Number(plot.dataset.layer) === layer
      && !plot.hasAttribute("data-stale") && !$("focus-caption").textContent.includes(EXACT_FAILED)) {
    $("focus-caption").textContent += ` · ${EXACT_FAILED}`;
  }
}

// Renormalised from 8-bit bytes a row that gave the hidden tokens nearly all its weight is lost (a
// visible share of 1e-4 is bytes of 0): a thumbnail was blank or not by whether its layer's exact
// values had come for the focus, so a saved view reopened drew other thumbnails than its page had.
// The grid draws a view that is not the plain one (hidden tokens, a threshold, a pair block) from
// exact values, and so asks for every layer's, as the focus does for its own. Not those that
// failed (each failure is said; the focus asks again for its own layer).
async function exactForGrid(run) {
  if (run.long || state.run !== run || isIdentity(viewOptions(), run.hasPair)) return;
  if (run.nLayers * run.nHeads * run.T ** 2 * 4 > GRID_EXACT_BYTES) return; // decoded: float32
  const wanted = [...Array(run.nLayers).keys()].filter((l) => run.hasLayer(l) && !run.isPrecise(l, 0) && !run.exactFailed.has(l));
  if (!wanted.length) return;
  // One request for them all: a run a GPU server kept as its 8-bit bytes is posted again in
  // float16 once (a request a layer had posted the text again as many times, all at once).
  const signal = state.controller.signal;
  const slice = await fromRun(run, "f16:grid", (id) => fetchSlice(id, wanted, null, "f16", signal),
    { format: "f16", post: () => postAttention({ ...state.request, layers: wanted, format: "f16" }, signal) },
    () => wanted.forEach((l) => exactFailed(run, l)));
  if (!slice || state.run !== run) return;
  wanted.forEach((l) => run.exactFailed.delete(l));
  run.ingest(slice);
  grid.paintAllSoon(viewOptions());
  if (state.aggregate !== "all" && wanted.includes(state.layer)) renderViews();
  exactForGrid(run); // layers whose 8-bit bytes came meanwhile (a long text's grid loads as it scrolls)
}

// One cell in every head, for the ranking of a picked cell (cell_heads.js). A GPU server keeps a
// u8 answer's run as its bytes: the text is then posted again in float16 first, as for loadExact.
async function exactCell(run, query, key) {
  const signal = state.controller.signal;
  // float32 from a run that holds it; a run kept quantised (a GPU server's u8) is posted again in
  // float16, one head of T x T weights, rather than in float32 JSON: 15 MB at T = 1,024 for a click.
  const format = holdsFor(run.precision, "json") ? await preciseFormat(run.nLayers * run.nHeads) : "f16";
  const values = async (id) => ({ values: await fetchCell(id, query, key, signal, format) });
  const post = async () => {
    const again = await postAttention({ ...state.request, layers: [0], heads: [0], format }, signal);
    return { precision: again.precision, ...(await values(again.run_id)) };
  };
  const reply = await fromRun(run, `cell:${query}:${key}`, values, { format, post });
  return state.run === run ? reply?.values ?? null : null;
}

async function loadMean(key, layers) {
  const run = state.run;
  const reply = await fromRun(run, `mean:${key}`, (id) => fetchMean(id, layers, state.controller.signal));
  if (!reply || state.run !== run) return;
  run.means.set(key, reply.attention.decoded.values);
  if (meanKey() === key) renderViews();
}

// A renormalised row is divided by the share its shown tokens got, and float16's rounding with it:
// weights under 2^-25 are 0 in float16 and those under 2^-14 coarse, so a row that gave the hidden
// tokens nearly all of its attention (a sink) lost what it gave the rest, up to whole rows of 0.
// Renormalised views read float32: the focused head alone, or the server's mean.
async function loadFloat32() {
  const run = state.run;
  const key = float32Key();
  const { layer, head } = state;
  const signal = state.controller.signal;
  const mean = meanKey();
  // float16 where a head's T x T passes the server's json budget, which GET /mean does not keep to
  const format = mean ? "json" : await preciseFormat(run.T * run.T);
  const reply = mean
    ? await fromRun(run, `f32:${key}`, (id) => fetchMean(id, mean === "all" ? [...Array(run.nLayers).keys()] : [layer], signal, format))
    : await fromRun(run, `f32:${key}`, (id) => fetchSlice(id, [layer], [head], format, signal),
      { format, post: () => postAttention({ ...state.request, layers: [layer], heads: [head], format }, signal) });
  if (!reply || state.run !== run) return;
  // An exported file answers with its own float16 or 8-bit weights, and says so in the dtype.
  const precision = { float16: "f16", uint8: "u8" }[reply.attention.dtype] ?? "f32";
  run.float32.set(key, { values: reply.attention.decoded.values, precision });
  if (float32Key() !== key) return;
  if (renormalises(viewOptions())) renderViews();
  else focus.refreshReading();
}

// Readings of the focused view in float32 (focus.exactReading): fetched when a cell is first read,
// once per view drawn (after a failure every move of the pointer had asked again).
function exactReadings(run, precision) {
  if (precision === "f32" || !FLOAT32_READINGS) return null;
  const key = float32Key();
  const n = run.tokens.length;
  const threshold = state.threshold;
  let asked = false;
  return (query, k) => {
    const values = run.float32.get(key)?.values;
    if (!values) {
      if (!asked) loadFloat32();
      asked = true;
      return undefined;
    }
    // A weight the threshold draws as 0 reads as the cell does ("< 0.10").
    return values[query * n + k] < threshold ? undefined : values[query * n + k];
  };
}

// Where run.float32 keeps what the focused view reads when it renormalises.
function float32Key() {
  const mean = meanKey();
  return mean ? `mean:${mean}` : `${state.layer}:${state.head}`;
}

function meanKey() {
  if (state.aggregate === "all") return "all";
  if (state.aggregate === "layer") return `layer:${state.layer}`;
  return null;
}

// ---- rendering --------------------------------------------------------------------------------

// The focused matrix and its precision ("f32", "f16" or "u8"); null while what it needs is on its
// way (and asked for).
function focusMatrix() {
  const run = state.run;
  if (renormalises(viewOptions())) {
    const exact = run.float32.get(float32Key());
    if (exact) return { matrix: exact.values, precision: exact.precision };
    loadFloat32();
    return null;
  }
  const key = meanKey();
  if (key) {
    const mean = run.exactMean(key);
    if (mean) return { matrix: mean, precision: exactPrecision(run) };
    // A layer's mean is averaged from its float16 heads (run.js), so it reads the same whichever
    // way the page got there; the mean of all heads is the server's.
    if (key === "all") loadMean(key, [...Array(run.nLayers).keys()]);
    else loadExact(state.layer);
    return null;
  }
  const precise = run.isPrecise(state.layer, state.head);
  // The grid's layers go first; the exact layer follows once none is on its way (see loadU8).
  if (!precise && !u8Pending()) loadExact(state.layer);
  if (precise) return { matrix: run.head(state.layer, state.head), precision: exactPrecision(run) };
  // Until the exact values arrive the 8-bit ones are as good to look at, but renormalised rows or
  // a threshold would carry their rounding: those wait.
  if (!run.hasLayer(state.layer)) {
    loadU8([state.layer]);
    return null;
  }
  if (!isIdentity(viewOptions(), run.hasPair)) return null;
  return { matrix: run.head(state.layer, state.head), precision: "u8" };
}

// What a run's "exact" values and means hold: a server's float16, or an exported file's own
// weights, which in a u8 file (its run's `precision`) are no more than its bytes.
function exactPrecision(run) {
  return FLOAT32_READINGS || holdsFor(run.precision, "f16") ? "f16" : "u8";
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

function exportCaption() {
  const text = state.request.text + (state.request.text_pair ? ` | ${state.request.text_pair}` : "");
  const short = text.length > 80 ? `${text.slice(0, 79)}…` : text;
  return `${state.run.model} · ${focusTitle()} · “${short}”`;
}

function panelTitles() {
  const names = { head: "Focused head", layer: `Mean of layer ${state.layer}`, all: "Mean of all heads" };
  $("focus-title").textContent = names[state.aggregate];
  const heads = drawnHeads();
  $("headview-title").textContent = state.aggregate === "head"
    ? `Head view: layer ${state.layer}, head${heads.length > 1 ? "s" : ""} ${heads.join(", ")}`
    : `Head view: ${names[state.aggregate].toLowerCase()}`;
}

function drawnHeads() {
  return [...new Set([state.head, ...state.extraHeads])].sort((a, b) => a - b);
}

async function renderViews({ headView: withHeadView = true } = {}) {
  const run = state.run;
  const token = ++state.renderToken;
  panelTitles();
  if (run.long) {
    $("focus-plot").removeAttribute("data-stale");
    return renderLongViews(token, withHeadView);
  }
  measures.setAggregate(state.aggregate);
  const focused = focusMatrix();
  // Until its values come the plot still shows the last view under the new one's heading: faded,
  // so that it does not read as the new view (nor, if they never come, stay as if it were).
  $("focus-plot").toggleAttribute("data-stale", !focused);
  if (!focused) {
    $("focus-caption").textContent = "Loading exact values…";
    return;
  }
  const view = viewOf(focused.matrix, run.tokens, viewOptions());
  if (!view.rows.length || !view.cols.length) {
    nothingShown();
    return;
  }
  const names = labels();
  focus.spans = (i) => quotedSpan(run.tokens[i].text);
  focus.exactReading = exactReadings(run, focused.precision);
  focus.onPick = rankByCell(run, names);
  await focus.render({
    view, labels: names.labels, title: focusTitle(), filename: fileStem(), exportCaption: exportCaption(),
    scale: state.scale, revision: `${run.runId}:${view.rows.length}x${view.cols.length}`, floor: zeroFloor(focused.precision),
  });
  if (token !== state.renderToken) return;
  measures.setFocusShown(true);
  labelPlot(focused.precision);
  $("focus-caption").textContent = caption(run, view, focus.current?.peak ?? 0, focused.precision);
  await focusShown(token, withHeadView);
}

// A picked cell (a click, a tap, Enter on the cell cursor) ranks every head by its weight.
function rankByCell(run, names) {
  return (query, key) => cellHeads.show(run, query, key, (i) => `#${i} ${names.labels[i]}`, state.layer, state.head);
}

// The largest weight the focused view shows as 0: one under the threshold, or under what the
// precision holds (float16 rounds those under 2^-25 to 0, the 8-bit bytes those under half a step).
function zeroFloor(precision) {
  const rounding = { f32: 0, f16: F16_ZERO, u8: state.run.scale / 2 }[precision];
  return Math.max(rounding, state.threshold);
}

// Every token hidden (one token under “Hide first token”, or only special ones): no heatmap or head
// view to draw, and a word on what brings them back.
function nothingShown() {
  const message = `No token is left to show: untick ${hidingOptions(state).join(" or ")} to see them.`;
  clearTimeout(state.headViewTimer);
  focus.clear(message);
  measures.setFocusShown(false);
  headView.clear(message);
}

function labelPlot(precision) {
  const plot = $("focus-plot");
  plot.dataset.layer = state.layer;
  plot.dataset.head = state.head;
  plot.dataset.aggregate = state.aggregate;
  plot.dataset.precision = precision;
  plot.dataset.scale = state.scale;
  plot.dataset.example = "false";
  plot.setAttribute("aria-label", `${focusTitle()}: attention heatmap, queries on rows, keys on columns. Arrow keys step through heads and layers; Shift+arrow keys read the weights cell by cell, and pan a zoomed view past its edge.`);
}

// A long run's focus: the head's overview at once, then the server's tiles of what is in view.
async function renderLongViews(token, withHeadView) {
  const run = state.run;
  const head = state.aggregate === "layer" ? "mean" : state.head;
  let base = null;
  if (head !== "mean") {
    try {
      base = await run.base(state.layer, head);
      if (state.run === run) viewsLoaded();
    } catch (err) {
      longRunError(run, err);
      return;
    }
  }
  if (token !== state.renderToken) return;
  focus.spans = (i) => quotedSpan(run.tokens[i].text);
  focus.exactReading = null; // a long run's readings come from its tiles (long_focus.js)
  const names = labels();
  focus.onPick = rankByCell(run, names);
  await focus.renderLong({
    run, layer: state.layer, head, base: base?.tile, peak: base?.peak ?? 0, labels: names.labels, title: focusTitle(),
    filename: fileStem(), exportCaption: exportCaption(), scale: state.scale, revision: `${run.runId}:long`,
  });
  if (token !== state.renderToken) return;
  labelPlot("tiles");
  $("focus-caption").textContent = longCaption(run, state.layer, state.scale, focus.window());
  await focusShown(token, withHeadView);
}

// The heatmap is on screen: the marks and measures for the bench, then the head view.
async function focusShown(token, withHeadView) {
  await nextFrame();
  mark("first-heatmap");
  if (state.interaction && token === state.renderToken) {
    const { name, start } = state.interaction;
    state.interaction = null;
    performance.measure(`manyeyes:interaction:${name}`, { start, end: performance.now() });
  }
  // The head view is secondary: drawn once the heatmap is on screen and the keys have paused
  // (at T=512 it is the heaviest view; a held arrow key would redraw it for every head passed).
  if (withHeadView) {
    clearTimeout(state.headViewTimer);
    state.headViewTimer = setTimeout(() => token === state.renderToken && renderHeadView(), HEAD_VIEW_PAUSE_MS);
  }
}

const FAINT = 0.1; // a per-head view whose largest weight is under this says so in its caption
const EXACT_FAILED = "8-bit values (±0.002): the exact ones could not be loaded";

// peak: the view's largest weight, as focus.render found it.
function caption(run, view, peak, precision) {
  const shown = Math.max(view.rows.length, view.cols.length);
  const count = shown === run.T ? tokenCount(run.T) : `${view.rows.length} × ${view.cols.length} of ${tokenCount(run.T)} shown`;
  const parts = [`${count}${run.truncated ? " (cut to fit)" : ""}`, `model ${run.model}`];
  parts.push(maskWords(run, focusMask()));
  const specials = run.tokens.some((t) => t.special); // tiny-gpt's and tiny-llama's runs have none
  if (state.hideSpecial) parts.push(specials ? "special tokens hidden" : "no special tokens to hide");
  if (state.hideFirst) parts.push("first token hidden");
  if ((state.hideSpecial && specials) || state.hideFirst) parts.push("rows renormalised");
  if (state.threshold > 0) parts.push(`weights under ${state.threshold.toFixed(2)} shown as 0`);
  if (state.scale === "fixed") parts.push("colour: fixed 0–1");
  if (state.scale === "log") parts.push("colour: log scale");
  // Per head, the darkest colour is the view's largest weight, however small: a pair's A→B block
  // of 0.0002 at most was drawn as dark as a sharp head, and only the colorbar's top said otherwise.
  if (state.scale === "head" && peak > 0 && peak < FAINT) parts.push(`faint: the darkest cell is ${weightText(peak)} (Fixed 0–1 puts it on one scale)`);
  if (precision === "u8" && run.exactFailed.has(state.layer)) parts.push(EXACT_FAILED);
  return parts.join(" · ");
}

function renderHeadView() {
  const run = state.run;
  if (run.long) {
    renderLongHeadView();
    return;
  }
  const options = viewOptions();
  const pal = palette();
  let heads;
  if (state.aggregate === "head") {
    heads = drawnHeads().map((h) => {
      const precise = run.isPrecise(state.layer, h);
      const matrix = precise || isIdentity(options, run.hasPair) ? run.head(state.layer, h) : null;
      return matrix && { matrix, color: pal.heads[h % pal.heads.length], id: `${h}${precise ? "" : "~"}` };
    }).filter(Boolean);
  } else {
    const focused = focusMatrix();
    heads = focused ? [{ matrix: focused.matrix, color: pal.heads[0], id: meanKey() }] : [];
  }
  if (state.aggregate === "head" && heads.length < drawnHeads().length) loadExact(state.layer); // renders again once in
  if (!heads.length) {
    // Not the last run's lines (or its "no token is left") while this one's exact values load.
    headView.clear("Loading exact values…");
    return;
  }
  const names = labels();
  // What the lines depend on; the colour scale is not part of it, so a scale change redraws nothing.
  const key = JSON.stringify([run.runId, state.layer, heads.map((d) => d.id), state.hideSpecial, state.hideFirst, state.threshold, state.segments, state.labels, pal.heads[0]]);
  headView.render({ key, tokens: run.tokens, options, heads, labels: names.labels, titles: names.titles, special: run.tokens.map((t) => t.special) });
  $("headview").dataset.layer = state.layer;
  $("headview").dataset.heads = state.aggregate === "head" ? drawnHeads().join(",") : state.aggregate;
  renderHeadChips();
}

// Top-k lines of the rows in view (at most QUERIES), for the focused head and those ticked.
function renderLongHeadView() {
  const run = state.run;
  if (state.aggregate !== "head") {
    longHeadView.cancel();
    $("headview").replaceChildren(el("p", { className: "empty", text: "The head view of a long run draws single heads: pick one (its lines come from the top-k route)." }));
    renderHeadChips();
    return;
  }
  const { q0, q1 } = focus.window();
  const pal = palette();
  const names = labels();
  const heads = drawnHeads().map((head) => ({ head, color: pal.heads[head % pal.heads.length] }));
  longHeadView.render({
    run, layer: state.layer, heads, q0, q1: Math.min(q1, q0 + QUERIES), labels: names.labels, titles: names.titles,
    special: run.tokens.map((t) => t.special),
  }).then((drawn) => {
    if (!drawn || state.run !== run) return;
    $("headview").dataset.layer = state.layer;
    $("headview").dataset.heads = drawnHeads().join(",");
    renderHeadChips();
  }).catch((err) => longRunError(run, err));
}

// A long run's tiles and top-k are read from the server's run cache. If the cache dropped the run
// while it is on screen (404 unknown_run), its text is posted again (the same run id) and the
// views drawn again, as short runs' slices do through fromRun; only a loss that recurs at once
// (or any other error) is shown.
function longRunError(run, err) {
  if (state.run !== run || err.name === "AbortError") return;
  const lost = err.status === 404 && err.code === "unknown_run";
  if (!lost || performance.now() - (run.revivedAt ?? -Infinity) < REVIVE_GAP_MS) {
    showError(describeError(err), "views");
    return;
  }
  if (run.reviving) return; // the tiles in flight fail together: one post answers them all
  run.reviving = postAttention({ ...state.request }, state.controller.signal)
    .then(() => {
      run.revivedAt = performance.now();
      if (state.run !== run) return;
      focus.runRevived();
      openLongRun(run, state.controller.signal);
      paintOverview(grid, run, state.scale).catch(() => {});
      renderViews();
    })
    .catch((again) => state.run === run && again.name !== "AbortError" && showError(describeError(again), "views"))
    .finally(() => { run.reviving = null; });
}

function renderHeadChips() {
  const run = state.run;
  const fieldset = $("headview-heads");
  const pal = palette();
  // Built again only when what they show changed: they are drawn with the run and again with the
  // head view's lines, and a rebuild drops the keyboard focus of a chip being tabbed through.
  const key = JSON.stringify([run.runId, run.nHeads, state.layer, state.head, [...state.extraHeads].sort(), state.aggregate, pal.heads]);
  // Under a mean the head view draws the mean, one set of lines: chips of single heads, greyed,
  // with the focused one ticked, offered a choice that meant nothing. The ticks are kept for the
  // return to a single head, and so is their room: hidden outright, the page below moved up by
  // their height and drew the measures panel at 512 tokens, which the user had not scrolled to.
  const offered = state.aggregate === "head";
  fieldset.hidden = false; // the template hides them until the first run
  fieldset.style.visibility = offered ? "" : "hidden";
  fieldset.inert = !offered;
  if (fieldset.dataset.key === key) return;
  fieldset.dataset.key = key;
  const chips = [el("legend", { text: `Heads of layer ${state.layer} drawn (the focused one always)` })];
  for (let h = 0; h < run.nHeads; h++) {
    const box = el("input", { attrs: { type: "checkbox", id: `hv-head-${h}` } });
    box.checked = h === state.head || state.extraHeads.has(h);
    box.disabled = state.aggregate !== "head" || h === state.head;
    box.addEventListener("change", () => {
      if (box.checked) state.extraHeads.add(h);
      else state.extraHeads.delete(h);
      panelTitles();
      renderHeadView();
      updatePermalink();
    });
    const swatch = el("span", { className: "swatch", attrs: { "aria-hidden": "true" } });
    swatch.style.background = pal.heads[h % pal.heads.length];
    chips.push(el("label", { className: "chip", attrs: { for: `hv-head-${h}` } }, [box, swatch, el("span", { text: `H${h}` })]));
  }
  fieldset.replaceChildren(...chips);
}

function setFocus(layer, head, how = "select") {
  const run = state.run;
  if (!run) return;
  startInteraction(how);
  layer = clamp(layer, run.nLayers);
  head = clamp(head, run.nHeads);
  state.layer = layer;
  state.head = head;
  $("head-note").hidden = true; // another head picked: the last Run's move is old news
  state.extraHeads.delete(head);
  if (state.aggregate === "all") state.aggregate = "head";
  $("layer").value = String(layer);
  $("head").value = String(head);
  $("aggregate").value = state.aggregate;
  grid.select(layer, head, state.aggregate);
  cellHeads.refresh(layer, head);
  updatePermalink();
  renderViews();
  if (!run.long) measures.onFocus(layer, head);
}

// ---- permalink --------------------------------------------------------------------------------

function viewState() {
  return {
    text: state.request.text, text_pair: state.request.text_pair ?? null, model: state.run.model,
    truncate: state.request.truncate, layer: state.layer, head: state.head, aggregate: state.aggregate,
    heads: [...state.extraHeads].sort((a, b) => a - b), hide_special: state.hideSpecial, hide_first: state.hideFirst,
    threshold: state.threshold, segments: state.segments, scale: state.scale, labels: state.labels,
    measure: $("measure").value, word_view: $("word-view").checked, ...measures.guessChoice(state.run),
  };
}

let saveTimer = 0;
let scheduled = null; // the view the timer will save, as it was when the change was made
let saving = 0; // saves whose address-bar write has not happened yet
let writes = Promise.resolve(); // those writes, in the order their saves began
let entry = 0; // counts Back and Forward: a save begun for the entry left writes nothing

// The address bar's writes go in the order the saves began, not as their POSTs come back: a
// change's save still on its way when the next text's entry was pushed wrote its id over that
// entry, and Back returned to the run without the change.
function saveAndWrite(view, push) {
  saving += 1;
  document.body.dataset.viewPending = "true"; // tests wait for the address bar to catch up
  const saved = saveView(view);
  const forEntry = entry;
  const written = writes.then(() => saved).then((id) => {
    // Written after Back or Forward it would name the entry left on the one gone to, while the
    // run restored there is on screen (until that run's own save replaced it).
    if (forEntry !== entry) return id;
    writePermalink(id, push, view);
    document.body.dataset.view = id;
    // A link that could not be saved before can be now: the failure no longer holds.
    if ($("link-status").textContent.startsWith(LINK_NOT_SAVED)) $("link-status").textContent = "";
    return id;
  }).finally(() => {
    saving -= 1;
    if (!saving && !saveTimer) delete document.body.dataset.viewPending;
  });
  writes = written.catch(() => {});
  return written;
}

// The save that was to come a moment later, now (if one was to come).
function flushScheduledSave() {
  if (!saveTimer) return;
  clearTimeout(saveTimer);
  saveTimer = 0;
  saveAndWrite(scheduled, false).catch(() => {
    // The link is a convenience: the view itself goes on working.
  });
}

function dropScheduledSave() {
  clearTimeout(saveTimer);
  saveTimer = 0;
  if (!saving) delete document.body.dataset.viewPending;
}

// Saved a moment after the last change (an arrow key held down saves once); `push` makes a new
// history entry, for a new text. An option change replaces the run's entry, so Back leaves the run:
// an entry per change would walk Back through every head an arrow key passed, running the text each time.
// The view a change leaves is taken at once: a new text's run could come within the moment, and
// its entry is pushed only after the last run's entry holds that change.
function updatePermalink(push = false) {
  if (!state.request || !state.run) return;
  if (push) {
    flushScheduledSave();
    saveAndWrite(viewState(), true).catch(() => {});
    return;
  }
  clearTimeout(saveTimer);
  scheduled = viewState();
  document.body.dataset.viewPending = "true";
  saveTimer = setTimeout(flushScheduledSave, 250);
}

function applyViewState(v) {
  state.aggregate = v.aggregate ?? "head";
  state.extraHeads = new Set(v.heads ?? []);
  state.hideSpecial = Boolean(v.hide_special);
  state.hideFirst = Boolean(v.hide_first);
  state.threshold = v.threshold ?? 0;
  state.segments = v.segments ?? "all";
  state.scale = v.scale ?? "head";
  state.labels = v.labels ?? "pieces";
  $("text").value = v.text;
  $("pair").value = v.text_pair ?? "";
  state.linked = { text: v.text, pair: v.text_pair ?? "" };
  TEXT_BOXES.forEach(fitTextBox);
  $("truncate").checked = Boolean(v.truncate);
  $("measure").value = v.measure ?? "raw";
  $("word-view").checked = Boolean(v.word_view);
  measures.restoreGuess(v.guess_position ?? null, v.guess_target ?? null);
  if (v.model && state.models.some((m) => m.id === v.model)) $("model").value = v.model;
  notePairing();
  syncControls();
}

function syncControls() {
  $("aggregate").value = state.aggregate;
  $("hide-special").checked = state.hideSpecial;
  $("hide-first").checked = state.hideFirst;
  $("threshold").value = String(state.threshold);
  $("threshold-value").textContent = state.threshold.toFixed(2);
  $("segments").value = state.segments;
  $("scale").value = state.scale;
  $("labels").value = state.labels;
}

async function restoreFromUrl(push) {
  const link = readPermalink();
  let saved = null;
  // Nothing ran: the example stays, under its own caption ("link", not "run": the example was
  // hidden as if "the run above failed").
  if (link.badView !== undefined) {
    showError(`This link is broken: “${link.badView.slice(0, 40)}” is no view id (those are 18 characters, 0–9 and a–f); `
      + "it may have been cut short when it was copied.", "link");
    return;
  }
  if (link.view) {
    try {
      saved = rememberedView(link.view) ?? await loadView(link.view);
    } catch (err) {
      showError(err.status === 404
        ? "This link has expired: the server no longer holds its view, nor the text it showed (a view is kept up to 30 days, "
          + "while the server has room for it). Type a sentence to start again."
        : `Cannot open this link: ${describeError(err)}`, "link");
      return;
    }
  } else if (link.legacy) {
    saved = { ...link.legacy, truncate: false };
  }
  if (!saved) return;
  applyViewState(saved);
  await submit({ layer: saved.layer ?? 0, head: saved.head ?? 0, push, fromLink: true });
  // An old link may name a model this server does not serve: say so rather than quietly swap it.
  if (saved.model && !state.models.some((m) => m.id === saved.model)) {
    $("link-status").textContent = `This link named the model “${saved.model}”, which this server does not serve; it ran on ${$("model").value}.`;
  } else if (state.run && !state.run.long && !$("error").textContent
             && ((saved.layer ?? 0) !== state.layer || (saved.head ?? 0) !== state.head)) {
    // An old link's layer or head past the model's: shown as the nearest, and said so.
    $("link-status").textContent = `This link named layer ${saved.layer ?? 0}, head ${saved.head ?? 0}; ${state.run.model} has `
      + `layers 0–${state.run.nLayers - 1} and heads 0–${state.run.nHeads - 1}, so it shows layer ${state.layer}, head ${state.head}.`;
  }
}

// ---- running ----------------------------------------------------------------------------------

// The two text areas: the sentence and the second sentence of a pair.
const TEXT_BOXES = ["text", "pair"];

// A text box grows with its text, up to its CSS max-height (then it scrolls).
function fitTextBox(id) {
  const box = $(id);
  box.style.height = "auto";
  box.style.height = `${box.scrollHeight + box.offsetHeight - box.clientHeight}px`;
}

// A link's text as it was saved while the box still holds it: a text area gives "\r\n" back as
// "\n", and the page ran another text than the link's (a byte-level model's 49 tokens became 48).
function asLinked(typed, linked) {
  return linked !== undefined && asTyped(linked) === typed ? linked : typed;
}

// A user's Run keeps the head being studied (the same head on a variant of the sentence is the
// commonest step of a study; it went back to L0 H0, the ticked heads with it), clamped to the new
// model's size. A link's restore names its own layer, head and ticked heads (applyViewState).
// A layer or head picked while the run is on its way is the one studied: the focus is read when
// the run lands (read when it was sent, the pick was undone by the run it was made under).
async function submit({ layer: askedLayer, head: askedHead, push = true, fromLink = false } = {}) {
  const focusNow = () => ({ layer: askedLayer ?? state.layer, head: askedHead ?? state.head });
  let studied = focusNow();
  if (!state.models.length) {
    // The model list never came (a refused key, a server gone): a run here crashed on no model
    // and left the page busy for good.
    showError("The page has no model list from the server: reload the page (and give the API key if it asks).", "form");
    return;
  }
  const text = asLinked($("text").value, state.linked?.text);
  const pair = asLinked($("pair").value, state.linked?.pair);
  if (!text.trim()) {
    showError(`${TYPE_FIRST}${state.run ? LAST_RUN_SHOWN : ""}`, "form");
    $("text").setAttribute("aria-invalid", "true");
    $("text").focus();
    return;
  }
  $("text").removeAttribute("aria-invalid");
  const typedIn = document.activeElement === $("text") || document.activeElement === $("pair");
  const fromRunButton = document.activeElement === $("run");
  state.controller?.abort();
  state.controller = new AbortController();
  state.marks = new Set();
  performance.clearMarks();
  mark("submit");
  showError("");
  setBusy(true);

  const info = modelInfo($("model").value);
  const sentLayer = clamp(studied.layer, info.n_layers);
  const request = { text, model: info.id, format: "u8", truncate: $("truncate").checked };
  if (pair.trim()) request.text_pair = pair;
  // stale_note.js: what is on its way, which the form may hold ("press Run" was said of it).
  $("run-form").dataset.running = JSON.stringify({ text, text_pair: request.text_pair ?? null, model: info.id });
  const lazy = info.n_layers > 1 && info.n_layers * info.n_heads * guessTokens(text.length + pair.length) ** 2 > EAGER_BYTES;
  let response;
  try {
    response = await postAttention(lazy ? { ...request, layers: [sentLayer] } : request, state.controller.signal);
  } catch (err) {
    if (err.name !== "AbortError") {
      // The last text's results stay on screen under the new text: they say so, faded, until a
      // run succeeds, rather than pass for the new text's.
      const stale = Boolean(state.run);
      document.body.toggleAttribute("data-stale", stale);
      showError(describeError(err) + (stale ? LAST_RUN_SHOWN : ""));
      // A text too long for the model is the box's mistake, as an empty one is: said on the box too.
      if (err.code === "too_long") $("text").setAttribute("aria-invalid", "true");
      setBusy(false);
      $("run-status").textContent = "";
    }
    return;
  }
  mark("response");
  document.body.removeAttribute("data-stale");
  // The model's sliding windows (GET /models) mask keys too far back, as causality masks later ones.
  const windows = state.models.find((m) => m.id === response.model)?.sliding_windows ?? [];
  const run = response.kept === "qk" ? new LongRun(response, windows) : new AttentionRun(response, windows);
  if (run.long) openLongRun(run, state.controller.signal);
  state.run = run;
  state.request = request;
  state.pending = new Set();
  studied = focusNow();
  state.layer = clamp(studied.layer, run.nLayers);
  state.head = clamp(studied.head, run.nHeads);
  sayMovedHead(fromLink ? null : studied, run);
  state.extraHeads = new Set([...state.extraHeads].filter((h) => h < run.nHeads && h !== state.head));
  if (!run.hasPair) state.segments = "all";
  setupControls(run);
  $("controls").hidden = false;
  $("keys-hint").hidden = false;
  updatePermalink(push);
  grid.build(run);
  grid.select(state.layer, state.head, state.aggregate);
  // The whole heatmap on screen, fitted to the window (focus.js). A phone's page went to the views'
  // top after each run, whose title, caption and hint pushed a plot as tall as the window (held
  // sideways, or a page at 200 %) past its foot: reveal takes the plot to the top instead then.
  // The experiment panels act on the run on screen, and drop what they showed of the last one.
  // Its tokens (with their character offsets) say what part of the text a run cut to fit covers.
  // Announced before reveal measures the room under the form: the "last run" note there goes with
  // it, and a page that measured it scrolled, then fitted the plot to the room without it.
  document.dispatchEvent(new CustomEvent("manyeyes:run", { detail: { request, long: run.long, causal: run.causal, tokens: run.tokens, truncated: run.truncated } }));
  if (NARROW.matches) $("controls").open = false;
  focus.reveal(run.T, NARROW.matches);
  cellHeads.clear(); // the last run's cell
  if (!run.long) headView.reserve(run.tokens, viewOptions());
  // The head chips above the head view as well: drawn with the lines after a pause, they pushed
  // everything under them (the measures panel) down by their height, once the page had laid it out.
  renderHeadChips();
  await renderViews();
  if (!run.long) measures.onRun(run, request, state.layer, state.head, labels().labels, viewOptions());
  else measures.onLongRun(run, request, labels().labels);
  setBusy(false);
  $("run-status").textContent = `Done: ${tokenCount(run.T)}, ${run.nLayers} layers × ${run.nHeads} heads.`;
  // After Enter the caret would keep the arrow keys in the text box, and a Run button that was
  // disabled while it worked has dropped keyboard focus to the page: the heatmap takes it. Not
  // when focus was elsewhere (an opened link, a restored view), nor when the user moved it since.
  const dropped = fromRunButton && (document.activeElement === document.body || document.activeElement === $("run"));
  if (typedIn || dropped) $("focus-plot").focus({ preventScroll: true });
  const options = viewOptions();
  run.layerBytes.forEach((bytes, l) => bytes && grid.paintLayer(l, options));
  exactForGrid(run);
  if (run.long) await paintOverview(grid, run, state.scale).catch((err) => state.run === run && showError(describeError(err), "views"));
  if (grid.complete) nextFrame().then(() => mark("grid-painted"));
}

// A Run on a smaller model shows the nearest head to the one studied: said, or the study went on at
// another head than the person believed, the selects changed without a word. (A link says it in
// its own status line.)
function sayMovedHead(studied, run) {
  const moved = Boolean(studied) && (studied.layer !== state.layer || studied.head !== state.head);
  $("head-note").hidden = !moved;
  $("head-note").textContent = moved
    ? `${run.model} has layers 0–${run.nLayers - 1} and heads 0–${run.nHeads - 1}: layer ${studied.layer}, head ${studied.head} `
      + `of the last run is shown as layer ${state.layer}, head ${state.head}.`
    : "";
}

function setupControls(run) {
  const range = (n) => [...Array(n).keys()].map((i) => ({ value: i, label: String(i) }));
  fillSelect($("layer"), range(run.nLayers), state.layer);
  fillSelect($("head"), range(run.nHeads), state.head);
  $("segments").disabled = !run.hasPair;
  state.aggregate = longControls(run, state.aggregate);
  syncControls();
}

let optionsBusy = false; // a redraw for changed options is under way
let optionsAgain = false; // ...and more changes came meanwhile

function optionsChanged(event) {
  startInteraction(event?.target?.id ?? "options");
  state.hideSpecial = $("hide-special").checked;
  state.hideFirst = $("hide-first").checked;
  state.threshold = Number($("threshold").value);
  state.segments = $("segments").value;
  state.scale = $("scale").value;
  state.labels = $("labels").value;
  $("threshold-value").textContent = state.threshold.toFixed(2);
  if (state.run) redrawOptions();
}

// At once (waiting for a frame would add one to every change), but a dragged slider's events
// while a redraw is under way make one more redraw, not one each; the focus first, the 72
// thumbnails in slices after it.
async function redrawOptions() {
  if (optionsBusy) {
    optionsAgain = true;
    return;
  }
  optionsBusy = true;
  try {
    await renderViews();
    if (!state.run.long) measures.setView(labels().labels, viewOptions());
    grid.paintAllSoon(viewOptions());
    exactForGrid(state.run);
    if (state.run.long) paintOverview(grid, state.run, state.scale).catch(() => {});
    updatePermalink();
  } finally {
    optionsBusy = false;
  }
  if (optionsAgain) {
    optionsAgain = false;
    redrawOptions();
  }
}

// ---- wiring -----------------------------------------------------------------------------------

// The arrows step through heads only on the heatmap and on the grid's thumbnails; anywhere else
// they keep their own work (scrolling the page or a panel, moving in a list). On the heatmap,
// Shift+arrows walk a cell cursor that reads each weight out, as hovering does for a mouse.
function onKey(event) {
  if (!state.run || event.altKey || event.ctrlKey || event.metaKey) return;
  const step = ARROW_STEPS[event.key];
  if (!step) return;
  // The heatmap itself, not a modebar button inside it: there the arrows are the button's own.
  const onHeatmap = event.target.id === "focus-plot";
  const thumb = event.target.closest("#grid .thumb");
  if (!onHeatmap && !thumb) return;
  if (event.shiftKey) {
    if (!onHeatmap) return;
    event.preventDefault();
    focus.moveCursor(...step);
    return;
  }
  event.preventDefault();
  const { nLayers, nHeads } = state.run;
  // On a thumbnail the arrows step from that thumbnail, and keyboard focus goes along: a grid
  // walked with Tab and arrows, where Enter keeps the head reached.
  const [layer, head] = thumb ? [Number(thumb.dataset.layer), Number(thumb.dataset.head)] : [state.layer, state.head];
  // Heads wrap into the neighbouring layer, so the arrows walk through every head in order.
  const flat = (layer + step[0]) * nHeads + head + step[1];
  const wrapped = (flat + nLayers * nHeads) % (nLayers * nHeads);
  state.aggregate = "head";
  setFocus(Math.floor(wrapped / nHeads), wrapped % nHeads, "arrow");
  if (onHeatmap) focus.announceHead(focusTitle()); // its label changes too, which screen readers do not re-read
  if (thumb) $("grid").querySelector(`.thumb[data-layer="${state.layer}"][data-head="${state.head}"]`)?.focus();
}

async function download(kind) {
  const run = state.run;
  if (!run || run.long) return; // off for long runs (long_run.js says why)
  const focused = focusMatrix();
  let matrix = focused?.matrix;
  let precision = { f32: "float32", f16: "float16", u8: "uint8" }[focused?.precision];
  if (state.aggregate === "head" && focused?.precision !== "f32") {
    // A single head is worth its exact float32 values: the cached run serves them without a new forward.
    try {
      const slice = await fetchSlice(run.runId, [state.layer], [state.head], "json", state.controller.signal);
      matrix = slice.attention.decoded.values;
      precision = slice.attention.dtype ?? "float32"; // an exported file's are its own float16 or 8-bit weights
    } catch {
      // Evicted or offline: the values on screen are still worth saving.
    }
  }
  if (!matrix) return;
  const data = { view: viewOf(matrix, run.tokens, viewOptions()), tokens: run.tokens, labels: labels().labels };
  if (kind === "csv") {
    downloadCsv(fileStem(), data);
  } else {
    downloadJson(fileStem(), data, {
      model: run.model, run_id: run.runId, text: state.request.text, text_pair: state.request.text_pair ?? null,
      layer: state.aggregate === "all" ? null : state.layer, head: state.aggregate === "head" ? state.head : null,
      aggregate: state.aggregate, hide_special: state.hideSpecial, hide_first: state.hideFirst, threshold: state.threshold,
      segments: state.segments, precision,
    });
  }
}

const LINK_NOT_SAVED = "The link could not be saved";
const TYPE_FIRST = "Type a sentence first.";

// The view saved at once, not a moment later as updatePermalink does; resolves to its id.
function saveNow() {
  dropScheduledSave();
  return saveAndWrite(viewState(), false);
}

async function copyLink() {
  const status = $("link-status");
  if (!state.run) return;
  try {
    await saveNow();
  } catch (err) {
    // The address bar then holds an older view (or none): pointing at it would mislead.
    status.textContent = `${LINK_NOT_SAVED}: ${describeError(err)}`;
    return;
  }
  const link = window.location.href;
  try {
    await navigator.clipboard.writeText(link);
    status.textContent = "Link copied.";
  } catch {
    status.textContent = copiedBySelection(link) ? "Link copied." : "The address bar holds this view: copy it from there.";
  }
}

// Over plain http to a network address (a classroom's laptop) the page is no secure context and
// has no navigator.clipboard: every Copy link said to copy from the address bar. A selected,
// hidden text box copied by execCommand still works there.
function copiedBySelection(text) {
  const box = el("textarea", { className: "visually-hidden", attrs: { readonly: "", "aria-hidden": "true", tabindex: "-1" } });
  box.value = text;
  const focused = document.activeElement;
  document.body.append(box);
  box.select();
  let copied = false;
  try {
    copied = document.execCommand("copy");
  } catch {
    copied = false;
  }
  box.remove();
  if (focused instanceof HTMLElement) focused.focus({ preventScroll: true });
  return copied;
}

// /export turns the saved view into one downloadable file. Saved now: the address bar lags a
// quarter second behind the controls, and the file should hold what the page shows. Fetched,
// not navigated to, so that a server with API keys gets the tab's key.
async function exportPage() {
  if (!state.run) return;
  try {
    const { blob, filename } = await requestFile(`export?view=${await saveNow()}`);
    saveFile(filename, "text/html", blob);
  } catch (err) {
    showError(`Cannot export this view: ${describeError(err)}`);
  }
}

// Until the first run the focus view shows a made-up example: the plot then exists and Plotly's
// heatmap code is warm, so the first real heatmap is only an update. Its title says it is no
// model's, and its rows add up to 1 as attention's do (they summed to 1.6: no softmax makes that).
function renderExample() {
  const words = "manyeyes shows what every attention head does .".split(" ");
  const tokens = words.map((text) => ({ text, special: false, segment: 0 }));
  const n = words.length;
  const matrix = new Float32Array(n * n);
  for (let q = 0; q < n; q++) {
    const row = words.map((_, k) => 1 / (1 + Math.abs(q - k) * 3));
    const sum = row.reduce((a, b) => a + b);
    row.forEach((w, k) => { matrix[q * n + k] = w / sum; });
  }
  const view = viewOf(matrix, tokens, { hideSpecial: false, threshold: 0, segments: "all" });
  $("focus-plot").dataset.example = "true";
  return focus.render({ view, labels: words, title: "Made-up example, not a model's output", filename: "manyeyes-example", revision: "example" });
}

async function init() {
  $("theme").value = themeChoice();
  setTheme(themeChoice());
  if (NARROW.matches) $("controls").open = false;
  renderExample();
  mountStaleNote();
  // Enter runs, as it did in the one-line box; Shift+Enter starts a line, and an input method's
  // Enter (isComposing) picks its word.
  for (const id of TEXT_BOXES) {
    $(id).addEventListener("keydown", (event) => {
      if (event.key !== "Enter" || event.shiftKey || event.altKey || event.ctrlKey || event.metaKey || event.isComposing) return;
      event.preventDefault();
      $("run-form").requestSubmit();
    });
    $(id).addEventListener("input", () => fitTextBox(id));
  }
  // "Type a sentence first" is over once there is one: it stayed up beside the typed text until
  // the next run (its "last run" note went as the text changed).
  $("text").addEventListener("input", () => {
    if (!$("text").value.trim() || !$("error").textContent.startsWith(TYPE_FIRST)) return;
    showError("");
    $("text").removeAttribute("aria-invalid");
  });
  window.addEventListener("resize", () => TEXT_BOXES.forEach(fitTextBox));
  $("run-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.busy) {
      state.runAgain = true;
      $("run-form").setAttribute("data-queued", ""); // stale_note.js: the run on its way is not the form's yet
      $("run-status").textContent = "Running… the text as it is now runs next.";
      return;
    }
    submit();
  });
  $("run").disabled = false; // index.html: until the line above, Run reloaded the page
  $("layer").addEventListener("change", () => setFocus(Number($("layer").value), state.head));
  $("head").addEventListener("change", () => setFocus(state.layer, Number($("head").value)));
  $("aggregate").addEventListener("change", () => {
    startInteraction("aggregate");
    state.aggregate = $("aggregate").value;
    grid.select(state.layer, state.head, state.aggregate);
    updatePermalink();
    renderViews();
  });
  for (const id of ["hide-special", "hide-first", "threshold", "segments", "scale", "labels"]) $(id).addEventListener("input", optionsChanged);
  for (const id of ["measure", "word-view", "attribution-position", "attribution-target"]) {
    $(id).addEventListener("change", () => updatePermalink());
  }
  $("theme").addEventListener("change", () => setTheme($("theme").value));
  $("download-csv").addEventListener("click", () => download("csv"));
  $("download-json").addEventListener("click", () => download("json"));
  $("copy-link").addEventListener("click", copyLink);
  $("export-page").addEventListener("click", exportPage);
  document.addEventListener("keydown", onKey);
  window.addEventListener("popstate", () => {
    // A change's save still to come belongs to the entry just left: written now it would replace
    // the entry Back went to. That entry's view is restored (and saved) below.
    dropScheduledSave();
    entry += 1;
    // Back to the bare page: the start state is a fresh visit's, every panel as before any run (the
    // experiments' too, which keep what they did with the last one): a reload is exactly that.
    const link = readPermalink();
    if (state.run && !link.view && !link.legacy) window.location.reload();
    else restoreFromUrl(false);
  });
  onThemeChange(() => {
    if (!state.run) {
      if ($("focus-plot").dataset.example === "true") renderExample();
      return;
    }
    grid.paintAll(viewOptions());
    if (state.run.long) paintOverview(grid, state.run, state.scale).catch(() => {});
    renderViews();
  });

  try {
    state.models = await modelsOnceLoaded();
  } catch (err) {
    showError(`Cannot list the models: ${describeError(err)}`, "models");
    return;
  }
  showError("");
  const label = (m) => `${m.id} (${m.family}, ${m.n_layers}×${m.n_heads}${m.causal ? ", causal" : ""})`;
  fillSelect($("model"), state.models.map((m) => ({ value: m.id, label: label(m) })), modelInfo("").id);
  $("model").addEventListener("change", notePairing);
  notePairing();
  document.body.dataset.ready = "true";
  await restoreFromUrl(false);
}

init();
