"""manyeyes: see what every attention head does.

Everything installs and imports under this one name (`manyeyes.model`, `manyeyes.app`), so a
user's own `model.py` or `app/` can never shadow ours, nor ours theirs.
"""

from pathlib import Path as _Path

# An install places app/ and model/ inside this folder. A source checkout keeps them beside it
# (the repository's layout), so there the checkout's root is searched for subpackages too; the
# current checkout then wins over any other install, which keeps git worktrees honest.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "model" / "attention.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)

from manyeyes.model import (  # noqa: E402
    AttentionModel,
    AttentionResult,
    Capture,
    ModelInfo,
    ModelLoadError,
    TooLongError,
    load,
)
from manyeyes.client import Client  # noqa: E402

__all__ = ["AttentionModel", "AttentionResult", "Capture", "Client", "ModelInfo", "ModelLoadError", "TooLongError", "load"]
