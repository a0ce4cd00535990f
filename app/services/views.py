"""Saved page views: a small LRU of view states under content ids, bounded in count and age.

A permalink then holds only the id, however long the text; like the run cache it forgets, and the
page says so when a link has expired."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import orjson


class ViewStore:
    def __init__(self, max_views: int = 10_000, ttl_s: float = 30 * 24 * 3600, clock=time.monotonic) -> None:
        self.max_views = max_views
        self.ttl_s = ttl_s
        self.clock = clock
        self._views: OrderedDict[str, tuple[float, dict]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def id_for(state: dict) -> str:
        # Sorted keys: the same view always gets the same id, so re-saving a view costs nothing.
        return hashlib.blake2b(orjson.dumps(state, option=orjson.OPT_SORT_KEYS), digest_size=9).hexdigest()

    def put(self, state: dict) -> str:
        view_id = self.id_for(state)
        with self._lock:
            self._views.pop(view_id, None)
            self._views[view_id] = (self.clock(), state)
            while len(self._views) > self.max_views:
                self._views.popitem(last=False)
        return view_id

    def get(self, view_id: str) -> dict | None:
        with self._lock:
            entry = self._views.get(view_id)
            if entry is None:
                return None
            saved, state = entry
            if self.clock() - saved > self.ttl_s:
                del self._views[view_id]
                return None
            self._views.move_to_end(view_id)
            return state

    def __len__(self) -> int:
        return len(self._views)
