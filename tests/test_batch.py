"""A padded batch gives every item exactly its single run."""

import torch

from manyeyes.model import load

TEXTS = [
    "Short.",
    "A somewhat longer sentence about river banks and money banks.",
    "Mid-length: attention, heads; and tokens!",
    "x",
]


def test_minilm_batch_equals_single_runs(minilm):
    batch = minilm.attend_batch(TEXTS)
    for text, item in zip(TEXTS, batch):
        single = minilm.attend(text)
        assert [t.id for t in item.tokens] == [t.id for t in single.tokens]
        assert item.attention.shape == single.attention.shape
        assert (item.attention - single.attention).abs().max() <= 1e-5
        assert (item.hidden - single.hidden).abs().max() <= 1e-4
        # An item's weights hold no more memory than themselves, never the whole batch's tensor.
        assert item.attention.untyped_storage().nbytes() == item.attention.nbytes


def test_gpt2_batch_equals_single_runs(tmp_path, bytelevel_tokenizer):
    import shutil

    from transformers import GPT2Config, GPT2Model

    tok_path, vocab = bytelevel_tokenizer
    torch.manual_seed(3)
    GPT2Model(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=30, n_layer=2, n_head=5)).save_pretrained(tmp_path)
    shutil.copy(tok_path, tmp_path / "tokenizer.json")
    m = load(tmp_path, device="cpu")
    for text, item in zip(TEXTS, m.attend_batch(TEXTS)):
        single = m.attend(text)
        assert (item.attention - single.attention).abs().max() <= 1e-5
        assert (item.logits - single.logits).abs().max() <= 1e-4
        upper = torch.triu(torch.ones_like(item.attention[0, 0], dtype=torch.bool), diagonal=1)
        assert torch.count_nonzero(item.attention[..., upper]) == 0
        assert (item.attention.sum(-1) - 1).abs().max() <= 1e-6
