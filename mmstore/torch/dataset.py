"""``StoreDataset``: a map-style ``torch.utils.data.Dataset`` over a store.

Batches without per-sample copies
---------------------------------
When a ``DataLoader`` batches automatically it calls ``dataset.__getitems__
(indices)`` and hands the result to its ``collate_fn``. ``StoreDataset.
__getitems__`` reads the whole batch with one ``Store.read_batch`` call straight
into the batch tensors (inside a worker process: into shared memory, so the
tensors cross back to the main process without another copy) and returns a
:class:`StoreBatch`. A ``StoreBatch`` is a sequence of per-sample views, so
any collate function that iterates samples still works, but its elements are
of a type registered in torch's ``default_collate_fn_map``: ``default_collate``
(the DataLoader's default) recognises them and returns the already-batched
tensors instead of stacking 256 per-sample tensors into a new one.
:func:`collate` does the same explicitly and can be passed as ``collate_fn``.

The batched path is faster than per-sample reads + stacking
(``benchmarks/bench_loader.py`` compares them). Both are bounded by what every
worker-process loader pays per batch: a fresh shared-memory segment of the
batch's size (38 MB for 256 images of 224x224x3; allocation + page faults)
that the batch is written into; the
thread-based :class:`mmstore.torch.Loader` avoids it.

Fork safety
-----------
The dataset holds a :class:`mmstore.Store`, which holds only plain data and
per-process handles tagged with the pid that created them (NOTE [fork safety]
in ``mmstore/store/reader.py``); it pickles as the store's path. So workers started
by fork, forkserver or spawn, persistent or not, each open their own mappings
on first use, even when the parent read the store before they started
(LMDB: NOTE [lmdb and fork] in ``mmstore/store/backends/lmdb.py``). No per-sample Python
objects are held: index data stays in the store's mapped files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate, default_collate_fn_map

from ..format.ragged import Ragged
from ..store.reader import Store, open_store
from ._ragged import (
    Padded,
    check_mode,
    check_pad,
    pad_list,
    ragged_batch,
    refuse_shaped,
    sample_of,
    split_fields,
)

__all__ = ["Padded", "StoreBatch", "StoreDataset", "collate", "open_store_arg"]


def open_store_arg(store: Store | str | os.PathLike[str]) -> Store:
    """A :class:`Store` from a store or a path."""
    if isinstance(store, Store):
        return store
    if isinstance(store, (str, os.PathLike)):
        return open_store(store)  # a path or a URL (s3://...)
    raise TypeError(f"expected an mmstore.Store, a path or a URL, got {type(store).__name__}")


def image_fields(store: Store, fields: Sequence[str]) -> set[str]:
    """Fixed-shape fields that look like HWC images (3-D, last dim 1, 3 or 4)."""
    return {f for f in fields if not store.schema[f].ragged and len(store.schema[f].shape) == 3
            and store.schema[f].shape[-1] in (1, 3, 4)}


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised tensor; in shared memory when ``shared`` (worker
    processes), allocated the way ``default_collate`` does it, so sending it
    to the main process costs no copy."""
    if shared:
        numel = int(np.prod(shape, dtype=np.int64))
        try:
            proto = torch.empty(0, dtype=dtype)
            storage = proto._typed_storage()._new_shared(numel, device="cpu")
            return proto.new(storage).resize_(*shape)
        except Exception:  # private API moved: fall back to a plain tensor
            pass
    return torch.empty(shape, dtype=dtype)


class StoreBatch(Sequence):
    """A batch read by :meth:`StoreDataset.__getitems__`.

    ``batch.data`` is the batched result (a dict of tensors, or a tuple);
    ``len(batch)`` is the batch size and ``batch[i]`` a per-sample view (a
    :class:`_SampleDict` / :class:`_SampleTuple`) for collate functions that
    iterate samples. ``default_collate`` and :func:`collate` return
    ``batch.data`` as is.
    """

    __slots__ = ("data", "_n", "_as_tuple")

    def __init__(self, data: dict[str, torch.Tensor] | tuple[torch.Tensor, ...], n: int, as_tuple: bool) -> None:
        self.data = data
        self._n = n
        self._as_tuple = as_tuple

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} out of range for a batch of {self._n}")
        s: _SampleTuple | _SampleDict
        if self._as_tuple:
            s = _SampleTuple(sample_of(t, i) for t in self.data)
        else:  # data is a dict when not _as_tuple
            s = _SampleDict((k, sample_of(v, i)) for k, v in self.data.items())  # type: ignore[union-attr]
        s._batch = self
        return s

    def __repr__(self) -> str:
        return f"<StoreBatch of {self._n}>"


