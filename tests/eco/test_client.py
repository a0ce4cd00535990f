"""manyeyes.Client against a live `manyeyes serve` (tiny-gpt on the CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import torch
import pytest

from manyeyes import Client
from manyeyes.client import ConnectionFailed, GenerationFailed, InvalidRequest, ManyeyesError, NotFound, Overloaded, RemoteModel, RemoteToken
from tests.eco.conftest import free_port, live_server
from tests.servers import wait_until

TEXT = "In the beginning was the Word."


@pytest.fixture(scope="module")
def client(server):
    with Client(server) as c:
        yield c


@pytest.fixture(scope="module")
def local(tiny_gpt):
    return tiny_gpt.attend(TEXT).attention.numpy()


def test_models_are_typed(client):
    [model] = client.models()
    assert isinstance(model, RemoteModel)
    assert (model.id, model.causal, model.n_layers, model.n_heads, model.default) == ("tiny-gpt", True, 2, 8, True)
    assert model.sliding_windows == (None, None) and isinstance(hash(model), int)
    assert model.token_changes == ("delete",)  # tiny-gpt's bytes have no mask or unknown token
    # Built from a list (as JSON gives it), it keeps a tuple: still hashable.
    built = dataclasses.replace(model, sliding_windows=[None, 5])
    assert built.sliding_windows == (None, 5) and isinstance(hash(built), int)


@pytest.mark.parametrize("fmt, tol", [("json", 1e-5), ("f16", 1e-3), ("u8", 0.5 / 255 + 1e-6)])
def test_attention_decodes_to_the_models_weights(client, local, fmt, tol):
    r = client.attention(TEXT, format=fmt)
    assert r.format == fmt
    assert r.attention.dtype == np.float32 and r.attention.shape == local.shape
    np.testing.assert_allclose(r.attention, local, atol=tol, rtol=0)
    assert isinstance(r.tokens[0], RemoteToken) and "".join(t.text for t in r.tokens) == TEXT
    assert r.layers == [0, 1] and r.heads == list(range(8)) and r.causal


def test_a_results_repr_is_one_short_line(client):
    """A notebook shows a result by its repr: it printed every token and the whole array."""
    long = client.attention("word " * 40, format="u8")
    said = repr(long)
    assert "\n" not in said and len(said) < 300, said
    assert said == (f"RemoteResult(run {long.run_id!r} of 'tiny-gpt', 200 tokens ['w', 'o', 'r', …, 'd', ' '], "
                    "attention (2, 8, 200, 200) of layers [0, 1], heads 0..7, truncated=False)")
    picked = client.slice(long, layers=[1], heads=[0, 5, 6], format="u8")
    assert "attention (1, 3, 200, 200) of layers [1], heads [0, 5, 6]" in repr(picked)
    one = client.attention("a", format="u8", predictions=2)
    assert "1 token ['a']" in repr(one) and "predictions at 1 position," in repr(one)


def test_every_result_types_repr_is_one_short_line_that_says_what_it_holds(client):
    """Only RemoteResult's repr was short: a notebook cell ending in c.overview(r), c.neuron(...),
    c.measures(...), c.topk(...) or a generation's step printed every array (MiniLM at 502
    tokens: 27,766 characters over 521 lines for the overview)."""
    r = client.attention("word " * 50, format="u8")  # 250 tokens, near tiny-gpt's 256
    run = repr(r.run_id)
    step = next(iter(client.generate("word " * 40, 1)))
    said = {
        "GenerationStep": (step, f"GenerationStep(0 at position 200: {step.token!r}, 5 alternatives, attention (2, 8, 201))"),
        "RemoteNeuron": (client.neuron(r, 1, 2, 249), f"RemoteNeuron(run {run}, layer 1, head 2 (key/value head 2 of 8), "
                                                       "query 249 over 250 keys, head_dim 16, largest weight"),
        "RemoteMeasures": (client.measures(r, ["rollout", "heads", "contributions"]),
                           f"RemoteMeasures(run {run}, layers [0, 1], heads 0..7: rollout (250, 250), contributions ("),
        "RemoteTile": (client.tile(r, 0, 3, rows=64, cols=64),
                       f"RemoteTile(run {run}, layer 0, head 3, queries [0, 250) × keys [0, 250), values (63, 63), max-pooled)"),
        "RemoteTopK": (client.topk(r, 1, 5, k=4), f"RemoteTopK(run {run}, layer 1, head 5, top 4 keys of queries [0, 250), "
                                                   "values (250, 4))"),
        "RemoteOverview": (client.overview(r), f"RemoteOverview(run {run}, values (2, 8, "),
    }
    for name, (result, start) in said.items():
        text = repr(result)
        assert type(result).__name__ == name and text.startswith(start), text
        assert "\n" not in text and len(text) < 250, (name, len(text), text[:300])
    assert "head_table of 16 heads" in repr(said["RemoteMeasures"][0])


def test_slice_and_head_use_model_wide_indices(client, local):
    full = client.attention(TEXT)
    part = client.slice(full, layers=[1], heads=[0, 5], format="json")
    assert part.run_id == full.run_id and part.attention.shape == (1, 2, *local.shape[2:])
    np.testing.assert_allclose(part.head(1, 5), local[1, 5], atol=1e-5)
    with pytest.raises(KeyError, match="layer 0, head 5"):
        part.head(0, 5)


def test_an_evicted_run_is_recomputed_from_its_request(client, local):
    gone = dataclasses.replace(client.attention(TEXT, layers=[0]), run_id="f" * 32)
    with pytest.raises(NotFound) as err:
        client.slice(gone.run_id, layers=[1])
    assert err.value.status == 404 and err.value.code == "unknown_run"
    again = client.slice(gone, layers=[1], heads=[3], format="json")
    assert again.layers == [1] and again.heads == [3]
    np.testing.assert_allclose(again.head(1, 3), local[1, 3], atol=1e-5)


def test_batch_returns_one_result_per_text(client, tiny_gpt):
    texts = ["And God said.", "Let there be light."]
    results = client.attention_batch(texts, layers=[1], format="json")
    for text, r in zip(texts, results):
        np.testing.assert_allclose(r.attention[0], tiny_gpt.attend(text).attention[1].numpy(), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, code, words",
    [
        ({"model": "nope"}, NotFound, "unknown_model", "nope"),
        ({"layers": [7]}, InvalidRequest, "invalid_request", "layer"),
        ({"text": "   "}, InvalidRequest, "invalid_request", "whitespace"),
        ({"text": "x" * 400}, InvalidRequest, "too_long", "256"),
    ],
)
def test_errors_carry_the_servers_code_and_message(client, kwargs, error, code, words):
    with pytest.raises(error) as err:
        client.attention(**{"text": TEXT, **kwargs})
    assert err.value.code == code and words in err.value.message


def test_an_unreachable_server_is_a_typed_error():
    with Client(f"http://127.0.0.1:{free_port()}", timeout_s=2, max_retries=1) as c, pytest.raises(ConnectionFailed) as err:
        c.models()
    assert (err.value.code, c.retries) == ("network", 1) and "could not be reached (tried 2 times over 0.25 s)" in err.value.message
    assert not Client(f"http://127.0.0.1:{free_port()}", timeout_s=2).ready()


def test_a_server_slower_than_timeout_s_is_not_reported_unreachable():
    # A read timeout (a long flow graph, a busy server) said "could not be reached", which sends a
    # user looking for a server that is up, instead of at the client's own timeout_s.
    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    with Client("http://manyeyes.test", timeout_s=7.5, transport=httpx.MockTransport(slow)) as c, \
            pytest.raises(ConnectionFailed) as err:
        c.models()
    assert err.value.status == 0 and err.value.code == "timeout"
    assert err.value.message == ("http://manyeyes.test took longer than this client's timeout_s (7.5 s) to answer "
                                 "GET /api/v1/models; raise Client(timeout_s=...) for slow requests")


def test_the_api_key_is_sent_as_a_bearer_token():
    seen = {}

    def answer(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, json={"models": []})

    with Client("http://proxy", api_key="s3cret", transport=httpx.MockTransport(answer)) as c:
        assert c.models() == []
    assert seen["auth"] == "Bearer s3cret"


def test_an_api_key_is_sent_as_utf8_and_without_the_newline_a_key_file_ends_in():
    """A non-ASCII key (which the server takes: keys are UTF-8 on both sides) was a
    UnicodeEncodeError from httpx; "key\\n" read from a file failed locally as an illegal header and
    was reported as a server that closed the connection mid-request."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.raw[[k.lower() for k, _ in request.headers.raw].index(b"authorization")][1])
        return httpx.Response(200, json={"models": []})

    for key in ("ключ", "plain\n", "  plain  "):
        with Client("http://proxy", api_key=key, transport=httpx.MockTransport(answer)) as c:
            assert c.models() == []
    assert seen == ["Bearer ключ".encode("utf-8"), b"Bearer plain", b"Bearer plain"]
    for bad in ("two\nlines", "tab\tinside", "   "):
        with pytest.raises(ValueError, match="no control characters"):
            Client("http://proxy", api_key=bad, transport=httpx.MockTransport(answer))


