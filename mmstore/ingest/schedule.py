"""Who decodes which slot range: here, or through the worker pool, retrying after a worker dies."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from .._os import crash as _crash
from ..errors import IngestError
from ..store.writer import SlotWriter
from .committer import Tally
from .records import RecordJob, process_range
from .workers import WorkerPool

__all__ = ["Scheduler", "WorkerFailed", "chunk_size"]


class WorkerFailed(IngestError):
    """A worker could not write the store (full disk, ...); the message says why."""


class Scheduler:
    """Hands out the pending ranges and stops early when too many inputs failed.

    A worker that dies while decoding (a decoder crash) makes its first range
    be retried one input at a time; the input that kills a worker again
    becomes a hole (``corrupt: decoding crashed the worker ...``).
    ``stopped`` is the reason the run stopped early, or None.
    """

    def __init__(self, ranges: Iterator[tuple[int, int]], tally: Tally, limit: Any) -> None:
        self.ranges = ranges
        self.tally = tally
        self.limit = limit
        self.retry: deque = deque()
        self.crashed_once: set[int] = set()
        self.exhausted = False
        self.stopped: str | None = None
        self.check_limit()

    def check_limit(self) -> bool:
        """Set ``stopped`` when more inputs failed than allowed; True then."""
        t = self.tally
        if self.stopped is None and self.limit.exceeded(t.nerr, len(t.done)):
            self.stopped = self.limit.message(t.nerr, t.reasons)
        return self.stopped is not None

    def next_range(self) -> tuple[int, int] | None:
        if self.retry:
            return self.retry.popleft()
        return next(self.ranges, None)

    # -- in this process ---------------------------------------------------------
    def run_inline(self, job: RecordJob, sw: Any, reader: Any) -> None:
        """Decode every pending range here (``workers=0``)."""
        while self.stopped is None:
            r = self.next_range()
            if r is None:
                return
            self.tally.finished(*r, process_range(job, sw, reader, *r))
            self.check_limit()

    def run_threads(self, job: RecordJob, n: int) -> None:
        """Decode every pending range on ``n`` threads of this process (each
        with its own writer and reader, as a worker process has; the decoder
        releases the GIL). A write error stops the others and is raised here."""
        lock = threading.Lock()
        failed: list[BaseException] = []

        def work() -> None:
            try:
                sw = SlotWriter(job.partial)
                try:
                    reader = job.source.reader()
                    while True:
                        with lock:
                            if self.stopped is not None or failed:
                                return
                            r = self.next_range()
                        if r is None:
                            return
                        errs = process_range(job, sw, reader, *r)
                        with lock:
                            self.tally.finished(*r, errs)
                            self.check_limit()
                finally:
                    sw.close()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                with lock:
                    failed.append(exc)

        threads = [threading.Thread(target=work, name=f"mmstore-decode-{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]

    # -- through the pool --------------------------------------------------------
    def run_pool(self, pool: WorkerPool) -> None:
        """Feed the workers until every range is answered or the run stops."""
        for i in range(len(pool)):
            self._fill(pool, i)
        while pool.busy() and self.stopped is None:
            for ev, i, payload in pool.wait(timeout=1.0):
                if ev == "msg":
                    self._on_answer(pool, i, payload)
                else:
                    self._on_death(pool, i, payload)
                if self.stopped is not None:
                    break
            self._hand_out_retries(pool)

    def _fill(self, pool: WorkerPool, i: int) -> None:
        for _ in range(WorkerPool.DEPTH):
            r = self.next_range()
            if r is None:
                self.exhausted = True
                return
            pool.send(i, r)

    def _on_answer(self, pool: WorkerPool, i: int, msg: tuple[str, int, int, Any]) -> None:
        kind, a, b, body = msg
        if kind == "fatal":
            raise WorkerFailed(str(body))
        pool.answered(i, (a, b))
        self.tally.finished(a, b, body)
        if self.check_limit() or self.exhausted:
            return
        r = self.next_range()
        if r is None:
            self.exhausted = True
        else:
            pool.send(i, r)

    def _on_death(self, pool: WorkerPool, i: int, code: int | None) -> None:
        # a crash point fired in the worker: the whole ingest "crashes" there
        _crash.follow_child(code, lambda: pool.close(kill=True))
        lost = list(pool.tasks[i])
        if lost:
            self._requeue(lost, code)
        pool.restart(i)
        self.exhausted = False
        self._fill(pool, i)
        self.check_limit()

    def _requeue(self, lost: list[tuple[int, int]], code: int | None) -> None:
        """Queue the ranges a dead worker held; find the input that killed it."""
        a, b = lost[0]
        if b - a == 1 and a in self.crashed_once:
            why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self.tally.finished(a, b, [(a, f"corrupt: decoding crashed the worker process ({why})")])
            lost = lost[1:]
        elif b - a == 1:
            self.crashed_once.add(a)
        else:  # retry the first range one input at a time to find the culprit
            self.retry.extendleft(reversed([(s, s + 1) for s in range(a, b)]))
            lost = lost[1:]
        self.retry.extendleft(reversed(lost))

    def _hand_out_retries(self, pool: WorkerPool) -> None:
        """An idle worker (after a restart drained the queue) picks up retries."""
        for i in range(len(pool)):
            while len(pool.tasks[i]) < WorkerPool.DEPTH and self.retry:
                pool.send(i, self.retry.popleft())


def chunk_size(chunk: int | None, record_bytes: int, nslots: int, workers: int) -> int:
    """Slots per range: ``chunk`` when given, else about 32 MB of records (8 to
    1024), small enough that every worker gets at least 16 ranges."""
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        return int(chunk)
    by_bytes = (32 << 20) // max(1, record_bytes)
    c = max(8, min(1024, by_bytes))
    # at least 16 chunks per worker: the last chunks leave workers idle while
    # one finishes (a few per worker made a small ingest measurably slower)
    balance = max(1, math.ceil(nslots / (workers * 16)))
    return max(1, min(c, balance))
