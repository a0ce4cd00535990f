"""How an answer travels: JSON or the raw binary frame (chosen by `Accept`), and which
compression (chosen by `Accept-Encoding`, and by whether it pays for itself end to end).

The frame (`Content-Type: application/vnd.manyeyes.frame`):

    offset 0   4 bytes   magic b"MEF1"
    offset 4   u32 LE    H, the header's length in bytes
    offset 8   H bytes   UTF-8 JSON: the same object the JSON answer has, except that each
                         `attention` carries `offset` and `nbytes` instead of `data`
    offset 8+H           the data section; each result's weights at its `offset`, `nbytes` long,
                         raw little-endian row-major uint8 (u8), float16 (f16) or float32 (json)

The header is padded with spaces so the data section starts on an 8-byte boundary: a browser
can view the bytes as a Float32Array/Uint16Array without copying.
"""

from __future__ import annotations

import struct
import zlib

import zstandard

try:  # ISA-L's deflate is ~3x zlib's at level 1; same gzip bytes on the wire
    from isal import isal_zlib as fast_zlib
except ImportError:  # pragma: no cover - the dependency is declared, this only keeps a bare install working
    fast_zlib = zlib

FRAME_MEDIA_TYPE = "application/vnd.manyeyes.frame"
MAGIC = b"MEF1"
ALIGN = 8


def accepts(header: str | None, token: str) -> bool:
    """True when a comma-separated Accept/Accept-Encoding header lists `token` with q > 0."""
    for part in (header or "").lower().split(","):
        name, _, params = part.strip().partition(";")
        if name.strip() != token:
            continue
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def frame(header: bytes, data: list[bytes]) -> list[bytes]:
    """The frame's pieces: prefix + padded header, then the data pieces as they are."""
    pad = -(len(MAGIC) + 4 + len(header)) % ALIGN
    header += b" " * pad
    return [MAGIC + struct.pack("<I", len(header)) + header, *data]


def read_frame(body: bytes) -> tuple[dict, memoryview]:
    """Inverse of frame(): (header object, data section). For tests and Python clients."""
    import orjson

    if body[:4] != MAGIC:
        raise ValueError(f"not a manyeyes frame: starts with {bytes(body[:4])!r}")
    (size,) = struct.unpack_from("<I", body, 4)
    return orjson.loads(body[8 : 8 + size]), memoryview(body)[8 + size :]


class Compression:
    """Picks and applies a Content-Encoding for one answer.

    zstd (level 1, ~350 MB/s here, decoded at ~1 GB/s) whenever the client accepts it: for `json`
    text from gzip_min_bytes on, for compact bodies from zstd_min_bytes on (0: never), where the
    bytes saved outweigh the two passes on any link slower than loopback. gzip only for `json`
    text, which shrinks 2.5-3x, with ISA-L at level 1: zlib's level 5 took longer than the
    forward pass. Compact bodies are never gzipped: deflate gains less on them for more time."""

    def __init__(self, zstd_level: int, zstd_min_bytes: int, gzip_level: int, gzip_min_bytes: int) -> None:
        self.zstd_level = zstd_level
        self.zstd_min_bytes = zstd_min_bytes
        self.gzip_level = gzip_level
        self.gzip_min_bytes = gzip_min_bytes

    def choose(self, accept_encoding: str | None, nbytes: int, text: bool) -> str | None:
        if not self.zstd_min_bytes and not text:
            return None
        # JSON text shrinks 3x and is worth it from gzip's small threshold on; compact bodies
        # shrink ~2x and only from zstd_min_bytes on.
        if nbytes >= (self.gzip_min_bytes if text else self.zstd_min_bytes) and accepts(accept_encoding, "zstd"):
            return "zstd"
        if text and nbytes >= self.gzip_min_bytes and accepts(accept_encoding, "gzip"):
            return "gzip"
        return None

    def apply(self, encoding: str | None, pieces: list[bytes]) -> list[bytes]:
        if encoding == "zstd":
            compressor = zstandard.ZstdCompressor(level=self.zstd_level).compressobj()
            out = [compressor.compress(p) for p in pieces]
            out.append(compressor.flush())
            return [b"".join(out)]
        if encoding == "gzip":
            compressor = fast_zlib.compressobj(self.gzip_level, fast_zlib.DEFLATED, 31)
            out = [compressor.compress(p) for p in pieces]
            out.append(compressor.flush())
            return [b"".join(out)]
        return pieces
