"""A Python client for a manyeyes server: numpy arrays and typed results, typed errors, 429 retries.

    from manyeyes import Client
    c = Client("http://127.0.0.1:8000")
    r = c.attention("The bank of the river.", model="minilm")
    r.attention.shape          # (layers, heads, T, T) float32 numpy
    r.head(2, 3)               # one head, by its model-wide layer and head index
    c.slice(r, layers=[0])     # another slice of the same run, no forward pass

    long = c.attention(book, model="tiny-llama")        # over the server's dense_max_tokens:
    long.kept, long.attention                           # "qk", None: the run kept queries and keys
    c.tile(long, layer=1, head=3, rows=512, cols=512)   # any window of any head, pooled or exact
    c.topk(long, layer=1, head=3, k=8)                  # every row's 8 largest weights
    c.overview(long).values                             # (layers, heads, r, c) thumbnails
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import numbers
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
import numpy as np

from manyeyes.indices import count_at_least

COMPACT_MEDIA_TYPE = "application/vnd.manyeyes+json"


# ---- errors -------------------------------------------------------------------------------------


# How the server names one text of a batch in an error: "texts[3]: input is 702 tokens long...",
# or a field's place in the body, "texts.3: String should have at least 1 character".
CHUNK_INDEX = re.compile(r"\b(texts|text_pairs)(\[|\.)(\d+)")


class ManyeyesError(Exception):
    """Any failure the server reported, with its HTTP status and the stable code of its error body.
    `status` is 0 when the server could not be reached or answered something unreadable, or when
    this Client is closed (code closed). Raised by attention_batch, it carries `partial`: the
    results of the texts before the chunk that failed, in order (texts[:len(exc.partial)])."""

    partial: list[RemoteResult] | None = None

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None, body: dict | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.body = body  # the server's whole error body, where it sent one (its fields beyond `error`)

    def __reduce__(self):
        # An exception unpickles as cls(*args), and args holds only the formatted message: raised in
        # a worker process, it failed to unpickle in the parent, which made multiprocessing.Pool hang
        # for good and ProcessPoolExecutor report a BrokenProcessPool instead of the server's error.
        return type(self), (self.status, self.code, self.message, self.retry_after_s, self.body), self.__dict__


class InvalidRequest(ManyeyesError):
    """422: blank text, a layer or head the model lacks, too long without truncate (code too_long)."""


class Unauthorized(ManyeyesError):
    """401 unauthorized: the server asks for an API key (Client(api_key=...)) and got none, or a wrong one."""


class NotFound(ManyeyesError):
    """404: unknown_model, unknown_run (evicted: post the text again) or not_found."""


class TooLarge(ManyeyesError):
    """413: body_too_large or too_many_cells (ask for u8/f16 or fewer layers and heads)."""


class Overloaded(ManyeyesError):
    """429 queue_full, still so after the client's retries."""


class NotReady(ManyeyesError):
    """503 not_ready: models still loading (raised at once: see Client.wait_ready), or a 503 with
    Retry-After (a server shutting down) still so after the client's retries."""


class ServerTimeout(ManyeyesError):
    """504: the request ran past the server's per-request budget."""


class ConnectionFailed(ManyeyesError):
    """The server could not be reached (code network), or did not answer within the client's
    timeout_s (code timeout)."""


class GenerationFailed(ManyeyesError):
    """A generation's stream ended with an error line: a step failed on the server after its
    200 and the steps before it (code generation_failed; the message says why)."""


ERRORS_BY_STATUS = {401: Unauthorized, 422: InvalidRequest, 404: NotFound, 413: TooLarge, 429: Overloaded, 503: NotReady, 504: ServerTimeout}


def error_from_response(response: httpx.Response) -> ManyeyesError:
    code, message = f"http_{response.status_code}", response.reason_phrase or "request failed"
    try:
        body = response.json()
        code, message = body["error"]["code"], body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        body = None  # not our JSON error body (a proxy's page): the status line is all there is
    cls = ERRORS_BY_STATUS.get(response.status_code, ManyeyesError)
    return cls(response.status_code, code, message, retry_after(response), body)


def retry_after(response: httpx.Response) -> float | None:
    try:
        seconds = float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date, which our server never sends
    # "nan" (from a proxy, not from us) parses, and time.sleep(nan) raises: treat it as absent.
    return max(seconds, 0.0) if not math.isnan(seconds) else None


def seconds(value, name: str, above_zero: bool = False) -> float:
    """A number of seconds a Client is given, as a float; ValueError in the caller's terms."""
    least = "above 0" if above_zero else "0 or more"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or (value <= 0 if above_zero else value < 0):
        raise ValueError(f"{name} must be a number of seconds, {least}; got {value!r}")
    return float(value)


def bearer(api_key: str) -> bytes:
    """The Authorization header's value. The key is sent as UTF-8, as the server reads it (httpx
    refused a non-ASCII str header before any request), and stripped of the spaces and newline a
    key read from a file ends in, as the server strips MANYEYES_API_KEYS: "key\\n" had failed as
    a server that "closed the connection" (an illegal header value, refused locally)."""
    key = api_key.strip()
    if not key or any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise ValueError("api_key must be the key's text: no control characters (a newline, a tab) inside it")
    return b"Bearer " + key.encode("utf-8")


# ---- results ------------------------------------------------------------------------------------


def _known(cls, fields: dict) -> dict:
    """The fields a result type knows: a newer server may send more, and an old client must not break."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in fields.items() if k in names}


@dataclass(frozen=True)
class RemoteToken:
    text: str
    id: int
    start: int
    end: int
    special: bool
    segment: int
    piece: str = ""  # the model's own vocabulary piece ("##ing", "Ġthe"); "" from servers before it


@dataclass(frozen=True)
class RemoteModel:
    id: str
    family: str
    causal: bool
    n_layers: int
    n_heads: int
    d_model: int
    head_dim: int
    max_tokens: int
    device: str
    default: bool
    n_kv_heads: int | None = None  # fewer than n_heads under grouped-query attention
    dtype: str = "float32"
    predictions: bool = False  # whether the model has an LM head to ask `predictions` of
    # Per layer: W when a query sees only its last W positions (itself included); None: no window.
    sliding_windows: tuple[int | None, ...] = ()
    # What change_token can do with its vocabulary: "delete", and "mask" / "unk" where it has them.
    token_changes: tuple[str, ...] = ()
    # A causal model's end-of-text ids, where `generate` stops; () from servers before them.
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self):
        # Tuples whatever it was given (the JSON's lists): a RemoteModel stays hashable.
        object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
        object.__setattr__(self, "token_changes", tuple(self.token_changes))
        object.__setattr__(self, "eos_ids", tuple(self.eos_ids))


@dataclass(frozen=True)
class Prediction:
    token: str  # how the id reads on its own, e.g. " the"
    id: int
    prob: float
    # The id's vocabulary piece, as a RemoteToken of that id has it ("Ġthe"; "å" for the byte 0xE5):
    # byte-level pieces of part of a character all read token "\ufffd", their pieces differ.
    # "" from servers before it.
    piece: str = ""

    def __repr__(self) -> str:
        # The piece only where the text cannot tell the id: the reprs of whole tokens stay as they were.
        piece = f", piece={self.piece!r}" if "\ufffd" in self.token else ""
        return f"Prediction(token={self.token!r}, id={self.id!r}, prob={self.prob!r}{piece})"

    @property
    def text(self) -> str:
        """`token` by the name a local generation's step gives it (`Choice.text`): the same loop,
        `step.token.text`, reads a local and a remote generation."""
        return self.token


def _choice(event: dict) -> Prediction:
    """A generation step's token or alternative (its `text` is a Prediction's `token`)."""
    return Prediction(event["text"], event["id"], event["prob"], event.get("piece", ""))


@dataclass(frozen=True)
class GenerationStep:
    index: int  # 0 for the first generated token
    position: int  # in the whole sequence, prompt included
    token: Prediction  # the chosen token and its probability under the model
    alternatives: list[Prediction]  # the most likely tokens at that point, best first
    attention: np.ndarray  # (n_layers, n_heads, position + 1): the token's row in every head

    def __repr__(self) -> str:
        return (f"GenerationStep({self.index} at position {self.position}: {self.token!r}, "
                f"{len(self.alternatives)} alternatives, attention {_shape(self.attention)})")


class _Stream:
    """What a Generation and the generator reading its stream share. Not the Generation itself:
    a generator holding the object that holds it is a cycle, so a dropped Generation was closed
    by the garbage collector, at any moment, even inside httpx's pool lock while another request
    of this thread held it: the collector's close of the old stream waited for that lock for good."""

    __slots__ = ("prompt", "response", "closed", "reason")

    def __init__(self) -> None:
        self.prompt: list[RemoteToken] | None = None
        self.response: httpx.Response | None = None  # the stream, once the server has answered
        self.closed = False
        self.reason: str | None = None  # the server's end line's, once it has come


