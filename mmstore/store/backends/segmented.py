"""A segmented store's record data: one backend per segment (see format.py,
"Segments"), behind the same interface as a single backend.

Global slot ``s`` is local slot ``s - first[k]`` of segment ``k``, where
``first`` are the cumulative segment sizes. ``read_into`` gets its slots
sorted, so each segment's share of a batch is one contiguous run of it, found
with one ``searchsorted``. A batch within one segment goes straight to that
segment's backend; a batch of a positional backend (memmap) over several is
copied record by record from each segment's mapping (see NOTE [gather]);
other backends (lmdb) read it per segment touched (one transaction each).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..._os.runs import SMALL_RECORD_BYTES, find_runs
from ..._os.safecopy import MappingFault, read_entries
from ...errors import ResourceLimitError
from ...format.layout import part_file
from ...format.schema import Schema
from .base import Backend, BackendReader, FieldSegment, PackedRecords

if TYPE_CHECKING:
    from ...format.parttable import PartTable

__all__ = ["SegmentedBackend"]

_BISECT_MAX = 4096  # segments: up to this many, a list of first slots (bisect); more, the int64 array (searchsorted)

# Entries of SMALL_RECORD_BYTES and more: ``preadv`` from each segment's file
# into the rows (releases the GIL, SIGBUS-proof: mmstore/_os/safecopy.py,
# ``read_entries``). Smaller ones: memmove called
# *without* releasing the GIL, where a GIL hand-off per 8-byte copy cost more
# than the copy (2 reader threads ran slower than a single store's np.take)
_memmove_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    cast(int, ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)  # memmove's address: never NULL
)


class _LazyParts(Sequence[Backend]):
    """The backends of a store's parts listed in a part table (format.py,
    "The part table"), each made and checked (its files' existence, sizes
    and headers: ``Backend.check``) on its first use: nothing per part is
    made when the store is opened.

    NOTE [open parts]: a part read keeps its files open (a descriptor per
    fixed field read with ``preadv``, a mapping and its descriptor per mapped
    file), so a whole epoch over a store of many parts would hold descriptors
    and mappings in proportion to the part count: a store of a million parts
    (a billion rows written in parts of a thousand) needs more than a
    process may open or map. With a ``cap`` (``bound``), at most that many
    parts hold their files: the least recently used part that no reader is
    using is closed and dropped when another one opens, and made again at
    its next use. A reader pins the parts it reads for as long as it
    uses their descriptors or mappings, so a part is never closed under a
    read; a part pinned by a reader is never dropped, even above the cap.
    Without a cap (a store whose every part fits), parts are kept, as before.
    The caps of every such store of a process share one budget of files
    (``_Budget``), so that reading several at once stays within the limits.
    """

    def __init__(self, make: Callable[[int], Backend], count: int) -> None:
        self._make = make
        self._built: list[Backend | None] = [None] * count
        self._mu = threading.Lock()
        self.cap: int | None = None
        self.files_per_part = 1
        self._use: OrderedDict[int, int] = OrderedDict()  # part -> pins, least recently used first (with a cap)
        self._drop: Callable[[int], None] = lambda k: None

    def bound(self, cap: int, drop: Callable[[int], None], files_per_part: int) -> None:
        """Keep at most ``cap`` parts open from now on; ``drop(k)`` forgets
        what a reader keeps of part ``k`` before it is closed."""
        with self._mu:
            self.cap, self._drop, self.files_per_part = max(1, int(cap)), drop, files_per_part
            for k, b in enumerate(self._built):
                if b is not None:
                    self._use.setdefault(k, 0)
            self._trim()

    def shrink(self, cap: int) -> None:
        """A smaller cap (another store took a share of the budget)."""
        with self._mu:
            self.cap = max(1, int(cap))
            self._trim()

    def __len__(self) -> int:
        return len(self._built)

    def __getitem__(self, k: int) -> Backend:  # type: ignore[override]
        b = self._built[k]
        if b is None:
            with self._mu:  # one backend per part, however many threads read it first
                b = self._built[k]
                if b is None:
                    b = self._built[k] = self._make(k)
                    if self.cap is not None:
                        self._use.setdefault(k, 0)
                        self._trim()
        return b

    def __iter__(self) -> Iterator[Backend]:
        return (self[k] for k in range(len(self._built)))

    def built(self) -> list[Backend]:
        """The backends made (and not dropped) so far."""
        return [b for b in self._built if b is not None]

    def pin(self, k: int) -> None:
        """Part ``k`` is being read: not to be closed until ``unpin(k)``."""
        if self.cap is not None:
            with self._mu:
                use = self._use
                use[k] = use.pop(k, 0) + 1  # the most recently used
                if len(use) > self.cap:
                    self._trim()

    def unpin(self, k: int) -> None:
        if self.cap is not None:
            with self._mu:
                self._use[k] -= 1
                if len(self._use) > self.cap:
                    self._trim()

    def pin_all(self, ks: Sequence[int]) -> None:
        if self.cap is not None:
            with self._mu:
                use = self._use
                for k in ks:
                    use[k] = use.pop(k, 0) + 1
                if len(use) > self.cap:
                    self._trim()

    def unpin_all(self, ks: Sequence[int]) -> None:
        if self.cap is not None:
            with self._mu:
                for k in ks:
                    self._use[k] -= 1
                if len(self._use) > self.cap:
                    self._trim()

    def _trim(self) -> None:
        """Close the least recently used unpinned parts above the cap (the lock held)."""
        cap = self.cap
        if cap is None:
            return
        use = self._use
        excess = len(use) - cap
        if excess <= 0:
            return
        victims = []
        for k, pins in use.items():  # oldest first; the pinned ones are mostly the newest
            if pins == 0:
                victims.append(k)
                if len(victims) == excess:
                    break
        for k in victims:
            del use[k]
            self._drop(k)
            b, self._built[k] = self._built[k], None
            if b is not None:
                b.close()


class SegmentedBackend(BackendReader):
    """The segments of one store, each read by its own backend of class ``cls``
    (whose name and capabilities it has; the write side is the single
    backend's: segmented stores are made by ``mmstore merge``).

    ``table``: the store's part table, instead of ``counts`` and ``parts``:
    each part's backend is then made, and its files checked, when that part
    is first read (format.py, "The part table")."""

    segmented = True

    def __init__(
        self, cls: type[Backend], root: str, schema: Schema, counts: Sequence[int], files: dict[str, int],
        parts: Sequence[str] | None = None, table: PartTable | None = None, **kw: Any,
    ) -> None:
        self._table = table
        if table is not None:
            self.firsts = table.firsts
        else:
            counts = [int(c) for c in counts]
            # each segment's first global slot, then the slot count (the parts' own ``first``)
            self.firsts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        super().__init__(root, schema, int(self.firsts[-1]), files)
        self.name = cls.name  # type: ignore[misc]
        self.positional = cls.positional  # type: ignore[misc]
        self.crashes_on_damage = cls.crashes_on_damage  # type: ignore[misc]
        self._cls, self._kw = cls, kw
        self._names = cls.data_file_names(schema)
        self.parts: Sequence[Backend]
        if table is not None:
            self.parts = _LazyParts(self._make_part, table.count)
        else:
            ids: Sequence[int | str] = list(parts) if parts is not None else range(len(counts))
            self.parts = [cls(root, schema, c, files, segment=k, **kw) for k, c in zip(ids, counts)]
            for k, part in enumerate(self.parts):
                part.first = int(self.firsts[k])  # global slot = first + local slot (for messages)
        # memmap: field -> (the arrays of the segments read so far, by segment; every segment's address, 0 until
        # then); the arrays are held while copying, so a close() meanwhile cannot unmap them
        self._bases: dict[str, tuple[dict[int, Any], np.ndarray]] = {}
        self.files_per_segment = len(cls.data_file_names(schema, 0))
        self._room = False  # open-files limit raised for this store's files (on first read)
        self._readers: dict[int, Callable[[int], dict[str, Any]]] = {}  # item readers of open parts (a cap)
        self._bounded: _LazyParts | None = None  # the parts, once a cap bounds them (NOTE [open parts])

    def _make_part(self, k: int) -> Backend:
        """Part ``k``'s backend from the part table, its files checked (NOTE
        [lazy parts]: before the first byte of the part is read)."""
        table = self._table
        if table is None:
            raise IndexError(k)
        pid = table.id(k)
        files = {part_file(pid, n): int(z) for n, z in zip(self._names, table.sizes[k].tolist())}
        b = self._cls(self.root, self.schema, int(self.firsts[k + 1] - self.firsts[k]), files, segment=pid,
                      **self._kw)
        b.first = int(self.firsts[k])
        b.check()
        return b

    def _built(self) -> Sequence[Backend]:
        """The parts' backends that exist now (all, unless the store has a part table)."""
        return self.parts.built() if isinstance(self.parts, _LazyParts) else self.parts

    def segment_backends(self) -> Sequence[Backend]:
        """See ``BackendReader.segment_backends``: with parts opened on demand,
        the parts themselves (NOTE [open parts]), not a list that would make
        and hold every one."""
        self._make_room()
        return self.parts if self._bounded is not None else list(self.parts)

    def segment_count(self) -> int:
        return len(self.parts)

    def data_paths(self) -> list[str]:
        if self._table is not None:  # named from the table: no backend made
            return [os.path.join(self.root, part_file(pid, n)) for pid in self._table.ids() for n in self._names]
        return [p for part in self.parts for p in part.data_paths()]

    def check(self) -> None:
        for part in self.parts:
            part.check()

    def _make_room(self) -> None:
        """NOTE [open files]: each mapped segment file holds a descriptor
        (Python's mmap keeps one), and each fixed field read with ``preadv``
        (every one by ``store[i]``, the big ones by batches) one more, so a
        store merged from 1,000 parts with 4 fields may hold 8,000 while
        reading; the soft limit is often 1,024. Done on the first read, not
        on open (opening maps nothing)."""
        if not self._room:
            from ..._os import raise_open_files_limit

            soft = raise_open_files_limit(2 * len(self.parts) * self.files_per_segment)
            if isinstance(self.parts, _LazyParts) and _BUDGET.share(self.parts, self.files_per_segment, soft,
                                                                    self._forget):
                self._bounded = self.parts
            self._room = True

    def _forget(self, k: int) -> None:
        """What this reader keeps of part ``k``, dropped before the part is
        closed (NOTE [open parts])."""
        self._readers.pop(k, None)
        for arrays, bases in self._bases.values():
            arrays.pop(k, None)
            bases[k] = 0

    def parts_on_demand(self) -> bool:
        """See ``BackendReader.parts_on_demand`` (NOTE [open parts])."""
        self._make_room()
        return self._bounded is not None

    def prepare(self, fields: Sequence[str] | None = None) -> None:
        self._make_room()
        try:
            for part in self._built():  # a part table's other parts are made, under a lock, when first read
                part.prepare(fields)
        except OSError as exc:
            if _is_fd_limit(exc):
                raise self._limit(exc) from None
            raise

    def item_reader(self) -> Callable[[int], dict[str, Any]]:
        """See NOTE [one-record path] (base.py): the reader of the segment
        holding the slot (made on its first read), given the local slot."""
        self._make_room()
        if self.parts_on_demand():
            return self._pinned_item_reader()
        firsts = self.firsts
        starts = firsts.tolist() if len(firsts) <= _BISECT_MAX else None
        readers: list[Callable[[int], dict[str, Any]] | None] = [None] * len(self.parts)
        slots = self.slots

        def read(slot: int) -> dict[str, Any]:
            if not 0 <= slot < slots:
                raise IndexError(f"slot {slot} is out of range for {slots} slots")
            if starts is not None:
                k = bisect.bisect_right(starts, slot) - 1
                first = starts[k]
            else:
                k = int(np.searchsorted(firsts, slot, side="right")) - 1
                first = int(firsts[k])
            r = readers[k]
            if r is None:
                try:
                    r = readers[k] = self.parts[k].item_reader()
                except OSError as exc:
                    if _is_fd_limit(exc):
                        raise self._limit(exc) from None
                    raise
            return r(slot - first)

        return read

    def _pinned_item_reader(self) -> Callable[[int], dict[str, Any]]:
        """``item_reader`` of a store whose parts are opened on demand (NOTE
        [open parts]): the part is pinned while its reader reads; its reader
        is kept while the part stays open."""
        firsts, slots, parts, readers = self.firsts, self.slots, cast(_LazyParts, self.parts), self._readers

        def read(slot: int) -> dict[str, Any]:
            if not 0 <= slot < slots:
                raise IndexError(f"slot {slot} is out of range for {slots} slots")
            k = int(np.searchsorted(firsts, slot, side="right")) - 1
            parts.pin(k)
            try:
                r = readers.get(k)
                if r is None:
                    r = readers[k] = parts[k].item_reader()
                return r(slot - int(firsts[k]))
            except OSError as exc:
                if _is_fd_limit(exc):
                    raise self._limit(exc) from None
                raise
            finally:
                parts.unpin(k)

        return read

    def _pinned(self, k: int) -> _Pin:
        """Part ``k`` pinned for the ``with`` block (NOTE [open parts])."""
        return _Pin(self.parts, [k])

    def gather_entries(self, name: str, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See ``BackendReader.gather_entries``: each touched segment's
        entries, joined (``slots`` ascending)."""
        s = np.asarray(slots, np.int64)
        if len(s) == 0:
            return np.zeros(0, np.uint8), np.zeros(0, np.int64)
        self._make_room()
        cuts = np.searchsorted(s, self.firsts, side="left")
        flats, sizes = [], []
        for k in np.flatnonzero(np.diff(cuts)).tolist():
            a, b = int(cuts[k]), int(cuts[k + 1])
            with self._pinned(k):
                f, z = self.parts[k].gather_entries(name, s[a:b] - self.firsts[k])
            flats.append(f)
            sizes.append(z)
        return np.concatenate(flats), np.concatenate(sizes)

    def _limit(self, exc: OSError) -> ResourceLimitError:
        return limit_error(self.root, len(self.parts), self.files_per_segment, exc, self.name)

    def read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        self._make_room()
        try:
            self._read_into(slots, rows, fields, out)
        except OSError as exc:
            if _is_fd_limit(exc):
                raise self._limit(exc) from None
            raise

    def _read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        n = len(slots)
        if n == 0:
            return
        k = int(np.searchsorted(self.firsts, slots[0], side="right")) - 1
        bounded = self._bounded
        if slots[-1] < self.firsts[k + 1]:  # one segment (store[i]; a batch within one part)
            if bounded is None:
                self.parts[k].read_into(slots - self.firsts[k], rows, fields, out)
                return
            with self._pinned(k):
                self.parts[k].read_into(slots - self.firsts[k], rows, fields, out)
            return
        cuts = np.searchsorted(slots, self.firsts, side="left")
        touched = np.flatnonzero(np.diff(cuts))
        if bounded is None:
            self._read_segments(slots, rows, fields, out, cuts, touched)
            return
        cap = cast(int, bounded.cap)
        if len(touched) > max(1, cap // _PIN_SHARE):
            # more parts than one read may hold open at once: read them a group at a time
            group = max(1, cap // _PIN_SHARE)
            for j in range(0, len(touched), group):
                ks = touched[j : j + group]
                a, b = int(cuts[ks[0]]), int(cuts[ks[-1] + 1])
                # (never the one-segment path above: ``out`` holds the whole batch's rows, not these alone)
                sub = np.searchsorted(slots[a:b], self.firsts, side="left")
                with _Pin(self.parts, ks.tolist()):
                    self._read_segments(slots[a:b], rows[a:b], fields, out, sub, ks)
            return
        with _Pin(self.parts, touched.tolist()):
            self._read_segments(slots, rows, fields, out, cuts, touched)

    def _read_segments(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray],
        cuts: np.ndarray, touched: np.ndarray,
    ) -> None:
        """``read_into`` of a batch over several segments (``touched``, pinned)."""
        if self.positional:
            # a batch spread over many segments: one address-based copy loop
            # instead of a few numpy calls per segment (see NOTE [gather]);
            # variable-size fields are decoded per segment, below
            fixed = [f for f in fields if not self.schema[f].variable]
            if fixed:
                self._gather_mapped(slots, rows, fixed, out, cuts, touched)
            fields = [f for f in fields if self.schema[f].variable]
            if not fields:
                return
        for k in touched.tolist():  # the segments this batch touches
            part = self.parts[k]
            a, b = int(cuts[k]), int(cuts[k + 1])
            local = slots[a:b] - self.firsts[k]
            r = rows[a:b]
            r0 = int(r[0])
            if int(r[-1]) - r0 == b - a - 1 and (b - a == 1 or bool(np.all(r[1:] > r[:-1]))):
                # consecutive rows: hand the part a view of the rows it fills
                part.read_into(local, np.arange(b - a), fields, {f: out[f][r0 : r0 + b - a] for f in fields})
            else:
                part.read_into(local, r, fields, out)

    def _gather_mapped(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray],
        cuts: np.ndarray, touched: np.ndarray,
    ) -> None:
        """NOTE [gather]: with many segments and small records, a per-segment
        path costs many times more per record than a single store (each
        touched segment costs a few numpy calls per field). Here the places of every record in its segment are
        computed at once, then read with ``preadv`` from each segment's file
        (big entries, as a single store does: one call per run of
        consecutive slots of a segment) or copied with one ``memmove`` a run
        of consecutive slots and rows out of the mappings (small entries): the
        cost no longer depends on how many segments a batch touches."""
        seg = np.repeat(np.arange(len(self.parts)), np.diff(cuts))  # slots are sorted
        local = slots - self.firsts[seg]
        on_demand = self._bounded is not None
        for name in fields:
            nb = self.schema[name].nbytes
            if nb == 0:
                continue
            if nb >= SMALL_RECORD_BYTES or on_demand:  # on demand: no mapping to keep per part
                self._read_big(name, nb, seg, local, rows, out[name], touched)
                continue
            held = self._bases.get(name)
            if held is None:
                held = self._bases[name] = ({}, np.zeros(len(self.parts), np.int64))
            arrays, bases = held
            for k in touched.tolist():  # see NOTE [truncated under a mapping] (memmap.py)
                if k not in arrays:
                    a = arrays[k] = self.parts[k].array(name)
                    bases[k] = a.ctypes.data
                self.parts[k].check_mapped(name)
            dst = out[name]
            src_addr = bases[seg] + local * nb
            dst_addr = dst.ctypes.data + rows.astype(np.int64) * nb
            starts, ends = find_runs(nb, src_addr, dst_addr)
            sa, da = src_addr.tolist(), dst_addr.tolist()
            for a, b in zip(starts, ends):
                _memmove_gil(da[a], sa[a], (b - a) * nb)

    def _read_big(self, name: str, nb: int, seg: np.ndarray, local: np.ndarray, rows: np.ndarray, dst: np.ndarray,
                  touched: np.ndarray) -> None:
        """Big entries of field ``name`` over several segments: ``preadv`` from
        each touched segment's descriptor (``BackendReader.field_fd``, checked
        like its mapping), one call per run of consecutive slots of a segment."""
        fds = np.full(len(self.parts), -1, np.int64)
        offs = np.zeros(len(self.parts), np.int64)
        for k in touched.tolist():
            fds[k], offs[k] = self.parts[k].field_fd(name)
        try:
            read_entries(fds[seg].tolist(), (offs[seg] + local * nb).tolist(), nb, dst, rows.tolist())
        except MappingFault as exc:
            k = int(seg[exc.entry])
            raise self.parts[k].short_read_error(name, int(fds[k])) from None

    def iter_packed(self, start: int, stop: int) -> PackedRecords:
        self._make_room()
        k0 = max(0, int(np.searchsorted(self.firsts, start, side="right")) - 1)
        for k in range(k0, len(self.parts)):
            lo, hi = int(self.firsts[k]), int(self.firsts[k + 1])
            if lo >= stop:
                break
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                with self._pinned(k):
                    it = self.parts[k].iter_packed(a - lo, b - lo)
                    try:
                        for s, v in it:
                            yield s + lo, v
                    except OSError as exc:
                        if _is_fd_limit(exc):
                            raise self._limit(exc) from None
                        raise
                    finally:
                        it.close()

    def entry_spans(self, name: str, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Variable-size field ``name``: the bytes slots ``[start, stop)``
        occupy in each segment's ``.bin`` they touch (see ``BackendReader``)."""
        out = []
        k0 = max(0, int(np.searchsorted(self.firsts, start, side="right")) - 1)
        for k in range(k0, len(self.parts)):
            lo, hi = int(self.firsts[k]), int(self.firsts[k + 1])
            if lo >= stop:
                break
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                with self._pinned(k):
                    out += self.parts[k].entry_spans(name, a - lo, b - lo)
        return out

    def entry_sizes(self, name: str, slots: np.ndarray) -> np.ndarray:
        s = np.asarray(slots, np.int64)
        out = np.zeros(len(s), np.int64)
        seg = np.searchsorted(self.firsts, s, side="right") - 1
        for k in np.unique(seg).tolist():
            sel = seg == k
            with self._pinned(k):
                out[sel] = self.parts[k].entry_sizes(name, s[sel] - self.firsts[k])
        return out

    def stored_entry_bytes(self, name: str) -> int | None:
        if self._table is not None:  # the parts' .bin sizes, from the table (no part is made)
            col = [c for c, n in enumerate(self._names) if n == f"{name}.bin"]
            return int(self._table.sizes[:, col[0]].sum()) if col and self.positional else None
        sizes = [part.stored_entry_bytes(name) for part in self.parts]
        return None if None in sizes else sum(s for s in sizes if s is not None)

    def field_segments(self, name: str) -> list[FieldSegment]:
        """Where field ``name`` lives, one entry per segment (positional backends)."""
        out = []
        for k in range(len(self.parts)):
            with self._pinned(k):
                (seg,) = self.parts[k].field_segments(name)
            out.append(seg._replace(first=int(self.firsts[k])))
        return out

    def rewrite_entries(self, name: str, entries: Mapping[int, Any], open_file: Callable[[str], int]) -> None:
        """Each segment's entries through its own backend (its local slots)."""
        by_part: dict[int, dict[int, Any]] = {}
        for s, data in entries.items():
            k = int(np.searchsorted(self.firsts, s, side="right")) - 1
            if not 0 <= k < len(self.parts) or s >= int(self.firsts[k + 1]):
                raise ValueError(f"{self.root}: slot {s} is out of range for {int(self.firsts[-1])} slots")
            by_part.setdefault(k, {})[s - int(self.firsts[k])] = data
        for k in sorted(by_part):
            with self._pinned(k):
                self.parts[k].rewrite_entries(name, by_part[k], open_file)

    def close(self) -> None:
        self._bases.clear()
        self._readers.clear()
        for part in self._built():
            part.close()


