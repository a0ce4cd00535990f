"""RoBERTa, DistilBERT and the masked-LM heads against transformers eager, on random configs whose
queries and keys are scaled up so attention is peaked (uniform attention would hide errors)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from manyeyes.model import ModelLoadError, load

TEXTS = [
    "The bank of the river.",
    "Attention heads look back, some look ahead; Café, naïve, 東京.",
    "a",
]
MASKED = "The quick [MASK] fox jumps over the [MASK] dog."


def sharpen(model, factor: float = 30.0) -> None:
    """Scale every query and key projection so each softmax row has a clear winner."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("query", "key", "q_lin", "k_lin"):
                module.weight.mul_(factor)


def peakedness(attentions) -> float:
    """Mean over all rows of the largest weight: 1/T when uniform, 1 when one-hot."""
    return torch.stack([a.amax(-1).mean() for a in attentions]).mean().item()


def save(model, folder: Path, tokenizer: Path, ref_cls):
    sharpen(model)
    model.save_pretrained(folder)
    shutil.copy(tokenizer, folder / "tokenizer.json")
    return ref_cls.from_pretrained(folder, attn_implementation="eager").eval()


def assert_parity(ours, ref, text: str, *, logits: bool = False) -> None:
    r = ours.attend(text, truncate=True)
    ids = torch.tensor([[t.id for t in r.tokens]])
    with torch.no_grad():
        out = ref(ids, output_attentions=True, output_hidden_states=True)
    assert len(r.tokens) == 1 or peakedness(out.attentions) > 0.6, "reference attention is not peaked"
    ref_attention = torch.stack([a[0] for a in out.attentions])
    assert (ref_attention - r.attention).abs().max().item() <= 1e-5
    assert (out.hidden_states[-1][0] - r.hidden).abs().max().item() <= 1e-4
    if logits:
        assert (out.logits[0] - r.logits).abs().max().item() <= 1e-4


