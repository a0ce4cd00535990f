"""The measures and the ablation over HTTP, checked against independent computations straight from
their definitions, on each built-in family: MiniLM (BERT, post-norm, bidirectional), tiny-gpt
(GPT-2 style, LayerNorm) and tiny-llama (RMSNorm, rotary, grouped-query attention, 4 query heads
over 2 key/value heads).

The oracles read nothing of manyeyes' measure code: they hook the network's own modules (each
block's input, out_proj's input and output, the final norm's input), recompute the values from
the block's parameters, and do every product in float64 with explicit d_model-wide vectors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manyeyes.app.config import Settings
from manyeyes.model import Capture
from tests.api.conftest import decode, serve

FAMILIES = {
    "minilm": "The bank of the river was muddy after the rain.",
    "tiny-gpt": "In the beginning God created the heaven and the earth.",
    "tiny-llama": "In the beginning God created the heaven and the earth.",
}


@pytest.fixture(scope="module")
def client():
    c = serve(Settings(models={name: name for name in FAMILIES}, device="cpu", warmup=False, max_wait_ms=5,
                       max_json_cells=2_000_000))
    yield c
    c.__exit__(None, None, None)


def model_of(client, name):
    return client.app.state.registry.get(name).model


def decoded(matrix: dict) -> np.ndarray:
    return decode(matrix).astype(np.float64)


class Hooks:
    """A forward with every tensor the definitions need, recorded by hooks of the test's own."""

    def __init__(self, model, edits: dict[int, callable] | None = None):
        self.model, self.edits = model, edits or {}
        self.block_in, self.mixed, self.out, self.final = {}, {}, {}, None

    def run(self, encoded):
        net, handles = self.model.net, []
        for i, block in enumerate(net.trf_blocks):
            handles.append(block.register_forward_pre_hook(
                lambda m, a, i=i: self.block_in.__setitem__(i, a[0][0].detach().double().clone())))

            def pre(m, a, i=i):
                x = a[0]
                if i in self.edits:
                    x = self.edits[i](x.clone())
                self.mixed[i] = x[0].detach().double().clone()  # (T, n_heads * head_dim)
                return (x,)

            handles.append(block.att.out_proj.register_forward_pre_hook(pre))
            handles.append(block.att.out_proj.register_forward_hook(
                lambda m, a, out, i=i: self.out.__setitem__(i, out[0].detach().double().clone())))
        if hasattr(net, "final_norm"):
            handles.append(net.final_norm.register_forward_pre_hook(
                lambda m, a: setattr(self, "final", a[0][0].detach().double().clone())))
        try:
            self.result = self.model.run([encoded], Capture(qkv=True))[0]
        finally:
            for h in handles:
                h.remove()
        return self


