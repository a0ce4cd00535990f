// Experiments on the page: ablate heads (from the grid: Alt-click, or the focused head) and undo,
// and mask / replace / delete a token by clicking it. Mounts the compare and generation panels too.

import { describeError, listModels } from "./api.js";
import { $, el } from "./dom.js";
import { mountCompare } from "./compare.js";
import { alignedDifference, busyWait, cellsOf, clearPlot, currentInput, decodeTensor, headRows, heatmap, maskLater, onRun, postJson, postPrecise, postWithDifference, rankingTable, status } from "./experiment_parts.js";
import { mountGeneration } from "./generate_view.js";
import { guessLabel, pieceLabel } from "./tokens.js";

// ---------------------------------------------------------------------------- ablation
const ablation = {
  input: null, // the form's input the stack belongs to
  clean: null, // decoded clean attention of that input
  causal: false, // ...and whether its model reads only backwards
  tokens: [],
  stack: [], // [{ ablate: [...], reply, attention }], newest last
  shown: null, // { layer, head } drawn in the heatmap
  busy: null, // the input whose ablation is under way: a new run's clicks do not wait for the last run's
  queue: [], // heads Alt-clicked meanwhile, ablated next, in order
  running: null, // { layer, head } of the ablation under way, until its answer; null once undone
  off: false, // a long run: the server keeps no dense weights to ablate
};

// currentInput() is a new object for each run shown: an answer asked for another one is dropped.
const stillShown = (input) => currentInput() === input;

function pieceLabels(tokens) {
  return tokens.map(pieceLabel);
}

// The head the heatmap shows for one ablation: the one shown so far while this ablation changes it
// (a head clicked in the ranking stays as heads are added), else the most changed one. A head at or
// before the first ablated layer cannot change: after Restore all it showed "L3 H1, after ablating
// L4 H0", the clean weights. `fresh`: a new stack, which opens on its own most changed head.
function headFor(entry, fresh) {
  const { ranking } = entry.reply;
  const shown = ablation.shown;
  const isShown = (c) => c.layer === shown.layer && c.head === shown.head;
  // A head of the last layer has no later heads to rank: the heatmap then shows that head.
  if (shown && !fresh && (ranking.some(isShown) || (!ranking.length && entry.ablate.some(isShown)))) return shown;
  const top = ranking[0] ?? entry.ablate.at(-1);
  return { layer: top.layer, head: top.head };
}

const sameAblation = (a, b) => a.length === b.length && a.every((x, i) => x.layer === b[i].layer && x.head === b[i].head && x.mode === b[i].mode);

