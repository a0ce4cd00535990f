"""Measures beyond raw weights, each checked against an independent computation from transformers."""

import math

import pytest
import torch

from manyeyes.model import Capture, load
from manyeyes.model.measures import (
    PROBE_LENGTH,
    capture_stream,
    contributions,
    fixed_offset_share,
    head_stats,
    head_table,
    induction_scores,
    information_flow,
    logit_attribution,
    merge_words,
    neuron_view,
    out_proj_gram,
    rollout,
    tag_heads,
)
from manyeyes.model.row_sums import row_sums
from manyeyes.model.tokenizer import Encoded, Token
from tests.conftest import save_random_gpt2

SENTENCE = "The bank was robbed, and the robbers fled across the river bank!"


@pytest.fixture(scope="module")
def hf_minilm(minilm_dir):
    from transformers import BertModel

    return BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt", device="cpu")


def reference_rollout(attentions) -> torch.Tensor:
    """Abnar & Zuidema's recipe written out from transformers' attentions, in float64 numpy-style loops."""
    n_tokens = attentions[0].shape[-1]
    joint = torch.eye(n_tokens, dtype=torch.float64)
    for layer in attentions:
        a = layer[0].double().mean(0)
        a = a + torch.eye(n_tokens, dtype=torch.float64)
        a = a / a.sum(-1, keepdim=True)
        joint = a @ joint
    return joint


def test_rollout_matches_transformers_attentions(minilm, hf_minilm):
    r = minilm.attend(SENTENCE)
    with torch.no_grad():
        ref = hf_minilm(torch.tensor([[t.id for t in r.tokens]]), output_attentions=True)
    ours = rollout(r.attention)
    assert (ours.double() - reference_rollout(ref.attentions)).abs().max().item() <= 1e-5
    assert torch.allclose(ours.sum(-1), torch.ones(len(r.tokens)), atol=1e-5)


def test_rollout_of_a_causal_model_never_looks_ahead(tiny):
    flow = rollout(tiny.attend("In the beginning God created the heaven.").attention)
    assert torch.equal(flow.triu(1), torch.zeros_like(flow))
    assert torch.allclose(flow.sum(-1), torch.ones(flow.shape[0]), atol=1e-5)


def context_inputs(hf_layers, attr_path):
    """Hooks that keep what each layer's output projection receives: the heads, concatenated."""
    seen = {}
    hooks = []
    for i, layer in enumerate(hf_layers):
        module = layer
        for part in attr_path:
            module = getattr(module, part)
        hooks.append(module.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0][0].detach())))
    return seen, hooks


def check_contributions(model, result, seen, dense_weights, n_heads, head_dim):
    """Both ways to the contributions: from the values (mixed again) and from the captured
    stream (out_proj's own input and output), each against transformers' context vectors."""
    stream = capture_stream(model, Encoded(result.tokens, [0] * len(result.tokens), False))
    both = [contributions(model, result), contributions(model, stream.result, stream.mixed, stream.outputs)]
    for ours in both:
        for layer, w_o in enumerate(dense_weights):
            context = seen[layer]  # (T, n_heads * head_dim) from transformers
            for head in range(n_heads):
                part = context[:, head * head_dim : (head + 1) * head_dim] @ w_o[:, head * head_dim : (head + 1) * head_dim].T
                assert (ours.norms[layer, head] - part.norm(dim=-1)).abs().max().item() <= 1e-5 * max(1.0, part.norm().item())
        total = ours.shares.sum(1) + ours.bias_shares
        assert torch.allclose(total, torch.ones_like(total), atol=1e-4)
    assert torch.allclose(both[0].shares, both[1].shares, atol=1e-5)
    assert torch.allclose(both[0].bias_shares, both[1].bias_shares, atol=1e-5)
    return both[0]


def test_out_proj_gram_is_kept_until_the_weight_changes(minilm):
    out_proj = minilm.net.trf_blocks[0].att.out_proj
    first = out_proj_gram(out_proj, 12)
    assert out_proj_gram(out_proj, 12) is first
    saved = out_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            out_proj.weight.mul_(2)
        assert torch.allclose(out_proj_gram(out_proj, 12), 4 * first, rtol=1e-5)
    finally:
        with torch.no_grad():
            out_proj.weight.copy_(saved)
    assert torch.allclose(out_proj_gram(out_proj, 12), first)


