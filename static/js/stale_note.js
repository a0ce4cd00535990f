// Says when the form no longer holds the run on screen. The view and every panel (ablation,
// compare, generation) act on that run: a person who had edited the sentence or picked another
// model saw the old grid stay with nothing to say so, and "Ablate" answered for the old sentence.

import { $, asTyped } from "./dom.js";
import { onRun } from "./experiment_parts.js";

export function mountStaleNote() {
  const note = $("stale-note");
  const [text, pair, model] = ["text", "pair", "model"].map($);
  let shown = null;

  // What of the form differs from a run's input: [] when it holds that run's.
  const differs = (input) => [
    // a link's text may hold "\r\n", which its text area holds as "\n"
    asTyped(text.value) !== asTyped(input.text) && "sentence",
    (pair.value.trim() ? asTyped(pair.value) : "") !== asTyped(input.text_pair ?? "") && "second sentence",
    model.value !== "" && model.value !== input.model && "model",
  ].filter(Boolean);

  function update() {
    const changed = !shown ? [] : differs(shown);
    note.hidden = changed.length === 0;
    const named = changed.length > 1 ? `${changed.slice(0, -1).join(", ")} and ${changed.at(-1)}` : changed[0];
    // Asked for while a run was going, the form's run goes next: "press Run" told the reader to ask
    // again for what was already on its way.
    const form = $("run-form");
    const running = form.dataset.running ? JSON.parse(form.dataset.running) : null;
    const them = changed.length > 1;
    const next = form.hasAttribute("data-queued") ? `${them ? "they run" : "it runs"} next`
      : running && differs(running).length === 0 ? `${them ? "they are" : "it is"} running`
        : `press Run to see ${them ? "them" : "it"}`;
    note.textContent = changed.length ? `Below is the last run, not the ${named} above: ${next}.` : "";
  }

  onRun((input) => {
    shown = input;
    update();
  });
  for (const field of [text, pair]) field.addEventListener("input", update);
  model.addEventListener("change", update);
  // A Run asked for while one runs queues it (main.js): said at once, not when the run before lands.
  new MutationObserver(update).observe($("run-form"), { attributes: true, attributeFilter: ["data-queued", "data-running"] });
}
