"""Multi-head attention, the chapter's module kept faithful and extended for inspection.

The constructor, attribute names and the persistent ``mask`` buffer match the classic
``MultiHeadAttention`` so that "LLMs from scratch" checkpoints load with ``strict=True``.
What is new is opt-in: a ``causal`` switch for encoders, a key-padding mask for batches,
and an ``attend`` entry point that hands back the per-head weights (and, on request, the
per-head q/k/v vectors) without storing anything on the module.

The modern decoder families add keyword-only switches, each off by default so the book's
module is unchanged: grouped-query attention (``num_kv_heads``), a ``head_dim`` that need not be
``d_out / num_heads``, rotary position embeddings on queries and keys (``rotary_dim``, the cos/sin
tables passed to ``attend``), mistral's ``sliding_window``, and an ``out_bias`` switch (qwen2 has
q/k/v biases but none on its output projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from manyeyes.model.rotary import apply_rotary


@dataclass(frozen=True)
class Capture:
    """What ``attend`` should hand back besides the context vectors."""

    weights: bool = True  # post-softmax attention, (b, num_heads, T, T)
    # Queries (b, num_heads, T, head_dim); keys and values (b, num_kv_heads, T, head_dim): under
    # grouped-query attention each key/value head serves num_heads / num_kv_heads query heads.
    qkv: bool = False
    # A float32 (b, num_heads, T, T) buffer the softmax writes into, so a caller that gathers
    # every layer into one tensor pays no extra copy (75 MB for MiniLM at T=512).
    weights_out: torch.Tensor | None = None
    # Long inputs: never hold a layer's (b, num_heads, T, T) weights. The softmax runs over row
    # blocks of queries and hands back, instead of the weights, what regenerates them exactly
    # (each row's max and sum, with the queries and keys) and a max-pooled overview of every head.
    keep: bool = False
    overview: int = 64  # the overview's side, in bins, when keep is set
    # Score cells one row block may hold (8 MB as float32). Small enough that a block's scores stay
    # in cache through the softmax, pooling and mixing, and that a causal model's blocks skip the
    # keys they cannot see: tiny-llama at T=2,048 took 188 ms in one 64 MB block and 66 ms in 8 MB
    # ones, a 6-layer llama at 4,096 2.47 s and 1.95 s (README, "Long inputs").
    block_cells: int = 1 << 21
    # False: the trace carries no (b, T, vocab_size) logits, which at long T can outweigh everything
    # else; the caller applies the network's `lm_head` to the hidden state a few rows at a time.
    logits: bool = True
    # False: the caller reads the weights (and queries and keys) only, never the residual stream
    # after the last softmax. The network then stops there: the last block computes no values,
    # no mixing, no out_proj and no feed-forward (a seventh of MiniLM's forward), and the trace
    # has neither hidden state nor logits.
    hidden: bool = True


# What the server's forwards keep: every weight and, for a model with a head, the top-k
# predictions, but no hidden state or (T, vocab) logits that nobody reads.
WEIGHTS_ONLY = Capture(hidden=False, logits=False)


class AttentionOutput(NamedTuple):
    context: torch.Tensor | None  # (b, num_tokens, d_out); None from attend(mix=False)
    weights: torch.Tensor | None  # (b, num_heads, num_tokens, num_tokens)
    # As the softmax saw them: after rotary, before the 1/sqrt(head_dim) scaling.
    queries: torch.Tensor | None  # (b, num_heads, num_tokens, head_dim)
    # Per key/value head, not repeated: query head h used key head h // (num_heads // num_kv_heads).
    keys: torch.Tensor | None  # (b, num_kv_heads, num_tokens, head_dim)
    values: torch.Tensor | None  # (b, num_kv_heads, num_tokens, head_dim)
    # Every key and value so far, the past's included, ready to be the next call's `past`.
    present: "KVCache | None" = None
    # Capture(keep=True) only: the softmax of row q is exp(score - row_max[q]) / row_sum[q], both
    # (b, num_heads, num_tokens) float32, and `overview` is (b, num_heads, r, c) float32, each
    # cell the largest weight in its bin of queries x keys (edges from `bin_edges`).
    row_max: torch.Tensor | None = None
    row_sum: torch.Tensor | None = None
    overview: torch.Tensor | None = None


class KVCache(NamedTuple):
    """One layer's keys (already rotated) and values, for generation: each (b, num_kv_heads, T_past, head_dim)."""

    keys: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.keys.shape[2]


