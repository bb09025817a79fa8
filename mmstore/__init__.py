"""mmstore: decode once into fixed-shape records, then read any sample in O(1).

``import mmstore`` needs numpy only; LMDB, OpenCV and PyTorch are imported
when a feature that needs them is used (``mmstore.torch`` is the only module
that imports torch).
"""

from __future__ import annotations

from ._version import __version__
from .errors import (
    FormatError,
    IncompleteStoreError,
    MmstoreError,
    VersionError,
)
from .reader import Store, open_store
from .schema import Field, Schema
from .splits import split
from .writer import StoreWriter

open = open_store  # noqa: A001 - mmstore.open(path) is the public entry point

__all__ = [
    "Field",
    "FormatError",
    "IncompleteStoreError",
    "MmstoreError",
    "Schema",
    "Store",
    "StoreWriter",
    "VersionError",
    "__version__",
    "open",
    "split",
]
