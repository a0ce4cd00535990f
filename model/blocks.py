"""A rotary pre-norm decoder: one network for llama, mistral, qwen2 and gpt_neox (Pythia).

The families differ only in switches of `DecoderConfig`: RMSNorm + SwiGLU (llama family) or
LayerNorm + GELU (gpt_neox), grouped-query attention, per-layer sliding windows, which
projections carry biases, and whether the feed-forward reads the block's input in parallel with
attention (gpt_neox) or the attention's output (everyone else). Names follow the book
(`tok_emb`, `trf_blocks.N.att.W_query`, `norm1.scale`, `final_norm`, `out_head`), with the
gated feed-forward's layers called `ff.gate`, `ff.up`, `ff.down`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from manyeyes.model.attention import Capture, MultiHeadAttention
from manyeyes.model.layers import FeedForward, LayerNorm, RMSNorm, ShapeInfo, SwiGLU, Trace, real_tokens_only
from manyeyes.model.rotary import RopeConfig, RotaryEmbedding


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int  # rows of the token embedding (and of the lm head)
    max_positions: int  # context the model was trained for (HF max_position_embeddings)
    emb_dim: int  # width of the residual stream (HF hidden_size)
    n_layers: int  # decoder blocks
    n_heads: int  # query heads per block
    n_kv_heads: int  # key/value heads per block; n_heads / n_kv_heads query heads share each
    head_dim: int  # width of one head; llama configs may set it apart from emb_dim / n_heads
    ff_dim: int  # hidden width of the feed-forward (HF intermediate_size)
    rope: RopeConfig  # rotary embedding of queries and keys, including partial rotary and scaling
    norm: str = "rms"  # "rms" (RMSNorm, llama family) or "layer" (LayerNorm, gpt_neox)
    norm_eps: float = 1e-6
    ff: str = "swiglu"  # "swiglu", or "erf"/"tanh": a two-layer GELU feed-forward of that form
    ff_bias: bool = False  # biases in the SwiGLU projections (llama mlp_bias)
    qkv_bias: bool = False  # biases on W_query/W_key/W_value (qwen2, gpt_neox, llama attention_bias)
    out_bias: bool = False  # bias on out_proj (gpt_neox, llama attention_bias; not qwen2)
    parallel_residual: bool = False  # gpt_neox: x + att(norm1(x)) + ff(norm2(x)) in one step
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () means no window anywhere
    tie_embeddings: bool = False  # out_head shares tok_emb's weight
    head_required: bool = True  # False: a base or task checkpoint, which may come without an LM head


def _norm(cfg: DecoderConfig) -> nn.Module:
    return RMSNorm(cfg.emb_dim, cfg.norm_eps) if cfg.norm == "rms" else LayerNorm(cfg.emb_dim, cfg.norm_eps)


class DecoderBlock(nn.Module):
    """Pre-norm block. Sequential: x += att(norm1(x)); x += ff(norm2(x)). Parallel: both read x."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=None,  # no fixed context: the causal mask is built per call
            dropout=0.0,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            out_bias=cfg.out_bias,
            rotary_dim=cfg.rope.rotary_dim,
            sliding_window=cfg.sliding_windows[layer] if cfg.sliding_windows else None,
        )
        self.norm1 = _norm(cfg)
        self.norm2 = _norm(cfg)
        if cfg.ff == "swiglu":
            self.ff = SwiGLU(cfg.emb_dim, cfg.ff_dim, bias=cfg.ff_bias)
        else:
            self.ff = FeedForward(cfg.emb_dim, cfg.ff_dim, cfg.ff)

    def forward(self, x, rope, key_padding_mask=None, capture: Capture = Capture(weights=False), past=None):
        att = self.att.attend(self.norm1(x), key_padding_mask, capture, rope=rope, past=past)
        ff = lambda h: self.ff(self.norm2(h))  # noqa: E731
        if self.parallel_residual:
            return x + att.context + real_tokens_only(ff, x, key_padding_mask), att
        x = x + att.context
        return x + real_tokens_only(ff, x, key_padding_mask), att

    def weights_only(self, x, rope, key_padding_mask=None, capture: Capture = Capture()):
        """The block up to its softmax, for a last block whose output nobody reads."""
        return self.att.attend(self.norm1(x), key_padding_mask, capture, rope=rope, mix=False)


class RotaryDecoder(ShapeInfo, nn.Module):
    causal = True

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.trf_blocks = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = _norm(cfg)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight  # one tensor, not a copy of a 100M-row table

    @property
    def has_lm_head(self) -> bool:
        return self.out_head is not None

    def drop_lm_head(self) -> None:
        """For a checkpoint with no LM head: no logits, no predictions, and no untrained head to load."""
        self.out_head = None

    @property
    def max_positions(self) -> int:
        """The longest input. Dynamic NTK exists to run past max_position_embeddings (its base grows
        with the input's length there), so it takes the factor's stretch of it: capped at
        max_position_embeddings, its scaling could never be reached. transformers sets no bound at
        all; a server needs one, and the factor is the stretch the config was written for."""
        rope = self.cfg.rope
        if rope.rope_type == "dynamic":
            return int(self.cfg.max_positions * max(rope.factor, 1.0))
        return self.cfg.max_positions

    @property
    def n_kv_heads(self) -> int:
        return self.cfg.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim

    def forward(self, in_idx):
        """Logits, (b, num_tokens, vocab_size)."""
        return self.inspect(in_idx, capture=Capture(weights=False)).logits

    def inspect(
        self, in_idx, key_padding_mask=None, capture: Capture = Capture(), token_type_ids=None, weights_out=None, past=None
    ) -> Trace:
        """weights_out: optional (n_layers, b, n_heads, T, T) float32 buffer that receives every layer's weights.

        past: per layer, the `KVCache` of earlier positions; in_idx then holds only the new tokens.
        """
        # token_type_ids is accepted and ignored so that every network shares one calling convention.
        _, num_tokens = in_idx.shape
        offset = len(past[0]) if past else 0
        positions = torch.arange(offset, offset + num_tokens, device=in_idx.device)
        # cos, sin: (num_tokens, rotary_dim), shared by every layer; (b, 1, num_tokens, rotary_dim)
        # where the frequencies follow each padded row's own length. With a cache, the length is
        # the whole sequence's, as a run of it all would see it.
        lengths = key_padding_mask.sum(-1) if key_padding_mask is not None and self.rotary.follows_length else None
        rope = self.rotary(positions, offset + num_tokens, lengths)
        x = self.tok_emb(in_idx)  # (b, num_tokens, emb_dim)
        layers = []
        for i, block in enumerate(self.trf_blocks):
            layer_capture = capture if weights_out is None else replace(capture, weights_out=weights_out[i])
            if not capture.hidden and i == len(self.trf_blocks) - 1 and not past:
                layers.append(block.weights_only(x, rope, key_padding_mask, layer_capture))
                return Trace(hidden=None, logits=None, layers=layers)
            x, att = block(x, rope, key_padding_mask, layer_capture, past=past[i] if past else None)
            layers.append(att)
        hidden = self.final_norm(x)
        logits = self.out_head(hidden) if capture.logits and self.out_head is not None else None
        return Trace(hidden=hidden, logits=logits, layers=layers)
