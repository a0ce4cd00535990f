// One analysed text: its tokens and whichever layers have arrived so far.
// Layers arrive as u8 (fast, for the grid); single heads can be refined to float16 for exact reading.

// What every run the page holds knows of its answer, short (AttentionRun) or long (LongRun);
// slidingWindows: the model's, per layer, from GET /models (the answer does not repeat them).
export function runHeader(response, slidingWindows = []) {
  return {
    runId: response.run_id,
    model: response.model,
    causal: response.causal,
    slidingWindows,
    nLayers: response.n_layers,
    nHeads: response.n_heads,
    tokens: response.tokens,
    truncated: response.truncated,
    T: response.tokens.length,
    hasPair: response.tokens.some((t) => t.segment === 1),
    precision: response.precision ?? "json",
  };
}

// Which keys a query cannot see, as the model masks them: later keys when `causal`, and with a
// sliding window of W positions those W or more behind the query. cell(q, k); block(q0, q1, k0, k1)
// says whether every cell of queries [q0, q1) × keys [k0, k1) is masked; span(q, T): the keys
// [from, to) of T that query q sees; none: nothing ever is.
export function maskRule(causal, window = null) {
  const far = window !== null;
  return {
    window,
    none: !causal && !far,
    cell: (q, k) => (causal && k > q) || (far && k <= q - window),
    block: (q0, q1, k0, k1) => (causal && k0 > q1 - 1) || (far && k1 - 1 <= q0 - window),
    span: (q, T) => [far ? Math.min(T, Math.max(0, q - window + 1)) : 0, causal ? Math.min(T, q + 1) : T],
  };
}

// The rule of one layer, or (layer null) of the mean over every layer: a cell is masked there only
// where every layer masks it, so the widest window counts and one layer without a window lifts it.
export function layerMask(run, layer) {
  const windows = run.slidingWindows.length ? run.slidingWindows : [null];
  const window = layer === null
    ? (windows.includes(null) ? null : Math.max(...windows))
    : (windows[layer] ?? null);
  return maskRule(run.causal, window);
}

// How the focused heatmap's caption says what the grey, hatched cells are.
export function maskWords(run, rule) {
  if (!run.causal && rule.window === null) return "bidirectional";
  const behind = rule.window === null ? "" : `, nor more than ${rule.window - 1} tokens back (sliding window)`;
  return run.causal
    ? `causal: grey hatched cells are masked, a token cannot see ahead${behind}`
    : `grey hatched cells are masked: a token cannot see more than ${rule.window - 1} tokens back (sliding window)`;
}

// Whether views of a run kept at `precision` (its answer's `precision`) can be had in `format`.
const PRECISION = { json: 0, f16: 1, u8: 2 };
export function holdsFor(precision, format) {
  return PRECISION[precision] <= PRECISION[format];
}

export class AttentionRun {
  constructor(response, slidingWindows = []) {
    Object.assign(this, runHeader(response, slidingWindows));
    this.layerBytes = new Array(this.nLayers).fill(null); // each Uint8Array [head][query][key]
    this.scale = 1 / 255;
    this.precise = new Map(); // "layer:head" -> Float32Array [query][key]
    this.means = new Map(); // "all" or "layer:N" -> Float32Array, the server's float32 mean
    // "layer:head" or "mean:all", "mean:layer:N" -> { values: float32 weights, precision: "f32" (an
    // exported file's: its own "f16" or "u8") }, for renormalised views and readings
    this.float32 = new Map();
    this.exactFailed = new Set(); // layers whose float16 values could not be fetched, until one fetch succeeds
    this.ingest(response);
  }

  // Accepts a POST or slice response, decoded by the API worker; only whole layers feed the grid.
  ingest({ layers, heads, attention }) {
    const { decoded } = attention;
    const [nL, nH, T] = decoded.shape;
    const cells = T * T;
    const headList = heads || [...Array(nH).keys()];
    const layerList = layers || [...Array(nL).keys()];
    const wholeLayers = nH === this.nHeads;
    layerList.forEach((layer, li) => {
      if (decoded.bytes) {
        this.scale = decoded.scale;
        if (wholeLayers) this.layerBytes[layer] = decoded.bytes.subarray(li * nH * cells, (li + 1) * nH * cells);
        return;
      }
      headList.forEach((head, hi) => {
        const start = (li * nH + hi) * cells;
        this.precise.set(`${layer}:${head}`, decoded.values.subarray(start, start + cells));
      });
    });
  }

  hasLayer(layer) {
    return this.layerBytes[layer] !== null;
  }

  isPrecise(layer, head) {
    return this.precise.has(`${layer}:${head}`);
  }

  headBytes(layer, head) {
    const cells = this.T * this.T;
    return this.layerBytes[layer].subarray(head * cells, (head + 1) * cells);
  }

  // One weight of one head, exact where its values have come, else 8-bit; null while its layer has not.
  weightAt(layer, head, query, key) {
    const at = query * this.T + key;
    const exact = this.precise.get(`${layer}:${head}`);
    if (exact) return exact[at];
    return this.hasLayer(layer) ? this.headBytes(layer, head)[at] * this.scale : null;
  }

  // Float weights of one head; null while its layer has not arrived.
  head(layer, head) {
    const exact = this.precise.get(`${layer}:${head}`);
    if (exact) return exact;
    if (!this.hasLayer(layer)) return null;
    const bytes = this.headBytes(layer, head);
    const values = new Float32Array(bytes.length);
    for (let i = 0; i < bytes.length; i++) values[i] = bytes[i] * this.scale;
    return values;
  }

  // The exact mean of "all" (the server's) or of "layer:N", averaged here from the layer's float16
  // heads once they have arrived: at T=512 that is 3 M additions, ~5 ms, against a round trip to
  // the server. null until then.
  exactMean(key) {
    if (!this.means.has(key) && key.startsWith("layer:")) {
      const layer = Number(key.split(":")[1]);
      const heads = [...Array(this.nHeads).keys()].map((h) => this.precise.get(`${layer}:${h}`));
      if (heads.every(Boolean)) this.means.set(key, meanOf(heads));
    }
    return this.means.get(key) ?? null;
  }
}

// The elementwise mean of equal-length float arrays, summed in float64 then stored as float32.
function meanOf(arrays) {
  const sum = new Float64Array(arrays[0].length);
  for (const a of arrays) for (let i = 0; i < a.length; i++) sum[i] += a[i];
  const mean = new Float32Array(sum.length);
  for (let i = 0; i < sum.length; i++) mean[i] = sum[i] / arrays.length;
  return mean;
}
