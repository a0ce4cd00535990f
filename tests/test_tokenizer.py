"""Tokens carry offsets into the original, un-normalised text; no padding, no silent truncation."""

import pytest

from manyeyes.model import TooLongError
from manyeyes.model.tokenizer import TextTokenizer


def test_uncased_offsets_point_at_original_characters(minilm):
    text = "Ünïcödé EMBEDDINGS unbelievably Straße"
    enc = minilm.encode(text)
    pieces = [t.piece for t in enc.tokens]
    assert any(p.startswith("##") for p in pieces), "the sentence must exercise ## pieces"
    for tok in enc.tokens:
        if tok.special:
            continue
        assert text[tok.start : tok.end] == tok.text
    # The uncased vocabulary lowercases, but what we show is the user's own spelling.
    assert "EMBEDDINGS".startswith(enc.tokens[2].text) or enc.tokens[2].text.isupper()
    joined = "".join(t.text for t in enc.tokens if not t.special and t.start >= text.index("unbelievably"))
    assert joined.startswith("unbelievably")


def test_specials_flagged_and_no_padding(minilm):
    enc = minilm.encode("Hi.")
    assert [t.text for t in enc.tokens] == ["[CLS]", "Hi", ".", "[SEP]"]
    assert [t.special for t in enc.tokens] == [True, False, False, True]
    assert "[PAD]" not in [t.piece for t in enc.tokens]
    assert len(enc) == 4  # the shipped tokenizer.json pads to 128; ours must not


def test_pairs_have_segments_and_offsets_into_each_text(minilm):
    a, b = "Where is the bank?", "By the river."
    enc = minilm.encode(a, b)
    segs = [t.segment for t in enc.tokens]
    assert segs == [0] * segs.index(1) + [1] * (len(segs) - segs.index(1))
    assert enc.type_ids == segs
    for tok in enc.tokens:
        if not tok.special:
            assert (a, b)[tok.segment][tok.start : tok.end] == tok.text


def test_too_long_raises_unless_truncating(minilm):
    text = "word " * 600
    with pytest.raises(TooLongError) as err:
        minilm.encode(text)
    assert err.value.n_tokens == 602 and err.value.max_tokens == 512
    assert "602" in str(err.value) and "512" in str(err.value)
    enc = minilm.encode(text, truncate=True)
    assert len(enc) == 512 and enc.truncated
    assert enc.tokens[-1].text == "[SEP]"  # truncation keeps the template intact
    assert not minilm.encode("short").truncated


def test_bytelevel_offsets(bytelevel_tokenizer):
    path, _ = bytelevel_tokenizer
    tok = TextTokenizer.from_file(path, max_tokens=64)
    text = "The café 東京 🙂 fox."
    enc = tok.encode(text)
    assert not any(t.special for t in enc.tokens)
    # Byte tokens that split a multi-byte character overlap on it, so check coverage by index.
    covered = {i for t in enc.tokens for i in range(t.start, t.end)}
    assert covered == {i for i, ch in enumerate(text) if ch != " "}
    starts = [t.start for t in enc.tokens]
    assert starts == sorted(starts)
    for t in enc.tokens:
        assert 0 <= t.start <= t.end <= len(text)
        assert t.text  # a bare-space token still shows something readable
        if t.end > t.start:
            assert t.text == text[t.start : t.end]


@pytest.mark.parametrize("call, message", [
    (lambda m: m.attend(None), "text must be a str, got NoneType"),
    (lambda m: m.attend(b"bytes"), "text must be a str, got bytes"),
    (lambda m: m.attend("A", text_pair=3), "text_pair must be a str, got int"),
    (lambda m: m.attend_batch(["A", None]), "text must be a str"),
    (lambda m: m.attend_batch("one text"), "list of str; for one text call attend"),
])
def test_what_is_not_text_is_refused_by_name(minilm, call, message):
    """attend(None) raised the tokenizer's own TypeError; attend_batch("abc") ran each character."""
    with pytest.raises(TypeError, match=message):
        call(minilm)


