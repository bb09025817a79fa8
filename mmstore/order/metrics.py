"""What an order costs and how well it mixes, measured without reading any data:
``contiguous_ranges`` (the reads a set of slots takes), ``count_seeks`` and
``modelled_hdd_seconds`` (a spinning disk's cost of an epoch), and
``shuffle_quality`` (how mixed its batches are). Re-exported by
:mod:`mmstore.order`, which documents them with the orders."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._os.runs import find_runs
from .args import _bad, _index_array, _int, _positive_float

# shuffle_quality's mean_abs_displacement of a uniform permutation (n large): E|U - V| of independent uniforms
UNIFORM_DISPLACEMENT = 1 / 3

def contiguous_ranges(
    indices: np.ndarray, max_gap: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Merge indices into sorted, disjoint ``[start, stop)`` ranges of slots.

    For ``madvise(WILLNEED)`` / ``preadv`` of a window or a batch.

    Parameters
    ----------
    indices : array of int
        Slots, in any order, repeats allowed.
    max_gap : int
        Also merge across gaps of at most ``max_gap`` slots not in
        ``indices`` (reading through a short gap is cheaper than a seek: on
        an HDD below ``seek_s * bandwidth / record_bytes`` records).  With
        ``max_gap=0`` the union of the ranges is exactly the set of
        ``indices``; with ``max_gap=block - 1`` a rank's share of a window
        shared with its neighbour is still read as whole runs.

    Returns
    -------
    (starts, stops) : tuple of numpy.ndarray
        ``int64`` arrays of equal length; ``starts[i + 1] > stops[i] + max_gap``.
    """
    max_gap = _int("max_gap", max_gap, 0)
    u = np.unique(_index_array("indices", indices))
    if u.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first, end = find_runs(1, u, max_gap=max_gap)
    return u[first], u[np.asarray(end) - 1] + 1


def _bounds(length: int, groups: int | np.ndarray) -> np.ndarray:
    if isinstance(groups, (int, np.integer)) and not isinstance(groups, (bool, np.bool_)):
        g = _int("groups", groups, 1)
        return np.append(np.arange(0, length, g, dtype=np.int64), length)
    b = np.asarray(groups)
    if (b.ndim != 1 or b.size < 1 or not np.issubdtype(b.dtype, np.integer)
            or b[0] != 0 or b[-1] != length or np.any(np.diff(b) < 0)):
        raise _bad("groups", groups if b.size < 8 else f"<array of {b.size} bounds>",
                   f"a group size >= 1 or non-decreasing bounds from 0 to {length}")
    return b.astype(np.int64, copy=False)


