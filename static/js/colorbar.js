// The focused heatmap's colorbar, drawn by the page next to the cells: stepping to a head with
// another peak then changes a few labels instead of making Plotly lay its figure out again.
// (Exports still get Plotly's own colorbar: see FocusView.download.)

import { el } from "./dom.js";

const LOG_TICKS = [[0, "0.0001"], [0.25, "0.001"], [0.5, "0.01"], [0.75, "0.1"], [1, "1"]];

// About five round steps (1, 2, 2.5 or 5 × 10^k) from 0 to top, as Plotly's own axes would pick.
function niceTicks(top) {
  if (!(top > 0)) return [[0, "0"]];
  const rough = top / 5;
  const power = 10 ** Math.floor(Math.log10(rough));
  const multiple = [1, 2, 2.5, 5, 10].find((m) => m * power >= rough);
  const step = multiple * power;
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9) + (multiple === 2.5 ? 1 : 0));
  const ticks = [];
  for (let i = 0; i * step <= top * (1 + 1e-9); i++) ticks.push([(i * step) / top, (i * step).toFixed(decimals)]);
  return ticks;
}

export class Colorbar {
  constructor(parent) {
    this.bar = el("div", { className: "cb-bar" });
    this.labels = el("div", { className: "cb-labels" });
    this.title = el("div", { className: "cb-title" });
    this.node = el("div", { className: "colorbar", attrs: { "aria-hidden": "true" } }, [this.bar, this.labels, this.title]);
    this.node.hidden = true;
    parent.append(this.node);
    this.key = "";
  }

  // box: the cells' rectangle in the plot's pixels; horizontal (phones) puts the bar under it.
  render({ stops, zmax, log, box, horizontal, color }) {
    const node = this.node;
    node.hidden = false;
    node.classList.toggle("horizontal", horizontal);
    node.style.color = color;
    if (horizontal) {
      Object.assign(node.style, { left: `${box.left}px`, top: `${box.top + box.height + 10}px`, width: `${box.width}px`, height: "" });
    } else {
      Object.assign(node.style, { left: `${box.left + box.width + 18}px`, top: `${box.top}px`, height: `${box.height}px`, width: "" });
    }
    const key = JSON.stringify([stops, zmax, log, horizontal]);
    if (key === this.key) return;
    this.key = key;
    this.bar.style.background = `linear-gradient(to ${horizontal ? "right" : "top"}, ${stops.map(([at, c]) => `${c} ${at * 100}%`).join(", ")})`;
    this.title.textContent = log ? "weight (log)" : "weight";
    const ticks = log ? LOG_TICKS : niceTicks(zmax);
    this.labels.replaceChildren(...ticks.map(([at, text]) => {
      const label = el("span", { text });
      label.style[horizontal ? "left" : "bottom"] = `${at * 100}%`;
      return label;
    }));
  }

  hide() {
    this.node.hidden = true;
  }
}
