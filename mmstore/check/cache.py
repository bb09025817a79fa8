"""``warm`` / ``evict``: move a whole store into or out of the page cache."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..store.reader import open_store

__all__ = ["CacheReport", "evict_store", "residency", "warm_store"]


@dataclass
class CacheReport:
    path: str
    action: str  # "warm" or "evict"
    bytes_total: int = 0
    resident_before: int = 0
    resident_after: int | None = None
    bytes_read: int = 0
    seconds: float = 0.0
    available: int | None = None
    complete: bool = True
    reason: str | None = None
    warnings: list[str] = field(default_factory=list)

    _json_extra = ("mb_per_s",)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e6 if self.seconds > 0 else 0.0


def residency(paths: list[str]) -> int | None:
    """Bytes of ``paths`` in the page cache (None where mincore is missing)."""
    from .. import _os

    try:
        return sum(_os.resident_bytes(p)[0] for p in paths)
    except (OSError, NotImplementedError):
        return None


def warm_store(
    path: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], Any] | None = None,
    max_fraction: float | None = 0.9,
    chunk_bytes: int = 16 << 20,
) -> CacheReport:
    """``Store.warm()`` plus residency before and after. When the store does
    not fit in ``max_fraction`` of the available memory the pass stops there
    and the report says so (``complete=False``, ``warnings``)."""
    store = open_store(path)
    try:
        paths = store.data_paths()
        w = store.warm(progress=progress, max_fraction=max_fraction, chunk_bytes=chunk_bytes)
        rep = CacheReport(
            path=store.path, action="warm", bytes_total=w.bytes_total, resident_before=w.resident_before,
            bytes_read=w.bytes_read, seconds=w.seconds, available=w.available, complete=w.complete, reason=w.reason,
        )
        rep.resident_after = residency(paths)
        if not w.complete and w.reason:
            rep.warnings.append(f"the store does not fit in memory; stopped: {w.reason}")
        elif rep.resident_after is not None and rep.resident_after < 0.95 * rep.bytes_total:
            rep.warnings.append(
                f"only {rep.resident_after:,} of {rep.bytes_total:,} bytes stayed in the page cache "
                "(memory pressure or a cgroup limit evicted the rest)"
            )
        return rep
    finally:
        store.close()


def evict_store(path: str | os.PathLike[str], *, sync: bool = False) -> CacheReport:
    """``Store.evict()`` plus residency before and after."""
    from .. import _os

    store = open_store(path)
    try:
        paths = store.data_paths()
        before = residency(paths)
        store.evict(sync=sync)
        rep = CacheReport(path=store.path, action="evict", bytes_total=sum(os.path.getsize(p) for p in paths),
                          resident_before=before or 0, resident_after=residency(paths))
        if rep.resident_after:
            info = _os.disk_info(store.path)
            why = ("the store is on a memory file system (tmpfs), whose pages cannot be dropped"
                   if info.get("tmpfs") else
                   "pages still mapped by running processes or not yet written back stay (try --sync)")
            rep.warnings.append(f"{rep.resident_after:,} bytes are still resident: {why}")
        return rep
    finally:
        store.close()
