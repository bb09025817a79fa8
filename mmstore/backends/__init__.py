"""Storage backends behind one small interface (see ``base.Backend``).

``memmap`` keeps one ``.npy`` file per field; ``lmdb`` one LMDB environment.
Both are specified in ``mmstore/format.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..schema import Schema
from .base import Backend, FieldSegment, SlotFile

__all__ = ["Backend", "FieldSegment", "SlotFile", "backend_class", "data_file_names", "open_backend"]


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name``."""
    if name == "memmap":
        from .memmap import MemmapBackend

        return MemmapBackend
    if name == "lmdb":
        from .lmdb import LmdbBackend

        return LmdbBackend
    raise ValueError(f"unknown backend {name!r}; choose 'memmap' or 'lmdb'")


def data_file_names(name: str, schema: Schema, segments: Sequence[int] | None = None) -> list[str]:
    """The data files of a store of backend ``name`` (and ``segments``, see format.py)."""
    cls = backend_class(name)
    if segments is None:
        return cls.data_file_names(schema)
    return [n for k in range(len(segments)) for n in cls.data_file_names(schema, k)]


def open_backend(
    name: str, root: str, schema: Schema, slots: int, files: dict[str, int],
    segments: Sequence[int] | None = None, **kw: Any,
) -> Backend:
    """The reading backend of a store: one backend, or one per segment."""
    cls = backend_class(name)
    if segments is None:
        return cls(root, schema, slots, files, **kw)
    from .segmented import SegmentedBackend

    return SegmentedBackend(cls, root, schema, segments, files, **kw)
