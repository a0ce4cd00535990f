"""`AttentionModel`: a loaded network plus its tokenizer, answering "what does each head attend to?"."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from manyeyes.model.attention import Capture, layer_windows
from manyeyes.model.buffers import empty_written_whole, own_copy
from manyeyes.model.errors import ModelLoadError
from manyeyes.model.kept import KeptAttention, kept_from_layers
from manyeyes.indices import whole_number
from manyeyes.model.tokenizer import Encoded, Token, brief_tokens


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is (`AttentionModel.info`): its name, architecture and sizes, how many
    positions it takes and where and in what dtype it runs. The server's model list reports these."""

    id: str
    family: str  # a Hugging Face model_type ("bert", "gpt2", "llama", ...) or "gpt" (a book checkpoint)
    causal: bool
    n_layers: int
    n_heads: int  # query heads; attention is returned per query head
    d_model: int
    head_dim: int
    max_tokens: int  # positions the model has; longer input needs truncation
    device: str
    dtype: str  # weights' dtype ("float32", "bfloat16", "float16"), or "float16" under GPU autocast
    n_kv_heads: int | None = None  # key/value heads (fewer than n_heads under grouped-query attention)
    predictions: bool = False  # has a language-model head: next-token (causal) or masked-token top-k
    # Per layer: each query sees only its last W positions, itself included (None: no window).
    sliding_windows: tuple[int | None, ...] = ()
    # A causal model's end-of-text ids: generation stops once it picks one (`loading.end_of_text_ids`).
    eos_ids: frozenset[int] = frozenset()


MAX_TOP_K = 20  # predictions kept per position; a request asks for at most this many


@dataclass(frozen=True)
class Prediction:
    """One of a model's most likely tokens at a position (`AttentionModel.predict` / `predictions`)."""

    token: str  # how the id reads on its own, e.g. " the"
    id: int
    prob: float  # softmax over the whole vocabulary, float32
    # The id's vocabulary piece, as an encoded token of that id has it ("Ġthe"; "å" for the byte
    # 0xE5): byte-level pieces of part of a character all read token "\ufffd", their pieces differ.
    piece: str = ""

    def __repr__(self) -> str:
        # The piece only where the text cannot tell the id: the reprs of whole tokens stay as they were.
        piece = f", piece={self.piece!r}" if "\ufffd" in self.token else ""
        return f"Prediction(token={self.token!r}, id={self.id!r}, prob={self.prob!r}{piece})"


@dataclass(eq=False)  # tensors have no truth value: == compared them and raised
class AttentionResult:
    """One input's run (`AttentionModel.attend`, `attend_batch`, `run`): its tokens and what the
    forward captured. T is the number of tokens; `truncated` says the input was cut to fit.

    Which parts are present depends on the `Capture` it ran with and the model: `attention` is
    None under Capture(keep=True), which fills `kept` instead; `logits`, `top_ids` and `top_probs`
    only for a model with a language-model head; queries, keys and values only with
    Capture(qkv=True). Its repr is one line: the token count, a few tokens, the attention's shape."""

    tokens: list[Token]
    truncated: bool
    attention: torch.Tensor | None  # (n_layers, n_heads, T, T) float32 on the CPU, post-softmax; None when kept
    hidden: torch.Tensor | None  # (T, d_model) float32, the last hidden state; None under Capture(hidden=False)
    logits: torch.Tensor | None  # (T, vocab_size) for language models; None under Capture(logits=False)
    # The MAX_TOP_K most likely ids per position and their probabilities, for models with a head.
    top_ids: torch.Tensor | None = None  # (T, MAX_TOP_K) int64
    top_probs: torch.Tensor | None = None  # (T, MAX_TOP_K) float32
    # Per layer, present only when asked for with Capture(qkv=True): queries (n_heads, T, head_dim),
    # keys and values (n_kv_heads, T, head_dim), one per key/value head under grouped-query attention.
    queries: list[torch.Tensor] | None = None
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    # Capture(keep=True): the queries and keys that regenerate every weight, on the model's device.
    kept: KeptAttention | None = None

    def __repr__(self) -> str:
        # One line: the generated repr printed every Token and whole tensors (16 KB for 16 tokens).
        if self.attention is not None:
            attention = f"attention {tuple(self.attention.shape)} {str(self.attention.dtype).removeprefix('torch.')}"
        else:
            attention = "attention kept" if self.kept is not None else "no attention"
        parts = [name for name, value in (("hidden", self.hidden), ("logits", self.logits), ("top-k", self.top_ids),
                                          ("queries/keys/values", self.queries)) if value is not None]
        with_parts = f", with {', '.join(parts)}" if parts else ""
        return (f"AttentionResult({brief_tokens(self.tokens)}, {attention}, "
                f"truncated={self.truncated}{with_parts})")


