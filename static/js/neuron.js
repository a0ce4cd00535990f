// The neuron view: for the focused head and one query token, the query vector, every key, the
// elementwise q ⊙ k, the scaled score, the softmax and the value each weight mixes. Vectors are
// drawn as colour strips (measures_colours.js: red negative, the heatmap's blue positive, per-vector
// scale); numbers are text.

import { el } from "./dom.js";
import { weightText } from "./focus.js";
import { signedFill } from "./measures_colours.js";

const CELL = 3; // px per vector component

function strip(vector, label) {
  const canvas = el("canvas", { className: "vec", attrs: { width: vector.length * CELL, height: 12, "aria-label": label, title: label } });
  const ctx = canvas.getContext("2d");
  const peak = Math.max(...vector.map(Math.abs), 1e-12);
  vector.forEach((v, i) => {
    ctx.fillStyle = signedFill(v, peak);
    ctx.fillRect(i * CELL, 0, CELL, 12);
  });
  return canvas;
}

const norm = (v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0));

// A token named with its position: in a repeated text (an induction test's R+R) two key rows read
// "y", and which "y" a weight went to is the question.
const placed = (i, label) => `${i}: ${label}`;

export class NeuronPanel {
  constructor(root, { onQuery }) {
    this.root = root;
    this.query = el("select", { attrs: { id: "neuron-query", "aria-label": "Query token" } });
    this.query.addEventListener("change", () => onQuery(Number(this.query.value)));
    this.note = el("p", { className: "caption", attrs: { id: "neuron-note" } });
    this.about = ""; // what the note says of the view drawn
    this.aside = ""; // and after it, under a mean above: that this is the focused head alone
    // Named by the note above it, which says which head and query token it shows.
    this.table = el("table", { className: "neuron-table", attrs: { id: "neuron-table", "aria-label": "Each key's vector, score, weight and value for the chosen query", "aria-describedby": "neuron-note" } });
    this.scroller = el("div", { className: "finder-scroll neuron-scroll" }, [this.table]);
    root.replaceChildren(
      el("div", { className: "finder-filters" }, [el("label", { text: "Query token ", attrs: { for: "neuron-query" } }), this.query]),
      this.note,
      this.scroller,
    );
  }

  // A clause after the note ("" for none), kept for the views drawn after it.
  setAside(aside) {
    this.aside = aside;
    if (this.about) this.note.textContent = this.about + aside;
  }

  setTokens(labels, chosen) {
    this.query.replaceChildren(...labels.map((label, i) => el("option", { text: placed(i, label), attrs: { value: i } })));
    this.query.value = String(chosen);
  }

  // A new run (or none, a long run's): nothing of the last run's table stays, and the note says
  // what comes (note: "" for nothing). The table was kept until the panel was scrolled to and this
  // run's view drawn, under this run's query tokens.
  clear(note = "") {
    this.about = "";
    this.note.textContent = note;
    this.table.replaceChildren();
    for (const key of ["layer", "head", "query", "strongest"]) delete this.root.dataset[key];
  }

  render(view, labels) {
    const group = view.n_heads / view.n_kv_heads;
    this.about = group > 1
      ? `Layer ${view.layer} head ${view.head} reads key/value head ${view.kv_head} of ${view.n_kv_heads} (grouped-query attention: ${group} query heads share it, so they see the same keys and values).`
      : `Layer ${view.layer} head ${view.head}: its own keys and values (key/value head ${view.kv_head}).`;
    this.note.textContent = this.about + this.aside;
    this.root.dataset.layer = view.layer;
    this.root.dataset.head = view.head;
    this.root.dataset.query = view.query_index;
    const header = el("tr", {}, ["key token", "key k", "q ⊙ k", "score q·k/√d", "softmax", "value v"].map((t) => el("th", { text: t, attrs: { scope: "col" } })));
    const queryRow = el("tr", { className: "neuron-query-row" }, [
      el("th", { text: `query: ${labels[view.query_index]}`, attrs: { scope: "row" } }),
      el("td", {}, [strip(view.query, `query vector, norm ${norm(view.query).toFixed(3)}`)]),
      el("td"), el("td"), el("td"), el("td"),
    ]);
    const rows = view.keys.map((key, j) => {
      const masked = view.scores[j] === null;
      return el("tr", { className: masked ? "masked" : "", attrs: { "data-key": j } }, [
        el("th", { text: placed(j, labels[j]), attrs: { scope: "row" } }),
        el("td", {}, [strip(key, `key ${j}, norm ${norm(key).toFixed(3)}`)]),
        el("td", {}, [strip(view.products[j], `q ⊙ k, sum ${view.products[j].reduce((s, x) => s + x, 0).toFixed(4)}`)]),
        el("td", { className: "num score", text: masked ? "masked" : view.scores[j].toFixed(4) }),
        el("td", { className: "num weight", text: weightText(view.weights[j], 0, 4) }, []),
        el("td", {}, [strip(view.values[j], `value ${j}, norm ${norm(view.values[j]).toFixed(3)}`)]),
      ]);
    });
    this.table.replaceChildren(el("thead", {}, [header]), el("tbody", {}, [queryRow, ...rows]));
    this.showStrongest(view.weights, rows);
  }

  // The box opens on the query's strongest key, not key 0: the query is the last token by
  // default, and at 90 tokens the box showed 16 rows of 1e-7 softmax with the weight ~70 rows
  // further down. Only the box scrolls (its row centred under the sticky header), not the page.
  showStrongest(weights, rows) {
    let best = -1;
    weights.forEach((w, j) => { if (w !== null && (best < 0 || w > weights[best])) best = j; });
    this.root.dataset.strongest = String(best);
    const row = rows[best];
    row?.classList.add("strongest");
    const box = this.scroller;
    if (!row || !box.clientHeight) return;
    const offset = row.getBoundingClientRect().top - box.getBoundingClientRect().top + box.scrollTop;
    box.scrollTop = Math.max(0, offset - (box.clientHeight - row.offsetHeight) / 2);
  }
}
