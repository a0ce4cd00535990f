"""Measures beyond raw weights for cached runs: rollout, value norms, contributions, the word
view, head stats and tags, information flow, the neuron view and direct logit attribution.

The run cache keeps attention only. Measures that read the weights alone (rollout, words, head
stats) are computed from it with no forward pass. The others need values, queries and keys,
and the residual stream: those come from one captured forward of the run's own tokens, made
the first time such a measure is asked for and kept in a separate LRU bounded in bytes (a
capture is L × T × 6·d floats: q, k, v, the stream, out_proj's input and output; a fraction
of the T² weights). The batcher's forward keeps none of that: most runs never ask for these,
and a capture with the stream costs more than a plain forward.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import orjson
import torch

from manyeyes.app.services.attention import (
    AttentionService,
    Reply,
    cells_bytes,
    finished_off_loop,
    resolve_indices,
    tokens_bytes,
)
from manyeyes.app.services.cache import Run, RunCache
from manyeyes.app.services.errors import InvalidInput, QueueFull, TooManyCells
from manyeyes.app.services.payload import as_bytes, to_f16
from manyeyes.app.services.registry import Served
from manyeyes.app.services.slots import CountedSlots, FairSlots, Grant
from manyeyes.model import measures as m
from manyeyes.model.analysis import value_weighted_norms
from manyeyes.model.runtime import AttentionResult
from manyeyes.model.tokenizer import Encoded

MATRIX_MEASURES = ("rollout", "value_norms", "contributions", "words", "heads")
NEEDS_CAPTURE = {"value_norms", "contributions"}
CAPTURE_SHARE = 4  # captures get 1/4 of MANYEYES_CACHE_BYTES in their own LRU, the runs the rest
CAPTURE_SLOTS = 2  # captured forwards at once; beyond, 429
# Flow routes cost O(L · T² · d_model), several forward passes at T=512: one at a time, the turns
# round-robin across clients, waiting in the render queue (its bounds, its 429s).
FLOW_SLOTS = 1
# Graphs kept as their JSON, the most recent within this many bytes: MiniLM's at T=512 takes 0.6 s
# of compute (seconds under load), and the page asks for the same one each time its flow view
# opens. One is 0.7 MB at T=507 and threshold 0.01 (10,885 edges), at most 20 MB (100 edges a
# target and layer); a run the cache evicted is a 404 first, graph or no graph.
FLOW_CACHE_BYTES = 32 << 20
# An edge's JSON at its longest: {"layer":47,"source":99999,"target":99999,"weight":0.999999,"head":127},
FLOW_EDGE_BYTES = 80
ROUTES = "the measures routes (measures, flow, neuron, logit-attribution)"


@dataclass(frozen=True)
class Captured:
    run_id: str
    # Kept without its (T, vocab) logits and without its weights: those are the cached run's
    # (same tokens, same forward), joined back by `with_weights`, never held twice.
    result: AttentionResult
    inputs: list[torch.Tensor]  # (T, d_model) per layer: the stream entering each block
    final: torch.Tensor | None  # (T, d_model): the stream entering the final norm
    # Per layer, out_proj's input (T, n_heads * head_dim) and output (T, d_model): contributions
    # read them instead of mixing the values again.
    mixed: list[torch.Tensor]
    outputs: list[torch.Tensor]
    # The capture's own float32 weights, kept only when the cached run's are quantised (u8 or f16,
    # as a GPU server keeps them): measures read the model's weights, not a transport format's.
    attention: torch.Tensor | None = None

    def with_weights(self, run: Run) -> AttentionResult:
        return replace(self.result, attention=self.attention if self.attention is not None else run.attention)

    @property
    def nbytes(self) -> int:
        r = self.result
        tensors = [r.hidden, *r.queries, *r.keys, *r.values, *self.inputs, *self.mixed, *self.outputs]
        tensors += [t for t in (self.final, self.attention) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def encode_matrix(values: torch.Tensor, fmt: str) -> dict:
    """A measure's tensor in the attention formats. Measures are not weights in [0, 1], so u8
    carries its own affine map: value ≈ offset + byte × scale."""
    values = values.float().contiguous()
    out = {"format": fmt, "dtype": {"json": "float32", "f16": "float16", "u8": "uint8"}[fmt], "shape": list(values.shape)}
    if fmt == "json":
        out["data"] = values.numpy()
        return out
    if fmt == "f16":
        out["data"] = base64.b64encode(to_f16(values)).decode("ascii")
        return out
    low = min(float(values.min()), 0.0) if values.numel() else 0.0
    high = float(values.max()) if values.numel() else 1.0
    scale = (high - low) / 255 if high > low else 1 / 255
    # One float32 temporary the size of the values (75 MB for value norms at T=512), not two, and
    # base64 reads the bytes where they are.
    raw = values.sub(low).div_(scale).round_().clamp_(0, 255).to(torch.uint8)
    out.update(data=base64.b64encode(as_bytes(raw.numpy())).decode("ascii"), scale=scale, offset=low)
    return out


# Beside the matrices, a measures answer's JSON carries a word list (as long as the tokens'), the
# head table's rows, and a little more.
HEAD_ROW_BYTES = 320  # ~200: 8 stats, its tags, layer and head
ANSWER_FRAME_BYTES = 16 * 1024


def measures_bytes(cells: int, fmt: str, tokens, names: list[str], rows: int) -> int:
    """The `measures` object's JSON, reckoned before it is made, for the answers' budget: `cells`
    values (base64 of their bytes in u8/f16, about 15 characters each in json), the word list,
    `rows` head-table rows."""
    total = cells_bytes(cells, fmt) + ANSWER_FRAME_BYTES
    if "words" in names:
        total += tokens_bytes(tokens)
    if "heads" in names:
        total += HEAD_ROW_BYTES * rows
    return total


def full_precision(run: Run) -> bool:
    return run.attention.dtype == torch.float32


def float_weights(run: Run, captured: Captured | None) -> torch.Tensor:
    """The run's (L, H, T, T) weights as the model made them, float32: its own, or for a run
    quantised on the device (u8/f16, as a GPU server keeps them) its capture's, which
    MeasuresService.in_turn makes for it. Measures and means of u8 bytes lose every weight under
    1/510 (most of a long row)."""
    return run.attention if captured is None else captured.with_weights(run).attention


def pick(tensor: torch.Tensor, layers: list[int], heads: list[int]) -> torch.Tensor:
    """(L, H, ...) -> (L', H', ...)."""
    return tensor.index_select(0, torch.tensor(layers)).index_select(1, torch.tensor(heads))


async def outlived(making: asyncio.Future) -> None:
    """Waits for what another request is making. Not `await making`: a waiter that hangs up would
    cancel it for every other waiter, and for its maker."""
    await asyncio.wait([making])


def replied(pieces: list[bytes], log: dict, grant: Grant | None, media_type: str = "application/json") -> Reply:
    """An answer that holds its bytes in the answers' budget until it is sent (a flow graph
    served from FLOW_CACHE_BYTES holds none)."""
    reply = Reply(pieces, media_type, log)
    if grant is not None:
        reply.own(grant)
    return reply


class MeasuresService:
    def __init__(self, attention: AttentionService) -> None:
        self.attention = attention
        self.settings = attention.settings
        self.captures = RunCache(attention.settings.cache_bytes // CAPTURE_SHARE)
        self._slots = CountedSlots(CAPTURE_SLOTS, attention.metrics.work_running.labels("capture"))
        # A flow graph at a time, in turns across clients: a 429 for any second one let a client
        # that asked again at once keep the route for good (another's got 36 429s in 36, review h50a).
        self._flow_turns = FairSlots(FLOW_SLOTS)
        self._flow_running = attention.metrics.work_running.labels("flow")
        # Run id -> the capture being made of it, which other requests for that run await.
        self._capturing: dict[str, asyncio.Future] = {}
        self._flows: OrderedDict[tuple[str, float], bytes] = OrderedDict()
        self._flows_making: dict[tuple[str, float], asyncio.Future] = {}  # the graphs on their way

    # ------------------------------------------------------------------ lookups
    def run(self, run_id: str) -> tuple[Run, Served]:
        run = self.attention.cached(run_id, ROUTES)
        return run, self.attention.registry.get(run.model)

    async def in_turn(self, run_id: str, nbytes: int, client: str, capture: bool, work, *args,
                      needs_weights: str = ROUTES, turn: FairSlots | None = None) -> tuple[object, Grant]:
        """(work(run, served, captured, *args) run on a worker thread, the grant of its answer's
        `nbytes`), waited for as a tile waits (TileService._answer): admitted to the render queue
        (429 beyond its bounds), then the bytes, then a render slot, all round-robin across
        clients. Until the slot is held the request holds the run's id, not the run: 30 /mean
        requests waiting on runs the cache then evicted held 500 MB beyond a 72 MiB cache. The run
        is read again in the slot (404 if it went meanwhile: still_cached, with no format, as
        measures read float32 weights whatever the run kept). `captured` is the run's captured
        forward where `capture` asks for it or the run is quantised (float_weights), else None.
        `turn`: a kind of work's own slots, held first (queued_with_bytes)."""
        making = self._capturing.get(run_id)
        if capture and making is not None:
            # Another request is making this run's capture: waited for in a render slot, it held the
            # slot idle for the capture's length (h50g). Waited for here, it is in the LRU by the turn.
            await outlived(making)
        async with self.attention.queued_with_bytes(nbytes, client, turn) as grant:
            run = self.attention.still_cached(run_id, None, needs_weights)
            served = self.attention.registry.get(run.model)
            captured = await self._captured_for(run, served, capture)
            return await finished_off_loop(work, run, served, captured, *args), grant

    async def _captured_for(self, run: Run, served: Served, capture: bool) -> Captured | None:
        return await self._captured(run, served) if capture or not full_precision(run) else None

    async def _captured(self, run: Run, served: Served) -> Captured:
        """The run's captured forward, from the LRU or made now on a worker thread; called in a
        render slot. Requests for one run wait for one forward, on the event loop: the page asks
        for a run's flow, neuron view and value norms at once, and each waiter blocked a thread of
        the pool everything else renders on (80 /neuron requests for one run held another
        client's POST up from 0.3 s to 7.6 s)."""
        while True:
            found = self._usable(self.captures.get(run.run_id), run)
            if found is not None:
                return found
            making = self._capturing.get(run.run_id)
            if making is None:
                break
            await outlived(making)
            # Failed or abandoned (its capture, if made, is in the LRU), or made for a float32 run
            # this one cannot use: look again, and make it if nobody is.
            found = None if making.cancelled() else self._usable(making.result(), run)
            if found is not None:
                return found
        if not self._slots.acquire():
            raise QueueFull(f"{CAPTURE_SLOTS} captured runs are already being computed; retry shortly", 1)
        making = self._capturing[run.run_id] = asyncio.get_running_loop().create_future()
        try:
            captured = await finished_off_loop(self._capture, run, served)
        except BaseException:
            making.cancel()
            raise
        finally:
            del self._capturing[run.run_id]
            self._slots.release()
        making.set_result(captured)
        return captured

    def _capture(self, run: Run, served: Served) -> Captured:
        model = served.model
        type_emb = getattr(model.net, "type_emb", None)
        n_types = type_emb.num_embeddings if type_emb is not None else 1
        encoded = Encoded(run.tokens, [min(t.segment, n_types - 1) for t in run.tokens], run.truncated)
        stream = m.capture_stream(model, encoded)
        own = None if full_precision(run) else stream.result.attention
        captured = Captured(run.run_id, replace(stream.result, logits=None, attention=None),
                            stream.inputs, stream.final, stream.mixed, stream.outputs, own)
        self.captures.put(captured)
        return captured

    @staticmethod
    def _usable(found: Captured | None, run: Run) -> Captured | None:
        """A capture that can stand in for this run: one without weights of its own serves only a
        run whose cached weights are float32."""
        return found if found is not None and (found.attention is not None or full_precision(run)) else None

    def _cells_check(self, cells: int, fmt: str) -> None:
        if fmt == "json" and cells > self.settings.max_json_cells:
            raise TooManyCells.json(cells, self.settings.max_json_cells)

    # ------------------------------------------------------------------ the matrix measures
    def _planned(self, served: Served, names: list[str], layers, heads, fmt: str, tokens) -> tuple[list, list, list, int]:
        """(names, each once; layers; heads; the answer's bytes) for a run of these tokens, or the
        413 for json beyond max_json_cells."""
        names = list(dict.fromkeys(names))  # a repeated name is answered once, never twice
        info = served.model.info
        layers = resolve_indices(layers, info.n_layers, "layer", info.id)
        heads = resolve_indices(heads, info.n_heads, "head", info.id)
        n, per_head = len(tokens), len(layers) * len(heads)
        cells = {"rollout": n * n, "value_norms": per_head * n * n, "contributions": 2 * per_head * n + len(layers) * n,
                 "words": per_head * n * n, "heads": 0}
        asked_cells = sum(cells[name] for name in names)
        self._cells_check(asked_cells, fmt)
        return names, layers, heads, measures_bytes(asked_cells, fmt, tokens, names, per_head)

    def reckoner(self, model: str, names: list[str], layers, heads, fmt: str):
        """tokens -> the bytes of these measures of a run of those tokens: for POST /attention,
        which reckons them with its answer's own (AttentionService.attend's extra_bytes)."""
        served = self.attention.registry.get(model)
        return lambda tokens: self._planned(served, names, layers, heads, fmt, tokens)[3]

    def _matrices_plan(self, run_id: str, names: list[str], layers, heads, fmt: str) -> tuple[str, list, list, list, int]:
        """(model, then _planned's plan) of a request checked against its run, which it does not
        return: the awaiting caller never holds the run (in_turn)."""
        run, served = self.run(run_id)
        return run.model, *self._planned(served, names, layers, heads, fmt, run.tokens)

    async def measures(self, run_id: str, names: list[str], layers, heads, fmt: str, client: str = "") -> Reply:
        """GET /runs/{run_id}/measures: the `measures` object (each asked name, one of
        MATRIX_MEASURES as the schemas check, -> its result) and what it is of. Each measure
        builds tensors the size of the run's weights (value norms: 75 MB at T=512), and 16 at once
        tripled the memory bound: they are made in a render slot (in_turn), and encoded there, as
        the matrices and their text are twice the answer and only the text leaves it."""
        model, names, layers, heads, nbytes = self._matrices_plan(run_id, names, layers, heads, fmt)
        measures, grant = await self.in_turn(run_id, nbytes, client, bool(NEEDS_CAPTURE & set(names)), self._encoded,
                                             names, layers, heads, fmt)
        head = orjson.dumps({"run_id": run_id, "model": model, "layers": layers, "heads": heads})
        # The measures as they were encoded (tens of MB at T=512), a piece of their own: no joined copy.
        return replied([head[:-1], b',"measures":', measures, b"}"], {"run_id": run_id}, grant)

    def _encoded(self, run: Run, served: Served, captured: Captured | None, names, layers, heads, fmt) -> bytes:
        return orjson.dumps(self._matrices(run, served, captured, names, layers, heads, fmt),
                            option=orjson.OPT_SERIALIZE_NUMPY)

    def _matrices(self, run: Run, served: Served, raw: Captured | None, names, layers, heads, fmt) -> dict:
        model = served.model
        captured = raw.with_weights(run) if raw is not None else None
        weights = float_weights(run, raw)
        out = {}
        for name in names:
            if name == "rollout":
                out[name] = encode_matrix(m.rollout(weights), fmt)
            elif name == "value_norms":
                out[name] = encode_matrix(value_weighted_norms(model, captured, layers, heads), fmt)
            elif name == "contributions":
                found = m.contributions(model, captured, raw.mixed, raw.outputs)
                out[name] = {
                    "norms": encode_matrix(pick(found.norms, layers, heads), fmt),
                    "shares": encode_matrix(pick(found.shares, layers, heads), fmt),
                    "bias_shares": encode_matrix(found.bias_shares.index_select(0, torch.tensor(layers)), fmt),
                }
            elif name == "words":
                words, merged = m.merge_words(run.tokens, pick(weights, layers, heads))  # per head: pick first
                out[name] = {
                    "words": [{"text": w.text, "start": w.start, "end": w.end, "segment": w.segment,
                               "special": w.special, "pieces": list(w.pieces)} for w in words],
                    "attention": encode_matrix(merged, fmt),
                }
            else:
                out[name] = self._heads(replace(run, attention=weights), served, layers, heads)
        return out

    @staticmethod
    def _heads(run: Run, served: Served, layers: list[int], heads: list[int]) -> dict:
        stats, tags = m.head_table(served.model, run)  # every head's; the rows follow the request's choice
        return {
            "stats": list(m.STAT_NAMES) + ["induction"],
            "rows": [
                {"layer": layer, "head": head, "tags": tags[layer][head],
                 "stats": {name: round(float(value[layer, head]), 6) for name, value in stats.items()}}
                for layer in layers for head in heads
            ],
            "thresholds": {tag: {"stat": stat, "at_least": value} for tag, (stat, value) in m.TAG_THRESHOLDS.items()},
            "positional_share": m.POSITIONAL_SHARE,
        }

    async def attach(self, pieces: list[bytes], run: Run, names: list[str], options, client: str = "") -> list[bytes]:
        """POST /attention's pieces with a `measures` member added before the closing brace (sent
        as its own piece: no joined copy). Of the run itself, not looked up again by id: the cache
        may have dropped it meanwhile, or (MANYEYES_CACHE_BYTES=0) never kept it; the answer's
        grant holds its bytes, and those of the measures (reckoner). Made and encoded in a render
        slot, as GET /measures makes them."""
        served = self.attention.registry.get(run.model)
        names, layers, heads, _ = self._planned(served, names, options.layers, options.heads, options.format, run.tokens)
        async with self.attention.renders.hold(client):
            captured = await self._captured_for(run, served, bool(NEEDS_CAPTURE & set(names)))
            measures = await finished_off_loop(self._encoded, run, served, captured, names, layers, heads, options.format)
        return [*pieces[:-1], pieces[-1][:-1], b',"measures":', measures, b"}"]

    # ------------------------------------------------------------------ the parameterised ones
    # Each is checked against its run, then waits its turn holding the run's id (in_turn), as
    # /measures does: they had gone straight to the thread pool, with no slot, share or 429.
    def _checked(self, run_id: str) -> tuple[Served, int]:
        """(served, the run's tokens) for a request's checks; the run itself is not returned (in_turn)."""
        run, served = self.run(run_id)
        return served, run.n_tokens

    async def flow(self, run_id: str, threshold: float, client: str = "") -> Reply:
        """The graph as JSON: serialised on the worker thread, and kept so."""
        served, n_tokens = self._checked(run_id)  # a run the cache evicted is a 404, graph or no graph
        key = (run_id, threshold)
        # One graph made for every request of it at once: each waiting its turn made it again (a
        # class opening one link, one graph made once a student, h50g).
        # The maker hands its graph to those waiting: one larger than FLOW_CACHE_BYTES is not kept,
        # and each waiter made it again in turn.
        graph = self._flows.get(key)
        while graph is None and (making := self._flows_making.get(key)) is not None:
            await outlived(making)
            graph = making.result()  # None: it failed, and this one makes it
        if graph is not None and key in self._flows:
            self._flows.move_to_end(key)
            return replied([graph], {"run_id": run_id}, None)  # kept: counted once, in FLOW_CACHE_BYTES
        if graph is not None:
            # Handed over and not kept: held in the answers' budget until sent, as its maker's is.
            deadline = time.monotonic() + self.settings.request_timeout_s
            return replied([graph], {"run_id": run_id}, await self.attention.reserve(len(graph), deadline, client))
        # A target's edges a layer: its sources and the residual, those of share ≥ threshold at most;
        # at most half the answers' budget, the most a client holds (a 32-layer model's reckoning,
        # 250 MiB for a graph of a few, went alone and held every other client's bytes up).
        edges = served.model.info.n_layers * n_tokens * min(n_tokens + 1, int(1 / threshold) + 1)
        nbytes = edges * FLOW_EDGE_BYTES + ANSWER_FRAME_BYTES
        if self.attention.answers.limit:
            nbytes = min(nbytes, self.attention.answers.limit // 2)
        making = self._flows_making[key] = asyncio.get_running_loop().create_future()
        # A graph its client hung up on is made all the same (the worker thread cannot be stopped,
        # and the cancel waits for it: finished_off_loop): it was thrown away, and those waiting
        # for it made it again, seconds each.
        made: list[bytes] = []

        def make(*args) -> bytes:
            made.append(self._flow(*args))
            return made[0]

        try:
            graph, grant = await self.in_turn(run_id, nbytes, client, True, make, threshold, turn=self._flow_turns)
        finally:
            del self._flows_making[key]
            if made:
                self._flows[key] = made[0]
                while sum(map(len, self._flows.values())) > FLOW_CACHE_BYTES:
                    self._flows.popitem(last=False)
            making.set_result(made[0] if made else None)
        return replied([graph], {"run_id": run_id}, grant)

    def _flow(self, run: Run, served: Served, captured: Captured, threshold: float) -> bytes:
        self._flow_running.inc()
        try:
            edges = m.flow_edges(served.model, captured.with_weights(run), captured.inputs, threshold)
        finally:
            self._flow_running.dec()
        return orjson.dumps({
            "run_id": run.run_id,
            "threshold": threshold,
            "n_layers": run.attention.shape[0],
            "n_tokens": len(run.tokens),
            "edges": [{"layer": e.layer, "source": e.source, "target": e.target, "weight": round(e.weight, 6),
                       "head": e.head} for e in edges],
        })

    async def neuron(self, run_id: str, layer: int, head: int, query: int, client: str = "") -> Reply:
        served, n_tokens = self._checked(run_id)
        info = served.model.info
        resolve_indices([layer], info.n_layers, "layer", info.id)
        resolve_indices([head], info.n_heads, "head", info.id)
        resolve_indices([query], n_tokens, "query position", info.id, f"this run of {n_tokens:,} tokens")
        # The query, then each key's k, q ⊙ k and v, score and weight.
        numbers = info.head_dim + n_tokens * (3 * info.head_dim + 2)
        pieces, grant = await self.in_turn(run_id, cells_bytes(numbers, "json") + ANSWER_FRAME_BYTES, client, True,
                                           self._neuron, layer, head, query)
        return replied(pieces, {"run_id": run_id}, grant)

    def _neuron(self, run: Run, served: Served, captured: Captured, layer: int, head: int, query: int) -> list[bytes]:
        view = m.neuron_view(served.model, captured.with_weights(run), layer, head, query)
        info = served.model.info

        def rows(t: torch.Tensor):
            return [[round(float(x), 6) for x in row] for row in t.tolist()] if t.dim() == 2 else [round(float(x), 6) for x in t.tolist()]

        return [orjson.dumps({
            "run_id": run.run_id, "layer": layer, "head": head, "kv_head": view.kv_head,
            "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads, "query_index": query,
            "query": rows(view.query), "keys": rows(view.keys), "products": rows(view.products),
            # -inf (a masked key) is not JSON: null says "masked" instead.
            "scores": [None if s == float("-inf") else round(s, 6) for s in view.scores.tolist()],
            # Six significant digits, not decimals: a weight of 4.6e-7 read 0 (and the page's
            # softmax column 0.0000) where its score said otherwise.
            "weights": [float(f"{w:.6g}") for w in view.weights.tolist()], "values": rows(view.values),
        }, option=orjson.OPT_SERIALIZE_NUMPY)]

    async def logits(self, run_id: str, position: int, target: int | None, top: int, client: str = "") -> Reply:
        served, n_tokens = self._checked(run_id)
        try:
            m.check_attributable(served.model)
        except ValueError as exc:
            raise InvalidInput(f"model {served.id}: {exc}") from None
        resolve_indices([position], n_tokens, "position", served.id, f"this run of {n_tokens:,} tokens")
        vocab = served.model.net.out_head.weight.shape[0]
        if target is not None and not 0 <= target < vocab:
            raise InvalidInput(f"target must be a token id in 0..{vocab - 1}")
        info = served.model.info
        # The ranked heads as head-table rows are reckoned, and a few numbers a layer.
        nbytes = HEAD_ROW_BYTES * min(top, info.n_layers * info.n_heads) + cells_bytes(2 * info.n_layers, "json")
        pieces, grant = await self.in_turn(run_id, nbytes + ANSWER_FRAME_BYTES, client, True,
                                           self._logits, position, target, top)
        return replied(pieces, {"run_id": run_id}, grant)

    def _logits(self, run: Run, served: Served, captured: Captured, position: int, target: int | None, top: int) -> list[bytes]:
        found = m.attribute_logit(served.model, captured.with_weights(run), captured.inputs, captured.final, position, target)
        ranked = found.ranked_heads()
        token = served.model.tokenizer.token_text(found.target)
        return [orjson.dumps({
            "run_id": run.run_id, "position": found.position, "target": found.target,
            "target_text": token, "target_piece": served.model.tokenizer.token_piece(found.target),
            "logit": found.logit, "total": found.total,
            "heads": [{"layer": layer, "head": head, "contribution": value} for layer, head, value in ranked[:top]],
            "attention_bias": found.attention_bias.tolist(), "mlps": found.mlps.tolist(),
            "embeddings": found.embeddings, "rest": found.rest,
        }, option=orjson.OPT_SERIALIZE_NUMPY)]
