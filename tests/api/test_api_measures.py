"""The measures over HTTP: each value equals the Python function's on the same run, in every
format; bad input is a clear 4xx."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from manyeyes.app.config import Settings
from manyeyes.model import Capture, load
from manyeyes.model import measures as m
from manyeyes.model.analysis import value_weighted_norms
from tests.api.conftest import decode, serve

TEXT = "The cat sat on the mat. The cat sat on"
PAIR = ("Where is the riverbank?", "On the other side.")
# Small enough that a json value-norms answer for tiny-gpt overflows it, large enough for rollout.
JSON_CELLS = 5_000


@pytest.fixture(scope="module")
def client():
    c = serve(Settings(models={"tiny-gpt": "tiny-gpt", "minilm": "minilm"}, device="cpu", max_wait_ms=5,
                       max_json_cells=200_000))
    yield c
    c.__exit__(None, None, None)


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt", device="cpu")


@pytest.fixture(scope="module")
def minilm():
    return load("minilm", device="cpu")


def post(client, **body):
    r = client.post("/api/v1/attention", json={"model": "tiny-gpt", **body})
    assert r.status_code == 200, r.text
    return r.json()


def decoded(matrix: dict) -> np.ndarray:
    if matrix["format"] == "u8":  # measures carry their own affine map
        raw = decode({**matrix, "scale": 1.0})
        return matrix["offset"] + raw * matrix["scale"]
    return decode(matrix)


def test_word_texts_name_each_character_once_on_byte_level_models(client):
    """Each byte piece of a multi-byte character carries the whole character: the word view's
    texts read "naïïve", " 🙂🙂🙂🙂" and " caféé" on tiny-gpt (the page's word labels too)."""
    text = "naïve 🙂 café\tnaïve"
    for model, ends in (("tiny-gpt", []), ("minilm", ["[CLS]", "[SEP]"])):
        body = post(client, model=model, text=text, format="u8", measures=["words"])
        words = body["measures"]["words"]["words"]
        assert [w["text"] for w in words if not w["special"]] == ["naïve", "🙂", "café", "naïve"], (model, words)
        assert [w["text"] for w in words if w["special"]] == ends


def test_post_measures_equal_the_python_functions(client, tiny):
    body = post(client, text=TEXT, format="json", measures=["rollout", "value_norms", "contributions", "words"])
    result = tiny.run([tiny.encode(TEXT)], Capture(qkv=True))[0]
    got = body["measures"]
    np.testing.assert_allclose(decoded(got["rollout"]), m.rollout(result.attention).numpy(), atol=1e-5)
    np.testing.assert_allclose(decoded(got["value_norms"]), value_weighted_norms(tiny, result).numpy(), atol=1e-5)
    found = m.contributions(tiny, result)
    np.testing.assert_allclose(decoded(got["contributions"]["norms"]), found.norms.numpy(), atol=1e-5)
    np.testing.assert_allclose(decoded(got["contributions"]["shares"]), found.shares.numpy(), atol=1e-5)
    np.testing.assert_allclose(decoded(got["contributions"]["bias_shares"]), found.bias_shares.numpy(), atol=1e-5)
    words, merged = m.merge_words(result.tokens, result.attention)
    assert [w["pieces"] for w in got["words"]["words"]] == [list(w.pieces) for w in words]
    np.testing.assert_allclose(decoded(got["words"]["attention"]), merged.numpy(), atol=1e-5)
    assert "heads" not in got and "predictions" not in body


@pytest.mark.parametrize("fmt", ["f16", "u8"])
def test_compact_formats_round_trip_signed_and_unbounded_values(client, tiny, fmt):
    body = post(client, text=TEXT, format=fmt, heads=[0, 1, 7], measures=["value_norms", "contributions"])
    result = tiny.run([tiny.encode(TEXT)], Capture(qkv=True))[0]
    norms = value_weighted_norms(tiny, result)[:, [0, 1, 7]].numpy()
    shares = m.contributions(tiny, result).shares[:, [0, 1, 7]].numpy()
    got_norms, got_shares = decoded(body["measures"]["value_norms"]), decoded(body["measures"]["contributions"]["shares"])
    assert got_norms.shape == norms.shape and got_shares.shape == shares.shape
    # f16: relative precision; u8: half a step of the measure's own range
    tol = (lambda x: 1e-3 * np.abs(x).max()) if fmt == "f16" else (lambda x: (x.max() - min(x.min(), 0)) / 255 / 2 + 1e-6)
    assert np.abs(got_norms - norms).max() <= tol(norms)
    assert np.abs(got_shares - shares).max() <= tol(shares)
    assert shares.min() < 0 or fmt == "f16"  # the u8 offset is exercised by a negative share


def test_head_table_tags_tiny_gpts_known_heads(client):
    body = post(client, text=TEXT, format="u8", measures=["heads"])
    rows = {(r["layer"], r["head"]): r for r in body["measures"]["heads"]["rows"]}
    assert len(rows) == 2 * 8
    assert "previous-token" in rows[0, 3]["tags"]
    assert "induction" in rows[1, 0]["tags"]
    assert rows[1, 0]["stats"]["induction"] >= body["measures"]["heads"]["thresholds"]["induction"]["at_least"]


def test_get_measures_serves_the_same_values_as_post(client):
    body = post(client, text=TEXT, format="json", measures=["rollout", "heads"])
    again = client.get(f"/api/v1/runs/{body['run_id']}/measures", params={"names": "rollout,heads"}).json()
    assert again["measures"] == body["measures"]
    sliced = client.get(f"/api/v1/runs/{body['run_id']}/measures",
                        params={"names": "value_norms", "layers": "1", "heads": "0,2"}).json()
    full = client.get(f"/api/v1/runs/{body['run_id']}/measures", params={"names": "value_norms"}).json()
    np.testing.assert_allclose(decoded(sliced["measures"]["value_norms"]),
                               decoded(full["measures"]["value_norms"])[1:2][:, [0, 2]], atol=1e-7)
    assert (sliced["layers"], sliced["heads"]) == ([1], [0, 2])
    twice = client.get(f"/api/v1/runs/{body['run_id']}/measures", params={"names": "rollout,rollout"}).json()
    assert list(twice["measures"]) == ["rollout"]


def test_flow_edges_equal_information_flow(client, tiny):
    run_id = post(client, text=TEXT, format="u8")["run_id"]
    got = client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": 0.1}).json()
    _, edges = m.information_flow(tiny, TEXT, threshold=0.1)
    assert [(e["layer"], e["source"], e["target"], e["head"]) for e in got["edges"]] == [
        (e.layer, e.source, e.target, e.head) for e in edges]
    np.testing.assert_allclose([e["weight"] for e in got["edges"]], [e.weight for e in edges], atol=1e-5)
    assert got["n_layers"] == 2 and all(e["weight"] >= 0.1 for e in got["edges"])


def test_flow_threshold_is_a_decimal_number(client):
    """pydantic alone read "0.1_0" (Python's digit grouping), "+0.1" and " 0.1 " as 0.1 (a review by use)."""
    run_id = post(client, text=TEXT, format="u8")["run_id"]
    for bad in ("0.1_0", "+0.1", " 0.1 ", "0x1p-3", "\u0660.1", "1e"):
        r = client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": bad})
        assert r.status_code == 422 and "threshold" in r.text and "decimal" in r.text, (bad, r.text)
    for good, value in (("0.1", 0.1), (".25", 0.25), ("1e-1", 0.1), ("1", 1.0), ("0.50", 0.5)):
        r = client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": good})
        assert r.status_code == 200 and r.json()["threshold"] == value, (good, r.text)


def test_a_runs_flow_graph_is_made_once_per_threshold(client, monkeypatch):
    """The page asks for the same graph each time its flow view opens: 4-14 s at T=507 each time."""
    made = []
    real = m.flow_edges
    monkeypatch.setattr(m, "flow_edges", lambda *args: made.append(args[-1]) or real(*args))
    run_id = post(client, text="Each flow is made once.", format="u8")["run_id"]
    first = client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": 0.2}).json()
    assert client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": 0.2}).json() == first
    other = client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": 0.3}).json()
    assert made == [0.2, 0.3] and other["threshold"] == 0.3 and len(other["edges"]) <= len(first["edges"])
    # Within their byte budget: with room for one graph, the older is made again.
    from manyeyes.app.services import measures as service_module

    monkeypatch.setattr(service_module, "FLOW_CACHE_BYTES", len(orjson.dumps(first)) + 10)
    client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": 0.4})
    client.get(f"/api/v1/runs/{run_id}/flow", params={"threshold": 0.2})
    assert made == [0.2, 0.3, 0.4, 0.2]


def test_neuron_view_equals_the_python_function(client, tiny):
    run_id = post(client, text=TEXT, format="u8")["run_id"]
    got = client.get(f"/api/v1/runs/{run_id}/neuron", params={"layer": 1, "head": 0, "query": 9}).json()
    view = m.neuron_view(tiny, tiny.run([tiny.encode(TEXT)], Capture(qkv=True))[0], 1, 0, 9)
    assert (got["kv_head"], got["n_kv_heads"], got["query_index"]) == (0, 8, 9)
    for name in ("query", "keys", "products", "weights", "values"):
        np.testing.assert_allclose(got[name], getattr(view, name).numpy(), atol=1e-5)
    scores = view.scores.numpy()
    assert got["scores"][10:] == [None] * (len(scores) - 10)  # later keys are masked: null, not -inf
    np.testing.assert_allclose(got["scores"][:10], scores[:10], atol=1e-5)
    assert math.isclose(sum(got["weights"]), 1.0, abs_tol=1e-5)
    # Weights keep six significant digits, however small: six decimals read 4.6e-7 as 0.
    np.testing.assert_allclose(got["weights"], view.weights.numpy(), rtol=5e-6, atol=0)


def test_logit_attribution_equals_the_python_function_and_adds_up(client, tiny):
    run_id = post(client, text=TEXT, format="u8")["run_id"]
    got = client.get(f"/api/v1/runs/{run_id}/logit-attribution", params={"position": 12, "top": 16}).json()
    want = m.logit_attribution(tiny, TEXT, 12)
    assert got["target"] == want.target and got["target_text"] == tiny.tokenizer.token_text(want.target)
    assert abs(got["logit"] - want.logit) < 1e-4 and abs(got["total"] - got["logit"]) < 1e-4
    assert [(h["layer"], h["head"]) for h in got["heads"]] == [(l_, h_) for l_, h_, _ in want.ranked_heads()]
    np.testing.assert_allclose([h["contribution"] for h in got["heads"]], [c for _, _, c in want.ranked_heads()], atol=1e-5)
    chosen = client.get(f"/api/v1/runs/{run_id}/logit-attribution", params={"position": 12, "target": 101, "top": 3}).json()
    assert chosen["target"] == 101 and len(chosen["heads"]) == 3


def test_a_position_past_the_run_names_the_runs_length_not_the_models(client):
    """It said "model tiny-gpt has positions 0..12": the model takes 256; the run has 13."""
    run_id = post(client, text="In the beginning God", format="u8")["run_id"]
    n = len(client.get(f"/api/v1/runs/{run_id}").json()["tokens"])
    for route, params, what in (("logit-attribution", {"position": n}, "position"),
                                ("neuron", {"layer": 0, "head": 0, "query": n}, "query position")):
        r = client.get(f"/api/v1/runs/{run_id}/{route}", params=params)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"] == f"{what} {n} does not exist: this run of {n} tokens has {what}s 0..{n - 1}"


def test_a_pair_on_a_bert_keeps_its_segments_in_the_capture(client, minilm):
    """The capture re-runs the cached tokens: type ids must come back from their segments."""
    body = client.post("/api/v1/attention", json={"model": "minilm", "text": PAIR[0], "text_pair": PAIR[1],
                                                  "format": "f16", "measures": ["value_norms"]}).json()
    result = minilm.run([minilm.encode(*PAIR)], Capture(qkv=True))[0]
    want = value_weighted_norms(minilm, result).numpy()
    assert np.abs(decoded(body["measures"]["value_norms"]) - want).max() <= 1e-3 * want.max()


def test_bad_input_is_a_clear_4xx(client):
    run_id = post(client, text=TEXT, format="u8")["run_id"]
    base = f"/api/v1/runs/{run_id}"
    cases = [
        (client.post("/api/v1/attention", json={"model": "tiny-gpt", "text": TEXT, "measures": ["flux"]}), 422, None),
        (client.post("/api/v1/attention", json={"model": "tiny-gpt", "text": TEXT, "measures": []}), 422, None),
        (client.get(f"{base}/measures", params={"names": "rollout,bogus"}), 422, None),  # the schema's pattern
        (client.get(f"{base}/measures", params={"names": ","}), 422, None),
        (client.get(f"{base}/measures", params={"names": "value_norms", "layers": "7"}), 422, "layer 7"),
        (client.get("/api/v1/runs/0123/measures", params={"names": "rollout"}), 404, "unknown or was evicted"),
        (client.get(f"{base}/flow", params={"threshold": 0}), 422, None),
        (client.get(f"{base}/flow", params={"threshold": "nan"}), 422, "written as a decimal"),  # not "less than or equal to 1"
        (client.get(f"{base}/neuron", params={"layer": 0, "head": 8, "query": 0}), 422, "head 8"),
        (client.get(f"{base}/neuron", params={"layer": 0, "head": 0, "query": 999}), 422, "query position 999"),
        (client.get(f"{base}/neuron", params={"layer": -1, "head": 0, "query": 0}), 422, None),
        (client.get(f"{base}/logit-attribution", params={"position": 99}), 422, "position 99"),
        (client.get(f"{base}/logit-attribution", params={"position": 0, "target": 257}), 422, "target"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        assert "error" in response.json() or status == 422
        if words:
            assert words in response.json()["error"]["message"]
    encoder = client.post("/api/v1/attention", json={"model": "minilm", "text": "Hi there", "format": "u8"}).json()
    refused = client.get(f"/api/v1/runs/{encoder['run_id']}/logit-attribution", params={"position": 1})
    assert refused.status_code == 422 and "language model" in refused.json()["error"]["message"]


def test_an_unknown_measure_name_is_named_in_the_422_not_shown_as_a_regex(client):
    # README: "an unknown measure ... is a 422 that names it"; the GET route answered with its
    # schema's regular expression, which named neither the bad name nor the good ones plainly.
    run_id = post(client, text=TEXT, format="u8")["run_id"]
    for names, bad in (("rollout,bogus", "'bogus'"), ("Rollout", "'Rollout'"), ("rollout,", "''")):
        r = client.get(f"/api/v1/runs/{run_id}/measures", params={"names": names})
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert message == (f"names: {bad} is not a measure; the measures are rollout, value_norms, contributions, "
                           "words, heads"), message
    pattern = client.get("/openapi.json").json()["paths"]["/api/v1/runs/{run_id}/measures"]["get"]["parameters"]
    assert any("rollout|value_norms" in str(p) for p in pattern)  # the schema still tells clients and fuzzers
    r = client.get(f"/api/v1/runs/{run_id}/measures", params={"names": "rollout,words"})
    assert r.status_code == 200 and set(r.json()["measures"]) == {"rollout", "words"}


def test_json_over_the_cell_budget_is_a_413():
    small = serve(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", max_json_cells=JSON_CELLS))
    try:
        run_id = small.post("/api/v1/attention", json={"text": TEXT, "format": "u8"}).json()["run_id"]
        ok = small.get(f"/api/v1/runs/{run_id}/measures", params={"names": "rollout"})
        assert ok.status_code == 200
        big = small.get(f"/api/v1/runs/{run_id}/measures", params={"names": "value_norms"})
        assert big.status_code == 413 and "format=u8" in big.json()["error"]["message"]
        assert small.get(f"/api/v1/runs/{run_id}/measures", params={"names": "value_norms", "format": "u8"}).status_code == 200
    finally:
        small.__exit__(None, None, None)


def test_capture_cache_counts_its_bytes(client):
    service = client.app.state.measures
    run_id = post(client, text="A fresh sentence for the capture cache.", format="u8", measures=["value_norms"])["run_id"]
    captured = service.captures.get(run_id)
    assert captured is not None
    r = captured.result
    expected = sum(t.numel() * 4 for t in [r.hidden, *r.queries, *r.keys, *r.values, *captured.inputs, captured.final,
                                            *captured.mixed, *captured.outputs])
    # neither the (T, vocab) logits nor a second copy of the weights is kept
    assert captured.nbytes == expected and r.logits is None and r.attention is None
    assert service.captures.nbytes <= service.captures.max_bytes
    run = client.app.state.service.cache.get(run_id)
    assert captured.with_weights(run).attention is run.attention


def test_grouped_query_attention_is_shown_honestly(tmp_path, bytelevel_tokenizer):
    """A random llama with 6 query heads over 2 key/value heads: query head 4 reads kv head 1, the
    same keys and values as head 3, and every number equals the Python functions'."""
    from tests.test_parity_decoders import save_random

    save_random(tmp_path, bytelevel_tokenizer, "llama", 3, num_key_value_heads=2)
    model = load(tmp_path, device="cpu")
    text = "The quick brown fox jumps over the lazy dog."
    gqa = serve(Settings(models={"gqa": str(tmp_path)}, device="cpu"))
    try:
        body = gqa.post("/api/v1/attention", json={"text": text, "format": "json", "measures": ["value_norms"]}).json()
        result = model.run([model.encode(text)], Capture(qkv=True))[0]
        np.testing.assert_allclose(decoded(body["measures"]["value_norms"]), value_weighted_norms(model, result).numpy(), atol=1e-5)
        base = f"/api/v1/runs/{body['run_id']}"
        four = gqa.get(f"{base}/neuron", params={"layer": 1, "head": 4, "query": 7}).json()
        three = gqa.get(f"{base}/neuron", params={"layer": 1, "head": 3, "query": 7}).json()
        assert (four["kv_head"], three["kv_head"], four["n_kv_heads"], four["n_heads"]) == (1, 1, 2, 6)
        assert four["keys"] == three["keys"] and four["values"] == three["values"] and four["query"] != three["query"]
        view = m.neuron_view(model, result, 1, 4, 7)
        np.testing.assert_allclose(four["keys"], view.keys.numpy(), atol=1e-5)
        np.testing.assert_allclose(four["weights"], view.weights.numpy(), atol=1e-5)
        dla = gqa.get(f"{base}/logit-attribution", params={"position": 7}).json()
        assert abs(dla["total"] - dla["logit"]) < 1e-4  # RMSNorm frozen at the run's scale
    finally:
        gqa.__exit__(None, None, None)


def test_flow_graphs_are_made_one_at_a_time_in_turns_across_clients(client):
    """A second flow while one was being made was a 429: one client asking again at once kept the
    route for good, and another's got 429 36 times in 36 (review h50a). They wait their turn, one
    graph at a time, round-robin across clients; a client past its share of waiting is a 429."""
    import asyncio

    service = client.app.state.measures
    runs = [post(client, text=f"{TEXT} {i}", format="u8")["run_id"] for i in range(4)]
    made, real = [], service._flow

    def flow(run, served, captured, threshold):
        made.append(run.run_id)
        return real(run, served, captured, threshold)

    service._flow = flow
    share, service.attention.queued.max_client_queue = service.attention.queued.max_client_queue, 3

    async def main():
        # A's three graphs asked first, then B's: B's is made after one more of A's, not after all.
        asked = [asyncio.create_task(service.flow(run_id, 0.02, "a")) for run_id in runs[:3]]
        await asyncio.sleep(0)
        asked.append(asyncio.create_task(service.flow(runs[3], 0.02, "b")))
        await asyncio.sleep(0)
        try:
            await service.flow(runs[3], 0.03, "a")  # a fourth of A's: past its share
        except Exception as exc:  # noqa: BLE001
            refused = exc
        return refused, await asyncio.gather(*asked)

    try:
        refused, replies = client.portal.call(main)
    finally:
        service._flow = real
        service.attention.queued.max_client_queue = share
    assert made == [runs[0], runs[1], runs[3], runs[2]], made
    assert type(refused).__name__ == "QueueFull" and "its share" in str(refused)
    assert all(reply.body for reply in replies) and service.attention.queued.waiting == 0


def test_one_graph_and_one_capture_serve_every_request_for_them_at_once(client):
    """Each request waiting its turn made the same flow graph again (a class opening one link: one
    graph a student), and a request waiting for another's capture of its run held a render slot
    idle for the capture's length (h50g)."""
    import asyncio
    import threading

    service = client.app.state.measures
    run_id = post(client, text=f"{TEXT} once", format="u8")["run_id"]
    made, real_flow, real_capture = [], service._flow, service._capture
    gate = threading.Event()

    def flow(run, served, captured, threshold):
        made.append(threshold)
        return real_flow(run, served, captured, threshold)

    def capture(run, served):
        gate.wait(30)
        return real_capture(run, served)

    service._flow, service._capture = flow, capture
    renders = service.attention.renders

    async def main():
        first = asyncio.create_task(service.measures(run_id, ["value_norms"], None, None, "f16", "a"))
        while run_id not in service._capturing:
            await asyncio.sleep(0.01)
        others = [asyncio.create_task(service.flow(run_id, 0.05, "b")) for _ in range(4)]
        await asyncio.sleep(0.3)
        free = renders.free  # the capture's slot taken; no waiter in the other
        gate.set()
        replies = await asyncio.gather(first, *others)
        return free, replies

    total = renders.free
    try:
        free, replies = client.portal.call(main)
    finally:
        service._flow, service._capture = real_flow, real_capture
        gate.set()
    assert free == total - 1, (free, total)
    assert made == [0.05] and len({bytes(b"".join(r.body)) for r in replies[1:]}) == 1


def test_a_flow_graph_whose_client_hung_up_is_kept_for_those_waiting_and_later(client):
    """The graph of a request cancelled while it was being made (its client hung up) was made all
    the same, then thrown away: a request waiting for it made it again, and so did the next one
    (4-10 s each at T=507; review h55b)."""
    import asyncio
    import threading

    service = client.app.state.measures
    run_id = post(client, text=f"{TEXT} hung up", format="u8")["run_id"]
    made, real_flow = [], service._flow
    started, gate = threading.Event(), threading.Event()

    def flow(run, served, captured, threshold):
        made.append(threshold)
        started.set()
        gate.wait(30)
        return real_flow(run, served, captured, threshold)

    service._flow = flow

    async def main():
        hung_up = asyncio.create_task(service.flow(run_id, 0.05, "a"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(service.flow(run_id, 0.05, "b"))
        await asyncio.sleep(0.05)
        hung_up.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        try:
            await hung_up
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the hung-up request was answered")
        first = await waiting
        later = await service.flow(run_id, 0.05, "c")
        return first, later

    try:
        first, later = client.portal.call(main)
    finally:
        service._flow = real_flow
        gate.set()
    assert made == [0.05]
    assert b"".join(first.body) == b"".join(later.body) and b'"edges":[' in b"".join(later.body)
    assert service._flows_making == {} and (run_id, 0.05) in service._flows


def test_simultaneous_requests_for_one_run_share_one_capture(client, monkeypatch):
    """The page asks for a run's flow, neuron view and value norms at once: more requests than
    capture slots, all answered, by one forward."""
    from concurrent.futures import ThreadPoolExecutor

    from manyeyes.app.services import measures as service_module

    run_id = post(client, text="Five requests, one capture, no 429.", format="u8")["run_id"]
    service = client.app.state.measures
    calls = []
    real = service_module.m.capture_stream

    def counted(model, encoded):
        calls.append(1)
        return real(model, encoded)

    monkeypatch.setattr(service_module.m, "capture_stream", counted)
    asked = ["flow", "neuron?layer=0&head=0&query=1", "measures?names=value_norms", "neuron?layer=1&head=2&query=3",
             "measures?names=contributions"]
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda path: client.get(f"/api/v1/runs/{run_id}/{path}"), asked))
    assert [r.status_code for r in answers] == [200] * 5, [r.text[:200] for r in answers]
    assert len(calls) == 1 and service._capturing == {}


def test_measures_join_a_json_answer_compressed_as_json_text_is(client):
    """Frames are the attention's wire; measures join a JSON answer, which is then compressed by
    the rules for JSON text (the attention routes' answers bypass GZipMiddleware)."""
    import gzip

    import zstandard

    body = {"model": "tiny-gpt", "text": TEXT, "format": "u8", "measures": ["rollout"]}
    plain = client.post("/api/v1/attention", json=body, headers={"Accept": "application/vnd.manyeyes.frame",
                                                                 "Accept-Encoding": "identity"})
    assert plain.status_code == 200 and "content-encoding" not in plain.headers
    assert plain.json()["measures"]["rollout"]["shape"] == [len(plain.json()["tokens"])] * 2
    for accept, encoding, decode in (("zstd, gzip", "zstd", zstandard.ZstdDecompressor().decompressobj().decompress),
                                     ("gzip", "gzip", gzip.decompress)):
        # Read raw: the test client would undo the compression itself.
        with client.stream("POST", "/api/v1/attention", json=body,
                           headers={"Accept": "application/vnd.manyeyes.frame", "Accept-Encoding": accept}) as r:
            raw = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["content-encoding"] == encoding and len(raw) < len(plain.content)
        sent = orjson.loads(decode(raw))
        assert sent["measures"] == plain.json()["measures"] and sent["attention"] == plain.json()["attention"]


def test_post_measures_are_of_the_run_just_computed_even_when_the_cache_keeps_none():
    """They looked the run up again by id: with MANYEYES_CACHE_BYTES=0 (or another client's runs
    evicting it meanwhile) the answer was a 404 telling the client to POST again."""
    api = serve(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False, cache_bytes=0))
    try:
        for names in (["rollout"], ["heads"], ["value_norms"]):
            r = api.post("/api/v1/attention", json={"text": TEXT, "model": "tiny-gpt", "format": "json", "measures": names})
            assert r.status_code == 200, r.text
            assert list(r.json()["measures"]) == names
    finally:
        api.__exit__(None, None, None)


def test_measures_and_means_take_a_render_slot(monkeypatch):
    """Each builds tensors the size of the run's weights off the loop with no limit of its own:
    16 value-norm requests at T=512 took RSS to 3.8 GB against a bound of 1.2 GB."""
    import threading
    import time

    from manyeyes.app.services.measures import MeasuresService

    api = serve(Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False, max_concurrent_renders=1))
    try:
        run_id = post(api, text=TEXT, model="tiny-gpt", format="u8")["run_id"]
        lock, active, most = threading.Lock(), [0], [0]
        real = MeasuresService._matrices

        def counted(self, *args):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            time.sleep(0.2)
            try:
                return real(self, *args)
            finally:
                with lock:
                    active[0] -= 1

        monkeypatch.setattr(MeasuresService, "_matrices", counted)
        urls = [f"/api/v1/runs/{run_id}/measures?names=rollout"] * 4 + [f"/api/v1/runs/{run_id}/mean"] * 2
        statuses = []
        threads = [threading.Thread(target=lambda u=u: statuses.append(api.get(u).status_code)) for u in urls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses == [200] * len(urls) and most[0] == 1
    finally:
        api.__exit__(None, None, None)
