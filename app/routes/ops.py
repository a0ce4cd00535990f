"""Operations: liveness, readiness and Prometheus metrics."""

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from manyeyes.app.deps import MetricsDep, RegistryDep
from manyeyes.app.routes.responses import errors
from manyeyes.app.schemas import Health, Ready
from manyeyes.app.services.errors import NotReady

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers. Says nothing about models."""
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses=errors(503))
async def readyz(registry: RegistryDep) -> Ready:
    """Ready once every configured model is loaded and warmed up; 503 until then."""
    if not registry.ready.is_set():
        raise NotReady(registry.not_ready_reason())
    return Ready(status="ready", models=[s.id for s in registry.served()])


@router.get("/metrics", response_class=Response)
async def metrics(m: MetricsDep) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
