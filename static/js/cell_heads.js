// One cell of the focused heatmap in every head: a click or tap on (query, key), or Enter on the
// cell cursor, ranks the heads by that weight, each a button that focuses it. "Which head links
// "it" to "animal"?" could be answered only by stepping through all 72 heads.

import { el } from "./dom.js";
import { F16_ZERO, weightText } from "./focus.js";
import { LRI, isolate } from "./tokens.js";

const SHOWN = 10;

export class CellHeads {
  constructor(box, onFocus) {
    this.box = box;
    this.onFocus = onFocus; // (layer, head): focus that head
    this.picked = null; // { run, query, key, name }
  }

  clear() {
    this.picked = null;
    this.box.replaceChildren();
    this.box.hidden = true;
  }

  // The model's weights as the run holds them: 8-bit for a layer whose exact values have not come
  // (the button's title says so), before any hiding or renormalising of the view. Written as the
  // heatmap's reading writes them (weightText): two decimals read 0.0029 as "0.00".
  show(run, query, key, name, layer, head) {
    this.picked = { run, query, key, name };
    const found = [];
    for (let l = 0; l < run.nLayers; l++) {
      for (let h = 0; h < run.nHeads; h++) {
        const weight = run.weightAt(l, h, query, key);
        if (weight !== null) found.push({ layer: l, head: h, weight, precise: run.isPrecise(l, h) });
      }
    }
    found.sort((a, b) => b.weight - a.weight || a.layer - b.layer || a.head - b.head);
    const missing = run.nLayers * run.nHeads - found.length;
    const button = (text, attrs, onClick) => {
      const node = el("button", { text, attrs: { type: "button", ...attrs } });
      node.addEventListener("click", onClick);
      return node;
    };
    const coarse = (run.scale ?? 0) / 2; // what an 8-bit byte rounds either way
    const list = el("ol", { className: "cell-heads-list" }, found.slice(0, SHOWN).map(({ layer: l, head: h, weight, precise }) =>
      el("li", {}, [button(`L${l} H${h} · ${weightText(weight, precise ? F16_ZERO : coarse)}`,
        { "data-layer": l, "data-head": h, "aria-pressed": String(l === layer && h === head),
          ...(precise ? {} : { title: `8-bit value (±${coarse.toPrecision(2)}) until layer ${l}'s exact values come` }) },
        () => this.onFocus(l, h))])));
    const waiting = missing ? ` (${missing} heads still loading)` : "";
    // A name ("#2 ל") is position then label, left to right: in a LEFT-TO-RIGHT ISOLATE an RTL
    // label no longer pulls the arrow and the other name around it (tokens.js isolate).
    const named = (i) => isolate(name(i), LRI);
    this.box.replaceChildren(
      el("p", { className: "hint", text: `${named(query)} → ${named(key)}, the heads by its weight${waiting}; click one to focus it:` }),
      list,
      button("Close", { "aria-label": "Close the heads ranked by one cell", id: "cell-heads-close" }, () => this.clear()),
    );
    this.box.hidden = false;
  }

  // Another head focused: its button is marked; layers that came since are ranked too.
  refresh(layer, head) {
    if (!this.picked) return;
    const { run, query, key, name } = this.picked;
    this.show(run, query, key, name, layer, head);
  }
}
