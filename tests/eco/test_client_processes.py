"""manyeyes.Client across processes: its errors back from a worker, and a Client used after fork()."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from manyeyes import Client
from manyeyes.client import (ConnectionFailed, GenerationFailed, InvalidRequest, ManyeyesError, NotFound, NotReady,
                             Overloaded, ServerTimeout, TooLarge, Unauthorized)
from manyeyes.model.errors import TooLongError

# Distinct ASCII texts of distinct lengths: a tiny-gpt answer spells its own text token by token,
# so an answer for another text shows.
TEXTS = ["In the beginning was the Word.", "And the earth was without form, and void.", "Let there be light.",
         "And God saw the light, that it was good.", "And the evening and the morning were the first day."]
FORK = multiprocessing.get_context("fork")
LOCAL = {}  # a model for forked workers, which inherit it (a packed model does not pickle)


def ask_unknown_model(base: str) -> None:
    Client(base).attention("Hi", model="no-such-model")


def encode_too_long() -> None:
    model = LOCAL["model"]
    model.encode("x" * (model.info.max_tokens + 10))


@pytest.mark.parametrize("cls", [ManyeyesError, InvalidRequest, Unauthorized, NotFound, TooLarge, Overloaded, NotReady,
                                 ServerTimeout, ConnectionFailed, GenerationFailed])
def test_client_errors_pickle_with_their_fields(cls):
    """An exception unpickles as cls(*args), and args held only the formatted message: TypeError,
    missing 'code' and 'message'."""
    error = cls(429, "queue_full", "the queue is full", 2.5, {"error": {"code": "queue_full"}, "queued": 3})
    error.partial = ["a result"]
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and str(copy) == str(error) == "429 queue_full: the queue is full"
    assert (copy.status, copy.code, copy.message, copy.retry_after_s, copy.body, copy.partial) == (
        429, "queue_full", "the queue is full", 2.5, {"error": {"code": "queue_full"}, "queued": 3}, ["a result"])
    bare = pickle.loads(pickle.dumps(cls(0, "network", "no server")))
    assert (bare.retry_after_s, bare.body, bare.partial) == (None, None, None)


def test_too_long_pickles_with_its_counts(tiny_gpt):
    with pytest.raises(TooLongError) as raised:
        tiny_gpt.encode("x" * (tiny_gpt.info.max_tokens + 10))
    copy = pickle.loads(pickle.dumps(raised.value))
    assert type(copy) is TooLongError and isinstance(copy, ValueError) and str(copy) == str(raised.value)
    assert (copy.n_tokens, copy.max_tokens) == (tiny_gpt.info.max_tokens + 10, tiny_gpt.info.max_tokens)


def test_a_worker_process_raises_the_real_error_in_the_parent(server, tiny_gpt):
    """The README offers the Client to multiprocessing's workers, but its errors did not unpickle:
    ProcessPoolExecutor said BrokenProcessPool ("terminated abruptly") instead of a wrong model
    name, and multiprocessing.Pool.map hung for good."""
    LOCAL["model"] = tiny_gpt
    with ProcessPoolExecutor(1, mp_context=FORK) as pool:
        with pytest.raises(NotFound) as err:
            pool.submit(ask_unknown_model, server).result(timeout=60)
        assert (err.value.status, err.value.code) == (404, "unknown_model") and "no-such-model" in err.value.message
        with pytest.raises(TooLongError) as too_long:
            pool.submit(encode_too_long).result(timeout=60)
        assert too_long.value.max_tokens == tiny_gpt.info.max_tokens
    with FORK.Pool(1) as pool:
        with pytest.raises(NotFound):
            pool.map_async(ask_unknown_model, [server]).get(timeout=60)


def in_forked_children(n: int, work) -> list:
    """work(i) in n children forked now; what each returned (JSON), or {"error": ...}, in order."""
    children = []
    for i in range(n):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                os.close(read)
                try:
                    out = json.dumps(work(i))
                except BaseException as exc:  # noqa: BLE001 (reported to the parent)
                    out = json.dumps({"error": repr(exc)})
                with os.fdopen(write, "w") as pipe:
                    pipe.write(out)
            finally:
                os._exit(0)
        os.close(write)
        children.append((pid, read))
    outs = []
    for pid, read in children:
        with os.fdopen(read) as pipe:
            outs.append(json.loads(pipe.read() or '{"error": "no output"}'))
        os.waitpid(pid, 0)
    return outs


def spelled(result) -> str:
    return "".join(t.text for t in result.tokens)


def test_a_client_used_after_fork_opens_its_own_connections(server):
    """A module-level Client used in a "fork" pool's workers after the parent had made a request:
    parent and children shared its pooled keep-alive socket, and got each other's answers (the
    tokens and weights of another text) with no error, or broken ones (illegal status line)."""
    c = Client(server)
    c.attention("the parent's request, which leaves a pooled connection", layers=[0], heads=[0])
    inherited = c.http
    go = time.monotonic() + 0.5  # every process asks at once: CLOCK_MONOTONIC is the machine's

    def child(i: int) -> dict:
        time.sleep(max(go - time.monotonic(), 0))
        answers = []
        for _ in range(6):
            try:
                answers.append(spelled(c.attention(TEXTS[i], layers=[0], heads=[0])))
            except ManyeyesError as exc:
                answers.append(repr(exc))
        own = c.http is not inherited
        c.close()
        return {"answers": answers, "own_http": own, "inherited_open": not inherited.is_closed}

    outs = in_forked_children(4, child)
    time.sleep(max(go - time.monotonic(), 0))
    mine = [spelled(c.attention(TEXTS[4], layers=[0], heads=[0])) for _ in range(6)]
    for i, out in enumerate(outs):
        assert out.get("answers") == [TEXTS[i]] * 6, out
        assert out["own_http"], "the child sent on the parent's httpx client"
        assert out["inherited_open"], "the child's close() closed the client (and sockets) it inherited"
    assert mine == [TEXTS[4]] * 6
    # The parent's client is the one it had, open: nothing the children did closed it.
    assert c.http is inherited and not inherited.is_closed
    assert spelled(c.attention(TEXTS[0], layers=[0], heads=[0])) == TEXTS[0]
    c.close()
