"""The writer lock of a destination: an ``flock`` on ``DEST.lock``, taken by
every process that writes a store (``StoreWriter``, ingest, merge) and
re-exported by :mod:`mmstore.store.writer`."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ..errors import DestinationError, LockedError

__all__ = ["acquire_lock", "release_lock"]


def acquire_lock(path: str) -> int:
    """Take the exclusive writer lock of destination ``path``; return its fd.

    The lock is an ``flock`` on ``PATH.lock``: the kernel drops it when the
    holder dies, so a killed ingest never leaves a lock that blocks the next
    run (a left-over ``PATH.lock`` file is harmless). ``flock`` is advisory and
    not reliable on every network file system.

    NOTE [lock file unlink]: the holder unlinks ``PATH.lock`` when it
    releases the lock (while still holding it), so no stray lock file stays
    behind. A process that opened the old file just before that unlink would
    then lock a file that no longer has the name, while a third process
    creates and locks a new one: two holders. So after ``flock`` succeeds the
    lock is only ours if ``PATH.lock`` still names the inode we locked;
    otherwise we let go and try again.

    The lock file is empty (0.2 wrote a pid into it) and is never followed
    through a symlink or written: a ``PATH.lock`` that is not a regular file,
    or holds anything but a pid, is not ours and is refused
    (:class:`DestinationError`).

    Raises
    ------
    LockedError
        Another live process holds it.
    """
    lock_path = os.path.abspath(path) + ".lock"
    for _ in range(100):
        fd = _open_lock_file(lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockedError(
                f"{path}: another process is writing this store right now (lock {lock_path} is held); "
                "wait for it to finish, or stop it first"
            ) from None
        try:
            named = os.stat(lock_path, follow_symlinks=False)
        except FileNotFoundError:
            named = None
        mine = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # the holder released and unlinked it under us: take the new one
    raise LockedError(f"{path}: could not take the lock {lock_path} (it kept being replaced); try again")


def _open_lock_file(lock_path: str) -> int:
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if os.path.islink(lock_path) or exc.errno == errno.ELOOP:
            raise DestinationError(f"{lock_path}: is a symbolic link, not an mmstore lock file; it is never "
                                   "followed: move it away, or choose another DEST") from None
        raise
    st = os.fstat(fd)
    head = os.pread(fd, 65, 0) if stat.S_ISREG(st.st_mode) else b"?"
    body = head.strip(b" \n\0")
    if not stat.S_ISREG(st.st_mode) or len(head) > 64 or (body and not body.isdigit()):
        os.close(fd)
        raise DestinationError(f"{lock_path}: exists and is not an mmstore lock file (an empty file, or one "
                               "holding a process id); it is never changed: move it away, or choose another DEST")
    return fd


def release_lock(path: str, fd: int, unlink: bool = True) -> None:
    """Let go of the lock; unlink ``PATH.lock`` first, while still holding it
    (see NOTE [lock file unlink]; ``unlink`` is kept for callers' clarity)."""
    if unlink:
        lock_path = os.path.abspath(path) + ".lock"
        try:
            named = os.stat(lock_path, follow_symlinks=False)
            mine = os.fstat(fd)
            if (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(lock_path)
        except FileNotFoundError:
            pass
    os.close(fd)
