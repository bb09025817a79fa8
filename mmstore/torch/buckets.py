"""Same-bucket batches: every batch one shape, batches of all shapes interleaved.

A store whose image field keeps each image's own shape in a few exact sizes
(*aspect buckets*: the field declares them in ``Field.buckets``, or the
records simply come in a few sizes) is read in batches of one bucket each:
``Loader(store, B)`` over a bucketed field (a :class:`BucketLoader`), or
``BucketLoader(store, B)`` over any field of images of their own shape,
grouping its records by their exact ``<name>_hw``. ``crop=`` wins: its
output has one shape already, so ``Loader(store, B, crop=...)`` is a plain
Loader. The batch's image field is ``(b, h, w, C)`` of that bucket
(``chw=True``: ``(b, C, h, w)``), every record exactly as stored
(``store[i][field]``, pixel for pixel). For ``DataLoader`` users
:class:`BucketBatchSampler` yields the same batches as lists of indices,
and ``StoreDataset`` stacks a batch whose records share one size.

NOTE [bucket schedule]: how an epoch is made
--------------------------------------------
* **Buckets.** The records read (the store, or ``indices=``) grouped by
  their ``(h, w)``; a field that declares ``buckets`` keeps its declared
  order (buckets without records are left out), otherwise shapes are
  sorted by ``(h, w)``. A size that is not one of the declared buckets, or
  a side of 0, is refused (:class:`~mmstore.errors.EntryDecodeError`: the
  store is damaged; ``mmstore verify``).
* **Within a bucket** the records follow the order asked for
  (``"permutation"``, ``"block"``, ``"sequential"``) over that bucket's
  records alone, with the order's seed replaced by a seed derived from
  ``(seed, h, w)`` (``numpy.random.SeedSequence``), so buckets of one size
  do not share a permutation. The rank split, ``pad`` and the block
  shuffle's blocks and windows are the order's own, per bucket: bucket ``b``
  of ``n_b`` records gives every rank the same number of batches ``c_b``
  (``pad=False``, the default: every record once, where no split gives
  equal counts the shorter ranks take one record twice, with one warning
  for all buckets; ``pad=True``: wrap-around as ``DistributedSampler``;
  ``drop_last=True``: each rank keeps ``n_b // world_size`` records of the
  bucket, then drops its short last batch, so that every rank still has
  the same count).
* **Interleaving.** The epoch is ``sum(c_b)`` batches; which bucket each
  step reads is a uniform random arrangement of ``c_b`` copies of every
  bucket id drawn from ``numpy.random.default_rng([seed, epoch,
  SCHEDULE_TAG])`` (:func:`bucket_schedule`); ``"sequential"`` reads the
  buckets one after the other, in bucket order. The counts are equal on
  every rank, so every rank reads the same bucket at the same step, with
  the same number of steps, and ``len(loader)`` is exact.
* **Resume.** A position in the epoch (the steps delivered) gives each
  bucket's position by counting its id in the schedule's first steps, so a
  state taken anywhere resumes exactly, in this process or another.

How the Loader reads it
-----------------------
One :class:`~mmstore.torch.Loader` per bucket over that bucket's records
(``indices=``), each reading its image field through the Loader's crop path
at exactly the bucket's size with a reader that copies instead of resizing
(:class:`ExactReader`: a piece's raw entries are read straight into their
rows of the batch buffer, in one AIO submit as a fixed-shape field's are;
an encoded entry is decoded straight into its row), and the other fields as
the Loader reads them. A bucket's batch is cut into one piece per usable
core, as the Loader cuts a fixed-shape batch read from memory. Everything a Loader does per batch
(the ring and its kept-batch rule, pinned memory, the CUDA side stream,
ragged fields, the window pass of a block shuffle, the fetch windows of a
store opened from a URL) is the bucket's Loader's, within its bucket.

Memory and threads (the bound): the buckets' loaders share one pool of
``tuning.threads`` reader threads; each reads ahead ``prefetch`` batches of
its own bucket (``tuning.prefetch``, default ``max(1, 4 // K)`` for ``K``
buckets), and starts (allocates its ring of ``prefetch + hold + 1``
buffers of its own batch, and queues its first batches) only when its
first batch of the epoch is within two steps. So at most ``K * prefetch``
batches are in flight and the rings hold ``(prefetch + hold + 1) *
sum(batch bytes of each bucket)``, about ``K`` times one Loader's ring at
``prefetch=1``; the memory budget (``tuning.mem_bytes``, else measured) is
divided between the buckets' loaders, so their read-ahead windows together
stay within it (a block shuffle's windows are per bucket: one window read
ahead per bucket). The first epoch's ``tuning.warm`` pass is one pass over
the store's files, as the Loader's. ``describe()`` gives every figure.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
from torch.utils.data import Sampler, Subset

from .. import _os
from ..engine import aio
from ..engine.crop import CenterCrop, CropReader
from ..engine.reads import data_paths, resident_fraction, shared_measures
from ..engine.state import subset_state
from ..engine.tuning import LoaderTuning, split_tuning
from ..errors import EntryDecodeError, LoaderStateError, SchemaError
from ..format.layout import note_identity, open_store_file
from ..format.shaped import shape_problem
from ..order import BlockShuffle, Order, OrderSpec, make_order, memory_budget
from ._source import resolve_source, transform_call
from .dataset import StoreDataset, open_store_arg
from .loader import Loader
from .sampler import _check_state, _EpochCursor, dist_rank_world

__all__ = [
    "BucketBatchSampler", "BucketLoader", "ExactReader", "SCHEDULE_TAG", "bucket_groups", "bucket_schedule",
    "wants_buckets",
]

SCHEDULE_TAG = 0x42554B54  # the third word of the schedule's seed ("BUKT")
MAX_SHAPES = 1024  # distinct sizes BucketLoader groups without declared buckets
LOOKAHEAD = 2  # a bucket's loader starts when its first batch of the epoch is this many steps ahead


# -- the schedule (torch-free) ------------------------------------------------------


def bucket_schedule(counts: Sequence[int], seed: int, epoch: int, *, interleave: bool = True) -> np.ndarray:
    """Which bucket each step of an epoch reads (NOTE [bucket schedule]).

    Parameters
    ----------
    counts : sequence of int
        Batches of each bucket in the epoch (this rank's; equal on every rank).
    seed, epoch : int
        The schedule is ``numpy.random.default_rng([seed, epoch,
        SCHEDULE_TAG]).permutation`` of ``counts[b]`` copies of every ``b``.
    interleave : bool, default True
        False: bucket 0's batches, then bucket 1's, ... (a sequential order).

    Returns
    -------
    numpy.ndarray
        ``int64`` bucket ids, ``sum(counts)`` of them.
    """
    c = np.asarray(counts, np.int64).reshape(-1)
    if c.size and int(c.min()) < 0:
        raise ValueError(f"bucket batch counts must be >= 0, got {c.tolist()}")
    labels = np.repeat(np.arange(len(c), dtype=np.int64), c)
    if not interleave or len(labels) < 2:
        return labels
    return np.random.default_rng([int(seed), int(epoch), SCHEDULE_TAG]).permutation(labels)


def bucket_seed(seed: int, shape: tuple[int, int]) -> int:
    """The seed of the order within the bucket of ``shape`` (NOTE [bucket schedule])."""
    return int(np.random.SeedSequence([int(seed), int(shape[0]), int(shape[1])]).generate_state(1)[0])


def bucket_groups(store: Any, field: str, indices: np.ndarray | None = None
                  ) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """The buckets of shaped ``field`` among the records ``indices`` (None:
    all): ``(shapes, positions)``, ``positions[b]`` the positions in
    ``indices`` (record indices when None) of the records of bucket
    ``shapes[b]``, increasing (NOTE [bucket schedule], "Buckets").

    Raises
    ------
    SchemaError
        ``field`` is not an image field of its own shape, or its records
        come in more than :data:`MAX_SHAPES` sizes without declared buckets.
    EntryDecodeError
        A record's size has a side of 0, or is none of the declared buckets.
    """
    fd = store.schema[field]
    if not fd.shaped:
        raise SchemaError(f"buckets: field {field!r} ({fd.dtype.str} {list(fd.shape)}) is not an image field of "
                          "its own shape; buckets group the records of such a field by their size")
    if indices is None:
        hw = np.asarray(store.column(fd.hw_name), np.int64).reshape(-1, 2)
        rec = np.arange(len(hw), dtype=np.int64)
    else:
        rec = np.asarray(indices, np.int64)
        hw = np.asarray(store.read_batch(rec, fields=[fd.hw_name])[fd.hw_name], np.int64).reshape(-1, 2)
    zero = np.flatnonzero((hw < 1).any(axis=1))
    if zero.size:
        j = int(zero[0])
        raise EntryDecodeError(f"field {field!r}, record {int(rec[j])}: {fd.hw_name!r} says {hw[j, 0]} x {hw[j, 1]} "
                               f"pixels (no image; {zero.size} such record(s)); run mmstore verify",
                               field=field, index=int(rec[j]), reason="a size with a side of 0")
    keys = hw[:, 0] * (1 << 32) + hw[:, 1]
    uniq, inv = np.unique(keys, return_inverse=True)
    declared = getattr(fd, "buckets", None)
    if declared:
        table = [(int(h), int(w)) for h, w in declared]
        pos = {h * (1 << 32) + w: k for k, (h, w) in enumerate(table)}
        missing = [int(u) for u in uniq.tolist() if u not in pos]
        if missing:
            j = int(np.flatnonzero(keys == missing[0])[0])
            raise EntryDecodeError(
                f"field {field!r}, record {int(rec[j])}: {fd.hw_name!r} says {hw[j, 0]} x {hw[j, 1]}, which is none "
                f"of its buckets {[list(b) for b in table]}; run mmstore verify", field=field, index=int(rec[j]),
                reason="not a bucket")
        rank = np.array([pos[int(u)] for u in uniq.tolist()], np.int64)
        order = np.argsort(rank, kind="stable")
    else:
        if len(uniq) > MAX_SHAPES:
            raise SchemaError(
                f"BucketLoader: field {field!r} has {len(uniq):,} distinct sizes among the records read, more than "
                f"{MAX_SHAPES} buckets; a batch holds records of one size, so these would be batches of a few "
                "records each. Ingest with aspect buckets (--buckets auto), or crop them into one shape (crop=)")
        order = np.arange(len(uniq))
    # positions of each bucket's records, in the order given: a stable sort by bucket
    inv = np.asarray(inv, np.int64).reshape(-1)
    by = np.argsort(inv, kind="stable")
    starts = np.searchsorted(inv[by], np.arange(len(uniq) + 1))
    shapes, groups = [], []
    for u in order.tolist():
        k = int(uniq[u])
        shapes.append((k >> 32, k & 0xFFFFFFFF))
        groups.append(by[starts[u] : starts[u + 1]].astype(np.int64))
    return shapes, groups


def _bucket_field(store: Any, fields: Sequence[str]) -> str:
    """The one image field of its own shape among ``fields`` (SchemaError otherwise)."""
    shaped = [f for f in fields if store.schema[f].shaped]
    if len(shaped) == 1:
        return shaped[0]
    if not shaped:
        raise SchemaError(f"BucketLoader groups the records of an image field of its own shape, but none of the "
                          f"fields read {list(fields)} is one; use Loader for a store of one shape")
    raise SchemaError(f"buckets: more than one field of images of their own shape is read ({shaped}); batches "
                      "are grouped by one: read one of them (fields=[...])")


def wants_buckets(store: Any, *, fields: Sequence[str] | None, crop: Any) -> bool:
    """Whether ``Loader(store, ..., fields=, crop=)`` reads same-bucket
    batches (is a :class:`BucketLoader`): when a field read declares aspect
    buckets, and never with ``crop=`` (its output has one shape already)."""
    if crop is not None:
        return False
    obj = store
    while isinstance(obj, Subset):
        obj = obj.dataset
    own = False
    if isinstance(obj, StoreDataset):
        st, fields = obj.store, obj.fields if fields is None else fields
    elif isinstance(obj, (str, os.PathLike)):
        try:
            st, own = open_store_arg(obj), True
        except Exception:  # noqa: BLE001 - the Loader raises it, with its own message
            return False
    else:
        st = obj
    try:
        schema = getattr(st, "schema", None)
        if schema is None:
            return False
        try:
            names = st.field_list(fields)
        except Exception:  # noqa: BLE001 - the Loader raises it
            return False
        return any(schema[f].shaped and getattr(schema[f], "buckets", None) for f in names)
    finally:
        if own:
            st.close()


# -- reading a bucket --------------------------------------------------------------


class ExactReader(CropReader):
    """The records of one bucket copied into their rows as stored: the
    Loader's crop path at exactly the bucket's size, without a resize.

    A raw entry is checked against the bucket's size (its byte count) and
    read with ``preadv`` straight into its row (a local store of one
    segment; otherwise the backend's ``gather_entries`` and one copy); a
    ``jpeg`` / ``png`` / ``zstd`` entry is checked
    (:func:`mmstore.format.shaped.shape_problem`) and decoded straight into
    its row. Pixel for pixel what ``store[i][field]`` gives."""

    def __init__(self, store: Any, field: str, shape: tuple[int, int], seed: int, epoch: int) -> None:
        super().__init__(store, field, CenterCrop(shape, ratio=1.0, field=field), seed, epoch)
        self.shape = (int(shape[0]), int(shape[1]))
        fd = store.schema[field]
        self._fd = fd
        self._row_bytes = self.shape[0] * self.shape[1] * int(fd.row_bytes)
        self._file: tuple[int, Any, int, int] | None = None  # (descriptor, offsets, data size, follows)
        self._open_lock = threading.Lock()

    @property
    def path(self) -> str:
        """What runs per record (``describe()``)."""
        if self.codec == "raw":
            return "each record read as stored straight into its row of the batch (no resize)"
        return f"each record's {self.codec} entry decoded straight into its row of the batch (no resize)"

    def read(self, records: np.ndarray, out: np.ndarray) -> None:
        """Records ``records`` (of this bucket) into ``out[j]``, as stored
        (through the grown store, once an append replaced the store: NOTE [a
        reader of a grown store] in mmstore/store/reader.py)."""
        if len(records) == 0:
            return
        file = self._file
        self.store.across_appends(self._read, records, out, file)

    def _read(self, records: np.ndarray, out: np.ndarray, file: Any) -> None:
        if self._file is file and file is not None and self.store.follows != file[3]:
            self._file = None  # opened in the store before an append: the grown store's file from now on
        slots = self.store.slot_view.slots_of(records)
        be = self.store.slot_view.backend
        if self.codec == "raw" and (self._file is not None or (
                be.positional and self.store.replica is None and be.segment_count() == 1)):
            self._pread_rows(be, slots, records, out)
            return
        for j, data in enumerate(self._gathered(be, slots)):
            self._place(data, out[j], int(slots[j]), int(records[j]))

    def _place(self, data: np.ndarray, row: np.ndarray, slot: int, record: int) -> None:
        why = shape_problem(self._fd, data, self.shape)
        if why is not None:
            raise _bad(self.field, slot, record, why)
        if self.codec == "raw":
            row.reshape(-1).view(np.uint8)[:] = data
            return
        try:
            self._fd.codec.decode_into(data, row)
        except EntryDecodeError as exc:
            raise _bad(self.field, slot, record, exc.reason or str(exc)) from None

    def _pread_rows(self, be: Any, slots: np.ndarray, records: np.ndarray, out: np.ndarray) -> None:
        """Raw entries of a local single-segment store: each entry's offsets
        proven in range and of the bucket's size, then one ``preadv`` into its row."""
        if self._file is None:
            with self._open_lock:
                if self._file is None:  # once per epoch and bucket; closed when the reader goes
                    path = be.entry_spans(self.field, 0, 0)[0][0]
                    # the very file the store was opened with (a store replaced meanwhile: StoreChangedError)
                    fd = open_store_file(path, missing=f"{path}: missing; the store was moved, deleted or "
                                         "replaced since it was opened", ident=be.ident)
                    try:
                        note_identity(be.ident, path, os.fstat(fd))
                    except BaseException:
                        os.close(fd)
                        raise
                    weakref.finalize(self, os.close, fd)
                    offs = np.asarray(be.entry_offsets(self.field)).view(np.ndarray)  # gathers without memmap's
                    self._file = (fd, offs, be.entry_data_size(self.field), self.store.follows)
        fd, offs, size, _ = self._file
        nb = self._row_bytes
        a_all = np.asarray(offs[slots], np.int64)
        b_all = np.asarray(offs[slots + 1], np.int64)
        bad = np.flatnonzero((a_all < 0) | (b_all < a_all) | (b_all > size) | (b_all - a_all != nb))
        if bad.size:
            j = int(bad[0])
            a, b = int(a_all[j]), int(b_all[j])
            why = (f"its offsets {a}..{b} are not an increasing pair within the {size:,}-byte data file"
                   if not 0 <= a <= b <= size else
                   f"an entry of {b - a:,} bytes, but its bucket is {self.shape[0]} x {self.shape[1]} pixels "
                   f"({nb:,} bytes)")
            raise _bad(self.field, int(slots[j]), int(records[j]), why + " (run mmstore verify)")
        # as the Loader reads a fixed-shape field (FieldFiles.read): the piece's records in one
        # AIO submit where there is one, else preadv; a short read is read again with preadv,
        # which raises the typed error at the end of the file
        ctx = aio.context() if len(slots) > 1 and out.flags.c_contiguous else None
        if ctx is None:
            _os.pread_records(fd, a_all, nb, out)
            return
        iov = np.zeros((len(slots), 1), aio.IOVEC)
        iov["base"][:, 0] = out.ctypes.data + np.arange(len(slots), dtype=np.uint64) * nb
        iov["len"][:, 0] = nb
        fds = np.full(len(slots), fd, np.int64)
        for j in np.flatnonzero(aio.read_vectors(ctx, fds, a_all, iov) != nb).tolist():
            _os.pread_records(fd, a_all[j : j + 1], nb, out[j : j + 1])


def _bad(name: str, slot: int, record: int, reason: str) -> EntryDecodeError:
    return EntryDecodeError(f"field {name!r}, record {record}, slot {slot}: {reason}", field=name, slot=slot,
                            index=record, reason=reason)


class _SharedPool(ThreadPoolExecutor):
    """The reader threads the buckets' loaders share; a bucket's loader
    releasing its resources does not stop them (:meth:`stop` does)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # a bucket's loader lets go; the BucketLoader stops the pool

    def stop(self, wait: bool) -> None:
        super().shutdown(wait=wait, cancel_futures=True)


class _Threads:
    """This process's shared pool (a forked child makes its own)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool: _SharedPool | None = None
        self.pid = -1

    def get(self) -> _SharedPool:
        if self.pool is None or self.pid != os.getpid():
            self.pool = _SharedPool(self.threads, thread_name_prefix="mmstore-buckets")
            self.pid = os.getpid()
        return self.pool

    def stop(self, wait: bool) -> None:
        pool, self.pool = self.pool, None
        if pool is not None and self.pid == os.getpid():
            pool.stop(wait)


class _BucketPart(Loader):
    """One bucket's Loader: its image field read by an :class:`ExactReader`,
    its reads on the shared threads."""

    _shape: tuple[int, int] = (1, 1)
    _threads: _Threads | None = None

    def _crop_reader(self, epoch: int) -> CropReader | None:
        if self._crop_field is None:
            return None
        return ExactReader(self.store, self._crop_field, self._shape, getattr(self.order, "seed", 0), epoch)

    def _setup(self) -> None:
        res = self._res
        if res.pid != os.getpid():
            res.adopt()
        if res.pool is None and self._threads is not None:
            res.pool = self._threads.get()
        super()._setup()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a bucket's loader is part of a BucketLoader; pickle the BucketLoader")


# -- the loader -------------------------------------------------------------------


def _spec_of(order: Any) -> OrderSpec:
    """``order=`` as an :class:`OrderSpec` (an Order object gives its parameters)."""
    if isinstance(order, str):
        return OrderSpec(order)
    if isinstance(order, OrderSpec):
        return order
    if isinstance(order, Order):
        extra = {"block": order.block, "window": order.window} if isinstance(order, BlockShuffle) else {}
        return OrderSpec(order.kind, seed=order.seed, rank=order.rank, world_size=order.world_size,
                         drop_last=order.drop_last, pad=order.pad, split=order.split, **extra)
    raise TypeError(f"order must be a kind name, an mmstore.order.OrderSpec or an Order, got {type(order).__name__}")


class BucketPlan(dict):
    """What a :class:`BucketLoader` chose (``describe()``): a dict whose
    ``str()`` reads as sentences. Keys: ``field``, ``buckets`` (one dict per
    bucket: ``shape``, ``records``, ``batches``, ``batch_bytes``), ``batches``
    (an epoch's steps), ``order``, ``prefetch`` (per bucket), ``hold``,
    ``threads`` (shared), ``ring_bytes`` (all the buckets' rings, once
    allocated), ``in_flight`` (the most batches queued at once),
    ``mem_bytes`` (each bucket's share of the budget), ``warm``, ``path``
    (what runs per record) and ``parts`` (each bucket's
    :class:`~mmstore.engine.plan.LoaderPlan`)."""

    def __str__(self) -> str:
        mb = lambda x: f"{x / 1e6:,.1f} MB"  # noqa: E731
        lines = [f"same-bucket batches of field {self['field']!r}: {len(self['buckets'])} bucket(s), "
                 f"{self['batches']} batches an epoch (order {self['order']})"]
        for b in self["buckets"]:
            lines.append(f"  {b['shape'][0]} x {b['shape'][1]}: {b['records']:,} records, {b['batches']} batches")
        lines.append(f"read-ahead: {self['prefetch']} batch(es) per bucket, at most {self['in_flight']} in flight, "
                     f"{self['threads']} shared reader threads")
        lines.append(f"rings: {mb(self['ring_bytes'])} once every bucket was read "
                     f"({self['prefetch']} prefetch + {self['hold']} hold + 1 buffers per bucket)")
        lines.append(f"per record: {self['path']}")
        return "\n".join(lines)


class BucketLoader(Loader):
    """Batches of one bucket each, from an image field of its own shape in a
    few sizes (what ``Loader(store, B)`` returns over a field that declares
    aspect buckets; ``BucketLoader(store, B)`` groups any field of images of
    their own shape by its records' exact sizes; NOTE [bucket schedule] in
    :mod:`mmstore.torch.buckets`).

    It takes the Loader's arguments (``crop=`` must be None, ``process=``
    False: its threads read in this process) and keeps its promises: ``len()`` exact,
    ``set_epoch``, the epoch rules, ``state_dict`` / ``load_state_dict``
    (a resume yields exactly the remaining batches, in another process too),
    ``close``, one epoch at a time, ``transform`` called with the epoch and
    the batch index across ranks, pickling. ``tuning.prefetch`` is per
    bucket; see the module docstring for memory and threads.
    """

    def __init__(
        self,
        store: Any,
        batch_size: int,
        order: str | OrderSpec | Order = "permutation",
        *,
        fields: Sequence[str] | None = None,
        drop_last: bool = False,
        device: Any = None,
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
        if crop is not None:
            raise TypeError("BucketLoader: crop= gives one fixed output shape, no buckets needed; "
                            "use Loader(store, batch_size, crop=...)")
        if process:
            raise ValueError("BucketLoader reads its buckets with threads in this process: process=True is for a "
                             "Loader of one shape (a crop= gives one: Loader(store, batch_size, crop=...))")
        from .loader import _count, _flag  # the Loader's argument checks, the same messages

        batch_size = _count("batch_size", batch_size)
        drop_last = _flag("drop_last", drop_last)
        spec = _spec_of(order)
        src = resolve_source(store, indices)
        self.store = src.store
        self._own_store = src.own
        try:
            self.fields = tuple(self.store.field_list(src.defaults.get("fields") if fields is None else fields))
            self.field = _bucket_field(self.store, self.fields)
            self.shapes, groups = bucket_groups(self.store, self.field, src.indices)
            if src.indices is not None:
                groups = [src.indices[g] for g in groups]
        except BaseException:
            if src.own:
                self.store.close()
            raise
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.indices: np.ndarray | None = src.indices
        self.tuning = tune = split_tuning(tuning, {})[0]
        self.as_tuple = bool(src.defaults.get("as_tuple", False) if as_tuple is None else _flag("as_tuple", as_tuple))
        self.transform = transform
        self._transform = transform_call(transform)
        rank, world = dist_rank_world(spec.rank, spec.world_size)
        self._spec = dataclasses.replace(spec, rank=rank, world_size=world)
        self._interleave = spec.kind != "sequential"
        k = max(1, len(self.shapes))
        self._prefetch = int(tune.prefetch) if tune.prefetch is not None else max(1, 4 // k)
        budget = memory_budget(tune.mem_bytes)[0]
        self._threads = _Threads(int(tune.threads or 16))
        # the threads a bucket's loader is told of only cut its batches (the pool is the shared one):
        # one piece per usable core, as the Loader cuts a fixed-shape batch read from memory; a
        # piece's raw records go out in one AIO submit, so a cold read keeps its queue depth
        sub_tuning = dataclasses.replace(tune, prefetch=self._prefetch, warm=False, mem_bytes=max(1, budget // k),
                                         threads=max(1, min(int(tune.threads or 16), _os.usable_cores())))
        from ._resources import check_device, check_pin_memory

        _, cuda = check_device(device)
        pin = check_pin_memory(pin_memory, cuda)
        defaults = src.defaults
        chw = bool(defaults.get("chw", False) if chw is None else _flag("chw", chw))
        ragged = defaults.get("ragged", "list") if ragged is None else ragged
        pad_value = defaults.get("pad_value", 0) if pad_value is None else pad_value
        self.chw = chw
        self.warm_report: _os.WarmReport | None = None
        self._config = {
            "batch_size": batch_size, "fields": self.fields, "drop_last": drop_last, "device": device,
            "pin_memory": pin_memory, "copy": copy, "as_tuple": self.as_tuple, "chw": chw, "ragged": ragged,
            "pad_value": pad_value, "transform": transform, "tuning": tuning,
        }
        parts: list[_BucketPart] = []
        try:
            with warnings.catch_warnings():
                # one warning for all the buckets below, not one per bucket
                warnings.filterwarnings("ignore", message=r"mmstore\.torch\.Loader: \d+ records over \d+ ranks")
                for shape, recs in zip(self.shapes, groups):
                    bspec = dataclasses.replace(self._spec, seed=bucket_seed(spec.seed, shape),
                                                drop_last=self._spec.drop_last or drop_last)
                    part = cast(_BucketPart, _BucketPart.__new__(_BucketPart))
                    part._shape = shape
                    part._threads = self._threads
                    part.__init__(  # type: ignore[misc]
                        self.store, batch_size, bspec,
                        fields=self.fields, drop_last=drop_last, device=device, pin_memory=pin, copy=copy,
                        as_tuple=False, chw=chw, ragged=ragged, pad_value=pad_value, indices=recs,
                        crop=CenterCrop(shape, ratio=1.0, field=self.field), tuning=sub_tuning,
                    )
                    parts.append(part)
        except BaseException:
            for p in parts:
                p.close()
            if src.own:
                self.store.close()
            raise
        self._parts = parts
        self.counts = [len(p) for p in parts]
        """Batches of each bucket in an epoch (this rank's; the same on every rank)."""
        self.order = parts[0].order if parts else None  # type: ignore[assignment]
        repeated = sum(p.order.repeated() for p in parts) if not (self._spec.pad or self._spec.drop_last) else 0
        if repeated and world > 1 and not drop_last:
            warnings.warn(
                f"mmstore.torch.Loader: {repeated} record(s) of {len(parts)} buckets are read twice per epoch so "
                f"that every one of the {world} ranks has the same number of batches of every bucket (a bucket "
                f"whose records per rank are a multiple of the batch size {batch_size}, with a remainder over the "
                "ranks); OrderSpec(..., drop_last=True) drops them instead", UserWarning, stacklevel=3,
            )
        self._epoch: int | None = None
        self._next_epoch = 0
        self._resume: tuple[int, int] | None = None
        self._pos: tuple[int, int] | None = None
        self._pos_used = False
        self._active: weakref.ref[_BucketEpoch] | None = None  # type: ignore[assignment]
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._warmed = False
        self._warm_mode = "none"
        self._warm_handle: Any = None  # a background warm pass (tuning.warm="background")
        self._finalizer = weakref.finalize(self, self._threads.stop, False)

    # -- public ------------------------------------------------------------------
    def __len__(self) -> int:
        return int(sum(self.counts))

    @property
    def fresh_buffers(self) -> int:
        """Ring buffers replaced across the buckets' rings (see ``Loader.fresh_buffers``)."""
        return sum(p.fresh_buffers for p in self._parts)

    @property
    def prefetch(self) -> int:
        """Batches each bucket reads ahead."""
        return self._prefetch

    @property
    def ring_size(self) -> int:
        """Buffers of each bucket's ring."""
        return self._parts[0].ring_size if self._parts else 0

    def schedule(self, epoch: int) -> np.ndarray:
        """The bucket (an index into :attr:`shapes`) of each step of ``epoch``."""
        return bucket_schedule(self.counts, self._spec.seed, epoch, interleave=self._interleave)

    def set_epoch(self, epoch: int) -> None:
        Loader.set_epoch(self, epoch)

    def __iter__(self) -> Iterator[Any]:
        with self._guard():
            run = self._active() if self._active is not None else None
            if run is not None and run.live():
                raise LoaderStateError(
                    f"mmstore.torch.Loader: epoch {run.epoch} is still being iterated ({run.pos - run.start} of "
                    f"{run.total - run.start} batches yielded); one Loader runs one epoch at a time. Finish that "
                    "loop, or end it early: `break` out of the `for` loop, or `del`/`.close()` the iterator")
            if run is not None:
                run.close()
            epoch = self._next_epoch if self._epoch is None else self._epoch
            start = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
            if not self._warmed:
                self._do_warm()
            it = _BucketEpoch(self, epoch, start)
            self._active = weakref.ref(it)
            self._pos, self._pos_used = (epoch, start), False
        return it

    def close(self) -> None:
        """Stop reading; free every bucket's threads, buffers and descriptors
        (an epoch in progress: its next ``next()`` raises ``LoaderStateError``)."""
        with self._guard():
            run = self._active() if self._active is not None else None
            if run is not None:
                run.closed = True
            for p in self._parts:
                p.close()
            self._threads.stop(True)
            warm, self._warm_handle = self._warm_handle, None
            if warm is not None:
                warm.stop()
            if self._own_store:
                self.store.close()

    def describe(self) -> BucketPlan:  # type: ignore[override]
        """What this loader chose: a :class:`BucketPlan` (the buckets and
        their batches, read-ahead, threads, ring memory, each bucket's plan)."""
        parts = [p.describe() for p in self._parts]
        buckets = [{"shape": list(s), "records": int(len(p.indices) if p.indices is not None else 0),
                    "batches": c, "batch_bytes": pl.batch_bytes}
                   for s, p, c, pl in zip(self.shapes, self._parts, self.counts, parts)]
        hold = self.tuning.hold
        ring = sum(p.ring_size * pl.batch_bytes for p, pl in zip(self._parts, parts))
        path = parts[0].crop["path"] if parts and parts[0].crop else ""
        return BucketPlan(
            field=self.field, buckets=buckets, batches=len(self), order=self._spec.kind, prefetch=self._prefetch,
            hold=hold, threads=self._threads.threads, ring_bytes=ring, in_flight=self._prefetch * len(self._parts),
            mem_bytes=self._parts[0].tuning.mem_bytes if self._parts else 0, warm=self._warm_mode, path=path,
            parts=parts,
        )

    def __repr__(self) -> str:
        return (f"<mmstore.torch.Loader (same-bucket batches) {self.store.path!r} batch_size={self.batch_size} "
                f"field={self.field!r} buckets={len(self.shapes)} order={self._spec.kind}>")

    # -- resume -------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        spec = dataclasses.asdict(self._spec)
        o = {"kind": "buckets", "order": spec, "field": self.field, "shapes": [list(s) for s in self.shapes],
             "counts": [int(c) for c in self.counts],
             "records": [int(len(p.indices)) if p.indices is not None else 0 for p in self._parts]}
        return {
            "batch_size": self.batch_size, "drop_last": self.drop_last, "order": o, "seed": spec["seed"],
            "rank": spec["rank"], "world_size": spec["world_size"],
            "store": {"store_id": str(self.store.store_id), "records": len(self.store)},
            "subset": subset_state(self.indices),
        }

    # -- internals ----------------------------------------------------------------
    def _do_warm(self) -> None:
        """The first epoch's warm pass (``tuning.warm``), for the whole store at once."""
        self._warmed = True
        mode = self.tuning.warm
        if self.store.replica is not None or not mode:
            return
        paths = data_paths(self.store, self.fields)
        if mode == "auto":
            n_read = len(self.store) if self.indices is None else len(self.indices)
            fits = all(p.describe().fits for p in self._parts)
            if not (fits and paths and 2 * n_read >= len(self.store) and resident_fraction(paths) < 0.5):
                return
        if mode == "background":
            self._warm_handle = _os.warm_in_background(paths)
            self._warm_mode = "background"
            return
        self.warm_report = _os.warm(paths)
        self._warm_mode = "foreground"

    def _deliver(self, batch: dict[str, Any], epoch: int, t: int) -> Any:
        out: Any = batch
        if self.as_tuple:
            out = tuple(batch[f] for f in self.fields)
        if self._transform is not None:
            out = self._transform(out, epoch, t * self._spec.world_size + self._spec.rank)  # type: ignore[operator]
        self._pos = (epoch, t + 1)
        return out

    # -- pickling: the configuration; the copy opens its own threads and files ------
    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "own_store": self._own_store, "order": self._spec, "config": self._config,
                "indices": self.indices, "epoch": self._epoch, "next_epoch": self._next_epoch,
                "resume": self._resume, "pos": self._pos, "pos_used": self._pos_used}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["store"], order=state["order"], indices=state["indices"], **state["config"])  # type: ignore[misc]
        self._own_store = state["own_store"]
        self._epoch, self._next_epoch = state["epoch"], state["next_epoch"]
        self._resume, self._pos, self._pos_used = state["resume"], state["pos"], state["pos_used"]


class _BucketEpoch:
    """One epoch of a :class:`BucketLoader`: the schedule, and the buckets'
    epoch iterators, each started when its first batch is ``LOOKAHEAD`` steps
    ahead and closed after its last batch."""

    def __init__(self, loader: BucketLoader, epoch: int, start: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.sched = loader.schedule(epoch)
        self.total = len(self.sched)
        self.start = self.pos = start
        k = len(loader.shapes)
        self.done = np.bincount(self.sched[:start], minlength=k).astype(np.int64) if k else np.zeros(0, np.int64)
        self.left = np.bincount(self.sched, minlength=k).astype(np.int64) - self.done if k else self.done
        self.its: dict[int, Any] = {}
        # the page cache's residency of the store's files and the usable cores, measured by the
        # first bucket that starts and used by every bucket of this epoch
        self.measures: dict[Any, Any] = {}
        self.ended = False
        self.closed = False
        self.pid = os.getpid()
        self._busy = threading.Lock()

    def live(self) -> bool:
        return not self.ended and not self.closed and self.pid == os.getpid()

    def __iter__(self) -> _BucketEpoch:
        return self

    def __len__(self) -> int:
        return self.total - self.start

    def _begin(self, b: int) -> None:
        """Start bucket ``b``'s epoch iterator at its position."""
        part = self.loader._parts[b]
        d = int(self.done[b])
        # the bucket's position, as load_state_dict + set_epoch would set it (without proving a
        # state this loader made): d of its batches of this epoch delivered (0: from its start)
        part._epoch, part._pos = self.epoch, None
        part._resume = (self.epoch, d) if d else None
        with shared_measures(self.measures):
            self.its[b] = iter(part)

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            raise LoaderStateError(f"mmstore.torch.Loader: this iterator of epoch {self.epoch} was started in process "
                                   f"{self.pid} and cannot be continued in forked process {os.getpid()}; start a "
                                   "new epoch here with iter(loader)")
        if not self._busy.acquire(blocking=False):
            raise LoaderStateError("mmstore.torch.Loader: two threads called next() on the same epoch iterator at "
                                   "once; an epoch is consumed by one thread at a time (use one Loader per thread)")
        try:
            return self._next()
        finally:
            self._busy.release()

    def _next(self) -> Any:
        if self.closed:
            raise LoaderStateError(f"mmstore.torch.Loader: the loader was closed (Loader.close()) while epoch "
                                   f"{self.epoch} was being iterated, after {self.pos - self.start} of "
                                   f"{self.total - self.start} batches; the epoch did not complete. Start a new "
                                   "epoch with iter(loader) if that was not intended")
        if self.ended:
            raise StopIteration
        t = self.pos
        if t >= self.total:
            self.loader._commit(self.epoch)
            self.close()
            raise StopIteration
        try:
            for u in range(t, min(self.total, t + 1 + LOOKAHEAD)):
                b = int(self.sched[u])
                if b not in self.its and self.left[b] > 0:
                    self._begin(b)
            b = int(self.sched[t])
            batch = next(self.its[b])
        except StopIteration:
            self.close()
            raise LoaderStateError(f"mmstore.torch.Loader: bucket {self.loader.shapes[b]} ended before its "
                                   "scheduled batches; this is a bug, please report it") from None
        except BaseException:
            self.close()
            raise
        self.done[b] += 1
        self.left[b] -= 1
        if self.left[b] == 0:
            self.its.pop(b).close()
        self.pos = t + 1
        if t + 1 - self.start == 2:
            self.loader._commit(self.epoch)
        return self.loader._deliver(batch, self.epoch, t)

    def close(self) -> None:
        """End this epoch: every bucket's iterator ends (what is queued is cancelled)."""
        self.ended = True
        its, self.its = self.its, {}
        for it in its.values():
            it.close()

    def __del__(self) -> None:
        self.ended = True
        self.its = {}  # each bucket's iterator ends as it is dropped, without waiting


def _pick(args: tuple[Any, ...], kwargs: dict[str, Any]) -> type[Loader] | None:
    """``Loader(*args, **kwargs)`` is a :class:`BucketLoader` over a field that declares buckets."""
    store = args[0] if args else kwargs.get("store")
    return BucketLoader if wants_buckets(store, fields=kwargs.get("fields"), crop=kwargs.get("crop")) else None


Loader._variants.append(_pick)


# -- the DataLoader sampler ---------------------------------------------------------


def _store_of(data: Any) -> tuple[Any, np.ndarray | None, Sequence[str] | None]:
    """The store, the subset's record indices (None: all) and the dataset's fields."""
    layers = []
    obj = data
    while isinstance(obj, Subset):
        layers.append(np.asarray(obj.indices, np.int64))
        obj = obj.dataset
    fields = None
    if isinstance(obj, StoreDataset):
        st, fields = obj.store, obj.fields
    else:
        st = open_store_arg(obj)
    sub = None
    for layer in reversed(layers):
        sub = layer if sub is None else sub[layer]
    return st, sub, fields


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of one bucket each, as lists of dataset indices (a DataLoader ``batch_sampler``).

    ``DataLoader(StoreDataset(store), batch_sampler=BucketBatchSampler(store, 16))``:
    every batch's records have one shape, so the default collate stacks
    them. The schedule is the Loader's (NOTE [bucket schedule] in
    :mod:`mmstore.torch.buckets`): the same buckets, per-bucket orders, rank
    split and interleaving for the same arguments.

    Parameters
    ----------
    store_or_dataset : Store, path, StoreDataset or Subset of one
        What the DataLoader reads (its length and the field's sizes are used;
        a ``Subset``'s indices are positions in it, as the DataLoader's are).
    batch_size : int
        Records per batch (a bucket's last batch is shorter unless ``drop_last``).
    seed : int, default 0
        The seed of the orders and of the interleaving, the same on every rank.
    drop_last : bool, default False
        Drop every bucket's short last batch (each rank keeps ``n_b //
        world_size`` of a bucket's records first, so the counts stay equal).
    rank, world_size : int, optional
        Default: ``torch.distributed``'s when it is initialised, else 0 and 1.
    order : {"permutation", "block", "sequential"}, default "permutation"
        The order within each bucket (``"sequential"`` also reads the buckets
        one after the other).
    pad : bool, default False
        As the Loader's: every record once and every rank the same number of
        batches of every bucket (False); wrap-around padding as
        ``DistributedSampler`` (True).
    field : str, optional
        The image field (default: the one field of images of their own shape).
    block, window, split : optional
        The order's, as :class:`~mmstore.order.OrderSpec`.

    ``set_epoch``, the epoch rules, ``state_dict(consumed=)`` /
    ``load_state_dict`` follow :class:`~mmstore.torch.OrderBatchSampler`,
    counted in batches (``yielded`` is the steps handed out).
    """

    def __init__(self, store_or_dataset: Any, batch_size: int, *, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, order: str = "permutation",
                 pad: bool = False, field: str | None = None, block: int | None = None, window: int | None = None,
                 split: str | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"BucketBatchSampler: batch_size must be an int >= 1, got {batch_size!r}")
        spec = OrderSpec(order, seed=seed, rank=rank, world_size=world_size, drop_last=bool(drop_last), pad=pad,
                         block=block, window=window, split=split)
        st, sub, fields = _store_of(store_or_dataset)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        names = st.field_list(fields)
        self.field = field if field is not None else _bucket_field(st, names)
        # positions in the Subset where there is one (what the DataLoader indexes), else record indices
        self.shapes, groups = bucket_groups(st, self.field, sub)
        r, w = dist_rank_world(rank, world_size)
        self.rank, self.world_size = r, w
        self.seed = int(seed)
        self._interleave = order != "sequential"
        self._groups = groups
        rb = max(1, int(st.stored_record_bytes(list(names))))
        self.orders: list[Order] = []
        for shape, g in zip(self.shapes, groups):
            kw: dict[str, Any] = spec.order_kw()
            kw["seed"] = bucket_seed(seed, shape)
            kw["drop_last"] = bool(drop_last)
            kw["batch_size"] = self.batch_size
            if order == "block":  # sized as the Loader sizes it (BlockShuffle.auto; block=/window= win)
                kw["record_bytes"] = rb
            self.orders.append(make_order(order, len(g), rank=r, world_size=w, **kw))
        n = [len(o) for o in self.orders]
        self.counts = [x // self.batch_size if self.drop_last else -(-x // self.batch_size) for x in n]
        """Batches of each bucket in an epoch (the same on every rank)."""
        self._cursor = _EpochCursor()

    @property
    def epoch(self) -> int:
        """The epoch being iterated, else the one the next iteration runs."""
        return self._cursor.state(None)[0]

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` in the next iteration (NOTE [epoch rules] in :mod:`mmstore.torch.sampler`)."""
        self._cursor.set_epoch(epoch)

    def schedule(self, epoch: int) -> np.ndarray:
        """The bucket (an index into :attr:`shapes`) of each step of ``epoch``."""
        return bucket_schedule(self.counts, self.seed, epoch, interleave=self._interleave)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """Every batch of ``epoch`` in order (``int64`` dataset indices)."""
        sched = self.schedule(epoch)
        cut = []
        for g, o, c in zip(self._groups, self.orders, self.counts):
            idx = g[o.epoch(epoch)]
            cut.append([idx[k * self.batch_size : (k + 1) * self.batch_size] for k in range(c)])
        nxt = [0] * len(cut)
        out = []
        for b in sched.tolist():
            out.append(cut[b][nxt[b]])
            nxt[b] += 1
        return out

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start, token = self._cursor.begin()
        return self._run(self.batches(epoch), start, token)

    def _run(self, batches: list[np.ndarray], start: int, token: object) -> Iterator[list[int]]:
        cur = self._cursor
        for t in range(start, len(batches)):
            if token is cur.token:
                cur.pos = t + 1
                if not cur.used and t > start:
                    cur.use(token)
            yield batches[t].tolist()
        cur.end(token, len(batches))

    def __len__(self) -> int:
        return int(sum(self.counts))

    def _expect(self) -> dict[str, Any]:
        return {"order": {"kind": "buckets", "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                          "orders": [o.describe() for o in self.orders], "shapes": [list(s) for s in self.shapes],
                          "field": self.field},
                "batch_size": self.batch_size, "drop_last_batch": self.drop_last}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where the epoch stands: ``{"version", "epoch", "yielded", ...}``,
        ``yielded`` the batches handed out (or ``consumed``, the batches the
        loop received, with a DataLoader that reads ahead)."""
        epoch, pos = self._cursor.state(consumed)
        return {"version": 1, "epoch": epoch, "yielded": pos, **self._expect()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue the saved epoch where it stood
        (:class:`~mmstore.errors.StateMismatchError` for a state of another
        sampler)."""
        epoch, pos = _check_state(state, self._expect(), type(self).__name__)
        self._cursor.load(epoch, min(pos, len(self)), len(self))