@pytest.fixture(scope="session")
def roberta_tokenizer(tmp_path_factory) -> tuple[Path, int]:
    """Byte-level BPE with RoBERTa's specials in RoBERTa's order (<pad> is 1) and its post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Attention heads look back."] * 20, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True)
    path = tmp_path_factory.mktemp("roberta-tok") / "tokenizer.json"
    tok.save(str(path))
    assert tok.token_to_id("<pad>") == 1 and tok.token_to_id("<mask>") == 4
    return path, tok.get_vocab_size()


def roberta_config(vocab: int, heads: int, layers: int = 2):
    from transformers import RobertaConfig

    return RobertaConfig(vocab_size=vocab, hidden_size=8 * heads, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=24 * heads, max_position_embeddings=34, type_vocab_size=1,
                         pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)


@pytest.mark.parametrize("heads", [3, 5, 7])
def test_roberta_matches_transformers(tmp_path, roberta_tokenizer, heads):
    from transformers import RobertaModel

    tok, vocab = roberta_tokenizer
    torch.manual_seed(heads)
    ref = save(RobertaModel(roberta_config(vocab, heads), add_pooling_layer=True), tmp_path, tok, RobertaModel)
    ours = load(tmp_path, device="cpu")
    # 34 position rows, of which the first pad_token_id + 1 = 2 are never used by real tokens.
    assert (ours.info.family, ours.info.n_heads, ours.info.max_tokens, ours.info.predictions) == ("roberta", heads, 32, False)
    for text in TEXTS:
        assert_parity(ours, ref, text)
    long = ours.attend("the quick brown fox " * 40, truncate=True)
    assert len(long.tokens) == 32  # the longest input uses the last position row, 33
    assert_parity(ours, ref, "the quick brown fox " * 40)


def test_roberta_positions_come_from_the_ids(tmp_path, roberta_tokenizer):
    """A pad id inside the input keeps position pad_token_id and the count skips it, as in transformers."""
    from transformers import RobertaModel

    tok, vocab = roberta_tokenizer
    torch.manual_seed(0)
    ref = save(RobertaModel(roberta_config(vocab, 3), add_pooling_layer=False), tmp_path, tok, RobertaModel)
    ours = load(tmp_path, device="cpu")
    ids = torch.tensor([[0, 57, 1, 1, 88, 91, 2]])
    assert ours.net.positions(ids).tolist() == [[2, 3, 1, 1, 4, 5, 6]]
    with torch.no_grad():
        expected = ref(ids).last_hidden_state
        got = ours.net.inspect(ids).hidden
    assert (expected - got).abs().max().item() <= 1e-4
    # A padded batch (the runtime pads with id 0, which is <s> here) gives each row its own run.
    single = [ours.attend(t, truncate=True).attention for t in TEXTS]
    for alone, batched in zip(single, ours.attend_batch(TEXTS, truncate=True)):
        assert (alone - batched.attention).abs().max().item() <= 1e-6


@pytest.mark.parametrize("heads,sinusoidal", [(3, False), (5, True)])
def test_distilbert_matches_transformers(tmp_path, minilm_dir, heads, sinusoidal):
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(heads)
    config = DistilBertConfig(vocab_size=30522, dim=8 * heads, n_layers=2, n_heads=heads, hidden_dim=24 * heads,
                              max_position_embeddings=40, sinusoidal_pos_embds=sinusoidal)
    ref = save(DistilBertModel(config), tmp_path, minilm_dir / "tokenizer.json", DistilBertModel)
    ours = load(tmp_path, device="cpu")
    assert (ours.info.family, ours.info.n_heads, ours.info.max_tokens) == ("distilbert", heads, 40)
    assert ours.net.type_emb is None
    for text in TEXTS:
        assert_parity(ours, ref, text)
    # DistilBERT has no segments: a pair runs with the same embeddings whatever its type ids.
    pair = ours.attend("Where is it?", "On the bank.")
    assert {t.segment for t in pair.tokens} == {0, 1}
    with torch.no_grad():
        out = ref(torch.tensor([[t.id for t in pair.tokens]]), output_attentions=True)
    assert (torch.stack([a[0] for a in out.attentions]) - pair.attention).abs().max().item() <= 1e-5


def test_a_pair_on_a_one_segment_bert_reads_segment_row_0(tmp_path, minilm_dir):
    """type_vocab_size 1 has no row for a pair's second text: an IndexError traceback ("index out of
    range in self") from `manyeyes attend A --pair B`. Every token reads row 0, as RoBERTa's pairs do."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(4)
    config = BertConfig(vocab_size=30522, hidden_size=15, num_hidden_layers=2, num_attention_heads=3,
                        intermediate_size=30, max_position_embeddings=40, type_vocab_size=1)
    ref = save(BertModel(config), tmp_path, minilm_dir / "tokenizer.json", BertModel)
    pair = load(tmp_path, device="cpu").attend("Where is it?", "On the bank.")
    assert [t.segment for t in pair.tokens] == [0] * 6 + [1] * 5  # [CLS] where is it ? [SEP] | on the bank . [SEP]
    ids = torch.tensor([[t.id for t in pair.tokens]])
    with torch.no_grad():
        out = ref(ids, token_type_ids=torch.zeros_like(ids), output_attentions=True, output_hidden_states=True)
    assert peakedness(out.attentions) > 0.6
    assert (torch.stack([a[0] for a in out.attentions]) - pair.attention).abs().max().item() <= 1e-5
    assert (out.hidden_states[-1][0] - pair.hidden).abs().max().item() <= 1e-4


