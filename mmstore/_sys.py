"""Page cache and kernel hints: the low-level half of ``warm``, ``evict``,
``inspect``'s residency figure and ``doctor``.

Everything here works on plain paths and file descriptors; nothing knows about
stores. The module imports only the standard library and numpy (``ctypes`` and
``concurrent.futures`` are loaded on first use).

What each function measures, and how
------------------------------------
- Residency (:func:`resident_bytes`) maps the file in windows of 1 GiB with
  ``mmap(2)`` through ctypes and asks ``mincore(2)`` which pages are in the page
  cache, as ``vmtouch`` does. Mapping does not fault anything in and does not
  change residency.
- Eviction (:func:`evict`) is ``posix_fadvise(POSIX_FADV_DONTNEED)``. The
  kernel drops only *clean*, unmapped-or-unlocked pages: pages still dirty
  (written, not yet on disk) stay unless ``sync=True`` writes them back first;
  pages of tmpfs/ramfs/shm files cannot be dropped at all (the page cache *is*
  their storage).
- Warming (:func:`warm`) is one sequential ``preadv`` pass into one reusable
  buffer, with ``POSIX_FADV_SEQUENTIAL`` for the file and
  ``POSIX_FADV_WILLNEED`` one chunk ahead of the reader (not for the whole
  file: on a file larger than memory that would read the file end to end
  before the first byte is copied, past the point where the cache is full).
- Memory figures come from ``/proc/meminfo`` and the process's cgroup (v2
  ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
  ``memory.usage_in_bytes``, every ancestor up to the mount root, because
  limits are hierarchical).

Platforms
---------
Linux is the target. Elsewhere the functions degrade as follows, and say so in
their docstrings:

=========================== ==================================================
raises ``NotImplementedError`` :func:`resident_bytes` (no ``mincore``, i.e.
                              Windows), :func:`evict` (no ``posix_fadvise``,
                              e.g. macOS, Windows), :func:`pread_records` only
                              where neither ``os.preadv`` nor ``os.pread``
                              exists (Windows)
returns ``None``              :func:`mem_available`, :func:`memory_limit`,
                              :func:`effective_available` (no ``/proc`` or
                              no cgroup), ``disk_info`` keys it cannot fill
returns ``False`` (no-op)     the hint helpers :func:`advise`,
                              :func:`fadvise_random`, :func:`fadvise_willneed`,
                              :func:`fadvise_sequential`, :func:`madvise`
skips a step                  :func:`warm` reads without hints, and without the
                              fit check when no memory figure is available
                              (``WarmReport.available is None``)
=========================== ==================================================

Thread safety: every function is safe to call from several threads; the reads
(``os.preadv``) release the GIL, so threads give real I/O concurrency.
"""

from __future__ import annotations

import errno
import mmap as _mmap
import os
import stat as _stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

__all__ = [
    "ReadSpeed",
    "TruncatedReadError",
    "WarmHandle",
    "WarmReport",
    "advise",
    "disk_info",
    "effective_available",
    "evict",
    "fadvise_random",
    "fadvise_sequential",
    "fadvise_willneed",
    "madvise",
    "mem_available",
    "mem_total",
    "memory_limit",
    "pread_records",
    "pread_records_multi",
    "pread_records_threaded",
    "raise_open_files_limit",
    "random_read_speed",
    "resident_bytes",
    "seq_read_speed",
    "warm",
    "warm_in_background",
]

PathLike = Union[str, "os.PathLike[str]"]

MiB = 1 << 20
GiB = 1 << 30
PAGE_SIZE: int = (
    os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else _mmap.PAGESIZE
)
# mincore() is asked about one window of this many bytes at a time, so a 1 TB
# file needs neither a 1 TB mapping nor a 256 MB result vector.
_MINCORE_WINDOW = 1 * GiB
# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX * page size (~2**63); v2
# writes "max". Anything at or above this is treated as "no limit".
_NO_LIMIT = 1 << 62

_HAS_PREADV = hasattr(os, "preadv")
_HAS_PREAD = hasattr(os, "pread")
_HAS_FADVISE = hasattr(os, "posix_fadvise")


class TruncatedReadError(OSError, EOFError):
    """A read hit end of file before the requested bytes were all there.

    An :class:`OSError` (``errno.EIO``, ``filename`` set) and an
    :class:`EOFError`. Attributes: ``offset`` (file offset of the read that
    came up short), ``expected`` and ``received`` (bytes), ``file_size``
    (``None`` if unknown).
    """

    def __init__(self, filename: str, offset: int, expected: int,
                 received: int, file_size: int | None) -> None:
        size = "unknown" if file_size is None else f"{file_size:,}"
        msg = (f"expected {expected:,} bytes at file offset {offset:,} but got "
               f"only {received:,} before end of file (file size {size}); "
               f"file truncated?")
        super().__init__(errno.EIO, msg, filename)
        self.offset = offset
        self.expected = expected
        self.received = received
        self.file_size = file_size


# --------------------------------------------------------------------------
# ctypes: mmap / mincore / munmap
# --------------------------------------------------------------------------

_libc_lock = threading.Lock()
_libc_cache: list[Any] = []


