"""One epoch of a :class:`~mmstore.torch.Loader`: its batches in flight and
its iterator.

* :class:`EpochBatches`: what the reader threads use (the epoch's order, the
  ring, the reads in flight, the window pass, the CUDA side stream). Its
  tasks sit in the loader's thread pool; it uses nothing of the loader (it
  only keeps it alive while its reads run) and does not reference the
  iterator.
* :class:`EpochIterator`: what ``iter(loader)`` returns; consumes the batches
  in order, one thread at a time. It keeps its loader alive through the
  loader's callbacks (as a list iterator keeps its list); the loader keeps
  only a weak reference to it, so dropping it ends the epoch at once.

The rules they implement are "Lifetime" in ``loader.py``'s docstring.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..engine.direct import DirectWindows
from ..engine.inflight import InFlight
from ..engine.reads import EpochReads, WindowPrefetch
from ..errors import LoaderStateError
from ._ragged import RaggedReader, tensors_of, to_device
from ._ring import Ring

__all__ = ["EpochBatches", "EpochIterator"]


class Cancelled(Exception):
    """The epoch was cancelled (ended, closed, dropped) while a step waited."""


class EpochBatches:
    """Batch ``k`` of an epoch is rows ``[k * batch_size, (k + 1) * batch_size)``
    of ``idx``, read into ring buffer ``(ring.cursor + k) % len(ring)`` in pieces of
    ``reads.piece_rows`` rows, one pool task each (so ``threads`` reads are in
    flight even for one batch). The first ``prefetch`` batches are queued at
    once; :meth:`submit` queues the others as buffers come free.

    ``device``: a CUDA device to copy batches to on a side stream, or None.
    ``guard_pinned``: CPU batches in pinned memory; the refill of a buffer
    waits for a CUDA event recorded on the current stream at the ``next()``
    that released it (a user's ``batch.cuda(non_blocking=True)``).
    ``check_kept``: the buffers' batches are yielded as they are (CPU, no
    copy); a buffer whose batch is still referenced is not refilled but
    replaced by a fresh one (``Ring.claim``, NOTE [kept batches]).

    ``ragged``: reads a batch's ragged fields (the record indices -> a dict
    of their torch forms); one more pool task per batch, its future kept
    with the batch's pieces (``ragged_futs``), its result merged into the
    batch by :meth:`host_batch`. When ``reads.ragged`` (lmdb: one lookup
    per record gives every field) the pieces read them with the fixed
    fields instead, and :meth:`host_batch` joins the pieces' results.

    ``owner`` (the loader) is only kept alive, never used: while a read of
    this epoch is queued or running, its loader is not garbage, so the
    loader's finalizer cannot close the files under a running read."""

    def __init__(
        self, idx: np.ndarray, *, batch_size: int, drop_last: bool, prefetch: int, ring: Ring,
        pool: ThreadPoolExecutor, reads: EpochReads, inflight: InFlight,
        window: WindowPrefetch | DirectWindows | None,
        device: torch.device | None, guard_pinned: bool, owner: object, check_kept: bool = False,
        ragged: RaggedReader | None = None,
    ) -> None:
        self._owner = owner
        self.idx = idx
        self.batch_size = batch_size
        n = len(idx)
        self.nbatches = n // batch_size if drop_last else -(-n // batch_size)
        self.ring, self.pool, self.reads, self.inflight, self.window = ring, pool, reads, inflight, window
        self.R = len(ring)
        self.base = ring.cursor  # batch k goes into buffer (base + k) % R: the ring cycles on across epochs
        self.device = device
        self.guard_pinned = guard_pinned
        self.check_kept = check_kept
        self.events: list[Any] = [None] * self.R
        self.ragged = ragged
        self.ragged_futs: list[Any] = [None] * self.R
        self.stream = None
        if device is not None:
            self.stream = inflight.stream = torch.cuda.Stream(device=device)
        try:
            if window is not None:
                window.start()
            for k in range(min(prefetch, self.nbatches)):
                self.submit(k)
        except BaseException:
            inflight.cancel("ended")
            inflight.wait()
            raise

    @property
    def cancelled(self) -> bool:
        return self.inflight.cancelled

    def slot(self, k: int) -> int:
        """The ring buffer of batch ``k``."""
        return (self.base + k) % self.R

    def bounds(self, k: int) -> tuple[int, int]:
        bs = self.batch_size
        return k * bs, min((k + 1) * bs, len(self.idx))

    def submit(self, k: int) -> None:
        """Queue the reads of batch ``k`` into its ring buffer."""
        s = self.slot(k)
        a, b = self.bounds(k)
        idx = self.idx[a:b]
        if self.cancelled:
            raise Cancelled()
        if self.guard_pinned:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.events[s] = ev
        ev = self.events[s]
        wait_win = -1
        if self.window is not None:
            wait_win = self.window.window_of(b - 1)
            self.window.ask(wait_win)
        views = self.ring.claim(s) if self.check_kept else self.ring.views[s]
        futs: list[Any] = []
        try:
            if self.ragged is not None and not self.reads.ragged:
                self.ragged_futs[s] = fut = self.pool.submit(self._ragged_task, idx)
                futs.append(fut)
            for lo in range(0, len(idx) if self.reads.fields else 0, self.reads.piece_rows):
                hi = min(lo + self.reads.piece_rows, len(idx))
                futs.append(self.pool.submit(self._task, idx, views, lo, hi, ev, wait_win, a))
            if self.ragged is not None and self.reads.ragged:
                self.ragged_futs[s] = list(futs)  # the pieces, in row order
            self.inflight.futs[s] = futs
            self._submit_hint(k + self.reads.willneed)
        except RuntimeError:  # the pool was shut down: Loader.close() from another thread
            self.inflight.futs[s] = futs
            if self.cancelled:
                raise Cancelled() from None
            raise

    def _submit_hint(self, ka: int) -> None:
        if self.reads.willneed and ka < self.nbatches:
            a, b = self.bounds(ka)
            self.pool.submit(self._hint_task, self.idx[a:b])

    def _task(self, idx: np.ndarray, slot: dict[str, np.ndarray], lo: int, hi: int, ev: Any, wait_win: int,
              a: int) -> Any:
        if self.cancelled:
            raise Cancelled()
        if ev is not None:
            ev.synchronize()  # the copy out of this pinned buffer has finished
        if wait_win >= 0:
            self.window.wait_for(wait_win)  # type: ignore[union-attr]
        copy_rows = getattr(self.window, "copy_rows", None)
        if copy_rows is None:
            got = self.reads.read(idx, slot, lo, hi)
        else:
            # window buffers (mmstore/engine/direct.py): the positional fields come out of them
            copy_rows(a + lo, self.reads.store.slot_view.slots_of(idx[lo:hi]),
                      {f: slot[f][lo:hi] for f in self.reads.files})
            got = self.reads.read(idx, slot, lo, hi, files=False)
        return None if got is None else self.ragged.piece(got)  # type: ignore[union-attr]

    def _ragged_task(self, idx: np.ndarray) -> dict[str, Any]:
        if self.cancelled:
            raise Cancelled()
        return self.ragged(idx)  # type: ignore[misc]

    def _hint_task(self, idx: np.ndarray) -> None:
        if not self.cancelled:
            try:
                self.reads.hint(idx)
            except OSError:
                pass

    def wait_batch(self, k: int) -> None:
        """Wait for batch ``k``'s reads; raise the first error among them."""
        futs = self.inflight.wait_slot(self.slot(k))
        if self.cancelled:
            raise Cancelled()
        for f in futs:
            exc = f.exception()
            if exc is not None:
                raise exc
        if self.window is not None:  # batches 0..k are read: windows before their end can go
            self.window.consumed(self.bounds(k)[1])

    def host_batch(self, k: int) -> dict[str, torch.Tensor]:
        a, b = self.bounds(k)
        out = self.ring.batch(self.slot(k), b - a)
        if self.ragged is not None:  # done: wait_batch(k) waited for it
            fut, self.ragged_futs[self.slot(k)] = self.ragged_futs[self.slot(k)], None
            if isinstance(fut, list):  # read by the pieces (reads.ragged)
                out.update(self.ragged.join([f.result() for f in fut]))
            else:
                out.update(fut.result())
        return out

    def to_gpu(self, k: int) -> tuple[dict[str, torch.Tensor], Any]:
        """Issue the copy of host batch ``k`` on the side stream; return the
        GPU tensors and the copy's event."""
        self.wait_batch(k)
        host = self.host_batch(k)
        with torch.cuda.stream(self.stream):
            gpu = {f: to_device(t, self.device) for f, t in host.items()}
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[self.slot(k)] = ev  # the reader of this buffer's next batch waits for it
        return gpu, ev


