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

import base64
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import orjson
import torch
from starlette.concurrency import run_in_threadpool

from manyeyes.app.services.attention import (
    AttentionService,
    cells_bytes,
    finished_off_loop,
    resolve_indices,
    tokens_bytes,
)
from manyeyes.app.services.cache import Run, RunCache
from manyeyes.app.services.errors import InvalidInput, QueueFull, TooManyCells
from manyeyes.app.services.payload import as_bytes, to_f16
from manyeyes.app.services.registry import Served
from manyeyes.app.services.slots import CountedSlots, Grant
from manyeyes.model import measures as m
from manyeyes.model.analysis import value_weighted_norms
from manyeyes.model.runtime import AttentionResult
from manyeyes.model.tokenizer import Encoded

MATRIX_MEASURES = ("rollout", "value_norms", "contributions", "words", "heads")
NEEDS_CAPTURE = {"value_norms", "contributions"}
CAPTURE_SHARE = 4  # captures get 1/4 of MANYEYES_CACHE_BYTES in their own LRU, the runs the rest
CAPTURE_SLOTS = 2  # captured forwards at once; beyond, 429
# Flow routes cost O(L · T² · d_model), several forward passes at T=512: one at a time, beyond 429.
FLOW_SLOTS = 1
# Graphs kept as their JSON, the most recent within this many bytes: MiniLM's at T=512 takes 0.6 s
# of compute (seconds under load), and the page asks for the same one each time its flow view
# opens. One is 0.7 MB at T=507 and threshold 0.01 (10,885 edges), at most 20 MB (100 edges a
# target and layer); a run the cache evicted is a 404 first, graph or no graph.
FLOW_CACHE_BYTES = 32 << 20


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


def pick(tensor: torch.Tensor, layers: list[int], heads: list[int]) -> torch.Tensor:
    """(L, H, ...) -> (L', H', ...)."""
    return tensor.index_select(0, torch.tensor(layers)).index_select(1, torch.tensor(heads))


