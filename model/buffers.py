"""Large CPU buffers that are written whole as soon as they exist, on transparent huge pages.

The first write to each 4 KiB page of a fresh mapping is a page fault. MiniLM's weights at T=512
are 75 MB, 18,432 pages: in the server, faulting them in took as long as the six softmaxes that
write them (34 ms against 16 ms on huge pages; 8.5 against 4.7 ms at T=256). A mapping of the
buffer's own, advised for huge pages, takes one fault per 2 MiB instead where the kernel allows it
(Linux with transparent huge pages set to "always" or "madvise").

That only beats `torch.empty` where its memory would be a fresh mapping too. Below glibc's mmap
threshold a freed block is reused from the heap with its pages already in, which no fresh mapping
beats; the threshold moves up to 32 MiB by default, and the server fixes it at 1 MiB to keep its
memory bounded (app/memory.py), which it reports here.
"""

from __future__ import annotations

import math
import mmap

import torch

# Below this at most one whole 2 MiB page fits, and the small pages cost little.
HUGE_PAGES_FROM_BYTES = 4 << 20
# glibc's dynamic mmap threshold at its highest on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX)
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20

_mapped_from_bytes = GLIBC_MMAP_THRESHOLD_MAX


def allocations_mapped_from(nbytes: int) -> None:
    """Tell this module that from `nbytes` on, every allocation is a fresh mapping (a fixed mmap threshold)."""
    global _mapped_from_bytes
    _mapped_from_bytes = nbytes


def empty_written_whole(shape: tuple[int, ...], device: torch.device | str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """`torch.empty(shape)` for a buffer the caller writes every element of at once.

    A large one is a private anonymous mapping of its own, unmapped when the last tensor that views
    it is freed: nothing of it outlives the data, unlike a heap block, whose pages would stay
    advised for whatever the heap put there next."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (
        torch.device(device).type != "cpu"
        or nbytes < max(HUGE_PAGES_FROM_BYTES, _mapped_from_bytes)
        or not hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):  # no such advice on this kernel, or no memory to map
        return torch.empty(shape, dtype=dtype, device=device)
    # The tensor holds the mapping open: it is closed when the tensor's storage is freed.
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` in memory of its own (`tensor.contiguous()` that always copies)."""
    return empty_written_whole(tuple(tensor.shape), tensor.device, tensor.dtype).copy_(tensor)