def _libc() -> Any:
    """The C library with mmap/mincore/munmap prototypes set, or raise
    NotImplementedError where there is none (Windows)."""
    if _libc_cache:
        if _libc_cache[0] is None:
            raise NotImplementedError(
                f"page-cache residency needs mmap(2)/mincore(2), which this "
                f"platform ({sys.platform}) does not provide")
        return _libc_cache[0]
    with _libc_lock:
        if not _libc_cache:
            lib = None
            try:
                import ctypes
                import ctypes.util

                if os.name == "posix":
                    try:
                        lib = ctypes.CDLL(None, use_errno=True)
                        lib.mincore  # noqa: B018 - probe the symbol
                    except (OSError, AttributeError):
                        name = ctypes.util.find_library("c")
                        lib = ctypes.CDLL(name, use_errno=True) if name else None
                if lib is not None:
                    mm = getattr(lib, "mmap64", None) or lib.mmap
                    mm.restype = ctypes.c_void_p
                    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_int64]
                    lib.mincore.restype = ctypes.c_int
                    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_void_p]
                    lib.munmap.restype = ctypes.c_int
                    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                    lib._mm_mmap = mm
            except Exception:  # pragma: no cover - exotic platforms
                lib = None
            _libc_cache.append(lib)
    return _libc()


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
    addr = lib._mm_mmap(None, maplen, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, start)
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


def _iter_residency(fd: int, size: int, start: int = 0,
                    window: int = _MINCORE_WINDOW):
    """Yield ``(page_offset, resident_bool_array)`` for page-aligned windows
    covering ``[start, size)``; ``start`` must be page aligned."""
    off = start
    while off < size:
        n = min(window, size - off)
        yield off, _mincore_pages(fd, off, n)
        off += n


def _resident_fd(fd: int, size: int, offset: int = 0,
                 length: int | None = None) -> int:
    """Resident bytes of ``[offset, offset+length)`` (clipped to ``size``),
    counting partial first/last pages by the bytes they hold in range."""
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


def _fileno(fd: Any) -> int:
    if isinstance(fd, int):
        return fd
    if hasattr(fd, "fileno"):
        return fd.fileno()
    raise TypeError(f"expected a file descriptor or an object with fileno(), "
                    f"got {type(fd).__name__}")


