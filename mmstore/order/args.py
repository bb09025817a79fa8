"""Argument checks shared by the torch-free core (orders, their measurements):
each returns the checked value or raises ``ValueError``/``TypeError`` naming
the argument, the value and what it must be."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np


def _bad(name: str, value: Any, requirement: str) -> ValueError:
    return ValueError(f"{name} must be {requirement}, got {name}={value!r}")


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as a Python int (numpy integers accepted, bools refused)."""
    if isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, "an integer")
    try:
        out = operator.index(value)
    except TypeError:
        raise _bad(name, value, "an integer") from None
    if minimum is not None and out < minimum:
        raise _bad(name, value, f">= {minimum}")
    return out


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, "True or False")
    return bool(value)


def _positive_float(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _bad(name, value, "a number > 0") from None
    if not (out > 0 and math.isfinite(out)):
        raise _bad(name, value, "a finite number > 0")
    return out


def _fraction(name: str, value: Any) -> float:
    out = _positive_float(name, value)
    if out >= 1:
        raise _bad(name, value, "in (0, 1)")
    return out


def _index_array(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise _bad(name, f"<array of shape {arr.shape}>", "a 1-D array of indices")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise _bad(name, f"<array of dtype {arr.dtype}>", "an integer array")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise _bad(name, f"<array with minimum {int(arr.min())}>", "non-negative indices")
    return arr
