// Direct logit attribution on the page: for one position and one of the model's guesses there,
// how much each head writes directly towards (blue) or against (red) that guess's logit, as a grid
// of layers × heads with each layer's MLP beside its heads, and the sum that makes the logit. The
// numbers are the API's (GET …/logit-attribution, every head); a click on a head focuses it.

import { el } from "./dom.js";
import { HeadFinder } from "./finder.js";
import { signedFill } from "./measures_colours.js";
import { hexToRgb, palette } from "./theme.js";
import { guessLabel } from "./tokens.js";

// "+0.31", "−0.33"; a value that rounds to zero has no sign ("−0.00" read as a push down).
// A cell's push under 0.005 gets a third decimal: "0.00" read as no push at all for +0.0032.
function signed(v, digits = 2) {
  const text = Math.abs(v).toFixed(Math.abs(v) < 0.005 ? Math.max(digits, 3) : digits);
  return Number(text) === 0 ? text : `${v > 0 ? "+" : "−"}${text}`;
}

// Dark text on a light cell, light text on a dark one: the fill is drawn over the paper colour,
// and a strong blue or red under the page's ink colour was unreadable in either theme.
function inkOn(fill) {
  const [r, g, b, a] = fill.match(/[\d.]+/g).map(Number);
  const paper = hexToRgb(palette().paper);
  const [R, G, B] = [r, g, b].map((c, i) => (paper[i] * (1 - a) + c * a) / 255);
  return 0.2126 * R + 0.7152 * G + 0.0722 * B > 0.5 ? "#111111" : "#ffffff";
}

function cell(value, peak, { className, label, attrs = {} }) {
  const fill = signedFill(value, peak);
  const node = el(attrs.type ? "button" : "span", {
    className, text: signed(value),
    attrs: { title: label, "aria-label": label, ...attrs },
  });
  node.style.background = fill;
  node.style.color = inkOn(fill);
  return node;
}

export class AttributionPanel {
  // onSelect(layer, head): a head's cell was clicked; onPick(): the position or guess changed.
  constructor(root, { onSelect, onPick }) {
    this.root = root;
    this.onSelect = onSelect;
    this.selected = null;
    this.position = el("select", { attrs: { id: "attribution-position", "aria-label": "Position whose guess is explained" } });
    this.target = el("select", { attrs: { id: "attribution-target", "aria-label": "Guess whose logit is split" } });
    // Another position offers its own guesses, its top one chosen, before the grid is asked for.
    this.position.addEventListener("change", () => { this.fillTargets(); onPick(); });
    this.target.addEventListener("change", () => onPick());
    this.sum = el("p", { className: "caption", attrs: { id: "attribution-sum" } });
    this.grid = el("div", { className: "attribution-grid", attrs: { role: "group", "aria-label": "Each head's direct push on the guess" } });
    this.legend = el("p", { className: "hint", attrs: { id: "attribution-legend" } });
    this.filters = el("div", { className: "finder-filters" }, [
      el("label", { text: "After ", attrs: { for: "attribution-position" } }), this.position,
      el("label", { text: " the guess ", attrs: { for: "attribution-target" } }), this.target,
    ]);
    // The grid scrolls sideways in its own box: a phone's 340 px held 8 heads and the MLP column only
    // by squeezing values over their neighbours.
    root.replaceChildren(this.filters, this.sum, el("div", { className: "attribution-scroll" }, [this.grid]), this.legend);
    this.labels = [];
    this.predictions = null;
    this.wanted = null;
  }

  // A new run (or new labels for its tokens): positions named as the page names tokens; the last
  // one chosen unless `keep` is a position of this run. ids: the tokens' vocabulary ids, whose
  // next one at a position is the text's own continuation there.
  setTokens(labels, keep = null, ids = this.ids) {
    this.labels = labels;
    this.ids = ids;
    const chosen = keep !== null && keep < labels.length ? keep : labels.length - 1;
    this.position.replaceChildren(...labels.map((label, i) => el("option", { text: `${i}: ${label}`, attrs: { value: i } })));
    this.position.value = String(chosen);
    this.fillTargets();
  }

  // A guess to choose once the run's guesses are offered (a link's; null: the top one).
  want(target) {
    this.wanted = target === null ? null : String(target);
  }

  wantedTarget() {
    return this.wanted === null || this.wanted === undefined ? null : Number(this.wanted);
  }

  // The run's top-k per position (predictions.js), or null before they come: the guesses offered.
  setPredictions(byPosition) {
    this.predictions = byPosition;
    this.fillTargets();
  }

  // The model's top guesses at the position, and the text's own next token there when it is not
  // one of them: why the model did not guess what came is the question a study of a sentence asks.
  fillTargets() {
    const keep = this.target.value;
    const position = Number(this.position.value);
    const top = this.predictions?.[position] ?? [];
    const next = this.ids?.[position + 1];
    const says = (id) => (id === next ? ", the text's next token" : "");
    const options = top.length
      ? top.map((p, i) => el("option", { text: `${guessLabel(p)} (${(p.prob * 100).toFixed(1)}%)${i ? "" : ", the top one"}${says(p.id)}`, attrs: { value: p.id } }))
      : [el("option", { text: "the top one", attrs: { value: "" } })];
    if (next !== undefined && !top.some((p) => p.id === next)) {
      options.push(el("option", { text: `${this.labels[position + 1]}, the text's next token`, attrs: { value: next } }));
    }
    this.target.replaceChildren(...options);
    const offered = (value) => value !== null && [...this.target.options].some((o) => o.value === value);
    if (this.predictions && offered(this.wanted)) this.target.value = this.wanted;
    else if (offered(keep)) this.target.value = keep;
    if (this.predictions) this.wanted = null; // a link's guess is chosen once, when the guesses come
  }

