"""Threads a command can walk away from: the requests of a push, a pull and a
``verify --deep`` of a store URL (standard library only).

NOTE [stopping a transfer]: a request to object storage cannot be stopped
from Python once the client library has it (obstore's runtime, botocore's
socket): a Ctrl-C reaches the main thread only, and a main thread that waits
for the request to end (``ThreadPoolExecutor``'s shutdown, or the interpreter
joining its worker threads at exit) waits for the whole upload of a large
file. So every request of a transfer runs on a *daemon* thread, and the main
thread only waits, interruptibly (a lock wait returns to Python on a
signal). When it is interrupted it sets the transfer's stop event, which the
workers check between files and between parts, and leaves at once; what was
in flight is abandoned (the process ending closes its sockets). The
transfer's journal is written after each step, atomically, so whatever a
worker was doing when the process ended, the journal names only what is done.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

__all__ = ["Pool", "Stopped", "call", "wait_all"]

T = TypeVar("T")
_TICK = 0.25  # how often a waiting worker looks at the stop event


class Stopped(Exception):
    """Raised in a worker that found its transfer's stop event set."""


def _run(fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        fut.set_exception(exc)


def call(fn: Callable[..., T], *args: Any, name: str = "mmstore-request") -> T:
    """``fn(*args)`` on a daemon thread; its result. The caller's wait can
    be interrupted (NOTE [stopping a transfer]); the call is then abandoned."""
    fut: Future[T] = Future()
    threading.Thread(target=_run, args=(fut, fn, args), name=name, daemon=True).start()
    return fut.result()


class Pool:
    """``width`` daemon threads running what is submitted, in order; a task
    submitted after ``stop`` is set is cancelled instead of run."""

    def __init__(self, width: int, name: str, stop: threading.Event) -> None:
        self.stop = stop
        self._todo: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._width = max(1, width)
        for i in range(self._width):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            fut, fn, args = item
            if self.stop.is_set():
                if fut.cancel():
                    fut.set_running_or_notify_cancel()  # so that wait() counts it as done
                continue
            _run(fut, fn, args)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._todo.put((fut, fn, args))
        return fut

    def close(self) -> None:
        """Let the threads end once the queue is done (never waits for them)."""
        for _ in range(self._width):
            self._todo.put(None)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.stop.set()  # an error or an interrupt: nothing more starts
        self.close()


def wait_all(futs: Iterable[Future[Any]], stop: threading.Event | None = None) -> None:
    """Wait for every future; then raise the first error (in the order
    given) if any. With ``stop``, a worker waiting here gives up with
    :class:`Stopped` as soon as it is set (the main thread is interrupted by
    the signal itself)."""
    order = list(futs)
    pending = set(order)
    while pending:
        if stop is not None and stop.is_set():
            raise Stopped
        _, pending = wait(pending, timeout=_TICK if stop is not None else None, return_when=FIRST_COMPLETED)
    errors = [Stopped() if fut.cancelled() else fut.exception() for fut in order]
    for exc in errors:  # the cause first: a task stopped because another failed says nothing
        if exc is not None and not isinstance(exc, Stopped):
            raise exc
    for exc in errors:
        if exc is not None:
            raise exc
