"""Step through generation: each new token with its probability, its alternatives and its attention row.

A key/value cache (`KVCache`, threaded through `MultiHeadAttention.attend`'s `past`) means each
step runs the network on one token, not on the whole sequence again. A step is yielded once its
token has itself been run, so that its attention row (what it looked at, in every head) comes with
it; the caller can stop between any two steps. Generation ends after a step whose token ends the
text (`ModelInfo.eos_ids`), as transformers' generate does, unless stop_at_eos=False.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from manyeyes.indices import count_at_least
from manyeyes.model.attention import Capture
from manyeyes.model.runtime import AttentionModel
from manyeyes.model.tokenizer import Encoded


@dataclass(frozen=True)
class Choice:
    id: int
    text: str  # the token decoded on its own (a byte-level piece may be part of a character)
    prob: float  # under the model's own distribution (temperature 1, no top-k cut)
    # The id's vocabulary piece, as a prompt token of that id has it: the bytes of part of a
    # character all read text "\ufffd", their pieces ("å" for 0xE5) tell them apart.
    piece: str = ""

    def __repr__(self) -> str:
        piece = f", piece={self.piece!r}" if "\ufffd" in self.text else ""
        return f"Choice(id={self.id!r}, text={self.text!r}, prob={self.prob!r}{piece})"

    @property
    def token(self) -> str:
        """`text` by the name a prediction (`AttentionModel.predictions`) and the client's steps
        give it: the same loop, `step.token.token`, reads a local and a remote generation."""
        return self.text


@dataclass(frozen=True)
class Step:
    index: int  # 0 for the first generated token
    position: int  # its position in the whole sequence, prompt included
    token: Choice
    alternatives: list[Choice]  # the most likely tokens at that point, best first
    attention: torch.Tensor  # (n_layers, n_heads, position + 1): the token's row in every head, float32
    ends_text: bool = False  # its token is an end-of-text id and stop_at_eos held: the last step


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (the most likely token every time)
    top_k: int | None = None  # sample only among the k most likely (sampling only)
    seed: int | None = None  # a seeded sample repeats exactly

    def __post_init__(self):
        # Checked here, where the caller made the mistake, not as a NaN or a torch error steps later.
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        # torch seeds a generator with an unsigned 64-bit integer
        for name, least, most in (("top_k", 1, None), ("seed", 0, 2**64 - 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least
                                      or (most is not None and value > most)):
                span = f">= {least}" if most is None else f"in {least}..{most}"
                raise ValueError(f"{name} must be None or an integer {span}, got {value!r}")


def can_generate(model: AttentionModel) -> bool:
    """A causal model with a language-model head: encoders and headless models cannot."""
    return model.info.causal and getattr(model.net, "has_lm_head", False)


def check_generator(model: AttentionModel) -> None:
    """Refuse encoders and models without a language-model head."""
    if not can_generate(model):
        raise ValueError(f"{model.info.id} is not a causal language model: it cannot generate")


def check_generation(model: AttentionModel, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse what cannot run: encoders, models without a head, and sequences past the context."""
    check_generator(model)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if prompt_tokens < 1:
        raise ValueError("the prompt needs at least one token")
    limit = model.info.max_tokens
    if prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        # Advice that runs as given: a prompt cut to limit - 1 was refused again at 5 new tokens.
        advice = (f"ask for at most {room} new token{'s' if room > 1 else ''}" if room >= 1
                  else f"shorten the prompt to at most {limit - max_new_tokens} token{'s' if limit - max_new_tokens > 1 else ''}"
                  if max_new_tokens < limit
                  else f"ask for fewer than {limit} new tokens")
        raise ValueError(
            f"{prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed {model.info.id}'s context of {limit}; {advice}"
        )


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature <= 0:
        return int(logits.argmax())
    # Less the largest first: at a temperature near 0 (1e-308) the quotients overflow, and
    # softmax of inf is NaN; this way the best token stays at 0 and the others go to -inf.
    logits = logits.double()
    scaled = (logits - logits.max()) / sampling.temperature
    if sampling.top_k:
        cutoff = scaled.topk(min(sampling.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < cutoff, -torch.inf)
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator))