def test_head_contributions_match_transformers_minilm(minilm, hf_minilm):
    r = minilm.attend(SENTENCE, capture=Capture(qkv=True))
    seen, hooks = context_inputs(hf_minilm.encoder.layer, ("attention", "output", "dense"))
    try:
        with torch.no_grad():
            hf_minilm(torch.tensor([[t.id for t in r.tokens]]))
    finally:
        for h in hooks:
            h.remove()
    weights = [layer.attention.output.dense.weight.detach() for layer in hf_minilm.encoder.layer]
    check_contributions(minilm, r, seen, weights, 12, 32)


def test_head_contributions_match_transformers_gpt2(tmp_path, bytelevel_tokenizer):
    hf = save_random_gpt2(tmp_path, bytelevel_tokenizer, 3, lm_head=False, n_embd=40, n_layer=2, n_head=5)
    ours = load(tmp_path, device="cpu")
    r = ours.attend("Attention heads look back, some look ahead.", capture=Capture(qkv=True))
    seen, hooks = context_inputs(hf.h, ("attn", "c_proj"))
    try:
        with torch.no_grad():
            hf(torch.tensor([[t.id for t in r.tokens]]))
    finally:
        for h in hooks:
            h.remove()
    # Conv1D stores (in, out): its Linear-layout weight is the transpose.
    weights = [block.attn.c_proj.weight.detach().T for block in hf.h]
    check_contributions(ours, r, seen, weights, 5, 8)


def test_contributions_need_values(minilm):
    with pytest.raises(ValueError, match=r"Capture\(qkv=True\)"):
        contributions(minilm, minilm.attend("hi"))


def test_tiny_gpt_tags_name_its_known_heads(tiny):
    text = (
        "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
        "conceived in Liberty, and dedicated to the proposition that all men are created equal."
    )
    stats, tags = head_table(tiny, tiny.attend(text))
    assert "previous-token" in tags[0][3], tags[0]
    assert "induction" in tags[1][0], (tags[1], stats["induction"][1])
    # Tags are specific: the induction head is the only one in layer 1 over the threshold.
    assert sum("induction" in t for t in tags[1]) == 1
    assert not any("induction" in t for t in tags[0])


def test_induction_probe_runs_once_per_model(tiny):
    first = induction_scores(tiny)
    assert induction_scores(tiny) is first


def test_induction_probe_fits_a_short_context(tmp_path, bytelevel_tokenizer):
    """Both copies of the probe must fit the model's positions (a 64-position GPT-2 raised IndexError: a 500)."""
    save_random_gpt2(tmp_path, bytelevel_tokenizer, 3, n_layer=1, n_head=2, n_embd=16)  # 64 positions
    model = load(tmp_path, device="cpu")
    assert model.info.max_tokens == 64 < 2 * PROBE_LENGTH
    scores = induction_scores(model)
    assert scores.shape == (1, 2) and torch.isfinite(scores).all() and (scores > 0).all()
    assert induction_scores(model) is scores  # kept under the length asked for, not the shortened one


def test_stats_from_hand_built_heads():
    from manyeyes.model.tokenizer import Token

    n = 6
    tokens = [Token(w, i, 0, 0, i == 0, 0, w) for i, w in enumerate(["[CLS]", "a", ",", "b", "a", "[SEP]"])]
    tokens[-1] = Token("[SEP]", 99, 0, 0, True, 0, "[SEP]")
    tokens[4] = Token("a", 1, 0, 0, False, 0, "a")  # a repeat of token 1
    prev = torch.zeros(n, n)
    prev[0, 0] = 1
    for i in range(1, n):
        prev[i, i - 1] = 1
    uniform = torch.full((n, n), 1 / n)
    att = torch.stack([prev, uniform])[None]  # (1 layer, 2 heads, T, T), bidirectional
    stats = head_stats(att, tokens, causal=False)
    assert stats["previous"][0, 0] == pytest.approx(1.0)
    assert stats["entropy"][0, 0] == pytest.approx(0.0, abs=1e-6)
    assert stats["entropy"][0, 1] == pytest.approx(1.0, abs=1e-6)
    assert stats["distance"][0, 0] == pytest.approx((0 + 5 * 1) / 6)
    # uniform: 1/6 on each of "," and [SEP]
    assert stats["delimiter"][0, 1] == pytest.approx(2 / 6)
    assert stats["duplicate"][0, 1] == pytest.approx(1 / 6)  # row 4 looks at 1 with 1/6
    causal_uniform = torch.tril(torch.ones(n, n))
    causal_uniform = (causal_uniform / causal_uniform.sum(-1, keepdim=True))[None, None]
    causal_stats = head_stats(causal_uniform, tokens, causal=True)
    # row i spreads evenly over 0..i: mean distance i/2 and entropy 1, over the rows 1..n-1
    assert causal_stats["distance"][0, 0] == pytest.approx(sum(i / 2 for i in range(1, n)) / (n - 1))
    assert causal_stats["entropy"][0, 0] == pytest.approx(1.0, abs=1e-6)


