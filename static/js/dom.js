// DOM helpers that only ever put text in as text: user tokens never reach innerHTML.

export function $(id) {
  return document.getElementById(id);
}

export function el(tag, { text, className, attrs } = {}, children = []) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  for (const child of children) node.append(child);
  return node;
}

// A text as a text area gives it back: every line break "\n" ("\r\n" and a lone "\r" too).
export function asTyped(text) {
  return text.replace(/\r\n?/g, "\n");
}

export function fillSelect(select, options, selected) {
  select.replaceChildren(...options.map(({ value, label }) => {
    const option = el("option", { text: label });
    option.value = String(value);
    return option;
  }));
  if (selected !== undefined) select.value = String(selected);
}

// Plotly reads a small HTML subset in labels ("<b>", "<br>"); entities keep tokens literal.
export function plotlyText(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

// A press on a plot gives it the keyboard, as a press on a control does: Plotly's drag layer
// cancels the press's default, so a clicked heatmap stayed unfocused and its arrows did nothing
// (a page opened from a link or an exported file had no other way in but Tab). Not on the
// modebar, whose buttons take focus themselves.
export function focusOnPress(plot) {
  plot.addEventListener("pointerdown", (event) => {
    if (document.activeElement !== plot && !event.target.closest(".modebar")) plot.focus({ preventScroll: true });
  });
}

// Plotly puts every button of a plot's modebar in the Tab order: seven stops a plot, 35 of the
// 109 on the way through the page (a review by keyboard). One stop a modebar instead, the toolbar
// pattern: Tab reaches its first button (or the last one used), ←/→ (Home/End) move along it.
export function oneStopModebars(root = document.body) {
  const buttons = (bar) => [...bar.querySelectorAll(".modebar-btn")];
  const tame = (bar) => buttons(bar).forEach((button, i) => { button.tabIndex = i ? -1 : 0; });
  new MutationObserver((records) => {
    for (const record of records) {
      for (const node of record.addedNodes) {
        // Plotly's modebar comes in divs; the labels, canvases and SVG a heatmap step adds are skipped at once.
        if (!(node instanceof HTMLDivElement)) continue;
        const bar = node.closest(".modebar");
        if (bar) tame(bar);
        else node.querySelectorAll(".modebar").forEach(tame);
      }
    }
  }).observe(root, { childList: true, subtree: true });
  root.addEventListener("keydown", (event) => {
    const button = event.target instanceof Element ? event.target.closest(".modebar-btn") : null;
    const steps = { ArrowLeft: -1, ArrowRight: 1, ArrowUp: -1, ArrowDown: 1 };
    if (!button || !(event.key in steps || event.key === "Home" || event.key === "End")) return;
    const all = buttons(button.closest(".modebar"));
    const at = all.indexOf(button);
    const next = event.key === "Home" ? 0 : event.key === "End" ? all.length - 1 : (at + steps[event.key] + all.length) % all.length;
    event.preventDefault();
    all.forEach((b, i) => { b.tabIndex = i === next ? 0 : -1; });
    all[next].focus();
  });
}

export function nextFrame() {
  return new Promise((resolve) => requestAnimationFrame(() => resolve()));
}

// Plots narrower than NARROW_PX keep Plotly's modebar on show over their top line (a phone has no
// hover to hide it): a title there goes MODEBAR_PX lower, under it.
export const NARROW_PX = 520;
export const MODEBAR_PX = 34;
