"""A BERT-family encoder (post-LN, erf GELU) on the same MultiHeadAttention, causal=False.

BERT, RoBERTa and DistilBERT differ only in where positions start, whether segments are embedded
and their key names, so one encoder serves all three; an optional masked-LM head gives logits."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from manyeyes.model.attention import Capture, MultiHeadAttention
from manyeyes.model.layers import GELU, FeedForward, LayerNorm, ShapeInfo, Trace, real_tokens_only


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int  # WordPiece vocabulary size
    max_positions: int  # learned absolute positions (HF max_position_embeddings)
    type_vocab_size: int  # segment embeddings; 2 for sentence pairs, 0 for none (DistilBERT)
    emb_dim: int  # hidden size
    n_heads: int  # attention heads per layer
    n_layers: int  # encoder layers
    ff_dim: int  # intermediate size of the feed-forward block
    ln_eps: float = 1e-12  # LayerNorm epsilon, read from the checkpoint's config
    gelu: str = "erf"  # "erf" (hidden_act "gelu") or "tanh" ("gelu_new")
    pad_token_id: int = 0
    # RoBERTa: position ids count the non-pad tokens and start at pad_token_id + 1, so the first
    # pad_token_id + 1 rows of the position table are never used by real tokens.
    positions_from_ids: bool = False
    head_gelu: str = "erf"  # the masked-LM head's activation (BERT: hidden_act; RoBERTa: always erf)
    # DistilBERT's sinusoidal_pos_embds: the position table is fixed sinusoids, so a checkpoint
    # that leaves it out can still load (the loader derives it).
    sinusoidal_positions: bool = False
    # The masked-LM head's decoder is the word embeddings (HF tie_word_embeddings); untied, the
    # checkpoint must carry its own, or the head would predict through the input embeddings.
    tied_head: bool = True


class MaskedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> vocabulary logits, as BERT, RoBERTa and DistilBERT all do."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.emb_dim, cfg.emb_dim)
        self.act = GELU(cfg.head_gelu)
        self.norm = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size)

    def forward(self, hidden):
        # (b, num_tokens, emb_dim) -> (b, num_tokens, vocab_size)
        return self.out_head(self.norm(self.act(self.dense(hidden))))


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
        x = self.norm2(x + real_tokens_only(self.ff, x, key_padding_mask))
        return x, att

    def weights_only(self, x, key_padding_mask=None, capture: Capture = Capture()):
        """The block up to its softmax, for a last block whose output nobody reads."""
        return self.att.attend(x, key_padding_mask, capture, mix=False)


class BertEncoder(ShapeInfo, nn.Module):
    causal = False

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=cfg.pad_token_id)
        self.pos_emb = nn.Embedding(cfg.max_positions, cfg.emb_dim)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.emb_dim) if cfg.type_vocab_size else None
        self.emb_norm = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.trf_blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        self.mlm_head: MaskedLMHead | None = None  # added by a loader whose checkpoint carries one

    def attach_mlm_head(self) -> None:
        self.mlm_head = MaskedLMHead(self.cfg)

    @property
    def has_lm_head(self) -> bool:
        return self.mlm_head is not None

    @property
    def max_positions(self) -> int:
        return self.cfg.max_positions - (self.cfg.pad_token_id + 1 if self.cfg.positions_from_ids else 0)

    def positions(self, in_idx):
        """(b, num_tokens) position ids; a plain arange broadcast over the batch unless RoBERTa's."""
        if self.cfg.positions_from_ids:
            # As transformers computes them, from the ids (a pad id keeps position pad_token_id).
            # The runtime right-pads with id 0, so its padding only extends the count past real rows.
            real = in_idx.ne(self.cfg.pad_token_id).int()
            return torch.cumsum(real, dim=1) * real + self.cfg.pad_token_id
        return torch.arange(in_idx.shape[1], device=in_idx.device)

    def inspect(
        self, in_idx, key_padding_mask=None, capture: Capture = Capture(), token_type_ids=None, weights_out=None
    ) -> Trace:
        """weights_out: optional (n_layers, b, n_heads, T, T) float32 buffer that receives every layer's weights."""
        # (b, num_tokens, emb_dim)
        x = self.tok_emb(in_idx) + self.pos_emb(self.positions(in_idx))
        if self.type_emb is not None:
            # One segment embedding (RoBERTa, and BERTs trained without pairs): a pair's second text
            # has no row of its own (transformers raises an IndexError), so every token reads row 0,
            # the only one the model has; Token.segment still tells the two texts apart.
            one_segment = token_type_ids is None or self.cfg.type_vocab_size == 1
            x = x + self.type_emb(torch.zeros_like(in_idx) if one_segment else token_type_ids)
        x = self.emb_norm(x)
        layers = []
        for i, block in enumerate(self.trf_blocks):
            layer_capture = capture if weights_out is None else replace(capture, weights_out=weights_out[i])
            if not capture.hidden and i == len(self.trf_blocks) - 1:
                layers.append(block.weights_only(x, key_padding_mask, layer_capture))
                return Trace(hidden=None, logits=None, layers=layers)
            x, att = block(x, key_padding_mask, layer_capture)
            layers.append(att)
        logits = self.mlm_head(x) if self.mlm_head is not None and capture.logits else None
        return Trace(hidden=x, logits=logits, layers=layers)

    def forward(self, in_idx, key_padding_mask=None, token_type_ids=None):
        return self.inspect(in_idx, key_padding_mask, Capture(weights=False), token_type_ids).hidden