@dataclass(eq=False)  # tensors have no truth value: == compared them and raised
class BatchOutput:
    """One padded batch's outputs, on the CPU: row i's are [i, ..., :n_i] (its own tokens)."""

    attention: torch.Tensor  # (b, n_layers, n_heads, width, width), as to_host made it
    hidden: torch.Tensor | None  # (b, width, d_model) float32
    logits: torch.Tensor | None  # (b, width, vocab_size) float32
    top_ids: torch.Tensor | None  # (b, width, MAX_TOP_K) int64
    top_probs: torch.Tensor | None  # (b, width, MAX_TOP_K) float32
    layers: list  # each layer's captured queries, keys and values, on the device (Capture(qkv=True))


def pick_device(preference: str | None = None) -> torch.device:
    """CUDA if available, else MPS, else CPU; an explicit preference wins, if this machine has it
    (else ModelLoadError, a message naming what was asked)."""
    if preference and preference != "auto":
        try:
            device = torch.device(preference)
        except RuntimeError:
            device = None
        # torch also names meta, xpu, hpu...: none runs these models here, so each is refused alike.
        if device is None or device.type not in ("cpu", "cuda", "mps"):
            raise ModelLoadError(f"unknown device {preference!r}: use cpu, cuda, cuda:N, mps or auto") from None
        if device.type in ("cuda", "mps") and not _has(device.type):
            raise ModelLoadError(f"device {preference!r} was asked for, but this machine's torch has none: "
                                 "use cpu or auto")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {preference!r} was asked for, but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
        return device
    if _has("cuda"):
        return torch.device("cuda")
    if _has("mps"):
        return torch.device("mps")
    return torch.device("cpu")


def _has(accelerator: str) -> bool:
    if accelerator == "cuda":
        return torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def padded_inputs(batch: list[Encoded], lengths: list[int], width: int) -> torch.Tensor:
    """(3, b, width) int64: each input's token ids, segment ids and 1 for each real token, right-padded with 0.

    Filled on the host in numpy: per-row torch copies were six torch calls an input (a batch of 64
    at T=16 spent 1.1-1.5 ms here, against 0.25-0.45 ms), and off the CPU the host's time is what
    bounds a forward of small inputs."""
    table = np.zeros((3, len(batch), width), dtype=np.int64)
    for row, (enc, n) in enumerate(zip(batch, lengths)):
        table[0, row, :n] = enc.ids
        table[1, row, :n] = enc.type_ids
        table[2, row, :n] = 1
    return torch.from_numpy(table)