def test_json_that_is_not_a_manyeyes_answer_is_a_typed_error_saying_so():
    """A proxy's login page or another service answering 200 with JSON of its own was a bare
    KeyError: 'models' (or 'attention')."""
    from manyeyes.client import ManyeyesError

    for foreign, said in (({"hello": 1}, "has no 'models'"), ([1, 2], "JSON but not an object (list)")):
        with Client("http://manyeyes.test", transport=httpx.MockTransport(lambda request: httpx.Response(200, json=foreign))) as c:
            with pytest.raises(ManyeyesError, match=re.escape(said)) as err:
                c.models()
            assert err.value.code == "unreadable" and "is base_url a manyeyes server" in err.value.message
            with pytest.raises(ManyeyesError, match="is base_url a manyeyes server"):
                c.attention("The bank.", format="json")
    with Client("http://manyeyes.test", transport=httpx.MockTransport(lambda request: httpx.Response(200, json={"a": 1}))) as c:
        with pytest.raises(ManyeyesError, match=r"^200 unreadable: the answer from http://manyeyes.test/api/v1/attention has no 'attention'"):
            c.attention("The bank.", format="json")


def test_wait_ready_stops_at_once_with_the_servers_reason_when_its_models_failed_to_load(monkeypatch):
    """It polled a server whose model could never load for the whole timeout (120 s by default),
    then said only "not ready after 120 s"; /readyz had said why from the start."""
    from manyeyes.client import NotReady

    monkeypatch.setattr("manyeyes.client.time.sleep", lambda s: None)
    polls = []
    reason = "model 'missing' is not in the Hugging Face cache and downloads are off"
    failed = httpx.MockTransport(lambda request: (polls.append(1), httpx.Response(
        503, json={"error": {"code": "not_ready", "message": reason}, "status": "failed", "models": {}}))[1])
    with Client("http://manyeyes.test", transport=failed) as c, pytest.raises(NotReady) as err:
        c.wait_ready(timeout_s=60)
    assert len(polls) == 1 and err.value.message == f"the server could not load its models: {reason}"
    loading = httpx.MockTransport(lambda request: httpx.Response(
        503, json={"error": {"code": "not_ready", "message": "models are still loading: tiny-gpt"}, "status": "loading"}))
    with Client("http://manyeyes.test", transport=loading) as c, pytest.raises(NotReady) as err:
        c.wait_ready(timeout_s=0.05, poll_s=0.01)
    assert err.value.message == "not ready after 0.05 s: models are still loading: tiny-gpt"


