"""The experiment and measure routes as a hostile program calls them, on each built-in family:
every bad input is a 4xx with a JSON error that says what is wrong, never a 500; edge inputs
that are fine (one token, every head ablated, a zero-width text) answer 200 with sane bodies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from manyeyes.app.config import Settings
from tests.api.conftest import decode, serve

MODELS = ("minilm", "tiny-gpt", "tiny-llama")
E = "/api/v1/experiments"


@pytest.fixture(scope="module")
def client():
    c = serve(Settings(models={name: name for name in MODELS}, device="cpu", warmup=False, max_wait_ms=5,
                       max_json_cells=200_000))
    yield c
    c.__exit__(None, None, None)


def post_raw(client, path: str, body: dict):
    """JSON as a client library that escapes everything would send it (lone surrogates included)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def refused(r, status: int, words: str = ""):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] and words in error["message"], error
    return error


def one(layer=0, head=0, **extra):
    return [{"layer": layer, "head": head, **extra}]


BAD = [
    ("ablate", {"text": "", "ablate": one()}, "text"),
    ("ablate", {"text": " \n\t", "ablate": one()}, "whitespace"),
    ("ablate", {"text": "\ud800", "ablate": one()}, "text"),
    ("ablate", {"text": "a", "ablate": one(), "text_pair": "  "}, "text_pair"),
    ("ablate", {"text": "a", "ablate": one(layer=2**70)}, "less than or equal to 4096"),
    ("ablate", {"text": "a", "ablate": one(layer=99)}, "no head L99 H0"),
    ("ablate", {"text": "a", "ablate": one(layer=-1)}, "layer"),
    ("ablate", {"text": "a", "ablate": one(head=0.0)}, "head"),
    ("ablate", {"text": "a", "ablate": one(head=True)}, "head"),
    ("ablate", {"text": "a", "ablate": one(head=None)}, "head"),
    ("ablate", {"text": "a", "ablate": one(head="1")}, "head"),
    ("ablate", {"text": "a", "ablate": one(mode="ZERO")}, "mode"),
    ("ablate", {"text": "a", "ablate": one() + one(mode="mean")}, "twice"),
    ("ablate", {"text": "a", "ablate": []}, "ablate"),
    ("ablate", {"text": "a", "ablate": None}, "ablate"),
    ("ablate", {"text": "a", "ablate": one(), "top_k": 21}, "top_k"),
    ("ablate", {"text": "a", "ablate": one(), "attention": {"heads": [2**63]}}, "head"),
    ("ablate", {"text": "a", "ablate": one(), "attention": {"layers": [0, 0]}}, "once"),
    ("ablate", {"text": "a", "ablate": one(), "attention": {"format": "f32"}}, "format"),
    ("ablate", {"text": "a", "ablate": one(), "truncate": "yes"}, "truncate"),
    ("ablate", {"text": "a", "ablate": one(), "extra": 1}, "extra"),
    ("change-token", {"text": "a b", "index": -1, "change": "delete"}, "index"),
    ("change-token", {"text": "a b", "index": 2**80, "change": "delete"}, "token index"),
    ("change-token", {"text": "a b", "index": 1.0, "change": "delete"}, "index"),
    ("change-token", {"text": "a b", "index": 1, "change": "swap"}, "change"),
    ("change-token", {"text": "a b", "index": 1, "change": "delete", "text_pair": "\u3000"}, "text_pair"),
    ("compare", {"text_a": "a"}, "text_b"),
    ("compare", {"text_a": "a", "text_b": "\t"}, "text_b"),
    ("compare", {"text_a": "a", "text_b": "b", "difference": {"heads": []}}, "heads"),
    ("compare", {"text_a": "a", "text_b": "b", "difference": {"layers": [99]}}, "layer 99"),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("path, body, words", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_experiment_input_is_a_clear_422(client, model, path, body, words):
    refused(post_raw(client, f"{E}/{path}", {"model": model, **body}), 422, words)


def test_numbers_of_thousands_of_digits_are_not_quoted_whole(client):
    """A 4,000-digit layer came back in a 4 KB message; one of 5,000 digits (past what int() reads)
    told the client to call sys.set_int_max_str_digits()."""
    for body in ({"text": "a b", "ablate": one(layer=10**3999)}, {"text": "a b", "ablate": one(head=10**3999)},
                 {"text": "a b", "index": 10**3999, "change": "delete"}):
        path = "ablate" if "ablate" in body else "change-token"
        error = refused(post_raw(client, f"{E}/{path}", body), 422)
        assert len(error["message"]) < 300, error
    raw = '{"text": "a b", "ablate": [{"layer": %s, "head": 0}]}' % ("9" * 5000)
    r = client.post(f"{E}/ablate", content=raw, headers={"content-type": "application/json"})
    error = refused(r, 400, "value has 5000 digits")
    assert "sys." not in error["message"] and len(error["message"]) < 300, error


@pytest.mark.parametrize("model", MODELS)
def test_too_long_and_truncated_inputs(client, model):
    info = client.app.state.registry.get(model).model.info
    long = "x " * (info.max_tokens + 1)
    refused(post_raw(client, f"{E}/ablate", {"model": model, "text": long, "ablate": one()}), 422, "tokens long")
    refused(post_raw(client, f"{E}/compare", {"model": model, "text_a": "x", "text_b": long}), 422, "text_b")
    r = post_raw(client, f"{E}/ablate", {"model": model, "text": long, "ablate": one(), "truncate": True})
    if info.max_tokens > client.app.state.settings.dense_max_tokens:  # tiny-llama: 2,048 positions
        error = refused(r, 422, "MANYEYES_DENSE_MAX_TOKENS")
        assert f"send at most {client.app.state.settings.dense_max_tokens:,} tokens" in error["message"], error
    else:
        assert r.status_code == 200, r.text
        assert len(r.json()["tokens"]) == info.max_tokens and r.json()["truncated"] is True
    refused(post_raw(client, f"{E}/compare", {"model": model, "text_a": "x" * 100_001, "text_b": "x"}), 422, "text_a")


@pytest.mark.parametrize("model", MODELS)
def test_every_head_ablated_and_one_token(client, model):
    info = client.app.state.registry.get(model).model.info
    every = [{"layer": layer, "head": head, "mode": mode} for layer in range(info.n_layers)
             for head in range(info.n_heads) for mode in ["zero" if (layer + head) % 2 else "mean"]]
    r = post_raw(client, f"{E}/ablate", {"model": model, "text": "The bank of the river.", "ablate": every,
                                         "attention": {"format": "json", "layers": [info.n_layers - 1]}})
    assert r.status_code == 200, r.text
    got = r.json()
    assert len(got["ranking"]) == (info.n_layers - 1) * info.n_heads
    assert all(0 <= row["divergence"] <= 1 and np.isfinite(row["divergence"]) for row in got["ranking"])
    rows = decode(got["attention"]).sum(-1)
    np.testing.assert_allclose(rows, 1, atol=1e-5)  # still distributions, no NaN
    if info.causal:
        assert all(np.isfinite(c["change"]) for c in got["logprob_change"])

    # One token: a causal LM has no next token to score, a BERT still has [CLS] a [SEP].
    r = post_raw(client, f"{E}/ablate", {"model": model, "text": "a", "ablate": one(), "top_k": 20})
    assert r.status_code == 200, r.text
    got = r.json()
    assert len(got["tokens"]) == (3 if model == "minilm" else 1)
    if info.causal:
        assert got["logprob_change"] == [] and len(got["predictions"]["after"][0]) == 20
    # the last layer ablated: nothing lies downstream to rank
    r = post_raw(client, f"{E}/ablate", {"model": model, "text": "a b", "ablate": one(layer=info.n_layers - 1)})
    assert r.status_code == 200 and r.json()["ranking"] == []

    # Deleting a text's only token left MiniLM [CLS] [SEP], and a pair's only token an empty second
    # segment: both were compared and answered 200, runs refused wherever they are asked for (review h52c).
    first = 1 if model == "minilm" else 0  # after [CLS]
    refused(post_raw(client, f"{E}/change-token", {"model": model, "text": "a", "index": first, "change": "delete"}),
            422, "deleting the only token of text leaves nothing of it to run")
    if model == "minilm":  # [CLS] hello [SEP] a [SEP]
        pair = {"model": model, "text": "hello", "index": 3, "change": "delete"}
        refused(post_raw(client, f"{E}/change-token", {**pair, "text_pair": "a"}),
                422, "deleting the only token of text_pair leaves nothing of it to run")
        r = post_raw(client, f"{E}/change-token", {**pair, "text_pair": "a b"})
        assert r.status_code == 200 and [t["text"] for t in r.json()["tokens_b"]] == ["[CLS]", "hello", "[SEP]", "b", "[SEP]"]
    # A zero-width space is not whitespace: the byte models keep its bytes; MiniLM keeps nothing of
    # it, and says so (a run of its specials alone was compared as if it were the text's).
    r = post_raw(client, f"{E}/compare", {"model": model, "text_a": "\u200b", "text_b": "\u200b"})
    if model == "minilm":
        refused(r, 422, "text_a: text gives no tokens on minilm")
    else:
        assert r.status_code == 200, r.text
        assert all(row["divergence"] == 0 for row in r.json()["ranking"])


@pytest.mark.parametrize("model", MODELS)
def test_bad_measure_queries_are_a_clear_4xx(client, model):
    run_id = post_raw(client, "/api/v1/attention", {"model": model, "text": "The bank of the river.",
                                                    "format": "u8"}).json()["run_id"]
    base = f"/api/v1/runs/{run_id}"
    info = client.app.state.registry.get(model).model.info
    cases = [
        ("measures", {}, 422, "names"),
        ("measures", {"names": "rollout,flow"}, 422, "'flow'"),
        ("measures", {"names": "rollout", "layers": "-1"}, 422, "-1"),
        ("measures", {"names": "rollout", "layers": "1.5"}, 422, "1.5"),
        ("measures", {"names": "rollout", "layers": "true"}, 422, "true"),
        ("measures", {"names": "value_norms", "layers": str(10**30)}, 422, "layer"),
        ("measures", {"names": "value_norms", "heads": f"{info.n_heads}"}, 422, f"head {info.n_heads}"),
        ("measures", {"names": "value_norms", "heads": "0,0"}, 422, "once"),
        ("measures", {"names": "rollout", "format": "F16"}, 422, "format"),
        ("flow", {"threshold": "abc"}, 422, "threshold"),
        ("flow", {"threshold": "inf"}, 422, "threshold"),
        ("flow", {"threshold": "0.001"}, 422, "threshold"),
        ("neuron", {"layer": "0", "head": "0"}, 422, "query"),
        ("neuron", {"layer": "0", "head": "0", "query": "1e3"}, 422, "query"),
        ("neuron", {"layer": "0", "head": "0", "query": "99999999999999999999"}, 422, "query"),
        ("neuron", {"layer": str(info.n_layers), "head": "0", "query": "0"}, 422, f"layer {info.n_layers}"),
        ("neuron", {"layer": "0", "head": "0", "query": "500"}, 422, "query position 500"),
        ("logit-attribution", {}, 422, "position"),
        ("logit-attribution", {"position": "true"}, 422, "position"),
        ("logit-attribution", {"position": "0", "top": "0"}, 422, "top"),
    ]
    if info.causal:
        cases += [
            ("logit-attribution", {"position": "99"}, 422, "position 99"),
            ("logit-attribution", {"position": "0", "target": "257"}, 422, "target"),
            ("logit-attribution", {"position": "0", "target": "-1"}, 422, "target"),
        ]
    else:
        cases += [("logit-attribution", {"position": "0"}, 422, "language model")]
    for path, params, status, words in cases:
        refused(client.get(f"{base}/{path}", params=params), status, words)
    for path, params in (("measures", {"names": "rollout"}), ("flow", {}), ("neuron", {"layer": 0, "head": 0, "query": 0}),
                         ("logit-attribution", {"position": 0})):
        refused(client.get(f"/api/v1/runs/{'0' * 32}/{path}", params=params), 404, "evicted")