class AttentionModel:
    """A network and its tokenizer, ready for inference: `manyeyes.load(...)` returns one.

    `attend(text)` runs one input and returns an AttentionResult (the weights of every layer and
    head, (n_layers, n_heads, T, T)); `attend_batch(texts)` runs several in one forward; `encode`
    and `run` split the two steps; `predict` / `predictions` read the top next (or masked) tokens.
    `info` (a ModelInfo) describes the model, `device` is where it runs, `net` and `tokenizer` are
    the torch module and tokenizer underneath."""

    def __init__(self, net: torch.nn.Module, tokenizer, info: ModelInfo, half: bool = False):
        self.net = net
        self.tokenizer = tokenizer
        # A ModelInfo built by hand may not name the windows; the net's attention modules know them,
        # and everything that reads the info (kept runs, GET /models, exports) needs them.
        self.info = info if info.sliding_windows else replace(info, sliding_windows=layer_windows(net))
        self.half = half
        # Matmuls under autocast in this dtype (float16 or bfloat16; None: none); the softmax and
        # the weights it writes stay float32 either way (see attention.py).
        self.autocast_dtype: torch.dtype | None = torch.float16 if half else None
        self.device = next(net.parameters()).device

    def __repr__(self) -> str:
        info = self.info
        return f"<AttentionModel {info.id!r}: {info.family}, {info.n_layers} layers × {info.n_heads} heads, {self.device}>"

    def encode(self, text: str, text_pair: str | None = None, truncate: bool = False) -> Encoded:
        """The model's tokens for `text` (and `text_pair`, a second segment), special tokens
        included, as an `Encoded` for `run`, `experiments.ablate` or `change_token`.

        truncate: cut an input longer than `info.max_tokens` to fit (Encoded.truncated says so);
        without it such an input is a TooLongError (a ValueError). TypeError for a text (or a
        text_pair other than None) that is not a str."""
        # The tokenizers' own errors for a non-string say nothing a caller can act on.
        for name, value in (("text", text), ("text_pair", text_pair)):
            if not isinstance(value, str) and not (name == "text_pair" and value is None):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        return self.tokenizer.encode(text, text_pair, truncate)

    def attend(self, text: str, text_pair: str | None = None, truncate: bool = False, capture: Capture = Capture()):
        """Run one text (and `text_pair`, a second segment) and return an AttentionResult:
        attention (n_layers, n_heads, T, T), float32 on the CPU, each row a query's weights over
        the keys (rows sum to 1); hidden (T, d_model); for a model with a language-model head,
        logits and the top-k ids and probabilities. `capture` chooses what else comes back (see
        `Capture`: qkv, hidden, logits, keep for long inputs).

        Errors as `encode`: TypeError for a non-str text, TooLongError past `info.max_tokens`
        unless truncate=True."""
        return self.run([self.encode(text, text_pair, truncate)], capture)[0]

    def attend_batch(self, texts: list[str], truncate: bool = False, capture: Capture = Capture()):
        """Several texts in one padded, masked forward: a list of AttentionResults in their order,
        each as `attend` would give it (its own T, its own storage; equal to a lone run up to
        float rounding). Under Capture(keep=True) each text runs alone.

        TypeError for a single str (use `attend`) or an item that is not a str; TooLongError for
        any text past `info.max_tokens` unless truncate=True."""
        if isinstance(texts, str):  # else each character would run as its own text
            raise TypeError("texts must be a list of str; for one text call attend")
        return self.run([self.encode(t, None, truncate) for t in texts], capture)

    def predict(self, text: str, top_k: int = 5, text_pair: str | None = None, truncate: bool = False):
        """{position: [Prediction, ...]} best first: the next token after every position for a
        causal LM, the masked token at each [MASK] / <mask> for a masked LM."""
        # Read before the forward: predict("a", "b") (attend's text_pair in second place) failed
        # after it with "'<=' not supported between 'int' and 'str'".
        whole_number(top_k, "top_k (predict's second argument; text_pair is a keyword)")
        if not self.info.predictions:
            raise ValueError(f"model {self.info.id} has no language-model head, so it makes no predictions")
        return self.predictions(self.attend(text, text_pair, truncate), top_k)

    def predictions(self, result: AttentionResult, top_k: int = 5) -> dict[int, list[Prediction]]:
        """`predict` for a run already made: {position: [Prediction, ...]}, best first, `top_k` each.
        Every position of a causal LM (the token after it); each [MASK] / <mask> of a masked LM.

        ValueError for a model with no language-model head (MiniLM), a result with no top-k
        (top_ids None), or a top_k outside 1..MAX_TOP_K (20; fewer for a smaller vocabulary)."""
        return self.predictions_from(result.tokens, result.top_ids, result.top_probs, top_k)

    def predictions_from(self, tokens: list[Token], top_ids, top_probs, top_k: int) -> dict[int, list[Prediction]]:
        """The same from a run's kept top-k tensors (the service caches those, not the logits)."""
        top_k = whole_number(top_k, "top_k")
        if not self.info.predictions:
            raise ValueError(f"model {self.info.id} has no language-model head, so it makes no predictions")
        if top_ids is None:
            raise ValueError("this result holds no predictions (top_ids is None): it was run by a model without a "
                             f"language-model head, or kept without them; run the text with {self.info.id}'s attend")
        if not 1 <= top_k <= top_ids.shape[1]:
            raise ValueError(f"top_k must be in 1..{top_ids.shape[1]}, got {top_k}")
        if self.info.causal:
            positions = list(range(len(tokens)))
        else:
            mask_id = self.tokenizer.mask_id
            positions = [i for i, t in enumerate(tokens) if mask_id is not None and t.id == mask_id]
        ids, probs = top_ids[positions, :top_k].tolist(), top_probs[positions, :top_k].tolist()
        text, piece = self.tokenizer.token_text, self.tokenizer.token_piece
        return {i: [Prediction(text(t), t, p, piece(t)) for t, p in zip(row_ids, row_probs)]
                for i, row_ids, row_probs in zip(positions, ids, probs)}

    def _autocast(self):
        if self.autocast_dtype is not None:
            # Weights stay float32; matmuls run in half precision and the softmax is upcast in attention.
            return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)
        return contextlib.nullcontext()

    def run(
        self, batch: list[Encoded], capture: Capture = Capture(), to_host: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> list[AttentionResult]:
        """One forward pass over already-encoded inputs, right-padded and masked as one batch.

        to_host: how the (n_layers, b, n_heads, width, width) weights leave the device (default
        `.cpu()`); the server passes one that quantises on the device and copies through pinned
        memory, so the attention may then come back as uint8 or float16."""
        if not isinstance(capture, Capture):
            raise TypeError(f"capture must be a Capture (manyeyes.model.Capture(qkv=True), ...), got {capture!r}")
        if isinstance(batch, (str, Encoded)) or not all(isinstance(e, Encoded) for e in batch):
            raise TypeError("run takes a list of what encode returns: run([model.encode(text)]); for texts, use "
                            "attend or attend_batch")
        if not batch:
            return []
        if capture.keep:
            return [self._run_kept(encoded, capture) for encoded in batch]
        lengths = [len(e) for e in batch]
        # (3, b, width): token ids, segment ids, real tokens
        out = self.forward_table(padded_inputs(batch, lengths, max(lengths)), lengths, capture, to_host)
        attention, hidden, logits, top_ids, top_probs = out.attention, out.hidden, out.logits, out.top_ids, out.top_probs

        # Each item owns exactly its own storage (a copy unless b == 1), so whoever keeps a result
        # (the service's run cache, a pickle) never keeps the rest of the batch alive: a row's
        # hidden and logits views held the whole batch's (346 MB pickled for 50 tiny-gpt texts).
        def own(tensor: torch.Tensor) -> torch.Tensor:
            return own_copy(tensor) if len(batch) > 1 else tensor.contiguous()

        results = []
        for row, (enc, n) in enumerate(zip(batch, lengths)):
            result = AttentionResult(
                tokens=enc.tokens,
                truncated=enc.truncated,
                attention=own(attention[row, :, :, :n, :n]),
                hidden=own(hidden[row, :n]) if hidden is not None else None,
                logits=own(logits[row, :n]) if logits is not None else None,
                top_ids=top_ids[row, :n].clone() if top_ids is not None else None,
                top_probs=top_probs[row, :n].clone() if top_probs is not None else None,
            )
            if capture.qkv:
                # each layer: (b, heads, width, head_dim) -> (heads, n, head_dim); kv heads for keys/values
                result.queries = [own(layer.queries[row, :, :n].float().cpu()) for layer in out.layers]
                result.keys = [own(layer.keys[row, :, :n].float().cpu()) for layer in out.layers]
                result.values = [own(layer.values[row, :, :n].float().cpu()) for layer in out.layers]
            results.append(result)
        return results

    def forward_table(
        self, table: torch.Tensor, lengths: list[int], capture: Capture = Capture(),
        to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> BatchOutput:
        """The forward pass of `run` over a padded (3, b, width) table (padded_inputs): the whole
        batch's outputs, not yet cut into its rows. A shared forward process (app/services/
        shared_forward.py) runs several workers' tables as one through this."""
        width = table.shape[2]
        padded = min(lengths) != width
        inputs = table.to(self.device)  # one copy to the device for all three
        ids, types, real = inputs[0], inputs[1], inputs[2].bool() if padded else None
        keep_hidden, keep_logits = capture.hidden, capture.logits
        # A model with a language-model head needs the hidden state for its predictions.
        capture = Capture(weights=True, qkv=capture.qkv, hidden=capture.hidden or self.info.predictions)
        # Every layer's softmax writes straight into this one tensor: no stack, no extra copy.
        # (n_layers, b, n_heads, width, width)
        # Read through the network's ShapeInfo: families name their config fields differently.
        weights = empty_written_whole((self.net.n_layers, len(lengths), self.net.n_heads, width, width), self.device)
        with torch.inference_mode(), self._autocast():
            trace = self.net.inspect(ids, real, capture, token_type_ids=types, weights_out=weights)
            # (n_layers, b, n_heads, width, width) -> (b, n_layers, n_heads, width, width)
            attention = (to_host or torch.Tensor.cpu)(weights).transpose(0, 1)
            # A head's model runs to the hidden state for its top-k, but copies it to the host only
            # when asked for: the server's WEIGHTS_ONLY forwards dropped it there every batch.
            hidden = trace.hidden.float().cpu() if trace.hidden is not None and keep_hidden else None
            logits = top_ids = top_probs = None
            if trace.logits is not None:
                logits = trace.logits.float()
                # Top-k on the device, and only (b, T, k) crosses to the CPU. p = exp(logit - logsumexp)
                # for the k kept ids: two reads of the logits, no softmaxed (b, T, vocab) copy.
                top = logits.topk(min(MAX_TOP_K, logits.shape[-1]), dim=-1)
                top_probs = (top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().cpu()
                top_ids = top.indices.cpu()
                # Copied to the host only when asked for: the server's answers keep the top-k alone,
                # and GPT-2's (8, 512, 50257) logits are 823 MB to move and free each batch.
                logits = logits.cpu() if keep_logits else None
        return BatchOutput(attention, hidden, logits, top_ids, top_probs, trace.layers)

    def _run_kept(self, encoded: Encoded, capture: Capture) -> AttentionResult:
        """One input through the row-block softmax: no layer ever holds its (heads, T, T) weights.

        One input per forward: long inputs gain nothing from batching (the forward is compute-bound)
        and unpadded rows keep the overview's bins and the causal masks simple."""
        ids = torch.tensor([encoded.ids], dtype=torch.long, device=self.device)
        types = torch.tensor([encoded.type_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode(), self._autocast():
            # The hidden state even when not asked for: the top predictions are read from it.
            trace = self.net.inspect(ids, None, replace(capture, logits=False, hidden=True), token_type_ids=types)
            kept = kept_from_layers(trace.layers, len(encoded), self.info.causal, self.sliding_windows, capture,
                                    self.autocast_dtype)
            top_ids = top_probs = None
            if self.info.predictions and self.net.lm_head is not None:
                top_ids, top_probs = self._top_predictions(trace.hidden[0])
        # No logits: (T, vocab_size) float32 is 1.6 GB for a 49k vocabulary at T = 8,192.
        return AttentionResult(
            tokens=encoded.tokens, truncated=encoded.truncated, attention=None,
            hidden=trace.hidden[0].float().cpu() if capture.hidden else None,
            logits=None, top_ids=top_ids, top_probs=top_probs, kept=kept,
            queries=[layer.queries[0].float().cpu() for layer in trace.layers] if capture.qkv else None,
            keys=[layer.keys[0].float().cpu() for layer in trace.layers] if capture.qkv else None,
            values=[layer.values[0].float().cpu() for layer in trace.layers] if capture.qkv else None,
        )

    def _top_predictions(self, hidden: torch.Tensor, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, MAX_TOP_K) ids and probabilities from the hidden state, `rows` positions of logits at a time."""
        if not len(hidden):  # a run of no tokens: torch.cat of no rows raised
            return torch.empty(0, MAX_TOP_K, dtype=torch.long), torch.empty(0, MAX_TOP_K)
        ids, probs = [], []
        for r0 in range(0, hidden.shape[0], rows):
            logits = self.net.lm_head(hidden[r0 : r0 + rows]).float()  # (rows, vocab_size)
            top = logits.topk(min(MAX_TOP_K, logits.shape[-1]), dim=-1)
            probs.append((top.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().cpu())
            ids.append(top.indices.cpu())
        return torch.cat(ids), torch.cat(probs)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: none), in layer order."""
        return self.info.sliding_windows
