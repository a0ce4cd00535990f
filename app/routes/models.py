"""GET /api/v1/models: what this server can run."""

from fastapi import APIRouter

from manyeyes.app.deps import RegistryDep
from manyeyes.app.routes.responses import errors
from manyeyes.app.schemas import ModelOut, ModelsResponse, ServerLimits
from manyeyes.model.experiments import token_changes

router = APIRouter(prefix="/api/v1", tags=["models"])


@router.get("/models", response_model=ModelsResponse, responses=errors(503))
async def list_models(registry: RegistryDep) -> ModelsResponse:
    registry.get(None)  # 503 while loading rather than an empty list
    settings = registry.settings
    return ModelsResponse(
        limits=ServerLimits(max_json_cells=settings.max_json_cells, max_new_tokens=settings.max_new_tokens),
        models=[
            ModelOut(
                id=s.id,
                family=s.model.info.family,
                causal=s.model.info.causal,
                n_layers=s.model.info.n_layers,
                n_heads=s.model.info.n_heads,
                n_kv_heads=s.model.info.n_kv_heads or s.model.info.n_heads,
                d_model=s.model.info.d_model,
                head_dim=s.model.info.head_dim,
                max_tokens=s.model.info.max_tokens,
                device=s.model.info.device,
                dtype=s.model.info.dtype,
                predictions=s.model.info.predictions,
                sliding_windows=list(s.model.info.sliding_windows),
                token_changes=token_changes(s.model),
                eos_ids=sorted(s.model.info.eos_ids),
                default=s.default,
            )
            for s in registry.served()
        ]
    )