def test_ready_and_wait_ready_poll_once_each_time_even_when_told_to_come_back_later(monkeypatch):
    """README: ready() and wait_ready() poll on their own and try once each time. A proxy's 503 with
    Retry-After (or a 429) was retried up to max_retries times inside each poll: ready() took 10 s
    to say False, and with Retry-After: 30 it would have blocked for minutes."""
    from manyeyes.client import NotReady

    slept, polls = [], []
    monkeypatch.setattr("manyeyes.client.time.sleep", slept.append)
    def later(status):
        return httpx.MockTransport(lambda request: (polls.append(1), httpx.Response(
            status, headers={"Retry-After": "30"}, json={"error": {"code": "busy", "message": "come back later"}}))[1])

    for status in (503, 429):
        polls.clear()
        with Client("http://manyeyes.test", transport=later(status)) as c:
            assert c.ready() is False
            assert (len(polls), slept, c.retries) == (1, [], 0)
    # wait_ready spaces its polls by the Retry-After, never past its own timeout.
    clock = [0.0]
    monkeypatch.setattr("manyeyes.client.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("manyeyes.client.time.sleep", lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))
    polls.clear()
    with Client("http://manyeyes.test", transport=later(503)) as c, pytest.raises(NotReady):
        c.wait_ready(timeout_s=45, poll_s=0.2)
    assert len(polls) == 3 and slept == [30.0, 15.0], (polls, slept)


def test_a_generation_slower_than_timeout_s_is_a_timeout_not_a_broken_stream():
    class Stalls(httpx.SyncByteStream):
        def __iter__(self):
            yield b"\n"
            raise httpx.ReadTimeout("timed out")

    stalls = httpx.MockTransport(lambda request: httpx.Response(200, stream=Stalls(), headers={"content-type": "application/x-ndjson"}))
    with Client("http://manyeyes.test", transport=stalls) as c, pytest.raises(ConnectionFailed) as err:
        list(c.generate("hi", 5, model="tiny-gpt"))
    assert err.value.code == "timeout" and "raise Client(timeout_s=...)" in err.value.message


def test_a_401_is_its_own_error_type():
    from manyeyes.client import Unauthorized

    refuse = httpx.MockTransport(lambda request: httpx.Response(
        401, json={"error": {"code": "unauthorized", "message": "this server needs an API key"}}))
    with Client("http://locked", transport=refuse) as c, pytest.raises(Unauthorized) as err:
        c.models()
    assert (err.value.status, err.value.code) == (401, "unauthorized") and isinstance(err.value, ManyeyesError)


def test_429_is_retried_after_retry_after_then_raised():
    # Room for one input and a slow forward: a second request at the same time gets 429.
    with live_server(max_queue=1, debug_forward_delay_s=1.5, warmup="false") as base:
        results, errors = [], []

        def call(c: Client, text: str):
            try:
                results.append(c.attention(text))
            except Exception as exc:  # noqa: BLE001 (collected and asserted below)
                errors.append(exc)

        patient, impatient = Client(base), Client(base, max_retries=0)
        first = threading.Thread(target=call, args=(patient, "Blessed are the meek."))
        first.start()
        # Until the first input holds the queue's one place (a 0.7 s sleep raced it on a loaded machine).
        wait_until(lambda: re.search(r"manyeyes_queue_admitted\{[^}]*\} 1\.0", httpx.get(f"{base}/metrics", timeout=10).text),
                   30, "the first input to be admitted")
        with pytest.raises(Overloaded) as err:
            impatient.attention("And the earth was without form.")
        assert err.value.code == "queue_full" and err.value.retry_after_s >= 1
        call(patient, "And the earth was without form.")  # waits out Retry-After, then succeeds
        first.join()
        assert not errors and len(results) == 2 and patient.retries >= 1


@pytest.mark.parametrize("fmt, tol", [("json", 1e-5), ("f16", 1e-3), ("u8", 0.5 / 255 + 1e-6)])
def test_frames_and_the_json_form_decode_to_the_same_weights(server, local, fmt, tol):
    """The client asks for the binary frame by default and falls back to JSON when told to."""
    seen = []
    hooks = {"response": [lambda response: seen.append(response.headers.get("content-type", ""))]}
    with Client(server) as framed, Client(server, frames=False) as plain:
        framed.http.event_hooks = hooks
        plain.http.event_hooks = hooks
        a = framed.attention(TEXT, format=fmt)
        b = plain.attention(TEXT, format=fmt)
        c = framed.attention_batch([TEXT, "And the Word was God."], format=fmt)[0]
        d = framed.slice(a, layers=[1], heads=[2], format=fmt)
    # the JSON form is application/json, or application/vnd.manyeyes+json for the compact formats
    assert seen[0].startswith("application/vnd.manyeyes.frame") and "json" in seen[1]
    assert seen[2].startswith("application/vnd.manyeyes.frame") and seen[3].startswith("application/vnd.manyeyes.frame")
    np.testing.assert_array_equal(a.attention, b.attention)
    np.testing.assert_allclose(a.attention, local, atol=tol, rtol=0)
    np.testing.assert_array_equal(c.attention, a.attention)
    np.testing.assert_array_equal(d.head(1, 2), a.head(1, 2))


def test_predictions_come_typed_and_match_the_model(client, tiny_gpt):
    r = client.attention(TEXT, predictions=3)
    assert set(r.predictions) == set(range(len(r.tokens)))
    logits = tiny_gpt.attend(TEXT).logits  # (T, vocab)
    probs = torch.softmax(logits.double(), -1)
    for position, guesses in r.predictions.items():
        assert len(guesses) == 3 and guesses[0].prob >= guesses[1].prob >= guesses[2].prob
        assert guesses[0].id == int(logits[position].argmax())
        assert guesses[0].prob == pytest.approx(float(probs[position].max()), abs=1e-5)


def test_generate_yields_the_models_steps_and_hangs_up_when_dropped(client, tiny_gpt):
    from manyeyes.model.generate import generate

    generation = client.generate(TEXT, 6)
    assert generation.prompt is None  # nothing is sent before the first step is asked for
    steps = list(generation)
    expected = list(generate(tiny_gpt, TEXT, 6))
    assert [s.token.id for s in steps] == [e.token.id for e in expected]
    # The keys of each step's row: the prompt's tokens (the start line, which was dropped), then the steps'
    assert [(t.text, t.id, t.start, t.end) for t in generation.prompt] == [
        (t.text, t.id, t.start, t.end) for t in tiny_gpt.encode(TEXT).tokens]
    assert steps[0].position == len(generation.prompt) and steps[0].attention.shape[-1] == len(generation.prompt) + 1
    for got, want in zip(steps, expected):
        assert got.attention.shape == tuple(want.attention.shape)
        np.testing.assert_allclose(got.attention, want.attention.numpy(), atol=1e-6)
    first = next(iter(client.generate(TEXT, 50)))  # dropping the iterator closes the stream
    assert first.index == 0
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        next(iter(client.generate(TEXT, 10_000)))


def test_a_dropped_generation_hangs_up_at_once_not_when_the_collector_runs(client):
    """The stream's generator held the Generation that held it: a dropped Generation was closed
    by the cyclic garbage collector, at any moment, once inside httpx's pool lock while this
    thread's next request held it, which waited for that lock for good (a CI run hung 25 min)."""
    import gc

    gc.disable()
    try:
        generation = client.generate(TEXT, 50)
        next(generation)
        response = generation._stream.response
        del generation
        assert response.is_closed  # by reference counting, here, not by a collection later
    finally:
        gc.enable()


@pytest.mark.parametrize("reason, error", [("error", "generation stopped: out of memory"),
                                           ("shutdown", "the server is shutting down; generate again shortly")])
def test_a_generation_that_fails_mid_stream_raises_after_its_steps(reason, error):
    """A stream the server ended early for its shutdown ended the loop as if every token had come."""
    lines = [{"type": "start", "model": "tiny-gpt", "n_layers": 1, "n_heads": 1, "prompt": []},
             {"type": "step", "index": 0, "position": 3, "token": {"text": " a", "id": 7, "prob": 0.5},
              "alternatives": [], "attention": [[[0.25, 0.25, 0.25, 0.25]]]},
             {"type": "end", "reason": reason, "tokens": 1, "error": error}]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body, headers={"content-type": "application/x-ndjson"}))
    with Client("http://manyeyes.test", transport=transport) as mocked:
        steps = mocked.generate("Hi", 3)
        assert next(steps).token.id == 7
        with pytest.raises(GenerationFailed, match=error) as failed:
            next(steps)
    assert failed.value.code == "generation_failed"


def test_measures_flow_neuron_and_attribution_come_typed(client, tiny_gpt):
    from manyeyes.model.measures import head_table, information_flow, rollout

    r = client.attention(TEXT, format="u8", layers=[0])
    m = client.measures(r, ["rollout", "heads", "contributions"], format="f16")
    local = tiny_gpt.attend(TEXT)
    np.testing.assert_allclose(m.rollout, rollout(local.attention).numpy(), atol=2e-3)
    _, tags = head_table(tiny_gpt, local)
    assert {(row["layer"], row["head"]): row["tags"] for row in m.head_table}[(0, 3)] == tags[0][3]
    total = m.contributions["shares"].sum(axis=1) + m.contributions["bias_shares"]
    np.testing.assert_allclose(total, 1.0, atol=1e-2)
    edges = client.flow(r, threshold=0.2)
    _, expected = information_flow(tiny_gpt, TEXT, threshold=0.2)
    assert {(e.layer, e.source, e.target) for e in edges} == {(e.layer, e.source, e.target) for e in expected}
    # Typed, numpy, as the local measures read (they were the raw JSON dicts).
    from manyeyes.model.measures import logit_attribution

    view = client.neuron(r, layer=1, head=0, query=5)
    assert view.kv_head == 0 and view.weights.shape == (len(r.tokens),) and view.keys.shape[0] == len(r.tokens)
    assert np.isnan(view.scores[6:]).all() and not np.isnan(view.scores[:6]).any()  # later keys are masked
    np.testing.assert_allclose(view.weights, local.attention[1, 0, 5].numpy(), atol=1e-5)
    dla = client.logit_attribution(r, position=5, top=3)
    want = logit_attribution(tiny_gpt, TEXT, position=5)
    assert [(layer, head) for layer, head, _ in dla.heads] == [(layer, head) for layer, head, _ in want.ranked_heads()[:3]]
    assert dla.target == want.target and abs(dla.logit - want.logit) < 1e-4
    np.testing.assert_allclose(dla.mlps, want.mlps.numpy(), atol=1e-4)
    assert abs(dla.total - dla.logit) < 1e-3
    gone = dataclasses.replace(r, run_id="e" * 32)
    with pytest.raises(NotFound):
        client.measures(gone.run_id, ["rollout"])


def test_generate_retries_a_429_and_a_broken_stream_or_body_is_a_typed_error():
    """generate() sent its request past the retry loop (a 429 raised at once), a stream cut off
    raised httpx's own error, and a 200 that was not JSON raised json's."""
    start = {"type": "start", "model": "tiny-gpt", "n_layers": 1, "n_heads": 1, "prompt": []}
    asked = []

    def answer(request):
        asked.append(request.url.path)
        if request.url.path == "/api/v1/generate" and len(asked) == 1:
            return httpx.Response(429, json={"error": {"code": "queue_full", "message": "busy"}}, headers={"Retry-After": "0"})
        if request.url.path == "/api/v1/generate":
            return httpx.Response(200, text=json.dumps(start) + "\n" + json.dumps({"type": "end", "reason": "length", "tokens": 0}) + "\n")
        return httpx.Response(200, text="<html>not an API</html>")

    with Client("http://manyeyes.test", transport=httpx.MockTransport(answer)) as mocked:
        assert list(mocked.generate("Hi", 1)) == [] and mocked.retries == 1
        with pytest.raises(ManyeyesError, match="not JSON") as unreadable:
            mocked.models()
        assert unreadable.value.code == "unreadable"

    class CutOff(httpx.SyncByteStream):
        def __iter__(self):
            yield (json.dumps(start) + "\n").encode()
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    cut = httpx.MockTransport(lambda request: httpx.Response(200, stream=CutOff()))
    with Client("http://manyeyes.test", transport=cut) as mocked, pytest.raises(ConnectionFailed, match="broke off"):
        list(mocked.generate("Hi", 3))


