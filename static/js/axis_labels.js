// The focused heatmap's token labels and axis titles, drawn by the page in an SVG over the plot.
// Plotly laid out and measured every label on each change of shape (hide-special at T=512:
// 130-410 ms a toggle, against 15-50 ms for the same axes without labels); here a label is a
// <text> placed by arithmetic. The groups keep Plotly's class names (xtick, ytick), so what the
// tests and a user's stylesheet knew still applies.

const SVG = "http://www.w3.org/2000/svg";
const TICK = 5; // length of a tick mark, px

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text; // tokens are text, never markup
  return node;
}

export class AxisLabels {
  constructor(parent) {
    this.node = svg("svg", { class: "axis-labels", "aria-hidden": "true" });
    parent.append(this.node);
    this.ticks = { x: [], y: [] };
  }

  // axes: { x: { values, texts, font, angle, top }, y: { values, texts, font }, titles: { x, y }, colors }
  // box: the plot area in the plot's pixels; ranges: the axes' data ranges.
  render(axes, box, ranges) {
    this.axes = axes;
    const { colors } = axes;
    const groups = [];
    this.ticks = { x: [], y: [] };
    for (const axis of ["x", "y"]) {
      const spec = axes[axis];
      spec.values.forEach((value, i) => {
        const text = svg("text", {}, spec.texts[i]);
        text.style.fontSize = `${spec.font}px`;
        text.style.fill = colors.text;
        const mark = svg("line", {});
        mark.style.stroke = colors.muted;
        const group = svg("g", { class: `${axis}tick` }, undefined);
        group.append(mark, text);
        if (axis === "y") {
          text.setAttribute("text-anchor", "end");
          text.setAttribute("dominant-baseline", "central");
          text.setAttribute("x", -(TICK + 3));
          mark.setAttribute("x1", -TICK);
        } else {
          const up = spec.top;
          text.setAttribute("text-anchor", up ? "start" : "end");
          text.setAttribute("dominant-baseline", "central");
          text.setAttribute("transform", `translate(0 ${up ? -(TICK + 3) : TICK + 3}) rotate(${spec.angle})`);
          mark.setAttribute("y1", up ? -TICK : TICK);
        }
        this.ticks[axis].push({ group, value });
        groups.push(group);
      });
    }
    for (const [axis, title] of Object.entries(axes.titles)) {
      if (!title.text) continue;
      const node = svg("text", { class: `${axis}title`, "text-anchor": "middle" }, title.text);
      node.style.fontSize = "12px";
      node.style.fill = colors.muted;
      this.ticks[`${axis}title`] = node;
      groups.push(node);
    }
    this.node.replaceChildren(...groups);
    this.move(box, ranges);
  }

  // Places every label for the ranges now shown (also mid-pan); labels outside the cells hide.
  move(box, ranges) {
    if (!this.axes) return;
    const [x0, x1] = ranges.x;
    const [y0, y1] = ranges.y;
    const px = (v) => box.left + ((v - x0) / (x1 - x0)) * box.width;
    const py = (v) => box.top + ((y1 - v) / (y1 - y0)) * box.height;
    const bottom = box.top + box.height;
    const xEdge = this.axes.x.top ? box.top : bottom;
    for (const { group, value } of this.ticks.x) {
      const x = px(value);
      group.setAttribute("transform", `translate(${x} ${xEdge})`);
      group.style.display = x < box.left - 0.5 || x > box.left + box.width + 0.5 ? "none" : "";
    }
    for (const { group, value } of this.ticks.y) {
      const y = py(value);
      group.setAttribute("transform", `translate(${box.left} ${y})`);
      group.style.display = y < box.top - 0.5 || y > bottom + 0.5 ? "none" : "";
    }
    const { titles } = this.axes;
    if (this.ticks.xtitle) {
      this.ticks.xtitle.setAttribute("x", box.left + box.width / 2);
      this.ticks.xtitle.setAttribute("y", bottom + titles.x.offset);
    }
    if (this.ticks.ytitle) {
      const x = box.left - titles.y.offset;
      const y = box.top + box.height / 2;
      this.ticks.ytitle.setAttribute("transform", `translate(${x} ${y}) rotate(-90)`);
    }
  }

  clear() {
    this.axes = null;
    this.node.replaceChildren();
  }
}
