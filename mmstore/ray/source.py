"""Reading a store as a ``ray.data.Dataset``: :func:`read`, over the Ray
Data ``Datasource`` :class:`StoreDatasource`.

Order. The rows of one execution are the epoch's order of the store's
records (:mod:`mmstore.order`): a seeded permutation of every record
(``order="permutation"``, ``numpy.random.default_rng([seed, epoch])``), a
block shuffle (``order="block"``: whole blocks of consecutive records,
shuffled within windows of blocks, for stores larger than memory and for
URLs), or the records as stored (``"sequential"``). The order is computed
once per execution on the process that plans it (the driver, or the actor
Ray Train runs a dataset in), put once in Ray's object store, and cut into
contiguous slices, one per read task; a task emits its slice's rows in
order, and the dataset keeps the tasks' order (``preserve_order``), so the
rows are the epoch's order, whatever the cluster or the number of tasks. A
block shuffle's slices are cut at its windows when there are at least as
many windows as tasks, so that each task reads whole windows of whole
blocks (one read each, in slot order).

Tasks. A task gets the store's path or URL, the slice's bounds and a
reference to the order, never an open store: it opens the store in its own
process (a URL through the node's cache, :func:`mmstore.open`), checks that
it is the store the dataset was planned on (its ``store_id``), and reads its
rows in batches of about Ray's target block size. A task that Ray retries
(its worker killed, its node lost) reads the same slice again: every record
exactly once per epoch. A task emits its rows a block at a time as it reads
them, so ``limit()`` ends the reads soon after Ray has its rows; a row limit
that Ray pushes into the tasks (``per_task_row_limit``) is kept: a task
then reads no more rows than it.

Columns. A fixed-shape field is a tensor column (Ray's
``ArrowTensorArray``, built over the gathered batch without a copy); a
field of shape ``()`` a plain Arrow column; ``str`` and ``bytes`` fields
Arrow large strings and binaries, ragged fields of shape ``(None,)`` Arrow
large lists, over the batch's own buffers; ragged fields with rows of more
than one value and images of their own shape are variable-shaped tensor
columns (``ArrowVariableShapedTensorArray``: each record an array of its
own shape). Each task's ``BlockMetadata`` holds its exact row count and the
exact bytes of the Arrow blocks it emits (for a ragged field stored with
zstd, its stored bytes: the decoded size is known only by decoding).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import pyarrow as pa
    import ray
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata
    from ray.data.extensions import ArrowTensorArray, ArrowVariableShapedTensorArray
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("mmstore.ray needs Ray Data: pip install 'mmstore[ray]'") from exc

from ..errors import StoreChangedError
from ..format.ragged import Ragged
from ..format.schema import Field, Schema
from ..order import BlockShuffle, Order, make_order
from ..remote.url import is_url
from ..store.reader import Store, open_store

__all__ = ["MIN_TASK_BYTES", "ORDERS", "ReadJob", "StoreDatasource", "arrow_column", "arrow_type", "default_tasks",
           "read"]

ORDERS = ("permutation", "block", "sequential")
_NOT_TASK_OPTIONS = {"datasource", "parallelism", "override_num_blocks", "read_args"}
_DEFAULT_BLOCK_BYTES = 128 << 20  # a read task's output block when Ray's context sets no target
MIN_TASK_BYTES = 4 << 20
"""The least bytes a read task of :func:`read` gets by default (see :func:`default_tasks`)."""
_OFFSET_BYTES = 8  # an Arrow large list's / large string's offset per row (as Arrow counts it: n, not n + 1)
_SHAPE_OFFSET_BYTES = 4  # a variable-shaped tensor's shape list offset per row
_SHAPE_DIM_BYTES = 8  # one dimension of a variable-shaped tensor's shape (int64)


# ---------------------------------------------------------------------------
# the Arrow columns of a batch


def _ndim(f: Field) -> int:
    """Dimensions of one record of a ragged or shaped field (its own shape)."""
    return len(f.shape)


def _tensor_list(f: Field) -> bool:
    """A ragged field read as a variable-shaped tensor column (rows of more
    than one value, or an image of its own shape), not an Arrow list."""
    return f.shaped or (f.ragged and f.kind == "array" and len(f.shape) > 1)


def _ragged_buffers(r: Ragged) -> tuple[np.ndarray, np.ndarray]:
    """``r``'s offsets from 0 (int64) and the values they index."""
    offsets = np.ascontiguousarray(r.offsets, dtype=np.int64)
    if offsets.size and offsets[0]:
        offsets = offsets - offsets[0]
        values = r.values[int(r.offsets[0]):]
    else:
        values = r.values
    return offsets, np.ascontiguousarray(values)


