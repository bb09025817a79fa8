"""Window buffers read with ``O_DIRECT``: the read-ahead pass for a store
larger than the memory budget.

For data that does not fit, the page cache is only a staging area: every
page the window pass reads there is copied once more into the ring and then
has to be reclaimed under the memory limit. In a memory cgroup smaller than
the store, the Loader's block-shuffle epoch through the page cache spent
several times the system CPU of one sequential read of the file, and
the page-cache pass's readahead gave up on pages it could not allocate
(NOTE [memory plan] in ``mmstore/engine/plan.py``). So, when the store does not fit:

* the pass reads each window's runs of consecutive records (one per block,
  or per stretch of a sequential order) with ``O_DIRECT`` ``preadv`` into a
  private window buffer on transparent huge pages (:class:`_Buffer`): the
  disk writes straight into it, no page cache, no reclaim, requests of the
  device's largest size (NOTE [huge window buffers]) in offset order,
  ``threads`` in flight;
* a batch copies its records out of the buffers of the windows it spans
  (``ctypes.memmove``, GIL released), the only copy of a record;
* a buffer goes back to a free list once every batch that reads its window
  is read (:meth:`DirectWindows.consumed`), so at most the windows spanned
  by the batches in flight plus the one being read are held.

Fields served this way are the positional ones the epoch reads with
``preadv`` (``EpochReads.files``); the others (small fields, variable-size
entries through ``Store.read_batch``) keep their path. Where ``O_DIRECT`` is
refused (tmpfs, some network file systems) the same spans are read buffered.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._os import pread_records
from .._os.runs import find_runs
from ..order import contiguous_ranges
from . import aio as _aio
from .inflight import InFlight, WindowPass, wait_all

__all__ = ["DirectWindows", "open_direct", "read_records_direct"]


def _close(buf: Any) -> None:
    try:
        buf.close()
    except BufferError:  # still exported somewhere: the collector frees it
        pass


_HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4K pages)


class _Buffer:
    """A private window buffer of ``size`` bytes that starts on a huge-page
    boundary, asked to be backed by transparent huge pages
    (``MADV_HUGEPAGE``; where THP is off or refused: plain pages, same
    behaviour, smaller requests).

    NOTE [huge window buffers]: an ``O_DIRECT`` read goes to the disk as
    requests of at most ``max_segments`` physically contiguous pieces of the
    destination (254 for a virtio disk). Into 4 KiB pages that is about 1 MiB
    per request, smaller requests and more of them than ``dd``'s buffered
    read (the page cache's large folios) sends; into huge pages the requests
    are several times larger, and a pass reads faster than into 4 KiB pages.
    On a disk whose request rate is the limit (a hard disk) the small
    requests cap a pass's rate."""

    def __init__(self, size: int) -> None:
        self.size = size
        # private: a shared anonymous mapping is shmem, whose huge pages are
        # off by default (shmem_enabled), where a private one follows ``enabled``
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self.map = mmap.mmap(-1, size + _HUGE, flags=flags) if flags else mmap.mmap(-1, size + _HUGE)
        madv = getattr(mmap, "MADV_HUGEPAGE", None)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.shift = -base % _HUGE
        self.addr = base + self.shift
        if madv is not None:
            try:
                self.map.madvise(madv, self.shift, size)
            except (OSError, ValueError):  # THP not built in: plain pages
                pass
        self.view = memoryview(self.map)[self.shift : self.shift + size]

    def close(self) -> None:
        self.view.release()
        _close(self.map)

_ALIGN = 4096  # O_DIRECT offset, length and address alignment (safe for 512 and 4K devices)
_PIECE = 8 << 20  # the longest single read (a multiple of _ALIGN)
_memmove = ctypes.memmove


class _Window:
    """One window in a buffer: its slots (sorted, unique) and, per field,
    the byte position of each slot's record in the buffer."""

    def __init__(self, slots: np.ndarray, pos: dict[str, np.ndarray], buf: _Buffer) -> None:
        self.slots, self.pos, self.buf, self.addr = slots, pos, buf, buf.addr


class DirectWindows(WindowPass):
    """A window pass with :class:`~mmstore.engine.reads.WindowPrefetch`'s
    interface (``start``, ``window_of``, ``ask``, ``wait_for``,
    ``consumed``) that reads into private buffers, and :meth:`copy_rows`,
    which serves the batches' records from them."""

    def __init__(self, reads: Any, idx: np.ndarray, bounds: np.ndarray, threads: int, inflight: InFlight, *,
                 cap: int, batch_size: int) -> None:
        super().__init__(idx, bounds, inflight)
        self.reads = reads
        self.fields = list(reads.files)
        self.windows: dict[int, _Window] = {}
        self.free: list[_Buffer] = []  # buffers to reuse
        self.cap = max(1, int(cap))  # bytes of buffers (held and free) the pass may keep
        self.mem = 0  # bytes of buffers now (held and free)
        self.batch_size = max(1, int(batch_size))
        self.pos = 0  # positions [0, pos) are in the ring
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="mmstore-window")
        self.direct: dict[int, int] = {}  # the loader's descriptor -> an O_DIRECT one (or itself)
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    # -- the interface the batches use -------------------------------------------
    def consumed(self, pos: int) -> None:
        """Positions ``[0, pos)`` are in the ring: free the buffers of the
        windows that end at or before ``pos``."""
        with self.inflight.cv:
            self.pos = max(self.pos, pos)
            gone = [w for w in self.windows if self.bounds[w + 1] <= pos]
            for w in gone:
                win = self.windows.pop(w)
                self.free.append(win.buf)
            self.inflight.cv.notify_all()  # the pass may wait for room, or for this position

    def copy_rows(self, pos0: int, slots: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Records ``slots`` (epoch positions ``pos0, pos0 + 1, ...``) into
        rows ``0..`` of ``out[f]`` for the fields served from the buffers."""
        if self.error is not None:
            raise self.error
        n = len(slots)
        ws = np.searchsorted(self.bounds, np.arange(pos0, pos0 + n), side="right") - 1
        for w in np.unique(ws).tolist():
            win = self.windows.get(w)
            if win is None:  # cancelled, or the pass failed: the batch's own reads
                rows = np.flatnonzero(ws == w)
                for f in self.fields:
                    got = np.empty((len(rows), *out[f].shape[1:]), out[f].dtype)
                    self.reads.files[f].read(slots[rows], got)
                    out[f][rows] = got
                continue
            rows = np.flatnonzero(ws == w)
            k = np.searchsorted(win.slots, slots[rows])
            for f in self.fields:
                dst = out[f]
                nb = dst.nbytes // max(1, len(dst))
                base = dst.ctypes.data
                src = (win.pos[f][k] + win.addr).tolist()
                for r, s in zip(rows.tolist(), src):
                    _memmove(base + r * nb, s, nb)

    # -- the pass --------------------------------------------------------------------
    def _loop(self) -> None:
        cv = self.inflight.cv
        b = self.bounds
        try:
            self._open_direct()
            for w in range(len(b) - 1):
                with cv:
                    while w > self.need and not self.inflight.cancelled:
                        cv.wait()
                if self.inflight.cancelled:
                    return
                win = self._read(self.idx[b[w] : b[w + 1]], int(b[w]))
                if self.inflight.cancelled:
                    return
                with cv:
                    self.windows[w] = win
                    self.done = w
                    cv.notify_all()
        except Exception:  # noqa: BLE001 - a window not read: its batches read their records
            pass  # themselves (copy_rows), which raises the typed error where there is one
        finally:
            with cv:
                self.done = len(b)
                cv.notify_all()
            self.pool.shutdown(wait=True, cancel_futures=True)
            for fd in set(self.direct.values()) - set(self.direct):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.direct = {}

    def _open_direct(self) -> None:
        flag = getattr(os, "O_DIRECT", 0)
        for ff in self.reads.files.values():
            for fd, path in zip(ff.fds, ff.paths):
                own = fd
                if flag:
                    try:
                        own = os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
                    except OSError:
                        own = fd
                self.direct[fd] = own

    def _buffer(self, size: int, start: int) -> Any:
        """A buffer of at least ``size`` bytes for the window starting at
        epoch position ``start``: a free one, else a new one once the
        buffers fit in ``cap`` (always for a window the next batch to be
        consumed reads, so the pass never waits on batches that wait on it)."""
        cv = self.inflight.cv
        size = -(-size // _HUGE) * _HUGE
        with cv:
            while True:
                for i, buf in enumerate(self.free):
                    if buf.size >= size:
                        del self.free[i]
                        return buf
                while self.free:  # too small: give them back
                    buf = self.free.pop()
                    self.mem -= buf.size
                    buf.close()
                if self.mem + size <= self.cap or start < self.pos + self.batch_size or self.inflight.cancelled:
                    self.mem += size
                    return _Buffer(size)
                cv.wait()

    def _read(self, idx: np.ndarray, start: int = 0) -> _Window:
        """Read window ``idx`` (epoch positions from ``start``)'s runs into a buffer; its map."""
        slots = np.unique(self.reads.store.slot_view.slots_of(idx))
        starts, stops = contiguous_ranges(slots)
        spans: list[tuple[int, int, int, int, int]] = []  # (fd, aligned offset, length, needed, buffer pos)
        pos = {f: np.empty(len(slots), np.int64) for f in self.fields}
        at = 0
        for f, ff in self.reads.files.items():
            nb = ff.nb
            k = 0  # index into slots of the next run's first slot
            for a, b in zip(starts.tolist(), stops.tolist()):
                for fd, off, length in ff.ranges(a, b):
                    a0 = off - off % _ALIGN
                    a1 = -(-(off + length) // _ALIGN) * _ALIGN
                    cnt = length // nb
                    pos[f][k : k + cnt] = at + (off - a0) + np.arange(cnt, dtype=np.int64) * nb
                    spans.append((fd, a0, a1 - a0, off + length - a0, at))
                    at += a1 - a0
                    k += cnt
        buf = self._buffer(max(at, 1), start)
        mv = buf.view
        futs = []
        for fd, off, length, need, at0 in spans:  # pieces of at most _PIECE: every thread busy
            for p in range(0, length, _PIECE):
                n = min(_PIECE, length - p)
                futs.append(self.pool.submit(self._read_span, fd, off + p, min(n, max(0, need - p)),
                                             mv[at0 + p : at0 + p + n]))
        wait_all(futs)
        for fu in futs:
            exc = fu.exception()
            if exc is not None:
                raise exc
        return _Window(slots, pos, buf)

    def _read_span(self, fd: int, off: int, need: int, dst: memoryview) -> None:
        """The aligned span at ``off`` into ``dst`` (at least its first
        ``need`` bytes, which hold the records): O_DIRECT when open so,
        buffered when the kernel refuses it. EOFError when the file ends
        before ``need`` (a truncated store: the batches then read for
        themselves and raise the typed error)."""
        own = self.direct.get(fd, fd)
        done, length = 0, len(dst)
        while done < length and not self.inflight.cancelled:
            try:
                got = os.preadv(own, [dst[done:]], off + done)
            except OSError:
                if own == fd:
                    raise
                own = fd  # O_DIRECT refused here: read buffered
                continue
            if got <= 0:
                break
            done += got
        if done < need and not self.inflight.cancelled:
            raise EOFError(f"window pass: {done:,} of {need:,} bytes at offset {off:,}")


# -- records read one by one (a permutation of a store that does not fit) --------------

_DIRECT_RUN_MAX = 16 << 20  # a longer run of consecutive records is read buffered
_records_tls = threading.local()  # each reader thread's aligned staging buffer


def open_direct(path: str) -> int | None:
    """``path`` opened with ``O_DIRECT``; None where it is refused (tmpfs,
    some network file systems, no ``O_DIRECT`` on this platform)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def _staging(size: int) -> Any:
    """This thread's page-aligned buffer of at least ``size`` bytes (a
    private anonymous mapping, reused); its first ``2 * _ALIGN`` bytes are
    also the two scratch blocks of a read in place (:func:`_read_in_place`)."""
    buf = getattr(_records_tls, "buf", None)
    if buf is None or len(buf[1]) < size:
        size = -(-max(size, 2 * _ALIGN) // (1 << 20)) * (1 << 20)
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        m = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        buf = _records_tls.buf = (m, memoryview(m), ctypes.addressof(ctypes.c_char.from_buffer(m)))
    return buf


_BLOCK = 512  # the device block a read in place is aligned to (NOTE [rows read in place] in _ring.py)
# O_DIRECT descriptors that refused a read in place (a device whose block is
# larger than _BLOCK): staged from then on. Keyed by number: a later file that
# gets a recycled number is staged too (slower, still exact)
_no_in_place: set[int] = set()


def _read_in_place(dfd: int, off: int, length: int, dst: int, row: memoryview) -> bool:
    """``length`` bytes at ``off`` of ``dfd`` (O_DIRECT) straight into
    ``row`` (address ``dst``, congruent to ``off`` modulo ``_BLOCK``): the
    whole blocks of the record go to the row, the blocks holding its head and
    its tail (when they are not whole) to this thread's two scratch blocks,
    whose record bytes are then copied into place. False where the read was
    refused (the device wants a larger block: staged from then on) or came
    up short (end of file: the caller reads buffered and raises the typed
    error)."""
    h = off % _BLOCK
    m0 = off - h + (_BLOCK if h else 0)  # the first whole block of the record
    end = off + length
    m1 = end - end % _BLOCK  # the end of its last whole block
    _, view, addr = _staging(2 * _ALIGN)
    iov = [view[:_BLOCK]] if h else []
    iov.append(row[m0 - off : m1 - off])
    if end > m1:
        iov.append(view[_ALIGN : _ALIGN + _BLOCK])
    try:
        got = os.preadv(dfd, iov, off - h)
    except OSError:
        _no_in_place.add(dfd)
        return False
    if got < end - (off - h):
        return False
    if h:
        _memmove(dst, addr + h, m0 - off)
    if end > m1:
        _memmove(dst + m1 - off, addr + _ALIGN, end - m1)
    return True


def _read_runs_aio(ctx: Any, dfds: list[int | None], which: np.ndarray, offsets: np.ndarray, nbytes: int, base: int,
                   starts: list[int], ends: list[int]) -> list[tuple[int, int]]:
    """The runs ``starts[k]:ends[k]`` that can be read in place (NOTE [rows
    read in place] in ``_ring.py``), read in place in one submit (NOTE
    [record reads in one submit] in ``mmstore/engine/aio.py``); returns the runs left to
    the caller (not eligible, or their read failed or came up short)."""
    st = np.asarray(starts, np.int64)
    en = np.asarray(ends, np.int64)
    off = offsets[st]
    length = (en - st) * nbytes
    dst = base + st * nbytes
    d = np.asarray([-1 if x is None or x in _no_in_place else x for x in dfds], np.int64)[which[st]]
    ok = (d >= 0) & ((dst - off) % _BLOCK == 0) & (length >= 2 * _BLOCK) & (length <= _DIRECT_RUN_MAX)
    sel = np.flatnonzero(ok)[: _AIO_RUNS]
    if len(sel) == 0:
        return list(zip(starts, ends))
    o, ln, ds = off[sel], length[sel], dst[sel]
    h = o % _BLOCK
    end = o + ln
    m0 = o - h + np.where(h > 0, _BLOCK, 0)
    m1 = end - end % _BLOCK
    _, _, addr = _staging(2 * _BLOCK * _AIO_RUNS)
    head = addr + np.arange(len(sel), dtype=np.int64) * (2 * _BLOCK)
    tail = head + _BLOCK
    iov = np.zeros((len(sel), 3), _aio.IOVEC)
    col = (h > 0).astype(np.int64)
    rows = np.arange(len(sel))
    iov["base"][rows, 0] = head
    iov["len"][rows, 0] = np.where(h > 0, _BLOCK, 0)
    iov["base"][rows, col] = ds + (m0 - o)
    iov["len"][rows, col] = m1 - m0
    has_tail = end > m1
    iov["base"][rows, col + 1] = np.where(has_tail, tail, 0)
    iov["len"][rows, col + 1] = np.where(has_tail, _BLOCK, 0)
    res = _aio.read_vectors(ctx, d[sel], o - h, iov)
    good = res >= end - (o - h)
    for i in np.flatnonzero(good & (h > 0)).tolist():
        _memmove(int(ds[i]), int(head[i] + h[i]), int(m0[i] - o[i]))
    for i in np.flatnonzero(good & has_tail).tolist():
        _memmove(int(ds[i] + m1[i] - o[i]), int(tail[i]), int(end[i] - m1[i]))
    if np.any(res == -errno.EINVAL):  # the device wants a larger block: staged from now on
        _no_in_place.update(d[sel][res == -errno.EINVAL].tolist())
    left = np.ones(len(st), bool)
    left[sel[good]] = False
    return [(starts[k], ends[k]) for k in np.flatnonzero(left).tolist()]


_AIO_RUNS = 512  # runs read in place per submit (two scratch blocks each in the staging buffer)


def read_records_direct(dfds: list[int | None], fds: list[int], which: np.ndarray, offsets: np.ndarray, nbytes: int,
                        out: np.ndarray) -> None:
    """Record ``i`` (``nbytes`` at ``offsets[i]`` of file ``which[i]``) into
    row ``i`` of ``out``, read with ``O_DIRECT`` (``dfds[which[i]]``): no
    page cache (NOTE [direct record reads]). Runs of consecutive records of
    one file are one read. A run whose rows are congruent to its file offset
    modulo the device block (the ring's buffers are allocated so: NOTE [rows
    read in place] in ``_ring.py``) is read straight into its rows, all such
    runs of the call in one AIO submit where AIO is available (NOTE [record
    reads in one submit] in ``mmstore/engine/aio.py``), else one ``preadv`` each; any other
    into this thread's aligned staging buffer and copied into the rows. Where
    ``O_DIRECT`` is not open or refused, and for a read that comes up short
    (a truncated file: the buffered read raises the typed
    :class:`~mmstore._os.TruncatedReadError`), the run is read buffered
    through ``fds`` instead.

    NOTE [direct record reads]: under a memory limit smaller than the store,
    random record reads with ``O_DIRECT`` are faster, for a fraction of the
    system CPU, than reads through the page cache (each page inserted,
    copied once, then reclaimed under the limit). Read in place, a record
    saves its reader thread the user CPU of the staging copy."""
    n = len(offsets)
    if n == 0:
        return
    offl = offsets.tolist()
    wl = which.tolist()
    starts, ends = find_runs(nbytes, offl, same=which if len(fds) > 1 else None)
    base = out.ctypes.data
    flat = None  # out's bytes, for a read in place (a C-contiguous out only)
    whole = bool(out.flags.c_contiguous)
    runs: Iterable[tuple[int, int]] = zip(starts, ends)
    ctx = _aio.context() if whole and any(d is not None for d in dfds) else None
    if ctx is not None:
        runs = _read_runs_aio(ctx, dfds, np.asarray(which, np.int64), np.asarray(offsets, np.int64), nbytes, base,
                              starts, ends)
    for s0, e0 in runs:
        k = wl[s0]
        off, length = offl[s0], (e0 - s0) * nbytes
        dfd = dfds[k]
        if dfd is not None and length <= _DIRECT_RUN_MAX:
            dst = base + s0 * nbytes
            if whole and (dst - off) % _BLOCK == 0 and length >= 2 * _BLOCK and dfd not in _no_in_place:
                if flat is None:
                    flat = out.reshape(-1).view(np.uint8).data
                if _read_in_place(dfd, off, length, dst, flat[s0 * nbytes : s0 * nbytes + length]):
                    continue
                if dfd not in _no_in_place:  # came up short: the buffered read says why
                    pread_records(fds[k], offsets[s0:e0], nbytes, out[s0:e0])
                    continue
            a0 = off - off % _ALIGN
            a1 = -(-(off + length) // _ALIGN) * _ALIGN
            _, view, addr = _staging(a1 - a0)
            done = 0
            try:
                while done < off + length - a0:
                    got = os.preadv(dfd, [view[done : a1 - a0]], a0 + done)
                    if got <= 0:
                        break
                    done += got
            except OSError:
                done = -1  # O_DIRECT refused for this read: buffered below
            if done >= off + length - a0:
                _memmove(dst, addr + off - a0, length)
                continue
        pread_records(fds[k], offsets[s0:e0], nbytes, out[s0:e0])
