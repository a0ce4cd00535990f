"""Large buffers written whole (model/buffers.py): their own mapping, advised for huge pages,
alive exactly as long as a tensor views them."""

import gc
import mmap
import platform
import subprocess
import sys
import time

import pytest
import torch

from manyeyes.model import buffers
from manyeyes.model.buffers import GLIBC_MMAP_THRESHOLD_MAX, HUGE_PAGES_FROM_BYTES, empty_written_whole

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@pytest.fixture
def server_allocator(monkeypatch):
    """What the server's start-up reports (app/memory.py): every block from 1 MiB is a fresh mapping.
    No mappings kept (a server started in this process may have turned that on)."""
    monkeypatch.setattr(buffers, "_mapped_from_bytes", 1 << 20)
    monkeypatch.setattr(buffers, "_pool", buffers.MappingPool())
    monkeypatch.setattr(buffers, "_huge_pages", False)


@pytest.fixture
def huge_pages(server_allocator, monkeypatch):
    """A server started with MANYEYES_HUGE_PAGES=true."""
    monkeypatch.setattr(buffers, "_huge_pages", True)


@pytest.fixture
def pool(server_allocator):
    """The server's setting: finished buffers' mappings kept for the next ones, up to 16 MiB here."""
    buffers.keep_free_mappings(16 << 20)
    return buffers._pool


def resident_pages(address: int, nbytes: int) -> int:
    """Pages of [address, address + nbytes) in memory, from /proc/self/pagemap (bit 63: present).
    Not smaps: the kernel merges a mapping with like neighbours into one entry."""
    first, count = address // mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read(count * 8)
    return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))


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


def test_a_large_buffer_is_its_own_advised_mapping_and_outlives_its_base_while_a_view_reads_it(huge_pages):
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


def test_a_finished_buffers_mapping_takes_the_next_buffer_that_fits(pool):
    first = empty_written_whole((6, 12, 128, 128))  # MiniLM's weights at T=128, 4.7 MB
    first.fill_(0.5)
    address = first.data_ptr()
    held = first[2, 3]  # a view keeps the mapping in use
    del first
    second = empty_written_whole((6, 12, 128, 128))
    kept = {address, second.data_ptr()}
    assert len(kept) == 2  # never a mapping something still reads
    assert float(held[0, 0]) == 0.5
    del held, second
    gc.collect()
    assert pool.kept_bytes() >= 2 * 6 * 12 * 128 * 128 * 4

    # Both finished: the next one of that size, or up to 1/16 smaller, is written into one of them.
    again = empty_written_whole((6, 12, 128, 128))
    assert again.data_ptr() in kept
    smaller = empty_written_whole((6, 12, 125, 125), dtype=torch.float32)  # 4.5 MB, within 1/16
    assert smaller.data_ptr() in kept - {again.data_ptr()}  # the other kept one
    much_smaller = empty_written_whole((6, 12, 100, 100))  # 2.9 MB: not worth a 4.7 MB mapping
    assert much_smaller.data_ptr() not in kept


def test_a_kept_mapping_holds_no_more_pages_than_its_new_buffer_needs(pool):
    big = empty_written_whole((8 << 20,), dtype=torch.uint8)
    big.fill_(7)
    address = big.data_ptr()
    del big
    smaller = empty_written_whole(((8 << 20) - (400 << 10),), dtype=torch.uint8)  # 400 KiB less
    assert smaller.data_ptr() == address
    assert resident_pages(address, 8 << 20) <= ((8 << 20) - (400 << 10)) // mmap.PAGESIZE + 1  # the tail went back
    smaller.fill_(1)
    assert int(smaller.sum()) == smaller.numel()  # fresh pages read as written, not as the old 7s


def test_the_pool_keeps_at_most_its_limit_and_none_once_turned_off(pool):
    for n in (3, 5, 7, 9, 11):  # 3 to 11 MiB, none fits another
        buffer = empty_written_whole((n << 20,), dtype=torch.uint8)
        assert pool.kept_bytes() <= 16 << 20  # what finished since the last buffer is counted at the next
        buffer.fill_(1)
        del buffer
    assert pool.kept_bytes() > 16 << 20  # 9 + 11 MiB: finished after the last buffer was made
    buffers.trim_kept_mappings()
    assert 0 < pool.kept_bytes() <= 16 << 20
    buffers.keep_free_mappings(0)
    assert pool.kept_bytes() == 0


def test_a_run_cache_eviction_unmaps_what_the_pool_does_not_keep(pool):
    from manyeyes.app.services.cache import Run, RunCache
    from manyeyes.model.kept import DenseAttention

    def run(run_id: str, weights: torch.Tensor) -> Run:
        return Run(run_id, "minilm", [], False, weights, kept=DenseAttention(weights))

    cache = RunCache(12 << 20)  # two MiniLM runs at T=128
    oldest = empty_written_whole((6, 12, 128, 128)).fill_(0)
    evicted = oldest.data_ptr()
    cache.put(run("r0", oldest))
    cache.put(run("r1", empty_written_whole((6, 12, 128, 128)).fill_(1)))
    del oldest
    buffers.keep_free_mappings(1)  # keep nothing finished: an evicted run's mapping must go at once
    newest = empty_written_whole((6, 12, 128, 128))
    assert pool.kept_bytes() == 0 and mapping_of(evicted) is not None
    cache.put(run("r2", newest))  # evicts r0, whose mapping nothing else reads
    del newest
    assert len(cache) == 2
    deadline = time.monotonic() + 10
    while mapping_of(evicted) is not None and time.monotonic() < deadline:  # unmapped on the pool's thread
        time.sleep(0.01)
    assert mapping_of(evicted) is None and pool.kept_bytes() == 0