def blocked_positions(
    num_queries: int, num_keys: int, *, causal: bool, sliding_window: int | None, device
) -> torch.Tensor | None:
    """(num_queries, num_keys) bool, True where a query may not look; None when nothing is blocked.

    Queries are the last `num_queries` of the `num_keys` positions, so a generation cache that
    holds earlier keys needs no other change here. Causal: key k is visible to query q iff k <= q.
    With a sliding window W (mistral, qwen2), iff q - W < k <= q: W keys including q itself,
    exactly transformers' `sliding_window_overlay` (kv_idx > q_idx - sliding_window).
    """
    if not causal and sliding_window is None:
        return None
    offset = num_keys - num_queries  # query i sits at position offset + i
    ones = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    # k > offset + i  <=>  k - i > offset: the band above diagonal offset
    blocked = ones.triu(offset + 1) if causal else torch.zeros_like(ones)
    if sliding_window is not None:
        # k <= offset + i - W  <=>  k - i <= offset - W: the band on and below diagonal offset - W
        blocked |= ones.tril(offset - sliding_window)
    return blocked


def layer_windows(net: torch.nn.Module) -> tuple[int | None, ...]:
    """Each attention layer's sliding window (None: none), in layer order."""
    return tuple(m.sliding_window for m in net.modules() if isinstance(m, MultiHeadAttention))


