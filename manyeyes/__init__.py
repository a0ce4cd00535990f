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

# Imported on first use (PEP 562): `from manyeyes import Client` is a thin HTTP client and took
# 3.4 s importing torch for the local model it never used.
_LAZY = {
    **dict.fromkeys(("AttentionModel", "AttentionResult", "Capture", "ModelInfo", "ModelLoadError", "TooLongError", "load"),
                    "manyeyes.model"),
    # The client's errors beside it: `except manyeyes.Overloaded` as a notebook would write it.
    **dict.fromkeys(("Client", "ManyeyesError", "InvalidRequest", "Unauthorized", "NotFound", "TooLarge", "Overloaded",
                     "NotReady", "ServerTimeout", "ConnectionFailed", "GenerationFailed", "save_results", "load_results"),
                    "manyeyes.client"),
}
__all__ = sorted(_LAZY)
# Submodules, reachable as attributes after a bare `import manyeyes` (`manyeyes.figures.heatmap`):
# only `from manyeyes import figures` found them, since only an import sets a submodule's name.
_SUBMODULES = ("client", "export", "figures", "model")


def __getattr__(name: str):
    import importlib

    if name == "__version__":
        # The installed distribution's (pyproject.toml's version); a checkout run without
        # installing has none to read.
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("manyeyes")
        except PackageNotFoundError:
            value = "0+unknown"
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'manyeyes' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES, "__version__"})
