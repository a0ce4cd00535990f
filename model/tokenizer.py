"""Tokenization with offsets into the caller's original text, never padded, never silently cut."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tokenizers import Tokenizer

from manyeyes.model.errors import CorruptFileError, TooLongError


class Token(NamedTuple):
    """One token of an input, immutable. A NamedTuple, not a frozen dataclass: a frozen
    dataclass's __init__ costs four times as much, 0.4 ms of every 512-token request."""

    text: str  # the original characters this token covers (its vocabulary piece for specials)
    id: int
    start: int  # character offsets into the text of its own segment, end exclusive
    end: int
    special: bool
    segment: int  # 0 for the first text, 1 for text_pair
    piece: str  # the vocabulary string, e.g. "##ing" or "Ġthe"


class TokenRows(Sequence[Token]):
    """Tokens kept for a long time (a cached run's), as rows the garbage collector stops walking.

    A list of `Token`s is one tracked object per token, for good: the collector untracks a tuple
    whose items are all atomic only when it is a plain tuple, never a NamedTuple. A run cache of
    short texts held 42,000 of them, most of what each full collection walked. Plain tuples of
    strings and ints are untracked at the first collection they see, so a run's tokens here cost
    one tracked object. Reads give `Token`s, made on the way out."""

    __slots__ = ("rows",)

    def __init__(self, tokens: Iterable[Token]) -> None:
        self.rows = tuple(map(tuple, tokens))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [Token._make(row) for row in self.rows[index]]
        return Token._make(self.rows[index])

    def __iter__(self) -> Iterator[Token]:
        return map(Token._make, self.rows)

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenRows):
            return self.rows == other.rows
        # A row equals its Token (the same fields, as a tuple) and nothing that is not a tuple:
        # tuple.__eq__ against a string gave NotImplemented, which all() counted as equal.
        return isinstance(other, Sequence) and len(other) == len(self.rows) and all(
            isinstance(token, tuple) and row == token for row, token in zip(self.rows, other)
        )

    def __repr__(self) -> str:
        return f"TokenRows({list(self)!r})"


@dataclass(frozen=True)
class Encoded:
    tokens: list[Token]
    type_ids: list[int]
    truncated: bool

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        # One line, as AttentionResult's: the generated repr printed every Token (170 KB for 2,000).
        return f"Encoded({brief_tokens(self.tokens)}, truncated={self.truncated})"


def brief_tokens(tokens) -> str:
    """A repr's view of a token list, one line at any length: "8 tokens ['[CLS]', 'the', 'bank', …, '[SEP]']"."""
    n = len(tokens)
    texts = [_short_text(t) for t in (tokens if n <= 6 else [*tokens[:3], *tokens[-2:]])]
    if n > 6:
        texts.insert(3, "…")
    return f"{n} token{'' if n == 1 else 's'} [{', '.join(texts)}]"


def _short_text(token) -> str:
    """A token's text for a repr, quoted, at most 12 characters of it."""
    text = getattr(token, "text", token)
    return repr(text if len(text) <= 12 else text[:11] + "…")


MASK_PIECES = ("[MASK]", "<mask>")
END_OF_TEXT = "<|endoftext|>"  # GPT-2's document separator, and what `manyeyes train` puts between files
UNK_PIECES = ("[UNK]", "<unk>")


