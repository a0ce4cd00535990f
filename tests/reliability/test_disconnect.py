"""unless_disconnected: the work runs in the request's own task, a watcher cancels it when the
client goes away, and only that cancel becomes a 499 (a shutdown's cancel stays a cancel)."""

from __future__ import annotations

import asyncio

import pytest

from manyeyes.app.disconnect import unless_disconnected
from manyeyes.app.services.errors import ClientClosed


class FakeRequest:
    """What unless_disconnected reads of a request: `receive`, fed by the test."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.messages.get()


def test_the_answer_comes_back_and_no_watcher_is_left_running():
    async def main():
        request = FakeRequest()
        answer = await unless_disconnected(request, asyncio.sleep(0.01, result="answer"))
        await asyncio.sleep(0)  # let the cancelled watcher finish
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return answer, others

    answer, others = asyncio.run(main())
    assert answer == "answer"
    assert others == []


def test_a_disconnect_cancels_the_work_and_reads_as_client_closed():
    async def main():
        request = FakeRequest()
        cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.02, request.messages.put_nowait, {"type": "http.disconnect"})
        with pytest.raises(ClientClosed):
            await unless_disconnected(request, work())
        # The request's task is not left cancelling: its error answer can still be sent.
        return cancelled.is_set(), asyncio.current_task().cancelling()

    assert asyncio.run(main()) == (True, 0)


def test_other_messages_before_the_disconnect_are_skipped():
    async def main():
        request = FakeRequest()
        request.messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, request.messages.put_nowait, {"type": "http.disconnect"})
        with pytest.raises(ClientClosed):
            await unless_disconnected(request, asyncio.sleep(30))

    asyncio.run(main())


def test_a_cancel_from_elsewhere_stays_a_cancel():
    """Shutdown cancels the whole request task; ShutdownAnswer turns that into a 503, so it must
    not be mistaken for the client leaving."""

    async def main():
        request = FakeRequest()
        task = asyncio.create_task(unless_disconnected(request, asyncio.sleep(30)))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())



def test_a_client_gone_mid_body_is_logged_as_499_not_500():
    """BodyLimit returned without an answer, and the access log counted a 500: an alert for a
    client that only hung up."""
    from manyeyes.app.middleware import AccessLog, BodyLimit
    from manyeyes.app.services.metrics import Metrics

    async def never_called(scope, receive, send):
        raise AssertionError("the route ran on half a body")

    metrics = Metrics()
    app = AccessLog(BodyLimit(never_called, max_bytes=1_000), metrics)
    messages = [{"type": "http.request", "body": b'{"text": ', "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/v1/attention", "headers": [(b"content-length", b"100")]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert metrics.requests.labels("other", "POST", "499")._value.get() == 1
    assert metrics.requests.labels("other", "POST", "500")._value.get() == 0
