// Stands in for the page's api.js inside a one-file export: the same exports, answered from the run
// embedded in the file, so the viewer works from file:// with no server and no network.
// Whatever api.js exports and this file does not redefine passes through unchanged.

export * from "manyeyes/original-api.js";
import { ApiError } from "manyeyes/original-api.js";
import { asTyped } from "manyeyes/dom.js";
import { decodeAttention } from "manyeyes/payload.js";

const embedded = JSON.parse(document.getElementById("manyeyes-export").textContent);
const run = embedded.run;
const [nLayers, nHeads, T] = run.attention.shape;
const cells = T * T;
let source = null; // the file's weights as stored: u8 `bytes` (times `scale`) or float `values`

// Decoded once, kept as stored: widening a u8 run to float32 up front took 4x its bytes and,
// with per-element callbacks, most of the seconds a long export took to open.
function stored() {
  if (source) return source;
  source = decodeAttention(run.attention);
  run.attention = { ...run.attention, data: null }; // the base64 text is no longer needed
  return source;
}

// Weights [from, from + count) as float32: a view for a float file, a u8 file's bytes times its scale.
function weightsOf(from, count) {
  const { bytes, values, scale } = stored();
  if (values) return values.subarray(from, from + count);
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = bytes[from + i] * scale;
  return out;
}

// The file holds float16 or 8-bit weights only: readings read those (a float32 fetch for each head
// read would only put "not in this file" up).
export const FLOAT32_READINGS = false;

function offline(message) {
  return new ApiError(0, "offline", `${message} This page is an export of one run; “manyeyes serve” analyses new text.`);
}

// The body the API would send for this run's (layers, heads, format), already decoded as the
// page's fetch worker delivers it. "json" (float32 on a server, which the page asks for where it
// renormalises rows: hidden tokens, one block of a pair) is the file's own weights, the best it
// holds, and says so in its dtype: refusing it left those views on an error and their downloads
// silent.
function answer(layers, heads, format) {
  layers = layers ?? [...Array(nLayers).keys()];
  heads = heads ?? [...Array(nHeads).keys()];
  const { bytes, values, scale } = stored();
  const size = layers.length * heads.length * cells;
  const shape = [layers.length, heads.length, T, T];
  const decoded = format === "u8"
    ? { shape, bytes: new Uint8Array(size), scale: bytes ? scale : 1 / 255 }
    : { shape, values: new Float32Array(size) }; // f16 and json alike: float32 values
  layers.forEach((l, li) => heads.forEach((h, hi) => {
    const from = (l * nHeads + h) * cells;
    const to = (li * heads.length + hi) * cells;
    if (decoded.values) decoded.values.set(weightsOf(from, cells), to);
    else if (bytes) decoded.bytes.set(bytes.subarray(from, from + cells), to);
    else for (let i = 0; i < cells; i++) decoded.bytes[to + i] = Math.round(values[from + i] * 255);
  }));
  const dtype = format === "u8" || (format === "json" && bytes) ? "uint8" : "float16";
  return { ...run, layers, heads, attention: { format, dtype, shape, data: null, decoded } };
}

// Answers arrive on a later task, as a server's would: the page schedules work (the head view)
// with setTimeout after it asks, and an answer that resolved at once would overtake it.
const later = () => new Promise((resolve) => setTimeout(resolve, 0));

// The file's one saved view (export.py puts ?view=<its id> in the address bar): the page restores
// the text, focus and every view option from it. Anything else (the measures panel's questions)
// needs a server.
export async function requestJson(url, init = {}) {
  if (url === `api/v1/views/${embedded.view_id}` && (init.method ?? "GET") === "GET") {
    await later();
    return structuredClone(embedded.view);
  }
  throw offline(`No server to ask for ${url}.`);
}

export async function listModels() {
  return [embedded.model];
}

// No server, so no limits to size requests to (the page asks none of these of the file).
export async function serverLimits() {
  return null;
}

// A file of "a\r\nb" (or a lone "\r") is asked for "a\nb", as its text box gives it back: it was
// refused as another text. No pair and an empty one are the same (the page leaves a blank out).
const lines = (text) => asTyped(text ?? "");

// The file holds every weight and answers any format: no server budget to keep under.
export async function preciseFormat() {
  return "json";
}

export async function postAttention(body) {
  const same = lines(body.text) === lines(embedded.text) && lines(body.text_pair) === lines(embedded.text_pair);
  if (!same || (body.model && body.model !== embedded.model.id)) throw offline("Only the exported text can be shown.");
  await later();
  return answer(body.layers, body.heads, body.format ?? "json");
}

export async function fetchSlice(runId, layers, heads, format) {
  await later();
  return answer(layers, heads, format);
}

// GET /cell's values, from the file's weights: the best it holds.
export async function fetchCell(runId, query, key) {
  await later();
  const out = new Float32Array(nLayers * nHeads);
  for (let i = 0; i < out.length; i++) out[i] = weightsOf(i * cells + query * T + key, 1)[0];
  return out;
}

// GET /mean's answer: one (1, 1, T, T) matrix, the mean over every head of `layers`, made from the
// file's weights (the page asks for it on "Mean of all heads"; api.js would start a fetch worker,
// which a file:// page cannot).
export async function fetchMean(runId, layers) {
  await later();
  const sum = new Float64Array(cells);
  for (const l of layers) {
    for (let h = 0; h < nHeads; h++) {
      const head = weightsOf((l * nHeads + h) * cells, cells);
      for (let i = 0; i < cells; i++) sum[i] += head[i];
    }
  }
  const count = layers.length * nHeads;
  const shape = [1, 1, T, T];
  const decoded = { shape, values: Float32Array.from(sum, (v) => v / count) };
  const dtype = stored().bytes ? "uint8" : "float16"; // a renormalised mean is labelled by it
  return { ...run, n_layers: 1, n_heads: 1, layers: [0], heads: [0], attention: { format: "f16", dtype, shape, data: null, decoded } };
}
