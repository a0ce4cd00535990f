"""A prediction's and a generated token's `piece`: the bytes of part of a character all read "\ufffd".

Before: on a byte-level model (tiny-llama, tiny-gpt) every guess and every generated token of a
byte >= 0x80 read token/text "\ufffd", in the API, the Client (`Prediction(token='�', id=245)`),
`manyeyes attend --top-k` and the page: ids 161, 159 and 102 could not be told apart, while the
prompt's own tokens carried their `piece`. Now each guess, step token and alternative carries the
`piece` a prompt token of that id has (the tokenizer's `token_piece`, the lookup `encode` makes).
"""

from __future__ import annotations

import re

import pytest

from manyeyes.app.config import Settings
from manyeyes.model import load
from manyeyes.model.generate import generate
from tests.api.conftest import serve

# Repeated, so that tiny-llama's induction heads guess the bytes of the characters it saw: 16 of
# its 90 positions have a byte of part of a character as their top guess.
TEXT = "東京で寿司を食べた。" * 3
PROMPT = "東京で寿司を食べた。東京で寿司を食べた。東"  # its first greedy token is a lone byte (0xD1)
REPLACEMENT = "\ufffd"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (each byte one printable character), written out here as the oracle."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


BYTE_OF_CHAR = _byte_alphabet()


def piece_bytes(piece: str) -> bytes | None:
    return bytes(BYTE_OF_CHAR[ch] for ch in piece) if piece and all(ch in BYTE_OF_CHAR for ch in piece) else None


@pytest.fixture(scope="module")
def llama():
    return load("tiny-llama", device="cpu")


@pytest.fixture(scope="module")
def api():
    client = serve(Settings(models={"tiny-llama": "tiny-llama"}, device="cpu", max_wait_ms=5))
    yield client
    client.__exit__(None, None, None)


def pieces_of_prompt(tokens) -> dict[int, str]:
    """id -> piece of the prompt's tokens (each id has one piece)."""
    seen: dict[int, set[str]] = {}
    for t in tokens:
        seen.setdefault(t["id"] if isinstance(t, dict) else t.id, set()).add(t["piece"] if isinstance(t, dict) else t.piece)
    assert all(len(p) == 1 for p in seen.values()), seen
    return {tid: p.pop() for tid, p in seen.items()}


def assert_pieces_tell_bytes_apart(guesses, prompt_pieces: dict[int, str], tokenizer) -> None:
    """guesses: (text, id, piece). Every piece is its id's; the "\ufffd" ones differ id by id, each
    the piece a prompt token of that id has, and its bytes are the byte(s) the text was read from."""
    broken = {(tid, piece) for text, tid, piece in guesses if text == REPLACEMENT}
    assert len({tid for tid, _ in broken}) >= 5, "the text should make tiny-llama guess several bytes"
    assert len({piece for _, piece in broken}) == len({tid for tid, _ in broken})  # one piece per id, none shared
    for text, tid, piece in guesses:
        assert piece == tokenizer.token_piece(tid) != ""
        if tid in prompt_pieces:
            assert piece == prompt_pieces[tid]
        if text == REPLACEMENT:
            raw = piece_bytes(piece)
            assert raw is not None and len(raw) == 1 and raw[0] >= 0x80 and raw.decode("utf-8", "replace") == text
    assert {tid for tid, _ in broken} & set(prompt_pieces), "some guessed bytes are the prompt's own"


def test_the_tokenizer_gives_an_id_the_piece_encode_gives_its_tokens(llama):
    for text in (TEXT, "naïve café 👩‍💻 שלום", " the end\n"):
        for t in llama.encode(text).tokens:
            assert llama.tokenizer.token_piece(t.id) == t.piece
    assert llama.tokenizer.token_piece(10**6) == ""  # past the vocabulary, as token_text reads it


def test_every_byte_level_pieces_bytes_are_what_its_text_was_read_from(llama):
    """The CLI's labels read a piece's bytes (`piece_bytes`): for every id but <|endoftext|>, they
    decode to the id's text, "\ufffd" for each byte of part of a character."""
    from manyeyes.labels import piece_bytes as ours

    tok = llama.tokenizer
    assert all(ours(chr(c)) == piece_bytes(chr(c)) for c in range(0x400)) and ours("") is None
    for tid in range(1, tok.vocab_size):
        raw = ours(tok.token_piece(tid))
        assert raw is not None and raw.decode("utf-8", "replace") == tok.token_text(tid), tid


def test_local_predictions_carry_their_piece_and_show_it_where_the_text_is_ambiguous(llama):
    found = llama.predict(TEXT, top_k=5)
    guesses = [(p.token, p.id, p.piece) for row in found.values() for p in row]
    assert_pieces_tell_bytes_apart(guesses, pieces_of_prompt(llama.encode(TEXT).tokens), llama.tokenizer)
    byte = next(p for row in found.values() for p in row if p.token == REPLACEMENT)
    assert repr(byte) == f"Prediction(token='{REPLACEMENT}', id={byte.id}, prob={byte.prob!r}, piece={byte.piece!r})"
    whole = next(p for row in found.values() for p in row if p.token != REPLACEMENT)
    assert "piece" not in repr(whole)  # a whole token's repr as it was


