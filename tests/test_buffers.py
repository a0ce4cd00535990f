"""Large buffers written whole (model/buffers.py): their own mapping, advised for huge pages,
alive exactly as long as a tensor views them."""

import gc
import sys

import pytest
import torch

from manyeyes.model import buffers
from manyeyes.model.buffers import GLIBC_MMAP_THRESHOLD_MAX, HUGE_PAGES_FROM_BYTES, empty_written_whole

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@pytest.fixture
def server_allocator(monkeypatch):
    """What the server's start-up reports (app/memory.py): every block from 1 MiB is a fresh mapping."""
    monkeypatch.setattr(buffers, "_mapped_from_bytes", 1 << 20)


def mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry whose range holds `address`: its range and fields, VmFlags split."""
    entry = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:  # a range line starts the next entry
                if entry is not None:
                    break
                start, end = (int(part, 16) for part in first.split("-"))
                if start <= address < end:
                    entry = {"start": start, "end": end}
            elif entry is not None:
                name, _, value = line.partition(":")
                entry[name] = value.split() if name == "VmFlags" else value.strip()
    return entry


def test_a_large_buffer_is_its_own_advised_mapping_and_outlives_its_base_while_a_view_reads_it(server_allocator):
    shape = (6, 1, 12, 256, 256)  # MiniLM's weights at T=256: 18.9 MB
    weights = empty_written_whole(shape)
    assert weights.shape == shape and weights.dtype == torch.float32 and weights.is_contiguous()
    weights.copy_(torch.arange(weights.numel(), dtype=torch.float32).view(shape))
    mapping = mapping_of(weights.data_ptr())
    assert mapping is not None and mapping["end"] - mapping["start"] >= weights.nbytes
    assert "hg" in mapping["VmFlags"]  # MADV_HUGEPAGE was taken
    address, last = weights.data_ptr(), float(weights.numel() - 1)

    # What the run cache keeps of a batch row is a view: the mapping must live on with it.
    row = weights.transpose(0, 1)[0]
    del weights
    gc.collect()
    assert float(row[5, 11, 255, 255]) == last and float(row[0, 0, 0, 1]) == 1.0
    del row
    gc.collect()
    left = mapping_of(address)
    assert left is None or "hg" not in left.get("VmFlags", [])  # unmapped (a new neighbour is not ours)


def test_small_buffers_and_other_devices_are_plain_torch_empty(server_allocator):
    small = empty_written_whole((HUGE_PAGES_FROM_BYTES // 4 - 1,))
    assert small.untyped_storage().resizable()  # torch's own allocation, not a mapping of ours
    assert empty_written_whole((2, 3), "meta").device.type == "meta"
    half = empty_written_whole((HUGE_PAGES_FROM_BYTES,), dtype=torch.float16)
    assert half.dtype == torch.float16 and half.numel() == HUGE_PAGES_FROM_BYTES


def test_below_glibcs_own_threshold_the_heap_is_left_to_reuse_its_blocks(monkeypatch):
    """Outside the server glibc reuses freed blocks up to 32 MiB from its heap, pages and all,
    which no fresh mapping beats: there a buffer of that size stays torch.empty's."""
    monkeypatch.setattr(buffers, "_mapped_from_bytes", GLIBC_MMAP_THRESHOLD_MAX)  # a process that set none
    assert empty_written_whole((GLIBC_MMAP_THRESHOLD_MAX // 4 - 1,)).untyped_storage().resizable()
    assert not empty_written_whole((GLIBC_MMAP_THRESHOLD_MAX // 4,)).untyped_storage().resizable()


def test_the_server_start_up_reports_its_threshold(monkeypatch):
    from manyeyes.app.memory import tune_malloc

    monkeypatch.setattr(buffers, "_mapped_from_bytes", GLIBC_MMAP_THRESHOLD_MAX)
    assert tune_malloc(1 << 20)
    assert buffers._mapped_from_bytes == 1 << 20


def test_the_forward_writes_every_weight_of_such_a_buffer(server_allocator):
    """The server's forward fills the buffer whole: no cell keeps what the fresh mapping held."""
    from manyeyes.model import load

    model = load("minilm", device="cpu")
    text = " ".join(["the river bank was full of fish"] * 20)
    (result,) = model.run([model.encode(text)])
    n = len(result.tokens)
    assert 6 * 12 * n * n * 4 >= HUGE_PAGES_FROM_BYTES
    assert "hg" in mapping_of(result.attention.data_ptr())["VmFlags"]
    sums = result.attention.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