class Generation(Iterator[GenerationStep]):
    """The steps of one generation, each as the server makes it. `prompt` holds the prompt's
    tokens (the first keys of every step's attention row) once the first step is read, and
    `reason` why it ended once the last is. Stop iterating, or close(), to hang up: the server
    stops within one step; a dropped Generation hangs up at once."""

    def __init__(self, steps: Callable[[_Stream], Iterator[GenerationStep]]) -> None:
        self._stream = _Stream()
        self._steps = steps(self._stream)

    @property
    def prompt(self) -> list[RemoteToken] | None:
        return self._stream.prompt

    @property
    def reason(self) -> str | None:
        """Why a complete generation ended: "length" (max_new_tokens came) or "eos" (the model
        ended the text: its last step's token is an end-of-text id, often fewer tokens than asked).
        None until the iteration has ended, and after a hang-up. A stream that ends otherwise
        ("error", "shutdown") raises GenerationFailed instead."""
        return self._stream.reason

    def __next__(self) -> GenerationStep:
        return next(self._steps)

    def close(self) -> None:
        """Hang up, from any thread: one blocked reading the next step ends its loop there, quietly.
        (A generator cannot be closed while another thread runs it: this raised "generator already
        executing" and the stream went on to its end.)"""
        self._stream.closed = True
        response = self._stream.response
        if response is not None:
            _hang_up(response)
        try:
            self._steps.close()
        except ValueError:
            pass  # another thread is inside next(): the hang-up ends its read, and it returns there

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class FlowEdge:
    layer: int  # from token `source` below this layer to token `target` above it
    source: int
    target: int
    weight: float  # the source's share of what the target's stream becomes
    head: int | None  # the head carrying most of it; None for the residual


@dataclass(frozen=True)
class RemoteNeuron:
    """The neuron view of one head and one query token (GET /runs/{id}/neuron), as numpy arrays."""

    run_id: str
    layer: int
    head: int
    kv_head: int  # the key/value head this query head reads (grouped-query attention: shared)
    n_heads: int
    n_kv_heads: int
    query_index: int
    query: np.ndarray  # (head_dim,) after rotary, before the 1/sqrt(head_dim) scaling
    keys: np.ndarray  # (T, head_dim)
    products: np.ndarray  # (T, head_dim): query ⊙ key
    scores: np.ndarray  # (T,): Σ(q ⊙ k) / √head_dim; NaN where the key is masked
    weights: np.ndarray  # (T,): the softmax, the head's attention row
    values: np.ndarray  # (T, head_dim)

    def __repr__(self) -> str:
        top = f", largest weight {np.nanmax(self.weights):.4f} at key {np.nanargmax(self.weights)}" if np.isfinite(self.weights).any() else ""
        return (f"RemoteNeuron(run {self.run_id!r}, layer {self.layer}, head {self.head} (key/value head {self.kv_head} of "
                f"{self.n_kv_heads}), query {self.query_index} over {len(self.keys)} keys, head_dim {self.query.shape[-1]}{top})")


@dataclass(frozen=True)
class RemoteLogitAttribution:
    """Direct logit attribution at one position (GET /runs/{id}/logit-attribution), as the local
    `manyeyes.model.measures.LogitAttribution` reads: every head + attention_bias + mlps +
    embeddings + rest add up to `total` (the logit, within 1e-4 in float32). `heads` holds only
    the `top` of largest effect (10 by default): ask for n_layers * n_heads to sum them all."""

    run_id: str
    position: int
    target: int  # the token id whose logit is split
    target_text: str
    logit: float
    total: float
    heads: list[tuple[int, int, float]]  # (layer, head, contribution), the largest effect (up or down) first
    attention_bias: np.ndarray  # (n_layers,)
    mlps: np.ndarray  # (n_layers,)
    embeddings: float
    rest: float  # the final norm's shift and the unembedding's bias
    target_piece: str = ""  # the target's vocabulary piece ("" from a server before it): tells bytes apart


@dataclass
class RemoteMeasures:
    """A run's measures as numpy arrays; only those asked for are set (see README, Reading the measures)."""

    run_id: str
    layers: list[int]
    heads: list[int]
    rollout: np.ndarray | None = None  # (T, T)
    value_norms: np.ndarray | None = None  # (layers, heads, T, T)
    contributions: dict[str, np.ndarray] | None = None  # norms, shares: (layers, heads, T); bias_shares: (layers, T)
    words: list[dict] | None = None  # text, start, end, segment, special, pieces
    word_attention: np.ndarray | None = None  # (layers, heads, W, W)
    head_table: list[dict] | None = None  # layer, head, tags, stats; a row per head of the layers and heads asked

    def __repr__(self) -> str:
        held = [f"{name} {_shape(value)}" for name, value in (("rollout", self.rollout), ("value_norms", self.value_norms))
                if value is not None]
        if self.contributions is not None:
            held.append(f"contributions ({', '.join(f'{k} {_shape(v)}' for k, v in self.contributions.items())})")
        if self.words is not None:
            held.append(f"{len(self.words)} words")
        if self.word_attention is not None:
            held.append(f"word_attention {_shape(self.word_attention)}")
        if self.head_table is not None:
            held.append(f"head_table of {len(self.head_table)} heads")
        return (f"RemoteMeasures(run {self.run_id!r}, layers {_indices(self.layers)}, heads {_indices(self.heads)}: "
                f"{', '.join(held) or 'no measure'})")


