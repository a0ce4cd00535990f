"""How a layer, head or other index given from Python is read, in one place for the model, the
figures, the export and the experiments."""

import operator


def whole_number(value, name: str) -> int:
    """A layer or head index as an int: numpy's integers (np.argmax's) are taken; a float, a string
    or a bool is a ValueError naming `name` (0.5 had drawn nothing, np.int64 failed deep in orjson)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be a whole number (an int), got {value!r}")


def count_at_least(value, least: int) -> int | None:
    """A count as an int when it is a whole number of at least `least`, numpy's integers too
    (README: counts may be numpy integers, as len(texts) // 4 computed with numpy is); None
    otherwise, for the caller to refuse in its own words."""
    try:
        count = whole_number(value, "count")
    except ValueError:
        return None
    return count if count >= least else None
