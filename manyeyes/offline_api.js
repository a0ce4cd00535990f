// Stands in for the page's api.js inside a one-file export: the same exports, answered from the run
// embedded in the file, so the viewer works from file:// with no server and no network.
// Whatever api.js exports and this file does not redefine passes through unchanged.

export * from "manyeyes/original-api.js";
import { ApiError } from "manyeyes/original-api.js";
import { decodeAttention } from "manyeyes/payload.js";

const embedded = JSON.parse(document.getElementById("manyeyes-export").textContent);
const run = embedded.run;
const [nLayers, nHeads, T] = run.attention.shape;
const cells = T * T;
let values = null; // Float32Array [layer][head][query][key], decoded on first use

function allValues() {
  if (values) return values;
  const decoded = decodeAttention(run.attention);
  values = decoded.values || Float32Array.from(decoded.bytes, (b) => b * decoded.scale);
  return values;
}

function offline(message) {
  return new ApiError(0, "offline", `${message} This page is an export of one run; \`manyeyes serve\` analyses new text.`);
}

// The body the API would send for this run's (layers, heads, format), already decoded as the
// page's fetch worker delivers it.
function answer(layers, heads, format) {
  layers = layers ?? [...Array(nLayers).keys()];
  heads = heads ?? [...Array(nHeads).keys()];
  if (format === "json") throw offline("Exact float32 values are not in this file.");
  const source = allValues();
  const out = new Float32Array(layers.length * heads.length * cells);
  layers.forEach((l, li) => heads.forEach((h, hi) => {
    const from = (l * nHeads + h) * cells;
    out.set(source.subarray(from, from + cells), (li * heads.length + hi) * cells);
  }));
  const shape = [layers.length, heads.length, T, T];
  const decoded = format === "u8"
    ? { shape, bytes: Uint8Array.from(out, (v) => Math.round(v * 255)), scale: 1 / 255 }
    : { shape, values: out };
  const dtype = format === "u8" ? "uint8" : "float16";
  return { ...run, layers, heads, attention: { format, dtype, shape, data: null, decoded } };
}

// Answers arrive on a later task, as a server's would: the page schedules work (the head view)
// with setTimeout after it asks, and an answer that resolved at once would overtake it.
const later = () => new Promise((resolve) => setTimeout(resolve, 0));

// The file's one saved view (export.py puts ?view=<its id> in the address bar): the page restores
// the text, focus and every view option from it. Anything else (the measures panel's questions)
// needs a server.
export async function requestJson(url, init = {}) {
  if (url === `/api/v1/views/${embedded.view_id}` && (init.method ?? "GET") === "GET") {
    await later();
    return structuredClone(embedded.view);
  }
  throw offline(`No server to ask for ${url}.`);
}

export async function listModels() {
  return [embedded.model];
}

export async function postAttention(body) {
  const same = body.text === embedded.text && (body.text_pair ?? null) === (embedded.text_pair ?? null);
  if (!same || (body.model && body.model !== embedded.model.id)) throw offline("Only the exported text can be shown.");
  await later();
  return answer(body.layers, body.heads, body.format ?? "json");
}

export async function fetchSlice(runId, layers, heads, format) {
  await later();
  return answer(layers, heads, format);
}

// GET /mean's answer: one (1, 1, T, T) matrix, the mean over every head of `layers`, made from the
// file's weights (the page asks for it on "Mean of all heads"; api.js would start a fetch worker,
// which a file:// page cannot).
export async function fetchMean(runId, layers) {
  await later();
  const source = allValues();
  const sum = new Float64Array(cells);
  for (const l of layers) {
    for (let h = 0; h < nHeads; h++) {
      const from = (l * nHeads + h) * cells;
      for (let i = 0; i < cells; i++) sum[i] += source[from + i];
    }
  }
  const count = layers.length * nHeads;
  const shape = [1, 1, T, T];
  const decoded = { shape, values: Float32Array.from(sum, (v) => v / count) };
  return { ...run, n_layers: 1, n_heads: 1, layers: [0], heads: [0], attention: { format: "f16", dtype: "float16", shape, data: null, decoded } };
}
