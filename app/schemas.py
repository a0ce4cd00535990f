"""The v1 contract: every request and response body, with the examples /docs shows."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from manyeyes.app.services.errors import brief

Format = Literal["json", "f16", "u8"]
PRECISION_DOC = (
    "The most precise format the run's later views can take. json unless a GPU server kept the run as "
    "the u8 or f16 bytes that crossed from its device; a more precise view then needs the text posted "
    "again in that format (otherwise 422 kept_quantised)"
)
Keep = Literal["auto", "weights", "qk"]


def _ascii_digits(value):
    """A query string's whole number as ASCII digits, as the list parameters take them
    (services.attention.parse_index): pydantic alone read "+1", "1.0" and " 1 " as 1."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError("must be a whole number written in digits (0, 1, 2, ...)")
    return value


# Marks an integer query parameter: Annotated[int, Query(ge=0), DIGITS] (after its bounds, which
# then still show in the schema as its minimum).
DIGITS = BeforeValidator(_ascii_digits)

_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _ascii_decimal(value):
    """A query string's number as a decimal, as JSON or a browser's form writes it: pydantic alone
    read "0.1_0" (Python's digit grouping), "+0.1" and " 0.1 " as 0.1."""
    if isinstance(value, str) and not _DECIMAL.fullmatch(value):
        raise ValueError("must be a number written as a decimal (0.05, .5, 1e-2)")
    return value


# Marks a float query parameter, as DIGITS an integer one.
DECIMAL = BeforeValidator(_ascii_decimal)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("text must contain something other than whitespace")
    return value


def _optional_not_blank(value: str | None) -> str | None:
    """text_pair's check, on every request that takes one: a blank second text ran as a pair with
    an empty segment ([CLS] text [SEP] [SEP]) and answered 200, a run of an input nobody meant."""
    return None if value is None else _not_blank(value)


# No model has more layers or heads than this; lists of them are bounded by it too.
MAX_INDEX = 4096
# The most texts a batch may hold, whatever the server's max_batch_texts says.
MAX_BATCH_TEXTS = 4096
# Unknown fields of one object named one by one (pydantic's words); more are one error.
UNKNOWN_NAMED = 4