@dataclass
class RemoteResult:
    """One run's attention as the server sent it: `attention[i, j]` is layer `layers[i]`, head `heads[j]`."""

    run_id: str
    model: str
    causal: bool
    n_layers: int
    n_heads: int
    tokens: list[RemoteToken]
    truncated: bool
    layers: list[int]
    heads: list[int]
    attention: np.ndarray | None  # (len(layers), len(heads), T, T) float32; None when kept == "qk"
    format: str | None
    device: str
    timing_ms: dict[str, float]
    # The POST body that made this run, so an evicted run can be recomputed by any server.
    request: dict | None = field(default=None, repr=False)
    # Asked for with predictions=K: position -> the model's top K (next token, or at a [MASK]).
    predictions: dict[int, list[Prediction]] | None = None
    # "qk": a long input whose run kept queries and keys; read it with tile/topk/overview.
    kept: str = "weights"
    # The most precise format the server's run can serve later views in ("json", "f16", "u8"): a
    # GPU server keeps a u8 answer's run as its bytes; a more precise view means posting again.
    precision: str = "json"

    def __repr__(self) -> str:
        # One line, as a local AttentionResult's: the generated repr printed every token and the
        # arrays (39,005 characters over 520 lines at 120 tokens).
        n = len(self.tokens)
        shown = self.tokens if n <= 6 else [*self.tokens[:3], None, *self.tokens[-2:]]
        texts = ", ".join("…" if t is None else repr(t.text if len(t.text) <= 12 else t.text[:11] + "…") for t in shown)
        if self.attention is not None:
            attention = f"attention {tuple(self.attention.shape)} of layers {_indices(self.layers)}, heads {_indices(self.heads)}"
        else:
            attention = f"kept={self.kept!r}, no weights in the answer"
        at = len(self.predictions or ())
        predictions = f", predictions at {at} position{'' if at == 1 else 's'}" if at else ""
        return (f"RemoteResult(run {self.run_id!r} of {self.model!r}, {n} token{'' if n == 1 else 's'} [{texts}], "
                f"{attention}{predictions}, truncated={self.truncated})")

    def head(self, layer: int, head: int) -> np.ndarray:
        """(T, T) for a model-wide layer and head index; KeyError if this slice lacks it, ValueError
        for a long run that kept queries and keys (read it with Client.tile / topk / overview)."""
        if self.attention is None and self.kept == "weights":
            raise ValueError(
                f"this answer carries no weights: it was asked with keep='qk', but run {self.run_id} holds whole "
                f"weights; read them with Client.slice(result, layers=[{layer}], heads=[{head}])"
            )
        if self.attention is None:
            raise ValueError(
                f"run {self.run_id} kept queries and keys (kept={self.kept!r}), not whole weights: read a head "
                f"with Client.tile(result, {layer}, {head}) (any window, pooled or exact), topk or overview"
            )
        try:
            return self.attention[self.layers.index(layer), self.heads.index(head)]
        except ValueError:
            raise KeyError(f"layer {layer}, head {head} is not in this slice (layers {self.layers}, heads {self.heads})") from None


def _shape(array) -> str:
    """An array in a result's one-line repr, as RemoteResult's: its shape. The generated reprs printed
    every value (c.overview of a 502-token run: 27,766 characters over 521 lines in a notebook)."""
    return str(tuple(np.shape(array)))


def _span(edges: list[int]) -> str:
    """The tokens pooled cells' edges cover, as [first, end)."""
    return f"[{edges[0]}, {edges[-1]})"


def _indices(indices: list[int]) -> str:
    """[0, 1, 2, 3] as 0..3; any other list as it is, cut after eight."""
    if len(indices) > 2 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]}"
    return str(indices) if len(indices) <= 8 else f"[{', '.join(map(str, indices[:8]))}, …] ({len(indices)})"


def decode_attention(attention: dict) -> np.ndarray:
    """The `attention` object of a v1 JSON body, or any matrix object of the API (a measure's, an
    experiment's), to float32 of its shape: json, f16, or u8 with value = offset + byte x scale
    (a compare's difference has offset -1: without it, every value came out 1 too high)."""
    shape = attention["shape"]
    fmt = attention["format"]
    if fmt == "json":
        return np.asarray(attention["data"], dtype=np.float32).reshape(shape)
    raw = base64.b64decode(attention["data"])
    if fmt == "f16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
    if fmt == "u8":
        values = np.frombuffer(raw, dtype=np.uint8).astype(np.float32).reshape(shape) * np.float32(attention["scale"])
        return values + np.float32(attention["offset"]) if attention.get("offset") else values
    raise ManyeyesError(0, "unknown_format", f"the server sent attention in an unknown format {fmt!r}")


FRAME_MEDIA_TYPE = "application/vnd.manyeyes.frame"
FRAME_DTYPES = {"u8": np.uint8, "f16": np.dtype("<f2"), "json": np.dtype("<f4")}


def frame_parts(body: bytes) -> tuple[dict, memoryview]:
    """The binary frame's JSON header and its data section: b"MEF1", a u32 LE header length, the
    header, then raw row-major data that the header's arrays point into by `offset` and `nbytes`
    (see app/services/wire.py)."""
    if body[:4] != b"MEF1":
        raise ManyeyesError(0, "unreadable", f"not a manyeyes frame: starts with {body[:4]!r}")
    size = int.from_bytes(body[4:8], "little")
    return json.loads(body[8 : 8 + size]), memoryview(body)[8 + size :]


def selection(layers: list[int] | None, heads: list[int] | None) -> dict[str, str]:
    """Query parameters for a choice of layers and heads (None: all of them)."""
    params = {}
    for name, chosen in (("layers", layers), ("heads", heads)):
        if chosen is not None:
            # A string is iterable too: layers="10" went out as layers 1 and 0, and answered them.
            if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Iterable):
                raise TypeError(f"{name} takes a list of numbers, such as [1] or range(3); got {type(chosen).__name__} {chosen!r}")
            # An array's truth is ambiguous ("if not chosen" raised on np.array([0, 1])): its list.
            chosen = list(chosen.tolist() if isinstance(chosen, np.ndarray) else chosen)
            if not chosen:  # the server reads an empty list as "all": say so instead
                raise ValueError(f"{name} is empty: pass None for all of them")
            params[name] = ",".join(map(str, chosen))
    return params


def _plain(value):
    """json.dumps's fallback: numpy integers, floats, booleans and arrays, and ranges, as plain JSON."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, range)):
        return list(value.tolist() if isinstance(value, np.ndarray) else value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _lines(response: httpx.Response) -> Iterator[str]:
    """A streamed body's lines; a connection cut mid-stream is ConnectionFailed, like any other,
    and a server slower than the client's timeout_s between two lines has code timeout, as for
    any other request."""
    try:
        yield from response.iter_lines()
    except httpx.ReadTimeout:
        raise ConnectionFailed(
            0, "timeout", "the stream stopped for longer than this client's timeout_s between two steps; raise "
            "Client(timeout_s=...) for slow generation",
        ) from None
    except httpx.TransportError as exc:
        raise ConnectionFailed(0, "network", f"the stream broke off: {exc}") from None


def _hang_up(response: httpx.Response) -> None:
    """Close a streamed response from any thread. Closing the socket does not wake a read blocked
    on it in another thread (nor tell the server); shutting it down does both, at once."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
    else:
        response.close()