  // Whether the panel shows what it shows unasked: the last token's top guess, no link's guess to
  // choose yet. A link saves that as no choice, so the link is the same before and after it comes.
  isDefault() {
    return Number(this.position.value) === this.labels.length - 1 && this.target.selectedIndex <= 0 && this.wanted === null;
  }

  // What to ask for: { position, target } (target null: the top guess).
  choice() {
    return { position: Number(this.position.value), target: this.target.value === "" ? null : Number(this.target.value) };
  }

  // note: what the panel says instead of a grid ("" for nothing); the controls hide with no run.
  clear(note = "", controls = true) {
    this.filters.hidden = !controls;
    this.sum.textContent = note;
    this.grid.replaceChildren();
    this.legend.textContent = "";
    for (const key of ["position", "target"]) delete this.root.dataset[key];
    this.drawnFrom = null;
  }

  // The theme changed: the same numbers in its colours.
  repaint() {
    if (this.drawnFrom) this.render(...this.drawnFrom);
  }

  // found: the API's answer with every head; shape: { layers, heads } of the model.
  render(found, { layers, heads }) {
    this.drawnFrom = [found, { layers, heads }];
    this.filters.hidden = false;
    const byHead = new Map(found.heads.map((h) => [`${h.layer}:${h.head}`, h.contribution]));
    const headSum = found.heads.reduce((s, h) => s + h.contribution, 0);
    const mlpSum = found.mlps.reduce((s, v) => s + v, 0);
    const biasSum = found.attention_bias.reduce((s, v) => s + v, 0);
    // The heads set the colour scale: an MLP's write is often several times a head's and washed
    // every head out to near white; an MLP past the heads' largest is drawn at full strength.
    const peak = Math.max(1e-12, ...found.heads.map((h) => Math.abs(h.contribution)));
    const after = this.labels[found.position] ?? "";
    this.sum.textContent = `Logit of “${guessLabel({ token: found.target_text, piece: found.target_piece })}” after “${after}”: ${found.logit.toFixed(3)} = `
      + `heads ${signed(headSum, 3)}, MLPs ${signed(mlpSum, 3)}, embeddings ${signed(found.embeddings, 3)}, `
      + `attention biases ${signed(biasSum, 3)}, final norm and output bias ${signed(found.rest, 3)}. `
      + "A head's effect through later layers is not counted here.";
    // Each column at least as wide as its widest value ("−0.33"), then sharing what is left.
    this.grid.style.gridTemplateColumns = `auto repeat(${heads + 1}, minmax(max-content, 1fr))`;
    const strongest = Math.max(...found.mlps.map(Math.abs));
    this.legend.textContent = `Colour: the strongest head's push (${peak.toFixed(2)}) is the fullest colour, red for down.`
      + (strongest > peak ? ` MLP cells past it (up to ${strongest.toFixed(2)}) are drawn at full colour too: read their numbers.` : "");
    const cells = [el("span"), ...[...Array(heads).keys()].map((h) => el("span", { className: "finder-axis", text: `H${h}` })),
                   el("span", { className: "finder-axis", text: "MLP" })];
    for (let layer = 0; layer < layers; layer++) {
      cells.push(el("span", { className: "finder-axis", text: `L${layer}` }));
      for (let head = 0; head < heads; head++) {
        const value = byHead.get(`${layer}:${head}`);
        if (value === undefined) { // beyond the API's top 4,096 of a very large model: too small to rank
          cells.push(el("span", { className: "finder-axis", text: "·", attrs: { title: `Layer ${layer} head ${head}: not among the largest` } }));
          continue;
        }
        const button = cell(value, peak, {
          className: "attribution-cell",
          label: `Layer ${layer} head ${head}: ${signed(value, 4)} to the logit`,
          attrs: { type: "button", "data-layer": layer, "data-head": head, "data-value": value, "aria-pressed": "false" },
        });
        button.addEventListener("click", () => this.onSelect(layer, head));
        button.addEventListener("keydown", (event) => HeadFinder.walk(event, this.grid.querySelectorAll("button[data-head]"), heads));
        cells.push(button);
      }
      cells.push(cell(found.mlps[layer], peak, { className: "attribution-mlp", label: `Layer ${layer} MLP: ${signed(found.mlps[layer], 4)} to the logit`, attrs: { "data-layer": layer, "data-value": found.mlps[layer] } }));
    }
    this.grid.replaceChildren(...cells);
    Object.assign(this.root.dataset, { position: found.position, target: found.target });
    const { layer, head } = this.selected ?? { layer: 0, head: 0 };
    this.select(layer, head);
  }

  // The focused head outlined, and the grid one Tab stop (the focused head's), as the finder's is.
  select(layer, head) {
    this.selected = { layer, head };
    const buttons = [...this.grid.querySelectorAll("button[data-head]")];
    for (const node of buttons) {
      const on = Number(node.dataset.layer) === layer && Number(node.dataset.head) === head;
      node.classList.toggle("selected", on);
      node.setAttribute("aria-pressed", String(on));
    }
    const stop = buttons.find((n) => n.classList.contains("selected")) ?? buttons[0];
    for (const node of buttons) node.tabIndex = node === stop ? 0 : -1;
  }
}
