"""Checks of a store's bookkeeping arrays that prove every offset and slot
in range before any reaches a copy (see format.py, "Reading a store from
someone else"); run once per process by ``Store``, in bounded memory."""

from __future__ import annotations

import numpy as np

from ..errors import FormatError

__all__ = ["check_index", "check_key_offsets"]


def check_key_offsets(path: str, offs: np.ndarray) -> None:
    """Key offsets start at 0 and never decrease (the last one equals the
    blob's size: checked at open). O(slots), once per process."""
    step = 1 << 20
    if len(offs) and int(offs[0]) != 0:
        raise FormatError(f"{path}: the first offset is {int(offs[0])}, expected 0; the file is damaged: "
                          "run `mmstore verify`")
    for a in range(0, len(offs), step):
        part = offs[a : a + step + 1]
        if len(part) > 1 and not bool(np.all(part[1:] >= part[:-1])):
            at = a + 1 + int(np.flatnonzero(part[1:] < part[:-1])[0])
            raise FormatError(f"{path}: offsets decrease at slot {at - 1} ({int(offs[at - 1])} then "
                              f"{int(offs[at])}); the file is damaged: run `mmstore verify`")


def check_index(path: str, ix: np.ndarray, slots: int) -> None:
    """Prove every slot of the index in range before any reaches a copy:
    strictly increasing (so no duplicates) and the last below ``slots``.
    O(records), once per process, in chunks (bounded memory)."""
    step = 1 << 20
    for a in range(0, len(ix), step):
        part = ix[a : a + step + 1]
        if len(part) > 1 and not bool(np.all(part[1:] > part[:-1])):
            at = a + 1 + int(np.flatnonzero(part[1:] <= part[:-1])[0])
            raise FormatError(
                f"{path}: not strictly increasing at index {at} ({int(ix[at - 1])} then {int(ix[at])}); the "
                "file is damaged: run `mmstore verify`, then restore it or re-create the store"
            )
    if len(ix) and int(ix[-1]) >= slots:
        raise FormatError(
            f"{path}: slot {int(ix[-1])} is out of range for {slots} slots; the file is damaged: "
            "run `mmstore verify`, then restore it or re-create the store"
        )
