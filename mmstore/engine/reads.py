"""How the Loader's reader threads read: the read strategies.

* **preadv** (:class:`FieldFiles`): a memmap field of at least
  ``PREAD_MIN_BYTES`` per record is read with ``os.preadv`` of each record
  (consecutive records in one call) from the field's files, at
  ``data_offset + slot * entry_bytes``, straight into the batch buffer, through
  the loader's own descriptors, in every epoch (cached or not: NOTE [warm vs
  cold reads]).
* **read_batch** (``Store.read_batch``): small fields (labels; a numpy
  gather out of the mapping), LMDB stores, ``method="mmap"`` (the backend's
  own reads: ``preadv`` for big entries, ``mmstore/_os/safecopy.py``).
* **window prefetch** (:class:`WindowPrefetch`): for a block shuffle, a thread
  brings each window's blocks into the page cache (long ``WILLNEED`` ranges,
  or long ``preadv`` reads) one window ahead of the batches.

:class:`EpochReads` picks, per epoch, which of them are used, cuts the
batches into pieces and gives the kernel its hints, following the page cache
as the epoch runs. :func:`field_segments` is the one place that asks the
backend where a field's records lie.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from .. import _os
from .._os.runs import SMALL_RECORD_BYTES
from ..errors import ResourceLimitError
from ..order import contiguous_ranges
from ..store.backends.base import FieldSegment
from ..store.backends.segmented import limit_error
from ..store.reader import Store
from . import aio as _aio
from .direct import open_direct, read_records_direct
from .inflight import InFlight, WindowPass, wait_all
from .tuning import LoaderTuning

__all__ = [
    "PREAD_MIN_BYTES", "EpochReads", "FieldFiles", "WindowPrefetch", "data_paths", "field_segments",
    "open_field_files", "prepare_store", "preadv_fields", "resident_fraction", "shared_measures",
]

PREAD_MIN_BYTES = SMALL_RECORD_BYTES  # smaller fields are gathered by the backend, not pread
_MiB = 1 << 20
_CHUNK = 8 * _MiB  # the longest single read of the window pass ("read")
_AIO_PIECES = 4  # pieces per batch when its records are read with AIO (NOTE [record reads in one submit])


# -- the store's files -------------------------------------------------------------

def field_segments(store: Store, field: str) -> list[FieldSegment] | None:
    """Where ``field``'s records lie, for positional reads: one segment per
    data file (several in a merged store, format.py "Segments"), or None when
    the backend is not positional (LMDB). The loader's one call into the
    backend's segment interface."""
    def segments() -> list[FieldSegment] | None:
        backend = store.slot_view.backend
        return backend.field_segments(field) if backend.positional else None

    return cast("list[FieldSegment] | None", store.across_appends(segments))  # NOTE [a reader of a grown store]


def data_paths(store: Store, fields: Sequence[str]) -> list[str]:
    """The files an epoch over ``fields`` reads (what ``warm`` and the
    residency check look at)."""
    backend = store.slot_view.backend
    if backend.positional and not backend.parts_on_demand():  # the fields read (variable-size: their .bin)
        paths = [seg.path for f in fields if not store.schema[f].variable for seg in field_segments(store, f) or ()]
        paths += [p for f in fields if store.schema[f].variable
                  for p, _, _ in store.slot_view.backend.entry_spans(f, 0, store.slots)]
    else:
        paths = store.slot_view.backend.data_paths()
    if store.records < store.slots:
        paths.append(os.path.join(store.path, "_index.npy"))
    return paths


def resident_fraction(paths: Sequence[str]) -> float:
    """Fraction of the bytes of ``paths`` in the page cache (0.0 when
    unknown). A file of more than ``RESIDENCY_WHOLE_BYTES`` is sampled:
    ``RESIDENCY_SAMPLES`` ranges of ``RESIDENCY_SAMPLE_BYTES`` spread evenly
    over it (``mincore`` of a whole file asks the page cache about every page
    of it, a cost per epoch that grows with the store). Of more than
    ``RESIDENCY_FILES`` files (a store of many parts), that many spread
    evenly over the list are looked at."""
    if len(paths) > RESIDENCY_FILES:
        paths = [paths[int(j)] for j in np.linspace(0, len(paths) - 1, RESIDENCY_FILES)]
    tot = res = 0.0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                size = os.fstat(fd).st_size
                r = _sampled_residency(fd, size)
            finally:
                os.close(fd)
        except (OSError, NotImplementedError):
            return 0.0
        res += r * size
        tot += size
    return res / tot if tot else 1.0


