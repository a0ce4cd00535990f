// The information-flow graph (Ferrando & Voita, 2024) as plain SVG: tokens along the bottom,
// one row of nodes per layer boundary going up, an edge per kept route, its width its weight.
// Clicking a head's edge focuses that head; residual edges (straight up) belong to no head.

import { el } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const ROW = 70; // px between layer rows
const LABEL_ROOM = 70; // px under the bottom row for the token labels
const ROUTES_LISTED = 20;

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

// A route's tokens with their positions: a text's repeated tokens ("c → a" twice) are told apart.
function routeEnds(edge, labels) {
  return `${labels[edge.source]} (#${edge.source}) → ${labels[edge.target]} (#${edge.target})`;
}

const MIN_STEP = 28; // px between tokens: below this the labels collide, so the panel scrolls
const MAX_STEP = 60;
const SIDE_ROOM = 56; // px for the level names on the left and the last label's slant on the right
const UNLAID_WIDTH = 956; // px to fit into while the panel is not laid out (hidden)

export class FlowGraph {
  constructor(root, { onEdge }) {
    this.root = root;
    this.onEdge = onEdge;
    this.drawn = null; // the last render's arguments, to draw again at a new width
    this.drawnWidth = 0;
    // What the colours mean (red is a negative share elsewhere on the page), and where the rest of
    // a graph wider than the panel is: its scroll bar may be an overlay, hidden until touched.
    this.legend = el("p", { className: "hint flow-legend" });
    // The spacing follows the panel's width (a 16-token graph 952 px wide was cut off in a
    // 660 px panel, its scroll bar hidden by overlay scroll bars); a resized panel redraws it.
    new ResizeObserver(() => {
      const width = this.root.clientWidth;
      if (this.drawn && width && Math.abs(width - this.drawnWidth) > 8) this.render(...this.drawn);
    }).observe(root);
  }

  clear(message) {
    this.drawn = null;
    this.root.replaceChildren(el("p", { className: "empty", text: message }));
  }

  render(flow, labels, focused) {
    this.drawn = [flow, labels, focused];
    this.drawnWidth = this.root.clientWidth;
    const { n_layers: nLayers, n_tokens: nTokens, edges } = flow;
    const room = (this.drawnWidth || UNLAID_WIDTH) - SIDE_ROOM;
    const step = Math.max(MIN_STEP, Math.min(MAX_STEP, room / Math.max(nTokens, 1)));
    const width = step * nTokens + SIDE_ROOM;
    const height = ROW * nLayers + LABEL_ROOM + 34;
    const x = (token) => 36 + step * (token + 0.5); // room on the left for the level names
    const y = (level) => 24 + ROW * (nLayers - level); // level 0: the embeddings, at the bottom
    const drawing = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
                                 "aria-label": `Information flow: ${edges.length} routes at threshold ${flow.threshold}` });
    const title = svg("title");
    title.textContent = "Routes between tokens through the layers; click an edge to focus its head";
    drawing.append(title);
    for (let level = 0; level <= nLayers; level++) {
      const name = svg("text", { x: 4, y: y(level) - 4, class: "flow-level" });
      name.textContent = level === 0 ? "emb" : `L${level - 1}`;
      drawing.append(name);
    }
    for (const edge of edges) {
      const onFocus = focused && edge.head === focused.head && edge.layer === focused.layer;
      const line = svg("line", {
        x1: x(edge.source), y1: y(edge.layer), x2: x(edge.target), y2: y(edge.layer + 1),
        "stroke-width": (0.5 + 6 * edge.weight).toFixed(2),
        class: `flow-edge${edge.head === null ? " residual" : ""}${onFocus ? " focused" : ""}`,
        "data-layer": edge.layer, "data-source": edge.source, "data-target": edge.target,
        "data-head": edge.head ?? "", "data-weight": edge.weight,
      });
      line.style.strokeOpacity = String(0.25 + 0.75 * edge.weight);
      const tip = svg("title");
      const through = edge.head === null ? "residual" : `layer ${edge.layer} head ${edge.head}`;
      tip.textContent = `${routeEnds(edge, labels)}: ${(edge.weight * 100).toFixed(1)}% via ${through}`;
      line.append(tip);
      if (edge.head !== null) line.addEventListener("click", () => this.onEdge(edge.layer, edge.head));
      drawing.append(line);
    }
    for (let level = 0; level <= nLayers; level++) {
      for (let t = 0; t < nTokens; t++) drawing.append(svg("circle", { cx: x(t), cy: y(level), r: 3, class: "flow-node" }));
    }
    labels.forEach((label, t) => {
      const text = svg("text", { x: x(t), y: y(0) + 14, class: "flow-token",
                                 transform: `rotate(45 ${x(t)} ${y(0) + 14})` });
      text.textContent = label; // textContent: a token is never markup
      drawing.append(text);
    });
    // A change of focused head redraws the graph only: the route list (maybe open, maybe holding
    // keyboard focus) stays in place, with the focused head's routes marked.
    const list = this.routeList(edges, labels);
    const wide = width > (this.drawnWidth || UNLAID_WIDTH);
    this.legend.textContent = "Red: a head's route (click it to focus that head); blue: the focused head's routes; grey: "
      + `the residual stream.${wide ? ` Scroll sideways for all ${nTokens} tokens.` : ""}`;
    const svgNow = this.root.querySelector(":scope > svg");
    if (list.parentNode === this.root && svgNow) svgNow.replaceWith(drawing);
    else this.root.replaceChildren(this.legend, drawing, list);
    for (const button of list.querySelectorAll(".flow-route")) {
      const on = focused && Number(button.dataset.layer) === focused.layer && Number(button.dataset.head) === focused.head;
      if (on) button.setAttribute("aria-current", "true");
      else button.removeAttribute("aria-current");
    }
  }

  // The strongest head routes as buttons: the graph's text equivalent for screen readers, and
  // its keyboard way in (hundreds of focusable edges would be hundreds of Tab stops). Built once
  // per flow answer.
  routeList(edges, labels) {
    if (this.routes?.edges === edges && this.routes.labels === labels) return this.routes.node;
    const strongest = edges.filter((e) => e.head !== null).sort((a, b) => b.weight - a.weight).slice(0, ROUTES_LISTED);
    const items = strongest.map((edge) => {
      const button = el("button", {
        className: "flow-route plain-button",
        text: `${routeEnds(edge, labels)}: ${(edge.weight * 100).toFixed(1)}% via layer ${edge.layer} head ${edge.head}`,
        attrs: { type: "button", "data-layer": edge.layer, "data-head": edge.head },
      });
      button.addEventListener("click", () => this.onEdge(edge.layer, edge.head));
      return el("li", {}, [button]);
    });
    const summary = el("summary", { text: `The ${strongest.length} strongest routes through heads, as a list` });
    const node = el("details", { className: "flow-routes" }, [summary, el("ol", {}, items)]);
    this.routes = { edges, labels, node };
    return node;
  }
}
