// Says when the form no longer holds the run on screen. The view and every panel (ablation,
// compare, generation) act on that run: a person who had edited the sentence or picked another
// model saw the old grid stay with nothing to say so, and "Ablate" answered for the old sentence.

import { onRun } from "./experiment_parts.js";

const lines = (text) => text.replace(/\r\n?/g, "\n"); // a text area holds "\n" for a link's "\r\n"

export function mountStaleNote() {
  const note = document.getElementById("stale-note");
  const [text, pair, model] = ["text", "pair", "model"].map((id) => document.getElementById(id));
  let shown = null;

  function update() {
    const changed = !shown ? [] : [
      lines(text.value) !== lines(shown.text) && "sentence",
      (pair.value.trim() ? lines(pair.value) : "") !== lines(shown.text_pair ?? "") && "second sentence",
      model.value !== "" && model.value !== shown.model && "model",
    ].filter(Boolean);
    note.hidden = changed.length === 0;
    const named = changed.length > 1 ? `${changed.slice(0, -1).join(", ")} and ${changed.at(-1)}` : changed[0];
    note.textContent = changed.length ? `Below is the last run, not the ${named} above: press Run to see ${changed.length > 1 ? "them" : "it"}.` : "";
  }

  onRun((input) => {
    shown = input;
    update();
  });
  for (const field of [text, pair]) field.addEventListener("input", update);
  model.addEventListener("change", update);
}