def _is_fd_limit(exc: OSError) -> bool:
    return exc.errno in (errno.EMFILE, errno.ENFILE) and not isinstance(exc, ResourceLimitError)


def limit_error(root: str, segments: int, per_segment: int, exc: OSError,
                backend: str = "memmap") -> ResourceLimitError:
    """The error for running out of descriptors on a store of ``segments`` segments (of ``backend``)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError):
        soft = -1
    need = segments * per_segment
    return ResourceLimitError(
        exc.errno,
        f"{root}: out of file descriptors ({exc.strerror}): this merged store has {segments:,} segments of "
        f"{per_segment} data file(s), which stay open while it is read, and this process may open "
        f"{soft:,} files in all. Raise the limit before starting (`ulimit -n {need + 1024}` in the shell, "
        "LimitNOFILE= for a systemd service, --ulimit nofile= for docker), or rewrite the store with one file "
        f"per field: `mmstore convert {root} PLAIN.store --backend {backend}` (which copies the data)",
    )


class _Pin:
    """Parts ``ks`` pinned for a ``with`` block (NOTE [open parts]); nothing
    when the store keeps every part open."""

    __slots__ = ("parts", "ks")

    def __init__(self, parts: Sequence[Backend], ks: list[int]) -> None:
        self.parts = parts if isinstance(parts, _LazyParts) and parts.cap is not None else None
        self.ks = ks

    def __enter__(self) -> None:
        if self.parts is not None:
            if len(self.ks) == 1:
                self.parts.pin(self.ks[0])
            else:
                self.parts.pin_all(self.ks)

    def __exit__(self, *exc: object) -> None:
        if self.parts is not None:
            if len(self.ks) == 1:
                self.parts.unpin(self.ks[0])
            else:
                self.parts.unpin_all(self.ks)


_MIN_OPEN_PARTS = 2  # a store keeps at least this many parts open, however many share the budget
# a read pins at most 1 / _PIN_SHARE of the open-parts cap at once, so that
# several reader threads together stay near it
_PIN_SHARE = 16


def open_files_budget(soft: int) -> int | None:
    """How many data files the stores of this process whose parts are opened
    on demand may keep open together (NOTE [open parts]): half of the
    descriptors it may still open under its soft limit ``soft`` (-1: none),
    at two a file (a mapping's and a ``preadv`` one), and half of the
    mappings it may still make under ``vm.max_map_count``; None when neither
    is known."""
    budgets = []
    if soft > 0:
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = 64
        budgets.append((soft - open_now) // 2 // 2)
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as fh:
            most = int(fh.read().split()[0])
        with open("/proc/self/maps", "rb") as fh:
            maps_now = sum(1 for _ in fh)
        budgets.append((most - maps_now) // 2)
    except (OSError, ValueError, IndexError):
        pass
    return max(_MIN_OPEN_PARTS, min(budgets)) if budgets else None


class _Budget:
    """The budget of :func:`open_files_budget`, taken once per process at
    the first store that needs it, split evenly between the stores bounded
    so far: a process reading several stores of many parts (a mix of data
    sets) stays within its limits however many it opens."""

    def __init__(self) -> None:
        self.files: int | None = None
        self.taken = False
        self.stores: weakref.WeakSet[_LazyParts] = weakref.WeakSet()
        self.mu = threading.Lock()

    def share(self, parts: _LazyParts, files_per_part: int, soft: int, drop: Callable[[int], None]) -> bool:
        """Bound ``parts`` when they do not fit in an even share of the
        budget (the shares of the stores bounded before shrink); True if so."""
        with self.mu:
            if not self.taken:
                self.files, self.taken = open_files_budget(soft), True
            if self.files is None:
                return False
            n = len(self.stores) + 1
            per = max(1, files_per_part)
            if len(parts) <= self.files // n // per:
                return False
            self.stores.add(parts)
            for p in list(self.stores):
                cap = max(_MIN_OPEN_PARTS, self.files // n // p.files_per_part)
                if p is parts:
                    p.bound(cap, drop, per)
                else:
                    p.shrink(cap)
            return True


_BUDGET = _Budget()


def _new_budget() -> None:
    global _BUDGET
    _BUDGET = _Budget()  # a forked child: its own descriptors and mappings, its own stores


os.register_at_fork(after_in_child=_new_budget)
