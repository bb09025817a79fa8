"""memmap backend: one standard ``.npy`` file per raw field, and a ``.bin`` with
an offsets ``.npy`` per variable-size field (see format.py)."""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..._os.io import fsync_file, pwrite_all
from ..._os.runs import SMALL_RECORD_BYTES
from ..._os.safecopy import MappingFault, read_entries
from ...errors import EntryDecodeError, FormatError, StoreChangedError
from ...format.layout import KEY_DTYPE, field_file, note_identity, open_store_file, variable_files
from ...format.schema import Schema
from .base import Backend, FieldSegment, PackedRecords, SlotFile, check_npy, entry_error, packed_record

__all__ = ["MemmapBackend"]

# Entries of at least SMALL_RECORD_BYTES are read with ``os.preadv`` from a
# descriptor of their file, straight into the caller's rows
# (``_os.safecopy.read_entries``: SIGBUS-proof, the GIL released, a big batch
# shared by a few threads); smaller ones are gathered out of the mapping with
# one numpy ``take``.


class MemmapBackend(Backend):
    """Fields are read through read-only shared mappings of their files."""

    name = "memmap"
    positional = True
    _fd_finalizer: weakref.finalize | None = None  # closes the preadv descriptors of a backend dropped unclosed

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | str | None = None,
        ident: dict[str, tuple[int, int, int, int]] | None = None, readahead: bool | None = None,
    ) -> None:
        super().__init__(root, schema, slots, files, segment, ident)  # readahead: the kernel's default
        self._offsets: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # field -> the exact size of its file
        self._arrays: dict[str, np.ndarray] = {}
        self._maps: dict[str, mmap.mmap] = {}
        # variable-size fields: field -> data offset of its offsets file, size of its .bin
        self._entry_offsets: dict[str, np.ndarray] = {}
        self._fds: dict[str, int] = {}  # fixed field -> descriptor for item_reader's preads
        self._live = [True]  # item_reader's functions refuse to read once close() ran

    @classmethod
    def write_layout(cls, schema: Schema) -> list[SlotFile]:
        # variable-size fields are spilled while writing (mmstore/store/spill.py)
        return [SlotFile(field_file(f.name), f.dtype, f.shape, f.nbytes, {f.name: 0}) for f in schema.fixed_fields]

    @classmethod
    def data_file_names(cls, schema: Schema, segment: int | str | None = None) -> list[str]:
        out: list[str] = []
        for f in schema:
            out += variable_files(f.name, segment) if f.variable else [field_file(f.name, segment)]
        return out

    @classmethod
    def field_file(cls, field: str, segment: int | str | None = None) -> str:
        return field_file(field, segment)

    @classmethod
    def finalize(cls, partial_dir: str, schema: Schema, slots: int, holes: np.ndarray) -> None:
        if schema.has_variable:
            from ..spill import collect, write_field_files

            write_field_files(partial_dir, collect(partial_dir, schema, slots, holes),
                              {f.name: variable_files(f.name) for f in schema.variable_fields})

    def check(self) -> None:
        # built aside and published at once: readers test ``if not self._offsets``
        # (threads' first reads race here), so it is empty or complete, never partial
        offsets: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for f in self.schema:
            if f.variable:
                self._check_variable(f.name, offsets, sizes)
                continue
            name = field_file(f.name, self.segment)
            offsets[f.name] = off = check_npy(
                os.path.join(self.root, name), f.dtype, (self.slots, *f.shape), self.files.get(name), self.ident
            )
            sizes[f.name] = off + self.slots * f.nbytes
        self._sizes.update(sizes)
        self._offsets = offsets

    def _check_variable(self, name: str, offsets: dict[str, int], sizes: dict[str, int]) -> None:
        """O(1): the offsets file's header and size, the ``.bin``'s size, the
        first offset 0 and the last one the ``.bin``'s size (format.py)."""
        bin_name, off_name = variable_files(name, self.segment)
        opath, bpath = os.path.join(self.root, off_name), os.path.join(self.root, bin_name)
        off = check_npy(opath, KEY_DTYPE, (self.slots + 1,), self.files.get(off_name), self.ident)
        fd = open_store_file(bpath, missing=f"{bpath}: missing, but the manifest lists it; the store is damaged: "
                             "restore the file from a copy or re-create the store", ident=self.ident)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        note_identity(self.ident, bpath, st)
        want = self.files.get(bin_name)
        if want is not None and st.st_size != want:
            what = "truncated (a copy or write did not finish?)" if st.st_size < want else "has extra bytes appended"
            raise FormatError(f"{bpath}: expected {want} bytes, found {st.st_size}: the file {what}; run "
                              "`mmstore verify` and re-create or repair the store")
        fd = open_store_file(opath, missing=f"{opath}: missing, but the manifest lists it; the store is damaged",
                             ident=self.ident)
        try:
            first = int.from_bytes(os.pread(fd, 8, off), "little")
            last = int.from_bytes(os.pread(fd, 8, off + 8 * self.slots), "little")
        finally:
            os.close(fd)
        if first != 0 or last != st.st_size:
            raise FormatError(
                f"{opath}: offsets run from {first} to {last}, expected 0 to {st.st_size} (the size of "
                f"{bin_name}); the two files are damaged or from different stores: run `mmstore verify`"
            )
        offsets[name] = off
        sizes[name] = st.st_size
        sizes[off_name] = off + 8 * (self.slots + 1)

    def array(self, name: str) -> np.ndarray:
        """The whole field as a read-only array over the mapping, shape (slots, *shape)."""
        arr = self._arrays.get(name)
        if arr is None:
            if not self._offsets:
                self.check()
            f = self.schema[name]
            if f.variable:
                raise TypeError(f"field {name!r} is variable-size ({f.codec}): its entries are not an array; "
                                "use entry_offsets(name) and read_into()")
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

    def entry_offsets(self, name: str) -> np.ndarray:
        """Variable-size field ``name``: its offsets index over the mapping
        (``slots + 1`` ``<u8``; the entry of slot ``s`` is bytes ``[o[s],
        o[s + 1])`` of its ``.bin``). Only the first and last were checked
        (at open): a caller proves each pair it uses (``0 <= o[s] <= o[s+1]
        <= entry_data_size(name)``)."""
        arr = self._entry_offsets.get(name)
        if arr is None:
            if not self._offsets:
                self.check()
            _, off_name = variable_files(name, self.segment)
            mm = self._map(os.path.join(self.root, off_name), off_name)
            self._maps[off_name] = mm
            arr = np.frombuffer(mm, dtype=KEY_DTYPE, count=self.slots + 1, offset=self._offsets[name])
            self._entry_offsets[name] = arr
        return arr

    def stored_entry_bytes(self, name: str) -> int:
        """The size of field ``name``'s ``.bin``, as the manifest lists it."""
        return int(self.files[variable_files(name, self.segment)[0]])

    def entry_data_size(self, name: str) -> int:
        """Size in bytes of variable-size field ``name``'s ``.bin`` (checked at open)."""
        if not self._offsets:
            self.check()
        return self._sizes[name]

    def _entry_data(self, name: str) -> memoryview:
        """The ``.bin`` of variable-size field ``name``, mapped (empty: an empty view)."""
        mm = self._maps.get(name)
        if mm is None:
            if self.entry_data_size(name) == 0:
                return memoryview(b"")
            bin_name, _ = variable_files(name, self.segment)
            mm = self._maps[name] = self._map(os.path.join(self.root, bin_name), name)
        return memoryview(mm)

    def _open_checked(self, path: str, name: str) -> int:
        """A descriptor of field ``name``'s file: the very file the store was
        opened with (identity checked on this descriptor), at its exact size."""
        fd = open_store_file(path, missing=f"{path}: missing; the store was moved or deleted while open",
                             ident=self.ident)
        try:
            st = os.fstat(fd)
            note_identity(self.ident, path, st)
            if st.st_size != self._sizes[name]:
                raise StoreChangedError(
                    f"{path}: {st.st_size} bytes, expected {self._sizes[name]}: the file changed since the "
                    "store was opened; reopen the store"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _map(self, path: str, name: str) -> mmap.mmap:
        """Map field ``name``'s file (see ``_open_checked``): through the descriptor this process already
        reads it with, when it has one (the file it opened, even if its name is gone since: a store
        replaced by an append or an overwrite keeps being read by whoever had it open)."""
        held = self._fds.get(name, -1)
        if held >= 0:
            return mmap.mmap(held, 0, access=mmap.ACCESS_READ)
        fd = self._open_checked(path, name)
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def _field_fd(self, name: str) -> int:
        """This process's descriptor of fixed field ``name``'s file for
        ``preadv`` reads, opened once and checked like a mapping
        (``_open_checked``); two threads' first reads keep one."""
        fd = self._fds.get(name, -1)
        if fd < 0:
            if not self._offsets:
                self.check()
            if self._fd_finalizer is None:
                self._fd_finalizer = weakref.finalize(self, _close_fds, self._fds, os.getpid())
            mine = self._open_checked(os.path.join(self.root, field_file(name, self.segment)), name)
            fd = self._fds.setdefault(name, mine)
            if fd != mine:
                os.close(mine)
        return fd

    def item_reader(self) -> Callable[[int], dict[str, Any]]:
        """See NOTE [one-record path] (base.py). Every fixed field is read with
        one ``os.preadv`` of its entry from a descriptor opened once per process
        and checked like a mapping (``_field_fd``), into a new array (a 0-d
        field gives its numpy scalar, as indexing an array does): such a read
        cannot fault (a file truncated while open gives a short read, a
        ``StoreChangedError``) and releases the GIL. Variable-size fields are
        decoded as in :meth:`read_into`."""
        # a 150 KB entry read that way (np.empty + preadv) costs somewhat more
        # than a copy out of a numpy memmap (the kernel's copy out of the page
        # cache is slower than a user-space memcpy, the price of a read that
        # cannot fault) and much less than the process_vm_readv copy
        # (_os.safecopy.copy_entries), whose fixed cost one entry does not
        # amortise; an 8-byte label less than the mapping's size check (an
        # fstat) plus the copy out of it
        if not self._offsets:
            self.check()
        # (name, kind, shape, dtype, fd, offset, entry bytes); kind: 0 an array, 1 a 0-d
        # field's scalar, 2 an empty entry, 3 ragged, 4 variable-size (decoded)
        plan: list[tuple[str, int, Any, Any, int, int, int]] = []
        for f in self.schema:
            if f.ragged:
                plan.append((f.name, 3, f, None, -1, 0, 0))
            elif f.variable:
                plan.append((f.name, 4, f.shape, f.dtype, -1, 0, 0))
            elif f.nbytes == 0:
                plan.append((f.name, 2, f.shape, f.dtype, -1, 0, 0))
            else:
                plan.append((f.name, 1 if f.shape == () else 0, f.shape, f.dtype, self._field_fd(f.name),
                             self._offsets[f.name], f.nbytes))
        slots, live = self.slots, self._live
        preadv, empty = os.preadv, np.empty

        def read(slot: int) -> dict[str, Any]:
            if not 0 <= slot < slots:
                raise IndexError(f"slot {slot} is out of range for {slots} slots")
            if not live[0]:
                raise ValueError(f"{self.root}: read from a closed backend")
            out: dict[str, Any] = {}
            for name, kind, shape, dtype, fd, off, nb in plan:
                if kind <= 1:
                    a = empty(shape, dtype)
                    # ndarray has the buffer protocol; numpy's stubs declare __buffer__ only for Python >= 3.12
                    if preadv(fd, (a,), off + slot * nb) != nb:  # type: ignore[arg-type]
                        raise self.short_read_error(name, fd)
                    out[name] = a[()] if kind else a
                elif kind == 2:
                    out[name] = empty(shape, dtype)
                elif kind == 3:  # ragged: its own number of rows
                    out[name] = self.ragged_entry(shape, slot)
                else:  # variable-size: decoded into a one-row array
                    a = empty((1, *shape), dtype)
                    self._read_entries(name, np.array([slot], np.int64), np.zeros(1, np.int64), a)
                    out[name] = a[0]
            return out

        return read

    def field_fd(self, name: str) -> tuple[int, int]:
        """See ``BackendReader.field_fd``: ``_field_fd``'s descriptor, checked
        (``check_read``), and the field's data offset."""
        fd = self._field_fd(name)
        self.check_read(name, fd)
        return fd, self._offsets[name]

    def short_read_error(self, name: str, fd: int) -> StoreChangedError:
        path = os.path.join(self.root, field_file(name, self.segment))
        return StoreChangedError(
            f"{path}: truncated to {os.fstat(fd).st_size} bytes while the store was open (expected "
            f"{self._sizes[name]}); the store was modified in use: reopen it, or run `mmstore verify`"
        )

    def check_read(self, name: str, fd: int) -> None:
        """``check_mapped`` for a field read with ``preadv`` through ``fd``:
        ``StoreChangedError`` when its file is shorter than it was (one
        ``fstat``). The read itself cannot fault; this makes a truncation an
        error for every batch, not only for those reaching past the new end."""
        if os.fstat(fd).st_size < self._sizes[name]:
            raise self.short_read_error(name, fd)

    def check_mapped(self, name: str) -> None:
        """Raise ``StoreChangedError`` when field ``name``'s mapped file is
        shorter than it was (one ``fstat`` of the mapping's descriptor).

        NOTE [truncated under a mapping]: a copy out of the mapped part of a
        truncated file kills the process with SIGBUS (or, within the file's
        last page, reads zeros), so every copy out of a mapping is preceded by
        this check. A truncation between the check and the end of the copy
        that follows cannot fault the copies of big entries (``_gather``:
        mmstore/_os/safecopy.py: they are read with ``preadv``, not copied out of
        the mapping); small entries (numpy ``take``, microseconds a batch)
        remain exposed to that race."""
        if self.schema[name].variable:
            bin_name, off_name = variable_files(name, self.segment)
            self._check_map(off_name, off_name)
            self._check_map(name, bin_name)
            return
        self._check_map(name, field_file(name, self.segment))

    def _check_map(self, key: str, file: str) -> None:
        mm = self._maps.get(key)
        if mm is not None and mm.size() < self._sizes[key]:
            path = os.path.join(self.root, file)
            raise StoreChangedError(
                f"{path}: truncated to {mm.size()} bytes while the store was open (expected "
                f"{self._sizes[key]}); the store was modified in use: reopen it, or run `mmstore verify`"
            )

    def field_location(self, name: str) -> tuple[str, int, int]:
        """``(path, data_offset, entry_bytes)`` of field ``name``: slot ``s``
        is at ``data_offset + s * entry_bytes`` (for ``os.preadv`` readers).
        The file at ``path`` is checked to be the one the store was opened with."""
        if not self._offsets:
            self.check()
        if self.schema[name].variable:
            raise TypeError(f"field {name!r} is variable-size: its entries have no fixed positions "
                            "(see entry_spans)")
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

    def rewrite_entries(self, name: str, entries: Mapping[int, Any], open_file: Callable[[str], int]) -> None:
        if not entries:
            return
        writes: list[tuple[int, Any]] = []  # (file offset, bytes)
        if self.schema[name].variable:
            path = os.path.join(self.root, variable_files(name, self.segment)[0])
            offs, size = self.entry_offsets(name), self.entry_data_size(name)
            for s, data in sorted(entries.items()):
                a, b = int(offs[s]), int(offs[s + 1])
                n = len(memoryview(data).cast("B"))
                if not a <= b <= size or b - a != n:
                    raise ValueError(f"{path}: field {name!r}, slot {s}: the new entry has {n} bytes but the slot "
                                     f"holds {max(0, b - a)} (offsets {a}..{b}); an entry cannot change size in place")
                writes.append((a, data))
        else:
            (seg,) = self.field_segments(name)
            path = seg.path
            for s, data in sorted(entries.items()):
                n = len(memoryview(data).cast("B"))
                if not 0 <= s < self.slots or n != seg.entry_bytes:
                    raise ValueError(f"{path}: field {name!r}, slot {s}: expected an entry of {seg.entry_bytes} "
                                     f"bytes for one of {self.slots} slots, got {n} bytes")
                writes.append((seg.offset + s * seg.entry_bytes, data))
        fd = open_file(path)
        try:
            for off, data in writes:
                pwrite_all(fd, data, off)
            fsync_file(fd)
        finally:
            os.close(fd)

    def prepare(self, fields: Sequence[str] | None = None) -> None:
        for name in self.schema.names if fields is None else fields:
            f = self.schema[name]
            if f.variable:
                self.entry_offsets(name)
                self._entry_data(name)
            elif f.nbytes >= SMALL_RECORD_BYTES:  # read with preadv (no mapping), its descriptor opened on first use
                if not self._offsets:
                    self.check()
            else:
                self.array(name)

    def entry_spans(self, name: str, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Variable-size field ``name``: the bytes that slots ``[start, stop)``
        occupy, as ``(path, offset, length)`` per data file (here one: the
        ``.bin``), for readahead of a run of slots. Offsets are clamped to the
        file, so a damaged index gives a short span, never one past the end."""
        offs = self.entry_offsets(name)
        size = self.entry_data_size(name)
        self.check_mapped(name)
        a = min(int(offs[max(0, start)]), size)
        b = min(max(int(offs[min(stop, self.slots)]), a), size)
        return [(os.path.join(self.root, variable_files(name, self.segment)[0]), a, b - a)]

    def _read_entries(self, name: str, slots: np.ndarray, rows: np.ndarray, dst: np.ndarray) -> None:
        """Decode the entries of ``slots`` of variable-size field ``name``
        straight into ``dst[rows]``; each offset pair is proven in range first."""
        f = self.schema[name]
        offs = self.entry_offsets(name)
        data = self._entry_data(name)
        self.check_mapped(name)  # see NOTE [truncated under a mapping]
        a = offs[slots].tolist()
        b = offs[slots + 1].tolist()
        size = self.entry_data_size(name)
        decode, shape = f.codec.decode_into, f.shape
        for j, r in enumerate(rows.tolist()):
            lo, hi = a[j], b[j]
            if not lo <= hi <= size:
                raise entry_error(self, name, int(slots[j]), f"its offsets {lo}..{hi} are not an increasing pair "
                                  f"within the {size}-byte data file (the offsets index is damaged)")
            try:
                decode(data[lo:hi], dst[r : r + 1].reshape(shape))  # a view, also of a scalar
            except EntryDecodeError as exc:
                raise entry_error(self, name, int(slots[j]), str(exc)) from None

    def gather_entries(self, name: str, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See ``BackendReader.gather_entries``: vectorised over the slots
        (no Python object per entry), out of the checked mapping."""
        s = np.asarray(slots, np.int64)
        if len(s) and not (0 <= int(s.min()) and int(s.max()) < self.slots):
            raise IndexError(f"slots {int(s.min())}..{int(s.max())} are out of range for {self.slots} slots")
        offs = self.entry_offsets(name)
        size = self.entry_data_size(name)
        a, b = offs[s], offs[s + 1]
        bad = np.flatnonzero((a > b) | (b > size))
        if len(bad):
            j = int(bad[0])
            raise entry_error(self, name, int(s[j]), f"its offsets {int(a[j])}..{int(b[j])} are not an increasing "
                              f"pair within the {size}-byte data file (the offsets index is damaged)")
        a = a.astype(np.int64)
        sizes = b.astype(np.int64) - a
        total = int(sizes.sum())
        if total == 0:
            return np.zeros(0, np.uint8), sizes
        data = np.frombuffer(self._entry_data(name), np.uint8)
        self.check_mapped(name)  # see NOTE [truncated under a mapping]
        if len(s) == 1:
            return data[int(a[0]) : int(a[0]) + total].copy(), sizes
        starts = np.zeros(len(s), np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        idx = np.repeat(a - starts, sizes)
        idx += np.arange(total, dtype=np.int64)
        return data[idx], sizes

    def read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        n = len(slots)
        if n == 0:
            return
        identity_rows = bool(n == 1 or np.all(rows[1:] > rows[:-1]))
        for name in fields:
            if self.schema[name].variable:
                self._read_entries(name, slots, rows, out[name])
                continue
            dst = out[name]
            nbytes = self.schema[name].nbytes
            if nbytes == 0:
                continue
            if nbytes >= SMALL_RECORD_BYTES:
                self._gather(name, dst, slots, rows, nbytes)
                continue
            src = self.array(name)
            self.check_mapped(name)  # see NOTE [truncated under a mapping]
            if identity_rows and rows[0] == 0 and rows[-1] == n - 1:
                np.take(src, slots, axis=0, out=dst)
            else:
                dst[rows] = np.take(src, slots, axis=0)

    def _gather(self, name: str, dst: np.ndarray, slots: np.ndarray, rows: np.ndarray, nbytes: int) -> None:
        """Read big entries with ``preadv`` into their rows (mmstore/_os/safecopy.py:
        a truncation is a ``StoreChangedError``, never SIGBUS)."""
        fd, off = self.field_fd(name)
        try:
            read_entries(fd, (slots * nbytes + off).tolist(), nbytes, dst, rows.tolist())
        except MappingFault:
            raise self.short_read_error(name, fd) from None

    def iter_packed(self, start: int, stop: int) -> PackedRecords:
        if self.schema.has_variable:
            yield from self._iter_packed_variable(start, stop)
            return
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

    def _iter_packed_variable(self, start: int, stop: int) -> PackedRecords:
        """``iter_packed`` with variable-size fields: each record's checksummed
        bytes (``packed_record``); an entry whose offsets are out of range
        raises ``EntryDecodeError``."""
        fixed = {f.name: self.array(f.name) for f in self.schema.fixed_fields}
        var = {f.name: (self.entry_offsets(f.name), self.entry_data_size(f.name)) for f in self.schema.variable_fields}
        datas = {name: self._entry_data(name) for name in var}
        for s in range(start, stop):
            if (s - start) % 1024 == 0:  # see NOTE [truncated under a mapping]
                for f in self.schema:
                    self.check_mapped(f.name)
            entries = {}
            for name, (offs, size) in var.items():
                lo, hi = int(offs[s]), int(offs[s + 1])
                if not lo <= hi <= size:
                    raise entry_error(self, name, s, f"its offsets {lo}..{hi} are not an increasing pair within "
                                      f"the {size}-byte data file (the offsets index is damaged)")
                entries[name] = datas[name][lo:hi]
            yield s, packed_record(self.schema, {k: a[s] for k, a in fixed.items()}, entries)

    def close(self) -> None:
        self._live[0] = False
        self._live = [True]
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._entry_offsets.clear()
        self._arrays.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the GC unmaps later
                pass
        self._maps.clear()


def _close_fds(fds: dict[str, int], pid: int) -> None:
    """Close the descriptors of a backend that was dropped without ``close()``
    (in the process that opened them: a forked child's copies are its own)."""
    if os.getpid() != pid:
        return
    for fd in list(fds.values()):
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
