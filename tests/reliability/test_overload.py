"""Overload, client disconnects and timeouts, made deterministic by the slow-forward test hook:
every admitted request holds its place for seconds, far longer than the burst takes to arrive."""

from __future__ import annotations

import asyncio
import gc
import socket
import time

import httpx
import numpy as np
import orjson
import pytest

from tests.reliability.conftest import HOST, assert_json_error, decode, live_server, wait_until

ATTENTION = "/api/v1/attention"
SENTENCES = [
    "The bank of the river was muddy.",
    "She paid the bill at the bank.",
    "Rivers flood their banks in spring.",
    "A heron waited on the bank.",
    "Interest rates rose again today.",
    "He sat by the water and read.",
    "The vault was empty by noon.",
    "Boats drifted past the old mill.",
]


def check_against_single_run(model, text: str, body: dict) -> None:
    reference = model.attend(text)
    assert [(t["text"], t["id"], t["start"], t["end"]) for t in body["tokens"]] == [
        (t.text, t.id, t.start, t.end) for t in reference.tokens
    ]
    np.testing.assert_allclose(decode(body["attention"]), reference.attention.numpy(), atol=1e-5, rtol=0)


async def burst(url: str, texts: list[str]) -> list[tuple[httpx.Response, float]]:
    """All at once, one connection each; each reply with the seconds it took."""
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=len(texts))) as client:
        started = time.monotonic()

        async def one(text):
            r = await client.post(ATTENTION, json={"text": text})
            return r, time.monotonic() - started

        return await asyncio.gather(*(one(t) for t in texts))


@pytest.mark.parametrize("capacity,extra", [(4, 3), (1, 1)])
def test_n_plus_k_simultaneous_requests_get_exactly_k_429s_at_once(capacity, extra):
    delay = 2.0
    with live_server(max_queue=capacity, debug_forward_delay_s=delay, request_timeout_s=120) as server:
        texts = SENTENCES[: capacity + extra]
        replies = asyncio.run(burst(server.url, texts))
        refused = [(r, t) for r, t in replies if r.status_code == 429]
        served = [(r, t, text) for (r, t), text in zip(replies, texts) if r.status_code != 429]
        assert len(refused) == extra, [r.status_code for r, _ in replies]
        for r, _ in refused:
            err = assert_json_error(r, 429)
            assert err["code"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1
        # At once: every refusal came before the first admitted request could finish its forward.
        assert max(t for _, t in refused) < min(t for _, t, _ in served)
        assert min(t for _, t, _ in served) >= delay
        server.batcher.forward_delay_s = 0  # the references below need no delay
        for r, _, text in served:
            assert r.status_code == 200, r.text
            check_against_single_run(server.model, text, r.json())
        assert server.metric("manyeyes_dropped_total", reason="queue_full") == extra


def open_request(port: int, body: dict) -> socket.socket:
    """A POST sent on a raw socket and left waiting, so the test can hang up whenever it likes."""
    payload = orjson.dumps(body)
    sock = socket.create_connection((HOST, port), timeout=30)
    sock.sendall(
        f"POST {ATTENTION} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


def hang_up(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, like a killed client
    sock.close()


def test_disconnects_while_queued_and_while_running_drop_the_work_and_free_the_worker(caplog):
    with live_server(max_queue=8, debug_forward_delay_s=2.0, request_timeout_s=120, max_batch_items=1) as server:
        batcher = server.batcher
        forwards_before = server.metric("manyeyes_forward_seconds_count")
        running = open_request(server.port, {"text": SENTENCES[0]})
        wait_until(lambda: batcher._running == 1, 30, "the first request to start its forward")
        queued = [open_request(server.port, {"text": text}) for text in SENTENCES[1:4]]
        wait_until(lambda: server.metric("manyeyes_queue_depth") == 3, 30, "three requests to queue")

        for sock in queued:
            hang_up(sock)
        # Dropped from the queue as soon as the server notices, not when the worker gets there.
        wait_until(lambda: server.metric("manyeyes_dropped_total", reason="cancelled") == 3, 30, "3 cancelled")
        assert server.metric("manyeyes_queue_depth") == 0
        assert batcher._running == 1, "the forward that was running should still be running"

        hang_up(running)  # while its forward runs: that cannot be stopped, but nobody waits for it
        wait_until(lambda: batcher._running == 0, 30, "the abandoned forward to end")
        batcher.forward_delay_s = 0
        with httpx.Client(base_url=server.url, timeout=60) as client:
            r = client.post(ATTENTION, json={"text": SENTENCES[4]})
            assert r.status_code == 200, r.text
            check_against_single_run(server.model, SENTENCES[4], r.json())
        # Only the running request and the last one ever reached the model.
        assert server.metric("manyeyes_forward_seconds_count") - forwards_before == 2
        assert (batcher._admitted, batcher._running, len(batcher._pending)) == (0, 0, 0)
        assert server.metric("manyeyes_requests_total", route=ATTENTION, status="499") == 4
    # Each abandoned wait is settled, not left for the collector to report: asyncio.wait_for
    # once left the gather's CancelledError unretrieved ("exception was never retrieved").
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_slow_forward_times_out_with_504_and_the_worker_recovers():
    budget, delay = 1.0, 3.0
    with live_server(request_timeout_s=budget, debug_forward_delay_s=delay, max_batch_items=1) as server:
        batcher = server.batcher
        with httpx.Client(base_url=server.url, timeout=60) as client:
            started = time.monotonic()
            # One running, one queued behind it: both over budget, both 504.
            replies = [r for r, _ in asyncio.run(burst(server.url, SENTENCES[:2]))]
            elapsed = time.monotonic() - started
            for r in replies:
                err = assert_json_error(r, 504)
                assert err["code"] == "timeout" and "1 s" in err["message"]
            assert elapsed < delay, f"504s took {elapsed:.2f} s, as long as the slow forward itself"
            # The queued one never ran: its time ran out (expired); nobody hung up (it was "cancelled").
            assert server.metric("manyeyes_dropped_total", reason="expired") == 1
            assert server.metric("manyeyes_dropped_total", reason="cancelled") == 0

            wait_until(lambda: batcher._running == 0, 30, "the slow forward to end")
            batcher.forward_delay_s = 0
            r = client.post(ATTENTION, json={"text": SENTENCES[2]})
            assert r.status_code == 200, r.text
            check_against_single_run(server.model, SENTENCES[2], r.json())
            assert (batcher._admitted, batcher._running, len(batcher._pending)) == (0, 0, 0)
