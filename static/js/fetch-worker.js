// Runs one API request off the main thread and decodes its attention payload; the decoded typed
// array is transferred back, not copied.

import { ApiError, request } from "./api.js";
import { decodeAttention } from "./payload.js";

self.onmessage = async ({ data: { id, url, init } }) => {
  try {
    const body = await request(url, init);
    const decoded = decodeAttention(body.attention);
    body.attention = { ...body.attention, data: null, decoded };
    self.postMessage({ id, body }, [(decoded.bytes || decoded.values).buffer]);
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
