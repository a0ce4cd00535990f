"""Measures beyond raw weights, each computed from one captured run with no second forward pass.

Raw weights mislead on their own: a head can put 0.9 on [SEP] and move almost nothing. These are
the field's corrections, side by side:

- `rollout`: attention rollout (Abnar & Zuidema, 2020);
- `head_writes` / `contributions`: what each head writes into the residual stream, its norm and
  its share of the attention block's output (after Kobayashi et al., 2020; Ferrando & Voita, 2024);
- `head_stats` / `tag_heads`: per-head statistics and automatic tags (after TransformerLens'
  head detector), with an induction score from a built-in repeated-random-tokens probe;
- `merge_words`: subword pieces merged into words, for any tokenizer with offsets;
- `neuron_view`: the query, keys, q ⊙ k, scores, softmax and values behind one row of one head.

Value-weighted norms stay in `manyeyes.model.analysis`.
"""

from __future__ import annotations

import functools
import math
import threading
import unicodedata
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from manyeyes.indices import index_below, whole_number
from manyeyes.model.attention import Capture, blocked_rows
from manyeyes.model.row_sums import row_sums
from manyeyes.model.runtime import AttentionModel, AttentionResult
from manyeyes.model.tokenizer import Encoded, Token


# ---------------------------------------------------------------------------- rollout
def rollout(attention: torch.Tensor) -> torch.Tensor:
    """R = Ã_L ⋯ Ã_1 with Ã_l = ½·mean_h A_l + ½·I, rows renormalised; (T, T).

    attention: (n_layers, n_heads, T, T). A causal model's weights are lower-triangular, and so
    is every Ã_l and their product: the causal form needs no special case, only no leakage, which
    the identity term cannot add.
    """
    n_tokens = attention.shape[-1]
    eye = torch.eye(n_tokens)
    result = None
    # float32 throughout: rows are distributions, so products stay within ~1e-7 of float64 at
    # T=512, and a float64 copy of every weight cost more than the rest of the rollout.
    for layer_mean in attention.float().mean(1):  # (T, T) per layer
        mixed = 0.5 * layer_mean + 0.5 * eye
        mixed = mixed / mixed.sum(-1, keepdim=True)
        # later layers on the left: token i at layer l reads rows of l-1; the first needs no product
        result = mixed if result is None else mixed @ result  # (T, T) @ (T, T) -> (T, T)
    return eye if result is None else result


# ---------------------------------------------------------------------------- what heads write
def _per_query_head(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_kv_heads, T, head_dim) -> (n_heads, T, head_dim): query head h reads kv head h // group."""
    group = n_heads // tensor.shape[0]
    return tensor.repeat_interleave(group, dim=0) if group > 1 else tensor


def head_writes(model: AttentionModel, result: AttentionResult) -> torch.Tensor:
    """Each head's write into the residual stream, (n_layers, n_heads, T, d_model).

    For head h at query i: Σ_j α_ij · v_j W_O,h, its slice of out_proj without the bias (the
    bias belongs to no head). Needs Capture(qkv=True).
    """
    if result.values is None:
        raise ValueError("head contributions need the values: run with Capture(qkv=True)")
    info = model.info
    writes = []
    for block, values, weights in zip(model.net.trf_blocks, result.values, result.attention):
        values = _per_query_head(values, info.n_heads)  # (n_heads, T, head_dim)
        w_o = block.att.out_proj.weight.detach().float().cpu()  # (d_model, n_heads * head_dim)
        # (d_model, n_heads * head_dim) -> (d_model, n_heads, head_dim) -> (n_heads, head_dim, d_model)
        w_o = w_o.view(w_o.shape[0], info.n_heads, info.head_dim).permute(1, 2, 0)
        # (n_heads, T, T) @ (n_heads, T, head_dim) -> (n_heads, T, head_dim)
        mixed = weights @ values
        # (n_heads, T, head_dim) @ (n_heads, head_dim, d_model) -> (n_heads, T, d_model)
        writes.append(mixed @ w_o)
    return torch.stack(writes)


@dataclass(frozen=True)
class Contributions:
    norms: torch.Tensor  # (n_layers, n_heads, T): ‖what head h writes at query i‖
    # (n_layers, n_heads, T): the head's write projected on the block's output y (heads + bias),
    # c·y / ‖y‖². Over the heads and the bias it sums to exactly 1; a head that cancels others
    # gets a negative share.
    shares: torch.Tensor
    bias_shares: torch.Tensor  # (n_layers, T): out_proj's bias, the remainder of the sum


def head_gram(w_o: torch.Tensor, n_heads: int) -> torch.Tensor:
    """W_O,hᵀ W_O,h per head, (n_heads, head_dim, head_dim): ‖x W_O,hᵀ‖² = x G_h xᵀ, so the norm of
    what a head writes needs no d_model-wide vector. w_o: out_proj's (d_model, n_heads * head_dim)."""
    # (d_model, n_heads * head_dim) -> (n_heads, head_dim, d_model)
    per_head = w_o.view(w_o.shape[0], n_heads, -1).permute(1, 2, 0)
    return per_head @ per_head.transpose(1, 2)  # (n_heads, head_dim, head_dim)


# Keyed by the out_proj module (a tensor key would compare elementwise): ((weight version, storage), gram).
_GRAMS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, int], torch.Tensor]]" = weakref.WeakKeyDictionary()


