"""Deterministic train/validation splits of a store (numpy only).

``mmstore.split(store, fraction=0.1, seed=0, stratify="label")`` returns
``(train, val)``: two sorted ``int64`` arrays of dataset indices (``0 ..
len(store) - 1``) that are disjoint and together hold every index once. Use
them on either reading path::

    train_ds = torch.utils.data.Subset(StoreDataset(store), train)
    val_loader = Loader(store, 256, indices=val)

Rules (the same result on any machine, numpy version or process)
----------------------------------------------------------------
* Randomness: one ``numpy.random.Generator(numpy.random.PCG64(seed))`` draws
  one ``float64`` key per index (``Generator.random(n)``, a documented,
  platform-independent stream); nothing uses numpy's global state. Within a
  group, the indices with the smallest keys (ties: the smaller index) go to
  validation. So the result depends only on ``n``, ``seed``, ``fraction`` and
  the labels.
* Without ``stratify``: ``n_val = floor(fraction * n + 0.5)`` (round half
  up), kept in ``[1, n - 1]`` when ``n >= 2`` and ``0 < fraction < 1``.
* With ``stratify``: the same rule per class: a class of ``c >= 2`` samples
  gives ``floor(fraction * c + 0.5)`` samples to validation, kept in ``[1,
  c - 1]`` (so every class of two or more samples is on both sides); a class
  of one sample goes to training (to validation only with ``fraction >=
  0.5``); when every class has one sample one side would be empty, which
  is a ``ValueError``. The validation total is the sum over classes, which can differ from
  the unstratified ``n_val`` by the per-class rounding.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["split"]


def _count(fraction: float, c: int) -> int:
    """Validation share of a group of ``c`` (module docstring, rounding)."""
    v = int(np.floor(fraction * c + 0.5))
    if c >= 2:
        return min(max(v, 1), c - 1)
    return min(v, c)


def _source(store_or_n: Any) -> tuple[int, Any]:
    """(n, store or None) from an int, a Store, a store path or a sized object."""
    if isinstance(store_or_n, (int, np.integer)) and not isinstance(store_or_n, bool):
        n = int(store_or_n)
        if n < 0:
            raise ValueError(f"split: n must be >= 0, got {n}")
        return n, None
    if isinstance(store_or_n, (str, os.PathLike)):
        from ..store.reader import open_store

        st = open_store(store_or_n)
        return len(st), st
    if hasattr(store_or_n, "__len__"):
        return len(store_or_n), store_or_n
    raise TypeError(f"split: expected a Store, a store path, a dataset or a count, got {type(store_or_n).__name__}")


def _field(obj: Any, name: str) -> np.ndarray:
    """Column ``name`` of a Store, of a dataset over one (``.store``), or of a
    ``Subset`` of those (``.dataset`` and ``.indices``, nested or not)."""
    if hasattr(obj, "indices") and hasattr(obj, "dataset"):
        return _field(obj.dataset, name)[np.asarray(obj.indices, dtype=np.int64)]
    store = getattr(obj, "store", obj)
    if store is None or not hasattr(store, "column"):
        what = "a count" if obj is None else type(obj).__name__
        raise TypeError(f"split: stratify={name!r} names a field, which needs a Store, a store path, a "
                        f"StoreDataset or a Subset of one, not {what}; pass the labels as an array instead")
    if name not in store.fields:
        raise ValueError(f"split: the store has no field {name!r} to stratify by (fields: "
                         f"{', '.join(store.fields)})")
    return np.asarray(store.column(name))


def _labels(stratify: Any, n: int, store: Any) -> np.ndarray:
    if isinstance(stratify, str):
        lab = _field(store, stratify)
    else:
        lab = np.asarray(stratify)
    if lab.shape[:1] != (n,) or lab.ndim != 1:
        raise ValueError(f"split: stratify needs one label per sample, shape ({n},), found shape {lab.shape}")
    return lab


def split(
    store_or_n: Any,
    fraction: float = 0.1,
    *,
    seed: int = 0,
    stratify: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``0 .. n - 1`` into training and validation indices, deterministically.

    Parameters
    ----------
    store_or_n : Store, str, dataset or int
        What to split: a :class:`mmstore.Store`, a store path, anything with
        ``len()`` (a ``StoreDataset``, a ``Subset``: the indices returned are
        then positions in it), or the number of samples.
    fraction : float, default 0.1
        Share of the samples that go to validation, in ``[0, 1]`` (rounding:
        module docstring).
    seed : int, default 0
        Seed of the PCG64 generator; the same seed gives the same split
        everywhere.
    stratify : str or array-like, optional
        Keep each class's proportion on both sides: a field name of the
        store (e.g. ``"label"``; also through a ``StoreDataset`` or a
        ``Subset`` of one) or one label per sample. ValueError when every
        class has one sample, so one side would be empty.

    Returns
    -------
    (train, val) : tuple of numpy.ndarray
        Sorted ``int64`` dataset indices, disjoint, together ``0 .. n - 1``.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating, np.integer)):
        raise TypeError(f"split: fraction must be a number in [0, 1], got {fraction!r}")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"split: fraction must be in [0, 1], got {fraction}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"split: seed must be an int >= 0, got {seed!r}")
    n, store = _source(store_or_n)
    keys = np.random.Generator(np.random.PCG64(int(seed))).random(n)
    is_val = np.zeros(n, dtype=bool)
    if stratify is None:
        groups = [np.arange(n, dtype=np.int64)]
        counts = [_count(fraction, n) if 0.0 < fraction < 1.0 else round(fraction * n)]
    else:
        lab = _labels(stratify, n, store)
        _, inv = np.unique(lab, return_inverse=True)
        by_class = np.argsort(inv, kind="stable")
        bounds = np.flatnonzero(np.diff(inv[by_class])) + 1
        groups = np.split(by_class.astype(np.int64), bounds) if n else []
        counts = [_count(fraction, len(g)) if 0.0 < fraction < 1.0 else round(fraction * len(g))
                  for g in groups]
    if stratify is not None and 0.0 < fraction < 1.0 and n >= 2 and sum(counts) in (0, n):
        side = "validation" if sum(counts) == 0 else "training"
        raise ValueError(
            f"split: stratified, the {side} side would be empty: all {len(groups)} classes have one sample "
            f"(n={n}), and a class of one sample goes to one side only; split without stratify, or stratify "
            "by a coarser label"
        )
    for g, v in zip(groups, counts):
        if v:
            pick = g[np.lexsort((g, keys[g]))[:v]]
            is_val[pick] = True
    idx = np.arange(n, dtype=np.int64)
    return idx[~is_val], idx[is_val]
