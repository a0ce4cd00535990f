"""Any head of any cached run, a window at a time (issue 10): full-resolution or pooled tiles of
one head or of a layer's mean, each query row's top-k, and every head's overview thumbnail.

Long runs keep their queries and keys (`KeptAttention`) and regenerate exactly the weights a
request covers; short runs answer from their kept tensor through a `DenseAttention`, so every
route works for both. The work happens in row blocks sized from `tile_block_bytes`: a request
holds at most its answer plus one block of weights, however long the run.
"""

from __future__ import annotations

import base64
import sys
import time
from dataclasses import dataclass

import orjson
import torch

from manyeyes.app.services.attention import (
    COMPACT_MEDIA_TYPE,
    AttentionService,
    Reply,
    Wire,
    answer_bytes,
    check_precision,
    finished_off_loop,
    negotiated,
    off_loop_unless_small,
    parse_index,
    resolve_indices,
)
from manyeyes.app.services.cache import Run
from manyeyes.app.services.errors import InvalidInput, TooManyCells, brief
from manyeyes.app.services.payload import attention_meta, links_for, raw_data, token_dicts
from manyeyes.app.services.wire import ALIGN, FRAME_MEDIA_TYPE, frame
from manyeyes.model.attention import Capture
from manyeyes.model.kept import MAX_TOPK, pooled, topk_rows

# GET /runs/{id} is mostly the run's tokens. Through its response model, on the event loop, it
# took 53-127 ms at 8,192 tokens and 334 ms at 32,768, with every other request waiting; up to
# this many tokens serialising costs less than the hop to a worker thread.
INLINE_INFO_TOKENS = 512


# ---------------------------------------------------------------------------- request checks
@dataclass(frozen=True)
class Window:
    q0: int
    q1: int
    k0: int
    k1: int

    @property
    def n_rows(self) -> int:
        return self.q1 - self.q0

    @property
    def n_cols(self) -> int:
        return self.k1 - self.k0


def span(run: Run, lo: int | None, hi: int | None, lo_name: str, hi_name: str) -> tuple[int, int]:
    """[lo, hi) within the run's tokens; defaults: all of them. Negative values are refused by
    the route (ge=0) before this."""
    n = run.n_tokens
    if hi is None and lo is not None and lo >= n:  # "below q1=39" named a bound the client never sent
        raise InvalidInput(f"{lo_name}={lo} is past the run's end: run {run.run_id} has {n:,} tokens, "
                           f"so {lo_name} lies in 0..{n - 1}")
    lo = 0 if lo is None else lo
    hi = n if hi is None else hi
    if hi > n:
        raise InvalidInput(f"{hi_name}={hi} is past the run's end: run {run.run_id} has {n:,} tokens, "
                           f"so {hi_name} is at most {n:,}")
    if lo >= hi:
        raise InvalidInput(f"{lo_name}={lo} must be below {hi_name}={hi}: the window [{lo_name}, {hi_name}) would be empty")
    return lo, hi


def parse_head(head: str, n_heads: int, model_id: str) -> int | None:
    """A query head index, or None for "mean" (the mean over the layer's heads)."""
    if head.strip().lower() == "mean":
        return None
    if not (head.isascii() and head.isdigit()):
        raise InvalidInput(f"head must be a head index or 'mean', got {brief(head)!r}")
    return resolve_indices([parse_index(head, "head")], n_heads, "head", model_id)[0]


def side(asked: int | None, extent: int, name: str, cap: int) -> int:
    """Answer rows (or cols): the window's extent at full resolution, else at most what was asked."""
    if asked is None:
        return extent
    if asked > cap:
        raise InvalidInput(f"{name}={asked} is over this server's tile size of {cap:,} per side")
    return min(asked, extent)


# ---------------------------------------------------------------------------- encoding
def array_meta(values: torch.Tensor, fmt: str) -> dict:
    if values.dtype in (torch.int32, torch.int64):
        return {"format": "i32" if fmt != "json" else "json", "dtype": "int32", "shape": list(values.shape)}
    return attention_meta(values, fmt)


