// The v1 attention API (issue 3): every failure becomes an ApiError that reads well to a person.

import { decodeAttention } from "./payload.js";

export class ApiError extends Error {
  constructor(status, code, message, retryAfter = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

// Shared with fetch-worker.js, which runs the same request off the main thread. binary: a frame
// answer comes back as its ArrayBuffer (JSON answers and errors are parsed either way).
export async function request(url, options = {}, binary = false) {
  const response = await answered(url, options);
  const type = response.headers.get("Content-Type") || "";
  return binary && type.startsWith("application/vnd.manyeyes.frame") ? response.arrayBuffer() : response.json();
}

// The fetch itself: the answer when it is a success, else an ApiError.
async function answered(url, options) {
  let response;
  try {
    response = await fetch(url, options);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "network", "The server could not be reached. Is `manyeyes serve` still running?");
  }
  if (response.ok) return response;
  let code = "http_" + response.status;
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error) ({ code, message } = body.error);
  } catch {
    // A non-JSON error (a proxy, a crash page): the status line is all we have.
  }
  throw new ApiError(response.status, code, message, response.headers.get("Retry-After"));
}

// API keys: a server started with MANYEYES_API_KEYS answers 401 until the page sends one. The page
// asks once, keeps the key for this tab only (sessionStorage), and asks again only if it is refused.
const KEY_ITEM = "manyeyes.apiKey";
let asking = null;

function withKey(init = {}) {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { ...init, headers: { ...(init.headers || {}), Authorization: `Bearer ${utf8Bytes(key)}` } } : init;
}

// The key's UTF-8 bytes, a character each: fetch sends a header's characters as single bytes and
// throws on any above U+00FF, where the server reads the header as UTF-8 (as curl and the Python
// client send it). A key "ключ" read as "the server could not be reached"; "café" was refused.
function utf8Bytes(text) {
  return String.fromCharCode(...new TextEncoder().encode(text));
}

function askForKey(refused) {
  // Several requests refused at once share one question.
  asking ??= Promise.resolve().then(() => {
    const key = window.prompt(refused
      ? "This manyeyes server refused that API key. Enter the right one (kept for this tab only), or cancel."
      : "This manyeyes server needs an API key. It is kept for this tab only.");
    if (key && key.trim()) sessionStorage.setItem(KEY_ITEM, key.trim());
    else sessionStorage.removeItem(KEY_ITEM);
    asking = null;
    return Boolean(key && key.trim());
  });
  return asking;
}

// Asks until a key is taken or the person cancels: a mistyped key had left the page with no
// models and no way to enter the key again but a reload.
async function authorised(call, init) {
  let sent = sessionStorage.getItem(KEY_ITEM);
  for (;;) {
    try {
      return await call(withKey(init));
    } catch (err) {
      if (!(err instanceof ApiError) || err.status !== 401) throw err;
      // A request that left before another one's question was answered retries with that answer.
      const current = sessionStorage.getItem(KEY_ITEM);
      if (!(current && current !== sent) && !(await askForKey(Boolean(sent)))) throw err;
      sent = sessionStorage.getItem(KEY_ITEM);
    }
  }
}

// Plain JSON calls (the measures, static/js/measures.js) with the tab's API key, asked for on a 401.
export function requestJson(url, init = {}) {
  return authorised((withAuth) => request(url, withAuth), init);
}

// The answer itself, for a body read as it streams (generation's NDJSON), with the tab's API key.
export function requestResponse(url, init = {}) {
  return authorised((withAuth) => answered(url, withAuth), init);
}

// A file the server names for saving (the exported page), fetched with the tab's API key, which
// a plain navigation to its address could not send.
export async function requestFile(url) {
  const response = await requestResponse(url);
  const named = /filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "");
  return { blob: await response.blob(), filename: named ? named[1] : "manyeyes.html" };
}

// One answer for the page's views (the form, Generate, predictions asked for it each); a failure
// is not kept, so that a later call asks again.
let models = null;
function modelsAnswer() {
  models ??= authorised((init) => request("api/v1/models", init), {})
    .catch((err) => {
      models = null;
      throw err;
    });
  return models;
}

export function listModels() {
  return modelsAnswer().then((body) => body.models);
}

// What the server was started with, where the page sizes its requests to it:
// { max_json_cells, max_new_tokens }.
export function serverLimits() {
  return modelsAnswer().then((body) => body.limits);
}

// "json" (float32), or "f16" where `cells` is over the server's format=json budget (GET /models'
// limits, MANYEYES_MAX_JSON_CELLS): an operator's lower budget refused the page's float32 reads
// with 413, and the view said it could not be loaded.
export async function preciseFormat(cells) {
  const limits = await serverLimits().catch(() => null);
  return limits && cells > limits.max_json_cells ? "f16" : "json";
}

// Where the server's models stand (/readyz, open without a key): { status: "ready" } or
// { status: "loading" | "failed", models: { id: { state, bytes_done?, bytes_total? } }, message }.
export async function readiness() {
  const response = await fetch("readyz", { cache: "no-store" });
  if (response.ok) return { status: "ready" };
  const body = await response.json().catch(() => ({}));
  return { status: body.status === "loading" ? "loading" : "failed", models: body.models || {}, message: body.error?.message || `status ${response.status}` };
}

// Attention payloads are fetched, parsed and decoded in a worker: tens of MB of base64 at T=512
// would otherwise stall the main thread while it draws. Replies carry `attention.decoded`.
let worker = null;
let nextId = 0;
const waiting = new Map();

