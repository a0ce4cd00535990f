"""Building blocks shared by the GPT and BERT stacks, named as in "LLMs from scratch"."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from manyeyes.model.attention import AttentionOutput


class LayerNorm(nn.Module):
    """The book's LayerNorm: parameters are called ``scale`` and ``shift``."""

    def __init__(self, emb_dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        # F.layer_norm is the book's biased-variance formula, fused, and matches HF to 1e-6.
        return F.layer_norm(x, (x.shape[-1],), self.scale, self.shift, self.eps)


class GELU(nn.Module):
    """GELU with a choice of form: GPT-2 uses the tanh approximation, BERT the exact erf."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "erf"):  # else any other name silently ran erf
            raise ValueError(f"gelu must be 'tanh' or 'erf', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        if self.approximate == "tanh":
            # The book's formula, written out so that its checkpoints behave identically.
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))
        return F.gelu(x)


class FeedForward(nn.Module):
    def __init__(self, emb_dim, hidden_dim, approximate: str = "tanh"):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(emb_dim, hidden_dim),
            GELU(approximate),
            nn.Linear(hidden_dim, emb_dim),
        )

    def forward(self, x):
        return self.layers(x)


def skips_padding(device: torch.device) -> bool:
    """Whether feed-forwards leave out a padded batch's padding rows on `device`. Picking the real
    rows out by a mask makes the device tell the host how many there are, and on a GPU that waits
    for every kernel queued before it, once a layer: the host stops launching the next layer's work
    until the GPU is idle. The padding rows' feed-forward costs a GPU less than that wait. On the
    CPU there is nothing to wait for, and leaving them out saved a quarter of a mixed batch's time."""
    return device.type == "cpu"


def real_tokens_only(token_wise, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """token_wise(x) for the real tokens of a padded batch, zeros for its padding.

    A feed-forward reads each token alone, and no real token ever reads a padding token (they are
    masked as keys), so computing it for the padding is waste: a quarter to half of a mixed-length
    batch's rows, and the feed-forward is two thirds of a layer's matmuls. real: (b, num_tokens) bool,
    True for real tokens, or None (no padding). A mask of another shape (a decoder's cache covers
    past keys as well), or a device where skipping costs more than it saves (skips_padding),
    means every row is computed."""
    if real is None or real.shape != x.shape[:-1] or not skips_padding(x.device):
        return token_wise(x)
    # (n_real, emb_dim): the batch's real tokens, row after row
    out = token_wise(x[real])
    # (b, num_tokens, out_dim), the real rows scattered back in place
    full = out.new_zeros(*x.shape[:-1], out.shape[-1])
    full[real] = out
    return full


class RMSNorm(nn.Module):
    """Root-mean-square norm (llama, mistral, qwen2): no mean, no shift; the gain is ``scale`` as in LayerNorm."""

    def __init__(self, emb_dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x):
        # Normalised in float32 whatever the compute dtype, as transformers' LlamaRMSNorm does.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale * normed.to(x.dtype)


class SwiGLU(nn.Module):
    """The gated feed-forward of llama-family models: down(silu(gate(x)) * up(x)).

    Named for their roles, ``ff.gate``, ``ff.up`` and ``ff.down`` (HF gate_proj, up_proj, down_proj).
    """

    def __init__(self, emb_dim, hidden_dim, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(emb_dim, hidden_dim, bias=bias)
        self.up = nn.Linear(emb_dim, hidden_dim, bias=bias)
        self.down = nn.Linear(hidden_dim, emb_dim, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Trace(NamedTuple):
    """Everything one inspecting forward pass yields."""

    hidden: torch.Tensor | None  # (b, num_tokens, emb_dim), the last hidden state; None under Capture(hidden=False)
    logits: torch.Tensor | None  # (b, num_tokens, vocab_size) for language models, else None
    layers: list[AttentionOutput]  # one per transformer block, in order


class ShapeInfo:
    """The read-only shape every network exposes, so loaders and the runtime never read family configs.

    A family whose config names things differently overrides the properties it must.
    """

    cfg: object

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def n_heads(self) -> int:
        return self.cfg.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # no grouped-query attention unless a family says so

    @property
    def d_model(self) -> int:
        return self.cfg.emb_dim

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def max_positions(self) -> int:
        return self.cfg.max_positions

    @property
    def has_lm_head(self) -> bool:
        return False

    @property
    def lm_head(self):
        """The module that maps the last hidden state to vocabulary logits (None without a head)."""
        head = getattr(self, "mlm_head", None) or getattr(self, "out_head", None)
        return head if self.has_lm_head else None
