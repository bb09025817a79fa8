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

__all__ = ["RecordSpans", "record_spans", "runs_of"]


def runs_of(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``slots`` as half-open runs ``[starts, stops)``."""
    if len(slots) <= 1:
        return slots, slots + 1
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = slots[np.concatenate(([0], cut))]
    stops = slots[np.concatenate((cut - 1, [len(slots) - 1]))] + 1
    return starts, stops


def _name(backend: BackendReader, path: str) -> str:
    """The name (in the manifest's ``files``) of a data file at ``path``: its
    path under the store's directory (``parts/<id>/<name>`` in a part)."""
    return os.path.relpath(path, backend.root).replace(os.sep, "/")


class RecordSpans:
    """The byte ranges that reading some slots of ``fields`` of a store (its
    ``backend`` and ``schema``) touches: ``spans(slots)`` gives ``(file name,
    starts, ends)`` for any slots (any order, duplicates allowed). Where the
    fixed fields lie is looked up once, so a call for one record costs
    arithmetic only."""

    def __init__(self, backend: BackendReader, schema: Schema, fields: Sequence[str]) -> None:
        self.backend = backend
        self.variable: list[str] = []
        # (file name, byte of slot 0, bytes a slot, first slot, end slot) of each file of a fixed field
        self.fixed: list[tuple[str, int, int, int, int]] = []
        if not backend.positional:
            return
        for name in fields:
            if schema[name].variable:
                self.variable.append(name)
                continue
            for seg in backend.field_segments(name):
                self.fixed.append((_name(backend, seg.path), seg.offset - seg.first * seg.entry_bytes,
                                   seg.entry_bytes, seg.first, seg.first + seg.count))

    def __call__(self, slots: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
        slots = np.asarray(slots, dtype=np.int64)
        if not self.backend.positional or not len(slots):
            return []
        s = slots if len(slots) == 1 else np.unique(slots)
        starts, stops = runs_of(s)
        out: list[tuple[str, np.ndarray, np.ndarray]] = []
        for name in self.variable:
            spans: dict[str, tuple[list[int], list[int]]] = {}
            for a, b in zip(starts.tolist(), stops.tolist()):
                for path, off, length in self.backend.entry_spans(name, a, b):
                    lo, hi = spans.setdefault(_name(self.backend, path), ([], []))
                    lo.append(off)
                    hi.append(off + length)
            out.extend((n, np.asarray(lo, np.int64), np.asarray(hi, np.int64)) for n, (lo, hi) in spans.items())
        if len(starts) == 1:  # one run (one record): in integers
            a0, b0 = int(starts[0]), int(stops[0])
            for name, base, eb, first, end in self.fixed:
                a, b = max(a0, first), min(b0, end)
                if b > a:
                    out.append((name, np.array([base + a * eb], np.int64), np.array([base + b * eb], np.int64)))
            return out
        for name, base, eb, first, end in self.fixed:
            a = np.minimum(np.maximum(starts, first), end)
            b = np.minimum(np.maximum(stops, first), end)
            keep = b > a
            if keep.any():
                out.append((name, base + a[keep] * eb, base + b[keep] * eb))
        return out


def record_spans(backend: BackendReader, schema: Schema, slots: np.ndarray,
                 fields: Sequence[str]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(file name, starts, ends)`` of the bytes that reading ``slots`` (any
    order, duplicates allowed) of ``fields`` of a store (its ``backend`` and
    ``schema``) touches (:class:`RecordSpans`, looked up anew)."""
    return RecordSpans(backend, schema, fields)(slots)