class Answer(dict):
    """A JSON answer's top level. A field it lacks is a ManyeyesError that says whose answer it may
    be: a proxy's login page or another service answering 200 with JSON of its own was a bare
    KeyError: 'models'."""

    def __init__(self, fields: dict, response: httpx.Response):
        super().__init__(fields)
        self.status = response.status_code
        try:
            self.url = str(response.request.url)
        except RuntimeError:  # a response made by hand, with no request
            self.url = "the server"

    def __missing__(self, key: str):
        raise ManyeyesError(self.status, "unreadable", f"the answer from {self.url} has no {key!r}: it is not a manyeyes "
                            f"answer (is base_url a manyeyes server, and not a proxy's page or another service?)")


def json_body(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError as exc:
        raise ManyeyesError(response.status_code, "unreadable", f"the response is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ManyeyesError(response.status_code, "unreadable", f"the answer is JSON but not an object ({type(body).__name__}): "
                            "it is not a manyeyes answer (is base_url a manyeyes server?)")
    return Answer(body, response)


def decode_frame(body: bytes) -> list[tuple[dict, np.ndarray]]:
    """Every result of a frame, each `attention` read from the data section."""
    header, data = frame_parts(body)
    results = header["results"] if "results" in header else [header]
    out = []
    for fields in results:
        att = fields["attention"]
        raw = np.frombuffer(data[att["offset"] : att["offset"] + att["nbytes"]], dtype=FRAME_DTYPES[att["format"]])
        array = raw.astype(np.float32).reshape(att["shape"])
        if att["format"] == "u8":
            array *= np.float32(att["scale"])
        out.append((fields, array))
    return out


def decode_body(response: httpx.Response) -> list[tuple[dict, np.ndarray]]:
    """Every result in a response as (its JSON fields, its attention array), from the binary
    frame or the JSON form, whichever the server chose to send."""
    if response.headers.get("content-type", "").startswith(FRAME_MEDIA_TYPE):
        return decode_frame(response.content)
    body = json_body(response)
    results = body["results"] if "results" in body else [body]
    return [(r, None if r["attention"] is None else decode_attention(r["attention"])) for r in results]


def to_result(fields: dict, array: np.ndarray, request: dict | None) -> RemoteResult:
    return RemoteResult(
        run_id=fields["run_id"],
        model=fields["model"],
        causal=fields["causal"],
        n_layers=fields["n_layers"],
        n_heads=fields["n_heads"],
        tokens=_tokens(fields["tokens"]),
        truncated=fields["truncated"],
        layers=fields["layers"],
        heads=fields["heads"],
        attention=array,
        format=None if fields["attention"] is None else fields["attention"]["format"],
        kept=fields.get("kept", "weights"),
        precision=fields.get("precision", "json"),
        device=fields["device"],
        timing_ms=fields["timing_ms"],
        request=request,
        predictions=_predictions(fields.get("predictions")),
    )


def _tokens(listed: list[dict]) -> list[RemoteToken]:
    return [RemoteToken(**_known(RemoteToken, t)) for t in listed]


def _predictions(by_position: dict | None) -> dict[int, list[Prediction]] | None:
    """position -> the top guesses, from JSON (whose keys are strings)."""
    if by_position is None:
        return None
    return {int(k): [Prediction(**_known(Prediction, p)) for p in v] for k, v in by_position.items()}


RESULTS_FORMAT = "manyeyes-results/1"


def save_results(path: str | os.PathLike, results: RemoteResult | list[RemoteResult]) -> None:
    """Results to one .npz file that `load_results` reads back with no server: each weights array
    as it came (float32, bit for bit), the rest (tokens, layers, heads, predictions, the request
    that made it) as JSON beside them. Not a pickle: a colleague's file is safe to open, and it
    does not depend on this module's classes staying as they are."""
    # One that is no list (a local run's AttentionResult, say) is checked as one: "object is not
    # iterable" said nothing of what to pass.
    results = list(results) if isinstance(results, Iterable) and not isinstance(results, (str, bytes)) else [results]
    wrong = next((r for r in results if not isinstance(r, RemoteResult)), None)
    if wrong is not None:
        raise TypeError("save_results takes RemoteResult objects (what Client.attention and attention_batch return), "
                        f"one or a list of them; got {type(wrong).__name__}")
    meta = [{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "attention"} for r in results]
    header = json.dumps({"format": RESULTS_FORMAT, "results": meta},
                        default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else _plain(v))
    arrays = {f"attention_{i}": r.attention for i, r in enumerate(results) if r.attention is not None}
    with open(path, "wb") as f:  # np.savez_compressed would add ".npz" to a name without it
        np.savez_compressed(f, results=np.frombuffer(header.encode(), dtype=np.uint8), **arrays)


def load_results(path: str | os.PathLike) -> list[RemoteResult]:
    """The results `save_results` wrote, in order, as RemoteResult objects (figures take them).
    Any other file is a ValueError that says so."""
    not_ours = ValueError(f"{os.fspath(path)} is not a file of manyeyes results (save_results writes them)")
    try:
        stored = np.load(path, allow_pickle=False)
    except ValueError as exc:  # a pickled .npy, or no numpy file at all
        raise not_ours from exc
    if not isinstance(stored, np.lib.npyio.NpzFile):  # a plain .npy: one array
        raise not_ours
    with stored:
        try:
            header = json.loads(stored["results"].tobytes()) if "results" in stored.files else None
        except (ValueError, UnicodeDecodeError) as exc:
            raise not_ours from exc
        if not isinstance(header, dict) or "format" not in header:
            raise not_ours
        if header["format"] != RESULTS_FORMAT:
            raise ValueError(f"{os.fspath(path)} holds {header['format']!r}; this manyeyes reads {RESULTS_FORMAT}")
        results = []
        for i, meta in enumerate(header.get("results") or []):
            array = stored[f"attention_{i}"] if f"attention_{i}" in stored.files else None
            try:
                results.append(RemoteResult(**{
                    **_known(RemoteResult, meta),
                    "tokens": _tokens(meta["tokens"]),
                    "attention": array,
                    "predictions": _predictions(meta.get("predictions")),
                }))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"{os.fspath(path)}: result {i} lacks a field a result needs ({exc})") from None
    return results


@dataclass(frozen=True)
class RemoteTile:
    """values[i, j] covers query rows [row_edges[i], row_edges[i+1]) and keys [col_edges[j], col_edges[j+1])."""

    run_id: str
    layer: int
    head: int | str  # "mean": the layer's mean over heads
    window: dict  # q0, q1, k0, k1
    pool: str  # "none" at full resolution, else "max" or "mean"
    row_edges: list[int]
    col_edges: list[int]
    values: np.ndarray  # (rows, cols) float32

    def __repr__(self) -> str:
        pooled = "every weight" if self.pool == "none" else f"{self.pool}-pooled"
        return (f"RemoteTile(run {self.run_id!r}, layer {self.layer}, head {self.head}, queries {_span(self.row_edges)} × "
                f"keys {_span(self.col_edges)}, values {_shape(self.values)}, {pooled})")


