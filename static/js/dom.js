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

export function nextFrame() {
  return new Promise((resolve) => requestAnimationFrame(() => resolve()));
}

// Plots narrower than NARROW_PX keep Plotly's modebar on show over their top line (a phone has no
// hover to hide it): a title there goes MODEBAR_PX lower, under it.
export const NARROW_PX = 520;
export const MODEBAR_PX = 34;
