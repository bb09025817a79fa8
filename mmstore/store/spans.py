"""Where records lie in a store's files: the byte ranges a read of some
slots touches, per data file.

A store opened from a URL reads through a sparse replica
(:mod:`mmstore.remote.replica`) that must have those bytes before a read
copies them out; the replica maps them to its blocks. Fixed (raw) fields are
at fixed positions (``FieldSegment``); variable-size fields' entries are
found through their offsets index. Fields of backends that are not
positional (LMDB) are fetched whole, so they have no spans here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..format.schema import Schema
from .backends.base import BackendReader

__all__ = ["record_spans", "runs_of"]


def runs_of(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``slots`` as half-open runs ``[starts, stops)``."""
    if not len(slots):
        return slots, slots
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = slots[np.concatenate(([0], cut))]
    stops = slots[np.concatenate((cut - 1, [len(slots) - 1]))] + 1
    return starts, stops


def _name(backend: BackendReader, path: str) -> str:
    """The name (in the manifest's ``files``) of a data file at ``path``: its
    path under the store's directory (``parts/<id>/<name>`` in a part)."""
    return os.path.relpath(path, backend.root).replace(os.sep, "/")


def record_spans(backend: BackendReader, schema: Schema, slots: np.ndarray,
                 fields: Sequence[str]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(file name, starts, ends)`` of the bytes that reading ``slots`` (any
    order, duplicates allowed) of ``fields`` of a store (its ``backend`` and
    ``schema``) touches."""
    s = np.unique(np.asarray(slots, dtype=np.int64))
    if not len(s) or not backend.positional:
        return []
    starts, stops = runs_of(s)
    out: list[tuple[str, np.ndarray, np.ndarray]] = []
    for name in fields:
        f = schema[name]
        if f.variable:
            spans: dict[str, tuple[list[int], list[int]]] = {}
            for a, b in zip(starts.tolist(), stops.tolist()):
                for path, off, length in backend.entry_spans(name, a, b):
                    lo, hi = spans.setdefault(_name(backend, path), ([], []))
                    lo.append(off)
                    hi.append(off + length)
            out.extend((n, np.asarray(lo, np.int64), np.asarray(hi, np.int64)) for n, (lo, hi) in spans.items())
            continue
        for seg in backend.field_segments(name):
            a = np.clip(starts, seg.first, seg.first + seg.count)
            b = np.clip(stops, seg.first, seg.first + seg.count)
            keep = b > a
            if not keep.any():
                continue
            base = seg.offset - seg.first * seg.entry_bytes
            out.append((_name(backend, seg.path), base + a[keep] * seg.entry_bytes,
                        base + b[keep] * seg.entry_bytes))
    return out
