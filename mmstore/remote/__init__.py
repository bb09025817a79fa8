"""Stores in object storage: URLs, the client, the remote index and the sparse replica.

``mmstore.open("s3://bucket/train.store", cache_dir=..., cache_limit=...)``
opens a store pushed with ``mmstore push`` through a local *replica*
(:mod:`mmstore.remote.replica`): the store's own files under the cache
directory, filled block by block as reads need them, every block verified
against the digests the push recorded (:mod:`mmstore.remote.index`, specified
in format.py, "A store in object storage"). The client (obstore) is an
optional extra, ``pip install 'mmstore[remote]'``; nothing here imports it
before a URL is used.

Modules: ``url`` (which strings are store URLs), ``client`` (requests,
retries, credentials, typed errors), ``index`` (``_remote.json``),
``replica`` (the cache: block states, locks, the limit, eviction). Importing
the package loads ``url`` only (``import mmstore`` stays light); the other
names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .url import StoreURL, is_url, local_path, parse_url

__all__ = ["Pin", "Remote", "Replica", "StoreURL", "client_available", "default_cache_dir", "is_url", "local_path",
           "open_replica", "parse_bytes", "parse_url"]

_LAZY = {"Remote": "client", "client_available": "client", "Pin": "replica", "Replica": "replica",
         "default_cache_dir": "replica", "open_replica": "replica", "parse_bytes": "replica"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
