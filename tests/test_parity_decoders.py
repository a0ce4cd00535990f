"""Parity of the rotary decoder families (llama, mistral, qwen2, gpt_neox) with transformers' eager attention.

Each case saves a random-weight model with `save_pretrained` (safetensors) beside a tokenizer.json,
loads the folder with `manyeyes.model.load`, and compares attention weights (1e-5), the last
hidden state and the logits (1e-4) with transformers in float32 eager attention. Weights are drawn
with a large initializer_range so attention is peaked: near-uniform weights would let a wrong
mask or a wrong rotation pass unnoticed, so every case asserts that the reference is peaked.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from manyeyes.model import load
from manyeyes.model.errors import ModelLoadError, TooLongError
from manyeyes.model.families import family_for, gpt2, gpt_neox, llama
from manyeyes.model.rotary import RotaryEmbedding, rope_config, rope_parameters

TEXT = (
    "Attention heads look at other tokens; some look back, some look ahead. The quick brown fox "
    "jumps over the lazy dog, and the dog looks back at the fox."
)
SHORT = "The quick brown fox."


def _classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),
    }[family]


def save_random(folder, tokenizer, family: str, seed: int, **overrides):
    """A random-weight `family` model saved to `folder` with the tokenizer; returns transformers' eager copy."""
    config_cls, model_cls = _classes(family)
    tok_path, vocab = tokenizer
    settings = dict(
        vocab_size=vocab,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=6,
        intermediate_size=80,
        max_position_embeddings=96,
        initializer_range=0.2,  # peaked attention; 0.02 gives near-uniform rows
    )
    torch.manual_seed(seed)
    model_cls(config_cls(**(settings | overrides))).save_pretrained(folder, safe_serialization=True)
    shutil.copy(tok_path, folder / "tokenizer.json")
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


def reference(model, ids: torch.Tensor):
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_hidden_states=True)
    return torch.stack([a[0] for a in out.attentions]), out.hidden_states[-1][0], out.logits[0]


def assert_peaked(attention: torch.Tensor, skip: int = 4):
    """Rows past the first few (which causality forces to be peaked) must concentrate well above uniform."""
    rows = attention[..., skip:, :]  # (layers, heads, T - skip, T)
    visible = (rows > 0).sum(-1)  # keys each query could see (softmax never underflows to 0 here)
    row_max = rows.amax(-1)
    above_uniform = row_max * visible  # 1.0 for a uniform row
    assert (row_max > 0.5).float().mean() > 0.05, "reference attention is rarely peaked: the test would have no power"
    assert above_uniform.median() > 2, f"reference attention is near-uniform ({above_uniform.median():.1f}x)"


def assert_parity(ours, ref_model, text: str = TEXT, min_tokens: int = 24):
    r = ours.attend(text, truncate=True)
    ids = torch.tensor([[t.id for t in r.tokens]])
    assert ids.shape[1] >= min_tokens
    attention, hidden, logits = reference(ref_model, ids)
    assert_peaked(attention)
    assert r.attention.shape == attention.shape
    assert (attention - r.attention).abs().max().item() <= 1e-5
    assert (hidden - r.hidden).abs().max().item() <= 1e-4
    assert (logits - r.logits).abs().max().item() <= 1e-4
    return r


