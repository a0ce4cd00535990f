// The model's own top-k beside each token (the next token for causal LMs, the masked token for MLM
// heads): a strip under the focused heatmap (each token with its top guess, the whole top-k on
// hover), a line in that heatmap's hover for the query row's token, and the same strip under the
// measures' heatmap. Asked for once per run; the heatmap's own code is untouched: the hover line is
// added by a listener on the plot's wrapper, which hears a mousemove after the plot's own listener
// (focus.js) has written the reading and set the tooltip's data-query.

import { describeError, listModels, postAttentionJson } from "./api.js";
import { el } from "./dom.js";

const TOP_K = 5;
// Spans per strip: beyond this many tokens the strip stops (the hover line still has every token).
const STRIP_TOKENS = 1024;

function percent(prob) {
  return `${(prob * 100).toFixed(1)}%`;
}

// "next after “cat”: sat 41.2%, is 9.0%, …" (causal) or "at “[MASK]”: …" (masked LM).
function describeTop(top, label, causal) {
  return `${causal ? "next after" : "at"} “${label}”: ` + top.map((p) => `${p.token} ${percent(p.prob)}`).join(", ");
}

// One span per token: the token, its top guess under it, the whole top-k in its title.
function renderStrip(container, labels, predictions, causal) {
  const shown = labels.slice(0, STRIP_TOKENS);
  const cells = shown.map((label, i) => {
    const top = predictions[String(i)];
    const title = top ? describeTop(top, label, causal) : label;
    // A list item that a screen reader reads as its title: the bare token and guess ran together.
    return el("span", { className: `pred${top ? "" : " none"}`, attrs: { title, "aria-label": title, role: "listitem", "data-position": i } }, [
      el("span", { className: "pred-token", text: label, attrs: { "aria-hidden": "true" } }),
      el("span", { className: "pred-guess", text: top ? top[0].token : "", attrs: { "aria-hidden": "true" } }),
    ]);
  });
  const rest = labels.length - shown.length;
  const tail = rest > 0 ? [el("span", { className: "hint", text: `… and ${rest} more tokens: hover the heatmap to read them.` })] : [];
  const name = causal ? "Next token" : "Masked token";
  container.replaceChildren(el("span", { className: "hint", text: `${name}: ` }),
    el("span", { className: "pred-list", attrs: { role: "list", "aria-label": `${name} guesses` } }, cells), ...tail);
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
    const wrap = plot.parentElement;
    wrap.after(this.strip);
    const annotate = (event) => {
      if (plot.contains(event.target)) this.annotate();
    };
    wrap.addEventListener("mousemove", annotate);
    wrap.addEventListener("pointerup", annotate);
  }

  // A new run: its predictions (one POST from the run cache, no forward pass), drawn into the strip
  // under the focused heatmap and into `others` (the measures' strip). Resolves to the predictions
  // or null (no language-model head, or an error, which the strips say).
  async load(run, request, labels, others = []) {
    const strips = (this.strips = [this.strip, ...others]);
    this.byPosition = null;
    this.labels = labels;
    const token = (this.token = {});
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

  // The query row's top-k under the reading focus.js has just put in the tooltip.
  annotate() {
    const tip = this.tooltip;
    if (tip.hidden || !this.byPosition || tip.dataset.query === undefined) return;
    const query = Number(tip.dataset.query);
    const top = this.byPosition[String(query)];
    if (!top) return;
    tip.textContent += `\n${describeTop(top, this.labels[query] ?? "", this.causal)}`;
    // Wider now: keep it inside the plot, as focus.js does.
    const width = this.plot.getBoundingClientRect().width;
    const left = parseFloat(tip.style.left) || 0;
    tip.style.left = `${Math.max(4, Math.min(left, width - tip.offsetWidth - 4))}px`;
  }
}
