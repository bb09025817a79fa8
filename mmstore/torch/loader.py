"""``Loader``: batches from a store with threads, no worker processes.

Why threads
-----------
A ``DataLoader`` with worker processes copies every batch into freshly
allocated shared memory and hands it across processes; on a small machine
that copy and the inter-process traffic, not the reads, set the ceiling.
Reads from a store are plain copies out of the page cache, and the calls that
do them release the GIL (``os.preadv``; ``ctypes.memmove`` for the mmap/LMDB
path), so one process with a few threads keeps several batches in flight and
writes them straight into a ring of reusable (optionally pinned) buffers.

How a batch is read
-------------------
The epoch's indices come from an :class:`mmstore.order.Order` (one ``int64``
array). Batch ``k`` is rows ``[k * batch_size, (k + 1) * batch_size)``. It is
cut into pieces of about ``piece_bytes``; each piece is one task for the
thread pool, so ``threads`` reads are in flight (queue depth) even for one
batch. Per piece:

* memmap stores whose files are not all in the page cache at the start of
  the epoch, fields of at least 2 KiB per record: ``os.preadv`` of each
  record (consecutive records in one call) from the field's ``.npy`` at
  ``data_offset + slot * entry_bytes`` into the batch buffer's rows, through
  the loader's own file descriptors (queue depth = ``threads``);
* cached memmap stores, smaller fields (labels), LMDB stores:
  ``Store.read_batch(piece, out=views)`` (``ctypes.memmove`` out of the
  mapping, GIL released; a numpy gather for small fields).

Kernel hints (preadv epochs): ``POSIX_FADV_RANDOM`` on the loader's descriptors for shuffled
orders (no useless readahead around 150 KB records), ``POSIX_FADV_SEQUENTIAL``
for sequential ones, and ``POSIX_FADV_WILLNEED`` on the records of the batch
``willneed`` batches after the newest one submitted (skipped when the store was
found resident at the start of the epoch). For a
:class:`mmstore.order.BlockShuffle` a window thread asks for each window's
blocks (a few long ``WILLNEED`` ranges, or long ``preadv`` reads) one window
ahead of the batches, which then read from memory or wait on pages already in
flight: the block shuffle's locality becomes long disk reads.

Buffer lifetime (the contract)
------------------------------
The loader owns a ring of ``prefetch + hold`` batch buffers and reuses them.
**A CPU batch yielded by the loader stays valid until the call of ``next()``
that yields the ``hold``-th batch after it** (that call starts refilling its
buffer): with the default ``hold=1`` a batch is valid until the next
``next()`` call on the iterator, i.e. for the body of a plain
``for batch in loader:`` loop; with ``hold=2`` the previous batch is also
still intact, and so on. To keep a batch longer, ``.clone()`` what you
keep, raise ``hold``, or pass ``copy=True`` (every batch is then a fresh
copy). ``batch[...]`` tensors of the last batch stay valid until the next
epoch starts. Never write into a yielded batch if you expect later batches to
be unaffected by it (buffers are overwritten, not reallocated).

With ``device="cuda"`` the batch is copied (uint8, non-blocking, from pinned
host buffers) on a side stream; the yielded GPU tensors are fresh
allocations that belong to the caller (no lifetime limit), the current stream
waits for the copy's event before it can use them, and they are marked with
``record_stream`` so the caching allocator does not hand their memory out
again while the caller's stream still uses them. A host buffer is refilled
only after the event of the copy out of it has completed.

With ``pin_memory=True`` and CPU batches, a ``batch.cuda(non_blocking=True)``
issued in the loop body may still be reading the pinned buffer when the
loader refills it: each ``next()`` records a CUDA event on the current stream
of the current device, and the refill of a buffer released by that call waits
for it. Copies issued on other streams are not covered: synchronize them
yourself, or use ``device="cuda"``.

Lifetime: epochs, threads, processes (the contract)
---------------------------------------------------
* **One epoch at a time.** ``iter(loader)`` while an earlier iterator of it is
  still live (not exhausted, not closed, still referenced) raises
  :class:`~mmstore.errors.LoaderStateError`, never ends that epoch short.
  An epoch ends when its iterator is exhausted, ``.close()``-d, or dropped:
  ``break`` out of a ``for`` loop, ``del it``, an exception. The loader holds
  only a weak reference to its iterator, so dropping it ends the epoch at
  once; the iterator holds the loader (as a list iterator holds its list).
* **Epoch numbers.** An iteration runs the epoch set with :meth:`Loader.set_epoch`,
  else the one after the last used. The number is used once the iterator
  yields its *second* batch (or is exhausted). A peek,
  ``next(iter(loader))``, used nothing: the next loop runs the same epoch
  from its first batch (a capped loop of two or more batches moves on).
* **Threads.** An iterator is consumed by one thread at a time: a
  ``next()`` while another thread is inside ``next()`` raises
  ``LoaderStateError`` (and so does a second thread's ``iter(loader)``, by
  the rule above). Use one Loader per thread.
* **close.** ``Loader.close()``, from any thread, ends the epoch in
  progress: the consumer's next ``next()`` raises ``LoaderStateError`` (it
  never looks like a completed epoch). ``iterator.close()`` ends it quietly
  (``StopIteration``). A closed loader reopens on the next ``iter()``.
* **Errors.** A read error of batch ``k`` is raised by the ``next()`` that
  would yield batch ``k``, after batches ``0 .. k-1`` were delivered (also
  on the CUDA path, which prepares batch ``k + 1`` ahead); the epoch then
  ends (``StopIteration`` after it) and the loader can start another.
* **Garbage.** Nothing blocks in a finalizer: a dropped iterator or loader
  cancels its queued reads and shuts its threads down without waiting (the
  collector may run them in any thread, a reader thread included). Loader
  and iterator form no reference cycle, so reference counting frees threads,
  descriptors and buffers as soon as the last reference goes.
* **fork.** In a forked child an inherited loader drops the parent's
  threads, futures and descriptors without touching them; ``iter()`` starts
  clean, ``close()`` returns at once, and continuing an inherited iterator
  raises ``LoaderStateError``. **Pickling** (spawn, forkserver) carries the
  configuration, the store and the epoch counter; the copy opens its own
  threads and files.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait
from typing import Any

import numpy as np
import torch

from .. import _sys
from .._runs import SMALL_RECORD_BYTES
from ..errors import LoaderStateError
from ..order import BlockShuffle, Order, Sequential, contiguous_ranges
from ..reader import Store
from .dataset import _image_fields, open_store_arg
from .sampler import build_order

__all__ = ["Loader"]

_PREAD_MIN_BYTES = SMALL_RECORD_BYTES  # smaller fields are gathered by the backend, not pread
_MiB = 1 << 20


class _Cancelled(Exception):
    pass


class Loader:
    """Shuffled batches from a store, read by threads into reusable buffers.

    Parameters
    ----------
    store : mmstore.Store or path
    batch_size : int
    order : Order or str, default "permutation"
        An :class:`mmstore.order.Order`, or a kind name (``"permutation"``,
        ``"block"``, ``"sequential"``) built for this rank (``rank``,
        ``world_size``, else ``torch.distributed``, else a single process).
    fields : sequence of str, optional
        Fields to read (default all), also the tuple order with ``as_tuple``.
    drop_last : bool, default False
        Drop the last, short batch of the epoch.
    device : str or torch.device, optional
        ``"cuda"`` (or ``"cuda:N"``): yield GPU tensors, copied asynchronously
        on a side stream. Default: CPU tensors.
    pin_memory : bool, optional
        Allocate the ring in pinned memory (default: when ``device`` is CUDA).
        Without CUDA it is not possible: a warning is given and plain memory
        is used. With CPU batches, a buffer is refilled only after the work
        queued on the current CUDA stream before the ``next()`` that released
        it (a ``batch.cuda(non_blocking=True)``) is done.
    prefetch : int, default 4
        Batches read ahead while the caller works on the current one.
    hold : int, default 1
        How many of the most recent batches stay valid (see the module
        docstring's buffer contract).
    copy : bool, default False
        Yield a fresh copy of every batch (no lifetime limit; costs a copy).
    threads : int, optional
        Reader threads (default 16: queue depth for cold reads; the reads
        release the GIL).
    as_tuple, chw : bool
        As for :class:`StoreDataset`.
    seed, rank, world_size, rank_drop_last, **order_kw
        For building ``order`` from a kind (``rank_drop_last`` is
        ``DistributedSampler``'s ``drop_last``).
    warm : bool or "background", default False
        Before the first batch, read the fields' files once sequentially into
        the page cache (``mmstore._sys.warm``; a warning when they do not fit
        in the available memory). ``"background"``: start that pass in a
        thread and read batches meanwhile. The report is ``loader.warm_report``.
    hints : bool, default True
        Give the kernel access hints (fadvise RANDOM/SEQUENTIAL/WILLNEED).
    willneed : int, default 2
        Batches beyond the ones in flight whose records get ``WILLNEED``.
    method : {"auto", "pread", "mmap"}
        How memmap fields are read. "pread": ``preadv`` for fields of at
        least 2 KiB per record (a numpy gather for smaller ones); "mmap":
        ``Store.read_batch`` (memmove out of the mapping); "auto" (default):
        "mmap" for an epoch that starts with the fields' files in the page
        cache, "pread" otherwise (see NOTE [warm vs cold reads]).
    piece_bytes : int, default 2 MiB
        Target size of one read task in preadv epochs (queue depth for cold
        reads); epochs read by memmove use one piece per CPU core instead.
    window_prefetch : {"willneed", "read", False}, default "willneed"
        For block-shuffle orders whose files are not already cached: bring
        each window's blocks into the page cache with long reads one window
        ahead of the batches (see :meth:`_read_window`). True means
        "willneed" (measured faster here: the kernel reads, no copy).
    window_threads : int, default 8
        Concurrent long reads of the window pass ("read").

    Iterating yields one epoch; the epoch is the one set with
    :meth:`set_epoch`, else one more than the last one used (starting at 0).
    One epoch runs at a time: ``iter()`` while an iterator is live raises
    :class:`~mmstore.errors.LoaderStateError` (see the module docstring,
    "Lifetime", for peeks, threads, ``close``, ``fork`` and pickling).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        batch_size: int,
        order: Order | str = "permutation",
        *,
        fields: Sequence[str] | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        prefetch: int = 4,
        hold: int = 1,
        copy: bool = False,
        threads: int | None = None,
        as_tuple: bool = False,
        chw: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        rank_drop_last: bool = False,
        warm: bool | str = False,
        hints: bool = True,
        willneed: int = 2,
        method: str = "auto",
        piece_bytes: int = 2 * _MiB,
        window_prefetch: bool | str = "willneed",
        window_threads: int = 8,
        **order_kw: Any,
    ) -> None:
        self._own_store = not isinstance(store, Store)
        self.store = open_store_arg(store)
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(prefetch) < 1 or int(hold) < 1:
            raise ValueError(f"prefetch and hold must be >= 1, got {prefetch} and {hold}")
        if method not in ("auto", "pread", "mmap"):
            raise ValueError(f"method must be 'auto', 'pread' or 'mmap', got {method!r}")
        if warm not in (False, True, "background"):
            raise ValueError(f"warm must be False, True or 'background', got {warm!r}")
        self.batch_size = int(batch_size)
        self.fields = tuple(self.store._field_list(fields))
        self.order = build_order(
            order, len(self.store), seed=seed, rank=rank, world_size=world_size,
            drop_last=rank_drop_last,
            record_bytes=max(1, sum(self.store.schema[f].nbytes for f in self.fields)), **order_kw,
        )
        self.drop_last = bool(drop_last)
        self.device = torch.device(device) if device is not None else None
        self._cuda = self.device is not None and self.device.type == "cuda"
        if self._cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} but torch.cuda.is_available() is False")
        if self.device is not None and self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        if pin_memory is None:
            pin_memory = self._cuda
        if pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "mmstore.torch.Loader: pin_memory=True needs CUDA, which is not available; "
                "using ordinary memory", UserWarning, stacklevel=2,
            )
            pin_memory = False
        self.pin_memory = bool(pin_memory)
        self.prefetch = int(prefetch)
        self.hold = int(hold)
        self.copy = bool(copy)
        self.threads = int(threads) if threads is not None else 16
        self.as_tuple = bool(as_tuple)
        self.chw = bool(chw)
        self.warm = warm
        self.hints = bool(hints)
        self.willneed = max(0, int(willneed))
        self.method = method
        self.piece_bytes = max(1, int(piece_bytes))
        if window_prefetch is True:
            window_prefetch = "willneed"
        if window_prefetch not in (False, None, "read", "willneed"):
            raise ValueError(f"window_prefetch must be 'read', 'willneed' or False, got {window_prefetch!r}")
        self.window_prefetch = window_prefetch or False
        self.window_threads = max(1, int(window_threads))
        self.warm_report: _sys.WarmReport | None = None
        self._warmed = False
        self._images = _image_fields(self.store, self.fields) if self.chw else set()
        self._tdtypes = {f: torch.from_numpy(np.empty(0, self.store.schema[f].dtype)).dtype for f in self.fields}
        self._config = {
            "batch_size": self.batch_size, "fields": self.fields, "drop_last": self.drop_last,
            "device": None if self.device is None else str(self.device), "pin_memory": self.pin_memory,
            "prefetch": self.prefetch, "hold": self.hold, "copy": self.copy, "threads": self.threads,
            "as_tuple": self.as_tuple, "chw": self.chw, "warm": self.warm, "hints": self.hints,
            "willneed": self.willneed, "method": self.method, "piece_bytes": self.piece_bytes,
            "window_prefetch": self.window_prefetch, "window_threads": self.window_threads,
        }
        self._epoch: int | None = None
        self._next_epoch = 0
        # per-process resources; released without blocking when the loader is
        # garbage (see "Lifetime" in the module docstring)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release, False)
        self._active: weakref.ref[_EpochRun] | None = None  # the iterator of the epoch in progress
        self._tasks: _Tasks | None = None  # the last epoch's reads: waited for before the ring is reused
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    # the per-process resources, by their historical names
    @property
    def _pool(self) -> ThreadPoolExecutor | None:
        return self._res.pool

    @property
    def _fds(self) -> dict[str, _FieldFiles]:
        return self._res.fds

    @property
    def _ring(self) -> list[dict[str, torch.Tensor]] | None:
        return self._res.ring

    # -- public ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next iteration."""
        self._epoch = int(epoch)

    def __len__(self) -> int:
        n = len(self.order)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        with self._guard():
            self._end_previous()
            epoch = self._next_epoch if self._epoch is None else self._epoch
            self._setup()
            if self.warm and not self._warmed:
                self._do_warm()
            run = _EpochRun(self, epoch)
            self._active = weakref.ref(run)
        return run

    def close(self) -> None:
        """Stop reading, free the threads, buffers and descriptors.

        An epoch still being iterated ends: its iterator's next ``next()``
        raises :class:`~mmstore.errors.LoaderStateError` (also when ``close``
        is called from another thread). A later ``iter(loader)`` opens
        everything again.
        """
        with self._guard():
            run = self._active() if self._active is not None else None
            self._active = None
            if run is not None:
                run._ep.tasks.cancel("closed")
            if self._tasks is not None:
                self._tasks.cancel("closed")
                self._tasks.wait()
                self._tasks = None
            self._res.release(True)
            if self._own_store:  # opened from a path: unmap (lets eviction drop the pages)
                self.store.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pickling: the configuration; the copy opens its own threads and files --
    def __getstate__(self) -> dict[str, Any]:
        return {
            "store": self.store, "own_store": self._own_store, "order": self.order, "config": self._config,
            "epoch": self._epoch, "next_epoch": self._next_epoch, "warmed": self._warmed,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        order = state["order"]
        self.__init__(  # type: ignore[misc]
            state["store"], order=order, rank=order.rank, world_size=order.world_size, **state["config"]
        )
        self._own_store = state["own_store"]
        self._epoch, self._next_epoch, self._warmed = state["epoch"], state["next_epoch"], state["warmed"]

    # -- epochs --------------------------------------------------------------------
    def _guard(self) -> threading.Lock:
        """This process's lock (one inherited through ``fork`` may be held by
        a thread that does not exist here)."""
        pid = os.getpid()
        if self._lock_pid != pid:
            self._lock = threading.Lock()
            self._lock_pid = pid
        return self._lock

    def _end_previous(self) -> None:
        """Refuse to start an epoch while one is being iterated; wait until
        the reads of an ended or abandoned one no longer write into the ring."""
        run = self._active() if self._active is not None else None
        if run is not None and run._live():
            raise LoaderStateError(
                f"mmstore.torch.Loader: epoch {run.epoch} is still being iterated ({run.k} of "
                f"{run.nbatches} batches yielded); one Loader runs one epoch at a time. Finish that loop, "
                "or end it early: `break` out of the `for` loop, or `del`/`.close()` the iterator; "
                "for two concurrent streams (or two threads) use two Loaders"
            )
        self._active = None
        if self._tasks is not None:  # abandoned (its iterator was dropped) or ended
            self._tasks.cancel("ended")
            self._tasks.wait()  # no-op in a forked child: the parent's threads do not run here
            self._tasks = None  # (only once waited for: an interrupted wait is redone next time)

    def _commit(self, epoch: int) -> None:
        """Epoch ``epoch`` counts as used: the next iteration takes the next one."""
        if self._epoch == epoch:
            self._epoch = None
        self._next_epoch = epoch + 1

    def __repr__(self) -> str:
        return (
            f"<mmstore.torch.Loader {self.store.path!r} batch_size={self.batch_size} "
            f"order={type(self.order).__name__} prefetch={self.prefetch} hold={self.hold} "
            f"threads={self.threads} device={self.device}>"
        )

    @property
    def ring_size(self) -> int:
        """Number of batch buffers the loader cycles through."""
        return self.prefetch + self.hold

    # -- setup -------------------------------------------------------------------
    def _setup(self) -> None:
        res = self._res
        if res.pid != os.getpid():  # first use, or used after fork: nothing inherited is ours
            res.adopt()
        if res.pool is None:
            res.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mmstore-loader")
        backend = self.store.backend  # open the backend in this thread, before the readers
        try:
            backend.prepare(self.fields)  # map the fields / open the environment once, outside the threads
        except OSError as exc:
            raise _fd_limit(self.store, exc) from None
        self.store.index  # noqa: B018 - map the index once, outside the threads
        if backend.positional and self.method != "mmap" and not res.fds:
            for f in self.fields:
                if self.store.schema[f].nbytes >= _PREAD_MIN_BYTES or self.method == "pread":
                    if self.store.schema[f].nbytes == 0:
                        continue
                    try:
                        res.fds[f] = _FieldFiles(backend.field_segments(f))
                    except OSError as exc:
                        raise _fd_limit(self.store, exc) from None
        if res.ring is None:
            res.ring = [self._alloc_slot() for _ in range(self.ring_size)]

    def _alloc_slot(self) -> dict[str, torch.Tensor]:
        slot = {}
        for f in self.fields:
            shape = (self.batch_size, *self.store.schema[f].shape)
            slot[f] = torch.empty(shape, dtype=self._tdtypes[f], pin_memory=self.pin_memory)
        return slot

    def _data_paths(self) -> list[str]:
        backend = self.store.backend
        if backend.positional:  # only the fields this loader reads
            paths = [seg.path for f in self.fields for seg in backend.field_segments(f)]
        else:
            paths = backend.data_paths()
        if self.store.records < self.store.slots:
            paths.append(os.path.join(self.store.path, "_index.npy"))
        return paths

    def _do_warm(self) -> None:
        self._warmed = True
        paths = self._data_paths()
        if self.warm == "background":
            self._res.warm_handle = _sys.warm_in_background(paths)
            return
        self.warm_report = rep = _sys.warm(paths)
        if not rep.complete:
            warnings.warn(
                f"mmstore.torch.Loader(warm=True): warmed {rep.bytes_read:,} of {rep.bytes_total:,} bytes "
                f"({rep.reason}); the rest is read from disk", UserWarning, stacklevel=3,
            )

    def _resident_fraction(self) -> float:
        tot = res = 0
        for p in self._data_paths():
            try:
                r, s = _sys.resident_bytes(p)
            except (OSError, NotImplementedError):
                return 0.0
            res += r
            tot += s
        return res / tot if tot else 1.0

    # -- reading (pool threads) --------------------------------------------------------
    def _read_piece(
        self, idx: np.ndarray, slot: dict[str, np.ndarray], lo: int, hi: int,
        fds: dict[str, _FieldFiles],
    ) -> None:
        store = self.store
        part = idx[lo:hi]
        rest = [f for f in self.fields if f not in fds]
        if fds:
            slots = store.slots_of(part)
            for f, ff in fds.items():
                ff.read(slots, slot[f][lo:hi])
        if rest:
            store.read_batch(part, fields=rest, out={f: slot[f][lo:hi] for f in rest})

    def _hint(self, idx: np.ndarray) -> None:
        if not self._fds or len(idx) == 0:  # only called when the epoch reads with preadv
            return
        slots = self.store.slots_of(idx)
        starts, stops = contiguous_ranges(slots)
        for ff in self._fds.values():
            for a, b in zip(starts.tolist(), stops.tolist()):
                for fd, pos, length in ff.ranges(a, b):
                    os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)

    def _read_window(self, idx: np.ndarray, run: _Epoch) -> None:
        """Bring a window's records into the page cache with long reads.

        ``window_prefetch="read"``: the window's contiguous runs of slots are
        read with ``preadv`` in chunks of up to 8 MiB by ``window_threads``
        threads (so several long requests are in flight), and the batches of
        the window wait until it is done. ``"willneed"``: one
        ``POSIX_FADV_WILLNEED`` per run; the kernel reads them with large
        requests in the background and the batches' reads wait on the pages
        in flight instead of issuing small random reads of their own.
        """
        if len(idx) == 0:
            return
        slots = self.store.slots_of(idx)
        starts, stops = contiguous_ranges(slots)
        targets = list(self._fds.values())
        if not targets:  # lmdb / mmap: touch the records through read_batch in order
            srt = np.sort(slots)
            for a in range(0, len(srt), 256):
                if run.cancelled:
                    return
                self.store.read_batch(np.asarray(self._slot_to_index(srt[a : a + 256])), fields=self.fields)
            return
        chunks = []
        for ff in targets:
            for a, b in zip(starts.tolist(), stops.tolist()):
                for fd, pos, length in ff.ranges(a, b):
                    if self.window_prefetch == "willneed":
                        chunks.append((fd, pos, length))
                        continue
                    end = pos + length
                    while pos < end:
                        step = min(8 * _MiB, end - pos)
                        chunks.append((fd, pos, step))
                        pos += step
        if self.window_prefetch == "willneed":
            for fd, pos, length in chunks:
                if run.cancelled:
                    return
                os.posix_fadvise(fd, pos, length, os.POSIX_FADV_WILLNEED)
            return
        futs = [run.win_pool.submit(  # type: ignore[union-attr]
            self._read_chunk, fd, pos, length, run) for fd, pos, length in chunks]
        _wait(futs)
        for f in futs:
            if f.exception() is not None and not run.cancelled:
                raise f.exception()  # type: ignore[misc]

    _tls = threading.local()

    def _read_chunk(self, fd: int, pos: int, length: int, run: _Epoch) -> None:
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = memoryview(bytearray(2 * _MiB))
        end = pos + length
        while pos < end and not run.cancelled:
            got = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
            if got <= 0:
                break
            pos += got

    def _slot_to_index(self, slots: np.ndarray) -> np.ndarray:
        ix = self.store.index
        if ix is None:
            return slots
        return np.searchsorted(ix, slots.astype(ix.dtype)).astype(np.int64)

    # -- output ----------------------------------------------------------------------
    def _wrap(self, tensors: dict[str, torch.Tensor]) -> Any:
        out = {}
        for f in self.fields:
            t = tensors[f]
            if f in self._images:
                t = t.permute(0, 3, 1, 2)
            out[f] = t
        if self.as_tuple:
            return tuple(out[f] for f in self.fields)
        return out


