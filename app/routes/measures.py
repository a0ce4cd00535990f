"""Measures of a cached run: GET /api/v1/runs/{run_id}/measures (the matrices and the head table,
also on POST /api/v1/attention as `measures`), /flow, /neuron and /logit-attribution."""

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import WithJsonSchema

from manyeyes.app.clients import client_of
from manyeyes.app.deps import MeasuresDep
from manyeyes.app.routes.responses import errors
from manyeyes.app.routes.runs import answered_while_connected
from manyeyes.app.schemas import DECIMAL, DIGITS, FlowResponse, Format, LogitAttributionResponse, MeasuresResponse, NeuronResponse
from manyeyes.app.services.attention import parse_index_list
from manyeyes.app.services.errors import InvalidInput, brief
from manyeyes.app.services.measures import MATRIX_MEASURES

router = APIRouter(prefix="/api/v1/runs/{run_id}", tags=["measures"])
# Each waits for its answer's bytes and a render slot, as a tile does: 504 when the bytes were not
# free in time, 429 beyond the render queue's bounds.
ERRORS = errors(404, 413, 429, 503, 504)


Index = Annotated[int, Query(ge=0, le=1_000_000), DIGITS]
_ONE = "(" + "|".join(MATRIX_MEASURES) + ")"
NAMES = f"^{_ONE}(,{_ONE})*$"  # in the schema too, so clients (and fuzzers) know the names


@router.get("/measures", response_model=MeasuresResponse, responses=ERRORS)
async def run_measures(
    run_id: str,
    service: MeasuresDep,
    request: Request,
    # The pattern is only in the schema: pydantic's own refusal quoted the regular expression
    # and not the name that failed it.
    names: Annotated[list[Annotated[str, WithJsonSchema({"type": "string", "pattern": NAMES})]],
                     Query(description=f"Comma-separated, any of {', '.join(MATRIX_MEASURES)}")],
    layers: Annotated[list[str] | None, Query(description="Comma-separated layer indices; default all")] = None,
    heads: Annotated[list[str] | None, Query(description="Comma-separated head indices; default all")] = None,
    format: Annotated[Format, Query()] = "json",
) -> Response:
    """Rollout (T, T), value-weighted norms (L, H, T, T), head contributions (L, H, T), the word
    view and the head table of a run. The first value-based measure of a run costs one captured
    forward pass (kept); the rest come from the cached weights."""
    asked = ",".join(names).split(",")
    unknown = next((name for name in asked if name not in MATRIX_MEASURES), None)
    if unknown is not None:
        raise InvalidInput(f"names: {brief(unknown)!r} is not a measure; the measures are {', '.join(MATRIX_MEASURES)}")
    layer_list, head_list = parse_index_list(layers, "layer"), parse_index_list(heads, "head")
    return await answered_while_connected(
        request, service.measures(run_id, asked, layer_list, head_list, format, client_of(request)))


@router.get("/flow", response_model=FlowResponse, responses=ERRORS)
async def run_flow(
    run_id: str,
    service: MeasuresDep,
    request: Request,
    threshold: Annotated[float, Query(ge=0.01, le=1.0, allow_inf_nan=False, description="Edges below this share are pruned; ≥ 0.01 bounds a target's edges per layer to 100"), DECIMAL] = 0.05,
) -> Response:
    """Information-flow routes (Ferrando & Voita, 2024): token → token edges through the layers,
    weighted by how much of the target's stream each source makes, pruned at `threshold`."""
    return await answered_while_connected(request, service.flow(run_id, threshold, client_of(request)))


@router.get("/neuron", response_model=NeuronResponse, responses=ERRORS)
async def run_neuron(run_id: str, service: MeasuresDep, request: Request, layer: Index, head: Index, query: Index) -> Response:
    """The neuron view of one head and one query token: the query, every key, q ⊙ k, the scaled
    scores, the softmax and the values. Under grouped-query attention, `kv_head` says which
    key/value head this query head reads."""
    return await answered_while_connected(request, service.neuron(run_id, layer, head, query, client_of(request)))


@router.get("/logit-attribution", response_model=LogitAttributionResponse, responses=ERRORS)
async def run_logit_attribution(
    run_id: str,
    service: MeasuresDep,
    request: Request,
    position: Index,
    target: Annotated[int | None, Query(ge=0, le=10_000_000, description="Token id; default the top prediction at `position`"), DIGITS] = None,
    top: Annotated[int, Query(ge=1, le=4096, description="Heads returned, the largest effect first, up or down (by absolute contribution)"), DIGITS] = 10,
) -> Response:
    """Direct logit attribution (causal LMs): each head's direct contribution to the logit of
    `target` at `position`, through the final norm frozen at this run's scale, ranked."""
    return await answered_while_connected(request, service.logits(run_id, position, target, top, client_of(request)))
