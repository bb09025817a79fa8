"""Sparse files and byte-range locks: what a cache filled block by block needs.

* :func:`punch_hole` gives a file's blocks back to the file system while the
  file keeps its size (``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``):
  the hole reads as zeros and takes no disk space.
* :func:`lock_range` / :func:`unlock_range` are open-file-description locks
  (``F_OFD_SETLK``/``F_OFD_SETLKW``) on a byte range. Unlike classic POSIX
  ``fcntl`` locks they belong to the open file, not to the process: two
  descriptors opened separately conflict even inside one process (so threads
  can lock against each other), a lock is never dropped by closing some other
  descriptor of the file, and the kernel drops them when the holder dies.
  Converting a held exclusive lock to shared over the same range is one
  atomic call.
* :func:`boot_id`: the kernel's id of this boot. Pages written but not yet on
  the disk survive a killed process (they are in the page cache) but not a
  power loss; a cache that records the boot it was written in knows when its
  "present" marks may name blocks whose bytes never reached the disk.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import threading
from typing import Any

__all__ = ["boot_id", "lock_range", "punch_hole", "unlock_range"]

_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
# struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (0 for OFD locks), padded to 32 bytes
_FLOCK = struct.Struct("@hhqqi4x")

_libc_lock = threading.Lock()
_libc: list[Any] = []


def _fallocate() -> Any:
    with _libc_lock:
        if not _libc:
            fn = None
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                fn = lib.fallocate64 if hasattr(lib, "fallocate64") else lib.fallocate
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            except (OSError, AttributeError):
                fn = None
            _libc.append(fn)
    return _libc[0]


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``[offset, offset + length)`` of ``fd`` (it then reads as
    zeros; the size is kept). False where the file system cannot punch holes
    (the caller then writes zeros or keeps the bytes)."""
    if length <= 0:
        return True
    fn = _fallocate()
    if fn is None:
        return False
    if fn(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"cannot give back {length} bytes at {offset}: {os.strerror(err)}")


def lock_range(fd: int, start: int, length: int, *, shared: bool, wait: bool) -> bool:
    """Lock bytes ``[start, start + length)`` of ``fd`` (an OFD lock).

    ``wait``: block until it is granted (True), else return False at once
    when another open file holds a conflicting lock. Re-locking a range this
    descriptor holds converts it (exclusive -> shared is atomic)."""
    arg = _FLOCK.pack(fcntl.F_RDLCK if shared else fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    while True:
        try:
            fcntl.fcntl(fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, arg)
            return True
        except InterruptedError:
            continue
        except OSError as exc:
            if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise


def unlock_range(fd: int, start: int, length: int) -> None:
    """Drop this descriptor's locks on ``[start, start + length)``."""
    fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), or "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""
