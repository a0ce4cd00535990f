"""Numerical parity with Hugging Face transformers (eager attention), the oracle for our weights."""

import shutil

import pytest
import torch

from manyeyes.model import ModelLoadError, load

SENTENCES = [
    "The bank of the river.",
    "The bank was robbed, and the robbers fled across the river bank!",
    "Ünïcödé — naïve café, 東京, Straße; émigrés' «quotes»?",
    "Tokenization splits unbelievably long words: antidisestablishmentarianism.",
    "Numbers 3.14159, e-mail a.b@c.io, and URLs https://example.org/x?y=1 — all text.",
    "a",
]
# A long paste: far past every model's positions, so `truncate` cuts it to the model's limit and
# every learned position (MiniLM's 512, the random configs' 48 and 64) takes part.
PASTE = " ".join(SENTENCES[:5] * 30)


def hf_attention(outputs) -> torch.Tensor:
    return torch.stack([a[0] for a in outputs.attentions])  # (L, H, T, T)


@pytest.fixture(scope="module")
def hf_minilm(minilm_dir):
    from transformers import BertModel

    return BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()


@pytest.mark.parametrize("sentence", SENTENCES)
def test_minilm_matches_transformers(minilm, hf_minilm, sentence):
    ours = minilm.attend(sentence)
    ids = torch.tensor([[t.id for t in ours.tokens]])
    with torch.no_grad():
        ref = hf_minilm(ids, output_attentions=True)
    assert ours.attention.shape == (6, 12, len(ours.tokens), len(ours.tokens))
    assert (hf_attention(ref) - ours.attention).abs().max().item() <= 1e-5
    assert (ref.last_hidden_state[0] - ours.hidden).abs().max().item() <= 1e-4


def test_minilm_at_its_full_512_positions_matches_transformers(minilm, hf_minilm):
    """A truncated paste fills every position: a position table read wrongly past some index shows here."""
    ours = minilm.attend(PASTE, truncate=True)
    assert ours.truncated and len(ours.tokens) == minilm.info.max_tokens == 512
    ids = torch.tensor([[t.id for t in ours.tokens]])
    with torch.no_grad():
        ref = hf_minilm(ids, output_attentions=True)
    assert (hf_attention(ref) - ours.attention).abs().max().item() <= 1e-5
    assert (ref.last_hidden_state[0] - ours.hidden).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "text, pair",
    [
        ("Where is the bank?", "It is by the river."),
        # Each half alone is longer than the short sentences above, together well over 100 positions.
        (" ".join(SENTENCES[:3] * 2), " ".join(SENTENCES[3:5] * 2)),
    ],
)
def test_minilm_pair_matches_transformers(minilm, hf_minilm, text, pair):
    ours = minilm.attend(text, pair)
    ids = torch.tensor([[t.id for t in ours.tokens]])
    types = torch.tensor([[t.segment for t in ours.tokens]])
    assert types.sum() > 0, "second sentence must be segment 1"
    with torch.no_grad():
        ref = hf_minilm(ids, token_type_ids=types, output_attentions=True)
    assert (hf_attention(ref) - ours.attention).abs().max().item() <= 1e-5
    assert (ref.last_hidden_state[0] - ours.hidden).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layers,heads,hidden", [(2, 3, 36), (3, 5, 40), (1, 7, 28)])
def test_random_bert_folder(tmp_path, minilm_dir, layers, heads, hidden):
    from transformers import BertConfig, BertModel

    torch.manual_seed(layers * 10 + heads)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=3 * hidden,
        max_position_embeddings=64,
        layer_norm_eps=1e-7,
    )
    BertModel(config, add_pooling_layer=True).save_pretrained(tmp_path)
    ref_model = BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    shutil.copy(minilm_dir / "tokenizer.json", tmp_path / "tokenizer.json")

    ours = load(tmp_path, device="cpu")
    assert (ours.info.n_layers, ours.info.n_heads, ours.info.max_tokens) == (layers, heads, 64)
    for sentence in [*SENTENCES[:4], PASTE]:
        r = ours.attend(sentence, truncate=True)
        assert sentence != PASTE or len(r.tokens) == 64  # the paste reaches the last position
        ids = torch.tensor([[t.id for t in r.tokens]])
        with torch.no_grad():
            ref = ref_model(ids, output_attentions=True)
        assert (hf_attention(ref) - r.attention).abs().max().item() <= 1e-5
        assert (ref.last_hidden_state[0] - r.hidden).abs().max().item() <= 1e-4