def test_a_generation_stream_without_its_end_line_or_with_a_stray_line_is_a_typed_error():
    """A stream cut off cleanly after its first step (a proxy's timeout) was read as a whole, shorter
    generation: 1 of 5 steps and no error. A line that is no event raised json's own error."""
    start = {"type": "start", "model": "tiny-gpt", "n_layers": 1, "n_heads": 1, "prompt": []}
    step = {"type": "step", "index": 0, "position": 3, "token": {"text": " a", "id": 7, "prob": 0.5},
            "alternatives": [], "attention": [[[0.25, 0.25, 0.25, 0.25]]]}

    def serving(*lines):
        body = "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
        return httpx.MockTransport(lambda request: httpx.Response(200, text=body, headers={"content-type": "application/x-ndjson"}))

    with Client("http://manyeyes.test", transport=serving(start, step)) as mocked:
        steps = mocked.generate("Hi", 5)
        assert next(steps).token.id == 7
        with pytest.raises(ConnectionFailed, match="ended after 1 of 5 steps without the server's end line") as cut:
            next(steps)
    assert cut.value.code == "network"
    for stray in ("<html>sign in to the proxy</html>\n", "[1, 2]\n", '{"no": "type"}\n'):
        with Client("http://manyeyes.test", transport=serving(start, stray)) as mocked, \
                pytest.raises(ManyeyesError, match="not one of its events") as unreadable:
            list(mocked.generate("Hi", 5))
        assert unreadable.value.code == "unreadable" and type(unreadable.value) is ManyeyesError


def test_close_from_another_thread_hangs_up_and_ends_the_readers_loop_quietly():
    """close() while another thread waited in next() for the next step raised "generator already
    executing", and the stream went on to its end, its slot held all along."""
    with live_server(debug_forward_delay_s=0.3) as base, Client(base) as c:
        generation = c.generate(TEXT, 100, model="tiny-gpt")
        got, raised = [], []

        def read():
            try:
                for step in generation:
                    got.append(step.index)
            except BaseException as exc:  # noqa: BLE001  anything the loop raised is a failure here
                raised.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline and reader.is_alive(), raised
            time.sleep(0.01)
        time.sleep(0.1)  # the reader waits in next() for a step 0.3 s away
        generation.close()
        reader.join(2)
        assert not reader.is_alive() and raised == [] and 1 <= len(got) < 10
        with pytest.raises(StopIteration):
            next(generation)
        # The server saw the hang-up: its slot is free and it counted the generation cancelled.
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(f"{base}/metrics").text
            if 'manyeyes_generations_total{outcome="cancelled"} 1.0' in text and 'manyeyes_work_running{kind="generation"} 0.0' in text:
                break
            assert time.monotonic() < deadline, [line for line in text.splitlines() if "generation" in line]
            time.sleep(0.1)


def test_a_retry_after_that_is_not_a_number_of_seconds_waits_the_default_instead_of_crashing(monkeypatch):
    # "nan" parses as a float, and time.sleep(nan) raised ValueError out of the retry loop.
    slept = []
    monkeypatch.setattr("manyeyes.client.time.sleep", slept.append)
    answers = iter(["nan", "inf", "-3", "Wed, 21 Oct 2026 07:28:00 GMT", None])

    def answer(request):
        value = next(answers)
        if value is None:
            return httpx.Response(200, json={"models": []})
        return httpx.Response(429, json={"error": {"code": "queue_full", "message": "busy"}}, headers={"Retry-After": value})

    with Client("http://manyeyes.test", max_retry_wait_s=12.0, transport=httpx.MockTransport(answer)) as mocked:
        assert mocked.models() == []
    assert slept == [1.0, 12.0, 1.0, 1.0]  # the default, capped, 0 (as "0" always has) is the default, the default


def test_figures_say_a_kept_result_has_no_weights_to_draw(client):
    from manyeyes import figures

    result = client.attention("In the beginning", keep="qk")
    with pytest.raises(ValueError, match="kept queries and keys"):
        figures.heatmap(result, layer=0, head=0)


def test_a_run_id_stays_one_path_segment_and_an_empty_selection_is_refused():
    """slice("../../etc") asked for GET /api/etc/attention; layers=[] came back as every layer."""
    asked = []

    def answer(request):
        asked.append(request.url.raw_path.decode())
        return httpx.Response(404, json={"error": {"code": "unknown_run", "message": "unknown"}})

    with Client("http://manyeyes.test", transport=httpx.MockTransport(answer)) as mocked:
        with pytest.raises(NotFound):
            mocked.slice("../../etc", layers=[0])
        assert asked[0].startswith("/api/v1/runs/..%2F..%2Fetc/attention"), asked
        with pytest.raises(ValueError, match="layers is empty"):
            mocked.slice("abc", layers=[])


def test_a_string_or_a_bare_number_of_layers_or_heads_is_refused_not_read_digit_by_digit():
    """slice(r, layers="10") asked for layers 1 and 0 and answered them, without a word."""
    asked = []
    with Client("http://manyeyes.test", transport=httpx.MockTransport(lambda request: asked.append(request))) as mocked:
        for chosen in ({"layers": "10"}, {"heads": "11"}, {"layers": 1}, {"heads": b"1"}):
            with pytest.raises(TypeError, match=r"takes a list of numbers, such as \[1\] or range\(3\)"):
                mocked.slice("abc", **chosen)
            with pytest.raises(TypeError, match="takes a list of numbers"):
                mocked.measures("abc", "rollout", **chosen)
    assert asked == []


class Recording(httpx.HTTPTransport):
    def __init__(self):
        super().__init__()
        self.sent = []

    def handle_request(self, request):
        response = super().handle_request(request)
        self.sent.append((request.method, request.url.path, response.status_code))
        return response


def test_a_slice_more_precise_than_a_quantised_run_is_posted_again(local):
    """A GPU server keeps a u8 answer's run as its bytes and refuses a float32 slice of it (422
    kept_quantised): slice() raised it; given the result, it now posts the text again."""
    transport = Recording()
    with live_server(device_quantise="true") as base, Client(base, transport=transport) as client:
        coarse = client.attention(TEXT, format="u8")
        assert coarse.precision == "u8"
        fine = client.slice(coarse, layers=[1], heads=[2], format="json")
        np.testing.assert_allclose(fine.head(1, 2), local[1, 2], atol=1e-6, rtol=0)
        assert fine.precision == "json" and fine.run_id == coarse.run_id
        assert [(method, status) for method, _, status in transport.sent] == [("POST", 200), ("GET", 422), ("POST", 200)]
        # The run now held at float32 serves any format from the cache, asked through either result.
        for result in (coarse, fine):
            assert client.slice(result, layers=[0], format="f16").precision == "json"
            assert transport.sent[-1] == ("GET", f"/api/v1/runs/{coarse.run_id}/attention", 200)
        # A bare run id has no request to post again: the server's refusal is the caller's.
        with pytest.raises(InvalidRequest) as refused:
            client.slice(client.attention("Another text.", format="u8").run_id, format="f16")
        assert refused.value.code == "kept_quantised"


