// Step through generation (causal models): tokens stream in as JSON lines; play, pause, step back
// and forward; the current token's row in every head, and one head's rows growing. Stop aborts the
// stream, and the server stops within one step of the hang-up.

import { describeError, listModels, requestResponse, serverLimits, whenNotBusy } from "./api.js";
import { $, el, fillSelect } from "./dom.js";
import { busyWait, clearPlot, currentInput, currentModel, decodeTensor, headRows, heatmap, mountModelLine, onRun, postPrecise, runTextPlaceholder, status } from "./experiment_parts.js";
import { guessLabel, pieceLabel, tokenCount } from "./tokens.js";

const PLAY_MS = 350;

// A prompt over the model's positions: generation cannot cut, so no "Cut to fit" in the advice.
const PROMPT = { subject: "Prompt", advice: "Write a shorter prompt, leaving room for the new tokens." };

// The prompt an empty box stands for: the run on screen. A run cut to fit covers only the start of
// its text (the kept tokens' characters; the server counts them in code points). Generation cannot
// cut, and the prompt shares the model's positions with the new tokens: a cut run fills them all,
// so its prompt keeps the first tokens that leave room for `n` new ones. Returns { text, cut } or { error }.
function runPrompt(input, run, n, info) {
  if (!input.truncate || !run || !info || !(Number.isInteger(n) && n >= 1)) return { text: input.text };
  const own = run.tokens.filter((t) => t.segment === 0); // a pair's second text is not the prompt
  const specials = own.filter((t) => t.special).length; // [CLS]/[SEP] or BOS, added again to the prompt
  const words = own.filter((t) => !t.special);
  const room = info.max_tokens - n - specials;
  if (!run.truncated && words.length <= room) return { text: input.text };
  if (room < 1) {
    return { error: `${n} new tokens leave no room for a prompt in ${info.id}'s ${info.max_tokens} positions: ask for at most ${info.max_tokens - specials - 1}.` };
  }
  // Cut after the last kept token, or before the first dropped one where that starts earlier: the
  // byte tokens of one character each span the whole character, and cutting after the first of
  // them kept the character's other bytes too (a prompt 1-3 tokens over the room).
  const kept = Math.min(room, words.length);
  const end = Math.min(words[kept - 1].end, words[kept]?.start ?? Infinity);
  if (end <= words[0].start) {
    // The room ends inside the first character (an emoji's 4 byte tokens): an empty prompt, which
    // the server refused with words about the text's length.
    const first = words.findIndex((t) => t.start > words[0].start);
    const needed = first < 0 ? words.length : first;
    return { error: `${n} new tokens leave no room for the prompt's first character (${tokenCount(needed)}) in ${info.id}'s ${info.max_tokens} positions: ask for at most ${info.max_tokens - specials - needed}.` };
  }
  return { text: Array.from(input.text).slice(0, end).join(""), cut: true };
}

const newTokens = (n) => `${n} new token${n === 1 ? "" : "s"}`;

// A body whose connection drops (the server stopped, a proxy cut it) ends here as a stream with
// no end line, which the caller says was cut off: its read rejects with a TypeError "network
// error", which read as a fault of the page's. Stop's abort stays an abort.
async function* ndjson(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read().catch((err) => {
      if (err.name === "AbortError") throw err;
      return { done: true };
    });
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).trim();
      buffer = buffer.slice(newline + 1);
      if (line) yield JSON.parse(line);
    }
    if (done) return;
  }
}

