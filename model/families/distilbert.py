"""DistilBERT: BERT's post-LN encoder with its own key names, no segment embeddings, and
(optionally) a sinusoidal position table that some checkpoints do not save."""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.bert import BertConfig, BertEncoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.families.bert import map_mlm_head
from manyeyes.model.keymap import TASK_HEADS, gelu_form, map_state, need, refuse_leftovers, rows_for, strip_prefix

MODEL_TYPES = ("distilbert",)

TOP = [
    ("embeddings.word_embeddings.weight", "tok_emb.weight", None),
    ("embeddings.LayerNorm.weight", "emb_norm.scale", None),
    ("embeddings.LayerNorm.bias", "emb_norm.shift", None),
]
POSITIONS = ("embeddings.position_embeddings.weight", "pos_emb.weight", None)
LAYER = [
    ("transformer.layer.{i}.attention.q_lin.weight", "trf_blocks.{i}.att.W_query.weight", None),
    ("transformer.layer.{i}.attention.q_lin.bias", "trf_blocks.{i}.att.W_query.bias", None),
    ("transformer.layer.{i}.attention.k_lin.weight", "trf_blocks.{i}.att.W_key.weight", None),
    ("transformer.layer.{i}.attention.k_lin.bias", "trf_blocks.{i}.att.W_key.bias", None),
    ("transformer.layer.{i}.attention.v_lin.weight", "trf_blocks.{i}.att.W_value.weight", None),
    ("transformer.layer.{i}.attention.v_lin.bias", "trf_blocks.{i}.att.W_value.bias", None),
    ("transformer.layer.{i}.attention.out_lin.weight", "trf_blocks.{i}.att.out_proj.weight", None),
    ("transformer.layer.{i}.attention.out_lin.bias", "trf_blocks.{i}.att.out_proj.bias", None),
    ("transformer.layer.{i}.sa_layer_norm.weight", "trf_blocks.{i}.norm1.scale", None),
    ("transformer.layer.{i}.sa_layer_norm.bias", "trf_blocks.{i}.norm1.shift", None),
    ("transformer.layer.{i}.ffn.lin1.weight", "trf_blocks.{i}.ff.layers.0.weight", None),
    ("transformer.layer.{i}.ffn.lin1.bias", "trf_blocks.{i}.ff.layers.0.bias", None),
    ("transformer.layer.{i}.ffn.lin2.weight", "trf_blocks.{i}.ff.layers.2.weight", None),
    ("transformer.layer.{i}.ffn.lin2.bias", "trf_blocks.{i}.ff.layers.2.bias", None),
    ("transformer.layer.{i}.output_layer_norm.weight", "trf_blocks.{i}.norm2.scale", None),
    ("transformer.layer.{i}.output_layer_norm.bias", "trf_blocks.{i}.norm2.shift", None),
]
# DistilBertForMaskedLM: vocab_transform -> activation -> vocab_layer_norm -> vocab_projector (tied).
MLM_HEAD = [
    ("vocab_transform.weight", "mlm_head.dense.weight", None),
    ("vocab_transform.bias", "mlm_head.dense.bias", None),
    ("vocab_layer_norm.weight", "mlm_head.norm.scale", None),
    ("vocab_layer_norm.bias", "mlm_head.norm.shift", None),
    ("vocab_projector.bias", "mlm_head.out_head.bias", None),
]
MLM_DECODER = ("vocab_projector.weight", None)  # its bias is the head's own, mapped above
IGNORED_PREFIXES = ("pre_classifier.", *TASK_HEADS)
IGNORED = ("embeddings.position_ids",)


def build(config: dict, path: Path) -> BertEncoder:
    dim, heads = need(config, "dim", path), need(config, "n_heads", path)
    if dim % heads:
        raise ModelLoadError(f"{path}: dim {dim} is not divisible by n_heads {heads}")
    gelu = gelu_form(config, "activation", path)
    return BertEncoder(
        BertConfig(
            vocab_size=need(config, "vocab_size", path),
            max_positions=need(config, "max_position_embeddings", path),
            type_vocab_size=0,
            emb_dim=dim,
            n_heads=heads,
            n_layers=need(config, "n_layers", path),
            ff_dim=need(config, "hidden_dim", path),
            ln_eps=1e-12,  # fixed in DistilBERT's code, not in its config
            gelu=gelu,
            pad_token_id=config.get("pad_token_id", 0) or 0,
            head_gelu=gelu,
            sinusoidal_positions=bool(config.get("sinusoidal_pos_embds", False)),
            tied_head=bool(config.get("tie_word_embeddings", True)),
        )
    )


def sinusoids(n_pos: int, dim: int) -> torch.Tensor:
    """DistilBERT's fixed table: sin on even columns, cos on odd, frequency 10000^(2*(j//2)/dim)."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    j = torch.arange(dim, dtype=torch.float64)[None, :]
    angle = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)  # (n_pos, dim)
    table = torch.empty(n_pos, dim, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(angle[:, 0::2]), torch.cos(angle[:, 1::2])
    return table.float()


def convert(weights: dict[str, torch.Tensor], net: BertEncoder, path: Path) -> dict[str, torch.Tensor]:
    state = strip_prefix(weights, "distilbert.")
    rows = list(TOP)
    if POSITIONS[0] in state or not net.cfg.sinusoidal_positions:
        rows.append(POSITIONS)
    mapped = map_state(state, rows_for(rows, LAYER, net.cfg.n_layers), path)
    if "pos_emb.weight" not in mapped:
        # A sinusoidal checkpoint that left its (fixed, derivable) table out.
        mapped["pos_emb.weight"] = sinusoids(net.cfg.max_positions, net.cfg.emb_dim)
    map_mlm_head(state, mapped, net, MLM_HEAD, MLM_DECODER, path)
    refuse_leftovers(state, lambda k: k in IGNORED or k.startswith(IGNORED_PREFIXES), "distilbert", path)
    return mapped
