"""A llama-family `RotaryDecoder` for training, and its Hugging Face llama folder.

The folder is the inverse of `families/llama.py`: config.json with model_type "llama", and
model.safetensors whose keys go through the same key table, so `load(folder)` (and transformers'
LlamaForCausalLM) read it like any llama checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from manyeyes.model.blocks import DecoderConfig, RotaryDecoder
from manyeyes.model.families.llama import LAYER, LM_HEAD, OUT_BIAS, QKV_BIAS, TOP
from manyeyes.model.keymap import rows_for
from manyeyes.model.rotary import RopeConfig

RMS_EPS = 1e-6  # llama's default rms_norm_eps


def decoder_config(
    vocab_size: int, context: int, emb_dim: int, layers: int, heads: int, kv_heads: int, ff_dim: int, rope_theta: float,
    attention_bias: bool = False,
) -> DecoderConfig:
    head_dim = emb_dim // heads
    return DecoderConfig(
        vocab_size=vocab_size,
        max_positions=context,
        emb_dim=emb_dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        ff_dim=ff_dim,
        rope=RopeConfig(head_dim=head_dim, rotary_dim=head_dim, theta=rope_theta, max_positions=context),
        norm="rms",
        norm_eps=RMS_EPS,
        ff="swiglu",
        qkv_bias=attention_bias,  # llama's attention_bias puts a bias on all four projections
        out_bias=attention_bias,
    )


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
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_state(net: RotaryDecoder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state_dict in Hugging Face llama names, through the loader's own table read backwards."""
    ours = net.state_dict()
    state = {}
    biases = (QKV_BIAS + OUT_BIAS) if net.cfg.qkv_bias else []
    for hf_key, our_key, transform in rows_for(TOP, LAYER + biases, net.cfg.n_layers):
        assert transform is None, f"{hf_key} is transformed on load; its inverse would be needed here"
        state["model." + hf_key] = ours[our_key]
    state[LM_HEAD] = ours["out_head.weight"]
    # safetensors wants contiguous tensors that share no storage.
    return {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in state.items()}


def save_weights(net: RotaryDecoder, path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file(hf_state(net, dtype), str(path), metadata={"format": "pt"})
