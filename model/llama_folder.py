"""A llama-family `RotaryDecoder` for training, and its Hugging Face llama folder.

The folder is the inverse of `families/llama.py`: config.json with model_type "llama", and
model.safetensors whose keys go through the same key table, so `load(folder)` (and transformers'
LlamaForCausalLM) read it like any llama checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.blocks import DecoderConfig, RotaryDecoder
from manyeyes.model.families.llama import LAYER, LM_HEAD, TOP, bias_rows, build
from manyeyes.model.keymap import rows_for

def training_decoder(
    vocab_size: int, context: int, emb_dim: int, layers: int, heads: int, kv_heads: int, ff_dim: int, rope_theta: float,
    attention_bias: bool = False,
) -> RotaryDecoder:
    """A fresh llama to train, built by the llama family's own loader from a config.json: the folder
    it is saved as then loads back as the same model by construction, not by two hand-kept copies
    of the same DecoderConfig agreeing. (attention_bias puts a bias on all four projections.)"""
    config = {
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": emb_dim, "intermediate_size": ff_dim,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": context, "rope_theta": rope_theta, "attention_bias": attention_bias,
    }
    return build(config, Path("manyeyes train"))


def hf_config(cfg: DecoderConfig, dtype: torch.dtype) -> dict:
    """config.json in transformers' LlamaConfig keys (4.x style rope_theta, which 5.x also reads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.ff_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope.theta,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # `manyeyes train`'s tokenizer has END_OF_TEXT as its first special token, id 0: named
        # here, transformers' generate stops there as ours does (which also reads the tokenizer)
        "eos_token_id": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_state(net: RotaryDecoder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state_dict in Hugging Face llama names, through the loader's own table read backwards."""
    ours = net.state_dict()
    state = {}
    for hf_key, our_key, transform in rows_for(TOP, LAYER + bias_rows(net.cfg), net.cfg.n_layers):
        assert transform is None, f"{hf_key} is transformed on load; its inverse would be needed here"
        state["model." + hf_key] = ours[our_key]
    state[LM_HEAD] = ours["out_head.weight"]
    # safetensors wants contiguous tensors that share no storage.
    return {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in state.items()}


def save_weights(net: RotaryDecoder, path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file(hf_state(net, dtype), str(path), metadata={"format": "pt"})
