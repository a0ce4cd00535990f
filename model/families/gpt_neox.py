"""GPT-NeoX (Pythia) on `RotaryDecoder`: LayerNorm + GELU, partial rotary, parallel residual.

Pythia rotates only the first `rotary_pct` (0.25) of each head and, with `use_parallel_residual`,
adds attention and feed-forward outputs that both read the block's input. Its attention is one
fused `query_key_value` projection whose output rows are grouped per head: [q_h | k_h | v_h] for
each head h in turn, not [all q | all k | all v] as GPT-2's c_attn is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.blocks import DecoderConfig, RotaryDecoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.keymap import (
    TASK_HEADS,
    as_weights,
    gelu_form,
    head_required,
    map_state,
    need,
    pop_required,
    refuse_leftovers,
    rows_for,
    saved_name,
    strip_prefix,
)
from manyeyes.model.rotary import rope_config, rope_parameters, rope_settings

MODEL_TYPES = ("gpt_neox",)

TOP = [
    ("embed_in.weight", "tok_emb.weight", None),
    ("final_layer_norm.weight", "final_norm.scale", None),
    ("final_layer_norm.bias", "final_norm.shift", None),
]
LAYER = [
    ("layers.{i}.input_layernorm.weight", "trf_blocks.{i}.norm1.scale", None),
    ("layers.{i}.input_layernorm.bias", "trf_blocks.{i}.norm1.shift", None),
    ("layers.{i}.post_attention_layernorm.weight", "trf_blocks.{i}.norm2.scale", None),
    ("layers.{i}.post_attention_layernorm.bias", "trf_blocks.{i}.norm2.shift", None),
    ("layers.{i}.mlp.dense_h_to_4h.weight", "trf_blocks.{i}.ff.layers.0.weight", None),
    ("layers.{i}.mlp.dense_h_to_4h.bias", "trf_blocks.{i}.ff.layers.0.bias", None),
    ("layers.{i}.mlp.dense_4h_to_h.weight", "trf_blocks.{i}.ff.layers.2.weight", None),
    ("layers.{i}.mlp.dense_4h_to_h.bias", "trf_blocks.{i}.ff.layers.2.bias", None),
    ("layers.{i}.attention.dense.weight", "trf_blocks.{i}.att.out_proj.weight", None),
]
OUT_BIAS = [("layers.{i}.attention.dense.bias", "trf_blocks.{i}.att.out_proj.bias", None)]
# The fused projection, reshuffled by `split_per_head_qkv` into our three.
FUSED_QKV = "layers.{i}.attention.query_key_value.{kind}"
QKV = ("W_query", "W_key", "W_value")  # the order inside each head's slice
LM_HEADS = ("embed_out.weight", "lm_head.weight")  # the name on disk, and transformers 5's in-memory name
# Causal-mask and rotary buffers that older checkpoints saved.
IGNORED_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")


def split_per_head_qkv(fused: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_key_value rows are [q_0 k_0 v_0 q_1 k_1 v_1 ...], each head_dim long; return (q, k, v).

    weight (3 * emb, emb) -> (n_heads, 3, head_dim, emb) -> three (emb, emb); bias likewise without emb.
    """
    per_head = fused.view(n_heads, 3, -1, *fused.shape[1:])  # (n_heads, 3, head_dim[, emb])
    return tuple(per_head[:, j].reshape(-1, *fused.shape[1:]).contiguous() for j in range(3))


def _rope_parameters(config: dict) -> dict:
    """Pythia-era configs name RoPE rotary_emb_base (default 10000) and rotary_pct (default 0.25).
    As transformers' GPTNeoXConfig does, those two (or their defaults) fill the RoPE dict, and a
    top-level rope_theta or partial_rotary_factor beside them is ignored: we took those first, and
    attention differed by up to 0.95 where a config held both."""
    params = rope_settings(config)
    params.setdefault("rope_theta", config.get("rotary_emb_base", 10000.0))
    params.setdefault("partial_rotary_factor", config.get("rotary_pct", 0.25))
    aliased = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta", "partial_rotary_factor")}
    return rope_parameters(aliased | {"rope_parameters": params})


def build(config: dict, path: Path) -> RotaryDecoder:
    hidden, heads = need(config, "hidden_size", path), need(config, "num_attention_heads", path)
    if hidden % heads:
        raise ModelLoadError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    head_dim = hidden // heads
    max_positions = need(config, "max_position_embeddings", path)
    try:
        rope = rope_config(_rope_parameters(config), head_dim, max_positions)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    attention_bias = bool(config.get("attention_bias", True))
    return RotaryDecoder(
        DecoderConfig(
            vocab_size=need(config, "vocab_size", path),
            max_positions=max_positions,
            emb_dim=hidden,
            n_layers=need(config, "num_hidden_layers", path),
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=head_dim,
            ff_dim=need(config, "intermediate_size", path),
            rope=rope,
            norm="layer",
            norm_eps=config.get("layer_norm_eps", 1e-5),
            ff=gelu_form(config, "hidden_act", path),
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            parallel_residual=bool(config.get("use_parallel_residual", True)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_required=head_required(config),
        )
    )


def convert(weights: dict[str, torch.Tensor], net: RotaryDecoder, path: Path) -> dict[str, torch.Tensor]:
    cfg = net.cfg
    heads = [(k, weights[k]) for k in LM_HEADS if k in weights]
    state = strip_prefix({k: v for k, v in weights.items() if k not in LM_HEADS}, "gpt_neox.")
    mapped = map_state(state, rows_for(TOP, LAYER + (OUT_BIAS if cfg.out_bias else []), cfg.n_layers), path)
    for i in range(cfg.n_layers):
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            key = FUSED_QKV.format(i=i, kind=kind)
            saved = saved_name(state, key)  # "gpt_neox.layers.0..." as the file names it
            fused = pop_required(state, key, path)
            if fused.dim() != (2 if kind == "weight" else 1) or fused.shape[0] != 3 * cfg.emb_dim:
                raise ModelLoadError(f"{path}: '{saved}' has shape {tuple(fused.shape)}, expected {3 * cfg.emb_dim} rows")
            for name, part in zip(QKV, split_per_head_qkv(fused, cfg.n_heads)):
                mapped.put(f"trf_blocks.{i}.att.{name}.{kind}", part, saved)
    if cfg.tie_embeddings:
        mapped.tie("out_head.weight", "tok_emb.weight")
    elif heads:
        mapped.put("out_head.weight", as_weights(heads[0][1], heads[0][0], path), heads[0][0])
    elif cfg.head_required:
        raise ModelLoadError(f"{path}: missing key 'embed_out.weight' (tie_word_embeddings is false)")
    else:
        net.drop_lm_head()
    refuse_leftovers(state, lambda k: k.endswith(IGNORED_SUFFIXES) or k.startswith(TASK_HEADS), "gpt_neox", path)
    return mapped