def test_an_evicted_run_is_posted_again_at_the_precision_its_tile_needs(local):
    """On a server that quantises on the device the re-post was always u8, so the default f16
    tile, top-k and overview of an evicted run were refused (422 kept_quantised)."""
    with live_server(device_quantise="true", cache_bytes=200_000) as base, Client(base) as client:
        result = client.attention(TEXT, format="f16")
        for i in range(12):  # other runs push it out of the 150 kB the cache holds
            client.attention(f"Run {i} pushes the first one out.", format="u8", layers=[0], heads=[0])
        with pytest.raises(NotFound):
            client.slice(result.run_id, layers=[0])
        tile = client.tile(result, 1, 2)
        np.testing.assert_allclose(tile.values, local[1, 2], atol=1e-3, rtol=0)
        # In the client's format, as tile's: json was refused (kept_quantised) by such a server.
        np.testing.assert_allclose(client.cell(result, 3, 1), local[:, :, 3, 1], atol=1e-3, rtol=0)
        assert client.topk(result, 1, 2, k=3).values.shape[-1] == 3
        assert client.overview(result).values.shape[:2] == local.shape[:2]


def test_the_client_imports_without_torch(tmp_path):
    """`from manyeyes import Client` imported torch (3.4 s) for a local model it never used."""
    import subprocess
    import sys

    # The errors come with it, as a notebook catches them: `from manyeyes import Overloaded`.
    probe = ("import sys; from manyeyes import Client, ManyeyesError, Overloaded, GenerationFailed; "
             "import manyeyes.client as c; assert Overloaded is c.Overloaded and issubclass(GenerationFailed, ManyeyesError); "
             "print(sorted(m for m in ('torch', 'tokenizers', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    from manyeyes import load  # the rest of the package's names still come from it

    assert load.__module__.startswith("manyeyes.model")


def test_head_of_a_kept_result_says_to_read_tiles_not_a_none_subscript():
    """r.head(1, 3) on a long run (kept queries and keys, attention None) raised TypeError:
    'NoneType' object is not subscriptable."""
    from manyeyes.client import RemoteResult

    kept = RemoteResult(run_id="9f1c", model="tiny-llama", causal=True, n_layers=2, n_heads=4, tokens=[], truncated=False,
                        layers=[0, 1], heads=[0, 1, 2, 3], attention=None, format=None, device="cpu", timing_ms={}, kept="qk")
    with pytest.raises(ValueError, match=r"run 9f1c kept queries and keys.*Client\.tile\(result, 1, 3"):
        kept.head(1, 3)


def test_wait_ready_on_an_unreachable_server_says_it_could_not_be_reached():
    """A wrong URL (or no server started) waited out timeout_s, then raised NotReady 503
    "not_ready", as if a server had answered that its models were loading."""
    with Client(f"http://127.0.0.1:{free_port()}", timeout_s=2) as c, pytest.raises(ConnectionFailed) as err:
        c.wait_ready(timeout_s=0.3, poll_s=0.05)
    assert (err.value.status, err.value.code) == (0, "network")
    assert err.value.message.startswith("not ready after 0.3 s: http://127.0.0.1:") and "could not be reached" in err.value.message


def test_numpy_indices_and_counts_go_into_request_bodies_as_plain_json(client, local):
    """np.argmax and friends give numpy integers: attention(layers=[np.int64(1)]),
    predictions=np.int64(2) or generate(text, np.int64(3)) raised "TypeError: Object of type int64
    is not JSON serializable" from inside httpx, while the GET routes took the same values."""
    layer, head = np.unravel_index(np.argmax(local[:, :, 3, 0]), local.shape[:2])  # np.int64s
    r = client.attention(TEXT, layers=[layer], heads=np.array([head]), format="json", predictions=np.int64(2))
    assert (r.layers, r.heads) == ([int(layer)], [int(head)])
    np.testing.assert_allclose(r.head(layer, head), local[layer, head], atol=1e-5)
    assert all(len(p) == 2 for p in r.predictions.values())
    [b] = client.attention_batch([TEXT], layers=range(1, 2), heads=[np.int32(4)], format="json")
    np.testing.assert_allclose(b.head(1, 4), local[1, 4], atol=1e-5)
    steps = list(client.generate(TEXT, np.int64(2), temperature=np.float32(0.0), alternatives=np.int8(1)))
    assert [s.index for s in steps] == [0, 1] and all(len(s.alternatives) == 1 for s in steps)


def test_numpy_arrays_of_layers_and_heads_go_into_query_strings(client, local):
    """slice(r, heads=np.array([0, 1])) and measures(..., layers=np.array(...)) raised "The truth
    value of an array with more than one element is ambiguous" before sending, where README says
    layers and heads may be numpy arrays and attention() took them."""
    r = client.attention(TEXT, format="json")
    part = client.slice(r, layers=np.array([0, 1]), heads=np.arange(0, 3), format="json")
    assert (part.layers, part.heads) == ([0, 1], [0, 1, 2])
    np.testing.assert_allclose(part.head(1, 2), local[1, 2], atol=1e-5)
    found = client.measures(r, ["value_norms"], layers=np.array([1]), heads=np.array([5, 7]))
    assert (found.layers, found.heads, found.value_norms.shape[:2]) == ([1], [5, 7], (1, 2))
    with pytest.raises(ValueError, match="heads is empty"):
        client.slice(r, heads=np.array([], dtype=int))


def test_batch_takes_any_number_of_texts_in_order_and_refuses_a_bare_string(client, tiny_gpt):
    """Forty texts were one request the server refuses (a batch holds at most 32: 422), and
    attention_batch("one text") went off as a 422 "texts: Input should be a valid list"."""
    texts = [f"Verse {i}: and it was so." for i in range(40)]
    sent = []
    client.http.event_hooks = {"request": [lambda request: sent.append(json.loads(request.content)["texts"])]}
    try:
        results = client.attention_batch(texts, layers=[0], heads=[3], format="json", predictions=1)
    finally:
        client.http.event_hooks = {"request": [], "response": []}
    assert [len(chunk) for chunk in sent] == [32, 8]
    assert len(results) == 40 and len({r.run_id for r in results}) == 40
    for i in (0, 31, 32, 39):
        assert "".join(t.text for t in results[i].tokens) == texts[i] and results[i].request["text"] == texts[i]
        np.testing.assert_allclose(results[i].head(0, 3), tiny_gpt.attend(texts[i]).attention[0, 3].numpy(), atol=1e-5)
        assert set(results[i].predictions) == set(range(len(texts[i])))
    assert [len(r.tokens) for r in client.attention_batch(texts[:5], batch_size=2)] == [len(t) for t in texts[:5]]
    with pytest.raises(TypeError, match="list of texts"):
        client.attention_batch("And God said.")
    for bad in ({"texts": []}, {"texts": ["a"], "batch_size": 0}):
        with pytest.raises(ValueError):
            client.attention_batch(**bad)


def test_a_batch_size_over_the_servers_limit_goes_at_the_limit_the_server_names(client):
    """batch_size=40 against a server that takes 32 was a 422 "a batch holds at most 32 texts":
    the error names the limit as a number, and the client goes on at it, nothing lost."""
    texts = [f"Verse {i}." for i in range(41)]
    sent = []
    client.http.event_hooks = {"request": [lambda request: sent.append(len(json.loads(request.content)["texts"]))]}
    try:
        results = client.attention_batch(texts, layers=[0], heads=[0], format="u8", batch_size=40)
    finally:
        client.http.event_hooks = {"request": [], "response": []}
    assert sent == [40, 32, 9]
    assert ["".join(t.text for t in r.tokens) for r in results] == texts
    refused = client.http.post("/api/v1/attention/batch", json={"texts": texts})
    assert refused.status_code == 422 and refused.json()["error"]["max_batch_texts"] == 32


def test_a_503_with_retry_after_is_retried_and_one_without_is_not(monkeypatch):
    """A server shutting down (or a proxy before a restarting one) answers 503 with Retry-After;
    the client raised it at once, like the 503 of models still loading, which has none."""
    slept = []
    monkeypatch.setattr("manyeyes.client.time.sleep", slept.append)
    answers = []

    def answer(request):
        answers.append(request.url.path)
        if len(answers) <= 2:
            return httpx.Response(503, json={"error": {"code": "not_ready", "message": "the server shut down before this "
                                  "request finished; retry shortly"}}, headers={"Retry-After": "5"})
        return httpx.Response(200, json={"models": []})

    with Client("http://manyeyes.test", transport=httpx.MockTransport(answer)) as mocked:
        assert mocked.models() == [] and mocked.retries == 2
    assert slept == [5.0, 5.0] and len(answers) == 3

    from manyeyes.client import NotReady

    loading = httpx.MockTransport(lambda request: (answers.append(1), httpx.Response(
        503, json={"error": {"code": "not_ready", "message": "models are still loading"}}))[1])
    answers.clear()
    with Client("http://manyeyes.test", transport=loading) as mocked, pytest.raises(NotReady) as err:
        mocked.models()
    assert len(answers) == 1 and err.value.retry_after_s is None and mocked.retries == 0
    shutting = httpx.MockTransport(lambda request: httpx.Response(
        503, json={"error": {"code": "not_ready", "message": "shut down"}}, headers={"Retry-After": "1"}))
    with Client("http://manyeyes.test", max_retries=2, transport=shutting) as mocked, pytest.raises(NotReady) as err:
        mocked.models()
    assert mocked.retries == 2 and err.value.retry_after_s == 1.0


def test_a_server_that_dies_mid_request_is_not_reported_unreachable(tmp_path):
    """The server was killed during the forward (an OOM kill, a crash): the client said it "could
    not be reached", which sends a user checking the URL of a server that answered a moment ago."""
    from tests.eco.conftest import ROOT, wait_ready

    port = free_port()
    env = {**os.environ, "MANYEYES_MODELS": json.dumps({"tiny-gpt": "tiny-gpt"}), "MANYEYES_DEBUG_FORWARD_DELAY_S": "30",
           "MANYEYES_WARMUP": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "manyeyes", "serve", "--port", str(port), "--device", "cpu",
                             "--log-level", "warning"], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc)
        threading.Timer(1.0, proc.kill).start()
        with Client(base, timeout_s=60) as c, pytest.raises(ConnectionFailed) as err:
            c.attention(TEXT)
    finally:
        proc.kill()
        proc.wait(timeout=15)
    assert (err.value.status, err.value.code) == (0, "network")
    assert err.value.message.startswith(f"{base} closed the connection before it had answered POST /api/v1/attention "
                                        "(the server stopped, restarted or crashed mid-request"), err.value.message
    assert "could not be reached" not in err.value.message