def reference_stats(att: torch.Tensor, tokens, causal: bool, reach: int | None = None) -> dict[str, torch.Tensor]:
    """head_stats' definitions written out plainly in float64, row by row of every head; `reach`,
    a sliding window every layer of `att` has (a row sees its last `reach` positions)."""
    from manyeyes.model.measures import _is_delimiter

    att = att.double()
    n = att.shape[-1]
    reach = reach or n
    delimiter = torch.tensor([float((t.special and k > 0) or _is_delimiter(t)) for k, t in enumerate(tokens)], dtype=torch.float64)
    out = {name: torch.zeros(att.shape[:2], dtype=torch.float64) for name in ("entropy", "distance", "delimiter", "duplicate")}
    seen = [(i + 1 if causal else n) - max(0, i - reach + 1) for i in range(n)]
    rows = [i for i in range(n) if seen[i] > 1]
    copies = [i for i in range(n) if any(tokens[j].id == tokens[i].id for j in range(max(0, i - reach + 1), i))]
    for i in rows:
        p = att[:, :, i]  # (L, H, T)
        out["entropy"] += -torch.special.xlogy(p, p).sum(-1) / math.log(seen[i]) / len(rows)
        out["distance"] += (p * (torch.arange(n) - i).abs()).sum(-1) / len(rows)
        out["delimiter"] += (p * delimiter).sum(-1) / len(rows)
    for i in copies:
        earlier = torch.tensor([float(j < i and tokens[j].id == tokens[i].id) for j in range(n)], dtype=torch.float64)
        out["duplicate"] += (att[:, :, i] * earlier).sum(-1) / len(copies)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_row_sums_match_float64_down_to_zeros_and_subnormals(causal):
    """The compiled pass (its own log from the float's bits) against xlogy and plain sums in float64,
    and its argmax against numpy's."""
    n = 37  # not a multiple of any vector width: the loop's tail is exercised too
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(5, n, n, generator=generator) * torch.tensor([0.1, 1.0, 5.0, 30.0, 80.0])[:, None, None]
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(scores, -1)
    weights[4, 3] = 0.0
    weights[4, 3, 1] = 1.0  # one-hot: entropy exactly 0
    weights[4, 5, :2] = torch.tensor([1e-40, 1e-39])  # subnormals (and the row's zeros past them)
    weights[4, 6] = 0.0
    weights[4, 6, :7] = 1 / 7  # ties: the first maximum, as numpy's argmax
    assert (weights == 0).any() and (weights[4, 5, :2] < torch.finfo(torch.float32).tiny).all()
    copies = (torch.rand(n, n, generator=generator) < 0.2).float()
    delimiters = (torch.rand(n, generator=generator) < 0.3).float()
    if causal:  # the pass reads a causal row only up to its query; the oracle sees the whole row
        copies = copies.tril()
    sums, argmax = row_sums(weights.numpy(), copies.numpy(), delimiters.numpy(), causal)
    assert (argmax == weights.numpy().argmax(-1)).all() and argmax[4, 6] == 0
    sums = torch.from_numpy(sums).double()
    w = weights.double()
    index = torch.arange(n, dtype=torch.float64)
    assert (sums[0] - torch.special.xlogy(w, w).sum(-1)).abs().max() < 1e-6
    assert sums[0, 4, 3] == 0.0
    expected_distance = (w * (index[:, None] - index[None, :]).abs()).sum(-1)
    assert ((sums[1] - expected_distance).abs() / expected_distance.clamp_min(1)).max() < 1e-6
    assert (sums[2] - (w * copies.double()).sum(-1)).abs().max() < 1e-6
    assert (sums[3] - w @ delimiters.double()).abs().max() < 1e-6
    assert torch.equal(sums[4], w.diagonal(dim1=-2, dim2=-1)) and torch.equal(sums[6], w[..., 0])
    assert (sums[5, :, 0] == 0).all() and torch.equal(sums[5, :, 1:], w.diagonal(offset=-1, dim1=-2, dim2=-1))


