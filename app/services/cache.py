"""Recent runs, kept whole (float32, all layers and heads) so any slice can be served later
without a forward pass. An LRU bounded in bytes."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from manyeyes.model.tokenizer import Token

TOKEN_BYTES = 160  # rough per-token overhead of the Token objects, so token lists count too


@dataclass(frozen=True)
class Run:
    run_id: str
    model: str
    tokens: list[Token]
    truncated: bool
    attention: torch.Tensor  # (n_layers, n_heads, T, T) float32, CPU
    # Models with an LM head: the top ids and probabilities per position, (T, MAX_TOP_K) each.
    top_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tops = sum(t.numel() * t.element_size() for t in (self.top_ids, self.top_probs) if t is not None)
        return self.attention.numel() * self.attention.element_size() + TOKEN_BYTES * len(self.tokens) + tops


def run_id_for(model: str, text: str, text_pair: str | None, truncate: bool) -> str:
    """Everything that changes the forward pass, and nothing that only changes the view of it."""
    key = "\x1f".join((model, text, "\x00" if text_pair is None else text_pair, "1" if truncate else "0"))
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()


class RunCache:
    def __init__(self, max_bytes: int, on_size=lambda nbytes: None) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._runs: OrderedDict[str, Run] = OrderedDict()
        self._lock = threading.Lock()
        self._on_size = on_size

    def get(self, run_id: str) -> Run | None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None:
                self._runs.move_to_end(run_id)
            return run

    def put(self, run: Run) -> bool:
        """False when the run alone is larger than the whole cache (it is then not kept)."""
        size = run.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._runs.pop(run.run_id, None)
            if old is not None:
                self.nbytes -= old.nbytes
            while self._runs and self.nbytes + size > self.max_bytes:
                _, evicted = self._runs.popitem(last=False)
                self.nbytes -= evicted.nbytes
            self._runs[run.run_id] = run
            self.nbytes += size
            self._on_size(self.nbytes)
        return True

    def __len__(self) -> int:
        return len(self._runs)
