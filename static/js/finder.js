// The head finder: every head of a run with its tags and statistics, as a sortable, filterable
// table and as a grid (layers × heads, tags as letters); a click focuses the head.

import { el } from "./dom.js";

const TAG_LETTER = { "previous-token": "P", induction: "I", "duplicate-token": "D", sink: "S", broad: "B", self: "=", positional: "→" };
const STAT_LABEL = {
  entropy: "entropy", distance: "distance", self: "self", previous: "prev", first: "first",
  delimiter: "delim", duplicate: "dup", induction: "induct",
};

export class HeadFinder {
  constructor(root, { onSelect }) {
    this.root = root;
    this.onSelect = onSelect;
    this.rows = [];
    this.sort = { key: "layer", descending: false };
    this.selected = null;
    this.tagFilter = el("select", { attrs: { id: "finder-tag", "aria-label": "Show heads with this tag" } });
    this.textFilter = el("input", { attrs: { id: "finder-filter", type: "search", placeholder: "L0H3, induction…", "aria-label": "Filter heads" } });
    this.tagFilter.addEventListener("change", () => this.drawTable());
    this.textFilter.addEventListener("input", () => this.drawTable());
    this.grid = el("div", { className: "finder-grid", attrs: { role: "group", "aria-label": "Heads by tag" } });
    // Named, as a caption would: a screen reader announced an unnamed table of numbers.
    this.table = el("table", { className: "finder-table", attrs: { "aria-label": "Every head's statistics and tags; a column's heading sorts by it" } });
    root.replaceChildren(
      el("div", { className: "finder-filters" }, [
        el("label", { text: "Tag ", attrs: { for: "finder-tag" } }), this.tagFilter,
        el("label", { text: " Filter ", attrs: { for: "finder-filter" } }), this.textFilter,
      ]),
      this.grid,
      el("div", { className: "finder-scroll" }, [this.table]),
    );
  }

  render(heads) {
    this.stats = heads.stats;
    this.rows = heads.rows;
    const tags = [...new Set(heads.rows.flatMap((r) => r.tags))].sort();
    const keep = this.tagFilter.value;
    this.tagFilter.replaceChildren(el("option", { text: "any tag", attrs: { value: "" } }),
      ...tags.map((t) => el("option", { text: t, attrs: { value: t } })));
    this.tagFilter.value = tags.includes(keep) ? keep : "";
    this.drawGrid();
    this.drawTable();
  }

  // A new run (or a long one, which gets no measures): the last run's heads go at once, not when
  // this run's answer comes; until then the grid and the table showed another text's tags and statistics.
  // The tag list goes too (it offered the last run's tags), but not the tag chosen: render()
  // keeps it if this run's heads have it. note: what the grid says meanwhile.
  clear(note = "") {
    this.rows = [];
    this.grid.replaceChildren(...(note ? [el("p", { className: "empty", text: note })] : []));
    this.table.replaceChildren();
    const chosen = this.tagFilter.value;
    this.tagFilter.replaceChildren(el("option", { text: "any tag", attrs: { value: "" } }),
      ...(chosen ? [el("option", { text: chosen, attrs: { value: chosen } })] : []));
    this.tagFilter.value = chosen;
  }

  select(layer, head) {
    this.selected = { layer, head };
    for (const node of this.root.querySelectorAll("[data-layer][data-head]")) {
      const on = Number(node.dataset.layer) === layer && Number(node.dataset.head) === head;
      node.classList.toggle("selected", on);
      if (node.tagName !== "TR") node.setAttribute("aria-pressed", String(on));
      else if (on) node.setAttribute("aria-current", "true"); // an empty aria-current means false
      else node.removeAttribute("aria-current");
    }
    this.rove(this.grid.querySelectorAll(".finder-cell"));
    this.rove(this.table.querySelectorAll("tbody tr"));
  }

  // One Tab stop per list (the selected head's, else the first): the grid's 72 cells and the
  // table's 72 rows stood between the finder's filters and the rest of the page.
  rove(nodes) {
    const list = [...nodes];
    const stop = list.find((n) => n.classList.contains("selected")) ?? list[0];
    for (const node of list) node.tabIndex = node === stop ? 0 : -1;
  }

  // The arrows move keyboard focus within a list of nodes: by one, or by `across` (a grid's row);
  // Home and End to its ends. At an edge focus stays (the key still does not scroll the page).
  static walk(event, nodes, across = 0) {
    const list = [...nodes];
    const at = list.indexOf(event.currentTarget);
    const row = across || 1;
    const target = { ArrowRight: across ? at + 1 : undefined, ArrowLeft: across ? at - 1 : undefined,
                     ArrowDown: at + row, ArrowUp: at - row, Home: 0, End: list.length - 1 }[event.key];
    if (target === undefined || at < 0) return;
    event.preventDefault();
    if (target < 0 || target >= list.length || target === at) return;
    list[at].tabIndex = -1;
    list[target].tabIndex = 0;
    list[target].focus();
  }