export function mountGeneration(box) {
  const field = (label, input) => el("label", { className: "inline-field" }, [el("span", { text: label }), input]);
  // An empty prompt is the run's text: the placeholder says so (an example there misled).
  const prompt = el("input", { attrs: { id: "gen-text", type: "text", "aria-label": "Prompt", placeholder: "A prompt (or run a sentence: its text)" } });
  const count = el("input", { attrs: { id: "gen-n", type: "number", min: 1, max: 256, value: 20 } });
  const temperature = el("input", { attrs: { id: "gen-temp", type: "number", min: 0, max: 10, step: 0.1, value: 0 } });
  const seed = el("input", { attrs: { id: "gen-seed", type: "number", min: 0, placeholder: "random" } });
  const stopAtEos = el("input", { attrs: { id: "gen-eos", type: "checkbox", checked: "" } });
  const eosField = el("label", { className: "inline-field", attrs: { title: "End the generation at the model's end-of-text token, as Hugging Face's generate does" } },
                      [stopAtEos, el("span", { text: "Stop at end of text" })]);
  const button = (id, text, title) => el("button", { text, attrs: { id, type: "button", title: title || text } });
  const start = button("gen-start", "Generate");
  const stop = button("gen-stop", "Stop", "Stop the generation (the server stops too)");
  const back = button("gen-back", "◀", "Step back");
  const play = button("gen-play", "Play");
  const forward = button("gen-forward", "▶", "Step forward");
  back.setAttribute("aria-label", "Step back");
  forward.setAttribute("aria-label", "Step forward");
  const layer = el("select", { attrs: { id: "gen-layer", "aria-label": "Layer of the growing heatmap" } });
  const head = el("select", { attrs: { id: "gen-head", "aria-label": "Head of the growing heatmap" } });
  const where = el("span", { className: "hint", attrs: { id: "gen-position", "aria-live": "polite" } });
  const note = el("p", { className: "exp-status", attrs: { id: "gen-status", role: "status", "aria-live": "polite" } });
  const why = el("p", { className: "hint", attrs: { id: "gen-why" } }); // why Generate is off, when it is
  why.hidden = true;
  // What is wrong with the tokens box, under it as it is typed in: 1500 went to the server, whose
  // refusal ("the number of tokens is at most 256") read as if the prompt were too long.
  const countNote = el("p", { className: "exp-field-error", attrs: { id: "gen-n-note" } });
  countNote.hidden = true;
  count.setAttribute("aria-describedby", "gen-n-note");
  start.setAttribute("aria-describedby", "gen-why");
  const tokens = el("div", { className: "gen-tokens", attrs: { id: "gen-tokens" } });
  const rowPlot = el("div", { className: "exp-plot", attrs: { id: "gen-row-plot" } });
  const growPlot = el("div", { className: "exp-plot", attrs: { id: "gen-grow-plot" } });
  const modelLine = el("p", { className: "hint model-line", attrs: { id: "gen-model" } });
  mountModelLine(modelLine);
  box.replaceChildren(
    el("h3", { text: "Step through generation" }),
    el("p", { className: "hint", text: "Causal models only. Greedy at temperature 0; a seed makes a sample repeat." }),
    modelLine,
    el("div", { className: "exp-row" }, [prompt, field("tokens", count), field("temperature", temperature), field("seed", seed), eosField, start, stop]),
    countNote,
    why,
    el("div", { className: "exp-row" }, [back, play, forward, where, field("layer", layer), field("head", head)]),
    note, tokens,
    el("div", { className: "exp-columns" }, [rowPlot, growPlot]),
  );
  // epoch: bumped when another run comes on screen, so a stream it stopped leaves no trace.
  // reason: the server's end line's ("length", "eos", ...), once it has come.
  const state = { start: null, prompt: null, steps: [], current: -1, follow: true, running: false, controller: null, timer: null, outcome: "", reason: "", epoch: 0 };
  window.manyeyesGeneration = state;

  // A button that disables itself under keyboard focus drops the focus to the page: it moves on to
  // the nearest control still enabled (Generate <-> Stop, ◀ -> ▶ at the first token).
  const neighbours = new Map([[start, [stop, prompt]], [stop, [start, prompt]], [back, [forward, play, prompt]],
                              [forward, [back, play, prompt]], [play, [back, forward, prompt]]]);

  function setButtons() {
    const focused = document.activeElement;
    stop.disabled = !state.running;
    start.disabled = state.running || Boolean(why.textContent);
    back.disabled = state.current <= 0;
    forward.disabled = state.current >= state.steps.length - 1;
    play.textContent = state.timer ? "Pause" : "Play";
    play.disabled = state.steps.length < 2;
    if (focused?.disabled) neighbours.get(focused)?.find((b) => !b.disabled)?.focus();
    // Playing or streaming moves a step every few hundred ms or faster: announcing each would
    // drown the reader (the status line says when the stream ends).
    where.setAttribute("aria-live", state.timer || state.running ? "off" : "polite");
  }

  function pieces() {
    // A generated token is read on its own (no characters of the prompt's to check a piece against):
    // guessLabel, so a byte of a split character shows as ‹E5›, not "�" for every byte.
    return [...state.start.prompt.map(pieceLabel), ...state.steps.map((s) => guessLabel(s.token))];
  }

  function render() {
    setButtons();
    if (state.current < 0) return;
    const step = state.steps[state.current];
    const all = pieces();
    const promptLength = state.start.prompt.length;
    tokens.replaceChildren(...all.map((text, i) => el("span", {
      className: `chip${i >= promptLength ? " generated" : ""}${i === step.position ? " current" : ""}${i > step.position ? " later" : ""}`,
      text, attrs: i === step.position ? { "aria-current": "true" } : {},
    })));
    const label = guessLabel(step.token);
    sayWhere();
    const { n_layers: L, n_heads: H } = state.start;
    const names = [];
    const z = [];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) { names.push(`L${l} H${h}`); z.push(step.attention[l][h]); }
    const keys = all.slice(0, step.position + 1);
    heatmap(rowPlot, z, { x: keys, y: names, yHeads: true, title: `Row of “${label}” in every head` });
    rowPlot.dataset.index = String(state.current);
    // The full heatmap so far: the prompt's rows (a causal prompt's rows never change as tokens
    // are added) over the generated tokens' rows. The keys after a row's own token are null, drawn
    // masked: the prompt's rows carry zeros there, which drew the same mask as weights of 0.
    const l = Number(layer.value), h = Number(head.value);
    const width = step.position + 1;
    const seen = (row, position) => [...row.slice(0, position + 1), ...Array(width - position - 1).fill(null)];
    const promptRows = state.prompt ? headRows(state.prompt, l, h).map(seen) : [];
    const generated = state.steps.slice(0, state.current + 1);
    const grown = [...promptRows, ...generated.map((s) => seen(Array.from(s.attention[l][h]), s.position))];
    const rowNames = [...all.slice(0, promptRows.length), ...generated.map((s) => guessLabel(s.token))];
    // Without the prompt's rows the first row is the first generated token's, at the prompt's length.
    const title = state.prompt ? `L${l} H${h}: the heatmap so far` : `L${l} H${h}: the generated tokens' rows (the prompt's are not shown)`;
    heatmap(growPlot, grown, { x: all.slice(0, width), y: rowNames, yFirst: state.prompt ? 0 : promptLength, title });
    growPlot.dataset.rows = String(grown.length);
  }

  // Which token is shown, of how many have come.
  function sayWhere() {
    const step = state.steps[state.current];
    if (!step) return;
    where.textContent = `Token ${state.current + 1} of ${state.steps.length}: “${guessLabel(step.token)}” (p ${step.token.prob.toFixed(3)})`;
  }

  function go(index) {
    state.current = Math.max(0, Math.min(index, state.steps.length - 1));
    state.follow = state.current === state.steps.length - 1 && state.running;
    render();
  }

  // Steps can arrive faster than two heatmaps draw: draw the newest once per frame, so the page
  // (and its Stop button) never falls behind the stream.
  let frame = 0;
  function followSoon() {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      if (state.follow && !state.timer) go(state.steps.length - 1);
    });
  }

  function pause() {
    clearInterval(state.timer);
    state.timer = null;
    setButtons();
  }

  // The prompt's own rows, for the full heatmap; the run cache usually has them already. A long
  // prompt's run keeps queries and keys, not weights (its answer has none): its rows are left out.
  // `mine`: the generation asking. A reply that comes after the next generation began is not its
  // prompt's: it drew the last prompt's rows over the new tokens (same token count, another text).
  async function loadPrompt(body, mine, signal) {
    const { n_layers: layers, n_heads: heads, prompt } = state.start;
    try {
      const reply = await postPrecise("api/v1/attention", (format) => ({ text: body.text, model: body.model, format }),
        layers * heads * prompt.length ** 2, undefined, signal);
      if (mine !== state.epoch) return;
      if (reply.tokens.length !== state.start?.prompt.length) return; // not the same tokens: leave the prompt out
      if (!reply.attention) return render();
      state.prompt = decodeTensor(reply.attention);
      render();
    } catch (err) {
      if (err.name !== "AbortError" && mine === state.epoch) status(note, `The prompt's rows could not be loaded: ${describeError(err)}`, "error");
    }
  }

  // The tokens box against its bounds (its max: the server's max_new_tokens, once GET /models has
  // said it), said under it; returns what is wrong, or "" (an empty box is the default, 20).
  function checkCount() {
    const n = Number(count.value);
    const problem = count.value.trim() === "" ? ""
      : count.validity.badInput || !Number.isInteger(n) || n < 1 ? "Tokens: a whole number, 1 or more."
        : n > Number(count.max) ? `Tokens: at most ${count.max} new tokens; ${n} asked for.` : "";
    countNote.textContent = problem;
    countNote.hidden = !problem;
    count.setAttribute("aria-invalid", String(Boolean(problem)));
    return problem;
  }
  count.addEventListener("input", checkCount);

  async function generate() {
    // Enter in the prompt while a stream runs: a second stream would interleave its steps with the first's.
    if (state.running) return;
    if (why.textContent) return status(note, why.textContent, "error"); // Enter in the prompt, with Generate off
    const input = currentInput();
    if (!prompt.value.trim() && !input) return status(note, "Write a prompt, or run a sentence: its text is the default prompt.", "error");
    const seedDigits = seed.value.trim();
    if (seed.validity.badInput || (seedDigits !== "" && !/^\d+$/.test(seedDigits))) {
      return status(note, "A seed is a whole number, 0 or more (empty: a random sample).", "error");
    }
    // An empty box is the default; a bad count or temperature is refused as the server's 422 is
    // (the last generation's picture goes), in the form's words: the server's named the API's
    // fields ("max_new_tokens: Input should be greater than or equal to 1").
    const n = count.value.trim() === "" ? 20 : Number(count.value);
    const heat = temperature.value.trim() === "" ? 0 : Number(temperature.value);
    const refusal = checkCount()
      || (temperature.validity.badInput || !(heat >= 0 && heat <= 10) ? "Temperature: a number from 0 (greedy) to 10." : "");
    const model = currentModel().model;
    const info = modelList.find((m) => m.id === model);
    const { text, cut, error } = prompt.value.trim() ? { text: prompt.value } : runPrompt(input, shownRun, n, info);
    if (error) return status(note, error, "error");
    pause();
    const body = { text, model, max_new_tokens: n, temperature: heat, stop_at_eos: stopAtEos.checked };
    let json = JSON.stringify(body);
    // The seed goes as typed: the API takes up to 2^64 - 1, and Number() rounds past 2^53
    // (9007199254740993 was sent as ...992, another sample). JSON allows no leading zeros.
    if (seedDigits !== "") json = `${json.slice(0, -1)},"seed":${seedDigits.replace(/^0+(?=\d)/, "")}}`;
    const mine = ++state.epoch;
    state.controller?.abort(); // the last generation's prompt rows, if they are still on their way
    Object.assign(state, { start: null, prompt: null, steps: [], current: -1, follow: true, running: true, outcome: "", reason: "", controller: new AbortController() });
    // The last generation's picture goes with its tokens: a refused one left it under the error.
    tokens.replaceChildren();
    where.textContent = "";
    [rowPlot, growPlot].forEach(clearPlot);
    status(note, `Generating with ${model ?? "the server's default model"}…`, "busy");
    setButtons();
    let failure = "";
    try {
      if (refusal) throw new RangeError(refusal);
      const init = { method: "POST", headers: { "Content-Type": "application/json" }, body: json, signal: state.controller.signal };
      const response = await whenNotBusy(() => requestResponse("api/v1/generate", init), state.controller.signal, busyWait(note, "generations"));
      for await (const event of ndjson(response)) {
        if (mine !== state.epoch) break;
        if (event.type === "start") {
          state.start = event;
          loadPrompt(body, mine, state.controller.signal);
          fitMenus(event.n_layers, event.n_heads);
        } else if (event.type === "step") {
          state.steps.push(event);
          if (state.follow && !state.timer) followSoon();
          else {
            setButtons();
            sayWhere(); // "Token 6 of 7" stayed while the stream went on to 12
          }
        } else if (event.type === "end") {
          // "length" (every token asked for) and "eos" (the model ended the text) are complete;
          // "error" (a step failed) or "shutdown" (the server is stopping) ended it early.
          state.outcome = event.reason === "length" || event.reason === "eos" ? "finished" : "failed";
          state.reason = event.reason;
          failure = event.error;
        }
      }
      if (mine !== state.epoch) return;
      // Each result names its model: which one answered was said nowhere (the run on screen's, not
      // the one picked above but not run).
      const from = state.start?.model ?? model;
      if (!state.outcome) {
        // The body ended without the server's end line: cut off (a proxy's timeout, a server that
        // stopped), where it read "Finished" as if every token had come.
        state.outcome = "failed";
        status(note, `The stream was cut off after ${tokenCount(state.steps.length)} of ${n}, before the server's end line: generate again.`, "error");
      } else if (state.outcome === "failed") status(note, `The server stopped after ${tokenCount(state.steps.length)}: ${failure}`, "error");
      else {
        // Why it ended, where it was not the length asked for: a text the model ended itself.
        const ended = state.reason === "eos" ? ` Stopped: the model ended the text (end-of-text token) after ${state.steps.length} of the ${tokenCount(n)} asked for.` : "";
        if (cut && state.start) {
          status(note, `Finished: ${newTokens(state.steps.length)} from ${from}, after the start of the run's text (${tokenCount(state.start.prompt.length)}): `
            + `the whole run and the new tokens would not fit in ${info.id}'s ${info.max_tokens} positions.${ended}`);
        } else status(note, `Finished: ${newTokens(state.steps.length)} from ${from}.${ended}`);
      }
    } catch (err) {
      // A stream stopped because another run came on screen says nothing: its panel is cleared.
      if (mine === state.epoch && err.name === "AbortError") {
        state.outcome = "stopped";
        status(note, `Stopped after ${tokenCount(state.steps.length)} from ${state.start?.model ?? model}.`);
      } else if (mine === state.epoch) {
        state.outcome = "failed";
        const said = err instanceof RangeError ? err.message : describeError(err, PROMPT);
        status(note, said.replace(/\bmax_new_tokens\b/g, "the number of new tokens"), "error");
      }
    } finally {
      const following = mine === state.epoch && state.follow && !state.timer && state.steps.length > 0;
      state.running = false;
      if (following) go(state.steps.length - 1); // the last step, even if its frame has not come yet
      state.follow = false;
      box.dataset.outcome = state.outcome;
      setButtons();
    }
  }

  // The menus hold the layers and heads of the model the panel uses; a chosen one stays while that
  // model has it. Only a changed count refills a menu, so an unchanged one keeps keyboard focus.
  function fitMenus(nLayers, nHeads) {
    for (const [select, n, name] of [[layer, nLayers, "L"], [head, nHeads, "H"]]) {
      if (select.options.length === n) continue;
      const kept = Number(select.value) < n ? Number(select.value) : 0;
      fillSelect(select, [...Array(n).keys()].map((i) => ({ value: i, label: `${name}${i}` })), kept);
    }
  }

  // The server refuses to generate from a model that reads both ways (422): Generate is off, and
  // says why, while such a model is the one it would use (currentModel). causal: a new run's own answer.
  const models = listModels().catch(() => []);
  let modelList = []; // the same, once it has come: generate() reads it without waiting
  models.then((list) => { modelList = list; });
  serverLimits().then((limits) => {
    if (!limits) return; // a one-file export: no server to generate with
    count.max = limits.max_new_tokens;
    if (count.value.trim()) checkCount();
  }, () => {});
  let shownRun = null; // the run on screen's tokens, and whether it was cut to fit
  async function checkModel(causal = null) {
    const list = await models;
    const model = currentModel().model;
    // Before main.js has filled the form's list its value is empty: the server's default then.
    const info = list.find((m) => m.id === model) ?? list.find((m) => m.default) ?? list[0];
    if (info) fitMenus(info.n_layers, info.n_heads);
    causal ??= info?.causal ?? true;
    const name = model ?? info?.id;
    why.textContent = causal ? "" : `Off: ${name} is not a causal model (it reads both ways), so it does not generate. ${currentInput() ? "Run" : "Pick"} a causal model to use it.`;
    why.hidden = causal;
    start.title = causal ? "Generate" : why.textContent;
    setButtons();
  }
  // Stops and clears the generation on show: it belongs to the last run, or to the model picked before.
  function forget() {
    state.epoch += 1;
    state.controller?.abort();
    pause();
    Object.assign(state, { start: null, prompt: null, steps: [], current: -1, follow: false, outcome: "", reason: "" });
    tokens.replaceChildren();
    where.textContent = "";
    [rowPlot, growPlot].forEach(clearPlot);
    status(note, "");
    setButtons();
  }

  $("model").addEventListener("change", () => {
    // With no run on screen the form's model is the one the panel uses (currentModel).
    if (!currentInput()) forget();
    checkModel();
  });
  checkModel();

  // Another run on screen, perhaps of another model.
  onRun((input, { causal, tokens: runTokens, truncated }) => {
    shownRun = { tokens: runTokens, truncated };
    checkModel(causal);
    forget();
    prompt.placeholder = runTextPlaceholder(input);
  });

  start.addEventListener("click", generate);
  prompt.addEventListener("keydown", (e) => e.key === "Enter" && generate());
  stop.addEventListener("click", () => state.controller?.abort());
  back.addEventListener("click", () => { pause(); go(state.current - 1); });
  forward.addEventListener("click", () => { pause(); go(state.current + 1); });
  play.addEventListener("click", () => {
    if (state.timer) return pause();
    if (state.current >= state.steps.length - 1) go(0);
    state.timer = setInterval(() => {
      go(state.current + 1);
      if (state.current >= state.steps.length - 1 && !state.running) pause();
    }, PLAY_MS);
    setButtons();
  });
  for (const select of [layer, head]) select.addEventListener("change", render);
  setButtons();
}
