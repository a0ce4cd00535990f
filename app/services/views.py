"""Saved page views: a small LRU of view states under content ids, bounded in count, bytes and age.

A permalink then holds only the id, however long the text; like the run cache it forgets, and the
page says so when a link has expired."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import orjson

MAX_VIEWS = 10_000
# Each view is kept as its JSON bytes, counted as such: a view may carry two texts of 200,000
# characters, and 10,000 of those would be gigabytes. SECURITY.md counts this inside its 100 MB.
MAX_VIEW_BYTES = 16 * 2**20
TTL_S = 30 * 24 * 3600


class ViewStore:
    def __init__(self, max_views: int = MAX_VIEWS, ttl_s: float = TTL_S, max_bytes: int = MAX_VIEW_BYTES,
                 clock=time.monotonic, shared=None) -> None:
        """shared: a SharedFiles (app/shared_runs.py) that worker processes share, so a link saved
        through one worker opens through any other."""
        self.max_views = max_views
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.clock = clock
        self._views: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.shared = shared

    def put(self, state: dict) -> str:
        """The view's id; a view larger than the whole store is refused (ValueError)."""
        # Sorted keys: the same view always gets the same id, so re-saving a view costs nothing.
        encoded = orjson.dumps(state, option=orjson.OPT_SORT_KEYS)
        if len(encoded) > self.max_bytes:
            raise ValueError(f"a view of {len(encoded):,} bytes is larger than the store's {self.max_bytes:,}")
        view_id = hashlib.blake2b(encoded, digest_size=9).hexdigest()
        with self._lock:
            self._drop(view_id)
            self._views[view_id] = (self.clock(), encoded)
            self.nbytes += len(encoded)
            while len(self._views) > self.max_views or self.nbytes > self.max_bytes:
                self._drop(next(iter(self._views)))
        if self.shared is not None:
            self.shared.put(f"view-{view_id}", encoded)
        return view_id

    def get(self, view_id: str) -> dict | None:
        with self._lock:
            entry = self._views.get(view_id)
            if entry is not None:
                saved, encoded = entry
                if self.clock() - saved > self.ttl_s:
                    self._drop(view_id)
                    return None
                self._views.move_to_end(view_id)
        if entry is None:
            return self._from_shared(view_id)  # outside the lock: it reads a file
        return orjson.loads(encoded)

    def _from_shared(self, view_id: str) -> dict | None:
        # Saved through another worker. Its age is the file's: the 30 days hold across workers.
        found = self.shared.read(f"view-{view_id}") if self.shared is not None else None
        if found is None or time.time() - found[1] > self.ttl_s:
            return None
        return orjson.loads(found[0])

    def _drop(self, view_id: str) -> None:
        entry = self._views.pop(view_id, None)
        if entry is not None:
            self.nbytes -= len(entry[1])

    def __len__(self) -> int:
        return len(self._views)
