"""The MultiHeadAttention module itself: classic interface kept, extensions correct."""

import threading

import pytest
import torch

from manyeyes.model.attention import Capture, MultiHeadAttention


def make(num_heads=3, d=12, context=16, causal=True):
    torch.manual_seed(0)
    return MultiHeadAttention(d, d, context, 0.0, num_heads, qkv_bias=True, causal=causal).eval()


def test_classic_constructor_names_and_buffer():
    mha = MultiHeadAttention(8, 8, 10, 0.1, 2)
    assert set(dict(mha.named_children())) == {"W_query", "W_key", "W_value", "out_proj", "dropout"}
    assert mha.W_query.bias is None  # qkv_bias=False by default, as in the book
    assert "mask" in mha.state_dict()
    assert torch.equal(mha.mask, torch.triu(torch.ones(10, 10), diagonal=1))
    assert mha.causal is True
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 10, 4, 0.0, 3)


def seed_forward(mha, x):
    """The chapter's forward, step by step, to check that ours computes the same thing."""
    b, t, _ = x.shape
    h, hd = mha.num_heads, mha.head_dim
    k = mha.W_key(x).view(b, t, h, hd).transpose(1, 2)
    q = mha.W_query(x).view(b, t, h, hd).transpose(1, 2)
    v = mha.W_value(x).view(b, t, h, hd).transpose(1, 2)
    scores = q @ k.transpose(2, 3)
    scores.masked_fill_(mha.mask.bool()[:t, :t], -torch.inf)
    w = torch.softmax(scores / hd**0.5, dim=-1)
    ctx = (w @ v).transpose(1, 2).contiguous().view(b, t, mha.d_out)
    return mha.out_proj(ctx), w


def test_default_is_the_chapters_causal_attention():
    mha = make()
    x = torch.randn(2, 7, 12)
    ref_ctx, ref_w = seed_forward(mha, x)
    out = mha.attend(x)
    assert torch.allclose(mha(x), ref_ctx, atol=1e-6)
    assert torch.allclose(out.weights, ref_w, atol=1e-6)
    assert out.weights.shape == (2, 3, 7, 7)


def test_causal_upper_triangle_is_exactly_zero_and_rows_sum_to_one():
    w = make().attend(torch.randn(3, 9, 12)).weights
    upper = torch.triu(torch.ones(9, 9, dtype=torch.bool), diagonal=1)
    assert torch.count_nonzero(w[..., upper]) == 0
    assert (w.sum(-1) - 1).abs().max() <= 1e-6


def test_bidirectional_attends_everywhere():
    w = make(causal=False).attend(torch.randn(1, 6, 12)).weights
    assert torch.all(w > 0)
    assert (w.sum(-1) - 1).abs().max() <= 1e-6


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_gives_each_row_its_unpadded_weights(causal):
    mha = make(causal=causal)
    a, b = torch.randn(1, 4, 12), torch.randn(1, 7, 12)
    batch = torch.cat([torch.cat([a, torch.randn(1, 3, 12)], 1), b])  # row 0 padded with noise
    real = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7], dtype=torch.bool)
    out = mha.attend(batch, real)
    solo_a, solo_b = mha.attend(a), mha.attend(b)
    assert (out.weights[0, :, :4, :4] - solo_a.weights[0]).abs().max() <= 1e-6
    assert torch.count_nonzero(out.weights[0, :, :, 4:]) == 0
    assert (out.weights[1] - solo_b.weights[0]).abs().max() <= 1e-6
    assert (out.context[0, :4] - solo_a.context[0]).abs().max() <= 1e-5


def test_qkv_only_on_request_and_consistent():
    mha = make()
    x = torch.randn(1, 5, 12)
    plain = mha.attend(x)
    assert plain.queries is None and plain.keys is None and plain.values is None
    full = mha.attend(x, capture=Capture(qkv=True))
    assert full.queries.shape == full.keys.shape == full.values.shape == (1, 3, 5, 4)
    # The weights must be reproducible from the returned q and k.
    scores = full.queries @ full.keys.transpose(2, 3) / 2.0
    scores = scores.masked_fill(mha.mask.bool()[:5, :5], -torch.inf)
    assert torch.allclose(torch.softmax(scores, -1), full.weights, atol=1e-6)
    # And the context from the weights and values.
    ctx = (full.weights @ full.values).transpose(1, 2).reshape(1, 5, 12)
    assert torch.allclose(mha.out_proj(ctx), full.context, atol=1e-6)
    assert mha.attend(x, capture=Capture(weights=False)).weights is None


