"""Storage backends behind one small interface (see ``base.Backend``).

``memmap`` keeps one ``.npy`` file per field; ``lmdb`` one LMDB environment.
Both are specified in ``mmstore/format.py``.
"""

from __future__ import annotations

from .base import Backend, SlotFile

__all__ = ["Backend", "SlotFile", "backend_class"]


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name``."""
    if name == "memmap":
        from .memmap import MemmapBackend

        return MemmapBackend
    if name == "lmdb":
        from .lmdb import LmdbBackend

        return LmdbBackend
    raise ValueError(f"unknown backend {name!r}; choose 'memmap' or 'lmdb'")
