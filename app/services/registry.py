"""Loads the configured models once, warms each up, and gives each device one Batcher."""

from __future__ import annotations

import copy
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from manyeyes.app.config import Settings
from manyeyes.app.services.batcher import Batcher, work_units
from manyeyes.app.services.device import AUTOCAST, quantises_on_device
from manyeyes.app.services.errors import NotReady, UnknownModel, brief
from manyeyes.app.services.metrics import Metrics, resident_bytes
from manyeyes.app.services.payload import to_u8
from manyeyes.app.services.shared_forward import ForwardClient, ForwardLink
from manyeyes.model import Capture, ModelLoadError, load
from manyeyes.model.attention import WEIGHTS_ONLY
from manyeyes.model.loading import BUILTINS
from manyeyes.model.measures import head_table
from manyeyes.model.runtime import AttentionModel

log = logging.getLogger("manyeyes.registry")


@dataclass
class Served:
    id: str
    model: AttentionModel
    batcher: Batcher
    default: bool
    qk_bytes: int = 4  # per query/key element of a kept run (kept_element_bytes)


def kept_element_bytes(model: AttentionModel) -> int:
    """Bytes per element of a kept run's queries and keys: not always the weights' dtype (under
    autocast they come out in float32). Probed with a tiny run rather than derived, so the
    cache's reckoning before a forward pass is exact."""
    return model.run([model.encode("a b")], Capture(keep=True))[0].kept.queries.element_size()


def weights_key(spec: str) -> str:
    """What two names' specs share when they load the same weights: a built-in name or a Hub id as
    written, a local path resolved (`./m`, `m/` and `/srv/m` are one folder), options kept. Settings
    such as the device and dtype are the server's, the same for every model."""
    where, mark, options = str(spec).partition("?")
    if where not in BUILTINS and where.strip():
        try:
            if Path(where).expanduser().exists():
                where = str(Path(where).expanduser().resolve())
        except (OSError, RuntimeError):  # a name too long for a path, a symlink loop: load() says what is wrong
            pass
    return where + mark + options


def named(model: AttentionModel, model_id: str) -> AttentionModel:
    """The same loaded model under another name: its network, tokenizer and what was computed
    on it are shared, and only its info (the id every answer, run id, batch and metric goes by)
    is its own. The batcher groups a forward by model object, so each name batches on its own."""
    alias = copy.copy(model)
    alias.info = replace(model.info, id=model_id)
    return alias


def load_configured(settings: Settings, model_id: str, spec: str, progress=None) -> AttentionModel:
    """A configured model as the server runs it: on its device, dtype and packing, under its
    autocast (every process that serves it loads it so: workers and the shared forward process)."""
    model = load(spec, device=settings.device, half=settings.half, dtype=settings.dtype, name=model_id,
                 pack=settings.pack_weights, progress=progress, show_progress=sys.stderr.isatty())
    if AUTOCAST[settings.autocast] is not None:
        model.autocast_dtype = AUTOCAST[settings.autocast]
        model.info = replace(model.info, dtype=settings.autocast)
    return model


HEAD_FINDER_WARM_UP = "The head finder warms up."


WARM_UP_TIMINGS = 3


