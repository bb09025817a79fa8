"""Ingest bookkeeping inside ``DEST.partial``: the run state and the commit log.

``_ingest.json`` (written once, atomically, right after the writer created
the ``.partial``) holds the fingerprint of the inputs and every parameter
that changes an output byte. A resume recomputes it and refuses to continue
when it differs (:class:`~mmstore.errors.ResumeMismatchError`).

``_ingest_commits.log`` is the commit log, append-only. One line per committed
chunk (a range of slots whose data a worker has written *and fsynced*)::

    {"a": 0, "b": 64, "e": [[3, "corrupt: ..."], ...]} <xxh3_64 hex of the JSON>\\n

``a``/``b`` are the slot range, ``e`` the holes in it with their reasons (so a
resume rebuilds ``errors.jsonl`` exactly). A line is appended with one
``pwrite`` and then the log is fsynced (``crash_point("commit")`` before the
append, ``write`` and ``fsync`` points inside): a crash leaves at most a torn
last line, which fails its checksum; on resume the log is cut back to its last
valid line and the chunks that are not in it are done again. Appending keeps a
commit O(1) whatever the number of chunks (a bitmap rewritten by temp + rename
would cost O(chunks) per commit). Ranges are slot ranges, not chunk numbers,
so a resume may use another chunk size or worker count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from .._os.crash import crash_point
from .._os.io import atomic_write, fsync_file, pwrite_all

__all__ = ["COMMIT_LOG", "STATE_FILE", "CommitLog", "read_state", "write_state"]

STATE_FILE = "_ingest.json"
COMMIT_LOG = "_ingest_commits.log"


def _digest(b: bytes) -> str:
    return xxhash.xxh3_64(b).hexdigest()


def write_state(partial: str, state: dict[str, Any]) -> None:
    atomic_write(os.path.join(partial, STATE_FILE), json.dumps(state, indent=1, sort_keys=True).encode() + b"\n")


def read_state(partial: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(partial, STATE_FILE), "rb") as fh:
            return json.loads(fh.read())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


class CommitLog:
    """The append-only commit log of one ``.partial`` directory."""

    def __init__(self, partial: str) -> None:
        self.path = os.path.join(partial, COMMIT_LOG)
        self.fd = -1
        self.size = 0

    def entries(self) -> Iterator[tuple[int, int, list[tuple[int, str]]]]:
        """Valid entries in order; sets ``self.size`` to the valid prefix length."""
        self.size = 0
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return
        with fh:
            pos = 0
            for line in fh:
                if not line.endswith(b"\n"):
                    break
                body, sep, dig = line[:-1].rpartition(b" ")
                if not sep or _digest(body) != dig.decode("ascii", "replace"):
                    break
                try:
                    obj = json.loads(body)
                    a, b = int(obj["a"]), int(obj["b"])
                    errs = [(int(s), str(r)) for s, r in obj.get("e", [])]
                except (ValueError, KeyError, TypeError):
                    break
                pos += len(line)
                self.size = pos
                yield a, b, errs

    def open(self) -> None:
        """Open for appending after the valid prefix (cutting a torn tail)."""
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size != self.size:
            os.ftruncate(self.fd, self.size)
            fsync_file(self.fd)

    def commit(self, a: int, b: int, errs: list[tuple[int, str]]) -> None:
        body = json.dumps({"a": a, "b": b, "e": [[int(s), r] for s, r in errs]}, separators=(",", ":")).encode()
        line = body + b" " + _digest(body).encode() + b"\n"
        crash_point("commit")
        pwrite_all(self.fd, line, self.size)
        fsync_file(self.fd)
        self.size += len(line)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


UNIT_MAX = 1024  # the most slots of a source's read unit kept whole in one range (pending_ranges)


def pending_ranges(done: np.ndarray, chunk: int, units: np.ndarray | None = None,
                   taper: int = 0) -> Iterator[tuple[int, int]]:
    """Ranges covering every slot not ``done``, in order: of at most ``chunk``
    slots each, or, with ``units`` (the slots where a unit of the source's
    reading starts: a Parquet file's row groups,
    :meth:`mmstore.ingest.parquet.ArrowSource.read_units`), of whole units,
    as many as make ``chunk`` slots or more, so that one worker reads a unit
    once instead of each worker that holds a piece of it reading all of it.
    A unit of more than :data:`UNIT_MAX` slots is cut every ``chunk`` slots,
    as without ``units``. ``taper`` (the number of decoders; without
    ``units``): the last ``2 * taper`` chunks' worth of slots go out in
    ranges of a quarter chunk, so that the decoders finish close together
    instead of all but one waiting while the last whole chunk is decoded."""
    n = len(done)
    if n == 0:
        return
    todo = ~done
    # run boundaries of todo
    d = np.diff(np.concatenate(([False], todo, [False])).astype(np.int8))
    starts = np.flatnonzero(d == 1)
    stops = np.flatnonzero(d == -1)
    cuts = None if units is None else np.unique(np.clip(np.asarray(units, np.int64), 0, n))
    left = int(todo.sum())
    tail = 2 * taper * chunk
    small = max(1, chunk // 4)
    for s, e in zip(starts.tolist(), stops.tolist()):
        if cuts is None:
            a = s
            while a < e:
                b = min(e, a + (chunk if left > tail else small))
                yield a, b
                left -= b - a
                a = b
            continue
        inner = cuts[(cuts > s) & (cuts < e)].tolist()
        a = s
        for lo, hi in zip([s, *inner], [*inner, e]):
            if hi - lo > UNIT_MAX:  # a large unit: cut as without units
                if lo > a:
                    yield a, lo
                for b in range(lo, hi, chunk):
                    yield b, min(b + chunk, hi)
                a = hi
            elif hi - a >= chunk:
                yield a, hi
                a = hi
        if a < e:
            yield a, e