class RequestBody(BaseModel):
    """Every request body: no coercion of client input (strict), no unknown fields, and few errors
    however the body is wrong. Describing a validation error is slow (about 4 µs each, on the event
    loop): a 1 MB body of 490,000 wrong list items or 60,000 unknown fields had the server describe
    every one (2.6 s, a 25 MB answer) while every other client waited. Lists are bounded
    (max_length), and many unknown fields of one object are one error."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data):
        if isinstance(data, dict) and len(data) > UNKNOWN_NAMED:
            unknown = [key for key in data if key not in cls.model_fields]
            if len(unknown) > UNKNOWN_NAMED:
                named = ", ".join(repr(brief(key, 40)) for key in unknown[:UNKNOWN_NAMED])
                raise ValueError(f"{len(unknown):,} fields this object does not take ({named}, ...); "
                                 f"it takes {', '.join(cls.model_fields)}")
        return data


class PredictionsRequest(RequestBody):
    top_k: int = Field(5, ge=1, le=20, description="Predictions per position, best first")


class Options(RequestBody):
    # strict (RequestBody): no coercion of client input, so `"truncate": 0` or `"layers": ["1"]` is
    # a 422, as the schema says, rather than a guess.

    model: str | None = Field(None, description="A model id from GET /api/v1/models; default: the server's default")
    layers: list[int] | None = Field(None, min_length=1, max_length=MAX_INDEX, description="Layer indices to return; default: all")
    heads: list[int] | None = Field(None, min_length=1, max_length=MAX_INDEX, description="Head indices to return; default: all")
    format: Format = Field(
        "json",
        description="json: nested float32 lists. f16: base64 little-endian float16. "
        "u8: base64 bytes, weight ≈ byte × scale (1/255). Compact formats are ~10× smaller and faster.",
    )
    truncate: bool = Field(False, description="Cut input longer than the model's positions instead of refusing it")
    predictions: PredictionsRequest | None = Field(
        None, description="Also return the model's own top-k predictions (422 for a model without an LM head)"
    )


class AttentionRequest(Options):
    text: str = Field(..., min_length=1)
    text_pair: str | None = Field(None, min_length=1, description="Second segment, for sentence-pair models")
    measures: list[MeasureName] | None = Field(
        None, min_length=1, max_length=64, description="Also return these measures of the run, in `format` (heads: JSON); "
        "the same as GET /api/v1/runs/{run_id}/measures"
    )
    keep: Keep = Field(
        "auto",
        description="What the run keeps. weights: the (layers, heads, T, T) weights, sent in the answer. "
        "qk: the queries and keys, from which /runs/{run_id}/tile, /topk and /overview compute any head "
        "exactly; the answer is then metadata with `attention: null` and `links`. auto: qk above the "
        "server's dense_max_tokens (GET /api/v1/runs/{run_id} tells) or when the weights would not fit "
        "the run cache, weights otherwise",
    )

    _text = field_validator("text")(_not_blank)

    _pair = field_validator("text_pair")(_optional_not_blank)

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"text": "The bank of the river.", "format": "u8"},
                {"text": "The bank of the river.", "layers": [2], "heads": [3], "format": "json"},
                {"text": "Where is it?", "text_pair": "On the bank.", "model": "minilm", "format": "f16"},
                {"text": "In the beginning", "model": "tiny-gpt", "format": "u8", "predictions": {"top_k": 3}},
                {"text": "The bank of the river.", "format": "u8", "measures": ["rollout", "heads"]},
                {"text": "A long document ...", "model": "tiny-gpt", "keep": "qk"},
            ]
        },
    )


class BatchRequest(Options):
    # Each text constrained, as `text` is: a constrained str is checked for valid Unicode, so a
    # lone surrogate is a 422 here rather than a TypeError in the tokenizer.
    texts: list[Annotated[str, Field(min_length=1)]] = Field(
        ..., min_length=1, max_length=MAX_BATCH_TEXTS, description="Texts to run; at most the server's max_batch_texts"
    )

    text_pairs: list[Annotated[str, Field(min_length=1)] | None] | None = Field(
        None, max_length=MAX_BATCH_TEXTS, description="Second segments, for sentence-pair models: one per text, in order (null: that text has none)"
    )

    @field_validator("texts")
    @classmethod
    def _texts(cls, values: list[str]) -> list[str]:
        for i, value in enumerate(values):
            if not value.strip():
                raise ValueError(f"texts[{i}] must contain something other than whitespace")
        return values

    @field_validator("text_pairs")
    @classmethod
    def _pairs(cls, values: list[str | None] | None) -> list[str | None] | None:
        for i, value in enumerate(values or []):
            if value is not None and not value.strip():
                raise ValueError(f"text_pairs[{i}] must contain something other than whitespace (null: no pair)")
        return values

    @model_validator(mode="after")
    def _one_pair_a_text(self) -> "BatchRequest":
        if self.text_pairs is not None and len(self.text_pairs) != len(self.texts):
            raise ValueError(f"text_pairs holds {len(self.text_pairs)} entries for {len(self.texts)} texts: one per text, null where none")
        return self

    def inputs(self) -> list[tuple[str, str | None]]:
        return list(zip(self.texts, self.text_pairs or [None] * len(self.texts)))

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"texts": ["The bank of the river.", "I paid at the bank."], "format": "u8"},
            {"texts": ["Where is it?", "Who said it?"], "text_pairs": ["On the bank.", None], "model": "minilm", "format": "f16"},
        ]},
    )


class TokenOut(BaseModel):
    text: str = Field(description="The characters this token covers; the vocabulary piece for special tokens")
    id: int
    start: int = Field(description="Character offset into its own segment's text")
    end: int = Field(description="Exclusive end offset")
    special: bool
    segment: int = Field(description="0: text, 1: text_pair")
    piece: str = Field(description="The model's own vocabulary piece: '##ing' (WordPiece), 'Ġthe' (byte-level BPE), '[UNK]'")


class AttentionData(BaseModel):
    format: Format
    dtype: Literal["float32", "float16", "uint8"]
    shape: list[int] = Field(description="[layers, heads, T, T]: rows are queries, columns keys")
    data: list | str = Field(description="Nested lists (json) or base64 (f16, u8), row-major")
    scale: float | None = Field(None, description="u8 only: weight ≈ byte × scale")


class PredictionOut(BaseModel):
    token: str = Field(description="How the predicted id reads on its own, e.g. ' the'; '\ufffd' for any byte-level "
                       "piece of part of a character (`piece` tells those apart)")
    id: int
    prob: float = Field(description="Softmax probability over the whole vocabulary")
    piece: str = Field(description="The id's vocabulary piece, as a token of that id in `tokens` has it: 'Ġthe', "
                       "'##ing', 'å' for the byte 0xE5")


class Timing(BaseModel):
    tokenize: float
    queue: float = Field(description="In the batcher's queue, waiting for a forward pass")
    forward: float
    wait: float = Field(0.0, description="For the answers' memory and a render slot, behind other answers being sent")
    encode: float


class MeanOf(BaseModel):
    layers: list[int] = Field(description="The model's layers averaged")
    heads: list[int] = Field(description="Each of those layers' heads averaged: all of them")


class AttentionResponse(BaseModel):
    run_id: str = Field(description="Fetch other slices of this run from GET /api/v1/runs/{run_id}/attention")
    model: str
    causal: bool
    n_layers: int
    n_heads: int
    tokens: list[TokenOut]
    truncated: bool
    layers: list[int]
    heads: list[int]
    kept: Literal["weights", "qk"] = Field(
        description="How the run is kept (a run id names the text, not how it was kept). weights: the run holds "
        "whole weights, and `attention` holds them, unless the request asked `keep: \"qk\"`: then `attention` is null "
        "and `links` given, as for a qk run. qk: the run kept queries and keys; `attention` is null and `links` names "
        "the routes that serve its heads"
    )
    precision: Format = Field(description=PRECISION_DOC)
    attention: AttentionData | None
    links: RunLinks | None = Field(None, description="where `attention` is null (a qk run, or `keep: \"qk\"` asked): URL "
                                   "templates of the run's routes")
    predictions: dict[str, list[PredictionOut]] | None = Field(
        None,
        description="Only when asked for: token position -> top-k. Causal LMs: the next token after every "
        "position. Masked LMs: the masked token at each [MASK] / <mask> position.",
    )
    measures: MeasuresOut | None = Field(None, description="Only when asked for with `measures`")
    mean_of: MeanOf | None = Field(None, description="Only from GET /runs/{run_id}/mean: what its one matrix averages")
    device: str
    timing_ms: Timing

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f",
                    "model": "minilm",
                    "causal": False,
                    "n_layers": 6,
                    "n_heads": 12,
                    "tokens": [
                        {"text": "[CLS]", "id": 101, "start": 0, "end": 0, "special": True, "segment": 0, "piece": "[CLS]"},
                        {"text": "Hi", "id": 7632, "start": 0, "end": 2, "special": False, "segment": 0, "piece": "hi"},
                        {"text": "[SEP]", "id": 102, "start": 0, "end": 0, "special": True, "segment": 0, "piece": "[SEP]"},
                    ],
                    "truncated": False,
                    "layers": [0],
                    "heads": [0],
                    "kept": "weights",
                    "precision": "json",
                    "attention": {
                        "format": "u8",
                        "dtype": "uint8",
                        "shape": [1, 1, 3, 3],
                        "data": "Ww6WYiV4OBSz",
                        "scale": 1 / 255,
                    },
                    "device": "cpu",
                    "timing_ms": {"tokenize": 0.1, "queue": 0.2, "forward": 8.1, "wait": 0.0, "encode": 0.1},
                }
            ]
        }
    )


class BatchResponse(BaseModel):
    results: list[AttentionResponse]


class ModelOut(BaseModel):
    id: str
    family: str = Field(description="Hugging Face model_type (bert, roberta, gpt2, llama, ...) or gpt (a book checkpoint)")
    causal: bool
    n_layers: int
    n_heads: int = Field(description="Query heads; attention is returned per query head")
    n_kv_heads: int = Field(description="Key/value heads: fewer than n_heads under grouped-query attention")
    d_model: int
    head_dim: int
    max_tokens: int
    device: str
    dtype: str = Field(description="Weights' dtype; softmax and returned weights are float32 regardless")
    predictions: bool = Field(description="Whether `predictions` may be asked for (the model has an LM head)")
    sliding_windows: list[int | None] = Field(
        description="Per layer: W when each query of that layer sees only its last W positions, itself included "
        "(the keys further back are masked, as later keys are in a causal model); null: no window"
    )
    token_changes: list[Literal["mask", "unk", "delete"]] = Field(
        description="The changes POST /experiments/change-token can make with this model's vocabulary: "
        "delete always; mask and unk where it has those tokens"
    )
    eos_ids: list[int] = Field(
        description="A causal model's end-of-text token ids, where POST /generate stops (its config's eos_token_id, "
        "else its tokenizer's <|endoftext|>); empty: none known, or an encoder"
    )
    default: bool


class ServerLimits(BaseModel):
    """What this server was started with, where a client must size its requests to it: the page
    asked for float32 JSON it could have known would be refused (413), and capped its tokens box
    at the default 256 whatever the server allowed."""

    max_json_cells: int = Field(description="Weights a format=json answer may hold (MANYEYES_MAX_JSON_CELLS); "
                                "beyond, 413 too_many_cells: ask for f16 or u8")
    max_new_tokens: int = Field(description="The most tokens one POST /generate may ask for (MANYEYES_MAX_NEW_TOKENS)")


class ModelsResponse(BaseModel):
    models: list[ModelOut]
    limits: ServerLimits


class ErrorDetail(BaseModel):
    code: str = Field(examples=["too_long"])
    message: str = Field(examples=["input is 700 tokens long but the model takes at most 512; shorten it or ask for truncation"])
    max_batch_texts: int | None = Field(None, description="POST /attention/batch with too many texts: the server's limit")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str = Field(examples=["ok"])


class Ready(BaseModel):
    status: str = Field(examples=["ready"])
    models: list[str]


class ModelProgress(BaseModel):
    state: Literal["queued", "loading", "downloading", "warming", "ready", "failed"]
    bytes_done: int | None = Field(None, description="While a Hugging Face id downloads")
    bytes_total: int | None = None


class Loading(ErrorResponse):
    """/readyz's 503: the error plus where each model stands."""

    status: Literal["loading", "failed"]
    models: dict[str, ModelProgress]


