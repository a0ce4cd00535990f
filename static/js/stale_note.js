// Says when the form no longer holds the run on screen. The view and every panel (ablation,
// compare, generation) act on that run: a person who had edited the sentence or picked another
// model saw the old grid stay with nothing to say so, and "Ablate" answered for the old sentence.

import { $, asTyped } from "./dom.js";
import { onRun } from "./experiment_parts.js";

export function mountStaleNote() {
  const note = $("stale-note");
  const [text, pair, model] = ["text", "pair", "model"].map($);
  let shown = null;

  function update() {
    const changed = !shown ? [] : [
      // a link's text may hold "\r\n", which its text area holds as "\n"
      asTyped(text.value) !== asTyped(shown.text) && "sentence",
      (pair.value.trim() ? asTyped(pair.value) : "") !== asTyped(shown.text_pair ?? "") && "second sentence",
      model.value !== "" && model.value !== shown.model && "model",
    ].filter(Boolean);
    note.hidden = changed.length === 0;
    const named = changed.length > 1 ? `${changed.slice(0, -1).join(", ")} and ${changed.at(-1)}` : changed[0];
    // Asked for while a run was going, the form's run goes next: "press Run" told the reader to ask
    // again for what was already on its way.
    const next = $("run-form").hasAttribute("data-queued") ? `${changed.length > 1 ? "they run" : "it runs"} next`
      : `press Run to see ${changed.length > 1 ? "them" : "it"}`;
    note.textContent = changed.length ? `Below is the last run, not the ${named} above: ${next}.` : "";
  }

  onRun((input) => {
    shown = input;
    update();
  });
  for (const field of [text, pair]) field.addEventListener("input", update);
  model.addEventListener("change", update);
}
