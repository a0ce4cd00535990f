// "Beyond raw weights": the measure chosen for the focused head (raw weights, rollout, value-
// weighted norms, head contributions), a word view, the model's predictions under it, and the
// head finder, information-flow graph and neuron view. main.js tells it about runs and focus.

import { ApiError, describeError, postAttentionJson, preciseFormat, requestJson, whenNotBusy } from "./api.js";
import { decodeAttention } from "./payload.js";
import { AttributionPanel } from "./attribution.js";
import { AxisLabels } from "./axis_labels.js";
import { cellUnder } from "./canvas_heatmap.js";
import { $, MODEBAR_PX, NARROW_PX, el, plotlyText } from "./dom.js";
import { FlowGraph } from "./flow.js";
import { cursorKeys, fontFor, labelsFit, localConfig, placementOf, shortLabel, stepCursor, ticks, weightText } from "./focus.js";
import { HeadFinder } from "./finder.js";
import { cellColours, peakOf, sequentialStops, signedStops } from "./measures_colours.js";
import { NeuronPanel } from "./neuron.js";
import { Predictions } from "./predictions.js";
import { holdsFor, layerMask, maskRule } from "./run.js";
import { MASKED, colorTable, onThemeChange } from "./theme.js";
import { hidingOptions, renormalises, viewOf } from "./transform.js";
import { visibleSpaces } from "./tokens.js";

const FLOW_AUTO_TOKENS = 128;
// Shown where the graph will be while its routes are fetched (a few forward passes): it was blank.
const FLOW_COMPUTING = "Computing the routes through the layers…";
const SEEN_MARGIN_PX = 200;
const LOADING_MS = 250; // before a measure on its way fades the last one (drawMeasure)
const TICK_FONT = 10; // px, the largest
const COLORBAR_PX = 85; // what Plotly's colour bar, its labels and its title take right of the cells

// The labels for a range, thinned and sized as the focused heatmap's are for an axis of axisPx
// pixels (every label once ALL_LABELS or fewer are in view and fit), and the room any of them
// needs at the largest font, once zoomed. The page draws them (axis_labels.js) over bare Plotly
// axes: with Plotly's own tick labels, even thinned and without automargin, each draw relaid and
// measured them, 180-210 ms of main thread at T=128.
function axisTicks(labels, range, axisPx = Infinity) {
  const { values, texts, shown } = ticks(labels.map((_, i) => i), labels, range, labelsFit(axisPx));
  let longest = 1;
  for (const label of labels) longest = Math.max(longest, shortLabel(label).length);
  return { values, texts, font: Math.min(TICK_FONT, fontFor(axisPx, shown)), room: 8 + TICK_FONT * 0.62 * longest };
}

// Square cells of a tokens × tokens measure in a plot `width` px wide with these margins, as tall
// as `tallest` at most: as wide as the width leaves beside the colour bar. Returns the plot's height
// and the colour bar's x (a fraction of Plotly's paper, the box inside the margins; null when the
// plot has no room) that sets the bar beside the cells, which stand at the paper's left.
function squareFit(width, margin, tallest) {
  const across = width - margin.l - margin.r;
  const side = Math.min(tallest - margin.t - margin.b, across - COLORBAR_PX);
  return { height: Math.max(260, margin.t + margin.b + side), colorbarX: across > 0 ? (side + 10) / across : null };
}

// The keys' labels slant at -45°: neighbours stand √½ of their spacing apart across the slant.
const KEYS_SLANT = Math.SQRT1_2;

// The matrix as a PNG data URL, one pixel per cell, coloured as the colorbar reads; the cells
// `mask` (run.js maskRule, or null) masks in the masked colour, as the focused heatmap draws them:
// the model never looks there, which a weight of 0 would not say.
function cellImage(matrix, signed, peak, mask = null) {
  const nRows = matrix.length;
  const nCols = matrix[0]?.length ?? 0;
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, nCols);
  canvas.height = Math.max(1, nRows);
  const context = canvas.getContext("2d");
  const image = context.createImageData(canvas.width, canvas.height);
  const pixels = new Uint32Array(image.data.buffer);
  const colours = cellColours(signed);
  const masked = colorTable()[MASKED];
  for (let i = 0; i < nRows; i++) {
    const row = matrix[i];
    for (let j = 0; j < nCols; j++) {
      if (mask?.cell(i, j)) {
        pixels[i * nCols + j] = masked;
        continue;
      }
      const x = signed ? 0.5 + row[j] / (2 * peak) : row[j] / peak; // 0 … 1 along the colorbar
      pixels[i * nCols + j] = colours[Math.round(255 * Math.min(1, Math.max(0, x)))];
    }
  }
  context.putImageData(image, 0, 0);
  return canvas.toDataURL("image/png");
}

// The view options that hide tokens, the only ones the raw weights follow: the threshold and pair
// blocks are ways of looking at the focused heatmap, and the other measures are not one head's
// softmax rows, which is what hiding renormalises.
const hidingOf = ({ hideSpecial, hideFirst }) => ({ hideSpecial, hideFirst });

// What the raw weights leave out under the view options, said under them; shown: how many rows are left.
function hidingWords(hiding, shown) {
  const by = hidingOptions(hiding);
  return shown ? `Tokens hidden by ${by.join(" and ")} are left out, each row renormalised over the rest, as in the focused heatmap.`
    : `No token is left to show: untick ${by.join(" or ")} to see them.`;
}