# ---------------------------------------------------------------------------- generation
class GenerateRequest(RequestBody):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"text": "In the beginning", "model": "tiny-gpt", "max_new_tokens": 20},
                {"text": "In the beginning", "model": "tiny-gpt", "max_new_tokens": 20, "temperature": 0.8, "top_k": 40, "seed": 1},
                {"text": "In the beginning", "model": "tiny-gpt", "max_new_tokens": 20, "stop_at_eos": False},
            ]
        },
    )

    text: str = Field(..., min_length=1, description="The prompt")
    model: str | None = Field(None, description="A causal model id from GET /api/v1/models; default: the server's "
                              "default, or where that is an encoder, the first causal model the server lists")
    max_new_tokens: int = Field(20, ge=1, description="Tokens to generate; bounded by the model's context and the server's max_new_tokens")
    temperature: float = Field(0.0, ge=0, le=10, allow_inf_nan=False, description="0: greedy; above 0: sample at this temperature")
    top_k: int | None = Field(None, ge=1, description="Sample only among the k most likely tokens")
    # torch seeds a generator with an unsigned 64-bit integer; a bigger one failed after the 200 was sent.
    seed: int | None = Field(None, ge=0, le=2**64 - 1, description="A seeded sample repeats exactly")
    alternatives: int = Field(5, ge=1, le=50, description="Most likely tokens reported with each step")
    stop_at_eos: bool = Field(
        True, description="End after a step whose token ends the text (the model's `eos_ids` in GET /api/v1/models), "
        "that step included, as Hugging Face's generate does; false: make max_new_tokens tokens whatever they are"
    )

    _text = field_validator("text")(_not_blank)


