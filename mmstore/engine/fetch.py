"""The window pass of a store opened from a URL: the epoch's order drives the
fetching of the replica's blocks (:mod:`mmstore.remote.replica`).

An epoch is cut into windows (a block shuffle's own windows, or runs of
consecutive batches for the other orders). A thread acquires the blocks of
window ``w`` (fetches what is absent, several range GETs in flight, and pins
it) ahead of the batches, up to ``ahead`` windows past the one the batches
read, in the order they will be read; a batch of window ``w`` waits until
``w`` is pinned, then reads from the page cache as any local read does. Once
every batch of a window is read, its pins are released and its blocks marked
consumed, so a cache limit evicts them first.

A window fetched ahead takes only the room the limit leaves; the window the
batches wait for may go over it by what is pinned (at most the windows in
flight): the limit is never exceeded by more than that.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..remote.replica import CONSUMED, KEEP
from ..store.spans import record_spans
from .inflight import InFlight, WindowPass

if TYPE_CHECKING:
    from ..remote.replica import Pin, Replica
    from ..store.reader import Store

__all__ = ["FETCH_WINDOW_BYTES", "RemoteWindows", "fetch_bounds", "remote_cost"]

_ROOM_WAIT_S = 0.02
FETCH_WINDOW_BYTES = 64 << 20  # a fetch window of an order without windows of its own


def remote_cost(replica: Replica, order: object, record_bytes: int) -> str:
    """What reading the epoch's order from the URL costs, in words."""
    if replica.complete():
        return "cached: every block is present; reads are local"
    name = type(order).__name__
    if name in ("BlockShuffle", "Sequential"):
        return ("each block is fetched once per epoch while it is not cached, ahead of the batches, in the order "
                "they read them")
    amp = replica.block_bytes / max(1, record_bytes)
    return (f"a {name} reads records one by one: each uncached record fetches its whole block of "
            f"{replica.block_bytes >> 20} MiB (up to {amp:.0f}x its {record_bytes:,} bytes) until the store is "
            "cached; a block shuffle (OrderSpec('block')) or a cache_limit that holds the store avoids it")


def fetch_bounds(n: int, batch_size: int, record_bytes: int, window_bytes: int) -> np.ndarray:
    """Window bounds for an order without windows of its own: runs of whole
    batches of about ``window_bytes``."""
    per = max(1, window_bytes // max(1, record_bytes * batch_size)) * batch_size
    return np.unique(np.concatenate((np.arange(0, n, per), [n]))).astype(np.int64)


class RemoteWindows(WindowPass):
    """Fetch and pin the blocks of the epoch's windows ahead of its batches."""

    def __init__(self, store: Store, fields: Sequence[str], idx: np.ndarray, bounds: np.ndarray,
                 inflight: InFlight, replica: Replica, ahead: int = 2) -> None:
        super().__init__(idx, bounds, inflight)
        self.store = store
        self.fields = list(fields)
        self.replica = replica
        self.ahead = max(1, int(ahead))
        self.pins: dict[int, Pin] = {}
        self.error: BaseException | None = None
        self.window_blocks: list[np.ndarray] | None = None
        self.last_use: np.ndarray | None = None

    def _plan_uses(self) -> None:
        """Under a cache limit: every window's blocks, and the last window of
        the epoch that reads each block. A window's block that a later window
        reads again (a block of the order straddles two of the replica's) is
        kept, not marked consumed, when its window is done (NOTE [blocks read
        again])."""
        nwin = len(self.bounds) - 1
        blocks = [self._blocks(w) for w in range(nwin)]
        last = np.full(self.replica.nblocks, -1, np.int64)
        if blocks:
            np.maximum.at(last, np.concatenate(blocks), np.repeat(np.arange(nwin), [len(b) for b in blocks]))
        self.window_blocks, self.last_use = blocks, last

    def _blocks(self, w: int) -> np.ndarray:
        if self.window_blocks is not None:
            return self.window_blocks[w]
        a, b = int(self.bounds[w]), int(self.bounds[w + 1])
        slots = self.store.slot_view.slots_of(self.idx[a:b])
        return self.replica.blocks_of(record_spans(self.store.slot_view.backend, self.store.schema, slots, self.fields))

    def _loop(self) -> None:
        cv = self.inflight.cv
        nwin = len(self.bounds) - 1
        pool = ThreadPoolExecutor(self.ahead, thread_name_prefix="mmstore-fetch-window")
        pending: deque[tuple[int, Future[Any]]] = deque()
        try:
            if self.replica.cache_limit is not None:
                self._plan_uses()
            w = 0
            while (w < nwin or pending) and not self.inflight.cancelled:
                # start windows up to `ahead` past the one the batches wait for
                while w < nwin and len(pending) < self.ahead and w <= self.need + self.ahead:
                    pending.append((w, pool.submit(self._acquire, w)))
                    w += 1
                if not pending:
                    with cv:
                        while w > self.need + self.ahead and not self.inflight.cancelled:
                            cv.wait(0.1)
                    continue
                k, fut = pending[0]
                pin = fut.result()
                pending.popleft()
                with cv:
                    if self.inflight.cancelled:
                        pin.release()
                        break
                    self.pins[k] = pin
                    self.done = k
                    cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the batch that waits for the window
            self.error = exc
        finally:
            for _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=True)
            for _, fut in pending:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    fut.result().release()
            with cv:
                self.done = len(self.bounds)  # never leave a batch waiting
                cv.notify_all()

    def _acquire(self, w: int) -> Pin:
        """Window ``w``'s blocks, present and pinned; ahead of the batches
        only in the room the limit leaves (waiting for consumption)."""
        blocks = self._blocks(w)
        cv = self.inflight.cv
        while True:
            needed = w < self.need  # a submitted batch reads window w (WindowPass.ask: need = w + 1)
            pin = self.replica.acquire(blocks, ahead=not needed)
            if pin is not None:
                return pin
            with cv:
                if self.inflight.cancelled:
                    raise RuntimeError("cancelled")
                cv.wait(_ROOM_WAIT_S)

    def wait_for(self, w: int) -> None:
        super().wait_for(w)
        if self.error is not None:
            raise self.error

    def consumed(self, pos: int) -> None:
        """Positions ``[0, pos)`` are read: release their windows' pins.

        NOTE [blocks read again]: a released window's blocks are marked
        consumed (evicted first) unless a later window of the epoch reads
        them too; those get a last use that keeps them longest, the sooner
        they are needed the longer, so a limit evicts what the epoch is done
        with before what it will read again."""
        with self.inflight.cv:
            done = [w for w in self.pins if self.bounds[w + 1] <= pos]
            pins = [(w, self.pins.pop(w)) for w in done]
            self.inflight.cv.notify_all()
        last = self.last_use
        for w, pin in pins:
            if last is None or not len(pin.blocks):
                pin.release(consumed=True)
                continue
            again = last[pin.blocks] > w
            use = self.replica.use
            use[pin.blocks[~again]] = CONSUMED
            use[pin.blocks[again]] = KEEP - last[pin.blocks[again]].astype(np.uint64)
            pin.release()
