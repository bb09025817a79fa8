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

Without a limit, a window fetched ahead takes only the room there is; the
window the batches wait for may go over it by what is pinned.

NOTE [order under a cache limit]: under a ``cache_limit`` each block is
fetched at most once an epoch (unless another reader of the cache evicts
it), the same blocks in every run with the same seed, whatever the timing:

* the order's sizes are chosen for the limit (:class:`LimitNeed`): the
  cache must hold the files kept whole and the headers, the windows in
  flight (the one read and ``ahead`` fetched), and every replica block that
  two order blocks share (a block of the order rarely ends on a block of
  the replica: such a block is read by two windows, anywhere in the epoch,
  and is kept in between). That sum is a bound over every seed. The
  largest order block up to the one the order has without a limit (else
  the smallest above it) whose narrowest window (a batch at least) fits is
  taken, with the widest window that still fits. A limit too small for any
  size is refused (``CacheLimitError``) with the smallest that works;
  sizes given by the caller are checked the same way;
* at the start of an epoch of a block shuffle or a sequential order, the
  fetch pass plans from the epoch's windows and the blocks present which
  blocks each window's fetch evicts first: blocks the epoch has done with
  (the longest done first), then cached blocks it reads later (the latest
  first), never one it read and reads again while anything else is left
  (then, and only then, ``ahead`` is lowered, and a block may be fetched
  twice). A permutation's windows are single batches, each touching blocks
  all over the store: it evicts as without a plan;
* window ``w`` evicts its planned blocks once the windows before
  ``w - ahead`` are read and unpinned and the windows before ``w`` have
  evicted theirs (in window order), then fetches what it lacks without
  evicting anything else: the cache's state after each window is the
  plan's, not the threads' timing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import CacheLimitError
from ..remote.replica import CONSUMED, KEEP
from ..store.spans import RecordSpans, record_spans
from .inflight import InFlight, WindowPass

if TYPE_CHECKING:
    from ..remote.replica import Pin, Replica
    from ..store.reader import Store

