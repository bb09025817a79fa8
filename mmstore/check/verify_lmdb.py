"""verify's LMDB pass, in child processes.

One flipped byte in an LMDB page can make liblmdb read outside its mapping
and kill the reading process with SIGBUS or SIGSEGV. verify must report that
damage, not die of it, so it never maps an LMDB file itself: a child process
(:mod:`mmstore.check._lmdb_child`, run with ``python -c``) walks the file with
a cursor and reports each key, value length and value checksum through a
pipe. When the child dies, the parent knows the last key it reported; it
then looks the following slots up one by one in new children, each death
naming one slot that could not be read, up to :data:`MAX_CRASHES` deaths per
range (the rest of the range is then reported unread as a whole).
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_CRASHES", "STALL_SECONDS", "ChildResult", "lmdb_entries", "value_layout_arg", "walk_range"]

MAX_CRASHES = 32  # deaths of the child per range before the rest of the range is given up
STALL_SECONDS = 120.0  # a child silent this long is stuck (a loop in damaged pages) and is killed
_SOURCE: list[str] = []


def _child_source() -> str:
    if not _SOURCE:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lmdb_child.py"), encoding="utf-8") as fh:
            _SOURCE.append(fh.read())
    return _SOURCE[0]


@dataclass
class ChildResult:
    """What one child reported. ``death`` is None when it finished (``D``),
    else how it ended: ``"SIGBUS"``, ``"exit 1 (...)"``, ``"no output for 120 s"``."""

    death: str | None = None
    error: str | None = None  # an error LMDB itself reported (a clean failure)
    entries: int | None = None
    pages_bytes: int | None = None  # stat: the bytes the meta page says the file's pages use
    last_slot: int | None = None  # the last slot reported (get: found or not), if 8-byte key

    @property
    def failure(self) -> str | None:
        """Why the child did not read everything, in words; None if it did."""
        if self.death is not None:
            return f"the reader process died: {self.death}"
        if self.error is not None:
            return f"LMDB reported: {self.error}"
        return None


OnRecord = Callable[[bytes, int, int | None], None]  # key, value length, xxh3_64 of the value (None: bad 2.0 layout)


def value_layout_arg(schema: Any) -> str:
    """The child's LAYOUT argument for ``schema`` ("" without variable-size
    fields: the value is the checksummed bytes)."""
    if not schema.has_variable:
        return ""
    return ",".join("v" if f.variable else f"f{f.nbytes}" for f in schema)


def _run_child(mode: str, path: str, lo: int, hi: int, readahead: bool, on_record: OnRecord | None = None,
               on_missing: Callable[[int], None] | None = None, layout: str = "") -> ChildResult:
    argv = [sys.executable, "-c", _child_source(), mode, "1" if readahead else "0", path, str(lo), str(hi), layout]
    res = ChildResult()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd="/", close_fds=True)
    buf = b""
    done = False
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], STALL_SECONDS)
            if not ready:
                proc.kill()
                res.death = f"no output for {STALL_SECONDS:.0f} s (stuck in a damaged page?)"
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
            buf, done = _parse(buf, res, on_record, on_missing)
        err = proc.stderr.read() if proc.stderr is not None else b""
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    if res.death is None and not done:
        if rc < 0:
            try:
                res.death = signal.Signals(-rc).name
            except ValueError:
                res.death = f"signal {-rc}"
        else:
            last = err.decode("utf-8", "backslashreplace").strip().splitlines()[-1:] or ["no message"]
            res.death = f"exit {rc} ({last[0]})"
    return res


def _parse(buf: bytes, res: ChildResult, on_record: OnRecord | None,
           on_missing: Callable[[int], None] | None) -> tuple[bytes, bool]:
    """Consume the complete messages at the start of ``buf``; return the rest
    and whether ``D`` (done) was read."""
    pos, n = 0, len(buf)
    while pos < n:
        tag = buf[pos : pos + 1]
        if tag == b"D":
            return buf[pos + 1 :], True
        if tag == b"S":
            if n - pos < 25:
                break
            entries, last_pgno, psize = struct.unpack_from("<QQQ", buf, pos + 1)
            res.entries, res.pages_bytes = entries, (last_pgno + 1) * psize
            pos += 25
        elif tag == b"N":
            if n - pos < 9:
                break
            (res.last_slot,) = struct.unpack_from("<Q", buf, pos + 1)
            if on_missing is not None:
                on_missing(res.last_slot)
            pos += 9
        elif tag == b"R":
            if n - pos < 3:
                break
            (klen,) = struct.unpack_from("<H", buf, pos + 1)
            end = pos + 3 + klen + 12
            if n < end:
                break
            key = buf[pos + 3 : pos + 3 + klen]
            vlen, h = struct.unpack_from("<IQ", buf, pos + 3 + klen)
            if klen == 8:
                res.last_slot = int.from_bytes(key, "big")
            if on_record is not None:
                on_record(key, vlen, h)
            pos = end
        elif tag == b"B":
            if n - pos < 3:
                break
            (klen,) = struct.unpack_from("<H", buf, pos + 1)
            end = pos + 3 + klen + 4
            if n < end:
                break
            key = buf[pos + 3 : pos + 3 + klen]
            (vlen,) = struct.unpack_from("<I", buf, pos + 3 + klen)
            if klen == 8:
                res.last_slot = int.from_bytes(key, "big")
            if on_record is not None:
                on_record(key, vlen, None)
            pos = end
        elif tag == b"X":
            if n - pos < 5:
                break
            (mlen,) = struct.unpack_from("<I", buf, pos + 1)
            if n - pos < 5 + mlen:
                break
            res.error = buf[pos + 5 : pos + 5 + mlen].decode("utf-8", "backslashreplace")
            pos += 5 + mlen
        else:
            raise ValueError(f"verify: unexpected output from the LMDB reader child ({tag!r})")
    return buf[pos:], False


def lmdb_entries(path: str) -> ChildResult:
    """The number of entries of the LMDB file ``path`` (``.entries``) and the
    bytes its pages use (``.pages_bytes``), or why not (``.failure``)."""
    return _run_child("stat", path, -1, -1, False)


def walk_range(path: str, lo: int, hi: int, stop: int, *, whole_start: bool, whole_end: bool, readahead: bool,
               on_record: OnRecord, on_missing: Callable[[int], None],
               on_unreadable: Callable[[int, int, str], None], layout: str = "") -> ChildResult:
    """Report every record of slots ``[lo, hi)`` of the LMDB file ``path``.

    ``whole_start`` / ``whole_end``: also report the keys before ``lo`` / from
    ``hi`` on (the first and the last range of a file, so that keys which are
    not slots are seen). ``stop``: the file's slot count. ``on_unreadable(a,
    b, why)`` is called for slots ``[a, b)`` that could not be read (the
    reader died, or LMDB reported the page damaged). ``layout``: see
    :func:`value_layout_arg`. Returns the first walk's result (its
    ``failure`` says why it did not finish).
    """
    res = _run_child("walk", path, -1 if whole_start else lo, -1 if whole_end else hi, readahead, on_record,
                     layout=layout)
    if res.failure is None:
        return res
    end = stop if whole_end else hi
    pos = lo if res.last_slot is None else max(lo, res.last_slot + 1)
    crashes = 1
    while pos < end:
        got = _run_child("get", path, pos, end, readahead, on_record, on_missing, layout)
        why = got.failure
        if why is None:
            break
        bad = pos if got.last_slot is None or got.last_slot < pos else got.last_slot + 1
        if bad >= end:
            break
        on_unreadable(bad, bad + 1, why)
        crashes += 1
        pos = bad + 1
        if crashes >= MAX_CRASHES and pos < end:
            on_unreadable(pos, end, f"not read: {crashes} failures in this range")
            break
    return res
