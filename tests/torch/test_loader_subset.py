"""Subsets: ``Loader(indices=)``, a ``StoreDataset`` or a ``Subset``
of one as the store argument."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Subset

import mmstore
from mmstore.errors import RecordIndexError
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning, StoreDataset


def _ids(loader):
    return np.concatenate([(b["idx"] if isinstance(b, dict) else b[-1]).numpy().copy() for b in loader])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sub=st.lists(st.integers(0, 300), min_size=1, max_size=120), kind=st.sampled_from(["permutation", "block",
       "sequential"]), ws=st.integers(1, 3), epoch=st.integers(0, 2))
def test_every_subset_entry_once_per_epoch(stores, sub, kind, ws, epoch):
    """Across the ranks every entry of the subset (duplicates included) is read
    once per epoch; a record more only where the ranks' batch counts would
    differ otherwise (and the Loader says so), and every rank the same
    number of batches."""
    path = stores["big"]
    sub = np.array(sub)
    kw = {"block": 4, "window": 3} if kind == "block" else {}
    got, nbatches = [], set()
    for rank in range(ws):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            L = Loader(
                path,
                8,
                OrderSpec(kind, seed=2, rank=rank, world_size=ws, **kw),
                fields=("idx",),
                indices=sub,
                tuning=LoaderTuning(prefetch=1, threads=1),
            )
        assert bool(said) == (L.order.repeated() > 0), [str(w.message) for w in said]
        L.set_epoch(epoch)
        got.append(_ids(L))
        assert len(got[-1]) == len(L.order) and len(L) == -(-len(L.order) // 8)
        nbatches.add(len(L))
        L.close()
    allv = np.concatenate(got)
    pad = len(allv) - len(sub)
    assert 0 <= pad < ws and len(nbatches) == 1
    if (len(sub) // ws) % 8 or len(sub) % ws == 0:
        assert pad == 0  # a split with equal batch counts exists: every entry exactly once
    # every entry once; the padding repeats entries of this epoch
    counts = np.bincount(allv, minlength=301) - np.bincount(sub, minlength=301)
    assert counts.min() >= 0 and counts.sum() == pad
    if kind == "sequential" and ws == 1:
        assert np.array_equal(allv, sub)  # the given order


def test_block_order_reads_subset_in_offset_order(stores):
    """Shuffled orders take the subset sorted: a block of the block shuffle is
    a run of increasing records."""
    rng = np.random.default_rng(0)
    sub = rng.choice(301, 120, replace=False)
    L = Loader(stores["big"], 8, OrderSpec("block", block=10, window=3, seed=1), fields=("idx",), indices=sub)
    ids = _ids(L)
    assert sorted(ids.tolist()) == sorted(sub.tolist())
    pos = L.order.epoch(0)
    assert np.array_equal(ids, np.sort(sub)[pos])
    bounds = L.order.window_bounds(0)
    for a, b in itertools.pairwise(bounds):  # a window: 3 blocks, each a run of neighbouring subset records
        p = np.sort(pos[a:b])
        assert np.count_nonzero(np.diff(p) != 1) <= 2
    assert np.array_equal(np.sort(sub), np.sort(ids))


def test_subset_pixels_and_negative_indices(stores):
    path = stores["big"]
    st = mmstore.open(path)
    L = Loader(path, 5, "sequential", indices=[-1, 0, 7, 7, 300], fields=("image", "idx"))
    batches = [{k: v.clone() for k, v in b.items()} for b in L]
    ids = np.concatenate([b["idx"].numpy() for b in batches])
    assert ids.tolist() == [300, 0, 7, 7, 300]
    np.testing.assert_array_equal(batches[0]["image"].numpy(), st.read_batch(ids)["image"])


def test_bad_indices_are_refused(stores):
    path = stores["big"]
    with pytest.raises(RecordIndexError, match="index 301 is out of range for 301 records"):
        Loader(path, 4, indices=[0, 301])
    with pytest.raises(RecordIndexError, match="-302"):
        Loader(path, 4, indices=[-302])
    with pytest.raises(RecordIndexError, match="boolean"):
        Loader(path, 4, indices=np.ones(301, bool))
    with pytest.raises(RecordIndexError, match="integers"):
        Loader(path, 4, indices=[0.5])
    with pytest.raises(ValueError, match="empty"):
        Loader(path, 4, indices=[])
    assert issubclass(RecordIndexError, IndexError)


def test_store_dataset_and_subsets(stores):
    path = stores["big"]
    ds = StoreDataset(path, fields=("image", "idx"), as_tuple=True, chw=True)
    L = Loader(ds, 16, "sequential")
    assert L.fields == ("image", "idx") and L.as_tuple and L.chw
    x, y = next(iter(L))
    assert x.shape == (16, 3, 24, 32) and np.array_equal(y.numpy(), np.arange(16))
    L.close()
    inner = Subset(ds, list(range(100, 200)))
    outer = Subset(inner, [5, 0, 99])
    assert np.array_equal(_ids(Loader(outer, 2, "sequential")), [105, 100, 199])
    assert np.array_equal(np.sort(_ids(Loader(inner, 16, "permutation"))), np.arange(100, 200))
    L = Loader(Subset(ds, np.arange(50)), 16, "permutation", fields=("idx",), as_tuple=False)
    assert sorted(_ids(L).tolist()) == list(range(50)) and not L.as_tuple
    with pytest.raises(ValueError, match="both a Subset and indices"):
        Loader(inner, 4, indices=[1])
    with pytest.raises(ValueError, match="transform"):
        Loader(StoreDataset(path, transform=lambda s: s), 4)
    with pytest.raises(RecordIndexError):
        Loader(Subset(ds, [400]), 4)
    with pytest.raises(TypeError, match="StoreDataset"):
        Loader(torch.zeros(3), 4)
    with pytest.raises(TypeError, match="got a Subset of list .*use a DataLoader"):
        Loader(Subset(list(range(5)), [1]), 4)
    with pytest.raises(ValueError, match=r"the Subset has no entries"):
        Loader(Subset(ds, []), 4)


def test_subset_loader_pickles(stores):
    import pickle

    L = Loader(stores["big"], 8, OrderSpec("permutation", seed=1), indices=np.arange(0, 301, 3), fields=("idx",))
    M = pickle.loads(pickle.dumps(L))
    assert np.array_equal(_ids(L), _ids(M))


def test_unsigned_indices_do_not_wrap_around(stores):
    """A uint64 index past int64's range is refused, not cast to a negative
    index that counts from the end (2**64 - 1 as int64 is -1: the last record)."""
    path = stores["big"]
    for big in (2**64 - 1, 2**63 + 5, 301):
        with pytest.raises(RecordIndexError, match=f"index {big} is out of range for 301 records"):
            Loader(path, 4, indices=np.array([0, big], dtype=np.uint64))
    loader = Loader(path, 4, order="sequential", indices=np.array([300, 2], dtype=np.uint32))
    assert _ids(loader).tolist() == [300, 2]