# (family, seed, config overrides): odd head counts, GQA ratios 6/2, 9/3, 4/1, 3/1, 5/5,
# an explicit head_dim, biases, tied heads, every rope_scaling variant, partial rotary, windows.
CASES = {
    "llama-gqa-6q2kv": ("llama", 1, dict(num_key_value_heads=2)),
    "llama-9q3kv-head_dim-bias-linear": (
        "llama", 2,
        dict(hidden_size=36, num_attention_heads=9, num_key_value_heads=3, head_dim=8, attention_bias=True,
             mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "llama-4q1kv-tied-llama3": (
        "llama", 3,
        dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
             rope_theta=500.0,
             rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}),
    ),
    "llama-5q-yarn": (
        "llama", 4,
        dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=5,
             rope_scaling={"rope_type": "yarn", "factor": 6.0, "original_max_position_embeddings": 16}),
    ),
    "llama-3q1kv-longrope": (
        "llama", 5,
        dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
             rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                           "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                           "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}),
    ),
    "mistral-window6-6q2kv": ("mistral", 6, dict(num_key_value_heads=2, sliding_window=6)),
    "qwen2-bias-window-on-layer1": (
        "qwen2", 7,
        dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, tie_word_embeddings=True,
             use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen2-7q7kv": ("qwen2", 8, dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=7)),
    "gpt_neox-parallel-rotary25": (
        "gpt_neox", 9, dict(hidden_size=80, num_attention_heads=5, rotary_pct=0.25, use_parallel_residual=True)
    ),
    "gpt_neox-sequential-rotary50-nobias": (
        "gpt_neox", 10,
        dict(hidden_size=48, num_attention_heads=3, rotary_pct=0.5, use_parallel_residual=False, attention_bias=False),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decoder_folder_matches_transformers(tmp_path, bytelevel_tokenizer, case):
    family, seed, overrides = CASES[case]
    ref_model = save_random(tmp_path, bytelevel_tokenizer, family, seed, **overrides)
    ours = load(tmp_path, device="cpu")
    cfg = ref_model.config
    assert ours.info.family == family and ours.info.causal
    assert ours.net.n_kv_heads == getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    assert ours.info.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    r = assert_parity(ours, ref_model)
    # The first token only sees itself, so its scores are exact; deeper rows are the real check above.
    assert torch.allclose(r.attention[:, :, 0, 0], torch.ones(()))


def test_mistral_window_is_shorter_than_the_context(tmp_path, bytelevel_tokenizer):
    ref_model = save_random(tmp_path, bytelevel_tokenizer, "mistral", 11, num_key_value_heads=3, sliding_window=4)
    r = assert_parity(load(tmp_path, device="cpu"), ref_model)
    T = r.attention.shape[-1]
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    outside = (k > q) | (k <= q - 4)
    assert T > 4 * 6 and r.attention[..., outside].abs().max() == 0
    assert (r.attention[..., ~outside] > 0).all()  # every key inside the window keeps some weight


def test_dynamic_ntk_beyond_the_trained_context(tmp_path, bytelevel_tokenizer):
    """Dynamic NTK only differs past max_position_embeddings: random ids, straight to the network."""
    ref_model = save_random(
        tmp_path, bytelevel_tokenizer, "llama", 12, num_key_value_heads=2, max_position_embeddings=24,
        rope_scaling={"rope_type": "dynamic", "factor": 3.0},
    )
    ours = load(tmp_path, device="cpu")
    ids = torch.randint(0, ours.net.cfg.vocab_size, (1, 56), generator=torch.Generator().manual_seed(0))
    attention, hidden, logits = reference(ref_model, ids)  # a fresh model: transformers' cache is empty
    assert_peaked(attention)
    with torch.no_grad():
        trace = ours.net.inspect(ids)
    assert (attention - torch.stack([a.weights[0] for a in trace.layers])).abs().max().item() <= 1e-5
    assert (hidden - trace.hidden[0]).abs().max().item() <= 1e-4
    assert (logits - trace.logits[0]).abs().max().item() <= 1e-4


def test_dynamic_ntk_runs_past_the_trained_context_as_transformers_does(tmp_path, bytelevel_tokenizer):
    """The tokenizer cut every input at max_position_embeddings, where dynamic NTK's scaling only
    begins: a model loaded by Hub id could never use it. Its inputs now go to the factor's stretch."""
    ref_model = save_random(
        tmp_path, bytelevel_tokenizer, "llama", 16, num_key_value_heads=2, max_position_embeddings=24,
        rope_scaling={"rope_type": "dynamic", "factor": 3.0},
    )
    ours = load(tmp_path, device="cpu")
    assert ours.info.max_tokens == 72
    text = " ".join(["the river bank"] * 6)
    r = ours.attend(text)
    assert 24 < len(r.tokens) <= 72
    ids = torch.tensor([[t.id for t in r.tokens]])
    attention, _, logits = reference(ref_model, ids)  # a fresh model: transformers' cache is empty
    assert (attention - r.attention).abs().max().item() <= 1e-5
    assert (logits - r.logits).abs().max().item() <= 1e-4
    with pytest.raises(TooLongError, match="at most 72"):
        ours.attend(" ".join(["the river bank"] * 40))


LONGROPE_16 = {"rope_type": "longrope", "original_max_position_embeddings": 16,
               "short_factor": [1.0 + i / 8 for i in range(4)], "long_factor": [2.0 + i for i in range(4)]}


@pytest.mark.parametrize("family,overrides", [
    ("mistral", dict(num_key_value_heads=2, sliding_window=3)),
    ("gpt_neox", dict(num_attention_heads=3, rotary_pct=0.5)),
    # SHORT fits the original 16 positions and TEXT does not: longrope turns them by different
    # frequencies, and the batch's width had chosen the long ones for both.
    ("llama", dict(num_key_value_heads=2, max_position_embeddings=64, rope_scaling=LONGROPE_16)),
])
def test_padded_batch_rows_equal_their_own_runs(tmp_path, bytelevel_tokenizer, family, overrides):
    """A window can hold only padding for a padded query; that must not turn real rows into NaN."""
    save_random(tmp_path, bytelevel_tokenizer, family, 13, **overrides)
    ours = load(tmp_path, device="cpu")
    batch = ours.attend_batch([TEXT, SHORT])
    assert len(ours.encode(SHORT)) <= 16 < len(ours.encode(TEXT))
    for text, r in zip([TEXT, SHORT], batch):
        alone = ours.attend(text)
        assert torch.isfinite(r.attention).all()
        assert (r.attention - alone.attention).abs().max().item() <= 1e-6
        assert (r.logits - alone.logits).abs().max().item() <= 1e-5


def test_returned_queries_and_keys_are_what_the_softmax_saw(tmp_path, bytelevel_tokenizer):
    """Under GQA the keys come back per key/value head (4q/2kv here); rebuilding the weights from them proves it."""
    from manyeyes.model.attention import Capture

    save_random(tmp_path, bytelevel_tokenizer, "mistral", 14, num_attention_heads=4, num_key_value_heads=2,
                hidden_size=32, sliding_window=5)
    r = load(tmp_path, device="cpu").attend(TEXT, capture=Capture(qkv=True))
    T = len(r.tokens)
    q_idx, k_idx = torch.arange(T)[:, None], torch.arange(T)[None, :]
    blocked = (k_idx > q_idx) | (k_idx <= q_idx - 5)
    for layer, (q, k) in enumerate(zip(r.queries, r.keys)):
        assert q.shape == (4, T, 8) and k.shape == (2, T, 8)
        scores = q @ k.repeat_interleave(2, dim=0).transpose(1, 2) / 8**0.5  # query head h uses kv head h // 2
        rebuilt = torch.softmax(scores.masked_fill(blocked, -torch.inf), dim=-1)
        assert (rebuilt - r.attention[layer]).abs().max().item() <= 1e-5


def test_dynamic_ntk_rows_of_a_padded_batch_equal_their_own_runs(tmp_path, bytelevel_tokenizer):
    """Past max_position_embeddings dynamic NTK stretches the base by the input's length: a row
    padded to a longer neighbour's width keeps its own (as transformers does for it alone)."""
    ref_model = save_random(
        tmp_path, bytelevel_tokenizer, "llama", 15, num_key_value_heads=2, max_position_embeddings=24,
        rope_scaling={"rope_type": "dynamic", "factor": 3.0},
    )
    ours = load(tmp_path, device="cpu")
    ids = torch.randint(0, ours.net.cfg.vocab_size, (2, 56), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 56, dtype=torch.bool)
    real[1, 40:] = False  # the second row is 40 tokens long, past 24 as the first is, by less
    with torch.no_grad():
        batch = ours.net.inspect(ids, real)
    for row, n in ((0, 56), (1, 40)):
        # fresh each time: transformers keeps the frequencies of the longest input it has seen
        fresh = type(ref_model).from_pretrained(tmp_path, attn_implementation="eager").eval()
        attention, _, logits = reference(fresh, ids[row:row + 1, :n])
        ours_row = torch.stack([a.weights[row, :, :n, :n] for a in batch.layers])
        assert (attention - ours_row).abs().max().item() <= 1e-5
        assert (logits - batch.logits[row, :n]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_length_following_tables_per_row_equal_each_rows_own(variant):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=8, max_position_embeddings=128,
                         rope_theta=10000.0, rope_scaling=dict(ROPE_VARIANTS[variant]))
    ours = RotaryEmbedding(rope_config(rope_parameters(json.loads(config.to_json_string())), 32, 128))
    lengths = torch.tensor([20, 200, 129, 128])  # each side of longrope's 32 and of dynamic's 128
    cos, sin = ours(torch.arange(200), 200, lengths)
    assert cos.shape == sin.shape == (4, 1, 200, 32)
    for row, n in enumerate(lengths.tolist()):
        theirs_cos, theirs_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(n)[None])
        assert (cos[row, 0, :n] - theirs_cos[0]).abs().max().item() <= 1e-6
        assert (sin[row, 0, :n] - theirs_sin[0]).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------- rotary tables alone
ROPE_VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + i / 8 for i in range(16)], "long_factor": [1.0 + i for i in range(16)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@pytest.mark.parametrize("length", [20, 200])
def test_rotary_tables_match_transformers(variant, length):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=8, max_position_embeddings=128,
                         rope_theta=10000.0, rope_scaling=dict(ROPE_VARIANTS[variant]))
    theirs = LlamaRotaryEmbedding(config)  # fresh for each length: its dynamic cache starts empty
    ours = RotaryEmbedding(rope_config(rope_parameters(json.loads(config.to_json_string())), 32, 128))
    assert torch.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    positions = torch.arange(length)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    our_cos, our_sin = ours(positions)
    assert (cos[0] - our_cos).abs().max().item() <= 1e-6
    assert (sin[0] - our_sin).abs().max().item() <= 1e-6