def _fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


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
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return (0, 0)
        return (_resident_fd(fd, size), size)
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
    if not _HAS_FADVISE:
        raise NotImplementedError(
            f"evicting from the page cache needs posix_fadvise, which this "
            f"platform ({sys.platform}) does not provide")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if sync:
            getattr(os, "fdatasync", os.fsync)(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# hints
# --------------------------------------------------------------------------

_ADVICE_NAMES = ("normal", "random", "sequential", "willneed", "dontneed")


def _fadvise_const(advice: str | int) -> int | None:
    if isinstance(advice, int):
        return advice
    if advice not in _ADVICE_NAMES:
        raise ValueError(f"unknown advice {advice!r}; expected one of "
                         f"{', '.join(_ADVICE_NAMES)} or an int constant")
    return getattr(os, "POSIX_FADV_" + advice.upper(), None)


def _madvise_const(advice: str | int) -> int | None:
    if isinstance(advice, int):
        return advice
    if advice not in _ADVICE_NAMES:
        raise ValueError(f"unknown advice {advice!r}; expected one of "
                         f"{', '.join(_ADVICE_NAMES)} or an int constant")
    return getattr(_mmap, "MADV_" + advice.upper(), None)


def _as_mmap(obj: Any) -> _mmap.mmap | None:
    if isinstance(obj, _mmap.mmap):
        return obj
    # numpy.memmap (also what numpy.load(..., mmap_mode=...) returns) keeps its
    # mapping in ``_mmap``; a view of one keeps it on ``.base``.
    while obj is not None:
        mm = getattr(obj, "_mmap", None)
        if isinstance(mm, _mmap.mmap):
            return mm
        obj = getattr(obj, "base", None)
    return None


def advise(target: Any, offset: int, length: int | None,
           advice: str | int) -> bool:
    """Give the kernel an access-pattern hint for a file or a mapping.

    Parameters
    ----------
    target : int, file object, mmap.mmap or numpy.memmap
        A file descriptor (or anything with ``fileno()``) gets
        ``posix_fadvise``; a mapping gets ``madvise``.
    offset, length : int
        Byte range; ``length`` 0 or None means "to the end". For a mapping,
        the range is widened to whole pages and is relative to the start of
        the mapping (for a numpy.memmap that is the start of the file's
        mapped region, not of the array).
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
    OSError
        The kernel refused the call (a closed fd, a range outside the mapping).
    """
    mm = _as_mmap(target)
    if mm is not None:
        return madvise(mm, advice, offset, length)
    fd = _fileno(target)
    const = _fadvise_const(advice)
    if const is None or not _HAS_FADVISE:
        return False
    os.posix_fadvise(fd, int(offset), int(length or 0), const)
    return True


def fadvise_random(fd: Any) -> bool:
    """``POSIX_FADV_RANDOM`` on the whole file: no readahead on this open file
    (for shuffled record reads). Returns False where unsupported (no-op)."""
    return advise(_fileno(fd), 0, 0, "random")


def fadvise_sequential(fd: Any) -> bool:
    """``POSIX_FADV_SEQUENTIAL`` on the whole file: larger readahead on this
    open file. Returns False where unsupported (no-op)."""
    return advise(_fileno(fd), 0, 0, "sequential")


def fadvise_willneed(fd: Any, offset: int = 0, length: int = 0) -> bool:
    """``POSIX_FADV_WILLNEED`` on ``[offset, offset+length)`` (``length`` 0 =
    to the end): start reading that range into the page cache now, without
    waiting. Returns False where unsupported (no-op)."""
    return advise(_fileno(fd), offset, length, "willneed")


def madvise(mm: Any, advice: str | int, offset: int = 0,
            length: int | None = None) -> bool:
    """``madvise`` on a Python mapping.

    Parameters
    ----------
    mm : mmap.mmap or numpy.memmap
    advice : str or int
        ``"random"`` (``MADV_RANDOM``: no readahead on page faults, for
        shuffled reads), ``"willneed"``, ``"sequential"``, ``"normal"``,
        ``"dontneed"``, or a constant from :mod:`mmap`.
    offset, length : int
        Byte range within the mapping, widened to whole pages; default all.

    Returns
    -------
    bool
        False (no-op) where ``mmap.madvise`` or the constant does not exist,
        or ``mm`` is not backed by an :class:`mmap.mmap`.
    """
    m = _as_mmap(mm)
    const = _madvise_const(advice)
    if m is None or const is None or not hasattr(m, "madvise"):
        return False
    size = len(m)
    if size == 0:
        return False
    start = int(offset) - int(offset) % _mmap.PAGESIZE
    end = size if not length else min(size, int(offset) + int(length))
    if end <= start:
        return False
    m.madvise(const, start, end - start)
    return True


# --------------------------------------------------------------------------
# memory figures
# --------------------------------------------------------------------------

def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    mult = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                    out[key.strip()] = int(parts[0]) * mult
    except OSError:
        pass
    return out


def mem_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, in bytes.

    The kernel's estimate of memory usable without swapping; it *includes*
    reclaimable page cache (so pages of a store already cached count as
    available). On kernels older than 3.14, ``MemFree + Buffers + Cached``.
    Returns None where ``/proc/meminfo`` does not exist (non-Linux). Ignores
    cgroup limits; see :func:`effective_available`.
    """
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    if "MemFree" in info:
        return info["MemFree"] + info.get("Buffers", 0) + info.get("Cached", 0)
    return None


def mem_total() -> int | None:
    """Physical memory in bytes (``MemTotal``, else ``sysconf``); None if
    neither is available."""
    info = _meminfo()
    if "MemTotal" in info:
        return info["MemTotal"]
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _unescape_mountinfo(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _parse_mountinfo(path: str = "/proc/self/mountinfo") -> list[dict[str, str]]:
    entries = []
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return entries
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        a = left.split()
        b = right.split()
        if len(a) < 5 or len(b) < 2:
            continue
        entries.append({
            "majmin": a[2],
            "root": _unescape_mountinfo(a[3]),
            "mount_point": _unescape_mountinfo(a[4]),
            "fs_type": b[0],
            "source": _unescape_mountinfo(b[1]),
            "super_options": b[2] if len(b) > 2 else "",
        })
    return entries


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat_key(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        pass
    return None


def _cgroup_levels(cgroup_file: str = "/proc/self/cgroup",
                   mountinfo_file: str = "/proc/self/mountinfo"
                   ) -> list[tuple[int, int | None, int]]:
    """``(limit, usage, reclaimable)`` for every cgroup level with a memory
    limit, from the process's cgroup up to the root of its mount (v2 and v1).
    ``usage`` may be None when unreadable; ``reclaimable`` is the level's
    inactive file cache (0 if unknown)."""
    try:
        with open(cgroup_file, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = _parse_mountinfo(mountinfo_file)
    levels: list[tuple[int, int | None, int]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, controllers, cpath = parts
        if controllers == "":
            version, mount = 2, next(
                (m for m in mounts if m["fs_type"] == "cgroup2"), None)
        elif "memory" in controllers.split(","):
            version, mount = 1, next(
                (m for m in mounts if m["fs_type"] == "cgroup"
                 and "memory" in m["super_options"].split(",")), None)
        else:
            continue
        if mount is None:
            continue
        mp, root = mount["mount_point"], mount["root"].rstrip("/")
        rel = cpath
        if root and (rel == root or rel.startswith(root + "/")):
            rel = rel[len(root):]
        leaf = os.path.normpath(mp + "/" + rel.lstrip("/"))
        if not os.path.isdir(leaf):
            # a path from outside this cgroup namespace: the mount itself
            # is the closest view of our cgroup we have
            leaf = mp
        names = (("memory.max", "memory.current", "inactive_file") if version == 2
                 else ("memory.limit_in_bytes", "memory.usage_in_bytes",
                       "total_inactive_file"))
        d = leaf
        while True:
            limit = _read_int(os.path.join(d, names[0]))
            if limit is not None and limit < _NO_LIMIT:
                usage = _read_int(os.path.join(d, names[1]))
                inactive = _read_stat_key(os.path.join(d, "memory.stat"), names[2])
                levels.append((limit, usage, inactive or 0))
            if version == 1 and d == leaf:
                # v1 with use_hierarchy also knows the effective limit
                h = _read_stat_key(os.path.join(d, "memory.stat"),
                                   "hierarchical_memory_limit")
                if h is not None and h < _NO_LIMIT and (
                        limit is None or h < limit):
                    usage = _read_int(os.path.join(d, names[1]))
                    inactive = _read_stat_key(os.path.join(d, "memory.stat"),
                                              names[2])
                    levels.append((h, usage, inactive or 0))
            if os.path.normpath(d) == os.path.normpath(mp):
                break
            parent = os.path.dirname(d)
            if parent == d or not parent.startswith(mp):
                break
            d = parent
    return levels


def memory_limit() -> int | None:
    """The memory limit of the process's cgroup, in bytes, or None.

    The smallest limit set on the process's cgroup or any ancestor visible in
    the container (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes`` /
    ``hierarchical_memory_limit``). None when no limit is set ("max", or v1's
    ~2**63 "unlimited"), or there is no cgroup filesystem (non-Linux). Never
    raises.
    """
    try:
        levels = _cgroup_levels()
    except Exception:
        return None
    return min((lim for lim, _, _ in levels), default=None)


def effective_available() -> int | None:
    """Memory this process can still fill with page cache, in bytes.

    ``min(MemAvailable, limit - working_set)`` over every limited cgroup level,
    where ``working_set = usage - inactive_file`` (the kubelet's definition:
    like MemAvailable, it treats inactive page cache as reclaimable). None if
    no figure is available (non-Linux). Never raises.
    """
    try:
        avail = mem_available()
        levels = _cgroup_levels()
    except Exception:
        return None
    for limit, usage, inactive in levels:
        room = limit - max(0, (usage or 0) - inactive)
        room = max(0, room)
        avail = room if avail is None else min(avail, room)
    return avail


# --------------------------------------------------------------------------
# positional reads
# --------------------------------------------------------------------------

def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """One positional read into ``buf``; returns bytes read (0 at EOF)."""
    if _HAS_PREADV:
        return os.preadv(fd, [buf], offset)
    if _HAS_PREAD:
        data = os.pread(fd, len(buf), offset)
        buf[:len(data)] = data
        return len(data)
    raise NotImplementedError(
        f"positional reads need os.preadv or os.pread, which this platform "
        f"({sys.platform}) does not provide")


def _read_full(fd: int, buf: memoryview, offset: int) -> None:
    total = len(buf)
    done = 0
    while done < total:
        got = _pread_into(fd, buf[done:], offset + done)
        if got == 0:
            try:
                size: int | None = os.fstat(fd).st_size
            except OSError:
                size = None
            raise TruncatedReadError(_fd_name(fd), offset, total, done, size)
        done += got


def _check_records(offsets: Any, nbytes: int, out: np.ndarray
                   ) -> tuple[np.ndarray, memoryview]:
    offs = np.asarray(offsets)
    if offs.ndim != 1:
        raise ValueError(f"offsets must be 1-D, got shape {offs.shape}")
    if offs.size and offs.dtype.kind not in "iu":
        raise TypeError(f"offsets must be integers, got dtype {offs.dtype}")
    offs = offs.astype(np.int64, copy=False)
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    n = len(offs)
    if out.nbytes != n * nbytes:
        raise ValueError(
            f"out holds {out.nbytes:,} bytes but {n} records of {nbytes:,} "
            f"bytes need {n * nbytes:,} (out.shape={out.shape}, "
            f"dtype={out.dtype})")
    if out.ndim >= 2 and out.shape[0] != n:
        raise ValueError(f"out has {out.shape[0]} rows, expected one per "
                         f"offset ({n})")
    if n and int(offs.min()) < 0:
        raise ValueError(f"negative offset {int(offs.min())}")
    flat = out.reshape(-1).view(np.uint8)
    return offs, memoryview(flat).cast("B")


def _runs(offs: np.ndarray, nbytes: int) -> tuple[list[int], list[int]]:
    """Start/end row indices of maximal runs whose offsets follow each other
    by exactly ``nbytes`` (so rows i..j-1 are one contiguous file range)."""
    n = len(offs)
    if n == 0:
        return [], []
    brk = np.flatnonzero(np.diff(offs) != nbytes) + 1
    starts = np.concatenate(([0], brk)).tolist()
    ends = np.concatenate((brk, [n])).tolist()
    return starts, ends


def _read_rows(fd: int | np.ndarray, offs: np.ndarray, nbytes: int, mv: memoryview,
               lo: int, hi: int) -> None:
    """Read records ``lo..hi-1`` into their rows of ``mv`` (``fd``: one file,
    or an array of one file descriptor per record)."""
    if isinstance(fd, np.ndarray):  # runs also end where the file changes
        part, o = fd[lo:hi], offs[lo:hi]
        brk = np.flatnonzero((np.diff(o) != nbytes) | (part[1:] != part[:-1])) + 1
        starts = np.concatenate(([0], brk)).tolist()
        ends = np.concatenate((brk, [hi - lo])).tolist()
        fdl = part.tolist()
    else:
        starts, ends = _runs(offs[lo:hi], nbytes)
        fdl = None
    offl = offs[lo:hi].tolist()
    for s, e in zip(starts, ends):
        try:
            _read_full(fd if fdl is None else fdl[s], mv[(lo + s) * nbytes:(lo + e) * nbytes], offl[s])
        except TruncatedReadError as err:
            if e - s == 1:
                raise
            # a merged run came up short: name the record that did
            k = err.received // nbytes
            raise TruncatedReadError(
                err.filename, err.offset + k * nbytes, nbytes,
                err.received - k * nbytes, err.file_size) from None


def pread_records(fd: Any, offsets: Any, nbytes: int, out: np.ndarray) -> None:
    """Read fixed-size records at arbitrary file offsets into rows of ``out``.

    Parameters
    ----------
    fd : int or file object
        Open for reading.
    offsets : array_like of int, shape (n,)
        Byte offset of each record in the file. Any order; duplicates allowed.
    nbytes : int
        Bytes per record.
    out : numpy.ndarray
        C-contiguous, writeable, exactly ``n * nbytes`` bytes: a ``(n, nbytes)``
        uint8 array, a flat uint8 array, or any array with ``n`` rows of
        ``nbytes`` bytes (e.g. ``(n, 224, 224, 3)`` uint8). Record ``i`` lands
        in row ``i``.

    Raises
    ------
    TruncatedReadError
        (an OSError and EOFError) a record extends past end of file; names the
        file, offset, expected and received bytes. Rows before it are filled,
        the rest are unspecified.
    ValueError, TypeError
        Bad ``out`` (size, contiguity, read-only) or offsets.

    Notes
    -----
    Consecutive rows whose offsets are consecutive records (``offsets[i+1] ==
    offsets[i] + nbytes``) are read with one ``preadv`` call, so a sorted
    batch of neighbouring records costs one syscall. Short reads are retried
    until the record is complete. The call releases the GIL while the kernel
    copies.
    """
    fd = _fileno(fd)
    offs, mv = _check_records(offsets, nbytes, out)
    _read_rows(fd, offs, int(nbytes), mv, 0, len(offs))


def raise_open_files_limit(need: int) -> int:
    """Make room for ``need`` more open files: raise the soft
    ``RLIMIT_NOFILE`` towards the hard limit when the files open now plus
    ``need`` (and a margin of 256) would exceed it. Returns the soft limit in
    effect afterwards (-1: unlimited or unknown). Never lowers a limit."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return -1
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    want = open_now + int(need) + 256
    if want > soft:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
    return int(soft)


def pread_records_multi(fds: Any, offsets: Any, nbytes: int, out: np.ndarray) -> None:
    """:func:`pread_records` with a file per record: record ``i`` is read from
    file descriptor ``fds[i]`` at ``offsets[i]`` into row ``i`` of ``out``.

    Runs of rows that are consecutive records of the same file are read with
    one ``preadv``, as in :func:`pread_records` (a segmented store's batch
    reads each segment's records straight into their rows, no staging copy).
    """
    offs, mv = _check_records(offsets, nbytes, out)
    fda = np.asarray(fds, dtype=np.int64).reshape(-1)
    if len(fda) != len(offs):
        raise ValueError(f"{len(fda)} file descriptors for {len(offs)} offsets")
    if len(offs):
        _read_rows(fda, offs, int(nbytes), mv, 0, len(offs))


def pread_records_threaded(fd: Any, offsets: Any, nbytes: int,
                           out: np.ndarray, pool: Any, *,
                           min_task_bytes: int = 1 * MiB,
                           tasks_per_thread: int = 2) -> None:
    """:func:`pread_records` with the rows split across threads.

    Parameters
    ----------
    fd, offsets, nbytes, out
        As for :func:`pread_records`.
    pool : concurrent.futures.Executor or int
        A thread pool to submit to (reuse one: creating threads costs more
        than a small batch), or a thread count for a pool made and shut down
        within this call.
    min_task_bytes : int, default 1 MiB
        Do not split the batch into pieces smaller than this; a small batch
        runs in the calling thread.
    tasks_per_thread : int, default 2
        Pieces per pool thread, for balance when some reads are slower.

    Notes
    -----
    Each piece is a contiguous range of rows, read with
    :func:`pread_records`'s run merging, so ``threads`` reads are in flight
    at once (queue depth). All pieces are waited for before returning, even
    when one fails, so no thread is still writing into ``out``; the first
    error is then raised.
    """
    fd = _fileno(fd)
    offs, mv = _check_records(offsets, nbytes, out)
    nbytes = int(nbytes)
    n = len(offs)
    if n == 0:
        return
    own_pool = None
    if isinstance(pool, int):
        if pool <= 1:
            _read_rows(fd, offs, nbytes, mv, 0, n)
            return
        from concurrent.futures import ThreadPoolExecutor

        own_pool = pool = ThreadPoolExecutor(pool, thread_name_prefix="mmstore-pread")
    try:
        workers = int(getattr(pool, "_max_workers", 0) or os.cpu_count() or 4)
        max_tasks = max(1, workers * max(1, tasks_per_thread))
        min_rows = max(1, -(-int(min_task_bytes) // nbytes))
        ntasks = max(1, min(max_tasks, n // min_rows))
        if ntasks == 1:
            _read_rows(fd, offs, nbytes, mv, 0, n)
            return
        bounds = np.linspace(0, n, ntasks + 1).astype(np.int64).tolist()
        from concurrent.futures import wait

        futs = [pool.submit(_read_rows, fd, offs, nbytes, mv, lo, hi)
                for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        wait(futs)
        for f in futs:
            exc = f.exception()
            if exc is not None:
                raise exc
    finally:
        if own_pool is not None:
            own_pool.shutdown(wait=True)


# --------------------------------------------------------------------------
# warm
# --------------------------------------------------------------------------

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


def _gib(n: int) -> str:
    """Human-readable byte count (binary units)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB),
                        ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _plan_stop(fds: list[int], sizes: list[int], budget: int
               ) -> tuple[int, int]:
    """The (file index, byte offset) where the pages not yet resident, counted
    in reading order, first exceed ``budget`` bytes."""
    left = budget
    for i, (fd, size) in enumerate(zip(fds, sizes)):
        for off, res in _iter_residency(fd, size):
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
    return len(fds), 0


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
    Hints: ``POSIX_FADV_SEQUENTIAL`` for each file, ``POSIX_FADV_WILLNEED``
    for the next chunk while the current one is copied (none past the stop
    point). The kernel's own readahead can still pull in up to one readahead
    window (typically 128 KiB - a few MiB) past the stop point. A file that
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

    fds: list[int] = []
    names: list[str] = []
    sizes: list[int] = []
    seen: set[tuple[int, int]] = set()
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                os.close(fd)
                continue
            seen.add(key)
            fds.append(fd)
            names.append(os.fsdecode(p))
            sizes.append(st.st_size if _stat.S_ISREG(st.st_mode) else 0)

        total = sum(sizes)
        try:
            resident = sum(_resident_fd(fd, s) for fd, s in zip(fds, sizes))
            measurable = True
        except (NotImplementedError, OSError):
            resident, measurable = 0, False
        available = effective_available() if max_fraction is not None else None
        report = WarmReport(paths=tuple(names), bytes_total=total,
                            bytes_planned=total, resident_before=resident,
                            available=available)

        # where to stop: (file index, offset); (len(fds), 0) = read everything
        stop_i, stop_off = len(fds), 0
        if available is not None and max_fraction is not None:
            capacity = int(max_fraction * available)
            budget = capacity - resident
            missing = total - resident
            if missing > max(0, budget):
                if measurable:
                    stop_i, stop_off = _plan_stop(fds, sizes, max(0, budget))
                else:
                    stop_i, stop_off = _plan_linear(sizes, max(0, budget))
            if stop_i < len(fds):
                planned = sum(sizes[:stop_i]) + stop_off
                report.bytes_planned = planned
                report.complete = False
                report.reason = (
                    f"files need {_gib(total)} of page cache ({_gib(missing)} "
                    f"not yet resident) but only {_gib(capacity)} may be used "
                    f"({max_fraction:g} of {_gib(available)} available); "
                    f"read the first {_gib(planned)} of {_gib(total)} "
                    f"({100 * planned / max(1, total):.0f}%)")

        buf = bytearray(chunk)
        mv = memoryview(buf)
        done = 0
        t0 = time.perf_counter()
        stopped = False
        for i, (fd, size) in enumerate(zip(fds, sizes)):
            if i > stop_i or (i == stop_i and stop_off == 0):
                break
            limit = stop_off if i == stop_i else size
            if limit <= 0:
                continue
            advise(fd, 0, 0, "sequential")
            off = 0
            while off < limit:
                if stop_event is not None and stop_event.is_set():
                    stopped = True
                    break
                n = min(chunk, limit - off)
                nxt = off + n
                if nxt < limit and _HAS_FADVISE:
                    os.posix_fadvise(fd, nxt, min(chunk, limit - nxt),
                                     os.POSIX_FADV_WILLNEED)
                got_total = 0
                while got_total < n:
                    got = _pread_into(fd, mv[got_total:n], off + got_total)
                    if got == 0:
                        break
                    got_total += got
                done += got_total
                off += got_total
                if progress is not None:
                    progress(done, report.bytes_planned)
                if got_total < n:  # file shrank
                    break
            if stopped:
                break
        report.seconds = time.perf_counter() - t0
        report.bytes_read = done
        if stopped:
            report.complete = False
            msg = (f"stopped by stop_event after {_gib(done)} of "
                   f"{_gib(report.bytes_planned)}")
            report.reason = msg if report.reason is None else (
                report.reason + "; " + msg)
        elif report.complete and done < total:
            report.complete = False
            report.reason = (f"read {done:,} of {total:,} bytes: files shrank "
                             f"during the pass")
        return report
    finally:
        for fd in fds:
            os.close(fd)


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


# --------------------------------------------------------------------------
# disk_info
# --------------------------------------------------------------------------

_NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph",
    "glusterfs", "beegfs", "afs", "panfs", "wekafs", "9p", "ncpfs", "davfs",
})
_MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "shm", "hugetlbfs"})


def _block_queue(majmin: str) -> tuple[str | None, str | None]:
    """(whole-disk name, its /sys queue dir) for a block device "maj:min"."""
    try:
        p = os.path.realpath(f"/sys/dev/block/{majmin}")
    except OSError:
        return None, None
    for d in (p, os.path.dirname(p)):  # a partition's queue is its parent's
        q = os.path.join(d, "queue")
        if os.path.isdir(q):
            return os.path.basename(d), q
    return (os.path.basename(p) if os.path.exists(p) else None), None


def disk_info(path: PathLike) -> dict[str, Any]:
    """Best-effort facts about the storage behind ``path``. Never raises.

    Parameters
    ----------
    path : str or os.PathLike
        A file or directory; if it does not exist, its nearest existing parent
        is described (where a store *would* go).

    Returns
    -------
    dict
        ``path`` (the existing path described), ``mount_point``, ``fs_type``,
        ``source`` (mount source, e.g. ``/dev/nvme0n1p2``), ``device`` (whole
        block device name, e.g. ``nvme0n1``), ``rotational`` (bool: HDD),
        ``read_ahead_kb``, ``tmpfs`` (memory-backed: tmpfs/ramfs/shm; pages
        cannot be evicted), ``network`` (nfs, cifs, lustre, gpfs, ceph, ...
        and any FUSE filesystem), ``fuse``, ``free_bytes`` (available to
        unprivileged users), ``total_bytes``. A key it cannot fill is None
        (on non-Linux, everything but the statvfs figures).
    """
    info: dict[str, Any] = dict.fromkeys((
        "path", "mount_point", "fs_type", "source", "device", "rotational",
        "read_ahead_kb", "tmpfs", "network", "fuse", "free_bytes",
        "total_bytes"))
    try:
        p = os.path.abspath(os.fsdecode(path))
        while not os.path.exists(p) and os.path.dirname(p) != p:
            p = os.path.dirname(p)
        p = os.path.realpath(p)
        info["path"] = p
    except Exception:
        return info
    try:
        sv = os.statvfs(p)
        info["free_bytes"] = sv.f_bavail * sv.f_frsize
        info["total_bytes"] = sv.f_blocks * sv.f_frsize
    except Exception:
        pass
    try:
        _fill_mount(info, p, depth=0)
    except Exception:
        pass
    return info


def _fill_mount(info: dict[str, Any], p: str, depth: int) -> None:
    mounts = _parse_mountinfo()
    if not mounts:
        return
    st_dev = os.stat(p).st_dev
    devstr = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    best, best_key = None, None
    for idx, m in enumerate(mounts):
        mp = m["mount_point"]
        if not (p == mp or p.startswith(mp.rstrip("/") + "/")):
            continue
        key = (len(mp), m["majmin"] == devstr, idx)
        if best_key is None or key > best_key:
            best, best_key = m, key
    if best is None:
        return
    fs = best["fs_type"]
    if depth == 0:
        info["mount_point"] = best["mount_point"]
        info["fs_type"] = fs
        info["source"] = best["source"]
        info["tmpfs"] = fs in _MEMORY_FS
        info["fuse"] = fs == "fuse" or fs.startswith("fuse.")
        info["network"] = (fs in _NETWORK_FS or fs.split(".")[0] in _NETWORK_FS
                           or bool(info["fuse"]))
    if info["tmpfs"] or info["network"]:
        return
    # the block device: from the mount's maj:min, else from the source node
    candidates = [best["majmin"]]
    src = best["source"]
    if src.startswith("/dev/"):
        try:
            rdev = os.stat(src).st_rdev
            candidates.append(f"{os.major(rdev)}:{os.minor(rdev)}")
        except OSError:
            pass
    for mm in candidates:
        if mm.startswith("0:"):
            continue  # anonymous device (overlay, btrfs subvolume, ...)
        name, q = _block_queue(mm)
        if name is None:
            continue
        info["device"] = name
        if q is not None:
            rot = _read_int(os.path.join(q, "rotational"))
            info["rotational"] = None if rot is None else bool(rot)
            info["read_ahead_kb"] = _read_int(os.path.join(q, "read_ahead_kb"))
        return
    # overlay: describe the upper directory's filesystem if it is visible
    if fs == "overlay" and depth == 0:
        for opt in best["super_options"].split(","):
            if opt.startswith("upperdir="):
                up = opt[len("upperdir="):]
                if os.path.isdir(up):
                    _fill_mount(info, os.path.realpath(up), depth=1)
                return


# --------------------------------------------------------------------------
# doctor micro-measurements
# --------------------------------------------------------------------------

@dataclass
class ReadSpeed:
    """One read-speed measurement.

    Attributes
    ----------
    kind : str
        ``"sequential"`` or ``"random"``.
    bytes : int
        Bytes read.
    ops : int
        Read calls timed (records for random reads, chunks for sequential).
    seconds : float
        Wall time of the timed reads.
    cold : bool
        Whether eviction of the sampled ranges was asked for first.
    resident_before : int or None
        Bytes of the sampled ranges still resident when timing started (after
        any eviction). Non-zero on a cold run means eviction did not work
        (tmpfs, dirty or locked pages) and the figure is a cache speed; None
        if it could not be measured.
    threads : int
        Concurrent readers (random reads only).
    """

    kind: str
    bytes: int = 0
    ops: int = 0
    seconds: float = 0.0
    cold: bool = False
    resident_before: int | None = None
    threads: int = 1

    @property
    def mb_per_s(self) -> float:
        """Rate in MB/s (10**6 bytes)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Mean time per op x threads, in ms (per-read latency seen by one
        reader)."""
        return 1e3 * self.seconds * self.threads / self.ops if self.ops else 0.0


def _drop_range(fd: int, offset: int, length: int, size: int | None = None
                ) -> None:
    """Evict ``[offset, offset+length)``, widening the range as needed.

    DONTNEED skips pages only partly inside the range and, on kernels with
    large page-cache folios, whole folios that straddle its ends. So widen to
    whole pages, and if ``size`` is given (residency checkable) and something
    is still resident, to 64 KiB and then 2 MiB (the largest folio) bounds.
    """
    for align in (PAGE_SIZE, 64 << 10, 2 * MiB):
        a = offset - offset % align
        b = -(-(offset + length) // align) * align
        os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        if size is None:
            return
        try:
            if _resident_fd(fd, size, offset, length) == 0:
                return
        except (OSError, NotImplementedError):
            return


def seq_read_speed(path: PathLike, max_bytes: int = 256 * MiB, *,
                   offset: int = 0, chunk_bytes: int = 4 * MiB,
                   cold: bool = True, max_seconds: float = 2.0) -> ReadSpeed:
    """Time one sequential read of up to ``max_bytes`` from ``offset``.

    Stops at ``max_bytes``, end of file, or after ``max_seconds``, whichever
    comes first. With ``cold=True`` the range is first evicted from the page
    cache (this drops it for everyone: a cached store gets slower until it is
    read again); where eviction is impossible (tmpfs, no posix_fadvise) the
    result says so through ``resident_before``.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        end = min(size, int(offset) + int(max_bytes))
        length = max(0, end - int(offset))
        if cold and length and _HAS_FADVISE:
            _drop_range(fd, int(offset), length, size)
        try:
            resident = _resident_fd(fd, size, int(offset), length) if length else 0
        except (OSError, NotImplementedError):
            resident = None
        if _HAS_FADVISE:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        chunk = max(PAGE_SIZE, int(chunk_bytes))
        mv = memoryview(bytearray(chunk))
        pos, ops = int(offset), 0
        t0 = time.perf_counter()
        deadline = t0 + max_seconds
        while pos < end:
            got = _pread_into(fd, mv[:min(chunk, end - pos)], pos)
            if got == 0:
                break
            pos += got
            ops += 1
            if time.perf_counter() > deadline:
                break
        dt = time.perf_counter() - t0
        return ReadSpeed("sequential", pos - int(offset), ops, dt, cold,
                         resident, 1)
    finally:
        os.close(fd)


def random_read_speed(path: PathLike, record_bytes: int, n: int = 256, *,
                      cold: bool = True, threads: int = 1, seed: int = 0,
                      max_seconds: float = 2.0) -> ReadSpeed:
    """Time ``n`` reads of ``record_bytes`` at random record-aligned offsets.

    Offsets are ``k * record_bytes`` for random distinct ``k`` (like shuffled
    record reads of a store field). ``POSIX_FADV_RANDOM`` is set on the
    reading descriptor so kernel readahead does not fetch neighbours. With
    ``cold=True`` each sampled range is evicted first, widened to whole pages
    (and, where the kernel keeps a large folio straddling the range, to 64 KiB
    or 2 MiB bounds): at most about ``n * (record_bytes + 2 MiB)`` bytes of the
    file leave the cache, the rest stays. ``threads > 1`` keeps that many reads in
    flight. Stops after ``max_seconds`` (counting only the reads done).

    Raises
    ------
    ValueError
        The file holds fewer than one record.
    """
    record_bytes = int(record_bytes)
    if record_bytes <= 0:
        raise ValueError(f"record_bytes must be > 0, got {record_bytes}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        nrec = size // record_bytes
        if nrec < 1:
            raise ValueError(f"{os.fsdecode(path)}: {size:,} bytes holds no "
                             f"record of {record_bytes:,} bytes")
        rng = np.random.default_rng(seed)
        n = int(min(n, nrec))
        ks = rng.choice(nrec, size=n, replace=False) if nrec > n else rng.permutation(nrec)
        offs = (ks.astype(np.int64) * record_bytes).tolist()
        if cold and _HAS_FADVISE:
            for o in offs:
                _drop_range(fd, o, record_bytes, size)
        try:
            resident: int | None = sum(
                _resident_fd(fd, size, o, record_bytes) for o in offs)
        except (OSError, NotImplementedError):
            resident = None
        if _HAS_FADVISE:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        threads = max(1, int(threads))
        counts = [0] * threads
        errors: list[BaseException] = []

        def worker(t: int, deadline: float) -> None:
            mv = memoryview(bytearray(record_bytes))
            try:
                for o in offs[t::threads]:
                    _read_full(fd, mv, o)
                    counts[t] += 1
                    if time.perf_counter() > deadline:
                        break
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        t0 = time.perf_counter()
        deadline = t0 + max_seconds
        if threads == 1:
            worker(0, deadline)
        else:
            ts = [threading.Thread(target=worker, args=(t, deadline))
                  for t in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        dt = time.perf_counter() - t0
        if errors:
            raise errors[0]
        ops = sum(counts)
        return ReadSpeed("random", ops * record_bytes, ops, dt, cold,
                         resident, threads)
    finally:
        os.close(fd)
