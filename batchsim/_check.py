"""Argument checks shared by every public constructor and function.

Each raises ``ValueError`` naming the parameter and the value it received, so that a
typo in a notebook cell points straight at the culprit.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value) + 0.0      # -0.0 is 0.0
    except OverflowError:               # an int past the largest float
        raise ValueError(f"{name} must be a number a float can hold, got {value!r:.40}") \
            from None
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    return value


def float_array(values) -> np.ndarray | None:
    """``values`` as a new array of floats if they are numbers, else None: booleans,
    strings and None (which numpy would read as NaN) are not."""
    try:
        given = np.asarray(values)
        numeric = given.dtype.kind in "iuf" or given.dtype.kind == "O" and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in given.ravel())
        return given.astype(float) if numeric else None
    except (TypeError, ValueError):   # a ragged sequence, or a number no float holds
        return None


def positive(name: str, value, *, allow_inf: bool = False) -> float:
    """``value`` as a float > 0 (finite unless ``allow_inf``)."""
    v = _real(name, value)
    if v <= 0 or (math.isinf(v) and not allow_inf):
        kind = "number" if allow_inf else "finite number"
        raise ValueError(f"{name} must be a positive {kind}, got {value!r}")
    return v


def non_negative(name: str, value, *, allow_inf: bool = False) -> float:
    """``value`` as a float >= 0 (finite unless ``allow_inf``)."""
    v = _real(name, value)
    if v < 0 or (math.isinf(v) and not allow_inf):
        kind = "number" if allow_inf else "finite number"
        raise ValueError(f"{name} must be a non-negative {kind}, got {value!r}")
    return v


def non_negative_or_inf(name: str, value) -> float:
    """``value`` as a float >= 0, infinity allowed (a wait that may be unbounded)."""
    return non_negative(name, value, allow_inf=True)


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1; floats such as 4.0 are refused (a batch size is a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    """``value`` as an int >= 0 (a count that may be zero; floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def one_of(name: str, value, choices) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def values(name: str, value, check) -> list:
    """``value`` (a list, array or single value) as a list, each checked by ``check``;
    not empty. A grid's axis: ``max_batch_size=16`` is the grid of one size."""
    if isinstance(value, (str, bytes)) or not np.iterable(value):
        value = [value]
    value = list(value)
    if not value:
        raise ValueError(f"{name} must hold at least one value, got []")
    return [check(name, v) for v in value]
