"""Small file-system helpers: atomic writes, fsync, preallocation, checksums.

Every write path of mmstore goes through these functions, so a fault test can
stop a run at any of them (see ``NOTE [crash points]`` in ``mmstore/_os/crash.py``).
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ResourceLimitError
from .crash import crash_point

__all__ = [
    "atomic_write",
    "check_space",
    "copy_range",
    "crash_point",  # re-exported: I/O callers import their crash hook with the helpers
    "describe_write_error",
    "fallocate",
    "fsync_dir",
    "free_bytes",
    "fsync_file",
    "fsync_path",
    "hasher",
    "pwrite_all",
    "record_checksum",
]


def fsync_file(fd: int) -> None:
    """fsync ``fd`` (a crash point)."""
    crash_point("fsync")
    os.fsync(fd)


def fsync_path(path: str) -> None:
    """fsync the file at ``path`` (written through another descriptor or by
    another process: fsync flushes a file's dirty pages whoever wrote them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_file(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    crash_point("fsync")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (a buffer) at ``offset``, looping on short writes."""
    crash_point("write")
    mv = memoryview(data).cast("B")
    done = 0
    n = mv.nbytes
    while done < n:
        w = os.pwrite(fd, mv[done:], offset + done)
        if w <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {w} bytes at offset {offset + done}")
        done += w


def copy_range(src: int, dst: int, src_off: int, dst_off: int, n: int) -> int:
    """Copy ``n`` bytes from descriptor ``src`` at ``src_off`` to ``dst`` at
    ``dst_off``, kernel-side with ``copy_file_range`` where the file systems
    allow it (extents shared on XFS/Btrfs), else by ``pread``/``pwrite``.
    Returns the bytes copied: fewer than ``n`` when ``src`` ended first (the
    caller says what that means)."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < n:
        if use_cfr:
            try:
                w = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_cfr = False
                continue
        else:
            buf = os.pread(src, min(n - done, 8 << 20), src_off + done)
            if buf:
                pwrite_all(dst, buf, dst_off + done)
            w = len(buf)
        if w == 0:
            break
        done += w
    return done


def fallocate(fd: int, offset: int, length: int, path: str) -> None:
    """Reserve disk blocks for ``[offset, offset+length)``.

    A write through a memory map into a sparse file on a full disk kills the
    process with SIGBUS; reserving the blocks first turns that into a clean
    ``ENOSPC`` here. File systems without ``fallocate`` (some network or FUSE
    file systems answer EOPNOTSUPP/EINVAL) fall back to extending the file
    with ``ftruncate``, which is all they can offer.
    """
    if length <= 0:
        return
    before = os.fstat(fd).st_size
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
            if os.fstat(fd).st_size < offset + length:
                os.ftruncate(fd, offset + length)
            return
        _give_back(fd, before, offset + length)
        raise OSError(
            exc.errno,
            f"{path}: cannot reserve {length} bytes ({os.strerror(exc.errno or 0)}); "
            "free some space or choose another destination",
        ) from None


def _give_back(fd: int, size: int, end: int) -> None:
    """Free the blocks a failed ``posix_fallocate`` took past ``size`` (ext4
    keeps what it allocated before running out): grow the file to ``end``
    (allocates nothing), then cut it back to ``size`` (frees every block past it)."""
    try:
        if os.fstat(fd).st_size < end:
            os.ftruncate(fd, end)
        os.ftruncate(fd, size)
    except OSError:
        pass


def free_bytes(path: str) -> int:
    """Bytes this process may still write on the file system holding ``path``."""
    st = os.statvfs(path)
    return int((st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize)


def fmt_bytes(n: float | int | None) -> str:
    """``n`` bytes for people: ``1.50 GB``, ``812 B``; None is ``unknown``."""
    if n is None:
        return "unknown"
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _mb(n: int) -> str:
    return f"{n:,} bytes" if n < 10**6 else f"{n / 1e6:,.1f} MB ({n:,} bytes)"


def check_space(path: str, need: int, what: str, largest: tuple[str, int] = ("", 0)) -> None:
    """Refuse to reserve ``need`` bytes under ``path`` when the file system
    does not have them, or the file ``largest = (name, bytes)`` when the
    process may not write one that large (``RLIMIT_FSIZE``), before any block
    is taken.

    Raises
    ------
    ResourceLimitError
        (``ENOSPC`` or ``EFBIG``) naming how much is needed and what is allowed.
    """
    cap = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if cap != resource.RLIM_INFINITY and largest[1] > cap:
        raise ResourceLimitError(
            errno.EFBIG,
            f"{what}: cannot reserve {largest[0]}: it needs {_mb(largest[1])} but this process may write files of "
            f"at most {_mb(cap)} "
            "(File too large: RLIMIT_FSIZE, `ulimit -f`); raise the limit or choose a smaller target size "
            "(nothing was reserved)",
        )
    free = free_bytes(path)
    if need > free:
        raise ResourceLimitError(
            errno.ENOSPC,
            f"{what}: needs {_mb(need)} for its data files but only {_mb(free)} are free on the file system of "
            f"{path}; free at least {_mb(need - free)} or choose another destination (nothing was reserved)",
        )


def describe_write_error(exc: OSError) -> str:
    """One line saying why writing a store failed: a full disk or a file-size
    limit get a cause a user can act on, anything else its own message."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        cause = "the disk is full (or over quota)"
    elif exc.errno == errno.EFBIG:
        cause = "a file grew past the allowed size (File too large: RLIMIT_FSIZE or the file system's limit)"
    else:
        return f"I/O error: {exc}"
    return f"writing the store failed: {cause} [{exc}]"


def atomic_write(path: str, data: bytes, *, unique: bool = False) -> None:
    """Write ``path`` atomically: temp file, fsync, rename, fsync the dir.
    ``unique``: the temp file's name is this process's own (``path.<pid>.<random>.tmp``),
    for a file that other processes may write at the same time (the last
    rename wins, whole); else ``path.tmp``."""
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp" if unique else path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, data, 0)
        fsync_file(fd)
    except BaseException:
        os.close(fd)
        if unique:
            os.unlink(tmp)
        raise
    os.close(fd)
    crash_point("rename")
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def hasher() -> Any:
    """A fresh xxh3_64 hasher (imported lazily: the core needs numpy only)."""
    import xxhash

    return xxhash.xxh3_64()


def record_checksum(arrays: Iterable[np.ndarray]) -> int:
    """xxh3_64 of the concatenated bytes of C-contiguous ``arrays``."""
    h = hasher()
    for a in arrays:
        h.update(a.data.cast("B") if a.ndim and a.size else a.tobytes())
    return int(h.intdigest())
