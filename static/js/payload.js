// Decoding the API's attention payloads into flat typed arrays, row-major [layer][head][query][key].

export function base64ToBytes(b64) {
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

// Returns { shape, bytes?, scale?, values? }: `bytes` for u8 (weight = byte * scale), else float `values`.
export function decodeAttention(attention) {
  const { format, shape } = attention;
  if (format === "u8") {
    return { shape, bytes: base64ToBytes(attention.data), scale: attention.scale ?? 1 / 255 };
  }
  if (format === "f16") {
    const raw = base64ToBytes(attention.data);
    const halves = new Uint16Array(raw.buffer, raw.byteOffset, raw.byteLength / 2);
    const table = halfToFloatTable();
    const values = new Float32Array(halves.length);
    for (let i = 0; i < halves.length; i++) values[i] = table[halves[i]];
    return { shape, values };
  }
  return { shape, values: Float32Array.from(attention.data.flat(3)) };
}