def test_fixed_offset_share_counts_argmax_offsets():
    n = 10
    att = torch.full((1, 3, n, n), 0.01)
    for i in range(n):
        att[0, 0, i, max(i - 2, 0)] = 0.9  # offset 2 on rows 2..9, 0 on rows 0 and 1
        att[0, 1, i, i] = 0.9  # offset 0 everywhere: positional, but not a fixed offset beyond 1
        att[0, 2, i, (0 if i % 2 else n - 1)] = 0.9  # two offsets, 5 rows each
    mode, share = fixed_offset_share(att.argmax(-1))
    assert mode[0].tolist() == [2, 0, -9] and share[0].tolist() == pytest.approx([0.8, 1.0, 0.1])
    tags = tag_heads({"previous": torch.zeros(1, 3)}, att.argmax(-1))
    assert tags == [[["positional"], [], []]]
    # A head with half its mass on earlier copies of its own token is named for it (the statistic
    # was there, no tag).
    tags = tag_heads({"duplicate": torch.tensor([[0.5, 0.49, 0.9]])}, att.argmax(-1))
    assert tags == [[["duplicate-token", "positional"], [], ["duplicate-token"]]]


@pytest.mark.parametrize("name", ["minilm", "tiny"])
def test_head_stats_match_a_plain_float64_computation(name, minilm, tiny):
    model = {"minilm": minilm, "tiny": tiny}[name]
    r = model.attend("The bank, the river and the bank again. The river ran; the bank stood. " * 3)
    ours = head_stats(r.attention, r.tokens, model.info.causal)
    want = reference_stats(r.attention, r.tokens, model.info.causal)
    for stat, expected in want.items():
        scale = expected.abs().max().item()  # distance is in tokens: float32 holds it to ~1e-7 relative
        assert (ours[stat].double() - expected).abs().max().item() <= 1e-6 * max(1.0, scale), stat


def test_word_view_merges_wordpiece_and_keeps_rows_stochastic(minilm):
    text = "Unbelievably naive robbers fled."
    r = minilm.attend(text)
    pieces = [t.piece for t in r.tokens]
    assert any(p.startswith("##") for p in pieces), pieces
    words, merged = merge_words(r.tokens, r.attention, (text, ""))
    assert [w.text for w in words] == ["[CLS]", "Unbelievably", "naive", "robbers", "fled", ".", "[SEP]"]
    assert merged.shape == (6, 12, len(words), len(words))
    assert torch.allclose(merged.sum(-1), torch.ones(merged.shape[:-1]), atol=1e-5)
    # By hand for one cell: mean over the query word's pieces of the sum over the key word's pieces.
    q, k = words[1].pieces, words[3].pieces
    expected = r.attention[2, 5][list(q)][:, list(k)].sum(-1).mean()
    assert merged[2, 5, 1, 3] == pytest.approx(expected.item(), abs=1e-6)


def test_word_view_joins_wordpiece_pieces_across_a_dropped_combining_mark(minilm):
    """MiniLM drops the virama and vowel signs of नमस्ते दुनिया (category Mn), so its pieces' spans
    leave gaps: the word view made four words of two (a review by use, non-English text)."""
    text = "नमस्ते दुनिया"
    r = minilm.attend(text)
    assert any(t.start > prev.end for prev, t in zip(r.tokens[1:], r.tokens[2:-1]))  # the gaps are there
    words, merged = merge_words(r.tokens, r.attention, (text, ""))
    assert [(w.start, w.special) for w in words] == [(0, True), (0, False), (7, False), (0, True)]
    assert words[2].text == "दुनिया"
    assert torch.allclose(merged.sum(-1), torch.ones(merged.shape[:-1]), atol=1e-5)
    # A space between two words still parts them, whatever the second piece's marker.
    apart = minilm.attend("bank robbers")
    assert len(merge_words(apart.tokens, apart.attention)[0]) == 4


