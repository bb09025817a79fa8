"""memmap backend: one standard ``.npy`` file per field (see format.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator, Sequence

import numpy as np

from ..format import field_file
from ..schema import Schema
from .base import Backend, FieldSegment, SlotFile, check_npy

__all__ = ["MemmapBackend"]

# Entries at least this big are copied one by one with memmove (which, as a
# ctypes foreign call, releases the GIL, so reader threads overlap their page
# faults); smaller ones are gathered with one numpy ``take``.
_MEMMOVE_MIN_BYTES = 2048
_memmove = ctypes.memmove


class MemmapBackend(Backend):
    """Fields are read through read-only shared mappings of their files."""

    name = "memmap"

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | None = None
    ) -> None:
        super().__init__(root, schema, slots, files, segment)
        self._offsets: dict[str, int] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._maps: dict[str, mmap.mmap] = {}

    @classmethod
    def write_layout(cls, schema: Schema) -> list[SlotFile]:
        return [SlotFile(field_file(f.name), f.dtype, f.shape, f.nbytes, {f.name: 0}) for f in schema]

    @classmethod
    def data_file_names(cls, schema: Schema, segment: int | None = None) -> list[str]:
        return [field_file(f.name, segment) for f in schema]

    def check(self) -> None:
        for f in self.schema:
            name = field_file(f.name, self.segment)
            self._offsets[f.name] = check_npy(
                os.path.join(self.root, name), f.dtype, (self.slots, *f.shape), self.files.get(name)
            )

    def array(self, name: str) -> np.ndarray:
        """The whole field as a read-only array over the mapping, shape (slots, *shape)."""
        arr = self._arrays.get(name)
        if arr is None:
            if not self._offsets:
                self.check()
            f = self.schema[name]
            path = os.path.join(self.root, field_file(name, self.segment))
            off = self._offsets[name]
            size = self.slots * f.nbytes
            if size == 0:
                arr = np.zeros((self.slots, *f.shape), f.dtype)
            else:
                with open(path, "rb") as fh:
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[name] = mm
                arr = np.frombuffer(mm, dtype=f.dtype, count=size // f.dtype.itemsize, offset=off)
                arr = arr.reshape((self.slots, *f.shape))
            self._arrays[name] = arr
        return arr

    def field_location(self, name: str) -> tuple[str, int, int]:
        """``(path, data_offset, entry_bytes)`` of field ``name``: slot ``s``
        is at ``data_offset + s * entry_bytes`` (for ``os.preadv`` readers)."""
        if not self._offsets:
            self.check()
        return os.path.join(self.root, field_file(name, self.segment)), self._offsets[name], self.schema[name].nbytes

    def field_segments(self, name: str) -> list[FieldSegment]:
        """Where field ``name`` lives, one entry per segment (here: one)."""
        path, off, nb = self.field_location(name)
        return [FieldSegment(path, off, nb, 0, self.slots)]

    def prepare(self, fields: Sequence[str] | None = None) -> None:
        for name in self.schema.names if fields is None else fields:
            self.array(name)

    def mapping(self, name: str) -> mmap.mmap | None:
        """The mmap object behind field ``name`` (for kernel hints)."""
        self.array(name)
        return self._maps.get(name)

    def read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        n = len(slots)
        if n == 0:
            return
        identity_rows = bool(n == 1 or np.all(rows[1:] > rows[:-1]))
        for name in fields:
            src = self.array(name)
            dst = out[name]
            nbytes = self.schema[name].nbytes
            if nbytes == 0:
                continue
            if nbytes < _MEMMOVE_MIN_BYTES:
                if identity_rows and rows[0] == 0 and rows[-1] == n - 1:
                    np.take(src, slots, axis=0, out=dst)
                else:
                    dst[rows] = np.take(src, slots, axis=0)
                continue
            _copy_rows(src, dst, slots, rows, nbytes)

    def iter_packed(self, start: int, stop: int) -> Iterator[tuple[int, memoryview | None]]:
        arrays = [self.array(f.name) for f in self.schema]
        buf = bytearray(self.schema.record_bytes)
        mv = memoryview(buf)
        for s in range(start, stop):
            pos = 0
            for f, arr in zip(self.schema, arrays):
                if f.nbytes:
                    mv[pos : pos + f.nbytes] = memoryview(arr[s]).cast("B") if f.shape else arr[s].tobytes()
                pos += f.nbytes
            yield s, mv

    def field_views(self, slot: int) -> list[np.ndarray]:
        """Views of each field's entry at ``slot`` (zero copy)."""
        return [self.array(f.name)[slot] for f in self.schema]

    def close(self) -> None:
        self._arrays.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the GC unmaps later
                pass
        self._maps.clear()


def _copy_rows(src: np.ndarray, dst: np.ndarray, slots: np.ndarray, rows: np.ndarray, nbytes: int) -> None:
    """memmove each entry (runs of consecutive slots and rows in one call)."""
    sbase = src.ctypes.data
    dbase = dst.ctypes.data
    s_list = slots.tolist()
    r_list = rows.tolist()
    n = len(s_list)
    j = 0
    while j < n:
        k = j + 1
        while k < n and s_list[k] == s_list[k - 1] + 1 and r_list[k] == r_list[k - 1] + 1:
            k += 1
        _memmove(dbase + r_list[j] * nbytes, sbase + s_list[j] * nbytes, (k - j) * nbytes)
        j = k