async function ablateHead(layer, head) {
  const input = currentInput();
  if (!input) return status($("ablate-status"), "Run a sentence first.", "error");
  // Alt-click on the grid still reaches here on a long run, whose panel is off: it posted the whole
  // text for weights the server does not keep, and failed in the page.
  if (ablation.off) return status($("ablate-status"), "Ablation is off for long runs (see above).", "error");
  if (ablation.busy === input) {
    ablation.queue.push({ layer, head }); // a click while one runs was dropped without a word
    updateButtons();
    return status($("ablate-status"), `Ablating… then L${layer} H${head} (${ablation.queue.length} waiting).`, "busy");
  }
  ablation.input = input; // each new run cleared the stack (forgetLastRun)
  const mode = $("ablate-mode").value;
  const previous = ablation.stack.at(-1)?.ablate || [];
  const list = [...previous.filter((a) => a.layer !== layer || a.head !== head), { layer, head, mode }];
  // The same list again would be an undo step that undoes nothing.
  if (sameAblation(list, previous)) {
    status($("ablate-status"), `L${layer} H${head} is already ablated (${mode}).`);
    const next = ablation.queue.shift();
    return next && ablateHead(next.layer, next.head);
  }
  ablation.busy = input;
  // Undo or Restore all pressed meanwhile drop it: its answer, built on the list before the press,
  // had put the heads just restored back (and a second undo step with them).
  const running = (ablation.running = { layer, head });
  updateButtons();
  status($("ablate-status"), `Ablating L${layer} H${head} (${mode})…`, "busy");
  try {
    if (!ablation.clean) {
      // Exact float32 while the server's json budget allows it (short sentences), else float16.
      const cells = await cellsOf(input.model, runRows);
      const clean = await postPrecise("api/v1/attention", (format) => ({ ...input, format }), cells);
      if (!stillShown(input)) return;
      ablation.tokens = clean.tokens;
      ablation.causal = clean.causal;
      ablation.format = clean.attention.format;
      ablation.clean = decodeTensor(clean.attention);
    }
    const reply = await postJson("api/v1/experiments/ablate", {
      ...input, ablate: list, top_k: 5, attention: { format: ablation.format },
    }, undefined, busyWait($("ablate-status"), "experiments"));
    if (!stillShown(input)) return;
    if (ablation.running === running) { // else undone meanwhile, and said so then: the heads waiting go on
      const entry = { ablate: list, reply, attention: decodeTensor(reply.attention) };
      ablation.shown = headFor(entry, !previous.length);
      ablation.stack.push(entry);
      // Said, not only drawn: a cleared line told a screen reader nothing of the result.
      const heads = list.length === 1 ? "1 head" : `${list.length} heads`;
      status($("ablate-status"), `Done on ${input.model}: L${layer} H${head} ablated (${mode}); ${heads} ablated in all.`, "");
    }
  } catch (err) {
    if (!stillShown(input)) return;
    status($("ablate-status"), describeError(err), "error");
    ablation.queue = []; // what was clicked meanwhile would fail the same way
  } finally {
    if (ablation.busy === input) ablation.busy = null;
    if (ablation.running === running) ablation.running = null;
  }
  renderAblation();
  const next = ablation.queue.shift();
  if (next) ablateHead(next.layer, next.head);
}

// The last thing asked goes first: a head waiting its turn, then the ablation under way, then the
// last one done.
function undo() {
  const waiting = ablation.queue.pop();
  const running = !waiting && ablation.running;
  if (waiting || running) {
    const { layer, head } = waiting || running;
    if (running) ablation.running = null;
    updateButtons();
    afterRestore(`Undone: L${layer} H${head} ${waiting ? "will not be ablated" : "is not ablated (its answer is dropped)"}.`);
    return;
  }
  if (!ablation.stack.length) return;
  ablation.stack.pop();
  // The clean picture may show any head; an ablation kept on the stack shows one it changes.
  const current = ablation.stack.at(-1);
  if (current) ablation.shown = headFor(current, false);
  renderAblation();
  afterRestore(current ? `Undone: ${current.ablate.length} still ablated.` : "Undone: no head ablated.");
}

function restoreAll() {
  ablation.stack = [];
  ablation.queue = [];
  ablation.running = null;
  renderAblation();
  afterRestore("Restored: no head ablated.");
}

// A button that disables itself drops keyboard focus to the page's body: it goes to the mode
// menu, the panel's first control, and the status line says what the press did.
function afterRestore(said) {
  status($("ablate-status"), said, "");
  if (document.activeElement === document.body || document.activeElement?.disabled) $("ablate-mode").focus();
}

// The grid strikes through the heads ablated, and says so to a screen reader: they were named only
// in the chips here, far below it, and with several ablated the grid showed none of them.
function markAblatedInGrid(ablate) {
  const modes = new Map(ablate.map((a) => [`${a.layer}:${a.head}`, a.mode]));
  for (const thumb of document.querySelectorAll("#grid .thumb")) {
    const { layer, head } = thumb.dataset;
    const mode = modes.get(`${layer}:${head}`);
    thumb.classList.toggle("ablated", Boolean(mode));
    thumb.setAttribute("aria-label", `Layer ${layer}, head ${head}${mode ? `, ablated (${mode})` : ""}`);
  }
}

