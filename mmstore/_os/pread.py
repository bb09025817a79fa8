"""The hot read path: fixed-size records at arbitrary file offsets into rows of an array (``preadv``)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ..errors import TruncatedReadError
from .files import fd_name, fileno
from .runs import find_runs

__all__ = [
    "TruncatedReadError", "pread_into", "pread_records", "pread_records_multi", "raise_open_files_limit",
    "read_full",
]

_HAS_PREADV = hasattr(os, "preadv")
_HAS_PREAD = hasattr(os, "pread")




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
    copies. Safe to call from several threads (into disjoint rows).
    """
    fd = fileno(fd)
    offs, mv = _check_records(offsets, nbytes, out)
    nbytes = int(nbytes)
    starts, ends = find_runs(nbytes, offs)
    _read_runs(fd, None, offs.tolist(), nbytes, mv, starts, ends)


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
    nbytes = int(nbytes)
    starts, ends = find_runs(nbytes, offs, same=fda)
    _read_runs(-1, fda.tolist(), offs.tolist(), nbytes, mv, starts, ends)


def _read_runs(fd: int, fds: list[int] | None, offl: list[int], nbytes: int, mv: memoryview,
               starts: list[int], ends: list[int]) -> None:
    """Read each run of rows ``s..e-1`` with one positional read (``fd``: one
    file, or ``fds``: a file descriptor per row, ``fd`` then unused)."""
    for s, e in zip(starts, ends):
        try:
            read_full(fd if fds is None else fds[s], mv[s * nbytes:e * nbytes], offl[s])
        except TruncatedReadError as err:
            if e - s == 1:
                raise
            # a merged run came up short: name the record that did
            k = err.received // nbytes
            raise TruncatedReadError(
                err.filename, err.offset + k * nbytes, nbytes,
                err.received - k * nbytes, err.file_size) from None


def read_full(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``offset`` of ``fd``, retrying short reads;
    :class:`TruncatedReadError` at end of file."""
    total = len(buf)
    done = 0
    while done < total:
        got = pread_into(fd, buf[done:], offset + done)
        if got == 0:
            try:
                size: int | None = os.fstat(fd).st_size
            except OSError:
                size = None
            raise TruncatedReadError(fd_name(fd), offset, total, done, size)
        done += got


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
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
    return offs, flat.data.cast("B")


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
