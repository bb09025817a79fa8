"""What every ingest source shares: the :class:`Listing` a scan produces
(numpy arrays of keys, sizes, labels and a fingerprint, see
:mod:`mmstore.ingest.sources`), the builder that fills it, the
:class:`Source` interface, per-input errors (:class:`InputError`,
:func:`reason_of`) and the bounded file read every file source uses."""

from __future__ import annotations

import os
import struct
from array import array
from typing import Any

import numpy as np
import xxhash

from ..decode import read_bytes
from ..errors import DecodeError as _CoreDecodeError

MAX_FILE_BYTES = 2 << 30  # a "photo" larger than this is refused before reading it


class InputError(_CoreDecodeError):
    """An input that becomes a hole (reason's first word is its category)."""


def reason_of(exc: BaseException) -> str | None:
    """The hole reason of a per-input error, or None for a fatal error."""
    r = getattr(exc, "reason", None)
    if isinstance(r, str) and isinstance(exc, ValueError):
        return r
    return None


class _Hash:
    """Streaming fingerprint of a listing."""

    def __init__(self, kind: str) -> None:
        self.h = xxhash.xxh3_128()
        self.h.update(kind.encode() + b"\0")

    def add(self, key: bytes, size: int, mtime: int, label: int) -> None:
        self.h.update(struct.pack("<Iqqq", len(key), size, mtime, label))
        self.h.update(key)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class Listing:
    """Inputs in slot order: keys (offsets + blob), labels, a fingerprint."""

    def __init__(
        self,
        offsets: np.ndarray,
        blob: np.ndarray,
        labels: np.ndarray | None,
        label_names: list[str] | None,
        fingerprint: str,
        warnings: dict[str, int] | None = None,
    ) -> None:
        self.offsets = offsets  # <u8, n + 1
        self.blob = blob  # uint8
        self.labels = labels  # int64 (n,) or None
        self.label_names = label_names
        self.fingerprint = fingerprint
        self.warnings = dict(warnings or {})
        # input index -> hole reason for inputs whose label is missing or not
        # valid (a list's blank or non-integer cells); sparse
        self.label_errors: dict[int, str] = {}
        # set by a source whose inputs are files named by its listing, when none exists (see none_found)
        self.none_found: str | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def key(self, i: int) -> bytes:
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()

    def sub(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys of slots ``lo..hi`` rebased: (offsets, blob) for ``set_keys``."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        return (self.offsets[lo : hi + 1] - np.uint64(a)).astype(np.uint64), self.blob[a:b]


class _Builder:
    def __init__(self, kind: str, with_labels: bool) -> None:
        self.offsets = array("Q", [0])
        self.blob = bytearray()
        self.labels = array("q") if with_labels else None
        self.hash = _Hash(kind)
        self.present = 0  # inputs added with a size (a file that exists)

    def add(self, key: bytes, size: int = -1, mtime: int = -1, label: int = -1) -> None:
        self.present += size >= 0
        self.blob += key
        self.offsets.append(len(self.blob))
        if self.labels is not None:
            self.labels.append(label)
        self.hash.add(key, size, mtime, label)

    def finish(self, label_names: list[str] | None, extra: str = "", warnings: dict | None = None) -> Listing:
        if extra:
            self.hash.h.update(extra.encode("utf-8", "surrogateescape"))
        offsets = np.frombuffer(self.offsets, dtype=np.uint64).copy()
        blob = np.frombuffer(bytes(self.blob), dtype=np.uint8) if self.blob else np.zeros(0, np.uint8)
        labels = np.frombuffer(self.labels, dtype=np.int64).copy() if self.labels is not None else None
        return Listing(offsets, blob, labels, label_names, self.hash.hexdigest(), warnings)


def none_found(b: _Builder, what: str, first: bytes, hint: str) -> str | None:
    """Why a listing of files none of which exists is refused by an ingest (a
    mistyped ``--root`` or path template would make every input a hole, after
    the whole run); None when some exists. ``make_plan`` raises it."""
    n = len(b.offsets) - 1
    if not n or b.present:
        return None
    name = os.fsdecode(first)
    name = name if len(name) <= 300 else name[:150] + f"...({len(name):,} characters)..." + name[-100:]
    return f"{what}: none of its {n:,} files exists (the first would be {name!r}); {hint}; nothing was created"


def _stat_key(path: bytes) -> tuple[int, int]:
    try:
        st = os.stat(path)
        return int(st.st_size), int(st.st_mtime_ns)
    except (OSError, ValueError):
        return -1, -1


def read_file(path: bytes | str) -> np.ndarray:
    """Read one input file, or raise a decode error with a reason."""
    return read_bytes(path, max_bytes=MAX_FILE_BYTES)


# --------------------------------------------------------------------------
# sources


class Source:
    """Base class. ``kind``, ``path`` and ``listing`` are set by ``scan``."""

    kind = "?"
    decoded = False  # True: load() returns arrays (no decode step)
    listing: Listing

    def __init__(self, path: str) -> None:
        self.path = path

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": os.path.abspath(self.path) if self.path else None}

    def scan(self) -> Listing:
        raise NotImplementedError

    def reader(self) -> Any:
        """A per-process object with ``load(i)`` (called after fork)."""
        return self

    def load(self, i: int) -> Any:
        raise NotImplementedError
