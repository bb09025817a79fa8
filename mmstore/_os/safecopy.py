"""Copies of store entries that cannot kill the process.

NOTE [truncated under a mapping] (backends/memmap.py): touching a mapped page
that lies past the end of its file (the file was truncated after it was
mapped) raises SIGBUS, which no Python code can catch: the training process
dies. A size check before each batch narrows that to a race with the copy
that follows it; the read paths close it for the copies that take long
enough to race (entries of ``SAFE_COPY_MIN_BYTES`` and more: images, not
labels) by not copying them out of a mapping at all:

* :func:`read_entries` (``Store.read_batch``; ``store[i]`` reads every fixed
  field the same way, ``MemmapBackend.item_reader``): ``os.preadv`` from a
  descriptor of the entry's file straight into the caller's rows. A kernel
  copy out of the page cache cannot fault: a file truncated under the reader
  gives a short read (a ``MappingFault`` here, a ``StoreChangedError`` for
  the caller). It releases the GIL, and a batch big enough is cut in parts
  read by a few threads at once (NOTE [parallel entry reads]).
* :func:`copy_entries`, for ranges of a mapping: ``process_vm_readv(2)``
  aimed at our own process copies between two address ranges in the kernel:
  a page it cannot fault in ends the copy early (a short count, or
  ``EFAULT``) instead of sending SIGBUS. It takes up to ``IOV_MAX`` (1024)
  entries per call and releases the GIL, but pins every source page, which
  made it slower than the ``preadv`` loop (the read paths no longer use it).

Where the call is refused (not Linux, or a seccomp profile without it:
``ENOSYS``/``EPERM``) the copy falls back to ``memmove`` once and for all:
then only the size check before each batch guards the mapping.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import usable_cores
from .runs import SMALL_RECORD_BYTES

if TYPE_CHECKING:  # the pool is made on the first split read: `import mmstore` starts no thread machinery
    from concurrent.futures import Future, ThreadPoolExecutor

__all__ = [
    "PARALLEL_MIN_BYTES", "SAFE_COPY_MIN_BYTES", "MappingFault", "copy_entries", "read_entries", "safe_copy_available",
]

# Entries at least this big are read without the mapping (see above): the one
# threshold between small and big records.
SAFE_COPY_MIN_BYTES = SMALL_RECORD_BYTES
_IOV_MAX = 1024


class MappingFault(Exception):
    """Part of a source range could not be read (a page past the end of a
    truncated file). Internal: callers turn it into ``StoreChangedError``
    naming the file. ``entry`` is the index of the first entry not copied."""

    def __init__(self, entry: int) -> None:
        super().__init__(f"entry {entry} could not be copied out of the mapping")
        self.entry = entry


def _load() -> Callable[..., int] | None:
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


# -- positional reads into the caller's rows -------------------------------------

# The reads below are a kernel copy per run of entries (``preadv``), which a
# batch's process_vm_readv copy was slower than; a memmove loop out of the
# mapping is faster but not SIGBUS-proof.
#
# NOTE [parallel entry reads]: a batch of big entries out of the page cache is
# a memory copy done by the kernel, one ``preadv`` per run of consecutive
# entries; on one thread it runs below the rate of the same rows copied from
# an in-RAM array (a user-space copy with wide registers), on two threads at
# about that rate (with the other core idle; with it busy the split gains
# nothing and costs little). So a read of
# at least PARALLEL_MIN_BYTES is cut in up to ``usable cores`` parts, all but
# one read by a small pool of this module's threads while the caller reads
# the last. Only one such read is split at a time: callers that already read
# concurrently (reader threads, each a part of a batch) get no extra threads.
PARALLEL_MIN_BYTES = 4 << 20
_MAX_PARTS = 4


class _Pool:
    """This process's pool for :func:`read_entries` (a forked child makes its own)."""

    def __init__(self) -> None:
        self.pid = -1
        self.pool: ThreadPoolExecutor | None = None
        self.parts = 1
        self.lock = threading.Lock()
        self.busy = False

    def get(self) -> tuple[ThreadPoolExecutor | None, int]:
        if self.pid != os.getpid():
            self.parts = max(1, min(_MAX_PARTS, usable_cores()))
            # a fork inherits the parent's pool object but none of its threads: start again
            from concurrent.futures import ThreadPoolExecutor

            self.pool = (ThreadPoolExecutor(self.parts - 1, thread_name_prefix="mmstore-read") if self.parts > 1
                         else None)
            self.lock = threading.Lock()
            self.busy = False
            self.pid = os.getpid()
        return self.pool, self.parts