def test_an_eviction_does_not_wait_for_the_unmapping(pool, monkeypatch):
    """munmap takes about 0.12 ms per MB: the request that evicted a 75 MB run waited 9 ms."""
    import threading

    from manyeyes.app.services.cache import Run, RunCache
    from manyeyes.model.kept import DenseAttention

    trimming, release = threading.Event(), threading.Event()

    def slow_trim():
        trimming.set()
        release.wait(10)

    monkeypatch.setattr(buffers, "_trimmer", buffers.Trimmer(slow_trim))
    cache = RunCache(6 << 20)  # one MiniLM run at T=128
    try:
        started = time.monotonic()
        for i in range(2):
            weights = empty_written_whole((6, 12, 128, 128))
            cache.put(Run(f"r{i}", "minilm", [], False, weights, kept=DenseAttention(weights)))
        returned_after = time.monotonic() - started
        assert trimming.wait(5), "the eviction asked for no trim"
        # put() returned while the trim still runs: a trim in put() itself would have held it 10 s.
        assert len(cache) == 1 and returned_after < 5 and not release.is_set()
    finally:
        release.set()


def test_a_forked_child_trims_on_a_thread_of_its_own():
    """A child has none of its parent's threads: asked to trim, it must start one, not wait forever."""
    script = """
import os, sys, threading
from manyeyes.model.buffers import Trimmer
done = threading.Event()
trimmer = Trimmer(done.set)
trimmer.request()
assert done.wait(5)
done.clear()
pid = os.fork()
if pid == 0:
    trimmer.request()
    os._exit(0 if done.wait(5) else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_small_buffers_and_other_devices_are_plain_torch_empty(huge_pages):
    small = empty_written_whole((HUGE_PAGES_FROM_BYTES // 4 - 1,))
    assert small.untyped_storage().resizable()  # torch's own allocation, not a mapping of ours
    assert empty_written_whole((2, 3), "meta").device.type == "meta"
    half = empty_written_whole((HUGE_PAGES_FROM_BYTES,), dtype=torch.float16)
    assert half.dtype == torch.float16 and half.numel() == HUGE_PAGES_FROM_BYTES


def test_below_glibcs_own_threshold_the_heap_is_left_to_reuse_its_blocks(huge_pages, monkeypatch):
    """Outside the server glibc reuses freed blocks up to 32 MiB from its heap, pages and all,
    which no fresh mapping beats: there a buffer of that size stays torch.empty's."""
    monkeypatch.setattr(buffers, "_mapped_from_bytes", GLIBC_MMAP_THRESHOLD_MAX)  # a process that set none
    assert empty_written_whole((GLIBC_MMAP_THRESHOLD_MAX // 4 - 1,)).untyped_storage().resizable()
    assert not empty_written_whole((GLIBC_MMAP_THRESHOLD_MAX // 4,)).untyped_storage().resizable()


def test_the_server_start_up_turns_on_its_buffer_pool_and_huge_pages_as_set(monkeypatch):
    from fastapi.testclient import TestClient

    from manyeyes.app.config import Settings
    from manyeyes.app.main import create_app

    monkeypatch.setattr(buffers, "_pool", buffers.MappingPool())
    monkeypatch.setattr(buffers, "_huge_pages", False)
    # A model path that fails at once: only the start-up's settings are wanted here.
    settings = Settings(models={"none": "/nonexistent/model"}, buffer_pool_bytes=12 << 20, huge_pages=True)
    with TestClient(create_app(settings)):
        assert buffers._pool.limit_bytes == 12 << 20 and buffers._huge_pages


def test_the_server_start_up_reports_its_threshold(monkeypatch):
    from manyeyes.app.memory import tune_malloc

    monkeypatch.setattr(buffers, "_mapped_from_bytes", GLIBC_MMAP_THRESHOLD_MAX)
    assert tune_malloc(1 << 20)
    assert buffers._mapped_from_bytes == 1 << 20


# Takes 8 MiB in blocks under the mmap threshold, gives them back, takes them again, and prints
# the page faults of the second taking: what a forward pays for its activations layer after layer.
HEAP_REUSE_PROBE = r"""
import ctypes, resource, sys
from manyeyes.app.memory import tune_malloc
assert tune_malloc(1 << 20, None if sys.argv[1] == "default" else int(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
def take():
    blocks = [libc.malloc(512 * 1024) for _ in range(16)]
    for block in blocks:
        ctypes.memset(block, 1, 512 * 1024)
    return blocks
def give(blocks):
    for block in reversed(blocks):
        libc.free(block)
give(take())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
give(take())
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_servers_trim_threshold_keeps_the_heap_a_forward_takes_again():
    """At the old trim threshold (twice the mmap threshold) the heap's top was given back and
    faulted in again on every forward; the server's setting keeps it."""
    from manyeyes.app.config import Settings

    def faults(trim: str) -> int:
        out = subprocess.run([sys.executable, "-c", HEAP_REUSE_PROBE, trim], capture_output=True, text=True, check=True)
        return int(out.stdout)

    assert faults(str(Settings().malloc_trim_threshold)) < 200
    assert faults("default") > 1_000  # 2 MiB: the 8 MiB top goes back and comes again, 2,048 pages


# A worker thread takes 200 MiB in blocks under the mmap threshold, in its own malloc arena, and
# frees all but every sixteenth: the holes stay resident until the heap is trimmed. Prints the
# resident MiB the freeing left, then what release_free_heap left.
HOLED_ARENA_PROBE = r"""
import ctypes, sys, threading
from manyeyes.app.memory import LIBC, release_free_heap, tune_malloc
assert tune_malloc(int(sys.argv[1]), int(sys.argv[2]))
LIBC.malloc.restype, LIBC.malloc.argtypes, LIBC.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20
def churn():
    blocks = [LIBC.malloc(64 << 10) for _ in range(3200)]
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for i, block in enumerate(blocks):
        if i % 16:
            LIBC.free(block)
before = resident_mib()
worker = threading.Thread(target=churn)
worker.start()
worker.join()
freed = resident_mib() - before
release_free_heap()
print(freed, resident_mib() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_release_free_heap_gives_back_the_holes_a_worker_threads_arena_keeps():
    """What the experiments call after each one (app/services/experiments.py): with the server's
    settings a freed heap stays resident in the thread's arena; malloc_trim returns it."""
    from manyeyes.app.config import Settings

    settings = Settings()
    probe = [sys.executable, "-c", HOLED_ARENA_PROBE, str(settings.malloc_mmap_threshold), str(settings.malloc_trim_threshold)]
    freed, trimmed = map(float, subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split())
    assert freed > 150  # 188 MiB of holes: freeing alone gave nothing back
    assert trimmed < 40  # the 12.5 MiB still taken, and the arena's own pages


def test_the_forward_writes_every_weight_of_such_a_buffer(huge_pages):
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


def test_the_arenas_are_trimmed_once_a_burst_when_requests_stop_ending():
    """The server gives the arenas' free memory back once requests have stopped ending for a
    while (app/memory.py QuietTrim): only experiments did, and an idle server rested over
    SECURITY.md's bound after a burst of measures (review h52c)."""
    import asyncio

    from manyeyes.app.memory import QuietTrim

    now = [0.0]
    quiet = QuietTrim(quiet_s=1.0, trim=lambda: None, clock=lambda: now[0])
    assert not quiet.due()  # nothing has ended: nothing to give back
    for t in (0.0, 0.4, 0.8, 1.2):  # a burst: requests keep ending
        now[0] = t
        quiet.began()
        quiet.ended()
        assert not quiet.due()
    now[0] = 2.2
    assert quiet.due()
    quiet.began()  # never beside a request: in a test's process one held up a burst for 1.2 s
    now[0] = 5.0
    assert not quiet.due()
    quiet.ended()
    assert not quiet.due()
    now[0] = 6.0
    assert quiet.due()

    calls = []

    async def main():
        trimming = QuietTrim(quiet_s=0.05, trim=lambda: calls.append(1))
        made = trimming.last_trim
        task = asyncio.create_task(trimming.run())
        await asyncio.sleep(0.2)
        assert calls == []
        trimming.began()
        trimming.ended()
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        task.cancel()
        return calls, trimming.last_end, trimming.last_trim > made  # the trim's time, for every_s

    assert asyncio.run(main()) == ([1], None, True)  # once for the burst, not again without a request


def test_a_steady_trickle_of_requests_still_has_the_arenas_trimmed_every_so_often():
    """A request every half second never leaves a second of quiet, and kept whatever a burst
    before it left in the arenas: between its requests they are given back every `every_s`."""
    from manyeyes.app.memory import QuietTrim

    now = [0.0]
    quiet = QuietTrim(quiet_s=1.0, every_s=30.0, trim=lambda: None, clock=lambda: now[0])
    due_at = []
    for step in range(1, 140):  # 69.5 s of requests, each 10 ms, every 0.5 s
        now[0] = step * 0.5
        quiet.began()
        assert not quiet.due()  # never beside a request, however long since the last trim
        now[0] += 0.01
        quiet.ended()
        now[0] += 0.2
        if quiet.due():  # as run() does (its time noted: the test above)
            due_at.append(round(now[0]))
            quiet.last_end, quiet.last_trim = None, now[0]
    assert due_at == [30, 60], due_at
    # A busy server (a request always in flight) is never trimmed, however long it has been.
    quiet.began()
    quiet.began()
    quiet.ended()
    now[0] += 100
    assert not quiet.due()
