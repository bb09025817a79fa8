"""Many ``O_DIRECT`` record reads in two system calls: Linux native AIO
(``io_submit`` / ``io_getevents``) through ``ctypes``, for the record reads
of a permutation whose store does not fit (``_direct.read_records_direct``).

NOTE [record reads in one submit]: a reader thread that reads its piece's
records with one ``preadv`` each gives up the GIL and takes it back once
per record; with 16 reader threads and the consumer that is a futex storm
(``strace -c`` of a permutation epoch counts many ``futex`` calls per
record) and the user CPU it costs is the Loader's own overhead per epoch.
Here a piece's reads are described in numpy arrays
(one ``iocb`` and three ``iovec``s per record, built without a Python loop
per record), submitted in one ``io_submit`` and reaped with
``io_getevents``, both called with the GIL released; the disk sees the
piece's reads at once, ``threads`` pieces in flight. One thread submitting
this way reads random records at about the rate of 16 threads with one
``preadv`` each, for a fraction of the CPU of the Loader's former reads (16
threads, Python around each read), which were also slower.

Where AIO is missing (another architecture, a seccomp filter, ``aio-max-nr``
reached) :func:`context` returns None and the caller reads with ``preadv``.
An ``iocb`` whose read fails or comes up short is reported to the caller,
which reads that record again its own way (and raises the typed error).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from typing import Any

import numpy as np

__all__ = ["IOVEC", "MAX_EVENTS", "AioContext", "available", "context", "read_vectors"]

# (io_setup, io_destroy, io_getevents, io_submit) per machine (asm-generic on arm64 / riscv64)
_NR = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2), "arm64": (0, 1, 4, 2), "riscv64": (0, 1, 4, 2)}
_IOCB_CMD_PREADV = 7
_IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("prio", "<i2"),
                  ("fd", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                  ("flags", "<u4"), ("resfd", "<u4")])
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
# reads in flight per context (per reader thread). The kernel counts a context
# as max(this, 4 x CPUs) x 2 against fs.aio-max-nr (65,536 by default, for the
# whole machine): 128 leaves room for ~256 reader threads' contexts.
MAX_EVENTS = 128


def _syscalls() -> tuple[Any, tuple[int, int, int, int]] | None:
    nr = _NR.get(platform.machine())
    if nr is None or not hasattr(os, "O_DIRECT") or np.little_endian is False:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn, nr


_SYS = _syscalls()
_off = {"unavailable": _SYS is None}  # set once io_setup is refused for good (ENOSYS, EPERM)
_tls = threading.local()


class AioContext:
    """One reader thread's AIO context and its reusable arrays (``iocb``s,
    their pointers, events); destroyed when the thread's locals go."""

    def __init__(self, ctx: int) -> None:
        self.ctx = ctx
        self.pid = os.getpid()  # a forked child has no AIO context of its parent's
        self.cbs = np.zeros(MAX_EVENTS, _IOCB)
        self.ptrs = np.empty(MAX_EVENTS, np.uint64)
        self.ptrs[:] = self.cbs.ctypes.data + np.arange(MAX_EVENTS, dtype=np.uint64) * _IOCB.itemsize
        self.events = np.zeros(MAX_EVENTS, _EVENT)

    def __del__(self) -> None:
        if _SYS is not None and self.ctx and self.pid == os.getpid():
            _SYS[0](ctypes.c_long(_SYS[1][1]), ctypes.c_ulong(self.ctx))
            self.ctx = 0


def context() -> AioContext | None:
    """This thread's AIO context (made on first use), or None where AIO is
    not available."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is not None and ctx.pid != os.getpid():  # this thread forked: a new context here
        ctx.ctx = 0
        ctx = _tls.ctx = None
    if ctx is not None or _off["unavailable"]:
        return ctx
    fn, nr = _SYS  # type: ignore[misc]
    handle = ctypes.c_ulong(0)
    if fn(ctypes.c_long(nr[0]), ctypes.c_long(MAX_EVENTS), ctypes.byref(handle)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            _off["unavailable"] = True
        return None  # EAGAIN (aio-max-nr reached): preadv this time, ask again next time
    _tls.ctx = ctx = AioContext(handle.value)
    return ctx


def available() -> bool:
    """Whether AIO can be asked for here (a context may still be refused
    later: :func:`context` then returns None and the caller reads with
    ``preadv``)."""
    return _SYS is not None and not _off["unavailable"]


def read_vectors(ctx: AioContext, fds: np.ndarray, offsets: np.ndarray, iovecs: np.ndarray) -> np.ndarray:
    """Read ``iovecs[i]`` (a row of ``(base, len)`` pairs, ``len`` 0 for an
    unused one) from ``offsets[i]`` of ``fds[i]``, for every ``i`` at once;
    returns each read's result (bytes read, or ``-errno``). Every read
    submitted is reaped before this returns, so the buffers may be reused
    whatever happens. A read the kernel did not take (``io_submit`` refused
    it) is reported as ``-EAGAIN``."""
    fn, nr = _SYS  # type: ignore[misc]
    n = len(offsets)
    res = np.full(n, -errno.EAGAIN, np.int64)
    used = (iovecs["len"] > 0).sum(axis=1)
    ivs = np.ascontiguousarray(iovecs)
    handle = ctypes.c_ulong(ctx.ctx)
    for a in range(0, n, MAX_EVENTS):
        b = min(n, a + MAX_EVENTS)
        k = b - a
        cb = ctx.cbs[:k]
        cb["data"] = np.arange(a, b, dtype=np.uint64)
        cb["opcode"] = _IOCB_CMD_PREADV
        cb["fd"] = fds[a:b]
        cb["buf"] = ivs.ctypes.data + np.arange(a, b, dtype=np.uint64) * ivs.strides[0]
        cb["nbytes"] = used[a:b]
        cb["offset"] = offsets[a:b]
        sent = 0
        while sent < k:
            got = fn(ctypes.c_long(nr[3]), handle, ctypes.c_long(k - sent),
                     ctypes.c_void_p(ctx.ptrs.ctypes.data + 8 * sent))
            if got < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                break  # refused: these stay -EAGAIN
            if got == 0:
                break
            sent += got
        done = 0
        ev = ctx.events
        while done < sent:
            got = fn(ctypes.c_long(nr[2]), handle, ctypes.c_long(1), ctypes.c_long(sent - done),
                     ctypes.c_void_p(ev.ctypes.data + _EVENT.itemsize * done), ctypes.c_void_p(None))
            if got < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                raise OSError(ctypes.get_errno(), "io_getevents")  # cannot happen with a valid context
            done += got
        res[ev["data"][:done].astype(np.int64)] = ev["res"][:done]
    return res
