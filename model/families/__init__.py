"""One module per Hugging Face model family, each answering three questions and nothing else:

- `build(config, path)`: our network, given their `config.json` (a dict) — which config fields
  become ours, and which block layout the family uses;
- `convert(weights, net, path)`: their tensors (a safetensors dict) -> our state dict, through the
  family's key table, naming the tensors it transposes and refusing unknown keys;
- `MODEL_TYPES`: the `model_type` values it answers for.

Every network a family builds exposes `causal`, `cfg` and `inspect(...) -> Trace`, and the
read-only shape properties `n_layers`, `n_heads`, `n_kv_heads`, `head_dim`, `d_model`,
`max_positions` and `has_lm_head` that `ModelInfo` is made from.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from manyeyes.model.errors import ModelLoadError
from manyeyes.model.families import bert, distilbert, gpt2, gpt_neox, llama, roberta

FAMILY_MODULES: tuple[ModuleType, ...] = (bert, roberta, distilbert, gpt2, gpt_neox, llama)
FAMILIES: dict[str, ModuleType] = {t: m for m in FAMILY_MODULES for t in m.MODEL_TYPES}


def family_for(model_type, path: Path) -> ModuleType:
    if model_type is None:
        raise ModelLoadError(
            f"{path} has no model_type, so its family is unknown; add the one it was saved as "
            f"(\"model_type\": ...), one of {', '.join(sorted(FAMILIES))}"
        )
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ModelLoadError(
            f"{path}: unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