def test_a_base_url_without_a_scheme_is_refused_when_the_client_is_made():
    """Client("127.0.0.1:8000") was made, then every call said the server "could not be reached:
    Request URL is missing an 'http://' or 'https://' protocol"."""
    for bad in ("127.0.0.1:8000", "localhost", "ftp://host"):
        with pytest.raises(ValueError, match=r"base_url must start with http:// or https://.*" + re.escape(repr(bad))):
            Client(bad)
    assert Client("HTTPS://example.test/").http.base_url.host == "example.test"


def test_an_evicted_run_without_weights_is_refused_again_not_returned_empty(client, local):
    """slice() of a long run (kept queries and keys) was a 422 kept_qk while the run was cached,
    and after its eviction a result with attention None; a keep="qk" answer of a run that holds
    weights is served them."""
    kept = client.attention("The qk run of this test.", keep="qk")
    assert kept.kept == "qk" and kept.attention is None
    with pytest.raises(InvalidRequest) as refused:
        client.slice(dataclasses.replace(kept, run_id="e" * 32), layers=[0])
    assert refused.value.code == "kept_qk"
    weights = client.attention(TEXT, layers=[0])  # cached with its weights, then asked as qk
    asked_qk = client.attention(TEXT, keep="qk")
    assert asked_qk.kept == "weights" and asked_qk.attention is None
    with pytest.raises(ValueError, match=r"asked with keep='qk'.*Client\.slice\(result, layers=\[1\], heads=\[3\]\)"):
        asked_qk.head(1, 3)
    from manyeyes import figures

    with pytest.raises(ValueError, match="draw Client.slice"):
        figures.heatmap(asked_qk, layer=1, head=3)
    again = client.slice(dataclasses.replace(asked_qk, run_id="e" * 32), layers=[1], heads=[3], format="json")
    assert again.run_id == weights.run_id
    np.testing.assert_allclose(again.head(1, 3), local[1, 3], atol=1e-5)


def test_a_compare_difference_in_u8_decodes_with_its_offset(client):
    """decode_attention dropped the u8 offset (-1 for a difference): every value came out 1 too high."""
    from manyeyes.client import decode_attention

    body = {"model": "tiny-gpt", "text_a": "The bank of the river.", "text_b": "The bank of the old river.",
            "difference": {"layers": [1], "heads": [3]}}
    exact, coarse = (client.http.post("/api/v1/experiments/compare", json=body | {"difference": body["difference"] | {"format": f}})
                     .json()["difference"] for f in ("json", "u8"))
    assert coarse["format"] == "u8" and coarse["offset"] == -1.0
    exact, coarse = decode_attention(exact), decode_attention(coarse)
    assert exact.min() < -0.05 and exact.max() > 0.05  # a difference: both signs, so an offset shows
    np.testing.assert_allclose(coarse, exact, atol=1 / 254 + 1e-6, rtol=0)


def test_measures_take_the_clients_format_and_one_name(client, tiny_gpt):
    """measures() asked float32 whatever the client's format (a 413 for MiniLM past ~167 tokens
    where f16 fitted), and "rollout" went out as the names r,o,l,l,o,u,t."""
    from manyeyes.model.measures import rollout

    r = client.attention(TEXT, layers=[0])
    m = client.measures(r, "rollout")
    assert np.array_equal(m.rollout, m.rollout.astype(np.float16).astype(np.float32)), "f16, the client's format"
    np.testing.assert_allclose(m.rollout, rollout(tiny_gpt.attend(TEXT).attention).numpy(), atol=1e-3)
    exact = client.measures(r, ["rollout"], format="json").rollout
    assert not np.array_equal(exact, exact.astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="at least one measure"):
        client.measures(r, [])


@pytest.mark.parametrize("kwargs, words", [({"max_retries": -1}, "max_retries"), ({"max_retries": 1.5}, "max_retries"),
                                           ({"format": "f32"}, "format must be one of u8, f16, json")])
def test_a_client_made_with_settings_it_cannot_use_says_so_at_once(kwargs, words):
    """max_retries=-1 made every call end in AssertionError; a bad format was a 422 at every call."""
    with pytest.raises(ValueError, match=words):
        Client("http://127.0.0.1:9", **kwargs)


