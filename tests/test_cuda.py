"""Parity sweep: the same requests to a CPU app (the reference) and to an app on an accelerator,
every answer compared number by number.

The accelerator is MANYEYES_TEST_ACCEL: by default CUDA where there is one, else the CPU, so CI
(which has no GPU) runs the sweep too, proving the harness and the GPU's own path: the accelerator
app always quantises on the device (device_quantise=True), as a GPU server does by default
(services/device.py quantises_on_device), and runs kept as u8 bytes meet the documented 422
kept_quantised. MANYEYES_TEST_ACCEL=cuda where CUDA is absent skips the module.

    python -m pytest -q -p no:cacheprovider tests/test_cuda.py
"""

from __future__ import annotations

import base64
import json
import os
import random
import typing

import numpy as np
import pytest
import torch

from manyeyes.app.config import Settings
from manyeyes.app.schemas import MeasureName
from tests.api.conftest import serve

ACCEL = os.environ.get("MANYEYES_TEST_ACCEL", "cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(
    ACCEL.startswith("cuda") and not torch.cuda.is_available(),
    reason=f"MANYEYES_TEST_ACCEL={ACCEL} needs CUDA",
)

MODELS = ("minilm", "tiny-gpt", "tiny-llama")
CAUSAL = ("tiny-gpt", "tiny-llama")  # both have a language-model head; minilm has none
MEASURES = list(typing.get_args(MeasureName))
SENTENCE = "The heron waited by the old stone mill while the boats went past under the green trees."

# Weights and probabilities lie in [0, 1]: float32 on another device reduces in another order,
# about 1e-6 apart; 2e-3 leaves room for TF32-like kernels without hiding a wrong head.
ATOL = 2e-3
# Unbounded values (scores, logits, value norms, neuron activations up to ~50) differ relatively,
# not absolutely, between devices: 1e-3 of the value on top of ATOL. It is also about one float16
# step (2^-10), so f16 answers of large values fit it.
RTOL = 1e-3
# Keys that legitimately differ between two servers: ids and timings, where the model runs, how the
# run is kept (precision: u8 on a quantising server; nbytes: the run's bytes in its cache) and links
# carrying run ids. Precision is asserted where it matters (test_*_precision, kept_quantised tests).
VOLATILE = frozenset({"run_id", "timing_ms", "device", "links", "precision", "nbytes"})
RANKED_BY = ("prob", "divergence", "contribution")  # lists sorted by these may swap near-tied items
RANKED_BY_SIZE = ("contribution",)  # logit attribution ranks heads by |contribution|


# ---------------------------------------------------------------------------- the two apps
def app(device: str, **extra):
    # warmup=False: a forward at each model's full length (2,048 for tiny-llama) proves nothing here.
    return serve(Settings(models={m: m for m in MODELS}, device=device, warmup=False, **extra))


@pytest.fixture(scope="module")
def ref():
    client = app("cpu")
    yield client
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def acc():
    client = app(ACCEL, device_quantise=True)
    yield client
    client.__exit__(None, None, None)


def text_for(tag: str) -> str:
    """A text of its own per test: run ids name the text, and the accelerator keeps a run at the
    precision of its first request, so sharing texts would make tests depend on their order."""
    return f"{SENTENCE} ({tag})"


def both(acc, ref, method: str, path: str, **kwargs):
    return acc.request(method, path, **kwargs), ref.request(method, path, **kwargs)


def assert_parity(got_r, want_r, what: str = "") -> dict:
    assert got_r.status_code == want_r.status_code == 200, (what, got_r.status_code, got_r.text[:300], want_r.text[:300])
    got, want = got_r.json(), want_r.json()
    compare(got, want)
    return got


# ---------------------------------------------------------------------------- the comparer
def at(path: str, suffix: str = "") -> str:
    """A path as failure messages show it: measures.rollout.data[3][1]."""
    return (path + suffix).lstrip(".") or "<root>"


def close(got: float, want: float, tol: float | None = None) -> bool:
    return abs(got - want) <= (ATOL + RTOL * abs(want) if tol is None else tol)


def is_array(node: dict) -> bool:
    return {"format", "shape", "data"} <= node.keys() and node["format"] in ("json", "f16", "u8", "i32")


