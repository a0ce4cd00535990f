"""Checkpoint key tables: map a foreign state dict onto ours, one explicit row per tensor.

A row is (their key, our key, transform); per-layer rows use `{i}`. A transform is named
(`transpose`), never an inline lambda, so a table says which tensors change layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from manyeyes.model.errors import CorruptFileError, ModelLoadError

Transform = Callable[[torch.Tensor], torch.Tensor] | None
Row = tuple[str, str, Transform]


# What fine-tuning adds on top of a base model (sequence, token and span classifiers): no part of
# the attention, so such checkpoints load for it, their extra tensors unread.
TASK_HEADS = ("score.", "classifier.", "qa_outputs.")


def head_required(config: dict) -> bool:
    """Whether a decoder checkpoint must carry its language-model head: yes for a *ForCausalLM /
    *LMHeadModel (or when config.json does not say), no for a base or task model, which then
    loads with no head and makes no predictions."""
    architectures = config.get("architectures") or []
    return not architectures or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)


def transpose(t: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D stores (in, out); nn.Linear wants (out, in)."""
    return t.t().contiguous()


def rows_for(top: Iterable[Row], per_layer: Iterable[Row], n_layers: int) -> list[Row]:
    per_layer = list(per_layer)
    return list(top) + [(src.format(i=i), dst.format(i=i), fn) for i in range(n_layers) for src, dst, fn in per_layer]


class Mapped(dict):
    """Our names -> tensors, remembering each one's key in the checkpoint for error messages.

    A tensor read from the checkpoint is set with `put` (or `tie`), not `mapped[ours] = ...`: one
    set without its source was reported under our name alone ('out_head.weight'), which no
    checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, str] = {}
        self.tied: set[str] = set()  # ours that are another tensor of ours: a head tied to the embeddings

    def put(self, ours: str, tensor: torch.Tensor, source: str) -> None:
        self[ours] = tensor
        self.sources[ours] = source

    def tie(self, ours: str, to: str) -> None:
        """`ours` is the very tensor already mapped to `to` (a language-model head tied to the word
        embeddings): an error about it names the key `to` came from, saying it is tied."""
        self.put(ours, self[to], self.sources[to])
        self.tied.add(ours)

    def update(self, other=(), /, **kwargs) -> None:
        """dict.update, keeping another Mapped's sources: merging a head's `map_state` into the
        body's dropped them, and its misshapen tensors were reported under our names."""
        super().update(other, **kwargs)
        if isinstance(other, Mapped):
            self.sources.update(other.sources)
            self.tied |= other.tied

    def theirs(self, ours: str) -> str:
        """How an error names `ours`'s tensor in the checkpoint ("" where the names are the same)."""
        source = self.sources.get(ours)
        if source is None or source == ours:
            return ""
        if ours in self.tied:
            return f" (tied to the word embeddings: the checkpoint's '{source}')"
        return f" (the checkpoint's '{source}')"


def as_weights(tensor: torch.Tensor, key: str, path: Path) -> torch.Tensor:
    """A checkpoint's weight as float32. Integers or booleans where weights belong (a quantised
    checkpoint, or another tensor under the name) would load as numbers that mean nothing."""
    if not tensor.is_floating_point():
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise ModelLoadError(f"{path}: '{key}' holds {dtype} values, not floating-point weights (is the checkpoint quantised?)")
    return tensor.float()


class Checkpoint(dict):
    """A checkpoint's tensors under the names the key tables read (a task model's prefix stripped),
    each remembering its name in the file, so that an error names the key a user can find there
    ("model.layers.1.self_attn.k_proj.weight", not "layers.1.self_attn.k_proj.weight")."""

    def __init__(self, named: Iterable[tuple[str, str, torch.Tensor]] = (), prefix: str = "") -> None:
        super().__init__()
        self.saved: dict[str, str] = {}
        self.prefix = prefix
        for saved, name, tensor in named:
            self[name] = tensor
            self.saved[name] = saved
        # The parts saved under the prefix ("layers", "embed_tokens"), by the first part of their
        # names: a key the file lacks is named as its neighbours are ("cls.*" beside "bert.*" has none).
        self.prefixed = {name.split(".")[0] for name, saved in self.saved.items() if prefix and saved.startswith(prefix)}

    def renamed(self, rename: Callable[[str], str]) -> Checkpoint:
        return Checkpoint(((self.saved[k], rename(k), v) for k, v in self.items()), self.prefix)


def saved_name(state: dict, key: str) -> str:
    """`key` as the file names it; a key the file lacks, as the file would have named it."""
    if not isinstance(state, Checkpoint):
        return key
    if key in state.saved:
        return state.saved[key]
    return state.prefix + key if key.split(".")[0] in state.prefixed else key