def _save_gpt2(tmp_path, bytelevel_tokenizer, layers, heads, emb, *, tie=True, activation="gelu_new", sharpen=False):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok_path, vocab = bytelevel_tokenizer
    torch.manual_seed(layers * 100 + heads)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=48,
        n_embd=emb,
        n_layer=layers,
        n_head=heads,
        activation_function=activation,
        tie_word_embeddings=tie,
    )
    model = GPT2LMHeadModel(config)
    if sharpen:
        _sharpen(model)
    model.save_pretrained(tmp_path)
    shutil.copy(tok_path, tmp_path / "tokenizer.json")
    return GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()


def _sharpen(model) -> None:
    """Scale a random init until it behaves like a trained model where parity has power.

    At init (std 0.02) attention is within ~0.01 of uniform and the MLP's inputs sit near 0, where
    the tanh and erf forms of GELU agree to 1e-6: parity then passes whichever form is used. Larger
    query/key weights peak the attention; larger MLP weights push pre-activations to |x| ~ 2-3,
    where the two forms differ most (5e-4); larger embeddings make the logits O(1).
    """
    emb = model.config.n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, : 2 * emb].mul_(20.0)  # queries and keys, not values
            block.mlp.c_fc.weight.mul_(8.0)
            block.mlp.c_proj.weight.mul_(6.0)
        model.transformer.wte.weight.mul_(10.0)


def _gpt2_reference(ref_model, ids, activation=None):
    """The reference's outputs; `activation` swaps in another GELU form to measure what parity can see."""
    from transformers.activations import ACT2FN

    saved = [block.mlp.act for block in ref_model.transformer.h]
    if activation is not None:
        for block in ref_model.transformer.h:
            block.mlp.act = ACT2FN[activation]
    try:
        with torch.no_grad():
            return ref_model(ids, output_attentions=True, output_hidden_states=True)
    finally:
        for block, act in zip(ref_model.transformer.h, saved):
            block.mlp.act = act