def decoded(node: dict) -> np.ndarray:
    """Any array of the API as float64 (int64 for indices), u8's offset included (measures, differences)."""
    shape, fmt = node["shape"], node["format"]
    if fmt == "json":
        return np.asarray(node["data"], dtype=np.int64 if node.get("dtype") == "int32" else np.float64).reshape(shape)
    raw = base64.b64decode(node["data"])
    if fmt == "i32":
        return np.frombuffer(raw, dtype="<i4").astype(np.int64).reshape(shape)
    if fmt == "f16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float64).reshape(shape)
    values = np.frombuffer(raw, dtype=np.uint8).astype(np.float64).reshape(shape) * node["scale"]
    return values + (node.get("offset") or 0.0)


def compare_arrays(got: dict, want: dict, path: str) -> None:
    for key in sorted((got.keys() | want.keys()) - {"data", "scale", "offset"}):
        compare(got.get(key), want.get(key), f"{path}.{key}")
    a, b = decoded(got), decoded(want)
    if want["format"] == "i32" or want.get("dtype") == "int32":
        tol = np.zeros_like(b, dtype=np.float64)
    elif want["format"] == "u8":
        # One count either way: a weight on a rounding edge may land on either side of it.
        scale = max(got["scale"], want["scale"])
        shift = abs((got.get("offset") or 0) - (want.get("offset") or 0))
        tol = np.full_like(b, scale * (1 + RTOL) + shift + 1e-7)
        assert close(got["scale"], want["scale"], RTOL * want["scale"] + 1e-9), f"{at(path, '.scale')}: {got['scale']} != {want['scale']}"
    else:
        tol = ATOL + RTOL * np.abs(b)
    bad = np.argwhere(~(np.abs(a - b) <= tol))
    if len(bad):
        first = tuple(int(i) for i in bad[0])
        where = at(path, ".data" + "".join(f"[{i}]" for i in first))
        raise AssertionError(f"{where}: accelerator {a[first].item()!r} != cpu {b[first].item()!r} (tolerance {tol[first]:.3g}; "
                             f"{len(bad)} of {b.size} cells differ, worst by {np.abs(a - b).max():.3g})")


def compare_ranked(got: list, want: list, path: str, value: str) -> None:
    """Best-first lists (predictions, rankings, attributions): the ranking key position by
    position; an item may change place only with one whose key ties with it within tolerance.
    Attributions rank by size, up or down (a head at +0.3 may swap with one at -0.3)."""
    assert len(got) == len(want), f"{at(path)}: accelerator has {len(got)} items, cpu {len(want)}"
    ident = lambda item: tuple((k, item[k]) for k in ("id", "layer", "head") if k in item)  # noqa: E731
    rank = (lambda item: abs(item[value])) if value in RANKED_BY_SIZE else (lambda item: item[value])  # noqa: E731
    for i, (g, w) in enumerate(zip(got, want)):
        assert close(rank(g), rank(w)), f"{at(path, f'[{i}].{value}')}: accelerator {g[value]!r} != cpu {w[value]!r}"
        if ident(g) == ident(w):
            compare(g, w, f"{path}[{i}]")
            continue
        tied = [j for j, other in enumerate(want) if ident(other) == ident(g)]
        at_edge = not tied and close(rank(w), rank(want[-1]))  # tied with the last: cut either way
        if tied:
            compare(g, want[tied[0]], f"{path}[{i}]")  # the same item, wherever the cpu ranked it
        assert at_edge or (tied and close(rank(want[tied[0]]), rank(w))), (
            f"{at(path, f'[{i}]')}: accelerator ranks {ident(g)} ({g[value]!r}) where cpu ranks {ident(w)} ({w[value]!r}); not a tie")


def compare_topk(got: dict, want: dict, path: str) -> None:
    """Key indices may differ only between weights that tie (zeros of a causal row, above all)."""
    for key in sorted((got.keys() | want.keys()) - {"indices"}):
        compare(got.get(key), want.get(key), f"{path}.{key}")
    for key in ("format", "dtype", "shape"):
        compare(got["indices"][key], want["indices"][key], f"{path}.indices.{key}")
    gi, wi, wv = decoded(got["indices"]), decoded(want["indices"]), decoded(want["values"])
    for r, j in np.argwhere(gi != wi):
        same_value = np.abs(wv[r] - wv[r, j]) <= ATOL
        ok = gi[r, j] in wi[r][same_value] or (same_value[-1] and gi[r, j] not in wi[r])
        assert ok, f"{at(path, f'.indices[{r}][{j}]')}: accelerator {gi[r, j]} != cpu {wi[r, j]}, and their weights do not tie"