function viaWorker(url, init, signal) {
  if (!worker) {
    worker = new Worker(new URL("./fetch-worker.js", import.meta.url), { type: "module" });
    worker.onmessage = ({ data }) => {
      const { resolve, reject } = waiting.get(data.id);
      waiting.delete(data.id);
      if (data.error) {
        const { status, code, message, retryAfter } = data.error;
        reject(new ApiError(status, code, message, retryAfter));
      } else {
        resolve(data.body);
      }
    };
  }
  const id = nextId++;
  return new Promise((resolve, reject) => {
    waiting.set(id, { resolve, reject });
    worker.postMessage({ id, url: new URL(url, window.location.href).href, init });
    // The worker still finishes an aborted request; its reply is simply not awaited any more.
    signal?.addEventListener("abort", () => reject(new DOMException("aborted", "AbortError")), { once: true });
  });
}

// The same POST answered as plain JSON on the main thread: small answers (predictions, a run
// posted again after eviction) that need no decoding worker.
export function postAttentionJson(body) {
  return requestJson("api/v1/attention", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
}

export function postAttention(body, signal) {
  const init = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  return authorised((withAuth) => viaWorker("api/v1/attention", withAuth, signal), init);
}

export function fetchSlice(runId, layers, heads, format, signal) {
  const query = new URLSearchParams({ format });
  if (layers) query.set("layers", layers.join(","));
  if (heads) query.set("heads", heads.join(","));
  return authorised((withAuth) => viaWorker(`api/v1/runs/${encodeURIComponent(runId)}/attention?${query}`, withAuth, signal), {});
}

// The float32 mean over every head of `layers`, computed by the server, sent as float16 (or as
// float32, format "json").
export function fetchMean(runId, layers, signal, format = "f16") {
  const query = new URLSearchParams({ format, layers: layers.join(",") });
  return authorised((withAuth) => viaWorker(`api/v1/runs/${encodeURIComponent(runId)}/mean?${query}`, withAuth, signal), {});
}

// One cell in every head, (layers × heads) float32: the exact values of a picked cell's ranking
// (cell_heads.js), which 8-bit ones had put in the wrong order. As float32 (json, a few hundred
// numbers): float16 rounded weights under 6e-5 to steps of 6e-8, and the ranking disagreed with
// the hover on the same cell (2.4e-7 for 2.1e-7).
export async function fetchCell(runId, query, key, signal, format = "json") {
  const params = new URLSearchParams({ query, key, format });
  const body = await requestJson(`api/v1/runs/${encodeURIComponent(runId)}/cell?${params}`, { signal });
  return decodeAttention(body.attention).values;
}

// Any head of a run comes as float32 too (format json): the page's readings are read from it.
export const FLOAT32_READINGS = true;

function isTooLong(err) {
  return err.status === 422 && /long|length|max_tokens|positions/i.test(`${err.code} ${err.message}`);
}

// The server runs a few experiments and generations at a time, and queues the rest of its work
// within bounds: a busy answer (429 with
// Retry-After) is asked again after that wait and up to a second more, so that a class's pages
// spread out, this many times, onWait(seconds) saying so meanwhile; an abort of `signal` ends the
// wait (AbortError). Without onWait a busy answer is the caller's to report. Students clicked again
// and again, each click a lottery (a review by use, a classroom).
const BUSY_RETRIES = 3;

export async function whenNotBusy(request, signal, onWait) {
  for (let tries = 0; ; tries++) {
    try {
      return await request();
    } catch (err) {
      if (err?.status !== 429 || !onWait || tries >= BUSY_RETRIES || signal?.aborted) throw err;
      const seconds = (err.retryAfter ?? 1) + Math.random();
      onWait(Math.ceil(seconds));
      await new Promise((resolve, reject) => {
        const timer = setTimeout(resolve, seconds * 1000);
        signal?.addEventListener("abort", () => {
          clearTimeout(timer);
          reject(new DOMException("The wait was cancelled", "AbortError"));
        }, { once: true });
      });
    }
  }
}

// `tooLong`: what an input over the model's positions is called and what to do about it (the
// run form's text, by default; Generate's prompt, which cannot be cut). The server's message ends
// in its own advice ("; shorten it"): the page gives advice once, in its words.
const RUN_TEXT = { subject: "Text", advice: "Shorten it, or tick “Cut to fit” to keep the start." };

export function describeError(err, tooLong = RUN_TEXT) {
  if (!(err instanceof ApiError)) return `Something went wrong in the page: ${err.message}`;
  const detail = err.message.replace(/\.?$/, ".");
  switch (err.status) {
    case 0:
      return err.message;
    case 401: {
      // The server's reason may begin by saying so itself ("this server needs an API key: send ..."):
      // the page said it twice.
      const reason = err.message.replace(/^this server needs an API key:?\s*/i, "").replace(/\.$/, "");
      return `This server needs an API key${reason ? ` (${reason})` : ""}. Reload the page to enter it again.`;
    }
    case 404:
      return `Not found: ${detail}`;
    case 413:
      // A run the server's cache cannot hold comes with the server's own advice, which may be
      // that no text is short enough.
      return err.code === "run_too_large" ? `Too large: ${detail}` : `Too large: ${detail} Try a shorter text.`;
    case 422:
      return isTooLong(err)
        ? `${tooLong.subject} too long: ${err.message.split(";")[0]}. ${tooLong.advice}`
        : `Cannot run this input: ${detail}`;
    case 429: {
      const wait = err.retryAfter ? ` Try again in ${err.retryAfter} s.` : " Try again in a moment.";
      return `The server is busy.${wait}`;
    }
    case 504:
      return `The server took too long to answer: ${detail} Try a shorter text.`;
    case 503:
      // Loading, not failing: a server that has just started answers so until its models are in.
      if (err.code === "not_ready") return `The server is not ready yet: ${detail} Try again in a moment.`;
    // falls through: any other 503 is a failure like the rest
    default:
      return `The server failed (${err.status}): ${detail}`;
  }
}