class ChoiceOut(BaseModel):
    id: int
    text: str = Field(description="How the id reads on its own; '\ufffd' for any byte-level piece of part of a character")
    prob: float = Field(description="Under the model's own distribution (temperature 1, no top-k cut)")
    piece: str = Field(description="The id's vocabulary piece, as a prompt token of that id has it: 'Ġthe', 'å' for the byte 0xE5")


class GenerateStart(BaseModel):
    type: Literal["start"] = "start"
    model: str
    n_layers: int
    n_heads: int
    prompt: list[TokenOut]


class GenerateStep(BaseModel):
    type: Literal["step"] = "step"
    index: int = Field(description="0 for the first generated token")
    position: int = Field(description="Its position in the whole sequence, prompt included")
    token: ChoiceOut
    alternatives: list[ChoiceOut]
    attention: list[list[list[float]]] = Field(description="(layers, heads, position + 1): the token's row in every head")


class GenerateEnd(BaseModel):
    type: Literal["end"] = "end"
    reason: Literal["length", "eos", "error", "shutdown"] = Field(
        "length", description="length: max_new_tokens were made; eos: the model ended the text (the last step's token is "
        "an end-of-text id; fewer tokens than asked, or as many where the last one ended it), a complete generation; "
        "error: a step failed, `error` says why; shutdown: the server is stopping (fewer tokens than asked)"
    )
    tokens: int
    error: str | None = Field(None, description="Only with reason error")


# ---- page: saved views (issue 13) -----------------------------------------------------------


class ViewState(RequestBody):
    """Everything the page needs to draw one view again; stored under its content id."""

    text: str = Field(..., min_length=1, max_length=200_000)
    text_pair: str | None = Field(None, min_length=1, max_length=200_000)
    # Saved under the id it resolves to. Required, a "" was told to "omit it for the default", which
    # was then a 422; "" is a 404 unknown_model, as on every route.
    model: str | None = Field(None, max_length=200, description="The served model's id; omitted: the server's default")
    truncate: bool = False
    layer: int = Field(0, ge=0, le=MAX_INDEX)
    head: int = Field(0, ge=0, le=MAX_INDEX)
    aggregate: Literal["head", "layer", "all"] = "head"
    heads: list[Annotated[int, Field(ge=0, le=MAX_INDEX)]] = Field(
        default_factory=list, max_length=256, description="Heads the head view draws"
    )
    hide_special: bool = False
    hide_first: bool = False
    # Saved at most at the page slider's 0.5 (check_view): not bounded here, where a view stored
    # before that check would fail to load.
    threshold: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="Weights under it drawn as 0 (saved: 0 to 0.5, the page's slider)")
    segments: Literal["all", "AA", "AB", "BA", "BB"] = "all"
    scale: Literal["head", "fixed", "log"] = "head"
    labels: Literal["pieces", "text"] = "pieces"
    measure: Literal["raw", "rollout", "value_norms", "contributions"] = Field(
        "raw", description="What the measures section draws for the focused head"
    )
    word_view: bool = Field(False, description="The measures section merges pieces into words")
    guess_position: int | None = Field(None, ge=0, le=1_000_000, description="Why this guess?: the position explained (default the last)")
    guess_target: int | None = Field(None, ge=0, le=10_000_000, description="Why this guess?: the token id explained (default the top guess)")

    _text = field_validator("text")(_not_blank)

    _pair = field_validator("text_pair")(_optional_not_blank)

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"text": "The bank of the river.", "model": "minilm", "layer": 2, "head": 3}]},
    )


class ViewSaved(BaseModel):
    id: str = Field(description="Content id: the same view always gets the same id; open /?view=<id>")


# ---- measures beyond raw weights (issue 11) --------------------------------------------------

MeasureName = Literal["rollout", "value_norms", "contributions", "words", "heads"]


class MeasureMatrix(BaseModel):
    format: Format
    dtype: Literal["float32", "float16", "uint8"]
    shape: list[int] = Field(description="rollout: [T, T]; value_norms and word attention: [layers, heads, T, T] "
                                         "(W for words); contributions: [layers, heads, T]; bias_shares: [layers, T]")
    data: list | str = Field(description="Nested lists (json) or base64 (f16, u8), row-major")
    scale: float | None = Field(None, description="u8 only: value ≈ offset + byte × scale")
    offset: float | None = Field(None, description="u8 only: the smallest value (0 unless some are negative)")