def out_proj_gram(out_proj: torch.nn.Linear, n_heads: int) -> torch.Tensor:
    """`head_gram` of an out_proj's weight, made once per weight and kept while the weight is
    unchanged (its version counter and storage: an in-place edit or a new tensor recomputes it).
    Value norms and contributions of every run reuse it."""
    weight = out_proj.weight
    found = _GRAMS.get(out_proj)
    if found is not None and found[0] == (weight._version, weight.data_ptr()) and found[1].shape[0] == n_heads:
        return found[1]
    gram = head_gram(weight.detach().float().cpu(), n_heads)
    _GRAMS[out_proj] = ((weight._version, weight.data_ptr()), gram)
    return gram


def contributions(
    model: AttentionModel,
    result: AttentionResult,
    mixed: list[torch.Tensor] | None = None,
    outputs: list[torch.Tensor] | None = None,
) -> Contributions:
    """`head_writes`' norms and shares, without ever holding the (n_layers, n_heads, T, d_model) writes.

    Per layer, with m_h = Σ_j α_ij v_j (the head's mixed values) and y the block's output:
    ‖m_h W_O,hᵀ‖² = m_h G_h m_hᵀ and m_h W_O,hᵀ · y = m_h · (y W_O,h): head_dim-wide work only.
    mixed, outputs: out_proj's input and output per layer as `capture_stream` keeps them; the
    forward already made both, so with them nothing is recomputed (without: from the values).
    """
    streamed = mixed is not None and outputs is not None
    if result.values is None and not streamed:
        raise ValueError("head contributions need the values (run with Capture(qkv=True)) or both mixed and outputs")
    info = model.info
    norms, shares, bias_shares = [], [], []
    for layer, block in enumerate(model.net.trf_blocks):
        w_o = block.att.out_proj.weight.detach().float().cpu()  # (d_model, n_heads * head_dim)
        bias = block.att.out_proj.bias
        bias = bias.detach().float().cpu() if bias is not None else torch.zeros(w_o.shape[0])
        if streamed:
            context, output = mixed[layer], outputs[layer]  # (T, n_heads * head_dim), (T, d_model)
            n_tokens = context.shape[0]
            # (T, n_heads * head_dim) -> (T, n_heads, head_dim) -> (n_heads, T, head_dim)
            heads = context.view(n_tokens, info.n_heads, -1).transpose(0, 1)
        else:
            values = _per_query_head(result.values[layer], info.n_heads)  # (n_heads, T, head_dim)
            heads = result.attention[layer] @ values  # (n_heads, T, T) @ (n_heads, T, head_dim) -> (n_heads, T, head_dim)
            n_tokens = heads.shape[1]
            context = heads.transpose(0, 1).reshape(n_tokens, -1)  # (T, n_heads * head_dim)
            output = context @ w_o.T + bias  # (T, d_model): the block's output, heads + bias
        # (T, d_model) @ (d_model, n_heads * head_dim) -> (n_heads, T, head_dim): y W_O,h per head
        pulled = (output @ w_o).view(n_tokens, info.n_heads, -1).transpose(0, 1)
        # Products multiplied in place: on this VM a fresh page costs more than the arithmetic on it.
        denom = torch.linalg.vector_norm(output, dim=-1).square().clamp_min(1e-30)  # (T,), with no (T, d) temporary
        squared = (heads @ out_proj_gram(block.att.out_proj, info.n_heads)).mul_(heads).sum(-1)  # (n_heads, T)
        norms.append(squared.clamp_min(0).sqrt())
        shares.append(pulled.mul_(heads).sum(-1) / denom)
        bias_shares.append((output @ bias) / denom)  # (T, d_model) @ (d_model,) -> (T,), over (T,)
    return Contributions(norms=torch.stack(norms), shares=torch.stack(shares), bias_shares=torch.stack(bias_shares))


# ---------------------------------------------------------------------------- head statistics and tags
STAT_NAMES = ("entropy", "distance", "self", "previous", "first", "delimiter", "duplicate")


def _is_delimiter(token: Token) -> bool:
    return _is_punctuation(token.text)


@functools.lru_cache(maxsize=1 << 16)
def _is_punctuation(text: str) -> bool:
    # Memoised: a vocabulary's pieces recur from run to run, and the character scan cost 2 ms at T=512.
    text = text.strip()
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def _host_array(attention: torch.Tensor) -> np.ndarray:
    """The weights as a contiguous float32 numpy array on the host (a view when they already are)."""
    return attention.detach().to("cpu", torch.float32).contiguous().numpy()


def head_stats(attention: torch.Tensor, tokens: list[Token], causal: bool,
               sliding_windows: tuple[int | None, ...] = ()) -> dict[str, torch.Tensor]:
    """Each statistic as (n_layers, n_heads), averaged over the query rows where it is defined.

    - entropy: a row's entropy over log(number of keys it may see), 0 sharp ... 1 uniform;
    - distance: Σ_j α_ij |i - j|, in tokens;
    - self: α_ii; previous: α_i,i-1; first: α_i,0, the sink share;
    - delimiter: mass on special tokens after the first and on punctuation ([SEP], ".", ",");
    - duplicate: mass on earlier copies of the query's own token.
    Rows that see a single key (a causal model's first row) carry no choice and are left out, and
    each statistic averages only the rows whose keys it reads are in reach: under a layer's
    sliding window (`sliding_windows`, per layer) a row sees its last W positions, so "first"
    counts the rows within W of the first token and "entropy" is over log(min(i + 1, W)).
    The sums over keys are one compiled pass over the weights, so the table stays a small
    fraction of the forward pass (README, "What the measures cost").
    """
    return _stats_and_argmax(attention, tokens, causal, sliding_windows)[0]