def test_partial_rotary_tables_match_gpt_neox():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    config = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25, rotary_emb_base=500)
    theirs = GPTNeoXRotaryEmbedding(config)
    net = gpt_neox.build(json.loads(config.to_json_string()), "config.json")
    assert net.cfg.rope.rotary_dim == 8
    cos, sin = theirs(torch.zeros(1), torch.arange(50)[None])
    our_cos, our_sin = net.rotary(torch.arange(50))
    assert (cos[0] - our_cos).abs().max().item() <= 1e-6 and (sin[0] - our_sin).abs().max().item() <= 1e-6


@pytest.mark.parametrize("extra", [dict(rope_theta=20000.0), dict(partial_rotary_factor=0.5),
                                   dict(rope_theta=20000.0, partial_rotary_factor=0.5, rotary_emb_base=500, rotary_pct=0.25)])
def test_gpt_neox_reads_rotary_emb_base_and_rotary_pct_over_their_generic_names(extra):
    """transformers' GPTNeoXConfig fills its RoPE from rotary_emb_base and rotary_pct (or their
    defaults) and ignores a top-level rope_theta or partial_rotary_factor; we took those first, and
    attention differed by up to 0.95."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    raw = dict(model_type="gpt_neox", hidden_size=128, num_attention_heads=4) | extra
    theirs = GPTNeoXRotaryEmbedding(GPTNeoXConfig(**raw))
    net = gpt_neox.build(dict(NEOX, **raw), "config.json")
    assert net.cfg.rope.rotary_dim == theirs.inv_freq.numel() * 2
    cos, sin = theirs(torch.zeros(1), torch.arange(50)[None])
    our_cos, our_sin = net.rotary(torch.arange(50))
    assert (cos[0] - our_cos).abs().max().item() <= 1e-6 and (sin[0] - our_sin).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------- what we refuse, and why
BASE = dict(model_type="llama", vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
            intermediate_size=32, max_position_embeddings=32)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "su-rope", "factor": 2.0}), "unsupported rope type 'su-rope'"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope type 'linear' needs factor"),
    # transformers refuses these (missing required keys); we had guessed defaults (review h55a).
    (dict(rope_scaling={"rope_type": "yarn"}), "rope type 'yarn' needs factor"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     "rope type 'llama3' needs original_max_position_embeddings, low_freq_factor, high_freq_factor"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
          original_max_position_embeddings=16), None),
    (dict(rope_parameters="linear"), "rope_parameters must be an object of rope settings \\(or null\\), got 'linear'"),
    (dict(head_dim=7), "head_dim 7 x partial_rotary_factor 1.0 .* leaves 7 dims to rotate"),
    (dict(rope_scaling={"rope_type": ["yarn"], "factor": 2.0}), "rope_type must be a name such as 'linear' or 'yarn', got \\['yarn'\\]"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "warp": 1}), "unsupported rope parameter.*warp"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor is unsupported"),
    (dict(num_key_value_heads=3, num_attention_heads=4), "not divisible by num_key_value_heads"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=None, layer_types=["sliding_attention"]),
     "no sliding_window"),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=4, layer_types=["sliding_attention"]),
     "asks for sliding attention but use_sliding_window is false"),
    (dict(model_type="mistral", sliding_window="4096"), "sliding_window must be a whole number >= 1 or null, got '4096'"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window must be a whole number >= 1 or null, got 0"),
])
def test_llama_family_refuses_what_it_cannot_honour(change, message):
    if message is None:  # the same settings, complete: built
        assert llama.build(BASE | change, "config.json").cfg.rope.rope_type == change["rope_parameters"]["rope_type"]
        return
    with pytest.raises(ModelLoadError, match=message):
        llama.build(BASE | change, "config.json")


@pytest.mark.parametrize("change,message", [
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(use_sliding_window="true"), "use_sliding_window must be true or false, got 'true'"),
    (dict(mlp_bias=[]), "mlp_bias must be true or false, got \\[\\]"),
    (dict(model_type=["llama"]), "unsupported model_type \\['llama'\\]; supported: bert"),
])
def test_config_values_of_the_wrong_kind_are_refused_by_name(tmp_path, change, message):
    """A string "false" was true to bool(): the head was tied to the embeddings over the saved
    lm_head.weight (transformers refuses the config); a list model_type was "unhashable type" (review h55a)."""
    from manyeyes.model.families import family_for
    from manyeyes.model.loading import check_numbers

    config = BASE | change
    with pytest.raises(ModelLoadError, match=message):
        family_for(config["model_type"], tmp_path / "config.json")
        check_numbers(config, tmp_path / "config.json")
    check_numbers(BASE | dict(tie_word_embeddings=False, use_sliding_window=None, mlp_bias=0), tmp_path / "config.json")


def test_a_gpt2_config_whose_width_does_not_split_into_heads_is_refused_in_its_own_terms():
    """GPTConfig's words were "emb_dim (35) is not divisible by n_heads (4)": no key of config.json."""
    from manyeyes.model.families import gpt2

    config = dict(model_type="gpt2", vocab_size=50, n_embd=35, n_head=4, n_layer=1, n_positions=16)
    with pytest.raises(ModelLoadError, match="config.json: n_embd 35 is not divisible by n_head 4$"):
        gpt2.build(config, "config.json")


