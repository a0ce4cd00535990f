"""The Python API used as a notebook user gets it wrong: each mistake is an error that names it,
never a torch or Python error from deep inside, and results compare as objects do."""

import pickle
import re

import pytest

from manyeyes.model import Capture, load
from manyeyes.model.experiments import ablate, change_token, compare
from manyeyes.model.generate import generate


@pytest.fixture(scope="module")
def causal():
    return load("tiny-gpt", device="cpu")


def test_results_compare_as_objects_instead_of_raising(minilm, causal):
    """The generated __eq__ compared tensors: "Boolean value of Tensor with more than one value is ambiguous"."""
    r = minilm.attend("The cat.")
    assert r == r and r != pickle.loads(pickle.dumps(r))
    done = ablate(causal, "The cat", [(0, 1)])
    assert done == done and done != ablate(causal, "The cat", [(0, 1)])
    kept = causal.attend("The cat", capture=Capture(keep=True)).kept
    assert kept == kept


@pytest.mark.parametrize("call, message", [
    (lambda m: m.predict("abc", top_k="5"), "top_k (predict's second argument; text_pair is a keyword) must be a whole number (an int), got '5'"),
    (lambda m: m.predict("a", "b"), "got 'b'"),  # attend's second argument is text_pair; predict's is top_k
    (lambda m: m.predict("a", 2.5), "got 2.5"),
    (lambda m: ablate(m, "", [(0, 1)]), "the text gives no tokens, so there is no attention to ablate"),
    (lambda m: ablate(m, "ab", [(0, 1)], top=-1), "top must be a whole number of at least 1 (guesses kept per position), got -1"),
    (lambda m: ablate(m, "ab", [(0, 1)], top=0), "got 0"),
    (lambda m: m.attend("ab", capture=Capture(keep=True)).kept.block(0, 0, 0, 1, 0, 1), "heads must be a non-empty list of indices in 0..7, got 0"),
    # Generation and the experiments besides ablate had torch's or Python's words for these.
    (lambda m: next(generate(m, "hi", 2, alternatives=-1)), "alternatives must be a whole number of at least 0 (0: none), got -1"),
    (lambda m: next(generate(m, "hi", None)), "max_new_tokens must be a whole number of at least 1, got None"),
    (lambda m: next(generate(m, "hi", "3")), "got '3'"),
    (lambda m: next(generate(m, "hi", 2.0)), "got 2.0"),
    (lambda m: next(generate(m, "hi", True)), "got True"),
    (lambda m: change_token(m, "The bank", 1.0, "delete"), "index must be a whole number (an int), got 1.0"),
    (lambda m: change_token(m, "The bank", True, "delete"), "got True"),
    (lambda m: change_token(m, "", 0, "delete"), "the text gives no tokens, so there is no token to change"),
    (lambda m: compare(m, "", "In the beginning"), "text_a gives no tokens, so there is nothing of it to compare"),
    (lambda m: compare(m, "In", ""), "text_b gives no tokens"),
])
def test_wrong_values_are_value_errors_that_name_them(causal, call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(causal)


@pytest.mark.parametrize("call, message", [
    (lambda m: m.attend("a", capture={"qkv": True}), "capture must be a Capture (manyeyes.model.Capture(qkv=True), ...), got {'qkv': True}"),
    (lambda m: m.attend("a", capture=True), "capture must be a Capture"),
    (lambda m: m.run(["hello"]), "run takes a list of what encode returns: run([model.encode(text)]); for texts, use attend or attend_batch"),
    (lambda m: m.run(m.encode("hello")), "run takes a list of what encode returns"),
])
def test_wrong_types_are_type_errors_that_name_them(minilm, call, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        call(minilm)


def test_predictions_of_another_models_result_say_the_result_has_none(minilm, causal):
    """It said "model tiny-gpt has no language-model head", which tiny-gpt has."""
    with pytest.raises(ValueError, match=re.escape("this result holds no predictions (top_ids is None): it was run by a "
                                                   "model without a language-model head")):
        causal.predictions(minilm.attend("The cat."))
    with pytest.raises(ValueError, match=re.escape("model minilm has no language-model head")):
        minilm.predict("The [MASK] sat.")  # before its forward pass, now
    assert len(causal.predict("ab", 3)[0]) == 3