def test_token_rows_read_as_the_tokens_and_leave_the_garbage_collector_nothing_to_walk(minilm):
    """A cached run keeps its tokens as TokenRows: the same tokens to every reader, and, once a
    collection has seen them, no object per token for the collector's full passes to walk."""
    import gc

    from manyeyes.app.services.cache import Run
    from manyeyes.model.tokenizer import Token, TokenRows

    tokens = minilm.encode("The heron waited by the old mill.").tokens
    run = Run("r", "minilm", tokens, False, None)
    kept = run.tokens
    assert isinstance(kept, TokenRows)
    assert kept == tokens and tokens == list(kept) and len(kept) == len(tokens)
    assert kept[3] == tokens[3] and isinstance(kept[3], Token) and kept[3].text == tokens[3].text
    assert kept[-2:] == tokens[-2:] and list(kept)[1:4] == tokens[1:4]
    assert Run("r", "minilm", kept, False, None).tokens is kept  # a run made from a run's tokens shares them
    assert kept != tokens[:-1] and kept != [tokens[0]._replace(id=-1), *tokens[1:]]
    assert kept != [t.text for t in tokens] and kept != "x" * len(tokens)  # same length, not tokens
    # A list of Tokens stays tracked forever (a NamedTuple is never untracked); the rows do not.
    gc.collect()
    gc.collect()
    assert all(gc.is_tracked(t) for t in tokens)
    assert not gc.is_tracked(kept.rows) and not any(gc.is_tracked(row) for row in kept.rows)


def test_a_lone_surrogate_is_a_value_error_naming_it():
    """load(...).attend("a\\ud800b") raised the tokenizer's "TypeError: TextEncodeInput must be
    Union[...]", which names a type, not the character at fault."""
    import pytest

    from manyeyes import load

    model = load("tiny-llama", device="cpu")
    with pytest.raises(ValueError, match=r"text_pair holds '\\udcff' at character 2, a lone surrogate"):
        model.attend("fine", "ok\udcff")
    with pytest.raises(ValueError, match=r"text holds '\\ud800' at character 1"):
        model.attend("a\ud800b")


def test_tiktoken_reads_an_id_past_its_vocabulary_as_nothing(monkeypatch):
    """A book checkpoint with nanoGPT's padded vocabulary (50,304 rows) and tiktoken's gpt2
    encoding (50,257 ids): logit attribution of a padded row's id raised KeyError, a 500."""
    import tiktoken

    from manyeyes.model.tokenizer import TiktokenTokenizer

    # A small byte-level encoding built here: tiktoken's gpt2 files are never downloaded in tests.
    ranks = {bytes([b]): b for b in range(256)}
    encoding = tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: encoding)
    tokenizer = TiktokenTokenizer(max_tokens=64)
    assert tokenizer.token_text(ord("a")) == "a"
    assert tokenizer.token_text(300) == ""


def _sentencepiece_like(path):
    """A Llama 2 style tokenizer: "▁" prepended and for spaces, BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog.", "apples and pears"] * 10,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return TextTokenizer.from_file(path, max_tokens=64)


@pytest.mark.parametrize("text, first", [("3 apples", "3"), ("\nthe fox", "\n"), ("é the", "é")])
def test_a_prepended_space_marker_is_not_labelled_as_the_first_character(tmp_path, text, first):
    """The tokenizers library gives a lone prepended "▁" the first character's offsets: "3 apples"
    read "3 3 ␣ a…" on the page, and the hover said the marker came from "3"."""
    tokens = _sentencepiece_like(tmp_path / "tokenizer.json").encode(text).tokens
    marker, covering = tokens[1], tokens[2]  # after <s>
    assert marker.piece == "▁" and marker.text == "▁"
    assert covering.text == first and covering.piece != "▁"
    spaces = [t for t in tokens[2:] if "▁" in t.piece]
    assert spaces and all(" " in t.text for t in spaces)  # a marker for a real space reads as one
