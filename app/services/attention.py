"""Attention runs: cache lookup, tokenization, a place in a micro-batch, and response bytes."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from manyeyes.app.config import Settings
from manyeyes.app.services.batcher import Done
from manyeyes.app.services.cache import Run, RunCache, run_bytes, run_id_for
from manyeyes.app.services.device import KEPT_DTYPE, KEPT_FORMAT, dequantised, quantise, serves
from manyeyes.app.services.errors import (
    InvalidInput,
    KeptQK,
    KeptQuantised,
    NeedsTiles,
    OverBudget,
    QueueFull,
    RunTooLarge,
    TooLong,
    TooManyCells,
    UnknownRun,
    brief,
)
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.slots import FairBytes, FairSlots, Grant
from manyeyes.app.services.payload import View, join_results, render_frame, render_kept, render_result
from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, Compression, prefers_frame
from manyeyes.app.services.registry import Registry, Served
from manyeyes.model.errors import TooLongError
from manyeyes.model.kept import DenseAttention
from manyeyes.model.tokenizer import Encoded, Token

# Compact formats are already ~10x smaller than JSON text; gzip would cost more than the forward.
COMPACT_MEDIA_TYPE = "application/vnd.manyeyes+json"
SLICE_ROUTE = "GET /api/v1/runs/{run_id}/attention"


@dataclass
class Item:
    text: str
    text_pair: str | None
    label: str  # how errors name this input: "" for a single text, "texts[3]: " in a batch
    run_id: str = ""
    tenant: str = ""  # whose run it is, on a server with API keys (run_id_for)
    run: Run | None = None
    encoded: Encoded | None = None
    kind: str = "weights"  # what its run keeps: "weights", or "qk" (queries and keys, a long input)
    # wait: for the answers' bytes and a render slot, other requests' answers ahead of it (an 8 s
    # wait behind a client's 200 tiles was in no figure of its own).
    timing: dict = field(default_factory=lambda: {"tokenize": 0.0, "queue": 0.0, "forward": 0.0, "wait": 0.0})


KEPT_NAMES = {"weights": "weights", "qk": "queries and keys"}


def mib(nbytes: int, other: int) -> str:
    """nbytes in MiB, as precisely as it takes to tell it from `other`: a refusal read "at least 3
    MiB ..., more than this server's run cache (3 MiB)"."""
    for digits in (0, 1, 2):
        if f"{nbytes / 2**20:,.{digits}f}" != f"{other / 2**20:,.{digits}f}":
            return f"{nbytes / 2**20:,.{digits}f} MiB"
    return f"{nbytes:,} bytes"


# Work this small costs less than a hop to the thread pool and back (tens of microseconds),
# so it runs on the event loop; anything bigger goes to a worker thread.
INLINE_CHARS = 2_000
INLINE_CELLS = 100_000
# A raw frame sent as it is only quantises (u8, f16) or views (float32; a subset of layers or
# heads is a copy) the weights: about 0.1 ms per million cells here, 0.2-0.5 ms in the server,
# where the hop to a worker thread and back cost 0.5 ms more at T=64. So frames up to MiniLM's
# whole T=128 answer render on the loop.
INLINE_FRAME_CELLS = 1_200_000


async def off_loop_unless_small(small: bool, fn, *args):
    return fn(*args) if small else await run_in_threadpool(fn, *args)


async def finished_off_loop(fn, *args):
    """fn(*args) on a worker thread, called in a render slot: if the request is cancelled meanwhile
    (its client hung up, or the server stops), the worker thread cannot be stopped, so this waits
    for it to end before the cancel goes on and the slot is released. Released at once, hang-ups
    would start more renders at once than max_concurrent_renders (as tiles do, services/tiles.py)."""
    working = asyncio.ensure_future(run_in_threadpool(fn, *args))
    try:
        return await asyncio.shield(working)
    except asyncio.CancelledError:
        await asyncio.wait([working])
        if not working.cancelled():
            working.exception()  # retrieved: nobody is left to answer
        raise


class RenderQueue:
    """Admission for the work that waits for a render slot (FairSlots) and runs in it: tile, top-k
    and overview requests (services/tiles.py) and slices too large to render on the loop
    (AttentionService.slice). One count for all of them, from admission until the work ends (or
    its client hangs up): beyond `max_queue` of them, or beyond a client's share
    (`max_client_queue`, else `max_queue`), the next is answered 429 queue_full with Retry-After
    at once. The slots go round-robin across clients, so others are not starved either way; this
    bounds how many one client can leave waiting. Event loop only (no lock)."""

    RETRY_AFTER_S = 1

    def __init__(self, slots: FairSlots, max_queue: int, max_client_queue: int | None = None,
                 metrics: Metrics | None = None) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.max_client_queue = max_client_queue or max_queue
        self.metrics = metrics  # refusals counted by reason, as the batcher's are (render_queue_full, render_client_share)
        self.waiting = 0  # admitted and not yet finished: waiting for a slot, or rendering in one
        self.waiting_of: Counter[str] = Counter()  # the same, per client (its share, as in the batcher)

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.dropped.labels(reason).inc()

    def admit(self, client: str = "") -> None:
        """Counts one more request of `client`, or raises QueueFull (429)."""
        if self.waiting >= self.max_queue:
            self._refused("render_queue_full")
            raise QueueFull(f"{self.waiting} tile requests and slices are already waiting for a render slot: this "
                            "server's queue of them is full; retry shortly", self.RETRY_AFTER_S)
        if self.waiting_of[client] >= self.max_client_queue:
            self._refused("render_client_share")
            raise QueueFull(f"this client already has {self.waiting_of[client]} tile requests and slices waiting for a "
                            "render slot: its share of this server's queue is full; retry shortly", self.RETRY_AFTER_S)
        self.waiting += 1
        self.waiting_of[client] += 1

    def release(self, client: str = "") -> None:
        self.waiting -= 1
        self.waiting_of[client] -= 1
        if self.waiting_of[client] <= 0:
            del self.waiting_of[client]

    @asynccontextmanager
    async def hold(self, client: str = ""):
        """`async with queue.hold(client):` admitted (else 429), then a render slot held until the
        block ends. Counted from the admission, released however the block ends (an answer, an
        error such as a 404 for a run evicted meanwhile, or a cancel when the client hangs up)."""
        self.admit(client)
        try:
            async with self.slots.hold(client):
                yield
        finally:
            self.release(client)


