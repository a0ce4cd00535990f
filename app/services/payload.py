"""Attention tensors to v1 response bytes. The heavy part works on whole tensors (torch/numpy)
and orjson; nothing walks the cells in Python."""

from __future__ import annotations

import base64
import sys
import time
from dataclasses import dataclass

import orjson
import torch

from manyeyes.app.services.cache import Run

U8_SCALE = 1 / 255
DTYPES = {"json": "float32", "f16": "float16", "u8": "uint8"}
NUMPY = orjson.OPT_SERIALIZE_NUMPY


@dataclass
class View:
    """What one response shows of a run."""

    layers: list[int]
    heads: list[int]
    format: str

    def cells(self, n_tokens: int) -> int:
        return len(self.layers) * len(self.heads) * n_tokens * n_tokens


def select(attention: torch.Tensor, layers: list[int], heads: list[int]) -> torch.Tensor:
    """(L, H, T, T) -> (L', H', T, T), contiguous; no copy when everything is asked for."""
    n_layers, n_heads = attention.shape[:2]
    if layers != list(range(n_layers)):
        attention = attention.index_select(0, torch.tensor(layers))
    if heads != list(range(n_heads)):
        attention = attention.index_select(1, torch.tensor(heads))
    return attention.contiguous()


def to_u8(attention: torch.Tensor) -> bytes:
    """Weights in [0, 1] as round(w * 255). Layer by layer: one small float buffer instead of a
    second full-size temporary, which at T=512 costs more in page faults than the arithmetic."""
    out = torch.empty(attention.shape, dtype=torch.uint8)
    buf = torch.empty(attention.shape[1:], dtype=torch.float32)
    for i in range(attention.shape[0]):
        torch.mul(attention[i], 255.0, out=buf)
        out[i].copy_(buf.round_())
    return out.numpy().tobytes()


def to_f16(attention: torch.Tensor) -> bytes:
    halves = attention.to(torch.float16).numpy()  # torch's conversion is vectorised; numpy's is not
    if sys.byteorder != "little":
        halves = halves.byteswap()
    return halves.tobytes()


def encode_attention(attention: torch.Tensor, fmt: str) -> list[bytes]:
    """The `attention` object of a response as serialised pieces: the data stays its own piece
    (up to 25 MB at T=512), never copied again into a bigger string."""
    head = orjson.dumps({"format": fmt, "dtype": DTYPES[fmt], "shape": list(attention.shape)})[:-1]
    if fmt == "json":
        return [head + b',"data":', orjson.dumps(attention.numpy(), option=NUMPY), b"}"]
    raw = to_u8(attention) if fmt == "u8" else to_f16(attention)
    tail = b'","scale":' + orjson.dumps(U8_SCALE) + b"}" if fmt == "u8" else b'"}'
    return [head + b',"data":"', base64.b64encode(raw), tail]


def token_dicts(run: Run) -> list[dict]:
    return [
        {"text": t.text, "id": t.id, "start": t.start, "end": t.end, "special": t.special, "segment": t.segment,
         "piece": t.piece}
        for t in run.tokens
    ]


def render_result(run: Run, info, view: View, timing_s: dict, predictions: dict | None = None) -> list[bytes]:
    """One v1 result as pieces of one JSON object, in the contract's field order;
    `timing_s` holds tokenize/queue/forward seconds, encode is measured here;
    `predictions` (position -> top-k dicts) appears only when it was asked for."""
    started = time.perf_counter()
    attention = encode_attention(select(run.attention, view.layers, view.heads), view.format)
    timing_s = {**timing_s, "encode": time.perf_counter() - started}
    before = {
        "run_id": run.run_id,
        "model": run.model,
        "causal": info.causal,
        "n_layers": run.attention.shape[0],
        "n_heads": run.attention.shape[1],
        "tokens": token_dicts(run),
        "truncated": run.truncated,
        "layers": view.layers,
        "heads": view.heads,
    }
    after = {"device": info.device, "timing_ms": {k: round(v * 1000, 3) for k, v in timing_s.items()}}
    if predictions is not None:
        after = {"predictions": predictions, **after}
    first = orjson.dumps(before)[:-1] + b',"attention":' + attention[0]
    return [first, *attention[1:-1], attention[-1] + b"," + orjson.dumps(after)[1:]]


def join_results(results: list[list[bytes]], batch: bool) -> list[bytes]:
    """`{"results": [...]}` for a batch, the lone object otherwise; still in pieces."""
    if not batch:
        return results[0]
    pieces = [b'{"results":[']
    for i, result in enumerate(results):
        pieces.extend(result if i == 0 else [b"," + result[0], *result[1:]])
    pieces.append(b"]}")
    return pieces