def _stats_and_argmax(attention: torch.Tensor, tokens: list[Token], causal: bool,
                      sliding_windows: tuple[int | None, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """head_stats, and each row's argmax (L, H, T) from the same pass, for the positional tag."""
    n_layers, n_tokens = attention.shape[0], attention.shape[-1]
    positions = torch.arange(n_tokens)
    windows = sliding_windows or (None,) * n_layers
    # (L, 1) per layer: a query reaches keys j > i - W, itself included (model/attention.py).
    reach = torch.tensor([[w if w is not None else n_tokens] for w in windows])
    visible = (positions + 1 if causal else torch.full((n_tokens,), n_tokens))  # (T,)
    behind = (positions - reach + 1).clamp_min(0)  # (L, T): keys out of reach behind each query
    visible = (visible - behind).float()  # (L, T)
    choosing = visible > 1  # (L, T)

    def row_mean(per_row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # per_row: (L, H, T); rows: (L, T) bool. A product with each layer's rows' mean weights:
        # a boolean index copied each strided (L, H, T) view first. A layer with no such row is 0.
        rows = rows.float()
        weights = rows / rows.sum(-1, keepdim=True).clamp_min(1)  # (L, T)
        return (per_row @ weights[:, :, None]).squeeze(-1)  # (L, H, T) @ (L, T, 1) -> (L, H)

    delimiters = torch.tensor([float((t.special and k > 0) or _is_delimiter(t)) for k, t in enumerate(tokens)])
    ids = torch.tensor([t.id for t in tokens])
    earlier_copy = (ids[:, None] == ids[None, :]) & (positions[None, :] < positions[:, None])  # (T, T)
    # (L, T): the latest earlier copy within reach (one behind the window draws no weight, and
    # its row would count a 0).
    latest_copy = torch.where(earlier_copy, positions[None, :], -1).amax(-1)  # (T,), -1 for none
    has_copy = (latest_copy >= 0) & (latest_copy > positions - reach)
    # Each row's sums over its keys, one compiled pass over the weights (model/row_sums.py):
    # per row, not one sum over a head's T² weights (float32 over 262k terms drifted by 4e-5 of
    # the distance at T=512, over one row's T terms by 1e-7).
    flat = _host_array(attention).reshape(-1, n_tokens, n_tokens)  # (L·H, T, T)
    sums, argmax = row_sums(flat, earlier_copy.numpy(), delimiters.numpy(), causal)
    # (L, H, T) each; `previous` is 0 on the first row
    plogp, distance, duplicate, delimiter, diagonal, previous, first = torch.from_numpy(sums).view(
        (7,) + attention.shape[:-1])
    entropy = -plogp  # nats; duplicate is 0 on rows without a copy
    normalised = entropy / visible.clamp_min(2).log()[:, None, :]  # (L, H, T) / (L, 1, T)
    sees_previous = (positions >= 1) & (reach >= 2)  # (L, T)
    sees_first = choosing & (positions >= 1) & (positions < reach)  # (L, T)
    stats = {
        "entropy": row_mean(normalised, choosing),
        "distance": row_mean(distance, choosing),
        "self": row_mean(diagonal, choosing),
        "previous": row_mean(previous, sees_previous),
        "first": row_mean(first, sees_first),
        "delimiter": row_mean(delimiter, choosing),
        "duplicate": row_mean(duplicate, has_copy),
    }
    return stats, torch.from_numpy(argmax).view(attention.shape[:-1])  # (L, H, T)


# Thresholds for the tags, each on a statistic above (or the induction probe). A head may carry
# several tags or none. They are deliberately strict: a tag should name what a head mostly does.
TAG_THRESHOLDS = {
    "previous-token": ("previous", 0.5),  # half its mass on the token just before
    "self": ("self", 0.5),
    "sink": ("first", 0.5),  # half its mass parked on the first token ([CLS], <s> or BOS)
    "broad": ("entropy", 0.8),  # close to uniform over what it may see
    "induction": ("induction", 0.3),  # on the probe: mass on the token after the earlier copy
    # Half its mass on earlier copies of its own token, over the rows that have one (TransformerLens'
    # duplicate_token_head): the statistic was there and no tag named such a head.
    "duplicate-token": ("duplicate", 0.5),
}
POSITIONAL_SHARE = 0.6  # "positional": the same fixed offset (not 0 or 1) is the argmax of ≥ 60% of rows


def fixed_offset_share(argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the most common i - argmax_j α_ij and the share of rows that have it; (n_layers, n_heads) each.
    `argmax`: (L, H, T), each row's first maximum (row_sums finds it in the head table's pass)."""
    n_tokens = argmax.shape[-1]
    offsets = torch.arange(n_tokens) - argmax  # (L, H, T), in -(T-1) .. T-1
    # The mode as the first (smallest) most counted offset: a count per offset, not torch.mode's sort.
    counts = torch.zeros(offsets.shape[:-1] + (2 * n_tokens - 1,)).scatter_add_(
        -1, offsets + (n_tokens - 1), torch.ones(offsets.shape))  # (L, H, 2T - 1)
    top = counts.max(-1)
    return top.indices - (n_tokens - 1), top.values / n_tokens


def tag_heads(stats: dict[str, torch.Tensor], argmax: torch.Tensor) -> list[list[list[str]]]:
    """tags[layer][head]: names from TAG_THRESHOLDS (plus "positional", from each row's `argmax`,
    (L, H, T)); "induction" needs stats["induction"]."""
    n_layers, n_heads = argmax.shape[:2]
    offset, share = fixed_offset_share(argmax)
    # Whole (L, H) comparisons, in float64 as a Python float compares, then one list each.
    flags = [(tag, (stats[stat].double() >= threshold).tolist())
             for tag, (stat, threshold) in TAG_THRESHOLDS.items() if stat in stats]
    flags.append(("positional", ((offset != 0) & (offset != 1) & (share.double() >= POSITIONAL_SHARE)).tolist()))
    return [[[tag for tag, on in flags if on[layer][head]] for head in range(n_heads)] for layer in range(n_layers)]


# Text whose token ids seed the induction probe: random draws over a model's whole vocabulary
# land on ids that training never updated (185 of tiny-gpt's 257 bytes never occur in its
# corpus), and an untrained embedding tells nothing about a head. Public domain (Lincoln), and a
# pangram, so that a byte-level model's pool holds every lower-case letter.
PROBE_SOURCE = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. The "
    "quick brown fox jumps over the lazy dog; It is for us the living, rather, to be dedicated here "
    "to the unfinished work which they who fought here have thus far so nobly advanced."
)
PROBE_LENGTH = 40  # random tokens per copy, at most; the probe is [first special?] + R + R
PROBE_SEED = 0


def induction_scores(model: AttentionModel, length: int = PROBE_LENGTH, seed: int = PROBE_SEED) -> torch.Tensor:
    """(n_layers, n_heads): on random tokens repeated twice, the mean weight from each token of the
    second copy to the token that followed its earlier occurrence (Olsson et al., 2022).

    The tokens of a copy are distinct, as in TransformerLens' test: drawn with repeats, a token
    had several earlier occurrences, a head that copies split its weight among their successors,
    and one at 0.39 on distinct tokens scored 0.17 (tiny-llama L1H2, untagged). A copy is then as
    long as the source has distinct tokens (34 bytes for a byte-level model), at most `length`.

    Computed once per model and kept on it: every run's tags reuse it. A model with fewer
    positions than the probe gets a shorter one (both copies must fit).
    """
    cached = getattr(model, "_induction_scores", None)
    if cached is not None and cached[0] == (length, seed):
        return cached[1]
    source = model.encode(PROBE_SOURCE, truncate=True)
    lead = [t for t in source.tokens[:1] if t.special]  # keep a BERT's [CLS]: its heads expect it
    pool = sorted({t.id for t in source.tokens if not t.special})
    asked, length = length, min(length, len(pool), (model.info.max_tokens - len(lead)) // 2)
    generator = torch.Generator().manual_seed(seed)
    draws = [pool[int(k)] for k in torch.randperm(len(pool), generator=generator)[:length]]
    body = [Token(str(i), i, 0, 0, False, 0, str(i)) for i in draws + draws]
    probe = Encoded(lead + body, [0] * (len(lead) + len(body)), False)
    attention = model.run([probe])[0].attention  # (n_layers, n_heads, T, T)
    start = len(lead)
    queries = torch.arange(start + length, start + 2 * length)  # every token of the second copy
    targets = queries - length + 1  # the token after its earlier occurrence
    scores = attention[:, :, queries, targets].mean(-1)
    model._induction_scores = ((asked, seed), scores)  # the key it is looked up by, not the shortened length
    return scores


def head_table(model: AttentionModel, result: AttentionResult) -> tuple[dict[str, torch.Tensor], list[list[list[str]]]]:
    """Stats for every head of a run, the model's induction scores beside them, and the tags."""
    stats, argmax = _stats_and_argmax(result.attention, result.tokens, model.info.causal, model.info.sliding_windows)
    stats["induction"] = induction_scores(model)
    return stats, tag_heads(stats, argmax)


# ---------------------------------------------------------------------------- word view
@dataclass(frozen=True)
class Word:
    text: str
    start: int
    end: int
    segment: int
    special: bool
    pieces: tuple[int, ...]  # token indices


def _ideograph(text: str) -> bool:
    """A CJK ideograph: a word of its own, as BERT's basic tokenizer splits them (Chinese and
    Japanese write no spaces, and touching spans made a whole sentence one word)."""
    return any(0x4E00 <= ord(c) <= 0x9FFF or 0x3400 <= ord(c) <= 0x4DBF or 0x20000 <= ord(c) <= 0x2FA1F
               or 0xF900 <= ord(c) <= 0xFAFF for c in text)


def _word_groups(tokens: list[Token]) -> list[list[int]]:
    """Consecutive pieces form a word when their spans touch or overlap in the same segment.

    Offsets, not vocabulary markers ("##", "Ġ", "▁"), decide, so WordPiece, byte-level BPE and
    SentencePiece behave alike. A piece that begins with a space begins a word (" bank"), and a
    lone space belongs to what follows it (" " then "(" is one word, not a word " "), or at a
    text's end to the word before it. Specials
    stand alone; so does punctuation ("river." is two words) but between two touching word
    pieces ("Don't", "e.g", "1,000", "well-known"); so do CJK ideographs. The bytes of one
    character (overlapping spans) are always one word. The one vocabulary marker read is
    WordPiece's "##" across a gap: BERT's tokenizer drops combining marks (NFD, then category Mn),
    so the pieces of नमस्ते leave out its virama and the spans of "नमस" and "##त" do not touch.
    """
    def contiguous(k: int) -> bool:  # piece k continues piece k - 1's span in one text
        token, prev = tokens[k], tokens[k - 1]
        return (k > 0 and not (token.special or prev.special) and token.segment == prev.segment
                and (token.start <= prev.end or (token.piece.startswith("##") and len(token.piece) > 2)))

    def wordlike(k: int) -> bool:
        return not (_is_delimiter(tokens[k]) or tokens[k].text.isspace() or _ideograph(tokens[k].text))

    groups: list[list[int]] = []
    inner = set()  # punctuation that joined the word around it
    for k, token in enumerate(tokens):
        prev = tokens[k - 1] if k else None
        if not contiguous(k):
            joins = False
        elif token.start < prev.end or prev.text.isspace():
            joins = True  # one character's bytes; a run of spaces and what follows it
        elif token.text[:1].isspace() or _ideograph(token.text) or _ideograph(prev.text):
            joins = False  # byte-level BPE: a leading space starts a word
        elif _is_delimiter(token):  # inside a word only: touching word pieces on both sides
            following = k + 1 < len(tokens) and contiguous(k + 1) and not tokens[k + 1].text[:1].isspace()
            joins = wordlike(k - 1) and following and wordlike(k + 1)
            if joins:
                inner.add(k)
        else:
            joins = not _is_delimiter(prev) or k - 1 in inner
        if joins:
            groups[-1].append(k)
        else:
            groups.append([k])
    # Spaces at a text's end, with no word to lead, end the word before them.
    merged: list[list[int]] = []
    for group in groups:
        if merged and contiguous(group[0]) and all(tokens[k].text.isspace() for k in group):
            merged[-1].extend(group)
        else:
            merged.append(group)
    return merged


def merge_words(tokens: list[Token], attention: torch.Tensor, source: tuple[str, str] | None = None):
    """Words and their attention, (..., W, W): keys summed over a word's pieces, queries averaged.

    Rows still sum to one. source: (text, text_pair), to name each word by its own characters.
    When no word has two pieces the merged attention is `attention` itself, not a copy.
    """
    groups = _word_groups(tokens)
    if len(groups) == len(tokens):
        merged = attention
    else:
        # Sums by index, not (W, T) @ A @ (T, W): two dense matmuls cost 4x a T=512 forward pass.
        word_of = torch.tensor([w for w, group in enumerate(groups) for _ in group])  # (T,)
        counts = torch.tensor([len(group) for group in groups], dtype=attention.dtype)  # (W,)
        # (..., T, T) -> (..., T, W): keys summed over each word's pieces
        keys = attention.new_zeros(attention.shape[:-1] + (len(groups),)).index_add_(-1, word_of, attention)
        # (..., T, W) -> (..., W, W): then queries averaged
        merged = keys.new_zeros(keys.shape[:-2] + (len(groups), len(groups))).index_add_(-2, word_of, keys)
        merged = merged / counts[:, None]
    words = []
    for group in groups:
        first, last = tokens[group[0]], tokens[group[-1]]
        if source is not None and not first.special:
            text = source[first.segment][first.start : last.end].strip() or first.text
        elif len(group) > 1:
            text = _joined(tokens[k] for k in group)
        else:
            text = first.text
        words.append(Word(text, first.start, last.end, first.segment, first.special, tuple(group)))
    return words, merged


def _joined(pieces) -> str:
    """A word's text from its pieces' without the source text. Each byte piece of a character that
    takes several bytes (a byte-level tokenizer's) carries that whole character, over the same
    span: "naïve" came out "naïïve", an emoji four times. A piece is added only past the last one's
    span; spaces at the ends go, as they do when the source names the word."""
    text, end = "", -1
    for piece in pieces:
        if piece.start >= end:
            text, end = text + piece.text, piece.end
    return text.strip() or text


# ---------------------------------------------------------------------------- neuron view
@dataclass(frozen=True)
class NeuronView:
    layer: int
    head: int
    kv_head: int  # the key/value head this query head reads (grouped-query attention shares them)
    query_index: int
    query: torch.Tensor  # (head_dim,), as the softmax saw it (after rotary, where the model has it)
    keys: torch.Tensor  # (T, head_dim)
    products: torch.Tensor  # (T, head_dim): query ⊙ key, whose sum is the raw score
    scores: torch.Tensor  # (T,): Σ(q ⊙ k) / √head_dim, -inf where masked
    weights: torch.Tensor  # (T,): the softmax of the scores, the row of the run's attention
    values: torch.Tensor  # (T, head_dim): what the weights mix


def neuron_view(model: AttentionModel, result: AttentionResult, layer: int, head: int, query_index: int) -> NeuronView:
    """One row of one head taken apart: the query at `query_index`, every key, their elementwise
    products, the scores Σ(q ⊙ k) / √head_dim (-inf where the causal mask or the layer's sliding
    window blocks a key), the run's own softmax row and the values it mixes; shapes in NeuronView.

    `result` must come from a run with Capture(qkv=True) (else ValueError) that kept its weights
    (not Capture(keep=True)). query_index counts as Python does (-1: the last token); outside the
    run it is an IndexError. A layer or head the model lacks (or no whole number) is a ValueError.
    Under grouped-query attention `kv_head` names the key/value head read."""
    if result.queries is None or result.keys is None or result.values is None:
        raise ValueError("the neuron view needs queries, keys and values: run with Capture(qkv=True)")
    info = model.info
    layer, head = index_below(layer, info.n_layers, "layer"), index_below(head, info.n_heads, "head")
    query_index = whole_number(query_index, "query_index")
    n_tokens = result.keys[layer].shape[1]
    if not -n_tokens <= query_index < n_tokens:
        raise IndexError(f"query_index {query_index} is outside this run's {n_tokens} tokens")
    query_index %= n_tokens  # -1: the last token, as Python counts (the causal mask needs it positive)
    n_kv = result.keys[layer].shape[0]
    kv_head = head // (info.n_heads // n_kv)
    query = result.queries[layer][head, query_index]  # (head_dim,)
    keys = result.keys[layer][kv_head]  # (T, head_dim)
    products = query[None, :] * keys  # (T, head_dim)
    scores = products.sum(-1) / math.sqrt(query.shape[-1])
    weights = result.attention[layer, head, query_index]
    # Masked keys (later ones, those behind the layer's sliding window) are -inf, whatever their score.
    blocked = blocked_rows(query_index, query_index + 1, 0, n_tokens, offset=0, causal=info.causal,
                           sliding_window=model.sliding_windows[layer], device=scores.device)
    if blocked is not None:
        scores[blocked[0]] = -math.inf
    return NeuronView(layer, head, kv_head, query_index, query, keys, products, scores, weights, result.values[layer][kv_head])


# ---------------------------------------------------------------------------- direct logit attribution
@dataclass(frozen=True)
class LogitAttribution:
    position: int  # the query position whose logits are read
    target: int  # the token id whose logit is decomposed
    logit: float  # the model's own logit for it
    heads: torch.Tensor  # (n_layers, n_heads): each head's direct contribution
    attention_bias: torch.Tensor  # (n_layers,): each out_proj's bias
    mlps: torch.Tensor  # (n_layers,): each feed-forward block's output
    embeddings: float  # token (and position) embeddings, the stream's start
    rest: float  # the final norm's shift and the unembedding's bias: fixed for this target

    @property
    def total(self) -> float:
        return float(self.heads.sum() + self.attention_bias.sum() + self.mlps.sum()) + self.embeddings + self.rest

    def ranked_heads(self) -> list[tuple[int, int, float]]:
        """(layer, head, contribution), the largest effect first, up or down: ranked by value, a
        short list left out the heads that pull hardest against the prediction (tiny-gpt's
        induction head at -0.50 came 16th of 16 where the first three were +0.34 to +0.16)."""
        n_heads = self.heads.shape[1]
        order = self.heads.flatten().abs().argsort(descending=True)
        return [(int(k) // n_heads, int(k) % n_heads, float(self.heads.flatten()[k])) for k in order]


class _StreamTap:
    """Hooks that keep the residual stream entering each block (and the final norm), and each
    out_proj's input and output: the heads' mixed values side by side and the block's write.

    Hooks sit on the shared module, so a server's other threads (its batcher, a generation) fire
    them too while the tap is on: only the thread that opened the tap is recorded.
    """

    def __init__(self, net):
        self.inputs: dict[int, torch.Tensor] = {}
        self.mixed: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._thread = threading.get_ident()
        self._hooks = []
        for i, block in enumerate(net.trf_blocks):
            self._hooks.append(block.register_forward_pre_hook(lambda m, args, i=i: self._keep(self.inputs, i, args[0])))
            self._hooks.append(block.att.out_proj.register_forward_hook(lambda m, args, out, i=i: self._out_proj(i, args[0], out)))
        if hasattr(net, "final_norm"):
            self._hooks.append(net.final_norm.register_forward_pre_hook(lambda m, args: self._keep(None, None, args[0])))

    def _keep(self, into: dict | None, index: int | None, tensor: torch.Tensor) -> None:
        if threading.get_ident() != self._thread:
            return
        tensor = tensor[0].detach().float().cpu()  # (T, width) of the lone input
        if into is None:
            self.final = tensor
        else:
            into[index] = tensor

    def _out_proj(self, index: int, context: torch.Tensor, output: torch.Tensor) -> None:
        self._keep(self.mixed, index, context)
        self._keep(self.outputs, index, output)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()


class Stream(NamedTuple):
    """One captured forward: the run with q/k/v, and what the measures that follow the residual
    stream read, so none of them recomputes what the forward already made."""

    result: AttentionResult
    inputs: list[torch.Tensor]  # (T, d_model) per layer: the stream entering each block
    final: torch.Tensor | None  # (T, d_model): the stream entering the final norm (None without one)
    # (T, n_heads * head_dim) per layer: out_proj's input, head h's Σ_j α_ij v_j in its slice
    mixed: list[torch.Tensor]
    outputs: list[torch.Tensor]  # (T, d_model) per layer: out_proj's output, the heads' writes + bias


def capture_stream(model: AttentionModel, encoded: Encoded, capture: Capture = Capture(qkv=True)) -> Stream:
    """One forward of one encoded input that keeps q/k/v, the residual stream entering each
    block and each attention block's out_proj input and output."""
    with _StreamTap(model.net) as tap:
        result = model.run([encoded], capture)[0]
    n_layers = len(tap.inputs)
    return Stream(result, [tap.inputs[i] for i in range(n_layers)], tap.final,
                  [tap.mixed[i] for i in range(n_layers)], [tap.outputs[i] for i in range(n_layers)])


def run_with_stream(model: AttentionModel, text: str, text_pair: str | None = None) -> Stream:
    """`capture_stream` of a text."""
    return capture_stream(model, model.encode(text, text_pair))


def _frozen_norm(norm: torch.nn.Module, stream: torch.Tensor):
    """The final norm as a linear map at this run's scale: (apply to a component, the constant part)."""
    scale = norm.scale.detach().float().cpu()
    if hasattr(norm, "shift"):  # LayerNorm: centre, then divide by this position's σ
        sigma = torch.sqrt(stream.var(-1, unbiased=False) + norm.eps)
        return (lambda c: scale * (c - c.mean(-1, keepdim=True)) / sigma), norm.shift.detach().float().cpu()
    rms = torch.sqrt(stream.pow(2).mean(-1) + norm.eps)  # RMSNorm: divide by this position's rms
    return (lambda c: scale * c / rms), torch.zeros_like(scale)


def logit_attribution(model: AttentionModel, text: str, position: int, target: int | None = None) -> LogitAttribution:
    """Each component's direct contribution to one logit, through the final norm frozen at this run's scale.

    For pre-norm language models (every causal family here): the stream entering the final norm
    is the embeddings plus, per layer, each head's write, the out_proj bias and the feed-forward
    output, so the parts add up to the logit exactly (TransformerLens' direct logit attribution).
    target None: the model's own top prediction at that position.
    """
    check_attributable(model)
    stream = run_with_stream(model, text)
    return attribute_logit(model, stream.result, stream.inputs, stream.final, position, target)


def check_attributable(model: AttentionModel) -> None:
    net = model.net
    if not model.info.causal or not hasattr(net, "final_norm") or not getattr(net, "has_lm_head", False):
        raise ValueError("logit attribution needs a pre-norm language model with a final norm and an output head")


def attribute_logit(model: AttentionModel, result: AttentionResult, inputs: list[torch.Tensor], final: torch.Tensor,
                    position: int, target: int | None = None) -> LogitAttribution:
    """`logit_attribution` of a run already captured by `capture_stream`. A result kept without
    its (T, vocab) logits gets the one row it needs from the last hidden state."""
    check_attributable(model)
    net = model.net
    n_tokens = len(result.tokens)
    if not 0 <= position < n_tokens:
        raise ValueError(f"position must be in 0..{n_tokens - 1}")
    if result.logits is not None:
        logits = result.logits[position]
    else:
        head_bias = getattr(net.out_head, "bias", None)
        logits = result.hidden[position] @ net.out_head.weight.detach().float().cpu().T  # (vocab,)
        if head_bias is not None:
            logits = logits + head_bias.detach().float().cpu()
    target = int(logits.argmax()) if target is None else int(target)
    if not 0 <= target < logits.shape[-1]:
        raise ValueError(f"target must be a token id in 0..{logits.shape[-1] - 1}")

    stream = final[position]  # (d_model,)
    normed, shift = _frozen_norm(net.final_norm, stream)
    unembed = net.out_head.weight.detach().float().cpu()[target]  # (d_model,)
    out_bias = float(net.out_head.bias[target]) if getattr(net.out_head, "bias", None) is not None else 0.0

    def direct(component: torch.Tensor) -> torch.Tensor:
        # normed keeps the shape: (d_model,) @ (d_model,) -> () for one part,
        # (n_layers, n_heads, d_model) @ (d_model,) -> (n_layers, n_heads) for every head's write
        return normed(component) @ unembed

    writes = head_writes(model, result)[:, :, position]  # (n_layers, n_heads, d_model)
    n_layers = writes.shape[0]
    attention_bias, mlps = torch.zeros(n_layers), torch.zeros(n_layers)
    for layer, block in enumerate(net.trf_blocks):
        bias = block.att.out_proj.bias
        bias = bias.detach().float().cpu() if bias is not None else torch.zeros_like(stream)
        after = inputs[layer + 1][position] if layer + 1 < n_layers else stream
        attention_bias[layer] = direct(bias)
        mlps[layer] = direct(after - inputs[layer][position] - writes[layer].sum(0) - bias)
    return LogitAttribution(
        position=position,
        target=target,
        logit=float(logits[target]),
        heads=direct(writes),
        attention_bias=attention_bias,
        mlps=mlps,
        embeddings=float(direct(inputs[0][position])),
        rest=float(shift @ unembed) + out_bias,  # (d_model,) @ (d_model,) -> ()
    )


# ---------------------------------------------------------------------------- information-flow routes
@dataclass(frozen=True)
class FlowEdge:
    layer: int  # the edge runs from token `source` below layer `layer` to token `target` above it
    source: int
    target: int
    weight: float  # the source's share of what the target's stream becomes, in [0, 1]
    head: int | None  # the head that carries most of it; None for the residual (source == target)


def _proximity(through: torch.Tensor, residual: torch.Tensor, total: torch.Tensor, silent: torch.Tensor) -> torch.Tensor:
    """Ferrando & Voita's importance: max(0, ‖y‖₁ - ‖y - z‖₁), normalised over the parts.

    through: (T_source, chunk, d), what each source token moved into each target, which this
    overwrites; residual and total (y): (chunk, d); silent: (chunk, T_source), True where no head
    attends from the target to the source (a later token under a causal mask): it moved nothing
    and scores 0 exactly, whatever the rounding of two sums of the same numbers.
    Returns (chunk, T_source + 1): every source, then the residual.
    """
    # In place: the (chunk, T, d) differences, their absolute values and the parts joined to the
    # residual were three fresh tensors of 25 MB a chunk at T=512.
    apart = through.sub_(total).abs_().sum(-1).T  # ‖z - y‖₁ = ‖y - z‖₁: (chunk, T_source)
    apart = torch.cat([apart, (total - residual).abs().sum(-1, keepdim=True)], dim=-1)  # (chunk, T_source + 1)
    raw = (total.abs().sum(-1, keepdim=True) - apart).clamp_min(0)
    raw[:, :-1].masked_fill_(silent, 0)
    return raw / raw.sum(-1, keepdim=True).clamp_min(1e-30)


FLOW_CHUNK = 32  # targets at a time: bounds the (chunk, T, d_model) edge tensor (25 MB at T=512)


def information_flow(model: AttentionModel, text: str, threshold: float = 0.05, text_pair: str | None = None):
    """Token-to-token routes through the layers (Ferrando & Voita, 2024), edges below `threshold` pruned.

    At each layer, token i's stream after attention is y_i = x_i + Σ_j z_ij + b, where z_ij is
    what every head moves from token j (Σ_h α_h,ij · v_h,j W_O,h) and x_i the residual. Each
    edge j → i weighs z_ij (the residual: x_i) by its proximity to y_i, so the edges into one
    token at one layer share 1. Returns (tokens, edges).
    """
    stream = run_with_stream(model, text, text_pair)
    return stream.result.tokens, flow_edges(model, stream.result, stream.inputs, threshold)


def flow_edges(model: AttentionModel, result: AttentionResult, inputs: list[torch.Tensor], threshold: float) -> list[FlowEdge]:
    """`information_flow`'s edges for a run already captured by `capture_stream`."""
    info = model.info
    edges: list[FlowEdge] = []
    for layer, block in enumerate(model.net.trf_blocks):
        values = _per_query_head(result.values[layer], info.n_heads)  # (n_heads, T, head_dim)
        w_o = block.att.out_proj.weight.detach().float().cpu()
        # (d_model, n_heads * head_dim) -> (n_heads, head_dim, d_model)
        w_o = w_o.view(w_o.shape[0], info.n_heads, info.head_dim).permute(1, 2, 0)
        moved = values @ w_o  # (n_heads, T_source, d_model): what each head would move from each token
        weights_l = result.attention[layer]  # (n_heads, T, T_source)
        residual = inputs[layer]  # (T, d_model)
        bias = block.att.out_proj.bias
        bias = bias.detach().float().cpu() if bias is not None else torch.zeros(residual.shape[-1])
        # α ≥ 0, so ‖α_h,ij · m_h,j‖ = α_h,ij ‖m_h,j‖: the carrier needs no (T, T, d_model) tensor.
        # max(0).indices, not argmax(0): the same first maximum, 6x faster across the heads' dimension.
        carrier = (weights_l * moved.norm(dim=-1).unsqueeze(1)).max(0).indices  # (T, T_source)
        n_tokens = residual.shape[0]
        weights = torch.empty(n_tokens, n_tokens + 1)
        # One contiguous copy a layer, batched by source: einsum made one a chunk, and its batched
        # matmuls over strided operands took twice as long.
        moved_by_source = moved.transpose(0, 1).contiguous()  # (T_source, n_heads, d_model)
        for start in range(0, n_tokens, FLOW_CHUNK):
            stop = min(start + FLOW_CHUNK, n_tokens)
            by_source = weights_l[:, start:stop].permute(2, 1, 0).contiguous()  # (T_source, chunk, n_heads)
            # (T_source, chunk, n_heads) x (T_source, n_heads, d_model) -> (T_source, chunk, d_model)
            through = torch.bmm(by_source, moved_by_source)
            total = residual[start:stop] + through.sum(0) + bias  # (chunk, d_model)
            silent = (weights_l[:, start:stop] == 0).all(0)  # (chunk, T_source)
            weights[start:stop] = _proximity(through, residual[start:stop], total, silent)
        kept = (weights > 0) & (weights >= threshold)  # (T, T_source + 1); the last column is the residual
        targets, sources = kept.nonzero(as_tuple=True)  # row-major: by target, then source
        # Read out in one go: a tensor index per edge was 0.1-0.2 s of a 500-token run's 10,000 edges.
        # (the residual column has no head: its index is clamped into range and the head dropped)
        found = zip(targets.tolist(), sources.tolist(), weights[targets, sources].tolist(),
                    carrier[targets, sources.clamp_max(n_tokens - 1)].tolist())
        edges += [
            FlowEdge(layer, target, target, weight, None) if source == n_tokens else FlowEdge(layer, source, target, weight, head)
            for target, source, weight, head in found
        ]
    return edges
