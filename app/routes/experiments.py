"""POST /api/v1/experiments/{ablate,change-token,compare}: change one thing, run again, rank what moved."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from manyeyes.app.clients import client_of
from manyeyes.app.disconnect import unless_disconnected
from manyeyes.app.routes.responses import PiecesResponse, errors
from manyeyes.app.schemas import AblateRequest, AblateResponse, ChangeTokenRequest, CompareRequest, ComparisonResponse
from manyeyes.app.services.experiments import ExperimentService
from manyeyes.app.services.slots import Grant

router = APIRouter(prefix="/api/v1/experiments", tags=["experiments"])
ERRORS = errors(404, 413, 415, 429, 503, 504)


async def get_experiments(request: Request) -> ExperimentService:  # async: no thread-pool hop (app/deps.py)
    return request.app.state.experiments  # built by the lifespan, with the other services (app/main.py)


ExperimentsDep = Annotated[ExperimentService, Depends(get_experiments)]


def _json(answer: tuple[bytes, Grant]) -> Response:
    body, grant = answer
    return PiecesResponse([body], "application/json", grant=grant)  # which gives the bytes back once sent


@router.post("/ablate", response_model=AblateResponse, responses=ERRORS)
async def ablate(body: AblateRequest, service: ExperimentsDep, request: Request) -> Response:
    """Silence heads at their slice of the output projection's input (zero, or their mean over
    this input's positions), run again, and rank every downstream head by how much its rows moved
    (Jensen–Shannon divergence). Models with an LM head also get top-k before/after and the change
    in log-probability of each actual next token (causal) or of the clean top guess at each mask (MLM)."""
    return _json(await unless_disconnected(request, service.ablate(body, client_of(request))))


@router.post("/change-token", response_model=ComparisonResponse, responses=ERRORS)
async def change_token(body: ChangeTokenRequest, service: ExperimentsDep, request: Request) -> Response:
    """Replace token `index` by the model's mask or unknown token, or delete it; the two runs are
    aligned on their tokens and every head ranked by the divergence of its aligned rows."""
    return _json(await unless_disconnected(request, service.change_token(body, client_of(request))))


@router.post("/compare", response_model=ComparisonResponse, responses=ERRORS)
async def compare(body: CompareRequest, service: ExperimentsDep, request: Request) -> Response:
    """Two texts aligned on their token strings (difflib), heads ranked by the divergence of their
    aligned rows, and on request A − B on the aligned cells."""
    return _json(await unless_disconnected(request, service.compare(body, client_of(request))))
