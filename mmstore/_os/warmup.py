"""``warm``: one sequential pass that pulls files into the page cache, within a memory budget."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ResourceLimitError
from . import cache, memory
from .files import PAGE_SIZE, GiB, MiB, PathLike, open_ro
from .pread import pread_into

__all__ = ["WarmHandle", "WarmReport", "warm", "warm_in_background"]


@dataclass
class WarmReport:
    """What a :func:`warm` pass did.

    Attributes
    ----------
    paths : tuple of str
        The files, in reading order, duplicates removed.
    bytes_total : int
        Sum of the file sizes.
    bytes_planned : int
        Bytes the pass meant to read: ``bytes_total``, or less when the files
        do not fit (then the first ``bytes_planned`` bytes in order).
    bytes_read : int
        Bytes actually read.
    resident_before : int
        Bytes of the files in the page cache before the pass.
    available : int or None
        :func:`effective_available` at the start; None if unknown (then no
        fit check was made).
    seconds : float
        Time spent reading (planning excluded).
    complete : bool
        True when every byte of every file was read.
    reason : str or None
        Why not complete (does not fit, stopped), else None.
    """

    paths: tuple[str, ...] = ()
    bytes_total: int = 0
    bytes_planned: int = 0
    bytes_read: int = 0
    resident_before: int = 0
    available: int | None = None
    seconds: float = 0.0
    complete: bool = True
    reason: str | None = None

    @property
    def mb_per_s(self) -> float:
        """Read rate in MB/s (10**6 bytes), 0.0 when nothing was timed."""
        return self.bytes_read / self.seconds / 1e6 if self.seconds > 0 else 0.0


def warm(paths: PathLike | Iterable[PathLike], *, chunk_bytes: int = 16 * MiB,
         progress: Callable[[int, int], Any] | None = None,
         max_fraction: float | None = 0.9,
         stop_event: Any = None) -> WarmReport:
    """Read files once, sequentially, so they end up in the page cache.

    Parameters
    ----------
    paths : path or iterable of paths
        Files to read, in order. A file listed twice (same device and inode)
        is read once.
    chunk_bytes : int, default 16 MiB
        Size of the one reusable read buffer (rounded up to whole pages).
    progress : callable(bytes_done, bytes_planned), optional
        Called after every chunk. An exception from it stops the pass and
        propagates.
    max_fraction : float or None, default 0.9
        Fit check. The files may occupy at most ``max_fraction *
        effective_available()`` bytes of page cache. Pages of the files that
        are already resident count against that (``MemAvailable`` includes
        them, and reading more must not push them out), so the budget for new
        pages is ``max_fraction * available - resident``. If the non-resident
        bytes exceed it, the pass stops at the page where the budget runs out
        (in reading order) and the report says ``complete=False`` with a
        ``reason``; the caller decides whether to warn. None disables the
        check.
    stop_event : threading.Event-like, optional
        Checked before every chunk; when set, the pass stops
        (``complete=False``).

    Returns
    -------
    WarmReport

    Raises
    ------
    OSError
        A file cannot be opened (checked for all files before reading any).

    Notes
    -----
    One file is open at a time (each is opened to be measured, then again to
    be read), so a store of more files than the process may open at once is
    warmed too. A file replaced between the two (another device or inode at
    its path) is not read, and the report says so.

    Hints: ``POSIX_FADV_SEQUENTIAL`` for each file; the kernel's own
    readahead reads ahead of the copies (NOTE [sequential pages]) and can pull
    in up to one readahead window (typically 128 KiB - a few MiB) past the
    stop point. A file that
    shrinks during the pass ends early without error. Residency is not
    guaranteed afterwards: memory pressure and other readers decide that.
    Where residency cannot be measured (no mincore), every byte counts as not
    resident; where no memory figure exists, the fit check is skipped.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    chunk = max(PAGE_SIZE, -(-int(chunk_bytes) // PAGE_SIZE) * PAGE_SIZE)
    if max_fraction is not None and not (0 < max_fraction <= 1):
        raise ValueError(f"max_fraction must be in (0, 1] or None, got {max_fraction}")
    files = _scan(paths)
    report, stop = _plan(files, max_fraction)
    t0 = time.perf_counter()
    done, stopped, replaced = _read_pass(files, stop, chunk, report.bytes_planned, progress, stop_event)
    report.seconds = time.perf_counter() - t0
    report.bytes_read = done
    _finish_report(report, stopped, replaced)
    return report


@dataclass
class _File:
    """A file of the pass: its name, identity (device, inode), size (0 for
    what is not a regular file) and resident bytes (None: not measurable)."""

    name: str
    key: tuple[int, int]
    size: int
    resident: int | None


def _open(path: PathLike) -> int:
    try:
        return open_ro(path)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise ResourceLimitError(
            exc.errno, f"{os.fsdecode(path)}: cannot be opened: {exc.strerror}; the process has no file "
            "descriptor left (warming holds one file open at a time): raise the open-files limit (`ulimit -n`) "
            "or close files") from None


def _scan(paths: Iterable[PathLike]) -> list[_File]:
    """Each file once (by device and inode), opened, measured and closed in turn."""
    out: list[_File] = []
    seen: set[tuple[int, int]] = set()
    for p in paths:
        fd = _open(p)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            try:
                resident: int | None = cache.resident_fd(fd, size)
            except (NotImplementedError, OSError):
                resident = None
        finally:
            os.close(fd)
        seen.add(key)
        out.append(_File(os.fsdecode(p), key, size, resident))
    return out


def _reopen(f: _File) -> int | None:
    """``f`` opened again; None when its path now names another file (or none)."""
    try:
        fd = _open(f.name)
    except FileNotFoundError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != f.key:
        os.close(fd)
        return None
    return fd


def _plan(files: list[_File], max_fraction: float | None) -> tuple[WarmReport, tuple[int, int]]:
    """The report before reading, and where to stop: (file index, offset);
    ``(len(files), 0)`` reads everything."""
    sizes = [f.size for f in files]
    names = [f.name for f in files]
    total = sum(sizes)
    measurable = all(f.resident is not None for f in files)
    resident = sum(f.resident or 0 for f in files) if measurable else 0
    available = memory.effective_available() if max_fraction is not None else None
    report = WarmReport(paths=tuple(names), bytes_total=total, bytes_planned=total,
                        resident_before=resident, available=available)
    stop = (len(files), 0)
    if available is None or max_fraction is None:
        return report, stop
    capacity = int(max_fraction * available)
    budget = max(0, capacity - resident)
    missing = total - resident
    if missing > budget:
        stop = _plan_stop(files, budget) if measurable else _plan_linear(sizes, budget)
    if stop[0] < len(files):
        planned = sum(sizes[:stop[0]]) + stop[1]
        report.bytes_planned = planned
        report.complete = False
        report.reason = (
            f"files need {_gib(total)} of page cache ({_gib(missing)} "
            f"not yet resident) but only {_gib(capacity)} may be used "
            f"({max_fraction:g} of {_gib(available)} available); "
            f"read the first {_gib(planned)} of {_gib(total)} "
            f"({100 * planned / max(1, total):.0f}%)")
    return report, stop


def _read_pass(files: list[_File], stop: tuple[int, int], chunk: int, planned: int,
               progress: Callable[[int, int], Any] | None, stop_event: Any) -> tuple[int, bool, list[str]]:
    """Read the files up to ``stop``; return (bytes read, stopped by
    ``stop_event``, the files replaced since they were measured)."""
    stop_i, stop_off = stop
    mv = memoryview(bytearray(chunk))
    done = 0
    replaced: list[str] = []
    for i, f in enumerate(files):
        if i > stop_i or (i == stop_i and stop_off == 0):
            break
        limit = stop_off if i == stop_i else f.size
        if limit <= 0:
            continue
        fd = _reopen(f)
        if fd is None:
            replaced.append(f.name)
            continue
        try:
            got_all, stopped = _read_file(fd, limit, mv, chunk, done, planned, progress, stop_event)
        finally:
            os.close(fd)
        done += got_all
        if stopped:
            return done, True, replaced
    return done, False, replaced


def _read_file(fd: int, limit: int, mv: memoryview, chunk: int, done: int, planned: int,
               progress: Callable[[int, int], Any] | None, stop_event: Any) -> tuple[int, bool]:
    """The first ``limit`` bytes of ``fd`` read in ``chunk``-byte reads;
    (bytes read, stopped by ``stop_event``). ``done`` bytes were read before
    it (for ``progress``)."""
    start = done
    cache.advise(fd, 0, 0, "sequential")
    off = 0
    while off < limit:
        if stop_event is not None and stop_event.is_set():
            return done - start, True
        n = min(chunk, limit - off)
        # NOTE [sequential pages]: plain reads, no WILLNEED ahead of them. The
        # kernel's sequential readahead (FADV_SEQUENTIAL doubles its window)
        # fills the page cache with large folios where the file system has
        # them, while WILLNEED and random reads fill it with single pages; a
        # later memory copy out of single pages (preadv or a mapping's page
        # faults) costs a lookup per 4 KiB, so every warm epoch that follows
        # reads slower. The readahead also keeps the disk busy during the copy,
        # which is what the WILLNEED hint was for.
        got = _read_chunk(fd, mv[:n], off)
        done += got
        off += got
        if progress is not None:
            progress(done, planned)
        if got < n:  # file shrank
            break
    return done - start, False


def _read_chunk(fd: int, mv: memoryview, off: int) -> int:
    """Fill ``mv`` from ``off``, stopping early only at end of file."""
    got_total = 0
    while got_total < len(mv):
        got = pread_into(fd, mv[got_total:], off + got_total)
        if got == 0:
            break
        got_total += got
    return got_total


def _finish_report(report: WarmReport, stopped: bool, replaced: list[str]) -> None:
    done = report.bytes_read
    if replaced:
        report.complete = False
        msg = (f"{len(replaced):,} file(s) replaced during the pass, not read: {replaced[0]}"
               + (" and others" if len(replaced) > 1 else ""))
        report.reason = msg if report.reason is None else report.reason + "; " + msg
    if stopped:
        report.complete = False
        msg = f"stopped by stop_event after {_gib(done)} of {_gib(report.bytes_planned)}"
        report.reason = msg if report.reason is None else report.reason + "; " + msg
    elif report.complete and done < report.bytes_total:
        report.complete = False
        report.reason = (f"read {done:,} of {report.bytes_total:,} bytes: files shrank "
                         f"during the pass")


def _gib(n: int) -> str:
    """Human-readable byte count (binary units)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _plan_stop(files: list[_File], budget: int) -> tuple[int, int]:
    """The (file index, byte offset) where the pages not yet resident, counted
    in reading order, first exceed ``budget`` bytes."""
    left = budget
    for i, f in enumerate(files):
        size = f.size
        fd = _reopen(f)
        if fd is None:  # replaced: the read pass skips it
            continue
        try:
            pages = list(cache.iter_residency(fd, size))
        finally:
            os.close(fd)
        for off, res in pages:
            missing = ~res
            # bytes of each missing page inside the file
            cost = missing.astype(np.int64) * PAGE_SIZE
            last_end = off + len(res) * PAGE_SIZE
            if last_end > size and missing[-1]:
                cost[-1] -= last_end - size
            csum = np.cumsum(cost)
            if csum.size and int(csum[-1]) > left:
                k = int(np.searchsorted(csum, left, side="right"))
                return i, off + k * PAGE_SIZE
            left -= int(csum[-1]) if csum.size else 0
    return len(files), 0


def _plan_linear(sizes: list[int], budget: int) -> tuple[int, int]:
    left = budget
    for i, s in enumerate(sizes):
        if s > left:
            return i, left - left % PAGE_SIZE
        left -= s
    return len(sizes), 0


class WarmHandle:
    """A :func:`warm` pass running in a background thread.

    Attributes
    ----------
    done : bool
        The thread finished (successfully or not).
    report : WarmReport or None
        The result, once done without error.
    error : BaseException or None
        The exception the pass raised, if any.
    """

    def __init__(self, paths: Any, kwargs: dict[str, Any]) -> None:
        self._stop = kwargs.pop("stop_event", None) or threading.Event()
        self.report: WarmReport | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(paths, kwargs), name="mmstore-warm",
            daemon=True)
        self._thread.start()

    def _run(self, paths: Any, kwargs: dict[str, Any]) -> None:
        try:
            self.report = warm(paths, stop_event=self._stop, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ask the pass to stop after the current chunk."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> WarmReport | None:
        """Wait for the pass; return its report (None if ``timeout`` ran
        out first); re-raise the exception if the pass failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self.error is not None:
            raise self.error
        return self.report


def warm_in_background(paths: PathLike | Iterable[PathLike],
                       **kwargs: Any) -> WarmHandle:
    """Start :func:`warm` in a daemon thread and return a :class:`WarmHandle`.

    Takes :func:`warm`'s keyword arguments. ``preadv`` releases the GIL, so
    the pass costs the caller little CPU time. ``paths`` is materialized
    before the thread starts. ``handle.stop()`` ends the pass early.
    """
    if not isinstance(paths, (str, bytes, os.PathLike)):
        paths = list(paths)
    return WarmHandle(paths, dict(kwargs))
