"""Train the book's GPTModel (or a llama-family RotaryDecoder) on plain text files, nanoGPT style,
into a folder `load(DIR)` reads.

The recipe: a byte-level BPE tokenizer trained on the text, the last tenth of the tokens held
out for validation, random windows as batches, AdamW with linear warmup and cosine decay,
gradient clipping. Everything random draws from generators seeded by `seed`, so a run on the
CPU repeats exactly, and a resumed run continues exactly where the interrupted one stopped.

The output folder holds (--arch gpt, the default):
    model.pth       the model's state_dict in the book's names (nothing else, so it loads anywhere)
    config.json     the book's GPTConfig keys
or (--arch llama) a Hugging Face llama folder:
    model.safetensors  the weights in Hugging Face llama key names
    config.json        LlamaConfig keys, model_type "llama"
and either way:
    tokenizer.json  the trained tokenizer
    card.json       corpus, licence, steps, tokens seen, losses, perplexity, seconds, command line
    checkpoint.pt   model + optimizer + step + random state, for --resume
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TextIO

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from manyeyes.model.blocks import RotaryDecoder
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.gpt import GPTConfig, GPTModel
from manyeyes.model.keymap import load_strict
from manyeyes.model.layers import SwiGLU
from manyeyes.model.llama_folder import hf_config, save_weights, training_decoder
from manyeyes.model.runtime import pick_device
from manyeyes.model.tokenizer import END_OF_TEXT  # separates files, so no window pretends one file continues another

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_KEYS = ("model", "optimizer", "batch_rng", "step", "tokens_seen", "seconds", "corpus_sha256", "commands",
                   "train_config")
WEIGHTS = {"gpt": "model.pth", "llama": "model.safetensors"}
ARCHS = tuple(WEIGHTS)
MIN_VOCAB = 257  # the 256 byte symbols plus END_OF_TEXT
VAL_FRACTION = 0.1
MIN_LR_RATIO = 0.1  # cosine decay ends at a tenth of the peak learning rate
WEIGHT_DECAY = 0.1
WEIGHT_INITS = ("gpt2", "torch")
GRAD_CLIP = 1.0
BETAS = (0.9, 0.95)
EVAL_BATCHES = 20
EVAL_SEED = 1234  # eval windows are fixed, so losses at different steps compare like with like

# What a resumed run may change; anything else would make it a different run.
RESUMABLE_OVERRIDES = ("steps", "device")
MAX_LR = 1e6


class TrainError(ValueError):
    """Bad arguments or unusable text; the message names the problem."""


@dataclass(frozen=True)
class TrainConfig:
    text: tuple[Path, ...]
    out: Path
    layers: int = 4
    heads: int = 4
    emb_dim: int = 128
    context: int = 128
    vocab_size: int = 2048
    steps: int = 2000
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 1337
    device: str = "auto"  # best available (CUDA, MPS, CPU); runs repeat exactly on the CPU
    warmup: int | None = None  # default: a tenth of the steps, at most 200
    eval_every: int | None = None  # default: ten evaluations per run
    save_dtype: str = "float32"  # storage of model.pth; "float16" halves it for shipping
    pos_init: str = "random"  # "random" (GPT-2's N(0, 0.02)) or "sinusoidal" (still trained)
    # "gpt2": N(0, 0.02), residual writers scaled down (init_weights); "torch": each module's own
    # PyTorch default (Linear U(±1/sqrt(fan_in)), Embedding N(0, 1)). The larger torch init makes
    # attention sharp from step 0; with a SwiGLU block, induction heads formed only under it here
    # (README, "The built-in tiny-llama").
    weight_init: str = "gpt2"
    # Freeze the feed-forward blocks; on a fresh model they start at zero output, so it is
    # attention-only. With the SwiGLU blocks training from step 0, a 2-layer llama formed no
    # induction head on copying text where the same model without them did (README, tiny-llama).
    freeze_ff: bool = False
    corpus_name: str | None = None  # what the card calls the corpus; default: the file names
    licence: str = "unknown (pass --licence)"
    arch: str = "gpt"  # "gpt" (the book's GPTModel) or "llama" (RotaryDecoder: RoPE, RMSNorm, SwiGLU, GQA)
    kv_heads: int | None = None  # llama: key/value heads, each shared by heads / kv_heads query heads; default heads
    ff_dim: int | None = None  # llama: SwiGLU hidden width; default 8/3 of emb_dim rounded up to 32
    rope_theta: float = 10000.0  # llama: RoPE base wavelength
    attention_bias: bool = False  # llama: biases on q, k, v and o (HF attention_bias)
    # Start from the weights of a folder this command wrote; its --arch, shape and tokenizer are
    # reused (CARD_SHAPE), so only what changes need be given.
    init_from: Path | None = None

    def __post_init__(self):
        positive = ("layers", "heads", "emb_dim", "steps", "batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise TrainError(f"--{_flag(name)} must be at least 1, not {getattr(self, name)}")
        if self.context < 2:
            raise TrainError(f"--context must be at least 2, not {self.context}")
        if self.emb_dim % self.heads:
            raise TrainError(f"--emb-dim ({self.emb_dim}) must be divisible by --heads ({self.heads})")
        if self.vocab_size < MIN_VOCAB:
            raise TrainError(f"--vocab-size must be at least {MIN_VOCAB} (256 bytes + {END_OF_TEXT}), not {self.vocab_size}")
        # Past ~3e37 AdamW's lr / (1 - beta1) overflows float32: a traceback, where 100 diverges as said.
        if not (0 < self.lr <= MAX_LR):
            raise TrainError(f"--lr must be a positive number of at most {MAX_LR:g}, not {self.lr}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise TrainError(f"--warmup must be in 0..{self.steps}, not {self.warmup}")
        if self.eval_every is not None and self.eval_every < 1:
            raise TrainError(f"--eval-every must be at least 1, not {self.eval_every}")
        if self.save_dtype not in ("float32", "float16"):
            raise TrainError(f"--save-dtype must be float32 or float16, not {self.save_dtype}")
        if self.pos_init not in ("random", "sinusoidal"):
            raise TrainError(f"--pos-init must be random or sinusoidal, not {self.pos_init}")
        if self.weight_init not in WEIGHT_INITS:
            raise TrainError(f"--weight-init must be {' or '.join(WEIGHT_INITS)}, not {self.weight_init}")
        if not self.text:
            raise TrainError("--text needs at least one file")
        if self.arch not in ARCHS:
            raise TrainError(f"--arch must be {' or '.join(ARCHS)}, not {self.arch}")
        if self.arch == "gpt":
            for name in ("kv_heads", "ff_dim", "attention_bias"):
                if getattr(self, name) not in (None, False):
                    raise TrainError(f"--{_flag(name)} applies to --arch llama only")
        else:
            if self.pos_init != "random":
                raise TrainError("--pos-init applies to --arch gpt only: llama rotates queries and keys instead")
            if self.n_kv_heads < 1:
                raise TrainError(f"--kv-heads must be at least 1, not {self.n_kv_heads}")
            if self.heads % self.n_kv_heads:
                raise TrainError(f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.n_kv_heads})")
            if self.ff_dim is not None and self.ff_dim < 1:
                raise TrainError(f"--ff-dim must be at least 1, not {self.ff_dim}")
            if (self.emb_dim // self.heads) % 2:
                raise TrainError(f"--emb-dim / --heads ({self.emb_dim // self.heads}) must be even: RoPE rotates pairs")
            if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
                raise TrainError(f"--rope-theta must be a positive number, not {self.rope_theta}")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def swiglu_dim(self) -> int:
        return self.ff_dim if self.ff_dim is not None else -(-8 * self.emb_dim // 3 // 32) * 32

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(200, self.steps // 10)

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)

    def to_json(self) -> dict:
        init = None if self.init_from is None else str(self.init_from)
        return {**asdict(self), "text": [str(p) for p in self.text], "out": str(self.out), "init_from": init}

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        init = None if d.get("init_from") is None else Path(d["init_from"])
        return cls(**{**d, "text": tuple(Path(p) for p in d["text"]), "out": Path(d["out"]), "init_from": init})


def _flag(name: str) -> str:
    return name.replace("_", "-")


def make_config(options: dict, resume: bool = False) -> TrainConfig:
    """A TrainConfig from command-line options (None means "not given").

    A resumed run takes its settings from DIR/checkpoint.pt; only RESUMABLE_OVERRIDES may differ.
    """
    given = {k: v for k, v in options.items() if v is not None}
    if not str(given.get("out", "")).strip():
        # Path("") is ".": the run would fill whatever folder the command was started in.
        raise TrainError(f"empty --out {given.get('out', '')!r}: give the folder to train into")
    given["text"] = tuple(Path(p) for p in given.get("text", ()))
    given["out"] = Path(given["out"])
    if "init_from" in given:
        given["init_from"] = Path(given["init_from"])
    unknown = sorted(set(given) - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise TrainError(f"unknown training option(s): {', '.join(unknown)}")
    if not resume:
        if "init_from" in given:
            if not given["init_from"].is_dir():  # "holds no card.json" for a path that is not there
                raise TrainError(f"--init-from {given['init_from']} is no folder: name a folder `manyeyes train` wrote")
            inherited = _init_shape(given["init_from"])
            # Another --arch than the folder's: nothing to take; _init_tokenizer names the mismatch.
            if given.get("arch", inherited.get("arch")) == inherited.get("arch"):
                _check_init_shape(given, inherited)
                given = {**inherited, **given}
        cfg = TrainConfig(**given)
        if cfg.arch == "gpt" and "rope_theta" in given:  # its default could not tell it was given: kept, unused
            raise TrainError("--rope-theta applies to --arch llama only")
        return cfg
    saved = _read_checkpoint(given["out"])["train_config"]
    for name, value in given.items():
        if name in ("text", "out") or name in RESUMABLE_OVERRIDES:
            continue
        if value != getattr(saved, name):
            theirs = "none (it was not given)" if getattr(saved, name) is None else getattr(saved, name)
            raise TrainError(
                f"--{_flag(name)} {value} differs from the checkpoint's {theirs}; "
                f"a resumed run may change only {', '.join('--' + n for n in RESUMABLE_OVERRIDES)}"
            )
    overrides = {k: given[k] for k in ("text", "out", *RESUMABLE_OVERRIDES) if k in given}
    # Another --steps stretches the cosine schedule; the warm-up and the evaluations' interval were
    # counted from the first --steps, and recounted they warmed the learning rate up again mid-run.
    overrides |= {"warmup": min(saved.warmup_steps, overrides.get("steps", saved.steps)), "eval_every": saved.eval_interval}
    return replace(saved, **overrides)


# The shape options a card's "config" (model_config) holds, under its own key for each arch.
# Each is a default only: a llama may be given another --context (RoPE has no position table).
CARD_SHAPE = {
    "gpt": {"layers": "n_layers", "heads": "n_heads", "emb_dim": "emb_dim", "context": "context_length", "vocab_size": "vocab_size"},
    "llama": {
        "layers": "num_hidden_layers", "heads": "num_attention_heads", "emb_dim": "hidden_size",
        "context": "max_position_embeddings", "vocab_size": "vocab_size",
        "kv_heads": "num_key_value_heads", "ff_dim": "intermediate_size", "rope_theta": "rope_theta",
        "attention_bias": "attention_bias",
    },
}


def _init_shape(folder: Path) -> dict:
    """The --arch and shape options of the run that wrote `folder`, from its card, so that
    --init-from need not restate them. A value given on the command line still wins (the loader
    then names a weight it does not fit). {} for a folder without a card: _init_tokenizer says so."""
    card_path = folder / "card.json"
    if not card_path.is_file():
        return {}
    config = _read_card(card_path).get("config")
    if not isinstance(config, dict):
        return {}
    arch = "llama" if config.get("model_type") == "llama" else "gpt"
    return {"arch": arch, **{option: config[key] for option, key in CARD_SHAPE[arch].items() if key in config}}


def _check_init_shape(given: dict, inherited: dict) -> None:
    """Refuse a shape option other than the --init-from folder's: one whose weights do not fit was
    named by the loader, but another --heads fits the same tensors and silently re-reads them as
    other heads (another --rope-theta, as other positions). RoPE has no position table, so a llama's
    --context may change."""
    for option, value in inherited.items():
        if option in given and given[option] != value and (option, inherited["arch"]) != ("context", "llama"):
            raise TrainError(
                f"--{_flag(option)} {given[option]} differs from the {value} of --init-from {given['init_from']}, whose "
                f"weights hold that shape; leave --{_flag(option)} out (only a llama's --context may change)"
            )


def _read_card(card_path: Path) -> dict:
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainError(f"--init-from {card_path} cannot be read as JSON: {exc}") from exc
    if not isinstance(card, dict):
        raise TrainError(f"--init-from {card_path} is not a card `manyeyes train` wrote (not a JSON object)")
    return card


# ---------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Corpus:
    texts: list[str]
    files: list[dict]  # name, bytes, sha256 of each file, for the card and for resume checks

    @property
    def sha256(self) -> str:
        return hashlib.sha256("".join(f["sha256"] for f in self.files).encode()).hexdigest()


def read_corpus(paths: tuple[Path, ...]) -> Corpus:
    texts, files = [], []
    for path in paths:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise TrainError(f"cannot read text file {path}: {exc.strerror or exc}") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TrainError(f"text file {path} is not UTF-8 (byte {exc.start}): {exc.reason}") from exc
        if not text.strip():
            raise TrainError(f"text file {path} is empty")
        texts.append(text)
        files.append({"name": Path(path).name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()})
    return Corpus(texts, files)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """GPT-2's recipe: bytes mapped to printable symbols, split GPT-2's way, merged by BPE.

    trim_offsets=False makes every token's offsets cover exactly the characters it encodes,
    leading space included, so tokens tile the caller's text with no gaps.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_chunks(texts), trainer)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _chunks(texts: list[str], lines_per_chunk: int = 1000):
    # Whole lines, so no word is cut in two; ByteLevel splits words the same way either side.
    for text in texts:
        lines = text.splitlines(keepends=True)
        for i in range(0, len(lines), lines_per_chunk):
            yield "".join(lines[i : i + lines_per_chunk])


