// The model's own top-k beside each token (the next token for causal LMs, the masked token for MLM
// heads): a strip under the focused heatmap (each token with its top guess, the whole top-k on
// hover), a line in that heatmap's reading for the query row's token, and the same strip under the
// measures' heatmap. Asked for once per run; the heatmap's own code is untouched: the reading line
// is added whenever focus.js writes the tooltip (hover, tap, or the keyboard's cell cursor).
//
// The strip is a box of a few rows with its own scroll: at 1,000 tokens the whole list was about
// 1,400 px of single letters under a 600 px heatmap (and 700 px more in the measures panel). The
// row read on the heatmap is outlined in it and scrolled into its view, so the guess of the token
// under the pointer or the cursor is always on screen; the rest are a scroll (or, by keyboard, a
// Tab stop and the arrow keys) away, and a screen reader still walks every item of the list.

import { describeError, listModels, postAttentionJson } from "./api.js";
import { el } from "./dom.js";
import { guessLabel } from "./tokens.js";

const TOP_K = 5;
// Spans per strip: beyond this many tokens the strip stops (the hover line still has every token).
const STRIP_TOKENS = 1024;

function percent(prob) {
  return `${(prob * 100).toFixed(1)}%`;
}

// "next after “cat”: sat 41.2%, is 9.0%, …" (causal) or "at “[MASK]”: …" (masked LM). A guessed
// token's spaces are written as the labels write them ("␣the", "␣"): a bare space read as nothing;
// a byte of a split character as its byte (‹E5›, guessLabel): each had read "�".
function describeTop(top, label, causal) {
  return `${causal ? "next after" : "at"} “${label}”: ` + top.map((p) => `${guessLabel(p)} ${percent(p.prob)}`).join(", ");
}

// One span per token: the token, its top guess under it, the whole top-k in its title. The list is
// the strip's scroll box (app's measures.css caps its height); `fitted` says, once it is laid out,
// whether it scrolls (see fitStrip).
function renderStrip(container, labels, predictions, causal) {
  const shown = labels.slice(0, STRIP_TOKENS);
  const cells = shown.map((label, i) => {
    const top = predictions[String(i)];
    const title = top ? describeTop(top, label, causal) : label;
    // A list item that a screen reader reads as its title: the bare token and guess ran together.
    return el("span", { className: `pred${top ? "" : " none"}`, attrs: { title, "aria-label": title, role: "listitem", "data-position": i } }, [
      el("span", { className: "pred-token", text: label, attrs: { "aria-hidden": "true" } }),
      // A guess that is or starts with a space (" the", a bare " ") written as the labels write
      // spaces (␣, ↵; tokens.js), which printed as nothing; data-token keeps the real text.
      el("span", { className: "pred-guess", text: top ? guessLabel(top[0]) : "", attrs: { "aria-hidden": "true", ...(top ? { "data-token": top[0].token } : {}) } }),
    ]);
  });
  const rest = labels.length - shown.length;
  // Past the strip's tokens the heatmap's hover reads the guesses. Both lines said "the rest" of
  // different things ("scroll for the rest" above, "1024 more: hover" below), which contradicted.
  // A touch screen reads a row with a tap (app.css shows one of the two words).
  const tail = rest > 0 ? [el("span", { className: "hint" }, [
    `… and ${rest} more tokens past these: `, el("span", { className: "for-keys", text: "hover" }), el("span", { className: "for-touch", text: "tap" }),
    " their rows in the heatmap to read their guesses.",
  ])] : [];
  const name = causal ? "Next-token guesses" : "Masked-token guesses";
  const list = el("div", { className: "pred-list", attrs: { role: "list", "aria-label": `${name}, ${shown.length} tokens` } }, cells);
  // One line of text, the count after one space: two flex items stood a .5rem gap apart, which
  // read as "Next token:  1000 tokens" on screen and as "Next token:1000 tokens" as text.
  const heading = el("span", { className: "hint pred-name" }, [`${name}: `, el("span", { className: "pred-more", attrs: { "aria-hidden": "true" } })]);
  container.dataset.clipped = String(rest > 0);
  container.replaceChildren(heading, list, ...tail);
  fitStrip(container);
}

// Whether the list scrolls, as laid out now: then it is a Tab stop (the arrow keys and Page Up/Down
// scroll it, as they do any scroll box) and the line above it says how many tokens it holds. A
// short run's list fits and stays out of the Tab order. A strip not laid out (hidden) is left as it is.
function fitStrip(container) {
  const list = container.querySelector(".pred-list");
  if (!list || !list.clientHeight) return;
  const scrolls = list.scrollHeight > list.clientHeight + 1;
  if (scrolls) list.setAttribute("tabindex", "0");
  else list.removeAttribute("tabindex");
  const count = list.children.length;
  container.querySelector(".pred-more").textContent = !scrolls ? ""
    : container.dataset.clipped === "true" ? `the first ${count} tokens, scroll through them; the heatmap row read is outlined.`
    : `${count} tokens, scroll for the rest; the heatmap row read is outlined.`;
}

// Outlines position's item (null: none) and scrolls the list, not the page, to bring it into view.
function markIn(container, position) {
  const list = container.querySelector(".pred-list");
  if (!list) return;
  list.querySelector(".pred.current")?.classList.remove("current");
  const item = position === null ? null : list.children[position];
  if (!item) return;
  item.classList.add("current");
  if (!list.clientHeight) return;
  // offsetTop is the item's top inside the list: the list is its offsetParent (position: relative).
  const top = item.offsetTop;
  const bottom = top + item.offsetHeight;
  if (top < list.scrollTop || bottom > list.scrollTop + list.clientHeight) {
    list.scrollTop = Math.max(0, top - (list.clientHeight - item.offsetHeight) / 2);
  }
}

