"""Capture of fd 2 around OpenCV's JPEG decoding, to catch libjpeg's "Corrupt JPEG data" warnings."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

from .proc import current_pid

__all__ = ["imdecode_captured"]

_cap_lock = threading.Lock()
_cap_file: Any = None
_cap_pid = -1

_CORRUPT_PREFIXES = (
    "Corrupt JPEG data",
    "Premature end of JPEG file",
    "Invalid SOS parameters",
    "Inconsistent progression",
)


def _close_capture() -> None:
    global _cap_file
    if _cap_file is not None:
        try:
            _cap_file.close()  # in a child: its own copy of the descriptor only
        except OSError:
            pass
        _cap_file = None


def _reset_after_fork() -> None:
    global _cap_lock, _cap_pid
    _cap_lock = threading.Lock()
    _close_capture()  # the inherited file shares its offset with the parent
    _cap_pid = -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(_close_capture)


def _sink_fd() -> int:
    global _cap_file, _cap_pid
    if _cap_file is None or _cap_pid != current_pid():
        import tempfile

        _cap_file = tempfile.TemporaryFile(buffering=0)
        _cap_pid = current_pid()
    return _cap_file.fileno()


def imdecode_captured(cv2: Any, buf: Any, flags: int) -> tuple[Any, str | None]:
    """``cv2.imdecode`` with fd 2 captured; returns (image, corruption warning or None)."""
    with _cap_lock:
        try:
            sink = _sink_fd()
            if sys.stderr is not None:
                sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):
            return cv2.imdecode(buf, flags), None
        try:
            os.dup2(sink, 2)
            try:
                img = cv2.imdecode(buf, flags)
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        size = os.lseek(sink, 0, os.SEEK_CUR)
        text = ""
        if size:
            os.lseek(sink, 0, os.SEEK_SET)
            text = os.read(sink, size).decode("utf-8", "replace")
            os.lseek(sink, 0, os.SEEK_SET)
            os.ftruncate(sink, 0)
    if not text:
        return img, None
    found = None
    forward = []
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if found is None and s.startswith(_CORRUPT_PREFIXES) and "bad ICC marker" not in s:
            found = s
        else:
            forward.append(line)
    if forward:
        try:
            os.write(2, "".join(forward).encode("utf-8", "replace"))
        except OSError:
            pass
    return img, found
