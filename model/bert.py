"""A BERT-family encoder (post-LN, erf GELU) on the same MultiHeadAttention, causal=False."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from manyeyes.model.attention import Capture, MultiHeadAttention
from manyeyes.model.layers import FeedForward, LayerNorm, ShapeInfo, Trace


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int  # WordPiece vocabulary size
    max_positions: int  # learned absolute positions (HF max_position_embeddings)
    type_vocab_size: int  # segment embeddings; 2 for sentence pairs
    emb_dim: int  # hidden size
    n_heads: int  # attention heads per layer
    n_layers: int  # encoder layers
    ff_dim: int  # intermediate size of the feed-forward block
    ln_eps: float = 1e-12  # LayerNorm epsilon, read from the checkpoint's config
    gelu: str = "erf"  # "erf" (hidden_act "gelu") or "tanh" ("gelu_new")
    pad_token_id: int = 0


class EncoderBlock(nn.Module):
    """Post-LN block: norm1(x + att(x)), then norm2(x + ff(x))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.max_positions,
            dropout=0.0,
            num_heads=cfg.n_heads,
            qkv_bias=True,
            causal=False,
        )
        self.norm1 = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.ff = FeedForward(cfg.emb_dim, cfg.ff_dim, cfg.gelu)
        self.norm2 = LayerNorm(cfg.emb_dim, cfg.ln_eps)

    def forward(self, x, key_padding_mask=None, capture: Capture = Capture(weights=False)):
        att = self.att.attend(x, key_padding_mask, capture)
        x = self.norm1(x + att.context)
        x = self.norm2(x + self.ff(x))
        return x, att


class BertEncoder(ShapeInfo, nn.Module):
    causal = False

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=cfg.pad_token_id)
        self.pos_emb = nn.Embedding(cfg.max_positions, cfg.emb_dim)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.emb_dim)
        self.emb_norm = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.trf_blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))

    def inspect(
        self, in_idx, key_padding_mask=None, capture: Capture = Capture(), token_type_ids=None, weights_out=None
    ) -> Trace:
        """weights_out: optional (n_layers, b, n_heads, T, T) float32 buffer that receives every layer's weights."""
        _, num_tokens = in_idx.shape
        positions = torch.arange(num_tokens, device=in_idx.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(in_idx)
        # (b, num_tokens, emb_dim)
        x = self.emb_norm(self.tok_emb(in_idx) + self.pos_emb(positions) + self.type_emb(token_type_ids))
        layers = []
        for i, block in enumerate(self.trf_blocks):
            layer_capture = capture if weights_out is None else replace(capture, weights_out=weights_out[i])
            x, att = block(x, key_padding_mask, layer_capture)
            layers.append(att)
        return Trace(hidden=x, logits=None, layers=layers)

    def forward(self, in_idx, key_padding_mask=None, token_type_ids=None):
        return self.inspect(in_idx, key_padding_mask, Capture(weights=False), token_type_ids).hidden
