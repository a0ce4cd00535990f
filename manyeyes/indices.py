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


def index_below(value, count: int, name: str) -> int:
    """whole_number(value, name), in 0..count - 1: layer 5 of a 2-layer model was a bare
    IndexError, and -1 (Python's last) a view that called itself layer -1."""
    index = whole_number(value, name)
    if not 0 <= index < count:
        raise ValueError(f"{name} {index} does not exist: this model's are 0..{count - 1}")
    return index


def index_list(values, count: int, name: str) -> list[int]:
    """Indices as a list of ints, each `index_below(count)`, from a list, tuple, range or numpy
    array; a single index, an empty list or one named twice is a ValueError naming `name`."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of whole numbers (or None for all), got {values!r}")
    indices = [index_below(v, count, name) for v in values]
    if not indices:
        raise ValueError(f"{name} is empty: leave it out (None) for all of them")
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name} names an index twice: {indices}")
    return indices


def count_at_least(value, least: int) -> int | None:
    """A count as an int when it is a whole number of at least `least`, numpy's integers too
    (README: counts may be numpy integers, as len(texts) // 4 computed with numpy is); None
    otherwise, for the caller to refuse in its own words."""
    try:
        count = whole_number(value, "count")
    except ValueError:
        return None
    return count if count >= least else None
