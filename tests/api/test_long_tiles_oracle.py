"""The long-run routes' numbers against two oracles, as a program calling the JSON API reads them:
tiles, top-k and the overview of 1,000-2,048-token runs kept as queries and keys (`keep` "qk" and
"auto") on tiny-llama (rotary, 4 query heads over 2 key/value heads) and tiny-gpt.

Oracle 1 is the model's own dense forward on the same text (1e-5, as the README promises); oracle 2
is softmax(q k^T / sqrt(d) + causal mask) in float64 from the run's kept queries and keys, so the
rebuild is checked against the formula, not only against other code of the same model. Windows
straddle the forward's row blocks (256 rows at T = 2,000 on tiny-llama) and its key bins, end in the
last partial block, and cover the causal upper triangle (exactly 0). f16 and u8 answers, as JSON and
as frames, are held to their quantisation steps; the same cells come back after the run was evicted
and posted again.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from manyeyes.app.config import Settings
from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, read_frame
from tests.api.conftest import serve
from tests.api.test_api_tiles import array

# Each format's error bound against float32: f16 rounds to 11 significant bits (weights <= 1, so
# within 2^-11 absolute), u8 to the nearest 1/255.
TOLERANCE = {"json": 1e-5, "f16": 2**-11 + 1e-6, "u8": 0.5 / 255 + 1e-6}
FRAME_DTYPES = {"json": "<f4", "f16": "<f2", "u8": "u1", "i32": "<i4"}


def random_text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    words = "the bank of a river was in the beginning and the word was with light darkness".split()
    return " ".join(rng.choice(words) for _ in range(chars))[:chars]


@pytest.fixture(scope="module")
def long_api():
    # A cache of 40 MB (30 MB for runs): a handful of 2,048-token tiny-llama runs, so eviction is cheap.
    client = serve(Settings(models={"tiny-llama": "tiny-llama", "tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False,
                            cache_bytes=40_000_000))
    yield client
    client.__exit__(None, None, None)


def post(api, text: str, model: str, **extra) -> dict:
    r = api.post("/api/v1/attention", json={"text": text, "model": model, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def tile(api, run_id: str, frame: bool = False, **params) -> np.ndarray:
    headers = {"Accept": FRAME_MEDIA_TYPE} if frame else {}
    r = api.get(f"/api/v1/runs/{run_id}/tile", params=params, headers=headers)
    assert r.status_code == 200, r.text
    if not frame:
        return array(r.json()["attention"])
    header, data = read_frame(r.content)
    meta = header["attention"]
    dtype = np.dtype(FRAME_DTYPES[meta["format"]])
    values = np.frombuffer(data, dtype, meta["nbytes"] // dtype.itemsize, meta["offset"]).astype(np.float32)
    return values.reshape(meta["shape"]) * meta.get("scale", 1.0)


def softmax_oracle(kept, layer: int) -> np.ndarray:
    """(heads, T, T) float64: softmax(q k^T / sqrt(d) + mask) from the kept queries and keys."""
    q = kept.queries[layer].double()  # (heads, T, d), after rotary
    k = kept.keys[layer].double()  # (kv_heads, T, d)
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # (heads, T, d): query head h reads key head h // group
    # (heads, T, d) @ (heads, d, T) -> (heads, T, T)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    n = q.shape[1]
    later = torch.ones(n, n, dtype=torch.bool).triu(1)  # (T, T): key after query, masked for a causal model
    return torch.softmax(scores.masked_fill(later, -torch.inf), dim=-1).numpy()


# Windows (q0, q1, k0, k1) as functions of T: every cell of them is compared.
def windows(n: int, block: int) -> list[tuple[int, int, int, int]]:
    """block: the forward's query rows per row block (KeptAttention.block_rows)."""
    block = min(block, n // 2)
    return [
        (block - 6, block + 14, 0, min(n, 1024)),  # rows across the forward's first row-block edge, keys from 0
        (max(0, n - 300), n, max(0, n - 300), n),  # the last, partial, row block; the diagonal and the upper triangle
        (n - 1, n, max(0, n - 1024), n),  # the last row
        (0, 1, 0, min(n, 1024)),  # the first row: one visible key, the rest exactly 0
        (n // 3, n // 3 + 100, n // 7, n // 7 + 200),  # an interior window off the diagonal
        (100, 200, 150, 250),  # straddles the diagonal: the causal upper triangle inside the window
    ]


@pytest.mark.parametrize("model_id,chars,keep,truncate", [
    ("tiny-llama", 2040, "qk", False),   # 2,040 tokens (byte-level), 8 row blocks of the forward
    ("tiny-llama", 1300, "auto", False),  # over dense_max_tokens (1,024): auto keeps queries and keys
    ("tiny-gpt", 2000, "qk", True),  # tiny-gpt holds 256 positions: truncated to them
])
def test_tiles_equal_the_dense_forward_and_the_softmax_of_the_kept_queries_and_keys(long_api, model_id, chars, keep, truncate):
    text = random_text(chars, chars)
    body = post(long_api, text, model_id, keep=keep, truncate=truncate)
    assert body["kept"] == "qk" and body["attention"] is None
    run_id, n = body["run_id"], len(body["tokens"])
    model = long_api.app.state.registry.get(model_id).model
    dense = model.attend(text, truncate=truncate).attention.numpy()  # (L, H, T, T)
    assert dense.shape[-1] == n
    kept = long_api.app.state.service.cache.get(run_id).kept
    if model_id == "tiny-llama":  # tiny-gpt's 256 tokens are one row block of its forward
        assert kept.block_rows < n - 300  # the windows span several of the forward's row blocks
    for layer in range(dense.shape[0]):
        formula = softmax_oracle(kept, layer)
        np.testing.assert_allclose(formula, dense[layer], atol=1e-5, rtol=0)  # the oracles agree
        for q0, q1, k0, k1 in windows(n, kept.block_rows):
            for head in (0, dense.shape[1] - 1, "mean"):
                want = (dense[layer].mean(0) if head == "mean" else dense[layer, head])[q0:q1, k0:k1]
                exact = (formula.mean(0) if head == "mean" else formula[head])[q0:q1, k0:k1]
                for fmt, frame in (("json", False), ("f16", False), ("u8", False), ("json", True), ("u8", True)):
                    got = tile(long_api, run_id, frame, layer=layer, head=head, q0=q0, q1=q1, k0=k0, k1=k1, format=fmt)
                    assert got.shape == want.shape
                    np.testing.assert_allclose(got, want, atol=TOLERANCE[fmt], rtol=0, err_msg=f"{fmt} {head} {q0, q1, k0, k1}")
                    np.testing.assert_allclose(got, exact, atol=TOLERANCE[fmt], rtol=0)
                    # A later key of a causal row is masked before the softmax: 0 in every format.
                    upper = np.arange(k0, k1)[None, :] > np.arange(q0, q1)[:, None]
                    assert not got[upper].any(), (fmt, head, q0, q1, k0, k1)


def bins(w: np.ndarray, row_edges: list[int], col_edges: list[int], how: str) -> np.ndarray:
    """numpy's own pooling of w into the bins the edges bound: max, or mean over each bin's cells."""
    if how == "max":
        return np.maximum.reduceat(np.maximum.reduceat(w, row_edges[:-1], axis=0), col_edges[:-1], axis=1)
    sums = np.add.reduceat(np.add.reduceat(w.astype(np.float64), row_edges[:-1], axis=0), col_edges[:-1], axis=1)
    return sums / np.outer(np.diff(row_edges), np.diff(col_edges))


@pytest.mark.parametrize("model_id,chars,truncate", [("tiny-llama", 2048, False), ("tiny-gpt", 2000, True)])
def test_topk_and_pooled_views_equal_the_dense_forward(long_api, model_id, chars, truncate):
    text = random_text(chars + 1, chars)
    body = post(long_api, text, model_id, keep="qk", truncate=truncate)
    run_id, n = body["run_id"], len(body["tokens"])
    dense = long_api.app.state.registry.get(model_id).model.attend(text, truncate=truncate).attention.numpy()
    for layer, head in ((0, 0), (1, 1)):
        w = dense[layer, head]
        best = -np.sort(-w, axis=1)  # (T, T) each row largest first
        for k in (1, 8, 64):
            for fmt in ("json", "f16", "u8"):
                r = long_api.get(f"/api/v1/runs/{run_id}/topk", params=dict(layer=layer, head=head, k=k, format=fmt))
                assert r.status_code == 200, r.text
                got = r.json()
                values, indices, rest = array(got["values"]), array(got["indices"]).astype(np.int64), array(got["rest"])
                assert values.shape == (n, k) and indices.shape == (n, k) and rest.shape == (n,)
                np.testing.assert_allclose(values, best[:, :k], atol=TOLERANCE[fmt], rtol=0)
                # The indices name keys that hold those weights (ties may name either key).
                np.testing.assert_allclose(np.take_along_axis(w, indices, 1), values, atol=TOLERANCE[fmt], rtol=0)
                np.testing.assert_allclose(rest, np.clip(1 - best[:, :k].sum(1), 0, None), atol=TOLERANCE[fmt] + 1e-5, rtol=0)
        # Pooled over the whole run: bins of ceil(T / size), the last narrower, max and mean of the cells.
        for rows, cols, how in ((7, 7, "max"), (1, 1, "mean"), (1024, 1024, "max"), (3, 1000, "mean")):
            r = long_api.get(f"/api/v1/runs/{run_id}/tile", params=dict(layer=layer, head=head, rows=rows, cols=cols, pool=how))
            got = r.json()
            re, ce = got["row_edges"], got["col_edges"]
            assert re == [*range(0, n, -(-n // min(rows, n))), n] and ce == [*range(0, n, -(-n // min(cols, n))), n]
            want = bins(w, re, ce, how)
            np.testing.assert_allclose(array(got["attention"]), want, atol=1e-5, rtol=0)
    overview = long_api.get(f"/api/v1/runs/{run_id}/overview", params={"format": "json"}).json()
    edges = overview["row_edges"]
    want = np.array([[bins(dense[layer, head], edges, edges, "max") for head in range(dense.shape[1])]
                     for layer in range(dense.shape[0])])
    np.testing.assert_allclose(array(overview["attention"]), want, atol=1e-5, rtol=0)


def test_the_same_cells_after_the_run_was_evicted_and_posted_again(long_api):
    text = random_text(7, 2040)
    first = post(long_api, text, "tiny-llama", keep="qk")
    run_id = first["run_id"]
    params = [dict(layer=1, head=h, q0=1790, q1=2040, k0=1016, k1=2040, format="json") for h in (0, 3)]
    params += [dict(layer=0, head="mean", rows=64, cols=512, pool="mean", format="json")]
    before = [tile(long_api, run_id, **p) for p in params]
    nbytes = long_api.get(f"/api/v1/runs/{run_id}").json()["nbytes"]
    # Enough other runs of its size to push it out of the LRU (looking it up would keep it in).
    for seed in range(100, 101 + long_api.app.state.service.cache.max_bytes // nbytes):
        post(long_api, random_text(seed, 2040), "tiny-llama", keep="qk")
    r = long_api.get(f"/api/v1/runs/{run_id}/tile", params=params[0])
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_run"
    again = post(long_api, text, "tiny-llama", keep="auto")
    assert again["run_id"] == run_id and again["kept"] == "qk" and again["timing_ms"]["forward"] > 0
    dense = long_api.app.state.registry.get("tiny-llama").model.attend(text).attention.numpy()
    for p, old in zip(params, before):
        new = tile(long_api, run_id, **p)
        np.testing.assert_array_equal(new, old)  # the same forward again: the same bits
        if p["head"] != "mean":
            np.testing.assert_allclose(new, dense[1, p["head"], 1790:2040, 1016:2040], atol=1e-5, rtol=0)