def test_api_predictions_carry_the_prompt_tokens_piece(api, llama):
    body = api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-llama", "format": "u8",
                                              "predictions": {"top_k": 5}}).json()
    rows = body["predictions"]
    assert all(set(p) == {"token", "id", "prob", "piece"} for row in rows.values() for p in row)
    guesses = [(p["token"], p["id"], p["piece"]) for row in rows.values() for p in row]
    assert_pieces_tell_bytes_apart(guesses, pieces_of_prompt(body["tokens"]), llama.tokenizer)
    # the fields that were there stay as they were
    expected = llama.predict(TEXT, top_k=5)
    assert {int(k): [(p["token"], p["id"]) for p in v] for k, v in rows.items()} == {
        k: [(p.token, p.id) for p in v] for k, v in expected.items()}


def test_api_generation_steps_carry_their_piece(api, llama):
    with api.stream("POST", "/api/v1/generate", json={"text": PROMPT, "model": "tiny-llama", "max_new_tokens": 4,
                                                       "alternatives": 20}) as r:
        import json

        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    start, steps = lines[0], [line for line in lines if line["type"] == "step"]
    prompt_pieces = pieces_of_prompt(start["prompt"])
    choices = [c for s in steps for c in (s["token"], *s["alternatives"])]
    assert all(set(c) == {"id", "text", "prob", "piece"} for c in choices)
    assert_pieces_tell_bytes_apart([(c["text"], c["id"], c["piece"]) for c in choices], prompt_pieces, llama.tokenizer)
    first = steps[0]["token"]
    assert first["text"] == REPLACEMENT and first["piece"] == llama.tokenizer.token_piece(first["id"])
    local = list(generate(llama, PROMPT, 4, alternatives=20))
    assert [(c["id"], c["text"], c["piece"]) for s in steps for c in (s["token"], *s["alternatives"])] == [
        (c.id, c.text, c.piece) for s in local for c in (s.token, *s.alternatives)]
    assert "piece=" in repr(local[0].token) and "piece=" not in repr(local[1].token)


def test_experiment_predictions_carry_their_piece(api, llama):
    body = api.post("/api/v1/experiments/ablate", json={"text": TEXT, "model": "tiny-llama", "top_k": 5,
                                                        "ablate": [{"layer": 1, "head": 0}]}).json()
    prompt_pieces = pieces_of_prompt(body["tokens"])
    for side in ("before", "after"):
        guesses = [(g["token"], g["id"], g["piece"]) for row in body["predictions"][side] for g in row]
        assert_pieces_tell_bytes_apart(guesses, prompt_pieces, llama.tokenizer)
    # The text's own next tokens, scored: each change names its token's piece as the prompt has it.
    changes = body["logprob_change"]
    assert any(c["token"] == REPLACEMENT for c in changes)
    assert all(c["piece"] == prompt_pieces[c["id"]] for c in changes)


def test_logit_attribution_names_its_targets_piece(api, llama):
    run = api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-llama", "format": "u8"}).json()
    prompt_pieces = pieces_of_prompt(run["tokens"])
    # A token that is one byte of a character split across tokens: its text alone reads "\ufffd".
    target = next(t["id"] for t in run["tokens"] if len(piece_bytes(t["piece"]) or b"") == 1 and piece_bytes(t["piece"])[0] >= 0x80)
    found = api.get(f"/api/v1/runs/{run['run_id']}/logit-attribution", params={"position": 0, "target": target}).json()
    assert found["target_text"] == REPLACEMENT and found["target_piece"] == prompt_pieces[target]


def test_cli_top_k_shows_a_split_characters_byte_not_a_replacement_character(capsys, llama):
    from manyeyes.app.cli import main

    assert main(["attend", TEXT, "--model", "tiny-llama", "--top-k", "5"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if re.match(r"^\s+\[\d+\].* -> ", line)]
    assert len(lines) == len(llama.encode(TEXT))
    assert REPLACEMENT not in "".join(line.split(" -> ", 1)[1] for line in lines)
    found = llama.predict(TEXT, top_k=5)
    byte = next(p for row in found.values() for p in row if p.token == REPLACEMENT)
    label = f"‹{piece_bytes(byte.piece)[0]:02X}›"
    assert f"{label} {byte.prob:.3f}" in out
    assert "'C' " in out  # whole tokens as they were, quoted


def test_the_client_reads_each_guess_and_steps_piece(llama):
    from manyeyes import Client
    from tests.eco.conftest import live_server

    with live_server({"tiny-llama": "tiny-llama"}) as base, Client(base) as c:
        r = c.attention(TEXT, model="tiny-llama", predictions=5)
        guesses = [(p.token, p.id, p.piece) for row in r.predictions.values() for p in row]
        assert_pieces_tell_bytes_apart(guesses, {t.id: t.piece for t in r.tokens}, llama.tokenizer)
        byte = next(p for row in r.predictions.values() for p in row if p.token == REPLACEMENT)
        assert f"piece={byte.piece!r}" in repr(byte)
        whole = next(p for row in r.predictions.values() for p in row if p.token != REPLACEMENT)
        assert repr(whole) == f"Prediction(token={whole.token!r}, id={whole.id}, prob={whole.prob!r})"
        steps = list(c.generate(PROMPT, 4, model="tiny-llama", alternatives=20))
        local = list(generate(llama, PROMPT, 4, alternatives=20))
        for name in ("text", "token", "piece"):  # the same loop reads a local and a remote step
            assert [getattr(s.token, name) for s in steps] == [getattr(s.token, name) for s in local]
            assert [getattr(a, name) for s in steps for a in s.alternatives] == [
                getattr(a, name) for s in local for a in s.alternatives]
        assert steps[0].token.token == REPLACEMENT and f"piece={steps[0].token.piece!r}" in repr(steps[0])
