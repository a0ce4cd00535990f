"""POST /api/v1/generate against a live server: streamed as made, exact rows, stopped by a hang-up."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

from manyeyes.model import load
from manyeyes.model.generate import generate
from tests.reliability.conftest import assert_json_error, live_server, wait_until

PROMPT = "In the beginning God created the heaven and the earth."


@pytest.fixture(scope="module")
def server():
    with live_server(models={"tiny-gpt": "tiny-gpt", "minilm": "minilm"}, max_new_tokens=64) as s:
        yield s


def lines(response: httpx.Response):
    for line in response.iter_lines():
        if line:
            yield json.loads(line)


def test_stream_matches_the_python_api_row_for_row(server):
    body = {"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 8}
    with httpx.stream("POST", f"{server.url}/api/v1/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        events = list(lines(r))
    start, steps, end = events[0], events[1:-1], events[-1]
    assert start["type"] == "start" and start["n_layers"] == 2 and start["n_heads"] == 8
    assert [t["piece"] for t in start["prompt"]][:2] == ["I", "n"]
    assert end == {"type": "end", "reason": "length", "tokens": 8}
    expected = list(generate(load("tiny-gpt", device="cpu"), PROMPT, 8))
    assert [s["token"]["id"] for s in steps] == [e.token.id for e in expected]
    for got, want in zip(steps, expected):
        assert got["position"] == want.position
        row = np.asarray(got["attention"], dtype=np.float32)
        assert row.shape == (2, 8, want.position + 1)
        assert np.abs(row - want.attention.numpy()).max() <= 1e-6
        assert got["token"]["prob"] == pytest.approx(want.token.prob)


def test_first_step_arrives_before_generation_finishes(server):
    """With a delay after each step, the first step must be readable long before the last is made."""
    server.app.state.settings.debug_forward_delay_s = 0.2
    try:
        body = {"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 10}
        t0 = time.monotonic()
        with httpx.stream("POST", f"{server.url}/api/v1/generate", json=body, timeout=60) as r:
            events = lines(r)
            assert next(events)["type"] == "start"
            assert next(events)["type"] == "step"
            first_at = time.monotonic() - t0
            rest = list(events)
        total = time.monotonic() - t0
    finally:
        server.app.state.settings.debug_forward_delay_s = 0.0
    assert rest[-1]["type"] == "end" and len(rest) == 10
    assert first_at < total - 1.0, (first_at, total)  # ≥ 9 delays of 0.2 s came after it


def test_a_client_that_hangs_up_stops_the_work(server):
    server.app.state.settings.debug_forward_delay_s = 0.1
    try:
        before_steps = server.metric("manyeyes_generation_steps_total", model="tiny-gpt")
        before_cancelled = server.metric("manyeyes_generations_total", outcome="cancelled")
        body = {"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 60}
        with httpx.stream("POST", f"{server.url}/api/v1/generate", json=body, timeout=60) as r:
            events = lines(r)
            next(events), next(events)  # start, then the first step: then hang up
        wait_until(
            lambda: server.metric("manyeyes_generations_total", outcome="cancelled") == before_cancelled + 1,
            20,
            "the server to record the cancelled generation",
        )
        made = server.metric("manyeyes_generation_steps_total", model="tiny-gpt") - before_steps
        time.sleep(0.5)  # five more delays: a generation still running would have made more steps
        assert server.metric("manyeyes_generation_steps_total", model="tiny-gpt") - before_steps == made
        assert made < 10, made  # stopped within a step or two of the hang-up, far short of 60
    finally:
        server.app.state.settings.debug_forward_delay_s = 0.0


@pytest.mark.parametrize(
    "body,status,code",
    [
        ({"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 65}, 422, "invalid_request"),  # server limit
        ({"text": "x " * 120, "model": "tiny-gpt", "max_new_tokens": 64}, 422, "invalid_request"),  # past the context
        ({"text": PROMPT, "model": "minilm", "max_new_tokens": 3}, 422, "invalid_request"),  # an encoder
        ({"text": PROMPT, "model": "nope", "max_new_tokens": 3}, 404, "unknown_model"),
        ({"text": "  ", "model": "tiny-gpt"}, 422, "invalid_request"),
        ({"text": PROMPT, "model": "tiny-gpt", "temperature": -1}, 422, "invalid_request"),
        ({"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": "5"}, 422, "invalid_request"),
        # torch's seeds are unsigned 64-bit: 2**64 was a 200 whose stream then broke off
        ({"text": PROMPT, "model": "tiny-gpt", "temperature": 1, "seed": 2**64}, 422, "invalid_request"),
    ],
)
def test_bad_requests_get_json_errors_before_any_stream(server, body, status, code):
    err = assert_json_error(httpx.post(f"{server.url}/api/v1/generate", json=body, timeout=30), status)
    assert err["code"] == code


def test_the_largest_seed_samples_and_a_full_prompt_is_told_to_shrink(server):
    body = {"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 2, "temperature": 1, "seed": 2**64 - 1}
    with httpx.stream("POST", f"{server.url}/api/v1/generate", json=body, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1]["type"] == "end", lines[-1]
    # A prompt that fills the context leaves no room: the advice was "ask for at most 0 new tokens".
    err = assert_json_error(httpx.post(f"{server.url}/api/v1/generate", json={"text": "x" * 256, "model": "tiny-gpt"}, timeout=30), 422)
    assert "shorten the prompt" in err["message"] and "at most 0" not in err["message"], err["message"]


def test_prompts_too_long_get_too_long_with_advice_that_can_be_followed(server):
    """As on every other route: `too_long`, and no "ask for truncation" (generation has none)."""
    over_positions = {"text": "x" * 300, "model": "tiny-gpt", "max_new_tokens": 1}
    err = assert_json_error(httpx.post(f"{server.url}/api/v1/generate", json=over_positions, timeout=30), 422)
    assert err["code"] == "too_long" and "truncat" not in err["message"], err
    assert err["message"].startswith("the prompt is 300 tokens long but tiny-gpt takes at most 256"), err
    # The length to cut to is the one that then runs: 255 with one new token (it said "at most 256",
    # and a 256-token prompt was then refused as leaving no room).
    assert err["message"].endswith("with 1 new, shorten it to at most 255"), err
    one = {"text": "x" * 255, "model": "tiny-gpt", "max_new_tokens": 2}
    err = assert_json_error(httpx.post(f"{server.url}/api/v1/generate", json=one, timeout=30), 422)
    assert err["message"].endswith("ask for at most 1 new token"), err
    limit = server.app.state.settings.max_text_chars
    over_chars = {"text": "x" * (limit + 1), "model": "tiny-gpt", "max_new_tokens": 1}
    err = assert_json_error(httpx.post(f"{server.url}/api/v1/generate", json=over_chars, timeout=30), 422)
    assert err == {"code": "too_long", "message": f"text is {limit + 1:,} characters long, over this server's limit of {limit:,}"}


def test_too_many_generations_at_once_get_429(server):
    service = server.app.state.generation
    taken = 0
    while service._slots.acquire():
        taken += 1
    try:
        r = httpx.post(f"{server.url}/api/v1/generate", json={"text": PROMPT, "model": "tiny-gpt"}, timeout=30)
        assert_json_error(r, 429)
        assert r.headers["Retry-After"] == "5"  # a generation runs for seconds: 1 sent clients back into the refusal
    finally:
        for _ in range(taken):
            service._slots.release()


def test_one_client_holds_at_most_half_the_generations(server):
    """Four streams one client opened and never read held every slot (the others' 429s said retry
    in 1 s) until the write deadline dropped them, and again on reconnecting."""
    service = server.app.state.generation
    share = service.client_share
    assert share == server.app.state.settings.max_generations // 2 >= 1
    here = "addr:127.0.0.1"  # the address the requests below come from
    for _ in range(share):
        service._take(here)
    try:
        r = httpx.post(f"{server.url}/api/v1/generate", json={"text": PROMPT, "model": "tiny-gpt"}, timeout=30)
        err = assert_json_error(r, 429)
        assert "its share" in err["message"] and r.headers["Retry-After"] == "5", err
        service._take("addr:10.0.0.7")  # another client still gets a slot
        service._give_back("addr:10.0.0.7")
    finally:
        for _ in range(share):
            service._give_back(here)
    with httpx.stream("POST", f"{server.url}/api/v1/generate", json={"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 2},
                      timeout=60) as r:
        assert r.status_code == 200 and [json.loads(x)["type"] for x in r.iter_lines() if x][-1] == "end"
    assert service._slots.held_by == {} and service._slots.free == server.app.state.settings.max_generations


def test_an_encoders_long_prompt_is_told_it_cannot_generate_not_to_shorten_it(server):
    r = httpx.post(f"{server.url}/api/v1/generate", json={"text": "word " * 600, "model": "minilm"}, timeout=30)
    err = assert_json_error(r, 422)
    assert err["message"] == "minilm is not a causal language model: it cannot generate", err


def test_seeded_sampling_repeats_over_http(server):
    body = {"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 6, "temperature": 1.0, "top_k": 20, "seed": 3}
    runs = []
    for _ in range(2):
        with httpx.stream("POST", f"{server.url}/api/v1/generate", json=body, timeout=60) as r:
            runs.append([e["token"]["id"] for e in lines(r) if e["type"] == "step"])
    assert runs[0] == runs[1] and len(runs[0]) == 6



def test_a_step_that_fails_ends_the_stream_with_its_reason(server, monkeypatch):
    """After the 200 a failing step used to drop the connection mid-chunk (a temperature of
    1e-308 did); now a last line says why, the slot is freed and the next generation runs."""
    import manyeyes.app.services.generation as generation

    def two_steps_then_fail(model, *args, **kwargs):
        steps = generate(model, *args, **kwargs)
        yield next(steps)
        yield next(steps)
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    before = server.metric("manyeyes_generations_total", outcome="failed")
    monkeypatch.setattr(generation, "generate", two_steps_then_fail)
    body = {"text": PROMPT, "model": "tiny-gpt", "max_new_tokens": 8}
    with httpx.stream("POST", f"{server.url}/api/v1/generate", json=body, timeout=60) as r:
        events = list(lines(r))
    assert [e["type"] for e in events] == ["start", "step", "step", "end"]
    assert events[-1]["reason"] == "error" and events[-1]["tokens"] == 2
    assert "inf, nan" in events[-1]["error"]
    assert server.metric("manyeyes_generations_total", outcome="failed") == before + 1
    monkeypatch.undo()
    with httpx.stream("POST", f"{server.url}/api/v1/generate", json={**body, "max_new_tokens": 2}, timeout=60) as r:
        assert list(lines(r))[-1] == {"type": "end", "reason": "length", "tokens": 2}


def test_a_generation_that_names_no_model_uses_a_causal_one():
    """A server whose default is minilm, an encoder (the built-in default): a generation with no
    model was always a 422 "not a causal language model". It takes the first causal model listed."""
    body = {"text": PROMPT, "max_new_tokens": 3, "stop_at_eos": False}
    with live_server(models={"minilm": "minilm", "tiny-gpt": "tiny-gpt"}) as encoder_first:
        url = f"{encoder_first.url}/api/v1/generate"
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            events = list(lines(r))
        assert r.status_code == 200 and events[0]["model"] == "tiny-gpt" and events[-1]["tokens"] == 3
        with httpx.stream("POST", url, json={**body, "model": "tiny-gpt"}, timeout=60) as r:
            assert list(lines(r)) == events
        # Naming the encoder is still refused, and says why.
        err = assert_json_error(httpx.post(url, json={**body, "model": "minilm"}, timeout=30), 422)
        assert err["message"] == "minilm is not a causal language model: it cannot generate"
    with live_server() as encoders_only:  # nothing can generate: the default's refusal
        err = assert_json_error(httpx.post(f"{encoders_only.url}/api/v1/generate", json=body, timeout=30), 422)
        assert err["message"] == "minilm is not a causal language model: it cannot generate"


def test_work_refused_once_a_shutdown_began_says_when_to_retry():
    """A generation, and an input for the batcher, asked for after the signal got 503 with no
    Retry-After, where the requests the drain's end cuts off have one (README's error table)."""
    with live_server(models={"tiny-gpt": "tiny-gpt"}, warmup=False) as server:
        server.app.state.shutdown.begin()  # what the server's signal handler calls
        generation = httpx.post(f"{server.url}/api/v1/generate", json={"text": "In the", "max_new_tokens": 2}, timeout=30)
        server.batcher.close()  # as the lifespan's end closes it
        attention = httpx.post(f"{server.url}/api/v1/attention", json={"text": "A closed batcher.", "model": "tiny-gpt"},
                               timeout=30)
        for r in (generation, attention):
            err = assert_json_error(r, 503)
            assert err["code"] == "not_ready" and "shutting down" in err["message"] and r.headers["retry-after"] == "5"
