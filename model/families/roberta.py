"""RoBERTa: BERT's encoder and key names under `roberta.`, positions counted from pad_token_id + 1."""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.bert import BertEncoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.families.bert import IGNORED, IGNORED_PREFIXES, LAYER, TOP, encoder_config, map_mlm_head
from manyeyes.model.keymap import map_state, need, refuse_leftovers, rows_for, strip_prefix

MODEL_TYPES = ("roberta",)

# RobertaLMHead: dense -> erf GELU (whatever hidden_act says) -> layer_norm -> decoder (tied).
MLM_HEAD = [
    ("lm_head.dense.weight", "mlm_head.dense.weight", None),
    ("lm_head.dense.bias", "mlm_head.dense.bias", None),
    ("lm_head.layer_norm.weight", "mlm_head.norm.scale", None),
    ("lm_head.layer_norm.bias", "mlm_head.norm.shift", None),
    ("lm_head.bias", "mlm_head.out_head.bias", None),
]
MLM_DECODER = ("lm_head.decoder.weight", "lm_head.decoder.bias")


def build(config: dict, path: Path) -> BertEncoder:
    pad = config.get("pad_token_id")
    pad = 1 if pad is None else pad
    positions = need(config, "max_position_embeddings", path)
    if not -1 <= pad <= positions - 2:
        # Positions run from pad + 1: below -1 the first is negative (an IndexError at every
        # forward), and from max_position_embeddings - 1 on there is none left (0 tokens, or a
        # negative length blamed on tokenizer.json).
        raise ModelLoadError(
            f"{path}: pad_token_id {pad} leaves RoBERTa no positions: they run from pad_token_id + 1 to "
            f"max_position_embeddings - 1 ({positions - 1}), so it must be in -1..{positions - 2}"
        )
    return BertEncoder(encoder_config(config, path, type_vocab_size=need(config, "type_vocab_size", path, default=1),
                                      pad_token_id=pad, positions_from_ids=True,
                                      head_gelu="erf"))


def convert(weights: dict[str, torch.Tensor], net: BertEncoder, path: Path) -> dict[str, torch.Tensor]:
    state = strip_prefix(weights, "roberta.")
    mapped = map_state(state, rows_for(TOP, LAYER, net.cfg.n_layers), path)
    map_mlm_head(state, mapped, net, MLM_HEAD, MLM_DECODER, path)
    refuse_leftovers(state, lambda k: k in IGNORED or k.startswith(IGNORED_PREFIXES), "roberta", path)
    return mapped
