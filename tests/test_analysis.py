import pytest
import torch

from manyeyes.model import Capture
from manyeyes.model.analysis import value_weighted_norms


def test_value_weighted_norms_match_brute_force(minilm):
    r = minilm.attend("The bank of the river.", capture=Capture(qkv=True))
    norms = value_weighted_norms(minilm, r)
    T = len(r.tokens)
    assert norms.shape == (6, 12, T, T)
    layer, head, i, j = 3, 7, 2, 5
    att = minilm.net.trf_blocks[layer].att
    v = r.values[layer][head, j]  # (head_dim,)
    w_o_slice = att.out_proj.weight[:, head * 32 : (head + 1) * 32]  # (d_model, head_dim)
    expected = (r.attention[layer, head, i, j] * (w_o_slice @ v)).norm()
    assert torch.isclose(norms[layer, head, i, j], expected, rtol=1e-4)
    # The q/k views reproduce the weights: nothing was recomputed differently.
    q, k = r.queries[layer][head], r.keys[layer][head]
    assert torch.allclose(torch.softmax(q @ k.T / 32**0.5, -1), r.attention[layer, head], atol=1e-5)


def test_norms_need_captured_values(minilm):
    with pytest.raises(ValueError, match="Capture\\(qkv=True\\)"):
        value_weighted_norms(minilm, minilm.attend("hi"))


def test_value_weighted_norms_of_some_heads_are_those_heads_of_all(minilm):
    r = minilm.attend("The bank of the river.", capture=Capture(qkv=True))
    every = value_weighted_norms(minilm, r)
    some = value_weighted_norms(minilm, r, [4, 0], [11, 3, 5])
    assert some.shape == (2, 3) + every.shape[2:]
    assert torch.equal(some, every[[4, 0]][:, [11, 3, 5]])
    assert torch.equal(value_weighted_norms(minilm, r, list(range(6)), list(range(12))), every)


def test_layers_and_heads_from_python_are_checked_by_name(minilm):
    """numpy arrays were "truth value ... ambiguous" or "could not be broadcast", layer 5 of 6 fine
    but 6 a bare IndexError, [] torch's own error (review h55b): checked as ablations are."""
    import numpy as np

    from manyeyes.model.measures import neuron_view

    r = minilm.attend("The bank of the river.", capture=Capture(qkv=True))
    every = value_weighted_norms(minilm, r)
    assert torch.equal(value_weighted_norms(minilm, r, np.array([4, 0]), np.arange(12)), every[[4, 0]])
    assert torch.equal(value_weighted_norms(minilm, r, range(2), (np.int64(3),)), every[:2, [3]])
    for layers, heads, message in (([6], None, "layers 6 does not exist: this model's are 0..5"),
                                   (None, [12], "heads 12 does not exist: this model's are 0..11"),
                                   (None, [-1], "heads -1 does not exist"),
                                   ([], None, "layers is empty"),
                                   (None, [1, 1], "heads names an index twice"),
                                   (None, [1.5], "heads must be a whole number"),
                                   (3, None, "layers must be a list of whole numbers")):
        with pytest.raises(ValueError, match=message):
            value_weighted_norms(minilm, r, layers, heads)
    view = neuron_view(minilm, r, np.int64(1), 2, -1)
    assert (view.layer, view.head, view.query_index) == (1, 2, len(r.tokens) - 1)
    for args, message in (((6, 0, 0), "layer 6 does not exist"), ((-1, -1, 0), "layer -1 does not exist"),
                          ((0, 12, 0), "head 12 does not exist"), ((0, 0, 1.0), "query_index must be a whole number")):
        with pytest.raises(ValueError, match=message):
            neuron_view(minilm, r, *args)