_pool = _Pool()


def read_entries(fds: int | Sequence[int], offsets: Sequence[int], nbytes: int, dst: np.ndarray,
                 rows: Sequence[int]) -> None:
    """Read entry ``k`` (``nbytes`` at file offset ``offsets[k]`` of ``fds``,
    or of ``fds[k]``) into row ``rows[k]`` of ``dst`` (C-contiguous, rows of
    ``nbytes``), with ``os.preadv``: one call per run of entries that are
    consecutive in one file (their rows need not be: one buffer each, or one
    for consecutive rows), the GIL released. A read of at least
    ``PARALLEL_MIN_BYTES`` is shared with this module's threads (NOTE
    [parallel entry reads]). Offsets are sorted for the fewest calls but may
    come in any order.

    Raises
    ------
    MappingFault
        The file ended before entry ``entry`` (it was truncated while open);
        ``entry`` is the first entry of the failing run (entries of other
        runs may or may not have been read).
    """
    n = len(offsets)
    if n == 0 or nbytes == 0:
        return
    mv = memoryview(dst).cast("B")  # type: ignore[arg-type]
    one = isinstance(fds, (int, np.integer))
    offs = offsets if isinstance(offsets, list) else list(offsets)
    rws = rows if isinstance(rows, list) else list(rows)
    fdl = None if one else (fds if isinstance(fds, list) else list(fds))  # type: ignore[arg-type]
    parts = 1
    pool = None
    if n > 1 and n * nbytes >= PARALLEL_MIN_BYTES:
        pool, parts = _pool.get()
        if pool is not None:
            with _pool.lock:
                if _pool.busy:
                    parts = 1
                else:
                    _pool.busy = True
    if parts <= 1:
        _read_span(int(fds) if one else -1, fdl, offs, nbytes, mv, rws, 0, n)  # type: ignore[arg-type]
        return
    try:
        parts = min(parts, n)
        cuts = [n * j // parts for j in range(parts + 1)]
        futs: list[Future[None]] = [
            pool.submit(_read_span, int(fds) if one else -1, fdl, offs, nbytes, mv, rws, cuts[j], cuts[j + 1])  # type: ignore[union-attr,arg-type]
            for j in range(parts - 1)
        ]
        first: BaseException | None = None
        try:
            _read_span(int(fds) if one else -1, fdl, offs, nbytes, mv, rws, cuts[-2], cuts[-1])  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other parts are done
            first = exc
        for f in futs:  # every part is waited for: none writes into dst after this returns
            fexc = f.exception()
            if fexc is not None and (first is None or _entry(fexc) < _entry(first)):
                first = fexc
        if first is not None:
            raise first
    finally:
        with _pool.lock:
            _pool.busy = False


def _entry(exc: BaseException) -> int:
    return exc.entry if isinstance(exc, MappingFault) else -1


def _read_span(fd: int, fds: list[int] | None, offs: list[int], nb: int, mv: memoryview, rows: list[int],
               lo: int, hi: int) -> None:
    """Entries ``lo .. hi - 1`` of :func:`read_entries`."""
    preadv = os.preadv
    k = lo
    while k < hi:
        f = fd if fds is None else fds[k]
        r = rows[k]
        bufs: list[memoryview] = []
        start = r  # the row where the current buffer starts
        j = k + 1
        while j < hi and offs[j] == offs[j - 1] + nb and (fds is None or fds[j] == f) and len(bufs) < _IOV_MAX - 1:
            rj = rows[j]
            if rj != r + 1:
                bufs.append(mv[start * nb : (r + 1) * nb])
                start = rj
            r = rj
            j += 1
        bufs.append(mv[start * nb : (r + 1) * nb])
        want = (j - k) * nb
        got = preadv(f, bufs, offs[k])
        if got != want:
            _finish(f, bufs, offs[k], got, want, k)
        k = j


def _finish(fd: int, bufs: list[memoryview], offset: int, got: int, want: int, entry: int) -> None:
    """A short ``preadv``: read the rest (a regular file returns fewer bytes
    only at its end, so the rest is normally nothing: the file was truncated)."""
    flat = [b.cast("B") for b in bufs]
    done = max(got, 0)
    while done < want:
        # the buffer holding byte ``done`` of the run and where in it
        pos, i = done, 0
        while pos >= len(flat[i]):
            pos -= len(flat[i])
            i += 1
        more = os.preadv(fd, [flat[i][pos:], *flat[i + 1 :]], offset + done)
        if more <= 0:
            raise MappingFault(entry)
        done += more