class _SampleDict(dict):
    """One sample of a :class:`StoreBatch` (views into the batch tensors)."""

    _batch: StoreBatch | None = None


class _SampleTuple(tuple):
    """One sample of a :class:`StoreBatch` in tuple form."""

    _batch: StoreBatch | None = None


def _collate_samples(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """``default_collate`` hook for :class:`StoreBatch` samples."""
    if isinstance(batch, StoreBatch):
        return batch.data
    # A list of samples that are not one whole StoreBatch (e.g. regrouped by
    # the user): collate them as plain dicts / tuples (this stacks = copies).
    first = batch[0]
    if isinstance(first, _SampleTuple) and len(batch) == len(first._batch or ()) and all(
        isinstance(s, _SampleTuple) and s._batch is first._batch for s in batch
    ) and _in_order(batch):
        return first._batch.data  # type: ignore[union-attr]
    if isinstance(first, _SampleDict) and len(batch) == len(first._batch or ()) and all(
        isinstance(s, _SampleDict) and s._batch is first._batch for s in batch
    ) and _in_order(batch):
        return first._batch.data  # type: ignore[union-attr]
    if isinstance(first, tuple):
        return default_collate([tuple(s) for s in batch])
    return default_collate([dict(s) for s in batch])


def _in_order(samples: Sequence[Any]) -> bool:
    b = samples[0]._batch
    if b is None:
        return False
    # the samples are the batch's own, in order, iff each row views row i
    # (of a batched tensor; list entries, str / bytes included, are the batch's own objects)
    keys = range(len(b.data)) if b._as_tuple else list(b.data)
    k = next((k for k in keys if isinstance(b.data[k], torch.Tensor)), None)
    if k is None:
        k = next(iter(keys))
        return all(isinstance(b.data[k], list) and s[k] is b.data[k][i] for i, s in enumerate(samples))
    return all(s[k].data_ptr() == b.data[k][i].data_ptr() for i, s in enumerate(samples))


# Registered once per process (also in spawned workers, which import this
# module to unpickle the dataset). Only our own sample types are affected.
default_collate_fn_map[_SampleDict] = _collate_samples
default_collate_fn_map[_SampleTuple] = _collate_samples


def collate(batch: Any, *, ragged_fields: Sequence[Any] | None = None, ragged: str = "list",
            pad_value: Any = 0) -> Any:
    """``collate_fn`` for :class:`StoreDataset`: a :class:`StoreBatch` passes
    through as its batched tensors (ragged fields as the dataset gives them);
    a list of samples (dicts or tuples: a dataset with a per-sample
    ``transform``, or ``ds[i]`` samples) is collated field by field: ragged
    ones as a list (``ragged="pad"``: a :class:`Padded` values + lengths;
    ``str`` / ``bytes``: a list either way), the others by ``default_collate``
    (stacked). ``ragged_fields``: the ragged keys (names; positions for
    tuples); default: ``str`` / ``bytes`` values and tensors whose shapes
    differ within the batch, so a batch whose entries happen to have one
    length is stacked: give the keys, or use :meth:`StoreDataset.collate`,
    which knows them."""
    if isinstance(batch, StoreBatch):
        return batch.data
    check_mode(ragged)
    if not isinstance(batch, Sequence) or not batch:
        return default_collate(batch)
    first = batch[0]
    if isinstance(first, Mapping):
        keys: Sequence[Any] = list(first)
    elif isinstance(first, tuple):
        keys = range(len(first))
    else:
        return default_collate(batch)
    out = {}
    for k in keys:
        col = [s[k] for s in batch]
        if _is_ragged(col, k, ragged_fields):
            tensors = all(isinstance(x, torch.Tensor) for x in col)
            out[k] = pad_list(col, pad_value, k if isinstance(k, str) else None) if ragged == "pad" and tensors else col
        else:
            out[k] = default_collate(col)
    if isinstance(first, Mapping):
        return out
    return tuple(out[k] for k in keys)


def _is_ragged(col: list[Any], key: Any, ragged_fields: Sequence[Any] | None) -> bool:
    if ragged_fields is not None:
        return key in ragged_fields
    if isinstance(col[0], (str, bytes)):
        return True
    return all(isinstance(x, torch.Tensor) for x in col) and len({tuple(x.shape) for x in col}) > 1


class StoreDataset(Dataset):
    """A map-style dataset over an mmstore store.

    Parameters
    ----------
    store : mmstore.Store or path
        The store (opened lazily: only the manifest is read here, the data
        files are mapped in each process on first read).
    fields : sequence of str, optional
        Fields to read, in output order (default: all, schema order).
    transform : callable, optional
        Applied to each sample (the dict or tuple of tensors) in
        ``__getitem__``. With a transform, ``__getitems__`` reads the batch in
        one call, then applies it per sample and returns a list of samples
        (collated by ``default_collate`` as usual).
    batch_transform : callable, optional
        Applied to the batched result (dict or tuple of tensors) in
        ``__getitems__`` (cheaper than a per-sample transform).
    as_tuple : bool, default False
        Return ``tuple(tensor for each field in fields)`` instead of a dict,
        e.g. ``fields=("image", "label"), as_tuple=True`` gives ``(image, label)``.
    chw : bool, default False
        Return image fields (3-D with 1, 3 or 4 channels last) as CHW
        (a permuted view, no copy: ``(N, C, H, W)`` batches with
        channels-last strides). Default: the store's layout (HWC).
    ragged : {"list", "pad"}, default "list"
        How a batch (``__getitems__``) gives a ragged field (a variable
        leading dimension): a list of tensors, one per record at its own
        length, or a :class:`Padded` ``(values, lengths)`` with ``values``
        ``(batch, longest, *row)`` filled with ``pad_value`` past each
        record's rows. ``str`` / ``bytes`` fields: a list of ``str`` /
        ``bytes`` either way. ``ds[i]`` gives the record's own tensor (or
        ``str`` / ``bytes``).
    pad_value : number or dict, default 0
        The padding of ``ragged="pad"``; a dict gives one per field (fields
        it does not name: 0). A value a field's dtype cannot hold (``-1`` for
        a uint8 field) is refused here, naming the field.

    Notes
    -----
    Tensors have the store's dtypes (images stay uint8: convert on the GPU
    with :mod:`mmstore.torch.gpu`). With ragged fields and a per-sample
    ``transform``, pass ``collate_fn=ds.collate`` to the ``DataLoader``
    (``default_collate`` would try to stack them); without a transform the
    default collate works.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        fields: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        *,
        batch_transform: Callable[[Any], Any] | None = None,
        as_tuple: bool = False,
        chw: bool = False,
        ragged: str = "list",
        pad_value: Any = 0,
    ) -> None:
        self.store = open_store_arg(store)
        self.fields = tuple(self.store.field_list(fields))
        self.ragged = check_mode(ragged)
        self._fixed, self._ragged = split_fields(self.store, self.fields)
        self.pad_value = check_pad(self.store, self._ragged, self.ragged, pad_value)
        # store[i] (the one-record path) reads every field: used when all are asked for
        self._whole = set(self.fields) == set(self.store.schema.names)
        self.transform = transform
        self.batch_transform = batch_transform
        self.as_tuple = bool(as_tuple)
        self.chw = bool(chw)
        self._images = image_fields(self.store, self.fields) if self.chw else set()
        self._pid = os.getpid()
        self._tdtypes = {
            f: torch.from_numpy(np.empty(0, self.store.schema[f].dtype)).dtype for f in self._fixed
        }

    def __len__(self) -> int:
        return len(self.store)

    def _check_pid(self) -> None:
        pid = os.getpid()
        if self._pid != pid:  # the Store reopens its handles by itself (NOTE [fork safety])
            self._pid = pid

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pid"] = -1
        return state

    def _wrap(self, arrays: Mapping[str, Any], batched: bool) -> Any:
        out: dict[str, torch.Tensor] = {}
        for f in self.fields:
            t = arrays[f]
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(t)
            if f in self._images:
                t = t.permute(0, 3, 1, 2) if batched else t.permute(2, 0, 1)
            out[f] = t
        if self.as_tuple:
            return tuple(out[f] for f in self.fields)
        return out

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, (np.integer,)):
            index = int(index)
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"a StoreDataset index must be an int, got {type(index).__name__}")
        self._check_pid()
        if self._whole:  # NOTE [one-record path] (backends/base.py)
            rec = self.store[index]
        else:
            got = self.store.read_batch([index], fields=self.fields)
            rec = {f: got[f][0] for f in self.fields}
        sample = self._wrap({f: _one(rec[f]) for f in self.fields}, batched=False)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample

    def read_batch_tensors(self, indices: Any) -> dict[str, torch.Tensor]:
        """Read ``indices`` into fresh tensors (shared memory inside a
        DataLoader worker), store layout, one ``read_batch`` call."""
        self._check_pid()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        # images of their own shape stack when the batch's records share one size
        # (a batch of one aspect bucket: mmstore.torch.BucketBatchSampler), else are refused
        shaped = [f for f in self.fields if self.store.schema[f].shaped]
        for f in shaped:
            hw = np.asarray(self.store.read_batch(idx, fields=[self.store.schema[f].hw_name])[
                self.store.schema[f].hw_name]).reshape(-1, 2)
            if len(hw) and not (hw == hw[0]).all():
                refuse_shaped(self.store, self.fields, "a batch of StoreDataset (__getitems__, what DataLoader "
                                                       "calls) of records of more than one size")
        shared = get_worker_info() is not None
        n = len(idx)
        tensors: dict[str, Any] = {
            f: _alloc((n, *self.store.schema[f].shape), self._tdtypes[f], shared) for f in self._fixed
        }
        got = self.store.read_batch(idx, fields=self.fields, out={f: t.numpy() for f, t in tensors.items()})
        for f in self._ragged:  # Ragged (values + offsets): a list of tensors, or Padded
            if f in shaped:  # one size (checked above): stacked
                dt = torch.from_numpy(np.empty(0, self.store.schema[f].dtype)).dtype
                recs = cast(list, got[f])  # a shaped field's batch: a list of arrays
                t = _alloc((n, *(recs[0].shape if n else (0, 0, *self.store.schema[f].shape[2:]))), dt, shared)
                if n:
                    np.stack(recs, out=t.numpy())
                tensors[f] = t
                continue
            tensors[f] = ragged_batch(cast(Ragged, got[f]), self.ragged, self.pad_value, f)  # read_batch: a Ragged
        return {f: tensors[f] for f in self.fields}

    def __getitems__(self, indices: Sequence[int]) -> Any:
        tensors = self.read_batch_tensors(indices)
        n = len(indices)
        if self.transform is not None:
            data = self._wrap(tensors, batched=True)
            samples = StoreBatch(data, n, self.as_tuple)
            return [self.transform(_plain(samples[i])) for i in range(n)]
        data = self._wrap(tensors, batched=True)
        if self.batch_transform is not None:
            data = self.batch_transform(data)
            if not isinstance(data, (dict, tuple)):
                raise TypeError("batch_transform must return a dict or a tuple of batched tensors")
        return StoreBatch(data, n, isinstance(data, tuple))

    def collate(self, batch: Any) -> Any:
        """:func:`collate` with this dataset's ragged fields and ``ragged`` /
        ``pad_value`` (``DataLoader(ds, collate_fn=ds.collate)``)."""
        keys = [i for i, f in enumerate(self.fields) if f in self._ragged] if self.as_tuple else self._ragged
        return collate(batch, ragged_fields=keys, ragged=self.ragged, pad_value=self.pad_value)

    def __repr__(self) -> str:
        return (f"StoreDataset({self.store.path!r}, fields={list(self.fields)}, as_tuple={self.as_tuple}, "
                f"chw={self.chw})")


def _one(v: Any) -> Any:
    """One record's value as torch gives it: a tensor (0-d for a scalar
    field), ``str`` / ``bytes`` as they are."""
    if isinstance(v, (str, bytes)):
        return v
    v = np.asarray(v)
    if not v.flags.writeable:  # a view of immutable bytes: the record's own copy
        v = v.copy()
    return torch.from_numpy(v)


def _plain(sample: Any) -> Any:
    return tuple(sample) if isinstance(sample, tuple) else dict(sample)

