"""Generation with a key/value cache: same tokens as transformers, same rows as a full recompute."""

import pytest
import torch

from manyeyes.model import load
from manyeyes.model.generate import Sampling, generate
from tests.conftest import save_random_gpt2
from tests.test_parity_decoders import save_random

PROMPT = "In the beginning God created the heaven and the earth. And the"


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt", device="cpu")


def check_rows_equal_full_recompute(model, prompt, steps):
    """Every streamed row equals that position's row of one full forward over prompt + generated."""
    ids = model.encode(prompt).ids + [s.token.id for s in steps]
    with torch.inference_mode():
        full = model.net.inspect(torch.tensor([ids]))
    attention = torch.stack([layer.weights[0] for layer in full.layers])  # (L, H, T, T)
    for step in steps:
        assert step.attention.shape == (model.info.n_layers, model.info.n_heads, step.position + 1)
        assert (step.attention - attention[:, :, step.position, : step.position + 1]).abs().max().item() <= 1e-5


def test_tiny_gpt_greedy_with_cache_equals_the_recompute(tiny):
    cached = list(generate(tiny, PROMPT, 12))
    recomputed = list(generate(tiny, PROMPT, 12, use_cache=False))
    assert [s.token.id for s in cached] == [s.token.id for s in recomputed]
    for a, b in zip(cached, recomputed):
        assert (a.attention - b.attention).abs().max().item() <= 1e-5
        assert a.token.prob == pytest.approx(b.token.prob, abs=1e-5)
    check_rows_equal_full_recompute(tiny, PROMPT, cached)
    first = cached[0]
    assert first.position == len(tiny.encode(PROMPT)) and first.alternatives[0].id == first.token.id
    assert first.alternatives[0].prob >= first.alternatives[1].prob


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", dict(num_key_value_heads=2)),
        ("mistral", dict(num_key_value_heads=3, sliding_window=6)),
    ],
)
def test_greedy_equals_transformers_generate(tmp_path, bytelevel_tokenizer, family, overrides):
    ref = save_random(tmp_path, bytelevel_tokenizer, family, 21, **overrides)
    ours = load(tmp_path, device="cpu")
    steps = list(generate(ours, "The quick brown fox", 10))
    ids = torch.tensor([ours.encode("The quick brown fox").ids])
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(ids),
                                pad_token_id=0, eos_token_id=None)
    assert [s.token.id for s in steps] == expected[0, ids.shape[1]:].tolist()
    check_rows_equal_full_recompute(ours, "The quick brown fox", steps)


@pytest.mark.parametrize("variant", ["longrope", "dynamic"])
def test_length_following_rope_generation_past_its_threshold_equals_the_recompute(tmp_path, bytelevel_tokenizer, variant):
    """The cached keys were turned by the short factors; once the sequence outgrows the original
    context every position turns by the long ones. A cached step had gone on with the short.
    Dynamic NTK's base changes at every length past max_position_embeddings (16 here), which
    generation could not reach while the context stopped there."""
    from tests.test_parity_decoders import LONGROPE_16

    scaling, positions = {"longrope": (LONGROPE_16, 64), "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 16)}[variant]
    save_random(tmp_path, bytelevel_tokenizer, "llama", 22, num_key_value_heads=2, max_position_embeddings=positions,
                rope_scaling=scaling)
    ours = load(tmp_path, device="cpu")
    prompt = "The quick brown fox jumps"
    assert len(ours.encode(prompt).ids) < 16
    cached = list(generate(ours, prompt, 16))
    assert cached[-1].position >= 16  # across the original 16 positions
    recomputed = list(generate(ours, prompt, 16, use_cache=False))
    assert [s.token.id for s in cached] == [s.token.id for s in recomputed]
    for a, b in zip(cached, recomputed):
        assert (a.attention - b.attention).abs().max().item() <= 1e-5
        assert a.token.prob == pytest.approx(b.token.prob, abs=1e-5)
    # (Not check_rows_equal_full_recompute: a step's row is its sequence's as long as it was then,
    # and a run of the final, longer one turns the early positions by the long factors too.)


def test_greedy_equals_transformers_generate_gpt2(tmp_path, bytelevel_tokenizer):
    ref = save_random_gpt2(tmp_path, bytelevel_tokenizer, 4, n_embd=48, n_layer=2, n_head=4)
    ours = load(tmp_path, device="cpu")
    ids = torch.tensor([ours.encode("Attention heads look").ids])
    steps = list(generate(ours, "Attention heads look", 12))
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids),
                                pad_token_id=0, eos_token_id=None)
    assert [s.token.id for s in steps] == expected[0, ids.shape[1]:].tolist()
    check_rows_equal_full_recompute(ours, "Attention heads look", steps)


