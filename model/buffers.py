"""Large CPU buffers that are written whole as soon as they exist, on transparent huge pages.

The first write to each 4 KiB page of a fresh mapping is a page fault. MiniLM's weights at T=512
are 75 MB, 18,432 pages: in the server, faulting them in took as long as the six softmaxes that
write them (34 ms against 16 ms on huge pages; 8.5 against 4.7 ms at T=256). A mapping of the
buffer's own, advised for huge pages, takes one fault per 2 MiB instead where the kernel allows it
(Linux with transparent huge pages set to "always" or "madvise"), when `advise_huge_pages(True)`
was called. That is off by default: where a virtual machine's host takes freed memory back, huge
pages were the slower ones. After such a pause 18 MiB took 28 ms to fault in on huge pages against
6 ms on small ones, and the server's forward at T=256 (19 MB of weights) 53-69 ms against 29-37
ms (twentieth session; the nineteenth's host had them 2x faster at T=512).

That only beats `torch.empty` where its memory would be a fresh mapping too. Below glibc's mmap
threshold a freed block is reused from the heap with its pages already in, which no fresh mapping
beats; the threshold moves up to 32 MiB by default, and the server fixes it at 1 MiB to keep its
memory bounded (app/memory.py), which it reports here.

A fresh mapping still pays for its pages, and on a virtual machine a page the host has taken back
costs far more than a fault: 4.5 MiB written into a new mapping took 0.8 to 7.6 ms (1.2 ms on
small pages), into memory written before 0.03 ms. So the server also keeps the mappings of
finished buffers, up to `keep_free_mappings(limit)` bytes of them, and writes the next buffer of a
size they fit (at most 1/16 larger) into one: the last request's weights and answer are the next
one's. A kept mapping's pages beyond the new buffer are given back, so it holds no more than a
fresh one would.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading

import torch

# Below this at most one whole 2 MiB page fits, and the small pages cost little.
HUGE_PAGES_FROM_BYTES = 4 << 20
# glibc's dynamic mmap threshold at its highest on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX)
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20

# A kept mapping serves buffers from 16/17 of its size up to its size.
REUSE_SLACK = 1 / 16

_mapped_from_bytes = GLIBC_MMAP_THRESHOLD_MAX
_huge_pages = False


def advise_huge_pages(enabled: bool) -> None:
    """Advise fresh buffers from HUGE_PAGES_FROM_BYTES for transparent huge pages (off by default)."""
    global _huge_pages
    _huge_pages = enabled


def allocations_mapped_from(nbytes: int) -> None:
    """Tell this module that from `nbytes` on, every allocation is a fresh mapping (a fixed mmap threshold)."""
    global _mapped_from_bytes
    _mapped_from_bytes = nbytes


class MappingPool:
    """Every mapping this module has handed out while keeping is on, in use or finished.

    A mapping is finished when nothing views it any more: no tensor, array or memoryview holds an
    export of it, so its reference count is back to this pool's own. That is read under the GIL,
    and a mapping is only ever handed out again under the pool's lock, already wrapped in its
    new tensor."""

    def __init__(self) -> None:
        self.limit_bytes = 0
        self._lock = threading.Lock()
        self._mappings: list[mmap.mmap] = []  # oldest first
        # A finished mapping's count, read the way _finished reads it: the list's reference, the
        # comprehension's and getrefcount's own.
        self._base_refs = self._counts([mmap.mmap(-1, mmap.PAGESIZE)])[0]

    @staticmethod
    def _counts(mappings: list[mmap.mmap]) -> list[int]:
        return [sys.getrefcount(m) for m in mappings]

    def _finished(self) -> list[mmap.mmap]:
        """The mappings nothing views any more, oldest first."""
        return [m for m, count in zip(self._mappings, self._counts(self._mappings)) if count <= self._base_refs]

    def tensor(self, nbytes: int, dtype: torch.dtype, huge: bool) -> torch.Tensor | None:
        """A flat tensor of nbytes in a kept mapping or a new one (None: no memory to map).
        Finished mappings beyond the limit are let go of first, so that at each new buffer at most
        the limit is kept."""
        dropped: list[mmap.mmap] = []
        with self._lock:
            finished = self._finished()
            fits = [m for m in finished if nbytes <= len(m) <= nbytes * (1 + REUSE_SLACK)]
            if fits:
                mapping = min(fits, key=len)
                self._mappings.remove(mapping)
                tail = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
                if tail < len(mapping):  # what a larger buffer wrote there goes back, as it would in a fresh one
                    mapping.madvise(mmap.MADV_DONTNEED, tail, len(mapping) - tail)
            else:
                dropped = self._drop_beyond_limit(finished)
                mapping = new_mapping(nbytes, huge)
            if mapping is not None and self.limit_bytes > 0:
                self._mappings.append(mapping)  # the most recently used last
            out = None if mapping is None else torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize)
        unmap(dropped)
        return out

    def _drop_beyond_limit(self, finished: list[mmap.mmap] | None = None) -> list[mmap.mmap]:
        """Take the oldest finished mappings out of the pool until at most the limit of them is
        kept; the caller unmaps them once it has let go of the lock (0.12 ms per MB here)."""
        finished = self._finished() if finished is None else finished
        kept = sum(len(m) for m in finished)
        dropped = []
        for mapping in finished:  # oldest first
            if kept <= self.limit_bytes:
                break
            kept -= len(mapping)
            self._mappings.remove(mapping)
            dropped.append(mapping)
        return dropped

    def keep(self, limit_bytes: int) -> None:
        with self._lock:
            self.limit_bytes = limit_bytes
            dropped = self._drop_beyond_limit()
            if limit_bytes <= 0:  # those still in use are unmapped when their tensors go, as before
                self._mappings.clear()
        unmap(dropped)

    def trim(self) -> None:
        with self._lock:
            dropped = self._drop_beyond_limit()
        unmap(dropped)

    def kept_bytes(self) -> int:
        """Bytes of finished mappings held for reuse."""
        with self._lock:
            return sum(len(m) for m in self._finished())


def new_mapping(nbytes: int, huge: bool) -> mmap.mmap | None:
    """A private anonymous mapping (None: no such advice on this kernel, or no memory to map)."""
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    return mapping


def unmap(mappings: list[mmap.mmap]) -> None:
    for mapping in mappings:
        mapping.close()  # munmap, with the GIL let go


class Trimmer:
    """Runs `trim` on a thread of its own when asked. munmap takes about 0.12 ms per MB here: a
    75 MB run evicted from the run cache kept the request that evicted it waiting 9 ms."""

    def __init__(self, trim) -> None:
        self.trim = trim
        self._wanted = threading.Event()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        # A forked child has none of its parent's threads: it starts its own when first asked.
        os.register_at_fork(after_in_child=self._forget_thread)

    def _forget_thread(self) -> None:
        self._thread = None
        self._start = threading.Lock()
        self._wanted = threading.Event()

    def request(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="manyeyes-unmap", daemon=True)
                self._thread.start()
        self._wanted.set()

    def _serve(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            self.trim()


_pool = MappingPool()


def trim_kept_mappings() -> None:
    """Unmap finished mappings beyond the limit now (say, after a cache let go of runs), rather
    than at the next large buffer."""
    if _pool.limit_bytes > 0:
        _pool.trim()


def trim_kept_mappings_soon() -> None:
    """The same on the pool's own thread, so that the caller (a request) does not wait for it."""
    if _pool.limit_bytes > 0:
        _trimmer.request()


