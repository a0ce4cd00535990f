"""A padded batch gives every item exactly its single run."""

import torch

from manyeyes.model import load
from manyeyes.model.runtime import padded_inputs

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


def test_a_batch_carries_each_inputs_ids_segments_and_padding(minilm):
    pair = minilm.encode("The bank.", "The river bank is muddy today.")
    short = minilm.encode("x")
    assert 1 in pair.type_ids  # the pair's second text is segment 1
    width, pad = len(pair), len(pair) - len(short)
    table = padded_inputs([pair, short], [len(pair), len(short)], width)
    assert table.dtype == torch.int64 and table.shape == (3, 2, width)
    assert table[0].tolist() == [pair.ids, short.ids + [0] * pad]
    assert table[1].tolist() == [pair.type_ids, short.type_ids + [0] * pad]
    assert table[2].tolist() == [[1] * width, [1] * len(short) + [0] * pad]
    # and the forward reads them: each item of the batch is its own run, segments included
    for item, encoded in zip(minilm.run([pair, short]), (pair, short)):
        (single,) = minilm.run([encoded])
        assert (item.attention - single.attention).abs().max() <= 1e-5


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


def calls_to(modules: dict[str, torch.nn.Module]):
    """name -> how many times the module ran, counted by forward hooks (removed by the caller)."""
    counts = dict.fromkeys(modules, 0)

    def counter(name):
        def hook(*_):
            counts[name] += 1

        return hook

    handles = [module.register_forward_hook(counter(name)) for name, module in modules.items()]
    return counts, handles


def last_block_parts(net) -> dict[str, torch.nn.Module]:
    last, first = net.trf_blocks[-1], net.trf_blocks[0]
    return {"last W_value": last.att.W_value, "last out_proj": last.att.out_proj, "last ff": last.ff,
            "first ff": first.ff, "last W_key": last.att.W_key}


def test_a_weights_only_run_stops_at_the_last_softmax_and_changes_no_weight(minilm):
    from manyeyes.model.attention import Capture

    encoded = [minilm.encode(text) for text in TEXTS]  # a padded batch
    full = minilm.run(encoded)
    counts, handles = calls_to(last_block_parts(minilm.net))
    try:
        lean = minilm.run(encoded, Capture(hidden=False))
    finally:
        for handle in handles:
            handle.remove()
    for a, b in zip(full, lean):
        assert torch.equal(a.attention, b.attention)  # the same float ops up to every softmax
        assert b.hidden is None
    assert counts == {"last W_value": 0, "last out_proj": 0, "last ff": 0, "first ff": 1, "last W_key": 1}


def test_a_model_with_predictions_keeps_its_whole_forward_when_asked_for_weights_only():
    from manyeyes.model.attention import WEIGHTS_ONLY

    gpt = load("tiny-gpt", device="cpu")
    encoded = [gpt.encode(text) for text in TEXTS]
    full, lean = gpt.run(encoded), gpt.run(encoded, WEIGHTS_ONLY)
    for a, b in zip(full, lean):
        assert torch.equal(a.attention, b.attention)
        # The same top-k: the forward ran whole, though neither hidden state nor logits is handed back.
        assert torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_probs, b.top_probs)
        assert a.hidden is not None and a.logits is not None
        assert b.hidden is None and b.logits is None
    # Nor does the batch's output carry them to the host (the server's forwards read it directly).
    from manyeyes.model.runtime import padded_inputs

    lengths = [len(e) for e in encoded]
    out = gpt.forward_table(padded_inputs(encoded, lengths, max(lengths)), lengths, WEIGHTS_ONLY)
    assert out.hidden is None and out.logits is None and out.top_ids is not None