def array_bytes(values: torch.Tensor, fmt: str) -> bytes:
    """Little-endian row-major bytes; weights as attention encodes them, indices as int32."""
    if values.dtype in (torch.int32, torch.int64):
        ints = values.to(torch.int32).numpy()
        return (ints.byteswap() if sys.byteorder != "little" else ints).tobytes()
    # 2-D for raw_data's u8 path, which works a row at a time; the bytes are the same.
    flat = values.float().reshape(-1, values.shape[-1]) if values.dim() else values.float().reshape(1, 1)
    return raw_data(flat.contiguous(), fmt)


def render(fields: dict, arrays: dict[str, torch.Tensor], fmt: str, as_frame: bool) -> tuple[list[bytes], str]:
    """One answer: `fields` then each array, as JSON (data inline) or as the binary frame
    (offset/nbytes into the data section, each array 8-byte aligned). Returns (pieces, media type)."""
    out = dict(fields)
    if as_frame:
        data, offset = [], 0
        for name, values in arrays.items():
            raw = array_bytes(values, fmt)
            meta = array_meta(values, fmt)
            if meta["format"] == "json":  # raw float32 in a frame, as /attention sends it
                meta["format"] = "i32" if meta["dtype"] == "int32" else "json"
            out[name] = {**meta, "offset": offset, "nbytes": len(raw)}
            padding = b"\0" * (-len(raw) % ALIGN)  # a piece of its own: raw may be a view
            data += [raw, padding] if padding else [raw]
            offset += len(raw) + len(padding)
        return frame(orjson.dumps(out), data), FRAME_MEDIA_TYPE
    for name, values in arrays.items():
        meta = array_meta(values, fmt)
        if fmt == "json":
            meta["data"] = values.numpy() if values.dtype != torch.int64 else values.to(torch.int32).numpy()
        else:
            meta["data"] = base64.b64encode(array_bytes(values, fmt)).decode("ascii")
        out[name] = meta
    media = "application/json" if fmt == "json" else COMPACT_MEDIA_TYPE
    return [orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)], media


OVERVIEW_SIDE = Capture.overview  # an overview's heads are pooled to this many rows and columns, at most
# A tile's row and column edges (two lists of at most max_tile_side + 1 positions, as JSON) and its fields.
EDGES_BYTES = 32 * 1024


