"""Encoded entries while a store is written: append-only spill files in ``STORE.partial``.

Entries of variable-size fields (format.py, "Encoded fields") have sizes only
known once encoded, so a writer cannot put them at a precomputed position.
Each :class:`~mmstore.store.writer.SlotWriter` (one per process: the ingest's
workers, or a ``StoreWriter``) appends its entries to its own pair of files:

``_spill.NNNNNN.bin``
    the encoded entries, back to back, in the order they were written;
``_spill.NNNNNN.idx``
    one 40-byte row per entry: ``<u8`` slot, variable-field number (its
    position among ``Schema.variable_fields``), offset in the ``.bin``,
    length, and a check word (:func:`_check_word`) that a torn or
    zero-filled row fails.

``NNNNNN`` is taken with ``O_EXCL`` as one more than the largest number in
the directory when the writer makes its first entry, so a writer that starts
after another has written gets a larger number. The entry of a slot is the
last valid row for it in (file number, row) order: a slot written again (by
the same writer, or by a later one after a crash or a resume) supersedes its
older entries; rows of ranges that were never committed are superseded when
the resumed run writes those ranges again, and whether a slot is a record or
a hole is the writer's state, never the spills'. Holes have empty entries.

At close, :func:`collect` finds each slot's entry and :func:`assemble` copies
them in slot order into ``<field>.bin`` with ``os.copy_file_range`` (one call
per run of entries that lie back to back in one spill, which is what a
worker writing a range makes), so the result is byte-identical whatever the
number of writers, their order and the interruptions. The spill files are
not part of the store: ``publish`` removes them.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any, NamedTuple

import numpy as np

from .._os.io import check_space, copy_range, fsync_dir, fsync_file, fsync_path, pwrite_all
from ..errors import SchemaError
from ..format.layout import npy_header
from ..format.schema import Schema

__all__ = ["Spill", "SpillEntries", "assemble", "collect", "is_spill_file", "spill_files", "sync_spills",
           "write_field_files"]

_ROW = 5  # u8 words per row
_ROW_BYTES = 8 * _ROW
_HOLD_BYTES = 4 << 20  # held entries are written when they reach this much
_NAME_RE = re.compile(r"^_spill\.(\d{6,})\.(bin|idx)$")
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5],
                dtype=np.uint64)
_SALT = np.uint64(0x6D6D73746F726521)  # a zero-filled row never checks


def _check_word(rows: np.ndarray) -> np.ndarray:
    """The check word of rows ``(n, 4)`` of uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        return (rows * _MIX).sum(axis=1, dtype=np.uint64) ^ _SALT


def is_spill_file(name: str) -> bool:
    """True for the name of a spill file (bookkeeping of a ``.partial``)."""
    return _NAME_RE.match(name) is not None


def spill_files(partial: str) -> list[tuple[int, str, str]]:
    """``(number, bin path, idx path)`` of every spill in ``partial``, by number."""
    nums = set()
    for name in os.listdir(partial):
        m = _NAME_RE.match(name)
        if m:
            nums.add(int(m.group(1)))
    return [(n, os.path.join(partial, f"_spill.{n:06d}.bin"), os.path.join(partial, f"_spill.{n:06d}.idx"))
            for n in sorted(nums)]


def sync_spills(partial: str) -> None:
    """fsync every spill file of ``partial`` (whichever process wrote it) and
    the directory (their names): a range committed after this is durable."""
    found = False
    for _, *paths in spill_files(partial):
        for p in paths:
            try:
                fsync_path(p)
            except FileNotFoundError:
                continue
            found = True
    if found:
        fsync_dir(partial)