def test_word_view_merges_bytes_of_one_character(tiny):
    text = "a 🏦 bank"
    r = tiny.attend(text)
    words, merged = merge_words(r.tokens, r.attention, (text, ""))
    assert "🏦" in [w.text for w in words]
    assert len(words) < len(r.tokens)
    assert torch.allclose(merged.sum(-1), torch.ones(merged.shape[:-1]), atol=1e-5)


@pytest.mark.parametrize("name", ["minilm", "tiny-gpt", "tiny-llama"])
def test_word_view_keeps_words_whole_and_marks_apart(name, minilm, tiny):
    """A space before punctuation was a word " ", "Don't" three words and "U.S.A." six, and
    "東京タワーは高い" one word on MiniLM (its spans touch); a review by use."""
    model = {"minilm": minilm, "tiny-gpt": tiny}.get(name) or load(name, device="cpu")
    text = "Don't stop, e.g. U.S.A. costs $3.14 (1,000) well-known #tag  double!"
    r = model.attend(text)
    words, _ = merge_words(r.tokens, r.attention, (text, ""))
    assert [w.text for w in words if not w.special] == [
        "Don't", "stop", ",", "e.g", ".", "U.S.A", ".", "costs", "$3.14", "(", "1,000", ")", "well-known",
        "#", "tag", "double", "!"]
    cjk = "東京タワーは高い。"
    r = model.attend(cjk)
    assert [w.text for w in merge_words(r.tokens, r.attention, (cjk, ""))[0] if not w.special] == [
        "東", "京", "タワーは", "高", "い", "。"]
    # Spaces at the end have no word to lead: they end the last word, and every piece is in a word.
    r = model.attend("the end  ")
    words, merged = merge_words(r.tokens, r.attention, ("the end  ", ""))
    assert [w.text for w in words if not w.special] == ["the", "end"]
    assert sorted(k for w in words for k in w.pieces) == list(range(len(r.tokens)))
    assert torch.allclose(merged.sum(-1), torch.ones(merged.shape[:-1]), atol=1e-5)


def test_neuron_view_reproduces_the_row(minilm, tiny):
    for model, text in ((minilm, SENTENCE), (tiny, "In the beginning God created the heaven.")):
        r = model.attend(text, capture=Capture(qkv=True))
        view = neuron_view(model, r, layer=1, head=2, query_index=5)
        assert view.kv_head == 2
        assert torch.allclose(view.products.sum(-1)[:6], (view.query @ view.keys.T)[:6], atol=1e-5)
        assert torch.allclose(torch.softmax(view.scores, -1), view.weights, atol=1e-5)
        if model.info.causal:
            assert math.isinf(view.scores[6].item()) and view.weights[6] == 0
        # -1 is the last token, as Python counts: its row, not every score masked.
        last = neuron_view(model, r, layer=1, head=2, query_index=-1)
        assert last.query_index == len(r.tokens) - 1
        assert torch.allclose(torch.softmax(last.scores, -1), last.weights, atol=1e-5)
        with pytest.raises(IndexError, match="outside"):
            neuron_view(model, r, layer=1, head=2, query_index=len(r.tokens))


def test_logit_attribution_adds_up_to_the_logit(tiny):
    text = "In the beginning God created the heaven and the earth."
    dla = logit_attribution(tiny, text, position=10)
    assert dla.target == int(tiny.attend(text).logits[10].argmax())
    assert dla.total == pytest.approx(dla.logit, abs=1e-4)
    assert dla.heads.shape == (2, 8)
    ranked = [value for _, _, value in dla.ranked_heads()]
    assert ranked[0] == pytest.approx(dla.heads.abs().max().item() * (1 if ranked[0] > 0 else -1))
    assert [abs(v) for v in ranked] == sorted((abs(v) for v in ranked), reverse=True)


def test_logit_attribution_ranks_a_head_writing_against_the_prediction_with_those_for_it(tiny):
    """Ranked by value, a head pulling hardest against the prediction came last, so `top=3` (the
    API's) never showed it. In this repeated sentence tiny-gpt's induction head L1 H0 writes
    against the predicted token at -0.5, the largest effect of any head."""
    text = "The cat sat on the mat. The cat sat on the mat."
    dla = logit_attribution(tiny, text, position=30)
    assert dla.heads.min() < 0 and -dla.heads.min() > dla.heads.max()
    layer, head, value = dla.ranked_heads()[0]
    assert value == dla.heads.min().item() and (layer, head) == divmod(int(dla.heads.argmin()), dla.heads.shape[1])


