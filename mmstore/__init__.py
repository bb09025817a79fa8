"""mmstore: decode once into fixed-shape records, then read any sample in O(1).

``import mmstore`` needs numpy only; LMDB, OpenCV and PyTorch are imported
when a feature that needs them is used (``mmstore.torch`` is the only module
that imports torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors
from ._version import __version__
from .errors import FormatError, IncompleteStoreError, MmstoreError, VersionError
from .format.schema import Field, Schema
from .ingest import from_dataset, from_hf, ingest, merge
from .ingest.append import append
from .order.splits import split
from .store.reader import Store, open_store
from .store.writer import StoreWriter

if TYPE_CHECKING:
    from .check.verify import verify_store as verify

open = open_store  # noqa: A001 - mmstore.open(path) is the public entry point

# `mmstore.ingest` is the function (the package's own entry point, as `mmstore.ingest.merge`
# is the merge function): `from mmstore.ingest import ...` still reaches the package's names.
# The checking tools are imported on first use.
_LAZY = {"verify": ("mmstore.check.verify", "verify_store")}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'mmstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value
    return value


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
    "append",
    "errors",
    "from_dataset",
    "from_hf",
    "ingest",
    "merge",
    "open",
    "split",
    "verify",
]
