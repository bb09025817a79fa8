"""How the Loader's reader threads read: the read strategies.

* **preadv** (:class:`FieldFiles`): a memmap field of at least
  ``PREAD_MIN_BYTES`` per record is read with ``os.preadv`` of each record
  (consecutive records in one call) from the field's files, at
  ``data_offset + slot * entry_bytes``, straight into the batch buffer, through
  the loader's own descriptors (queue depth = reader threads).
* **memmove** (``Store.read_batch``): cached memmap stores, small fields
  (labels), LMDB stores: ``ctypes.memmove`` out of the mapping (GIL released;
  a numpy gather for small fields).
* **window prefetch** (:class:`WindowPrefetch`): for a block shuffle, a thread
  brings each window's blocks into the page cache (long ``WILLNEED`` ranges,
  or long ``preadv`` reads) one window ahead of the batches.

:class:`EpochReads` picks, per epoch, which of them are used and gives the
kernel its hints. :func:`field_segments` is the one place that asks the
backend where a field's records lie.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as _wait

import numpy as np

from .. import _sys
from .._runs import SMALL_RECORD_BYTES
from ..backends.base import FieldSegment
from ..backends.segmented import limit_error
from ..errors import ResourceLimitError
from ..order import contiguous_ranges
from ..reader import Store
from ._ring import InFlight
from ._tuning import LoaderTuning

__all__ = [
    "PREAD_MIN_BYTES", "EpochReads", "FieldFiles", "WindowPrefetch", "data_paths", "field_segments",
    "open_field_files", "prepare_store", "resident_fraction",
]

PREAD_MIN_BYTES = SMALL_RECORD_BYTES  # smaller fields are gathered by the backend, not pread
_MiB = 1 << 20
_CHUNK = 8 * _MiB  # the longest single read of the window pass ("read")


# -- the store's files -------------------------------------------------------------

def field_segments(store: Store, field: str) -> list[FieldSegment] | None:
    """Where ``field``'s records lie, for positional reads: one segment per
    data file (several in a merged store, format.py "Segments"), or None when
    the backend is not positional (LMDB). The loader's one call into the
    backend's segment interface."""
    backend = store.backend
    return backend.field_segments(field) if backend.positional else None


def data_paths(store: Store, fields: Sequence[str]) -> list[str]:
    """The files an epoch over ``fields`` reads (what ``warm`` and the
    residency check look at)."""
    if store.backend.positional:  # only the fields read (a variable-size field: its .bin files)
        paths = [seg.path for f in fields if not store.schema[f].variable for seg in field_segments(store, f) or ()]
        paths += [p for f in fields if store.schema[f].variable for p, _, _ in store.backend.entry_spans(f, 0, store.slots)]
    else:
        paths = store.backend.data_paths()
    if store.records < store.slots:
        paths.append(os.path.join(store.path, "_index.npy"))
    return paths


def resident_fraction(paths: Sequence[str]) -> float:
    """Fraction of the bytes of ``paths`` in the page cache (0.0 when unknown)."""
    tot = res = 0
    for p in paths:
        try:
            r, s = _sys.resident_bytes(p)
        except (OSError, NotImplementedError):
            return 0.0
        res += r
        tot += s
    return res / tot if tot else 1.0


def _fd_limit(store: Store, exc: OSError) -> OSError:
    """Out of descriptors on a merged store: say why and what to do."""
    if exc.errno not in (errno.EMFILE, errno.ENFILE) or isinstance(exc, ResourceLimitError) or not store.segments:
        return exc
    per = len(store.fields) + 1  # mapped + opened for preadv
    return limit_error(store.path, len(store.segments), per, exc)


def prepare_store(store: Store, fields: Sequence[str]) -> None:
    """Map the fields (open the environment) and the index once, in the
    calling thread, before the reader threads use them."""
    try:
        store.backend.prepare(fields)
    except OSError as exc:
        raise _fd_limit(store, exc) from None
    store.index  # noqa: B018 - map the index once, outside the threads