class EpochIterator:
    """The iterator ``iter(loader)`` returns: one pass over one epoch.

    ``on_used(epoch)`` is called once the epoch counts as used (its second
    batch, or its end; for an epoch resumed mid-way, the second batch this
    iterator yields, so a peek after ``load_state_dict`` keeps the resume);
    ``wrap(tensors, epoch, batch_index)`` turns a batch of tensors into what
    is yielded. ``offset``: the batches of the epoch before the first one
    read (a resume, ``Loader.load_state_dict``); batch ``k`` of
    ``batches`` is batch ``offset + k`` of the epoch. Both are the loader's, so the iterator keeps its loader alive;
    the loader keeps only a weak reference to the iterator, so dropping the
    iterator (``break``, ``del``, an exception) ends the epoch at once, by
    reference counting, without blocking: queued reads are cancelled and the
    next ``iter(loader)`` waits for the ones still running before it reuses
    the ring.
    """

    def __init__(
        self, batches: EpochBatches, epoch: int, *, prefetch: int, copy: bool,
        on_used: Callable[[int], None], wrap: Callable[[dict[str, torch.Tensor], int, int], Any],
        offset: int = 0,
    ) -> None:
        self._ep = batches
        self.inflight = batches.inflight
        self.epoch = epoch
        self.nbatches = batches.nbatches
        self.k = 0  # next batch to yield (of ``batches``)
        self.offset = offset
        self._prefetch = prefetch
        self._copy = copy
        self._on_used = on_used
        self._wrap = wrap
        self._busy = threading.Lock()
        self._pending_gpu: tuple[dict[str, torch.Tensor], Any] | None = None
        self._pending_exc: BaseException | None = None

    def live(self) -> bool:
        """Still being iterated in this process (not ended, closed, forked)."""
        t = self.inflight
        return not t.cancelled and t.pid == os.getpid()

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return self.nbatches

    def __next__(self) -> Any:
        pid = self.inflight.pid
        if pid != os.getpid():
            raise LoaderStateError(
                f"mmstore.torch.Loader: this iterator of epoch {self.epoch} was started in process "
                f"{pid} and cannot be continued in forked process {os.getpid()} (its reader "
                "threads exist only in the parent); start a new epoch here with iter(loader), "
                "which starts clean"
            )
        if not self._busy.acquire(blocking=False):
            raise LoaderStateError(
                "mmstore.torch.Loader: two threads called next() on the same epoch iterator at once; "
                "an epoch is consumed by one thread at a time (use one Loader per thread)"
            )
        try:
            return self._next()
        finally:
            self._busy.release()

    def _next(self) -> Any:
        ep = self._ep
        k = self.k
        if ep.cancelled:
            self._raise_cancelled()
        if self._pending_exc is not None:  # batch k's read failed while batch k - 1 was prepared
            exc, self._pending_exc = self._pending_exc, None
            self._end()
            raise exc
        if k >= self.nbatches:
            self._on_used(self.epoch)
            self._end()
            raise StopIteration
        try:
            out = self._batch(k)
        except Cancelled:
            self._raise_cancelled()
        except BaseException:
            self._end()
            raise
        self.k = k + 1
        if k == 1:  # a second batch (not a peek): the epoch is used. A resumed epoch too: a peek
            # at its first remaining batch (next(iter(loader)) after load_state_dict) keeps the resume
            self._on_used(self.epoch)
        return self._wrap(out, self.epoch, self.offset + k)

    def _batch(self, k: int) -> dict[str, torch.Tensor]:
        ep = self._ep
        # the buffer of the oldest batch (k + prefetch - len(ring)) takes batch k + prefetch
        if k + self._prefetch < self.nbatches:
            ep.submit(k + self._prefetch)
        if ep.device is not None:
            return self._next_gpu(k)
        ep.wait_batch(k)
        out = ep.host_batch(k)
        if self._copy:  # a numpy copy: no torch intra-op (OpenMP) threads, which hang
            # in a forked child once the parent used them
            # (ragged fields are fresh for every batch already)
            out = {f: torch.from_numpy(t.numpy().copy()) if isinstance(t, torch.Tensor) else t
                   for f, t in out.items()}
        return out

    def _next_gpu(self, k: int) -> dict[str, torch.Tensor]:
        ep = self._ep
        cur = self._pending_gpu if self._pending_gpu is not None else ep.to_gpu(k)
        self._pending_gpu = None
        if k + 1 < self.nbatches:
            try:
                self._pending_gpu = ep.to_gpu(k + 1)
            except Cancelled:
                raise
            except Exception as exc:  # noqa: BLE001 - batch k + 1's error, raised when it is asked for
                self._pending_exc = exc
        gpu, ev = cur
        stream = torch.cuda.current_stream(ep.device)
        stream.wait_event(ev)
        for v in gpu.values():
            for t in tensors_of(v):
                t.record_stream(stream)
        return gpu

    def _raise_cancelled(self) -> None:
        if self.inflight.reason == "closed":
            raise LoaderStateError(
                f"mmstore.torch.Loader: the loader was closed (Loader.close()) while epoch {self.epoch} "
                f"was being iterated, after {self.k} of {self.nbatches} batches; the epoch did not "
                "complete. Start a new epoch with iter(loader) if that was not intended"
            ) from None
        raise StopIteration

    def _end(self) -> None:
        """End this epoch: cancel what is queued, wait for what runs."""
        self.inflight.cancel("ended")
        self.inflight.wait()

    def close(self) -> None:
        """End this epoch early: cancel what is queued, wait for what runs
        (nothing writes into the ring after this returns). Later ``next()``
        calls raise ``StopIteration``; ``iter(loader)`` starts the next epoch."""
        if self.inflight.pid != os.getpid():
            return
        self._end()

    def __del__(self) -> None:
        # dropped (break, del, an exception, garbage collection in any thread):
        # cancel without waiting; the next iter(loader) waits for what still runs.
        # An epoch that ended (its last batch, close()) returns at once: a signal's
        # exception raised inside a finalizer is lost (printed, not raised), so the
        # finalizer that runs after every finished epoch does as little as it can,
        # and a Ctrl-C at the end of an epoch stops the loop
        if self.inflight.cancelled:
            return
        try:
            self.inflight.cancel("ended")
        except Exception:  # noqa: BLE001
            pass
