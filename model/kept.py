"""A run kept as queries and keys instead of weights, and the views of it computed on demand.

A (layers, heads, T, T) float32 tensor is 75 MB for MiniLM at T = 512 and 18 GB for a 30-layer
model at T = 4,096, while the queries and keys that produced it grow with T alone. So a long run
keeps, per layer, the queries and keys as the softmax saw them (after rotary) and each row's max
and sum; any head's weights, any window of them and any aggregate are then rebuilt exactly:
weight = exp(q · k / sqrt(head_dim) - row_max) / row_sum, the forward's own float ops.

`DenseAttention` serves the same views from a kept weights tensor (short runs), so callers never
ask which kind of run they hold. Every view works a block of query rows at a time: `block` holds
its answer plus one row block of scores (`block_cells`), and a pooled window or top-k about two
blocks besides its answer (the block of weights it reads, and the scores that block is made in).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from manyeyes.model.attention import Capture, bin_edges, bin_width, max_pool, row_block, visible_keys

BLOCK_CELLS = 1 << 21  # weights one row block of a view may hold: 8 MB as float32
MAX_TOPK = 64


def check_window(att, layer: int, heads: list[int], q0: int, q1: int, k0: int, k1: int) -> None:
    """Refuse, naming it, a window that does not lie inside the run (torch would index past it or
    answer with a tensor of the wrong shape)."""
    n = att.n_tokens
    if not 0 <= layer < att.n_layers:
        raise ValueError(f"layer must be in 0..{att.n_layers - 1}, got {layer}")
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__") or not heads or any(not 0 <= h < att.n_heads for h in heads):
        raise ValueError(f"heads must be a non-empty list of indices in 0..{att.n_heads - 1}, got {heads!r}")
    if not (0 <= q0 < q1 <= n and 0 <= k0 < k1 <= n):
        raise ValueError(f"the window must satisfy 0 <= q0 < q1 <= {n} and 0 <= k0 < k1 <= {n}, "
                         f"got queries [{q0}, {q1}) and keys [{k0}, {k1})")


class Pooled(NamedTuple):
    values: torch.Tensor  # (r, c) float32
    row_edges: torch.Tensor  # (r + 1,) int64: bin i covers queries [row_edges[i], row_edges[i + 1])
    col_edges: torch.Tensor  # (c + 1,) int64, keys likewise

    # One line, not every value: a notebook showed some 60 lines of tensor.
    def __repr__(self) -> str:
        return (f"Pooled(values {tuple(self.values.shape)} of queries 0..{int(self.row_edges[-1])} "
                f"and keys 0..{int(self.col_edges[-1])})")


class TopK(NamedTuple):
    values: torch.Tensor  # (n, k) float32, each row's largest weights, largest first
    indices: torch.Tensor  # (n, k) int64, their keys
    rest: torch.Tensor  # (n,) float32, the row's weight outside those k (never negative)

    def __repr__(self) -> str:
        return f"TopK(values and indices {tuple(self.values.shape)}, rest {tuple(self.rest.shape)})"


@dataclass(eq=False)  # tensors have no truth value: == compared them and raised
class KeptAttention:
    """One input's attention, kept as what regenerates it. Tensors stay on the run's device."""

    queries: torch.Tensor  # (n_layers, n_heads, T, head_dim), after rotary, before the 1/sqrt(head_dim)
    keys: torch.Tensor  # (n_layers, n_kv_heads, T, head_dim), after rotary
    row_max: torch.Tensor  # (n_layers, n_heads, T) float32, each row's largest masked score
    row_sum: torch.Tensor  # (n_layers, n_heads, T) float32, each row's sum of exp(score - row_max)
    overview: torch.Tensor  # (n_layers, n_heads, r, c) float32, max-pooled weights, made in the forward
    causal: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    # The forward's row blocks and key alignment: scores are rebuilt over the same key ranges, since
    # a matmul's rounding can depend on its width, and then come out bit for bit as the forward's.
    block_rows: int
    key_align: int
    # The forward's autocast dtype (None: none): its scores came out of a half-precision matmul,
    # and its row max and sum with them, so a rebuild runs the same matmul or rows miss 1 by 10%.
    autocast: torch.dtype | None = None

    def __repr__(self) -> str:
        # One line: the dataclass's own printed every tensor, 75,000 characters for 362 tokens.
        kv = self.keys.shape[1]
        return (f"KeptAttention({self.n_layers} layers x {self.n_heads} heads"
                f"{f' ({kv} key heads)' if kv != self.n_heads else ''}, {self.n_tokens} tokens, "
                f"head_dim {self.queries.shape[-1]}, {'causal' if self.causal else 'bidirectional'}, "
                f"{self.nbytes / 2**20:.1f} MiB on {self.queries.device})")

    @property
    def n_layers(self) -> int:
        return self.queries.shape[0]

    @property
    def n_heads(self) -> int:
        return self.queries.shape[1]

    @property
    def n_tokens(self) -> int:
        return self.queries.shape[2]

    @property
    def nbytes(self) -> int:
        held = (self.queries, self.keys, self.row_max, self.row_sum, self.overview)
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def qk_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.queries, self.keys))

    def overview_pooled(self) -> Pooled:
        return Pooled(self.overview, *overview_edges(self.n_tokens, self.overview.shape[-1]))

    def block(self, layer: int, heads: list[int], q0: int, q1: int, k0: int, k1: int,
              block_cells: int = BLOCK_CELLS) -> torch.Tensor:
        """(len(heads), q1 - q0, k1 - k0) float32: the weights of those heads in that window.

        Scores are computed a few rows at a time over the keys the forward scored for those rows,
        so besides the answer this holds one buffer of at most block_cells scores (or one row of
        them), in which each block is masked and softmaxed in place: no gathered copy of the keys,
        no mask tensor, no second block."""
        check_window(self, layer, heads, q0, q1, k0, k1)
        queries, keys = self.queries[layer], self.keys[layer]
        n, head_dim = self.n_tokens, queries.shape[-1]
        window = self.sliding_windows[layer]
        group = self.n_heads // keys.shape[0]  # query head h reads key head h // group
        index = torch.tensor(heads, device=queries.device)
        out = torch.zeros(len(heads), q1 - q0, k1 - k0, device=queries.device)
        as_forward = (torch.autocast(device_type=queries.device.type, dtype=self.autocast) if self.autocast is not None
                      else contextlib.nullcontext())
        # float32 matmuls write straight into the buffer; half-precision ones (a half model, or the
        # forward's autocast) are converted into it, as .float() converted them.
        direct = queries.dtype == torch.float32 and self.autocast is None
        scratch = scores = weights = None
        for first in range(q0 // self.block_rows * self.block_rows, q1, self.block_rows):
            f0, f1 = visible_keys(first, min(n, first + self.block_rows), n, causal=self.causal,
                                  sliding_window=window, align=self.key_align)
            c0, c1 = max(k0, f0), min(k1, f1)
            if c0 >= c1:
                continue  # no query of this block sees any key of the window
            lo, hi = max(q0, first), min(q1, first + self.block_rows)  # the window's rows in this forward block
            step = rows_per_block(len(heads), f1 - f0, block_cells)
            need = len(heads) * min(step, hi - lo) * (f1 - f0)
            if scratch is None or scratch.numel() < need:
                scratch = scores = weights = None  # the smaller one goes before the bigger one is made
                scratch = torch.empty(need, device=queries.device)
            for r0 in range(lo, hi, step):
                r1 = min(hi, r0 + step)
                scores = scratch[: len(heads) * (r1 - r0) * (f1 - f0)].view(len(heads), r1 - r0, f1 - f0)
                for i, h in enumerate(heads):
                    # (1, r1 - r0, head_dim) @ (1, head_dim, f1 - f0), one head at a time, so its keys are
                    # a view: a gathered copy of every asked head's keys outweighed the scores (3 to 1
                    # for a 12-head layer mean at T = 8,192, head_dim 64).
                    scaled = queries[h : h + 1, r0:r1] * head_dim**-0.5  # scaled as attention.py scales them
                    paired = keys[h // group : h // group + 1, f0:f1].transpose(1, 2)
                    if direct:
                        torch.bmm(scaled, paired, out=scores[i : i + 1])
                    else:
                        with as_forward:
                            scores[i : i + 1] = torch.bmm(scaled, paired)
                # (heads, r1 - r0) -> (heads, r1 - r0, 1), broadcast over the keys
                top = self.row_max[layer, index, r0:r1].unsqueeze(-1)
                total = self.row_sum[layer, index, r0:r1].unsqueeze(-1)
                weights = scores.sub_(top).exp_().div_(total)
                # Blocked keys get weight 0, as a -inf score would: query r0 + i may not see key f0 + j
                # beyond it (causal: j - i > r0 - f0) or at or before its reach minus the window.
                if self.causal and f1 - 1 > r0:
                    weights.tril_(r0 - f0)
                if window is not None and f0 <= r1 - 1 - window:
                    weights.triu_(r0 - f0 - window + 1)
                out[:, r0 - q0 : r1 - q0, c0 - k0 : c1 - k0] = weights[:, :, c0 - f0 : c1 - f0]
        return out


@dataclass
class DenseAttention:
    """The same views over a kept (n_layers, n_heads, T, T) weights tensor (a short run)."""

    attention: torch.Tensor  # float32, or float16 / uint8 as quantised on the device (see `to_float`)
    to_float: object = None  # uint8 -> float32 for a quantised tensor; None: a plain .float()
    _overview: Pooled | None = field(default=None, repr=False)

    @property
    def n_layers(self) -> int:
        return self.attention.shape[0]

    @property
    def n_heads(self) -> int:
        return self.attention.shape[1]

    @property
    def n_tokens(self) -> int:
        return self.attention.shape[2]

    @property
    def overview_nbytes(self) -> int:
        """What it holds beyond the weights it shares with its run: the overview, once made."""
        return 0 if self._overview is None else self._overview.values.numel() * self._overview.values.element_size()

    def block(self, layer: int, heads: list[int], q0: int, q1: int, k0: int, k1: int,
              block_cells: int = BLOCK_CELLS) -> torch.Tensor:
        """As KeptAttention.block, cut from the weights (block_cells: nothing is computed)."""
        check_window(self, layer, heads, q0, q1, k0, k1)
        window = self.attention[layer, heads, q0:q1, k0:k1]  # (len(heads), rows, cols)
        return self.to_float(window) if self.to_float is not None else window.float()

    def overview_pooled(self, size: int = 64) -> Pooled:
        if self._overview is None:
            rows, cols = overview_edges(self.n_tokens, size)
            values = torch.stack([
                torch.stack([pooled(self, layer, [head], 0, self.n_tokens, 0, self.n_tokens, size, size, "max").values
                             for head in range(self.n_heads)])
                for layer in range(self.n_layers)
            ])  # (n_layers, n_heads, r, c)
            self._overview = Pooled(values, rows, cols)
        return self._overview


def overview_edges(n_tokens: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    edges = bin_edges(n_tokens, size)
    return edges, edges


def rows_per_block(heads: int, cols: int, block_cells: int = BLOCK_CELLS) -> int:
    """Query rows one block of `heads` heads over `cols` keys may hold within block_cells (at least one)."""
    return max(1, block_cells // max(1, heads * cols))


def pooled(att, layer: int, heads: list[int] | None, q0: int, q1: int, k0: int, k1: int,
           rows: int, cols: int, how: str = "max", block_cells: int = BLOCK_CELLS) -> Pooled:
    """The window [q0, q1) x [k0, k1) of one head (heads=[h]) or of the layer's mean over heads
    (heads=None) as at most rows x cols bins, each the max or mean of its float32 weights.

    rows/cols at least the window's size give it at full resolution. Reads at most block_cells
    weights at once (and holds about two blocks besides the answer), however tall a row bin is
    (rows=64 of an 8,192-token layer mean is 128 rows x 12 heads x 8,192 keys, 50 MB): such a bin
    is pooled a slab of rows at a time."""
    if how not in ("max", "mean"):
        raise ValueError(f"pooling is max or mean, not {how!r}")
    head_list = list(range(att.n_heads)) if heads is None else list(heads)
    check_window(att, layer, head_list, q0, q1, k0, k1)
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be at least 1, got {rows} x {cols}")
    row_edges, col_edges = bin_edges(q1 - q0, rows) + q0, bin_edges(k1 - k0, cols) + k0
    row_width, col_width = int(row_edges[1] - row_edges[0]), int(col_edges[1] - col_edges[0])
    out = torch.empty(len(row_edges) - 1, len(col_edges) - 1)

    def weights_of(r0: int, r1: int) -> torch.Tensor:  # (r1 - r0, k1 - k0): the head, or the heads' mean
        weights = att.block(layer, head_list, r0, r1, k0, k1, block_cells)  # (heads, r1 - r0, k1 - k0)
        return (weights.mean(0) if heads is None else weights[0])

    block_rows = rows_per_block(len(head_list), k1 - k0, block_cells)
    if block_rows >= row_width:  # whole row bins per block, so no bin straddles two blocks
        step = block_rows // row_width * row_width
        for r0 in range(q0, q1, step):
            r1 = min(q1, r0 + step)
            first = (r0 - q0) // row_width
            out[first : first + -(-(r1 - r0) // row_width)] = _pool(weights_of(r0, r1), row_width, col_width, how).cpu()
        return Pooled(out, row_edges, col_edges)
    for i, (b0, b1) in enumerate(zip(row_edges.tolist(), row_edges[1:].tolist())):
        # a bin taller than a block: slabs of it, combined as max of maxes or row-weighted means
        acc = None
        for s0 in range(b0, b1, block_rows):
            s1 = min(b1, s0 + block_rows)
            part = _pool(weights_of(s0, s1), s1 - s0, col_width, how)[0].cpu()  # (c,)
            part = part if how == "max" else part * (s1 - s0)
            acc = part if acc is None else (torch.maximum(acc, part) if how == "max" else acc + part)
        out[i] = acc if how == "max" else acc / (b1 - b0)
    return Pooled(out, row_edges, col_edges)


def _pool(weights: torch.Tensor, row_width: int, col_width: int, how: str) -> torch.Tensor:
    if row_width == col_width == 1:
        return weights
    if how == "max":
        return max_pool(weights, row_width, col_width)
    # Mean: sums per bin over the padded grid, then each bin's real count (the last ones may be narrower).
    rows, cols = weights.shape
    r, c = -(-rows // row_width), -(-cols // col_width)
    padded = weights.new_zeros(r * row_width, c * col_width)
    padded[:rows, :cols] = weights
    # (r * row_width, c * col_width) -> (r, row_width, c, col_width) -> (r, c)
    sums = padded.view(r, row_width, c, col_width).sum((1, 3))
    row_counts = torch.full((r,), row_width, dtype=weights.dtype, device=weights.device)
    row_counts[-1] = rows - (r - 1) * row_width
    col_counts = torch.full((c,), col_width, dtype=weights.dtype, device=weights.device)
    col_counts[-1] = cols - (c - 1) * col_width
    return sums / (row_counts[:, None] * col_counts[None, :])


def topk_rows(att, layer: int, head: int, k: int, q0: int, q1: int, block_cells: int = BLOCK_CELLS) -> TopK:
    """Each query row's k largest weights with their keys, and the weight left over."""
    n_keys = att.n_tokens
    if not 1 <= k <= min(MAX_TOPK, n_keys):
        raise ValueError(f"k must be in 1..{min(MAX_TOPK, n_keys)}, got {k}")
    check_window(att, layer, [head], q0, q1, 0, n_keys)
    values = torch.empty(q1 - q0, k)
    indices = torch.empty(q1 - q0, k, dtype=torch.long)
    step = rows_per_block(1, n_keys, block_cells)
    for r0 in range(q0, q1, step):
        r1 = min(q1, r0 + step)
        top = att.block(layer, [head], r0, r1, 0, n_keys, block_cells)[0].topk(k, dim=-1)  # (r1 - r0, k) each
        values[r0 - q0 : r1 - q0], indices[r0 - q0 : r1 - q0] = top.values.cpu(), top.indices.cpu()
    rest = (1 - values.sum(-1)).clamp_(min=0)
    return TopK(values, indices, rest)


def kept_from_layers(layers, n: int, causal: bool, sliding_windows, capture: Capture,
                     autocast: torch.dtype | None = None) -> KeptAttention:
    """The KeptAttention of a one-input Capture(keep=True) trace, from its per-layer outputs."""
    row = 0
    n_heads = layers[0].queries.shape[1]
    width = bin_width(n, capture.overview)  # the overview's, on both axes (1 for no tokens)
    return KeptAttention(
        queries=torch.stack([layer.queries[row, :, :n] for layer in layers]),  # (n_layers, n_heads, n, head_dim)
        keys=torch.stack([layer.keys[row, :, :n] for layer in layers]),  # (n_layers, n_kv_heads, n, head_dim)
        row_max=torch.stack([layer.row_max[row, :, :n] for layer in layers]),  # (n_layers, n_heads, n)
        row_sum=torch.stack([layer.row_sum[row, :, :n] for layer in layers]),
        overview=torch.stack([layer.overview[row] for layer in layers]),  # (n_layers, n_heads, r, c)
        causal=causal,
        sliding_windows=tuple(sliding_windows),
        block_rows=row_block(n, n_heads, width, capture.block_cells),  # as attention.py chose them
        key_align=width,
        autocast=autocast,
    )