def warm_up(model: AttentionModel, dense_max_tokens: int) -> tuple[int, float]:
    """One forward at the longest input that keeps whole weights: pays one-time costs now and
    proves the shapes. Not beyond dense_max_tokens: at 8,192 positions the weights alone of a
    6-layer, 12-head model would be 19 GB, and such inputs keep queries and keys instead.
    Returns the work units and seconds of a short forward past the one-time costs (the head
    finder's text, the fastest of WARM_UP_TIMINGS), the batcher's first rate: without one, admission by work has nothing to
    judge by, and a fresh server's first burst was all admitted, to end in 504s thirty seconds
    later."""
    info = model.info
    words = min(info.max_tokens, dense_max_tokens) + 8
    encoded = model.encode("hello " * words, truncate=True)
    while len(encoded) > dense_max_tokens and words > 1:  # a tokenizer that splits "hello " in several
        words = max(1, words * dense_max_tokens // len(encoded) - 1)
        encoded = model.encode("hello " * words, truncate=True)
    n = len(encoded)
    # The forward the batcher runs: weights only, so the warm-up pays no last feed-forward at full length.
    result = model.run([encoded], WEIGHTS_ONLY)[0]
    expected = (info.n_layers, info.n_heads, n, n)
    if tuple(result.attention.shape) != expected:
        raise ModelLoadError(f"{info.id}: warm-up attention has shape {tuple(result.attention.shape)}, expected {expected}")
    to_u8(result.attention[:1, :1])  # compiles the u8 quantiser, off the first u8 answer
    # The head finder's one-time costs, off the first request: the model's induction probe and the
    # compiled row pass. On a short text: the compile costs the same at any length, the pass T².
    short = model.encode(HEAD_FINDER_WARM_UP, truncate=True)
    # The fastest of a few: one forward that met a hiccup (another process's burst, a page-fault
    # storm) once took 0.5 s where 10 ms is usual, and a fresh server then judged its first burst
    # 50x too slow and refused it (429 "about 26.8 s of work queued" for four 350-word texts).
    timings = []
    for _ in range(WARM_UP_TIMINGS):
        started = time.perf_counter()
        run = model.run([short], WEIGHTS_ONLY)[0]
        timings.append(time.perf_counter() - started)
    head_table(model, run)
    return work_units(len(short)), min(timings)


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics, forward_link: ForwardLink | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.forward_link = forward_link  # the shared forward process, where workers have one
        self.default_id = settings.default_model_id()
        self._served: dict[str, Served] = {}
        self._batchers: dict[str, Batcher] = {}
        self.ready = threading.Event()
        self.failure: str | None = None
        # Per model, for /readyz while loading: state (queued, downloading, loading, warming,
        # ready, failed) and, while a Hub id downloads, bytes_done / bytes_total.
        self.progress: dict[str, dict] = {model_id: {"state": "queued"} for model_id in settings.all_models()}
        for model_id in self.progress:  # 0 from the start: a model that never loads shows as not ready, not as absent
            metrics.model_ready.labels(model_id).set(0)
        metrics.cache_bytes_limit.set(settings.cache_bytes)

    def load_all(self, before_ready: Callable[[], None] | None = None) -> None:
        """Blocking; the app runs it in a thread so /healthz answers while models load.
        before_ready runs once every model has loaded, before /readyz says so."""
        s = self.settings
        model_id = None
        try:
            time.sleep(s.debug_load_delay_s)
            specs = s.all_models()
            if self.default_id not in specs:
                raise ModelLoadError(f"default model {self.default_id!r} is not among the configured models {sorted(specs)}")
            loaded: dict[str, Served] = {}  # weights_key -> the first name that loaded those weights
            for model_id, spec in specs.items():
                started = time.monotonic()
                self.progress[model_id] = {"state": "loading"}
                first = loaded.get(weights_key(spec))
                timed = None
                if first is not None:
                    # Two names for one model (a=org/gpt2,b=org/gpt2) loaded two copies of its weights.
                    model, qk_bytes = named(first.model, model_id), first.qk_bytes
                else:
                    model = load_configured(s, model_id, spec, progress=self._reporter(model_id))
                    if s.warmup:
                        self.progress[model_id] = {"state": "warming"}
                        timed = warm_up(model, s.dense_max_tokens)
                    qk_bytes = kept_element_bytes(model)
                device = model.info.device
                if device not in self._batchers:
                    self._batchers[device] = Batcher(
                        device,
                        self.metrics,
                        max_batch_tokens=s.max_batch_tokens,
                        max_batch_items=s.max_batch_items,
                        max_wait_s=s.max_wait_ms / 1000,
                        max_queue=s.max_queue,
                        forward_delay_s=s.debug_forward_delay_s,
                        max_client_queue=s.max_client_queue,
                        max_batch_cells=s.max_batch_cells,
                        work_fraction=s.work_budget_fraction,
                        device_quantise=quantises_on_device(device, s.device_quantise),
                        shared=ForwardClient(self.forward_link, self.metrics) if self.forward_link else None,
                    )
                if timed is not None:
                    self._batchers[device].seed_rate(model.info.id, *timed)
                self._served[model_id] = Served(model_id, model, self._batchers[device], model_id == self.default_id,
                                                qk_bytes)
                loaded.setdefault(weights_key(spec), self._served[model_id])
                self.progress[model_id] = {"state": "ready"}
                if first is not None:
                    log.info("model %s (%s) shares the weights model %s loaded", model_id, spec, first.id)
                else:
                    log.info("loaded model %s (%s) on %s in %.2fs", model_id, spec, device, time.monotonic() - started)
            model_id = None  # past the loads: a failure from here on is no model's
            if before_ready is not None:
                before_ready()
            # The memory bound's base (SECURITY.md): every model loaded and warmed up, nothing cached yet.
            if (rss := resident_bytes()) is not None:
                self.metrics.rss_after_warmup.set(rss)
            for model_id in self._served:
                self.metrics.model_ready.labels(model_id).set(1)
            self.ready.set()
        except Exception as exc:  # reported by /readyz; the process stays up for diagnosis
            self.failure = f"{type(exc).__name__}: {exc}"
            if model_id is not None and not isinstance(exc, ModelLoadError):
                # A load error names its file; anything else (a warm-up forward's IndexError) named
                # neither the model nor its spec.
                self.failure = f"model {model_id} ({specs[model_id]}): {self.failure}"
            failed = model_id if model_id is not None else self.default_id
            for model_id, state in self.progress.items():
                if state["state"] not in ("ready", "queued"):
                    self.progress[model_id] = {"state": "failed"}
            self.metrics.model_load_failures.labels(failed).inc()
            log.error("model loading failed: %s", self.failure)

    def _reporter(self, model_id: str):
        def report(done: int, total: int) -> None:
            state = "downloading" if done < total else "loading"
            self.progress[model_id] = {"state": state, "bytes_done": done, "bytes_total": total}

        return report

    def get(self, model_id: str | None) -> Served:
        if not self.ready.is_set():
            raise NotReady(self.not_ready_reason())
        if model_id == "":  # not a way to say "the default": a client that sends it has lost a value
            raise UnknownModel(f"model is empty; omit it for the default ({self.default_id}), or name one of "
                               f"{', '.join(self._served)}")
        served = self._served.get(model_id or self.default_id)
        if served is None:
            raise UnknownModel(f"unknown model {brief(model_id, 64)!r}; this server has {', '.join(self._served)}")
        return served

    def not_ready_reason(self) -> str:
        if self.failure:
            return f"model loading failed: {self.failure}"
        return "models are still loading"

    def served(self) -> list[Served]:
        return list(self._served.values()) if self.ready.is_set() else []

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops every batcher, waiting up to `timeout_s` in all (not each: at a shutdown, three
        models whose forwards were still running took 0.75 s of the second kept for the exit)."""
        deadline = time.monotonic() + timeout_s
        for batcher in self._batchers.values():
            batcher.close(max(deadline - time.monotonic(), 0.0))