# ---------------------------------------------------------------------------- the service
class TileService:
    """Reads runs from the attention service's cache; renders and compresses as it does."""

    def __init__(self, attention: AttentionService) -> None:
        self.attention = attention
        self.settings = attention.settings
        self.block_cells = attention.settings.tile_block_bytes // 4  # float32 weights

    def _run(self, run_id: str, fmt: str | None = None) -> tuple[Run, object]:
        run = self.attention.cached(run_id)
        if fmt is not None:
            check_precision(run, fmt)  # /topk's `rest` from u8 bytes was 4x the true remainder
        return run, self.attention.registry.get(run.model).model.info

    def _check_json(self, cells: int, fmt: str, what: str) -> None:
        if fmt == "json" and cells > self.settings.max_json_cells:
            raise TooManyCells.json(cells, self.settings.max_json_cells, f"numbers for {what}", "ask for format=f16 or u8")

    async def _answer(self, run_id: str, work, wire: Wire, fmt: str, log: dict, client: str, cells: int) -> Reply:
        """Runs `work(run)` (-> (fields, arrays)) on a worker thread, bounded like the renders are and
        sharing their slots, which go round-robin across clients, and their queue's 429 bound
        (RenderQueue). The run is read from the cache once the slot is held (see
        AttentionService.still_cached). First, the answer's bytes (at most `cells` values, and
        the row and column edges) are granted from the answers' budget: a tile of json is up to
        15 MB, held until its reader takes it."""

        def build(run: Run) -> tuple[list[bytes], str, str | None]:
            fields, arrays = work(run)
            pieces, media = render(fields, arrays, fmt, wire.frame)
            text = media == "application/json"
            sent, encoding = self.attention.compression.encode(wire.accept_encoding, pieces, text)
            return sent, media, encoding

        # A long run's tile is seconds of work on a CPU: beyond max_queue of them (and of large
        # slices) waiting, or a client's share of those, 429 (RenderQueue).
        started = time.perf_counter()
        async with self.attention.queued_with_bytes(answer_bytes(cells, fmt, wire.frame) + EDGES_BYTES, client) as grant:
            body, media, encoding = await finished_off_loop(build, self.attention.still_cached(run_id, fmt))
        _, headers = negotiated(wire, fmt, encoding)  # the media type is render()'s
        log["timing_ms"] = round((time.perf_counter() - started) * 1000, 2)
        reply = Reply(body, media, log, headers)
        reply.own(grant)
        return reply

    # -- GET /runs/{run_id}
    async def info_json(self, run_id: str) -> bytes:
        """The answer, serialised: off the loop for a long run, whose tokens are most of it."""
        run, info = self._run(run_id)
        return await off_loop_unless_small(run.n_tokens <= INLINE_INFO_TOKENS, self._info_json, run, info)

    def _info_json(self, run: Run, info) -> bytes:
        kept = run.kept
        if run.kind == "qk":
            shapes = {"queries": list(kept.queries.shape), "keys": list(kept.keys.shape)}
        else:
            shapes = {"attention": list(run.attention.shape)}
        return orjson.dumps({
            "run_id": run.run_id, "model": run.model, "causal": info.causal, "n_layers": info.n_layers,
            "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads or info.n_heads, "n_tokens": run.n_tokens,
            "tokens": token_dicts(run.tokens), "truncated": run.truncated, "kept": run.kind,
            "precision": run.precision, "shapes": shapes,
            "nbytes": run.nbytes, "dense_max_tokens": self.settings.dense_max_tokens, "links": links_for(run.run_id),
        })

    # -- GET /runs/{run_id}/tile
    def _tile_plan(self, run_id: str, layer: int, head: str, q0, q1, k0, k1, rows, cols, fmt: str):
        """The request checked against its run: (layer, head index or None, window, rows, cols).
        A plain function, so the awaiting route never holds the run (see AttentionService.still_cached)."""
        run, info = self._run(run_id, fmt)
        layer = resolve_indices([layer], info.n_layers, "layer", info.id)[0]
        head_index = parse_head(head, info.n_heads, info.id)
        window = Window(*span(run, q0, q1, "q0", "q1"), *span(run, k0, k1, "k0", "k1"))
        cap = self.settings.max_tile_side
        n_rows, n_cols = side(rows, window.n_rows, "rows", cap), side(cols, window.n_cols, "cols", cap)
        if n_rows > cap or n_cols > cap:
            over = " and ".join(name for name, size in (("rows", n_rows), ("cols", n_cols)) if size > cap)
            raise TooManyCells(
                f"this window is {window.n_rows:,} x {window.n_cols:,} weights, and a tile has at most {cap:,} "
                f"a side: ask for {over} (at most {cap:,}) to get it pooled (pool=max or mean), or a smaller window"
            )
        self._check_json(n_rows * n_cols, fmt, "this tile")
        return layer, head_index, window, n_rows, n_cols

    async def tile(self, run_id: str, layer: int, head: str, q0, q1, k0, k1, rows, cols, pool: str, fmt: str,
                   wire: Wire, client: str = "") -> Reply:
        layer, head_index, window, n_rows, n_cols = self._tile_plan(run_id, layer, head, q0, q1, k0, k1, rows, cols, fmt)
        full = n_rows == window.n_rows and n_cols == window.n_cols
        heads = None if head_index is None else [head_index]

        def work(run: Run):
            found = pooled(run.kept, layer, heads, window.q0, window.q1, window.k0, window.k1, n_rows, n_cols,
                                  pool, self.block_cells)
            fields = {
                "run_id": run.run_id, "layer": layer, "head": "mean" if head_index is None else head_index,
                "window": {"q0": window.q0, "q1": window.q1, "k0": window.k0, "k1": window.k1},
                "shape": list(found.values.shape), "pool": "none" if full else pool,
                "row_edges": found.row_edges.tolist(), "col_edges": found.col_edges.tolist(),
            }
            return fields, {"attention": found.values.float().cpu()}

        return await self._answer(run_id, work, wire, fmt, {"run_id": run_id, "tile": [n_rows, n_cols]}, client,
                                  n_rows * n_cols)

    # -- GET /runs/{run_id}/cell
    def _cell_plan(self, run_id: str, query: int, key: int, fmt: str) -> tuple[int, int]:
        """(n_layers, n_heads) once (query, key) is checked against the run, which it does not
        return (see _tile_plan)."""
        run, info = self._run(run_id, fmt)
        for name, position in (("query", query), ("key", key)):
            if position >= run.n_tokens:
                raise InvalidInput(f"{name}={position} is past the run's end: run {run.run_id} has {run.n_tokens:,} "
                                   f"tokens, so {name} lies in 0..{run.n_tokens - 1}")
        return info.n_layers, info.n_heads

    async def cell(self, run_id: str, query: int, key: int, fmt: str, wire: Wire, client: str = "") -> Reply:
        """One (query, key) weight in every layer and head, as exact as the run holds it: the page's
        "which head links these two tokens?" ranked heads by 8-bit values (two heads 0.001 apart
        swapped, one left out) and had no cheaper way to the exact ones than whole layers."""
        n_layers, n_heads = self._cell_plan(run_id, query, key, fmt)

        def work(run: Run):
            heads = list(range(n_heads))
            # (n_heads, 1, 1) a layer -> (n_layers, n_heads)
            values = torch.stack([run.kept.block(layer, heads, query, query + 1, key, key + 1)[:, 0, 0]
                                  for layer in range(n_layers)])
            fields = {"run_id": run.run_id, "query": query, "key": key, "shape": [n_layers, n_heads]}
            return fields, {"attention": values.float().cpu()}

        return await self._answer(run_id, work, wire, fmt, {"run_id": run_id, "cell": [query, key]}, client, n_layers * n_heads)

    # -- GET /runs/{run_id}/topk
    def _topk_plan(self, run_id: str, layer: int, head: int, k: int, q0, q1, fmt: str):
        """(layer, head, k, q0, q1) checked against the run, which it does not return (see _tile_plan)."""
        run, info = self._run(run_id, fmt)
        layer = resolve_indices([layer], info.n_layers, "layer", info.id)[0]
        head = resolve_indices([head], info.n_heads, "head", info.id)[0]
        limit = min(self.settings.max_topk, MAX_TOPK)
        if k > limit:
            raise InvalidInput(f"k={k} is over this server's limit of {limit} weights per row")
        k = min(k, run.n_tokens)
        q0, q1 = span(run, q0, q1, "q0", "q1")
        self._check_json((q1 - q0) * k, fmt, "these rows")
        return layer, head, k, q0, q1

    async def topk(self, run_id: str, layer: int, head: int, k: int, q0, q1, fmt: str, wire: Wire, client: str = "") -> Reply:
        layer, head, k, q0, q1 = self._topk_plan(run_id, layer, head, k, q0, q1, fmt)

        def work(run: Run):
            found = topk_rows(run.kept, layer, head, k, q0, q1, self.block_cells)
            fields = {"run_id": run.run_id, "layer": layer, "head": head, "k": k, "q0": q0, "q1": q1}
            return fields, {"values": found.values.float().cpu(), "indices": found.indices.cpu(),
                            "rest": found.rest.float().cpu()}

        # values, indices and the rest of each row: reckoned as weights, which no index outgrows
        return await self._answer(run_id, work, wire, fmt, {"run_id": run_id, "topk": [q1 - q0, k]}, client,
                                  (q1 - q0) * (2 * k + 1))

    # -- GET /runs/{run_id}/overview
    async def overview(self, run_id: str, fmt: str, wire: Wire, client: str = "") -> Reply:
        info = self._run(run_id, fmt)[1]  # 404 / kept_quantised now; the run itself is read in its slot

        def work(run: Run):
            found = run.kept.overview_pooled()  # a short run makes its overview now, once
            self._grew(run)
            self._check_json(found.values.numel(), fmt, "the overview")
            fields = {"run_id": run.run_id, "n_layers": info.n_layers, "n_heads": info.n_heads,
                      "row_edges": found.row_edges.tolist(), "col_edges": found.col_edges.tolist(), "pool": "max"}
            return fields, {"attention": found.values.float().cpu()}

        cells = info.n_layers * info.n_heads * OVERVIEW_SIDE**2
        return await self._answer(run_id, work, wire, fmt, {"run_id": run_id, "overview": True}, client, cells)

    def _grew(self, run: Run) -> None:
        """A dense run makes its overview on first use: the cache counts those bytes too."""
        if run.kind == "weights":
            self.attention.cache.refresh(run)
