"""Reading and writing stores: :class:`Store` (``reader``), :class:`StoreWriter`
(``writer``, the one writer of store bytes), and the backends that hold the
records (``backends``: memmap, segmented, LMDB)."""

from __future__ import annotations

from .reader import Store, open_store
from .writer import StoreWriter

__all__ = ["Store", "StoreWriter", "open_store"]