// Undo and Restore all while there is something to undo: done, under way or waiting.
function updateButtons() {
  const nothing = !ablation.stack.length && !ablation.running && !ablation.queue.length;
  $("ablate-undo").disabled = nothing;
  $("ablate-clear").disabled = nothing;
}

function renderAblation() {
  const current = ablation.stack.at(-1);
  updateButtons();
  const chips = (current?.ablate || []).map((a) => el("li", { className: "chip", text: `L${a.layer} H${a.head} · ${a.mode}` }));
  $("ablate-list").replaceChildren(...chips);
  markAblatedInGrid(current?.ablate || []);
  const plot = $("ablate-plot");
  plot.dataset.depth = String(ablation.stack.length);
  // Beside the ablated head, its clean weights and what the ablation changed (ablated − clean, on
  // the measures' diverging scale), as Compare shows A, B and A − B: the ablated pattern alone
  // had to be compared by eye with the focused heatmap far above. With nothing ablated, the one
  // plot shows the clean run.
  const cleanPlot = $("ablate-plot-clean");
  const diffPlot = $("ablate-plot-diff");
  const besides = Boolean(current && ablation.clean && ablation.shown);
  for (const div of [cleanPlot, diffPlot]) {
    if (!besides) clearPlot(div);
    div.hidden = !besides;
  }
  if (!ablation.clean || !ablation.shown) {
    clearPlot(plot);
    for (const key of ["layer", "head", "state"]) delete plot.dataset[key]; // the cleared plot's, not the last run's
    $("ablate-ranking").replaceChildren();
    $("ablate-predictions").replaceChildren();
    return;
  }
  const { layer, head } = ablation.shown;
  const tensor = current ? current.attention : ablation.clean;
  const labels = pieceLabels(ablation.tokens);
  // A head in or before the first ablated layer keeps its weights (an ablation silences what a head
  // writes): "after ablating L1 H0" over the clean pattern read as if it had changed.
  const unchanged = current && layer <= Math.min(...current.ablate.map((a) => a.layer));
  // Past two heads the list outgrew the plot's width and both ends of the title were cut, the
  // shown head's name with them; the chips above list every ablated head.
  const listed = current && (current.ablate.length <= 2
    ? current.ablate.map((a) => `L${a.layer} H${a.head} (${a.mode})`).join(", ") : `${current.ablate.length} heads`);
  const what = current ? `after ablating ${listed}${unchanged ? ": weights unchanged" : ""}` : "clean (nothing ablated)";
  const rows = maskLater(headRows(tensor, layer, head), ablation.causal);
  heatmap(plot, rows, { x: labels, y: labels, title: `L${layer} H${head}, ${what}` });
  Object.assign(plot.dataset, { layer, head, state: current ? "ablated" : "clean" });
  if (besides) {
    const clean = maskLater(headRows(ablation.clean, layer, head), ablation.causal);
    heatmap(cleanPlot, clean, { x: labels, y: labels, title: `L${layer} H${head}, clean` });
    const change = rows.map((row, r) => row.map((v, c) => (v === null ? null : v - clean[r][c])));
    heatmap(diffPlot, change, { x: labels, y: labels, signed: true, title: `Ablated − clean · L${layer} H${head}${unchanged ? " (no change)" : ""}` });
    Object.assign(diffPlot.dataset, { layer, head });
  }
  if (!current) {
    $("ablate-ranking").replaceChildren(el("p", { className: "hint", text: "Nothing ablated: the heatmap shows the clean run." }));
    $("ablate-predictions").replaceChildren();
    return;
  }
  $("ablate-ranking").replaceChildren(current.reply.ranking.length
    ? rankingTable(current.reply.ranking, {
      caption: "Downstream heads, most changed first (click to show)",
      shows: "the ablation heatmap",
      onPick: (l, h) => {
        const hadFocus = $("ablate-ranking").contains(document.activeElement);
        ablation.shown = { layer: l, head: h };
        renderAblation(); // a new table: keyboard focus goes to the same head's button in it
        if (hadFocus) $("ablate-ranking").querySelector(`tr[data-layer="${l}"][data-head="${h}"] button`)?.focus();
      },
    })
    : el("p", { className: "hint", text: "No later layer: an ablated head of the last layer changes no other head's weights, only the predictions below." }));
  $("ablate-predictions").replaceChildren(predictionTable(current.reply));
}

