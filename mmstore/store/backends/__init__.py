"""Storage backends behind one small interface (see ``base``).

``memmap`` keeps one ``.npy`` file per field; ``lmdb`` one LMDB environment;
a merged store reads its segments through ``segmented``. All are specified in
``mmstore/format/__init__.py``. Code outside this package asks a backend what it can
do (``BackendReader.positional``, ``segmented``, the hooks in ``base``), never
which one it is: a new backend is a module here, its class in
``_REGISTRY`` and its section of format.py (with its name in
``SUPPORTED_BACKENDS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...format.schema import Schema
from .base import Backend, BackendReader, FieldSegment, SlotFile
from .lmdb import LmdbBackend
from .memmap import MemmapBackend
from .segmented import SegmentedBackend

__all__ = [
    "Backend", "BackendReader", "FieldSegment", "SlotFile", "backend_class", "data_file_names", "open_backend",
]


# every backend, by the name manifests and writers use (format.SUPPORTED_BACKENDS)
_REGISTRY: dict[str, type[Backend]] = {cls.name: cls for cls in (MemmapBackend, LmdbBackend)}


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name`` (the writers' factory)."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown backend {name!r}; choose 'memmap' or 'lmdb'")
    return cls


def data_file_names(name: str, schema: Schema, segments: Sequence[int] | None = None,
                    parts: Sequence[str] | None = None) -> list[str]:
    """The data files of a store of backend ``name`` (and ``segments``, whose
    ``parts`` when it has them, see format.py)."""
    cls = backend_class(name)
    if segments is None:
        return cls.data_file_names(schema)
    ids = list(parts) if parts is not None else range(len(segments))
    return [n for k in ids for n in cls.data_file_names(schema, k)]


def open_backend(
    name: str, root: str, schema: Schema, slots: int, files: dict[str, int],
    segments: Sequence[int] | None = None, parts: Sequence[str] | None = None, table: Any = None, **kw: Any,
) -> BackendReader:
    """The reading backend of a store: one backend, or one per segment (named
    by ``parts`` when the store has them; ``kw``: ``ident`` and ``readahead``,
    see ``Backend``). ``table``: the store's decoded part table
    (``mmstore.format.parttable.PartTable``) instead of ``segments`` and
    ``parts``: each part's backend is made when first read."""
    cls = backend_class(name)
    if table is not None:
        return SegmentedBackend(cls, root, schema, [], files, table=table, **kw)
    if segments is None:
        return cls(root, schema, slots, files, **kw)
    return SegmentedBackend(cls, root, schema, segments, files, parts=parts, **kw)