def map_state(state: dict[str, torch.Tensor], rows: Iterable[Row], path: Path) -> Mapped:
    """Pop each row's tensor from `state` (float32) into our names; a missing key names itself."""
    mapped = Mapped()
    for src, dst, fn in rows:
        saved = saved_name(state, src)
        if src not in state:
            raise ModelLoadError(f"{path}: missing key '{saved}' (for '{dst}')")
        tensor = as_weights(state.pop(src), saved, path)
        mapped.put(dst, fn(tensor) if fn else tensor, saved)
    return mapped


def pop_required(state: dict[str, torch.Tensor], key: str, path: Path) -> torch.Tensor:
    saved = saved_name(state, key)
    if key not in state:
        raise ModelLoadError(f"{path}: missing key '{saved}'")
    return as_weights(state.pop(key), saved, path)


def strip_prefix(weights: dict[str, torch.Tensor], prefix: str) -> Checkpoint:
    """Task models save the base model under a prefix ("bert.", "transformer.", "model.")."""
    return Checkpoint(((k, k.removeprefix(prefix), v) for k, v in weights.items()), prefix)


def refuse_leftovers(state: dict[str, torch.Tensor], ignorable: Callable[[str], bool], family: str, path: Path):
    for key in state:
        if not ignorable(key):
            raise ModelLoadError(f"{path}: unexpected key '{saved_name(state, key)}'; is this really a {family} checkpoint?")


def all_finite(t: torch.Tensor) -> bool:
    """Whether no value is NaN or infinite. Through the extremes, which carry any NaN or infinity:
    five times faster than isfinite(t).all(), which writes a mask as large as the tensor (1.2 s of
    MiniLM's 2.4 s load, paid at every server start)."""
    return t.numel() == 0 or all(bool(torch.isfinite(extreme)) for extreme in torch.aminmax(t))


def load_strict(net: torch.nn.Module, mapped: dict[str, torch.Tensor], path: Path, derived=("mask",)):
    """Shape-check every tensor by name, then load strictly; derived buffers come from the module."""
    own = net.state_dict()
    for key, tensor in own.items():
        if key.rsplit(".", 1)[-1] in derived and key not in mapped:
            mapped[key] = tensor
    for key in own:
        if key not in mapped:
            raise ModelLoadError(f"{path}: missing key '{key}'")
        # A plain dict (a book checkpoint, our own state_dict in train.py) is keyed by our names already.
        theirs = mapped.theirs(key) if isinstance(mapped, Mapped) else ""
        if own[key].is_floating_point() and not mapped[key].is_floating_point():
            dtype = str(mapped[key].dtype).removeprefix("torch.")
            raise ModelLoadError(f"{path}: '{key}'{theirs} holds {dtype} values, not floating-point weights")
        # NaN or infinite weights answered attention of NaNs: null in JSON, a head attending
        # nowhere in u8, a crash in the terminal.
        if mapped[key] is not own[key] and mapped[key].is_floating_point() and not all_finite(mapped[key]):
            raise ModelLoadError(f"{path}: '{key}'{theirs} holds NaN or infinite values; is the checkpoint damaged?")
        if tuple(mapped[key].shape) != tuple(own[key].shape):
            raise ModelLoadError(
                f"{path}: shape mismatch for '{key}'{theirs}: checkpoint has {tuple(mapped[key].shape)}, "
                f"model expects {tuple(own[key].shape)}"
            )
        # A saved derived buffer (the book's causal mask) is the one the config makes, or the file is
        # damaged: a zeroed mask let a query see later tokens in the dense path alone (the long-input
        # path masks by position), and a mask of ones made every first row NaN.
        if key.rsplit(".", 1)[-1] in derived and mapped[key] is not own[key] and not torch.equal(mapped[key] != 0, own[key] != 0):
            raise ModelLoadError(
                f"{path}: '{key}'{theirs} is not the mask this model derives from its config (1 above the diagonal, "
                "0 elsewhere); is the checkpoint damaged?"
            )
    for key in mapped:
        if key not in own:
            raise ModelLoadError(f"{path}: unexpected key '{key}'")
    net.load_state_dict(mapped, strict=True)


def read_json(path: Path) -> dict:
    if not path.exists():
        raise ModelLoadError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptFileError(f"cannot read JSON {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path} must hold a JSON object")
    return data


_REQUIRED = object()


def need(config: dict, key: str, path: Path, default=_REQUIRED):
    """A config number the model cannot be built without, or `default` where transformers' config
    class gives an absent key one. A null is refused by name: past `check_numbers` (which lets it
    pass) it failed in a constructor naming no key, or blamed tokenizer.json."""
    if key not in config:
        if default is _REQUIRED:
            raise ModelLoadError(f"{path} lacks the key '{key}'")
        return default
    if config[key] is None:
        raise ModelLoadError(f"{path}: {key} is null, but the model cannot be built without it")
    return config[key]


GELU_FORMS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def gelu_form(config: dict, key: str, path: Path, default: str = "gelu") -> str:
    act = config.get(key, default)
    if act not in GELU_FORMS:
        raise ModelLoadError(f"{path}: unsupported activation {key}={act!r}; this family runs {', '.join(GELU_FORMS)}")
    return GELU_FORMS[act]
