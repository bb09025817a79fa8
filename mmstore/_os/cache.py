"""The page cache: residency (``mincore``), eviction (``DONTNEED``) and access hints (``posix_fadvise``)."""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .files import HAS_FADVISE, PAGE_SIZE, GiB, MiB, PathLike, fileno, open_ro

__all__ = [
    "advise", "evict", "evict_range", "fadvise_random", "fadvise_sequential", "iter_residency", "missing_ranges",
    "resident_bytes", "resident_fd",
]

# mincore() is asked about one window of this many bytes at a time, so a 1 TB
# file needs neither a 1 TB mapping nor a 256 MB result vector.
_MINCORE_WINDOW = 1 * GiB


class _Calls(NamedTuple):
    """The C library's calls a residency query makes, their prototypes set."""

    mmap: Callable[..., Any]  # mmap64 where the C library has it (offsets past 2 GiB on 32-bit)
    mincore: Callable[..., int]
    munmap: Callable[..., int]


_libc_lock = threading.Lock()
_libc_cache: list[_Calls | None] = []


def _libc() -> _Calls:
    """The C library's mmap/mincore/munmap, or raise NotImplementedError
    where there are none (Windows)."""
    if not _libc_cache:
        with _libc_lock:
            if not _libc_cache:
                _libc_cache.append(_load_libc())
    calls = _libc_cache[0]
    if calls is None:
        raise NotImplementedError(
            f"page-cache residency needs mmap(2)/mincore(2), which this "
            f"platform ({sys.platform}) does not provide")
    return calls


def _load_libc() -> _Calls | None:
    try:
        import ctypes
        import ctypes.util

        if os.name != "posix":
            return None
        lib: ctypes.CDLL | None
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mincore  # noqa: B018 - probe the symbol
        except (OSError, AttributeError):
            name = ctypes.util.find_library("c")
            lib = ctypes.CDLL(name, use_errno=True) if name else None
        if lib is None:
            return None
        mm = getattr(lib, "mmap64", None) or lib.mmap
        mm.restype = ctypes.c_void_p
        mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        lib.mincore.restype = ctypes.c_int
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return _Calls(mm, lib.mincore, lib.munmap)
    except Exception:  # pragma: no cover - exotic platforms
        return None


