"""The ingest's worker pool: forked decoder processes, each fed slot ranges over its own pipe.

Workers get ``PR_SET_PDEATHSIG = SIGKILL`` so a killed ingest leaves no
writers behind; they ignore SIGINT (the parent stops them). Each opens its own
:class:`~mmstore.store.writer.SlotWriter` and source reader, and answers every
range with ``("ok", a, b, holes)`` or ``("fatal", a, b, message)``; pixels
never cross a pipe.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any

from .._os.io import describe_write_error
from .._os.proc import set_pdeathsig
from ..store.writer import SlotWriter
from .records import RecordJob, process_range

__all__ = ["WorkerPool", "default_workers"]


def default_workers() -> int:
    """The number of CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


def _quiet_decoder() -> None:
    try:
        import cv2  # lazy: only image ingests need OpenCV

        cv2.setNumThreads(1)  # one process per core already
        # decode failures are reported in errors.jsonl; keep OpenCV's own
        # warnings ("PNG input buffer is incomplete" ...) off the progress bar
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    except Exception:  # noqa: BLE001
        pass


def _worker_main(conn: Any, job: RecordJob, parent: int) -> None:
    set_pdeathsig()
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _quiet_decoder()
    try:
        sw = SlotWriter(job.partial)
        reader = job.source.reader()
    except OSError as exc:
        conn.send(("fatal", -1, -1, describe_write_error(exc)))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        a, b = msg
        try:
            errs = process_range(job, sw, reader, a, b)
        except OSError as exc:
            conn.send(("fatal", a, b, describe_write_error(exc)))
            break
        conn.send(("ok", a, b, errs))
    sw.close()


class WorkerPool:
    """``n`` forked worker processes, each fed ranges over its own pipe;
    ``tasks[i]`` are the ranges sent to worker ``i`` and not yet answered."""

    DEPTH = 2  # ranges queued per worker

    def __init__(self, n: int, job: RecordJob) -> None:
        self.ctx = mp.get_context("fork")
        self.job = job
        if not job.source.decoded or job.spec is not None:
            try:  # import the decoder once here: every worker inherits it by fork
                importlib.import_module("cv2")
            except ImportError:
                pass
        self.procs: list[Any] = [None] * n
        self.conns: list[Any] = [None] * n
        self.tasks: list[deque] = [deque() for _ in range(n)]
        for i in range(n):
            self._start(i)

    def __len__(self) -> int:
        return len(self.procs)

    def _start(self, i: int) -> None:
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        p = self.ctx.Process(target=_worker_main, args=(child_conn, self.job, os.getpid()), daemon=True)
        # NOTE [OpenCV and fork]: a child forked while OpenCV's thread pool
        # exists in this process inherits the pool's condition variables with
        # waiters that do not exist in the child, and its first
        # cv2.setNumThreads() hangs forever in pthread_cond_destroy (found by
        # running the demo inside the test suite). Wind the pool down for the
        # fork and restore the caller's setting afterwards.
        cv2 = sys.modules.get("cv2")
        threads = cv2.getNumThreads() if cv2 is not None else 1
        if cv2 is not None and threads != 1:
            cv2.setNumThreads(1)
        try:
            p.start()
        finally:
            if cv2 is not None and threads != 1:
                cv2.setNumThreads(threads)
        child_conn.close()
        self.procs[i] = p
        self.conns[i] = parent_conn
        self.tasks[i] = deque()

    def send(self, i: int, rng: tuple[int, int]) -> None:
        self.tasks[i].append(rng)
        try:
            self.conns[i].send(rng)
        except OSError:  # the worker died; its sentinel reports it and the range is retried
            pass

    def answered(self, i: int, rng: tuple[int, int]) -> None:
        """Worker ``i`` answered ``rng``: it is no longer in flight."""
        if self.tasks[i] and self.tasks[i][0] == rng:
            self.tasks[i].popleft()

    def busy(self) -> bool:
        return any(self.tasks)

    def wait(self, timeout: float) -> list[tuple[str, int, Any]]:
        """Events: ("msg", worker, message) or ("died", worker, exitcode)."""
        objs: dict[Any, tuple[str, int]] = {}
        for i, (c, p) in enumerate(zip(self.conns, self.procs)):
            objs[c] = ("conn", i)
            objs[p.sentinel] = ("proc", i)
        out: list[tuple[str, int, Any]] = []
        seen_dead = set()
        for r in wait(list(objs), timeout):
            kind, i = objs[r]
            if kind == "proc" or not self._drain(i, out):
                seen_dead.add(i)
        for i in sorted(seen_dead):
            self.procs[i].join(timeout=5)
            self._drain(i, out)  # what it sent before dying
            out.append(("died", i, self.procs[i].exitcode))
        return out

    def _drain(self, i: int, out: list[tuple[str, int, Any]]) -> bool:
        """Append worker ``i``'s waiting messages to ``out``; False at end of pipe."""
        try:
            while self.conns[i].poll():
                out.append(("msg", i, self.conns[i].recv()))
        except (EOFError, OSError):
            return False
        return True

    def restart(self, i: int) -> None:
        try:
            self.conns[i].close()
        except OSError:
            pass
        self._start(i)

    def close(self, kill: bool = False) -> None:
        """Stop every worker: ask them to finish (or kill them), then reap them."""
        for c, p in zip(self.conns, self.procs):
            if p is not None and not kill and p.is_alive():
                try:
                    c.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self.procs:
            if p is None:
                continue
            if kill:
                p.kill()
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