def test_no_state_kept_between_calls_under_threads():
    mha = make(causal=False)
    before = set(vars(mha))
    inputs = [torch.randn(1, n, 12) for n in range(2, 10)]
    expected = [mha.attend(x).weights for x in inputs]
    got = [None] * len(inputs)

    def work(i):
        for _ in range(20):
            got[i] = mha.attend(inputs[i]).weights

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(vars(mha)) == before
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_weights_out_receives_the_weights_in_place():
    mha = make()
    x = torch.randn(2, 6, 12)
    buffer = torch.full((2, 3, 6, 6), float("nan"))
    out = mha.attend(x, capture=Capture(weights_out=buffer))
    assert out.weights.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer, mha.attend(x).weights)


@pytest.mark.parametrize("kv_heads,causal,window,padded", [
    (None, True, None, False), (None, False, None, True), (2, True, None, True), (2, True, 5, False), (None, False, 7, True),
])
def test_scores_are_made_in_weights_out_with_the_same_results_bit_for_bit(kv_heads, causal, window, padded):
    """With a buffer for the weights, the scores are made, masked and softmaxed in it: the layer
    allocates no (b, heads, T, T) tensor of its own (12.6 MB of fresh pages a layer for MiniLM at
    T=512), and the weights and context are those of the plain call, bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(1)
    b, heads, tokens = 2, 4, 48
    mha = MultiHeadAttention(16, 16, 64, 0.0, heads, causal=causal, num_kv_heads=kv_heads, sliding_window=window).eval()
    x = torch.randn(b, tokens, 16)
    real = torch.ones(b, tokens, dtype=torch.bool)
    if padded:
        real[0, 30:] = False
    mask = real if padded else None
    buffer = torch.full((b, heads, tokens, tokens), float("nan"))
    with torch.inference_mode():
        plain = mha.attend(x, mask)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            into = mha.attend(x, mask, Capture(weights_out=buffer))
    assert into.weights.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer, plain.weights) and torch.equal(into.context, plain.context)
    # each allocation on its own (masks are at most (b, 1, T, T)): none the size of the layer's scores
    assert not [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= buffer.nbytes // 2]


@pytest.mark.parametrize("kv_heads,causal", [(None, True), (2, True), (None, False)])
def test_training_uses_the_fused_kernel_and_computes_the_same(kv_heads, causal, monkeypatch):
    """In training nothing is inspected: the fused kernel (no T x T weights kept for the backward)
    gives the same context and the same gradients as the inspecting path."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, 32, 0.0, num_heads=4, causal=causal, num_kv_heads=kv_heads)
    x = torch.randn(2, 20, 16, requires_grad=True)
    mha.eval()
    expected = mha(x)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    mha.train()
    got = mha(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    assert calls and torch.allclose(got, expected, atol=1e-5) and torch.allclose(got_grad, expected_grad, atol=1e-4)
    assert mha.attend(x, capture=Capture()).weights is not None  # inspecting in training mode still works


def test_keep_refuses_a_key_padding_mask():
    """The row blocks mask no padding (their callers run one unpadded input): under a sliding
    window a padded query whose whole window was padding got a row of -inf, and NaN came out."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 8, None, 0.0, 2, sliding_window=2).eval()
    x = torch.randn(1, 8, 8)
    real = torch.tensor([[True] * 3 + [False] * 5])
    with torch.no_grad():
        assert mha.attend(x, real).context.isfinite().all()  # the plain path lets such a query see itself
        with pytest.raises(ValueError, match="Capture\\(keep=True\\) runs one unpadded input"):
            mha.attend(x, real, Capture(keep=True))
        # unpadded, keep computes what the plain path does
        kept, plain = mha.attend(x[:, :3], None, Capture(keep=True)), mha.attend(x[:, :3])
    assert torch.allclose(kept.context, plain.context, atol=1e-6)


@pytest.mark.parametrize("window", [None, 2])
def test_keep_over_no_tokens_gives_empty_outputs_as_the_plain_path_does(window):
    """bin_edges(0, ...) stepped range(0, 0, 0): a ValueError from deep inside the row blocks."""
    from manyeyes.model.attention import bin_count, bin_edges

    assert bin_edges(0, 64).tolist() == [0] and bin_count(0, 64) == 0  # no tokens, no bins
    mha = MultiHeadAttention(8, 8, None, 0.0, 2, sliding_window=window).eval()
    x = torch.randn(1, 0, 8)
    with torch.no_grad():
        plain, kept = mha.attend(x), mha.attend(x, capture=Capture(keep=True))
    assert kept.context.shape == plain.context.shape == (1, 0, 8)
    assert kept.row_max.shape == kept.row_sum.shape == (1, 2, 0) and kept.overview.shape == (1, 2, 0, 0)
