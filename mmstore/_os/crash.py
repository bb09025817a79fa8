"""Fault injection for the crash tests: ``crash_point(name)`` ends the process at an armed point.

NOTE [crash points]: tests set ``MMSTORE_CRASH_AT="phase:k"`` (phase one of
write, fsync, commit, rename, merge, or "any") to make the process die with
``os._exit(77)`` just before the k-th such operation, counted per process
(or call :func:`arm` in a forked child). Unarmed, a crash point costs one
truthiness test. This is how the fault suite walks every numbered point of an
ingest or a merge in turn. Production code only ever calls :func:`crash_point`
(and the ingest parent :func:`follow_child`, so a crash in a worker crashes
the whole run, as a power cut would).
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["EXIT_CODE", "arm", "crash_point", "follow_child"]

EXIT_CODE = 77
_armed = os.environ.get("MMSTORE_CRASH_AT", "")
_counts: dict[str, int] = {}


def arm(spec: str) -> None:
    """Arm ``spec`` (``"phase:k"``, or ``""`` to disarm) and restart the counts."""
    global _armed
    _armed = spec
    _counts.clear()


def crash_point(phase: str) -> None:
    """Die here if the armed spec names this occurrence of ``phase``."""
    if not _armed:
        return
    want, _, k = _armed.partition(":")
    if want not in (phase, "any"):
        return
    _counts[want] = _counts.get(want, 0) + 1
    if str(_counts[want]) == k:
        os._exit(EXIT_CODE)


def follow_child(exitcode: int | None, cleanup: Callable[[], None]) -> None:
    """When armed and a child process died at a crash point, run ``cleanup``
    and die the same way (the child's crash is the whole run's crash)."""
    if _armed and exitcode == EXIT_CODE:
        cleanup()
        os._exit(EXIT_CODE)