@dataclass(frozen=True)
class RemoteTopK:
    run_id: str
    layer: int
    head: int
    k: int
    q0: int
    q1: int
    values: np.ndarray  # (q1 - q0, k) float32, largest first
    indices: np.ndarray  # (q1 - q0, k) int32 key positions
    rest: np.ndarray  # (q1 - q0,) float32: 1 - the row's k weights

    def __repr__(self) -> str:
        return (f"RemoteTopK(run {self.run_id!r}, layer {self.layer}, head {self.head}, top {self.k} keys of queries "
                f"[{self.q0}, {self.q1}), values {_shape(self.values)})")


@dataclass(frozen=True)
class RemoteOverview:
    run_id: str
    row_edges: list[int]
    col_edges: list[int]
    values: np.ndarray  # (layers, heads, rows, cols) float32, max-pooled

    def __repr__(self) -> str:
        return (f"RemoteOverview(run {self.run_id!r}, values {_shape(self.values)}, max-pooled over queries "
                f"{_span(self.row_edges)} × keys {_span(self.col_edges)})")


ARRAY_DTYPES = {**FRAME_DTYPES, "i32": np.dtype("<i4")}


def decode_array(meta: dict, data: memoryview | None = None) -> np.ndarray:
    """One array of a tile/topk/overview answer: from the frame's data section, or inline."""
    fmt = meta["format"]
    if data is not None:
        raw = np.frombuffer(data[meta["offset"] : meta["offset"] + meta["nbytes"]], dtype=ARRAY_DTYPES[fmt])
    elif fmt == "json":
        return np.asarray(meta["data"], dtype=np.int32 if meta["dtype"] == "int32" else np.float32).reshape(meta["shape"])
    else:
        raw = np.frombuffer(base64.b64decode(meta["data"]), dtype=ARRAY_DTYPES[fmt])
    array = raw.reshape(meta["shape"])
    if fmt == "i32":
        return array.astype(np.int32)
    array = array.astype(np.float32)
    return array * np.float32(meta["scale"]) if fmt == "u8" else array


def decode_arrays(response: httpx.Response) -> tuple[dict, dict[str, np.ndarray]]:
    """(the answer's other fields, its arrays by name), from the frame or the JSON form."""
    if response.headers.get("content-type", "").startswith(FRAME_MEDIA_TYPE):
        fields, data = frame_parts(response.content)
    else:
        fields, data = json_body(response), None
    arrays = {k: decode_array(v, data) for k, v in fields.items() if isinstance(v, dict) and "dtype" in v}
    return {k: v for k, v in fields.items() if k not in arrays}, arrays


# ---- the client ---------------------------------------------------------------------------------