def blocked_rows(
    q0: int, q1: int, k0: int, k1: int, *, offset: int, causal: bool, sliding_window: int | None, device
) -> torch.Tensor | None:
    """(q1 - q0, k1 - k0) bool: `blocked_positions` cut to one window, without building all of it.

    Query i sits at position offset + i, as there. None when nothing in the window is blocked:
    decided from the positions, since asking the device (blocked.any()) waits for it (on a GPU, for
    every kernel queued so far), once per row block of every layer of a long run."""
    first_query, last_query = offset + q0, offset + q1 - 1
    later_keys = causal and k1 - 1 > first_query  # some key after some query
    keys_behind = sliding_window is not None and k0 <= last_query - sliding_window  # some key out of reach
    if q1 <= q0 or k1 <= k0 or not (later_keys or keys_behind):
        return None
    # (q1 - q0, 1) and (1, k1 - k0): where each query may look, against each key's position
    query_pos = torch.arange(offset + q0, offset + q1, device=device).unsqueeze(1)
    key_pos = torch.arange(k0, k1, device=device).unsqueeze(0)
    blocked = key_pos > query_pos if causal else torch.zeros(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
    if sliding_window is not None:
        blocked |= key_pos <= query_pos - sliding_window
    return blocked


def visible_keys(q0: int, q1: int, num_keys: int, *, causal: bool, sliding_window: int | None, align: int) -> tuple[int, int]:
    """[k0, k1): the keys that queries at positions [q0, q1) may see at all, widened to multiples of `align`.

    The row-block softmax scores only these (half the work of a causal model); `kept` scores the
    same range again, so a rebuilt weight comes out of the very same float ops."""
    k1 = q1 if causal else num_keys
    k0 = max(0, q0 - sliding_window + 1) if sliding_window is not None else 0
    return k0 // align * align, min(num_keys, -(-k1 // align) * align)


def masked_band(q0: int, q1: int, k0: int, k1: int, *, causal: bool, sliding_window: int | None) -> tuple[int, int]:
    """[lo, hi) within [k0, k1): the only keys that some query at positions [q0, q1) may not see.

    Causal: keys after the first query; a sliding window: keys at or before the last query's reach."""
    if sliding_window is None:
        return (max(k0, q0 + 1), k1) if causal else (k0, k0)
    return k0, (k1 if causal else max(k0, min(k1, q1 - sliding_window)))


def row_block(num_keys: int, heads: int, row_width: int, block_cells: int) -> int:
    """Query rows per block of the row-block softmax: whole overview bins, as many as the budget allows."""
    return max(1, block_cells // max(1, heads * num_keys) // row_width) * row_width


def bin_edges(n: int, size: int) -> torch.Tensor:
    """Edges of at most `size` bins over range(n): equal width ceil(n / size), the last one may be
    narrower. No tokens, no bins: n = 0 gives the one edge [0] (a keep run of 0 tokens, whose
    overview is (b, heads, 0, 0), as its plain run's weights are (b, heads, 0, 0))."""
    return torch.tensor([*range(0, n, bin_width(n, size)), n], dtype=torch.long)


def bin_width(n: int, size: int) -> int:
    """The bins' width, at least 1: range(0, 0, 0) raised ValueError for n = 0."""
    return max(1, -(-n // max(1, min(size, n))))


def bin_count(n: int, size: int) -> int:
    """len(bin_edges(n, size)) - 1, without making the tensor (the server reckons it per request)."""
    return -(-n // bin_width(n, size))


def max_pool(weights: torch.Tensor, row_width: int, col_width: int) -> torch.Tensor:
    """(..., R, C) -> (..., ceil(R / row_width), ceil(C / col_width)): the largest weight per bin."""
    *lead, rows, cols = weights.shape
    full = cols // col_width * col_width
    # Splitting the unit-stride key axis is a view even on a slice, so no copy of the block is made.
    pooled = weights[..., :full].unflatten(-1, (full // col_width, col_width)).amax(-1)  # (..., R, C // col_width)
    if full < cols:
        pooled = torch.cat((pooled, weights[..., full:].amax(-1, keepdim=True)), dim=-1)
    full = rows // row_width * row_width
    out = pooled[..., :full, :].unflatten(-2, (full // row_width, row_width)).amax(-2)  # (..., R // row_width, c)
    if full < rows:
        out = torch.cat((out, pooled[..., full:, :].amax(-2, keepdim=True)), dim=-2)
    return out


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        d_in,
        d_out,
        context_length,
        dropout,
        num_heads,
        qkv_bias=False,
        causal=True,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        out_bias: bool = True,
        rotary_dim: int = 0,
        sliding_window: int | None = None,
    ):
        """The seed's arguments, then the decoder families' switches.

        context_length: size of the book's persistent causal `mask` buffer; None builds the mask
            per call instead (rotary models have no fixed context, and a 32k x 32k buffer is 4 GB).
        num_kv_heads: key/value heads for grouped-query attention; divides num_heads. Default num_heads.
        head_dim: width of each head; default d_out // num_heads. Queries are num_heads * head_dim
            wide, keys and values num_kv_heads * head_dim; out_proj maps num_heads * head_dim -> d_out.
        out_bias: bias on out_proj (the book has one; qwen2, llama and mistral do not).
        rotary_dim: leading dims of each head that `attend`'s cos/sin tables rotate (0: no rotary).
        sliding_window: each query sees only its last `sliding_window` positions (itself included).
        """
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if d_out % num_heads != 0:
                raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
            head_dim = d_out // num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and at most head_dim ({head_dim})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window ({sliding_window}) must be positive")
        self.d_out = d_out
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.rotary_dim = rotary_dim
        self.sliding_window = sliding_window

        self.W_query = nn.Linear(d_in, num_heads * head_dim, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, num_kv_heads * head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_kv_heads * head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(num_heads * head_dim, d_out, bias=out_bias)
        self.dropout = nn.Dropout(dropout)
        if context_length is not None:
            # Persistent, as in the book, so its checkpoints carry `...att.mask` and load strictly.
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))
        else:
            self.mask = None

    def forward(self, x, key_padding_mask=None):
        """The classic call: context vectors only, shape (b, num_tokens, d_out)."""
        return self.attend(x, key_padding_mask, Capture(weights=False)).context

    def _blocked(self, num_queries: int, num_keys: int, device) -> torch.Tensor | None:
        """(num_queries, num_keys): the queries are the last num_queries positions."""
        if self.mask is not None and self.sliding_window is None:
            return self.mask.bool()[num_keys - num_queries : num_keys, :num_keys] if self.causal else None
        return blocked_positions(num_queries, num_keys, causal=self.causal, sliding_window=self.sliding_window, device=device)

    def attend(
        self,
        x,
        key_padding_mask=None,
        capture: Capture = Capture(),
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        past: KVCache | None = None,
        mix: bool = True,
    ) -> AttentionOutput:
        """Attention with its internals.

        key_padding_mask: (b, num_tokens) bool, True for real tokens. Padded keys get zero
        weight, so each row of a padded batch equals its unpadded run. Not with Capture(keep=True),
        which runs one unpadded input (a ValueError).
        rope: (cos, sin), each (num_tokens, rotary_dim), from `RotaryEmbedding`; required when
        the module was built with rotary_dim > 0. The caller computes them once for all layers.

        past: the earlier positions' keys and values (a `KVCache`, the previous call's
        `present`), for generation. x then holds only the new positions, rope covers only them,
        key_padding_mask (if any) covers past and new keys, and the weights are
        (b, num_heads, num_new, T_past + num_new): each new query's whole row.

        mix=False stops after the softmax, for a network's last block when nobody reads what
        follows (`Capture.hidden`): no values unless captured, no context, no `present`.
        """
        b, num_tokens, _ = x.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads

        # (b, num_tokens, heads * head_dim) -> (b, num_tokens, heads, head_dim) -> (b, heads, num_tokens, head_dim)
        queries = self.W_query(x).view(b, num_tokens, heads, head_dim).transpose(1, 2)
        # (b, num_tokens, kv_heads * head_dim) -> (b, kv_heads, num_tokens, head_dim)
        keys = self.W_key(x).view(b, num_tokens, kv_heads, head_dim).transpose(1, 2)
        values = None
        if mix or capture.qkv or capture.keep or past is not None:
            # (b, num_tokens, kv_heads * head_dim) -> (b, kv_heads, num_tokens, head_dim), as the keys
            values = self.W_value(x).view(b, num_tokens, kv_heads, head_dim).transpose(1, 2)
        if self.rotary_dim:
            if rope is None:
                raise ValueError("this attention rotates queries and keys: pass rope=(cos, sin)")
            cos, sin = rope
            queries, keys = apply_rotary(queries, cos, sin), apply_rotary(keys, cos, sin)
        if past is not None:
            # (b, kv_heads, T_past, head_dim) + (b, kv_heads, num_tokens, head_dim) along the tokens
            keys = torch.cat((past.keys.to(keys.dtype), keys), dim=2)
            values = torch.cat((past.values.to(values.dtype), values), dim=2)
        num_keys = keys.shape[2]
        if capture.keep:  # before any (b, heads, T, T) scores exist: 3.2 GB a layer at T = 8,192
            if key_padding_mask is not None:  # its callers run one input, unpadded; the row blocks mask no padding
                raise ValueError("Capture(keep=True) runs one unpadded input at a time: pass no key_padding_mask")
            return self._attend_in_row_blocks(queries, keys, values, capture)
        inspects_nothing = not capture.weights and not capture.qkv and capture.weights_out is None
        if self.training and inspects_nothing and past is None and key_padding_mask is None and self.sliding_window is None:
            # Training inspects nothing: PyTorch's fused kernel never builds the (b, heads, T, T) weights,
            # forward or backward, which at T = 2,048 made each step several times slower.
            context = F.scaled_dot_product_attention(
                queries, keys, values, dropout_p=self.dropout.p, is_causal=self.causal, enable_gqa=group > 1
            )  # (b, heads, T, head_dim)
            # (b, heads, T, head_dim) -> (b, T, heads, head_dim) -> (b, T, heads * head_dim) -> (b, T, d_out)
            context = self.out_proj(context.transpose(1, 2).reshape(b, num_tokens, heads * head_dim))
            return AttentionOutput(context, None, None, None, None, present=KVCache(keys, values))

        # Scaling the queries (T x head_dim) instead of the scores (T x T) is the same maths, cheaper.
        # Each key head serves `group` consecutive query heads; stacking those heads' queries along
        # the token axis gives one matmul per key head with no repeated copy of the keys:
        # (b, heads, T, head_dim) -> (b, kv_heads, group * T, head_dim)
        scaled = (queries * head_dim**-0.5).reshape(b, kv_heads, group * num_tokens, head_dim)
        # The scores are made, masked and softmaxed in the caller's buffer, when their dtype allows:
        # a fresh (b, heads, T, T) tensor a layer is fresh pages to fault in once it passes the
        # server's mmap threshold (12.6 MB a layer for MiniLM at T=512), and one more pass over memory.
        out = capture.weights_out
        in_place = (
            out is not None and out.dtype == scaled.dtype and out.is_contiguous()
            and out.shape == (b, heads, num_tokens, num_keys) and not torch.is_autocast_enabled(x.device.type)
            and not (torch.is_grad_enabled() and (scaled.requires_grad or keys.requires_grad))  # out= has no autograd
        )
        # (b, kv_heads, group * T, head_dim) @ (b, kv_heads, head_dim, T_keys) -> (b, kv_heads, group * T, T_keys)
        #   -> (b, heads, T, T_keys), a free view since query head h = kv head * group + r
        if in_place:
            attn_scores = out
            torch.matmul(scaled, keys.transpose(2, 3), out=out.view(b, kv_heads, group * num_tokens, num_keys))
        else:
            attn_scores = (scaled @ keys.transpose(2, 3)).view(b, heads, num_tokens, num_keys)

        blocked = self._blocked(num_tokens, num_keys, x.device)  # (num_tokens, num_keys) or None
        if key_padding_mask is not None:
            # (b, num_keys) -> (b, 1, 1, num_keys), broadcast over heads and queries
            padded = ~key_padding_mask.bool().view(b, 1, 1, num_keys)
            if self.sliding_window is not None and past is None:
                # A padded query's whole window can be padding; letting it see itself keeps its row
                # finite (no NaN to leak through 0 * NaN into real rows). Real rows never see padding.
                padded = padded & ~torch.eye(num_tokens, dtype=torch.bool, device=x.device)
            blocked = padded if blocked is None else (blocked | padded)
        if blocked is not None:
            # Adding a 0/-inf mask in place is the same result, bit for bit, as masked_fill and several
            # times cheaper on CPU than a masked_fill that broadcasts a bool mask over every head.
            additive = torch.zeros(blocked.shape, dtype=attn_scores.dtype, device=attn_scores.device)
            attn_scores += additive.masked_fill_(blocked, -torch.inf)  # (num_tokens, num_tokens) or (b, 1, T, T)

        # Softmax in float32 even under half-precision autocast: the weights are the product.
        if capture.weights_out is not None:
            # In place when the scores are already there: the same values, bit for bit.
            attn_weights = torch.softmax(attn_scores.float(), dim=-1, out=capture.weights_out)
        else:
            attn_weights = torch.softmax(attn_scores.float(), dim=-1)
        if not mix:
            return AttentionOutput(
                context=None,
                weights=attn_weights if capture.weights else None,
                queries=queries if capture.qkv else None,
                keys=keys if capture.qkv else None,
                values=values if capture.qkv else None,
            )
        attn_weights = attn_weights.to(values.dtype)
        dropped = self.dropout(attn_weights)

        # (b, heads, T, T_keys) -> (b, kv_heads, group * T, T_keys) @ (b, kv_heads, T_keys, head_dim)
        #   -> (b, kv_heads, group * T, head_dim) -> (b, heads, T, head_dim) -> (b, T, heads, head_dim)
        context = (dropped.reshape(b, kv_heads, group * num_tokens, num_keys) @ values)
        context = context.view(b, heads, num_tokens, head_dim).transpose(1, 2)
        # (b, num_tokens, heads, head_dim) -> (b, num_tokens, heads * head_dim) -> (b, num_tokens, d_out)
        context = self.out_proj(context.reshape(b, num_tokens, heads * head_dim))

        want_qkv = capture.qkv
        return AttentionOutput(
            context=context,
            weights=attn_weights if capture.weights else None,
            queries=queries if want_qkv else None,
            keys=keys if want_qkv else None,
            values=values if want_qkv else None,
            present=KVCache(keys, values),
        )

    def _attend_in_row_blocks(self, queries, keys, values, capture: Capture) -> AttentionOutput:
        """`attend`'s attention of one unpadded input (no key-padding mask: `attend` refuses one
        with keep), a block of query rows at a time, for `Capture(keep=True)`: the same weights
        and context up to float rounding, since the blocks' matmuls are shaped differently.

        No (b, heads, T, T) tensor ever exists: each block's scores are softmaxed, pooled into the
        overview and mixed into the context, then dropped. Each row's max and sum are kept, so
        `kept.KeptAttention` can rebuild any weight from the queries and keys with the same float ops.
        """
        b, heads, num_tokens, head_dim = queries.shape
        kv_heads, num_keys = keys.shape[1], keys.shape[2]
        group = heads // kv_heads
        offset = num_keys - num_tokens
        row_width, col_width = bin_width(num_tokens, capture.overview), bin_width(num_keys, capture.overview)
        rows_per_block = row_block(num_keys, b * heads, row_width, capture.block_cells)

        context = torch.empty(b, heads, num_tokens, head_dim, dtype=values.dtype, device=values.device)
        row_max = torch.empty(b, heads, num_tokens, device=queries.device)
        row_sum = torch.empty(b, heads, num_tokens, device=queries.device)
        overview = torch.empty(b, heads, bin_count(num_tokens, capture.overview), bin_count(num_keys, capture.overview),
                               device=queries.device)
        scale = head_dim**-0.5
        overview.zero_()  # bins no query can see stay 0: their keys are never scored
        # One buffer for every block's scores: a fresh 64 MB tensor per block is a fresh mmap (and
        # its page faults) once large allocations bypass the heap, as the server sets them to.
        reuse = queries.dtype == torch.float32 and not torch.is_autocast_enabled(queries.device.type)
        scratch = torch.empty(b * heads * rows_per_block * num_keys if reuse else 0, device=queries.device)
        for q0 in range(0, num_tokens, rows_per_block):
            q1 = min(num_tokens, q0 + rows_per_block)
            rows = q1 - q0
            # Whole overview bins of keys, so the pooling needs no padding
            k0, k1 = visible_keys(q0 + offset, q1 + offset, num_keys, causal=self.causal,
                                  sliding_window=self.sliding_window, align=col_width)
            # (b, heads, rows, head_dim) -> (b, kv_heads, group * rows, head_dim), as in `attend`
            scaled = (queries[:, :, q0:q1] * scale).reshape(b, kv_heads, group * rows, head_dim)
            # (b, kv_heads, group * rows, head_dim) @ (b, kv_heads, head_dim, k1 - k0) -> (b, heads, rows, k1 - k0)
            if reuse:
                scores = scratch[: b * heads * rows * (k1 - k0)].view(b, kv_heads, group * rows, k1 - k0)
                torch.matmul(scaled, keys[:, :, k0:k1].transpose(2, 3), out=scores)
                scores = scores.view(b, heads, rows, k1 - k0)
            else:
                scores = (scaled @ keys[:, :, k0:k1].transpose(2, 3)).view(b, heads, rows, k1 - k0).float()
            # Only the columns where some row of the block is blocked need a mask; every row sees
            # itself, so none is all -inf.
            band = masked_band(q0 + offset, q1 + offset, k0, k1, causal=self.causal, sliding_window=self.sliding_window)
            blocked = blocked_rows(q0, q1, *band, offset=offset, causal=self.causal,
                                   sliding_window=self.sliding_window, device=scores.device)
            if blocked is not None:
                # an added 0/-inf mask: bit for bit masked_fill, and far cheaper than a broadcast bool fill
                scores[..., band[0] - k0 : band[1] - k0] += torch.zeros(blocked.shape, device=scores.device).masked_fill_(
                    blocked, -torch.inf
                )
            top = scores.amax(-1, keepdim=True)  # (b, heads, rows, 1)
            weights = scores.sub_(top).exp_()
            total = weights.sum(-1, keepdim=True)
            weights.div_(total)
            row_max[:, :, q0:q1], row_sum[:, :, q0:q1] = top.squeeze(-1), total.squeeze(-1)
            # whole row bins per block (the last block may end in a narrower one), whole key bins
            overview[:, :, q0 // row_width : -(-q1 // row_width), k0 // col_width : -(-k1 // col_width)] = max_pool(
                weights, row_width, col_width
            )
            # (b, heads, rows, k1 - k0) -> (b, kv_heads, group * rows, k1 - k0) @ (b, kv_heads, k1 - k0, head_dim)
            #   -> (b, heads, rows, head_dim)
            mixed = weights.to(values.dtype).view(b, kv_heads, group * rows, k1 - k0) @ values[:, :, k0:k1]
            context[:, :, q0:q1] = mixed.view(b, heads, rows, head_dim)
        # (b, heads, T, head_dim) -> (b, T, heads, head_dim) -> (b, T, heads * head_dim) -> (b, T, d_out)
        out = self.out_proj(context.transpose(1, 2).reshape(b, num_tokens, heads * head_dim))
        return AttentionOutput(
            context=out, weights=None, queries=queries, keys=keys, values=values if capture.qkv else None,
            present=KVCache(keys, values), row_max=row_max, row_sum=row_sum, overview=overview,
        )