__all__ = ["FETCH_WINDOW_BYTES", "LimitNeed", "RemoteWindows", "fetch_bounds", "limit_block_sizes", "remote_cost"]

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
                 inflight: InFlight, replica: Replica, ahead: int = 2, batch_size: int = 1,
                 planned: bool = True) -> None:
        super().__init__(idx, bounds, inflight)
        self.store = store
        self.fields = list(fields)
        self.replica = replica
        self.ahead = max(1, int(ahead))
        self.batch_size = max(1, int(batch_size))
        self.planned = planned  # under a limit: evictions planned per window (windows of an order's blocks)
        self.pins: dict[int, Pin] = {}
        self.error: BaseException | None = None
        self.window_blocks: list[np.ndarray] | None = None
        self.last_use: np.ndarray | None = None
        self.victims: list[np.ndarray] | None = None  # under a limit: what window w's fetch evicts first
        self.released = 0  # windows [0, released) are read and unpinned
        self.turn = 0  # the next window whose evictions are due (they go in window order)
        self.plan: dict[str, Any] = {}

    def _plan_uses(self) -> None:
        """Under a cache limit: every window's blocks, and the last window of
        the epoch that reads each block. A window's block that a later window
        reads again (a block of the order straddles two of the replica's) is
        kept, not marked consumed, when its window is done (NOTE [blocks read
        again])."""
        nwin = len(self.bounds) - 1
        blocks = [self._blocks(w) for w in range(nwin)]
        last = np.full(self.replica.nblocks, -1, np.int64)
        first = np.full(self.replica.nblocks, nwin, np.int64)
        if blocks:
            which = np.repeat(np.arange(nwin), [len(b) for b in blocks])
            np.maximum.at(last, np.concatenate(blocks), which)
            np.minimum.at(first, np.concatenate(blocks), which)
        self.window_blocks, self.last_use = blocks, last
        if not self.planned:
            return
        ahead = self.ahead
        victims, refetch = self._simulate(first, ahead)
        while refetch and ahead > 1:  # fewer windows in flight leave room for what the epoch keeps
            ahead -= 1
            victims, refetch = self._simulate(first, ahead)
        self.ahead, self.victims = ahead, victims
        self.plan = {"ahead": ahead, "fetch_again": refetch}

    def _simulate(self, first: np.ndarray, ahead: int) -> tuple[list[np.ndarray], bool]:
        """The blocks each window's fetch evicts first, and whether a block
        the epoch read and reads again had to be (NOTE [order under a cache
        limit])."""
        rep = self.replica
        blocks, last = cast("list[np.ndarray]", self.window_blocks), cast("np.ndarray", self.last_use)
        limit = cast(int, rep.cache_limit)
        sizes = rep.sizes
        present = rep.state == 1  # present (NOTE [block states] in mmstore/remote/replica.py)
        evictable = np.ones(rep.nblocks, dtype=bool)
        evictable[rep.sticky] = False
        used = rep.disk_bytes()
        dead = np.argsort(last, kind="stable")  # not read again this epoch: the longest done first
        dead_last = last[dead]
        future = np.flatnonzero(present & evictable & (first < len(blocks)))  # cached, read later: the latest first
        future = future[np.argsort(-first[future], kind="stable")]
        neg_first = -first[future]
        dp = fp = 0
        victims: list[np.ndarray] = []
        refetch = False

        def take(seg: np.ndarray, over: int) -> tuple[np.ndarray, int]:
            """The first blocks of ``seg`` that are present and evictable, up
            to ``over`` bytes; and how far into ``seg`` they go."""
            ok = np.flatnonzero(present[seg] & evictable[seg])
            if not len(ok):
                return seg[:0], len(seg)
            cs = np.cumsum(sizes[seg[ok]])
            t = int(np.searchsorted(cs, over, side="left"))
            if t >= len(ok) - 1:
                return seg[ok], len(seg)
            return seg[ok[: t + 1]], int(ok[t]) + 1

        for j, win in enumerate(blocks):
            new = win[~present[win]]
            over = used + int(sizes[new].sum()) - limit
            out = []
            if over > 0:
                hi = int(np.searchsorted(dead_last, j - ahead, side="left"))
                got, step = take(dead[dp:hi], over)
                dp += step
                out.append(got)
                over -= int(sizes[got].sum())
            if over > 0:
                hi = int(np.searchsorted(neg_first, -j, side="left"))
                got, step = take(future[fp:hi], over)
                fp += step
                out.append(got)
                over -= int(sizes[got].sum())
            if over > 0:  # only blocks the epoch read and reads again are left
                busy = np.concatenate(blocks[max(0, j - ahead) : j + 1])
                cand = np.setdiff1d(np.flatnonzero(present & evictable), busy)
                cand = cand[np.argsort(-last[cand], kind="stable")]
                got, _ = take(cand, over)
                refetch = refetch or bool(len(got))
                out.append(got)
            got = np.concatenate(out) if out else np.zeros(0, np.int64)
            present[got] = False
            used += int(sizes[new].sum()) - int(sizes[got].sum())
            present[new] = True
            victims.append(got)
        return victims, refetch

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
        if self.victims is not None:
            return self._acquire_planned(w, blocks)
        while True:
            needed = w < self.need  # a submitted batch reads window w (WindowPass.ask: need = w + 1)
            pin = self.replica.acquire(blocks, ahead=not needed)
            if pin is not None:
                return pin
            with cv:
                if self.inflight.cancelled:
                    raise RuntimeError("cancelled")
                cv.wait(_ROOM_WAIT_S)

    def _acquire_planned(self, w: int, blocks: np.ndarray) -> Pin:
        """Window ``w`` under a limit, as planned: once the windows before
        ``w - ahead`` are read and unpinned (unless one batch reads both),
        and the windows before ``w`` have evicted theirs, evict ``w``'s
        victims, then fetch and pin its blocks without evicting anything
        else (NOTE [order under a cache limit])."""
        cv = self.inflight.cv
        bs, b = self.batch_size, self.bounds
        back = w - self.ahead - 1  # the last window that must be unpinned first
        wait = back >= 0 and (int(b[back + 1]) - 1) // bs < int(b[w]) // bs
        with cv:
            while not self.inflight.cancelled and (self.turn < w or (wait and self.released <= back)):
                cv.wait(0.1)
            if self.inflight.cancelled:
                raise RuntimeError("cancelled")
        victims = cast("list[np.ndarray]", self.victims)[w]
        try:
            self.replica.evict(victims)
        finally:
            with cv:
                self.turn = w + 1
                cv.notify_all()
        return cast("Pin", self.replica.acquire(blocks, evict=False))

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
        if pins:
            with self.inflight.cv:
                while self.released < len(self.bounds) - 1 and int(self.bounds[self.released + 1]) <= pos:
                    self.released += 1
                self.inflight.cv.notify_all()


# -- the order and its fetches under a cache limit ---------------------------------------