class ContributionsOut(BaseModel):
    norms: MeasureMatrix = Field(description="‖what head h writes into the residual stream at query i‖")
    shares: MeasureMatrix = Field(description="That write projected on the whole attention block's output; "
                                              "heads plus bias_shares sum to 1 per position, negative when a head cancels others")
    bias_shares: MeasureMatrix = Field(description="out_proj's bias: the rest of the sum")


class WordOut(BaseModel):
    text: str
    start: int
    end: int
    segment: int
    special: bool
    pieces: list[int] = Field(description="Indices of the tokens this word merges")


class WordsOut(BaseModel):
    words: list[WordOut]
    attention: MeasureMatrix = Field(description="Keys summed over a word's pieces, queries averaged; rows still sum to 1")


class HeadRow(BaseModel):
    layer: int
    head: int
    tags: list[str] = Field(description="previous-token, induction, sink, broad, self, positional; several or none")
    stats: dict[str, float] = Field(description="entropy (0 sharp…1 uniform over the keys in reach), distance (tokens), self, "
                                                "previous, first, delimiter, duplicate (attention shares), induction (the built-in "
                                                "probe); each a mean over the rows where it is defined, 0 where none is (duplicate "
                                                "on a text with no repeated token)")


class TagRule(BaseModel):
    stat: str
    at_least: float


class HeadsOut(BaseModel):
    stats: list[str]
    rows: list[HeadRow] = Field(description="The heads asked for (every head by default), layer-major")
    thresholds: dict[str, TagRule]
    positional_share: float = Field(description="positional: one fixed offset (not 0 or 1) is the argmax of at least this share of rows")


class MeasuresOut(BaseModel):
    """Only the measures asked for are present."""

    rollout: MeasureMatrix | None = Field(None, description="Attention rollout (Abnar & Zuidema, 2020), (T, T): over every layer and head, whatever layers and heads ask")
    value_norms: MeasureMatrix | None = Field(None, description="‖α_ij · f_h(x_j)‖ (Kobayashi et al., 2020)")
    contributions: ContributionsOut | None = None
    words: WordsOut | None = None
    heads: HeadsOut | None = None


class MeasuresResponse(BaseModel):
    run_id: str
    model: str
    layers: list[int]
    heads: list[int]
    measures: MeasuresOut

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "model": "tiny-gpt", "layers": [1], "heads": [0],
        "measures": {
            "rollout": {"format": "json", "dtype": "float32", "shape": [2, 2], "data": [[1.0, 0.0], [0.62, 0.38]]},
            "value_norms": {"format": "u8", "dtype": "uint8", "shape": [1, 1, 2, 2], "data": "/wAxfw==",
                            "scale": 0.0112, "offset": 0.0},
            "heads": {"stats": ["entropy", "distance", "self", "previous", "first", "delimiter", "duplicate", "induction"],
                      "rows": [{"layer": 1, "head": 0, "tags": ["induction"],
                                "stats": {"entropy": 0.5, "distance": 13.9, "self": 0.07, "previous": 0.06, "first": 0.37,
                                          "delimiter": 0.02, "duplicate": 0.31, "induction": 0.61}}],
                      "thresholds": {"induction": {"stat": "induction", "at_least": 0.3}}, "positional_share": 0.6},
        },
    }]})


class FlowEdgeOut(BaseModel):
    layer: int = Field(description="The edge runs from token `source` below this layer to token `target` above it")
    source: int
    target: int
    weight: float = Field(description="The source's share of what the target's stream becomes; a target's edges at a layer sum to 1 before pruning")
    head: int | None = Field(description="The head that carries most of it; null for the residual (source == target)")


class FlowResponse(BaseModel):
    run_id: str
    threshold: float
    n_layers: int
    n_tokens: int
    edges: list[FlowEdgeOut]

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "threshold": 0.05, "n_layers": 2, "n_tokens": 3,
        "edges": [{"layer": 0, "source": 0, "target": 1, "weight": 0.41, "head": 3},
                  {"layer": 0, "source": 1, "target": 1, "weight": 0.59, "head": None}]}]})


class NeuronResponse(BaseModel):
    run_id: str
    layer: int
    head: int
    kv_head: int = Field(description="The key/value head this query head reads: head // (n_heads / n_kv_heads)")
    n_heads: int
    n_kv_heads: int
    query_index: int
    query: list[float] = Field(description="(head_dim,) as the softmax saw it: after rotary where the model has it")
    keys: list[list[float]] = Field(description="(T, head_dim)")
    products: list[list[float]] = Field(description="(T, head_dim): query ⊙ key; a row sums to the raw score")
    scores: list[float | None] = Field(description="Σ(q ⊙ k) / √head_dim; null where the key is masked (later tokens of a causal model, keys behind a sliding window)")
    weights: list[float] = Field(description="The softmax: this query's row of the head's attention")
    values: list[list[float]] = Field(description="(T, head_dim): what the weights mix")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "layer": 1, "head": 4, "kv_head": 1, "n_heads": 6, "n_kv_heads": 2,
        "query_index": 1, "query": [0.5, -1.0], "keys": [[1.0, 0.2], [0.1, -0.9]], "products": [[0.5, -0.2], [0.05, 0.9]],
        "scores": [0.212, 0.672], "weights": [0.387, 0.613], "values": [[0.3, 0.1], [-0.2, 0.4]]}]})


