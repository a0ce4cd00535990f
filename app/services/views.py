"""Saved page views: a small LRU of view states under content ids, bounded in count, bytes and age.

A permalink then holds only the id, however long the text; like the run cache it forgets, and the
page says so when a link has expired. Each client holds at most a share of the store (its own
oldest views go first beyond it), so one client's saves cannot push out everyone else's; on a
server with API keys a view's id is keyed by its saver's secret, so no other key can work out
the id of a view of a guessed text (the id alone opens it: a permalink is for sharing)."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager

import orjson

from manyeyes.app.services.errors import QueueFull, ViewTooLarge
from manyeyes.app.shared_runs import OWNER_SHARE, SharedUnreachable, hold_to_share

log = logging.getLogger("manyeyes.views")

MAX_VIEWS = 10_000
# Each view is kept as its JSON bytes, counted as such: a view may carry two texts of 200,000
# characters, and 10,000 of those would be gigabytes. SECURITY.md counts this inside its 100 MB.
MAX_VIEW_BYTES = 16 * 2**20
TTL_S = 30 * 24 * 3600


class ViewStore:
    def __init__(self, max_views: int = MAX_VIEWS, ttl_s: float = TTL_S, max_bytes: int = MAX_VIEW_BYTES,
                 clock=time.monotonic, shared=None) -> None:
        """shared: the store copies of the app share (SharedFiles between worker processes, the
        Ray actor between replicas), with put(key, bytes, owner) and read(key). It is then the
        one store views are kept in and opened from, so every copy opens the same views, and a
        copy started after a crash opens them too: each copy kept a store of its own besides,
        larger and evicting in another order, so the copy that saved a view opened it after the
        others had forgotten it, and lost it in a crash. A copy keeps views itself only while
        the shared store cannot be reached (it raises SharedUnreachable or OSError)."""
        self.max_views = max_views
        self.ttl_s = ttl_s
        # A view the shared store would not take (its share of the bytes is smaller) is refused
        # here, not handed an id that opens nowhere.
        self.max_bytes = min(max_bytes, getattr(shared, "max_bytes", max_bytes))
        self.nbytes = 0
        self.clock = clock
        self._views: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()  # id -> (saved, JSON, owner)
        self._owned: dict[str, list[int]] = {}  # owner -> [views, bytes]
        self._lock = threading.Lock()
        self.shared = shared

    def put(self, state: dict, owner: str = "", tenant: str = "") -> str:
        """The view's id; a view larger than the whole store is refused (ViewTooLarge, 413).
        owner: the client saving it, held to its share; tenant: its key's secret digest (hex), or ""."""
        # Sorted keys: the same view always gets the same id, so re-saving a view costs nothing.
        encoded = orjson.dumps(state, option=orjson.OPT_SORT_KEYS)
        if len(encoded) > self.max_bytes:
            # Reached only where MANYEYES_MAX_BODY_BYTES lets a body outgrow a worker's share of the views.
            raise ViewTooLarge(f"a view of {len(encoded):,} bytes is larger than the store's {self.max_bytes:,}: "
                               "save a view of a shorter text")
        view_id = hashlib.blake2b(encoded, digest_size=9, key=bytes.fromhex(tenant)).hexdigest()
        if self.shared is not None:
            try:
                self.shared.put(f"view-{view_id}", encoded, owner)
                return view_id
            except (SharedUnreachable, OSError) as exc:
                log.warning("view %s kept by this copy alone: the shared store failed (%s)", view_id, exc)
        with self._lock:
            self._drop(view_id)
            self._views[view_id] = (self.clock(), encoded, owner)
            self.nbytes += len(encoded)
            owned = self._owned.setdefault(owner, [0, 0])
            owned[0] += 1
            owned[1] += len(encoded)
            if owner:
                hold_to_share(self._views, lambda v: self._views[v][2], owner, view_id,
                              lambda: owned[0] > self.max_views // OWNER_SHARE or owned[1] > self.max_bytes // OWNER_SHARE,
                              self._drop)
            while len(self._views) > self.max_views or self.nbytes > self.max_bytes:
                self._drop(next(iter(self._views)))
        return view_id

    def get(self, view_id: str) -> dict | None:
        if self.shared is not None:
            try:
                return self._from_shared(view_id)
            except (SharedUnreachable, OSError) as exc:
                log.warning("view %s looked up in this copy alone: the shared store failed (%s)", view_id, exc)
        with self._lock:
            entry = self._views.get(view_id)
            if entry is not None:
                saved, encoded, _ = entry
                if self.clock() - saved > self.ttl_s:
                    self._drop(view_id)
                    return None
                self._views.move_to_end(view_id)
        return None if entry is None else orjson.loads(encoded)

    def _from_shared(self, view_id: str) -> dict | None:
        # Its age is the entry's: the 30 days hold across copies.
        found = self.shared.read(f"view-{view_id}")
        if found is None or time.time() - found[1] > self.ttl_s:
            return None
        return orjson.loads(found[0])

    def _drop(self, view_id: str) -> None:
        entry = self._views.pop(view_id, None)
        if entry is not None:
            self.nbytes -= len(entry[1])
            owned = self._owned[entry[2]]
            owned[0] -= 1
            owned[1] -= len(entry[1])
            if not owned[0]:
                del self._owned[entry[2]]

    def __len__(self) -> int:
        return len(self._views)


class SaveSlots:
    """Views being saved at once, in all and per client, refused beyond (429). Each save tokenizes
    its text (up to 100,000 characters) on a thread of the pool that static files and the sync
    routes share: 45 saves at once held it for 8 s, and the page's own scripts waited."""

    def __init__(self, total: int = 2, per_client: int = 1) -> None:
        self.total = total
        self.per_client = per_client
        self._busy: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, client: str):
        with self._lock:
            if sum(self._busy.values()) >= self.total or self._busy.get(client, 0) >= self.per_client:
                raise QueueFull(f"this server saves {self.total} views at once, {self.per_client} per client, and is "
                                "at that now: save it again in a moment", 1)
            self._busy[client] = self._busy.get(client, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._busy[client] -= 1
                if not self._busy[client]:
                    del self._busy[client]
