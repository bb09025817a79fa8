"""What the structure pass of ``verify`` learned about a store (its
manifest, segments, offsets, holes and bookkeeping arrays), handed to the
content passes (:mod:`mmstore.check.verify_entries`, :mod:`mmstore.check.verify`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.layout import decode_key, segment_ids
from ..format.schema import Schema
from ..store.backends import backend_class

__all__ = ["Ctx"]


class Ctx:
    """What the structure pass learned, for the content pass."""

    def __init__(self, path: str, manifest: dict[str, Any]) -> None:
        self.path = path
        self.m = manifest
        self.schema = Schema(manifest["schema"], classes=manifest["classes"], buckets=manifest["buckets"])
        self.slots: int = manifest["slots"]
        self.records: int = manifest["records"]
        self.backend: str = manifest["backend"]
        self.cls = backend_class(self.backend)
        self.segmented = manifest.get("segments") is not None
        # (segment id: its number, its part id or None, first slot, slot count) of each data segment
        counts = manifest.get("segments") or [self.slots]
        firsts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        found = segment_ids(manifest)
        ids: list[int | str | None] = list(found) if found is not None else [None]
        self.segments: list[tuple[int | str | None, int, int]] = [
            (ids[k], firsts[k], int(c)) for k, c in enumerate(counts)
        ]
        self.data_ok = True
        self.offsets: dict[tuple[str, int | str | None], int] = {}  # (field, segment) -> data offset
        self.checksums: np.ndarray | None = None
        self.key_offsets: np.ndarray | None = None
        self.key_blob: bytes | None = None
        self.index: np.ndarray | None = None
        self.holes = np.zeros(self.slots, dtype=bool)
        # variable-size fields (positional backends): (field, segment) -> its
        # offsets index and the size of its .bin, and the global slots whose
        # entry the offsets do not place within the .bin (format.py, "Encoded fields")
        self.entries: dict[tuple[str, int | str | None], tuple[np.ndarray, int]] = {}
        self.bad_entries: dict[str, np.ndarray] = {}
        self.offset_findings: list[tuple[str, str, int, np.ndarray, str]] = []

    def key_of(self, slot: int) -> str:
        if self.key_offsets is None or self.key_blob is None or not 0 <= slot < self.slots:
            return ""
        a, b = int(self.key_offsets[slot]), int(self.key_offsets[slot + 1])
        return decode_key(self.key_blob[a:b]) if 0 <= a <= b <= len(self.key_blob) else ""

    def index_of(self, slot: int) -> int | None:
        if not 0 <= slot < self.slots or self.holes[slot]:
            return None
        if self.index is None:
            return slot
        k = int(np.searchsorted(self.index, slot))
        return k if k < len(self.index) and int(self.index[k]) == slot else None
