"""Operations: liveness, readiness and Prometheus metrics."""

import orjson
from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from manyeyes.app.deps import MetricsDep, RegistryDep
from manyeyes.app.schemas import Health, Loading, Ready
from manyeyes.app.services.errors import NotReady, error_body

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers. Says nothing about models."""
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses={503: {"model": Loading, "description": "Models still loading, or failed"}})
async def readyz(registry: RegistryDep) -> Ready:
    """Ready once every configured model is loaded and warmed up; 503 until then, with each model's
    state and, while a Hugging Face id downloads, its bytes_done / bytes_total."""
    if not registry.ready.is_set():
        body = error_body(NotReady.code, registry.not_ready_reason())
        body |= {"status": "failed" if registry.failure else "loading", "models": dict(registry.progress)}
        return Response(orjson.dumps(body), status_code=503, media_type="application/json")
    return Ready(status="ready", models=[s.id for s in registry.served()])


@router.get("/metrics", response_class=Response)
async def metrics(m: MetricsDep) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