// The focused heatmap's ways of looking that no measure follows, as the page's controls name them.
const lookingOf = ({ threshold = 0, segments = "all" }) => [threshold > 0 && "“Threshold”", segments !== "all" && "“Pairs”"].filter(Boolean);

// What the word view did to the pieces (the API's rule, README "word view").
const WORDS_MERGED = "Words: each word's key pieces are summed and its query pieces averaged";

// Why "Words, not pieces" is off under the head contributions (said in the caption and the box's title).
const WORDS_OFF = "“Words, not pieces” is off here: it merges token × token maps, and these rows are heads";

const LEGENDS = { raw: "weight", rollout: "share", value_norms: "‖α·f(x)‖", contributions: "share (− cancels)" };

const CAPTIONS = {
  raw: "The focused head's softmax weights: where each query (row) looks.",
  rollout: "Attention rollout (Abnar & Zuidema, 2020): every layer's mean head plus the residual, multiplied through; how much of each input token reaches each position at the top.",
  value_norms: "Value-weighted norms ‖α·f(x)‖ (Kobayashi et al., 2020): a weight counts only as much as what it moves; a big weight on a token with a tiny value vector fades.",
  contributions: "Each head's share of what the layer's attention writes at each position (rows: heads; columns: query tokens); negative shares cancel other heads.",
};

// One head's weights as rows, from json lists or float16 base64.
function rowsOf(attention) {
  if (attention.format === "json") return matrixOf(attention);
  const { shape, values } = decodeAttention(attention);
  const n = shape.at(-1);
  return Array.from({ length: shape.at(-2) }, (_, r) => Array.from(values.subarray(r * n, (r + 1) * n)));
}

function matrixOf(measure) {
  // json measures: nested lists; flatten to rows of the last two axes.
  let data = measure.data;
  while (Array.isArray(data[0]?.[0])) data = data[0];
  return data;
}

// The raw weights as the focused heatmap shows them (transform.js viewOf): the tokens it hides
// (special ones, the first) left out, each row renormalised over the keys that stay. tokens: the
// run's, or the word view's words (a special token is a word of its own). Returns the kept rows as
// plain arrays, their labels, the mask in the kept cells' terms and each kept row's token index.
function hiddenOut(matrix, tokens, labels, { hideSpecial, hideFirst }, mask) {
  const T = tokens.length;
  const flat = new Float32Array(T * T);
  matrix.forEach((row, i) => flat.set(row, i * T));
  const view = viewOf(flat, tokens, { hideSpecial, hideFirst, threshold: 0, segments: "all", mask });
  const n = view.cols.length;
  return {
    matrix: view.rows.map((_, r) => Array.from(view.values.subarray(r * n, (r + 1) * n))),
    rows: view.rows.map((i) => labels[i]), cols: view.cols.map((j) => labels[j]),
    mask: { cell: view.masked }, positions: view.rows,
  };
}

// Sum over a word's key pieces, mean over its query pieces: the same rule as the API's word view.
function mergeWords(matrix, words) {
  return words.map((qw) => words.map((kw) => {
    let total = 0;
    for (const q of qw.pieces) for (const k of kw.pieces) total += matrix[q][k];
    return total / qw.pieces.length;
  }));
}

class Measures {
  constructor(focusHead) {
    this.focusHead = focusHead;
    // The template's words, put back on each new plot: a mouse's and a touch screen's (app.css shows one).
    this.readingHint = [...$("measure-reading").childNodes].map((node) => node.cloneNode(true));
    this.run = null;
    this.cursor = null; // { row, col } of the keyboard's cell cursor, while in use
    this.cursorBox = el("div", { className: "cell-cursor", attrs: { "aria-hidden": "true" } });
    this.cursorBox.hidden = true;
    this.layer = 0;
    this.head = 0;
    this.aggregate = "head"; // what the focused heatmap shows (main.js): one head, or a mean
    this.shown = null; // { kind, hidden, wordView } of the measure drawn, for its caption
    this.looking = []; // the focused heatmap's own view options set (threshold, pair block), named in the caption
    this.queryIndex = 0;
    this.flow = null;
    this.words = null;
    this.predictions = null;
    // Under the focused heatmap and in its hover, and in the strip under this section's heatmap.
    this.predictionsView = new Predictions($("focus-plot"), $("tooltip"));
    this.finder = new HeadFinder($("finder"), { onSelect: (l, h) => this.focusHead(l, h) });
    this.flowGraph = new FlowGraph($("flow"), { onEdge: (l, h) => this.focusHead(l, h) });
    this.neuron = new NeuronPanel($("neuron"), { onQuery: (q) => { this.queryIndex = q; this.drawNeuron(); } });
    this.attribution = new AttributionPanel($("attribution"), { onSelect: (l, h) => this.focusHead(l, h), onPick: () => this.drawAttribution() });
    this.attributed = null; // the run, position and guess the attribution grid shows (it does not follow the focus)
    this.restoredGuess = null; // a link's position and guess, for the run it restores
    $("measure").addEventListener("change", () => this.drawMeasure());
    $("word-view").addEventListener("change", () => this.drawMeasure());
    onThemeChange(() => { // the colours follow the theme, as the heatmap's do
      this.drawMeasure();
      this.attribution.repaint();
    });
    const threshold = $("flow-threshold");
    threshold.addEventListener("change", () => this.loadFlow());
    $("flow-draw").addEventListener("click", () => {
      this.forgetFlow(FLOW_COMPUTING);
      this.loadFlow();
    });
    threshold.addEventListener("input", () => { $("flow-threshold-value").textContent = Number(threshold.value).toFixed(2); });
    this.stale = false; // a focus change not drawn yet (see drawFocusWhenSeen)
    new IntersectionObserver(([entry]) => {
      if (entry.isIntersecting && this.stale && this.run) this.drawFocus();
    }, { rootMargin: `${SEEN_MARGIN_PX}px 0px` }).observe($("measures"));
  }