function predictionTable(reply) {
  if (!reply.logprob_change) return el("p", { className: "hint", text: "This model has no language-model head: no predictions to compare." });
  if (!reply.logprob_change.length) return el("p", { className: "hint", text: "No position to score (a masked LM needs a [MASK] in the text)." });
  const top = new Map(reply.predictions.positions.map((p, i) => [p, i]));
  const changes = [...reply.logprob_change].sort((a, b) => Math.abs(b.change) - Math.abs(a.change)).slice(0, 8);
  const mean = reply.logprob_change.reduce((s, c) => s + c.change, 0) / reply.logprob_change.length;
  const rows = changes.map((c) => {
    const i = top.get(c.position);
    const guess = (g) => (g ? `${guessLabel(g)} (${g.prob.toFixed(2)})` : "");
    return el("tr", { attrs: { "data-position": c.position } }, [
      el("td", { text: `${c.position}: ${pieceLabel(reply.tokens[c.position])}` }),
      el("td", { text: guessLabel(c) }),
      el("td", { text: c.change.toFixed(3), className: "num" }),
      el("td", { text: `${guess(reply.predictions.before[i]?.[0])} → ${guess(reply.predictions.after[i]?.[0])}` }),
    ]);
  });
  const what = reply.causal ? "the actual next token" : "the clean top guess at the mask";
  // Not the class "predictions": that is the strip under the heatmap, laid out as a flex row.
  return el("table", { className: "exp-table logprob-changes" }, [
    el("caption", { text: `Δ log p of ${what}: mean ${mean.toFixed(3)}; largest changes` }),
    el("thead", {}, [el("tr", {}, ["At", "Target", "Δ log p", "Top guess before → after"].map((t) => el("th", { text: t })))]),
    el("tbody", {}, rows),
  ]);
}

// ---------------------------------------------------------------------------- token change
async function loadTokens() {
  const input = currentInput();
  if (!input) return status($("token-status"), "Run a sentence first.", "error");
  try {
    const reply = await postJson("api/v1/attention", { ...input, layers: [0], heads: [0], format: "u8" });
    if (!stillShown(input)) return;
    const chips = reply.tokens.map((t, i) => {
      const chip = el("button", { className: `chip token${t.special ? " special" : ""}`, text: pieceLabel(t),
        attrs: { type: "button", "data-index": i, title: t.special ? "Special tokens stay" : `Change token ${i}` } });
      chip.disabled = t.special;
      chip.addEventListener("click", () => changeToken(input, i));
      return chip;
    });
    $("token-chips").replaceChildren(...chips);
  } catch (err) {
    if (stillShown(input)) status($("token-status"), describeError(err), "error");
  }
}

// The last token clicked is the one shown: an earlier click's slower answer came after it and
// replaced it, and the first answer back had cleared the status while the other still ran.
let lastChange = 0;