def _assert_gpt2_parity(ref, r):
    assert (hf_attention(ref) - r.attention).abs().max().item() <= 1e-5
    assert (ref.hidden_states[-1][0] - r.hidden).abs().max().item() <= 1e-4
    assert (ref.logits[0] - r.logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layers,heads,emb", [(2, 3, 24), (3, 5, 40)])
def test_random_gpt2_folder(tmp_path, bytelevel_tokenizer, layers, heads, emb):
    ref_model = _save_gpt2(tmp_path, bytelevel_tokenizer, layers, heads, emb)
    ours = load(tmp_path, device="cpu")
    assert ours.info.family == "gpt2" and ours.info.causal
    for sentence in [*SENTENCES[:4], PASTE]:
        r = ours.attend(sentence, truncate=True)
        assert sentence != PASTE or len(r.tokens) == 48  # the paste reaches the last position
        _assert_gpt2_parity(_gpt2_reference(ref_model, torch.tensor([[t.id for t in r.tokens]])), r)


@pytest.mark.parametrize("activation, wrong", [("gelu_new", "gelu"), ("gelu", "gelu_new"), ("gelu_pytorch_tanh", "gelu")])
def test_sharpened_gpt2_parity_tells_the_gelu_forms_apart(tmp_path, bytelevel_tokenizer, activation, wrong):
    """Peaked attention and large activations, so parity at 1e-5/1e-4 would fail with the other GELU."""
    ref_model = _save_gpt2(tmp_path, bytelevel_tokenizer, 3, 4, 48, activation=activation, sharpen=True)
    ours = load(tmp_path, device="cpu")
    for sentence in [SENTENCES[1], SENTENCES[3], PASTE]:
        r = ours.attend(sentence, truncate=True)
        ids = torch.tensor([[t.id for t in r.tokens]])
        ref = _gpt2_reference(ref_model, ids)
        # The reference is what a trained model looks like: most queries put most weight on one key
        # (uniform would give query i 1/(i+1), at most 0.2 from the fifth token on).
        att = hf_attention(ref)  # (L, H, T, T)
        assert att.max(-1).values[:, :, 4:].mean().item() > 0.5
        # And the check has power: the wrong GELU form moves every output far beyond the tolerance.
        other = _gpt2_reference(ref_model, ids, activation=wrong)
        assert (hf_attention(other) - att).abs().max().item() > 20 * 1e-5
        assert (other.hidden_states[-1][0] - ref.hidden_states[-1][0]).abs().max().item() > 4 * 1e-4
        assert (other.logits[0] - ref.logits[0]).abs().max().item() > 5 * 1e-4
        _assert_gpt2_parity(ref, r)


def test_gpt2_untied_head_and_pytorch_bin(tmp_path, bytelevel_tokenizer):
    """An untied lm_head must be used as saved, and the legacy .bin format must load too."""
    ref_model = _save_gpt2(tmp_path, bytelevel_tokenizer, 2, 3, 24, tie=False)
    with torch.no_grad():
        ref_model.lm_head.weight.add_(0.5)  # make untying observable
    (tmp_path / "model.safetensors").unlink()
    torch.save({f"transformer.{k}": v for k, v in ref_model.transformer.state_dict().items()}
               | {"lm_head.weight": ref_model.lm_head.weight}, tmp_path / "pytorch_model.bin")
    r = load(tmp_path, device="cpu").attend("The quick brown fox.")
    ids = torch.tensor([[t.id for t in r.tokens]])
    with torch.no_grad():
        ref = ref_model(ids)
    assert (ref.logits[0] - r.logits).abs().max().item() <= 1e-4


def test_gpt2_untied_checkpoint_without_its_head_is_refused(tmp_path, bytelevel_tokenizer):
    """tie_word_embeddings false and no lm_head.weight: the head used to be wte, predicting silently
    wrong; the llama family already names the missing key."""
    from safetensors.torch import load_file, save_file

    _save_gpt2(tmp_path, bytelevel_tokenizer, 1, 3, 24, tie=False)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: missing key 'lm_head\.weight' \(tie_word_embeddings is false\)"):
        load(tmp_path, device="cpu")


def test_an_untied_gpt2_base_model_loads_with_no_head(tmp_path, bytelevel_tokenizer):
    """GPT2Model saved untied has no lm_head.weight: it predicted through wte (each position's top
    token itself), where an untied llama or gpt_neox base model loads with no head."""
    from tests.conftest import save_random_gpt2

    ref_model = save_random_gpt2(tmp_path, bytelevel_tokenizer, 2, lm_head=False, n_embd=24, n_layer=2, n_head=3,
                                 tie_word_embeddings=False)
    ours = load(tmp_path, device="cpu")
    assert not ours.info.predictions and ours.net.out_head is None
    r = ours.attend(SENTENCES[1])
    assert r.logits is None
    with pytest.raises(ValueError, match="no language-model head"):
        ours.predict(SENTENCES[1])
    with torch.no_grad():
        ref = ref_model(torch.tensor([[t.id for t in r.tokens]]), output_attentions=True)
    assert (hf_attention(ref) - r.attention).abs().max().item() <= 1e-5


def test_legacy_bert_keys(tmp_path, minilm_dir, minilm):
    """TF-era `LayerNorm.gamma/beta` names and the `bert.` prefix map to the same model."""
    from safetensors.torch import load_file

    state = load_file(str(minilm_dir / "model.safetensors"))
    legacy = {
        "bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in state.items()
    }
    legacy["cls.predictions.bias"] = torch.zeros(3)
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    a = load(tmp_path, device="cpu").attend("The bank of the river.")
    b = minilm.attend("The bank of the river.")
    assert torch.equal(a.attention, b.attention)
