"""The process's allocator settings, applied once at start-up.

PyTorch's CPU tensors come from glibc malloc. Attention tensors are large (75 MB for MiniLM at
T=512) and of every size in between, and glibc's default grows its mmap threshold dynamically up
to 32 MB once such blocks are freed: after that most of them come from the heap, whose holes are
reused only by blocks that fit and are rarely returned to the OS. Under mixed-length load RSS
climbed to 3.5 GB while the run cache held 512 MB. A fixed threshold (which also turns off the
dynamic growth) gives every large block its own mapping, unmapped on free.

The trim threshold is set apart from it. glibc gives a heap's free top back to the OS once it
passes that size, and the next block carved from it faults its pages in again. At twice the
mmap threshold (2 MiB) a MiniLM forward at T=128 grew and trimmed its heap layer after layer:
about 1,200 page faults a forward, which on this virtual machine made the server's forward 27 to
31 ms against 14 to 16 ms in a plain script. Only the top is kept, and only up to the threshold
per arena; the large blocks that fragmented the heap are mappings of their own either way."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time

from manyeyes.model.buffers import allocations_mapped_from

log = logging.getLogger("manyeyes")
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


LIBC = _libc()


def tune_malloc(mmap_threshold: int, trim_threshold: int | None = None) -> bool:
    """True when glibc took the settings; False elsewhere (musl, macOS) or when turned off.
    trim_threshold None: twice the mmap threshold."""
    if mmap_threshold <= 0:
        return False
    mallopt = getattr(LIBC, "mallopt", None)
    if mallopt is None:
        log.info("no glibc mallopt here; the allocator keeps its defaults")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    trim = 2 * mmap_threshold if trim_threshold is None else trim_threshold
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim) == 1
    if ok:
        release_free_heap()
        allocations_mapped_from(mmap_threshold)  # where buffers written whole may take mappings of their own
    return ok


def release_free_heap() -> None:
    """Gives every malloc arena's free memory back to the OS (glibc's malloc_trim; nothing
    elsewhere). An experiment's tensors, some on the heap, are freed on the worker thread that
    made them, in that thread's arena, and each arena keeps its free top up to the trim threshold:
    after bursts of 512-token experiments the server sat 440 MB above its warm-up with an empty
    run cache, for good, past SECURITY.md's bound once the cache filled (review h50a)."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class QuietTrim:
    """Gives every arena's free memory back (release_free_heap) once no request has been in
    flight for `quiet_s`, once a burst, on a worker thread. Each thread that did a request's heavy
    work (a captured forward for the measures, a flow graph, an encoding) frees its tensors in its
    own arena, which keeps its free top up to MANYEYES_MALLOC_TRIM_THRESHOLD (64 MiB, kept high so
    that forwards do not fault their pages in again layer after layer): after 45 s of measures,
    flows and means an idle server rested 34 MB over SECURITY.md's bound with its run cache 71%
    full, and malloc_trim gave 125 MB back (review h52c). Under load nothing is trimmed: the
    arenas' tops are what the next requests take, and a trim (10-25 ms here) never runs beside a
    request: in a test's process, whose heap is every test's, one held up a burst for 1.2 s.
    A steady trickle (a request every half second) is no load, but never a second of quiet either,
    and would keep a burst's arenas for as long as it lasts: so between requests they are also
    given back once `every_s` has passed since the last trim (a request that comes during one may
    wait those milliseconds for its arena).

    `began()` and `ended()` around each request (event loop only); `run()` is the lifespan's task."""

    def __init__(self, quiet_s: float = 1.0, every_s: float = 30.0, trim=None, clock=time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.every_s = every_s
        self.trim = trim or release_free_heap
        self.clock = clock
        self.last_end: float | None = None  # None: nothing has ended since the last trim
        self.last_trim = clock()
        self.in_flight = 0
        self.trims = 0

    def began(self) -> None:
        self.in_flight += 1

    def ended(self) -> None:
        self.in_flight -= 1
        self.last_end = self.clock()

    def due(self) -> bool:
        if self.in_flight or self.last_end is None:
            return False
        now = self.clock()
        return now - self.last_end >= self.quiet_s or now - self.last_trim >= self.every_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.quiet_s)
            if self.due():
                self.last_end = None
                started = time.perf_counter()
                await asyncio.to_thread(self.trim)
                self.last_trim = self.clock()
                self.trims += 1
                log.debug("gave the arenas' free memory back in %.1f ms", (time.perf_counter() - started) * 1000)


def freeze_long_lived() -> None:
    """Moves every object alive now out of the cyclic garbage collector's reach (`gc.freeze`).
    Run once, when the models have loaded.

    A full collection walks every tracked object: after start-up that is ~310,000 of them (the
    models, torch, pydantic, FastAPI), which live as long as the process. Under 32 clients of
    short texts a full collection came every 2-3 s and held the GIL for 200-260 ms, stalling the
    event loop and the forward thread's Python alike; with them frozen, 22-24 ms (11-16 ms once
    cached runs kept their tokens as rows, model/tokenizer.py TokenRows). Frozen objects are still
    freed by reference counting; only a reference cycle among them would never be collected, and
    what is alive at that moment is the process's own furniture, kept to the end (models are
    loaded once and never dropped). Collecting first leaves no garbage behind to freeze."""
    gc.collect()
    gc.freeze()
    log.info("moved %d start-up objects out of the garbage collector's reach", gc.get_freeze_count())


def prepare_serving_process(settings) -> None:
    """What every process that runs forwards for the server sets before its models load (a
    worker's lifespan, the shared forward process): the allocator, the buffer pool, huge pages,
    the interpreter's switch interval and how its threads wait for a CUDA GPU."""
    import sys

    from manyeyes.app.services.device import set_cuda_wait
    from manyeyes.model.buffers import advise_huge_pages, keep_free_mappings

    tune_malloc(settings.malloc_mmap_threshold, settings.malloc_trim_threshold)
    keep_free_mappings(settings.buffer_pool_bytes)
    advise_huge_pages(settings.huge_pages)
    if settings.switch_interval_ms:
        # The forward thread takes the GIL back after every torch op; with the default 5 ms
        # interval a busy event loop made each re-take wait, and a batch of 8 short inputs
        # took seconds while 200 requests were being answered.
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
    if settings.device is None or settings.device in ("auto", "cuda") or settings.device.startswith("cuda:"):
        # Before the models load: the policy is fixed when torch makes its CUDA context.
        said = set_cuda_wait(settings.cuda_wait)
        if said is not None:
            log.info("CUDA waits: %s", said)