  pick(row) {
    this.select(row.layer, row.head);
    this.onSelect(row.layer, row.head);
  }

  drawGrid() {
    const nHeads = Math.max(...this.rows.map((r) => r.head)) + 1;
    this.grid.style.gridTemplateColumns = `auto repeat(${nHeads}, minmax(1.8em, 1fr))`;
    const cells = [el("span"), ...[...Array(nHeads).keys()].map((h) => el("span", { className: "finder-axis", text: `H${h}` }))];
    for (const row of this.rows) {
      if (row.head === 0) cells.push(el("span", { className: "finder-axis", text: `L${row.layer}` }));
      const letters = row.tags.map((t) => TAG_LETTER[t] ?? "?").join("");
      const name = `Layer ${row.layer} head ${row.head}: ${row.tags.join(", ") || "no tag"}`;
      const cell = el("button", {
        className: "finder-cell", text: letters || "·",
        attrs: { type: "button", "data-layer": row.layer, "data-head": row.head, "data-tags": row.tags.join(" "),
                 title: name, "aria-label": name, "aria-pressed": "false" },
      });
      if (row.tags.length) cell.classList.add(`tag-${row.tags[0]}`);
      cell.addEventListener("click", () => this.pick(row));
      cell.addEventListener("keydown", (event) => HeadFinder.walk(event, this.grid.querySelectorAll(".finder-cell"), nHeads));
      cells.push(cell);
    }
    this.grid.replaceChildren(...cells);
    if (this.selected) this.select(this.selected.layer, this.selected.head); // marks it and roves both lists
    else this.rove(this.grid.querySelectorAll(".finder-cell"));
  }

  visibleRows() {
    const tag = this.tagFilter.value;
    const words = this.textFilter.value.trim().toLowerCase().split(/[\s,]+/).filter(Boolean); // as the placeholder lists them
    // A head's name matches whole ("l1h1" was also L1 H10 and L1 H11); other words anywhere.
    const named = (w) => /^l\d+h\d+$/.test(w);
    const rows = this.rows.filter((r) => (!tag || r.tags.includes(tag)) && words.every((w) =>
      (named(w) ? `l${r.layer}h${r.head}` === w : `l${r.layer}h${r.head} ${r.tags.join(" ")}`.includes(w))));
    const { key, descending } = this.sort;
    const value = (r) => (key === "layer" ? r.layer * 1e4 + r.head : key === "tags" ? r.tags.join(",") : r.stats[key]);
    rows.sort((a, b) => {
      const [x, y] = [value(a), value(b)];
      const order = x < y ? -1 : x > y ? 1 : 0;
      return descending ? -order : order;
    });
    return rows;
  }

  drawTable() {
    const columns = [["layer", "Head"], ["tags", "Tags"], ...this.stats.map((s) => [s, STAT_LABEL[s] ?? s])];
    const header = el("tr", {}, columns.map(([key, label]) => {
      const sorted = this.sort.key === key;
      const button = el("button", { className: "plain-button", text: label + (sorted ? (this.sort.descending ? " ▼" : " ▲") : ""),
                                    attrs: { type: "button", "data-sort": key } });
      button.addEventListener("click", () => {
        this.sort = { key, descending: sorted ? !this.sort.descending : key !== "layer" && key !== "tags" };
        this.drawTable();
        // The header row is drawn anew: focus stays on this column's button, not the page's body.
        this.table.querySelector(`thead button[data-sort="${key}"]`)?.focus();
      });
      return el("th", { attrs: { scope: "col", "aria-sort": sorted ? (this.sort.descending ? "descending" : "ascending") : "none" } }, [button]);
    }));
    const body = this.visibleRows().map((row) => {
      const tr = el("tr", { attrs: { "data-layer": row.layer, "data-head": row.head, tabindex: "0" } }, [
        el("th", { text: `L${row.layer} H${row.head}`, attrs: { scope: "row" } }),
        el("td", { text: row.tags.join(", ") }),
        ...this.stats.map((s) => el("td", { className: "num", text: row.stats[s].toFixed(s === "distance" ? 1 : 2) })),
      ]);
      tr.addEventListener("click", () => this.pick(row));
      tr.addEventListener("keydown", (event) => {
        if (event.key === "Enter" || event.key === " ") {
          event.preventDefault();
          event.stopPropagation();
          this.pick(row);
        } else {
          HeadFinder.walk(event, this.table.querySelectorAll("tbody tr"));
        }
      });
      return tr;
    });
    this.table.replaceChildren(el("thead", {}, [header]), el("tbody", {}, body));
    if (this.selected) this.select(this.selected.layer, this.selected.head);
    else this.rove(this.table.querySelectorAll("tbody tr"));
  }
}