  // A GPU server keeps the page's u8 run as the bytes that crossed from the device (the run's
  // `precision` says so) and will not slice float32 from them (422 kept_quantised): posting the
  // text again at float32 recomputes it, and the server keeps that run from then on.
  async rawWeights(layer, head) {
    const T = this.run.tokens.length;
    const format = await preciseFormat(T * T); // float16 where the server's json budget is lower
    if (holdsFor(this.run.precision, format)) {
      try {
        return rowsOf((await this.get(`attention?layers=${layer}&heads=${head}&format=${format}`)).attention);
      } catch (err) {
        if (!(err instanceof ApiError && err.code === "kept_quantised")) throw err;
      }
    }
    const answer = await this.post({ layers: [layer], heads: [head], format });
    this.run.precision = answer.precision;
    return rowsOf(answer.attention);
  }

  async get(path) {
    const url = `api/v1/runs/${encodeURIComponent(this.run.runId)}/${path}`;
    try {
      return await requestJson(url);
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404 && err.code === "unknown_run")) throw err;
      await this.post({ format: "u8", layers: [0], heads: [0] });
      return requestJson(url);
    }
  }

  post(extra) {
    return postAttentionJson({ ...this.request, ...extra });
  }

  status(id, err) {
    $(id).textContent = err ? describeError(err) : "";
  }

  // labels: what each token is called, as the page's Labels control says; options: the view options
  // (main.js viewOptions), whose hidden tokens the raw weights leave out too (setView when they change).
  onRun(run, requestBody, layer, head, labels, options) {
    this.run = run;
    this.layer = layer;
    this.head = head;
    this.request = requestBody;
    this.labels = labels;
    this.hiding = hidingOf(options);
    this.looking = lookingOf(options);
    this.flow = this.words = this.predictions = null;
    this.predictionsSettled = false;
    this.queryIndex = run.tokens.length - 1;
    this.neuron.setTokens(this.labels, this.queryIndex);
    $("measures").hidden = false;
    this.forgetPlot();
    this.forgetNeuron("This run's neuron view is drawn when this panel is in view.");
    // A link's position and guess go to the run it restores, once; a later run starts at its last token.
    const restored = this.restoredGuess;
    this.restoredGuess = null;
    this.attribution.setTokens(this.labels, restored?.position ?? null, run.tokens.map((t) => t.id));
    this.attribution.want(restored?.target ?? null);
    this.attribution.setPredictions(null);
    this.forgetAttribution("This run's attribution is drawn when this panel is in view.");
    this.forgetHeads("Finding this run's heads…");
    const token = (this.token = {});
    this.loadHeads(token);
    // The flow graph costs several forward passes at T=512 (README): long inputs draw it on request.
    const auto = run.tokens.length <= FLOW_AUTO_TOKENS;
    $("flow-draw").hidden = auto;
    if (auto) {
      this.forgetFlow(FLOW_COMPUTING);
      this.loadFlow(token);
    } else {
      this.forgetFlow(`${run.tokens.length} tokens: press “Draw the graph” (it takes a while at this length).`);
    }
    this.finder.select(layer, head);
    // The panel is drawn when it is seen (see drawFocusWhenSeen), a run's first draw too: drawn at
    // once, its heatmap, neuron view and graph landed in frames of 150-330 ms at T=128, just as the
    // user starts stepping through heads above it.
    this.loadPredictions().then(() => this.drawFocusWhenSeen());
  }

  // The view options changed: the same tokens, named and hidden as the focused heatmap names and hides them.
  setView(labels, options) {
    const looking = lookingOf(options);
    if (looking.join() !== this.looking.join()) {
      this.looking = looking;
      if (this.shown) this.caption();
    }
    const hiding = hidingOf(options);
    if (!this.run || (labels === this.labels && hiding.hideSpecial === this.hiding.hideSpecial && hiding.hideFirst === this.hiding.hideFirst)) return;
    this.hiding = hiding;
    if (labels !== this.labels) {
      this.labels = labels;
      this.neuron.setTokens(labels, this.queryIndex);
      this.attribution.setTokens(labels, this.attribution.choice().position);
      this.attributed = null; // its sum names the position's token: drawn again under the new labels
      this.predictionsView.relabel(labels);
    }
    this.drawFocusWhenSeen();
  }

  // A long run gets no measures (main.js; long_run.js hides the panel's views and says why):
  // forget everything the last short run drew in them, so none of it is kept under this run. Its
  // predictions still go under the heatmap: they come with the run the server keeps, so asking
  // again is answered from its cache, without a forward (they were dropped without a word).
  onLongRun(run, request, labels) {
    this.token = {}; // loads still in flight for the last run drop their answers
    this.run = null;
    this.flow = null;
    this.predictions = null;
    this.predictionsView.clear();
    this.forgetPlot();
    this.forgetNeuron("");
    this.forgetAttribution("", false);
    this.forgetHeads();
    this.forgetFlow("");
    this.predictionsView.load(run, request, labels);
  }

  // As forgetPlot for the head finder and the flow graph: the last run's heads and routes go at
  // once. They stayed until this run's answers came (or, after a long run, until the next short
  // run's did): another text's tags, statistics and tokens under this run's views.
  forgetHeads(note = "") {
    this.finder.clear(note);
    delete $("finder").dataset.runId;
    this.status("finder-status");
  }

  forgetFlow(note) {
    this.flowWait?.abort(); // the last run's graph is asked for no more
    this.flowGraph.clear(note);
    delete $("flow").dataset.threshold;
    this.status("flow-status");
  }

  // As forgetPlot for the neuron view: the last run's table goes at once (it stayed, under this
  // run's query tokens, until the panel was scrolled to); note: what the view says meanwhile.
  forgetNeuron(note) {
    this.neuron.clear(note);
    this.status("neuron-status");
  }

  forgetAttribution(note, controls = true) {
    this.attributed = null;
    this.attribution.clear(note, controls);
    this.status("attribution-status");
  }

  // A new run: the last run's heatmap goes at once. It was drawn again only once the panel was
  // scrolled to (drawFocusWhenSeen), and until then showed another text's cells under this run's views.
  forgetPlot() {
    this.drawToken = {}; // a measure still loading for the last run is not drawn either
    this.cells = null;
    this.fit = null;
    this.shown = null;
    this.dropCursor();
    const plot = $("measure-plot");
    plot.hidden = $("measure-reading").hidden = true; // plot() shows them with the new cells
    plot.measured = null;
    for (const key of ["measure", "layer", "head", "words"]) delete plot.dataset[key];
    $("measure-caption").textContent = "";
    this.status("measure-status");
  }

  // The focused heatmap shows one head, a layer's mean or the mean of all heads (main.js). The
  // measure and the neuron view stay with the focused head: under a mean they say so, as they
  // read as the map above ("Raw weights, layer 0 head 0" under a mean of all heads).
  setAggregate(aggregate) {
    if (aggregate === this.aggregate) return;
    this.aggregate = aggregate;
    if (this.shown) this.caption();
    this.neuron.setAside(this.oneHead());
  }

  // The clause said under a mean, for a view of the focused head alone ("" under a single head).
  oneHead() {
    if (this.aggregate === "head") return "";
    return ` One head, not the ${this.aggregate === "all" ? "mean of all heads" : `mean of layer ${this.layer}'s heads`} above.`;
  }

  // Whether the focused heatmap is drawn (main.js), which the predictions' strip under it follows.
  setFocusShown(shown) {
    this.predictionsView.setHeatmapShown(shown);
  }

  onFocus(layer, head) {
    this.layer = layer;
    this.head = head;
    this.finder.select(layer, head);
    this.attribution.select(layer, head);
    if (!this.run) return;
    this.drawFocusWhenSeen();
  }

  // The flow graph, the measure (a T × T matrix fetched as JSON, drawn on Plotly's axes) and the
  // neuron view cost 0.15-0.3 s of main thread per focus change at T=128 to 512 (1-3 s before the
  // measure's labels were thinned), every arrow step: off screen they wait to be scrolled to.
  drawFocusWhenSeen() {
    const box = $("measures").getBoundingClientRect();
    const seen = box.bottom > -SEEN_MARGIN_PX && box.top < window.innerHeight + SEEN_MARGIN_PX && box.height > 0;
    if (seen) this.drawFocus();
    else this.stale = true;
  }

  drawFocus() {
    const { layer, head } = this;
    this.stale = false;
    if (this.flow) this.flowGraph.render(this.flow, this.labels, { layer, head });
    this.drawMeasure();
    this.drawNeuron();
    this.drawAttribution();
  }

  async loadHeads(token = this.token) {
    try {
      const body = await this.get("measures?names=heads");
      if (token !== this.token) return;
      this.finder.render(body.measures.heads);
      this.finder.select(this.layer, this.head);
      $("finder").dataset.runId = this.run.runId;
      this.status("finder-status");
    } catch (err) {
      if (token !== this.token) return;
      this.finder.clear(""); // not "Finding…" for ever: the status says why
      this.status("finder-status", err);
    }
  }

  async loadFlow(token = this.token) {
    if (!this.run) return;
    const threshold = Number($("flow-threshold").value);
    this.flowWait?.abort(); // a wait to ask again for another threshold's graph
    const wait = (this.flowWait = new AbortController());
    // The server makes one flow graph at a time (in turns across clients; a busy answer says its
    // queue is full), and a short run's graph is drawn by itself, with no
    // button: a busy answer left "Try again in 2 s" with nothing to press (a class on one laptop had
    // 10% of them turned away). It is asked again (whenNotBusy), and the button shows meanwhile.
    const busy = (seconds) => {
      $("flow-draw").hidden = false;
      $("flow-status").textContent = `The server is busy: asking again in ${seconds} s…`;
    };
    try {
      const flow = await whenNotBusy(() => this.get(`flow?threshold=${threshold}`), wait.signal, busy);
      // A later threshold's ask supersedes this one: its answer, come last, drew the older graph
      // under the newer slider value (only the wait to ask again was aborted, not the request).
      if (token !== this.token || wait !== this.flowWait) return;
      this.flow = flow;
      this.flowGraph.render(flow, this.labels, { layer: this.layer, head: this.head });
      $("flow").dataset.threshold = String(threshold);
      this.status("flow-status");
      $("flow-draw").hidden = this.run.tokens.length <= FLOW_AUTO_TOKENS;
    } catch (err) {
      if (token !== this.token || wait !== this.flowWait || err?.name === "AbortError") return;
      if (!this.flow) this.flowGraph.clear(""); // not "Computing…" for ever: the status says why
      this.status("flow-status", err);
      $("flow-draw").hidden = false; // to ask again by hand
    }
  }

  async loadPredictions() {
    const run = this.run;
    const found = await this.predictionsView.load(run, this.request, this.labels, [$("predictions")]);
    if (run !== this.run) return; // a later run's answer is never overwritten by this one
    this.predictions = found;
    this.predictionsSettled = true; // an error too: the attribution then explains the top guess
    this.attribution.setPredictions(found);
  }

  async wordsOf() {
    if (!this.words) this.words = (await this.get("measures?names=words&layers=0&heads=0")).measures.words.words;
    return this.words;
  }

  async drawMeasure() {
    if (!this.run) return;
    const kind = $("measure").value;
    const wordView = $("word-view").checked && kind !== "contributions";
    // Greyed out without a word, it read as broken.
    $("word-view").disabled = kind === "contributions";
    for (const node of [$("word-view"), $("word-view").nextElementSibling]) node.title = kind === "contributions" ? WORDS_OFF : "";
    const { layer, head } = this;
    const token = (this.drawToken = {});
    // On a slow link the last measure stayed drawn, its caption over it, under the new one's name in
    // the menu, and read as the new one: faded, the caption says what is coming. Not at once, or
    // every head's quick answer would flash.
    const waiting = setTimeout(() => this.fade(token, `Loading ${$("measure").selectedOptions[0].text.toLowerCase()}…`), LOADING_MS);
    try {
      let matrix;
      let rows = this.labels;
      let cols = this.labels;
      let signed = false;
      if (kind === "raw" && wordView) {
        const body = await this.get(`measures?names=words&layers=${layer}&heads=${head}`);
        matrix = matrixOf(body.measures.words.attention);
        this.words = body.measures.words.words;
      } else if (kind === "raw") {
        matrix = await this.rawWeights(layer, head);
      } else if (kind === "rollout") {
        matrix = matrixOf((await this.get("measures?names=rollout")).measures.rollout);
      } else if (kind === "value_norms") {
        matrix = matrixOf((await this.get(`measures?names=value_norms&layers=${layer}&heads=${head}`)).measures.value_norms);
      } else {
        const body = await this.get(`measures?names=contributions&layers=${layer}`);
        matrix = matrixOf(body.measures.contributions.shares);
        rows = [...Array(matrix.length).keys()].map((h) => `H${h}`);
        signed = true;
      }
      if (wordView && kind !== "raw") matrix = mergeWords(matrix, await this.wordsOf());
      if (wordView) rows = cols = (await this.wordsOf()).map((w) => w.text);
      if (token !== this.drawToken) return;
      await this.plot(matrix, rows, cols, signed, kind, wordView, { layer, head });
      this.status("measure-status");
    } catch (err) {
      this.status("measure-status", err);
      this.fade(token); // the last measure under its own caption, the error said under it
    } finally {
      clearTimeout(waiting);
    }
  }

  // The plot on screen faded while it is not the measure the menu names: `loading` says what is
  // coming in the caption; without it the caption is the plot's own again.
  fade(token, loading) {
    if (token !== this.drawToken) return;
    $("measure-plot").setAttribute("data-stale", "");
    if (loading) $("measure-caption").textContent = loading;
    else if (this.shown) this.caption();
  }

  // The cells are painted by the page into one image laid on Plotly's axes; Plotly draws only a
  // single brick under it (for the autorange and the colorbar), the labels and the zoom. A Plotly
  // heatmap of 128 × 128 cells took 150-250 ms of main thread to draw, the image a few ms.
  // { layer, head }: the head the matrix was fetched for (the focus may have moved on since).
  async plot(matrix, rows, cols, signed, kind, wordView, { layer, head }) {
    const plot = $("measure-plot");
    // Rows and columns are tokens, but for contributions (heads × tokens). The rollout mixes every
    // layer's reach and the word view merges tokens: only causality masks those.
    let mask = kind === "contributions" ? null
      : kind === "rollout" || wordView ? maskRule(this.run.causal) : layerMask(this.run, layer);
    let positions = null; // each row's token, where hidden tokens leave rows out
    const hidden = kind === "raw" && renormalises(this.hiding);
    if (hidden) ({ matrix, rows, cols, mask, positions } = hiddenOut(matrix, wordView ? this.words : this.run.tokens, rows, this.hiding, mask));
    const peak = peakOf(matrix, 1e-12);
    this.cells = { matrix, rows, cols, mask, positions, headRows: kind === "contributions",
                   predictions: !wordView && kind !== "contributions" ? this.predictions : null };
    plot.measured = { matrix, signed, peak }; // what is drawn, for tests and tools
    this.dropCursor(); // its cell may not exist in the new matrix
    this.showReadingHint();
    // Every token hidden: no cells to draw, and the caption says what brings them back.
    plot.hidden = $("measure-reading").hidden = !matrix.length;
    if (!matrix.length) return this.drawn(kind, { layer, head }, wordView, hidden);
    const x = axisTicks(cols, null);
    const y = axisTicks(rows, null);
    // a label at -45° needs about 0.75 of its length below the axis; on a phone the title goes
    // under the modebar, which covered its layer and head
    const under = plot.clientWidth < NARROW_PX ? MODEBAR_PX : 0;
    const margin = { t: 36 + under, r: 10, b: 12 + Math.round(x.room * 0.75), l: 12 + Math.round(y.room) };
    // Tokens × tokens (words × words) keep square cells, as the focused heatmap's do (scaleanchor):
    // as wide as the plot's width leaves beside the labels and colour bar, as tall as before at
    // most. At 1,000 tokens the cells were stretched to the panel's width, 1148 × 581 px at 1366 px.
    // The cells stand at the left, their colour bar beside them, not across the box from them. The
    // contributions (heads × tokens) keep the whole box.
    const square = rows.length === cols.length;
    const tallest = Math.max(260, Math.min(640, 120 + 16 * rows.length));
    // Fitted again to the plot's width when the window resizes (refit): the colour bar was placed
    // once, at a fraction of the width drawn for, and drifted away from the cells after a resize.
    this.fit = square ? { margin, tallest, width: plot.clientWidth } : null;
    const { height, colorbarX } = square ? squareFit(plot.clientWidth, margin, tallest) : { height: tallest, colorbarX: null };
    // The focused heatmap's colours (measures_colours.js); the colorbar is the legend.
    const trace = {
      type: "heatmap", z: [[0]], x: [-0.5, cols.length - 0.5], y: [-0.5, rows.length - 0.5], hoverinfo: "none",
      colorscale: signed ? signedStops() : sequentialStops(),
      zmin: signed ? -peak : 0, zmax: peak,
      colorbar: { title: { text: LEGENDS[kind], side: "right" }, thickness: 12, ...(colorbarX === null ? {} : { x: colorbarX }) },
    };
    const cells = {
      source: cellImage(matrix, signed, peak, mask), xref: "x", yref: "y", x: -0.5, y: -0.5, sizex: cols.length, sizey: rows.length,
      xanchor: "left", yanchor: "top", sizing: "stretch", layer: "above",
    };
    const ink = getComputedStyle(document.body).color;
    const bare = { showticklabels: false, ticks: "", showgrid: false, zeroline: false, constrain: "domain" };
    const title = kind === "rollout" ? "Rollout, all layers" : `${$("measure").selectedOptions[0].text}, layer ${layer}${kind === "contributions" ? "" : ` head ${head}`}`;
    await window.Plotly.react(plot, [trace], {
      // Over the cells' left edge, as the focused heatmap's: square cells leave the box's middle empty.
      title: { text: plotlyText(title) + (wordView ? " (words)" : ""), font: { size: 13 }, x: 0, xref: "paper", xanchor: "left",
               yref: "container", y: 1, yanchor: "top", pad: { t: 10 + under } },
      xaxis: { ...bare, autorange: true, constraintoward: "left" }, yaxis: { ...bare, autorange: "reversed", scaleanchor: square ? "x" : undefined },
      margin, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", font: { color: ink },
      height, images: [cells],
    }, this.config());
    this.exportName = `manyeyes-${this.run.model}-${kind}${kind === "rollout" ? "" : `-L${layer}`}${kind === "contributions" || kind === "rollout" ? "" : `-H${head}`}`;
    if (!this.listening) this.listen(plot);
    this.placeLabels();
    this.drawn(kind, { layer, head }, wordView, hidden);
  }

  // What the plot shows now, in its data attributes (which tests wait for) and its caption; hidden:
  // whether the view options left tokens out.
  drawn(kind, { layer, head }, wordView, hidden) {
    Object.assign($("measure-plot").dataset, { measure: kind, layer, head, words: String(wordView) });
    $("measure-plot").removeAttribute("data-stale");
    this.shown = { kind, hidden, wordView };
    this.caption();
  }

  caption() {
    const { kind, hidden, wordView } = this.shown;
    // Hiding renormalises one head's softmax rows: the other measures show every token, and say so
    // (they ignored the ticked boxes without a word).
    const by = hidingOptions(this.hiding);
    const ignored = kind !== "raw" && renormalises(this.hiding)
      ? ` ${by.join(" and ")} ${by.length > 1 ? "apply" : "applies"} to the raw weights only: every token is shown here.` : "";
    // The rollout takes every layer's mean, the contributions every head of the layer: no one head.
    const single = kind === "raw" || kind === "value_norms" ? this.oneHead() : "";
    // Off under the contributions, the word view says why there, and in its box's title.
    const words = kind === "contributions" ? ` ${WORDS_OFF}.` : wordView ? ` ${WORDS_MERGED}${kind === "raw" ? ", so rows still sum to 1." : "."}` : "";
    // The threshold and the pair block were applied to the focused heatmap and not here, unsaid.
    const looks = this.looking.length
      ? ` ${this.looking.join(" and ")} ${this.looking.length > 1 ? "apply" : "applies"} to the focused heatmap only: every weight and pair block is shown here.` : "";
    $("measure-caption").textContent = (hidden ? `${CAPTIONS[kind]} ${hidingWords(this.hiding, this.cells.matrix.length)}` : CAPTIONS[kind] + ignored) + single + words + looks;
  }

  // "query → key: value" for a cell, and the model's next-token guess after the query where there
  // is one, in the line under the plot.
  readAt(i, j) {
    const { matrix, rows, cols, mask, positions, predictions, headRows } = this.cells;
    const position = positions ? positions[i] : i;
    const top = predictions?.[String(position)]?.[0];
    const next = top ? ` · next: ${visibleSpaces(top.token)} ${(top.prob * 100).toFixed(0)}%` : "";
    // The row's token outlined in the strip under the plot (its own scroll box) and scrolled to.
    this.predictionsView.mark($("predictions"), predictions ? position : null);
    const reading = $("measure-reading");
    // Each token with its position: "u → u" read two of a repeated text's tokens as one.
    const query = headRows ? rows[i] : `#${position} ${rows[i]}`;
    const key = `#${positions ? positions[j] : j} ${cols[j]}`;
    reading.textContent = `${query} → ${key}: ${mask?.cell(i, j) ? "masked" : weightText(matrix[i][j], 0, 4)}${next}`;
    Object.assign(reading.dataset, { row: i, col: j });
    return reading.textContent;
  }

  showReadingHint() {
    const reading = $("measure-reading");
    reading.replaceChildren(...this.readingHint.map((node) => node.cloneNode(true)));
    delete reading.dataset.row;
    delete reading.dataset.col;
  }

  // The cell under the pointer; the keyboard's cursor gives way to it. Off the cells (a few
  // words' square sits in a wider plot) the last cell's reading stayed, as if it were pointed at.
  readCell(event) {
    if (!this.cells) return;
    const cell = cellUnder($("measure-plot"), event.clientX, event.clientY, this.cells.rows.length, this.cells.cols.length);
    if (!cell) {
      if (!this.cursor && $("measure-reading").dataset.row !== undefined) {
        this.showReadingHint();
        this.predictionsView.mark($("predictions"), null);
      }
      return;
    }
    this.dropCursor();
    this.readAt(cell.row, cell.col);
  }

  // Arrow keys on the focused heatmap: a cell cursor for those who cannot hover, outlined and
  // read out through a polite live region (hovering updates only the line under the plot).
  moveCursor(dRow, dCol) {
    if (!this.cells) return;
    const plot = $("measure-plot");
    if (!this.cursorBox.isConnected) plot.append(this.cursorBox);
    const step = stepCursor(plot, this.cursor, dRow, dCol, this.cells.rows.length, this.cells.cols.length, this.cursorBox);
    if (!step) return;
    this.cursor = step.cell;
    $("measure-cell-reading").textContent = this.readAt(step.cell.row, step.cell.col);
  }

  dropCursor() {
    this.cursor = null;
    this.cursorBox.hidden = true;
    $("measure-cell-reading").textContent = "";
  }

  // One config for the plot's life (a changed one redraws from scratch), as private as the
  // focused heatmap's; its exports label the axes with Plotly (the page draws them on screen).
  config() {
    this.plotConfig ??= localConfig((format) => this.download(format));
    return this.plotConfig;
  }

  // The plot as on screen, labelled by Plotly, captioned with the model and the text.
  download(format) {
    const plot = $("measure-plot");
    const { ranges, box } = placementOf(plot);
    const { rows, cols } = this.cells;
    const labelled = (labels, range, axisPx) => {
      const { values, texts, font } = axisTicks(labels, range, axisPx);
      return { showticklabels: true, ticks: "outside", tickmode: "array", tickvals: values, ticktext: texts.map(plotlyText), tickfont: { size: font } };
    };
    const text = this.request.text + (this.request.text_pair ? ` | ${this.request.text_pair}` : "");
    const short = text.length > 80 ? `${text.slice(0, 79)}…` : text;
    const layout = {
      ...plot.layout,
      xaxis: { ...plot.layout.xaxis, ...labelled(cols, ranges.x, box.width * KEYS_SLANT), range: ranges.x, autorange: false, tickangle: -45 },
      yaxis: { ...plot.layout.yaxis, ...labelled(rows, ranges.y, box.height), range: ranges.y, autorange: false },
      title: { ...plot.layout.title, text: `${plot.layout.title.text} · ${plotlyText(`${this.run.model} · “${short}”`)}` },
    };
    return window.Plotly.downloadImage({ data: plot.data, layout }, {
      format, filename: this.exportName, width: plot.clientWidth, height: plot.clientHeight, scale: format === "png" ? 2 : 1,
    });
  }

  // The labels of the tokens (or heads) now in view, at the axes' current ranges and lengths: a
  // phone's axes hold fewer of them, smaller.
  placeLabels() {
    const place = placementOf($("measure-plot"));
    if (!place || !this.cells) return;
    const { rows, cols } = this.cells;
    const { box, ranges } = place;
    const colour = getComputedStyle(document.body).color;
    this.labelsView.render({
      x: { ...axisTicks(cols, ranges.x, box.width * KEYS_SLANT), angle: -45, top: false }, y: axisTicks(rows, ranges.y, box.height),
      titles: { x: { text: "" }, y: { text: "" } }, colors: { text: colour, muted: colour },
    }, box, ranges);
  }

  // Once per plot: hover readings, and labels that follow a pan and are redrawn after a zoom
  // (every token once ALL_LABELS or fewer are in view), as the focused heatmap's are.
  listen(plot) {
    this.listening = true;
    this.labelsView = new AxisLabels(plot);
    plot.addEventListener("mousemove", (event) => this.readCell(event));
    // A tap on a phone never hovers (and Plotly's drag layer cancels the touch's mouse events): a
    // press released where it began reads its cell, as on the focused heatmap (focus.js).
    let down = null;
    plot.addEventListener("pointerdown", (event) => {
      down = event.pointerType === "mouse" ? null : { x: event.clientX, y: event.clientY };
    });
    plot.addEventListener("pointerup", (event) => {
      if (down && Math.hypot(event.clientX - down.x, event.clientY - down.y) < 8) this.readCell(event);
      down = null;
    });
    // Escape drops the cursor too: its reading covered the cells around it until focus left.
    cursorKeys(plot, (dRow, dCol) => this.moveCursor(dRow, dCol), () => this.dropCursor());
    plot.on("plotly_relayout", (update) => {
      // Plotly's own resize (responsive config) relays out the width alone, after the window's.
      if (update?.autosize) this.refit(plot);
      this.placeLabels();
      if (this.cursor) this.moveCursor(0, 0); // the outline follows its cell through a zoom
    });
    plot.on("plotly_relayouting", () => {
      const place = placementOf(plot);
      if (place) this.labelsView.move(place.box, place.ranges);
    });
  }

  // Square cells fitted again to the plot's new width, the colour bar beside them: the height and
  // the bar's place as plot() would choose them now, without drawing the cells again.
  async refit(plot) {
    const fit = this.fit;
    if (!fit || !this.cells || plot.hidden || plot.clientWidth === fit.width) return;
    fit.width = plot.clientWidth;
    const { height, colorbarX } = squareFit(fit.width, fit.margin, fit.tallest);
    if (colorbarX === null) return;
    // Not Plotly.update: a relayout of the height alone sets the width too (Plotly sizes both
    // dimensions or neither), and its responsive resize skips a plot with both set. The plot kept
    // the width of its first resize for good: a phone turned and turned back held a 617 px plot
    // in a 325 px panel, and the page zoomed out to 58 % around it.
    const [trace] = plot.data;
    await window.Plotly.react(plot, [{ ...trace, colorbar: { ...trace.colorbar, x: colorbarX } }], { ...plot.layout, height }, this.config());
    if (fit !== this.fit) return; // drawn anew, or forgotten, meanwhile
    this.placeLabels(); // plotly_update, not plotly_relayout: the labels and cursor follow here
    if (this.cursor) this.moveCursor(0, 0);
  }

  async drawNeuron() {
    if (!this.run) return;
    const { run, layer, head, queryIndex } = this;
    try {
      const view = await this.get(`neuron?layer=${layer}&head=${head}&query=${queryIndex}`);
      // Not the last run's view either, answered after this run cleared it (same head and query).
      if (run !== this.run || layer !== this.layer || head !== this.head || queryIndex !== this.queryIndex) return;
      this.neuron.setAside(this.oneHead()); // a mean of another layer's heads, said when it was set
      this.neuron.render(view, this.labels);
      this.status("neuron-status");
    } catch (err) {
      if (run === this.run) this.status("neuron-status", err);
    }
  }

  // The position and guess of "Why this guess?" as a saved view of `run` holds them (null: the
  // defaults). A run not yet handed to this panel (main.js saves its link first) holds a link's
  // guess, or none: the last run's position went into the new run's link, and the same view came
  // back under another id once the panel clamped it.
  guessChoice(run) {
    if (run !== this.run) {
      const wanted = run?.causal && !run.long ? this.restoredGuess : null;
      return { guess_position: wanted?.position ?? null, guess_target: wanted?.target ?? null };
    }
    if (!this.run || !this.run.causal || this.attribution.isDefault()) return { guess_position: null, guess_target: null };
    const { position, target } = this.attribution.choice();
    // Before the run's guesses come, a link's guess is still only wanted: saved as it was.
    return { guess_position: position, guess_target: target ?? this.attribution.wantedTarget() };
  }

  restoreGuess(position, target) {
    this.restoredGuess = position === null ? null : { position, target };
  }

  // Direct logit attribution at the chosen position and guess, every head of the model. It does
  // not depend on the focused head (only the outline does): asked for again only when the run,
  // the position or the guess changes.
  async drawAttribution() {
    // Drawn once the run's guesses are in (loadPredictions draws the panel then): they say whether
    // the model has a language-model head, and which guesses the panel offers.
    if (!this.run || !this.predictionsSettled) return;
    const run = this.run;
    const { position, target } = this.attribution.choice();
    const key = `${run.runId}:${position}:${target}`;
    if (this.attributed === key) return;
    if (!run.causal || !this.predictionsView.available) {
      this.forgetAttribution(!run.causal ? "Direct logit attribution explains a causal language model's next-token guess; this model reads both ways."
        : "This model has no language-model head: no guesses to explain.", false);
      this.attributed = key;
      return;
    }
    this.attributed = key;
    const { nLayers: layers, nHeads: heads } = run;
    try {
      const found = await this.get(`logit-attribution?position=${position}${target === null ? "" : `&target=${target}`}&top=${Math.min(4096, layers * heads)}`);
      if (run !== this.run || this.attributed !== key) return;
      this.attribution.render(found, { layers, heads });
      this.status("attribution-status");
    } catch (err) {
      if (run !== this.run || this.attributed !== key) return;
      this.attributed = null; // asked again at the next draw
      this.status("attribution-status", err);
    }
  }
}

// focusHead(layer, head): how the page focuses a head (main.js's setFocus).
export function mountMeasures(focusHead) {
  return new Measures(focusHead);
}