@pytest.mark.parametrize("change,windows", [
    # The key left out is the config classes' default, 4096 (a window 0.38 off at 4,300 tokens);
    # null is no window.
    (dict(model_type="mistral"), (4096,)),
    (dict(model_type="mistral", sliding_window=None), ()),
    (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=0), (4096,)),
    (dict(model_type="qwen2"), (None,)),
])
def test_a_missing_sliding_window_is_the_config_classes_default(change, windows):
    assert llama.build(BASE | change, "config.json").cfg.sliding_windows == windows


NEOX = dict(model_type="gpt_neox", vocab_size=50, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
            intermediate_size=64, max_position_embeddings=32)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="relu"), "unsupported activation hidden_act='relu'"),
    (dict(rotary_pct=0.1), r"head_dim 16 x partial_rotary_factor 0.1 \(rotary_pct in GPT-NeoX configs\) leaves 1 dims"),
    (dict(rotary_pct=0.01), "leaves 0 dims to rotate; only an even number above 0"),
    (dict(num_attention_heads=3), "not divisible by num_attention_heads"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0, "alpha": 1}), "unsupported rope parameter.*alpha"),
])
def test_gpt_neox_refuses_what_it_cannot_honour(change, message):
    with pytest.raises(ModelLoadError, match=message):
        gpt_neox.build(NEOX | change, "config.json")