async function changeToken(input, index) {
  const change = $("token-change").value;
  const mine = ++lastChange;
  status($("token-status"), `Running with token ${index} ${change === "delete" ? "deleted" : `as ${change}`}…`, "busy");
  try {
    const reply = await postWithDifference("api/v1/experiments/change-token", { ...input, index, change }, runRows, busyWait($("token-status"), "experiments"));
    if (!stillShown(input) || mine !== lastChange) return;
    const difference = decodeTensor(reply.difference);
    const inA = new Set(reply.pairs.map((p) => p[0]));
    const inB = new Set(reply.pairs.map((p) => p[1]));
    const line = (tokens, kept, name) => el("div", { className: "aligned-line" }, [
      el("span", { className: "line-name", text: name }),
      // Unaligned tokens say so in words too, not only by their red border.
      ...tokens.map((t, i) => el("span", { className: `chip${kept.has(i) ? "" : " unaligned"}`, text: pieceLabel(t) },
        kept.has(i) ? [] : [el("span", { className: "visually-hidden", text: " (unaligned)" })])),
    ]);
    // A head's row opens its before − after on the aligned cells (the rows named heads and showed
    // nothing of what moved in them).
    const plot = el("div", { className: "exp-plot", attrs: { id: "token-plot-diff" } });
    const show = (layer, head) => alignedDifference(plot, reply, difference, layer, head, runCausal, ["before", "after"]);
    $("token-result").replaceChildren(
      line(reply.tokens_a, inA, "Before"), line(reply.tokens_b, inB, "After"),
      el("div", { className: "exp-columns" }, [
        rankingTable(reply.ranking, { caption: "Heads whose aligned rows moved most (click to show)", onPick: show, shows: "the difference heatmap" }),
        plot,
      ]),
    );
    $("token-result").dataset.index = String(index);
    const top = reply.ranking[0];
    if (top) show(top.layer, top.head);
    status($("token-status"), `Done on ${input.model}: token ${index} ${change === "delete" ? "deleted" : `as ${change}`}`
      + (top ? `; L${top.layer} H${top.head} moved most.` : "."), "");
  } catch (err) {
    if (!stillShown(input) || mine !== lastChange) return;
    status($("token-status"), describeError(err), "error");
    // The menu's check could not tell (the server was busy): the refusal tells, and the menu follows it.
    if (lacks(err, change)) {
      changes.set(input.model, { ...changes.get(input.model), [change]: false });
      fitChanges(input.model, runCausal);
    }
  }
}

// ---------------------------------------------------------------------------- which changes a model has
// GET /models lists each model's `token_changes` (GPT-2 and tiny-gpt have no mask or unknown token,
// a BERT both): the page offers only those. model id -> { mask, unk }: true or false; absent until
// the list has come (then everything is offered, and a refusal turns its option off).
const changes = new Map();
const LABELS = { mask: "mask", unk: "unknown token" };

const lacks = (err, change) => err.status === 422 && new RegExp(`has no ${change} token`).test(err.message);

async function askChanges(model) {
  if (changes.has(model)) return;
  const info = (await listModels()).find((m) => m.id === model);
  const has = info?.token_changes;
  if (has) changes.set(model, { mask: has.includes("mask"), unk: has.includes("unk") });
}

// The user's own pick, kept across models that lack it: null until they pick one.
let picked = null;

// The menu for `model`: what it lacks is off and says so; the pick (or by default mask, delete on a
// causal model, which usually has no mask token) where the model has it, else delete.
function fitChanges(model, causal) {
  const menu = $("token-change");
  const known = changes.get(model) ?? {};
  for (const option of menu.options) {
    if (option.value === "delete") continue;
    option.disabled = known[option.value] === false;
    option.textContent = option.disabled ? `${LABELS[option.value]} (${model} has none)` : LABELS[option.value];
  }
  const want = picked ?? (causal ? "delete" : "mask");
  menu.value = known[want] === false ? "delete" : want;
}

