"""Experiments: change one thing, run again, and rank what moved.

- `ablate`: silence heads where they enter the model, at their slice of out_proj's input (not
  their weights, not out_proj's output), by zero or by their mean over this run's positions;
- `change_token`: replace a token with the mask or unknown token, or delete it;
- `compare`: two inputs, aligned on their token strings with difflib.

Every experiment ranks the heads by the Jensen-Shannon divergence of their rows, averaged over
the query rows the two runs share, and reports how the model's predictions moved.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from manyeyes.indices import count_at_least, whole_number
from manyeyes.labels import align
from manyeyes.model.runtime import AttentionModel, AttentionResult
from manyeyes.model.tokenizer import Encoded, Token

MODES = ("zero", "mean")


# ---------------------------------------------------------------------------- divergence
# float64 values in one step of the divergence: 8 MB temporaries, where whole (L, H, T, T) float64
# copies were about ten times 151 MB for one comparison at T=512 (MiniLM).
STEP_VALUES = 1 << 20


def js_divergence(p: torch.Tensor, q: torch.Tensor, normalise: bool = False) -> torch.Tensor:
    """Jensen-Shannon divergence in bits (0 same ... 1 disjoint) over the last dimension.
    normalise: divide each row by its sum first (rows cut down to some of their keys)."""
    keys = p.shape[-1]
    rows_p, rows_q = p.reshape(-1, keys), q.reshape(-1, keys)  # (rows, keys), views where they can be
    out = torch.empty(rows_p.shape[0])
    step = max(1, STEP_VALUES // max(keys, 1))
    for start in range(0, rows_p.shape[0], step):
        a = rows_p[start : start + step].to(torch.float64, copy=True)  # (step, keys)
        b = rows_q[start : start + step].to(torch.float64, copy=True)
        if normalise:
            a /= a.sum(-1, keepdim=True).clamp_min(1e-30)
            b /= b.sum(-1, keepdim=True).clamp_min(1e-30)
        m = (a + b).mul_(0.5).clamp_min_(1e-300)  # > 0 wherever a or b is: the clamp only stops 0/0
        out[start : start + step] = (_kl_bits(a, m) + _kl_bits(b, m)).mul_(0.5).clamp_min_(0)
    return out.reshape(p.shape[:-1])  # (rows,) -> p.shape[:-1], e.g. (n_layers, n_heads, R)


def _kl_bits(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.xlogy(a, a / m).sum(-1) / math.log(2)  # a zero term counts 0 (xlogy)


@dataclass(frozen=True)
class HeadChange:
    layer: int
    head: int
    divergence: float  # mean JS divergence (bits) over the shared query rows


def rank_heads(before: torch.Tensor, after: torch.Tensor, normalise: bool = False) -> list[HeadChange]:
    """before, after: (n_layers, n_heads, R, K) rows over the same keys; largest change first."""
    per_head = js_divergence(before, after, normalise).mean(-1)  # (n_layers, n_heads)
    n_heads = per_head.shape[1]
    order = per_head.flatten().argsort(descending=True)
    return [HeadChange(int(k) // n_heads, int(k) % n_heads, float(per_head.flatten()[k])) for k in order]


def _ranking_text(ranking: list[HeadChange], shown: int = 3) -> str:
    """The first heads of a ranking and how many it holds, for a one-line repr."""
    if not ranking:
        return "no head ranked"
    first = ", ".join(f"L{c.layer} H{c.head} {c.divergence:.3g}" for c in ranking[:shown])
    more = f", … ({len(ranking)} heads)" if len(ranking) > shown else ""
    return f"most changed (JS bits): {first}{more}"


# ---------------------------------------------------------------------------- predictions
@dataclass(frozen=True)
class Guess:
    id: int
    token: str
    prob: float
    piece: str = ""  # the id's vocabulary piece, as a prompt token of that id has it (`Prediction.piece`)


def top_k(model: AttentionModel, logits: torch.Tensor, k: int) -> list[list[Guess]]:
    """Per position, the k most likely tokens; (T, vocab) logits."""
    probs = torch.softmax(logits.double(), -1)
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    decode, piece = model.tokenizer.token_text, model.tokenizer.token_piece
    return [[Guess(int(i), decode(int(i)), float(v), piece(int(i))) for v, i in zip(vs, row)] for vs, row in zip(values, ids)]


# ---------------------------------------------------------------------------- ablation
@dataclass(frozen=True)
class Ablation:
    """One head to silence in `ablate`: head `head` of layer `layer` (from 0), by `mode`.

    "zero" sets the head's slice of out_proj's input to 0; "mean" sets it to that slice's mean over
    this run's positions. `ablate` also takes a plain (layer, head) or (layer, head, mode) tuple,
    and numpy's integers as indices; it refuses a head the model lacks or a mode not in MODES."""

    layer: int
    head: int
    mode: str = "zero"  # "zero", or "mean": the head's output averaged over this run's positions