_shared = threading.local()  # the measures installed by shared_measures, per thread


@contextlib.contextmanager
def shared_measures(memo: dict[Any, Any]) -> Iterator[None]:
    """Within the block, the :class:`EpochReads` started in this thread take
    their page-cache residency of a set of files, and the usable cores, from
    ``memo`` (measured by the first and kept there): the loaders of one
    epoch over the same files (a bucket's each) measure them once. ``memo``
    lives as long as the caller wants the figures to hold (an epoch)."""
    prev = getattr(_shared, "memo", None)
    _shared.memo = memo
    try:
        yield
    finally:
        _shared.memo = prev


def _measured(key: Any, measure: Any) -> Any:
    """``measure()``, or what ``shared_measures``' memo holds for ``key``."""
    memo = getattr(_shared, "memo", None)
    if memo is None:
        return measure()
    if key not in memo:
        memo[key] = measure()
    return memo[key]


def _resident(paths: Sequence[str]) -> float:
    return float(_measured(("resident", tuple(paths)), lambda: resident_fraction(paths)))


RESIDENCY_WHOLE_BYTES = 32 * _MiB
RESIDENCY_SAMPLES = 32
RESIDENCY_FILES = 256  # files looked at, at most, by resident_fraction
RESIDENCY_SAMPLE_BYTES = 128 << 10


def _sampled_residency(fd: int, size: int) -> float:
    """The resident fraction of an open file of ``size`` bytes (see :func:`resident_fraction`)."""
    if size == 0:
        return 1.0
    if size <= RESIDENCY_WHOLE_BYTES:
        return _os.resident_fd(fd, size) / size
    step = (size - RESIDENCY_SAMPLE_BYTES) / (RESIDENCY_SAMPLES - 1)
    got = sum(_os.resident_fd(fd, size, int(k * step), RESIDENCY_SAMPLE_BYTES) for k in range(RESIDENCY_SAMPLES))
    return got / (RESIDENCY_SAMPLES * RESIDENCY_SAMPLE_BYTES)


def _fd_limit(store: Store, exc: OSError) -> OSError:
    """Out of descriptors on a merged store: say why and what to do."""
    if exc.errno not in (errno.EMFILE, errno.ENFILE) or isinstance(exc, ResourceLimitError) or not store.segments:
        return exc
    per = len(store.fields) + 1  # mapped + opened for preadv
    return limit_error(store.path, len(store.segments), per, exc, store.backend_name)


def prepare_store(store: Store, fields: Sequence[str]) -> None:
    """Map the fields (open the environment) and the index once, in the
    calling thread, before the reader threads use them."""
    try:
        store.across_appends(lambda: store.slot_view.backend.prepare(fields))  # (see field_segments)
    except OSError as exc:
        raise _fd_limit(store, exc) from None
    store.slot_view.index  # noqa: B018 - map the index once, outside the threads