def _block_ranges(replica: Replica, spans: RecordSpans, slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each file of a fixed field that the replica fills block by block:
    the first and last replica block of each of ``slots``' records."""
    B = replica.block_bytes
    out = []
    for name, base, eb, first, end in spans.fixed:
        g0 = replica.first.get(name)
        if g0 is None:
            continue
        s = np.clip(slots, first, max(first, end - 1))
        a = base + s * eb
        out.append((g0 + a // B, g0 + (a + eb - 1) // B))
    return out


class LimitNeed:
    """What a block shuffle over ``slots`` (the slot of each position of the
    order, in the order's record numbering) needs of a replica's cache,
    whatever its seed (NOTE [order under a cache limit])."""

    def __init__(self, replica: Replica, spans: RecordSpans, slots: np.ndarray) -> None:
        self.replica = replica
        self.ranges = _block_ranges(replica, spans, np.asarray(slots, dtype=np.int64))
        self.n = len(slots)
        self.base = replica.whole_bytes + int(replica.sizes[replica.sticky].sum())
        self.all = replica.whole_bytes + replica.sparse_bytes  # a limit that holds every block
        self._seen: dict[int, tuple[np.ndarray, int]] = {}

    def footprints(self, block: int) -> tuple[np.ndarray, int]:
        """Bytes of the replica blocks each order block of ``block`` records
        touches (at most), and of the blocks two order blocks or more share."""
        got = self._seen.get(block)
        if got is None:
            got = self._seen[block] = self._footprints(block)
        return got

    def _footprints(self, block: int) -> tuple[np.ndarray, int]:
        B = self.replica.block_bytes
        cut = np.arange(0, self.n, block)
        fp = np.zeros(len(cut), np.int64)
        shared = 0
        for lo, hi in self.ranges:
            if not len(lo):
                continue
            a = np.minimum.reduceat(lo, cut)
            b = np.maximum.reduceat(hi, cut)
            fp += (b - a + 1) * B
            m = self.replica.nblocks + 1
            cover = np.bincount(a, minlength=m)[:m] - np.bincount(b + 1, minlength=m)[:m]
            shared += int(np.count_nonzero(np.cumsum(cover) >= 2)) * B
        return fp, shared

    def need(self, block: int, window: int, ahead: int) -> int:
        """The most bytes the cache holds at once: the files kept whole and
        the headers, ``ahead + 1`` windows in flight, and every block two
        order blocks share (kept from its first window to its last)."""
        fp, shared = self.footprints(block)
        top = np.sort(fp)[::-1][:window].sum()
        return min(self.all, self.base + (ahead + 1) * int(top) + shared)

    def sizes(self, limit: int, block: int, window: int, batch_size: int, *, fixed: bool,
              fixed_block: bool = False) -> tuple[int, int]:
        """``(block, window)`` for a block shuffle under ``limit``: the
        given ones when ``fixed`` (checked), else the largest block from
        ``block`` down (then the smallest above it; only ``block`` when
        ``fixed_block``), with the widest window up to ``window``, that fits.
        Raises ``CacheLimitError`` with the smallest limit that works."""
        if limit >= self.all:
            return block, window
        if fixed:
            least = self.need(block, window, 1)
            if least <= limit:
                return block, window
            raise CacheLimitError(
                f"{self.replica.url}: cache_limit {limit:,} bytes is too small for a block shuffle of block={block}, "
                f"window={window} to fetch each block once an epoch: it needs at least {least:,} bytes. Raise "
                "cache_limit, or leave block= and window= out and let the Loader size them for the limit")
        ks: list[int] = []  # the given block and smaller ones first, then larger ones (fewer shared blocks)
        k = max(1, block)
        while k > 1:
            ks.append(k)
            k = max(1, int(k * 0.75))
        ks.append(1)
        k = max(1, block)
        while k < self.n:
            k = min(self.n, max(k + 1, int(k * 1.33)))
            ks.append(k)
        if fixed_block:
            ks = [max(1, block)]
        best = (self.all, max(1, block), max(1, window))  # a limit that holds every block works with any sizes
        for ahead in (2, 1):
            for k in ks:
                fp, shared = self.footprints(k)
                top = np.cumsum(np.sort(fp)[::-1])
                least_m = min(len(top), max(1, -(-batch_size // k)))  # a window holds a batch at least
                room = (limit - self.base - shared) // (ahead + 1)
                fits = int(np.searchsorted(top, room, side="right"))  # windows of m blocks fit for m <= fits
                if fits >= least_m:
                    return k, max(least_m, min(window, fits))
                if ahead == 1:
                    need = min(self.all, self.base + shared + 2 * int(top[least_m - 1]))
                    if need < best[0]:
                        best = (need, k, least_m)
        need, k, m = best
        raise CacheLimitError(
            f"{self.replica.url}: cache_limit {limit:,} bytes is too small for a block shuffle to fetch each block "
            f"once an epoch: it needs at least {need:,} bytes (the files kept whole, two windows in flight and the "
            f"blocks two order blocks share; with block={k}, window={m}). Raise cache_limit to {need:,} or more")


def limit_block_sizes(kw: dict[str, Any], store: Store, fields: Sequence[str], indices: np.ndarray | None,
                      batch_size: int, block: int, window: int) -> dict[str, Any]:
    """``order="block"``'s sizes for a store opened from a URL under a cache
    limit (NOTE [order under a cache limit]); ``block``/``window`` are the
    sizes without a limit (or the ones given in ``kw``, then only checked)."""
    replica = store.replica
    if replica is None or replica.cache_limit is None:
        return {**kw, "block": block, "window": window}
    n = len(store) if indices is None else len(indices)
    pos = np.arange(n, dtype=np.int64) if indices is None else np.sort(np.asarray(indices, dtype=np.int64))
    slots = store.slot_view.slots_of(pos)
    need = LimitNeed(replica, RecordSpans(store.slot_view.backend, store.schema, fields), slots)
    k, m = need.sizes(replica.cache_limit, block, window, batch_size, fixed="window" in kw,
                      fixed_block=kw.get("block") is not None)
    return {**kw, "block": k, "window": m}