class MeasuresService:
    def __init__(self, attention: AttentionService) -> None:
        self.attention = attention
        self.settings = attention.settings
        self.captures = RunCache(attention.settings.cache_bytes // CAPTURE_SHARE)
        self._slots = CountedSlots(CAPTURE_SLOTS, attention.metrics.work_running.labels("capture"))
        self._flow_slots = CountedSlots(FLOW_SLOTS, attention.metrics.work_running.labels("flow"))
        self._capturing: dict[str, list] = {}
        self._guard = threading.Lock()
        self._flows: OrderedDict[tuple[str, float], bytes] = OrderedDict()

    # ------------------------------------------------------------------ lookups
    def run(self, run_id: str) -> tuple[Run, Served]:
        run = self.attention.cached(run_id, "the measures routes (measures, flow, neuron, logit-attribution)")
        return run, self.attention.registry.get(run.model)

    def _capture(self, run: Run, served: Served) -> Captured:
        """The run's captured forward, from the LRU or made now (on a worker thread). Requests
        for one run wait for one forward and hold no slot while they wait: the page asks for a
        run's flow, neuron view and value norms at once."""
        found = self._usable(self.captures.get(run.run_id), run)
        if found is not None:
            return found
        with self._guard:
            entry = self._capturing.setdefault(run.run_id, [threading.Lock(), 0])  # [lock, waiters]
            entry[1] += 1
        try:
            with entry[0]:
                found = self._usable(self.captures.get(run.run_id), run)
                if found is not None:
                    return found
                if not self._slots.acquire():
                    raise QueueFull(f"{CAPTURE_SLOTS} captured runs are already being computed; retry shortly", 1)
                try:
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
                finally:
                    self._slots.release()
        finally:
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    self._capturing.pop(run.run_id, None)

    def weights(self, run: Run, served: Served) -> torch.Tensor:
        """The run's (L, H, T, T) weights as the model made them, float32: its own, or for a run
        quantised on the device (u8/f16, as a GPU server keeps them) its capture's, made once.
        Measures and means of u8 bytes lose every weight under 1/510 (most of a long row)."""
        return run.attention if full_precision(run) else self._capture(run, served).attention

    @staticmethod
    def _usable(found: Captured | None, run: Run) -> Captured | None:
        """A capture that can stand in for this run: one without weights of its own serves only a
        run whose cached weights are float32."""
        return found if found is not None and (found.attention is not None or full_precision(run)) else None

    def _cells_check(self, cells: int, fmt: str) -> None:
        if fmt == "json" and cells > self.settings.max_json_cells:
            raise TooManyCells(
                f"format=json would return {cells:,} values, over this server's limit of "
                f"{self.settings.max_json_cells:,}; ask for format=u8 or f16, or fewer layers/heads"
            )

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

    async def matrices(self, run: Run, served: Served, names: list[str], layers, heads, fmt: str,
                       client: str = "", reserve: bool = True) -> tuple[bytes, Grant | None]:
        """The `measures` object of a response (each asked name, one of MATRIX_MEASURES as the
        schemas check, -> its result) as JSON, and its bytes in the answers' budget, which the
        caller hands to the response that sends it (none when `reserve` is false: the caller's
        grant has them already). Of the run itself, not looked up again by id: the cache may have
        dropped it meanwhile, or (MANYEYES_CACHE_BYTES=0) never kept it."""
        names, layers, heads, nbytes = self._planned(served, names, layers, heads, fmt, run.tokens)
        # The answer's bytes first (as for POST /attention), then a render slot: each of these
        # builds tensors the size of the run's weights (value norms: 75 MB at T=512), and 16 at
        # once tripled the memory bound. Encoded in the slot: the matrices and their text are
        # twice the answer, and only the text leaves it, held by the grant until it is sent.
        work = (self._encoded, run, served, names, layers, heads, fmt)
        if not reserve:
            async with self.attention.renders.hold(client):
                return await finished_off_loop(*work), None
        async with self.attention.bytes_then_slot(nbytes, client) as grant:
            return await finished_off_loop(*work), grant

    def _encoded(self, run: Run, served: Served, names, layers, heads, fmt) -> bytes:
        return orjson.dumps(self._matrices(run, served, names, layers, heads, fmt), option=orjson.OPT_SERIALIZE_NUMPY)

    def _matrices(self, run: Run, served: Served, names, layers, heads, fmt) -> dict:
        model = served.model
        raw = self._capture(run, served) if NEEDS_CAPTURE & set(names) else None
        captured = raw.with_weights(run) if raw is not None else None
        # The capture's float32 weights when it was made anyway: a capture that did not fit its LRU
        # would otherwise be made a second time by weights().
        weights = captured.attention if captured is not None else self.weights(run, served)
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
        as its own piece: no joined copy). Their bytes were reckoned with the answer's (reckoner)."""
        served = self.attention.registry.get(run.model)
        measures, _ = await self.matrices(run, served, names, options.layers, options.heads, options.format, client,
                                          reserve=False)
        return [*pieces[:-1], pieces[-1][:-1], b',"measures":', measures, b"}"]

    # ------------------------------------------------------------------ the parameterised ones
    async def flow(self, run_id: str, threshold: float) -> bytes:
        """The graph as JSON: serialised on the worker thread (20 MB at most), and kept so."""
        run, served = self.run(run_id)
        return await run_in_threadpool(self._flow, run, served, threshold)

    def _flow(self, run: Run, served: Served, threshold: float) -> bytes:
        key = (run.run_id, threshold)
        with self._guard:
            if key in self._flows:
                self._flows.move_to_end(key)
                return self._flows[key]
        captured = self._capture(run, served)
        if not self._flow_slots.acquire():
            raise QueueFull("an information-flow graph is already being computed; retry shortly", 2)
        try:
            edges = m.flow_edges(served.model, captured.with_weights(run), captured.inputs, threshold)
        finally:
            self._flow_slots.release()
        graph = orjson.dumps({
            "run_id": run.run_id,
            "threshold": threshold,
            "n_layers": run.attention.shape[0],
            "n_tokens": len(run.tokens),
            "edges": [{"layer": e.layer, "source": e.source, "target": e.target, "weight": round(e.weight, 6),
                       "head": e.head} for e in edges],
        })
        with self._guard:
            self._flows[key] = graph
            while sum(map(len, self._flows.values())) > FLOW_CACHE_BYTES:
                self._flows.popitem(last=False)
        return graph

    async def neuron(self, run_id: str, layer: int, head: int, query: int) -> dict:
        run, served = self.run(run_id)
        info = served.model.info
        resolve_indices([layer], info.n_layers, "layer", info.id)
        resolve_indices([head], info.n_heads, "head", info.id)
        resolve_indices([query], len(run.tokens), "query position", info.id, f"this run of {len(run.tokens):,} tokens")
        return await run_in_threadpool(self._neuron, run, served, layer, head, query)

    def _neuron(self, run: Run, served: Served, layer: int, head: int, query: int) -> dict:
        view = m.neuron_view(served.model, self._capture(run, served).with_weights(run), layer, head, query)
        info = served.model.info

        def rows(t: torch.Tensor):
            return [[round(float(x), 6) for x in row] for row in t.tolist()] if t.dim() == 2 else [round(float(x), 6) for x in t.tolist()]

        return {
            "run_id": run.run_id, "layer": layer, "head": head, "kv_head": view.kv_head,
            "n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads, "query_index": query,
            "query": rows(view.query), "keys": rows(view.keys), "products": rows(view.products),
            # -inf (a masked key) is not JSON: null says "masked" instead.
            "scores": [None if s == float("-inf") else round(s, 6) for s in view.scores.tolist()],
            # Six significant digits, not decimals: a weight of 4.6e-7 read 0 (and the page's
            # softmax column 0.0000) where its score said otherwise.
            "weights": [float(f"{w:.6g}") for w in view.weights.tolist()], "values": rows(view.values),
        }

    async def logits(self, run_id: str, position: int, target: int | None, top: int) -> dict:
        run, served = self.run(run_id)
        try:
            m.check_attributable(served.model)
        except ValueError as exc:
            raise InvalidInput(f"model {served.id}: {exc}") from None
        resolve_indices([position], len(run.tokens), "position", served.id, f"this run of {len(run.tokens):,} tokens")
        vocab = served.model.net.out_head.weight.shape[0]
        if target is not None and not 0 <= target < vocab:
            raise InvalidInput(f"target must be a token id in 0..{vocab - 1}")
        return await run_in_threadpool(self._logits, run, served, position, target, top)

    def _logits(self, run: Run, served: Served, position: int, target: int | None, top: int) -> dict:
        captured = self._capture(run, served)
        found = m.attribute_logit(served.model, captured.with_weights(run), captured.inputs, captured.final, position, target)
        ranked = found.ranked_heads()
        token = served.model.tokenizer.token_text(found.target)
        return {
            "run_id": run.run_id, "position": found.position, "target": found.target,
            "target_text": token, "target_piece": served.model.tokenizer.token_piece(found.target),
            "logit": found.logit, "total": found.total,
            "heads": [{"layer": layer, "head": head, "contribution": value} for layer, head, value in ranked[:top]],
            "attention_bias": found.attention_bias.tolist(), "mlps": found.mlps.tolist(),
            "embeddings": found.embeddings, "rest": found.rest,
        }
