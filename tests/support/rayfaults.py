"""Faults inside a Ray write task, carried by the data: an image cell that is a path (it
reads like one) which kills or fails the process that opens it, on the first attempt only.

The first attempt is the one that creates ``marker`` (``O_EXCL``), so a retry of the task
finds it and reads the path as any other. Sent to Ray's workers by value (see
:func:`register`), so the workers need not import the tests.
"""

from __future__ import annotations

import os
import signal


class TaskFault(BaseException):
    """Raised by a ``"raise"`` fault: a ``BaseException``, so no per-input handler turns it
    into a hole, as a task's own crash would not be."""


class FaultyPath(os.PathLike):
    """A path that, the first time any process opens it, does ``action`` (``"kill"``:
    SIGKILL the process, ``"raise"``: raise :class:`TaskFault`)."""

    def __init__(self, path: str, marker: str, action: str) -> None:
        self.path, self.marker, self.action = path, marker, action

    def __fspath__(self) -> str:
        try:
            fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return self.path
        os.close(fd)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise TaskFault(f"injected fault reading {self.path}")


class PlainPath(os.PathLike):
    """A path cell of the same type, without a fault."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


def register() -> None:
    """Send this module's classes to Ray's workers by value."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
