// Runs one API request off the main thread and decodes its attention payload; the decoded typed
// array is transferred back, not copied. Attention is asked for as a binary frame (raw bytes, no
// base64); the browser negotiates zstd or gzip by itself and hands over the decoded bytes.

import { ApiError, request } from "./api.js";
import { FRAME_MEDIA_TYPE, decodeAttention, decodeFrame } from "./payload.js";

self.onmessage = async ({ data: { id, url, init } }) => {
  try {
    const headers = { ...(init.headers || {}), Accept: `${FRAME_MEDIA_TYPE}, application/json;q=0.5` };
    const reply = await request(url, { ...init, headers }, true);
    let body;
    if (reply instanceof ArrayBuffer) {
      body = decodeFrame(reply);
    } else {
      // A server (or a proxy) that answered JSON after all: base64 or nested lists.
      body = reply;
      // A long run's answer (`kept: "qk"`) has no attention: the page asks for tiles instead.
      if (body.attention) body.attention = { ...body.attention, decoded: decodeAttention(body.attention), data: null };
    }
    const decoded = body.attention?.decoded;
    self.postMessage({ id, body }, decoded ? [(decoded.bytes || decoded.values).buffer] : []);
  } catch (err) {
    const known = err instanceof ApiError;
    self.postMessage({
      id,
      error: {
        status: known ? err.status : 0,
        code: known ? err.code : "client",
        message: known ? err.message : `The response could not be read: ${err.message}`,
        retryAfter: known ? err.retryAfter : null,
      },
    });
  }
};