def test_counts_may_be_numpy_integers_and_bad_ones_keep_their_words(server, tiny_gpt):
    """README: counts may be numpy integers. max_retries=np.int64(2) and batch_size=np.int64(2)
    (len(texts) // 4 computed with numpy) were refused as "must be a whole number"."""
    texts = ["And God said.", "Let there be light.", "And there was light."]
    with Client(server, max_retries=np.int64(2)) as c:
        assert c.max_retries == 2 and type(c.max_retries) is int
        sent = []
        c.http.event_hooks = {"request": [lambda request: sent.append(len(json.loads(request.content)["texts"]))]}
        results = c.attention_batch(texts, batch_size=np.int64(2), layers=[0], format="json")
    assert sent == [2, 1] and ["".join(t.text for t in r.tokens) for r in results] == texts
    np.testing.assert_allclose(results[2].head(0, 3), tiny_gpt.attend(texts[2]).attention[0, 3].numpy(), atol=1e-5)
    for bad in (np.int64(-1), np.float64(2.0), "2", True):
        with pytest.raises(ValueError, match=re.escape(f"max_retries must be a whole number >= 0; got {bad!r}")):
            Client(server, max_retries=bad)
    with Client(server) as c:
        for bad in (np.int64(0), np.float64(2.0), 2.5, False):
            with pytest.raises(ValueError, match=re.escape(f"batch_size must be a whole number, at least 1; got {bad!r}")):
                c.attention_batch(texts, batch_size=bad)


def test_a_client_refuses_bad_seconds_and_keys_when_made():
    """Checked only at the first call: timeout_s=0 failed every request as a server that "could not
    be reached (tried 6 times over 7.8 s)", timeout_s=-1 and max_retry_wait_s=-1 as httpx's and
    sleep's errors, api_key=123 as an AttributeError (review h55d). No server is needed to make one."""
    for bad in (0, -1, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match=re.escape(f"timeout_s must be a number of seconds, above 0; got {bad!r}")):
            Client("http://127.0.0.1:9", timeout_s=bad)
    for bad in (-1, -0.5, float("nan"), "1"):
        with pytest.raises(ValueError, match=re.escape(f"max_retry_wait_s must be a number of seconds, 0 or more; got {bad!r}")):
            Client("http://127.0.0.1:9", max_retry_wait_s=bad)
    for bad, kind in ((123, "int"), (b"key", "bytes")):
        with pytest.raises(ValueError, match=re.escape(f"api_key must be the key as a str (or None); got {kind}")):
            Client("http://127.0.0.1:9", api_key=bad)
    with Client("http://127.0.0.1:9", timeout_s=np.float32(2.5), max_retry_wait_s=0, api_key=None) as c:
        assert c.http.timeout.read == 2.5 and c.max_retry_wait_s == 0.0
    # No limit, or httpx's own: passed on as before.
    with Client("http://127.0.0.1:9", timeout_s=None) as c:
        assert c.http.timeout.read is None
    with Client("http://127.0.0.1:9", timeout_s=httpx.Timeout(10, read=600)) as c:
        assert (c.http.timeout.connect, c.http.timeout.read) == (10, 600)


def test_a_client_pickles_as_a_new_client_of_the_same_server(client, local):
    """httpx's client holds a lock and sockets: a Client passed to a worker process (multiprocessing,
    joblib) failed to pickle."""
    import pickle

    with pickle.loads(pickle.dumps(client)) as copy:
        assert copy.http is not client.http and copy.http.base_url == client.http.base_url
        assert copy.format == client.format and copy.max_retries == client.max_retries
        result = copy.attention(TEXT, layers=[1], heads=[0])
        np.testing.assert_allclose(result.head(1, 0), local[1, 0], atol=1e-3, rtol=0)
    with pytest.raises(TypeError, match="transport"):
        pickle.dumps(Client("http://127.0.0.1:1", transport=httpx.MockTransport(lambda request: httpx.Response(200))))


def test_a_refused_connection_is_tried_again_and_a_restarted_servers_loading_is_waited_out(monkeypatch):
    """A server restarting mid-batch refused the next connection, and the client gave up at once
    although that request had never reached a server; once it listened again it said 503 while
    its models loaded. Both are waited out within max_retries; ready() and wait_ready() poll on
    their own and ask once."""
    from manyeyes.client import NotReady

    slept = []
    monkeypatch.setattr("manyeyes.client.time.sleep", slept.append)
    answers = []

    def restarting(request):
        answers.append(request.url.path)
        if len(answers) <= 2:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if len(answers) <= 4:
            return httpx.Response(503, json={"error": {"code": "not_ready", "message": "models are still loading"}})
        return httpx.Response(200, json={"models": []})

    with Client("http://manyeyes.test", transport=httpx.MockTransport(restarting)) as mocked:
        assert mocked.models() == [] and mocked.retries == 4
    assert slept == [0.25, 0.5, 1.0, 2.0] and len(answers) == 5
    answers.clear()
    with Client("http://manyeyes.test", max_retries=3, transport=httpx.MockTransport(restarting)) as mocked, \
            pytest.raises(NotReady) as err:
        mocked.models()
    assert err.value.code == "not_ready" and len(answers) == 4

    def refused(request):
        answers.append(request.url.path)
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    slept.clear(), answers.clear()
    with Client("http://manyeyes.test", max_retries=3, max_retry_wait_s=0.6, transport=httpx.MockTransport(refused)) as mocked:
        with pytest.raises(ConnectionFailed) as err:
            mocked.models()
        assert len(answers) == 4 and slept == [0.25, 0.5, 0.6]
        assert err.value.message.startswith("http://manyeyes.test could not be reached (tried 4 times over 1.4 s): ")
        answers.clear()
        assert not mocked.ready() and len(answers) == 1
        with pytest.raises(ConnectionFailed):
            mocked.wait_ready(timeout_s=0)
        assert len(answers) == 2
    slept.clear(), answers.clear()
    with Client("http://manyeyes.test", max_retries=0, transport=httpx.MockTransport(refused)) as mocked, \
            pytest.raises(ConnectionFailed) as err:
        mocked.models()
    assert len(answers) == 1 and not slept and "could not be reached: " in err.value.message


def test_a_call_waits_for_a_server_that_starts_meanwhile():
    """The real thing: a refused connection (nothing listens yet), then the starting server's
    503 while it loads tiny-gpt, then the answer."""
    from tests.eco.conftest import ROOT

    port = free_port()
    env = {**os.environ, "MANYEYES_MODELS": json.dumps({"tiny-gpt": "tiny-gpt"}), "MANYEYES_WARMUP": "false"}
    command = [sys.executable, "-m", "manyeyes", "serve", "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    started = []
    threading.Timer(0.5, lambda: started.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.DEVNULL))).start()
    try:
        with Client(f"http://127.0.0.1:{port}", max_retries=200, max_retry_wait_s=0.2) as c:
            result = c.attention(TEXT, layers=[0], heads=[3])
            assert "".join(t.text for t in result.tokens) == TEXT and c.retries >= 2
    finally:
        time.sleep(0.6)  # the timer has fired, whatever happened
        for proc in started:
            proc.kill()
            proc.wait(timeout=15)


def test_a_failed_batch_keeps_the_results_of_the_chunks_before_it(client, tiny_gpt):
    """A long attention_batch lost every finished chunk when a later one failed (a restart, one
    text too long): the error now carries them, in order, to resume from."""
    texts = ["And God said.", "Let there be light.", "And there was light.", "x" * 400, "And God saw."]
    with pytest.raises(InvalidRequest) as err:
        client.attention_batch(texts, batch_size=2, layers=[0], format="json")
    assert err.value.code == "too_long"
    # Named by its place in the list passed, not in the chunk of two it went in.
    assert err.value.message.startswith("texts[3]: ") and str(err.value).startswith("422 too_long: texts[3]: ")
    assert ["".join(t.text for t in r.tokens) for r in err.value.partial] == texts[:2]
    np.testing.assert_allclose(err.value.partial[1].head(0, 3), tiny_gpt.attend(texts[1]).attention[0, 3].numpy(), atol=1e-5)
    with pytest.raises(InvalidRequest) as err:
        client.attention_batch(texts[3:], batch_size=2)
    assert err.value.partial == [] and err.value.message.startswith("texts[0]: ")