def _mincore_pages(fd: int, offset: int, length: int) -> np.ndarray:
    """Residency of the pages covering ``[offset, offset+length)`` of ``fd``:
    one bool per page, page 0 being the page that holds ``offset`` rounded
    down. ``length`` must be > 0 and the range inside the file."""
    import ctypes

    lib = _libc()
    start = offset - offset % PAGE_SIZE
    maplen = offset + length - start
    npages = -(-maplen // PAGE_SIZE)
    vec = np.zeros(npages, dtype=np.uint8)
    addr = lib.mmap(None, maplen, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        e = ctypes.get_errno()
        raise OSError(e, f"mmap for mincore failed: {os.strerror(e)}")
    try:
        if lib.mincore(addr, maplen, vec.ctypes.data) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mincore failed: {os.strerror(e)}")
    finally:
        lib.munmap(addr, maplen)
    return (vec & 1).astype(bool)


def iter_residency(fd: int, size: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(page_offset, resident_bool_array)`` for page-aligned windows
    covering ``[start, size)``; ``start`` must be page aligned."""
    off = start
    while off < size:
        n = min(_MINCORE_WINDOW, size - off)
        yield off, _mincore_pages(fd, off, n)
        off += n


def resident_fd(fd: int, size: int, offset: int = 0, length: int | None = None) -> int:
    """Resident bytes of ``[offset, offset+length)`` of an open file of
    ``size`` bytes (the range clipped to ``size``), counting partial
    first/last pages by the bytes they hold in range.

    Raises OSError (mapping failed) or NotImplementedError (no mincore)."""
    end = size if length is None else min(size, offset + length)
    if end <= offset:
        return 0
    total = 0
    pos = offset
    while pos < end:
        n = min(_MINCORE_WINDOW, end - pos)
        res = _mincore_pages(fd, pos, n)
        first_page = pos - pos % PAGE_SIZE
        count = int(np.count_nonzero(res)) * PAGE_SIZE
        # trim the parts of the first and last page outside [pos, pos+n)
        if res[0]:
            count -= pos - first_page
        tail = first_page + len(res) * PAGE_SIZE - (pos + n)
        if res[-1]:
            count -= tail
        total += count
        pos += n
    return total


def missing_ranges(fd: int, offset: int, length: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the runs of ``[offset, offset+length)`` of an
    open file whose pages are not in the page cache (pages being read count
    as present), clipped to the range; ``[]`` when all are present or
    residency cannot be checked (no ``mincore``, a failed mapping)."""
    if length <= 0:
        return []
    try:
        res = _mincore_pages(fd, offset, length)
    except (OSError, NotImplementedError, ValueError):
        return []
    if res.all():
        return []
    base = offset - offset % PAGE_SIZE
    miss = np.flatnonzero(~res)
    cut = np.flatnonzero(np.diff(miss) > 1) + 1
    out = []
    for run in np.split(miss, cut):
        a = max(offset, base + int(run[0]) * PAGE_SIZE)
        b = min(offset + length, base + (int(run[-1]) + 1) * PAGE_SIZE)
        if b > a:
            out.append((a, b - a))
    return out


def resident_bytes(path: PathLike) -> tuple[int, int]:
    """How much of a file is in the page cache.

    Parameters
    ----------
    path : str or os.PathLike
        A regular file.

    Returns
    -------
    (resident, size) : tuple of int
        Bytes of the file currently in the page cache, and the file size. The
        last partial page counts only the bytes inside the file, so
        ``resident <= size`` always. A zero-length file gives ``(0, 0)``.

    Raises
    ------
    OSError
        The file cannot be opened or mapped.
    NotImplementedError
        The platform has no ``mincore(2)`` (Windows).

    Notes
    -----
    The file is mapped read-only, 1 GiB at a time, and ``mincore(2)`` reports
    one bit per page; mapping does not read anything. The figure is a
    snapshot: other processes and memory pressure change it at any time.
    """
    fd = open_ro(path)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return (0, 0)
        return (resident_fd(fd, size), size)
    finally:
        os.close(fd)


def evict(path: PathLike, *, sync: bool = False) -> None:
    """Ask the kernel to drop a file's pages from the page cache.

    Parameters
    ----------
    path : str or os.PathLike
        A regular file.
    sync : bool, default False
        ``fdatasync`` the file first, so pages still dirty from a recent write
        are clean and can be dropped. Without it, ``POSIX_FADV_DONTNEED`` only
        starts writeback of dirty pages and leaves them resident.

    Raises
    ------
    OSError
        The file cannot be opened.
    NotImplementedError
        The platform has no ``posix_fadvise`` (macOS, Windows).

    Notes
    -----
    A hint, not a guarantee: dirty pages (see ``sync``), pages locked or mapped
    by another process, and any page of a tmpfs/ramfs/shm file stay resident.
    Check with :func:`resident_bytes` if it matters.
    """
    if not HAS_FADVISE:
        raise NotImplementedError(
            f"evicting from the page cache needs posix_fadvise, which this "
            f"platform ({sys.platform}) does not provide")
    fd = open_ro(path)
    try:
        if sync:
            getattr(os, "fdatasync", os.fsync)(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_range(fd: int, offset: int, length: int, size: int | None = None) -> bool:
    """Evict ``[offset, offset+length)`` of an open file, widening the range as needed.

    DONTNEED skips pages only partly inside the range and, on kernels with
    large page-cache folios, whole folios that straddle its ends. So widen to
    whole pages, and if ``size`` (the file size) is given and something is
    still resident, to 64 KiB and then 2 MiB (the largest folio) bounds.

    Returns False when ``size`` was given and part of the range is still
    resident after the widest try (tmpfs, dirty or locked pages); True
    otherwise (including when residency cannot be measured). A no-op
    returning True where ``posix_fadvise`` does not exist.
    """
    if not HAS_FADVISE:
        return True
    for align in (PAGE_SIZE, 64 << 10, 2 * MiB):
        a = offset - offset % align
        b = -(-(offset + length) // align) * align
        os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        if size is None:
            return True
        try:
            if resident_fd(fd, size, offset, length) == 0:
                return True
        except (OSError, NotImplementedError):
            return True
    return False


_ADVICE_NAMES = ("normal", "random", "sequential", "willneed", "dontneed")


def advise(target: Any, offset: int, length: int | None, advice: str | int) -> bool:
    """Give the kernel an access-pattern hint (``posix_fadvise``) for an open file.

    Parameters
    ----------
    target : int or file object
        A file descriptor, or anything with ``fileno()``.
    offset, length : int
        Byte range; ``length`` 0 or None means "to the end".
    advice : str or int
        ``"normal"``, ``"random"``, ``"sequential"``, ``"willneed"``,
        ``"dontneed"``, or a platform constant.

    Returns
    -------
    bool
        True if the hint was given, False where the platform lacks the call or
        the constant (a no-op).

    Raises
    ------
    ValueError
        Unknown advice name.
    TypeError
        ``target`` is neither an int nor has ``fileno()``.
    OSError
        The kernel refused the call (a closed fd).
    """
    fd = fileno(target)
    if isinstance(advice, int):
        const: int | None = advice
    elif advice in _ADVICE_NAMES:
        const = getattr(os, "POSIX_FADV_" + advice.upper(), None)
    else:
        raise ValueError(f"unknown advice {advice!r}; expected one of "
                         f"{', '.join(_ADVICE_NAMES)} or an int constant")
    if const is None or not HAS_FADVISE:
        return False
    os.posix_fadvise(fd, int(offset), int(length or 0), const)
    return True


def fadvise_random(fd: Any) -> bool:
    """``POSIX_FADV_RANDOM`` on the whole file: no readahead on this open file
    (for shuffled record reads). Returns False where unsupported (no-op)."""
    return advise(fd, 0, 0, "random")


def fadvise_sequential(fd: Any) -> bool:
    """``POSIX_FADV_SEQUENTIAL`` on the whole file: larger readahead on this
    open file. Returns False where unsupported (no-op)."""
    return advise(fd, 0, 0, "sequential")
