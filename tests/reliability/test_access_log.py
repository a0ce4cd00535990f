"""The access log's time: from the request's start to its answer's last byte."""

from __future__ import annotations

import asyncio
import logging

import orjson

from manyeyes.app.middleware import AccessLog
from manyeyes.app.services.metrics import Metrics


def logged_ms(app, caplog) -> float:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    with caplog.at_level(logging.INFO, logger="manyeyes.access"):
        try:
            asyncio.run(AccessLog(app, Metrics())(scope, receive, send))
        except RuntimeError:
            pass
    (record,) = [r for r in caplog.records if r.name == "manyeyes.access"]
    return orjson.loads(record.getMessage())["ms"]


def test_the_time_ends_at_the_last_byte_not_when_the_app_winds_down(caplog):
    async def answers_then_lingers(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.1)  # counted: the client is still waiting
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})
        await asyncio.sleep(0.6)  # not counted: the client has its answer

    assert 100 <= logged_ms(answers_then_lingers, caplog) < 600


def test_without_an_answer_the_time_ends_when_the_app_does(caplog):
    async def fails(scope, receive, send):
        await asyncio.sleep(0.1)
        raise RuntimeError("boom")

    assert logged_ms(fails, caplog) >= 100
