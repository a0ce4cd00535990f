"""The book's GPTModel, with its names and layout, built on our MultiHeadAttention."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn

from manyeyes.model.attention import Capture, MultiHeadAttention
from manyeyes.model.layers import FeedForward, LayerNorm, ShapeInfo, Trace, real_tokens_only


def check_kind(name: str, value, kind: type) -> None:
    """A config value of its field's type: JSON's "1e-5" or true where a number belongs is refused."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name} must be {'a number' if kind is float else kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class GPTConfig:
    """The book's config keys, so its JSON dicts round-trip unchanged."""

    vocab_size: int = 50257  # size of the BPE vocabulary
    context_length: int = 1024  # maximum number of positions
    emb_dim: int = 768  # width of the residual stream
    n_heads: int = 12  # attention heads per block
    n_layers: int = 12  # transformer blocks
    drop_rate: float = 0.1  # dropout everywhere (inactive at inference)
    qkv_bias: bool = False  # bias on the query/key/value projections (True for GPT-2 weights)
    ln_eps: float = 1e-5  # LayerNorm epsilon, fixed in the book
    gelu: str = "tanh"  # "tanh" (book, GPT-2) or "erf"

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(unknown)}")
        missing = sorted(k for k in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers") if k not in d)
        if missing:
            raise ValueError(f"missing config keys: {', '.join(missing)}")
        for f in fields(cls):
            if f.name in d:
                check_kind(f.name, d[f.name], type(f.default))
        cfg = cls(**d)
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
        if not cfg.ln_eps > 0 or not 0 <= cfg.drop_rate < 1:
            raise ValueError(f"ln_eps must be > 0 and drop_rate in [0, 1), got {cfg.ln_eps} and {cfg.drop_rate}")
        if cfg.gelu not in ("tanh", "erf"):
            raise ValueError(f"gelu must be 'tanh' or 'erf', got {cfg.gelu!r}")
        if cfg.emb_dim % cfg.n_heads != 0:
            raise ValueError(f"emb_dim ({cfg.emb_dim}) is not divisible by n_heads ({cfg.n_heads})")
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "gpt2-small": GPTConfig(emb_dim=768, n_layers=12, n_heads=12, qkv_bias=True),
    "gpt2-medium": GPTConfig(emb_dim=1024, n_layers=24, n_heads=16, qkv_bias=True),
    "gpt2-large": GPTConfig(emb_dim=1280, n_layers=36, n_heads=20, qkv_bias=True),
    "gpt2-xl": GPTConfig(emb_dim=1600, n_layers=48, n_heads=25, qkv_bias=True),
}


class TransformerBlock(nn.Module):
    """Pre-LN block: x + att(norm1(x)), then x + ff(norm2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=cfg.drop_rate,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
        )
        self.ff = FeedForward(cfg.emb_dim, 4 * cfg.emb_dim, cfg.gelu)
        self.norm1 = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.norm2 = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x, key_padding_mask=None, capture: Capture = Capture(weights=False), past=None):
        att = self.att.attend(self.norm1(x), key_padding_mask, capture, past=past)
        x = x + self.drop_shortcut(att.context)
        x = x + self.drop_shortcut(real_tokens_only(lambda h: self.ff(self.norm2(h)), x, key_padding_mask))
        return x, att

    def weights_only(self, x, key_padding_mask=None, capture: Capture = Capture()):
        """The block up to its softmax, for a last block whose output nobody reads."""
        return self.att.attend(self.norm1(x), key_padding_mask, capture, mix=False)


class GPTModel(ShapeInfo, nn.Module):
    causal = True

    @property
    def max_positions(self) -> int:
        return self.cfg.context_length

    @property
    def has_lm_head(self) -> bool:
        return self.out_head is not None

    def drop_lm_head(self) -> None:
        """For a GPT-2 base checkpoint with no head of its own: no logits, no predictions."""
        self.out_head = None

    def __init__(self, cfg: GPTConfig | dict):
        super().__init__()
        cfg = cfg if isinstance(cfg, GPTConfig) else GPTConfig.from_dict(cfg)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        # A ModuleList keeps the book's `trf_blocks.N.` keys and lets us thread masks through.
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = LayerNorm(cfg.emb_dim, cfg.ln_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, in_idx):
        """The book's call: logits, (b, num_tokens, vocab_size)."""
        return self.inspect(in_idx, capture=Capture(weights=False)).logits

    def inspect(
        self, in_idx, key_padding_mask=None, capture: Capture = Capture(), token_type_ids=None, weights_out=None, past=None
    ) -> Trace:
        """weights_out: optional (n_layers, b, n_heads, T, T) float32 buffer that receives every layer's weights.

        past: per layer, the `KVCache` of earlier positions (a previous Trace's layers' `present`);
        in_idx then holds only the new tokens, placed after them.
        """
        # token_type_ids is accepted and ignored so that GPT and BERT share one calling convention.
        _, num_tokens = in_idx.shape
        offset = len(past[0]) if past else 0
        positions = torch.arange(offset, offset + num_tokens, device=in_idx.device)
        x = self.drop_emb(self.tok_emb(in_idx) + self.pos_emb(positions))  # (b, num_tokens, emb_dim)
        layers = []
        for i, block in enumerate(self.trf_blocks):
            layer_capture = capture if weights_out is None else replace(capture, weights_out=weights_out[i])
            if not capture.hidden and i == len(self.trf_blocks) - 1 and not past:
                layers.append(block.weights_only(x, key_padding_mask, layer_capture))
                return Trace(hidden=None, logits=None, layers=layers)
            x, att = block(x, key_padding_mask, layer_capture, past=past[i] if past else None)
            layers.append(att)
        hidden = self.final_norm(x)
        logits = self.out_head(hidden) if capture.logits and self.out_head is not None else None
        return Trace(hidden=hidden, logits=logits, layers=layers)