class HeadAttribution(BaseModel):
    layer: int
    head: int
    contribution: float


class LogitAttributionResponse(BaseModel):
    run_id: str
    position: int
    target: int = Field(description="The token id whose logit is decomposed (default: the model's top prediction)")
    target_text: str = Field(description="The target as its own text (a byte of part of a character reads \"\\ufffd\")")
    target_piece: str = Field("", description="The target's vocabulary piece, as a token of that id carries: tells bytes apart")
    logit: float = Field(description="The model's own logit")
    total: float = Field(description="Every head + attention biases + MLPs + embeddings + rest: equals logit within 1e-4 in float32")
    heads: list[HeadAttribution] = Field(description="Direct contributions, largest first, the top `top`")
    attention_bias: list[float]
    mlps: list[float]
    embeddings: float
    rest: float = Field(description="The final norm's shift and the unembedding's bias")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "position": 5, "target": 109, "target_text": "m",
        "target_piece": "m", "logit": 6.2663, "total": 6.2663, "heads": [{"layer": 0, "head": 3, "contribution": 0.685},
                                                   {"layer": 0, "head": 2, "contribution": 0.27}],
        "attention_bias": [0.01, -0.02], "mlps": [1.9, 2.4], "embeddings": 0.8, "rest": 0.0}]})


# ---- experiments: ablate, change a token, compare (issue 12) -------------------------------


class HeadAblation(RequestBody):
    # Bounded as a view's are: a 4,000-digit layer was quoted whole in the error message.
    layer: int = Field(..., ge=0, le=MAX_INDEX)
    head: int = Field(..., ge=0, le=MAX_INDEX)
    mode: Literal["zero", "mean"] = Field(
        "zero", description="zero: silence the head; mean: replace its output by its mean over this input's positions"
    )


class TensorRequest(RequestBody):
    """Which layers and heads of a (layers, heads, T, T) tensor to send back, and how."""

    layers: list[int] | None = Field(None, min_length=1, max_length=MAX_INDEX, description="Layer indices; default: all")
    heads: list[int] | None = Field(None, min_length=1, max_length=MAX_INDEX, description="Head indices; default: all")
    format: Format = Field("u8", description="json: float32 lists; f16: base64 float16; u8: base64 bytes (see scale/offset)")


class ExperimentOptions(RequestBody):
    model: str | None = Field(None, description="A model id from GET /api/v1/models; default: the server's default")
    truncate: bool = Field(False, description="Cut input longer than the model's positions instead of refusing it")


class AblateRequest(ExperimentOptions):
    text: str = Field(..., min_length=1)
    text_pair: str | None = Field(None, min_length=1, description="Second segment, for sentence-pair models")
    ablate: list[HeadAblation] = Field(..., min_length=1, max_length=MAX_INDEX, description="Heads to silence, each once")
    top_k: int = Field(5, ge=1, le=20, description="Predictions before/after per predicted position (models with an LM head)")
    attention: TensorRequest | None = Field(None, description="Also return the ablated run's attention")

    _text = field_validator("text")(_not_blank)
    _pair = field_validator("text_pair")(_optional_not_blank)

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"text": "In the beginning God created the heaven and the earth.", "model": "tiny-gpt",
                 "ablate": [{"layer": 0, "head": 3, "mode": "zero"}]},
                {"text": "The bank of the river.", "model": "minilm",
                 "ablate": [{"layer": 1, "head": 4, "mode": "mean"}], "attention": {"layers": [2], "format": "f16"}},
            ]
        },
    )


class ChangeTokenRequest(ExperimentOptions):
    text: str = Field(..., min_length=1, examples=["The bank of the river."])
    text_pair: str | None = Field(None, min_length=1)
    index: int = Field(..., ge=0, examples=[2], description="Token position (as in `tokens` of POST /api/v1/attention)")
    change: Literal["mask", "unk", "delete"] = Field(
        ..., examples=["delete"],
        description="Replace by the mask or unknown token (422 for a model that has none, like GPT-2's), or delete it",
    )
    difference: TensorRequest | None = Field(None, description="Also return A − B on aligned cells")

    _text = field_validator("text")(_not_blank)
    _pair = field_validator("text_pair")(_optional_not_blank)

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"text": "The bank of the river.", "model": "minilm", "index": 2, "change": "mask"},
                {"text": "The bank of the river.", "index": 2, "change": "delete"},
            ]
        },
    )


class CompareRequest(ExperimentOptions):
    text_a: str = Field(..., min_length=1)
    text_b: str = Field(..., min_length=1)
    difference: TensorRequest | None = Field(None, description="Also return A − B on aligned cells")

    _a = field_validator("text_a")(_not_blank)
    _b = field_validator("text_b")(_not_blank)

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"text_a": "The bank of the river.", "text_b": "The bank of the old river.", "model": "minilm"},
                {"text_a": "The bank of the river.", "text_b": "The shore of the river.",
                 "difference": {"layers": [2], "heads": [3], "format": "json"}},
            ]
        },
    )


