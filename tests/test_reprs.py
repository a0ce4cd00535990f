"""Reprs a notebook shows: one line that says what a result or a model is, not its every number."""

import dataclasses

import pytest

from manyeyes.model import Capture, load


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt", device="cpu")


def test_a_result_is_one_line_whatever_its_length(minilm, tiny):
    """Displaying a 16-token result printed 16 KB: every Token, then whole tensors."""
    r = minilm.attend("The bank of the river.")
    assert repr(r) == ("AttentionResult(8 tokens ['[CLS]', 'The', 'bank', …, '.', '[SEP]'], attention (6, 12, 8, 8) "
                       "float32, truncated=False, with hidden)")
    long = minilm.attend("word " * 600, truncate=True)
    assert repr(long).startswith("AttentionResult(512 tokens ['[CLS]', 'word', 'word', …, 'word', '[SEP]'], "
                                 "attention (6, 12, 512, 512) float32, truncated=True")
    assert len(repr(long)) < 200 and "\n" not in repr(long)
    assert repr(tiny.attend("hi")) == ("AttentionResult(2 tokens ['h', 'i'], attention (2, 8, 2, 2) float32, "
                                       "truncated=False, with hidden, logits, top-k)")
    assert repr(tiny.attend("")).startswith("AttentionResult(0 tokens [], attention (2, 8, 0, 0)")
    # Only what was captured is named; a kept run says so instead of a shape.
    assert repr(minilm.attend("a b", capture=Capture(qkv=True, hidden=False))).endswith(
        "truncated=False, with queries/keys/values)")
    kept = tiny.run([tiny.encode("In the beginning")], Capture(keep=True))[0]
    assert ", attention kept, " in repr(kept) and "16 tokens" in repr(kept)
    # A token's text is quoted (a newline stays on the line) and cut at 12 characters.
    tokens = [r.tokens[0]._replace(text=text) for text in ("a\nb", "x" * 30)]
    odd = dataclasses.replace(r, tokens=tokens, attention=r.attention[:, :, :2, :2])
    assert "['a\\nb', 'xxxxxxxxxxx…']" in repr(odd) and "\n" not in repr(odd)


def test_an_encoded_input_is_one_line_whatever_its_length(minilm):
    """encode's answer printed every Token: 170 KB for 2,000 tokens."""
    assert repr(minilm.encode("The bank of the river.")) == (
        "Encoded(8 tokens ['[CLS]', 'The', 'bank', …, '.', '[SEP]'], truncated=False)")
    long = minilm.encode("word " * 600, truncate=True)
    assert repr(long) == "Encoded(512 tokens ['[CLS]', 'word', 'word', …, 'word', '[SEP]'], truncated=True)"


def test_a_result_is_still_a_dataclass(tiny):
    r = tiny.attend("hi")
    assert r == r and dataclasses.replace(r, truncated=True) != r
    assert [f.name for f in dataclasses.fields(r)][:5] == ["tokens", "truncated", "attention", "hidden", "logits"]


def test_a_model_names_itself(minilm, tiny):
    """A model printed as `<AttentionModel object at 0x…>`."""
    assert repr(minilm) == "<AttentionModel 'minilm': bert, 6 layers × 12 heads, cpu>"
    assert repr(tiny) == "<AttentionModel 'tiny-gpt': gpt, 2 layers × 8 heads, cpu>"


def test_experiment_results_are_one_line(tiny):
    """A 2 x 8 model's comparison printed 9.3 KB and its ablation 8.7 KB: both runs in full, then
    every HeadChange and Guess."""
    from manyeyes.model.experiments import ablate, compare

    c = compare(tiny, "the river bank", "the river bend")
    top = c.ranking[:3]
    assert repr(c) == (f"Comparison(14 and 14 tokens, {len(c.pairs)} aligned; most changed (JS bits): "
                       + ", ".join(f"L{h.layer} H{h.head} {h.divergence:.3g}" for h in top) + ", … (16 heads))")
    a = ablate(tiny, "the river bank", [(0, 1)])
    assert repr(a).startswith("AblationResult(14 tokens; most changed (JS bits): L")
    assert repr(a).endswith(f", … (8 heads); Δ log p mean {float(a.logprob_change.mean()):.3g} over 13 targets)")
    last = ablate(tiny, "the river bank", [(1, 1)])  # nothing downstream of the last layer
    assert repr(last).startswith("AblationResult(14 tokens; no head ranked; Δ log p mean ")
    for r in (c, a, last):
        assert len(repr(r)) < 200 and "\n" not in repr(r)


def test_a_kept_run_and_its_pictures_are_one_line(tiny):
    """A kept run printed every tensor (75,000 characters for 362 tokens), its pooled overview and
    top-k some 60 lines each."""
    from manyeyes.model.kept import topk_rows

    kept = tiny.run([tiny.encode("In the beginning")], Capture(keep=True))[0].kept
    assert repr(kept) == (f"KeptAttention(2 layers x 8 heads, 16 tokens, head_dim {kept.queries.shape[-1]}, causal, "
                          f"{kept.nbytes / 2**20:.1f} MiB on cpu)")
    assert repr(kept.overview_pooled()) == "Pooled(values (2, 8, 16, 16) of queries 0..16 and keys 0..16)"
    assert repr(topk_rows(kept, 0, 0, 3, 0, 16)) == "TopK(values and indices (16, 3), rest (16,))"