def compare_heads_table(got: dict, want: dict, path: str) -> None:
    """Tags are thresholds on stats: one may flip only where its stat sits on the threshold."""
    for key in sorted((got.keys() | want.keys()) - {"rows"}):
        compare(got.get(key), want.get(key), f"{path}.{key}")
    assert len(got["rows"]) == len(want["rows"]), f"{at(path, '.rows')}: {len(got['rows'])} != {len(want['rows'])}"
    rules = want["thresholds"]
    for i, (g, w) in enumerate(zip(got["rows"], want["rows"])):
        where = f"{path}.rows[{i}]"
        compare({k: v for k, v in g.items() if k != "tags"}, {k: v for k, v in w.items() if k != "tags"}, where)
        for tag in set(g["tags"]) ^ set(w["tags"]):
            rule = rules.get(tag)
            assert rule is not None and close(w["stats"][rule["stat"]], rule["at_least"]), (
                f"{at(where, '.tags')}: accelerator {g['tags']} != cpu {w['tags']} ({tag!r} is not on its threshold)")


def compare_flow(got: dict, want: dict, path: str) -> None:
    """Edges are pruned at the threshold: one near it may be kept on one side only."""
    for key in sorted((got.keys() | want.keys()) - {"edges"}):
        compare(got.get(key), want.get(key), f"{path}.{key}")
    key = lambda e: (e["layer"], e["source"], e["target"], e["head"] is None)  # noqa: E731
    g, w = {key(e): e for e in got["edges"]}, {key(e): e for e in want["edges"]}
    for k in sorted(g.keys() | w.keys()):
        where = f"{path}.edges{list(k)}"
        if k in g and k in w:
            compare(g[k], w[k], where)
        else:
            lone = g.get(k) or w[k]
            assert close(lone["weight"], want["threshold"]), (
                f"{at(where)}: only the {'accelerator' if k in g else 'cpu'} has it, weight {lone['weight']} (threshold {want['threshold']})")


def compare(got, want, path: str = "") -> None:
    """JSON answers: dicts key by key (VOLATILE skipped), lists element-wise, floats within
    ATOL + RTOL·|cpu|, everything else exactly. Messages name the path and both values."""
    where = at(path)
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: accelerator {got!r} is not a dict like cpu's"
        if is_array(want):
            return compare_arrays(got, want, path)
        if {"values", "indices", "rest"} <= want.keys():
            return compare_topk(got, want, path)
        if {"rows", "thresholds"} <= want.keys():
            return compare_heads_table(got, want, path)
        if {"edges", "threshold"} <= want.keys():
            return compare_flow(got, want, path)
        keys_g, keys_w = got.keys() - VOLATILE, want.keys() - VOLATILE
        assert keys_g == keys_w, f"{where}: keys differ: accelerator only {sorted(keys_g - keys_w)}, cpu only {sorted(keys_w - keys_g)}"
        for key in want:
            if key not in VOLATILE:
                compare(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list), f"{where}: accelerator {got!r} is not a list like cpu's"
        ranked = next((v for v in RANKED_BY if want and all(isinstance(x, dict) and v in x for x in want)), None)
        if ranked:
            return compare_ranked(got, want, path, ranked)
        assert len(got) == len(want), f"{where}: accelerator has {len(got)} items, cpu {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            compare(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{where}: accelerator {got!r}, cpu {want!r}"
        assert close(got, want), f"{where}: accelerator {got!r} != cpu {want!r} (tolerance {ATOL + RTOL * abs(want):.3g})"
    else:  # ints, strings, bools, None: token ids, shapes, indices, tags
        assert type(got) is type(want) and got == want, f"{where}: accelerator {got!r} != cpu {want!r}"


# ---------------------------------------------------------------------------- the sweep
def post(acc, ref, path: str, body: dict):
    return both(acc, ref, "POST", f"/api/v1/{path}", json=body)