class HeadChangeOut(BaseModel):
    layer: int
    head: int
    divergence: float = Field(description="Jensen–Shannon divergence in bits (0..1) per query row, averaged")


class LogprobChange(BaseModel):
    position: int = Field(description="Where the prediction is made")
    id: int = Field(description="Causal LM: the actual next token. Masked LM: the clean model's top guess at the mask")
    token: str
    piece: str = Field("", description="The id's vocabulary piece, as a prediction's: tells bytes that read \"\\ufffd\" apart")
    before: float = Field(description="log p (natural log) before the ablation")
    after: float
    change: float = Field(description="after − before")


class PredictionsChange(BaseModel):
    positions: list[int] = Field(description="Causal LM: every position. Masked LM: each mask")
    before: list[list[PredictionOut]]
    after: list[list[PredictionOut]]


class TensorOut(BaseModel):
    format: Format
    dtype: Literal["float32", "float16", "uint8"]
    shape: list[int] = Field(description="[layers, heads, rows, columns]")
    layers: list[int]
    heads: list[int]
    data: list | str = Field(description="Nested lists (json) or base64 (f16 little-endian, u8), row-major")
    scale: float | None = Field(None, description="u8 only: value ≈ byte × scale + offset")
    offset: float | None = Field(None, description="u8 only")


class AblateResponse(BaseModel):
    model: str
    causal: bool
    n_layers: int
    n_heads: int
    tokens: list[TokenOut]
    truncated: bool
    ablate: list[HeadAblation]
    ranking: list[HeadChangeOut] = Field(description="Every head after the first ablated layer, largest change first")
    predictions: PredictionsChange | None = Field(None, description="Models with an LM head only")
    logprob_change: list[LogprobChange] | None = Field(None, description="Models with an LM head only")
    attention: TensorOut | None = Field(None, description="The ablated run's attention, when asked for")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "tiny-gpt", "causal": True, "n_layers": 2, "n_heads": 8,
                    "tokens": [{"text": "I", "id": 41, "start": 0, "end": 1, "special": False, "segment": 0, "piece": "I"}],
                    "truncated": False,
                    "ablate": [{"layer": 0, "head": 3, "mode": "zero"}],
                    "ranking": [{"layer": 1, "head": 0, "divergence": 0.41}],
                    "predictions": {"positions": [0], "before": [[{"token": "n", "id": 78, "prob": 0.62, "piece": "n"}]],
                                    "after": [[{"token": "n", "id": 78, "prob": 0.35, "piece": "n"}]]},
                    "logprob_change": [{"position": 0, "id": 78, "token": "n", "piece": "n", "before": -0.48, "after": -1.05,
                                        "change": -0.57}],
                }
            ]
        }
    )


class ComparisonResponse(BaseModel):
    model: str
    n_layers: int
    n_heads: int
    tokens_a: list[TokenOut]
    tokens_b: list[TokenOut]
    truncated_a: bool = Field(description="A was cut to the model's length (with `truncate`)")
    truncated_b: bool = Field(description="B was cut to the model's length (with `truncate`)")
    pairs: list[tuple[int, int]] = Field(description="Aligned (index in A, index in B), in order")
    ranking: list[HeadChangeOut] = Field(description="Every head, largest change over the aligned rows first")
    difference: TensorOut | None = Field(
        None, description="A − B on aligned cells, shape [layers, heads, P, P] for P aligned pairs, when asked for"
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "minilm", "n_layers": 6, "n_heads": 12,
                    "tokens_a": [{"text": "[CLS]", "id": 101, "start": 0, "end": 0, "special": True, "segment": 0, "piece": "[CLS]"}],
                    "tokens_b": [{"text": "[CLS]", "id": 101, "start": 0, "end": 0, "special": True, "segment": 0, "piece": "[CLS]"}],
                    "truncated_a": False, "truncated_b": False,
                    "pairs": [[0, 0]],
                    "ranking": [{"layer": 2, "head": 3, "divergence": 0.12}],
                }
            ]
        }
    )


# ---- long inputs: runs that keep queries and keys, and the routes that serve them (issue 10) ----


class RunLinks(BaseModel):
    """URL templates, the run id filled in; `{name}` marks a query parameter to fill or drop."""

    run: str
    tile: str
    topk: str
    overview: str


class ArrayData(BaseModel):
    """An array in the encodings attention uses: nested lists (json), base64 little-endian float16
    (f16) or bytes with value ≈ byte × scale (u8). Under `Accept: application/vnd.manyeyes.frame`,
    `offset` and `nbytes` into the frame's data section replace `data`."""

    format: Literal["json", "f16", "u8", "i32"] = Field(description="i32: base64 little-endian int32 (indices)")
    dtype: Literal["float32", "float16", "uint8", "int32"]
    shape: list[int]
    data: list | str | None = None
    scale: float | None = Field(None, description="u8 only: value ≈ byte × scale")
    offset: int | None = Field(None, description="Frame only: where the bytes start in the data section")
    nbytes: int | None = Field(None, description="Frame only")