class Spill:
    """The spill of one writer (created on its first entry)."""

    def __init__(self, partial: str) -> None:
        self.partial = partial
        self.fds: tuple[int, int] | None = None
        self.pos = 0
        self.rows = 0
        self._held: tuple[bytearray, list[tuple[int, int, int]]] | None = None

    def _create(self) -> tuple[int, int]:
        for _ in range(1000):
            have = spill_files(self.partial)
            n = have[-1][0] + 1 if have else 1
            idx = os.path.join(self.partial, f"_spill.{n:06d}.idx")
            try:
                ifd = os.open(idx, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue  # another writer took this number first
            bfd = os.open(os.path.join(self.partial, f"_spill.{n:06d}.bin"),
                          os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            return bfd, ifd
        raise OSError(errno.EEXIST, f"{self.partial}: could not create a spill file (names kept being taken)")

    def add(self, slot: int, field: int, entry: Any) -> None:
        """Append ``entry`` (bytes-like) as field number ``field`` of ``slot``
        (now, or at :meth:`flush` while held)."""
        if self.fds is None:
            self.fds = self._create()
        mv = memoryview(entry)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = memoryview(mv.tobytes())
        held = self._held
        if held is None:
            self._write(mv, [(slot, field, mv.nbytes)])
            return
        held[0].extend(mv)
        held[1].append((slot, field, mv.nbytes))
        if len(held[0]) >= _HOLD_BYTES:
            self.flush()

    def hold(self) -> None:
        """Gather the entries added from now on until :meth:`flush`."""
        self._held = (bytearray(), [])

    def release(self) -> None:
        """Stop gathering; entries not flushed are dropped (never written)."""
        self._held = None

    def flush(self) -> None:
        """Write the gathered entries: their bytes, then their rows, one call each."""
        held = self._held
        if held is None or not held[1]:
            return
        data, entries = held
        self._held = (bytearray(), [])
        self._write(memoryview(data), entries)

    def _write(self, data: memoryview, entries: list[tuple[int, int, int]]) -> None:
        """Append ``data`` (the entries' bytes back to back) and one row per entry;
        ``pos`` and ``rows`` move only once both are written."""
        if self.fds is None:
            self.fds = self._create()
        pwrite_all(self.fds[0], data, self.pos)
        words = np.array(entries, np.uint64).reshape(-1, 3)
        starts = self.pos + np.concatenate(([0], np.cumsum(words[:, 2])[:-1])).astype(np.uint64)
        words = np.stack([words[:, 0], words[:, 1], starts, words[:, 2]], axis=1)
        rows = np.concatenate([words, _check_word(words)[:, None]], axis=1).astype("<u8")
        pwrite_all(self.fds[1], rows, self.rows * _ROW_BYTES)
        self.pos += data.nbytes
        self.rows += len(rows)

    def sync(self) -> None:
        if self.fds is not None:
            for fd in self.fds:
                fsync_file(fd)

    def close(self) -> None:
        if self.fds is not None:
            for fd in self.fds:
                os.close(fd)
            self.fds = None


class SpillEntries(NamedTuple):
    """Where each slot's entry of one variable field is: spill number index
    ``src[s]`` into ``paths`` (-1: empty), byte ``start[s]``, ``length[s]``."""

    paths: list[str]
    src: np.ndarray
    start: np.ndarray
    length: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        """The field's offsets index (``slots + 1`` ``<u8``, format.py)."""
        out = np.zeros(len(self.length) + 1, np.dtype("<u8"))
        np.cumsum(self.length, out=out[1:])
        return out


def collect(partial: str, schema: Schema, slots: int, holes: np.ndarray) -> dict[str, SpillEntries]:
    """Each variable field's entry of every slot (holes empty), from the spills.

    Raises
    ------
    SchemaError
        A record slot has no entry of a variable field (it was marked written
        without being written).
    """
    nvar = len(schema.variable_fields)
    spills = spill_files(partial)
    paths = [b for _, b, _ in spills]
    tables = []
    for k, (_, bpath, ipath) in enumerate(spills):
        try:
            raw = np.fromfile(ipath, np.dtype("<u8"))
            bsize = os.stat(bpath).st_size
        except FileNotFoundError:
            continue
        rows = raw[: len(raw) // _ROW * _ROW].reshape(-1, _ROW).astype(np.uint64)
        ok = (_check_word(rows[:, :4]) == rows[:, 4]) & (rows[:, 0] < slots) & (rows[:, 1] < nvar)
        ok &= (rows[:, 2] <= bsize) & (rows[:, 3] <= bsize - np.minimum(rows[:, 2], bsize))
        rows = rows[ok]
        tables.append(np.concatenate([np.full((len(rows), 1), k, np.uint64), rows[:, :4]], axis=1))
    table = np.concatenate(tables) if tables else np.zeros((0, 5), np.uint64)
    record = ~np.asarray(holes, bool)[:slots]
    out: dict[str, SpillEntries] = {}
    for v, f in enumerate(schema.variable_fields):
        t = table[table[:, 2] == v]
        # the last row of each slot wins: the first of the reversed table
        rev = t[::-1]
        slot_ids, first = np.unique(rev[:, 1], return_index=True)
        win = rev[first]
        src = np.full(slots, -1, np.int64)
        start = np.zeros(slots, np.int64)
        length = np.zeros(slots, np.int64)
        s = slot_ids.astype(np.int64)
        src[s] = win[:, 0].astype(np.int64)
        start[s] = win[:, 3].astype(np.int64)
        length[s] = win[:, 4].astype(np.int64)
        missing = np.flatnonzero(record & (src < 0))
        if len(missing):
            raise SchemaError(
                f"{partial}: {len(missing)} record slot(s) have no stored entry of field {f.name!r} (first: "
                f"{missing[:5].tolist()}): they were marked written without being written; write them again"
            )
        src[~record] = -1
        length[~record] = 0
        out[f.name] = SpillEntries(paths, src, start, length)
    return out


def assemble(ent: SpillEntries, dest: str) -> None:
    """Write ``dest`` (the field's ``.bin``): every slot's entry in slot order, fsynced."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        take = np.flatnonzero(ent.length > 0)
        if len(take):
            src, start, length = ent.src[take], ent.start[take], ent.length[take]
            dst = ent.offsets[:-1].astype(np.int64)[take]
            # a run: entries back to back in one spill (one copy for the lot)
            brk = (src[1:] != src[:-1]) | (start[1:] != start[:-1] + length[:-1])
            starts = np.concatenate([[0], np.flatnonzero(brk) + 1])
            ends = np.concatenate([starts[1:], [len(take)]])
            opened: dict[int, int] = {}
            try:
                for a, b in zip(starts.tolist(), ends.tolist()):
                    k = int(src[a])
                    if k not in opened:
                        opened[k] = os.open(ent.paths[k], os.O_RDONLY)
                    n = int(start[b - 1] + length[b - 1] - start[a])
                    _copy(opened[k], fd, int(start[a]), int(dst[a]), n)
            finally:
                for sfd in opened.values():
                    os.close(sfd)
        fsync_file(fd)
    finally:
        os.close(fd)


def _copy(src: int, dst: int, src_off: int, dst_off: int, n: int) -> None:
    """Copy ``n`` bytes of a spill into the field file (``_os.io.copy_range``)."""
    done = copy_range(src, dst, src_off, dst_off, n)
    if done < n:
        raise OSError(errno.EIO, f"spill file ended {n - done} bytes early (copy at {src_off + done})")


def write_field_files(partial: str, entries: dict[str, SpillEntries], names: dict[str, tuple[str, str]]) -> None:
    """Write each variable field's ``.bin`` and ``.offsets.npy`` (``names``:
    field -> the two file names) from its collected entries, fsynced; refused
    before any byte is written when the disk lacks the space."""
    need = sum(int(e.length.sum()) + 8 * (len(e.length) + 1) + 128 for e in entries.values())
    largest = max(((int(e.length.sum()), names[f][0]) for f, e in entries.items()), default=(0, ""))
    check_space(partial, need, partial, (largest[1], largest[0]))
    for f, e in entries.items():
        bin_name, off_name = names[f]
        assemble(e, os.path.join(partial, bin_name))
        offs = e.offsets
        fd = os.open(os.path.join(partial, off_name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            head = npy_header(offs.dtype, offs.shape)
            pwrite_all(fd, head, 0)
            pwrite_all(fd, offs, len(head))
            fsync_file(fd)
        finally:
            os.close(fd)
    fsync_dir(partial)
