"""Analyses computed from a captured run, with no second forward pass."""

from __future__ import annotations

import torch

from manyeyes.model.measures import out_proj_gram
from manyeyes.model.runtime import AttentionModel, AttentionResult


def value_weighted_norms(
    model: AttentionModel, result: AttentionResult, layers: list[int] | None = None, heads: list[int] | None = None
) -> torch.Tensor:
    """‖α_ij · f(x_j)‖ per head (Kobayashi et al., 2020), shape (n_layers, n_heads, T, T), or
    (len(layers), len(heads), T, T) for the layers and heads asked for (default all).

    f(x_j) is token j's value vector for one head pushed through that head's slice of out_proj,
    so a weight counts only as much as what it actually moves. Needs Capture(qkv=True).
    """
    if result.values is None:
        raise ValueError("value-weighted norms need the values: run with Capture(qkv=True)")
    info = model.info
    layers = list(range(info.n_layers)) if layers is None else layers
    heads = list(range(info.n_heads)) if heads is None else heads
    n_tokens = result.attention.shape[-1]
    all_heads = heads == list(range(info.n_heads))
    out = torch.empty((len(layers), len(heads), n_tokens, n_tokens))
    for i, layer in enumerate(layers):
        block, values = model.net.trf_blocks[layer], result.values[layer]
        # Under grouped-query attention query head h reads kv head h // group: (n_heads, T, head_dim)
        group = info.n_heads // values.shape[0]
        values = values.repeat_interleave(group, dim=0) if group > 1 else values
        # ‖v_j W_O,hᵀ‖² = v_j G_h v_jᵀ with G_h = W_O,hᵀ W_O,h: no (n_heads, T, d_model) tensor
        squared = ((values @ out_proj_gram(block.att.out_proj, info.n_heads)) * values).sum(-1)  # (n_heads, T)
        norms = squared.clamp_min(0).sqrt()[heads]  # ‖f(x_j)‖ per key, (len(heads), T)
        # Only the asked heads' weights are read (the page asks for one: 1/(L·H) of the work), and
        # each product goes straight into the answer: (H', T, T) * (H', 1, T), α_ij scaling key j.
        weights = result.attention[layer] if all_heads else result.attention[layer][heads]
        torch.mul(weights, norms.unsqueeze(1), out=out[i])
    return out
