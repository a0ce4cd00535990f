"""Operations: liveness, readiness and Prometheus metrics."""

import re

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST

from manyeyes.app.deps import MetricsDep, ReadyMarksDep, RegistryDep
from manyeyes.app.schemas import Health, Loading, Ready
from manyeyes.app.services.errors import NotReady, error_body

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers. Says nothing about models."""
    return Health(status="ok")


# An absolute path (POSIX, or a Windows drive's), up to its last component: the folders above a
# model file are the operator's business, not every client's.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/\\-])(?:/|[A-Za-z]:[\\/])(?:[^\s/\\'\"(),;]+[/\\])+(?=[^\s/\\'\"(),;])")


def without_folders(reason: str) -> str:
    """`reason` with each absolute path cut to its file or folder name: no such model file or folder:
    /srv/acme/weights.pth -> .../weights.pth."""
    return ABSOLUTE_PATH.sub(".../", reason)


@router.get("/readyz", response_model=Ready, responses={503: {"model": Loading, "description": "Models still loading, or failed"}})
async def readyz(request: Request, registry: RegistryDep, marks: ReadyMarksDep) -> Ready:
    """Ready once every configured model is loaded and warmed up (with workers: in every worker);
    503 until then, with each model's state and, while a Hugging Face id downloads, its
    bytes_done / bytes_total. On a server with API keys, which answers /readyz to anyone, a failed
    load's reason names model files without their folders (the server log has them whole)."""
    waiting = marks.waiting() if marks is not None and registry.ready.is_set() else []
    failed = marks.failed(waiting) if waiting else {}
    if not registry.ready.is_set() or waiting:
        if not waiting:
            reason = registry.not_ready_reason()
        elif failed:
            reason = "; ".join(f"worker {slot} could not load its models: {why}" for slot, why in failed.items())
        else:
            reason = f"workers {waiting} are still loading their models"
        if getattr(request.app.state, "keys", None):
            reason = without_folders(reason)
        body = error_body(NotReady.code, reason)
        body |= {"status": "failed" if registry.failure or failed else "loading", "models": dict(registry.progress)}
        return Response(orjson.dumps(body), status_code=503, media_type="application/json")
    return Ready(status="ready", models=[s.id for s in registry.served()])


@router.get("/metrics", response_class=Response)
async def metrics(m: MetricsDep) -> Response:
    # With workers, every worker's metric files are read: off the loop.
    return Response(await run_in_threadpool(m.exposition), media_type=CONTENT_TYPE_LATEST)