class FieldFiles:
    """A memmap field's open files for ``preadv`` epochs: one per segment of
    the store (a merged store has several; see format.py, "Segments").

    NOTE [page-cache reads in one submit]: a piece's records are read with
    one Linux AIO ``io_submit`` of a ``preadv`` each (``_aio.read_vectors``)
    where AIO is there: on a descriptor without ``O_DIRECT`` the kernel does
    each read (a copy out of the page cache, or a read from the disk) inside
    the submit, so the reader thread gives up the GIL once per piece, not once
    per record: with 16 reader threads and the consumer, a ``preadv`` per
    record made every record wait for the GIL again (NOTE [record reads in one
    submit] in ``mmstore/engine/aio.py``). Elsewhere, one ``preadv`` per run of consecutive
    records."""

    def __init__(self, segments: list[FieldSegment]) -> None:
        self.fds: list[int] = []
        try:
            for seg in segments:
                self.fds.append(os.open(seg.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except BaseException:
            self.close()
            raise
        self.offs = [seg.offset for seg in segments]
        self.paths = [seg.path for seg in segments]
        self.firsts = np.array([seg.first for seg in segments] + [segments[-1].first + segments[-1].count], np.int64)
        self.nb = segments[0].entry_bytes
        self.dfds: list[int | None] | None = None  # O_DIRECT descriptors (use_direct)
        self.direct = False

    def close(self) -> None:
        for fd in [*self.fds, *(self.dfds or ())]:
            try:
                if fd is not None:
                    os.close(fd)
            except OSError:
                pass
        self.fds = []
        self.dfds = None
        self.direct = False

    def use_direct(self, on: bool) -> None:
        """Read records with ``O_DIRECT`` (``_direct.read_records_direct``:
        no page cache) from now on, or through the page cache again."""
        if on and self.dfds is None:
            self.dfds = [open_direct(p) for p in self.paths]
        self.direct = bool(on) and any(d is not None for d in self.dfds or ())

    def read(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Record ``slots[j]`` into ``out[j]``."""
        nb = self.nb
        if self.direct:
            seg = (np.searchsorted(self.firsts, slots, side="right") - 1 if len(self.fds) > 1
                   else np.zeros(len(slots), np.int64))
            offs = np.asarray(self.offs, np.int64)[seg] + (slots - self.firsts[seg]) * nb
            read_records_direct(self.dfds, self.fds, seg, offs, nb, out)  # type: ignore[arg-type]
            return
        if len(self.fds) == 1:
            fds = None
            offs = self.offs[0] + slots * nb
        else:
            seg = np.searchsorted(self.firsts, slots, side="right") - 1
            fds = np.asarray(self.fds, np.int64)[seg]
            offs = np.asarray(self.offs, np.int64)[seg] + (slots - self.firsts[seg]) * nb
        ctx = _aio.context() if len(slots) > 1 and out.flags.c_contiguous else None
        if ctx is not None:  # NOTE [page-cache reads in one submit]
            fda = np.full(len(slots), self.fds[0], np.int64) if fds is None else fds
            iov = np.zeros((len(slots), 1), _aio.IOVEC)
            iov["base"][:, 0] = out.ctypes.data + np.arange(len(slots), dtype=np.uint64) * nb
            iov["len"][:, 0] = nb
            bad = np.flatnonzero(_aio.read_vectors(ctx, fda, offs, iov) != nb)
            # a record the submit did not read whole is read again with preadv,
            # which retries a short read and raises the typed error at the end of a file
            for j in bad.tolist():
                _os.pread_records(int(fda[j]), offs[j : j + 1], nb, out[j : j + 1])
            return
        if fds is None:
            _os.pread_records(self.fds[0], offs, nb, out)
        else:
            _os.pread_records_multi(fds, offs, nb, out)

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
            (_os.fadvise_random if advice == os.POSIX_FADV_RANDOM else _os.fadvise_sequential)(fd)


def preadv_fields(store: Store, fields: Sequence[str], method: str) -> list[str]:
    """The fields that method ``method`` reads with ``preadv``: memmap fields
    of at least ``PREAD_MIN_BYTES`` per record (any size with "pread"); none
    with "mmap" or on LMDB. Variable-size fields are decoded by
    ``Store.read_batch`` in the reader threads, into the batch buffer."""
    backend = store.slot_view.backend
    if method == "mmap" or not backend.positional or backend.parts_on_demand():
        return []
    return [f for f in fields if not store.schema[f].variable and store.schema[f].nbytes
            and (store.schema[f].nbytes >= PREAD_MIN_BYTES or method == "pread")]


def open_field_files(store: Store, fields: Sequence[str], method: str) -> dict[str, FieldFiles]:
    """The ``preadv`` files of :func:`preadv_fields`."""
    files: dict[str, FieldFiles] = {}
    try:
        for f in preadv_fields(store, fields, method):
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
                for path, pos, length in store.slot_view.backend.entry_spans(f, a, b):
                    if length:
                        if path not in fds:
                            fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                        os.posix_fadvise(fds[path], pos, length, os.POSIX_FADV_WILLNEED)
    finally:
        for fd in fds.values():
            os.close(fd)


def _slot_to_index(store: Store, slots: np.ndarray) -> np.ndarray:
    ix = store.slot_view.index
    if ix is None:
        return slots
    return np.searchsorted(ix, slots.astype(ix.dtype)).astype(np.int64)


# -- one epoch's reads --------------------------------------------------------------

class EpochReads:
    """How one epoch reads its pieces: ``preadv`` for the fields in
    ``self.files``, ``Store.read_batch`` for the rest; and the kernel hints.

    NOTE [warm vs cold reads]: the fields in ``self.files`` are read with
    ``preadv`` into the batch rows in every epoch, from the page cache or the
    disk alike (a kernel copy that cannot fault and releases the GIL; a copy
    out of the mapping would need the slower SIGBUS-proof kernel copy of
    ``mmstore._os.safecopy``). What follows the page cache is how a batch is cut
    (method "auto"; "pread" keeps the second cut) and hinted
    (``state["cached"]``):

    * cached: a batch is a memory copy, bound by the CPU: one piece per core
      (the fewest Python tasks), no ``WILLNEED``;
    * not cached: a piece per reader thread (queue depth ``threads`` for the
      disk), ``WILLNEED`` on the records ``willneed`` batches ahead.

    The residency is measured over the fields' files when the epoch starts,
    then sampled every ``FOLLOW_BATCHES`` delivered batches on records of the
    batches not yet submitted (:meth:`follow`), so an epoch whose store is
    warmed or evicted while it runs changes its cut from the next batch on.
    ``state`` (``Loader.describe()["reads"]``) says what is in use.
    """

    def __init__(
        self, store: Store, fields: Sequence[str], files: dict[str, FieldFiles], tuning: LoaderTuning, *,
        batch_size: int, shuffled: bool, block: bool, ragged: Sequence[str] = (), direct: bool = False,
        crop: Any = None,
    ) -> None:
        self.store = store
        self.fields = tuple(fields)
        # a cropped field (mmstore/engine/crop.py: CropReader) is read, cropped and resized
        # record by record into its rows, after the other fields of the piece
        self.crop = crop
        resident = _resident(data_paths(store, fields)) if (files or block) else 1.0
        self.cached = resident >= 0.99
        self.files = files
        self.rest = [f for f in self.fields if f not in self.files and (crop is None or f not in crop.fields)]
        # ragged fields read with the pieces' fixed ones, in the same read_batch:
        # a backend whose one lookup per record gives every field (lmdb), where
        # a read of their own would look every record up again (_ragged.py)
        self.ragged = tuple(ragged) if (ragged and self.rest and store.slot_view.backend.ragged_lists) else ()
        rb = sum(store.schema[f].nbytes for f in fields) or 1
        base = max(1, tuning.piece_bytes // rb)
        # memmove epochs (no preadv fields), epochs whose window pass brings the
        # records into the page cache ahead of the batches, and cached epochs are
        # CPU-bound: one piece per core (faster than 2 MiB pieces: fewer Python
        # calls per batch)
        self._warm_rows = max(base, -(-batch_size // max(2, os.cpu_count() or 2)))
        # random record reads from the disk (one request each, whatever the piece):
        # a batch is spread over every reader thread, so the batch the consumer waits
        # for next (the first one above all) is not read by a few threads while the
        # others read batches after it
        self._cold_rows = min(base, max(1, -(-batch_size // max(1, int(tuning.threads or 1))))) if shuffled else base
        self._batch_size = batch_size
        self._tuning = tuning
        self._shuffled = shuffled
        self._block = block
        self.decode_gate = _decode_gate(store, [*self.rest, *(crop.fields if crop is not None else ())], batch_size,
                                        block)
        # a store that does not fit, read record by record (a permutation): O_DIRECT
        # reads, no page cache (NOTE [direct record reads] in mmstore/engine/direct.py)
        self.direct = bool(direct and self.files and not self.cached and not block)
        # the loader's files serve every epoch: set or reset. Not the small fields
        # method="pread" reads: a 4 KiB disk read each, where their file stays cached
        for ff in files.values():
            ff.use_direct(self.direct and ff.nb >= PREAD_MIN_BYTES)
        self.direct = self.direct and any(ff.direct for ff in self.files.values())
        if tuning.hints and self.files and not self.direct:
            for ff in self.files.values():
                ff.advise(os.POSIX_FADV_RANDOM if shuffled else os.POSIX_FADV_SEQUENTIAL)
        self.state: dict[str, Any] = {"cached": self.cached, "resident": round(resident, 3), "switches": 0}
        self._idx: np.ndarray | None = None
        self._set_cut()

    def _set_cut(self) -> None:
        """``piece_rows`` and ``willneed`` for the residency in ``self.cached``."""
        t = self._tuning
        # method="pread" keeps the disk's cut whatever the cache (preadv asked for)
        if not self.files or self._block or (self.cached and t.method == "auto"):
            self.piece_rows = self._warm_rows
        else:
            self.piece_rows = self._cold_rows
        if self.decode_gate is not None:
            self.piece_rows = -(-self._batch_size // self.decode_gate[1])
        elif self.crop is not None:  # a crop is CPU work per record: the batch over every reader thread
            self.piece_rows = min(self.piece_rows, -(-self._batch_size // max(1, int(t.threads or 1))))
        if self.direct and _aio.available():
            # each piece's reads go out in one AIO submit (NOTE [record reads in one
            # submit] in mmstore/engine/aio.py): a few long pieces per batch, not one per thread
            self.piece_rows = min(_aio.MAX_EVENTS, max(1, -(-self._batch_size // _AIO_PIECES)))
        self.willneed = 0  # hint the records of the batch this many batches ahead
        # a window pass reads the records of later batches with long
        # requests; per-record WILLNEED would race it with small ones
        if (t.hints and self.files and not self.direct and t.willneed and self._shuffled and not self.cached
                and not self._block):
            self.willneed = t.willneed
        self.state.update(cached=self.cached, piece_rows=self.piece_rows, willneed=self.willneed,
                          direct=self.direct)

    def watch(self, idx: np.ndarray, ahead: int) -> None:
        """Let :meth:`follow` sample the records of ``idx`` (the epoch's order
        from its first batch read), past the ``ahead`` batches already queued."""
        if self.files and not self.direct and not self._block and len(idx):
            self._idx = idx
            self._ahead = ahead

    def follow(self, k: int) -> None:
        """Batch ``k`` (of the epoch's ``idx``) was delivered: every
        ``FOLLOW_BATCHES`` batches, sample the page-cache residency of records
        of the batches after those queued and switch the cut when it changed.
        Called between submits, in the consumer's thread (the cut of a batch
        never changes while it is being queued)."""
        idx = self._idx
        if idx is None or (k + 1) % FOLLOW_BATCHES:
            return
        a = (k + 1 + self._ahead) * self._batch_size
        b = min(len(idx), a + FOLLOW_BATCHES * self._batch_size)
        if a >= b:
            return
        pos = np.linspace(a, b - 1, num=min(FOLLOW_SAMPLES, b - a)).astype(np.int64)
        try:
            cached = _all_resident(self.files, self.store.slot_view.slots_of(idx[pos]))
        except (OSError, NotImplementedError, ValueError):
            return
        if cached != self.cached:
            self.cached = cached
            self.state["switches"] += 1
            self._set_cut()

    def range_sources(self) -> list[FieldFiles]:
        """Where the window pass finds the byte ranges of a run of slots:
        one object per field read positionally, each with ``ranges(a, b)`` ->
        ``[(fd, offset, length), ...]`` per data file (``FieldFiles``). A
        field read through ``Store.read_batch`` (variable-size entries) plugs
        in here with an object giving its entries' byte ranges the same way;
        fields without one are brought in by ``WindowPrefetch._touch``."""
        return list(self.files.values())

    def read(self, idx: np.ndarray, slot: dict[str, np.ndarray], lo: int, hi: int, files: bool = True) -> Any:
        """Rows ``lo:hi`` of a batch: records ``idx[lo:hi]`` into ``slot[f][lo:hi]``
        (``files=False``: only the fields not read with ``preadv``); returns
        the piece's ``self.ragged`` fields (``{name: Ragged}``), or None."""
        part = idx[lo:hi]
        if self.files and files:
            slots = self.store.slot_view.slots_of(part)
            for f, ff in self.files.items():
                ff.read(slots, slot[f][lo:hi])
        if self.rest:
            names = [*self.rest, *self.ragged]
            if self.decode_gate is None:
                got = self.store.read_batch(part, fields=names, out={f: slot[f][lo:hi] for f in self.rest})
            else:
                with self.decode_gate[0]:
                    got = self.store.read_batch(part, fields=names, out={f: slot[f][lo:hi] for f in self.rest})
            if self.ragged and self.crop is None:
                return {f: got[f] for f in self.ragged}
        if self.crop is not None:  # CPU-bound (decode, resize): one task per usable core at a time
            f = self.crop.field
            if self.decode_gate is None:
                self.crop.read(part, slot[f][lo:hi])
            else:
                with self.decode_gate[0]:
                    self.crop.read(part, slot[f][lo:hi])
            if self.rest and self.ragged:
                return {f: got[f] for f in self.ragged}
        return None

    def hint(self, idx: np.ndarray) -> None:
        """``POSIX_FADV_WILLNEED`` on the records ``idx`` (preadv epochs)."""
        if not self.files or len(idx) == 0:
            return
        starts, stops = contiguous_ranges(self.store.slot_view.slots_of(idx))
        for ff in self.files.values():
            for a, b in zip(starts.tolist(), stops.tolist()):
                for fd, pos, length in ff.ranges(a, b):
                    os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)


# how often (delivered batches) and on how many records of the batches ahead
# an epoch samples the page cache (EpochReads.follow): a few mincore calls
FOLLOW_BATCHES = 8
FOLLOW_SAMPLES = 16


def _all_resident(files: dict[str, FieldFiles], slots: np.ndarray) -> bool:
    """Whether every record ``slots`` of every field in ``files`` is wholly in the page cache."""
    for ff in files.values():
        for s in slots.tolist():
            for fd, off, length in ff.ranges(s, s + 1):
                if _os.resident_fd(fd, off + length, off, length) < length:
                    return False
    return True


def _decode_gate(store: Store, fields: Sequence[str], batch_size: int,
                 block: bool) -> tuple[threading.BoundedSemaphore, int] | None:
    """For an epoch that decodes encoded fields from memory (their files are
    cached, or a window pass brings them in ahead): ``(gate, cores)``, at most
    one decoding task per usable core (``_os.usable_cores``), the batch in
    one contiguous piece per core. None otherwise.

    NOTE [decode-bound reads]: with more reader threads decoding at once
    than usable cores, the reads fall short of the decode limit (the same
    decoder on one thread per core, bytes in RAM); one per core reaches it:
    the decode releases the GIL, so more threads than cores only add
    switches, GIL hand-offs and cache misses. A cold permutation keeps every
    thread (queue depth for the page faults)."""
    encoded = [f for f in fields if store.schema[f].variable]
    if not encoded or not (block or _resident(data_paths(store, encoded)) >= 0.99):
        return None
    cores = min(int(_measured("cores", _os.usable_cores)), batch_size)
    return threading.BoundedSemaphore(cores), cores


# -- block shuffle: the window pass -------------------------------------------------

_tls = threading.local()  # each window reader thread's scratch buffer


class WindowPrefetch(WindowPass):
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
    through ``Store.read_batch`` in slot order.

    The windows are any cut of the epoch (``bounds``): a block shuffle's
    windows, or consecutive runs of a sequential order. ``drop_behind``
    (the store is larger than the memory budget): once every batch that
    reads window ``w`` is read (:meth:`consumed`), its byte ranges are
    dropped from the page cache (``POSIX_FADV_DONTNEED``), so the next
    windows do not have to push out pages still needed by reclaim under a
    memory limit."""

    def __init__(
        self, reads: EpochReads, idx: np.ndarray, bounds: np.ndarray, mode: str, threads: int, inflight: InFlight,
        drop_behind: bool = False, chunk: int = _CHUNK,
    ) -> None:
        super().__init__(idx, bounds, inflight)
        self.reads = reads
        self.mode = mode
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="mmstore-window")
        self.own: dict[int, int] = {}  # the loader's descriptor -> the pass's own (its readahead state)
        self.filled = 0  # bytes that WILLNEED left out and the pass read itself
        self.drop_behind = drop_behind
        self.chunk = max(1, int(chunk))  # the longest read of mode "read" (each thread's buffer)
        self.held: list[int] = []  # windows read and not yet dropped (drop_behind)

    def _open_own(self) -> None:
        """The pass reads through descriptors of its own, advised
        ``POSIX_FADV_SEQUENTIAL``: the batches' descriptors are advised
        RANDOM for shuffled orders, which makes the kernel issue exactly the
        requested pages in small requests; with a sequential readahead state
        a long read goes to the disk as requests of the device's maximum size
        (measured on the simulated HDD: NOTE in ``mmstore/engine/plan.py``)."""
        for src in self.reads.range_sources():
            for fd, path in zip(src.fds, getattr(src, "paths", ())):
                try:
                    own = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    continue
                self.own[fd] = own
                _os.fadvise_sequential(own)

    def _close_own(self) -> None:
        own, self.own = self.own, {}
        for fd in own.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _loop(self) -> None:
        b = self.bounds
        cv = self.inflight.cv
        try:
            self._open_own()
            for w in range(len(b) - 1):
                with cv:
                    while w > self.need and not self.inflight.cancelled:
                        cv.wait()
                if self.inflight.cancelled:
                    return
                self.read_window(self.idx[b[w] : b[w + 1]])
                with cv:
                    self.done = w
                    if self.drop_behind:
                        self.held.append(w)
                    cv.notify_all()
        except Exception:  # noqa: BLE001 - a prefetch pass only: a failing read is
            pass  # reported by the batch that reads the record; this thread prints nothing
        finally:
            with cv:
                self.done = len(b)  # never leave a batch waiting
                cv.notify_all()
            self.pool.shutdown(wait=True, cancel_futures=True)  # reads of at most self.chunk
            self._close_own()

    def consumed(self, pos: int) -> None:
        """Positions ``[0, pos)`` of the epoch are read into the ring: drop
        the windows that lie wholly before ``pos`` (``drop_behind``)."""
        if not self.drop_behind:
            return
        with self.inflight.cv:
            done = [w for w in self.held if self.bounds[w + 1] <= pos]
            self.held = [w for w in self.held if self.bounds[w + 1] > pos]
        for w in done:
            if self.inflight.cancelled:
                return
            slots = self.reads.store.slot_view.slots_of(self.idx[self.bounds[w] : self.bounds[w + 1]])
            for fd, off, length in self._runs(slots):
                try:
                    os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
                except OSError:  # a hint only
                    pass

    def read_window(self, idx: np.ndarray) -> None:
        """Bring the records ``idx`` (one window) into the page cache."""
        if len(idx) == 0:
            return
        slots = self.reads.store.slot_view.slots_of(idx)
        if not self.reads.files:
            self._touch(slots)
            return
        chunks = self._chunks(slots)
        if self.mode == "willneed":
            for fd, pos, length in chunks:
                if self.inflight.cancelled:
                    return
                os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)
            # WILLNEED is best effort: under a memory limit its readahead
            # gives up on pages it cannot allocate at once. What it left out
            # is read here, in long requests, not by the batches record by record.
            chunks = [(fd, a, n) for fd, pos, length in chunks for a, n in _os.missing_ranges(fd, pos, length)]
            self.filled += sum(c[2] for c in chunks)
            if not chunks:
                return
        futs = [self.pool.submit(self._read_chunk, fd, pos, length) for fd, pos, length in chunks]
        wait_all(futs)
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

    def _runs(self, slots: np.ndarray) -> list[tuple[int, int, int]]:
        """``(fd, offset, length)`` of the runs of consecutive ``slots``, per
        field and data file, in offset order within each file."""
        starts, stops = contiguous_ranges(slots)
        out = []
        for src in self.reads.range_sources():
            for a, b in zip(starts.tolist(), stops.tolist()):
                out += src.ranges(a, b)
        return out

    def _chunks(self, slots: np.ndarray) -> list[tuple[int, int, int]]:
        """The window's runs (:meth:`_runs`), cut into reads of at most
        ``_CHUNK`` for mode "read"."""
        chunks = []
        for fd, pos, length in self._runs(slots):
            step = length if self.mode == "willneed" else self.chunk
            chunks += [(fd, p, min(step, pos + length - p)) for p in range(pos, pos + length, step)]
        return chunks

    def _read_chunk(self, fd: int, pos: int, length: int) -> None:
        fd = self.own.get(fd, fd)
        buf = getattr(_tls, "buf", None)
        if buf is None or len(buf) != self.chunk:
            buf = _tls.buf = memoryview(bytearray(self.chunk))
        end = pos + length
        while pos < end and not self.inflight.cancelled:
            got = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
            if got <= 0:
                break
            pos += got