def arrow_column(f: Field, value: Any) -> Any:
    """The Arrow array of field ``f``'s batch ``value`` (as ``read_batch``
    returns it): see the module docstring for each kind."""
    if f.shaped:
        return ArrowVariableShapedTensorArray.from_numpy(list(value))
    if f.ragged:
        if _tensor_list(f):
            return ArrowVariableShapedTensorArray.from_numpy(value.split())
        offsets, values = _ragged_buffers(value)
        n = len(offsets) - 1
        buffers = [None, pa.py_buffer(offsets), pa.py_buffer(values)]
        if f.kind == "str":  # read_batch has checked that every entry is UTF-8
            return pa.Array.from_buffers(pa.large_string(), n, buffers)
        if f.kind == "bytes":
            return pa.Array.from_buffers(pa.large_binary(), n, buffers)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    if f.shape == ():
        return pa.array(value)
    return ArrowTensorArray.from_numpy(np.ascontiguousarray(value))


def arrow_type(f: Field) -> Any:
    """The Arrow type of field ``f``'s column."""
    value_type = pa.from_numpy_dtype(f.dtype)
    if _tensor_list(f):
        from ray.data.extensions import ArrowVariableShapedTensorType

        return ArrowVariableShapedTensorType(value_type, _ndim(f))
    if f.ragged:
        return {"str": pa.large_string(), "bytes": pa.large_binary()}.get(f.kind, pa.large_list(value_type))
    if f.shape == ():
        return value_type
    return ArrowTensorArray.from_numpy(np.zeros((1, *f.shape), f.dtype)).type