def count_seeks(order: np.ndarray, groups: int | np.ndarray) -> int:
    """Seeks to read ``order`` when each group's reads are issued sorted.

    Parameters
    ----------
    order : array of int
        Slots in the order they are consumed.
    groups : int or array of int
        A group size (a batch: ``batch_size``) or group bounds ``[0, ...,
        len(order)]`` (e.g. :meth:`BlockShuffle.window_bounds`).

    Returns
    -------
    int
        For each non-empty group, one seek for its first read plus one for
        every break in its sorted slots (next slot > previous + 1; a repeated
        slot is a cache hit).
    """
    order = _index_array("order", order)
    bounds = _bounds(order.shape[0], groups)
    if order.size == 0:
        return 0
    sizes = np.diff(bounds)
    nonempty = int(np.count_nonzero(sizes))
    if sizes.size and np.all(sizes[:-1] == sizes[0]) and sizes[-1] == sizes[0]:
        s = np.sort(order.reshape(-1, int(sizes[0])), axis=1)
        return nonempty + int(np.count_nonzero(np.diff(s, axis=1) > 1))
    span = int(order.max()) + 2
    gid = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
    key = np.sort(gid * span + order)
    same = (key[1:] // span) == (key[:-1] // span)
    return nonempty + int(np.count_nonzero(same & (np.diff(key) > 1)))


def modelled_hdd_seconds(
    order: np.ndarray,
    record_bytes: int,
    batch_size: int = 256,
    *,
    seek_s: float = 0.008,
    bandwidth: float = 150e6,
    groups: int | np.ndarray | None = None,
) -> float:
    """Modelled seconds to read ``order`` from one hard disk.

    ``count_seeks(order, groups) * seek_s + len(order) * record_bytes /
    bandwidth``: reads are issued a group at a time in sorted slot order, each
    non-contiguous read costs a seek (8 ms), every byte is transferred at the
    sequential bandwidth (150 MB/s).  No page cache across groups.

    ``groups`` defaults to ``batch_size`` (a loader reading one batch per
    call).  A loader that prefetches a block shuffle's window whole (its
    blocks are a few long reads, then served from the page cache) is modelled
    with ``groups=order.window_bounds(epoch)``.

    Notes
    -----
    The transfer term bounds any speed-up: with 150 KB records a random read
    costs 8 ms of seek per 1 ms of transfer, so no order can be more than
    ~9x faster than a permutation.
    """
    record_bytes = _int("record_bytes", record_bytes, 1)
    batch_size = _int("batch_size", batch_size, 1)
    seek_s = _positive_float("seek_s", seek_s)
    bandwidth = _positive_float("bandwidth", bandwidth)
    order = _index_array("order", order)
    seeks = count_seeks(order, batch_size if groups is None else groups)
    return seeks * seek_s + order.shape[0] * record_bytes / bandwidth


# --------------------------------------------------------------------------
# shuffle quality


def shuffle_quality(
    order: np.ndarray,
    labels: np.ndarray | None = None,
    batch_size: int = 256,
    *,
    n: int | None = None,
) -> dict[str, Any]:
    """How well ``order`` mixes the data, and how local its reads are.

    Parameters
    ----------
    order : array of int
        Dataset indices in the order they are consumed (an epoch, or one
        rank's part of it).
    labels : array, optional
        ``labels[i]`` is the label of dataset index ``i``.  Without labels the
        label of index ``i`` is its percentile, ``i * 100 // n``: the labels of
        a store ingested class by class (100 equal classes), the worst case for
        an order that keeps neighbours together.
    batch_size : int
        Consecutive positions forming a batch (the last one may be short).
    n : int, optional
        Dataset size; defaults to ``max(order) + 1``.

    Returns
    -------
    dict
        ``mean_abs_displacement``
            ``mean |pos * n / len - idx| / n``: 0 for the sequential order,
            about 1/3 for a uniform permutation (``UNIFORM_DISPLACEMENT``).  Blind to local mixing (a
            permutation of blocks scores 1/3 too).
        ``same_label_pairs``
            Fraction of pairs within a batch with equal labels, divided by
            the same fraction expected from a uniform shuffle of the same
            labels: 1.0 is as mixed as a uniform shuffle; a class-sorted
            sequential order scores about the number of classes.
        ``adjacent_same_label``
            The same ratio for adjacent positions within a batch (lag-1
            label autocorrelation).
        ``labels_per_batch`` / ``labels_per_batch_uniform``
            Distinct labels per batch, observed and expected from a uniform
            shuffle.
        ``runs_per_batch`` / ``mean_run_length``
            Contiguous runs of slots per batch when its reads are sorted (=
            seeks per batch in :func:`modelled_hdd_seconds`) and records per
            run: the locality of per-batch reads.
        ``length``, ``batch_size``, ``labels`` (``"given"`` or
        ``"index percentile"``).
    """
    order = _index_array("order", order)
    batch_size = _int("batch_size", batch_size, 1)
    length = order.shape[0]
    top = int(order.max()) + 1 if length else 0
    n = top if n is None else _int("n", n, top)
    out: dict[str, Any] = {
        "length": length,
        "batch_size": batch_size,
        "labels": "index percentile" if labels is None else "given",
    }
    if length == 0:
        return {**out, "mean_abs_displacement": 0.0, "same_label_pairs": 1.0,
                "adjacent_same_label": 1.0, "labels_per_batch": 0.0,
                "labels_per_batch_uniform": 0.0, "runs_per_batch": 0.0,
                "mean_run_length": 0.0}
    pos = np.arange(length, dtype=np.float64) * (n / length)
    pos -= order
    out["mean_abs_displacement"] = float(np.abs(pos, out=pos).mean() / n)
    del pos

    if labels is None:
        lab = order * 100 // n
    else:
        labels = np.asarray(labels)
        if labels.ndim != 1 or labels.shape[0] < n:
            raise _bad("labels", f"<array of shape {labels.shape}>",
                       f"a 1-D array with at least n={n} labels")
        lab = labels[order]
    out.update(_label_mixing(lab, batch_size))
    nbatch = -(-length // batch_size)
    seeks = count_seeks(order, batch_size)
    out["runs_per_batch"] = seeks / nbatch
    out["mean_run_length"] = length / seeks
    return out


def _label_mixing(lab: np.ndarray, batch_size: int) -> dict[str, float]:
    """The label figures of :func:`shuffle_quality` for labels in consumption order."""
    length = lab.shape[0]
    _, codes, counts = np.unique(lab, return_inverse=True, return_counts=True)
    codes = codes.astype(np.int64, copy=False).ravel()
    classes = counts.size
    # expected same-label probability for a random pair of a uniform shuffle
    q = float(np.sum(counts * (counts - 1.0))) / (length * (length - 1.0)) if length > 1 else 0.0

    nbatch = -(-length // batch_size)
    bid = np.arange(length, dtype=np.int64) // batch_size
    keys, kc = np.unique(bid * classes + codes, return_counts=True)
    sizes = np.full(nbatch, batch_size, dtype=np.float64)
    sizes[-1] = length - (nbatch - 1) * batch_size
    pairs = float(np.sum(sizes * (sizes - 1)) / 2)
    same = float(np.sum(kc * (kc - 1.0)) / 2)
    adj = np.ones(length - 1, dtype=bool)
    adj[batch_size - 1 :: batch_size] = False  # pairs that cross a batch edge
    n_adj = int(adj.sum())
    same_adj = int(np.count_nonzero((codes[1:] == codes[:-1]) & adj))
    return {
        "same_label_pairs": _ratio(same / pairs if pairs else 0.0, q),
        "adjacent_same_label": _ratio(same_adj / n_adj if n_adj else 0.0, q),
        "labels_per_batch": keys.size / nbatch,
        "labels_per_batch_uniform": _expected_distinct(counts, length, sizes),
    }


def _ratio(observed: float, expected: float) -> float:
    if expected <= 0:
        return 1.0 if observed <= 0 else math.inf
    return observed / expected


def _expected_distinct(counts: np.ndarray, total: int, sizes: np.ndarray) -> float:
    """Mean distinct labels per batch under a uniform shuffle (hypergeometric):
    per batch of size b, sum over labels of 1 - C(total - c, b) / C(total, b)."""
    result = 0.0
    lg = math.lgamma
    uc, mult = np.unique(counts, return_counts=True)
    ub, bmult = np.unique(sizes.astype(np.int64), return_counts=True)
    for b, bm in zip(ub.tolist(), bmult.tolist()):
        per = 0.0
        for c, m in zip(uc.tolist(), mult.tolist()):
            if total - c < b:
                p_none = 0.0
            else:  # C(total-c, b) / C(total, b)
                p_none = math.exp(lg(total - c + 1) - lg(total - c - b + 1)
                                  - lg(total + 1) + lg(total - b + 1))
            per += m * (1.0 - p_none)
        result += bm * per
    return result / float(sizes.size)