// ---------------------------------------------------------------------------- mount
function buildAblation() {
  const mode = el("select", { attrs: { id: "ablate-mode", "aria-label": "Ablation mode" } }, [
    el("option", { text: "zero", attrs: { value: "zero" } }),
    el("option", { text: "mean over positions", attrs: { value: "mean" } }),
  ]);
  const add = el("button", { text: "Ablate focused head", attrs: { id: "ablate-add", type: "button" } });
  add.addEventListener("click", () => ablateHead(Number($("layer").value), Number($("head").value)));
  const undoButton = el("button", { text: "Undo", attrs: { id: "ablate-undo", type: "button", disabled: "" } });
  undoButton.addEventListener("click", undo);
  const clear = el("button", { text: "Restore all", attrs: { id: "ablate-clear", type: "button", disabled: "" } });
  clear.addEventListener("click", restoreAll);
  $("ablate-box").replaceChildren(
    el("h3", { text: "Ablate heads" }),
    el("p", { className: "hint", text: "Alt-click a head in the grid (Alt+Enter on a focused thumbnail), or ablate the focused one. The head's output is zeroed, or replaced by its mean, where it enters the output projection." }),
    el("div", { className: "exp-row" }, [mode, add, undoButton, clear]),
    el("ul", { className: "chips", attrs: { id: "ablate-list", "aria-label": "Ablated heads" } }),
    el("p", { className: "exp-status", attrs: { id: "ablate-status", role: "status", "aria-live": "polite" } }),
    el("div", { className: "exp-columns three" }, [
      el("div", { className: "exp-plot", attrs: { id: "ablate-plot-clean", hidden: "" } }),
      el("div", { className: "exp-plot", attrs: { id: "ablate-plot", "data-depth": "0" } }),
      el("div", { className: "exp-plot", attrs: { id: "ablate-plot-diff", hidden: "" } }),
    ]),
    el("div", { className: "exp-columns" }, [el("div", { attrs: { id: "ablate-ranking" } }), el("div", { attrs: { id: "ablate-predictions" } })]),
  );
  // Alt-click on a grid thumbnail ablates it (a plain click still focuses it, as before); Alt+Enter
  // is the keyboard's Alt-click (a button's keyboard click carries no Alt).
  const ablateThumb = (e) => {
    const cell = e.target.closest?.(".thumb");
    if (!cell || !e.altKey || (e.type === "keydown" && e.key !== "Enter")) return;
    e.preventDefault();
    ablateHead(Number(cell.dataset.layer), Number(cell.dataset.head));
  };
  $("grid").addEventListener("click", ablateThumb);
  $("grid").addEventListener("keydown", ablateThumb);
}

function buildTokenChange() {
  const change = el("select", { attrs: { id: "token-change", "aria-label": "Token change" } }, [
    el("option", { text: "mask", attrs: { value: "mask" } }),
    el("option", { text: "unknown token", attrs: { value: "unk" } }),
    el("option", { text: "delete", attrs: { value: "delete" } }),
  ]);
  change.addEventListener("change", () => { picked = change.value; });
  const load = el("button", { text: "Show tokens", attrs: { id: "token-load", type: "button" } });
  load.addEventListener("click", loadTokens);
  $("token-box").replaceChildren(
    el("h3", { text: "Change a token" }),
    el("p", { className: "hint", text: "Show the sentence's tokens, then click one to replace it with the model's mask or unknown token, or to delete it." }),
    el("div", { className: "exp-row" }, [change, load]),
    el("div", { className: "chips", attrs: { id: "token-chips" } }),
    el("p", { className: "exp-status", attrs: { id: "token-status", role: "status", "aria-live": "polite" } }),
    el("div", { attrs: { id: "token-result" } }),
  );
}

let runCausal = false; // whether the run on screen's model reads only backwards
let runRows = 0; // ...and its tokens, the rows of its weights (an answer's size, for its format)

// Another run on screen: what the panels showed belonged to the last one.
function forgetLastRun(input, { causal, long, tokens }) {
  runCausal = causal;
  runRows = tokens.length;
  fitChanges(input.model, causal);
  askChanges(input.model).then(() => stillShown(input) && fitChanges(input.model, causal), () => {});
  Object.assign(ablation, { input: null, clean: null, tokens: [], stack: [], shown: null, busy: null, queue: [], running: null, off: long });
  lastChange += 1;
  status($("ablate-status"), "");
  renderAblation();
  $("token-chips").replaceChildren();
  $("token-result").replaceChildren();
  delete $("token-result").dataset.index;
  status($("token-status"), "");
}

function mount() {
  if (!$("experiments")) return;
  buildAblation();
  buildTokenChange();
  onRun(forgetLastRun);
  mountCompare($("compare-box"));
  mountGeneration($("generate-box"));
  // Read by the browser tests: what the panels hold, never written to from outside.
  window.manyeyesExperiments = { ablation };
}

mount();
