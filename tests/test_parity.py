"""Numerical parity with Hugging Face transformers (eager attention), the oracle for our weights."""

import json
import shutil

import pytest
import torch

from manyeyes.model import load

SENTENCES = [
    "The bank of the river.",
    "The bank was robbed, and the robbers fled across the river bank!",
    "Ünïcödé — naïve café, 東京, Straße; émigrés' «quotes»?",
    "Tokenization splits unbelievably long words: antidisestablishmentarianism.",
    "Numbers 3.14159, e-mail a.b@c.io, and URLs https://example.org/x?y=1 — all text.",
    "a",
]


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


def test_minilm_pair_matches_transformers(minilm, hf_minilm):
    ours = minilm.attend("Where is the bank?", "It is by the river.")
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
    for sentence in SENTENCES[:4]:
        r = ours.attend(sentence, truncate=True)
        ids = torch.tensor([[t.id for t in r.tokens]])
        with torch.no_grad():
            ref = ref_model(ids, output_attentions=True)
        assert (hf_attention(ref) - r.attention).abs().max().item() <= 1e-5
        assert (ref.last_hidden_state[0] - r.hidden).abs().max().item() <= 1e-4


def _save_gpt2(tmp_path, bytelevel_tokenizer, layers, heads, emb, *, tie=True, activation="gelu_new"):
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
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    shutil.copy(tok_path, tmp_path / "tokenizer.json")
    return GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()


@pytest.mark.parametrize("layers,heads,emb", [(2, 3, 24), (3, 5, 40)])
def test_random_gpt2_folder(tmp_path, bytelevel_tokenizer, layers, heads, emb):
    ref_model = _save_gpt2(tmp_path, bytelevel_tokenizer, layers, heads, emb)
    ours = load(tmp_path, device="cpu")
    assert ours.info.family == "gpt2" and ours.info.causal
    for sentence in SENTENCES[:4]:
        r = ours.attend(sentence, truncate=True)
        ids = torch.tensor([[t.id for t in r.tokens]])
        with torch.no_grad():
            ref = ref_model(ids, output_attentions=True, output_hidden_states=True)
        assert (hf_attention(ref) - r.attention).abs().max().item() <= 1e-5
        assert (ref.hidden_states[-1][0] - r.hidden).abs().max().item() <= 1e-4
        assert (ref.logits[0] - r.logits).abs().max().item() <= 1e-4


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