def test_logit_attribution_matches_transformers_gpt2(tmp_path, bytelevel_tokenizer):
    """Per-head direct effects from transformers' own pieces: c_proj inputs, c_proj weight, ln_f, wte."""
    hf = save_random_gpt2(tmp_path, bytelevel_tokenizer, 5, n_embd=40, n_layer=2, n_head=5)
    ours = load(tmp_path, device="cpu")
    text = "Attention heads look back, some look ahead."
    position, target = 4, 17
    dla = logit_attribution(ours, text, position, target)

    ids = torch.tensor([[t.id for t in ours.encode(text).tokens]])
    seen, hooks = context_inputs(hf.transformer.h, ("attn", "c_proj"))
    final = {}
    hooks.append(hf.transformer.ln_f.register_forward_pre_hook(lambda m, a: final.__setitem__("x", a[0][0].detach())))
    try:
        with torch.no_grad():
            out = hf(ids)
    finally:
        for h in hooks:
            h.remove()
    assert dla.logit == pytest.approx(out.logits[0, position, target].item(), abs=1e-4)
    x = final["x"][position]
    ln = hf.transformer.ln_f
    sigma = torch.sqrt(x.var(unbiased=False) + ln.eps)
    w_u = hf.lm_head.weight[target]
    for layer, block in enumerate(hf.transformer.h):
        w_o = block.attn.c_proj.weight.T  # (out, in)
        for head in range(5):
            part = seen[layer][position, head * 8 : (head + 1) * 8] @ w_o[:, head * 8 : (head + 1) * 8].T
            expected = (ln.weight * (part - part.mean()) / sigma) @ w_u
            assert dla.heads[layer, head].item() == pytest.approx(expected.item(), abs=1e-5)
    assert dla.total == pytest.approx(dla.logit, abs=1e-4)


def test_logit_attribution_refuses_an_encoder(minilm):
    with pytest.raises(ValueError, match="pre-norm language model"):
        logit_attribution(minilm, "hello", 0)


def test_information_flow_edges_share_each_target_and_respect_causality(tiny):
    text = "In the beginning God created the heaven."
    tokens, edges = information_flow(tiny, text, threshold=0.0)
    n = len(tokens)
    assert all(e.source <= e.target for e in edges), "a causal model has no edge from a later token"
    for layer in range(2):
        for target in range(n):
            total = sum(e.weight for e in edges if e.layer == layer and e.target == target)
            assert total == pytest.approx(1.0, abs=1e-5)
    pruned = information_flow(tiny, text, threshold=0.2)[1]
    assert 0 < len(pruned) < len(edges) and all(e.weight >= 0.2 for e in pruned)


def test_information_flow_proximity_by_hand(minilm):
    """One edge recomputed from the definition with the value vectors and out_proj by hand."""
    from manyeyes.model.measures import run_with_stream

    text = "The bank of the river."
    tokens, edges = information_flow(minilm, text, threshold=0.0)
    r, inputs = run_with_stream(minilm, text)[:2]
    layer, target, source = 2, 3, 1
    att = minilm.net.trf_blocks[layer].att
    w_o, b = att.out_proj.weight.detach(), att.out_proj.bias.detach()
    z = []
    for j in range(len(tokens)):
        moved = sum(r.attention[layer, h, target, j] * (w_o[:, h * 32 : (h + 1) * 32] @ r.values[layer][h, j]) for h in range(12))
        z.append(moved)
    x = inputs[layer][target]
    y = x + sum(z) + b
    raw = [max(0.0, (y.abs().sum() - (y - p).abs().sum()).item()) for p in z + [x]]
    expected = raw[source] / sum(raw)
    [edge] = [e for e in edges if e.layer == layer and e.target == target and e.source == source and e.head is not None]
    assert edge.weight == pytest.approx(expected, abs=1e-5)


