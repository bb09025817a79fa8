"""mmstore: decode once into fixed-shape records, then read any sample in O(1).

``import mmstore`` needs numpy only; LMDB, OpenCV and PyTorch are imported
when a feature that needs them is used (``mmstore.torch`` is the only module
that imports torch).
"""

from __future__ import annotations

__version__ = "0.2.0"

from .errors import (  # noqa: E402
    FormatError,
    IncompleteStoreError,
    MmstoreError,
    VersionError,
)
from .reader import Store, open_store  # noqa: E402
from .schema import Field, Schema  # noqa: E402
from .writer import StoreWriter  # noqa: E402

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
]
