"""The ingest's committer: finished ranges go to the writer and, after an fsync, to the commit log."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import IngestError
from ..store.writer import StoreWriter
from .progress import Progress
from .resume import CommitLog

__all__ = ["CommitThread", "Tally"]


class CommitThread:
    """Background thread: fsync the store's files, then commit the chunks.

    A chunk is handed over after its worker finished writing it; an fsync that
    starts after that covers its pages (fsync flushes a file's dirty pages
    whoever wrote them), so the commit that follows is safe. Batching every
    chunk that arrived during the previous fsync keeps fsyncs off the decoders'
    path and their number small.
    """

    # NOTE [Ctrl-C and locks]: the main thread talks to this thread only
    # through a queue.SimpleQueue, whose put() holds no Python-level lock. A
    # threading.Condition here deadlocked on Ctrl-C: KeyboardInterrupt can
    # land between a `with cv:` acquiring the lock and its body starting, so
    # the main thread kept the lock while it then waited for this thread,
    # which needed the lock to stop (seen once under heavy load; a hung
    # `mmstore ingest` after SIGINT).
    _STOP = None

    def __init__(self, sync: Callable[[], None], log: CommitLog) -> None:
        self.sync = sync
        self.log = log
        self.q: Any = queue.SimpleQueue()
        self.abandon = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mmstore-commit", daemon=True)
        self.thread.start()

    def put(self, a: int, b: int, errs: list[tuple[int, str]]) -> None:
        self.q.put((a, b, errs))

    def _take(self) -> tuple[list[Any], bool]:
        """The next item and everything that arrived during the previous
        fsync; whether the stop mark was among them."""
        batch = [self.q.get()]
        while True:
            try:
                batch.append(self.q.get_nowait())
            except queue.Empty:
                break
        stop = self._STOP in batch
        return [x for x in batch if x is not self._STOP], stop

    def _run(self) -> None:
        while True:
            batch, stop = self._take()
            if batch and not self.abandon:
                try:
                    self.sync()
                    for a, b, errs in batch:
                        if self.abandon:
                            break
                        self.log.commit(a, b, errs)
                except BaseException as exc:  # noqa: BLE001 - reported by check()
                    self.error = exc
                    return
            if stop:
                return

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self, drain: bool = True) -> None:
        if not drain:
            self.abandon = True
        self.q.put(self._STOP)
        self.thread.join()
        if drain:
            self.check()


class Tally:
    """What the run has finished: each finished range is told to the writer
    (written slots and holes), counted, shown, and handed to the committer."""

    def __init__(self, writer: StoreWriter, listing: Any, lo: int, nslots: int) -> None:
        self.writer = writer
        self.listing = listing
        self.lo = lo
        self.done = np.zeros(nslots, bool)
        self.reasons: Counter = Counter()
        self.nerr = 0
        self.committer: CommitThread | None = None
        self.progress: Progress | None = None

    @property
    def already(self) -> int:
        return int(self.done.sum())

    def start(self, committer: CommitThread, progress: Progress) -> None:
        """Begin taking finished ranges (after the workers were forked)."""
        self.committer, self.progress = committer, progress

    def replay(self, entries: Iterable[tuple[int, int, list[tuple[int, str]]]]) -> None:
        """Apply the valid committed entries of a resumed run's log (up to the
        first that does not fit this run)."""
        n = len(self.done)
        for a, b, errs in entries:
            if not (0 <= a <= b <= n) or any(not a <= s < b for s, _ in errs):
                break
            self._apply(a, b, errs)

    def finished(self, a: int, b: int, errs: list[tuple[int, str]]) -> None:
        """Range ``a..b`` is written (``errs`` are its holes): commit and count it."""
        committer, progress = self.committer, self.progress
        if committer is None or progress is None:  # pragma: no cover - a bug guard (start() runs before any range)
            raise IngestError(f"range {a}..{b} finished before the run started")
        committer.check()
        committer.put(a, b, errs)
        self._apply(a, b, errs)
        progress.update(b - a, len(errs))

    def _apply(self, a: int, b: int, errs: list[tuple[int, str]]) -> None:
        bad = {s for s, _ in errs}
        for s, r in errs:
            self.writer.skip(s, self.listing.key(self.lo + s), r)
            self.reasons[r] += 1
        ok = np.array([s for s in range(a, b) if s not in bad], np.int64) if bad else np.arange(a, b, dtype=np.int64)
        if len(ok):
            self.writer.mark_written(ok)
        self.done[a:b] = True
        self.nerr += len(errs)
