"""GPT-2 on the book's GPTModel: pre-LN decoder, learned positions, fused c_attn in Conv1D layout."""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.errors import ModelLoadError
from manyeyes.model.gpt import GPTConfig, GPTModel
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
    transpose,
)

MODEL_TYPES = ("gpt2",)

TOP = [
    ("wte.weight", "tok_emb.weight", None),
    ("wpe.weight", "pos_emb.weight", None),
    ("ln_f.weight", "final_norm.scale", None),
    ("ln_f.bias", "final_norm.shift", None),
]
LAYER = [
    ("h.{i}.ln_1.weight", "trf_blocks.{i}.norm1.scale", None),
    ("h.{i}.ln_1.bias", "trf_blocks.{i}.norm1.shift", None),
    # c_attn is split three ways in `convert`, then each third transposed.
    ("h.{i}.attn.c_proj.weight", "trf_blocks.{i}.att.out_proj.weight", transpose),
    ("h.{i}.attn.c_proj.bias", "trf_blocks.{i}.att.out_proj.bias", None),
    ("h.{i}.ln_2.weight", "trf_blocks.{i}.norm2.scale", None),
    ("h.{i}.ln_2.bias", "trf_blocks.{i}.norm2.shift", None),
    ("h.{i}.mlp.c_fc.weight", "trf_blocks.{i}.ff.layers.0.weight", transpose),
    ("h.{i}.mlp.c_fc.bias", "trf_blocks.{i}.ff.layers.0.bias", None),
    ("h.{i}.mlp.c_proj.weight", "trf_blocks.{i}.ff.layers.2.weight", transpose),
    ("h.{i}.mlp.c_proj.bias", "trf_blocks.{i}.ff.layers.2.bias", None),
]
QKV = ("W_query", "W_key", "W_value")  # the order of c_attn's three slices
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # HF's causal-mask buffers


def build(config: dict, path: Path) -> GPTModel:
    emb = need(config, "n_embd", path)
    if config.get("n_inner") not in (None, 4 * emb):
        raise ModelLoadError(f"{path}: n_inner={config['n_inner']} is unsupported; GPTModel uses 4 * n_embd")
    heads = need(config, "n_head", path)
    if emb % heads:  # said in the config's terms: GPTConfig's "emb_dim" and "n_heads" are ours
        raise ModelLoadError(f"{path}: n_embd {emb} is not divisible by n_head {heads}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(flag):
            raise ModelLoadError(f"{path}: {flag}=true is unsupported")
    if config.get("add_cross_attention"):
        # Cross-attention to an encoder's states: the decoder half of an encoder-decoder, not a language model.
        raise ModelLoadError(f"{path}: add_cross_attention=true (a GPT-2 that attends to an encoder) is unsupported")
    if config.get("scale_attn_weights", True) is not True:
        raise ModelLoadError(f"{path}: scale_attn_weights=false is unsupported")
    try:
        cfg = GPTConfig.from_dict(
            dict(
                vocab_size=need(config, "vocab_size", path),
                context_length=need(config, "n_positions", path),
                emb_dim=emb,
                n_heads=heads,
                n_layers=need(config, "n_layer", path),
                drop_rate=0.0,
                qkv_bias=True,
                ln_eps=config.get("layer_norm_epsilon", 1e-5),
                gelu=gelu_form(config, "activation_function", path, default="gelu_new"),
            )
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    net = GPTModel(cfg)
    net.tied_head = bool(config.get("tie_word_embeddings", True))
    net.head_required = head_required(config)
    return net


def convert(weights: dict[str, torch.Tensor], net: GPTModel, path: Path) -> dict[str, torch.Tensor]:
    lm_head = weights.get("lm_head.weight")
    state = strip_prefix({k: v for k, v in weights.items() if k != "lm_head.weight"}, "transformer.")
    mapped = map_state(state, rows_for(TOP, LAYER, net.cfg.n_layers), path)
    for i in range(net.cfg.n_layers):
        for kind in ("weight", "bias"):
            key = f"h.{i}.attn.c_attn.{kind}"
            saved = saved_name(state, key)  # "transformer.h.0..." in a task model's file
            fused = pop_required(state, key, path)
            if fused.shape[-1] % 3:
                raise ModelLoadError(f"{path}: '{saved}' has shape {tuple(fused.shape)}, not divisible in three")
            # weight (emb, 3*emb) -> three (emb, emb), each transposed to Linear's (out, in); bias (3*emb,)
            for name, part in zip(QKV, fused.chunk(3, dim=-1)):
                mapped.put(f"trf_blocks.{i}.att.{name}.{kind}", transpose(part) if kind == "weight" else part, saved)
    # As the other families: tied, the head is wte whatever a saved lm_head.weight holds; untied,
    # wte in the head's place would predict silently wrong, so a base model goes without one.
    if net.tied_head:
        mapped.tie("out_head.weight", "tok_emb.weight")
    elif lm_head is not None:
        mapped.put("out_head.weight", as_weights(lm_head, "lm_head.weight", path), "lm_head.weight")
    elif net.head_required:
        raise ModelLoadError(f"{path}: missing key 'lm_head.weight' (tie_word_embeddings is false)")
    else:
        net.drop_lm_head()
    refuse_leftovers(state, lambda k: k.endswith(IGNORED_SUFFIXES) or k.startswith(TASK_HEADS), "gpt2", path)
    return mapped
