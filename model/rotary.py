"""Rotary position embeddings (RoPE) in the neox/llama "rotate_half" layout, with the scaled variants.

A head's first `rotary_dim` dimensions are rotated as `rotary_dim / 2` pairs (i, i + rotary_dim/2),
pair i turning by angle `position * inv_freq[i]`; the rest pass through (partial rotary, Pythia).
The `rope_scaling` variants only change `inv_freq` (and, for yarn/longrope, a factor on cos and
sin). The maths follows transformers' `modeling_rope_utils.py`, operation for operation in float32,
so that our angles equal theirs to the last bit that matters for attention parity.

One deliberate difference: transformers' "dynamic" NTK caches the frequencies of the longest input
seen so far; ours is a pure function of the current input length (what the method describes),
so a fresh transformers model and ours agree on every call. In a padded batch each row's length
chooses its own frequencies (`RotaryEmbedding.forward`'s `lengths`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int  # width of one attention head
    rotary_dim: int  # leading dims of each head that rotate; == head_dim unless partial rotary
    theta: float = 10000.0  # base wavelength (HF rope_theta / rotary_emb_base)
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float | None = None  # context extension factor (linear, dynamic, yarn, longrope, llama3)
    max_positions: int = 2048  # HF max_position_embeddings; dynamic scales only beyond it
    original_max_positions: int | None = None  # pre-extension context (yarn, longrope, llama3)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    beta_fast: float = 32.0  # yarn: rotations above which a pair extrapolates
    beta_slow: float = 1.0  # yarn: rotations below which a pair interpolates
    mscale: float | None = None  # yarn (DeepSeek form of the attention factor)
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn/longrope: factor on cos and sin; None: derived
    truncate: bool = True  # yarn: round the correction range to whole dims
    short_factor: tuple[float, ...] | None = field(default=None)  # longrope: per-pair divisors up to original
    long_factor: tuple[float, ...] | None = field(default=None)  # longrope: per-pair divisors beyond it

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 1..head_dim ({self.head_dim})")
        needs_factor = self.rope_type in ("linear", "dynamic", "llama3")
        if needs_factor and self.factor is None:
            raise ValueError(f"rope type {self.rope_type!r} needs a 'factor'")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                value = getattr(self, name)
                if value is None or len(value) != self.rotary_dim // 2:
                    raise ValueError(f"longrope needs {name} with {self.rotary_dim // 2} values")

    @property
    def original(self) -> int:
        return self.original_max_positions or self.max_positions


def _exponents(dim: int, device=None) -> torch.Tensor:
    """2i / dim for each rotated pair, float32: the same tensor transformers builds."""
    return torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim


def inverse_frequencies(cfg: RopeConfig, seq_len: int | None = None, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq of shape (rotary_dim / 2,), attention_factor) for inputs of `seq_len` positions."""
    dim, base = cfg.rotary_dim, cfg.theta
    kind = cfg.rope_type
    if kind == "default":
        return 1.0 / (base ** _exponents(dim, device)), 1.0
    if kind == "linear":
        # Dividing the frequencies is the same as dividing the positions by `factor`.
        return (1.0 / (base ** _exponents(dim, device))) / cfg.factor, 1.0
    if kind == "dynamic":
        # NTK-aware: stretch the base once the input outgrows the trained context.
        seq_len = max(seq_len or 0, cfg.max_positions)
        base = base * ((cfg.factor * seq_len / cfg.max_positions) - (cfg.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** _exponents(dim, device)), 1.0
    if kind == "yarn":
        return _yarn(cfg, device)
    if kind == "longrope":
        return _longrope(cfg, seq_len, device)
    return _llama3(cfg, device)


def _yarn(cfg: RopeConfig, device) -> tuple[torch.Tensor, float]:
    dim, base, original = cfg.rotary_dim, cfg.theta, cfg.original
    factor = cfg.factor if cfg.factor is not None else cfg.max_positions / original

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = cfg.attention_factor
    if attention_factor is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention_factor = float(mscale_of(factor, cfg.mscale) / mscale_of(factor, cfg.mscale_all_dim))
        else:
            attention_factor = mscale_of(factor)

    def dim_for_rotations(rotations):
        # The pair index whose wavelength fits `rotations` times into the original context.
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for_rotations(cfg.beta_fast or 32), dim_for_rotations(cfg.beta_slow or 1)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated = 1.0 / pos_freqs  # high-frequency pairs keep their trained angles
    interpolated = 1.0 / (factor * pos_freqs)  # low-frequency pairs are slowed down by `factor`
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    keep = 1 - ramp  # 1: extrapolate, 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep, attention_factor


def _longrope(cfg: RopeConfig, seq_len: int | None, device) -> tuple[torch.Tensor, float]:
    original = cfg.original
    factor = cfg.factor if cfg.factor is not None else cfg.max_positions / original
    attention_factor = cfg.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    # One set of per-pair divisors up to the original context, another beyond it.
    divisors = cfg.long_factor if seq_len and seq_len > original else cfg.short_factor
    ext = torch.tensor(divisors, dtype=torch.float32, device=device)
    shape = torch.arange(0, cfg.rotary_dim, 2, dtype=torch.int64, device=device).float() / cfg.rotary_dim
    return 1.0 / (ext * cfg.theta**shape), attention_factor


def _llama3(cfg: RopeConfig, device) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (cfg.theta ** _exponents(cfg.rotary_dim, device))
    original = cfg.original
    low_freq_wavelen = original / cfg.low_freq_factor
    high_freq_wavelen = original / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (original / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


class RotaryEmbedding(nn.Module):
    """Turns positions into the (cos, sin) tables that `apply_rotary` uses; holds no parameters."""

    def __init__(self, cfg: RopeConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_factor = inverse_frequencies(cfg)
        # Non-persistent: derived from the config, so never part of a checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # longrope's other set, past the original context: made once, not at every long forward.
        if cfg.rope_type == "longrope":
            self.register_buffer("long_inv_freq", inverse_frequencies(cfg, cfg.original + 1)[0], persistent=False)

    @property
    def follows_length(self) -> bool:
        """Whether the frequencies depend on the input's length (dynamic NTK, longrope)."""
        return self.cfg.rope_type in ("dynamic", "longrope")

    def frequency_key(self, seq_len: int):
        """Equal for two lengths exactly when they rotate by the same frequencies: keys cached at
        one length serve the other only then."""
        kind = self.cfg.rope_type
        if kind == "dynamic" and seq_len > self.cfg.max_positions:
            return seq_len
        if kind == "longrope":
            return seq_len > self.cfg.original
        return None

    def _frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        kind = self.cfg.rope_type
        if kind == "dynamic" and seq_len > self.cfg.max_positions:
            return inverse_frequencies(self.cfg, seq_len, self.inv_freq.device)
        if kind == "longrope" and seq_len > self.cfg.original:
            return self.long_inv_freq, self.attention_factor
        return self.inv_freq, self.attention_factor

    def _row_frequencies(self, lengths: torch.Tensor) -> torch.Tensor:
        """(b, rotary_dim / 2): each row's frequencies for its own length, on the device (no read
        of the lengths back to the host). The attention factor depends on none of them."""
        cfg, lengths = self.cfg, lengths.to(self.inv_freq.device)[:, None]
        if cfg.rope_type == "longrope":
            return torch.where(lengths > cfg.original, self.long_inv_freq[None, :], self.inv_freq[None, :])
        # dynamic NTK, as inverse_frequencies computes it for one length, here for each
        dim = cfg.rotary_dim
        seq_len = lengths.clamp(min=cfg.max_positions).double()
        base = cfg.theta * ((cfg.factor * seq_len / cfg.max_positions) - (cfg.factor - 1)) ** (dim / (dim - 2))
        return (1.0 / (base.float() ** _exponents(dim, self.inv_freq.device)[None, :])).float()

    def forward(
        self, positions: torch.Tensor, seq_len: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int; returns cos and sin, each (T, rotary_dim) float32.

        seq_len: the input's length in positions (default: last position + 1); passing it spares a
        device-to-host read on a GPU.
        lengths: (b,) each row's own length in a right-padded batch. Where the frequencies follow
        the length, each row then gets its own: cos and sin are (b, 1, T, rotary_dim), and a text
        rotates as it does alone, whatever the batch's width (the widest row's length had chosen
        every row's).
        """
        if lengths is not None and self.follows_length:
            inv_freq = self._row_frequencies(lengths)  # (b, rotary_dim / 2)
            # (1, T, 1) * (b, 1, rotary_dim / 2) -> (b, T, rotary_dim / 2)
            freqs = positions.float()[None, :, None] * inv_freq[:, None, :]
            angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (b, 1, T, rotary_dim): broadcast over heads
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        inv_freq, attention_factor = self._frequencies(seq_len if seq_len is not None else int(positions.max()) + 1)
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # (T, rotary_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, rotary_dim): pair i and i + rotary_dim/2 share an angle
        return angles.cos() * attention_factor, angles.sin() * attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim: the 90-degree turn of each (i, i + d/2) pair."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, T, head_dim); cos, sin: (T, rotary_dim). Rotates the first rotary_dim dims of each head."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, passed), dim=-1)


def rope_settings(config: dict) -> dict:
    """A copy of the config's own rope dict. Both present (a transformers-5 config given a
    `rope_scaling` by hand): transformers reads rope_scaling and drops rope_parameters
    (`rope_scaling or rope_parameters`), and so do we."""
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            # dict("linear") said "dictionary update sequence element #0 has length 1".
            raise ValueError(f"{key} must be an object of rope settings (or null), got {config[key]!r}")
    return dict(config.get("rope_scaling") or config.get("rope_parameters") or {})


def rope_parameters(config: dict, theta_key: str = "rope_theta") -> dict:
    """The RoPE settings of a Hugging Face config.json, whichever transformers version wrote it.

    transformers 5 writes one `rope_parameters` dict (with rope_theta inside); 4.x wrote a
    top-level `rope_theta` and a `rope_scaling` dict (or null) whose kind was `type` or `rope_type`.
    """
    params = rope_settings(config)
    params.setdefault("rope_theta", config.get(theta_key, 10000.0))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    # 4.x's older name `type` goes either way; a `rope_type` beside it wins, as in transformers.
    params.setdefault("rope_type", params.pop("type", "default"))
    # Phi-3 style configs keep the pre-extension length at the top level, and transformers prefers it there.
    if "original_max_position_embeddings" in config:
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return params


KNOWN_KEYS = {
    "rope_type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate", "short_factor", "long_factor",
}


# What transformers' rope validation requires of each type (original_max_position_embeddings may
# also stand at the config's top level: rope_parameters() brings it in).
REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}


def rope_config(params: dict, head_dim: int, max_positions: int) -> RopeConfig:
    """A RopeConfig from `rope_parameters(...)`; ValueError names anything it cannot honour."""
    unknown = sorted(set(params) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unsupported rope parameter(s): {', '.join(unknown)}")
    rope_type = params.get("rope_type")
    if not isinstance(rope_type, str):  # ["yarn"] was "unhashable type: 'list'"
        raise ValueError(f"rope_type must be a name such as 'linear' or 'yarn', got {rope_type!r}")
    missing = [key for key in REQUIRED.get(rope_type, ()) if params.get(key) is None]
    if missing:
        # As transformers refuses them, rather than guessing at defaults that change every position.
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in rope_scaling / rope_parameters")
    factor = params.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or rotary_dim <= 0:
        # Said in the config's terms: "rotary_dim 5" named no key a user could find.
        raise ValueError(
            f"head_dim {head_dim} x partial_rotary_factor {factor} (rotary_pct in GPT-NeoX configs) leaves "
            f"{rotary_dim} dims to rotate; only an even number above 0 is supported"
        )

    def optional(key, cast=float):
        value = params.get(key)
        return None if value is None else cast(value)

    def pairs(key):
        value = params.get(key)
        return None if value is None else tuple(float(v) for v in value)

    theta, factor = float(params["rope_theta"]), optional("factor")
    # Either at 0 makes every angle NaN: a model that "runs" and answers null weights.
    if not theta > 0 or (factor is not None and not factor > 0):
        raise ValueError(f"rope_theta and rope_scaling's factor must be > 0, got {theta} and {factor}")
    return RopeConfig(
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        theta=theta,
        rope_type=params.get("rope_type", "default"),
        factor=factor,
        max_positions=max_positions,
        original_max_positions=optional("original_max_position_embeddings", int),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        short_factor=pairs("short_factor"),
        long_factor=pairs("long_factor"),
    )
