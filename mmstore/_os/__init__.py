"""Operating-system layer: positional reads, page cache, memory and disk facts (stdlib + numpy only).

Everything here works on plain paths and file descriptors; nothing knows about
stores. The package imports only the standard library and numpy (``ctypes``
is loaded on first use).

Modules, by concern
-------------------
``io``       the write side: atomic writes, fsync, preallocation, checksums, and what a
             failed write means (every write of a store goes through it).
``safecopy`` ``preadv`` of a batch's entries into the caller's rows (reads that cannot fault).
``lock``     the writer lock of a destination (``flock``).
``memplan``  the memory a process may fill and how a loader splits it.
``runs``     runs of consecutive records (one read or copy per run).
``stderr``   capture of fd 2 around a C library's warnings.
``crash``    fault injection for the crash tests (armed by an environment variable).
``pread``    the hot read path: :func:`pread_records` / :func:`pread_records_multi`
             (one ``preadv`` per run of consecutive records), :class:`TruncatedReadError`.
``cache``    the page cache: residency (:func:`resident_bytes`, ``mmap(2)`` +
             ``mincore(2)`` in 1 GiB windows, as ``vmtouch`` does), eviction
             (:func:`evict`, :func:`evict_range`: ``POSIX_FADV_DONTNEED``) and hints
             (:func:`advise`, :func:`fadvise_random`, :func:`fadvise_sequential`).
``warmup``   :func:`warm`: one sequential ``preadv`` pass into one reusable buffer, with
             ``POSIX_FADV_SEQUENTIAL`` for the file and the kernel's readahead ahead of the
             reads (NOTE [sequential pages]).
``memory``   :func:`mem_available` (``/proc/meminfo``), :func:`memory_limit` and
             :func:`effective_available` (cgroup v2 ``memory.max``/``memory.current``, v1
             ``memory.limit_in_bytes``/``memory.usage_in_bytes``, every ancestor up to the
             mount root, because limits are hierarchical).
``disk``     :func:`disk_info`: filesystem, block device, rotational, network/tmpfs.
``speed``    :func:`seq_read_speed`, :func:`random_read_speed` (``doctor``'s probes).
``proc``, ``files``  parsers of /proc and /sys files; shared constants and fd helpers.
``threads`` daemon threads that a Ctrl-C walks away from (requests to object storage).

Eviction drops only *clean* pages: pages still dirty stay unless ``sync=True``
writes them back first; pages of tmpfs/ramfs/shm files cannot be dropped at all
(the page cache *is* their storage).

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
                              :func:`fadvise_random`, :func:`fadvise_sequential`
skips a step                  :func:`warm` reads without hints, and without the
                              fit check when no memory figure is available
                              (``WarmReport.available is None``)
=========================== ==================================================

Thread safety: every function is safe to call from several threads; the reads
(``os.preadv``) release the GIL, so threads give real I/O concurrency.
"""

from __future__ import annotations

from .cache import (
    advise,
    evict,
    evict_range,
    fadvise_random,
    fadvise_sequential,
    missing_ranges,
    resident_bytes,
    resident_fd,
)
from .disk import disk_info
from .files import PAGE_SIZE, GiB, MiB, PathLike
from .memory import effective_available, mem_available, memory_limit
from .pread import TruncatedReadError, pread_records, pread_records_multi, raise_open_files_limit
from .proc import usable_cores
from .speed import ReadSpeed, random_read_speed, seq_read_speed
from .warmup import WarmHandle, WarmReport, warm, warm_in_background

__all__ = [
    "GiB",
    "MiB",
    "PAGE_SIZE",
    "PathLike",
    "ReadSpeed",
    "TruncatedReadError",
    "WarmHandle",
    "WarmReport",
    "advise",
    "disk_info",
    "effective_available",
    "evict",
    "evict_range",
    "fadvise_random",
    "fadvise_sequential",
    "mem_available",
    "memory_limit",
    "missing_ranges",
    "pread_records",
    "pread_records_multi",
    "raise_open_files_limit",
    "random_read_speed",
    "resident_bytes",
    "resident_fd",
    "seq_read_speed",
    "usable_cores",
    "warm",
    "warm_in_background",
]
