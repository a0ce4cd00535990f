"""numba for the loops eager PyTorch would run as several passes over a run's weights."""

from __future__ import annotations

import numba


def compiled(**options):
    """A decorator: `numba.njit(**options)`, compiled once per machine. numba keeps the machine
    code beside the module, or in the user's cache directory when the install is read-only; with
    neither writable it compiles per process (a second or less, paid by the server's warm-up)
    instead of failing the import."""

    def decorate(function):
        try:
            return numba.njit(cache=True, **options)(function)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(**options)(function)

    return decorate
