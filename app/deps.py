"""Dependencies the routes inject: the services the lifespan built.

They are `async def` though they never await: FastAPI runs a plain `def` dependency in its
thread pool, a hop there and back for every request (about half of the server's own time
beyond the forward at T=16 went to two such hops)."""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated
from urllib.parse import unquote_to_bytes

from fastapi import Depends, Request

from manyeyes.app.services.attention import AttentionService
from manyeyes.app.services.errors import ApiError, InvalidInput, brief
from manyeyes.app.services.generation import GenerationService
from manyeyes.app.services.measures import MeasuresService
from manyeyes.app.services.metrics import Metrics
from manyeyes.app.services.registry import Registry
from manyeyes.app.services.tiles import TileService
from manyeyes.app.shared_runs import ReadyMarks


async def get_service(request: Request) -> AttentionService:
    return request.app.state.service


async def get_generation(request: Request) -> GenerationService:
    return request.app.state.generation


async def get_tiles(request: Request) -> TileService:
    return request.app.state.tiles


async def get_measures(request: Request) -> MeasuresService:
    return request.app.state.measures


async def get_registry(request: Request) -> Registry:
    return request.app.state.registry


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def get_ready_marks(request: Request) -> ReadyMarks | None:
    """Which workers have loaded (manyeyes serve --workers); None for a single server."""
    return getattr(request.app.state, "ready_marks", None)


ServiceDep = Annotated[AttentionService, Depends(get_service)]
RegistryDep = Annotated[Registry, Depends(get_registry)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
ReadyMarksDep = Annotated[ReadyMarks | None, Depends(get_ready_marks)]
GenerationDep = Annotated[GenerationService, Depends(get_generation)]
TilesDep = Annotated[TileService, Depends(get_tiles)]
MeasuresDep = Annotated[MeasuresService, Depends(get_measures)]


def _query_params(dependant) -> dict[str, bool]:
    """The query parameters a route declares, its dependencies' included: name -> takes a list."""
    names = {param.alias: _takes_many(param.field_info.annotation) for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_params(sub)
    return names


def _takes_many(annotation) -> bool:
    """list[str], list[str] | None, ...: a parameter that may be given more than once."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_many(arg) for arg in typing.get_args(annotation))
    return origin in (list, tuple, set, frozenset)


async def utf8_json(request: Request) -> None:
    """JSON is UTF-8 (RFC 8259): FastAPI's parser (json.loads) had read UTF-16 and UTF-32 bodies
    too, where the README's error table says a body that is not UTF-8 JSON is refused. (Bytes that
    are not UTF-8 at all are refused where they are parsed, as the body's own 400 or 422.)"""
    if request.method == "POST" and json.detect_encoding(await request.body()) not in ("utf-8", "utf-8-sig"):
        raise ApiError("the body is not valid JSON: JSON is UTF-8, and these bytes are UTF-16 or UTF-32")


async def utf8_url(request: Request) -> None:
    """A URL's percent-escapes are UTF-8, as a JSON body's bytes are: the server decodes them with
    replacement characters, so `/export?text=%FF%FE` exported a run of "\ufffd\ufffd" and
    `/api/v1/runs/%FF/attention` named a run "\ufffd", where the same bytes in a body got a 400."""
    for part, raw in (("path", request.scope.get("raw_path")), ("query string", request.scope.get("query_string"))):
        if not raw or (b"%" not in raw and raw.isascii()):  # the usual URL: nothing to decode
            continue
        try:
            unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(
                f"the {part} is not UTF-8 once its %-escapes are decoded (the byte 0x{exc.object[exc.start]:02x}, "
                f"{exc.start} bytes into them): percent-encode a text's UTF-8 bytes"
            ) from None


async def known_query(request: Request) -> None:
    """An API route refuses query parameters it does not take: `?layer=0` for `?layers=0` was
    ignored, and the answer was every layer with nothing to say the filter had not applied. And
    one that takes a single value refuses it twice: `?layer=0&layer=3` answered layer 3 alone."""
    if not request.scope.get("query_string"):
        return
    route = request.scope["route"]
    declared = getattr(route, "declared_query", None)
    if declared is None:
        declared = route.declared_query = _query_params(route.dependant)
    given = request.query_params
    unknown = sorted({name for name in given if name not in declared})
    if unknown:
        takes = ", ".join(sorted(declared)) or "none"
        raise InvalidInput(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} {', '.join(repr(brief(n)) for n in unknown[:8])} "
            f"for {request.method} {route.path}; it takes: {takes}"
        )
    repeated = sorted({name for name in given if not declared[name] and len(given.getlist(name)) > 1})
    if repeated:
        raise InvalidInput(
            f"query parameter {', '.join(repr(n) for n in repeated)} given more than once for {request.method} "
            f"{route.path}; it takes one value"
        )