def test_a_seeded_sample_repeats_and_seeds_differ(tiny):
    sampling = Sampling(temperature=1.0, top_k=20, seed=7)
    first = [s.token.id for s in generate(tiny, PROMPT, 16, sampling)]
    again = [s.token.id for s in generate(tiny, PROMPT, 16, sampling)]
    other = [s.token.id for s in generate(tiny, PROMPT, 16, Sampling(temperature=1.0, top_k=20, seed=8))]
    assert first == again and first != other


def test_top_k_sampling_stays_within_the_top_k(tiny):
    for step in generate(tiny, PROMPT, 8, Sampling(temperature=2.0, top_k=3, seed=1), alternatives=3):
        assert step.token.id in [a.id for a in step.alternatives]


@pytest.mark.parametrize("temperature", [1e-308, 5e-324])
def test_a_temperature_near_zero_samples_the_best_token(tiny, temperature):
    """Dividing the logits by 1e-308 overflowed to inf, softmax made NaN, and the stream died
    mid-answer; at such a temperature sampling is greedy."""
    sampled = [s.token.id for s in generate(tiny, PROMPT, 4, Sampling(temperature=temperature, seed=3))]
    assert sampled == [s.token.id for s in generate(tiny, PROMPT, 4, Sampling(temperature=0.0))]


def test_bounds_are_refused(tiny, minilm):
    with pytest.raises(ValueError, match="exceed tiny-gpt's context of 256"):
        next(generate(tiny, PROMPT, 250))
    with pytest.raises(ValueError, match="at least 1"):
        next(generate(tiny, PROMPT, 0))
    # A full prompt is told the length that then runs: it was told 255 whatever it asked for, and
    # a prompt cut to 255 was refused again at 5 new tokens.
    full = tiny.encode("x" * 256)
    with pytest.raises(ValueError, match="shorten the prompt to at most 251 tokens$"):
        next(generate(tiny, full, 5))
    assert len(list(generate(tiny, tiny.encode("x" * 251), 5, stop_at_eos=False))) == 5
    with pytest.raises(ValueError, match="ask for fewer than 256 new tokens$"):
        next(generate(tiny, full, 256))
    with pytest.raises(ValueError, match="not a causal language model"):
        next(generate(minilm, "hello", 3))


@pytest.mark.parametrize("sampling", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -0.5}, {"temperature": "1"},
    {"top_k": 0}, {"top_k": -1}, {"top_k": 2.5}, {"top_k": True}, {"seed": -1}, {"seed": 2**64}, {"seed": "7"},
])
def test_bad_sampling_is_refused_where_it_is_made(sampling):
    """A NaN temperature sampled garbage and top_k=-1 raised torch's own topk error steps later."""
    name = next(iter(sampling))
    with pytest.raises(ValueError, match=name):
        Sampling(**sampling)


def test_good_sampling_is_accepted():
    assert Sampling(temperature=0, top_k=1, seed=0) and Sampling(temperature=2.0, seed=2**64 - 1)


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_the_prompts_forward_holds_no_weights_and_the_steps_are_unchanged(name, monkeypatch):
    """Each streamed row comes from its step's own forward: the prompt's (layers, heads, T, T)
    weights and (T, vocab) logits were made and held for nothing (L x H x T^2 floats until the
    first step; tiny-llama's 2,040-token prompt grew the process by 237 MB)."""
    model = load(name, device="cpu")
    prompt = ("In the beginning God created the heaven and the earth. " * 40)[: model.info.max_tokens - 8]
    n = len(model.encode(prompt))
    real = model.net.inspect
    traces = []

    def recording(*args, **kwargs):
        trace = real(*args, **kwargs)
        traces.append(trace)
        return trace

    monkeypatch.setattr(model.net, "inspect", recording)
    cached = list(generate(model, prompt, 3))
    prompt_trace = traces[0]
    big = [layer.weights for layer in prompt_trace.layers if layer.weights is not None and layer.weights.numel() >= n * n]
    assert not big and prompt_trace.logits is None
    monkeypatch.setattr(model.net, "inspect", real)
    recomputed = list(generate(model, prompt, 3, use_cache=False))
    assert [s.token.id for s in cached] == [s.token.id for s in recomputed]
    for a, b in zip(cached, recomputed):
        assert a.position == b.position and a.attention.shape == (model.info.n_layers, model.info.n_heads, a.position + 1)
        assert (a.attention - b.attention).abs().max().item() <= 1e-5
        assert a.token.prob == pytest.approx(b.token.prob, abs=1e-5)
        assert [c.id for c in a.alternatives] == [c.id for c in b.alternatives]
