"""Experiments over HTTP: ablate heads, change a token, compare two texts.

Each request runs two forwards plus its ranking on a worker thread, never on the event loop. At
most `max_experiments` run at once (beyond it, 429), each within the request time budget (else
504); a slot is held until its thread's work has really ended, so clients that hang up or time
out cannot pile up work behind the server's back. Before that, the answer's bytes are reckoned
from the tokenized texts and granted from the answers' budget (MANYEYES_ANSWER_BYTES), held until
the answer has been sent.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import threading
import time

import orjson
import torch
from starlette.concurrency import run_in_threadpool

from manyeyes.app.config import Settings
from manyeyes.app.memory import release_free_heap
from manyeyes.app.services.attention import (
    ANSWER_FIELDS_BYTES,
    INLINE_CHARS,
    AttentionService,
    cells_bytes,
    check_some_tokens,
    off_loop_unless_small,
    resolve_indices,
    tokens_bytes,
)
from manyeyes.app.services.errors import InvalidInput, KeptQK, OverBudget, QueueFull, TooLong, TooManyCells
from manyeyes.app.services.payload import token_dicts
from manyeyes.app.services.registry import Registry, Served
from manyeyes.app.services.slots import CountedSlots, Grant
from manyeyes.model.buffers import trim_kept_mappings_soon
from manyeyes.model.errors import TooLongError
from manyeyes.model.experiments import Ablation, Comparison, ablate, changed_tokens, compare_results, validate_ablations
from manyeyes.model.tokenizer import Encoded

NUMPY = orjson.OPT_SERIALIZE_NUMPY
DTYPES = {"json": "float32", "f16": "float16", "u8": "uint8"}


def ranking_dicts(ranking) -> list[dict]:
    return [{"layer": c.layer, "head": c.head, "divergence": c.divergence} for c in ranking]


def guesses(rows) -> list[list[dict]]:
    return [[{"token": g.token, "id": g.id, "prob": g.prob, "piece": g.piece} for g in row] for row in rows]


def tensor_out(values: torch.Tensor, layers: list[int], heads: list[int], fmt: str, signed: bool) -> dict:
    """(L, H, R, C) float32 as json lists or base64; u8 maps [0, 1] (weights) onto 0..255, or
    [-1, 1] (differences, `signed`) onto 0..254, so that byte 127 is exactly 0 (over 0..255 no
    byte was: two identical texts' difference read -0.0039, "B above A", in every cell): value ≈
    byte × scale + offset."""
    chosen = values.index_select(0, torch.tensor(layers)).index_select(1, torch.tensor(heads)).contiguous()
    out = {"format": fmt, "dtype": DTYPES[fmt], "shape": list(chosen.shape), "layers": layers, "heads": heads}
    if fmt == "json":
        out["data"] = chosen.numpy()
        return out
    if fmt == "f16":
        halves = chosen.to(torch.float16).numpy()
        out["data"] = base64.b64encode((halves.byteswap() if sys.byteorder != "little" else halves).tobytes()).decode()
        return out
    low, span, top = (-1.0, 2.0, 254) if signed else (0.0, 1.0, 255)
    scale = span / top
    raw = ((chosen - low) / scale).round_().clamp_(0, top).to(torch.uint8)
    out.update(data=base64.b64encode(raw.numpy().tobytes()).decode(), scale=scale, offset=low)
    return out


# An answer's JSON beyond its tokens and tensor, at its worst: a ranked head ({"layer", "head",
# "divergence"}), a guess of a prediction (its token's text escaped, id, probability), a position's
# change in log-probability, an aligned pair.
RANKED_HEAD_BYTES = 96
GUESS_BYTES = 384
LOGPROB_BYTES = 512
PAIR_BYTES = 24
CHANGED_TOKEN_BYTES = 1024  # the one token a change puts in (the model's mask or unknown piece)


def experiment_bytes(served: Served, tokens: list, view, rows: int, guesses: int = 0) -> int:
    """An experiment's answer, reckoned before its forwards for the answers' budget: `tokens` (one
    list per text), every head ranked, `guesses` predictions and log-probability changes per
    position (ablations on a model with an LM head), the aligned pairs, and the asked tensor of
    `rows` x `rows` cells per head (as an answer's weights)."""
    info = served.model.info
    total = sum(tokens_bytes(t) for t in tokens) + info.n_layers * info.n_heads * RANKED_HEAD_BYTES
    total += rows * (PAIR_BYTES + guesses * 2 * GUESS_BYTES + (LOGPROB_BYTES if guesses else 0))
    if view is not None:
        layers, heads, fmt = view
        total += cells_bytes(len(layers) * len(heads) * rows * rows, fmt)
    return total + ANSWER_FIELDS_BYTES


class ExperimentService:
    def __init__(self, settings: Settings, registry: Registry, attention: AttentionService) -> None:
        self.settings = settings
        self.registry = registry
        self.attention = attention  # its answers' budget: these answers hold their bytes there too
        self._slots = CountedSlots(settings.max_experiments, attention.metrics.work_running.labels("experiment"))

    # ------------------------------------------------------------------ routes' entry points
    # Each returns the answer's JSON and its bytes in the answers' budget, for the response that
    # sends it. The texts are tokenized first, so that the answer is reckoned before its forwards.
    async def ablate(self, body, client: str = "") -> tuple[bytes, Grant]:
        served = self.registry.get(body.model)
        info = served.model.info
        self.attention.check_chars([(body.text, body.text_pair)])
        try:  # the Python API's own checks, before anything is tokenized
            validate_ablations(served.model, [Ablation(a.layer, a.head, a.mode) for a in body.ablate])
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        view = self._view(served, body.attention)
        deadline = time.monotonic() + self.settings.request_timeout_s
        encoded = await self._tokenized(deadline, served, body.text, body.text_pair, body.truncate)
        self._check_cells(view, len(encoded))
        guesses = body.top_k if info.predictions else 0
        nbytes = experiment_bytes(served, [encoded.tokens], view, len(encoded), guesses)
        return await self._run(nbytes, client, deadline, self._ablate, served, body, view, encoded)

    async def change_token(self, body, client: str = "") -> tuple[bytes, Grant]:
        served = self.registry.get(body.model)
        self.attention.check_chars([(body.text, body.text_pair)])
        view = self._view(served, body.difference)
        deadline = time.monotonic() + self.settings.request_timeout_s
        encoded = await self._tokenized(deadline, served, body.text, body.text_pair, body.truncate)
        self._check_cells(view, len(encoded))
        # The changed text's tokens are the same but one, now the mask or unknown token (or none).
        nbytes = experiment_bytes(served, [encoded.tokens, encoded.tokens], view, len(encoded)) + CHANGED_TOKEN_BYTES
        return await self._run(nbytes, client, deadline, self._change_token, served, body, view, encoded)

    async def compare(self, body, client: str = "") -> tuple[bytes, Grant]:
        served = self.registry.get(body.model)
        self._check_chars(body.text_a, "text_a: ")
        self._check_chars(body.text_b, "text_b: ")
        view = self._view(served, body.difference)
        deadline = time.monotonic() + self.settings.request_timeout_s
        a = await self._tokenized(deadline, served, body.text_a, None, body.truncate, "text_a: ")
        b = await self._tokenized(deadline, served, body.text_b, None, body.truncate, "text_b: ")
        aligned = min(len(a), len(b))  # at most: each token is in one pair
        self._check_cells(view, aligned)
        nbytes = experiment_bytes(served, [a.tokens, b.tokens], view, aligned)
        return await self._run(nbytes, client, deadline, self._compare, served, body, view, a, b)

    # ------------------------------------------------------------------ bounds
    def _check_chars(self, text: str, label: str) -> None:
        """The attention service's character limit, its message naming which of compare's texts."""
        try:
            self.attention.check_chars([(text, None)])
        except TooLong as exc:
            raise TooLong(label + exc.message) from None

    @staticmethod
    def _view(served: Served, asked) -> tuple[list[int], list[int], str] | None:
        if asked is None:
            return None
        info = served.model.info
        return (resolve_indices(asked.layers, info.n_layers, "layer", info.id),
                resolve_indices(asked.heads, info.n_heads, "head", info.id), asked.format)

    def _check_cells(self, view, rows: int) -> None:
        if view is None or view[2] != "json":
            return
        cells = len(view[0]) * len(view[1]) * rows * rows
        if cells > self.settings.max_json_cells:
            raise TooManyCells.json(cells, self.settings.max_json_cells)

    def _over_budget(self) -> OverBudget:
        return OverBudget(f"the experiment did not finish within its {self.settings.request_timeout_s:g} s budget")

    async def _tokenized(self, deadline: float, served: Served, text: str, pair: str | None, truncate: bool,
                         label: str = "") -> Encoded:
        """`_encode` on the loop when the text is short (as POST /attention's), else on a worker
        thread, within the request's time budget."""
        small = len(text) + len(pair or "") <= INLINE_CHARS
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                return await off_loop_unless_small(small, self._encode, served, text, pair, truncate, label)
        except TimeoutError:
            raise self._over_budget() from None

    async def _run(self, nbytes: int, client: str, deadline: float, fn, *args) -> tuple[bytes, Grant]:
        """fn(*args) on a worker thread once the answer's `nbytes` are granted (bytes before the
        slot, as for every answer: see AttentionService.queued_with_bytes) and a slot is free,
        all by the request's deadline."""
        grant = await self.attention.reserve(nbytes, deadline, client)
        try:
            return await self._in_slot(fn, args, deadline, client), grant
        except BaseException:
            grant.release()
            raise

    async def _in_slot(self, fn, args, deadline: float, client: str) -> bytes:
        if not self._slots.acquire(client):
            if self._slots.holds_share(client):
                raise QueueFull(f"this client has {self._slots.client_share} experiment{'s' if self._slots.client_share != 1 else ''} running, its share of this "
                                f"server's {self.settings.max_experiments}; try again when one ends", retry_after_s=1)
            raise QueueFull(f"{self.settings.max_experiments} experiment{'s are' if self.settings.max_experiments != 1 else ' is'} "
                            f"running; try again shortly", retry_after_s=1)

        started = threading.Event()

        def work():
            started.set()
            try:
                time.sleep(self.settings.debug_forward_delay_s)  # the test hook, as for a batch's forward
                return fn(*args)
            finally:
                self._slots.release(client)  # only once the forwards have really ended
                release_free_heap()  # its tensors' heap, freed in this thread's arena (app/memory.py)
                trim_kept_mappings_soon()  # and its buffers' mappings, past what the buffer pool keeps

        try:
            return await asyncio.wait_for(run_in_threadpool(work), deadline - time.monotonic())
        except TimeoutError:
            raise self._over_budget() from None
        finally:
            # Cancelled (a timeout, a hang-up) while waiting for a worker thread, work() never runs
            # and would never release its slot: two such and every experiment was a 429 until a
            # restart. Once a thread has it, anyio waits for it, so work() has run by now.
            if not started.is_set():
                self._slots.release(client)

    def _encode(self, served: Served, text: str, pair: str | None, truncate: bool, label: str = "") -> Encoded:
        try:
            encoded = served.model.encode(text, pair, truncate)
        except TooLongError as exc:
            raise TooLong.tokens(exc, label) from None
        check_some_tokens(served.id, encoded, pair is not None, label)
        # Experiments compare whole weights of two forwards; long inputs keep queries and keys instead.
        limit = self.settings.dense_max_tokens
        if len(encoded) > limit:
            # `truncate` cuts to the model's positions only: the advice says what does fit.
            raise KeptQK(
                f"{label}input is {len(encoded):,} tokens long; experiments compare whole weights, which this server "
                f"computes up to {limit:,} tokens (MANYEYES_DENSE_MAX_TOKENS): send at most {limit:,} tokens, or start "
                "the server with a higher MANYEYES_DENSE_MAX_TOKENS. A long run's weights can still be read, without "
                "experiments, through GET /api/v1/runs/{run_id}/tile, /topk and /overview"
            )
        return encoded

    # ------------------------------------------------------------------ work, on a worker thread
    def _ablate(self, served: Served, body, view, encoded: Encoded) -> bytes:
        model = served.model
        ablations = [Ablation(a.layer, a.head, a.mode) for a in body.ablate]
        try:
            result = ablate(model, encoded, ablations, top=body.top_k)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        info = model.info
        out = {
            "model": served.id,
            "causal": info.causal,
            "n_layers": info.n_layers,
            "n_heads": info.n_heads,
            "tokens": token_dicts(encoded.tokens),
            "truncated": encoded.truncated,
            "ablate": [{"layer": a.layer, "head": a.head, "mode": a.mode} for a in ablations],
            "ranking": ranking_dicts(result.ranking),
            "predictions": None,
            "logprob_change": None,
            "attention": None,
        }
        if result.top_before is not None:
            out["predictions"] = {"positions": result.predicted, "before": guesses(result.top_before),
                                  "after": guesses(result.top_after)}
            decode, piece = model.tokenizer.token_text, model.tokenizer.token_piece
            # change is after - before of the very floats shown (a float32 change was 1e-7 off it)
            out["logprob_change"] = [
                {"position": p, "id": t, "token": decode(t), "piece": piece(t), "before": before, "after": after,
                 "change": after - before}
                for (p, t), before, after in zip(result.targets, result.logprob_before.tolist(), result.logprob_after.tolist())
            ]
        if view is not None:
            out["attention"] = tensor_out(result.after.attention, *view, signed=False)
        return orjson.dumps(out, option=NUMPY)

    def _change_token(self, served: Served, body, view, encoded: Encoded) -> bytes:
        model = served.model
        try:
            changed = changed_tokens(model, encoded, body.index, body.change)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        before, after = model.run([encoded, changed])
        return self._comparison(served, compare_results(before, after), view)

    def _compare(self, served: Served, body, view, a: Encoded, b: Encoded) -> bytes:
        run_a, run_b = served.model.run([a, b])
        try:
            comparison = compare_results(run_a, run_b)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return self._comparison(served, comparison, view)

    def _comparison(self, served: Served, c: Comparison, view) -> bytes:
        self._check_cells(view, len(c.pairs))
        info = served.model.info
        out = {
            "model": served.id,
            "n_layers": info.n_layers,
            "n_heads": info.n_heads,
            "tokens_a": token_dicts(c.a.tokens),
            "tokens_b": token_dicts(c.b.tokens),
            "truncated_a": c.a.truncated,
            "truncated_b": c.b.truncated,
            "pairs": c.pairs,
            "ranking": ranking_dicts(c.ranking),
            "difference": tensor_out(c.difference, *view, signed=True) if view is not None else None,
        }
        return orjson.dumps(out, option=NUMPY)
