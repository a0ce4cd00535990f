"""Llama, Mistral and Qwen2: one key table, three small config adapters, on `RotaryDecoder`.

All three are pre-RMSNorm decoders with RoPE, grouped-query attention and a SwiGLU feed-forward.
They differ in config switches only: which projections have biases (llama `attention_bias` and
`mlp_bias`; qwen2 always q/k/v and never o_proj; mistral none), and where a sliding window applies
(mistral: every layer; qwen2: the layers its `layer_types` mark, or from `max_window_layers` on).
"""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.blocks import DecoderConfig, RotaryDecoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.keymap import (
    TASK_HEADS,
    as_weights,
    head_required,
    map_state,
    need,
    refuse_leftovers,
    rows_for,
    strip_prefix,
)
from manyeyes.model.rotary import rope_config, rope_parameters

MODEL_TYPES = ("llama", "mistral", "qwen2")

TOP = [
    ("embed_tokens.weight", "tok_emb.weight", None),
    ("norm.weight", "final_norm.scale", None),
]
LAYER = [
    ("layers.{i}.input_layernorm.weight", "trf_blocks.{i}.norm1.scale", None),
    ("layers.{i}.self_attn.q_proj.weight", "trf_blocks.{i}.att.W_query.weight", None),
    ("layers.{i}.self_attn.k_proj.weight", "trf_blocks.{i}.att.W_key.weight", None),
    ("layers.{i}.self_attn.v_proj.weight", "trf_blocks.{i}.att.W_value.weight", None),
    ("layers.{i}.self_attn.o_proj.weight", "trf_blocks.{i}.att.out_proj.weight", None),
    ("layers.{i}.post_attention_layernorm.weight", "trf_blocks.{i}.norm2.scale", None),
    ("layers.{i}.mlp.gate_proj.weight", "trf_blocks.{i}.ff.gate.weight", None),
    ("layers.{i}.mlp.up_proj.weight", "trf_blocks.{i}.ff.up.weight", None),
    ("layers.{i}.mlp.down_proj.weight", "trf_blocks.{i}.ff.down.weight", None),
]
# Present only when the config switches them on (see `bias_rows`).
QKV_BIAS = [
    ("layers.{i}.self_attn.q_proj.bias", "trf_blocks.{i}.att.W_query.bias", None),
    ("layers.{i}.self_attn.k_proj.bias", "trf_blocks.{i}.att.W_key.bias", None),
    ("layers.{i}.self_attn.v_proj.bias", "trf_blocks.{i}.att.W_value.bias", None),
]
OUT_BIAS = [("layers.{i}.self_attn.o_proj.bias", "trf_blocks.{i}.att.out_proj.bias", None)]
MLP_BIAS = [
    ("layers.{i}.mlp.gate_proj.bias", "trf_blocks.{i}.ff.gate.bias", None),
    ("layers.{i}.mlp.up_proj.bias", "trf_blocks.{i}.ff.up.bias", None),
    ("layers.{i}.mlp.down_proj.bias", "trf_blocks.{i}.ff.down.bias", None),
]
LM_HEAD = "lm_head.weight"
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a derived buffer older checkpoints saved
SILU = ("silu", "swish")  # transformers' two names for x * sigmoid(x)


def _biases(config: dict, model_type: str) -> tuple[bool, bool, bool]:
    """(qkv_bias, out_bias, ff_bias) as each family's modeling code wires them."""
    if model_type == "qwen2":
        return True, False, False
    if model_type == "mistral":
        return False, False, False
    attention_bias = bool(config.get("attention_bias", False))
    return attention_bias, attention_bias, bool(config.get("mlp_bias", False))


# MistralConfig's and Qwen2Config's default, for a config that leaves the key out (null: no window).
DEFAULT_SLIDING_WINDOW = 4096


def _sliding_windows(config: dict, model_type: str, n_layers: int, path: Path) -> tuple[int | None, ...]:
    if model_type == "llama":
        return ()
    window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"{path}: sliding_window must be a whole number >= 1 or null, got {window!r}")
    if model_type == "mistral":
        return (window,) * n_layers if window is not None else ()
    # qwen2: the window exists only with use_sliding_window, and only on the layers marked for it.
    window = window if config.get("use_sliding_window", False) else None
    layer_types = config.get("layer_types")
    if layer_types is None:
        start = config.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"{path}: unsupported layer_types {layer_types!r}")
    if "sliding_attention" in layer_types and window is None:
        why = ("use_sliding_window is false" if config.get("sliding_window") is not None
               else "no sliding_window is set")
        raise ModelLoadError(f"{path}: layer_types asks for sliding attention but {why}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def build(config: dict, path: Path) -> RotaryDecoder:
    model_type = config.get("model_type")
    hidden, heads = need(config, "hidden_size", path), need(config, "num_attention_heads", path)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    n_layers = need(config, "num_hidden_layers", path)
    max_positions = need(config, "max_position_embeddings", path)
    if not config.get("head_dim") and hidden % heads:
        raise ModelLoadError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")
    if config.get("hidden_act", "silu") not in SILU:
        raise ModelLoadError(f"{path}: unsupported hidden_act {config.get('hidden_act')!r}; {model_type} uses silu")
    try:
        params = rope_parameters(config)
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            # transformers' llama rotates whole heads in its default RoPE but honours the factor in the
            # scaled ones; we refuse the ambiguity rather than guess.
            raise ModelLoadError(f"{path}: partial_rotary_factor is unsupported for {model_type}")
        rope = rope_config(params, head_dim, max_positions)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    qkv_bias, out_bias, ff_bias = _biases(config, model_type)
    return RotaryDecoder(
        DecoderConfig(
            vocab_size=need(config, "vocab_size", path),
            max_positions=max_positions,
            emb_dim=hidden,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            ff_dim=need(config, "intermediate_size", path),
            rope=rope,
            norm="rms",
            norm_eps=config.get("rms_norm_eps", 1e-6),
            ff="swiglu",
            ff_bias=ff_bias,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            sliding_windows=_sliding_windows(config, model_type, n_layers, path),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_required=head_required(config),
        )
    )


def bias_rows(cfg: DecoderConfig) -> list:
    return (QKV_BIAS if cfg.qkv_bias else []) + (OUT_BIAS if cfg.out_bias else []) + (MLP_BIAS if cfg.ff_bias else [])


def convert(weights: dict[str, torch.Tensor], net: RotaryDecoder, path: Path) -> dict[str, torch.Tensor]:
    cfg = net.cfg
    lm_head = weights.get(LM_HEAD)
    state = strip_prefix({k: v for k, v in weights.items() if k != LM_HEAD}, "model.")
    mapped = map_state(state, rows_for(TOP, LAYER + bias_rows(cfg), cfg.n_layers), path)
    if cfg.tie_embeddings:
        # Tied: the head is the embedding, whatever a saved lm_head.weight holds, as README promises for
        # every family (transformers 4 tied it too; 5 keeps a saved copy that differs, with a warning).
        mapped.tie("out_head.weight", "tok_emb.weight")
    elif lm_head is not None:
        mapped.put("out_head.weight", as_weights(lm_head, LM_HEAD, path), LM_HEAD)
    elif cfg.head_required:
        raise ModelLoadError(f"{path}: missing key '{LM_HEAD}' (tie_word_embeddings is false)")
    else:
        net.drop_lm_head()
    refuse_leftovers(state, lambda k: k.endswith(IGNORED_SUFFIXES) or k.startswith(TASK_HEADS), "llama/mistral/qwen2", path)
    return mapped
