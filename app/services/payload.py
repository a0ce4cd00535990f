"""Attention tensors to v1 response bytes. The heavy part works on whole tensors (torch/numpy)
and orjson; nothing walks the cells in Python."""

from __future__ import annotations

import base64
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson
import torch

from manyeyes.app.services.cache import Run
from manyeyes.app.services.wire import frame
from manyeyes.model.buffers import empty_written_whole
from manyeyes.model.jit import compiled
from manyeyes.model.tokenizer import Token, TokenRows

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


@compiled(nogil=True, boundscheck=False)
def _quantise_u8(weights, out):
    # float32 multiply, then round half to even: torch.mul(w, 255.0).round_(), bit for bit, in
    # one vectorised pass with no float temporary (and no OpenMP team on the render thread).
    for i in range(weights.size):
        out[i] = np.uint8(np.rint(weights[i] * np.float32(255.0)))


def to_u8(attention: torch.Tensor) -> memoryview:
    """Weights in [0, 1] as round(w * 255), the same bytes services/device.quantise makes on a device.

    Written straight into the body's own buffer: an array plus its `tobytes()` copy were two fresh
    1.2 MB mappings at T=128 under the server's mmap threshold, 0.6 ms of page faults against 0.1.
    The buffer is not zero-filled first (a bytearray is): every byte is written by the quantiser,
    and the fill was a second pass over fresh pages, 0.9 against 0.7 ms at T=128 and 17 against
    6 ms at T=512 in one process under the server's allocator setting. In the server the buffer
    is a finished buffer's memory where one fits (model/buffers.py): pages already in, no faults
    where it was written before."""
    weights = attention.float().contiguous().numpy().reshape(-1)
    out = empty_written_whole((weights.size,), dtype=torch.uint8).numpy()
    _quantise_u8(weights, out)
    return as_bytes(out)


def as_bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as a flat byte view: bodies are sent from it, never copied."""
    return memoryview(np.ascontiguousarray(array)).cast("B")


def to_f16(attention: torch.Tensor) -> memoryview:
    # torch's conversion is vectorised (numpy's is not), into a buffer on huge pages as in to_u8
    halves = empty_written_whole(tuple(attention.shape), dtype=torch.float16).copy_(attention).numpy()
    if sys.byteorder != "little":
        halves = halves.byteswap()
    return as_bytes(halves)


def raw_data(attention: torch.Tensor, fmt: str) -> bytes | memoryview:
    """The weights as little-endian row-major bytes: what base64 wraps, and what a frame carries.
    A view of the tensor where its memory already holds those bytes (it keeps the tensor alive)."""
    if attention.dtype == torch.uint8:  # quantised on the device already (see services/device.py)
        return as_bytes(attention.numpy())
    if fmt == "u8":
        return to_u8(attention)
    if fmt == "f16":
        return to_f16(attention)
    floats = attention.float().numpy()
    return as_bytes(floats.byteswap() if sys.byteorder != "little" else floats)


def attention_meta(attention: torch.Tensor, fmt: str) -> dict:
    meta = {"format": fmt, "dtype": DTYPES[fmt], "shape": list(attention.shape)}
    if fmt == "u8":
        meta["scale"] = U8_SCALE
    return meta


def encode_attention(attention: torch.Tensor, fmt: str) -> list[bytes]:
    """The `attention` object of a JSON response as serialised pieces: the data stays its own
    piece (up to 25 MB at T=512), never copied again into a bigger string."""
    meta = attention_meta(attention, fmt)
    scale = meta.pop("scale", None)
    head = orjson.dumps(meta)[:-1]
    if fmt == "json":
        return [head + b',"data":', orjson.dumps(attention.float().numpy(), option=NUMPY), b"}"]
    tail = b'","scale":' + orjson.dumps(scale) + b"}" if fmt == "u8" else b'"}'
    return [head + b',"data":"', base64.b64encode(raw_data(attention, fmt)), tail]


def token_dicts(tokens: Sequence[Token]) -> list[dict]:
    """Each token as the contract's object, its fields in Token's order. A run's TokenRows give
    their plain rows (no Token made only to be read back): 0.09 ms at T=512 against 0.23."""
    rows = tokens.rows if isinstance(tokens, TokenRows) else tokens
    return [
        {"text": text, "id": id_, "start": start, "end": end, "special": special, "segment": segment, "piece": piece}
        for text, id_, start, end, special, segment, piece in rows
    ]


def result_fields(run: Run, info, view: View, predictions: dict | None = None) -> tuple[dict, dict]:
    """The fields before and after `attention`, in the contract's order; `predictions`
    (position -> top-k dicts) appears only when it was asked for."""
    before = {
        "run_id": run.run_id,
        "model": run.model,
        "causal": info.causal,
        # From the tensor: the mean route's answer is one (1, 1, T, T) matrix and says so.
        "n_layers": run.attention.shape[0] if run.attention is not None else info.n_layers,
        "n_heads": run.attention.shape[1] if run.attention is not None else info.n_heads,
        "tokens": token_dicts(run.tokens),
        "truncated": run.truncated,
        "layers": view.layers,
        "heads": view.heads,
        "kept": run.kind,
        "precision": run.precision,
    }
    after = {"device": info.device}
    if predictions is not None:
        after = {"predictions": predictions, **after}
    return before, after


def timing_ms(timing_s: dict) -> dict:
    return {k: round(v * 1000, 3) for k, v in timing_s.items()}


def render_result(run: Run, info, view: View, timing_s: dict, predictions: dict | None = None,
                  mean_of: dict | None = None) -> list[bytes]:
    """One v1 result as pieces of one JSON object, in the contract's field order;
    `timing_s` holds tokenize/queue/forward seconds, encode is measured here. `mean_of`: the
    layers and heads the mean route's one matrix averages."""
    started = time.perf_counter()
    attention = encode_attention(select(run.attention, view.layers, view.heads), view.format)
    before, after = result_fields(run, info, view, predictions)
    if mean_of is not None:
        after = {"mean_of": mean_of, **after}
    after["timing_ms"] = timing_ms({**timing_s, "encode": time.perf_counter() - started})
    first = orjson.dumps(before)[:-1] + b',"attention":' + attention[0]
    return [first, *attention[1:-1], attention[-1] + b"," + orjson.dumps(after)[1:]]


