"""The reads in flight: ``InFlight`` is one epoch's reads into a loader's
ring of buffers (futures per buffer) and whether that epoch was cancelled;
``WindowPass`` a block shuffle's window read one window ahead. Both stop at
interpreter exit before the thread pools shut down."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np


def wait_all(futs: list[Future[Any]]) -> None:
    """Wait until every future of ``futs`` is done (cancelled counts as done).

    One future at a time, in its own ``with`` of its lock: ``concurrent.futures.wait``
    takes the locks of all its futures one after the other, and a
    ``KeyboardInterrupt`` raised between two of them (Ctrl-C in a training loop)
    leaves the first ones held; the reader thread that finishes such a future
    then blocks in ``set_result`` for ever, and so does the loader's next wait.
    """
    for f in futs:
        if not f.done():
            try:
                f.exception()
            except CancelledError:
                pass


class InFlight:
    """The reads of one epoch in flight, and whether the epoch was cancelled.

    Shared by the epoch's state, its iterator's finalizer and the loader (which
    waits for them before reusing the ring); references none of them, so
    holding it keeps no epoch or loader alive."""

    def __init__(self, nslots: int) -> None:
        self.pid = os.getpid()
        self.futs: list[list[Future[Any]] | None] = [None] * nslots
        self.cancelled = False
        # "ended" (finished, closed by its owner, abandoned, failed) or "closed" (Loader.close)
        self.reason = ""
        self.cv = threading.Condition()  # window progress (an RLock: notify is safe from a finalizer)
        self.win_thread: threading.Thread | None = None
        self.stream: Any = None  # the CUDA side stream of the epoch's copies
        self.hold: Any = None  # released once nothing of the epoch reads (a replica's whole pin)

    def cancel(self, reason: str) -> None:
        """Stop the epoch: queued reads are cancelled, waiting threads woken.
        Never blocks (called from finalizers, in any thread)."""
        if not self.cancelled:
            self.reason = reason
            self.cancelled = True
        if self.pid != os.getpid():
            return  # a forked child: the parent's futures and locks are not ours
        for futs in self.futs:
            for f in futs or ():
                f.cancel()
        with self.cv:
            self.cv.notify_all()

    def wait(self) -> None:
        """Wait until nothing of this epoch writes into the ring any more.
        Called by the consumer's thread (``iter``, ``close``), never from a
        finalizer."""
        if self.pid != os.getpid():
            return
        for i, futs in enumerate(self.futs):
            if futs:
                wait_all(futs)
                self.futs[i] = None
        t = self.win_thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self.win_thread = None
        if self.stream is not None:
            self.stream.synchronize()
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.release()

    def wait_slot(self, s: int) -> list[Future[Any]]:
        """Wait for the reads into buffer ``s``; return their futures (and
        forget them, unless the epoch was cancelled meanwhile)."""
        futs = self.futs[s] or []
        wait_all(futs)
        if not self.cancelled:
            self.futs[s] = None
        return futs


class WindowPass:
    """What every window pass shares (``_reads.WindowPrefetch``,
    ``_direct.DirectWindows``): the epoch cut into windows at ``bounds``, a
    thread (the subclass's ``_loop``) that reads window ``w + 1`` while the
    batches of window ``w`` are read, and the handshake with the batches
    through the epoch's condition variable: ``need`` is the last window a
    submitted batch reads, ``done`` the last window read."""

    def __init__(self, idx: np.ndarray, bounds: np.ndarray, inflight: InFlight) -> None:
        self.idx = idx
        self.bounds = bounds
        self.inflight = inflight
        self.done = -1
        self.need = 0

    def _loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        t = threading.Thread(target=self._loop, name="mmstore-window", daemon=True)
        self.inflight.win_thread = t  # the epoch's wait() joins it
        _WINDOW_PASSES.add(self.inflight)
        t.start()

    def window_of(self, pos: int) -> int:
        """The window of position ``pos`` of the epoch."""
        return int(np.searchsorted(self.bounds, pos, side="right")) - 1

    def ask(self, w: int) -> None:
        """A batch of window ``w`` was submitted: read up to window ``w + 1``."""
        cv = self.inflight.cv
        with cv:
            if w + 1 > self.need:
                self.need = w + 1
                cv.notify_all()

    def wait_for(self, w: int) -> None:
        """Block until window ``w`` is read (or the pass ended)."""
        cv = self.inflight.cv
        with cv:
            while self.done < w and not self.inflight.cancelled:
                cv.wait()


# NOTE [window threads at exit]: a window thread is a daemon (an epoch the
# user abandons must not keep the process alive), but a daemon thread still
# running when the interpreter finalizes is killed by pthread_exit the next
# time it takes the GIL; if that happens inside a C++ call (torch, with
# noexcept frames on the stack) the forced unwind ends in std::terminate
# ("terminate called without an active exception", exit status 134). So the
# passes still running when the interpreter exits (a loop that raised, a
# script that ends mid-epoch) are cancelled and joined first: from
# threading's exit hooks, which run before the reader pools are shut down
# (those hooks run last-registered first) and before finalization.
_WINDOW_PASSES: weakref.WeakSet[InFlight] = weakref.WeakSet()


def _stop_window_passes() -> None:
    passes = list(_WINDOW_PASSES)
    for inflight in passes:
        inflight.cancel("interpreter exit")
    for inflight in passes:
        t = inflight.win_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=30)


_register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9: before pools shut down
try:
    (_register or atexit.register)(_stop_window_passes)
except RuntimeError:  # imported while the interpreter is already shutting down
    pass