def generate(
    model: AttentionModel,
    prompt: str | Encoded,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    alternatives: int = 5,
    use_cache: bool = True,
    stop_at_eos: bool = True,
) -> Iterator[Step]:
    """Yield one `Step` per new token. use_cache=False recomputes the whole sequence each step
    (the reference the cache is checked and benchmarked against). `prompt` may come encoded
    already: the server tokenizes it first, to refuse a long one before it streams.

    stop_at_eos: end after the first step whose token is one of `model.info.eos_ids` (that step
    is yielded, with the row the model read when it ended the text), so fewer than
    max_new_tokens may come; False runs to max_new_tokens whatever the tokens are."""
    # Checked as counts here: None or "3" was a TypeError from a comparison, -1 alternatives
    # torch's "selected index k out of range", and True ran as 1.
    if count_at_least(max_new_tokens, 1) is None:
        raise ValueError(f"max_new_tokens must be a whole number of at least 1, got {max_new_tokens!r}")
    if count_at_least(alternatives, 0) is None:
        raise ValueError(f"alternatives must be a whole number of at least 0 (0: none), got {alternatives!r}")
    encoded = prompt if isinstance(prompt, Encoded) else model.encode(prompt)
    check_generation(model, len(encoded), max_new_tokens)
    ends = model.info.eos_ids if stop_at_eos else frozenset()
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    decode, piece = model.tokenizer.token_text, model.tokenizer.token_piece
    ids = list(encoded.ids)
    device = model.device

    def forward(new_ids: list[int], past, capture: Capture = Capture(weights=True)):
        # Entered per forward, never held across a yield: inference mode is per thread, and a
        # server may run each step on a different worker thread.
        with torch.inference_mode(), model._autocast():
            return model.net.inspect(torch.tensor([new_ids], device=device), capture=capture, past=past)

    rotary = getattr(model.net, "rotary", None)

    def rotates_as_before(length: int) -> bool:
        return rotary is None or rotary.frequency_key(length) == rotary.frequency_key(length - 1)

    def last_logits(trace) -> torch.Tensor:
        if trace.logits is not None:
            return trace.logits[0, -1].float().cpu()
        with torch.inference_mode(), model._autocast():
            # (1, d_model) -> (1, vocab): the head on the last position only
            return model.net.out_head(trace.hidden[:, -1]).float()[0].cpu()

    # The prompt's own weights are never streamed (each step's row comes from that step's
    # forward), yet they were made and held, every layer's (heads, T, T) at once, until the first
    # step: L x H x T^2 floats, tiny-llama's 2,040-token prompt grew the process by 237 MB. Under
    # the cache the prompt runs as a long input does (`keep`: row blocks, no T x T tensor, and the
    # same keys and values for the cache), and its (T, vocab) logits are read at the last position
    # only: 38 MB. The recompute path is the reference and reads each row from its whole forward.
    prompt_capture = Capture(weights=False, logits=False, keep=True) if use_cache else Capture(weights=True)
    trace = forward(ids, None, prompt_capture)
    logits = last_logits(trace)
    past = [layer.present for layer in trace.layers]
    del trace  # nothing of the prompt's forward but its keys and values outlives this line
    for index in range(max_new_tokens):
        probs = torch.softmax(logits.double(), -1)
        chosen = _choose(logits, sampling, generator)
        top = probs.topk(min(alternatives, probs.shape[-1]))
        ids.append(chosen)
        if use_cache and not rotates_as_before(len(ids)):
            # The frequencies changed at this length (longrope past its original context): every
            # cached key was turned by the old ones, so the whole sequence runs again, as a run of
            # it all would, and its keys become the cache.
            trace = forward(ids, None)
            past = [layer.present for layer in trace.layers]
        elif use_cache:
            trace = forward([chosen], past)
            past = [layer.present for layer in trace.layers]
        else:
            trace = forward(ids, None)
        # each layer's weights: (1, n_heads, new queries, T) -> the last query's row, (n_heads, T)
        row = torch.stack([layer.weights[0, :, -1] for layer in trace.layers]).float().cpu()
        yield Step(
            index=index,
            position=len(ids) - 1,
            token=Choice(chosen, decode(chosen), float(probs[chosen]), piece(chosen)),
            alternatives=[Choice(int(i), decode(int(i)), float(p), piece(int(i))) for p, i in zip(top.values, top.indices)],
            attention=row,
            ends_text=chosen in ends,
        )
        if chosen in ends:
            return
        logits = trace.logits[0, -1].float().cpu()