function hint(container, text) {
  container.replaceChildren(el("span", { className: "hint", text }));
}

export class Predictions {
  // plot: the focused heatmap's element; tooltip: the reading it shows on hover.
  constructor(plot, tooltip) {
    this.plot = plot;
    this.tooltip = tooltip;
    this.byPosition = null; // {position: [{token, id, prob}, …]} of the current run
    this.causal = true;
    this.labels = [];
    this.models = null;
    this.available = false; // the run on screen has predictions to strip
    this.heatmapShown = true; // false while every token is hidden: no heatmap to sit under
    this.strip = el("div", { className: "predictions focus-predictions", attrs: { id: "focus-predictions", "aria-label": "The model's predictions per token" } });
    this.strip.hidden = true;
    plot.parentElement.after(this.strip);
    // Each time focus.js writes a reading into the tooltip (a hover, a tap, a Shift+arrow step of
    // the cell cursor, the cursor read again after a pan), its query's guesses go under it. Pointer
    // listeners missed the keyboard's cursor, whose reading came without a pointer event.
    new MutationObserver(() => this.annotate()).observe(tooltip, { childList: true, characterData: true, subtree: true });
    // A strip laid out anew (shown, or the window resized) may start or stop scrolling.
    this.resized = new ResizeObserver((entries) => entries.forEach((entry) => fitStrip(entry.target)));
    this.resized.observe(this.strip);
    // main.js announces a new run before it draws its heatmaps, and asks for its predictions only
    // after them: the last run's guesses go now, not one drawn frame (or more) later.
    document.addEventListener("manyeyes:run", () => this.forgetRun());
  }

  // The run on screen is about to change: no strip or hover line of the last run's guesses.
  forgetRun() {
    this.token = {}; // a load still in flight for the last run is not drawn
    this.byPosition = null;
    for (const strip of this.strips ?? [this.strip]) hint(strip, "Loading this run's predictions…");
    delete this.strip.dataset.runId;
  }

  // A new run: its predictions (one POST from the run cache, no forward pass), drawn into the strip
  // under the focused heatmap and into `others` (the measures' strip). Resolves to the predictions
  // or null (no language-model head, or an error, which the strips say).
  async load(run, request, labels, others = []) {
    const strips = (this.strips = [this.strip, ...others]);
    for (const strip of others) this.resized.observe(strip); // observing one twice is a no-op
    this.forgetRun(); // again: the measures' strip may be new to it
    this.labels = labels;
    const token = this.token;
    this.models ??= listModels().catch(() => []);
    const info = (await this.models).find((m) => m.id === run.model);
    if (token !== this.token) return null;
    // Under the focused heatmap only when there is something to show; the measures' strip says why not.
    this.available = Boolean(info?.predictions);
    this.showStrip();
    if (!info?.predictions) {
      for (const strip of others) hint(strip, "This model has no language-model head: no predictions.");
      return null;
    }
    try {
      const body = await postAttentionJson({ ...request, format: "u8", layers: [0], heads: [0], predictions: { top_k: TOP_K } });
      if (token !== this.token) return null;
      this.byPosition = body.predictions;
      this.causal = info.causal;
      for (const strip of strips) renderStrip(strip, labels, this.byPosition, this.causal);
      this.strip.dataset.runId = run.runId;
      return this.byPosition;
    } catch (err) {
      if (token === this.token) for (const strip of strips) hint(strip, describeError(err));
      return null;
    }
  }

  // The same run's tokens under other labels: the strips drawn again, nothing asked for.
  relabel(labels) {
    this.labels = labels;
    if (this.byPosition) for (const strip of this.strips) renderStrip(strip, labels, this.byPosition, this.causal);
  }

  // A run this view is not told about (a long run, which the measures skip): nothing shown, and
  // no hover line from the previous run's positions.
  clear() {
    this.token = {};
    this.byPosition = null;
    this.available = false;
    this.showStrip();
    // The measures' strip too: the last run's guesses do not stay on screen under another run.
    for (const strip of this.strips ?? []) strip.replaceChildren();
    delete this.strip.dataset.runId;
  }

  // Whether the focused heatmap is drawn: with every token hidden it gives way to the word that no
  // token is left, which a strip of every token's guess under it contradicted.
  setHeatmapShown(shown) {
    this.heatmapShown = shown;
    this.showStrip();
  }

  showStrip() {
    this.strip.hidden = !(this.available && this.heatmapShown);
  }

  // The query row's top-k under the reading focus.js has just put in the tooltip, once (this
  // line's own write is heard too), and that row's item outlined in the strip and scrolled to.
  annotate() {
    const tip = this.tooltip;
    if (tip.hidden || !this.byPosition || tip.dataset.query === undefined) return;
    const query = Number(tip.dataset.query);
    const top = this.byPosition[String(query)];
    if (!top) return;
    const line = `\n${describeTop(top, this.labels[query] ?? "", this.causal)}`;
    if (tip.textContent.endsWith(line)) return;
    tip.textContent += line;
    // Wider now: keep it inside the plot, as focus.js does.
    const width = this.plot.getBoundingClientRect().width;
    const left = parseFloat(tip.style.left) || 0;
    tip.style.left = `${Math.max(4, Math.min(left, width - tip.offsetWidth - 4))}px`;
    markIn(this.strip, query);
  }

  // The measures' heatmap read at a token's row (null: at none of the strip's): its item outlined
  // in the measures' strip, as the focused heatmap's reading does in its own.
  mark(container, position) {
    if (this.byPosition) markIn(container, position);
  }
}