def encode_corpus(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for i, text in enumerate(texts):
        if i:
            ids.append(end)
        ids.extend(tokenizer.encode(text).ids)
    return torch.tensor(ids, dtype=torch.long)


def split_ids(ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last tenth is held out; each side needs at least one full window plus its target."""
    need = context + 1
    n_val = max(need, int(len(ids) * VAL_FRACTION))
    if len(ids) - n_val < need:
        raise TrainError(
            f"the text is too short: {len(ids)} tokens, but --context {context} needs at least "
            f"{2 * need} (a window for training and one for validation); give more text or a smaller --context"
        )
    return ids[:-n_val], ids[-n_val:]


def get_batch(data: torch.Tensor, batch_size: int, context: int, gen: torch.Generator):
    """Random windows: inputs (batch_size, context) and the same shifted by one as targets."""
    starts = torch.randint(len(data) - context, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + context] for s in starts.tolist()])
    return x, y


# ---------------------------------------------------------------------------- model and optimizer
def build_model(cfg: TrainConfig, vocab_size: int) -> GPTModel | RotaryDecoder:
    if cfg.arch == "llama":
        model = training_decoder(
            vocab_size, cfg.context, cfg.emb_dim, cfg.layers, cfg.heads, cfg.n_kv_heads, cfg.swiglu_dim, cfg.rope_theta,
            cfg.attention_bias,
        )
    else:
        model = GPTModel(GPTConfig(
            vocab_size=vocab_size,
            context_length=cfg.context,
            emb_dim=cfg.emb_dim,
            n_heads=cfg.heads,
            n_layers=cfg.layers,
            drop_rate=0.0,  # short runs over a whole corpus underfit rather than overfit
            qkv_bias=False,
        ))
    if cfg.weight_init == "gpt2":
        init_weights(model)
    if cfg.freeze_ff:
        freeze_feed_forward(model)
    if cfg.pos_init == "sinusoidal":  # --arch gpt only (__post_init__)
        with torch.no_grad():
            model.pos_emb.weight.copy_(sinusoidal_positions(cfg.context, cfg.emb_dim))
    return model


def sinusoidal_positions(context: int, emb_dim: int) -> torch.Tensor:
    """The original Transformer's position table, as a starting point the model keeps training.

    Learned positions start as noise, and a head that attends "one token back" must first learn
    a position code in which that offset is a fixed linear map; sinusoids have that property from
    step 0. Scaled so their RMS equals the 0.02 of the token embeddings they are added to.
    """
    pos = torch.arange(context, dtype=torch.float32).unsqueeze(1)  # (context, 1)
    freq = torch.exp(torch.arange(0, emb_dim, 2, dtype=torch.float32) * (-math.log(10000.0) / emb_dim))
    table = torch.zeros(context, emb_dim)
    table[:, 0::2] = torch.sin(pos * freq)  # (context, emb_dim / 2)
    table[:, 1::2] = torch.cos(pos * freq)[:, : emb_dim // 2]
    return table * (0.02 * math.sqrt(2.0))


def init_weights(model: GPTModel | RotaryDecoder) -> None:
    """GPT-2's init: PyTorch's default N(0, 1) embeddings train far slower at this scale.

    Projections that write into the residual stream are scaled down by sqrt(2 * n_layers), so
    the stream's variance does not grow with depth.
    """
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if name.endswith(("att.out_proj", "ff.layers.2", "ff.down")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def freeze_feed_forward(model: GPTModel | RotaryDecoder) -> None:
    """Zero each feed-forward block's last projection (its output is then 0) and exclude the block
    from training. --init-from loads its weights afterwards, and they stay as loaded."""
    for block in model.trf_blocks:
        last = block.ff.down if isinstance(block.ff, SwiGLU) else block.ff.layers[2]
        with torch.no_grad():
            last.weight.zero_()
            if last.bias is not None:
                last.bias.zero_()
        block.ff.requires_grad_(False)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    # Decay matrices and embeddings only; decaying LayerNorm scales and biases only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to MIN_LR_RATIO * cfg.lr at the last step."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    min_lr = MIN_LR_RATIO * cfg.lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr - min_lr)


def lm_loss(model: GPTModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (b, context, vocab_size)
    # (b, context, vocab_size) -> (b * context, vocab_size) against (b * context,)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@torch.no_grad()
def estimate_loss(model: GPTModel, data: torch.Tensor, cfg: TrainConfig, device: torch.device) -> float:
    """Mean loss over EVAL_BATCHES fixed windows; the same windows at every evaluation."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    model.eval()
    losses = []
    for _ in range(EVAL_BATCHES):
        x, y = get_batch(data, cfg.batch_size, cfg.context, gen)
        losses.append(lm_loss(model, x.to(device), y.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------------- files
def _umask() -> int:
    """The process's umask, read where Linux shows it: os.umask() reads it only by setting it, and
    a file another thread made meanwhile would have been created world-writable."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)  # elsewhere: set for an instant, to the strictest, and put back
    os.umask(umask)
    return umask


def _atomic_save(write, path: Path) -> None:
    """Write to a temporary name, then rename: an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    # safetensors creates its file 0600 whatever the umask: a folder mounted into the container,
    # which runs as another user, could not be read. Every file gets what a plain open() gives.
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _write_json(path: Path, data: dict) -> None:
    _atomic_save(lambda p: p.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8"), path)


def _read_checkpoint(out: Path) -> dict:
    """DIR/checkpoint.pt, its "train_config" read into a TrainConfig; a file of any other making is
    refused by name (the book's {"model_state_dict": ...} was a KeyError traceback)."""
    from manyeyes.model.loading import unloadable

    path = Path(out) / CHECKPOINT
    if not path.exists():
        raise TrainError(f"cannot resume: {path} does not exist (train without --resume first)")
    foreign = f"cannot resume: {path} is not a checkpoint `manyeyes train` wrote"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and unpickler errors all mean the same to a user
        raise TrainError(f"{foreign} ({unloadable(path, exc, 'a training checkpoint of tensors and plain data')})") from exc
    if not isinstance(ckpt, dict):
        raise TrainError(f"{foreign} (it holds a {type(ckpt).__name__}, not a dict)")
    missing = [key for key in CHECKPOINT_KEYS if key not in ckpt]
    if missing:
        raise TrainError(f"{foreign} (it has no {', '.join(map(repr, missing))})")
    try:
        return {**ckpt, "train_config": TrainConfig.from_json(ckpt["train_config"])}
    except (KeyError, TypeError, AttributeError) as exc:
        raise TrainError(f"{foreign} (its train_config is unreadable: {exc!r})") from exc


def save_model(model: GPTModel | RotaryDecoder, out: Path, save_dtype: str) -> None:
    dtype = torch.float16 if save_dtype == "float16" else torch.float32
    if isinstance(model, RotaryDecoder):
        _atomic_save(lambda p: save_weights(model, p, dtype), out / WEIGHTS["llama"])
        _write_json(out / "config.json", hf_config(model.cfg, dtype))
        return
    state = {k: v.detach().to("cpu", dtype) if v.is_floating_point() else v.cpu() for k, v in model.state_dict().items()}
    _atomic_save(lambda p: torch.save(state, p), out / WEIGHTS["gpt"])
    _write_json(out / "config.json", model.cfg.to_dict())


def model_config(model: GPTModel | RotaryDecoder) -> dict:
    """What config.json holds, for the card."""
    if isinstance(model, RotaryDecoder):
        return hf_config(model.cfg, next(iter(model.parameters())).dtype)
    return model.cfg.to_dict()


def init_from(model: GPTModel | RotaryDecoder, cfg: TrainConfig) -> dict:
    """Copy the weights of the folder cfg.init_from into model; returns that folder's card.

    The folder is read by the same loader as any model, so a shape or key that differs (another
    width, another vocabulary, the other --arch) is named in the error. Only positions may
    differ: RoPE has no position table, so a llama trained at one --context starts another.
    """
    from manyeyes.model.loading import load

    folder = cfg.init_from
    card_path = folder / "card.json"
    try:
        source = load(folder, device="cpu").net
        if type(source) is not type(model):
            raise TrainError(f"--init-from {folder} is not an --arch {cfg.arch} model")
        load_strict(model, dict(source.state_dict()), folder)
    except ModelLoadError as exc:
        raise TrainError(f"--init-from {folder} does not fit this model: {exc}") from exc
    card = _read_card(card_path)
    keep = ("corpus", "steps", "tokens_seen", "train_loss", "val_loss", "seconds", "command", "resumed_with", "init_from")
    return {"folder": str(folder), **{k: card[k] for k in keep if k in card}}


# ---------------------------------------------------------------------------- the loop
class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line now and then otherwise."""

    def __init__(self, total: int, stream: TextIO, lines: int = 20):
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.every = max(1, total // lines)
        self.last_draw = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float, eta_s: float) -> None:
        done = step == self.total
        now = time.monotonic()
        if self.tty:
            if not done and now - self.last_draw < 0.2:
                return
        elif not done and step % self.every:
            return
        self.last_draw = now
        filled = int(30 * step / self.total)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (30 - filled)}] "
            f"loss {loss:.3f} | {tokens_per_s / 1000:.1f}k tok/s | ETA {_duration(eta_s)}"
        )
        self.stream.write(("\r" + line + ("\n" if done else "")) if self.tty else line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        self.stream.write(("\r\033[K" if self.tty else "") + message + "\n")
        self.stream.flush()


class StopAfterStep:
    """Ctrl-C while training: the step in progress finishes, and the run stops there, saved.

    A KeyboardInterrupt raised where the signal lands is almost always inside a step (the backward,
    the optimizer), where model, optimizer and step count disagree and nothing can be saved: the
    run lost everything since its last evaluation. A second Ctrl-C stops at once, as before.
    Signals reach only the main thread; elsewhere this does nothing."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.asked = False
        self._installed = False
        self._previous = self._previous_term = None

    def __enter__(self) -> "StopAfterStep":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._ask)
            # SIGTERM (`timeout`, a process manager, a cluster's preemption) stops the same way: it
            # ended the run unsaved and unsaid, losing every step since the last evaluation.
            self._previous_term = signal.signal(signal.SIGTERM, self._ask)
            self._installed = True
        return self

    def _ask(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        self.progress.note("stopping after this step (Ctrl-C again stops at once, without saving it)")

    def __exit__(self, *exc) -> None:
        if self._installed:  # None: a handler set outside Python, which Python cannot put back
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            signal.signal(signal.SIGTERM, self._previous_term if self._previous_term is not None else signal.SIG_DFL)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(cfg: TrainConfig, resume: bool = False, command: str = "", stream: TextIO | None = None) -> dict:
    """Train (or resume) into cfg.out; returns the card it wrote. Progress goes to stream (stderr)."""
    device = _device(cfg.device)
    corpus = read_corpus(cfg.text)
    out = cfg.out
    if resume:
        ckpt = _read_checkpoint(out)
        if ckpt["corpus_sha256"] != corpus.sha256:
            raise TrainError(f"cannot resume: the --text files differ from the ones {out / CHECKPOINT} was trained on")
        # A run stopped after its last step but before its card (Ctrl-C in the final evaluation) is
        # finished: evaluated and carded, with no step more.
        if ckpt["step"] >= cfg.steps and _carded(out, ckpt["step"]):
            raise TrainError(f"nothing to do: {out} is already trained for {ckpt['step']} steps; pass a larger --steps")
        if ckpt["step"] > cfg.steps:  # a typo (50 for 50000) had ended the run and rewritten its plan
            raise TrainError(
                f"--steps {cfg.steps} is below the {ckpt['step']} steps {out} has trained (its plan was "
                f"{ckpt['train_config'].steps}): pass more, or leave --steps out to keep the plan"
            )
        tokenizer = _read_tokenizer(out / "tokenizer.json", "cannot resume")
    else:
        held = _model_file(out)
        if held:
            resumable = "pass --resume to continue it, or " if held == CHECKPOINT else ""
            raise TrainError(f"{out} already holds a model ({held}); {resumable}choose another --out")
        # With --init-from, the ids must mean what they meant to the weights we start from.
        tokenizer = _init_tokenizer(cfg) if cfg.init_from is not None else train_tokenizer(corpus.texts, cfg.vocab_size)
        ckpt = None

    train_ids, val_ids = split_ids(encode_corpus(tokenizer, corpus.texts), cfg.context)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tokenizer.get_vocab_size()).to(device)
    optimizer = make_optimizer(model, cfg.lr)
    batch_gen = torch.Generator().manual_seed(cfg.seed)
    step, tokens_seen, seconds_before, commands = 0, 0, 0.0, [command]
    started_from = init_from(model, cfg) if cfg.init_from is not None and ckpt is None else None
    if ckpt is None:
        # Only now that every check has passed: a refused run leaves --out as it found it.
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainError(f"cannot create --out {out}: {exc.strerror or exc}") from exc
    else:
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            batch_gen.set_state(ckpt["batch_rng"])
        except (RuntimeError, ValueError, TypeError) as exc:  # load_state_dict lists every key, on lines of its own
            reason = " ".join(str(exc).split())
            raise TrainError(f"cannot resume: {out / CHECKPOINT} does not fit the model of its own train_config: "
                             f"{reason[:200]}{'...' if len(reason) > 200 else ''}") from exc
        step, tokens_seen, seconds_before = ckpt["step"], ckpt["tokens_seen"], ckpt["seconds"]
        commands = ckpt["commands"] + [command]
        started_from = ckpt.get("init_from")
    saved_step = step if ckpt is not None else None

    def stop_if_diverged(finite: bool, what: str) -> None:
        """Stop at the first loss (or weights) not finite: training on had written NaN weights over
        the last good checkpoint at each evaluation, and a card of invalid JSON."""
        if finite:
            return
        kept = (f"{out / CHECKPOINT} keeps step {saved_step}; train again with a lower --lr than {cfg.lr} in another --out"
                if saved_step is not None else f"nothing was saved; train again with a lower --lr than {cfg.lr}")
        raise TrainError(f"{what} diverged at step {step}: training stopped, {kept}")

    def checkpoint(seconds: float) -> None:
        nonlocal saved_step
        stop_if_diverged(all(bool(torch.isfinite(p).all()) for p in model.parameters()), "the weights")
        if saved_step is None:
            # With the first checkpoint, not before: a run that saved nothing leaves --out without a
            # tokenizer.json, which would make a second try refuse the folder as another model's.
            _atomic_save(lambda p: tokenizer.save(str(p)), out / "tokenizer.json")
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "batch_rng": batch_gen.get_state(),
            "step": step,
            "tokens_seen": tokens_seen,
            "seconds": seconds,
            "corpus_sha256": corpus.sha256,
            "commands": commands,
            "train_config": cfg.to_json(),
            "init_from": started_from,
        }
        _atomic_save(lambda p: torch.save(state, p), out / CHECKPOINT)
        save_model(model, out, cfg.save_dtype)
        saved_step = step

    progress = Progress(cfg.steps, stream or sys.stderr)
    progress.note(
        f"training {cfg.arch}, {cfg.layers} layers x {cfg.heads} heads, emb {cfg.emb_dim}, context {cfg.context}, "
        f"vocab {tokenizer.get_vocab_size()} on {len(train_ids):,} tokens ({len(val_ids):,} held out), "
        f"{device}" + ("" if not step else f"; resuming at step {step}" if step < cfg.steps else
                       f"; all {step} steps are trained, finishing the run")
    )
    model.train()
    started = time.monotonic()
    start_step = step
    mid_step = False  # an interrupt inside a step leaves model, optimizer and step out of step
    saved_last = False  # the last step's checkpoint is written
    try:
        with StopAfterStep(progress) as stop:
            while step < cfg.steps:
                mid_step = True
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, cfg)
                x, y = get_batch(train_ids, cfg.batch_size, cfg.context, batch_gen)
                loss = lm_loss(model, x.to(device), y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                optimizer.step()
                step += 1
                tokens_seen += x.numel()
                mid_step = False
                value = loss.item()
                stop_if_diverged(math.isfinite(value), f"the training loss ({value})")

                elapsed = time.monotonic() - started
                rate = (step - start_step) * x.numel() / max(elapsed, 1e-9)
                progress.update(step, value, rate, (cfg.steps - step) * x.numel() / max(rate, 1e-9))
                if step % cfg.eval_interval == 0 and step < cfg.steps:
                    val = estimate_loss(model, val_ids, cfg, device)
                    stop_if_diverged(math.isfinite(val), f"the validation loss ({val})")
                    progress.note(f"step {step}: val loss {val:.3f}")
                    checkpoint(seconds_before + time.monotonic() - started)
                if stop.asked:
                    raise KeyboardInterrupt
            # Saved before the final evaluation (80 batches): a Ctrl-C during it had lost every
            # step since the last save, without a word.
            seconds = seconds_before + time.monotonic() - started
            checkpoint(seconds)
            saved_last = True
            if stop.asked:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        if not mid_step and not saved_last:
            checkpoint(seconds_before + time.monotonic() - started)
        if saved_step is not None:
            progress.note(f"interrupted; {out / CHECKPOINT} holds step {saved_step}; "
                          f"continue with `{_resume_command(out, cfg.text)}`")
        else:
            progress.note("interrupted before any step was saved; there is nothing to resume")
        raise

    try:
        train_loss = estimate_loss(model, train_ids, cfg, device)
        val_loss = estimate_loss(model, val_ids, cfg, device)
    except KeyboardInterrupt:
        progress.note(f"interrupted in the final evaluation; {out} holds all {step} steps, but no card.json "
                      f"(its losses were not measured): finish it with `{_resume_command(out, cfg.text)}`")
        raise
    stop_if_diverged(math.isfinite(train_loss) and math.isfinite(val_loss),
                     f"the final losses (train {train_loss}, validation {val_loss})")
    perplexity = _perplexity(val_loss)
    card = {
        "model": "RotaryDecoder (llama family), causal" if cfg.arch == "llama" else "GPTModel (LLMs from scratch), causal",
        "corpus": cfg.corpus_name or ", ".join(f["name"] for f in corpus.files),
        "corpus_files": corpus.files,
        "licence": cfg.licence,
        "tokens": {"train": len(train_ids), "validation": len(val_ids)},
        "steps": step,
        "tokens_seen": tokens_seen,
        "train_loss": round(train_loss, 4),
        "val_loss": round(val_loss, 4),
        "val_perplexity": None if perplexity is None else round(perplexity, 2),  # None: beyond a float (loss > 709)
        "seconds": round(seconds, 1),
        "command": commands[0],
        "resumed_with": commands[1:],  # each --resume, in order; resuming re-stretches the cosine to --steps
        "device": str(device),
        "torch": torch.__version__,
        "config": model_config(model),
        "init_from": started_from,  # the run these weights started from (None: random init), with its own card
        "training": {
            "batch_size": cfg.batch_size,
            "lr": cfg.lr,
            "warmup_steps": cfg.warmup_steps,
            "min_lr": MIN_LR_RATIO * cfg.lr,
            "weight_decay": WEIGHT_DECAY,
            "betas": list(BETAS),
            "grad_clip": GRAD_CLIP,
            "seed": cfg.seed,
            "validation": f"the last {VAL_FRACTION:.0%} of the tokens, never trained on",
            "weights_dtype": cfg.save_dtype,
        },
    }
    _write_json(out / "card.json", card)
    progress.note(
        f"done: {step} steps, {tokens_seen:,} tokens in {_duration(seconds)}; train loss {train_loss:.3f}, "
        f"val loss {val_loss:.3f} (perplexity {'beyond a float' if perplexity is None else f'{perplexity:.4g}'}); "
        f"wrote {out}"
    )
    return card


def _perplexity(loss: float) -> float | None:
    """exp(loss), or None where it is beyond the largest float (a diverging run): math.exp raised
    OverflowError after the whole run, and a little below that printed a number hundreds of digits long."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else None


def _carded(out: Path, step: int) -> bool:
    """Whether out's card.json reports `step` steps: a run stopped after its last step has none, or
    that of an earlier, shorter run it continued."""
    try:
        return json.loads((out / "card.json").read_text(encoding="utf-8")).get("steps") == step
    except (OSError, ValueError, AttributeError):  # missing or damaged: finishing writes it anew
        return False


# Files a training run writes, or another model keeps: training into a folder holding one overwrote
# it (a Hugging Face folder with pytorch_model.bin lost its config.json and tokenizer.json to ours).
MODEL_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")


def _model_file(out: Path) -> str | None:
    """A file in out that makes it a model's folder: checkpoint.pt first (it can be resumed), then
    weights, then a config.json or tokenizer.json alone."""
    if not out.is_dir():
        return None
    held = [p.name for p in out.iterdir() if p.name.endswith(MODEL_SUFFIXES) or p.name in ("config.json", "tokenizer.json")]
    return min(held, key=lambda name: (name != CHECKPOINT, name.endswith(".json"), name), default=None)


def _resume_command(out: Path, text: tuple[Path, ...]) -> str:
    """The command that continues or finishes the run in out: --text is required, so it is named."""
    return shlex.join(["manyeyes", "train", "--text", *map(str, text), "--out", str(out), "--resume"])


def _stopped_run(folder: Path) -> dict | None:
    """folder's checkpoint, where its card.json does not report the checkpoint's step: a run stopped
    after its last step, before its card, or a continued run stopped with the shorter run's card."""
    try:
        ckpt = _read_checkpoint(folder)
    except TrainError:  # none, or not ours: the folder is judged by its other files
        return None
    return None if _carded(folder, ckpt["step"]) else ckpt


def _init_tokenizer(cfg: TrainConfig) -> Tokenizer:
    stopped = _stopped_run(cfg.init_from)
    if stopped is not None:
        raise TrainError(
            f"--init-from {cfg.init_from} holds a run that was stopped before it finished (its checkpoint.pt is at step "
            f"{stopped['step']}, which no card.json reports): finish it first with "
            f"`{_resume_command(cfg.init_from, stopped['train_config'].text)}`"
        )
    for name in ("card.json", "tokenizer.json"):
        if not (cfg.init_from / name).exists():
            raise TrainError(f"--init-from {cfg.init_from} holds no {name}: it is not a folder `manyeyes train` finished")
    # Without its weights the folder read as a Hugging Face one: "config.json has no model_type".
    if not (cfg.init_from / WEIGHTS[cfg.arch]).exists():
        other = next((arch for arch, name in WEIGHTS.items() if (cfg.init_from / name).exists()), None)
        raise TrainError(f"--init-from {cfg.init_from} holds no {WEIGHTS[cfg.arch]}, the weights of an --arch {cfg.arch} run"
                         + (f": it is an --arch {other} run" if other else ""))
    tokenizer = _read_tokenizer(cfg.init_from / "tokenizer.json", f"--init-from {cfg.init_from}")
    if tokenizer.get_vocab_size() != cfg.vocab_size:
        raise TrainError(
            f"--vocab-size {cfg.vocab_size} differs from the {tokenizer.get_vocab_size()} ids of --init-from {cfg.init_from}'s tokenizer"
        )
    return tokenizer


def _read_tokenizer(path: Path, what: str) -> Tokenizer:
    """A training folder's tokenizer, or one line naming the file (it was a Rust traceback)."""
    if not path.exists():
        raise TrainError(f"{what}: {path} is missing")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception for any bad file
        raise TrainError(f"{what}: {path} is not a tokenizer file `manyeyes train` wrote ({exc})") from exc


def _device(name: str) -> torch.device:
    if name == "auto":
        return pick_device(None)
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's message lists its every device type (meta, xla, hpu, ...)
        raise TrainError(f"--device {name!r} is no device: use auto, cpu, cuda, cuda:N or mps") from None
    available = {
        "cpu": True,
        "cuda": torch.cuda.is_available(),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
    }
    if device.type not in available:
        raise TrainError(f"--device {name} cannot train: use auto, cpu, cuda, cuda:N or mps")
    if not available[device.type]:
        raise TrainError(f"--device {name} is not available on this machine")
    return device