class Client:
    """A synchronous client for one server. `api_key` is sent as `Authorization: Bearer ...`, which a
    server started with API keys requires (SECURITY.md), as may a proxy in front of it. A 429 is retried after its
    Retry-After (capped at `max_retry_wait_s`) up to `max_retries` times, then raised as Overloaded; a
    refused connection (a server restarting) is tried again within the same budget, after 0.25 s,
    0.5 s, 1 s and so on. Safe to share between threads, and to use in a process forked after it was
    made: the child opens its own connections."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        max_retries: int = 5,
        max_retry_wait_s: float = 30.0,
        format: str = "f16",
        frames: bool = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.lower().startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, as in 'http://127.0.0.1:8000'; got {base_url!r}")
        headers = {"User-Agent": f"manyeyes-client python/{sys.version_info.major}.{sys.version_info.minor}"}
        if frames:
            # The fastest form the server offers: raw bytes in a small frame, no base64 and no
            # parsing of numbers; zstd where the server finds it pays (httpx decodes it).
            headers["Accept"] = f"{FRAME_MEDIA_TYPE}, application/json;q=0.5"
            headers["Accept-Encoding"] = "zstd, gzip"
        retries = count_at_least(max_retries, 0)
        if retries is None:
            # -1 ran no attempt at all, and every call ended in an AssertionError
            raise ValueError(f"max_retries must be a whole number >= 0; got {max_retries!r}")
        max_retries = retries
        if format not in FRAME_DTYPES:
            raise ValueError(f"format must be one of {', '.join(FRAME_DTYPES)}; got {format!r}")
        # Checked here, not at the first call: timeout_s=0 failed every request as a server that
        # "could not be reached (tried 6 times)", and -1 or a negative wait as httpx's or sleep's error.
        # None (no limit) and an httpx.Timeout go to httpx as they are, as they always did.
        if timeout_s is not None and not isinstance(timeout_s, httpx.Timeout):
            timeout_s = seconds(timeout_s, "timeout_s", above_zero=True)
        max_retry_wait_s = seconds(max_retry_wait_s, "max_retry_wait_s")
        if api_key is not None and not isinstance(api_key, str):
            raise ValueError(f"api_key must be the key as a str (or None); got {type(api_key).__name__}")
        if api_key:
            headers["Authorization"] = bearer(api_key)
        # What __init__ was given, so that a pickled Client (multiprocessing, joblib, Ray tasks)
        # arrives as a new one with its own connections.
        self._arguments = dict(base_url=base_url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries,
                               max_retry_wait_s=max_retry_wait_s, format=format, frames=frames, transport=transport)
        self._headers = headers
        self._http = self._connect()
        self._pid = os.getpid()  # the process whose connections _http holds
        self._closed = False
        self.max_retries = max_retries
        self.max_retry_wait_s = max_retry_wait_s
        self.format = format  # f16: exact to float16 at half json's size and none of its parsing
        self.retries = 0  # 429s, 503s and refused connections waited out over this client's life

    @property
    def http(self) -> httpx.Client:
        """The httpx client this Client sends with (for routes it has no method for yet): this
        process's own, and ManyeyesError (code closed) once the Client is closed."""
        if self._closed:
            raise ManyeyesError(0, "closed", "this Client is closed: make a new Client (or call it inside its `with` block)")
        if self._pid != os.getpid():
            # Forked (a "fork" multiprocessing pool calling a module-level Client): the child held
            # the parent's pooled keep-alive sockets, and two processes reading one connection got
            # each other's answers with no error. The inherited client is dropped, not closed:
            # only the child's copies of the descriptors go when it is collected, never a
            # connection the parent is using.
            self._http = self._connect()
            self._pid = os.getpid()
        return self._http

    def _connect(self) -> httpx.Client:
        # A transport= given to the Client is the caller's, and is shared as it was given.
        arguments = self._arguments
        return httpx.Client(base_url=arguments["base_url"].rstrip("/"), headers=self._headers,
                            timeout=arguments["timeout_s"], transport=arguments["transport"])

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's connections; any later call raises ManyeyesError (code closed)."""
        was_closed, self._closed = self._closed, True  # first: a call it cuts off reads it as closed
        if not was_closed and self._pid == os.getpid():  # a forked child never closed what it inherited
            self._http.close()

    def _closed_during(self, method: str, path: str) -> ManyeyesError:
        """A call in flight when close() came from another thread: it had read as the server crashing."""
        return ManyeyesError(0, "closed", f"this Client was closed (close() from another thread) while {method} {path} "
                                          "was on its way: make a new Client")

    def __getstate__(self) -> dict:
        if self._arguments["transport"] is not None:
            raise TypeError("a Client made with a transport= cannot be pickled; make one in each process instead")
        return self._arguments

    def __setstate__(self, arguments: dict) -> None:
        self.__init__(**arguments)

    def _send(self, method: str, path: str, stream: bool = False, retry: bool = True, **kwargs) -> httpx.Response:
        """The response, after retrying a 429, or a 503 that says when to come back (Retry-After:
        a server shutting down, a proxy in front of a restarting one), after its Retry-After
        (capped) up to max_retries times; errors raised typed. A 503 without Retry-After (models
        still loading) is NotReady at once: wait_ready waits for that. A refused connection is
        tried again within the same max_retries, after 0.25 s, 0.5 s, 1 s... (capped at
        max_retry_wait_s), and once one was, so is that 503 on the same waits: a restarted server
        loading its models. retry=False (ready, wait_ready: they poll on their own) retries
        nothing: a proxy's 503 with Retry-After: 30 had held ready() for minutes. stream=True
        leaves the body unread (the caller closes it). A JSON body may hold numpy integers and
        arrays."""
        if "json" in kwargs:  # numpy scalars (np.argmax's) and arrays, which json.dumps refuses
            kwargs["content"] = json.dumps(kwargs.pop("json"), default=_plain).encode("utf-8")
            kwargs["headers"] = {"Content-Type": "application/json", **(kwargs.get("headers") or {})}
        http = self.http
        refused, waited = 0, 0.0
        for attempt in range(self.max_retries + 1):
            try:
                response = http.send(http.build_request(method, path, **kwargs), stream=stream)
                if response.is_error and stream:
                    response.read()
            except RuntimeError:
                # httpx's "Cannot send a request, as the client has been closed": close() from
                # another thread came first (during a retry's pause, or just before the send).
                if self._closed:
                    raise self._closed_during(method, path) from None
                raise
            except (httpx.ReadTimeout, httpx.WriteTimeout):
                # Reached, but slower than the client allows: not a server to go looking for.
                raise ConnectionFailed(
                    0, "timeout", f"{http.base_url} took longer than this client's timeout_s "
                    f"({http.timeout.read} s) to answer {method} {path}; raise Client(timeout_s=...) for slow requests",
                ) from None
            except httpx.ConnectError as exc:
                # Nothing took the connection (a server restarting, not started yet), so the request
                # never reached one and cannot have done anything: safe to send again. A restart
                # ended a long attention_batch at once, with every finished chunk lost.
                if retry and attempt < self.max_retries:
                    self.retries += 1
                    pause = min(0.25 * 2**refused, self.max_retry_wait_s)
                    time.sleep(pause)
                    refused, waited = refused + 1, waited + pause
                    continue
                tries = f" (tried {refused + 1} times over {waited:.2g} s)" if refused else ""
                raise ConnectionFailed(0, "network", f"{http.base_url} could not be reached{tries}: {exc}") from None
            except (httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol) as exc:
                raise ConnectionFailed(0, "network", f"{http.base_url} could not be reached: {exc}") from None
            except httpx.TransportError as exc:
                if self._closed:  # close() from another thread cut it ("Bad file descriptor")
                    raise self._closed_during(method, path) from None
                # Connected, then the connection ended before a whole answer: the server went away
                # (stopped, restarted, killed for memory) or a proxy cut it. Not retried: the same
                # request may be what brought it down.
                raise ConnectionFailed(
                    0, "network", f"{http.base_url} closed the connection before it had answered {method} {path} "
                    f"(the server stopped, restarted or crashed mid-request, or a proxy cut it off): {exc}",
                ) from None
            wait = retry_after(response)
            # Refused, then 503 without Retry-After: the server restarted and is loading its models.
            restarting = response.status_code == 503 and wait is None and refused > 0
            retryable = response.status_code == 429 or (response.status_code == 503 and wait is not None) or restarting
            if retry and retryable and attempt < self.max_retries:
                self.retries += 1
                response.close()
                if restarting:  # on the same doubling waits: the budget reads the same however a restart goes
                    pause = min(0.25 * 2**refused, self.max_retry_wait_s)
                    refused, waited = refused + 1, waited + pause
                else:
                    pause = min(wait or 1.0, self.max_retry_wait_s)
                time.sleep(pause)
                continue
            if response.is_error:
                raise error_from_response(response)
            return response
        raise AssertionError("unreachable: the last attempt returns or raises")

    # -- operations --

    def ready(self) -> bool:
        """True once every model on the server is loaded and warmed up. It does not check the
        api_key: /readyz is open to all, so a server that needs a key reads True without one or
        with a wrong one; models() is the cheap call that does (Unauthorized)."""
        try:
            self._send("GET", "/readyz", retry=False)
        except (NotReady, Overloaded, ConnectionFailed):  # Overloaded: a proxy's 429
            return False
        return True

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Until the server is ready: NotReady at once if its models failed to load (the server's
        reason, which waiting would not change), NotReady if it still answered 503 after
        timeout_s, ConnectionFailed if it could not be reached (a wrong URL, no server started).
        Like ready(), about the server's models only: the api_key is first checked by a real call.
        A Retry-After (a proxy's) spaces the polls out, up to the time left."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._send("GET", "/readyz", retry=False)
                return
            except (NotReady, Overloaded, ConnectionFailed) as exc:
                last = exc
            if isinstance(last, NotReady) and (last.body or {}).get("status") == "failed":
                raise NotReady(503, last.code, f"the server could not load its models: {last.message}", body=last.body)
            left = deadline - time.monotonic()
            if left <= 0:
                raise type(last)(last.status, last.code, f"not ready after {timeout_s:g} s: {last.message}",
                                 body=last.body) from None
            time.sleep(max(poll_s, min(last.retry_after_s or 0.0, left)))

    def models(self) -> list[RemoteModel]:
        return [RemoteModel(**_known(RemoteModel, m)) for m in json_body(self._send("GET", "/api/v1/models"))["models"]]

    def attention(
        self,
        text: str,
        text_pair: str | None = None,
        *,
        model: str | None = None,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        format: str | None = None,
        truncate: bool = False,
        predictions: int | None = None,
        keep: str | None = None,
    ) -> RemoteResult:
        """predictions=K: also the model's top K per position (next token for causal LMs, at each
        [MASK] for masked LMs); InvalidRequest for a model without an LM head.
        keep: "auto" (the server's default: whole weights up to its dense_max_tokens), "weights"
        or "qk" (queries and keys: the result's attention is None, read it with tile/topk/overview)."""
        body = {"text": text, "text_pair": text_pair, "model": model, "layers": layers, "heads": heads,
                "format": format or self.format, "truncate": truncate,
                "predictions": None if predictions is None else {"top_k": predictions}, "keep": keep}
        body = {k: v for k, v in body.items() if v is not None}
        [(fields, array)] = decode_body(self._send("POST", "/api/v1/attention", json=body))
        return to_result(fields, array, body)

    def attention_batch(
        self,
        texts: list[str],
        *,
        text_pairs: list[str | None] | None = None,
        model: str | None = None,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        format: str | None = None,
        truncate: bool = False,
        predictions: int | None = None,
        batch_size: int = 32,
    ) -> list[RemoteResult]:
        """One result per text, in order; text_pairs: each text's second segment (None: none), as
        attention()'s text_pair. The texts go `batch_size` at a time, each request one
        padded forward, so any number of texts can be passed; a server configured for fewer a batch
        (its max_batch_texts, 32 by default) says its limit, and the rest go that many at a time. Each text must fit the server's
        dense bound (else TooLarge needs_tiles: post it alone with attention()). An error raised
        after some chunks finished carries their results in `exc.partial` (input order, the texts
        texts[:len(exc.partial)]; [] when the first chunk failed): pass the rest to resume."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a list of texts; for one text, call attention(text) or pass [text]")
        texts = list(texts)
        if not texts:
            raise ValueError("texts is empty: pass at least one text")
        if isinstance(text_pairs, (str, bytes)):
            raise TypeError("text_pairs must be a list, one second segment (or None) per text")
        pairs = None if text_pairs is None else list(text_pairs)
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"text_pairs holds {len(pairs)} entries for {len(texts)} texts: one per text, None where none")
        size = count_at_least(batch_size, 1)
        if size is None:
            raise ValueError(f"batch_size must be a whole number, at least 1; got {batch_size!r}")
        batch_size = size
        options = {"model": model, "layers": layers, "heads": heads, "format": format or self.format, "truncate": truncate,
                   "predictions": None if predictions is None else {"top_k": predictions}}
        options = {k: v for k, v in options.items() if v is not None}
        results = []
        try:
            while len(results) < len(texts):
                chunk = texts[len(results) : len(results) + batch_size]
                chunk_pairs = None if pairs is None else pairs[len(results) : len(results) + batch_size]
                sent = {"texts": chunk, **options} if chunk_pairs is None else {"texts": chunk, "text_pairs": chunk_pairs, **options}
                try:
                    pieces = decode_body(self._send("POST", "/api/v1/attention/batch", json=sent))
                except InvalidRequest as exc:
                    limit = ((exc.body or {}).get("error") or {}).get("max_batch_texts")
                    if isinstance(limit, int) and 1 <= limit < len(chunk):
                        batch_size = limit  # the same chunk again, cut to the server's size
                        continue
                    raise
                for k, (text, (fields, array)) in enumerate(zip(chunk, pieces)):
                    pair = None if chunk_pairs is None else chunk_pairs[k]
                    # What made it, as attention() would post it: an evicted run is recomputed from this.
                    made_by = {"text": text, **options} if pair is None else {"text": text, "text_pair": pair, **options}
                    results.append(to_result(fields, array, made_by))
        except ManyeyesError as exc:
            # A failure late in a long run (a restart past the retries, one text too long) threw
            # away every chunk already computed: they go with the error, and the run resumes at
            # texts[len(exc.partial):].
            exc.partial = results
            if results:
                # The server names a text by its place in the chunk it was sent: texts[1] of the
                # second chunk of 4 was texts[5] of the caller's list, and the message sent them
                # to a sentence that was fine.
                exc.message = CHUNK_INDEX.sub(lambda m: f"{m[1]}{m[2]}{int(m[3]) + len(results)}", exc.message)
                exc.args = (f"{exc.status} {exc.code}: {exc.message}",)
            raise
        return results

    def slice(
        self,
        run: RemoteResult | str,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        format: str | None = None,
    ) -> RemoteResult:
        """Other layers/heads of a run from the server's run cache. Given a result (not a bare
        run id), a run the server no longer holds, or holds at less precision than `format` (a GPU
        server keeps a u8 answer's run as its bytes: 422 kept_quantised), is recomputed from the
        request that made it."""
        run_id = run if isinstance(run, str) else run.run_id
        params = {"format": format or self.format, **selection(layers, heads)}
        again = not isinstance(run, str) and run.request is not None
        # Asked even where `run.precision` is too coarse: another request may have made the run
        # finer since, and a refusal costs less than a needless forward pass.
        try:
            [(fields, array)] = decode_body(self._send("GET", f"/api/v1/runs/{quote(run_id, safe='')}/attention", params=params))
            return to_result(fields, array, run.request if again else None)
        except (NotFound, InvalidRequest) as exc:
            if exc.code not in ("unknown_run", "kept_quantised") or not again:
                raise
        body = {**run.request, "format": params["format"]}
        body.pop("layers", None)
        body.pop("heads", None)
        body.update({k: v for k, v in (("layers", layers), ("heads", heads)) if v is not None})
        [(fields, array)] = decode_body(self._send("POST", "/api/v1/attention", json=body))
        if array is None:
            # A long input's run keeps queries and keys (or keep="qk" was asked): the GET serves a
            # run with weights, and refuses one without as it did before the run was evicted
            # (422 kept_qk), where this returned a result with no attention.
            again_id = quote(fields["run_id"], safe="")
            [(fields, array)] = decode_body(self._send("GET", f"/api/v1/runs/{again_id}/attention", params=params))
        return to_result(fields, array, run.request)

    def generate(
        self,
        text: str,
        max_new_tokens: int = 20,
        *,
        model: str | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        alternatives: int = 5,
        stop_at_eos: bool = True,
    ) -> Generation:
        """Each new token as the server makes it; the prompt's tokens in `.prompt` once the first
        is read. Stop iterating (or close the iterator) to hang up: the server stops within one
        step. Greedy unless temperature > 0. The iteration ends after a token that ends the text
        (the model's `eos_ids`; `.reason` is then "eos") unless stop_at_eos=False, or after
        max_new_tokens ("length")."""
        body = {"text": text, "max_new_tokens": max_new_tokens, "model": model, "temperature": temperature,
                "top_k": top_k, "seed": seed, "alternatives": alternatives,
                # Sent only when it is not the server's default: a server that predates it refuses the field.
                "stop_at_eos": None if stop_at_eos else False}
        body = {k: v for k, v in body.items() if v is not None}
        return Generation(lambda stream: self._generate(stream, body))

    def _generate(self, stream: _Stream, body: dict) -> Iterator[GenerationStep]:
        # A 429 (all generation slots busy) is retried as any request's is, before any step.
        response = self._send("POST", "/api/v1/generate", stream=True, json=body, headers={"Accept": "application/x-ndjson"})
        stream.response = response
        steps = 0
        try:
            if stream.closed:  # closed from another thread while the request was on its way
                return
            try:
                for line in _lines(response):
                    if not line:
                        continue
                    try:
                        event = json.loads(line)
                        kind = event["type"]
                    except (ValueError, TypeError, KeyError):
                        # A proxy's page or a cut line: typed, as a body that is not JSON is elsewhere.
                        raise ManyeyesError(response.status_code, "unreadable",
                                            f"the generation stream holds a line that is not one of its events: {line[:80]!r}") from None
                    if kind == "start":
                        stream.prompt = _tokens(event["prompt"])
                    if kind == "end":
                        if event.get("reason") not in ("length", "eos"):
                            # "error" (a step failed) or "shutdown" (the server is stopping): fewer tokens than asked.
                            # "eos" is complete: the model ended the text.
                            raise GenerationFailed(response.status_code, "generation_failed",
                                                   event.get("error") or f"the generation ended early ({event.get('reason')})")
                        stream.reason = event["reason"]
                        return
                    if kind != "step":
                        continue
                    steps += 1
                    yield GenerationStep(
                        index=event["index"],
                        position=event["position"],
                        token=_choice(event["token"]),
                        alternatives=[_choice(a) for a in event["alternatives"]],
                        attention=np.asarray(event["attention"], dtype=np.float32),
                    )
            except ConnectionFailed:
                if stream.closed:  # our own hang-up (close() from another thread): the loop just ends
                    return
                if self._closed:  # the Client's close(), not the Generation's: as for any other call
                    raise self._closed_during("POST", "/api/v1/generate") from None
                raise
            if not stream.closed:
                # The body ended without the server's end line: it was cut off (a proxy's timeout, a
                # server that stopped), and what came was read as a whole, shorter generation.
                raise ConnectionFailed(0, "network", f"the generation stream ended after {steps} of "
                                       f"{body['max_new_tokens']} steps without the server's end line: it was cut off")
        finally:
            response.close()

    # -- measures beyond raw weights --

    def _run_get(self, run: RemoteResult | str, path: str, params: dict) -> dict:
        """GET one of a run's routes; a run the server evicted is posted again (given a result)."""
        return json_body(self._run_response(run, path, params))

    def _run_response(self, run: RemoteResult | str, path: str, params: dict) -> httpx.Response:
        run_id = run if isinstance(run, str) else run.run_id
        url = f"/api/v1/runs/{quote(run_id, safe='')}/{path}".rstrip("/")
        try:
            return self._send("GET", url, params=params)
        except NotFound as exc:
            if exc.code != "unknown_run" or isinstance(run, str) or run.request is None:
                raise
            # At the precision the GET asks for (float32 where it names none): a server that
            # quantises on the device keeps the run as the bytes it was posted at, and refuses a
            # tile, top-k or overview more precise than them.
            fmt = params.get("format") or "json"
            self._send("POST", "/api/v1/attention", json={**run.request, "format": fmt, "layers": [0], "heads": [0]})
            return self._send("GET", url, params=params)

    def measures(
        self,
        run: RemoteResult | str,
        names: list[str] | str,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        format: str | None = None,
    ) -> RemoteMeasures:
        """Any of rollout, value_norms, contributions, words, heads for a run (one name or a list),
        at the client's format unless `format` says otherwise."""
        if isinstance(names, str):  # "rollout" went out as r,o,l,l,o,u,t
            names = [names]
        if not names:
            raise ValueError("name at least one measure: rollout, value_norms, contributions, words or heads")
        params = {"names": ",".join(names), "format": format or self.format, **selection(layers, heads)}
        body = self._run_get(run, "measures", params)
        found = body["measures"]
        out = RemoteMeasures(run_id=body["run_id"], layers=body["layers"], heads=body["heads"])
        if found.get("rollout"):
            out.rollout = decode_attention(found["rollout"])
        if found.get("value_norms"):
            out.value_norms = decode_attention(found["value_norms"])
        if found.get("contributions"):
            out.contributions = {k: decode_attention(v) for k, v in found["contributions"].items()}
        if found.get("words"):
            out.words = found["words"]["words"]
            out.word_attention = decode_attention(found["words"]["attention"])
        if found.get("heads"):
            out.head_table = found["heads"]["rows"]
        return out

    def flow(self, run: RemoteResult | str, threshold: float = 0.05) -> list[FlowEdge]:
        """Information-flow routes (Ferrando & Voita, 2024), edges below `threshold` pruned."""
        body = self._run_get(run, "flow", {"threshold": threshold})
        return [FlowEdge(**_known(FlowEdge, e)) for e in body["edges"]]

    def neuron(self, run: RemoteResult | str, layer: int, head: int, query: int) -> RemoteNeuron:
        """The neuron view of one head and query token: the query, every key, q ⊙ k, the scores,
        the softmax and the values, and which key/value head the query head reads."""
        body = self._run_get(run, "neuron", {"layer": layer, "head": head, "query": query})
        arrays = {name: np.asarray(body[name], dtype=np.float32) for name in ("query", "keys", "products", "weights", "values")}
        scores = np.array([np.nan if s is None else s for s in body["scores"]], dtype=np.float32)
        return RemoteNeuron(**{**_known(RemoteNeuron, body), **arrays, "scores": scores})

    def logit_attribution(self, run: RemoteResult | str, position: int, target: int | None = None,
                          top: int = 10) -> RemoteLogitAttribution:
        """Each head's direct contribution to one logit (causal LMs): the `top` heads of largest
        effect, up or down, first; target: a token id, default the model's top guess there."""
        params = {"position": position, "top": top}
        if target is not None:
            params["target"] = target
        body = self._run_get(run, "logit-attribution", params)
        return RemoteLogitAttribution(**{
            **_known(RemoteLogitAttribution, body),
            "heads": [(h["layer"], h["head"], h["contribution"]) for h in body["heads"]],
            "attention_bias": np.asarray(body["attention_bias"], dtype=np.float64),
            "mlps": np.asarray(body["mlps"], dtype=np.float64),
        })

    # -- long inputs: any head of any run, a window at a time

    def run_info(self, run: RemoteResult | str) -> dict:
        """What the server holds of a run: tokens, kept ("weights" or "qk"), shapes, bytes, links."""
        return self._run_get(run, "", {})

    def tile(
        self,
        run: RemoteResult | str,
        layer: int,
        head: int | str,
        q0: int | None = None,
        q1: int | None = None,
        k0: int | None = None,
        k1: int | None = None,
        *,
        rows: int | None = None,
        cols: int | None = None,
        pool: str = "max",
        format: str | None = None,
    ) -> RemoteTile:
        """One head (head="mean": the layer's mean) over [q0, q1) x [k0, k1), default the whole
        run: every weight, or pooled ("max" or "mean") to rows x cols; at most 1024 a side."""
        params = {"layer": layer, "head": head, "q0": q0, "q1": q1, "k0": k0, "k1": k1, "rows": rows, "cols": cols,
                  "pool": pool, "format": format or self.format}
        fields, arrays = decode_arrays(self._run_response(run, "tile", {k: v for k, v in params.items() if v is not None}))
        return RemoteTile(**_known(RemoteTile, fields), values=arrays["attention"])

    def cell(self, run: RemoteResult | str, query: int, key: int, *, format: str | None = None) -> np.ndarray:
        """(n_layers, n_heads) float32: the weight from `query` to `key` in every layer and head
        ("which heads link these two tokens?"), as exact as the run holds it (format: as tile's,
        the client's by default; a GPU server keeps an f16 run as float16 and refuses json)."""
        params = {"query": query, "key": key, "format": format or self.format}
        _, arrays = decode_arrays(self._run_response(run, "cell", params))
        return arrays["attention"]

    def topk(
        self, run: RemoteResult | str, layer: int, head: int, k: int = 8, q0: int | None = None, q1: int | None = None,
        *, format: str | None = None,
    ) -> RemoteTopK:
        """Each query row's k largest weights (largest first), their key positions and the mass left over."""
        params = {"layer": layer, "head": head, "k": k, "q0": q0, "q1": q1, "format": format or self.format}
        fields, arrays = decode_arrays(self._run_response(run, "topk", {k: v for k, v in params.items() if v is not None}))
        return RemoteTopK(**_known(RemoteTopK, fields), values=arrays["values"], indices=arrays["indices"], rest=arrays["rest"])

    def overview(self, run: RemoteResult | str, *, format: str | None = None) -> RemoteOverview:
        """Every head's max-pooled thumbnail of the whole run."""
        fields, arrays = decode_arrays(self._run_response(run, "overview", {"format": format or self.format}))
        return RemoteOverview(**_known(RemoteOverview, fields), values=arrays["attention"])
