// Compare two sentences: the heads ranked by how much their aligned rows differ, and one head
// side by side (A, B) with the difference A − B on the aligned cells.

import { ApiError, describeError } from "./api.js";
import { el } from "./dom.js";
import { alignedDifference, busyWait, clearPlot, currentInput, currentModel, decodeTensor, heatmap, maskLater, mountModelLine, onRun, postJson, postWithDifference, rankingTable, runTextPlaceholder, status } from "./experiment_parts.js";
import { pieceLabel } from "./tokens.js";

// A comparison cuts its sentences as the run on screen was cut: ticking "Cut to fit" alone did
// nothing, and the same "too long" came back word for word. The server names the field
// ("text_b: input is ..."); the page names the box.
const COMPARED = { subject: "Sentence", advice: "Shorten it, or tick “Cut to fit” and press Run: a comparison is cut as the run on screen was." };

function comparisonError(err) {
  const field = err instanceof ApiError ? /^text_(a|b): /.exec(err.message) : null;
  if (!field) return describeError(err, COMPARED);
  const named = new ApiError(err.status, err.code, err.message.slice(field[0].length), err.retryAfter);
  return describeError(named, { ...COMPARED, subject: `Sentence ${field[1].toUpperCase()}` });
}

// The fewest tokens the shorter sentence can have, one a word (WordPiece and byte-level BPE both
// split words apart): the server reckons a json difference on the shorter sentence's tokens, and
// refuses it whenever even this many are over its budget.
function shorterAtLeast({ text_a: a, text_b: b }) {
  const words = (text) => text.split(/\s+/).filter(Boolean).length;
  return Math.min(words(a), words(b));
}

export function mountCompare(box) {
  // An empty A is the run's text: the placeholder says so (an example sentence there misled).
  const a = el("input", { attrs: { id: "compare-a", type: "text", "aria-label": "Sentence A", placeholder: "Sentence A (or run one: its text)" } });
  const b = el("input", { attrs: { id: "compare-b", type: "text", "aria-label": "Sentence B", placeholder: "Sentence B, to compare with A" } });
  const go = el("button", { text: "Compare", attrs: { id: "compare-run", type: "button" } });
  const note = el("p", { className: "exp-status", attrs: { id: "compare-status", role: "status", "aria-live": "polite" } });
  const ranking = el("div", { attrs: { id: "compare-ranking" } });
  const modelLine = el("p", { className: "hint model-line", attrs: { id: "compare-model" } });
  mountModelLine(modelLine);
  const plots = ["compare-plot-a", "compare-plot-b", "compare-plot-diff"].map((id) => el("div", { className: "exp-plot", attrs: { id } }));
  box.replaceChildren(
    el("h3", { text: "Compare two sentences" }),
    el("p", { className: "hint", text: "Tokens are aligned on their pieces; heads are ranked by the divergence of their aligned rows." }),
    modelLine,
    el("div", { className: "exp-row" }, [a, b, go]),
    note,
    el("div", { className: "exp-columns three" }, plots),
    ranking,
  );
  const state = { reply: null, difference: null, input: null, shown: null, token: 0 };

  async function show(layer, head) {
    const token = ++state.token;
    state.shown = { layer, head };
    const { reply, input } = state;
    const run = (text) => postJson("api/v1/attention", { text, model: input.model, truncate: input.truncate, layers: [layer], heads: [head], format: "json" });
    try {
      const [ra, rb] = await Promise.all([run(input.text_a), run(input.text_b)]);
      if (token !== state.token) return;
      const pieces = (tokens) => tokens.map(pieceLabel);
      heatmap(plots[0], maskLater(ra.attention.data[0][0], ra.causal), { x: pieces(ra.tokens), y: pieces(ra.tokens), title: `A · L${layer} H${head}` });
      heatmap(plots[1], maskLater(rb.attention.data[0][0], rb.causal), { x: pieces(rb.tokens), y: pieces(rb.tokens), title: `B · L${layer} H${head}` });
      alignedDifference(plots[2], reply, state.difference, layer, head, ra.causal);
    } catch (err) {
      status(note, describeError(err), "error");
    }
  }

  async function compare() {
    const { model, truncate } = currentModel();
    const token = ++state.token;
    const input = { text_a: a.value || currentInput()?.text || "", text_b: b.value, model, truncate };
    forgetComparison(); // a failed comparison, or one refused here, left the last one's heatmaps and ranking under its error
    if (!input.text_a.trim() || !input.text_b.trim()) {
      return status(note, input.text_a.trim() ? "Write sentence B to compare with A." : "Write two sentences to compare.", "error");
    }
    status(note, `Comparing on ${model ?? "the server's default model"}…`, "busy");
    try {
      const reply = await postWithDifference("api/v1/experiments/compare", input, shorterAtLeast(input), busyWait(note, "experiments"));
      if (token !== state.token) return; // another run came on screen meanwhile
      Object.assign(state, { reply, input, difference: decodeTensor(reply.difference) });
      ranking.replaceChildren(rankingTable(reply.ranking, { caption: "Heads whose aligned rows differ most (click to show)", onPick: show, shows: "the difference heatmap" }));
      // The model named: which one answered was said nowhere (a model picked above, not run, is not it).
      status(note, `Done on ${reply.model ?? model}: ${reply.pairs.length} aligned tokens of ${reply.tokens_a.length} and ${reply.tokens_b.length}.`);
      const top = reply.ranking[0];
      await show(top.layer, top.head);
    } catch (err) {
      if (token === state.token) status(note, comparisonError(err), "error");
    }
  }

  function forgetComparison() {
    Object.assign(state, { reply: null, difference: null, input: null, shown: null });
    plots.forEach(clearPlot);
    plots[2].dataset.ready = "false";
    ranking.replaceChildren();
  }

  // Another run on screen, perhaps of another model: the last comparison no longer applies.
  onRun((input) => {
    state.token += 1;
    forgetComparison();
    status(note, "");
    a.placeholder = runTextPlaceholder(input);
  });

  go.addEventListener("click", compare);
  for (const input of [a, b]) input.addEventListener("keydown", (e) => e.key === "Enter" && compare());
  window.manyeyesCompare = state;
}
