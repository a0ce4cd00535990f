// Decoding the API's attention payloads into flat typed arrays, row-major [layer][head][query][key].

// The binary frame (Accept: application/vnd.manyeyes.frame): "MEF1", u32 LE header length, a JSON
// header (the JSON answer with attention.offset/nbytes in place of data), then the raw weights.
export const FRAME_MEDIA_TYPE = "application/vnd.manyeyes.frame";
const MAGIC = "MEF1";

function base64ToBytes(b64) {
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(b64);
  const binary = atob(b64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

let halfTable = null;

// All 65536 float16 bit patterns, decoded once: a table lookup beats bit twiddling per cell.
function halfToFloatTable() {
  if (halfTable) return halfTable;
  halfTable = new Float32Array(65536);
  for (let bits = 0; bits < 65536; bits++) {
    const sign = bits & 0x8000 ? -1 : 1;
    const exponent = (bits >> 10) & 0x1f;
    const fraction = bits & 0x3ff;
    let value;
    if (exponent === 0) value = fraction * 2 ** -24;
    else if (exponent === 31) value = fraction ? NaN : Infinity;
    else value = (1 + fraction / 1024) * 2 ** (exponent - 15);
    halfTable[bits] = sign * value;
  }
  return halfTable;
}

function halvesToFloats(halves) {
  const table = halfToFloatTable();
  const values = new Float32Array(halves.length);
  for (let i = 0; i < halves.length; i++) values[i] = table[halves[i]];
  return values;
}

// Returns { shape, bytes?, scale?, values? }: `bytes` for u8 (weight = byte * scale), else float `values`.
export function decodeAttention(attention) {
  const { format, shape } = attention;
  if (format === "u8") {
    return { shape, bytes: base64ToBytes(attention.data), scale: attention.scale ?? 1 / 255 };
  }
  if (format === "f16") {
    const raw = base64ToBytes(attention.data);
    return { shape, values: halvesToFloats(new Uint16Array(raw.buffer, raw.byteOffset, raw.byteLength / 2)) };
  }
  return { shape, values: Float32Array.from(attention.data.flat(3)) };
}

// A frame's header object, each result's attention carrying `decoded` (views into `buffer` where
// the dtype allows: the data section starts 8-byte aligned, so u8 and float32 need no copy).
export function decodeFrame(buffer) {
  const view = new DataView(buffer);
  const magic = String.fromCharCode(...new Uint8Array(buffer, 0, 4));
  if (magic !== MAGIC) throw new Error(`not a manyeyes frame (starts with ${JSON.stringify(magic)})`);
  const headerLength = view.getUint32(4, true);
  const body = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, headerLength)));
  const dataStart = 8 + headerLength;
  for (const result of body.results ?? [body]) {
    const attention = result.attention;
    const start = dataStart + attention.offset;
    const { format, shape, nbytes } = attention;
    if (format === "u8") {
      attention.decoded = { shape, bytes: new Uint8Array(buffer, start, nbytes), scale: attention.scale ?? 1 / 255 };
    } else if (format === "f16") {
      attention.decoded = { shape, values: halvesToFloats(new Uint16Array(buffer, start, nbytes / 2)) };
    } else {
      attention.decoded = { shape, values: new Float32Array(buffer, start, nbytes / 4) };
    }
  }
  return body;
}
