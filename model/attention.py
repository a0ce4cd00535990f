"""Multi-head attention, the chapter's module kept faithful and extended for inspection.

The constructor, attribute names and the persistent ``mask`` buffer match the classic
``MultiHeadAttention`` so that "LLMs from scratch" checkpoints load with ``strict=True``.
What is new is opt-in: a ``causal`` switch for encoders, a key-padding mask for batches,
and an ``attend`` entry point that hands back the per-head weights (and, on request, the
per-head q/k/v vectors) without storing anything on the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Capture:
    """What ``attend`` should hand back besides the context vectors."""

    weights: bool = True  # post-softmax attention, (b, num_heads, T, T)
    qkv: bool = False  # per-head queries, keys and values, each (b, num_heads, T, head_dim)
    # A float32 (b, num_heads, T, T) buffer the softmax writes into, so a caller that gathers
    # every layer into one tensor pays no extra copy (75 MB for MiniLM at T=512).
    weights_out: torch.Tensor | None = None


class AttentionOutput(NamedTuple):
    context: torch.Tensor  # (b, num_tokens, d_out)
    weights: torch.Tensor | None  # (b, num_heads, num_tokens, num_tokens)
    queries: torch.Tensor | None  # (b, num_heads, num_tokens, head_dim)
    keys: torch.Tensor | None  # (b, num_heads, num_tokens, head_dim)
    values: torch.Tensor | None  # (b, num_heads, num_tokens, head_dim)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True):
        super().__init__()
        if d_out % num_heads != 0:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.causal = causal

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        # Persistent, as in the book, so its checkpoints carry `...att.mask` and load strictly.
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x, key_padding_mask=None):
        """The classic call: context vectors only, shape (b, num_tokens, d_out)."""
        return self.attend(x, key_padding_mask, Capture(weights=False)).context

    def attend(self, x, key_padding_mask=None, capture: Capture = Capture()) -> AttentionOutput:
        """Attention with its internals.

        key_padding_mask: (b, num_tokens) bool, True for real tokens. Padded keys get zero
        weight, so each row of a padded batch equals its unpadded run.
        """
        b, num_tokens, _ = x.shape

        # (b, num_tokens, d_out) -> (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        # Scaling the queries (T x head_dim) instead of the scores (T x T) is the same maths, cheaper.
        # (b, num_heads, num_tokens, head_dim) @ (b, num_heads, head_dim, num_tokens) -> (b, num_heads, num_tokens, num_tokens)
        attn_scores = (queries * self.head_dim**-0.5) @ keys.transpose(2, 3)

        blocked = None
        if self.causal:
            blocked = self.mask.bool()[:num_tokens, :num_tokens]  # (num_tokens, num_tokens)
        if key_padding_mask is not None:
            # (b, num_tokens) -> (b, 1, 1, num_tokens), broadcast over heads and queries
            padded = ~key_padding_mask.bool().view(b, 1, 1, num_tokens)
            blocked = padded if blocked is None else (blocked | padded)
        if blocked is not None:
            attn_scores = attn_scores.masked_fill(blocked, -torch.inf)

        # Softmax in float32 even under half-precision autocast: the weights are the product.
        if capture.weights_out is not None:
            attn_weights = torch.softmax(attn_scores.float(), dim=-1, out=capture.weights_out)
        else:
            attn_weights = torch.softmax(attn_scores.float(), dim=-1)
        attn_weights = attn_weights.to(values.dtype)
        dropped = self.dropout(attn_weights)

        # (b, num_heads, num_tokens, num_tokens) @ (b, num_heads, num_tokens, head_dim)
        #   -> (b, num_heads, num_tokens, head_dim) -> (b, num_tokens, num_heads, head_dim)
        context = (dropped @ values).transpose(1, 2)
        # (b, num_tokens, num_heads, head_dim) -> (b, num_tokens, d_out)
        context = self.out_proj(context.reshape(b, num_tokens, self.d_out))

        want_qkv = capture.qkv
        return AttentionOutput(
            context=context,
            weights=attn_weights if capture.weights else None,
            queries=queries if want_qkv else None,
            keys=keys if want_qkv else None,
            values=values if want_qkv else None,
        )