def get_run(acc, ref, run_id: str, route: str, **params):
    return both(acc, ref, "GET", f"/api/v1/runs/{run_id}{'/' + route if route else ''}", params=params)


def test_the_accelerator_app_runs_on_the_accelerator(acc, ref):
    # Otherwise a silent fallback to the CPU would make every parity below trivially true.
    for client, device in ((acc, ACCEL), (ref, "cpu")):
        models = client.get("/api/v1/models").json()["models"]
        assert [m["id"] for m in models] == list(MODELS)
        assert all(m["device"].split(":")[0] == device.split(":")[0] for m in models), models
    got, want = both(acc, ref, "GET", "/api/v1/models")
    compare(got.json(), want.json())


@pytest.mark.parametrize("fmt", ["json", "f16", "u8"])
@pytest.mark.parametrize("model", MODELS)
def test_attention_in_each_format(acc, ref, model, fmt):
    got, want = post(acc, ref, "attention", {"text": text_for(f"post {fmt}"), "model": model, "format": fmt})
    body = assert_parity(got, want)
    # A quantising server keeps the run as the bytes it sent; the CPU keeps float32 for any format.
    assert (body["precision"], want.json()["precision"]) == (fmt, "json")


@pytest.mark.parametrize("model", MODELS)
def test_every_measure_and_predictions_in_the_answer(acc, ref, model):
    body = {"text": text_for("measures"), "model": model, "format": "f16", "measures": MEASURES}
    got = assert_parity(*post(acc, ref, "attention", body))
    assert set(got["measures"]) == set(MEASURES)
    asked = body | {"predictions": {"top_k": 5}}
    got, want = post(acc, ref, "attention", asked)
    if model in CAUSAL:
        assert len(assert_parity(got, want)["predictions"]) == len(got.json()["tokens"])
    else:  # no language-model head: both refuse alike
        assert got.status_code == want.status_code == 422 and got.json() == want.json()


@pytest.mark.parametrize("model", MODELS)
def test_a_padded_batch(acc, ref, model):
    # Two lengths: the shorter row is padded and masked in the one forward.
    texts = ["Short text.", text_for("batch")]
    got = assert_parity(*post(acc, ref, "attention/batch", {"texts": texts, "model": model, "format": "f16"}))
    lengths = [len(r["tokens"]) for r in got["results"]]
    assert lengths[0] < lengths[1]


@pytest.fixture(scope="module")
def dense_runs(acc, ref):
    """One float32 run per model on each server (posted as json), for the run routes."""
    runs = {}
    for model in MODELS:
        got, want = post(acc, ref, "attention", {"text": text_for("routes"), "model": model, "format": "json"})
        assert_parity(got, want)
        runs[model] = got.json()["run_id"], want.json()["run_id"]
    return runs


