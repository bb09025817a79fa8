"""What a :class:`~mmstore.torch.Loader` reads from, and its ``transform``.

* :func:`resolve_source`: the ``store`` argument (a store, a path, a
  :class:`~mmstore.torch.StoreDataset`, a ``torch.utils.data.Subset`` of one,
  nested subsets included) and ``indices=`` as one store, the record indices
  of the subset (or None: every record) and the dataset's own ``fields`` /
  ``as_tuple`` / ``chw`` / ``ragged`` / ``pad_value`` (defaults for the loader's).
* :func:`transform_call`: how the loader calls a ``transform``.

Subset rule: ``indices`` are record indices of the store (``len(store)``
ones, negative ones counted from the end, as for ``Store.read_batch``); a
record listed twice is read twice per epoch (oversampling), every entry once.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import Subset

from ..errors import RecordIndexError
from ..store.reader import Store
from .dataset import StoreDataset, open_store_arg

__all__ = ["Source", "resolve_source", "transform_call"]


class Source:
    """``store``, ``indices`` (int64 record indices, or None for all),
    ``own`` (the store was opened here, from a path), ``defaults`` (the
    dataset's ``fields``/``as_tuple``/``chw``)."""

    def __init__(self, store: Store, indices: np.ndarray | None, own: bool, defaults: dict[str, Any]) -> None:
        self.store, self.indices, self.own, self.defaults = store, indices, own, defaults


def resolve_source(store: Any, indices: Any = None) -> Source:
    """The store, subset and dataset defaults of a Loader's ``store`` and ``indices`` arguments."""
    sub: np.ndarray | None = None
    layers: list[Any] = []
    obj = store
    while isinstance(obj, Subset):  # Subset(Subset(ds, a), b) is ds at a[b]
        layers.append(obj.indices)
        obj = obj.dataset
    defaults: dict[str, Any] = {}
    if isinstance(obj, StoreDataset):
        if obj.transform is not None or obj.batch_transform is not None:
            raise ValueError(
                "mmstore.torch.Loader: the StoreDataset given has a transform, which the Loader does not "
                "call (it reads whole batches without the dataset); build the dataset without it and pass "
                "Loader(..., transform=f), which is called on every batch"
            )
        defaults = {"fields": obj.fields, "as_tuple": obj.as_tuple, "chw": obj.chw, "ragged": obj.ragged,
                    "pad_value": obj.pad_value}
        st, own = obj.store, False
    elif isinstance(obj, (Store, str, os.PathLike)):
        st, own = open_store_arg(obj), not isinstance(obj, Store)
    else:
        got = type(obj).__name__ if obj is store else f"a Subset of {type(obj).__name__}"
        raise TypeError(
            f"mmstore.torch.Loader reads an mmstore.Store, a store path, a StoreDataset or a "
            f"torch.utils.data.Subset of one; got {got} (a Loader reads whole batches from the store, "
            "without the dataset's __getitem__: use a DataLoader for another dataset)"
        )
    for layer in reversed(layers):  # innermost first
        pos = _as_index_array(layer, len(st) if sub is None else len(sub), "Subset indices")
        sub = pos if sub is None else sub[pos]
    if indices is not None:
        if layers:
            raise ValueError(
                "mmstore.torch.Loader: both a Subset and indices= were given; give one (indices= are "
                "record indices of the store; Subset(dataset, indices) is the same subset)"
            )
        sub = _as_index_array(indices, len(st), "indices")
    if sub is not None and len(sub) == 0:
        given = "indices= has" if indices is not None else "the Subset has"
        raise ValueError(f"mmstore.torch.Loader: the subset is empty ({given} no entries); nothing to read")
    return Source(st, sub, own, defaults)


def _as_index_array(indices: Any, n: int, what: str) -> np.ndarray:
    """``indices`` as int64 in ``[0, n)`` (negative ones from the end)."""
    idx = np.asarray(indices)
    if idx.dtype == bool:
        raise RecordIndexError(f"{what}: a boolean mask was given; pass np.flatnonzero(mask)")
    if idx.ndim != 1:
        raise RecordIndexError(f"{what} must be a 1-D sequence of record indices, got an array of shape "
                               f"{idx.shape}; pass np.ravel(...) of it if the flattened order is what you mean")
    if idx.size and idx.dtype.kind not in "iu":
        raise RecordIndexError(f"{what} must be integers, got dtype {idx.dtype}")
    if idx.dtype.kind == "u":  # compare before the cast: 2**64 - 1 as int64 is -1, the last record
        bad = idx >= n
        idx = np.where(bad, 0, idx).astype(np.int64)
    else:
        idx = idx.astype(np.int64, copy=True)
        idx[idx < 0] += n
        bad = (idx < 0) | (idx >= n)
    if bad.any():
        first = int(np.asarray(indices).reshape(-1)[np.flatnonzero(bad)[0]])
        raise RecordIndexError(
            f"{what}: index {first} is out of range for {n} records ({int(bad.sum())} of {len(idx)} "
            f"indices are); valid indices are 0..{n - 1} (or -{n}..-1)"
        )
    return idx


def transform_call(transform: Callable[..., Any] | None) -> Callable[[Any, int, int], Any] | None:
    """How the loader calls ``transform``: ``transform(batch, epoch=e,
    batch_index=k)`` when it takes those keywords (or ``**kwargs``), as
    :class:`mmstore.torch.augment.Pipeline` does, with the one it takes when
    it takes one of them, else ``transform(batch)``."""
    if transform is None:
        return None
    if not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    try:
        params = inspect.signature(transform).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        params = ()  # type: ignore[assignment]
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in params) or {"epoch", "batch_index"} <= names:
        return lambda batch, e, k: transform(batch, epoch=e, batch_index=k)
    if "epoch" in names:  # one of the two: it gets the one it takes
        return lambda batch, e, k: transform(batch, epoch=e)
    if "batch_index" in names:
        return lambda batch, e, k: transform(batch, batch_index=k)
    return lambda batch, e, k: transform(batch)