@dataclass(frozen=True)
class Wire:
    """What the client said it can read: the frame (`Accept`) and which compressions."""

    frame: bool = False
    accept_encoding: str | None = None

    @classmethod
    def from_headers(cls, accept: str | None, accept_encoding: str | None) -> Wire:
        return cls(prefers_frame(accept), accept_encoding)


@dataclass
class Reply:
    body: list[bytes]  # pieces of one answer (bytes-like: the weights may be a view), sent without joining
    media_type: str
    log: dict  # run ids and timings for the request's log line
    headers: dict = field(default_factory=dict)
    runs: list = field(default_factory=list)  # the answer's runs, as computed (the cache may drop them)
    # The answer's bytes in the service's budget (AttentionService.answers), while this reply owns
    # them: a route hands them over to the response that sends the answer (PiecesResponse gives them
    # back once it is sent); a caller that only reads the reply (export, another worker's recompute)
    # gives them back by dropping it.
    _grant: list[Grant] = field(default_factory=list, repr=False)

    def own(self, grant: Grant) -> None:
        self._grant.append(grant)
        weakref.finalize(self, release_all, self._grant)

    def hand_over(self) -> Grant | None:
        return self._grant.pop() if self._grant else None

    def release(self) -> None:
        """Gives the bytes back now, not when a traceback lets the reply go."""
        release_all(self._grant)


def release_all(grants: list[Grant]) -> None:
    while grants:
        grants.pop().release()


# An answer's bytes a weight while it is encoded and sent: raw in a frame, base64 (4/3) in JSON,
# and json's text about 15 characters a weight (format=json's 2 M cells: ~30 MB).
JSON_TEXT_BYTES = 15
# Beside its weights, an answer's JSON holds its fields and its tokens: each token's text and
# vocabulary piece (a character escaped at worst as \u00XX: 6 bytes) and its own fields.
ANSWER_FIELDS_BYTES = 4096
TOKEN_FIELDS_BYTES = 128


def tokens_bytes(tokens) -> int:
    return sum(6 * (len(t.text.encode()) + len(t.piece.encode())) + TOKEN_FIELDS_BYTES for t in tokens)