# (route, params); head and layer indices within the smallest model's (tiny-llama: 2 layers, 4 heads)
ROUTES = {
    "run": ("", {}),
    "slice": ("attention", {"layers": "0,1", "heads": "1,3", "format": "json"}),
    "slice-u8": ("attention", {"layers": "1", "format": "u8"}),
    "tile": ("tile", {"layer": 1, "head": 2, "q0": 2, "q1": 15, "k0": 0, "k1": 12, "format": "json"}),
    "tile-mean-pooled": ("tile", {"layer": 0, "head": "mean", "rows": 5, "cols": 4, "pool": "mean", "format": "f16"}),
    "topk": ("topk", {"layer": 1, "head": 0, "k": 4, "format": "json"}),
    "overview": ("overview", {"format": "json"}),
    "mean": ("mean", {"layers": "0,1", "format": "json"}),
    "measures": ("measures", {"names": ",".join(MEASURES), "format": "u8"}),
    "measures-json": ("measures", {"names": ",".join(MEASURES), "layers": "1", "heads": "0,3", "format": "json"}),
    "flow": ("flow", {"threshold": 0.05}),
    "neuron": ("neuron", {"layer": 1, "head": 1, "query": 3}),
    "logit-attribution": ("logit-attribution", {"position": 5, "top": 4096}),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model", MODELS)
def test_run_routes(acc, ref, dense_runs, model, route):
    path, params = ROUTES[route]
    acc_id, ref_id = dense_runs[model]
    got = acc.get(f"/api/v1/runs/{acc_id}{'/' + path if path else ''}", params=params)
    want = ref.get(f"/api/v1/runs/{ref_id}{'/' + path if path else ''}", params=params)
    if route == "logit-attribution" and model not in CAUSAL:  # needs a pre-norm LM head
        assert got.status_code == want.status_code == 422 and got.json() == want.json()
        return
    assert_parity(got, want, route)


@pytest.mark.parametrize("model", MODELS)
def test_a_run_kept_as_u8_on_the_accelerator_serves_only_u8_views(acc, ref, model):
    """README "GPU.": a u8 answer's run stays as its bytes on a quantising server, so more precise
    slices, tiles, top-k and overviews are a 422 kept_quantised there; the CPU serves them. The
    measures and /mean read the captured forward's float32 weights, so they still agree."""
    got, want = post(acc, ref, "attention", {"text": text_for("kept u8"), "model": model, "format": "u8"})
    assert_parity(got, want)
    run_id = got.json()["run_id"]
    acc_info, ref_info = get_run(acc, ref, run_id, "")
    assert (acc_info.json()["precision"], ref_info.json()["precision"]) == ("u8", "json")
    views = [("attention", {"layers": "0"}), ("tile", {"layer": 0, "head": 1}), ("tile", {"layer": 1, "head": "mean"}),
             ("topk", {"layer": 0, "head": 1, "k": 3}), ("overview", {})]
    for route, params in views:
        for fmt in ("json", "f16"):
            refused, served = get_run(acc, ref, run_id, route, **params, format=fmt)
            assert served.status_code == 200, (route, fmt, served.text)
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "kept_quantised", (route, fmt, refused.text)
        assert_parity(*get_run(acc, ref, run_id, route, **params, format="u8"), f"{route} u8")
    for route, params in (("measures", {"names": ",".join(MEASURES), "format": "json"}), ("mean", {"format": "json"}),
                          ("flow", {}), ("neuron", {"layer": 0, "head": 0, "query": 2})):
        assert_parity(*get_run(acc, ref, run_id, route, **params), route)


def experiments(model: str) -> dict[str, dict]:
    text = text_for("experiment")
    return {
        "ablate": {"text": text, "model": model, "ablate": [{"layer": 0, "head": 1}, {"layer": 1, "head": 2, "mode": "mean"}],
                   "top_k": 3, "attention": {"layers": [1], "format": "u8"}},
        "change-token": {"text": text, "model": model, "index": 3, "change": "delete", "difference": {"format": "f16"}},
        "change-token-mask": {"text": text, "model": model, "index": 3, "change": "mask" if model == "minilm" else "unk",
                              "difference": {"heads": [0, 2], "format": "u8"}},
        "compare": {"text_a": text, "text_b": text.replace("old", "new"), "model": model,
                    "difference": {"layers": [0], "heads": [0, 1], "format": "json"}},
    }


@pytest.mark.parametrize("kind", list(experiments("minilm")))
@pytest.mark.parametrize("model", MODELS)
def test_experiments(acc, ref, model, kind):
    body = experiments(model)[kind]
    got, want = post(acc, ref, f"experiments/{kind.removesuffix('-mask')}", body)
    if want.status_code == 422:  # a byte-level model has no mask or unknown token: refused alike
        assert kind == "change-token-mask" and model != "minilm"
        assert got.status_code == 422 and got.json() == want.json()
        return
    answer = assert_parity(got, want, kind)
    assert answer["ranking"], "an experiment that moves nothing compares nothing"


def generated(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


@pytest.mark.parametrize("model", CAUSAL)
def test_greedy_generation(acc, ref, model):
    body = {"text": "In the beginning God created", "model": model, "max_new_tokens": 6, "alternatives": 4}
    got, want = post(acc, ref, "generate", body)
    got, want = generated(got), generated(want)
    # Greedy decoding must pick the very same tokens: a flip would change everything after it.
    assert [s["token"]["id"] for s in got if s["type"] == "step"] == [s["token"]["id"] for s in want if s["type"] == "step"]
    assert want[-1] == {"type": "end", "reason": "length", "tokens": 6}
    compare(got, want)


def long_text(n_chars: int) -> str:
    rng = random.Random(0)
    words = "the heron waited by the old stone mill while boats went past under green trees in warm light".split()
    return " ".join(rng.choice(words) for _ in range(n_chars))[:n_chars]


@pytest.fixture(scope="module")
def long_run(acc, ref):
    # tiny-llama is byte-level (one token a byte, no special tokens): 1,500 characters, 1,500 tokens,
    # over dense_max_tokens (1,024), kept as queries and keys on both servers.
    body = {"text": long_text(1500), "model": "tiny-llama", "keep": "qk", "format": "u8"}
    got = assert_parity(*post(acc, ref, "attention", body), "long post")
    assert got["kept"] == "qk" and got["attention"] is None and len(got["tokens"]) == 1500
    return got["run_id"], len(got["tokens"])


@pytest.mark.parametrize("view", ["run", "tile-window", "tile-pooled", "tile-mean", "topk", "overview", "overview-u8"])
def test_long_context_views(acc, ref, long_run, view):
    run_id, n = long_run
    route, params = {
        "run": ("", {}),
        "tile-window": ("tile", {"layer": 1, "head": 3, "q0": n - 100, "q1": n, "k0": n - 300, "k1": n, "format": "json"}),
        "tile-pooled": ("tile", {"layer": 0, "head": 1, "rows": 64, "cols": 64, "pool": "max", "format": "f16"}),
        "tile-mean": ("tile", {"layer": 1, "head": "mean", "rows": 48, "cols": 40, "pool": "mean", "format": "json"}),
        "topk": ("topk", {"layer": 1, "head": 2, "k": 8, "q0": n - 500, "q1": n, "format": "json"}),
        "overview": ("overview", {"format": "json"}),
        "overview-u8": ("overview", {"format": "u8"}),
    }[view]
    got = assert_parity(*get_run(acc, ref, run_id, route, **params), view)
    if view == "run":
        assert got["kept"] == "qk" and got["n_tokens"] == n


# ---------------------------------------------------------------------------- the comparer itself
# On the CPU both apps answer alike, so these are what shows the sweep can fail at all.
def u8_node(values: list[int], scale: float = 1 / 255) -> dict:
    return {"format": "u8", "dtype": "uint8", "shape": [len(values)], "scale": scale,
            "data": base64.b64encode(bytes(values)).decode()}


def test_the_comparer_names_the_cell_that_differs():
    want = {"attention": {"format": "json", "dtype": "float32", "shape": [2, 2], "data": [[0.5, 0.5], [0.25, 0.75]]}}
    got = json.loads(json.dumps(want))
    compare(got, want)
    got["attention"]["data"][1][0] += 0.01
    with pytest.raises(AssertionError, match=r"attention\.data\[1\]\[0\]: accelerator 0\.26 != cpu 0\.25"):
        compare(got, want)


def test_the_comparer_allows_one_u8_count_and_no_more():
    compare(u8_node([10, 200]), u8_node([11, 199]))
    with pytest.raises(AssertionError, match=r"data\[1\]"):
        compare(u8_node([10, 202]), u8_node([10, 200]))


def test_the_comparer_lets_ranked_items_swap_only_on_a_tie():
    want = [{"id": 1, "prob": 0.5}, {"id": 2, "prob": 0.5}, {"id": 3, "prob": 0.1}]
    compare([want[1], want[0], want[2]], want, "predictions")
    with pytest.raises(AssertionError, match="predictions"):
        compare([want[0], {"id": 4, "prob": 0.1}, {"id": 3, "prob": 0.1}], want, "predictions")
    heads = [{"layer": 0, "head": 1, "contribution": 0.3}, {"layer": 1, "head": 0, "contribution": -0.3},
             {"layer": 0, "head": 0, "contribution": 0.1}]
    compare([heads[1], heads[0], heads[2]], heads, "heads")  # a tie in size, up and down
    with pytest.raises(AssertionError, match="heads"):
        compare([heads[0], heads[2], heads[1]], heads, "heads")


def test_the_comparer_refuses_extra_keys_and_other_types():
    with pytest.raises(AssertionError, match="keys differ"):
        compare({"a": 1, "b": 2}, {"a": 1})
    with pytest.raises(AssertionError, match="accelerator '1' != cpu 1"):
        compare({"a": "1"}, {"a": 1})
    compare({"a": 1, "run_id": "x", "timing_ms": {}}, {"a": 1, "run_id": "y"})  # volatile keys are skipped
