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

Where the code is: this module holds the :class:`Loader` (configuration,
epoch counter, the per-process resources: thread pool, ``preadv``
descriptors, ring); ``mmstore/engine/tuning.py`` the tuning knobs (:class:`LoaderTuning`);
``_ring.py`` the ring of buffers; ``mmstore/engine/inflight.py`` one epoch's reads in flight;
``_epoch.py`` the epoch's batches and its iterator; ``mmstore/engine/reads.py`` the read
strategies (preadv, memmove, window prefetch, kernel hints); ``_source.py``
the ``store`` argument (datasets, subsets, ``indices=``) and the
``transform`` call; ``mmstore/engine/state.py`` the resume state.

Kept batches (the contract)
---------------------------
**A batch the loader yielded never changes afterwards**, whatever the loop
does with it: ``ys = [y for _, y in loader]`` keeps every label intact. The
loader owns a ring of ``prefetch + hold + 1`` reusable batch buffers and
yields CPU batches as views of them, without a copy. Before it refills a
buffer it checks whether anything outside the loader still references a
batch of it (a tensor, a slice ``batch[0:2]``, the ``chw`` permuted view,
``.numpy()`` of it, a list, tuple or dict holding one: their storage's
reference count, NOTE [kept batches] in ``_ring.py``); if so the buffer is
left to the user and the ring takes a fresh one (counted by
``Loader.fresh_buffers``). A loop that drops each batch (``for batch in
loader:`` with the loop variable rebound each step) never triggers it: the
``+ 1`` buffer is the one the loop variable still holds while ``next()``
runs: up to ``hold`` yielded batches may still be referenced during
``next()``, the loop variable included, without fresh allocations (``prev =
batch`` at the end of the body needs no more than ``hold=1``). Copies
(``.clone()``, ``.cuda()``, ``.float()``, a ``transform``'s output) hold
nothing of the ring. ``copy=True`` yields a
copy of every batch (one ring of ``prefetch + hold`` buffers, no check).
Writing into a yielded batch changes only that batch.

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
  The rule shared with :class:`~mmstore.torch.OrderSampler`: **an epoch
  that was used moves the next iteration to the next epoch by itself;
  ``set_epoch`` always wins** (so ``set_epoch(epoch)`` each epoch, as with
  ``DistributedSampler``, and no ``set_epoch`` at all give the same epochs).
* **Resume.** ``state_dict()`` says which epoch and how many of its batches
  were delivered: the position reached, also after the loop was left
  (``break``, an exception), and ``(e, all of its batches)`` after the last
  batch of epoch ``e``; ``load_state_dict()`` (in this process or a new one)
  makes the next iteration yield exactly the remaining batches of that
  epoch (none for a complete one), in the same order and with the same
  ``transform`` draws, and the iterations after it the next epochs.
  ``set_epoch`` with the state's epoch keeps the resume; another epoch drops
  it, with a warning when batches of it were left (``mmstore/engine/state.py`` has the
  layout, the checkpoint recipe and what must match).
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

import dataclasses
import inspect
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import _os
from ..engine.crop import CropReader, crop_field, follow_crop, out_shape
from ..engine.direct import DirectWindows
from ..engine.fetch import FETCH_WINDOW_BYTES, RemoteWindows, fetch_bounds, limit_block_sizes, remote_cost
from ..engine.inflight import InFlight
from ..engine.plan import LoaderPlan, plan_memory, widen_ring
from ..engine.reads import (
    PREAD_MIN_BYTES,
    EpochReads,
    WindowPrefetch,
    data_paths,
    open_field_files,
    preadv_fields,
    prepare_store,
    resident_fraction,
)
from ..engine.state import Resumable
from ..engine.tuning import LoaderTuning, split_tuning
from ..errors import LoaderStateError, SchemaError
from ..order import BlockShuffle, Order, OrderSpec, Sequential
from ._epoch import EpochBatches, EpochIterator
from ._process import Helper, HelperBatches, helper_setup
from ._ragged import RaggedReader, check_mode, check_pad, refuse_shaped, split_fields
from ._resources import Resources, check_device, check_pin_memory, torch_dtype
from ._ring import Ring
from ._source import resolve_source, transform_call
from .dataset import image_fields
from .sampler import build_order

if TYPE_CHECKING:
    from ..remote.replica import Replica
    from ..store.reader import Store

__all__ = ["Loader", "LoaderTuning"]


class Loader(Resumable):
    """Shuffled batches from a store, read by threads into reusable buffers.

    Parameters
    ----------
    store : mmstore.Store, path, StoreDataset or Subset
        What to read. A :class:`StoreDataset` gives its store and its
        ``fields``/``as_tuple``/``chw`` (defaults for the loader's); a
        ``torch.utils.data.Subset`` of one (nested ones too) also its indices.
    batch_size : int
        Records per batch, a positive int (the last batch of an epoch is
        shorter unless ``drop_last``).
    order : str, OrderSpec or Order, default "permutation"
        What order the records are read in, and how an epoch is split over
        ranks. A kind name (``"permutation"``, ``"block"``,
        ``"sequential"``) is ``OrderSpec(kind)``; an
        :class:`mmstore.order.OrderSpec` carries the seed, the rank and world
        size (None: ``torch.distributed``'s, else a single process), how a
        count that the ranks do not divide is split (default: every record
        exactly once per epoch and every rank the same number of batches;
        the last batch's size differs between ranks; where no split gives
        equal counts, the shorter ranks each take one record twice, with a
        warning; ``pad=True``: equal lengths by wrap-around padding, as
        ``DistributedSampler``; ``drop_last=True``: the tail dropped) and a
        block shuffle's ``block``/``window`` (None: sized from the record
        size, "Distributed split" in :mod:`mmstore.order`). An
        :class:`~mmstore.order.Order` object is used as it is built (an
        exact one, ``pad=False``, with this loader's batch size).
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
    copy : bool, default False
        Yield a fresh copy of every batch. Not needed for correctness: by
        default batches are yielded without a copy and a batch still
        referenced when its buffer comes round again keeps that buffer (see
        "Kept batches" in the module docstring).
    as_tuple, chw : bool
        As for :class:`StoreDataset` (default: the dataset's, else False).
    ragged : {"list", "pad"}, optional
        How a ragged field (a variable leading dimension: boxes, token ids)
        is yielded: ``"list"`` (default), a list of tensors, record ``j``'s
        of shape ``(n_j, *row)``; ``"pad"``, a
        :class:`~mmstore.torch.Padded` ``(values, lengths)``: ``values``
        ``(batch, longest, *row)`` filled with ``pad_value`` past each
        record's rows, ``lengths`` int64. ``str`` / ``bytes`` fields: a list
        of ``str`` / ``bytes`` in both modes. Ragged fields are not in the
        ring: one more pool task per batch reads them with
        ``Store.read_batch`` (values + offsets, no Python object per record)
        and builds the tensors, which are fresh for every batch (the
        kept-batch check does not concern them; ``copy=True`` does not copy
        them again); with ``device`` they are moved there too. Default: the
        dataset's, else ``"list"``.
    pad_value : number or dict, optional
        The padding of ``ragged="pad"`` (default: the dataset's, else 0); a
        dict gives one per field (``{"boxes": -1, "iscrowd": 0}``, fields it
        does not name: 0). A value a field's dtype cannot hold (``-1`` for a
        uint8 field) is refused here, naming the field.
    indices : array of int, optional
        Read only these records (record indices of the store; negative ones
        from the end; out of range: :class:`~mmstore.errors.RecordIndexError`).
        Every entry once per epoch (a record listed twice is read twice),
        split over ranks like the whole store. The order runs over the
        subset's positions: ``"sequential"`` keeps the given order, shuffled
        orders take the subset sorted by record first (so ``"block"`` reads
        runs of neighbouring records).
    transform : callable, optional
        Called on every batch in the consumer's thread (inside ``next()``),
        after it is on ``device``, with what would be yielded (the dict, or
        the tuple with ``as_tuple``); its result is yielded. When it takes
        the keywords ``epoch`` and ``batch_index`` (as
        :class:`mmstore.torch.augment.Pipeline` does) it is called as
        ``transform(batch, epoch=e, batch_index=k)``, ``k`` numbering the
        batches of epoch ``e`` across ranks (this rank's batch ``j`` is
        ``j * world_size + rank``, so ranks draw different parameters), the
        same after a resume; else ``transform(batch)``.
    crop : RandomResizedCrop or CenterCrop, optional
        Crop one image field (images of their own shape, or a fixed-shape
        image field) into a fixed output: the batch's field is ``(batch,
        out_h, out_w[, C])``, each record cropped and resized by the reader
        threads into the batch buffer (a JPEG entry decoded at the reduced
        DCT scale its box allows, a PNG or zstd one whole;
        ``describe()["crop"]`` says what runs; the crop's ``boxes=`` makes
        box and polygon fields follow it). Record ``r``'s
        box in epoch ``e`` is a function of (the order's seed, ``e``,
        ``r``): the same after a resume and on every rank
        (:mod:`mmstore.engine.crop`). Without ``crop=``, a field read that
        declares aspect buckets makes this loader a
        :class:`~mmstore.torch.BucketLoader`: batches of one bucket each,
        the records as stored (:mod:`mmstore.torch.buckets`).
    tuning : LoaderTuning, optional
        How to read: ``prefetch``, ``hold``, ``threads``, ``warm``, ``hints``,
        ``willneed``, ``method``, ``piece_bytes``, ``window_prefetch``,
        ``window_threads``, ``mem_bytes`` (see :class:`LoaderTuning`); read
        back as ``loader.tuning``.
    process : bool, default False
        Run the reader threads in one helper process and hand the batches
        over in shared memory, so that the reads never take the training
        loop's thread's GIL (a loop busy with Python, such as one launching
        GPU kernels, keeps its speed). The batches, the order, resume,
        ``transform`` and every rule below are the same; the helper starts
        with the first ``iter()`` (a new Python process: about a second) and
        lives as long as the loader. The store, order and crop must be
        picklable. With ``device='cuda'`` the shared memory is pinned
        (``cudaHostRegister``) for the copies to the GPU; not with
        ``pin_memory=True`` for CPU batches, nor over aspect buckets
        (:mod:`mmstore.torch._process`).

    Iterating yields one epoch; the epoch is the one set with
    :meth:`set_epoch`, else one more than the last one used (starting at 0),
    resumed mid-way after :meth:`load_state_dict`.
    One epoch runs at a time: ``iter()`` while an iterator is live raises
    :class:`~mmstore.errors.LoaderStateError` (see the module docstring,
    "Lifetime", for peeks, threads, ``close``, ``fork`` and pickling).
    """

    # what a Loader(...) call may build instead: each entry, given the call's arguments, names a
    # subclass or None (mmstore/torch/buckets.py adds BucketLoader: a field that declares aspect buckets)
    _variants: list[Callable[[tuple[Any, ...], dict[str, Any]], type[Loader] | None]] = []

    def __new__(cls, *args: Any, **kwargs: Any) -> Loader:
        if cls is Loader and (args or kwargs):
            for pick in Loader._variants:
                sub = pick(args, kwargs)
                if sub is not None:
                    return super().__new__(sub)
        return super().__new__(cls)

    def __init__(
        self,
        store: Any,
        batch_size: int,
        order: str | OrderSpec | Order = "permutation",
        *,
        fields: Sequence[str] | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        copy: bool = False,
        as_tuple: bool | None = None,
        chw: bool | None = None,
        ragged: str | None = None,
        pad_value: Any = None,
        indices: Any = None,
        transform: Any = None,
        crop: Any = None,
        tuning: LoaderTuning | None = None,
        process: bool = False,
    ) -> None:
        batch_size = _count("batch_size", batch_size)
        self.process = _flag("process", process)
        src = resolve_source(store, indices)
        self._own_store = src.own
        self.store = src.store
        order = _order_arg(order)
        self.tuning = split_tuning(tuning, {})[0]
        self.batch_size = batch_size
        self.fields = tuple(self.store.field_list(src.defaults.get("fields") if fields is None else fields))
        try:
            self._crop_field = None if crop is None else crop_field(self.store, self.fields, crop)
            refuse_shaped(self.store, [f for f in self.fields if f != self._crop_field], "the Loader")
        except (SchemaError, TypeError):
            if src.own:
                self.store.close()
            raise
        self.crop = crop
        # ragged fields are read per batch beside the ring (_ragged.py), the others into it;
        # a cropped field goes into the ring at the crop's output shape
        self._fixed, self._ragged = split_fields(self.store, self.fields)
        if self._crop_field is not None:
            self._ragged = tuple(f for f in self._ragged if f != self._crop_field)
            self._fixed = tuple(f for f in self.fields if f in self._fixed or f == self._crop_field)
        self.ragged = check_mode(src.defaults.get("ragged", "list") if ragged is None else ragged)
        self.pad_value = check_pad(self.store, self._ragged, self.ragged,
                                   src.defaults.get("pad_value", 0) if pad_value is None else pad_value)
        self.device, self._cuda = check_device(device)
        if self.process and pin_memory and not self._cuda:
            raise ValueError(
                "mmstore.torch.Loader: process=True pins the memory it shares with the helper process only for "
                "its own copies to the GPU (device='cuda'); drop pin_memory=True (CPU batches in shared "
                "memory), or use process=False for pinned CPU batches"
            )
        self.copy = _flag("copy", copy)
        # batches yielded straight from the ring are checked for references
        # (NOTE [kept batches] in _ring.py); one more buffer keeps the batch the
        # loop variable still holds during next() out of the refill
        self._check = int(self._check_kept and not self.copy and not self._cuda)
        n = len(self.store) if src.indices is None else len(src.indices)
        rb = max(1, sum(self._ring_bytes(f) for f in self._fixed))  # decoded: the ring's
        sb = self.store.stored_record_bytes(self.fields)  # on disk: the page cache's and the windows'
        self._record_bytes = sb
        self._plan = LoaderPlan(**plan_memory(
            batch_bytes=self.batch_size * rb, record_bytes=sb, records=n, hold=self.tuning.hold + self._check,
            prefetch=self.tuning.prefetch, mem_bytes=self.tuning.mem_bytes,
        ))
        if isinstance(order, OrderSpec):  # every record once, the same batch count on every rank
            kw = order.order_kw()
            if order.kind == "block":
                kw = _block_sizes(kw, n, sb, self.store, self.fields, src.indices, self.batch_size)
            kw["batch_size"] = self.batch_size
            self.order = build_order(order.kind, n, rank=order.rank, world_size=order.world_size,
                                     record_bytes=sb, **kw)
        else:
            self.order = build_order(order, n)
        if not self.order.pad and self.order.batch_size != self.batch_size:  # an exact order object
            self.order = dataclasses.replace(self.order, batch_size=self.batch_size)
        _warn_repeated(self.order)
        if isinstance(self.order, BlockShuffle):
            _check_windows(self.order, sb, self._plan)
        self._plan.update(self._readahead_plan(sb))
        if self.process:
            self._plan.update({"process": 0})
        if self._crop_field is not None:
            reader = self._crop_reader(0)
            self._plan.crop = {"field": self._crop_field, "crop": repr(crop), "path": reader.path if reader else ""}
        self.indices: np.ndarray | None = src.indices
        """The subset's record indices, as the order's positions map them (None: every record)."""
        if self.indices is not None and not isinstance(self.order, Sequential):
            self.indices = np.sort(self.indices, kind="stable")
        self.drop_last = _flag("drop_last", drop_last)
        self.pin_memory = check_pin_memory(pin_memory, self._cuda)
        self.as_tuple = bool(src.defaults.get("as_tuple", False) if as_tuple is None else _flag("as_tuple", as_tuple))
        self.chw = bool(src.defaults.get("chw", False) if chw is None else _flag("chw", chw))
        self.transform = transform
        self._transform = transform_call(transform)
        self.warm_report: _os.WarmReport | None = None
        self._warmed = False
        self._images = image_fields(self.store, self.fields) if self.chw else set()
        if self.chw and self._crop_field is not None and len(self._ring_shape(self._crop_field)) == 3:
            self._images.add(self._crop_field)
        self._config = {
            "batch_size": self.batch_size, "fields": self.fields, "drop_last": self.drop_last,
            "device": None if self.device is None else str(self.device), "pin_memory": self.pin_memory,
            "copy": self.copy, "as_tuple": self.as_tuple, "chw": self.chw, "tuning": self.tuning,
            "transform": self.transform, "ragged": self.ragged, "pad_value": self.pad_value, "crop": self.crop,
            "process": self.process,
        }
        self._epoch: int | None = None
        self._next_epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches delivered) from load_state_dict
        self._pos: tuple[int, int] | None = None  # (epoch, batches delivered) of the latest iteration
        self._pos_used = False  # that iteration used its epoch (a peek does not: the state stays put)
        # per-process resources; released without blocking when the loader is
        # garbage (see "Lifetime" in the module docstring)
        self._res = Resources()
        self._finalizer = weakref.finalize(self, self._res.release, False)
        self._active: weakref.ref[EpochIterator] | None = None  # the iterator of the epoch in progress
        self._tasks: InFlight | None = None  # the last epoch's reads: waited for before the ring is reused
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    # -- public ----------------------------------------------------------------
    # class switch for benchmarks: False restores the unchecked ring (batches
    # overwritten once their buffer comes round; benchmarks/bench_keep.py)
    _check_kept = True

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next iteration (it always wins; a
        resume loaded with :meth:`load_state_dict` is kept when ``epoch`` is
        its epoch, dropped otherwise, with a warning: the rest of the resumed
        epoch is then never delivered)."""
        self._epoch = _count("epoch", epoch, 0)
        self._pos = None  # the state now says where the next iteration starts
        if self._resume is not None and self._resume[0] != self._epoch:
            e, done = self._resume
            self._resume = None
            if done >= len(self):  # the resumed epoch was complete: nothing is dropped
                return
            warnings.warn(
                f"mmstore.torch.Loader.set_epoch({self._epoch}) drops the resume loaded by load_state_dict "
                f"(epoch {e}, {done} of {len(self)} batches delivered): the rest of epoch {e} will not be "
                f"delivered; to finish it, start the epoch loop at the state's epoch (set_epoch({e}))",
                UserWarning, stacklevel=2,
            )

    @property
    def fresh_buffers(self) -> int:
        """Ring buffers replaced since the ring was allocated because a
        batch yielded from them was still referenced when they came round
        (0 for a loop that drops each batch)."""
        ring = self._res.ring
        return 0 if ring is None else ring.renewed

    def __len__(self) -> int:
        n = len(self.order)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        with self._guard():
            self._end_previous()
            epoch = self._next_epoch if self._epoch is None else self._epoch
            start = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
            self._setup()
            if not self._warmed:
                self._do_warm()
            run = self._start_epoch(epoch, start)
            self._active = weakref.ref(run)
            self._pos, self._pos_used = (epoch, start), False
        return run

    def close(self) -> None:
        """Stop reading, free the threads, buffers and descriptors.

        An epoch still being iterated ends: its iterator's next ``next()``
        raises :class:`~mmstore.errors.LoaderStateError` (also when ``close``
        is called from another thread). A later ``iter(loader)`` opens
        everything again.
        """
        with self._guard():
            self._active = None
            if self._tasks is not None:  # the epoch in progress, or the last one
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

    @property
    def prefetch(self) -> int:
        """Batches read ahead: ``tuning.prefetch``, else sized from the memory budget."""
        return int(self._plan.prefetch)

    @property
    def ring_size(self) -> int:
        """Number of batch buffers the loader cycles through: ``prefetch +
        hold``, plus one when CPU batches are yielded without a copy (the
        batch the loop variable still holds while ``next()`` runs)."""
        return self.prefetch + self.tuning.hold + self._check

    def describe(self) -> LoaderPlan:
        """What this loader chose and why: a :class:`~mmstore.engine.plan.LoaderPlan`
        (the sizing rule of ``mmstore/engine/plan.py``; its attributes are
        listed there, ``plan["fits"]`` reads one as a mapping would) whose
        ``str()`` reads as sentences. ``hold`` is ``tuning.hold``, + 1 when
        CPU batches are yielded without a copy (the buffer of the batch the
        loop variable holds). A copy: later epochs do not change it."""
        return self._plan.copy()

    def _readahead_plan(self, record_bytes: int) -> dict[str, Any]:
        """The read-ahead part of the plan, for this loader's order."""
        t, o, p = self.tuning, self.order, self._plan
        out: dict[str, Any] = {"order": type(o).__name__, "threads": t.threads, "window_mode": t.window_prefetch,
                               "window_threads": t.window_threads, "block": None, "window": None}
        records = 0
        if isinstance(o, BlockShuffle):
            out.update(block=o.block, window=o.window, window_bytes=o.block * o.window * record_bytes)
            records = o.block * o.window
        elif isinstance(o, Sequential) and (o.world_size == 1 or o.split == "contiguous"):
            records = max(self.batch_size, p.window_bytes // record_bytes)
            out["window_bytes"] = records * record_bytes
        windows = bool(t.window_prefetch) and records > 0
        if (windows and isinstance(o, BlockShuffle) and not p.fits
                and min(2 * records, len(o)) * record_bytes > p.cache_bytes):
            # the memory cannot hold the window served and the next one (the order is the
            # same on every rank, not sized from this memory): a window read ahead would be
            # evicted before its batches read it, so batches read their own records
            windows = False
            out["windows_do_not_fit"] = True
        if windows:  # the pass's read buffers come out of the page cache's share
            chunk = int(min(8 << 20, max(1 << 20, p.cache_bytes // 16 // t.window_threads)))
            out["window_chunk"] = chunk
            out["cache_bytes"] = max(0, p.cache_bytes - t.window_threads * chunk)
        # private O_DIRECT window buffers are memory that cannot be reclaimed:
        # only with room for them (else the page cache pass, which degrades
        # gracefully under a tight limit)
        # (block shuffles: 2.1x the page-cache pass; sequential orders: 1.4x on the
        # simulated HDD, the same speed for a third of the system CPU here)
        preadv = bool(preadv_fields(self.store, self._fixed, t.method))  # O_DIRECT serves these fields only
        remote = self.store.replica is not None  # the replica's fetch pass reads ahead instead (engine/fetch.py)
        direct = (windows and not p.fits and t.window_prefetch == "read" and isinstance(o, DIRECT_ORDERS)
                  and p.cache_bytes >= DIRECT_MIN_CACHE and preadv and not remote)
        if not windows and t.prefetch is None:  # a store that does not fit: more batches in flight
            out.update(widen_ring(vars(p)))
        # a store that does not fit, read per batch: records read with O_DIRECT
        # (NOTE [direct record reads] in mmstore/engine/direct.py)
        # (fields of at least PREAD_MIN_BYTES a record: method="pread"'s small ones keep the page cache)
        large = any(self.store.schema[f].nbytes >= PREAD_MIN_BYTES for f in preadv_fields(self.store, self._fixed,
                                                                                           t.method))
        direct_reads = not windows and not p.fits and large and not isinstance(o, Sequential) and not remote
        out.update(
            readahead="windows" if windows else "per batch", window_records=records if windows else 0,
            window_direct=direct, drop_behind=windows and not p.fits and not direct,
            direct_reads=direct_reads, willneed=0 if windows or direct_reads else t.willneed,
        )
        return out

    def _window_bounds(self, epoch: int, length: int) -> np.ndarray | None:
        """Where the read-ahead windows of ``epoch`` start and end (None: no window pass)."""
        if self._plan.readahead != "windows" or length == 0:
            return None
        if isinstance(self.order, BlockShuffle):
            return self.order.window_bounds(epoch)
        # a sequential order's windows are the loader's own cut: the first is one
        # batch, so the first batch waits for its own records only, not a whole window
        step = int(self._plan.window_records)
        first = min(step, self.batch_size, length)
        return np.append(np.append(0, np.arange(first, length, step, dtype=np.int64)), length)

    def __repr__(self) -> str:
        t = self.tuning
        return (
            f"<mmstore.torch.Loader {self.store.path!r} batch_size={self.batch_size} "
            f"order={type(self.order).__name__} prefetch={self.prefetch} hold={t.hold} "
            f"threads={t.threads} device={self.device}{' process=True' if self.process else ''}>"
        )

    # -- pickling: the configuration; the copy opens its own threads and files --
    def __getstate__(self) -> dict[str, Any]:
        return {
            "store": self.store, "own_store": self._own_store, "order": self.order, "config": self._config,
            "epoch": self._epoch, "next_epoch": self._next_epoch, "warmed": self._warmed,
            "indices": self.indices, "resume": self._resume, "pos": self._pos, "pos_used": self._pos_used,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["store"], order=state["order"], indices=state["indices"], **state["config"],
        )
        self._own_store = state["own_store"]
        self._epoch, self._next_epoch, self._warmed = state["epoch"], state["next_epoch"], state["warmed"]
        self._resume = state["resume"]
        self._pos, self._pos_used = state.get("pos"), state.get("pos_used", False)

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
        if run is not None and run.live():
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

    def _start_epoch(self, epoch: int, start: int = 0) -> EpochIterator:
        """Queue the first batches of ``epoch`` from batch ``start`` on; its iterator."""
        wrap = self._wrap
        if self.process:
            return self._start_helper_epoch(epoch, start)
        batches, reads = self._epoch_batches(epoch, start, check_kept=bool(self._check),
                                             device=self.device if self._cuda else None)

        def deliver(tensors: dict[str, torch.Tensor], epoch: int, k: int) -> Any:
            # called by the iterator in the consumer's thread after it queued the
            # next batch: where the reads may change their cut (EpochReads.follow)
            reads.follow(k - start)
            return wrap(tensors, epoch, k)

        return EpochIterator(
            batches, epoch, prefetch=self.prefetch, copy=self.copy, on_used=self._commit, wrap=deliver,
            offset=start,
        )

    def _start_helper_epoch(self, epoch: int, start: int) -> EpochIterator:
        """``process=True``: the epoch read by the helper process into the shared ring."""
        res = self._res
        if res.helper is not None and res.helper.dead:  # it stopped during an earlier epoch: start another
            res.helper.close()
            res.helper = None
        if res.helper is None:
            res.helper = Helper(helper_setup(self), res.ring)  # type: ignore[arg-type]
            self._plan.update({"process": res.helper.pid})
        rows = len(self.order) - start * self.batch_size
        batches = HelperBatches(
            res.helper, epoch=epoch, start=start, rows=rows, batch_size=self.batch_size, drop_last=self.drop_last,
            prefetch=self.prefetch, ring=res.ring, device=self.device if self._cuda else None,  # type: ignore[arg-type]
            check_kept=bool(self._check),
        )
        self._tasks = batches.inflight  # type: ignore[assignment]
        return EpochIterator(
            batches, epoch, prefetch=self.prefetch, copy=self.copy,  # type: ignore[arg-type]
            on_used=self._commit, wrap=self._wrap, offset=start,
        )

    def _epoch_batches(self, epoch: int, start: int, *, check_kept: bool,
                       device: torch.device | None) -> tuple[EpochBatches, EpochReads]:
        """The reads of ``epoch`` from batch ``start`` on into the ring, the first batches queued."""
        t, res = self.tuning, self._res
        idx = self.order.epoch(epoch)
        if self.indices is not None:
            idx = self.indices[idx]
        bounds = self._window_bounds(epoch, len(idx))
        if start:  # a resume: the epoch from row start * batch_size on
            a0 = start * self.batch_size
            idx = idx[a0:]
            if bounds is not None:
                bounds = np.unique(np.clip(bounds - a0, 0, None))
        crop = self._crop_reader(epoch)
        reads = EpochReads(  # box fields that follow the crop are read per batch (follow_crop), not in pieces
            self.store, self._fixed, res.files, t, batch_size=self.batch_size,
            ragged=() if crop is not None and crop.follows else self._ragged,
            shuffled=not isinstance(self.order, Sequential), block=bounds is not None,
            direct=bool(self._plan.direct_reads), crop=crop,
        )
        inflight = InFlight(len(res.ring))  # type: ignore[arg-type]
        self._tasks = inflight  # from now on the next iter()/close() waits for these reads
        window: DirectWindows | WindowPrefetch | RemoteWindows | None = None
        replica = self.store.replica
        if replica is not None:
            window = self._remote_pass(replica, epoch, start, idx, inflight)
        if window is not None or bounds is None or reads.cached:  # (a complete replica reads as local)
            pass
        elif self._plan.window_direct and reads.files:
            window = DirectWindows(reads, idx, bounds, t.window_threads, inflight,
                                   cap=2 * self._plan.window_bytes, batch_size=self.batch_size)
        else:
            window = WindowPrefetch(reads, idx, bounds, str(t.window_prefetch), t.window_threads, inflight,
                                    drop_behind=bool(self._plan.drop_behind), chunk=self._plan.window_chunk)
        self._plan.reads = reads.state  # describe()["reads"]: the cut in use, as the cache changes
        if window is None:
            reads.watch(idx, self.prefetch)  # the epoch follows the page cache (EpochReads.follow)
        batches = EpochBatches(
            idx, batch_size=self.batch_size, drop_last=self.drop_last, prefetch=self.prefetch,
            ring=res.ring, pool=res.pool, reads=reads, inflight=inflight, window=window,  # type: ignore[arg-type]
            device=device, guard_pinned=self.pin_memory and device is None,
            owner=self, check_kept=check_kept,
            ragged=follow_crop(RaggedReader(self.store, self._ragged, self.ragged, self.pad_value), crop)
            if self._ragged else None,
        )
        return batches, reads

    def _remote_pass(self, replica: Replica, epoch: int, start: int, idx: np.ndarray,
                     inflight: InFlight) -> RemoteWindows | None:
        """The window pass that fetches the epoch's blocks of a store opened
        from a URL; None when every block is present: the epoch then pins
        them all at once and reads as from a local store (NOTE [a complete
        replica])."""
        inflight.hold = replica.pin_complete()
        window = None
        if inflight.hold is None:
            if isinstance(self.order, BlockShuffle):
                fb = self.order.window_bounds(epoch)
                if start:
                    fb = np.unique(np.clip(fb - start * self.batch_size, 0, None))
            elif isinstance(self.order, Sequential):
                lim = replica.cache_limit
                fb = fetch_bounds(len(idx), self.batch_size, max(1, self._record_bytes),
                                  FETCH_WINDOW_BYTES if lim is None else max(1, min(FETCH_WINDOW_BYTES, lim // 4)))
            else:  # records one by one: a batch touches a block per record, so a window is one batch
                fb = fetch_bounds(len(idx), self.batch_size, max(1, self._record_bytes), 1)
            window = RemoteWindows(self.store, self.fields, idx, fb, inflight, replica, batch_size=self.batch_size,
                                   planned=isinstance(self.order, (BlockShuffle, Sequential)))
        self._plan.remote = {**replica.describe(), "windows": 0 if window is None else len(window.bounds) - 1,
                             "cost": remote_cost(replica, self.order, self._record_bytes)}
        return window

    def _commit(self, epoch: int) -> None:
        """Epoch ``epoch`` counts as used: the next iteration takes the next one."""
        if self._pos is not None and self._pos[0] == epoch:
            self._pos_used = True
        if self._epoch == epoch:
            self._epoch = None
        if self._resume is not None and self._resume[0] == epoch:
            self._resume = None
        self._next_epoch = epoch + 1

    # -- setup -------------------------------------------------------------------
    def _setup(self) -> None:
        res = self._res
        if res.pid != os.getpid():  # first use, or used after fork: nothing inherited is ours
            res.adopt()
        if self.process:  # the helper reads: here only the shared ring
            if res.ring is None:
                shapes = {f: (self._ring_shape(f), torch_dtype(self.store.schema[f].dtype)) for f in self._fixed}
                res.ring = Ring(self.ring_size, self.batch_size, shapes, self.pin_memory, shared=True)
            return
        if res.pool is None:
            res.pool = ThreadPoolExecutor(self.tuning.threads, thread_name_prefix="mmstore-loader")
        prepare_store(self.store, self.fields)  # in this thread, before the readers
        if not res.files:
            res.files = open_field_files(self.store, [f for f in self._fixed if f != self._crop_field],
                                         self.tuning.method)
        if res.ring is None:
            shapes = {f: (self._ring_shape(f), torch_dtype(self.store.schema[f].dtype)) for f in self._fixed}
            # rows of the preadv fields at their records' file offsets mod the block (NOTE [rows read in place])
            align = {f: ff.offs[0] for f, ff in res.files.items()}
            res.ring = Ring(self.ring_size, self.batch_size, shapes, self.pin_memory, align=align,
                            huge=bool(self._plan.direct_reads))

    def _ring_shape(self, f: str) -> tuple[int, ...]:
        """Field ``f``'s record shape in the ring: the crop's output for the cropped field."""
        if f == self._crop_field:
            return out_shape(self.store, f, self.crop)
        return tuple(self.store.schema[f].shape)

    def _ring_bytes(self, f: str) -> int:
        return int(np.prod(self._ring_shape(f), dtype=np.int64)) * self.store.schema[f].dtype.itemsize

    def _crop_reader(self, epoch: int) -> CropReader | None:
        """The crops of ``epoch`` (None without ``crop=``): seeded by the order's seed (NOTE [crop parameters])."""
        if self._crop_field is None:
            return None
        return CropReader(self.store, self._crop_field, self.crop, getattr(self.order, "seed", 0), epoch)

    def _do_warm(self) -> None:
        """The first epoch's warm pass (``tuning.warm``), decided once."""
        self._warmed = True
        if self.store.replica is not None:  # the fetch pass brings the blocks in, in the order's order
            self._plan.warm = "none"
            return
        paths = data_paths(self.store, self.fields)
        mode, auto = self.tuning.warm, self.tuning.warm == "auto"
        if auto:
            mode = self._auto_warm(paths)
        self._plan.warm = "background" if mode == "background" else ("foreground" if mode else "none")
        if mode == "background":
            self._res.warm_handle = _os.warm_in_background(paths)
            return
        if not mode:
            return
        self.warm_report = rep = _os.warm(paths)
        if not rep.complete and not auto:
            warnings.warn(
                f"mmstore.torch.Loader(warm=True): warmed {rep.bytes_read:,} of {rep.bytes_total:,} bytes "
                f"({rep.reason}); the rest is read from disk", UserWarning, stacklevel=3,
            )

    def _auto_warm(self, paths: list[str]) -> bool:
        """``warm="auto"``: whether to warm before the first batch (see ``LoaderTuning.warm``)."""
        p = self._plan
        n_read = len(self.store) if self.indices is None else len(self.indices)
        if not p.fits or p.direct_reads or 2 * n_read < len(self.store) or not paths:
            return False
        return resident_fraction(paths) < 0.5

    # -- output ----------------------------------------------------------------------
    def _wrap(self, tensors: dict[str, torch.Tensor], epoch: int, k: int) -> Any:
        out: Any = {}
        for f in self.fields:
            t = tensors[f]
            if f in self._images:
                t = t.permute(0, 3, 1, 2)
            out[f] = t
        if self.as_tuple:
            out = tuple(out[f] for f in self.fields)
        if self._transform is not None:
            # batches are numbered across ranks (batch k of rank r is k * world + r), so
            # ranks draw different augmentation parameters, the same after a resume
            world, rank = getattr(self.order, "world_size", 1), getattr(self.order, "rank", 0)
            out = self._transform(out, epoch, k * world + rank)
        self._pos = (epoch, k + 1)  # delivered: what state_dict() reports, also after the loop is left
        return out


# the signature users see is __init__'s: __new__ only picks the class (a BucketLoader over buckets)
setattr(Loader, "__signature__",  # noqa: B010 - a class attribute that inspect.signature reads
        inspect.signature(Loader.__init__).replace(
            parameters=list(inspect.signature(Loader.__init__).parameters.values())[1:]))

DIRECT_MIN_CACHE = 64 << 20  # the smallest page-cache share for O_DIRECT window buffers
# orders whose windows are read with O_DIRECT when the store does not fit (NOTE [huge window
# buffers] in mmstore/engine/direct.py: with huge-page buffers a sequential order reads faster that way too)
DIRECT_ORDERS: tuple[type, ...] = (BlockShuffle, Sequential)


def _order_arg(order: Any) -> OrderSpec | Order:
    """The ``order`` argument as an :class:`OrderSpec` (a kind name is
    ``OrderSpec(kind)``) or an :class:`Order` object."""
    if isinstance(order, str):
        return OrderSpec(order)
    if not isinstance(order, (OrderSpec, Order)):
        raise TypeError(f"order must be a kind name, an mmstore.order.OrderSpec or an Order, "
                        f"got {type(order).__name__}")
    return order


def _block_sizes(kw: dict[str, Any], n: int, record_bytes: int, store: Store, fields: Sequence[str],
                 indices: np.ndarray | None, batch_size: int) -> dict[str, Any]:
    """``order="block"``'s sizes: as ``BlockShuffle.auto`` picks them (or the
    ones given). Nothing measured here enters them (the order must be the same
    on every rank and in a resumed process); the memory only sizes the reads
    (:func:`_check_windows`). A store opened from a URL with a cache limit
    (a setting, the same on every rank) gets sizes that let each block be
    fetched once an epoch under it, or the limit is refused with the
    smallest that works (:func:`mmstore.engine.fetch.limit_block_sizes`)."""
    limited = store.replica is not None and store.replica.cache_limit is not None
    if ("mem_bytes" in kw and "window" not in kw) or ("window" in kw and not limited):
        return kw
    sizes = BlockShuffle.auto_sizes(n, record_bytes, block=kw.get("block"))
    window = kw.get("window", sizes["window"])
    return limit_block_sizes(kw, store, fields, indices, batch_size, sizes["block"], window)


def _check_windows(order: BlockShuffle, record_bytes: int, plan: LoaderPlan) -> None:
    """Warn when this loader's memory cannot hold the two windows the
    read-ahead keeps (the window served and the next one): the order stays
    what every rank computes, the reads then go back to disk."""
    if plan.fits:
        return
    window_bytes = order.block * order.window * record_bytes
    need = min(2 * window_bytes, len(order) * record_bytes)
    cache = int(plan.cache_bytes)
    if need <= cache:
        return
    fit = cache // 2 // max(1, order.block * record_bytes)
    smaller = (f"window={fit} (or smaller)" if fit >= 1 else
               f"block={max(1, cache // 2 // record_bytes)}, window=1 (or smaller)")
    warnings.warn(
        f"mmstore.torch.Loader(order='block'): a window is {order.window} block(s) of {order.block} records "
        f"({_mb(window_bytes)}; the order is the same on every rank and in every run, so it is not sized from "
        f"this machine's memory), and the read-ahead holds two, {_mb(need)}, but this loader may fill "
        f"{_mb(cache)} of page cache ({plan.budget_source}; see describe()): records will be read from disk "
        f"more than once. Pass {smaller} on every rank and in every run that resumes this one, or give the "
        "process more memory",
        UserWarning, stacklevel=3,
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n:,} bytes"


def _warn_repeated(order: Order) -> None:
    """Say when an exactly-once split still reads records twice (the equal batch count needs it)."""
    if order.pad or order.drop_last or order.world_size == 1:
        return
    extra = order.repeated()
    if extra:
        n, w, b = order.n, order.world_size, order.batch_size
        warnings.warn(
            f"mmstore.torch.Loader: {n} records over {w} ranks in batches of {b}: {n % w} of the ranks would get one "
            f"batch more than the others (a DDP step the others never take), so {extra} record(s) are read "
            f"twice per epoch to give every rank {-(-len(order) // b)} batches. For every record exactly once "
            f"choose a batch size for which {n} // {w} is not a multiple of it, or OrderSpec(..., drop_last=True) "
            "to drop instead",
            UserWarning, stacklevel=3,
        )


def _count(name: str, value: Any, minimum: int = 1) -> int:
    """An integer argument: ints and numpy integers, never a bool, a float or a string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"mmstore.torch.Loader: {name} must be an integer, got {value!r} ({type(value).__name__})")
    if int(value) < minimum:
        raise ValueError(f"mmstore.torch.Loader: {name} must be >= {minimum}, got {value}")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"mmstore.torch.Loader: {name} must be True or False, got {value!r}")
    return bool(value)
