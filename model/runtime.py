"""`AttentionModel`: a loaded network plus its tokenizer, answering "what does each head attend to?"."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from manyeyes.model.attention import Capture
from manyeyes.model.tokenizer import Encoded, Token


@dataclass(frozen=True)
class ModelInfo:
    id: str
    family: str  # "bert", "gpt2" (Hugging Face GPT-2) or "gpt" (a book GPTModel checkpoint)
    causal: bool
    n_layers: int
    n_heads: int
    d_model: int
    head_dim: int
    max_tokens: int  # positions the model has; longer input needs truncation
    device: str
    dtype: str  # compute dtype: "float32", or "float16" under GPU autocast


@dataclass
class AttentionResult:
    tokens: list[Token]
    truncated: bool
    attention: torch.Tensor  # (n_layers, n_heads, T, T) float32 on the CPU, post-softmax
    hidden: torch.Tensor  # (T, d_model) float32, the last hidden state
    logits: torch.Tensor | None  # (T, vocab_size) for language models
    # Per layer, each (n_heads, T, head_dim): present only when asked for with Capture(qkv=True).
    queries: list[torch.Tensor] | None = None
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None


def pick_device(preference: str | None = None) -> torch.device:
    """CUDA if available, else MPS, else CPU; an explicit preference wins."""
    if preference and preference != "auto":
        return torch.device(preference)
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class AttentionModel:
    def __init__(self, net: torch.nn.Module, tokenizer, info: ModelInfo, half: bool = False):
        self.net = net
        self.tokenizer = tokenizer
        self.info = info
        self.half = half
        # Matmuls under autocast in this dtype (float16 or bfloat16; None: none); the softmax and
        # the weights it writes stay float32 either way (see attention.py).
        self.autocast_dtype: torch.dtype | None = torch.float16 if half else None
        self.device = next(net.parameters()).device

    def encode(self, text: str, text_pair: str | None = None, truncate: bool = False) -> Encoded:
        return self.tokenizer.encode(text, text_pair, truncate)

    def attend(self, text: str, text_pair: str | None = None, truncate: bool = False, capture: Capture = Capture()):
        return self.run([self.encode(text, text_pair, truncate)], capture)[0]

    def attend_batch(self, texts: list[str], truncate: bool = False, capture: Capture = Capture()):
        return self.run([self.encode(t, None, truncate) for t in texts], capture)

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
        if not batch:
            return []
        lengths = [len(e) for e in batch]
        width = max(lengths)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        types = torch.zeros(len(batch), width, dtype=torch.long)
        real = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, enc in enumerate(batch):
            ids[row, : len(enc)] = torch.tensor(enc.ids, dtype=torch.long)
            types[row, : len(enc)] = torch.tensor(enc.type_ids, dtype=torch.long)
            real[row, : len(enc)] = True
        padded = min(lengths) != width
        capture = Capture(weights=True, qkv=capture.qkv)
        cfg = self.net.cfg
        # Every layer's softmax writes straight into this one tensor: no stack, no extra copy.
        # (n_layers, b, n_heads, width, width)
        weights = torch.empty(cfg.n_layers, len(batch), cfg.n_heads, width, width, device=self.device)
        with torch.inference_mode(), self._autocast():
            trace = self.net.inspect(
                ids.to(self.device),
                real.to(self.device) if padded else None,
                capture,
                token_type_ids=types.to(self.device),
                weights_out=weights,
            )
            # (n_layers, b, n_heads, width, width) -> (b, n_layers, n_heads, width, width)
            attention = (to_host or torch.Tensor.cpu)(weights).transpose(0, 1)
            hidden = trace.hidden.float().cpu()
            logits = trace.logits.float().cpu() if trace.logits is not None else None

        results = []
        for row, (enc, n) in enumerate(zip(batch, lengths)):
            result = AttentionResult(
                tokens=enc.tokens,
                truncated=enc.truncated,
                # Each item owns exactly its own storage (a copy unless b == 1), so whoever keeps
                # a result (the service's run cache) never keeps the rest of the batch alive.
                attention=attention[row, :, :, :n, :n].contiguous(),
                hidden=hidden[row, :n],
                logits=logits[row, :n] if logits is not None else None,
            )
            if capture.qkv:
                # each layer: (b, n_heads, width, head_dim) -> (n_heads, n, head_dim)
                result.queries = [layer.queries[row, :, :n].float().cpu() for layer in trace.layers]
                result.keys = [layer.keys[row, :, :n].float().cpu() for layer in trace.layers]
                result.values = [layer.values[row, :, :n].float().cpu() for layer in trace.layers]
            results.append(result)
        return results