def _fd_limit(store: Store, exc: OSError) -> OSError:
    """Out of descriptors on a merged store: say why and what to do."""
    import errno

    from ..errors import ResourceLimitError

    if exc.errno not in (errno.EMFILE, errno.ENFILE) or isinstance(exc, ResourceLimitError) or not store.segments:
        return exc
    from ..backends.segmented import limit_error

    per = len(store.fields) + 1  # mapped + opened for preadv
    return limit_error(store.path, len(store.segments), per, exc)


class _FieldFiles:
    """A memmap field's open files for ``preadv`` epochs: one per segment of
    the store (a merged store has several; see format.py, "Segments")."""

    def __init__(self, segments: list[Any]) -> None:
        self.fds: list[int] = []
        try:
            for seg in segments:
                self.fds.append(os.open(seg.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except BaseException:
            self.close()
            raise
        self.offs = [seg.offset for seg in segments]
        self.firsts = np.array([seg.first for seg in segments] + [segments[-1].first + segments[-1].count], np.int64)
        self.nb = segments[0].entry_bytes

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def read(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Record ``slots[j]`` into ``out[j]``."""
        nb = self.nb
        if len(self.fds) == 1:
            _sys.pread_records(self.fds[0], self.offs[0] + slots * nb, nb, out)
            return
        seg = np.searchsorted(self.firsts, slots, side="right") - 1
        offs = np.asarray(self.offs, np.int64)[seg] + (slots - self.firsts[seg]) * nb
        _sys.pread_records_multi(np.asarray(self.fds, np.int64)[seg], offs, nb, out)

    def ranges(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(fd, offset, length)`` of the global slot range ``[a, b)``, cut at
        segment boundaries."""
        out = []
        k = int(np.searchsorted(self.firsts, a, side="right")) - 1
        while a < b and k < len(self.fds):
            hi = min(b, int(self.firsts[k + 1]))
            if hi > a:
                lo = a - int(self.firsts[k])
                out.append((self.fds[k], self.offs[k] + lo * self.nb, (hi - a) * self.nb))
            a = hi
            k += 1
        return out


class _Resources:
    """A Loader's resources in one process: the reader pool, the ``preadv``
    descriptors, the ring, a background warm pass. Referenced by the loader
    and by its ``weakref.finalize``; references neither the loader nor an
    epoch."""

    def __init__(self) -> None:
        self.pid = -1
        self.pool: ThreadPoolExecutor | None = None
        self.fds: dict[str, _FieldFiles] = {}
        self.ring: list[dict[str, torch.Tensor]] | None = None
        self.warm_handle: _sys.WarmHandle | None = None

    def adopt(self) -> None:
        """Start clean in this process. After ``fork`` the parent's pool, its
        futures and its warm thread do not run here and their locks may be
        held forever: they are dropped untouched; the descriptors are this
        process's own copies and are closed."""
        self.pool = None
        self.warm_handle = None
        self._close_fds()
        self.ring = None
        self.pid = os.getpid()

    def release(self, wait: bool) -> None:
        """Shut the pool down, close the descriptors, drop the ring.

        ``wait=False`` (the finalizer of a loader that became garbage, which
        may run in any thread, a pool thread included) blocks on nothing:
        queued reads are cancelled and the threads exit when their current
        read is done (nothing of the loader is left for them to write into)."""
        if self.pid != os.getpid():  # inherited through fork: nothing here is ours to stop
            self.adopt()
            return
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
        warm, self.warm_handle = self.warm_handle, None
        if warm is not None:
            warm.stop()
            if wait:
                try:
                    warm.join()
                except Exception:  # noqa: BLE001 - a failed warm pass is not fatal at close
                    pass
        self._close_fds()
        self.ring = None

    def _close_fds(self) -> None:
        fds, self.fds = self.fds, {}
        for ff in fds.values():
            ff.close()


class _Tasks:
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
        self.stream: Any = None

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
                _wait(futs)
                self.futs[i] = None
        t = self.win_thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self.win_thread = None
        if self.stream is not None:
            self.stream.synchronize()


class _Epoch:
    """The state of one epoch that the reader threads use: the order, the
    ring's numpy views, the reads in flight. Referenced by the epoch's
    iterator and by the tasks in the pool; the loader does not reference it."""

    def __init__(self, loader: Loader, epoch: int) -> None:
        self.loader = L = loader
        self.epoch = epoch
        self.idx = L.order.epoch(epoch)
        n = len(self.idx)
        bs = L.batch_size
        self.nbatches = n // bs if L.drop_last else -(-n // bs)
        self.R = L.ring_size
        self.tasks = _Tasks(self.R)
        L._tasks = self.tasks  # from now on the next iter()/close() waits for these reads
        self.events: list[Any] = [None] * self.R
        # pinned CPU batches: a user's `batch.cuda(non_blocking=True)` may still
        # read a buffer when next() is called; its refill waits for an event
        # recorded on the current stream at that call
        self.guard_pinned = L.pin_memory and not L._cuda
        # this epoch's buffers (Loader.close() from another thread may drop the loader's)
        self.ring: list[dict[str, torch.Tensor]] = L._ring or []
        self.np_ring = [{f: t.numpy() for f, t in slot.items()} for slot in self.ring]
        rb = sum(L.store.schema[f].nbytes for f in L.fields) or 1
        self.piece_rows = max(1, L.piece_bytes // rb)
        shuffled = not isinstance(L.order, Sequential)
        block = bool(L.window_prefetch) and isinstance(L.order, BlockShuffle) and n > 0
        # NOTE [warm vs cold reads]: measured here (2 cores, 150 KB records),
        # memmove out of the mapping (GIL released) served ~2x more samples/s
        # than preadv when the store is in the page cache (no page-table
        # faults once mapped; a user-space copy), while preadv did ~1.5x better
        # cold (one read per record at queue depth ``threads``, where a fault
        # reads around the faulting page). So "auto" picks per epoch.
        self.resident = L._resident_fraction() if (L._fds or block) else 1.0
        cached = self.resident >= 0.99
        self.fds = {} if (L.method == "auto" and cached) else L._fds
        if not self.fds:
            # memmove epochs are CPU-bound: one piece per core (measured ~2x
            # faster than 2 MiB pieces here: fewer Python calls per batch)
            self.piece_rows = max(self.piece_rows, -(-L.batch_size // max(2, os.cpu_count() or 2)))
        self.do_hints = L.hints and bool(self.fds)
        self.willneed = 0
        if self.do_hints:
            for ff in self.fds.values():
                for fd in ff.fds:
                    (_sys.fadvise_random if shuffled else _sys.fadvise_sequential)(fd)
            if L.willneed and shuffled and not cached:
                self.willneed = L.willneed
        # block shuffle: windows read sequentially ahead of the batches
        self.win_bounds: np.ndarray | None = None
        self.win_pool: ThreadPoolExecutor | None = None
        self.win_done = -1
        self.win_need = 0
        # CUDA
        self.stream = None
        if L._cuda:
            self.stream = self.tasks.stream = torch.cuda.Stream(device=L.device)
        try:
            if block and not cached:
                self.win_bounds = L.order.window_bounds(epoch)
                self.win_pool = ThreadPoolExecutor(L.window_threads, thread_name_prefix="mmstore-window")
                t = threading.Thread(target=self._window_loop, name="mmstore-window", daemon=True)
                self.tasks.win_thread = t
                t.start()
            for k in range(min(L.prefetch, self.nbatches)):
                self.submit(k)
        except BaseException:
            self.tasks.cancel("ended")
            self.tasks.wait()
            raise

    @property
    def cancelled(self) -> bool:
        return self.tasks.cancelled

    # -- windows -------------------------------------------------------------------
    def _window_of(self, pos: int) -> int:
        return int(np.searchsorted(self.win_bounds, pos, side="right")) - 1  # type: ignore[arg-type]

    def _window_loop(self) -> None:
        b = self.win_bounds
        cv = self.tasks.cv
        if b is None:
            return
        try:
            for w in range(len(b) - 1):
                with cv:
                    while w > self.win_need and not self.cancelled:
                        cv.wait()
                if self.cancelled:
                    return
                self.loader._read_window(self.idx[b[w] : b[w + 1]], self)
                with cv:
                    self.win_done = w
                    cv.notify_all()
        except Exception:  # noqa: BLE001 - a prefetch pass only: a failing read is
            pass  # reported by the batch that reads the record; this thread prints nothing
        finally:
            with cv:
                self.win_done = len(b)  # never leave a batch waiting
                cv.notify_all()
            if self.win_pool is not None:
                self.win_pool.shutdown(wait=False, cancel_futures=True)

    def _wait_window(self, w: int) -> None:
        cv = self.tasks.cv
        with cv:
            while self.win_done < w and not self.cancelled:
                cv.wait()

    # -- submitting ----------------------------------------------------------------
    def bounds(self, k: int) -> tuple[int, int]:
        bs = self.loader.batch_size
        return k * bs, min((k + 1) * bs, len(self.idx))

    def submit(self, k: int) -> None:
        """Queue the reads of batch ``k`` into its ring slot."""
        L = self.loader
        s = k % self.R
        a, b = self.bounds(k)
        idx = self.idx[a:b]
        slot = self.np_ring[s]
        pool = L._pool
        if pool is None or self.cancelled:
            raise _Cancelled()
        if self.guard_pinned:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.events[s] = ev
        ev = self.events[s]
        wait_win = -1
        if self.win_bounds is not None:
            wait_win = self._window_of(b - 1)
            with self.tasks.cv:
                if wait_win + 1 > self.win_need:
                    self.win_need = wait_win + 1
                    self.tasks.cv.notify_all()
        futs = []
        try:
            for lo in range(0, len(idx), self.piece_rows):
                hi = min(lo + self.piece_rows, len(idx))
                futs.append(pool.submit(self._task, idx, slot, lo, hi, ev, wait_win))
            self.tasks.futs[s] = futs
            if self.willneed:
                ka = k + self.willneed
                if ka < self.nbatches:
                    a2, b2 = self.bounds(ka)
                    pool.submit(self._hint_task, self.idx[a2:b2])
        except RuntimeError:  # the pool was shut down: Loader.close() from another thread
            self.tasks.futs[s] = futs
            if self.cancelled:
                raise _Cancelled() from None
            raise

    def _task(self, idx: np.ndarray, slot: dict[str, np.ndarray], lo: int, hi: int, ev: Any, wait_win: int) -> None:
        if self.cancelled:
            raise _Cancelled()
        if ev is not None:
            ev.synchronize()  # the copy out of this pinned buffer has finished
        if wait_win >= 0:
            self._wait_window(wait_win)
        self.loader._read_piece(idx, slot, lo, hi, self.fds)

    def _hint_task(self, idx: np.ndarray) -> None:
        if not self.cancelled:
            try:
                self.loader._hint(idx)
            except OSError:
                pass

    def wait_batch(self, k: int) -> None:
        """Wait for batch ``k``'s reads; raise the first error among them."""
        s = k % self.R
        futs = self.tasks.futs[s] or []
        _wait(futs)
        if self.cancelled:
            raise _Cancelled()
        self.tasks.futs[s] = None
        for f in futs:
            exc = f.exception()
            if exc is not None:
                raise exc

    def host_batch(self, k: int) -> dict[str, torch.Tensor]:
        a, b = self.bounds(k)
        slot = self.ring[k % self.R]
        m = b - a
        return {f: (t if m == t.shape[0] else t[:m]) for f, t in slot.items()}

    def to_gpu(self, k: int) -> tuple[int, Any, Any]:
        """Issue the copy of host batch ``k`` on the side stream."""
        L = self.loader
        self.wait_batch(k)
        host = self.host_batch(k)
        s = k % self.R
        with torch.cuda.stream(self.stream):
            gpu = {f: t.to(L.device, non_blocking=True) for f, t in host.items()}
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[s] = ev  # the reader of this slot's next batch waits for it
        return k, gpu, ev


class _EpochRun:
    """The iterator ``iter(loader)`` returns: one pass over one epoch.

    It keeps its loader alive (as a list iterator keeps its list); the loader
    keeps only a weak reference to it, so dropping the iterator (``break``,
    ``del``, an exception) ends the epoch at once, by reference counting,
    without blocking: queued reads are cancelled and the next ``iter(loader)``
    waits for the ones still running before it reuses the ring.
    """

    def __init__(self, loader: Loader, epoch: int) -> None:
        self._ep = _Epoch(loader, epoch)
        self.epoch = epoch
        self.nbatches = self._ep.nbatches
        self.k = 0  # next batch to yield
        self._busy = threading.Lock()
        self._pending_gpu: tuple[int, Any, Any] | None = None
        self._pending_exc: BaseException | None = None

    @property
    def futs(self) -> list[list[Future[Any]] | None]:
        """The reads in flight, per ring slot."""
        return self._ep.tasks.futs

    def _live(self) -> bool:
        t = self._ep.tasks
        return not t.cancelled and t.pid == os.getpid()

    def __iter__(self) -> _EpochRun:
        return self

    def __len__(self) -> int:
        return self.nbatches

    def __next__(self) -> Any:
        tasks = self._ep.tasks
        if tasks.pid != os.getpid():
            raise LoaderStateError(
                f"mmstore.torch.Loader: this iterator of epoch {self.epoch} was started in process "
                f"{tasks.pid} and cannot be continued in forked process {os.getpid()} (its reader "
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
        L = ep.loader
        k = self.k
        if ep.cancelled:
            self._raise_cancelled()
        if self._pending_exc is not None:  # batch k's read failed while batch k - 1 was prepared
            exc, self._pending_exc = self._pending_exc, None
            self._end()
            raise exc
        if k >= self.nbatches:
            L._commit(self.epoch)
            self._end()
            raise StopIteration
        try:
            # batch k - hold is released: its slot takes batch k + prefetch
            if k + L.prefetch < self.nbatches:
                ep.submit(k + L.prefetch)
            if L._cuda:
                out = self._next_gpu(k)
            else:
                ep.wait_batch(k)
                out = ep.host_batch(k)
                if L.copy:  # a numpy copy: no torch intra-op (OpenMP) threads, which hang
                    # in a forked child once the parent used them
                    out = {f: torch.from_numpy(t.numpy().copy()) for f, t in out.items()}
        except _Cancelled:
            self._raise_cancelled()
        except BaseException:
            self._end()
            raise
        self.k = k + 1
        if k == 1:  # a second batch: not a peek; the epoch number is used
            L._commit(self.epoch)
        return L._wrap(out)

    def _next_gpu(self, k: int) -> dict[str, torch.Tensor]:
        ep = self._ep
        cur = self._pending_gpu if self._pending_gpu is not None else ep.to_gpu(k)
        self._pending_gpu = None
        if k + 1 < self.nbatches:
            try:
                self._pending_gpu = ep.to_gpu(k + 1)
            except _Cancelled:
                raise
            except Exception as exc:  # noqa: BLE001 - batch k + 1's error, raised when it is asked for
                self._pending_exc = exc
        _, gpu, ev = cur
        stream = torch.cuda.current_stream(ep.loader.device)
        stream.wait_event(ev)
        for t in gpu.values():
            t.record_stream(stream)
        return gpu

    def _raise_cancelled(self) -> None:
        t = self._ep.tasks
        if t.reason == "closed":
            raise LoaderStateError(
                f"mmstore.torch.Loader: the loader was closed (Loader.close()) while epoch {self.epoch} "
                f"was being iterated, after {self.k} of {self.nbatches} batches; the epoch did not "
                "complete. Start a new epoch with iter(loader) if that was not intended"
            ) from None
        raise StopIteration

    def _end(self) -> None:
        """End this epoch: cancel what is queued, wait for what runs."""
        t = self._ep.tasks
        t.cancel("ended")
        t.wait()

    def close(self) -> None:
        """End this epoch early: cancel what is queued, wait for what runs
        (nothing writes into the ring after this returns). Later ``next()``
        calls raise ``StopIteration``; ``iter(loader)`` starts the next epoch."""
        if self._ep.tasks.pid != os.getpid():
            return
        self._end()

    def __del__(self) -> None:
        # dropped (break, del, an exception, garbage collection in any thread):
        # cancel without waiting; the next iter(loader) waits for what still runs
        try:
            self._ep.tasks.cancel("ended")
        except Exception:  # noqa: BLE001
            pass