def cells_bytes(cells: int, fmt: str, frame: bool = False) -> int:
    """`cells` values of an answer in this format, as sent."""
    raw = KEPT_DTYPE[fmt].itemsize
    if frame:
        return cells * raw
    return cells * JSON_TEXT_BYTES if fmt == "json" else -(-cells * raw * 4 // 3)


def answer_bytes(cells: int, fmt: str, frame: bool, tokens=()) -> int:
    """An answer of `cells` weights and these tokens, reckoned before it is made."""
    return ANSWER_FIELDS_BYTES + tokens_bytes(tokens) + cells_bytes(cells, fmt, frame)


def check_precision(run: Run, fmt: str) -> None:
    """A run kept quantised on the device (a GPU server's) holds only the bytes its answer had:
    a view of it in a more precise format would dress those bytes up as that format's values."""
    if run.attention is not None and not serves(run.attention.dtype, fmt):
        raise KeptQuantised(
            f"run {brief(run.run_id, 64)} was kept as {str(run.attention.dtype).removeprefix('torch.')} (quantised on "
            f"the device); format={fmt} needs more precision: POST the text again with format={fmt}"
        )


def resolve_indices(asked: list[int] | None, count: int, what: str, model_id: str, holder: str | None = None) -> list[int]:
    """holder: who has `count` of them when the model does not (a run's positions)."""
    if asked is None:
        return list(range(count))
    bad = [i for i in asked if not 0 <= i < count]
    if bad:
        raise InvalidInput(f"{what} {brief(bad[0])} does not exist: {holder or f'model {model_id}'} has {what}s 0..{count - 1}")
    # Repeats would let a small request ask for an unbounded response (layers=[0]*100000 in u8).
    if len(set(asked)) != len(asked):
        raise InvalidInput(f"each {what} may be asked for once; {what}s {asked[:16]}{'...' if len(asked) > 16 else ''} repeat some")
    return list(asked)


MAX_INDEX_DIGITS = 9


def predictions_body(model, run: Run, top_k: int | None) -> dict | None:
    """The answer's `predictions`: position -> the model's top_k, best first (None: not asked)."""
    if top_k is None:
        return None
    found = model.predictions_from(run.tokens, run.top_ids, run.top_probs, top_k)
    return {str(pos): [{"token": p.token, "id": p.id, "prob": p.prob, "piece": p.piece} for p in preds]
            for pos, preds in found.items()}


def covers(run: Run, other: Run) -> bool:
    """Whether `run` serves every route and format `other` does: weights serve all that queries
    and keys do (tiles, topk, overview), and weights kept more precisely serve more formats."""
    if other.kind == "qk":
        return True
    return run.kind == "weights" and serves(run.attention.dtype, KEPT_FORMAT[other.attention.dtype])


def parse_index_list(values: list[str] | None, what: str) -> list[int] | None:
    """Query lists as `layers=0,2` or `layers=0&layers=2`; None (all) when not given. An empty
    list or entry is refused, as the JSON bodies refuse `"layers": []`: `layers=,` had meant all
    of them and `layers=1,,0` had passed, either of which may be a client's bug."""
    if not values:
        return None
    parts = [part.strip() for part in ",".join(values).split(",")]
    if not any(parts):
        raise InvalidInput(f"{what}s is empty: leave it out for all of them")
    if not all(parts):
        raise InvalidInput(f"{what}s has an empty entry ({brief(','.join(values))!r}): list indices as 0,2")
    return [parse_index(part, what) for part in parts]


def parse_index(part: str, what: str) -> int:
    """One index from a query string. ASCII digits only: int() would also read "+1", "1_0" and
    other scripts' digits, and refuses over 4,300 digits with a ValueError (a 500)."""
    if not (part.isascii() and part.isdigit()):
        raise InvalidInput(f"{what}s must be integers (0, 1, 2, ...), got {brief(part)!r}")
    if len(part.lstrip("0")) > MAX_INDEX_DIGITS:  # leading zeros add nothing ("00000000001" is 1)
        raise InvalidInput(f"{what} {brief(part)} does not exist: no model has that many")
    return int(part)


def check_some_tokens(model_id: str, encoded: Encoded, has_pair: bool, label: str = "") -> None:
    """A text that is not blank can still give no token: MiniLM drops a lone combining mark, a
    zero-width space, a control character. Its run (only [CLS] and [SEP]) was answered as if it
    were the text's, with nothing to say that none of the text was read (the experiments too)."""
    if encoded.truncated:
        return  # cut to fit: a long text can leave its pair no room (a tiktoken model cuts at the end)
    tokens = encoded.tokens
    for segment, name, order in ((0, "text", tokens), (1, "text_pair", reversed(tokens))):
        if segment == 1 and not has_pair:
            continue
        if not any(not t.special and t.segment == segment for t in order):
            raise InvalidInput(
                f"{label}{name} gives no tokens on {model_id}: its tokenizer drops every character of it "
                "(combining marks on their own, zero-width and control characters); give it a word or a sign it reads"
            )


def negotiated(wire: Wire, fmt: str, encoding: str | None) -> tuple[str, dict]:
    """(media type, headers) of an answer that Accept and Accept-Encoding chose: the same URL
    answers differently to other values of them (Vary)."""
    media_type = FRAME_MEDIA_TYPE if wire.frame else "application/json" if fmt == "json" else COMPACT_MEDIA_TYPE
    headers = {"Vary": "Accept, Accept-Encoding"}
    if encoding:
        headers["Content-Encoding"] = encoding
    return media_type, headers


def items_for(model: str, texts: list[tuple[str, str | None]], batch: bool, truncate: bool, tenant: str) -> list[Item]:
    return [
        Item(text, pair, f"texts[{i}]: " if batch else "", run_id_for(model, text, pair, truncate, tenant), tenant=tenant)
        for i, (text, pair) in enumerate(texts)
    ]


class AttentionService:
    def __init__(self, settings: Settings, registry: Registry, cache: RunCache, metrics: Metrics,
                 run_directory=None) -> None:
        self.settings = settings
        self.registry = registry
        self.cache = cache
        self.metrics = metrics
        # Where copies of the app (workers, replicas) record the request behind each run they
        # compute, so another copy asked for a slice of it can compute it again (app/shared_runs.py).
        self.run_directory = run_directory
        if run_directory is not None:
            run_directory.hold_while(cache.holds)
        # Answers encoded (and tiles computed, services/tiles.py) at once; each holds its answer meanwhile.
        self.renders = FairSlots(settings.max_concurrent_renders)
        # Tiles and large slices waiting for one of those slots: bounded, 429 beyond (RenderQueue).
        self.queued = RenderQueue(self.renders, settings.max_queue, settings.max_client_queue, metrics)
        # Bytes held by answers on their way out: their runs and their encoded bytes, from before
        # the forward pass until sent. Without it a crowd of clients asking for large answers
        # piled up runs waiting for a render slot and answers waiting for their readers (300
        # connections asking for 2 M cells of json: 3.5 GB against a bound of 1.3 GB).
        self.answers = FairBytes(settings.answer_bytes, metrics.answer_bytes)
        self.compression = Compression(
            settings.zstd_level, settings.zstd_min_bytes, settings.attention_gzip_level, settings.gzip_min_bytes
        )

    # ------------------------------------------------------------------ public
    async def attend(
        self, texts: list[tuple[str, str | None]], options, batch: bool, started: float, wire: Wire = Wire(), client: str = "",
        extra_bytes: Callable[[Sequence[Token]], int] | None = None, tenant: str = "",
    ) -> Reply:
        """extra_bytes(tokens): what the caller will add to one text's answer (measures, a page
        around it), reckoned with the answer's own bytes in one grant: a request that held the
        answer's bytes while it waited for more could hold them against every other such request."""
        served = self.registry.get(options.model)
        view = self._view(served, options.layers, options.heads, options.format)
        top_k = self._top_k(served, options.predictions)
        self.check_chars(texts, batch)
        deadline = started + self.settings.request_timeout_s
        # Hashing a text for its run id costs about 13 ms a million characters.
        chars = sum(len(text) + len(pair or "") for text, pair in texts)
        items = await off_loop_unless_small(chars <= INLINE_CHARS, items_for, served.id, texts, batch, options.truncate, tenant)
        # A batch answers with weights only; one text may keep queries and keys (see kind_for).
        keep = getattr(options, "keep", "weights")
        measures = getattr(options, "measures", None)
        grant = await self._compute(served, items, view, options.truncate, deadline, client, keep, bool(measures), wire,
                                    extra_bytes)
        try:
            reply = await self._reply(served, items, view, batch, wire, top_k, client)
        except BaseException:
            grant.release()
            raise
        reply.runs = [item.run for item in items]
        reply.own(grant)
        return reply

    def kind_for(self, keep: str, n_tokens: int, label: str = "", measures: bool = False, truncated: bool = False) -> str:
        """What a run of n_tokens keeps: auto keeps weights up to dense_max_tokens, as always,
        and queries and keys beyond; weights beyond the limit is refused (413)."""
        limit = self.settings.dense_max_tokens
        if keep == "weights" and n_tokens > limit:
            cut = " (cut to fit)" if truncated else ""
            # Without a run cache "keep": "qk" is refused too (run_too_large): advised here, it was a dead end.
            remedy = ("this server keeps no runs (MANYEYES_CACHE_BYTES=0), so it cannot serve a longer one: send at "
                      f"most {limit:,} tokens, or turn the run cache on" if self.cache.max_bytes == 0 else
                      'POST /api/v1/attention with "keep": "qk" (or "auto") and read the run through '
                      "GET /api/v1/runs/{run_id}/tile, /topk and /overview")
            raise NeedsTiles(
                f"{label}input is {n_tokens:,} tokens long{cut}; this server sends whole weights up to {limit:,} tokens. {remedy}"
            )
        kind = "qk" if keep == "qk" or (keep == "auto" and n_tokens > limit) else "weights"
        if kind == "qk" and measures and keep == "qk":
            raise KeptQK(
                'measures need a run\'s whole weights, and "keep": "qk" keeps only its queries and keys; '
                'drop `measures`, or ask for "keep": "auto" or "weights"'
            )
        if kind == "qk" and measures:
            raise KeptQK(
                f"{label}measures need a run's whole weights, and this input ({n_tokens:,} tokens) keeps queries and keys "
                f"(over this server's dense_max_tokens, {limit:,}); drop `measures`, and read its heads through "
                "GET /api/v1/runs/{run_id}/tile, /topk and /overview"
            )
        return kind

    def slice(self, run_id: str, layers: list[int] | None, heads: list[int] | None, fmt: str, wire: Wire = Wire(),
              client: str = "") -> Reply | Coroutine[None, None, Reply]:
        """A slice of a cached run's weights: the Reply itself when it is small enough to render on
        the loop (_renders_inline), else a coroutine that waits for a render slot and renders it
        there, which the route awaits (unless_disconnected: a client that hangs up leaves the queue).
        That coroutine holds the run's id, not the run (see _slice_in_slot), and is admitted to the
        render queue when awaited, as tiles are (RenderQueue: 429 beyond its bound); an inline slice
        is not counted."""
        run = self.cached(run_id, SLICE_ROUTE)
        served = self.registry.get(run.model)
        view = self._view(served, layers, heads, fmt)
        self._check_cells([run.n_tokens], view)
        check_precision(run, fmt)
        items = [Item("", None, "", run_id, run=run)]
        nbytes = self._held_bytes(served, items, view, wire)
        if self._renders_inline(view.cells(run.n_tokens), view, wire):
            grant = self.answers.try_take(nbytes, client)
            if grant is not None:
                try:
                    reply = self._replied(items, view, wire, *self._render(served, items, view, False, wire))
                except BaseException:
                    grant.release()
                    raise
                reply.own(grant)
                return reply
        return self._slice_in_slot(run_id, served, view, wire, client, nbytes)

    async def _slice_in_slot(self, run_id: str, served: Served, view: View, wire: Wire, client: str, nbytes: int) -> Reply:
        """The run is read again once a render slot is held (still_cached), as tiles' are. Admitted
        here, not in `slice`: a coroutine cancelled before it starts would never release its count."""
        started = time.perf_counter()
        async with self.queued_with_bytes(nbytes, client) as grant:
            items = [Item("", None, "", run_id, run=self.still_cached(run_id, view.format, SLICE_ROUTE))]
            items[0].timing["wait"] = time.perf_counter() - started
            body, encoding = await finished_off_loop(self._render, served, items, view, False, wire)
            reply = self._replied(items, view, wire, body, encoding)
        reply.own(grant)
        return reply

    @asynccontextmanager
    async def bytes_then_slot(self, nbytes: int, client: str):
        """`async with service.bytes_then_slot(nbytes, client) as grant:` `nbytes` of the answers'
        budget granted within the request's time budget (else 504), then a render slot, held while
        the block runs. Bytes before the slot: a request holding a slot while it waited for bytes
        would stand in the way of the answers holding them, which wait for a slot to be encoded.
        The grant is given back if the block fails; else the caller hands it to its answer."""
        grant = await self.reserve(nbytes, time.monotonic() + self.settings.request_timeout_s, client)
        try:
            async with self.renders.hold(client):
                yield grant
        except BaseException:
            grant.release()
            raise

    @asynccontextmanager
    async def queued_with_bytes(self, nbytes: int, client: str, turn: FairSlots | None = None):
        """bytes_then_slot, admitted to the render queue first (else 429): tiles and large slices.
        `turn`: slots of one kind of work to hold first, taken in turns across clients (the flow
        graphs', one at a time), waited for in the queue, counted and bounded as it is."""
        self.queued.admit(client)
        try:
            async with turn.hold(client) if turn is not None else nullcontext():
                async with self.bytes_then_slot(nbytes, client) as grant:
                    yield grant
        finally:
            self.queued.release(client)

    def cached(self, run_id: str, needs_weights: str | None = None) -> Run:
        """The cached run, else 404. needs_weights names a route that reads the whole weights:
        a run that kept queries and keys gets a 422 saying which routes serve it."""
        run = self.cache.get(run_id)
        self.metrics.cache.labels("hit" if run else "miss").inc()
        if run is None:
            raise UnknownRun(
                f"run {brief(run_id, 64)} is unknown or was evicted from the cache; POST /api/v1/attention again to recompute it"
            )
        if needs_weights and run.kind == "qk":
            self._refuse_qk(run, needs_weights)
        return run

    def still_cached(self, run_id: str, fmt: str | None, needs_weights: str | None = None) -> Run:
        """The run again, once a render slot is held. A request waiting for a slot holds only the
        run's id: holding the run itself kept every evicted run with a request queued on it alive,
        outside the cache's byte bound (150 queued tiles on 150 evicted 2,048-token tiny-llama runs:
        1 GB of resident memory under a 40 MB cache). The same id is the same model, text and
        truncation, so a run recomputed meanwhile has the tokens the request was checked against.
        fmt None: the caller reads float32 weights whatever precision the run kept (the measures)."""
        run = self.cache.get(run_id)
        if run is None:
            raise UnknownRun(
                f"run {brief(run_id, 64)} was evicted from the cache while this request waited for its turn; "
                "POST /api/v1/attention again to recompute it"
            )
        if needs_weights and run.kind == "qk":  # evicted, then recomputed by a request that kept queries and keys
            self._refuse_qk(run, needs_weights)
        if fmt is not None:
            check_precision(run, fmt)  # a run that replaced it may have been kept quantised (a GPU server's)
        return run

    def _refuse_qk(self, run: Run, needs_weights: str) -> None:
        """A run that kept queries and keys, read by a route that needs whole weights: 422."""
        raise KeptQK(
            # Not "is N tokens long and kept": that read as if its length were why, where keep="qk"
            # or a run cache too small for its weights may be.
            f"run {run.run_id} ({run.n_tokens:,} tokens) kept its queries and keys, not whole weights, "
            f"so {needs_weights} cannot serve it; GET /api/v1/runs/{run.run_id}/tile, /topk and /overview do "
            f"(any head, window, pooling), or POST it again with \"keep\": \"weights\" if it is at most "
            f"{self.settings.dense_max_tokens:,} tokens"
        )

    # ------------------------------------------------------------------ steps
    def _view(self, served: Served, layers, heads, fmt: str) -> View:
        info = served.model.info
        return View(
            resolve_indices(layers, info.n_layers, "layer", info.id),
            resolve_indices(heads, info.n_heads, "head", info.id),
            fmt,
        )

    @staticmethod
    def _top_k(served: Served, asked) -> int | None:
        if asked is None:
            return None
        if not served.model.info.predictions:
            raise InvalidInput(
                f"model {served.id} has no language-model head, so it makes no predictions; "
                "GET /api/v1/models says which models do"
            )
        return asked.top_k

    def check_chars(self, texts: list[tuple[str, str | None]], batch: bool = False) -> None:
        """Refuses long pastes before the tokenizer sees them (truncate=true tokenizes all of it)."""
        limit = self.settings.max_text_chars
        for i, (text, pair) in enumerate(texts):
            size = len(text) + len(pair or "")
            if size > limit:
                raise TooLong.chars(size, limit, f"texts[{i}]: " if batch else "", pair=bool(pair))

    def _check_cells(self, lengths: list[int], view: View) -> None:
        if view.format != "json":
            return
        cells = sum(view.cells(n) for n in lengths)
        if cells > self.settings.max_json_cells:
            raise TooManyCells.json(cells, self.settings.max_json_cells, "attention weights",
                                    "ask for format=u8 or f16, or fewer layers/heads (that answer's run_id then serves "
                                    "slices of the run from GET /api/v1/runs/{run_id}/attention)")

    def _check_held(self, served: Served, lengths: list[int]) -> None:
        """A batch's runs are all held at once, as float32 weights and again as its answer: at
        most as many weights as one forward pass may make (one text alone always runs). 32 texts
        cut to 512 tokens were 2.4 GB of weights and an 807 MB answer."""
        if len(lengths) < 2:
            return
        info = served.model.info
        cells = info.n_layers * info.n_heads * sum(n * n for n in lengths)
        limit = self.settings.max_batch_cells
        if cells > limit:
            raise TooManyCells(
                f"this batch's weights are {cells:,} cells ({4 * cells / 2**20:,.0f} MiB as float32), over this "
                f"server's limit of {limit:,} for one request; send fewer or shorter texts in each batch"
            )

    def _fit_cache(self, served: Served, item: Item, keep: str, measures: bool, fmt: str) -> None:
        """A run the cache could never hold was answered 200 with links that all 404 (a 4,399-token
        input of SmolLM2's shape: 187 s of forward pass, then nothing to read). "auto" keeps queries
        and keys when the weights would not fit; what still does not fit is refused now, before the
        forward pass. A cache of 0 bytes means caching is off: runs are answered, never kept, so a
        run that keeps queries and keys (its answer holds only links to the run) is refused."""
        cap = self.cache.max_bytes
        if cap == 0 and item.kind == "qk":
            limit = self.settings.dense_max_tokens
            raise RunTooLarge(
                f"{item.label}this input ({len(item.encoded):,} tokens) keeps its queries and keys, read through links to "
                "the run, and this server keeps no runs (MANYEYES_CACHE_BYTES=0), so none of its routes could read it; "
                f"send at most {limit:,} tokens (answered with their weights), or turn the run cache on"
            )
        if cap == 0:
            return
        model, n = served.model, len(item.encoded)
        weight_bytes = KEPT_DTYPE[fmt].itemsize if served.batcher.device_quantise else 4

        def need(kind: str, tokens: int = n) -> int:
            return run_bytes(model.info, tokens, kind, weight_bytes, served.qk_bytes)

        # Under auto a run keeps queries and keys when its weights do not fit: either form will do.
        kinds = ("weights", "qk") if item.kind == "weights" and keep == "auto" and not measures else (item.kind,)
        fitting = [kind for kind in kinds if need(kind) <= cap]
        if fitting:
            item.kind = fitting[0]
            return
        low, high = 0, n  # the longest input whose run fits in some form: need() grows with the tokens
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if any(need(kind, mid) <= cap for kind in kinds) else (low, mid - 1)
        other = ', or ask for "keep": "auto" (its queries and keys fit)' if keep == "weights" and not measures and need("qk") <= cap else ""
        # Advice to send "at most 0 tokens" (or only the special tokens every input has) sent
        # people to shorten texts that no length would let through: the setting is the problem.
        least = sum(token.special for token in item.encoded.tokens) + 1
        advice = (f"send at most {low:,} tokens{other}, or raise MANYEYES_CACHE_BYTES" if low >= least or other
                  else "no input of this model fits it: the server's MANYEYES_CACHE_BYTES must be raised")
        held = " or ".join(f"{mib(need(kind), cap)} of {KEPT_NAMES[kind]}" for kind in kinds)
        raise RunTooLarge(
            f"{item.label}this input's run ({n:,} tokens) would hold at least {held}, more than this server's run cache "
            f"({mib(cap, need(kinds[-1]))}, 3/4 of MANYEYES_CACHE_BYTES), so none of its routes could read it; {advice}"
        )

    async def _compute(
        self, served: Served, items: list[Item], view: View, truncate: bool, deadline: float, client: str,
        keep: str = "weights", measures: bool = False, wire: Wire = Wire(),
        extra_bytes: Callable[[Sequence[Token]], int] | None = None,
    ) -> Grant:
        """Fill each item's run: from the cache, else through one place each in the batcher. The
        bytes its answer will hold are granted first (a run computed is held until it is answered)."""
        missing = []
        for item in items:
            item.run = self.cache.get(item.run_id)
            if item.run is not None:
                item.kind = self.kind_for(keep, item.run.n_tokens, item.label, measures, item.run.truncated)
                # Weights serve every route queries and keys do (tiles, topk, overview), so a run
                # is only ever replaced by one that serves more: another client may be reading it.
                if item.run.kind == "qk" and item.kind == "weights":
                    item.run = None  # kept queries and keys only: run it again for its weights
                elif item.kind == "weights" and not serves(item.run.attention.dtype, view.format):
                    item.run = None  # kept at less precision than this format needs: run it again
            self.metrics.cache.labels("hit" if item.run else "miss").inc()
            if item.run is None:
                missing.append(item)
        if not missing:
            lengths = [item.run.n_tokens for item in items if item.kind == "weights"]
            self._check_cells(lengths, view)
            self._check_held(served, lengths)
            return await self._reserve_timed(items, self._held_bytes(served, items, view, wire, extra_bytes), deadline, client)
        batcher = served.batcher
        batcher.admit(len(missing), client)
        submitted = 0
        try:
            chars = sum(len(i.text) + len(i.text_pair or "") for i in missing)
            await off_loop_unless_small(chars <= INLINE_CHARS, self._tokenize, served, missing, truncate)
            for item in missing:
                item.kind = self.kind_for(keep, len(item.encoded), item.label, measures, item.encoded.truncated)
                self._fit_cache(served, item, keep, measures, view.format)
            lengths = [len(i.encoded) if i.run is None else i.run.n_tokens for i in items if i.kind == "weights"]
            self._check_cells(lengths, view)
            self._check_held(served, lengths)
            # Judged by the work ahead before it waits for bytes, and counted in it meanwhile.
            held = batcher.held_back(served.model, [i.encoded for i in missing], deadline, client)
            nbytes = self._held_bytes(served, items, view, wire, extra_bytes)
            try:
                grant = await self._reserve_timed(items, nbytes, deadline, client, held)
            except OverBudget:
                # Its time ran out waiting for the bytes its answers will hold: admitted inputs
                # dropped for that, as the queue's are (Batcher.expire).
                self.metrics.dropped.labels("expired").inc(len(missing))
                raise
            try:
                futures = batcher.submit(served.model, [i.encoded for i in missing], deadline, client, view.format,
                                         [i.kind == "qk" for i in missing], held=held)
            except BaseException:
                grant.release()
                raise
            submitted = len(missing)
        finally:
            batcher.release(len(missing) - submitted, client)
        try:
            await self._collect(served, items, missing, futures, view, truncate, deadline)
        except BaseException:
            grant.release()
            raise
        return grant

    async def _reserve_timed(self, items: list[Item], nbytes: int, deadline: float, client: str,
                             while_waiting: AbstractContextManager | None = None) -> Grant:
        started = time.perf_counter()
        grant = await self.reserve(nbytes, deadline, client, while_waiting)
        for item in items:
            item.timing["wait"] += time.perf_counter() - started
        return grant

    async def reserve(self, nbytes: int, deadline: float, client: str,
                      while_waiting: AbstractContextManager | None = None) -> Grant:
        """`nbytes` of the answers' budget (FairBytes), waited for until the request's deadline;
        `while_waiting` is entered only where it must wait, for the wait."""
        grant = self.answers.try_take(nbytes, client)
        if grant is not None:
            return grant
        try:
            with while_waiting or nullcontext():
                async with asyncio.timeout(deadline - time.monotonic()):
                    return await self.answers.take(nbytes, client)
        except TimeoutError:
            raise OverBudget(
                f"the request did not finish within its {self.settings.request_timeout_s:g} s budget: the answers "
                "this server is sending already hold the memory it keeps for them; retry shortly"
            ) from None

    def _held_bytes(self, served: Served, items: list[Item], view: View, wire: Wire,
                    extra_bytes: Callable[[Sequence[Token]], int] | None = None) -> int:
        """Each item's run (a cached one may be dropped from the cache meanwhile, and is held all
        the same), its answer and what the caller adds to it, reckoned before the forward pass as
        the cache reckons runs."""
        weight_bytes = KEPT_DTYPE[view.format].itemsize if served.batcher.device_quantise else 4
        total = 0
        for item in items:
            if item.run is not None:
                tokens, total = item.run.tokens, total + item.run.nbytes
            else:
                tokens = item.encoded.tokens
                total += run_bytes(served.model.info, len(tokens), item.kind, weight_bytes, served.qk_bytes)
            if item.kind == "weights":
                total += answer_bytes(view.cells(len(tokens)), view.format, wire.frame, tokens)
            if extra_bytes is not None:
                total += extra_bytes(tokens)
        return total

    async def _collect(self, served: Served, items: list[Item], missing: list[Item], futures, view: View,
                       truncate: bool, deadline: float) -> None:
        """The forward passes' results, as the items' runs, cached."""
        # At the deadline the batcher fails the answers not yet given (OverBudget, a 504) and drops
        # the inputs still queued as expired. Not asyncio.timeout: it cancelled the futures, which
        # the batcher takes for a client that hung up (every 504 was counted as cancelled).
        # A client that hangs up cancels this task, and with it the futures (counted as cancelled).
        expiry = asyncio.get_running_loop().call_later(
            max(deadline - time.monotonic(), 0.0), served.batcher.expire, futures,
            f"the request did not finish within its {self.settings.request_timeout_s:g} s budget; "
            "the server is busy or the input is long",
        )
        try:
            # Not asyncio.wait_for: when the client hung up, it left the gather's CancelledError
            # unretrieved, and the collector logged "exception was never retrieved" for each.
            # One future is awaited as it is: gather's own future cost a loop turn more.
            done: list[Done] = [await futures[0]] if len(futures) == 1 else await asyncio.gather(*futures)
        except BaseException:
            # One input's failure fails the request, and gather leaves the others' futures pending:
            # their inputs would stay queued, in their client's share, to be run for nobody.
            for future in futures:
                future.cancel()
            raise
        finally:
            expiry.cancel()
        for item, result in zip(missing, done):
            done_result = result.result
            # A weights run is read by the tile routes through a DenseAttention over its tensor.
            weights = done_result.attention
            if weights is not None and served.batcher.device_quantise and weights.dtype != KEPT_DTYPE[view.format]:
                # The batch kept a batch-mate's precision (json: float32); where that outgrows the
                # cache, this run keeps its own request's, the precision _fit_cache reckoned with.
                whole = run_bytes(served.model.info, len(done_result.tokens), "weights", weights.element_size(), served.qk_bytes)
                if whole > self.cache.max_bytes > 0:  # hundreds of MB by then: off the loop
                    weights = await run_in_threadpool(lambda w=weights: quantise(w.float(), view.format))
            kept = done_result.kept if item.kind == "qk" else DenseAttention(weights, dequantised(weights.dtype))
            item.run = Run(item.run_id, served.id, done_result.tokens, done_result.truncated,
                           weights, done_result.top_ids, done_result.top_probs, kept)
            item.timing.update(queue=result.queue_s, forward=result.forward_s)
            # Another request may have cached this id meanwhile (same text, another `keep` or
            # format): a run that serves more stays, as on a cache hit above.
            stored = self.cache.put(item.run, replaces=lambda cached, new=item.run: not covers(cached, new))
            if not stored and 0 < self.cache.max_bytes < item.run.nbytes:  # _fit_cache's reckoning fell short
                raise RunTooLarge(
                    f"{item.label}this input's run holds {item.run.nbytes / 2**20:,.0f} MiB, more than this server's run "
                    f"cache ({self.cache.max_bytes / 2**20:,.0f} MiB), so none of its routes could read it; send a "
                    "shorter text, or raise MANYEYES_CACHE_BYTES"
                )
        if self.run_directory is not None:
            await self.run_directory.remember([(i.run_id, (served.id, i.text, i.text_pair, truncate, i.tenant, i.kind, view.format))
                                               for i in missing])

    def _tokenize(self, served: Served, items: list[Item], truncate: bool) -> None:
        for item in items:
            started = time.perf_counter()
            try:
                item.encoded = served.model.encode(item.text, item.text_pair, truncate)
            except TooLongError as exc:
                raise TooLong.tokens(exc, item.label) from None
            check_some_tokens(served.id, item.encoded, item.text_pair is not None, item.label)
            item.timing["tokenize"] = time.perf_counter() - started

    async def _reply(self, served: Served, items: list[Item], view: View, batch: bool, wire: Wire,
                     top_k: int | None = None, client: str = "") -> Reply:
        cells = sum(view.cells(item.run.n_tokens) for item in items if item.kind == "weights")
        if self._renders_inline(cells, view, wire):
            body, encoding = self._render(served, items, view, batch, wire, top_k)
        else:
            started = time.perf_counter()
            async with self.renders.hold(client):
                for item in items:
                    item.timing["wait"] += time.perf_counter() - started
                body, encoding = await finished_off_loop(self._render, served, items, view, batch, wire, top_k)
        return self._replied(items, view, wire, body, encoding)

    def _replied(self, items: list[Item], view: View, wire: Wire, body: list[bytes], encoding: str | None) -> Reply:
        media_type, headers = negotiated(wire, view.format, encoding)
        if any(item.kind == "qk" for item in items):  # metadata and links only: JSON, whatever Accept asks
            media_type = "application/json"
        return Reply(body, media_type, self._log(items), headers)

    def _renders_inline(self, cells: int, view: View, wire: Wire) -> bool:
        """Small work, or a frame that needs no base64, text or compression (which take 10-50x
        as long a cell)."""
        if cells <= INLINE_CELLS:
            return True
        nbytes = cells * KEPT_DTYPE[view.format].itemsize
        return wire.frame and cells <= INLINE_FRAME_CELLS and not self.compression.choose(wire.accept_encoding, nbytes, False)

    def _render(self, served: Served, items: list[Item], view: View, batch: bool, wire: Wire,
                top_k: int | None = None) -> tuple[list[bytes], str | None]:
        info = served.model.info
        found = [predictions_body(served.model, item.run, top_k) for item in items]
        if items[0].kind == "qk":  # never in a batch (kind_for); always JSON
            body, text = render_kept(items[0].run, info, view, items[0].timing, found[0]), True
        elif wire.frame:
            body, text = render_frame([(item.run, item.timing, p) for item, p in zip(items, found)], info, view, batch), False
        else:
            body = join_results([render_result(item.run, info, view, item.timing, p) for item, p in zip(items, found)], batch)
            text = view.format == "json"
        return self.compression.encode(wire.accept_encoding, body, text)

    async def compress_text(self, pieces: list[bytes], accept_encoding: str | None,
                            client: str = "") -> tuple[list[bytes], str | None]:
        """JSON text a route finished itself, compressed by the rules `_render` follows (the
        attention routes' answers skip GZipMiddleware): off the loop, as it can be tens of MB,
        and in a render slot, as `_reply` compresses."""
        if self.compression.choose(accept_encoding, sum(len(p) for p in pieces), True) is None:
            return pieces, None  # no slot, no hop for what goes out as it is
        async with self.renders.hold(client):
            return await run_in_threadpool(self.compression.encode, accept_encoding, pieces, True)

    @staticmethod
    def _log(items: list[Item]) -> dict:
        return {
            "run_id": [i.run_id for i in items] if len(items) > 1 else items[0].run_id,
            "timing_ms": [{k: round(v * 1000, 2) for k, v in i.timing.items()} for i in items],
        }