GPT2 = dict(model_type="gpt2", vocab_size=50, n_embd=32, n_head=2, n_layer=1, n_positions=32)


@pytest.mark.parametrize("change,message", [
    (dict(add_cross_attention=True), r"add_cross_attention=true \(a GPT-2 that attends to an encoder\) is unsupported"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=true is unsupported"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=true is unsupported"),
    (dict(scale_attn_weights=False), "scale_attn_weights=false is unsupported"),
    (dict(n_inner=100), "n_inner=100 is unsupported"),
])
def test_gpt2_refuses_what_it_cannot_honour(change, message):
    """add_cross_attention was refused as "unexpected key ...crossattention...; is this really a gpt2
    checkpoint?", which it is."""
    with pytest.raises(ModelLoadError, match=message):
        gpt2.build(GPT2 | change, "config.json")


def test_untied_head_must_be_present(tmp_path, bytelevel_tokenizer):
    save_random(tmp_path, bytelevel_tokenizer, "llama", 15, num_key_value_heads=2)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing key 'lm_head.weight'"):
        load(tmp_path, device="cpu")


def test_errors_name_a_key_as_the_checkpoint_saves_it(tmp_path, bytelevel_tokenizer):
    """The tables read a LlamaForCausalLM's keys without their "model." prefix, and the errors named
    them so: "missing key 'layers.1.self_attn.k_proj.weight'", a key no file listing shows."""
    from safetensors.torch import load_file, save_file

    save_random(tmp_path, bytelevel_tokenizer, "llama", 15, num_key_value_heads=2)
    state = {k: v.clone() for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    key = "model.layers.1.self_attn.k_proj.weight"
    for broken, message in (
        ({k: v for k, v in state.items() if k != key}, f"missing key '{key}' (for 'trf_blocks.1.att.W_key.weight')"),
        (state | {key: torch.zeros(3, 3)}, f"shape mismatch for 'trf_blocks.1.att.W_key.weight' (the checkpoint's '{key}')"),
        (state | {"model.layers.1.self_attn.rotary": torch.zeros(1)}, "unexpected key 'model.layers.1.self_attn.rotary'"),
        (state | {key: torch.zeros(state[key].shape, dtype=torch.int8)}, f"'{key}' holds int8 values"),
        # one NaN answered attention of NaNs (null in JSON, a head attending nowhere in u8)
        (state | {key: state[key].index_fill(1, torch.tensor([2]), float("nan"))},
         f"'trf_blocks.1.att.W_key.weight' (the checkpoint's '{key}') holds NaN or infinite values"),
    ):
        save_file(broken, str(tmp_path / "model.safetensors"))
        with pytest.raises(ModelLoadError) as err:
            load(tmp_path, device="cpu")
        assert message in str(err.value)


def test_unknown_model_type_lists_the_families():
    with pytest.raises(ModelLoadError, match="unsupported model_type 't5'; supported: ") as err:
        family_for("t5", "config.json")
    listed = str(err.value).split("supported: ")[-1].split(", ")
    assert set(listed) == {"bert", "distilbert", "gpt2", "gpt_neox", "llama", "mistral", "qwen2", "roberta"}


@pytest.mark.parametrize("num_queries,num_keys,window", [(6, 6, None), (9, 9, 1), (9, 9, 4), (3, 9, 4)])
def test_mask_matches_transformers_mask_functions(num_queries, num_keys, window):
    """Our blocked positions against transformers' own mask predicates, including a cache-style offset."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from manyeyes.model.attention import blocked_positions

    allowed_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    offset = num_keys - num_queries
    allowed = torch.tensor([
        [bool(allowed_fn(torch.tensor(0), torch.tensor(0), torch.tensor(offset + i), torch.tensor(k)))
         for k in range(num_keys)]
        for i in range(num_queries)
    ])
    ours = blocked_positions(num_queries, num_keys, causal=True, sliding_window=window, device="cpu")
    assert torch.equal(ours, ~allowed)


def _as_transformers4(folder, family: str):
    """Rewrite a saved config.json the way transformers 4.x wrote it: most hub checkpoints look like this."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    theta = params.pop("rope_theta")
    if family == "gpt_neox":
        config |= {"rotary_emb_base": theta, "rotary_pct": params.pop("partial_rotary_factor")}
    else:
        config["rope_theta"] = theta
    kind = params.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else params | {"type": kind}  # the oldest spelling
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("case", ["llama-5q-yarn", "llama-4q1kv-tied-llama3", "gpt_neox-parallel-rotary25"])
def test_transformers4_configs_load_the_same(tmp_path, bytelevel_tokenizer, case):
    family, seed, overrides = CASES[case]
    overrides = dict(overrides, rope_theta=2000.0) if family != "gpt_neox" else dict(overrides, rotary_emb_base=2000)
    ref_model = save_random(tmp_path, bytelevel_tokenizer, family, seed, **overrides)
    _as_transformers4(tmp_path, family)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    assert_parity(load(tmp_path, device="cpu"), ref_model)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_rope_scaling_added_to_a_transformers5_config_wins_as_in_transformers(tmp_path, bytelevel_tokenizer, family):
    """A config with both spellings (rope_scaling written by hand into a saved rope_parameters config):
    transformers reads rope_scaling; ours ran the saved default RoPE (attention 0.92 off)."""
    overrides = dict(num_key_value_heads=2) if family == "llama" else dict(hidden_size=64, num_attention_heads=4)
    save_random(tmp_path, bytelevel_tokenizer, family, 12, **overrides)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    assert config["rope_parameters"]["rope_type"] == "default"
    path.write_text(json.dumps(config | {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    config_cls, model_cls = _classes(family)
    ref_model = model_cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert ref_model.config.rope_parameters["rope_type"] == "linear"
    assert_parity(load(tmp_path, device="cpu"), ref_model)


@pytest.mark.parametrize("family, model_class, head_class", [
    ("llama", "LlamaModel", None),
    ("llama", "LlamaForSequenceClassification", "LlamaModel"),
    ("qwen2", "Qwen2ForTokenClassification", "Qwen2Model"),
    ("gpt_neox", "GPTNeoXModel", None),
    ("gpt_neox", "GPTNeoXForSequenceClassification", "GPTNeoXModel"),
])
def test_base_and_task_checkpoints_load_without_an_lm_head(tmp_path, bytelevel_tokenizer, family, model_class, head_class):
    """A base or classifier checkpoint has no LM head: it was refused ("missing key 'lm_head.weight'",
    "unexpected key 'score.weight'") though the attention needs none. It loads, predicting nothing."""
    import transformers as tf

    config_cls, _ = _classes(family)
    tok_path, vocab = bytelevel_tokenizer
    torch.manual_seed(4)
    config = config_cls(vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=80,
                        max_position_embeddings=96, initializer_range=0.2, tie_word_embeddings=False, num_labels=3,
                        pad_token_id=0, **({} if family == "gpt_neox" else {"num_key_value_heads": 2}))
    getattr(tf, model_class)(config).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())
    ours = load(tmp_path, device="cpu")
    assert not ours.info.predictions and ours.attend(SHORT).logits is None
    with pytest.raises(ValueError, match="no language-model head"):
        ours.predict(SHORT)
    reference_model = getattr(tf, model_class).from_pretrained(tmp_path, attn_implementation="eager").eval()
    base = reference_model if head_class is None else getattr(reference_model, "model", None) or reference_model.gpt_neox
    r = ours.attend(TEXT, truncate=True)
    with torch.no_grad():
        out = base(torch.tensor([[t.id for t in r.tokens]]), output_attentions=True)
    assert (r.attention - torch.stack([a[0] for a in out.attentions])).abs().max() <= 1e-5


def test_a_causal_lm_checkpoint_still_needs_its_head(tmp_path, bytelevel_tokenizer):
    """architectures says *ForCausalLM: a missing untied head is a broken file, not a base model."""
    save_random(tmp_path, bytelevel_tokenizer, "gpt_neox", 15, tie_word_embeddings=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    for key in [k for k in weights if k.endswith(("embed_out.weight", "lm_head.weight"))]:
        del weights[key]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing key 'embed_out.weight'"):
        load(tmp_path, device="cpu")


def test_a_gpt2_classifier_loads_its_attention(tmp_path, bytelevel_tokenizer):
    """GPT2ForSequenceClassification was refused: "unexpected key 'score.weight'"."""
    import transformers as tf

    tok_path, vocab = bytelevel_tokenizer
    torch.manual_seed(5)
    config = tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=48, n_layer=2, n_head=6, initializer_range=0.2,
                           num_labels=2, pad_token_id=0)
    tf.GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())
    ours = load(tmp_path, device="cpu")
    reference_model = tf.GPT2ForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    r = ours.attend(SHORT)
    with torch.no_grad():
        out = reference_model.transformer(torch.tensor([[t.id for t in r.tokens]]), output_attentions=True)
    assert (r.attention - torch.stack([a[0] for a in out.attentions])).abs().max() <= 1e-5


def test_rope_type_is_read_from_either_spelling_and_type_never_survives():
    """transformers 4.x wrote the kind as `type` or `rope_type`; `rope_type` wins where both are there."""
    for scaling, kind in (({"type": "linear", "factor": 2.0}, "linear"),
                          ({"type": "linear", "rope_type": "yarn", "factor": 2.0}, "yarn"),
                          ({"factor": 2.0}, "default")):
        params = rope_parameters({"rope_scaling": scaling})
        assert params["rope_type"] == kind and "type" not in params, (scaling, params)
