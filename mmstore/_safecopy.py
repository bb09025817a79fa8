"""Copies out of a memory mapping that cannot kill the process.

NOTE [truncated under a mapping] (backends/memmap.py): touching a mapped page
that lies past the end of its file (the file was truncated after it was
mapped) raises SIGBUS, which no Python code can catch: the training process
dies. A size check before each batch narrows that to a race with the copy
that follows it; this module closes it for the copies that take long enough
to race (entries of ``SAFE_COPY_MIN_BYTES`` and more: images, not labels).

``process_vm_readv(2)`` aimed at our own process copies between two address
ranges in the kernel: a page it cannot fault in ends the copy early (a short
count, or ``EFAULT``) instead of sending SIGBUS. It takes up to ``IOV_MAX``
(1024) entries per call and, as a ctypes foreign call, releases the GIL, so
one call gathers a whole batch: measured on this project's 2-core VM it is
as fast as one ``memmove`` per entry from 2 KiB up (0.6-1.0x the time; 256
random 12 KiB entries: 0.65 ms against 1.0 ms) and slower below (256
8-byte labels: 130 us against numpy ``take``'s 8 us), hence the threshold.

Where the call is refused (not Linux, or a seccomp profile without it:
``ENOSYS``/``EPERM``) the copy falls back to ``memmove`` once and for all:
then only the size check before each batch guards the mapping.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np

from ._runs import SMALL_RECORD_BYTES

__all__ = ["MappingFault", "SAFE_COPY_MIN_BYTES", "copy_entries", "safe_copy_available"]

# Entries at least this big are copied with process_vm_readv (see above):
# the one threshold between small and big records.
SAFE_COPY_MIN_BYTES = SMALL_RECORD_BYTES
_IOV_MAX = 1024


class MappingFault(Exception):
    """Part of a source range could not be read (a page past the end of a
    truncated file). Internal: callers turn it into ``StoreChangedError``
    naming the file. ``entry`` is the index of the first entry not copied."""

    def __init__(self, entry: int) -> None:
        super().__init__(f"entry {entry} could not be copied out of the mapping")
        self.entry = entry


def _load() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()
_usable: bool | None = None  # None: not tried yet


def safe_copy_available() -> bool:
    """Whether copies here are SIGBUS-proof (tries the call once)."""
    if _usable is None:
        src = np.arange(16, dtype=np.uint8)
        dst = np.zeros(16, np.uint8)
        copy_entries(np.array([dst.ctypes.data], np.int64), np.array([src.ctypes.data], np.int64), 16)
    return bool(_usable)


def copy_entries(dst_addr: np.ndarray, src_addr: np.ndarray, nbytes: int) -> None:
    """Copy ``nbytes`` from each address in ``src_addr`` (inside a mapping) to
    the matching address in ``dst_addr`` (memory we own).

    Raises
    ------
    MappingFault
        A source page could not be read: nothing past ``entry`` was copied
        (entries before it were).
    """
    global _usable
    n = len(src_addr)
    if n == 0:
        return
    if _usable is not False and _readv is not None:
        local = np.empty((n, 2), np.uint64)
        remote = np.empty((n, 2), np.uint64)
        local[:, 0] = dst_addr
        remote[:, 0] = src_addr
        local[:, 1] = nbytes
        remote[:, 1] = nbytes
        la, ra = local.ctypes.data, remote.ctypes.data
        pid = os.getpid()
        for j in range(0, n, _IOV_MAX):
            k = min(_IOV_MAX, n - j)
            got = _readv(pid, la + 16 * j, k, ra + 16 * j, k, 0)
            if got == k * nbytes:
                _usable = True
                continue
            err = ctypes.get_errno() if got < 0 else 0
            if got < 0 and err in (errno.ENOSYS, errno.EPERM) and not _usable:
                _usable = False  # refused here (seccomp, an old kernel): memmove from now on
                break
            done = max(got, 0) // nbytes
            raise MappingFault(j + done)
        else:
            return
    move = ctypes.memmove
    for d, s in zip(dst_addr.tolist(), src_addr.tolist()):
        move(d, s, nbytes)