def test_flow_proximity_by_definition_and_silent_sources_score_zero():
    """_proximity against max(0, ‖y‖₁ - ‖y - z‖₁) normalised, in float64; a source marked
    silent (no head attends to it) scores 0 whatever its part holds, and the rest still share 1."""
    from manyeyes.model.measures import _proximity

    generator = torch.Generator().manual_seed(0)
    through = torch.randn(6, 3, 16, generator=generator)  # (T_source, chunk, d)
    residual = torch.randn(3, 16, generator=generator)
    through[4, 1] = 3 * residual[1]  # most of that target's stream: a large share, unless silent
    total = residual + through.sum(0)
    silent = torch.zeros(3, 6, dtype=torch.bool)
    silent[1, 4] = True
    got = _proximity(through.clone(), residual, total, silent)  # (chunk, T_source + 1)

    y = total.double()
    parts = torch.cat([through.double().transpose(0, 1), residual.double().unsqueeze(1)], dim=1)  # (chunk, T+1, d)
    raw = (y.abs().sum(-1, keepdim=True) - (y.unsqueeze(1) - parts).abs().sum(-1)).clamp_min(0)
    raw[1, 4] = 0
    expected = raw / raw.sum(-1, keepdim=True)
    assert got[1, 4] == 0
    assert torch.allclose(got.double(), expected, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(3), atol=1e-6)


def test_numba_loops_compile_when_no_cache_directory_is_writable(monkeypatch):
    """numba's cache=True fails at decoration when neither the install nor $HOME can be written
    (checked by hand on a read-only tmpfs); the row pass and the u8 quantiser then compile per
    process instead."""
    import numba

    from manyeyes.model import jit

    real = numba.njit

    def without_a_cache_directory(*args, cache=False, **kwargs):
        if cache:
            raise RuntimeError("cannot cache function 'add_one': no locator available for file 'row_sums.py'")
        return real(*args, **kwargs)

    monkeypatch.setattr(jit.numba, "njit", without_a_cache_directory)

    def add_one(x):
        return x + 1

    compiled = jit.compiled(nogil=True)(add_one)
    assert compiled(41) == 42 and hasattr(compiled, "py_func")  # a numba dispatcher, not the plain function


@pytest.mark.parametrize("causal", [True, False])
def test_head_stats_count_only_the_keys_a_sliding_window_leaves_in_reach(causal):
    """Under a window of W a row sees min(i + 1, W) keys: entropy was over log(i + 1), so a head
    uniform over its window read 0.66 (never "broad"), and "first" averaged rows that cannot see
    token 0 (0.21 for 0.77 on a random Mistral; a review by use)."""
    n, window = 29, 5
    words = "a b c a d e b f a g".split() * 3
    tokens = [Token(w, ord(w), 0, 0, False, 0, w) for w in words[:n]]
    positions = torch.arange(n)
    behind = positions[None, :] <= positions[:, None] - window  # (T, T): keys out of reach
    blocked = behind | (positions[None, :] > positions[:, None]) if causal else behind
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, n, n, generator=generator) * 2
    scores[1] = scores[1].masked_fill(blocked, float("-inf"))  # layer 1 windowed, layer 0 not
    if causal:
        scores[0] = scores[0].masked_fill(positions[None, :] > positions[:, None], float("-inf"))
    scores[1, 2] = torch.zeros(n, n).masked_fill(blocked, float("-inf"))  # uniform over its window
    att = torch.softmax(scores, -1)
    stats = head_stats(att, tokens, causal, (None, window))
    assert stats["entropy"][1, 2] == pytest.approx(1.0, abs=1e-6)
    assert "broad" in tag_heads({**stats, "induction": torch.zeros(2, 3)}, att.argmax(-1))[1][2]
    # Every statistic against the definitions, row by row, in float64, with each layer's reach.
    for layer, reach in ((0, n), (1, window)):
        want = reference_stats(att[layer:layer + 1], tokens, causal, reach)
        p = att[layer].double()  # (H, T, T)
        rows = [i for i in range(n) if (i + 1 if causal else n) - max(0, i - reach + 1) > 1]
        sees_first = [i for i in rows if 1 <= i < reach]
        want["self"] = sum(p[:, i, i] for i in rows) / len(rows)
        want["first"] = sum(p[:, i, 0] for i in sees_first) / len(sees_first)
        want["previous"] = sum(p[:, i, i - 1] for i in range(1, n)) / (n - 1)
        for name, value in want.items():
            assert torch.allclose(stats[name][layer].double(), value.reshape(-1), atol=1e-6), (layer, name)
