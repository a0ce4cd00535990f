// The focus view: one head (or a mean) as a Plotly heatmap with token labels and a reading tooltip.

import { plotlyText } from "./dom.js";
import { palette } from "./theme.js";

const MAX_TICKS = 48;
const MAX_LABEL = 14;

function shortLabel(text) {
  return text.length > MAX_LABEL ? text.slice(0, MAX_LABEL - 1) + "…" : text;
}

// Index-based axes: the same word can occur twice, so labels are ticks, never categories.
function ticks(indices, tokens) {
  const step = Math.max(1, Math.ceil(indices.length / MAX_TICKS));
  const tickvals = [];
  const ticktext = [];
  for (let i = 0; i < indices.length; i += step) {
    tickvals.push(i);
    ticktext.push(plotlyText(shortLabel(tokens[indices[i]].text)));
  }
  return { tickvals, ticktext, tickmode: "array" };
}

export class FocusView {
  constructor(plot, tooltip) {
    this.plot = plot;
    this.tooltip = tooltip;
    this.current = null;
    this.listening = false;
    this.filename = "manyeyes";
    // One config object for the plot's whole life: a changed config makes Plotly.react redraw from scratch.
    const download = (format) => (gd) => window.Plotly.downloadImage(gd, { format, filename: this.filename, scale: format === "png" ? 2 : 1 });
    this.config = {
      responsive: true,
      displaylogo: false,
      modeBarButtonsToRemove: ["toImage", "select2d", "lasso2d", "autoScale2d"],
      modeBarButtonsToAdd: [
        { name: "downloadPng", title: "Download plot as PNG", icon: window.Plotly.Icons.camera, click: download("png") },
        { name: "downloadSvg", title: "Download plot as SVG", icon: window.Plotly.Icons.disk, click: download("svg") },
      ],
    };
  }

  async render({ view, tokens, title, filename }) {
    const pal = palette();
    const nRows = view.rows.length;
    const nCols = view.cols.length;
    const z = new Array(nRows);
    let peak = 0;
    for (let r = 0; r < nRows; r++) {
      const row = new Array(nCols);
      for (let c = 0; c < nCols; c++) {
        // null leaves a gap that shows the masked colour, so masked never reads as zero.
        const v = view.masked(r, c) ? null : view.values[r * nCols + c];
        row[c] = v;
        if (v > peak) peak = v;
      }
      z[r] = row;
    }
    this.current = { view, tokens };
    this.filename = filename;
    const fontSize = Math.max(nRows, nCols) > 64 ? 9 : 11;
    const axisFont = { size: fontSize, color: pal.text };
    const xTicks = ticks(view.cols, tokens);
    const yTicks = ticks(view.rows, tokens);
    // Margins sized from the longest label: Plotly's automargin would cost extra layout passes.
    const labelPx = (t) => 8 + fontSize * 0.62 * Math.max(1, ...t.ticktext.map((s) => s.length));
    // On a phone the colorbar goes under the plot, leaving the width to the matrix.
    const narrow = this.plot.clientWidth < 520;
    const keysSpace = labelPx(xTicks) * 0.87 + (narrow ? 8 : 34);
    const trace = {
      type: "heatmap",
      z,
      colorscale: pal.stops,
      zmin: 0,
      zmax: peak > 0 ? peak : 1,
      // Long inputs: one pixel per cell, scaled by the browser (crisp via CSS), far cheaper than
      // painting hundreds of thousands of bricks; shorter ones keep bricks, which export crisply too.
      zsmooth: Math.max(nRows, nCols) > 200 ? "fast" : false,
      hoverinfo: "none",
      colorbar: narrow
        ? { orientation: "h", y: -0.03, yanchor: "top", thickness: 10, len: 0.9, outlinewidth: 0, title: { text: "weight", side: "top" } }
        : { title: { text: "weight", side: "right" }, thickness: 12, outlinewidth: 0 },
    };
    const layout = {
      title: { text: plotlyText(title), font: { size: 15, color: pal.text }, x: 0.02, xanchor: "left", y: 0.995, yanchor: "top" },
      paper_bgcolor: pal.paper,
      plot_bgcolor: pal.masked,
      font: { color: pal.text, family: "system-ui, -apple-system, Segoe UI, sans-serif" },
      margin: {
        t: narrow ? 30 + keysSpace : 40,
        r: 10,
        b: narrow ? 50 : keysSpace,
        l: labelPx(yTicks) + (narrow ? 4 : 30),
      },
      xaxis: {
        ...xTicks, tickangle: -60, tickfont: axisFont, side: narrow ? "top" : "bottom",
        title: { text: narrow ? "" : "key (attended to)", font: { color: pal.muted, size: 12 }, standoff: 6 },
        showgrid: false, zeroline: false, constrain: "domain",
      },
      yaxis: {
        ...yTicks, tickfont: axisFont, autorange: "reversed",
        title: { text: narrow ? "" : "query (attending)", font: { color: pal.muted, size: 12 }, standoff: 6 },
        showgrid: false, zeroline: false, scaleanchor: nRows === nCols ? "x" : undefined, constrain: "domain",
      },
    };
    await window.Plotly.react(this.plot, [trace], layout, this.config);
    if (!this.listening) this.listen();
  }

  listen() {
    this.listening = true;
    this.plot.on("plotly_hover", (event) => {
      const point = event.points[0];
      if (!point || !this.current) return;
      const { view, tokens } = this.current;
      const r = point.pointIndex[0];
      const c = point.pointIndex[1];
      const query = tokens[view.rows[r]].text;
      const key = tokens[view.cols[c]].text;
      const reading = view.masked(r, c) ? "masked" : view.values[r * view.cols.length + c].toFixed(3);
      this.tooltip.textContent = `${query} → ${key}: ${reading}`;
      this.tooltip.dataset.query = view.rows[r];
      this.tooltip.dataset.key = view.cols[c];
      this.tooltip.hidden = false;
      const box = this.plot.getBoundingClientRect();
      const x = event.event.clientX - box.left;
      const y = event.event.clientY - box.top;
      this.tooltip.style.left = `${Math.min(x + 14, box.width - this.tooltip.offsetWidth - 4)}px`;
      this.tooltip.style.top = `${y + 16}px`;
    });
    this.plot.on("plotly_unhover", () => {
      this.tooltip.hidden = true;
    });
  }
}
