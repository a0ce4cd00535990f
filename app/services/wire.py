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

import re
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


# RFC 9110's qvalue: 0 to 1, at most three decimals. Anything else ("inf", "1e999") is malformed.
QVALUE = re.compile(r"(0(\.[0-9]{0,3})?|1(\.0{0,3})?)")


def listed(header: str | None, token: str) -> float | None:
    """The q a comma-separated Accept/Accept-Encoding header gives `token` by name: 1 when listed
    without one, 0 when its q is malformed, None when it is not listed."""
    for part in (header or "").lower().split(","):
        name, _, params = part.strip().partition(";")
        if name.strip() != token:
            continue
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip() == "q":
                value = value.strip()
                return float(value) if QVALUE.fullmatch(value) else 0.0
        return 1.0
    return None


def coding_q(accept_encoding: str | None, coding: str) -> float:
    """The q Accept-Encoding gives a content coding: by name, else by `*`, which stands for every
    coding the header does not name (RFC 9110, 12.5.3); 0 when neither is listed."""
    q = listed(accept_encoding, coding)
    if q is None:
        q = listed(accept_encoding, "*")
    return q or 0.0


def header_list(headers, name: str) -> str:
    """A request header as one comma-separated list, however many lines it came on (RFC 9110, 5.3)."""
    return ", ".join(headers.getlist(name))


# The JSON answer's own media types: application/json (float32) and the compact form's.
JSON_MEDIA_TYPES = ("application/json", "application/vnd.manyeyes+json")


def prefers_frame(accept: str | None) -> bool:
    """The frame when Accept names it, unless JSON ranks higher: `frame;q=0.1, application/json`
    (or the compact form's `application/vnd.manyeyes+json`, which ranked nothing) asks for JSON.
    The most specific range that covers JSON gives its q (RFC 9110, 12.5.1)."""
    frame_q = listed(accept, FRAME_MEDIA_TYPE) or 0.0
    named = [q for q in (listed(accept, name) for name in JSON_MEDIA_TYPES) if q is not None]
    covering = (listed(accept, name) for name in ("application/*", "*/*"))
    json_q = max(named) if named else next((q for q in covering if q is not None), 0.0)
    return frame_q > 0 and frame_q >= json_q


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

    Whichever of zstd and gzip the client ranks higher, zstd on a tie: for `json` text from
    gzip_min_bytes on (it shrinks 2.5-3x), for compact bodies from zstd_min_bytes on (0: never),
    where the bytes saved outweigh the two passes on any link slower than loopback. Both at level
    1 cost about the same here: on MiniLM's u8 answer at T=512 (18.9 MB) zstd made 6.9x smaller
    in 49 ms, ISA-L's gzip 5.9x in 35 ms; on its f16 answer both 1.2x in ~135 ms. gzip counts: a
    browser offers zstd only over https, so a page on a LAN address over plain http got its 19 MB
    answers uncompressed while compact bodies were never gzipped. zlib's level 5 took longer than
    the forward pass, so gzip is ISA-L at level 1 by default."""

    def __init__(self, zstd_level: int, zstd_min_bytes: int, gzip_level: int, gzip_min_bytes: int) -> None:
        self.zstd_level = zstd_level
        self.zstd_min_bytes = zstd_min_bytes
        self.gzip_level = gzip_level
        self.gzip_min_bytes = gzip_min_bytes

    def choose(self, accept_encoding: str | None, nbytes: int, text: bool) -> str | None:
        """The encoding the client ranks highest, zstd on a tie, for a body big enough to be worth it."""
        worth = nbytes >= self.gzip_min_bytes if text else 0 < self.zstd_min_bytes <= nbytes
        if not worth:
            return None
        zstd_q, gzip_q = coding_q(accept_encoding, "zstd"), coding_q(accept_encoding, "gzip")
        if zstd_q > 0 and zstd_q >= gzip_q:
            return "zstd"
        return "gzip" if gzip_q > 0 else None

    def encode(self, accept_encoding: str | None, pieces: list[bytes], text: bool) -> tuple[list[bytes], str | None]:
        """The pieces as sent, and their Content-Encoding (None: as they are)."""
        encoding = self.choose(accept_encoding, sum(len(p) for p in pieces), text)
        return self.apply(encoding, pieces), encoding

    def apply(self, encoding: str | None, pieces: list[bytes]) -> list[bytes]:
        if encoding == "zstd":
            # The size in the frame's header: without it the one-call ZstdDecompressor().decompress(body)
            # refuses the answer ("could not determine content size"), and clients guess a buffer.
            size = sum(len(p) for p in pieces)
            compressor = zstandard.ZstdCompressor(level=self.zstd_level).compressobj(size=size)
            out = [compressor.compress(p) for p in pieces]
            out.append(compressor.flush())
            return [b"".join(out)]
        if encoding == "gzip":
            compressor = fast_zlib.compressobj(self.gzip_level, fast_zlib.DEFLATED, 31)
            out = [compressor.compress(p) for p in pieces]
            out.append(compressor.flush())
            return [b"".join(out)]
        return pieces
