"""Recent runs, kept whole so any slice can be served later without a forward pass: short runs
as their (L, H, T, T) weights, long ones as the queries and keys that regenerate them (a
`KeptAttention`, issue 10). An LRU bounded in bytes, every byte a run holds counted."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from manyeyes.app.services.device import KEPT_FORMAT
from manyeyes.model.attention import Capture, bin_count
from manyeyes.model.buffers import trim_kept_mappings_soon
from manyeyes.model.runtime import MAX_TOP_K
from manyeyes.model.tokenizer import Token, TokenRows

TOKEN_BYTES = 160  # rough per-token overhead of a run's token rows (their strings included), so they count too


@dataclass(frozen=True)
class Run:
    run_id: str
    model: str
    tokens: Sequence[Token]  # kept as TokenRows, which the garbage collector does not walk
    truncated: bool
    # (n_layers, n_heads, T, T) float32 (or f16/u8 when quantised on the device), CPU; None for a
    # run that kept queries and keys instead (kept is then its KeptAttention).
    attention: torch.Tensor | None
    # Models with an LM head: the top ids and probabilities per position, (T, MAX_TOP_K) each.
    top_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    # KeptAttention (queries, keys, lse, overview) of a qk run; for a cached weights run, the
    # DenseAttention over `attention` that the tile routes read (services/tiles.py).
    kept: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, TokenRows):
            object.__setattr__(self, "tokens", TokenRows(self.tokens))

    @property
    def kind(self) -> str:
        return "weights" if self.attention is not None else "qk"

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def precision(self) -> str:
        """The most precise format this run's views can take: a GPU server keeps a u8 (f16) answer's
        run as the bytes that crossed from the device; queries and keys rebuild any format."""
        return "json" if self.attention is None else KEPT_FORMAT[self.attention.dtype]

    @property
    def nbytes(self) -> int:
        tops = sum(t.numel() * t.element_size() for t in (self.top_ids, self.top_probs) if t is not None)
        held = TOKEN_BYTES * len(self.tokens) + tops
        if self.attention is None:
            return held + self.kept.nbytes  # queries, keys, row statistics, overview
        held += self.attention.numel() * self.attention.element_size()
        # A short run's DenseAttention shares that tensor and adds its overview, once made.
        return held + self.kept.overview_nbytes


def run_bytes(info, n_tokens: int, kind: str, weight_bytes: int, qk_bytes: int) -> int:
    """The most `Run.nbytes` of a run of n_tokens will be, known before the forward pass that makes
    it: a qk run's as it is put in the cache, a weights run's once its overview is made too (on
    first use, after it was cached). weight_bytes: per weight as kept (4, or 1/2 quantised on the
    device); qk_bytes: per query/key element (the model's dtype)."""
    tops = n_tokens * MAX_TOP_K * (8 + 4) if info.predictions else 0  # int64 ids, float32 probabilities
    held = TOKEN_BYTES * n_tokens + tops
    rows = info.n_layers * info.n_heads * n_tokens
    bins = bin_count(n_tokens, Capture().overview)
    overview = info.n_layers * info.n_heads * bins * bins * 4  # max-pooled, float32
    if kind == "weights":
        return held + rows * n_tokens * weight_bytes + overview
    kv_heads = info.n_kv_heads or info.n_heads
    queries_keys = info.n_layers * (info.n_heads + kv_heads) * n_tokens * info.head_dim * qk_bytes
    return held + queries_keys + 2 * rows * 4 + overview  # row max and sum, float32


def run_id_for(model: str, text: str, text_pair: str | None, truncate: bool, tenant: str = "") -> str:
    """Everything that changes the forward pass, and nothing that only changes the view of it.
    tenant: on a server with API keys, the key's secret digest (clients.tenant_of): each key's
    runs are its own, and no other key can work out their ids from a guessed text."""
    # JSON, not a separator: any character a separator could be may also be in a client's text, and
    # ("x\x1fy", "z") must not share a run with ("x", "y\x1fz"). ASCII escapes keep lone surrogates hashable.
    fields = [model, text, text_pair, truncate] + ([tenant] if tenant else [])
    key = json.dumps(fields, ensure_ascii=True)
    return hashlib.blake2b(key.encode("ascii"), digest_size=16).hexdigest()


class RunCache:
    """Holds anything with `run_id` and `nbytes`. A run's size is recorded when it is put and
    again by refresh(): a dense run's overview is made on first use, after the run was cached."""

    def __init__(self, max_bytes: int, on_size=lambda nbytes: None) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._runs: OrderedDict[str, Run] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._on_size = on_size

    def get(self, run_id: str) -> Run | None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None:
                self._runs.move_to_end(run_id)
            return run

    def holds(self, run_id: str) -> bool:
        """Whether the run is cached, without counting as a use of it (get moves it to the newest)."""
        return run_id in self._runs

    def put(self, run: Run, replaces=lambda cached: True) -> bool:
        """False when the run is not kept: alone it is larger than the whole cache, or a run is
        cached under its id and `replaces(that run)` says no (checked under the lock, so two
        requests that raced to compute one id cannot both decide from a stale look)."""
        size = run.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            cached = self._runs.get(run.run_id)
            if cached is not None and not replaces(cached):
                self._runs.move_to_end(run.run_id)
                return False
            if self._runs.pop(run.run_id, None) is not None:
                self.nbytes -= self._sizes.pop(run.run_id)
            evicted = self._evict(self.max_bytes - size)
            self._runs[run.run_id] = run
            self._sizes[run.run_id] = size
            self.nbytes += size
            self._on_size(self.nbytes)
        if evicted:
            trim_kept_mappings_soon()  # the evicted runs' buffers, past what the buffer pool keeps
        return True

    def refresh(self, run: Run) -> None:
        """Count a cached run again after it grew; older runs make room, this one stays."""
        with self._lock:
            if self._runs.get(run.run_id) is not run:
                return  # evicted or replaced meanwhile: nothing of it is counted any more
            size = run.nbytes
            self.nbytes += size - self._sizes[run.run_id]
            self._sizes[run.run_id] = size
            self._runs.move_to_end(run.run_id)
            evicted = self._evict(self.max_bytes, keep=1)
            self._on_size(self.nbytes)
        if evicted:
            trim_kept_mappings_soon()

    def _evict(self, until: int, keep: int = 0) -> int:
        """Oldest first, until at most `until` bytes are held or only `keep` runs are left; how many went."""
        count = 0
        while len(self._runs) > keep and self.nbytes > until:
            evicted, _ = self._runs.popitem(last=False)
            self.nbytes -= self._sizes.pop(evicted)
            count += 1
        return count

    def __len__(self) -> int:
        return len(self._runs)
