"""Weights in the dtype asked for (or stored, on CUDA); the softmax and returned weights stay float32."""

from __future__ import annotations

import shutil

import pytest
import torch

from manyeyes.model import ModelLoadError, load
from manyeyes.model.loading import compute_dtype

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def gpt2_bf16_folder(tmp_path_factory, bytelevel_tokenizer):
    """A random GPT-2 saved in bfloat16, as most current checkpoints are stored."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("bf16")
    tok, vocab = bytelevel_tokenizer
    torch.manual_seed(5)
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=24, n_layer=2, n_head=3)).to(
        torch.bfloat16).save_pretrained(folder)
    shutil.copy(tok, folder / "tokenizer.json")
    return folder


def test_dtype_policy():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype(None, cuda, torch.bfloat16) == torch.bfloat16  # stored dtype on CUDA
    assert compute_dtype("auto", cuda, torch.float16) == torch.float16
    assert compute_dtype(None, cuda, torch.float32) == torch.float32
    assert compute_dtype(None, cpu, torch.bfloat16) == torch.float32  # widened on the CPU
    assert compute_dtype("bfloat16", cpu, torch.float32) == torch.bfloat16  # asked for wins
    assert compute_dtype(torch.float16, cpu, torch.float32) == torch.float16
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'; choose auto, float32, bfloat16, float16"):
        compute_dtype("int8", cpu, torch.float32)


def test_bf16_checkpoint_loads_as_float32_on_cpu_by_default(gpt2_bf16_folder):
    m = load(gpt2_bf16_folder, device="cpu")
    assert m.info.dtype == "float32" and all(p.dtype == torch.float32 for p in m.net.parameters())


@pytest.mark.parametrize("spec", ["gpt2_bf16_folder", "minilm"])
def test_bfloat16_runs_on_cpu_and_returns_float32_weights(spec, request):
    spec = request.getfixturevalue(spec) if spec != "minilm" else spec
    wide, narrow = load(spec, device="cpu"), load(spec, device="cpu", dtype="bfloat16")
    assert narrow.info.dtype == "bfloat16"
    assert {p.dtype for p in narrow.net.parameters()} == {torch.bfloat16}
    # Buffers (the book's causal mask) are not narrowed.
    assert all(b.dtype != torch.bfloat16 for b in narrow.net.buffers())
    a, b = wide.attend(TEXT), narrow.attend(TEXT)
    assert b.attention.dtype == torch.float32 and b.hidden.dtype == torch.float32
    assert torch.allclose(b.attention.sum(-1), torch.ones(()), atol=1e-5)  # normalised in float32
    # bfloat16 has 8 bits of mantissa: close to the float32 run, not equal to it.
    assert 0 < (a.attention - b.attention).abs().max().item() < 0.1
    if wide.info.predictions:
        assert b.logits.dtype == torch.float32 and b.top_probs.dtype == torch.float32
        assert narrow.predict(TEXT, top_k=1)[0][0].id == wide.predict(TEXT, top_k=1)[0][0].id


def test_book_checkpoint_in_float16():
    m = load("tiny-gpt", device="cpu", dtype="float16")
    assert m.info.dtype == "float16" and m.attend(TEXT).attention.dtype == torch.float32


def test_llama_from_a_cached_id_in_bfloat16(tmp_path, monkeypatch, bytelevel_tokenizer):
    """A grouped-query llama saved in bfloat16 under an id: CPU default widens it, bfloat16 on
    request narrows parameters only (the rotary tables stay float32), attention stays float32."""
    from huggingface_hub import constants
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.hub_cache import add_to_cache

    tok, vocab = bytelevel_tokenizer
    folder, cache = tmp_path / "smol", tmp_path / "cache"
    torch.manual_seed(9)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                 num_key_value_heads=2, intermediate_size=80, max_position_embeddings=64)).to(
        torch.bfloat16).save_pretrained(folder)
    shutil.copy(tok, folder / "tokenizer.json")
    add_to_cache(cache, "HuggingFaceTB/SmolLM2-135M", folder)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    wide = load("HuggingFaceTB/SmolLM2-135M", device="cpu", name="smol")
    assert (wide.info.family, wide.info.n_heads, wide.info.n_kv_heads, wide.info.dtype) == ("llama", 6, 2, "float32")
    narrow = load("HuggingFaceTB/SmolLM2-135M", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in narrow.net.parameters()} == {torch.bfloat16}
    assert all(b.dtype != torch.bfloat16 for b in narrow.net.buffers())
    a, b = wide.attend(TEXT), narrow.attend(TEXT)
    assert b.attention.dtype == torch.float32 and a.attention.shape == b.attention.shape
    assert 0 < (a.attention - b.attention).abs().max().item() < 0.1
    assert list(narrow.predict(TEXT, top_k=2)) == list(range(len(b.tokens)))
