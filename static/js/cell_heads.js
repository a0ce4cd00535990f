// One cell of the focused heatmap in every head: a click or tap on (query, key), or Enter on the
// cell cursor, ranks the heads by that weight, each a button that focuses it. "Which head links
// "it" to "animal"?" could be answered only by stepping through all 72 heads.

import { $, el } from "./dom.js";
import { F16_ZERO, weightText } from "./focus.js";
import { LRI, isolate } from "./tokens.js";

const SHOWN = 10;

export class CellHeads {
  // exactCell(run, query, key): a promise of the cell in every head, (layers × heads) float32 from
  // the server (null when it could not come): 8-bit values 1/255 apart ranked two heads 0.001
  // apart the wrong way round, and left out the tenth.
  constructor(box, onFocus, exactCell) {
    this.box = box;
    this.onFocus = onFocus; // (layer, head): focus that head
    this.exactCell = exactCell;
    this.picked = null; // { run, query, key, name, exact }
    this.focused = { layer: 0, head: 0 };
    // "run query key" -> the promise of that cell's exact values: a cell picked again while its
    // values were on their way was asked nothing (the request was pending), and the first answer
    // was for a pick that no longer stood, so the ranking stayed 8-bit.
    this.asked = new Map();
  }

  clear() {
    this.picked = null;
    this.asked.clear();
    this.box.replaceChildren();
    this.box.hidden = true;
  }

  // The model's weights, before any hiding or renormalising of the view: the cell's exact values
  // once they come, meanwhile the run's, 8-bit for a layer whose exact values have not come (the
  // hint and each such button's title say so). Written as the heatmap's reading writes them
  // (weightText): two decimals read 0.0029 as "0.00".
  show(run, query, key, name, layer, head) {
    const picked = { run, query, key, name, exact: null };
    this.picked = picked;
    this.render(layer, head);
    // Asked even where every head's float16 values are here: the heatmap's reading of a cell is
    // float32, and a ranking from float16 disagreed with it (2.4e-7 for 2.1e-7, 0.157 for 0.156).
    const cell = `${run.runId} ${query} ${key}`;
    if (!this.asked.has(cell)) {
      const asking = this.exactCell(run, query, key);
      this.asked.set(cell, asking);
      asking.then((exact) => exact || this.asked.delete(cell)); // a failure may be asked again
    }
    this.asked.get(cell).then((exact) => {
      if (this.picked !== picked) return;
      // Failed: a long run, which holds no weight of its own, had said "still loading" for good.
      if (!exact) picked.failed = true;
      else picked.exact = exact;
      this.render(this.focused.layer, this.focused.head);
    });
  }

  render(layer, head) {
    this.focused = { layer, head };
    const { run, query, key, name, exact } = this.picked;
    const found = [];
    for (let l = 0; l < run.nLayers; l++) {
      for (let h = 0; h < run.nHeads; h++) {
        const weight = exact ? exact[l * run.nHeads + h] : run.weightAt(l, h, query, key);
        if (weight !== null) found.push({ layer: l, head: h, weight, precise: Boolean(exact) || run.isPrecise(l, h) });
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
    // The server's float32 is the weight itself; the run's own float16 rounds to 0 under 3e-8.
    const floor = exact ? 0 : F16_ZERO;
    const list = el("ol", { className: "cell-heads-list" }, found.slice(0, SHOWN).map(({ layer: l, head: h, weight, precise }) =>
      el("li", {}, [button(`L${l} H${h} · ${weightText(weight, precise ? floor : coarse)}`,
        { "data-layer": l, "data-head": h, "data-exact": String(Boolean(exact)), "aria-pressed": String(l === layer && h === head),
          ...(precise ? {} : { title: `8-bit value (±${coarse.toPrecision(2)}) until layer ${l}'s exact values come` }) },
        () => this.onFocus(l, h))])));
    const { failed } = this.picked;
    const notes = [missing && (failed ? `${missing} heads could not be read (see above); pick it again to retry` : `${missing} heads still loading`),
      found.some((f) => !f.precise) && (failed ? "8-bit values: the exact ones could not be read" : "8-bit values until the exact ones come")];
    const waiting = notes.some(Boolean) ? ` (${notes.filter(Boolean).join("; ")})` : "";
    // A name ("#2 ל") is position then label, left to right: in a LEFT-TO-RIGHT ISOLATE an RTL
    // label no longer pulls the arrow and the other name around it (tokens.js isolate).
    const named = (i) => isolate(name(i), LRI);
    // Drawn again when the exact values come: the button that had the keyboard keeps it.
    const had = this.box.contains(document.activeElement) ? document.activeElement : null;
    this.box.replaceChildren(
      // app.css shows one of the two words: a mouse's or a touch screen's.
      el("p", { className: "hint" }, [`${named(query)} → ${named(key)}, the heads by its weight${waiting}; `,
        el("span", { className: "for-keys", text: "click" }), el("span", { className: "for-touch", text: "tap" }), " one to focus it:"]),
      list,
      button("Close", { "aria-label": "Close the heads ranked by one cell", id: "cell-heads-close" }, () => this.clear()),
    );
    this.box.hidden = false;
    if (had?.id === "cell-heads-close") $("cell-heads-close").focus({ preventScroll: true });
    else if (had?.dataset.layer) {
      this.box.querySelector(`button[data-layer="${had.dataset.layer}"][data-head="${had.dataset.head}"]`)?.focus({ preventScroll: true });
    }
  }

  // Another head focused: its button is marked; layers that came since are ranked too.
  refresh(layer, head) {
    if (this.picked) this.render(layer, head);
  }
}