_trimmer = Trimmer(trim_kept_mappings)


def keep_free_mappings(limit_bytes: int) -> None:
    """Keep up to limit_bytes of finished buffers' mappings for the next buffers (0: unmap them at once)."""
    _pool.keep(limit_bytes)


def empty_written_whole(shape: tuple[int, ...], device: torch.device | str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """`torch.empty(shape)` for a buffer the caller writes every element of at once.

    From the mmap threshold, with the pool on or huge pages advised, it is a private anonymous
    mapping of its own: a kept one it fits, or a new one. It is unmapped when the last tensor that
    views it is freed, unless the pool keeps it for the next buffer; a heap block's pages would
    instead stay advised for whatever the heap put there next. Zero bytes cannot be mapped."""
    nbytes = math.prod(shape) * dtype.itemsize
    # Only where torch.empty would be a fresh mapping too (from the mmap threshold): a kept one to
    # write again, or one advised for huge pages.
    huge = _huge_pages and nbytes >= HUGE_PAGES_FROM_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
    pooled = _pool.limit_bytes > 0 and hasattr(mmap, "MADV_DONTNEED")
    if torch.device(device).type != "cpu" or nbytes == 0 or nbytes < _mapped_from_bytes or not (huge or pooled):
        return torch.empty(shape, dtype=dtype, device=device)
    # The tensor holds the mapping open: unmapped when its storage is freed, unless the pool keeps it.
    flat = _pool.tensor(nbytes, dtype, huge)
    return torch.empty(shape, dtype=dtype, device=device) if flat is None else flat.view(shape)


def own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` in memory of its own (`tensor.contiguous()` that always copies)."""
    return empty_written_whole(tuple(tensor.shape), tensor.device, tensor.dtype).copy_(tensor)
