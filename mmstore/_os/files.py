"""Constants and file-descriptor helpers shared by the ``_os`` modules."""

from __future__ import annotations

import mmap
import os
from typing import Any, Union

__all__ = ["GiB", "HAS_FADVISE", "MiB", "PAGE_SIZE", "PathLike", "fd_name", "fileno", "open_ro"]

PathLike = Union[str, "os.PathLike[str]"]

MiB = 1 << 20
GiB = 1 << 30
PAGE_SIZE: int = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else mmap.PAGESIZE
HAS_FADVISE = hasattr(os, "posix_fadvise")


def open_ro(path: PathLike) -> int:
    """A read-only, close-on-exec file descriptor for ``path``."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


def fileno(fd: Any) -> int:
    """``fd`` itself if an int, else ``fd.fileno()``; TypeError otherwise."""
    if isinstance(fd, int):
        return fd
    if hasattr(fd, "fileno"):
        return fd.fileno()
    raise TypeError(f"expected a file descriptor or an object with fileno(), "
                    f"got {type(fd).__name__}")


def fd_name(fd: int) -> str:
    """The path an open descriptor refers to (Linux), else ``<fd N>``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"