def links_for(run_id: str) -> dict:
    """URL templates of a run's routes (issue 10); `{name}` is a query parameter to fill or drop."""
    base = f"/api/v1/runs/{run_id}"
    return {
        "run": base,
        "tile": f"{base}/tile?layer={{layer}}&head={{head}}&q0={{q0}}&q1={{q1}}&k0={{k0}}&k1={{k1}}"
                "&rows={rows}&cols={cols}&pool={pool}&format={format}",
        "topk": f"{base}/topk?layer={{layer}}&head={{head}}&k={{k}}&q0={{q0}}&q1={{q1}}&format={{format}}",
        "overview": f"{base}/overview?format={{format}}",
    }


def render_kept(run: Run, info, view: View, timing_s: dict, predictions: dict | None = None) -> list[bytes]:
    """A run that kept queries and keys: the usual fields, `attention: null` and the links to
    the routes that serve its heads, as one JSON object."""
    started = time.perf_counter()
    before, after = result_fields(run, info, view, predictions)
    after["timing_ms"] = timing_ms({**timing_s, "encode": time.perf_counter() - started})
    return [orjson.dumps({**before, "attention": None, "links": links_for(run.run_id), **after})]


def join_results(results: list[list[bytes]], batch: bool) -> list[bytes]:
    """`{"results": [...]}` for a batch, the lone object otherwise; still in pieces."""
    if not batch:
        return results[0]
    pieces = [b'{"results":[']
    for i, result in enumerate(results):
        pieces.extend(result if i == 0 else [b"," + result[0], *result[1:]])
    pieces.append(b"]}")
    return pieces


def render_frame(runs: list[tuple[Run, dict, dict | None]], info, view: View, batch: bool,
                 mean_of: dict | None = None) -> list[bytes]:
    """The same answer as a binary frame (see services/wire.py): one JSON header, raw data after.
    `runs` holds (run, timing seconds, predictions or None) per result; `mean_of` as render_result's."""
    results, data, offset = [], [], 0
    for run, timing_s, predictions in runs:
        started = time.perf_counter()
        attention = select(run.attention, view.layers, view.heads)
        raw = raw_data(attention, view.format)
        before, after = result_fields(run, info, view, predictions)
        if mean_of is not None:
            after = {"mean_of": mean_of, **after}
        after["timing_ms"] = timing_ms({**timing_s, "encode": time.perf_counter() - started})
        meta = {**attention_meta(attention, view.format), "offset": offset, "nbytes": len(raw)}
        results.append({**before, "attention": meta, **after})
        data.append(raw)
        offset += len(raw)
    header = orjson.dumps({"results": results} if batch else results[0])
    return frame(header, data)