def test_a_client_closed_from_another_thread_mid_call_says_it_was_closed():
    """The call in flight raised ConnectionFailed: "closed the connection before it had answered ...
    (the server stopped, restarted or crashed mid-request ...): [Errno 9] Bad file descriptor"."""
    with live_server(debug_forward_delay_s=0.5) as base:
        for call in (lambda c: c.attention(TEXT, model="tiny-gpt"),
                     lambda c: list(c.generate(TEXT, 50, model="tiny-gpt"))):
            c = Client(base)
            threading.Timer(0.2, c.close).start()
            with pytest.raises(ManyeyesError, match="this Client was closed \\(close\\(\\) from another thread\\) while POST") as err:
                call(c)
            assert (err.value.status, err.value.code, type(err.value)) == (0, "closed", ManyeyesError)
        # close() marked the Client closed after closing its connections: a call it cut off in
        # between still read as the server crashing (17 of 600 such races, review h57h); one
        # closed just before its send was httpx's RuntimeError (7 of 3,000).
        import random

        for _ in range(1000):
            c = Client(base)
            threading.Timer(random.uniform(0, 0.004), c.close).start()
            try:
                c.models()
            except ManyeyesError as exc:
                assert exc.code == "closed", exc


def test_a_closed_client_says_it_is_closed():
    """A call after close() raised httpx's RuntimeError ("Cannot send a request, as the client has
    been closed"), which `except ManyeyesError` does not catch."""
    answer = httpx.MockTransport(lambda request: httpx.Response(200, json={"models": []}))
    with Client("http://manyeyes.test", transport=answer) as c:
        assert c.models() == []
    for _ in range(2):
        with pytest.raises(ManyeyesError, match="this Client is closed") as err:
            c.models()
        assert (err.value.status, err.value.code) == (0, "closed")
        c.close()  # again: nothing to do
    with pytest.raises(ManyeyesError, match="this Client is closed"):
        next(iter(c.generate("Hi", 2)))


def test_a_generation_steps_token_reads_the_same_locally_and_remotely(client, tiny_gpt):
    """A local step's token had .text, the client's .token: the same loop broke on one of them."""
    from manyeyes.model.generate import generate

    remote, local_steps = list(client.generate(TEXT, 4)), list(generate(tiny_gpt, TEXT, 4))
    for name in ("text", "token"):
        assert [getattr(s.token, name) for s in remote] == [getattr(s.token, name) for s in local_steps]
        assert [getattr(a, name) for a in remote[0].alternatives] == [getattr(a, name) for a in local_steps[0].alternatives]
    assert remote[0].token.text == remote[0].token.token and remote[0].token.text


def test_the_package_has_a_version_and_its_submodules_after_a_bare_import(tmp_path):
    """`import manyeyes; manyeyes.figures` was an AttributeError (only `from manyeyes import
    figures` worked), and there was no __version__."""
    import subprocess
    import sys
    from importlib.metadata import version

    probe = ("import sys, manyeyes; v = manyeyes.__version__; f = manyeyes.figures.heatmap; "
             "print(v, 'torch' in sys.modules, manyeyes.export.export_html.__module__, manyeyes.client.Client is manyeyes.Client, "
             "{'figures', 'export', '__version__'} <= set(dir(manyeyes)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [version("manyeyes"), "False", "manyeyes.export", "True", "True"], out.stdout + out.stderr


def test_saved_results_load_in_a_new_process_bit_for_bit_with_no_server(client, tmp_path):
    """A paper's results had no documented way to disk: pickle (unsafe to share) or hand-made JSON."""
    from manyeyes.client import load_results, save_results

    texts = ["And God said, Let there be light.", "Ünïcödé ✓ and a tab\there.", "x"]
    results = client.attention_batch(texts, format="f16", predictions=3)
    kept_qk = dataclasses.replace(results[2], attention=None, kept="qk")
    path = tmp_path / "study"  # no suffix: written where asked, not at study.npz
    save_results(path, [*results, kept_qk])
    assert path.exists() and not (tmp_path / "study.npz").exists()
    script = (
        "import sys, pickle; from manyeyes.client import load_results; from manyeyes import figures\n"
        "rs = load_results(sys.argv[1]); figures.heatmap(rs[0], 1, 3)\n"
        "sys.stdout.buffer.write(pickle.dumps([(r.attention, {k: v for k, v in vars(r).items() if k != 'attention'}) for r in rs]))"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, check=True)
    loaded = pickle.loads(out.stdout)
    assert len(loaded) == 4
    for original, (attention, fields) in zip([*results, kept_qk], loaded):
        if original.attention is None:
            assert attention is None
        else:
            assert attention.dtype == np.float32 and attention.tobytes() == original.attention.tobytes()
        assert fields == {k: v for k, v in vars(original).items() if k != "attention"}
    assert loaded[0][1]["predictions"][0][0].piece == results[0].predictions[0][0].piece
    # In this process too, and one result alone.
    save_results(tmp_path / "one.npz", results[1])
    (again,) = load_results(tmp_path / "one.npz")
    assert again.tokens == results[1].tokens and np.array_equal(again.head(1, 3), results[1].head(1, 3))


def test_load_results_refuses_other_files_without_unpickling_them(tmp_path):
    from manyeyes.client import load_results, save_results

    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    np.savez(tmp_path / "garbage.npz", results=np.frombuffer(b"\xff\xfe not json", dtype=np.uint8))
    np.savez(tmp_path / "list.npz", results=np.frombuffer(b"[1, 2]", dtype=np.uint8))
    np.save(tmp_path / "plain.npy", np.zeros(3))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "text.npz").write_text("not numpy at all")
    for name in ("other.npz", "garbage.npz", "list.npz", "plain.npy", "objects.npy", "text.npz"):
        with pytest.raises(ValueError, match="not a file of manyeyes results"):
            load_results(tmp_path / name)
    header = b'{"format": "manyeyes-results/1", "results": [{"run_id": "x"}]}'
    np.savez(tmp_path / "partial.npz", results=np.frombuffer(header, dtype=np.uint8))
    with pytest.raises(ValueError, match="result 0 lacks a field"):
        load_results(tmp_path / "partial.npz")
    with pytest.raises(TypeError, match="RemoteResult objects .* one or a list of them; got ndarray"):
        save_results(tmp_path / "x.npz", [np.zeros(3)])
    # One that is no list, as a local run's result: it was "'AttentionResult' object is not iterable".
    class AttentionResult:
        pass

    with pytest.raises(TypeError, match="one or a list of them; got AttentionResult"):
        save_results(tmp_path / "x.npz", AttentionResult())


def test_attention_batch_sends_a_pair_per_text_across_chunks(client):
    texts, pairs = ["And God said.", "Let there be light.", "And there was light.", "And God saw."], ["Yes.", None, "No.", "So."]
    results = client.attention_batch(texts, text_pairs=pairs, batch_size=3, layers=[0], format="json")
    for text, pair, result in zip(texts, pairs, results):
        alone = client.attention(text, text_pair=pair, layers=[0], format="json")
        assert result.run_id == alone.run_id and np.array_equal(result.attention, alone.attention)
        assert result.request.get("text_pair") == pair  # an evicted run is posted again with its pair
    with pytest.raises(InvalidRequest) as err:  # the blank pair is the fourth, second of its chunk
        client.attention_batch(texts, text_pairs=["Yes.", None, "No.", " "], batch_size=2, layers=[0])
    assert "text_pairs[3] must contain" in err.value.message and len(err.value.partial) == 2
    # The body's own field names count too: "texts.0" was the third text of the list.
    with pytest.raises(InvalidRequest) as err:
        client.attention_batch(["And God said.", "Let there be light.", ""], batch_size=2, layers=[0])
    assert err.value.message.startswith("texts.2") and len(err.value.partial) == 2, err.value.message
    with pytest.raises(ValueError, match="3 entries for 4 texts"):
        client.attention_batch(texts, text_pairs=pairs[:3])