@contextmanager
def _silenced(model: AttentionModel, ablations: Iterable[Ablation], means: dict[tuple[int, int], torch.Tensor]):
    """Pre-hooks on out_proj that overwrite each ablated head's slice of its input.

    Hooks live on the shared module, but only act on forwards run by the thread that set them:
    a server runs other requests' forwards (and generations) on the same model at the same time.
    """
    head_dim = model.info.head_dim
    owner = threading.get_ident()
    by_layer: dict[int, list[Ablation]] = {}
    for a in ablations:
        by_layer.setdefault(a.layer, []).append(a)
    hooks = []

    def hook_for(layer_ablations):
        def pre_hook(module, args):
            if threading.get_ident() != owner:
                return None
            heads = args[0].clone()  # (b, T, n_heads * head_dim), the heads glued back
            for a in layer_ablations:
                part = slice(a.head * head_dim, (a.head + 1) * head_dim)
                if a.mode == "zero":
                    heads[..., part] = 0
                else:
                    heads[..., part] = means[(a.layer, a.head)].to(heads.device, heads.dtype)
            return (heads,)

        return pre_hook

    for layer, layer_ablations in by_layer.items():
        hooks.append(model.net.trf_blocks[layer].att.out_proj.register_forward_pre_hook(hook_for(layer_ablations)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _head_means(model: AttentionModel, result: AttentionResult, ablations: list[Ablation]) -> dict[tuple[int, int], torch.Tensor]:
    """Each mean-ablated head's output (α V, its slice of out_proj's input) averaged over positions."""
    means = {}
    for a in ablations:
        if a.mode != "mean":
            continue
        values = result.values[a.layer]  # (n_kv_heads, T, head_dim)
        kv = a.head // (model.info.n_heads // values.shape[0])
        # (T, T) @ (T, head_dim) -> (T, head_dim), then the mean over query positions
        means[(a.layer, a.head)] = (result.attention[a.layer, a.head] @ values[kv]).mean(0)
    return means


@dataclass(eq=False)  # tensors have no truth value: == compared them and raised
class AblationResult:
    """What `ablate` found. `before` and `after` are the whole runs (attention (n_layers, n_heads,
    T, T)); `ranking` holds only the heads after the first ablated layer, since none before it can
    move. The prediction fields are None for a model with no language-model head (MiniLM)."""

    before: AttentionResult
    after: AttentionResult
    ranking: list[HeadChange]  # heads downstream of the first ablated layer, largest change first
    # log p(target) (float64) at each (position, target id) of `targets`, before and after: for a
    # causal LM the actual next token after every position but the last; for a masked LM, at each
    # mask, the token the unablated model ranks first (the text says nothing about what the mask hides).
    logprob_before: torch.Tensor | None
    logprob_after: torch.Tensor | None
    top_before: list[list[Guess]] | None  # per position of `predicted`, best first
    top_after: list[list[Guess]] | None
    targets: list[tuple[int, int]] | None = None
    predicted: list[int] | None = None  # positions with predictions: all (causal) or the masks (MLM)

    @property
    def logprob_change(self) -> torch.Tensor | None:
        """Δ log p(target): after - before, in float64 like both."""
        return None if self.logprob_before is None else self.logprob_after - self.logprob_before

    def __repr__(self) -> str:
        # One line, as a result's (a 2 x 8 model's ablation printed 8.7 KB of HeadChange and Guess)
        change = self.logprob_change
        said = "" if change is None or not len(change) else \
            f"; Δ log p mean {float(change.mean()):.3g} over {len(change)} target{'s' if len(change) > 1 else ''}"
        return f"AblationResult({len(self.before.tokens)} tokens; {_ranking_text(self.ranking)}{said})"


def validate_ablations(model: AttentionModel, ablations: Iterable[Ablation | tuple]) -> list[Ablation]:
    """The ablations as a list of `Ablation`s with int indices, each a head of `model`, named once.

    Takes (layer, head) and (layer, head, mode) tuples, and numpy's integers (np.argmax's) as
    indices, as the figures do. TypeError for anything else; ValueError for an empty list, an index
    that is no whole number, a head the model lacks, a head named twice or an unknown mode."""
    ablations = [_as_ablation(a) for a in ablations]
    if not ablations:
        raise ValueError("name at least one (layer, head) to ablate")
    info = model.info
    seen = set()
    for k, a in enumerate(ablations):
        try:
            a = ablations[k] = Ablation(whole_number(a.layer, "layer"), whole_number(a.head, "head"), a.mode)
        except ValueError:
            raise ValueError(f"a head is named by two whole numbers, layer and head, not {a.layer!r} and {a.head!r}") from None
        if not (0 <= a.layer < info.n_layers and 0 <= a.head < info.n_heads):
            raise ValueError(f"no head L{a.layer} H{a.head}: layers 0..{info.n_layers - 1}, heads 0..{info.n_heads - 1}")
        if (a.layer, a.head) in seen:  # the later mode would silently win
            raise ValueError(f"head L{a.layer} H{a.head} is named twice")
        seen.add((a.layer, a.head))
        if a.mode not in MODES:
            raise ValueError(f"unknown ablation mode {a.mode!r}; expected one of {', '.join(MODES)}")
    return ablations


def _as_ablation(value) -> Ablation:
    if isinstance(value, Ablation):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3):
        return Ablation(*value)
    raise TypeError(f"each ablation is an Ablation(layer, head, mode) or a (layer, head) tuple, got {value!r}; "
                    "one head is a list of one: [Ablation(0, 3)]")


def _encoded(model: AttentionModel, value: str | Encoded) -> Encoded:
    """A text encoded as `compare` encodes its texts (no truncation), or an Encoded as it is."""
    if isinstance(value, str):
        return model.encode(value)
    if isinstance(value, Encoded):
        return value
    raise TypeError(f"expected a text (str) or model.encode(text)'s Encoded, got {type(value).__name__}")


def ablate(model: AttentionModel, encoded: str | Encoded, ablations: Iterable[Ablation | tuple],
           top: int = 5) -> AblationResult:
    """Run `encoded` twice, clean and with `ablations` silenced, and rank what moved downstream.

    encoded: a text (str, encoded with `model.encode`, so TooLongError past the model's positions)
    or an `Encoded` from `model.encode(text, truncate=True)` and the like.
    ablations: `Ablation`s or (layer, head[, mode]) tuples, at least one (see `validate_ablations`
    for what is refused). top: guesses kept per predicted position, for a model with an LM head.

    Returns an AblationResult: both runs, the heads after the first ablated layer ranked by mean
    Jensen-Shannon divergence (bits) of their rows, and, for a model with a language-model head,
    the top `top` guesses and log p of each target before and after (see AblationResult)."""
    from manyeyes.model.attention import Capture

    encoded = _encoded(model, encoded)
    if len(encoded) == 0:  # a causal model's empty text: torch's reshape error, deep in the means
        raise ValueError("the text gives no tokens, so there is no attention to ablate")
    if count_at_least(top, 1) is None:
        raise ValueError(f"top must be a whole number of at least 1 (guesses kept per position), got {top!r}")
    ablations = validate_ablations(model, ablations)
    before = model.run([encoded], Capture(qkv=True))[0]
    means = _head_means(model, before, ablations)
    with _silenced(model, ablations, means):
        after = model.run([encoded])[0]
    first = min(a.layer for a in ablations)
    # Heads in or before the first ablated layer cannot move: rank only what lies downstream.
    ranking = rank_heads(before.attention[first + 1 :], after.attention[first + 1 :])
    ranking = [HeadChange(c.layer + first + 1, c.head, c.divergence) for c in ranking]
    logp_before = logp_after = tops_before = tops_after = targets = positions = None
    if before.logits is not None:
        positions = prediction_positions(model, encoded)
        tops_before = top_k(model, before.logits[positions], top)
        tops_after = top_k(model, after.logits[positions], top)
        if model.info.causal:
            targets = list(zip(range(len(encoded) - 1), encoded.ids[1:]))
        else:
            targets = [(p, int(before.logits[p].argmax())) for p in positions]
        logp_before, logp_after = target_logprobs(before.logits, targets), target_logprobs(after.logits, targets)
    return AblationResult(before, after, ranking, logp_before, logp_after, tops_before, tops_after, targets, positions)


def prediction_positions(model: AttentionModel, encoded: Encoded) -> list[int]:
    """Where the model's head predicts something: every position of a causal LM, each mask of a masked LM."""
    if model.info.causal:
        return list(range(len(encoded)))
    mask_id = model.tokenizer.mask_id
    return [i for i, token_id in enumerate(encoded.ids) if mask_id is not None and token_id == mask_id]


def target_logprobs(logits: torch.Tensor, targets: list[tuple[int, int]]) -> torch.Tensor:
    """log p(id | position) for each (position, id), in float64; (T, vocab) logits."""
    if not targets:
        return torch.zeros(0, dtype=torch.float64)
    logp = torch.log_softmax(logits.double(), -1)
    positions, ids = zip(*targets)
    return logp[torch.tensor(positions), torch.tensor(ids)]


# ---------------------------------------------------------------------------- token changes and comparison
@dataclass(eq=False)  # tensors have no truth value: == compared them and raised
class Comparison:
    """Two runs side by side (`compare`, `change_token`). `pairs` are the indices of the tokens
    difflib aligns; `ranking` every head, largest mean Jensen-Shannon divergence (bits) first, over
    the aligned rows restricted to the aligned keys and renormalised; `difference` A - B on the
    aligned cells, as they are."""

    a: AttentionResult
    b: AttentionResult
    pairs: list[tuple[int, int]]  # aligned (index in a, index in b)
    ranking: list[HeadChange]
    # (n_layers, n_heads, P, P): A - B on aligned cells (raw weights, not renormalised)
    difference: torch.Tensor

    def __repr__(self) -> str:
        # One line, as a result's (a 2 x 8 model's comparison printed 9.3 KB)
        return (f"Comparison({len(self.a.tokens)} and {len(self.b.tokens)} tokens, {len(self.pairs)} aligned; "
                f"{_ranking_text(self.ranking)})")


def compare_results(a: AttentionResult, b: AttentionResult) -> Comparison:
    """Per-head divergence over aligned rows, each row restricted to the aligned keys and renormalised.

    Mass on keys that exist in only one input is left out of the divergence, so a deleted token
    changes a head's score only through what it did to the shared tokens.
    """
    pairs = align(a.tokens, b.tokens)
    if not pairs:
        raise ValueError("the two inputs share no token to align")
    ia = torch.tensor([p[0] for p in pairs])
    ib = torch.tensor([p[1] for p in pairs])
    wa = a.attention[:, :, ia[:, None], ia]  # (L, H, P, P), one copy
    wb = b.attention[:, :, ib[:, None], ib]
    # Renormalised a few rows at a time inside the divergence, not as two more whole copies.
    ranking = rank_heads(wa, wb, normalise=True)
    return Comparison(a, b, pairs, ranking, wa.sub_(wb))  # the difference, in wa's memory


def compare(model: AttentionModel, text_a: str, text_b: str) -> Comparison:
    """Two texts in one batch, aligned on their tokens and ranked by how each head's rows differ.

    Each text is encoded with `model.encode` (TooLongError past the model's positions). Returns a
    Comparison, difference (n_layers, n_heads, P, P) for P aligned tokens; ValueError when the two
    share no token to align."""
    encoded = [model.encode(text_a), model.encode(text_b)]
    for name, one in zip(("text_a", "text_b"), encoded):
        if len(one) == 0:  # said as "the two inputs share no token to align"
            raise ValueError(f"{name} gives no tokens, so there is nothing of it to compare")
    a, b = model.run(encoded)
    return compare_results(a, b)


CHANGES = ("mask", "unk", "delete")


def token_changes(model: AttentionModel) -> list[str]:
    """The changes `changed_tokens` can make with this model's vocabulary: "delete" always, "mask"
    and "unk" where it has those tokens (GPT-2 and tiny-gpt have neither, a BERT both)."""
    has = getattr(model.tokenizer, "special_token", lambda kind: None)
    return [change for change in CHANGES if change == "delete" or has(change) is not None]


def changed_tokens(model: AttentionModel, encoded: Encoded, index: int, change: str) -> Encoded:
    """The same input with token `index` replaced by the model's mask or unknown token, or deleted."""
    if change not in CHANGES:
        raise ValueError(f"unknown change {change!r}; expected one of {', '.join(CHANGES)}")
    index = whole_number(index, "index")  # 1.0 was a TypeError from list indexing, True token 1
    if len(encoded) == 0:
        raise ValueError("the text gives no tokens, so there is no token to change")
    if not 0 <= index < len(encoded):
        raise ValueError(f"token index must be in 0..{len(encoded) - 1}")
    if encoded.tokens[index].special:
        raise ValueError("special tokens ([CLS], [SEP], BOS) stay: change a word piece")
    tokens, types = list(encoded.tokens), list(encoded.type_ids)
    if change == "delete":
        # Special tokens are not the text: [CLS] [SEP] alone, or a pair's second segment emptied,
        # is a run the API refuses where it is asked for directly (a text that gives no tokens).
        segment = tokens[index].segment
        if not any(not t.special and t.segment == segment for i, t in enumerate(tokens) if i != index):
            raise ValueError(f"deleting the only token of {'text_pair' if segment else 'text'} leaves nothing of it to run")
        del tokens[index], types[index]
    else:
        replacement = model.tokenizer.special_token(change) if hasattr(model.tokenizer, "special_token") else None
        if replacement is None:
            raise ValueError(f"{model.info.id} has no {change} token")
        piece, token_id = replacement
        old = tokens[index]
        tokens[index] = Token(piece, token_id, old.start, old.end, True, old.segment, piece)
    return Encoded(tokens, types, encoded.truncated)


def change_token(model: AttentionModel, encoded: str | Encoded, index: int, change: str) -> Comparison:
    """The input against itself with token `index` changed: "mask" or "unk" (the model's mask or
    unknown token in its place) or "delete"; `token_changes(model)` lists what the model allows.

    encoded: a text (str, encoded with `model.encode`) or an `Encoded`; `index` counts its tokens,
    special ones included. Returns a Comparison, `a` the input as it is and `b` the changed one.
    ValueError for an unknown change, an index outside the tokens, a special token ([CLS], BOS),
    deleting the only token of the text or of its pair (special ones aside), or a mask or unknown
    token the vocabulary lacks (GPT-2, tiny-gpt)."""
    encoded = _encoded(model, encoded)
    changed = changed_tokens(model, encoded, index, change)
    before, after = model.run([encoded, changed])
    return compare_results(before, after)