class TextTokenizer:
    """Wraps a `tokenizers.Tokenizer`; holds two immutable copies so calls never mutate shared state."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int):
        self.max_tokens = max_tokens
        self._full = Tokenizer.from_str(tokenizer.to_str())
        self._full.no_padding()
        self._full.no_truncation()
        self._cut = Tokenizer.from_str(self._full.to_str())
        self._cut.enable_truncation(max_length=max_tokens)

    @classmethod
    def from_file(cls, path: Path, max_tokens: int) -> "TextTokenizer":
        try:
            return cls(Tokenizer.from_file(str(path)), max_tokens)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise CorruptFileError(f"cannot read tokenizer {path}: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """The rows an embedding needs for every id this tokenizer can give: its largest id + 1. Not
        get_vocab_size, a count: a vocabulary with a gap in its ids counted fewer, passed the load's
        check, and its top ids were an IndexError at the embedding (a 500 from the server)."""
        return max(self._full.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def mask_id(self) -> int | None:
        """The id masked-LM predictions are made at: BERT's [MASK] or RoBERTa's <mask>."""
        for piece in MASK_PIECES:
            tid = self._full.token_to_id(piece)
            if tid is not None:
                return tid
        return None

    @property
    def end_of_text_id(self) -> int | None:
        """The id of END_OF_TEXT in this vocabulary (GPT-2's 50256, the built-ins' 0); None where it has none."""
        return self._full.token_to_id(END_OF_TEXT)

    def token_text(self, tid: int) -> str:
        """How one vocabulary id reads on its own (" the" for byte-level BPE, "##ing" for WordPiece).
        A byte-level piece of part of a character reads "\ufffd", whichever byte it is: `token_piece` tells them apart."""
        return self._full.decode([tid], skip_special_tokens=False) or (self._full.id_to_token(tid) or "")

    def token_piece(self, tid: int) -> str:
        """One id's vocabulary piece, the `piece` an encoded token of that id carries (`Encoding.tokens`
        is this lookup): "Ġthe", "##ing", "å" for the byte 0xE5. "" for an id past the vocabulary."""
        return self._full.id_to_token(tid) or ""

    def special_token(self, kind: str) -> tuple[str, int] | None:
        """(piece, id) of the "mask" or "unk" token, under the spellings BERT and RoBERTa families use."""
        pieces = MASK_PIECES if kind == "mask" else (getattr(self._full.model, "unk_token", None), *UNK_PIECES)
        for piece in pieces:
            tid = self._full.token_to_id(piece) if piece else None
            if tid is not None:
                return piece, tid
        return None

    def encode(self, text: str, text_pair: str | None = None, truncate: bool = False) -> Encoded:
        # encode_batch of one: the same encoding in the same time, but it lets go of the
        # interpreter lock while it works (encode holds it), so the server's forward thread
        # runs meanwhile (200 µs at 120 tokens).
        source = (text, text_pair) if text_pair is not None else text
        try:
            (enc,) = self._full.encode_batch([source])
        except TypeError:
            _check_encodable(text, text_pair)  # the tokenizer's own words name a type, not the character
            raise
        truncated = False
        if len(enc.ids) > self.max_tokens:
            if not truncate:
                raise TooLongError(len(enc.ids), self.max_tokens)
            (enc,) = self._cut.encode_batch([source])
            truncated = True
        sources = (text, text_pair or "")
        tokens = []
        for tid, piece, (start, end), special, type_id, seq in zip(
            enc.ids, enc.tokens, enc.offsets, enc.special_tokens_mask, enc.type_ids, enc.sequence_ids
        ):
            segment = seq if seq is not None else type_id
            span = sources[segment][start:end] if not special else piece
            if _prepended_space_marker(piece, span):
                span = ""
            # A token with no span of its own (a lone byte-level space) shows its decoded form.
            tokens.append(Token(span or self._full.decode([tid], skip_special_tokens=False) or piece,
                                tid, start, end, bool(special), segment, piece))
        return Encoded(tokens, list(enc.type_ids), truncated)


SPACE_MARKER = "\u2581"  # SentencePiece's "▁", LOWER ONE EIGHTH BLOCK: a space in its pieces


def _prepended_space_marker(piece: str, span: str) -> bool:
    """A SentencePiece-style tokenizer (Llama 2, Mistral) puts "▁" before the text; where the first
    character is a digit, a newline or a byte-fallback one, the marker is a token of its own, and
    the tokenizers library gives it the first character's offsets. That span is not what it
    stands for ("3 apples" labelled "3 3 ␣ a…"): "▁" replaces spaces only, so a marker covering
    neither a space nor the literal character is the prepended one and shows its own form."""
    return bool(piece) and piece.strip(SPACE_MARKER) == "" and " " not in span and SPACE_MARKER not in span


GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"


def tiktoken_gpt2_cached() -> bool:
    """True when tiktoken's gpt2 files are already on disk; we never let it download."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "data-gym-cache"
    )
    return Path(cache, hashlib.sha1(GPT2_BPE_URL.encode()).hexdigest()).exists()


class TiktokenTokenizer:
    """tiktoken's gpt2 encoding behind the same `encode` as TextTokenizer (no special tokens)."""

    def __init__(self, max_tokens: int):
        import tiktoken

        self.max_tokens = max_tokens
        self._enc = tiktoken.get_encoding("gpt2")

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    mask_id = None  # GPT-2's encoding has no mask token

    @property
    def end_of_text_id(self) -> int:
        return self._enc.eot_token  # END_OF_TEXT, 50256: the encoding's one special token

    def token_text(self, tid: int) -> str:
        # A padded vocabulary (nanoGPT's 50,304) has output rows past the encoding's 50,257 ids:
        # those read as nothing, as a Hugging Face tokenizer reads them, not as a KeyError.
        try:
            return self._enc.decode_single_token_bytes(tid).decode("utf-8", errors="replace")
        except KeyError:
            return ""

    def token_piece(self, tid: int) -> str:
        """One id's piece, as `encode` gives its tokens theirs: this encoding's pieces are its
        tokens' own text (a byte of part of a character reads "\ufffd" here too)."""
        return self.token_text(tid)

    def special_token(self, kind: str) -> tuple[str, int] | None:
        return None  # GPT-2's encoding has neither a mask nor an unknown token

    def encode(self, text: str, text_pair: str | None = None, truncate: bool = False) -> Encoded:
        tokens: list[Token] = []
        for segment, part in enumerate((text, text_pair)):
            if part is None:
                continue
            ids = self._enc.encode_ordinary(part)
            _, starts = self._enc.decode_with_offsets(ids)
            ends = starts[1:] + [len(part)]
            for tid, start, end in zip(ids, starts, ends):
                piece = self.token_piece(tid)
                tokens.append(Token(part[start:end] or piece, tid, start, end, False, segment, piece))
        truncated = len(tokens) > self.max_tokens
        if truncated and not truncate:
            raise TooLongError(len(tokens), self.max_tokens)
        tokens = tokens[: self.max_tokens]
        return Encoded(tokens, [t.segment for t in tokens], truncated)


def _check_encodable(text, text_pair) -> None:
    """ValueError naming the first character no tokenizer takes: a lone surrogate (what Python
    makes of bytes that were not UTF-8), which the tokenizer refused as a TypeError about its types."""
    for name, value in (("text", text), ("text_pair", text_pair)):
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} holds {value[exc.start]!r} at character {exc.start}, a lone surrogate, "
                             "which is not text (bytes that were not UTF-8, decoded with surrogateescape?)") from None
