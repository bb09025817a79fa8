"""The interface every backend implements, read side and write side."""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import ClassVar, NamedTuple

import numpy as np

from ..errors import FormatError
from ..format import note_identity, open_store_file, read_npy_header
from ..schema import Schema

__all__ = ["Backend", "FieldSegment", "SlotFile", "check_npy"]


class SlotFile(NamedTuple):
    """A preallocated file of fixed-size slot entries, as writers see it.

    ``fields`` maps a field name to its byte offset inside one entry
    (``stride`` bytes); entry ``s`` starts at ``header_len + s * stride``.
    """

    name: str
    dtype: np.dtype
    entry_shape: tuple[int, ...]
    stride: int
    fields: dict[str, int]


class FieldSegment(NamedTuple):
    """One file of a memmap field: global slot ``first + j`` (``0 <= j <
    count``) is at byte ``offset + j * entry_bytes`` of ``path``."""

    path: str
    offset: int
    entry_bytes: int
    first: int
    count: int


class Backend(ABC):
    """Read access to the record data of one finished store.

    Instances are created per process (see ``NOTE [fork safety]`` in
    ``reader.py``); they map or open their files lazily.
    """

    name: ClassVar[str]

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | None = None,
        ident: dict[str, tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.root = root
        self.schema = schema
        self.slots = slots
        self.files = files
        self.segment = segment  # None: the store's only data files; k: segment k's
        self.first: int | None = None  # a segment's first global slot (set by SegmentedBackend)
        # path -> identity of each data file when the store was opened (shared
        # with the Store): a file opened later must be that file (see format.py)
        self.ident = ident

    # -- layout -----------------------------------------------------------
    @classmethod
    @abstractmethod
    def write_layout(cls, schema: Schema) -> list[SlotFile]:
        """The slot files a writer fills (in the ``.partial`` directory)."""

    @classmethod
    @abstractmethod
    def data_file_names(cls, schema: Schema, segment: int | None = None) -> list[str]:
        """File names holding record data in a finished store (of one segment)."""

    @classmethod
    def finalize(cls, partial_dir: str, schema: Schema, slots: int, holes: np.ndarray) -> None:
        """Turn the written slot files into the finished data files
        (``holes`` is a bool array over slots). Default: nothing to do."""

    # -- read side --------------------------------------------------------
    @abstractmethod
    def check(self) -> None:
        """Validate the data files against the manifest without reading data
        (O(fields)). Raise ``FormatError`` naming the file."""

    @abstractmethod
    def read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        """Copy slot ``slots[j]`` of each field into ``out[field][rows[j]]``.

        ``slots`` is sorted ascending (reads in file order); ``rows`` says where
        each goes in the caller's order.
        """

    @abstractmethod
    def iter_packed(self, start: int, stop: int) -> Iterator[tuple[int, memoryview | None]]:
        """Yield ``(slot, packed record bytes or None for an absent record)`` for
        slots in ``[start, stop)``; the view is valid until the next item."""

    def data_paths(self) -> list[str]:
        """Absolute paths of the data files (for warm/evict/verify)."""
        return [os.path.join(self.root, n) for n in self.data_file_names(self.schema, self.segment)]

    def prepare(self, fields: Sequence[str] | None = None) -> None:  # noqa: B027 - optional hook
        """Open mappings / environments (of ``fields``, default all) now,
        before reader threads start."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release handles (mappings, environments)."""


def check_npy(
    path: str, dtype: np.dtype, shape: tuple[int, ...], size: int | None = None,
    ident: dict[str, tuple[int, int, int, int]] | None = None,
) -> int:
    """Check an ``.npy`` file's header and exact size; return its data offset.

    The file must be a regular file, not a symlink (``open_store_file``);
    ``ident`` records (or, when it holds ``path``, checks) its identity.

    Raises
    ------
    FormatError
        Missing file, not a regular file, another dtype or shape, or a size
        that is not exactly header + data (numpy itself accepts appended junk
        silently).
    StoreChangedError
        ``ident`` says the file was another one when the store was opened.
    """
    fd = open_store_file(path, missing=(
        f"{path}: missing, but the manifest lists it; the store is damaged: "
        "restore the file from a copy or re-create the store"))
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        note_identity(ident, path, st)
        got_dtype, got_shape, offset = read_npy_header(path, fh)
    actual = st.st_size
    if got_dtype != dtype or got_dtype.str != dtype.str:
        raise FormatError(f"{path}: header says dtype {got_dtype.str!r}, the manifest says {dtype.str!r}")
    if got_shape != shape:
        raise FormatError(
            f"{path}: header says shape {got_shape}, the manifest expects {shape}; "
            "the file was edited or belongs to another store"
        )
    want = offset + math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if actual != want:
        what = "truncated (a copy or write did not finish?)" if actual < want else "has extra bytes appended"
        raise FormatError(
            f"{path}: expected {want} bytes ({shape[0] if shape else 1} rows), found {actual}: "
            f"the file {what}; run `mmstore verify` and re-create or repair the store"
        )
    if size is not None and size != actual:
        raise FormatError(f"{path}: the manifest lists {size} bytes, found {actual}")
    return offset
