"""How :func:`mmstore.ray.write` cuts the dataset's stream of blocks into
parts, one write task each.

A part holds ``part_rows`` rows, cut out of consecutive blocks (a block may
end in one part and go on in the next: a part lists slices of blocks). The
stream is read ``slots * part_rows`` rows ahead of the parts handed out
(``slots``: the write tasks the cluster runs at once), so when it ends the
planner knows the rows that are left, and splits them evenly into up to
``4 * slots`` parts of at least ``min_rows`` rows: the last wave of tasks
then ends together, instead of one CPU decoding a whole part while the
others wait (on a job of a few thousand rows, most of the job). The rows of
the parts, in order, are the rows of the stream, in order, each once.

With ``part_rows=None`` every block is a part of its own, as it comes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

Cut = tuple[int, int]  # rows [start, end) of a block


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, end)`` of a block (``ref``, of ``rows`` rows in all)."""

    ref: Any
    start: int
    end: int
    rows: int

    @property
    def cut(self) -> Cut | None:
        """The slice to take of the block, or None for the whole block."""
        return None if (self.start, self.end) == (0, self.rows) else (self.start, self.end)

    @property
    def n(self) -> int:
        return self.end - self.start


Part = list[Piece]


class PartPlan:
    """Feed blocks with :meth:`add` (each returns the parts ready), then
    :meth:`finish` (the rest of the parts)."""

    def __init__(self, part_rows: int | None, slots: int, min_rows: int = 64) -> None:
        if part_rows is not None and part_rows < 1:
            raise ValueError(f"part_rows must be >= 1 or None, got {part_rows}")
        self.part_rows = part_rows
        self.slots = max(1, int(slots))
        self.min_rows = max(1, int(min_rows))
        self._queue: deque[Piece] = deque()
        self._queued = 0

    def add(self, ref: Any, rows: int, cut: Cut | None = None) -> list[Part]:
        """Take a block of ``rows`` rows (all of them, or the rows ``cut`` of it)."""
        start, end = cut if cut is not None else (0, rows)
        if end <= start:
            return []
        piece = Piece(ref, start, end, rows)
        if self.part_rows is None:
            return [[piece]]
        self._queue.append(piece)
        self._queued += piece.n
        out = []
        while self._queued >= self.part_rows * (self.slots + 1):  # keep slots parts' rows ahead
            out.append(self._take(self.part_rows))
        return out

    def finish(self) -> list[Part]:
        """The parts of the rows left, split evenly (see the module docstring)."""
        left = self._queued
        if not left:
            return []
        most = self.part_rows or left  # (a plan without part_rows queues nothing)
        k = max(-(-left // most), min(4 * self.slots, max(1, left // self.min_rows)))
        sizes = [left // k + (1 if i < left % k else 0) for i in range(k)]
        return [self._take(s) for s in sizes]

    def _take(self, n: int) -> Part:
        part: Part = []
        while n:
            head = self._queue[0]
            if head.n <= n:
                part.append(self._queue.popleft())
                n -= head.n
                self._queued -= head.n
            else:
                part.append(Piece(head.ref, head.start, head.start + n, head.rows))
                self._queue[0] = Piece(head.ref, head.start + n, head.end, head.rows)
                self._queued -= n
                n = 0
        return part
