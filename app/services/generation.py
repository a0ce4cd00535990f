"""Generation streamed step by step, off the event loop, stopping within one step of a hang-up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator

import anyio
import orjson

from manyeyes.app.config import Settings
from manyeyes.app.services.attention import INLINE_CHARS, off_loop_unless_small
from manyeyes.app.services.errors import InvalidInput, NotReady, QueueFull, TooLong
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.registry import Registry, Served
from manyeyes.app.services.slots import CountedSlots
from manyeyes.model.errors import TooLongError
from manyeyes.model.generate import Sampling, Step, can_generate, check_generation, check_generator, generate

_DONE = object()
log = logging.getLogger(__name__)
# How long a refused client is told to wait: a generation runs for seconds (its steps are
# streamed as the client reads them), so "1" sent it back into the same refusal.
RETRY_AFTER_S = 5


def _choice(c) -> dict:
    return {"id": c.id, "text": c.text, "prob": c.prob, "piece": c.piece}


def _step_line(step: Step) -> bytes:
    body = {
        "type": "step",
        "index": step.index,
        "position": step.position,
        "token": _choice(step.token),
        "alternatives": [_choice(c) for c in step.alternatives],
        "attention": step.attention.numpy(),  # float32, serialised exactly
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


class ShutdownClock:
    """When a shutdown began: `server.Server` calls `begin` from its signal handler."""

    def __init__(self) -> None:
        self.began: float | None = None

    def begin(self) -> None:
        if self.began is None:
            self.began = time.monotonic()

    def past(self, seconds: float, ahead: float = 0.0) -> bool:
        """Whether a shutdown began and `seconds` after it will have gone by in `ahead` seconds."""
        return self.began is not None and time.monotonic() - self.began + ahead >= seconds


class GenerationService:
    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics,
                 shutdown: ShutdownClock | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.shutdown = shutdown or ShutdownClock()
        # uvicorn cancels what still runs once the drain is over; a stream stops a second before
        # that, its last step included.
        self.stream_grace_s = max(settings.drain_s() - 1.0, 0.0)
        # Each running generation holds a worker thread for its steps: bounded, beyond it 429; and a
        # client holds at most half of them: four streams one client opened and never read held
        # every slot until the write deadline dropped them, and again on reconnecting.
        self._slots = CountedSlots(settings.max_generations, metrics.work_running.labels("generation"))
        self.client_share = self._slots.client_share

    async def start(self, body, client: str = "") -> Generation:
        """Validate everything a client can get wrong (4xx before any byte), then stream NDJSON."""
        if self.shutdown.began is not None:  # asked on a kept-alive connection while the server drains
            raise NotReady.shutting_down()
        served = self.registry.get(body.model) if body.model is not None else self._default_generator()
        model = served.model
        if body.max_new_tokens > self.settings.max_new_tokens:
            raise InvalidInput(f"max_new_tokens is at most {self.settings.max_new_tokens} on this server")
        if len(body.text) > self.settings.max_text_chars:
            raise TooLong.chars(len(body.text), self.settings.max_text_chars)
        try:
            check_generator(model)  # before the prompt's length: an encoder's long prompt was "too long"
            # A long prompt tokenized on the loop held every other request (0.85 s at 100,000 characters).
            prompt = await off_loop_unless_small(len(body.text) <= INLINE_CHARS, model.encode, body.text)
            check_generation(model, len(prompt), body.max_new_tokens)
        except TooLongError as exc:
            # Not the model's own hint: generation has no truncation to ask for.
            # The room the new tokens leave, not the model's whole context: "at most 256" sent a user
            # who cut the prompt to 256 back for "at most 255" (with one new token).
            room = exc.max_tokens - body.max_new_tokens
            raise TooLong(
                f"the prompt is {exc.n_tokens:,} tokens long but {served.id} takes at most {exc.max_tokens:,} tokens in all"
                + (f"; with {body.max_new_tokens:,} new, shorten it to at most {room:,}" if room >= 1 else "")
            ) from None
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        self._take(client)
        steps = generate(
            model, prompt, body.max_new_tokens, Sampling(body.temperature, body.top_k, body.seed), body.alternatives,
            stop_at_eos=body.stop_at_eos,
        )
        start = {
            "type": "start",
            "model": served.id,
            "n_layers": model.info.n_layers,
            "n_heads": model.info.n_heads,
            "prompt": [
                {"text": t.text, "id": t.id, "start": t.start, "end": t.end, "special": t.special, "segment": t.segment, "piece": t.piece}
                for t in prompt.tokens
            ],
        }
        return Generation(self, served.id, start, steps, client)

    def _default_generator(self) -> Served:
        """The model a request that names none generates with: the server's default, or where that
        one cannot generate (the built-in default, minilm, is an encoder: such a request was always
        refused) the first causal model served. With none, the default, which check_generator refuses."""
        default = self.registry.get(None)
        for served in (default, *self.registry.served()):
            if can_generate(served.model):
                return served
        return default

    def _take(self, client: str) -> None:
        if self._slots.acquire(client):
            return
        if self._slots.holds_share(client):
            raise QueueFull(f"this client has {self.client_share} generation{'s' if self.client_share != 1 else ''} running, its share of this server's "
                            f"{self.settings.max_generations}; start another when one ends", retry_after_s=RETRY_AFTER_S)
        raise QueueFull(f"{self.settings.max_generations} generation{'s are' if self.settings.max_generations != 1 else ' is'} "
                        f"running; try again in a few seconds",
                        retry_after_s=RETRY_AFTER_S)

    def _give_back(self, client: str) -> None:
        self._slots.release(client)

    async def _stream(self, generation: Generation, model_id: str, start: dict, steps) -> AsyncIterator[bytes]:
        generation.started = True
        outcome = "cancelled"  # unless the loop below runs to its end
        count = 0
        ended = False  # the last step's token ended the text (Step.ends_text)
        delay = self.settings.debug_forward_delay_s
        longest = 0.0  # the longest step yet, its line's send and any debug delay included
        try:
            yield orjson.dumps(start) + b"\n"
            while True:
                if self.shutdown.past(self.stream_grace_s, ahead=longest):
                    # A stream that would run past the shutdown grace was cut off at its end by
                    # uvicorn (no end line, a traceback per stream in the log). It goes on while
                    # the grace allows, then ends saying why; a step is not begun that would end
                    # past it (checked before each step only, a 4 s step ran into the cut-off).
                    outcome = "shutdown"
                    yield orjson.dumps({"type": "end", "reason": "shutdown", "tokens": count,
                                        "error": "the server is shutting down; generate again shortly"}) + b"\n"
                    return
                # One step per worker-thread hop: the loop stays free, and a client that hangs up
                # cancels this coroutine between two steps, so at most one more step runs.
                began = time.monotonic()
                try:
                    step = await anyio.to_thread.run_sync(lambda: next(steps, _DONE))
                except Exception as exc:
                    # The 200 and some lines are already sent: a last line says why it stopped,
                    # where a dropped connection would leave the client a broken chunk.
                    log.exception("generation failed after %d tokens", count)
                    outcome = "failed"
                    yield orjson.dumps({"type": "end", "reason": "error", "tokens": count,
                                        "error": f"generation stopped: {exc}"}) + b"\n"
                    return
                if step is _DONE:
                    break
                self.metrics.generation_steps.labels(model_id).inc()
                count += 1
                ended = step.ends_text
                yield _step_line(step)
                if delay:
                    await anyio.sleep(delay)
                longest = max(longest, time.monotonic() - began)
            outcome = "finished"
            # "eos" also where the last token asked for ends the text: the model ended it there.
            reason = "eos" if ended else "length"
            yield orjson.dumps({"type": "end", "reason": reason, "tokens": count}) + b"\n"
        finally:
            self.metrics.generations.labels(outcome).inc()
            steps.close()
            generation.release()


class Generation:
    """One generation's NDJSON lines and the slot it holds, released exactly once.

    The slot is taken before the 200 (so that a full server answers 429), but the lines may never
    be read to their end: a client that hangs up while a line is being sent leaves the stream
    suspended at a `yield`, and one that hangs up before the first line leaves it never started.
    Starlette closes neither, so the slot came back only when the garbage collector happened to
    finalise the stream: four such hang-ups and every generation was a 429 meanwhile. The route
    calls `aclose` whatever happened, which ends the steps and frees the slot at once.
    """

    def __init__(self, service: GenerationService, model_id: str, start: dict, steps, client: str = "") -> None:
        self._service = service
        self._client = client
        self._metrics = service.metrics
        self._released = False
        self._guard = threading.Lock()
        self._steps = steps
        self.started = False
        self._lines = service._stream(self, model_id, start, steps)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._lines

    async def aclose(self) -> None:
        await self._lines.aclose()  # a suspended stream runs its `finally`; an unstarted one does not
        if not self.started:
            self._metrics.generations.labels("cancelled").inc()
            self._steps.close()
        self.release()

    def release(self) -> None:
        with self._guard:
            if self._released:
                return
            self._released = True
        self._service._give_back(self._client)
