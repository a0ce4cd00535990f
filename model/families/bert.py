"""BERT (and MiniLM, which is BERT-shaped): post-LN encoder, learned absolute positions."""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.bert import BertConfig, BertEncoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.keymap import TASK_HEADS, Checkpoint, Mapped, Row, as_weights, gelu_form, map_state, need, refuse_leftovers, rows_for, saved_name, strip_prefix

MODEL_TYPES = ("bert",)

TOP = [
    ("embeddings.word_embeddings.weight", "tok_emb.weight", None),
    ("embeddings.position_embeddings.weight", "pos_emb.weight", None),
    ("embeddings.token_type_embeddings.weight", "type_emb.weight", None),
    ("embeddings.LayerNorm.weight", "emb_norm.scale", None),
    ("embeddings.LayerNorm.bias", "emb_norm.shift", None),
]
LAYER = [
    ("encoder.layer.{i}.attention.self.query.weight", "trf_blocks.{i}.att.W_query.weight", None),
    ("encoder.layer.{i}.attention.self.query.bias", "trf_blocks.{i}.att.W_query.bias", None),
    ("encoder.layer.{i}.attention.self.key.weight", "trf_blocks.{i}.att.W_key.weight", None),
    ("encoder.layer.{i}.attention.self.key.bias", "trf_blocks.{i}.att.W_key.bias", None),
    ("encoder.layer.{i}.attention.self.value.weight", "trf_blocks.{i}.att.W_value.weight", None),
    ("encoder.layer.{i}.attention.self.value.bias", "trf_blocks.{i}.att.W_value.bias", None),
    ("encoder.layer.{i}.attention.output.dense.weight", "trf_blocks.{i}.att.out_proj.weight", None),
    ("encoder.layer.{i}.attention.output.dense.bias", "trf_blocks.{i}.att.out_proj.bias", None),
    ("encoder.layer.{i}.attention.output.LayerNorm.weight", "trf_blocks.{i}.norm1.scale", None),
    ("encoder.layer.{i}.attention.output.LayerNorm.bias", "trf_blocks.{i}.norm1.shift", None),
    ("encoder.layer.{i}.intermediate.dense.weight", "trf_blocks.{i}.ff.layers.0.weight", None),
    ("encoder.layer.{i}.intermediate.dense.bias", "trf_blocks.{i}.ff.layers.0.bias", None),
    ("encoder.layer.{i}.output.dense.weight", "trf_blocks.{i}.ff.layers.2.weight", None),
    ("encoder.layer.{i}.output.dense.bias", "trf_blocks.{i}.ff.layers.2.bias", None),
    ("encoder.layer.{i}.output.LayerNorm.weight", "trf_blocks.{i}.norm2.scale", None),
    ("encoder.layer.{i}.output.LayerNorm.bias", "trf_blocks.{i}.norm2.shift", None),
]
# The masked-LM head (BertForMaskedLM, BertForPreTraining). Its decoder weight is tied to the
# word embeddings and usually not saved; its decoder bias is tied to `cls.predictions.bias`.
MLM_HEAD = [
    ("cls.predictions.transform.dense.weight", "mlm_head.dense.weight", None),
    ("cls.predictions.transform.dense.bias", "mlm_head.dense.bias", None),
    ("cls.predictions.transform.LayerNorm.weight", "mlm_head.norm.scale", None),
    ("cls.predictions.transform.LayerNorm.bias", "mlm_head.norm.shift", None),
    ("cls.predictions.bias", "mlm_head.out_head.bias", None),
]
MLM_DECODER = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
# Task heads and derived buffers that carry nothing attention needs. A masked-LM head is mapped
# above when its first key is there; what is left under `cls.` (next-sentence head) is ignored.
IGNORED_PREFIXES = ("pooler.", "cls.", *TASK_HEADS)
IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids")


def encoder_config(config: dict, path: Path, **family) -> BertConfig:
    """The BERT-layout config keys (BERT, RoBERTa); `family` overrides what a family fixes."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{path}: only absolute position embeddings are supported")
    if config.get("is_decoder"):
        # transformers makes such a model causal (BertLMHeadModel, RobertaForCausalLM); read as an
        # encoder its weights would see every later token.
        raise ModelLoadError(f"{path}: is_decoder is true: a causal {config.get('model_type', 'bert')} is not "
                             "supported (its encoders are: set is_decoder to false only if the model was trained as one)")
    hidden, heads = need(config, "hidden_size", path), need(config, "num_attention_heads", path)
    if hidden % heads:
        raise ModelLoadError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    fields = dict(
        vocab_size=need(config, "vocab_size", path),
        max_positions=need(config, "max_position_embeddings", path),
        type_vocab_size=need(config, "type_vocab_size", path, default=2),
        emb_dim=hidden,
        n_heads=heads,
        n_layers=need(config, "num_hidden_layers", path),
        ff_dim=need(config, "intermediate_size", path),
        ln_eps=config.get("layer_norm_eps", 1e-12),
        gelu=gelu_form(config, "hidden_act", path),
        pad_token_id=config.get("pad_token_id", 0) or 0,
        tied_head=bool(config.get("tie_word_embeddings", True)),
    )
    fields["head_gelu"] = fields["gelu"]
    return BertConfig(**{**fields, **family})


def build(config: dict, path: Path) -> BertEncoder:
    return BertEncoder(encoder_config(config, path))


def _renamed(weights: dict[str, torch.Tensor]) -> Checkpoint:
    """Strip the task model's prefix and rename TF-era LayerNorm.gamma/beta."""
    return strip_prefix(weights, "bert.").renamed(
        lambda k: k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"))


def map_mlm_head(state: dict[str, torch.Tensor], mapped: Mapped, net: BertEncoder,
                 rows: list[Row], decoder: tuple[str, str | None], path: Path) -> None:
    """When the checkpoint carries a masked-LM head, give `net` one and map it. The decoder weight
    is the word embeddings when tied (whatever a saved copy holds, as in the decoder families), else
    the checkpoint's own, which must be there; a saved decoder bias duplicates the head's bias."""
    if rows[0][0] not in state:
        return
    net.attach_mlm_head()
    mapped.update(map_state(state, rows, path))  # with each tensor's checkpoint key
    saved = saved_name(state, decoder[0])
    weight = state.pop(decoder[0], None)
    if net.cfg.tied_head:
        mapped.tie("mlm_head.out_head.weight", "tok_emb.weight")
    elif weight is None:
        raise ModelLoadError(f"{path}: missing key '{saved}' (tie_word_embeddings is false)")
    else:
        mapped.put("mlm_head.out_head.weight", as_weights(weight, saved, path), saved)
    if decoder[1] is not None:
        state.pop(decoder[1], None)


def convert(weights: dict[str, torch.Tensor], net: BertEncoder, path: Path) -> dict[str, torch.Tensor]:
    state = _renamed(weights)
    mapped = map_state(state, rows_for(TOP, LAYER, net.cfg.n_layers), path)
    map_mlm_head(state, mapped, net, MLM_HEAD, MLM_DECODER, path)
    refuse_leftovers(state, lambda k: k in IGNORED or k.startswith(IGNORED_PREFIXES), "bert", path)
    return mapped
