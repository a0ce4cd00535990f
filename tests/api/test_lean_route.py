"""LeanRoute: the attention routes answer a valid JSON body without FastAPI's dependency solving,
and give exactly FastAPI's answer for everything else."""

from __future__ import annotations

import json

import fastapi.routing
import pytest
from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.dependencies.utils import get_dependant
from fastapi.testclient import TestClient
from pydantic import BaseModel

from manyeyes.app.routes.lean import LeanRoute, plan_for
from manyeyes.app.schemas import AttentionRequest


@pytest.fixture
def solved(monkeypatch):
    """Paths of the requests FastAPI's own handler solved dependencies for."""
    paths = []
    real = fastapi.routing.solve_dependencies

    async def counting(*args, **kwargs):
        paths.append(kwargs["request"].url.path)
        return await real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    return paths


class FastAPIsOwnHandler:
    """Any dependency override sends a request to FastAPI's handler, which honours overrides."""

    def __init__(self, client: TestClient) -> None:
        self.overrides = client.app.dependency_overrides

    def __enter__(self):
        self.overrides[plan_for] = lambda: None  # overrides a callable no route depends on
        return self

    def __exit__(self, *exc):
        self.overrides.pop(plan_for)


JSON = {"content-type": "application/json"}


def test_a_valid_body_skips_dependency_solving_and_the_rest_go_to_fastapi(api, solved):
    assert api.post("/api/v1/attention", json={"text": "Lean.", "format": "u8"}).status_code == 200
    assert api.post("/api/v1/attention/batch", json={"texts": ["Lean.", "Leaner."], "format": "u8"}).status_code == 200
    assert solved == []
    # A body that fails validation, another media type and an override: FastAPI's handler.
    assert api.post("/api/v1/attention", json={"text": " "}).status_code == 422
    assert api.post("/api/v1/attention", content=b'{"text": "Lean."}', headers={"content-type": "text/plain"}).status_code == 415
    with FastAPIsOwnHandler(api):
        assert api.post("/api/v1/attention", json={"text": "Lean.", "format": "u8"}).status_code == 200
    assert solved == ["/api/v1/attention"] * 3
    # The including router's dependency still runs on the lean path: a query it does not take is refused.
    assert api.post("/api/v1/attention", params={"format": "u8"}, json={"text": "Lean."}).status_code == 422
    assert len(solved) == 3


BODIES = [
    b'{"text": "Same answer.", "format": "u8"}',
    b'{"text": "First.", "text": "Last wins.", "format": "u8"}',
    b'{"text": "caf\\u00e9 \\ud83d\\ude00", "format": "u8", "layers": [0], "heads": [1, 2]}',
    b'{"text": "\\ud800"}',
    b'{"text": "x", "layers": [1.0]}',
    b'{"text": "x", "layers": [1e400]}',
    b'{"text": "x", "layers": [NaN]}',
    b'{"text": "x", "layers": [99999999999999999999999]}',
    b'{"text": "x", "truncate": 0}',
    b'{"text": "x", "format": "U8"}',
    b'{"text": "x", "extra": 1}',
    b'{"text": "x", "predictions": {"top_k": 3}}',
    b'{"text": "x", "predictions": {"top_k": "3"}}',
    b'{"text": "x", "model": null, "text_pair": "y", "format": "f16", "keep": "weights"}',
    b'{"text": "x"} trailing',
    b'{"text": "x", "format": "u8"}\n ',
    b'\xef\xbb\xbf{"text": "x"}',
    '{"text": "utf-16"}'.encode("utf-16"),
    b'{"text": "\xff"}',
    b"[1, 2]",
    b'"text"',
    b"",
    b"{}",
]


def comparable(response) -> tuple:
    body = response.json()
    body.pop("timing_ms", None)
    return response.status_code, body


@pytest.mark.parametrize("raw", BODIES, ids=range(len(BODIES)))
def test_the_lean_path_answers_every_body_as_fastapi_does(api, raw):
    lean = api.post("/api/v1/attention", content=raw, headers=JSON)
    with FastAPIsOwnHandler(api):
        standard = api.post("/api/v1/attention", content=raw, headers=JSON)
    assert comparable(lean) == comparable(standard)


def test_the_body_is_read_the_way_fastapi_reads_it():
    """What pydantic's JSON parser accepts, FastAPI (json.loads, then validation) accepts the same."""
    accepted = 0
    for raw in BODIES:
        try:
            lean = AttentionRequest.model_validate_json(raw)
        except ValueError:
            continue  # refused: FastAPI's handler answers it
        assert lean == AttentionRequest.model_validate(json.loads(raw)), raw
        accepted += 1
    # The ones the schema takes: plain, duplicate keys, escapes, a huge index (the service refuses it),
    # predictions (refused for MiniLM by the service), every option, trailing whitespace.
    assert accepted == 7


class Thing(BaseModel):
    name: str


async def state(request: Request) -> str:
    return "state"


async def deeper(value: str = Depends(state)) -> str:
    return value


def test_routes_it_cannot_serve_itself_keep_fastapis_handler(solved):
    async def plain(thing: Thing, request: Request, value: str = Depends(state)) -> Response:
        return Response(f"{thing.name} {value}")

    async def with_header(thing: Thing, x_mode: str = Header("a")) -> Response:
        return Response(f"{thing.name} {x_mode}")

    async def nested(thing: Thing, value: str = Depends(deeper)) -> Response:
        return Response(f"{thing.name} {value}")

    async def twice(thing: Thing, a: str = Depends(state), b: str = Depends(state)) -> Response:
        return Response(a + b)

    async def model_out(thing: Thing) -> Thing:
        return thing

    def blocking(thing: Thing) -> Response:
        return Response(thing.name)

    async def unresolved(thing: Thing) -> "NotImportedHere":  # noqa: F821
        return Response(thing.name)

    assert plan_for(get_dependant(path="/", call=plain), False).dependencies == (("value", state),)
    for endpoint in (with_header, nested, twice, model_out, blocking, unresolved):
        assert plan_for(get_dependant(path="/", call=endpoint), False) is None, endpoint.__name__

    app = FastAPI()
    for endpoint in (plain, with_header, nested, model_out):
        app.router.add_api_route(f"/{endpoint.__name__}", endpoint, methods=["POST"], route_class_override=LeanRoute)
    client = TestClient(app)
    assert client.post("/plain", json={"name": "n"}).text == "n state"
    assert solved == []
    assert client.post("/with_header", json={"name": "n"}, headers={"x-mode": "b"}).text == "n b"
    assert client.post("/nested", json={"name": "n"}).text == "n state"
    assert client.post("/model_out", json={"name": "n"}).json() == {"name": "n"}
    assert len(solved) == 3