def test_each_batch_result_owns_its_storage_and_only_what_was_asked_for():
    """A batch result's hidden state and logits were views of the whole batch's: one 8-token
    result of 50 pickled to 6.8 MB (20 KB alone), and keeping it kept the batch alive."""
    import pickle

    from manyeyes.model.attention import Capture

    gpt = load("tiny-gpt", device="cpu")
    results = gpt.attend_batch(TEXTS, capture=Capture(qkv=True))
    for result in results:
        tensors = [result.attention, result.hidden, result.logits, result.top_ids, result.top_probs,
                   *result.queries, *result.keys, *result.values]
        for tensor in tensors:
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    alone = gpt.attend(TEXTS[0], capture=Capture(qkv=True))
    assert len(pickle.dumps(results[0])) < 1.2 * len(pickle.dumps(alone))
    lean = gpt.attend_batch(TEXTS, capture=Capture(logits=False))
    assert all(r.logits is None and r.top_ids is not None for r in lean)
    assert all(r.hidden is None for r in gpt.attend_batch(TEXTS, capture=Capture(hidden=False)))


def test_every_family_network_stops_at_the_last_softmax_with_the_same_weights():
    from manyeyes.model.attention import Capture

    for name in ("tiny-gpt", "tiny-llama"):  # the book's GPTModel and the rotary decoder
        net = load(name, device="cpu").net
        ids = torch.randint(0, 200, (2, 23))
        real = torch.ones(2, 23, dtype=torch.bool)
        real[1, 17:] = False
        with torch.inference_mode():
            full = net.inspect(ids, real)
            counts, handles = calls_to(last_block_parts(net))
            try:
                lean = net.inspect(ids, real, Capture(hidden=False))
            finally:
                for handle in handles:
                    handle.remove()
        assert lean.hidden is None and lean.logits is None and lean.layers[-1].context is None, name
        for a, b in zip(full.layers, lean.layers):
            assert torch.equal(a.weights, b.weights), name
        assert counts == {"last W_value": 0, "last out_proj": 0, "last ff": 0, "first ff": 1, "last W_key": 1}, name


def rows_into_feed_forwards(model, texts: list[str]) -> tuple[list[int], list]:
    """Rows each block's feed-forward received during one padded batch, and the batch's results."""
    seen: list[int] = []
    handles = [block.ff.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
               for block in model.net.trf_blocks]
    try:
        results = model.attend_batch(texts)
    finally:
        for handle in handles:
            handle.remove()
    return seen, results


def test_feed_forwards_skip_the_padding(minilm):
    """Each family's feed-forward runs on the real tokens only (model/layers.real_tokens_only),
    and the batch still equals its single runs."""
    for model in (minilm, load("tiny-gpt"), load("tiny-llama")):
        seen, results = rows_into_feed_forwards(model, TEXTS)
        lengths = [len(item.tokens) for item in results]
        assert min(lengths) < max(lengths)  # the batch is padded
        # BERT's last block stops at its softmax when the hidden state is not asked for; here it is.
        assert seen and set(seen) == {sum(lengths)}, (seen, lengths)
        for text, item in zip(TEXTS, results):
            single = model.attend(text)
            assert (item.attention - single.attention).abs().max() <= 1e-5


def test_off_the_cpu_feed_forwards_take_every_row(minilm, monkeypatch):
    """Where picking the real rows out would wait for the device (a GPU: layers.skips_padding),
    the feed-forwards run on the padding too, and the batch still equals its single runs: the
    GPU's branch, run on the CPU."""
    from manyeyes.model import layers

    monkeypatch.setattr(layers, "skips_padding", lambda device: False)
    for model in (minilm, load("tiny-gpt"), load("tiny-llama")):
        seen, results = rows_into_feed_forwards(model, TEXTS)
        lengths = [len(item.tokens) for item in results]
        assert min(lengths) < max(lengths)
        assert seen and set(seen) == {len(TEXTS) * max(lengths)}, (seen, lengths)
        for text, item in zip(TEXTS, results):
            single = model.attend(text)
            assert (item.attention - single.attention).abs().max() <= 1e-5