class FieldFiles:
    """A memmap field's open files for ``preadv`` epochs: one per segment of
    the store (a merged store has several; see format.py, "Segments")."""

    def __init__(self, segments: list[FieldSegment]) -> None:
        self.fds: list[int] = []
        try:
            for seg in segments:
                self.fds.append(os.open(seg.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except BaseException:
            self.close()
            raise
        self.offs = [seg.offset for seg in segments]
        self.firsts = np.array([seg.first for seg in segments] + [segments[-1].first + segments[-1].count], np.int64)
        self.nb = segments[0].entry_bytes

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def read(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Record ``slots[j]`` into ``out[j]``."""
        nb = self.nb
        if len(self.fds) == 1:
            _sys.pread_records(self.fds[0], self.offs[0] + slots * nb, nb, out)
            return
        seg = np.searchsorted(self.firsts, slots, side="right") - 1
        offs = np.asarray(self.offs, np.int64)[seg] + (slots - self.firsts[seg]) * nb
        _sys.pread_records_multi(np.asarray(self.fds, np.int64)[seg], offs, nb, out)

    def ranges(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(fd, offset, length)`` of the global slot range ``[a, b)``, cut at
        segment boundaries."""
        out = []
        k = int(np.searchsorted(self.firsts, a, side="right")) - 1
        while a < b and k < len(self.fds):
            hi = min(b, int(self.firsts[k + 1]))
            if hi > a:
                lo = a - int(self.firsts[k])
                out.append((self.fds[k], self.offs[k] + lo * self.nb, (hi - a) * self.nb))
            a = hi
            k += 1
        return out

    def advise(self, advice: int) -> None:
        """``posix_fadvise(advice)`` on every file, whole."""
        for fd in self.fds:
            (_sys.fadvise_random if advice == os.POSIX_FADV_RANDOM else _sys.fadvise_sequential)(fd)


def open_field_files(store: Store, fields: Sequence[str], method: str) -> dict[str, FieldFiles]:
    """The ``preadv`` files of the fields that method ``method`` reads that
    way: memmap fields of at least ``PREAD_MIN_BYTES`` per record (any size
    with "pread"); none with "mmap" or on LMDB."""
    files: dict[str, FieldFiles] = {}
    if method == "mmap":
        return files
    try:
        for f in fields:
            nbytes = store.schema[f].nbytes
            if store.schema[f].variable:
                continue  # decoded by Store.read_batch in the reader threads, into the batch buffer
            if nbytes == 0 or (nbytes < PREAD_MIN_BYTES and method != "pread"):
                continue
            segs = field_segments(store, f)
            if segs is None:
                break
            files[f] = FieldFiles(segs)
    except OSError as exc:
        _close_all(files)
        raise _fd_limit(store, exc) from None
    except BaseException:
        _close_all(files)
        raise
    return files


def _close_all(files: dict[str, FieldFiles]) -> None:
    for ff in files.values():
        ff.close()


def _willneed_entries(store: Store, fields: Sequence[str], slots: np.ndarray) -> None:
    """``POSIX_FADV_WILLNEED`` on the entries of sorted ``slots`` of
    variable-size ``fields`` (one range per run of consecutive slots)."""
    starts, stops = contiguous_ranges(slots)
    fds: dict[str, int] = {}
    try:
        for f in fields:
            for a, b in zip(starts.tolist(), stops.tolist()):
                for path, pos, length in store.backend.entry_spans(f, a, b):
                    if length:
                        if path not in fds:
                            fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                        os.posix_fadvise(fds[path], pos, length, os.POSIX_FADV_WILLNEED)
    finally:
        for fd in fds.values():
            os.close(fd)


def _slot_to_index(store: Store, slots: np.ndarray) -> np.ndarray:
    ix = store.index
    if ix is None:
        return slots
    return np.searchsorted(ix, slots.astype(ix.dtype)).astype(np.int64)


# -- one epoch's reads --------------------------------------------------------------

class EpochReads:
    """How one epoch reads its pieces: ``preadv`` for the fields in
    ``self.files``, ``Store.read_batch`` for the rest; and the kernel hints.

    NOTE [warm vs cold reads]: measured here (2 cores, 150 KB records),
    memmove out of the mapping (GIL released) served ~2x more samples/s than
    preadv when the store is in the page cache (no page-table faults once
    mapped; a user-space copy), while preadv did ~1.5x better cold (one read
    per record at queue depth ``threads``, where a fault reads around the
    faulting page). So method "auto" picks per epoch, from the residency of
    the fields' files at the start of the epoch (``self.cached``)."""

    def __init__(
        self, store: Store, fields: Sequence[str], files: dict[str, FieldFiles], tuning: LoaderTuning, *,
        batch_size: int, shuffled: bool, block: bool,
    ) -> None:
        self.store = store
        self.fields = tuple(fields)
        resident = resident_fraction(data_paths(store, fields)) if (files or block) else 1.0
        self.cached = resident >= 0.99
        self.files = {} if (tuning.method == "auto" and self.cached) else files
        self.rest = [f for f in self.fields if f not in self.files]
        rb = sum(store.schema[f].nbytes for f in fields) or 1
        self.piece_rows = max(1, tuning.piece_bytes // rb)
        if not self.files:
            # memmove epochs are CPU-bound: one piece per core (measured ~2x
            # faster than 2 MiB pieces here: fewer Python calls per batch)
            self.piece_rows = max(self.piece_rows, -(-batch_size // max(2, os.cpu_count() or 2)))
        self.willneed = 0  # hint the records of the batch this many batches ahead
        if tuning.hints and self.files:
            for ff in self.files.values():
                ff.advise(os.POSIX_FADV_RANDOM if shuffled else os.POSIX_FADV_SEQUENTIAL)
            if tuning.willneed and shuffled and not self.cached:
                self.willneed = tuning.willneed

    def read(self, idx: np.ndarray, slot: dict[str, np.ndarray], lo: int, hi: int) -> None:
        """Rows ``lo:hi`` of a batch: records ``idx[lo:hi]`` into ``slot[f][lo:hi]``."""
        part = idx[lo:hi]
        if self.files:
            slots = self.store.slots_of(part)
            for f, ff in self.files.items():
                ff.read(slots, slot[f][lo:hi])
        if self.rest:
            self.store.read_batch(part, fields=self.rest, out={f: slot[f][lo:hi] for f in self.rest})

    def hint(self, idx: np.ndarray) -> None:
        """``POSIX_FADV_WILLNEED`` on the records ``idx`` (preadv epochs)."""
        if not self.files or len(idx) == 0:
            return
        starts, stops = contiguous_ranges(self.store.slots_of(idx))
        for ff in self.files.values():
            for a, b in zip(starts.tolist(), stops.tolist()):
                for fd, pos, length in ff.ranges(a, b):
                    os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)


# -- block shuffle: the window pass -------------------------------------------------

_tls = threading.local()  # each window reader thread's scratch buffer


class WindowPrefetch:
    """A block-shuffle epoch's window pass: a thread that brings window
    ``w``'s records into the page cache while the batches of window ``w - 1``
    are read, so the block shuffle's locality becomes long disk reads.

    ``mode="read"``: the window's contiguous runs of slots are read with
    ``preadv`` in chunks of up to 8 MiB by ``threads`` threads (several long
    requests in flight), and the batches of the window wait until it is done.
    ``"willneed"``: one ``POSIX_FADV_WILLNEED`` per run; the kernel reads them
    with large requests in the background and the batches' reads wait on the
    pages in flight instead of issuing small random reads of their own.
    Without ``preadv`` files (LMDB, memmove epochs) the records are touched
    through ``Store.read_batch`` in slot order."""

    def __init__(
        self, reads: EpochReads, idx: np.ndarray, bounds: np.ndarray, mode: str, threads: int, inflight: InFlight,
    ) -> None:
        self.reads = reads
        self.idx = idx
        self.bounds = bounds
        self.mode = mode
        self.inflight = inflight
        self.done = -1  # the last window in the page cache
        self.need = 0  # the last window a submitted batch reads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="mmstore-window") if mode == "read" else None

    def start(self) -> None:
        t = threading.Thread(target=self._loop, name="mmstore-window", daemon=True)
        self.inflight.win_thread = t  # the epoch's wait() joins it
        t.start()

    def window_of(self, pos: int) -> int:
        """The window of position ``pos`` of the epoch."""
        return int(np.searchsorted(self.bounds, pos, side="right")) - 1

    def ask(self, w: int) -> None:
        """A batch of window ``w`` was submitted: read up to window ``w + 1``."""
        cv = self.inflight.cv
        with cv:
            if w + 1 > self.need:
                self.need = w + 1
                cv.notify_all()

    def wait_for(self, w: int) -> None:
        """Block until window ``w`` is read (or the pass ended)."""
        cv = self.inflight.cv
        with cv:
            while self.done < w and not self.inflight.cancelled:
                cv.wait()

    def _loop(self) -> None:
        b = self.bounds
        cv = self.inflight.cv
        try:
            for w in range(len(b) - 1):
                with cv:
                    while w > self.need and not self.inflight.cancelled:
                        cv.wait()
                if self.inflight.cancelled:
                    return
                self.read_window(self.idx[b[w] : b[w + 1]])
                with cv:
                    self.done = w
                    cv.notify_all()
        except Exception:  # noqa: BLE001 - a prefetch pass only: a failing read is
            pass  # reported by the batch that reads the record; this thread prints nothing
        finally:
            with cv:
                self.done = len(b)  # never leave a batch waiting
                cv.notify_all()
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)

    def read_window(self, idx: np.ndarray) -> None:
        """Bring the records ``idx`` (one window) into the page cache."""
        if len(idx) == 0:
            return
        slots = self.reads.store.slots_of(idx)
        if not self.reads.files:
            self._touch(slots)
            return
        chunks = self._chunks(slots)
        if self.mode == "willneed":
            for fd, pos, length in chunks:
                if self.inflight.cancelled:
                    return
                os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)
            return
        futs = [self.pool.submit(self._read_chunk, fd, pos, length) for fd, pos, length in chunks]  # type: ignore[union-attr]
        _wait(futs)
        for f in futs:
            if f.exception() is not None and not self.inflight.cancelled:
                raise f.exception()  # type: ignore[misc]

    def _touch(self, slots: np.ndarray) -> None:
        store, srt = self.reads.store, np.sort(slots)
        # variable-size fields are not decoded twice: their entries' bytes are
        # asked for (WILLNEED) and decoded once, by the batch that reads them
        fixed = [f for f in self.reads.fields if not store.schema[f].variable]
        var = [f for f in self.reads.fields if store.schema[f].variable]
        if var:
            _willneed_entries(store, var, srt)
        for a in range(0, len(srt), 256) if fixed else ():
            if self.inflight.cancelled:
                return
            store.read_batch(np.asarray(_slot_to_index(store, srt[a : a + 256])), fields=fixed)

    def _chunks(self, slots: np.ndarray) -> list[tuple[int, int, int]]:
        """``(fd, offset, length)`` of the window's runs of slots; cut into
        reads of at most 8 MiB for mode "read"."""
        starts, stops = contiguous_ranges(slots)
        chunks = []
        for ff in self.reads.files.values():
            for a, b in zip(starts.tolist(), stops.tolist()):
                for fd, pos, length in ff.ranges(a, b):
                    step = length if self.mode == "willneed" else _CHUNK
                    chunks += [(fd, p, min(step, pos + length - p)) for p in range(pos, pos + length, step)]
        return chunks

    def _read_chunk(self, fd: int, pos: int, length: int) -> None:
        buf = getattr(_tls, "buf", None)
        if buf is None:
            buf = _tls.buf = memoryview(bytearray(2 * _MiB))
        end = pos + length
        while pos < end and not self.inflight.cancelled:
            got = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
            if got <= 0:
                break
            pos += got