def test_distilbert_sinusoidal_table_is_derived_when_not_saved(tmp_path, minilm_dir):
    from safetensors.torch import load_file, save_file
    from transformers import DistilBertConfig, DistilBertModel

    from manyeyes.model.families.distilbert import sinusoids

    torch.manual_seed(1)
    config = DistilBertConfig(vocab_size=30522, dim=24, n_layers=1, n_heads=3, hidden_dim=48,
                              max_position_embeddings=40, sinusoidal_pos_embds=True)
    ref = save(DistilBertModel(config), tmp_path, minilm_dir / "tokenizer.json", DistilBertModel)
    table = ref.embeddings.position_embeddings.weight.detach()
    assert (sinusoids(40, 24) - table).abs().max().item() <= 1e-6
    weights = load_file(tmp_path / "model.safetensors")
    del weights["embeddings.position_embeddings.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    assert_parity(load(tmp_path, device="cpu"), ref, TEXTS[1])


# ----------------------------------------------------------------------------- masked-LM heads
def _mlm_bert(folder, minilm_dir, heads=5):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(11)
    config = BertConfig(vocab_size=30522, hidden_size=8 * heads, num_hidden_layers=2, num_attention_heads=heads,
                        intermediate_size=16 * heads, max_position_embeddings=40)
    return save(BertForMaskedLM(config), folder, minilm_dir / "tokenizer.json", BertForMaskedLM)


def _mlm_roberta(folder, tokenizer):
    from transformers import RobertaForMaskedLM

    tok, vocab = tokenizer
    torch.manual_seed(12)
    return save(RobertaForMaskedLM(roberta_config(vocab, 3)), folder, tok, RobertaForMaskedLM)


def _mlm_distilbert(folder, minilm_dir):
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(13)
    config = DistilBertConfig(vocab_size=30522, dim=21, n_layers=2, n_heads=7, hidden_dim=42, max_position_embeddings=40)
    return save(DistilBertForMaskedLM(config), folder, minilm_dir / "tokenizer.json", DistilBertForMaskedLM)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_masked_lm_logits_and_predictions_match_transformers(tmp_path, minilm_dir, roberta_tokenizer, family):
    if family == "bert":
        ref, text = _mlm_bert(tmp_path, minilm_dir), MASKED
    elif family == "roberta":
        ref, text = _mlm_roberta(tmp_path, roberta_tokenizer), MASKED.replace("[MASK]", "<mask>")
    else:
        ref, text = _mlm_distilbert(tmp_path, minilm_dir), MASKED
    ours = load(tmp_path, device="cpu")
    assert ours.info.family == family and ours.info.predictions
    assert_parity(ours, ref, text, logits=True)

    r = ours.attend(text)
    mask_positions = [i for i, t in enumerate(r.tokens) if t.text in ("[MASK]", "<mask>")]
    assert len(mask_positions) == 2
    predicted = ours.predict(text, top_k=5)
    assert list(predicted) == mask_positions  # masked-token predictions only where the masks are
    with torch.no_grad():
        probs = torch.softmax(ref(torch.tensor([[t.id for t in r.tokens]])).logits[0], -1)
    for pos, preds in predicted.items():
        best = probs[pos].topk(5)
        assert [p.id for p in preds] == best.indices.tolist()
        assert max(abs(p.prob - q) for p, q in zip(preds, best.values.tolist())) <= 1e-5
        assert preds[0].token == ours.tokenizer.token_text(preds[0].id)


def test_bert_without_a_head_makes_no_predictions(tmp_path, minilm_dir):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=30522, hidden_size=12, num_hidden_layers=1, num_attention_heads=3,
                         intermediate_size=24, max_position_embeddings=20)).save_pretrained(tmp_path)
    shutil.copy(minilm_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    m = load(tmp_path, device="cpu")
    assert not m.info.predictions and m.attend(MASKED).logits is None
    with pytest.raises(ValueError, match="has no language-model head"):
        m.predict(MASKED)


def test_tiny_gpt_predicts_the_top_of_its_own_logits():
    m = load("tiny-gpt", device="cpu")
    assert m.info.predictions and m.info.causal
    text = "In the beginning God created the heaven"
    predicted = m.predict(text, top_k=3)
    r = m.attend(text)
    assert list(predicted) == list(range(len(r.tokens)))  # next token after every position
    with torch.no_grad():
        logits = m.net(torch.tensor([[t.id for t in r.tokens]]))[0]  # the book's forward, separately
    probs = torch.softmax(logits, -1)
    for pos, preds in predicted.items():
        best = probs[pos].topk(3)
        assert [p.id for p in preds] == best.indices.tolist()
        assert max(abs(p.prob - q) for p, q in zip(preds, best.values.tolist())) <= 1e-6
    # A trained model: after "the heave" comes "n" (byte-level), the top guess.
    assert predicted[len(r.tokens) - 2][0].token == "n"
    with pytest.raises(ValueError, match="top_k must be in 1..20"):
        m.predict(text, top_k=21)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_bert_layout_decoder_is_refused_not_read_as_an_encoder(tmp_path, minilm_dir, roberta_tokenizer, family):
    """is_decoder makes transformers' BERT and RoBERTa causal; read as encoders their rows had
    weight on later tokens (0.9 off), with no word said."""
    import json

    if family == "bert":
        _mlm_bert(tmp_path, minilm_dir)
    else:
        _mlm_roberta(tmp_path, roberta_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"is_decoder": True}))
    with pytest.raises(ModelLoadError, match=f"is_decoder is true: a causal {family} is not supported"):
        load(tmp_path, device="cpu")


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_an_untied_masked_lm_head_needs_its_own_decoder_and_a_tied_one_reads_the_embeddings(
        tmp_path, minilm_dir, family):
    """Untied and without its decoder weight, the head predicted through the input embeddings
    (logits 1.4 off); tied, a saved decoder that differs is not read, as transformers 4 read it
    (transformers 5 warns and keeps the copy: the reference here is loaded before it is written)."""
    import json

    from safetensors.torch import load_file, save_file

    ref = _mlm_bert(tmp_path, minilm_dir) if family == "bert" else _mlm_distilbert(tmp_path, minilm_dir)
    decoder = "cls.predictions.decoder.weight" if family == "bert" else "vocab_projector.weight"
    weights = {name: tensor.clone() for name, tensor in load_file(tmp_path / "model.safetensors").items()}
    weights[decoder] = torch.randn_like(weights.get(decoder, ref.get_input_embeddings().weight.detach()))
    save_file(weights, tmp_path / "model.safetensors")
    assert_parity(load(tmp_path, device="cpu"), ref, MASKED, logits=True)  # tied: the saved copy is not read

    del weights[decoder]
    save_file(weights, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    with pytest.raises(ModelLoadError, match=f"missing key '{decoder}' \\(tie_word_embeddings is false\\)"):
        load(tmp_path, device="cpu")


def test_a_negative_pad_token_id_loads_as_transformers_reads_it(tmp_path, roberta_tokenizer):
    """pad_token_id -1 (common in configs) was refused; nn.Embedding counts it from the end."""
    import json

    _mlm_roberta(tmp_path, roberta_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"pad_token_id": -1}))
    from transformers import RobertaForMaskedLM

    ref = RobertaForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert_parity(load(tmp_path, device="cpu"), ref, MASKED.replace("[MASK]", "<mask>"), logits=True)


@pytest.mark.parametrize("pad", [-2, -100, 33, 200])
def test_a_pad_token_id_that_leaves_roberta_no_positions_is_refused_by_name(tmp_path, roberta_tokenizer, pad):
    """Positions run from pad_token_id + 1: -2 loaded and every forward was an IndexError, 33 (of 34
    positions) took 0 tokens, 200 was blamed on tokenizer.json."""
    import json

    _mlm_roberta(tmp_path, roberta_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"pad_token_id": pad}))
    with pytest.raises(ModelLoadError, match=rf"pad_token_id {pad} leaves RoBERTa no positions: .* must be in -1\.\.32$"):
        load(tmp_path, device="cpu")