def _fixed_bytes(f: Field, rows: int) -> int:
    """Bytes of ``rows`` rows of fixed field ``f`` in Arrow (as ``Array.nbytes`` counts them)."""
    if f.shape == ():
        return -(-rows // 8) if f.dtype == np.bool_ else rows * f.dtype.itemsize
    return rows * (f.nbytes + _OFFSET_BYTES)


def _variable_bytes(f: Field, data: np.ndarray) -> np.ndarray:
    """Bytes of each record of ragged or shaped field ``f`` in Arrow, from
    each record's data bytes ``data``."""
    if _tensor_list(f):
        return data + _OFFSET_BYTES + _SHAPE_OFFSET_BYTES + _SHAPE_DIM_BYTES * _ndim(f)
    return data + _OFFSET_BYTES


# ---------------------------------------------------------------------------
# the read tasks

_OPEN: dict[tuple[Any, ...], Store] = {}  # this worker's open stores (one per target and store_id; per process)


def _open(target: str, cache_dir: str | None, cache_limit: int | str | None) -> Store:
    """The store at ``target``: a URL through this node's cache."""
    if is_url(target):
        return open_store(target, cache_dir=cache_dir, cache_limit=cache_limit)
    return open_store(target)


class ReadJob:
    """What every read task of one dataset shares (plain data: it pickles as
    the target and the options, never an open store).

    Parameters
    ----------
    target
        The store's absolute path or URL.
    store_id
        The ``store_id`` of the store the dataset was planned on.
    fields
        The fields to read, in order.
    cache_dir, cache_limit
        A URL's cache on each node (None: the node's default).
    """

    def __init__(self, target: str, store_id: str, fields: Sequence[str], cache_dir: str | None,
                 cache_limit: int | str | None) -> None:
        self.target, self.store_id, self.fields = target, store_id, list(fields)
        self.cache_dir, self.cache_limit = cache_dir, cache_limit

    def open(self) -> Store:
        """The store, opened once per worker process."""
        key = (os.getpid(), self.target, self.store_id, self.cache_dir, self.cache_limit)
        store = _OPEN.get(key)
        if store is None:
            store = _open(self.target, self.cache_dir, self.cache_limit)
            if store.store_id != self.store_id:
                store.close()
                raise StoreChangedError(
                    f"{self.target}: the store there is not the one this dataset was made from (store_id "
                    f"{store.store_id}, expected {self.store_id}): it was replaced; make the dataset again "
                    "(mmstore.ray.read) to read the new store")
            _OPEN[key] = store
        return store

    def read_unit(self, store: Store, indices: np.ndarray) -> dict[str, Any]:
        """One read: records ``indices`` of the fields, in that order."""
        return store.read_batch(indices, self.fields)

    def blocks(self, order_ref: Any, start: int, stop: int, units: np.ndarray, rows_per_block: int) -> Iterator[Any]:
        """The Arrow blocks of positions ``start:stop`` of the order: each
        read unit (``units``: bounds within the slice) read in one call, and
        emitted in blocks of at most ``rows_per_block`` rows."""
        store = self.open()
        order = ray.get(order_ref)
        idx = order[start:stop]
        for a, b in zip(units[:-1].tolist(), units[1:].tolist()):
            batch = self.read_unit(store, idx[a:b])
            for lo in range(0, b - a, rows_per_block):
                hi = min(lo + rows_per_block, b - a)
                yield self.table(store, batch, lo, hi, whole=(lo == 0 and hi == b - a))

    def table(self, store: Store, batch: dict[str, Any], lo: int, hi: int, whole: bool) -> Any:
        """Rows ``lo:hi`` of ``batch`` as an Arrow table."""
        schema = store.schema
        cols = {}
        for name in self.fields:
            f, v = schema[name], batch[name]
            if not whole:
                if f.shaped:
                    v = v[lo:hi]
                elif f.ragged:
                    a, b = int(v.offsets[lo]), int(v.offsets[hi])
                    v = Ragged(v.values[a:b], v.offsets[lo:hi + 1] - a, v.kind)
                else:
                    v = v[lo:hi]
            cols[name] = arrow_column(f, v)
        return pa.table(cols)


def _read_fn(job: ReadJob, order_ref: Any, start: int, stop: int, units: np.ndarray,
             rows_per_block: int) -> Any:
    def read_fn() -> Iterator[Any]:
        return job.blocks(order_ref, start, stop, units, rows_per_block)

    return read_fn


# ---------------------------------------------------------------------------
# the datasource


def _positive(name: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _task_bounds(length: int, tasks: int, windows: np.ndarray | None) -> np.ndarray:
    """Bounds of the tasks' contiguous slices of an order of ``length``: at
    window bounds when there are at least as many windows as tasks, else
    equal cuts."""
    tasks = max(1, min(tasks, length))
    if windows is not None and len(windows) - 1 >= tasks:
        pick = np.round(np.linspace(0, len(windows) - 1, tasks + 1)).astype(np.int64)
        return np.asarray(windows, np.int64)[pick]
    return (np.arange(tasks + 1, dtype=np.int64) * length) // tasks


class StoreDatasource(Datasource):
    """A store as a Ray Data ``Datasource``: one epoch of its records in a
    seeded order, cut into contiguous slices, one read task each. Use
    :func:`read`; its parameters are this class's (but
    ``override_num_blocks``, ``ray_remote_args`` and ``preserve_order``).

    ``ray.data.read_datasource(StoreDatasource(...))`` reads the same rows;
    set ``ds.context.execution_options.preserve_order = True`` for the
    epoch's order across tasks (:func:`read` does).

    Columns: a fixed-shape field is a tensor column (``ArrowTensorArray``,
    over the gathered batch without a copy), a field of shape ``()`` a plain
    Arrow column, ``str`` / ``bytes`` fields ``large_string`` /
    ``large_binary`` and ragged fields of shape ``(None,)`` ``large_list``
    columns (over the batch's own buffers), ragged fields with rows of more
    than one value and images of their own shape variable-shaped tensor
    columns (``ArrowVariableShapedTensorArray``: each record an array of
    its own shape). ``job_type`` is the :class:`ReadJob` class the read
    tasks run (a subclass may wrap its reads)."""

    job_type: type[ReadJob] = ReadJob

    def __init__(self, store: str | os.PathLike[str] | Store, *, fields: Sequence[str] | str | None = None,
                 order: str = "permutation", seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, block: int | None = None, window: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str | None = None) -> None:
        super().__init__()
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if order != "block" and (block is not None or window is not None):
            raise ValueError(f"block= and window= size a block shuffle (order='block'); this order is {order!r}")
        self.seed, self.epoch = _positive("seed", seed), _positive("epoch", epoch)
        self.kind = order
        cache = os.fspath(cache_dir) if cache_dir is not None else None
        if isinstance(store, Store):
            target = store.url or os.path.abspath(store.path)
            self._store: Store | None = None
            opened = store
        else:
            target = os.fspath(store)
            if not is_url(target):
                target = os.path.abspath(target)
            if not is_url(target) and (cache is not None or cache_limit is not None):
                raise TypeError(f"{target!r}: cache_dir and cache_limit are for stores read from a URL")
            opened = self._store = _open(target, cache, cache_limit)
        self.schema: Schema = opened.schema
        names = opened.field_list(fields)
        self.job = ReadJob(target, opened.store_id, names, cache, cache_limit)
        self.records = len(opened)
        if order == "block":
            self.order: Order = BlockShuffle.auto(self.records, opened.stored_record_bytes(), block=block,
                                                  window=window, seed=self.seed, rank=rank, world_size=world_size,
                                                  drop_last=drop_last)
        else:
            okw: dict[str, Any] = {"rank": rank, "world_size": world_size, "drop_last": drop_last}
            if order != "sequential":
                okw["seed"] = self.seed
            self.order = make_order(order, self.records, **okw)
        # the mean decoded bytes of a record of each ragged field (to size blocks before reading)
        self._mean = {n: self._mean_bytes(opened, n) for n in names if self.schema[n].ragged}
        self._projection_map = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # the planning process's handle: another process opens its own
        return state

    def _opened(self) -> Store:
        if self._store is None:
            self._store = _open(self.job.target, self.job.cache_dir, self.job.cache_limit)
        return self._store

    def _mean_bytes(self, store: Store, name: str) -> float:
        f = self.schema[name]
        if f.shaped:
            hw = store.read_batch(np.arange(min(len(store), 4096)), [f.hw_name])[f.hw_name]
            per_px = f.dtype.itemsize * math.prod(f.shape[2:])
            return float((hw[:, 0].astype(np.float64) * hw[:, 1]).mean() * per_px) if len(hw) else 0.0
        return float(store.stored_record_bytes([name])) if len(store) else 0.0

    # -- Ray's Datasource interface -------------------------------------------------
    def get_name(self) -> str:
        return "mmstore"

    def supports_projection_pushdown(self) -> bool:
        return True

    def _fields(self) -> list[str]:
        keep = self.get_projection_map()
        return [n for n in self.job.fields if keep is None or n in keep]

    def _record_bytes(self, names: Sequence[str]) -> float:
        total = 0.0
        for n in names:
            f = self.schema[n]
            total += _fixed_bytes(f, 1) if not f.ragged else float(_variable_bytes(f, np.array([self._mean[n]]))[0])
        return total

    def estimate_inmemory_data_size(self) -> int | None:
        return int(self._record_bytes(self._fields()) * len(self.order))

    def arrow_schema(self, names: Sequence[str] | None = None) -> Any:
        """The Arrow schema of the rows (of ``names``, default: the fields read)."""
        names = self._fields() if names is None else names
        return pa.schema([(n, arrow_type(self.schema[n])) for n in names])

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[Any]:
        names = self._fields()
        idx = self.order.epoch(self.epoch)
        length = len(idx)
        if length == 0:
            return []
        windows = self.order.window_bounds(self.epoch) if isinstance(self.order, BlockShuffle) else None
        bounds = _task_bounds(length, max(1, int(parallelism)), windows)
        target = getattr(data_context, "target_max_block_size", None) or _DEFAULT_BLOCK_BYTES
        rows_per_block = max(1, int(target // max(1.0, self._record_bytes(names))))
        sizes = self._row_bytes(names, idx)
        job = self.job_type(self.job.target, self.job.store_id, names, self.job.cache_dir, self.job.cache_limit)
        ref = ray.put(idx)
        schema = self.arrow_schema(names)
        tasks = []
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            stop = b if per_task_row_limit is None else min(b, a + int(per_task_row_limit))
            units = self._units(a, stop, windows, rows_per_block)
            nbytes = self._task_bytes(names, sizes, a, stop, units, rows_per_block)
            meta = BlockMetadata(num_rows=stop - a, size_bytes=nbytes, exec_stats=None, input_files=None)
            tasks.append(ReadTask(_read_fn(job, ref, a, stop, units, rows_per_block), meta, schema=schema,
                                  per_task_row_limit=per_task_row_limit))
        return tasks

    # -- planning ---------------------------------------------------------------------
    @staticmethod
    def _units(a: int, b: int, windows: np.ndarray | None, rows_per_block: int) -> np.ndarray:
        """Bounds, within the slice ``a:b``, of its reads: the windows of a
        block shuffle (each read whole), else blocks of ``rows_per_block``."""
        if windows is None:
            cuts = np.arange(a, b, rows_per_block, dtype=np.int64)
        else:
            cuts = np.asarray(windows, np.int64)
            cuts = cuts[(cuts > a) & (cuts < b)]
        return np.unique(np.concatenate(([a, b], cuts))).astype(np.int64) - a

    def _row_bytes(self, names: Sequence[str], idx: np.ndarray) -> dict[str, np.ndarray]:
        """Arrow bytes of each record of the order, of each ragged field."""
        ragged = [n for n in names if self.schema[n].ragged]
        if not ragged:
            return {}
        store = self._opened()
        out = {}
        for n in ragged:
            f = self.schema[n]
            if f.shaped:
                hw = store.read_batch(idx, [f.hw_name])[f.hw_name].astype(np.int64)
                data = hw[:, 0] * hw[:, 1] * (f.dtype.itemsize * math.prod(f.shape[2:]))
            else:
                data = store.slot_view.entry_sizes(n, idx)
            out[n] = _variable_bytes(f, np.asarray(data, np.int64))
        return out

    def _task_bytes(self, names: Sequence[str], sizes: dict[str, np.ndarray], a: int, b: int, units: np.ndarray,
                    rows_per_block: int) -> int:
        """The bytes of the Arrow blocks a task of positions ``a:b`` emits."""
        blocks = [min(rows_per_block, int(hi - lo) - k) for lo, hi in zip(units[:-1], units[1:])
                  for k in range(0, int(hi - lo), rows_per_block)]
        total = 0
        for n in names:
            f = self.schema[n]
            if f.ragged:
                total += int(sizes[n][a:b].sum())
            else:
                total += sum(_fixed_bytes(f, r) for r in blocks)
        return total


def default_tasks(source: StoreDatasource) -> int:
    """The read tasks of :func:`read` by default: one per Ray target block
    of the epoch's bytes, and at least two per CPU of the cluster while each
    still gets :data:`MIN_TASK_BYTES`: Ray's own default cuts a small data
    set into many tasks of a few rows, each of which then costs more to
    start than to read."""
    nbytes = source.estimate_inmemory_data_size() or 0
    target = ray.data.DataContext.get_current().target_max_block_size or _DEFAULT_BLOCK_BYTES
    cpus = int(float(ray.cluster_resources().get("CPU", 1.0))) if ray.is_initialized() else 1
    tasks = max(-(-nbytes // target), min(2 * max(cpus, 1), -(-nbytes // MIN_TASK_BYTES)))
    return max(1, min(int(tasks), len(source.order)))


def read(
    store: str | os.PathLike[str] | Store,
    *,
    fields: Sequence[str] | str | None = None,
    order: str = "permutation",
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    block: int | None = None,
    window: int | None = None,
    override_num_blocks: int | None = None,
    preserve_order: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | str | None = None,
    ray_remote_args: Mapping[str, Any] | None = None,
) -> Any:
    """One epoch of a store as a ``ray.data.Dataset``, in a seeded order.

    Parameters
    ----------
    store
        A local path (seen by every node: a shared file system when the
        cluster has several nodes), an object-storage URL (each node reads
        it through its own verified cache, as :func:`mmstore.open`), or an
        open :class:`~mmstore.Store` (its path or URL is used; the tasks
        open their own).
    fields
        The fields to read (default: all); ``select_columns`` on the
        dataset reads fewer still. Only those fields are read.
    order
        ``"permutation"``: every record once, in a uniform random order of
        ``seed`` and ``epoch`` (``mmstore.order.Permutation``);
        ``"block"``: a block shuffle (``mmstore.order.BlockShuffle``, sized
        as the Loader sizes it, or by ``block=`` and ``window=``): tasks
        read whole blocks, for stores larger than memory and for URLs;
        ``"sequential"``: the stored order.
    seed, epoch
        The order is a function of these (and of the store, ``order``,
        ``rank``, ``world_size``, ``drop_last``, ``block``, ``window``)
        only: the same on any cluster and for any number of tasks. Make one
        dataset per epoch, ``read(..., epoch=e)``, for a new order each
        epoch.
    rank, world_size, drop_last
        Read only this rank's part of the epoch (as
        ``DistributedSampler``: every rank the same number of rows, the
        order padded by wrap-around, or its tail dropped with
        ``drop_last``): one dataset per training worker, each of its own
        records.
    override_num_blocks
        The read tasks, each one contiguous slice of the epoch's order
        (default: :func:`default_tasks`: one per Ray target block of the
        epoch's bytes, at least two per CPU of the cluster while each still
        gets 4 MiB).
    preserve_order
        Rows in exactly the epoch's order (default). False: each task's
        rows in order, the tasks' blocks as they finish (no task waits for
        a slower one before it).
    cache_dir, cache_limit
        For a URL: the cache of each node, as in :func:`mmstore.open`.
    ray_remote_args
        The read tasks' Ray options, as ``ray.data.read_datasource`` names
        them (``num_cpus``, ``memory``, ``runtime_env``, ``resources``, ...).

    Returns
    -------
    ray.data.Dataset
        A column per field (its Arrow type: see :class:`StoreDatasource`).

    Raises
    ------
    KeyError
        A field the store does not have.
    ValueError
        An unknown ``order``, or ``block``/``window`` for another order.
    """
    source = StoreDatasource(store, fields=fields, order=order, seed=seed, epoch=epoch, rank=rank,
                             world_size=world_size, drop_last=drop_last, block=block, window=window,
                             cache_dir=cache_dir, cache_limit=cache_limit)
    kw: dict[str, Any] = {}
    if override_num_blocks is not None:
        kw["override_num_blocks"] = _positive("override_num_blocks", override_num_blocks, 1)
    else:
        kw["override_num_blocks"] = default_tasks(source)
    if ray_remote_args:
        named = set(inspect.signature(ray.data.read_datasource).parameters) - _NOT_TASK_OPTIONS
        unknown = sorted(set(ray_remote_args) - named)
        if unknown:
            raise ValueError(f"ray_remote_args {unknown} are not read task options; options are {sorted(named)}")
        kw.update(ray_remote_args)
    ds = ray.data.read_datasource(source, **kw)
    ds.context.execution_options.preserve_order = bool(preserve_order)
    return ds