class RunInfo(BaseModel):
    run_id: str
    model: str
    causal: bool
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_tokens: int
    tokens: list[TokenOut]
    truncated: bool
    kept: Literal["weights", "qk"]
    precision: Format = Field(description=PRECISION_DOC)
    shapes: dict[str, list[int]] = Field(description="What the run holds: attention [L, H, T, T] (weights), "
                                                     "or queries [L, H, T, d] and keys [L, KV, T, d] (qk)")
    nbytes: int = Field(description="Bytes the run holds in the server's run cache")
    dense_max_tokens: int = Field(description="This server keeps weights (keep=auto) up to this many tokens")
    links: RunLinks

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "model": "tiny-llama", "causal": True, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "n_tokens": 2,
        "tokens": [{"text": "I", "id": 41, "start": 0, "end": 1, "special": False, "segment": 0, "piece": "I"},
                   {"text": "n", "id": 78, "start": 1, "end": 2, "special": False, "segment": 0, "piece": "n"}],
        "truncated": False, "kept": "qk", "precision": "json", "shapes": {"queries": [2, 4, 2, 32], "keys": [2, 2, 2, 32]}, "nbytes": 4128,
        "dense_max_tokens": 1024,
        "links": {"run": "/api/v1/runs/5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f",
                  "tile": "/api/v1/runs/5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f/tile?layer={layer}&head={head}&q0={q0}&q1={q1}"
                          "&k0={k0}&k1={k1}&rows={rows}&cols={cols}&pool={pool}&format={format}",
                  "topk": "/api/v1/runs/5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f/topk?layer={layer}&head={head}&k={k}&q0={q0}&q1={q1}&format={format}",
                  "overview": "/api/v1/runs/5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f/overview?format={format}"},
    }]})


class TileWindow(BaseModel):
    q0: int = Field(description="First query row (inclusive)")
    q1: int = Field(description="Last query row (exclusive)")
    k0: int = Field(description="First key column (inclusive)")
    k1: int = Field(description="Last key column (exclusive)")


class TileResponse(BaseModel):
    run_id: str
    layer: int
    head: int | Literal["mean"] = Field(description="A query head, or mean: the mean over the layer's heads")
    window: TileWindow
    shape: list[int] = Field(description="[rows, cols] of the answer")
    pool: Literal["none", "max", "mean"] = Field(description="none: full resolution (every weight of the window)")
    row_edges: list[int] = Field(description="rows + 1 query positions: answer row i covers [row_edges[i], row_edges[i+1])")
    col_edges: list[int] = Field(description="cols + 1 key positions, likewise")
    attention: ArrayData = Field(description="(rows, cols) float32 weights, pooled from the exact float32 weights")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "layer": 1, "head": 3, "window": {"q0": 0, "q1": 4096, "k0": 0, "k1": 4096},
        "shape": [2, 2], "pool": "max", "row_edges": [0, 2048, 4096], "col_edges": [0, 2048, 4096],
        "attention": {"format": "json", "dtype": "float32", "shape": [2, 2], "data": [[1.0, 0.0], [0.61, 0.93]]},
    }]})


class CellResponse(BaseModel):
    run_id: str
    query: int
    key: int
    shape: list[int] = Field(description="[n_layers, n_heads]")
    attention: ArrayData = Field(description="(n_layers, n_heads) float32: the weight from `query` to `key` in every "
                                             "layer and head, as exact as the run holds it")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "query": 5, "key": 0, "shape": [2, 3],
        "attention": {"format": "json", "dtype": "float32", "shape": [2, 3], "data": [[0.91, 0.02, 0.33], [0.5, 0.0, 0.96]]},
    }]})


class TopKResponse(BaseModel):
    run_id: str
    layer: int
    head: int
    k: int
    q0: int
    q1: int
    values: ArrayData = Field(description="(q1 - q0, k): each query row's k largest weights, largest first")
    indices: ArrayData = Field(description="(q1 - q0, k) key positions of those weights (json: lists; f16/u8: i32)")
    rest: ArrayData = Field(description="(q1 - q0,): 1 - the sum of the row's k weights, the mass left over")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "layer": 1, "head": 3, "k": 2, "q0": 0, "q1": 2,
        "values": {"format": "json", "dtype": "float32", "shape": [2, 2], "data": [[1.0, 0.0], [0.7, 0.3]]},
        "indices": {"format": "json", "dtype": "int32", "shape": [2, 2], "data": [[0, 1], [1, 0]]},
        "rest": {"format": "json", "dtype": "float32", "shape": [2], "data": [0.0, 0.0]},
    }]})


class OverviewResponse(BaseModel):
    run_id: str
    n_layers: int
    n_heads: int
    row_edges: list[int]
    col_edges: list[int]
    pool: Literal["max"] = "max"
    attention: ArrayData = Field(description="(layers, heads, rows, cols): every head's max-pooled thumbnail")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "run_id": "5be8d1f0c0a94e3b9d1f4a3c2b1e0d9f", "n_layers": 1, "n_heads": 1, "row_edges": [0, 2, 3],
        "col_edges": [0, 2, 3], "pool": "max",
        "attention": {"format": "u8", "dtype": "uint8", "shape": [1, 1, 2, 2], "data": "/wCZZg==", "scale": 1 / 255},
    }]})
