"""lmdb backend: one LMDB environment in one file (see format.py).

Writers fill a staging ``.npy`` of packed records at their slots (so any
number of processes can write in any order), then ``finalize`` inserts the
records into a fresh environment in key order, which makes the file the same
for the same records whatever order they were written in. The staging file
is removed by ``publish`` (regression: a crash between its removal and the
manifest left a ``.partial`` that could not resume).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import mmap
import os
import resource
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..._os.crash import crash_point
from ..._os.io import fsync_dir, fsync_path
from ...errors import EntryDecodeError, FormatError, StoreChangedError
from ...format.layout import LMDB_FILE, LMDB_TXN_RECORDS, lmdb_file, lmdb_key, note_identity, open_store_file
from ...format.schema import Schema
from .base import Backend, PackedRecords, SlotFile, check_npy, entry_error, packed_record, unpack_record

__all__ = ["LmdbBackend", "STAGING_FILE", "lmdb_map_size"]

STAGING_FILE = "_staging.npy"
# NOTE [lmdb readahead]: readahead=False is the usual advice for random reads
# of small values, and right for them; but with 150 KB records it made cold
# reads much slower, because each record spans ~37 pages that the kernel then
# fetches one fault at a time. So readahead follows the record size.
READAHEAD_MIN_RECORD_BYTES = 16384
_memmove = ctypes.memmove
_ENVS: dict[tuple[int, int], list[Any]] = {}  # (dev, inode) -> [env, users, opener pid, fd, span]
# NOTE [environment registry]: py-lmdb refuses to open a file a second time in
# one process while its first environment is open, so looking an entry up,
# opening it and closing the last user's must not interleave between threads
# (a Store dropped in one thread while another opens the same file read
# "already open in this process"). _ENVS_LOCK guards _ENVS. A release comes
# from a finalizer (any thread, at any allocation, also inside a locked
# region of the same thread), which must never block: it queues its key in
# _PENDING and drains the queue only when it gets the lock at once; whoever
# holds the lock drains it before letting go.
_ENVS_LOCK = threading.Lock()
_PENDING: list[tuple[int, int]] = []


def _after_fork_in_child() -> None:
    global _ENVS_LOCK  # another thread may have held it at fork: that thread is gone in the child
    _ENVS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _lmdb() -> Any:
    try:
        import lmdb
    except ImportError:
        raise ImportError(
            "the lmdb backend needs the 'lmdb' package: pip install lmdb"
        ) from None
    return lmdb


def lmdb_map_size(record_bytes: int, records: int) -> int:
    """A map size that ``records`` values of ``record_bytes`` always fit in.

    A value larger than LMDB's node limit (about half a page) lives in its own
    run of overflow pages (16-byte page header included); smaller values
    share leaf pages, which a worst-case split leaves half full. Branch pages,
    the free list and copy-on-write pages of the last transaction get 25% plus
    8 MiB of margin.
    """
    page = mmap.PAGESIZE
    if record_bytes + 16 > (page - 16) // 2:
        per = math.ceil((record_bytes + 16) / page) * page + 32
    else:
        per = 2 * (record_bytes + 8 + 8 + 2)
    size = int(records * per * 1.25) + (8 << 20)
    return -(-size // page) * page


def lmdb_map_size_of(value_bytes: np.ndarray) -> int:
    """:func:`lmdb_map_size` for values of the sizes ``value_bytes`` (one per
    record: a store with variable-size fields)."""
    page = mmap.PAGESIZE
    v = np.asarray(value_bytes, np.int64)
    big = v + 16 > (page - 16) // 2
    per = np.where(big, -(-(v + 16) // page) * page + 32, 2 * (v + 8 + 8 + 2))
    size = int(int(per.sum()) * 1.25) + (8 << 20)
    return -(-size // page) * page


def value_layout(schema: Schema, buf: Any) -> list[tuple[int, int]] | None:
    """``(start, length)`` in an lmdb value of each variable-size field's entry
    (format.py, "lmdb backend": raw fields, one ``<u8`` length per variable
    field, the entries), or None when the value's size does not match that
    layout (checked before any slicing)."""
    return layout_reader(schema)(buf)


@functools.lru_cache(maxsize=32)
def layout_reader(schema: Schema) -> Callable[[Any], list[tuple[int, int]] | None]:
    """:func:`value_layout` of ``schema`` as a function of the value alone,
    made once per schema: the batch reads call it for every record, so it
    reads the lengths with one precompiled ``struct`` (no numpy object per
    record; a Python int sum cannot overflow)."""
    rb, nvar = schema.record_bytes, len(schema.variable_fields)
    head = rb + 8 * nvar
    unpack = struct.Struct(f"<{nvar}Q").unpack_from

    if nvar == 1:
        def one(buf: Any) -> list[tuple[int, int]] | None:
            size = len(buf)
            if size < head:
                return None
            (n,) = unpack(buf, rb)
            return [(head, n)] if head + n == size else None
        return one

    def many(buf: Any) -> list[tuple[int, int]] | None:
        size = len(buf)
        if size < head:
            return None
        lens = unpack(buf, rb)
        if head + sum(lens) != size:
            return None
        out, pos = [], head
        for n in lens:
            out.append((pos, n))
            pos += n
        return out
    return many


class LmdbBackend(Backend):
    """Records are read with one read-only transaction per batch."""

    name = "lmdb"
    crashes_on_damage = True  # see NOTE [lmdb meta pages] and mmstore.check.verify_lmdb
    ragged_lists = True  # ragged entries come out of the same lookup as the rest of the record

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | str | None = None,
        ident: dict[str, tuple[int, int, int, int]] | None = None, readahead: bool | None = None,
    ) -> None:
        super().__init__(root, schema, slots, files, segment, ident)
        self.file = lmdb_file(segment)
        self.readahead = (
            schema.record_bytes >= READAHEAD_MIN_RECORD_BYTES if readahead is None else bool(readahead)
        )
        self._env: Any = None

    @classmethod
    def write_layout(cls, schema: Schema) -> list[SlotFile]:
        fields = {f.name: off for f, off in zip(schema.fixed_fields, schema.offsets)}
        return [SlotFile(STAGING_FILE, np.dtype("|u1"), (schema.record_bytes,), schema.record_bytes, fields)]

    @classmethod
    def data_file_names(cls, schema: Schema, segment: int | str | None = None) -> list[str]:
        return [lmdb_file(segment)]

    @classmethod
    def check_available(cls) -> None:
        _lmdb()

    @classmethod
    def finalize_bytes(cls, schema: Schema, slots: int) -> int:
        """The records once more: ``records.mdb`` is built next to the staging file."""
        return slots * schema.record_bytes

    @classmethod
    def finalize(cls, partial_dir: str, schema: Schema, slots: int, holes: np.ndarray) -> None:
        lmdb = _lmdb()
        path = os.path.join(partial_dir, LMDB_FILE)
        for stale in (path, path + "-lock"):
            if os.path.exists(stale):
                os.unlink(stale)
        staging = os.path.join(partial_dir, STAGING_FILE)
        rb = schema.record_bytes
        offset = check_npy(staging, np.dtype("|u1"), (slots, rb))
        present = np.flatnonzero(~holes)
        if schema.has_variable:
            cls._finalize_variable(path, staging, offset, schema, slots, holes, present)
            return
        map_size = lmdb_map_size(rb, len(present))
        env = lmdb.open(
            path, subdir=False, lock=False, map_size=map_size, readahead=False,
            meminit=True, max_dbs=0, sync=True, metasync=True,
        )
        try:
            with open(staging, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if slots * rb else None
                view = memoryview(mm) if mm is not None else memoryview(b"")
                try:
                    for start in range(0, len(present), LMDB_TXN_RECORDS):
                        map_size = _put_chunk(env, view, present[start : start + LMDB_TXN_RECORDS].tolist(),
                                              offset, rb, map_size)
                finally:
                    view.release()  # before the mapping closes, also when a put failed
                    if mm is not None:
                        mm.close()
            env.sync(True)
        except lmdb.Error as exc:  # liblmdb says "Input/output error" for a full disk or a file size limit
            raise _write_failure(path, exc) from None
        finally:
            env.close()
        fsync_path(path)
        fsync_dir(partial_dir)
        # the staging file stays until publish() removes what the manifest does
        # not list: a crash before the manifest is durable must find it on resume

    @classmethod
    def _finalize_variable(cls, path: str, staging: str, offset: int, schema: Schema, slots: int,
                           holes: np.ndarray, present: np.ndarray) -> None:
        """``finalize`` with variable-size fields: each value is the staged
        fixed part, the entries' lengths and the entries (from the spills)."""
        from ..spill import collect

        lmdb = _lmdb()
        found = collect(os.path.dirname(path), schema, slots, holes)
        ents = [found[f.name] for f in schema.variable_fields]
        rb = schema.record_bytes
        sizes = rb + 8 * len(ents) + sum((e.length for e in ents), np.zeros(slots, np.int64))
        map_size = lmdb_map_size_of(sizes[present])
        paths = ents[0].paths if ents else []
        maps = []
        env = lmdb.open(path, subdir=False, lock=False, map_size=map_size, readahead=False,
                        meminit=True, max_dbs=0, sync=True, metasync=True)
        try:
            for p in paths:
                with open(p, "rb") as fh:
                    maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(fh.fileno()).st_size
                                else None)
            with open(staging, "rb") as fh:
                fixed = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if slots * rb else None

                def value(s: int) -> bytes:
                    parts = [fixed[offset + s * rb : offset + (s + 1) * rb] if fixed is not None else b""]
                    parts += [int(e.length[s]).to_bytes(8, "little") for e in ents]
                    for e in ents:
                        if e.length[s]:
                            a = int(e.start[s])
                            parts.append(maps[int(e.src[s])][a : a + int(e.length[s])])  # type: ignore[index]
                    return b"".join(parts)

                try:
                    for start in range(0, len(present), LMDB_TXN_RECORDS):
                        chunk = present[start : start + LMDB_TXN_RECORDS].tolist()
                        map_size = put_values(env, [(lmdb_key(s), value(s)) for s in chunk], map_size)
                finally:
                    if fixed is not None:
                        fixed.close()
            env.sync(True)
        except lmdb.Error as exc:
            raise _write_failure(path, exc) from None
        finally:
            env.close()
            for m in maps:
                if m is not None:
                    m.close()
        fsync_path(path)
        fsync_dir(os.path.dirname(path))

    # -- read side -----------------------------------------------------------
    def _open_file(self) -> tuple[int, os.stat_result]:
        """Open the LMDB file (a regular file, the one the store was opened
        with, of the manifest's size, with sane meta pages): ``(fd, stat)``."""
        path = os.path.join(self.root, self.file)
        fd = open_store_file(path, missing=(
            f"{path}: missing, but the store lists it (in its manifest or part table); the store is damaged: restore "
            "the file or re-create the store"), ident=self.ident)
        try:
            st = os.fstat(fd)
            note_identity(self.ident, path, st)
            want = self.files.get(self.file)
            if want is not None and st.st_size != want:
                what = "truncated" if st.st_size < want else "longer than written (junk appended?)"
                raise FormatError(
                    f"{path}: expected {want} bytes, found {st.st_size}: the file is {what}; "
                    "run `mmstore verify` and re-create or repair the store"
                )
            check_lmdb_meta(path, fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def check(self) -> None:
        path = os.path.join(self.root, self.file)
        os.close(self._open_file()[0])
        if self.slots == 0:
            return
        try:  # one record's length tells whether the schema describes these values
            with self.env().begin(buffers=True) as txn:
                cur = txn.cursor()
                if cur.first():
                    k, v = cur.item()
                    if self.schema.has_variable:
                        fits = value_layout(self.schema, v) is not None
                        need = f"values of {self.schema.record_bytes} bytes + 8 per variable-size field + entries"
                    else:
                        fits = len(v) == self.schema.record_bytes
                        need = f"{self.schema.record_bytes}-byte values"
                    if len(k) != 8 or not fits:
                        raise FormatError(
                            f"{path}: first record has a {len(k)}-byte key and {len(v)}-byte value; "
                            f"the manifest's schema needs 8-byte keys and {need}: "
                            "the manifest and the data belong to different stores"
                        )
        except _lmdb().Error as exc:
            raise FormatError(f"{path}: the LMDB file is damaged ({exc}); run `mmstore verify`") from None
        finally:
            self.close()

    def env(self) -> Any:
        """The read-only environment of this process (opened on first use).

        NOTE [lmdb and fork]: py-lmdb refuses to open one environment twice
        in a process, and a forked child inherits that registry. Closing the
        inherited environment in the child can hang (a parent thread may have
        held a transaction at fork time), so a child keeps using the inherited
        one: it is read-only and opened with ``lock=False`` (no reader table,
        no pid-bound lock state), its mapping is inherited intact, and new
        transactions in the child only read the meta pages (tested under a
        reader thread in the parent). Stores on the same file share one
        environment; only the process that opened it ever closes it.
        """
        if self._env is None:
            fd, st = self._open_file()
            with _registry():
                key = (st.st_dev, st.st_ino)  # a store re-created at the same path is another file
                ent = _ENVS.get(key)
                if ent is None:
                    lmdb = _lmdb()
                    path = os.path.realpath(os.path.join(self.root, self.file))
                    try:
                        try:
                            env = self._open_env(lmdb, path, _map_size(st.st_size))
                        except lmdb.MemoryError:  # see NOTE [past the end of the file]
                            env = self._open_env(lmdb, path, _map_size(st.st_size, _SMALL_TAIL))
                    except lmdb.Error as exc:
                        os.close(fd)
                        raise FormatError(f"{path}: not a readable LMDB environment ({exc})") from None
                    now = os.stat(path)
                    if (now.st_dev, now.st_ino) != key:  # replaced between the checks and lmdb.open
                        env.close()
                        os.close(fd)
                        raise StoreChangedError(f"{path}: replaced while the store was being opened; reopen it")
                    span = _mapped_range(st)
                    if span is not None:
                        _zero_tail(span, st.st_size)
                    ent = _ENVS[key] = [env, 0, os.getpid(), fd, span and (span[0], span[0] + st.st_size)]
                else:
                    os.close(fd)
                ent[1] += 1
                self._env = ent[0]
                self._env_key = key
                self._fd = ent[3]  # for the size check before each read
                self._span = ent[4]  # (start, end) of the file's bytes in the mapping, or None
                # a Store dropped without close() must still give its share back
                self._release = weakref.finalize(self, _release_env, key)
        return self._env

    def _open_env(self, lmdb: Any, path: str, map_size: int) -> Any:
        return lmdb.open(
            path, subdir=False, readonly=True, lock=False, readahead=self.readahead,
            meminit=False, max_dbs=0, max_spare_txns=4, map_size=map_size,
        )

    def _check_size(self) -> None:
        """See NOTE [truncated under a mapping] in memmap.py: LMDB maps the
        file too, so a truncated file is refused before each batch."""
        want = self.files.get(self.file)
        if want is not None:
            size = os.fstat(self._fd).st_size
            if size < want:
                raise StoreChangedError(
                    f"{os.path.join(self.root, self.file)}: truncated to {size} bytes while the store was open "
                    f"(expected {want}); the store was modified in use: reopen it, or run `mmstore verify`"
                )

    def _values(self, slots: np.ndarray, layout: Any) -> Iterator[tuple[int, Any, int, Any]]:
        """``(j, value, address, layout(value))`` of each of ``slots``, looked
        up in one read transaction (open while the caller uses the value);
        a value that is missing, damaged, of a size ``layout`` refuses (None)
        or outside the mapping raises before the caller sees it."""
        keys = slots.astype(">u8").tobytes()
        env = self.env()
        self._check_size()
        span = self._span
        with env.begin(buffers=True) as txn:
            get = txn.get
            for j in range(len(slots)):
                try:
                    buf = get(keys[8 * j : 8 * j + 8])
                except _lmdb().Error as exc:
                    self._damaged(int(slots[j]), exc)
                lay = layout(buf) if buf is not None else None
                if lay is None:
                    self._bad(int(slots[j]), buf)
                addr = np.frombuffer(buf, np.uint8).ctypes.data
                if span is not None and not span[0] <= addr <= span[1] - len(buf):
                    self._outside(int(slots[j]))
                yield j, buf, addr, lay

    def read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        if len(slots) == 0:
            return
        if self.schema.has_variable:
            self._read_variable(slots, rows, fields, out)
            return
        rb = self.schema.record_bytes
        parts = [
            (out[name].ctypes.data, self.schema.offset(name), self.schema[name].nbytes)
            for name in fields
            if self.schema[name].nbytes
        ]
        r_list = rows.tolist()
        for j, _, addr, _ in self._values(slots, lambda b: True if len(b) == rb else None):
            r = r_list[j]
            for dbase, off, nb in parts:
                _memmove(dbase + r * nb, addr + off, nb)

    def _read_variable(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        """``read_into`` of a schema with variable-size fields: each value's
        size is checked against its layout before any slice of it is used."""
        fixed = [(out[n].ctypes.data, self.schema.offset(n), self.schema[n].nbytes)
                 for n in fields if not self.schema[n].variable and self.schema[n].nbytes]
        var_ix = {f.name: k for k, f in enumerate(self.schema.variable_fields)}
        var = [(n, var_ix[n], self.schema[n].codec.decode_into, out[n]) for n in fields
               if n in var_ix and not self.schema[n].ragged]
        ragged = [(var_ix[n], out[n]) for n in fields if self.schema[n].ragged]
        r_list = rows.tolist()
        for j, buf, addr, lay in self._values(slots, self._layout()):
            r = r_list[j]
            for dbase, off, nb in fixed:
                _memmove(dbase + r * nb, addr + off, nb)
            for k, lst in ragged:
                a, n = lay[k]
                lst[r] = bytes(buf[a : a + n])
            for name, k, decode, dst in var:
                a, n = lay[k]
                try:
                    decode(buf[a : a + n], dst[r : r + 1].reshape(dst.shape[1:]))  # a view, also of a scalar
                except EntryDecodeError as exc:
                    raise entry_error(self, name, int(slots[j]), str(exc)) from None

    def gather_entries(self, name: str, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See ``BackendReader.gather_entries``: one lookup per slot, each
        value's size checked against its layout first."""
        k = [f.name for f in self.schema.variable_fields].index(name)
        s = np.asarray(slots, np.int64)
        sizes = np.zeros(len(s), np.int64)
        parts = []
        if len(s):
            for j, buf, _, lay in self._values(s, self._layout()):
                a, n = lay[k]
                parts.append(bytes(buf[a : a + n]))
                sizes[j] = n
        return np.frombuffer(b"".join(parts), np.uint8).copy(), sizes

    def _layout(self) -> Callable[[Any], list[tuple[int, int]] | None]:
        """This store's :func:`layout_reader` (cached per schema)."""
        return layout_reader(self.schema)

    def prepare(self, fields: Sequence[str] | None = None) -> None:
        self.env()

    def _damaged(self, slot: int, exc: Exception) -> None:
        path = os.path.join(self.root, self.file)
        where = f"slot {slot}" if self.first is None else f"slot {self.first + slot} (key {slot} of this segment)"
        raise FormatError(f"{path}: the LMDB file is damaged where {where} is looked up ({exc}); "
                          "run `mmstore verify` and repair or re-create the store") from None

    def _outside(self, slot: int) -> None:
        path = os.path.join(self.root, self.file)
        where = f"slot {slot}" if self.first is None else f"slot {self.first + slot} (key {slot} of this segment)"
        raise FormatError(f"{path}: the record for {where} points past the end of the file; the LMDB file is "
                          "damaged: run `mmstore verify` and repair or re-create the store")

    def _bad(self, slot: int, buf: Any) -> None:
        path = os.path.join(self.root, self.file)
        where = f"slot {slot}" if self.first is None else f"slot {self.first + slot} (key {slot} of this segment)"
        if buf is None:
            raise FormatError(f"{path}: no record for {where}; the store is damaged (run `mmstore verify`)")
        if self.schema.has_variable:
            raise FormatError(
                f"{path}: record for {where} has {len(buf)} bytes, which does not match its layout ("
                f"{self.schema.record_bytes} bytes of raw fields, {len(self.schema.variable_fields)} entry lengths "
                "and the entries they add up to); the store is damaged: run `mmstore verify`"
            )
        raise FormatError(
            f"{path}: record for {where} has {len(buf)} bytes, expected {self.schema.record_bytes}"
        )

    def iter_packed(self, start: int, stop: int) -> PackedRecords:
        env = self.env()
        self._check_size()
        span = self._span
        with env.begin(buffers=True) as txn:
            cur = txn.cursor()
            nxt = start
            if cur.set_range(lmdb_key(start)):
                for k, v in cur:
                    s = int.from_bytes(k, "big")
                    if s >= stop:
                        break
                    while nxt < s:
                        yield nxt, None
                        nxt += 1
                    if span is not None and len(v):
                        addr = np.frombuffer(v, np.uint8).ctypes.data
                        if not span[0] <= addr <= span[1] - len(v):
                            self._outside(s)
                    yield s, (self._canonical(s, v) if self.schema.has_variable else v)
                    nxt = s + 1
            while nxt < stop:
                yield nxt, None
                nxt += 1

    def entry_sizes(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Stored sizes of variable-size field ``name`` at ``slots`` (one
        lookup each; an absent record or a value off its layout counts 0)."""
        k = [f.name for f in self.schema.variable_fields].index(name)
        out = np.zeros(len(slots), np.int64)
        with self.env().begin(buffers=True) as txn:
            for j, s in enumerate(np.asarray(slots, np.int64).tolist()):
                v = txn.get(lmdb_key(s))
                lay = value_layout(self.schema, v) if v is not None else None
                out[j] = lay[k][1] if lay is not None else 0
        return out

    def _canonical(self, slot: int, v: Any) -> memoryview:
        """A 2.0 value as the bytes its checksum covers (``iter_packed``)."""
        lay = value_layout(self.schema, v)
        if lay is None:
            self._bad(slot, v)
        fixed = {f.name: v[o : o + f.nbytes] for f, o in zip(self.schema.fixed_fields, self.schema.offsets)}
        entries = {f.name: v[a : a + n] for f, (a, n) in zip(self.schema.variable_fields, lay)}  # type: ignore[arg-type]
        return packed_record(self.schema, fixed, entries)

    def has_stray_entries(self, holes: np.ndarray) -> bool:
        """A key that is not one of this segment's records (malformed, past
        its slots, or a hole's): a scan of the keys only."""
        with self.env().begin() as txn:
            for k in txn.cursor().iternext(keys=True, values=False):
                s = int.from_bytes(k, "big") if len(k) == 8 else -1
                if not 0 <= s < len(holes) or holes[s]:
                    return True
        return False

    def rebuild(self, directory: str, holes: np.ndarray, fixes: Mapping[int, bytes]) -> None:
        """See ``Backend.rebuild``. With variable-size fields the new file has
        the same keys, values and transactions as a writer's ``finalize``
        (each fix as its 2.0 value: format.py, "lmdb backend"); every other
        value is copied as it is."""
        if not self.schema.has_variable:
            super().rebuild(directory, holes, fixes)
            return
        lmdb = _lmdb()
        present = np.flatnonzero(~holes).tolist()
        old = self.env()

        def value(txn: Any, j: int) -> bytes | None:
            fix = fixes.get(j)
            if fix is not None:
                return _value_of(self.schema, fix)
            v = txn.get(lmdb_key(j))
            return bytes(v) if v is not None else None

        with old.begin(buffers=True) as txn:
            sizes = np.array([len(value(txn, j) or b"") for j in present], np.int64)
        path = os.path.join(directory, lmdb_file(None))
        map_size = lmdb_map_size_of(sizes)
        env = lmdb.open(path, subdir=False, lock=False, map_size=map_size, readahead=False, meminit=True,
                        max_dbs=0, sync=True, metasync=True)
        try:
            with old.begin(buffers=True) as txn:
                for a in range(0, len(present), LMDB_TXN_RECORDS):
                    items = [(lmdb_key(j), value(txn, j)) for j in present[a : a + LMDB_TXN_RECORDS]]
                    map_size = put_values(env, [(k, v) for k, v in items if v is not None], map_size)
            env.sync(True)
        finally:
            env.close()
        fsync_path(path)

    def close(self) -> None:
        if self._env is not None:
            self._env = None
            self._release()


# NOTE [past the end of the file]: a damaged node inside a page can make
# LMDB, or py-lmdb (which touches every page of a value it returns, to fault
# it in without the GIL), read past the end of the file: a node offset or key
# size (16 bits) up to 64 KiB past its page, a value size (32 bits) up to
# 4 GiB past the value's start. Past the end of the file, a shared mapping of
# it is SIGBUS; past the end of the mapping, SIGSEGV. So the environment maps
# the file plus _TAIL bytes of address space, and that tail is replaced by
# private zero pages (read-only: no memory is committed, reads share the
# kernel's zero page): such a read finds zeros, LMDB returns an error or a
# value that fails the length and range checks in read_into, and the process
# lives. Where the address space is limited (ulimit -v), the tail is
# _SMALL_TAIL, which still covers the 16-bit offsets.
_TAIL = (4 << 30) + (128 << 10)
_SMALL_TAIL = 256 << 10


def _map_size(file_size: int, tail: int = _TAIL) -> int:
    page = mmap.PAGESIZE
    return -(-(file_size + tail) // page) * page


def _mapped_range(st: os.stat_result) -> tuple[int, int] | None:
    """Where LMDB mapped the file ``st`` describes in this process:
    ``(start, end of the mapping)``, from ``/proc/self/maps`` (None elsewhere)."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) >= 5 and parts[4] == str(st.st_ino) and parts[3] == want and int(parts[2], 16) == 0:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    return start, end
    except OSError:
        pass
    return None


def _zero_tail(span: tuple[int, int], file_size: int) -> None:
    """See NOTE [past the end of the file]: map zero pages over the part of
    the mapping ``span`` that lies past the end of the file."""
    if not sys.platform.startswith("linux"):
        return
    page = mmap.PAGESIZE
    start = -(-(span[0] + file_size) // page) * page
    if start >= span[1]:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    map_fixed = 0x10
    got = libc.mmap(start, span[1] - start, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed, -1, 0)
    if got != start:
        raise OSError(ctypes.get_errno(), "mapping zero pages after an LMDB file failed")


def _value_of(schema: Schema, packed: bytes) -> bytes:
    """A record's checksummed bytes as its 2.0 value (format.py, "lmdb
    backend": the raw fields, the entries' lengths, the entries)."""
    parts = unpack_record(schema, packed)
    if parts is None:
        raise ValueError("internal error: the rebuilt record has no valid layout")
    fixed, entries = parts
    var = schema.variable_fields
    return b"".join([*(fixed[f.name].tobytes() for f in schema.fixed_fields),
                     *(len(entries[f.name]).to_bytes(8, "little") for f in var),
                     *(bytes(entries[f.name]) for f in var)])


def put_values(env: Any, items: list[tuple[bytes, Any]], map_size: int) -> int:
    """One write transaction of ``(key, value)`` items in key order; returns
    the map size (grown if the estimate was too small)."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in items:
                    txn.put(k, v, append=True)
                crash_point("commit")
            return map_size
        except _lmdb().MapFullError:
            map_size *= 2
            env.set_mapsize(map_size)


def _put_chunk(env: Any, view: memoryview, chunk: list[int], offset: int, rb: int, map_size: int) -> int:
    """One write transaction of ``chunk``'s records; returns the map size
    (grown if the estimate was too small)."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for s in chunk:
                    o = offset + s * rb
                    txn.put(lmdb_key(s), view[o : o + rb], append=True)
                crash_point("commit")
            return map_size
        except _lmdb().MapFullError:
            # NOTE: lmdb_map_size should make this unreachable; a too-small map is grown, never fatal
            map_size *= 2
            env.set_mapsize(map_size)


def _write_failure(path: str, exc: Exception) -> OSError:
    """liblmdb reports a full disk and a file size limit alike as "Input/output
    error": tell them apart by the file's size and the free space, so the
    message names the cause (``_os.io.describe_write_error``, the CLI's hint)."""
    code = errno.EIO
    try:
        size = os.path.getsize(path)
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        st = os.statvfs(os.path.dirname(path) or ".")
        if soft != resource.RLIM_INFINITY and size + (1 << 20) >= soft:
            code = errno.EFBIG
        elif st.f_bavail * st.f_frsize < (1 << 20):
            code = errno.ENOSPC
    except OSError:
        pass
    return OSError(code, f"writing the LMDB file failed ({exc})", path)


class _registry:
    """Hold ``_ENVS_LOCK``; drain the releases queued meanwhile on the way out."""

    def __enter__(self) -> None:
        _ENVS_LOCK.acquire()

    def __exit__(self, *exc: object) -> None:
        try:
            _drain_releases()
        finally:
            _ENVS_LOCK.release()
        if _PENDING:  # queued by another thread after the drain above
            _try_drain()


def _release_env(key: tuple[int, int]) -> None:
    """A Store's share of an environment given back (from a finalizer: never
    blocks; see NOTE [environment registry])."""
    _PENDING.append(key)
    _try_drain()


def _try_drain() -> None:
    if _ENVS_LOCK.acquire(blocking=False):
        try:
            _drain_releases()
        finally:
            _ENVS_LOCK.release()


def _drain_releases() -> None:
    while _PENDING:
        key = _PENDING.pop()
        ent = _ENVS.get(key)
        if ent is None:
            continue
        ent[1] -= 1
        if ent[1] <= 0 and ent[2] == os.getpid():  # see NOTE [lmdb and fork]
            del _ENVS[key]
            ent[0].close()
            os.close(ent[3])


# NOTE [lmdb meta pages]: LMDB (0.9) trusts the file: it maps it and follows
# page numbers, refusing only those >= the meta page's last page + 1
# (MDB_PAGE_NOTFOUND). A damaged meta page (its last page past the end of the
# file, a wrong page size, a root outside the file) makes it read past the end
# of the file, which kills the process with SIGBUS. So both meta pages are
# checked here before LMDB sees the file; then every page number LMDB accepts
# lies inside the file. Layout (64-bit): page header 16 bytes, then MDB_meta:
# magic u32, version u32, address u64, mapsize u64, two MDB_db of 48 bytes
# (pad u32 [the free DB's holds the page size], flags u16, depth u16, branch,
# leaf, overflow pages, entries, root: u64 each), last_pg u64, txnid u64.
_MDB_MAGIC = 0xBEEFC0DE
_MDB_VERSION = 1
_P_META = 0x08
_P_INVALID = 2**64 - 1
_META_BYTES = 152


def check_lmdb_meta(path: str, fd: int, size: int) -> None:
    """Refuse an LMDB file whose meta pages LMDB would read past the file's end with."""
    def bad(what: str) -> FormatError:
        return FormatError(f"{path}: not a valid LMDB file ({what}); the file is damaged: "
                           "run `mmstore verify`, then repair or re-create the store")

    head = os.pread(fd, _META_BYTES, 0)
    if len(head) < _META_BYTES:
        raise bad(f"{size} bytes, shorter than its meta page")
    psize = int.from_bytes(head[40:44], "little")
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise bad(f"page size {psize}")
    if size < 2 * psize:
        raise bad(f"{size} bytes, shorter than its two meta pages of {psize} bytes")
    for k in (0, 1):
        m = head if k == 0 else os.pread(fd, _META_BYTES, psize)
        u64 = lambda o, m=m: int.from_bytes(m[o : o + 8], "little")  # noqa: E731
        magic, version = int.from_bytes(m[16:20], "little"), int.from_bytes(m[20:24], "little")
        flags = int.from_bytes(m[10:12], "little")
        if magic != _MDB_MAGIC or version != _MDB_VERSION or not flags & _P_META or u64(0) != k:
            raise bad(f"meta page {k}: magic {magic:#x}, version {version}, flags {flags:#x}")
        last = u64(136)
        if (last + 1) * psize > size:
            raise bad(f"meta page {k} says the data ends at page {last}, past the end of the "
                      f"{size}-byte file")
        for db, o in (("free", 40), ("main", 88)):
            root, depth = u64(o + 40), int.from_bytes(m[o + 6 : o + 8], "little")
            if root != _P_INVALID and not 2 <= root <= last or depth > 32:
                raise bad(f"meta page {k}: {db} database root page {root} (last page {last}), depth {depth}")
