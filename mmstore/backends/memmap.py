"""memmap backend: one standard ``.npy`` file per field (see format.py)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence

import numpy as np

from .._runs import SMALL_RECORD_BYTES
from .._safecopy import MappingFault, copy_entries
from ..errors import StoreChangedError
from ..format import field_file, note_identity, open_store_file
from ..schema import Schema
from .base import Backend, FieldSegment, SlotFile, check_npy

__all__ = ["MemmapBackend"]

# Entries of at least SMALL_RECORD_BYTES are copied by the kernel, in one call
# a batch (``_safecopy.copy_entries``: SIGBUS-proof, and as a ctypes foreign
# call it releases the GIL, so reader threads overlap their page faults);
# smaller ones are gathered with one numpy ``take``.


class MemmapBackend(Backend):
    """Fields are read through read-only shared mappings of their files."""

    name = "memmap"
    positional = True

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | None = None,
        ident: dict[str, tuple[int, int, int, int]] | None = None, readahead: bool | None = None,
    ) -> None:
        super().__init__(root, schema, slots, files, segment, ident)  # readahead: the kernel's default
        self._offsets: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # field -> the exact size of its file
        self._arrays: dict[str, np.ndarray] = {}
        self._maps: dict[str, mmap.mmap] = {}

    @classmethod
    def write_layout(cls, schema: Schema) -> list[SlotFile]:
        return [SlotFile(field_file(f.name), f.dtype, f.shape, f.nbytes, {f.name: 0}) for f in schema]

    @classmethod
    def data_file_names(cls, schema: Schema, segment: int | None = None) -> list[str]:
        return [field_file(f.name, segment) for f in schema]

    @classmethod
    def field_file(cls, field: str, segment: int | None = None) -> str:
        return field_file(field, segment)

    def check(self) -> None:
        for f in self.schema:
            name = field_file(f.name, self.segment)
            self._offsets[f.name] = off = check_npy(
                os.path.join(self.root, name), f.dtype, (self.slots, *f.shape), self.files.get(name), self.ident
            )
            self._sizes[f.name] = off + self.slots * f.nbytes

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
                mm = self._map(path, name)
                self._maps[name] = mm
                arr = np.frombuffer(mm, dtype=f.dtype, count=size // f.dtype.itemsize, offset=off)
                arr = arr.reshape((self.slots, *f.shape))
            self._arrays[name] = arr
        return arr

    def _map(self, path: str, name: str) -> mmap.mmap:
        """Map field ``name``'s file: the very file the store was opened with
        (identity checked on the descriptor that is mapped), at its exact size."""
        fd = open_store_file(path, missing=f"{path}: missing; the store was moved or deleted while open")
        try:
            st = os.fstat(fd)
            note_identity(self.ident, path, st)
            if st.st_size != self._sizes[name]:
                raise StoreChangedError(
                    f"{path}: {st.st_size} bytes, expected {self._sizes[name]}: the file changed since the "
                    "store was opened; reopen the store"
                )
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def check_mapped(self, name: str) -> None:
        """Raise ``StoreChangedError`` when field ``name``'s mapped file is
        shorter than it was (one ``fstat`` of the mapping's descriptor, ~1 us).

        NOTE [truncated under a mapping]: a copy out of the mapped part of a
        truncated file kills the process with SIGBUS (or, within the file's
        last page, reads zeros), so every copy out of a mapping is preceded by
        this check. A truncation between the check and the end of the copy
        that follows cannot fault the copies of big entries (``_gather``:
        mmstore/_safecopy.py); small entries (numpy ``take``, microseconds
        a batch) remain exposed to that race."""
        mm = self._maps.get(name)
        if mm is not None and mm.size() < self._sizes[name]:
            path = os.path.join(self.root, field_file(name, self.segment))
            raise StoreChangedError(
                f"{path}: truncated to {mm.size()} bytes while the store was open (expected "
                f"{self._sizes[name]}); the store was modified in use: reopen it, or run `mmstore verify`"
            )

    def field_location(self, name: str) -> tuple[str, int, int]:
        """``(path, data_offset, entry_bytes)`` of field ``name``: slot ``s``
        is at ``data_offset + s * entry_bytes`` (for ``os.preadv`` readers).
        The file at ``path`` is checked to be the one the store was opened with."""
        if not self._offsets:
            self.check()
        path = os.path.join(self.root, field_file(name, self.segment))
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            raise StoreChangedError(f"{path}: missing; the store was moved or deleted while open") from None
        note_identity(self.ident, path, st, mtime=False)  # a stat, not an open: the reader checks its own
        return path, self._offsets[name], self.schema[name].nbytes

    def field_segments(self, name: str) -> list[FieldSegment]:
        """Where field ``name`` lives, one entry per segment (here: one)."""
        path, off, nb = self.field_location(name)
        return [FieldSegment(path, off, nb, 0, self.slots)]

    def prepare(self, fields: Sequence[str] | None = None) -> None:
        for name in self.schema.names if fields is None else fields:
            self.array(name)

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
            self.check_mapped(name)  # see NOTE [truncated under a mapping]
            if nbytes < SMALL_RECORD_BYTES:
                if identity_rows and rows[0] == 0 and rows[-1] == n - 1:
                    np.take(src, slots, axis=0, out=dst)
                else:
                    dst[rows] = np.take(src, slots, axis=0)
                continue
            self._gather(name, src, dst, slots, rows, nbytes)

    def _gather(self, name: str, src: np.ndarray, dst: np.ndarray, slots: np.ndarray, rows: np.ndarray,
                nbytes: int) -> None:
        """Copy big entries out of the mapping; a truncation racing the copy is
        a ``StoreChangedError``, not SIGBUS (see mmstore/_safecopy.py)."""
        try:
            copy_entries(dst.ctypes.data + rows.astype(np.int64) * nbytes,
                         src.ctypes.data + slots.astype(np.int64) * nbytes, nbytes)
        except MappingFault:
            self.check_mapped(name)  # names the file and its new size
            path = os.path.join(self.root, field_file(name, self.segment))
            raise StoreChangedError(f"{path}: part of the file could not be read while the store was open; "
                                    "it was modified in use: reopen the store, or run `mmstore verify`") from None

    def iter_packed(self, start: int, stop: int) -> Iterator[tuple[int, memoryview | None]]:
        arrays = [self.array(f.name) for f in self.schema]
        buf = bytearray(self.schema.record_bytes)
        mv = memoryview(buf)
        for s in range(start, stop):
            if (s - start) % 1024 == 0:  # see NOTE [truncated under a mapping]
                for f in self.schema:
                    self.check_mapped(f.name)
            pos = 0
            for f, arr in zip(self.schema, arrays):
                if f.nbytes:
                    mv[pos : pos + f.nbytes] = memoryview(arr[s]).cast("B") if f.shape else arr[s].tobytes()
                pos += f.nbytes
            yield s, mv

    def close(self) -> None:
        self._arrays.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the GC unmaps later
                pass
        self._maps.clear()