def values_from_parameters(model, block, x: torch.Tensor) -> torch.Tensor:
    """(n_heads, T, head_dim), float64: each query head's values, from the block's own W_value, the
    layer's input and (pre-norm families) norm1; query head h reads key/value head h // group."""
    info = model.info
    inp = x if info.family == "bert" else block.norm1(x.float()[None])[0].double()  # BERT is post-norm
    w = block.att.W_value.weight.detach().double()  # (n_kv_heads * head_dim, d_model)
    b = block.att.W_value.bias
    v = inp @ w.T + (b.detach().double() if b is not None else 0)  # (T, n_kv_heads * head_dim)
    n_kv = w.shape[0] // info.head_dim
    v = v.view(v.shape[0], n_kv, info.head_dim).transpose(0, 1)  # (n_kv_heads, T, head_dim)
    return v[[h // (info.n_heads // n_kv) for h in range(info.n_heads)]]  # (n_heads, T, head_dim)


def w_o_slice(block, head: int, head_dim: int) -> torch.Tensor:
    """(d_model, head_dim): the columns of out_proj that head `head`'s slice multiplies."""
    return block.att.out_proj.weight.detach().double()[:, head * head_dim:(head + 1) * head_dim]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rollout_value_norms_and_contributions_match_their_definitions(client, name):
    model, text = model_of(client, name), FAMILIES[name]
    r = client.post("/api/v1/attention", json={"model": name, "text": text, "format": "json",
                                               "measures": ["rollout", "value_norms", "contributions"]})
    assert r.status_code == 200, r.text
    body = r.json()
    hooks = Hooks(model).run(model.encode(text))
    attention = hooks.result.attention.double()  # (L, H, T, T)
    info = model.info
    n_layers, n_heads, n = attention.shape[:3]
    assert decoded(body["attention"]).shape == tuple(attention.shape)
    np.testing.assert_allclose(decoded(body["attention"]), attention.numpy(), atol=1e-6)

    # Rollout (Abnar & Zuidema): Ã_l = ½ mean_h A_l + ½ I, rows renormalised, R = Ã_L ⋯ Ã_1.
    rollout = torch.eye(n, dtype=torch.float64)
    for layer in range(n_layers):
        mixed = 0.5 * attention[layer].mean(0) + 0.5 * torch.eye(n, dtype=torch.float64)
        mixed = mixed / mixed.sum(-1, keepdim=True)
        rollout = mixed @ rollout
    got = decoded(body["measures"]["rollout"])
    np.testing.assert_allclose(got, rollout.numpy(), atol=2e-6)
    np.testing.assert_allclose(got.sum(-1), 1, atol=1e-5)
    if info.causal:
        assert np.abs(np.triu(got, 1)).max() == 0

    # Value-weighted norms (Kobayashi et al.): ‖α_ij · v_j W_O,hᵀ‖ with the d_model-wide vector.
    norms = torch.empty(n_layers, n_heads, n, n, dtype=torch.float64)
    writes = torch.empty(n_layers, n_heads, n, info.d_model, dtype=torch.float64)
    for layer, block in enumerate(model.net.trf_blocks):
        values = values_from_parameters(model, block, hooks.block_in[layer])  # (H, T, head_dim)
        # what out_proj was really fed, head by head: Σ_j α_ij v_j (checks the values and the GQA map)
        for head in range(n_heads):
            mixed = attention[layer, head] @ values[head]  # (T, T) @ (T, head_dim) -> (T, head_dim)
            part = hooks.mixed[layer][:, head * info.head_dim:(head + 1) * info.head_dim]
            torch.testing.assert_close(mixed, part, atol=1e-4, rtol=1e-4)
            moved = values[head] @ w_o_slice(block, head, info.head_dim).T  # (T, head_dim) @ (head_dim, d) -> (T, d)
            norms[layer, head] = attention[layer, head] * moved.norm(dim=-1)[None, :]
            writes[layer, head] = part @ w_o_slice(block, head, info.head_dim).T  # (T, head_dim) @ (head_dim, d)
    got = decoded(body["measures"]["value_norms"])
    np.testing.assert_allclose(got, norms.numpy(), rtol=1e-4, atol=1e-4 * float(norms.max()))

    # Contributions: ‖head h's write at query i‖ and its projection on out_proj's output y, c·y / ‖y‖².
    contributions = body["measures"]["contributions"]
    output = torch.stack([hooks.out[layer] for layer in range(n_layers)])  # (L, T, d)
    np.testing.assert_allclose(decoded(contributions["norms"]), writes.norm(dim=-1).numpy(), rtol=1e-4, atol=1e-5)
    shares = (writes * output[:, None]).sum(-1) / output.square().sum(-1)[:, None]  # (L, H, T)
    np.testing.assert_allclose(decoded(contributions["shares"]), shares.numpy(), atol=1e-4)
    bias = torch.stack([b.att.out_proj.bias.detach().double() if b.att.out_proj.bias is not None
                        else torch.zeros(info.d_model, dtype=torch.float64) for b in model.net.trf_blocks])
    # heads + bias are y itself: their shares add to 1
    bias_shares = (bias[:, None] * output).sum(-1) / output.square().sum(-1)  # (L, T)
    np.testing.assert_allclose(decoded(contributions["bias_shares"]), bias_shares.numpy(), atol=1e-4)
    np.testing.assert_allclose(decoded(contributions["shares"]).sum(1) + decoded(contributions["bias_shares"]), 1,
                               atol=1e-4)


def frozen_norm(norm, stream: torch.Tensor):
    """The final norm at this position's scale as a linear map, and its constant part (float64)."""
    gamma = norm.scale.detach().double()
    if hasattr(norm, "shift"):  # LayerNorm
        sigma = torch.sqrt(stream.var(unbiased=False) + norm.eps)
        return (lambda c: gamma * (c - c.mean(-1, keepdim=True)) / sigma), norm.shift.detach().double()
    rms = torch.sqrt(stream.square().mean() + norm.eps)  # RMSNorm
    return (lambda c: gamma * c / rms), torch.zeros_like(gamma)


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_logit_attribution_matches_its_definition(client, name):
    model, text = model_of(client, name), FAMILIES[name]
    run_id = client.post("/api/v1/attention", json={"model": name, "text": text, "format": "u8"}).json()["run_id"]
    hooks = Hooks(model).run(model.encode(text))
    info, net = model.info, model.net
    n = len(hooks.result.tokens)
    unembed = net.out_head.weight.detach().double()  # (vocab, d)
    for position, target in ((n - 1, None), (7, 5), (0, 100)):
        params = {"position": position, "top": 4096} | ({} if target is None else {"target": target})
        r = client.get(f"/api/v1/runs/{run_id}/logit-attribution", params=params)
        assert r.status_code == 200, r.text
        got = r.json()
        logits = hooks.result.logits[position].double()
        want_target = int(logits.argmax()) if target is None else target
        assert got["target"] == want_target
        assert got["logit"] == pytest.approx(float(logits[want_target]), abs=1e-4)
        stream = hooks.final[position]  # (d,)
        normed, shift = frozen_norm(net.final_norm, stream)
        u = unembed[want_target]
        # the model's own logit is the frozen norm of the whole stream: the decomposition is exact
        assert float(normed(stream) @ u + shift @ u) == pytest.approx(float(logits[want_target]), abs=1e-4)
        heads = {}
        for layer, block in enumerate(net.trf_blocks):
            for head in range(info.n_heads):
                part = hooks.mixed[layer][position, head * info.head_dim:(head + 1) * info.head_dim]
                heads[(layer, head)] = float(normed(part @ w_o_slice(block, head, info.head_dim).T) @ u)
        assert len(got["heads"]) == info.n_layers * info.n_heads
        for row in got["heads"]:
            assert row["contribution"] == pytest.approx(heads[(row["layer"], row["head"])], abs=1e-4), row
        ordered = [abs(row["contribution"]) for row in got["heads"]]  # the largest effect first, up or down
        assert ordered == sorted(ordered, reverse=True)
        assert float(normed(hooks.block_in[0][position]) @ u) == pytest.approx(got["embeddings"], abs=1e-4)
        for layer in range(info.n_layers):
            after = hooks.block_in[layer + 1][position] if layer + 1 < info.n_layers else stream
            mlp = after - hooks.block_in[layer][position] - hooks.out[layer][position]  # the block's feed-forward write
            assert float(normed(mlp) @ u) == pytest.approx(got["mlps"][layer], abs=1e-4)
        assert got["total"] == pytest.approx(got["logit"], abs=1e-4)


def test_logit_attribution_of_an_encoder_is_a_422(client):
    run_id = client.post("/api/v1/attention", json={"model": "minilm", "text": FAMILIES["minilm"],
                                                    "format": "u8"}).json()["run_id"]
    r = client.get(f"/api/v1/runs/{run_id}/logit-attribution", params={"position": 1})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


def js_bits(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in bits over the last dimension, float64."""
    m = (p + q) / 2

    def kl(a):
        return torch.where(a > 0, a * (a / m.clamp_min(1e-300)).log(), torch.zeros_like(a)).sum(-1)

    return (kl(p) + kl(q)) / 2 / np.log(2)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ablation_equals_editing_out_projs_input_by_hand(client, name):
    """Zero one head's slice of out_proj's input, replace another's by its mean over positions, and
    the API's ablated run is this run: its attention, its log-probabilities and its ranking."""
    model, text = model_of(client, name), FAMILIES[name]
    info = model.info
    zero_head, mean_head = info.n_heads - 1, 1
    r = client.post("/api/v1/experiments/ablate", json={
        "model": name, "text": text, "top_k": 3, "attention": {"format": "json"},
        "ablate": [{"layer": 0, "head": zero_head, "mode": "zero"}, {"layer": 1, "head": mean_head, "mode": "mean"}]})
    assert r.status_code == 200, r.text
    got = r.json()
    encoded = model.encode(text)
    clean = Hooks(model).run(encoded)
    d = info.head_dim
    mean = clean.mixed[1][:, mean_head * d:(mean_head + 1) * d].mean(0)  # (head_dim,)

    def zero(x):
        x[..., zero_head * d:(zero_head + 1) * d] = 0
        return x

    def average(x):
        x[..., mean_head * d:(mean_head + 1) * d] = mean.to(x.dtype)
        return x

    ablated = Hooks(model, {0: zero, 1: average}).run(encoded)
    # the edit moved something: otherwise the comparison below says nothing
    assert not torch.allclose(ablated.out[0], clean.out[0], atol=1e-3)
    # out_proj is linear: zeroing a slice takes exactly that head's write out of its output
    head_write = clean.mixed[0][:, zero_head * d:(zero_head + 1) * d] @ w_o_slice(model.net.trf_blocks[0], zero_head, d).T
    torch.testing.assert_close(ablated.out[0], clean.out[0] - head_write, atol=1e-4, rtol=1e-4)

    after = ablated.result.attention.double()
    np.testing.assert_allclose(decoded(got["attention"]), after.numpy(), atol=1e-5)
    before = clean.result.attention.double()
    # every head after layer 0, ranked by the mean JS divergence of its rows
    want = js_bits(before[1:], after[1:]).mean(-1)  # (L - 1, H)
    assert len(got["ranking"]) == (info.n_layers - 1) * info.n_heads
    for row in got["ranking"]:
        assert row["layer"] >= 1
        assert row["divergence"] == pytest.approx(float(want[row["layer"] - 1, row["head"]]), abs=1e-5)
    if info.causal:
        logp_before = torch.log_softmax(clean.result.logits.double(), -1)
        logp_after = torch.log_softmax(ablated.result.logits.double(), -1)
        assert len(got["logprob_change"]) == len(encoded) - 1
        for row in got["logprob_change"]:
            p, t = row["position"], row["id"]
            assert t == encoded.ids[p + 1]
            assert row["before"] == pytest.approx(float(logp_before[p, t]), abs=1e-4)
            assert row["after"] == pytest.approx(float(logp_after[p, t]), abs=1e-4)
        top_after = logp_after.exp().topk(3, dim=-1)
        for p, guesses in enumerate(got["predictions"]["after"]):
            assert [g["id"] for g in guesses] == top_after.indices[p].tolist()
            assert [g["prob"] for g in guesses] == pytest.approx(top_after.values[p].tolist(), abs=1e-5)
    else:
        assert got["logprob_change"] is None and got["predictions"] is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_slice_in_any_order_is_the_same_numbers_as_the_whole(client, name):
    """layers=1,0 and heads=3,0,2: each answer's rows follow the order asked, in every format."""
    text = FAMILIES[name]
    whole = client.post("/api/v1/attention", json={"model": name, "text": text, "format": "json",
                                                    "measures": ["value_norms", "contributions"]}).json()
    layers, heads = [1, 0], [3, 0, 2]
    norms = decoded(whole["measures"]["value_norms"])[np.ix_(layers, heads)]
    shares = decoded(whole["measures"]["contributions"]["shares"])[np.ix_(layers, heads)]
    for fmt, atol in (("json", 0), ("f16", 2e-3), ("u8", None)):
        r = client.get(f"/api/v1/runs/{whole['run_id']}/measures",
                       params={"names": "value_norms,contributions", "layers": "1,0", "heads": "3,0,2", "format": fmt})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["layers"] == layers and got["heads"] == heads
        for want, part in ((norms, got["measures"]["value_norms"]), (shares, got["measures"]["contributions"]["shares"])):
            if fmt == "u8":  # value ≈ offset + byte × scale
                raw = decode({**part, "scale": 1.0})
                values, tolerance = part["offset"] + raw * part["scale"], part["scale"] / 2 + 1e-6
            else:
                values, tolerance = decoded(part), atol * max(1.0, float(np.abs(want).max()))
            assert values.shape == want.shape
            np.testing.assert_allclose(values, want, atol=tolerance)
