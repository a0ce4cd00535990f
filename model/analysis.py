"""Analyses computed from a captured run, with no second forward pass."""

from __future__ import annotations

import torch

from manyeyes.indices import index_list
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
    # Checked, as ablations are: numpy's arrays were "truth value ... ambiguous", layer 5 a bare IndexError.
    layers = list(range(info.n_layers)) if layers is None else index_list(layers, info.n_layers, "layers")
    heads = list(range(info.n_heads)) if heads is None else index_list(heads, info.n_heads, "heads")
    blocks = model.net.trf_blocks
    # All asked layers in one batch of products: per-layer loops spent more in dispatch than in
    # arithmetic at T=128. Under grouped-query attention query head h reads kv head h // group.
    values = torch.stack([result.values[layer] for layer in layers])  # (L', n_kv_heads, T, head_dim)
    group = info.n_heads // values.shape[1]
    values = values.repeat_interleave(group, dim=1) if group > 1 else values  # (L', n_heads, T, head_dim)
    grams = torch.stack([out_proj_gram(blocks[layer].att.out_proj, info.n_heads) for layer in layers])
    every_head = heads == list(range(info.n_heads))
    if not every_head:
        values, grams = values[:, heads], grams[:, heads]  # (L', H', T, head_dim), (L', H', head_dim, head_dim)
    # ‖v_j W_O,hᵀ‖² = v_j G_h v_jᵀ with G_h = W_O,hᵀ W_O,h: no (heads, T, d_model) tensor
    squared = (values @ grams).mul_(values).sum(-1)  # (L', H', T)
    norms = squared.clamp_min(0).sqrt()  # ‖f(x_j)‖ per key
    # Only the asked heads' weights are read (the page asks for one: 1/(L·H) of the work).
    weights = result.attention
    if not every_head or layers != list(range(info.n_layers)):
        weights = weights[torch.tensor(layers)[:, None], torch.tensor(heads)]  # copies the asked (T, T) blocks only
    return weights * norms.unsqueeze(2)  # (L', H', T, T) * (L', H', 1, T): α_ij scaling key j
