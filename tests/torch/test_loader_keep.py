"""Kept batches: batches a user keeps never change; a loop that drops
each batch keeps reusing the ring (NOTE [kept batches] in ``_ring.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.order import BlockShuffle, Permutation, Sequential
from mmstore.torch import Loader, LoaderTuning

ORDERS = {
    "sequential": lambda n: Sequential(n),
    "permutation": lambda n: Permutation(n, seed=5),
    "block": lambda n: BlockShuffle(n, block=8, window=3, seed=5),
}


def _expect(path, ids):
    """The store's records of ``ids`` (the idx field holds the record's index)."""
    return mmstore.open(path).read_batch(ids)


@pytest.mark.parametrize("kind", sorted(ORDERS))
def test_keep_every_batch_dict(stores, kind):
    """``batches = list(loader)``: every batch intact at the end, two epochs running."""
    path = stores["big"]
    L = Loader(path, 16, ORDERS[kind](301), tuning=LoaderTuning(prefetch=2, threads=3, piece_bytes=2048))
    kept = [list(L), list(L)]  # the second epoch refills the ring while the first is kept
    for e, batches in enumerate(kept):
        ids = np.concatenate([b["idx"].numpy() for b in batches])
        assert np.array_equal(ids, ORDERS[kind](301).epoch(e))
        want = _expect(path, ids)
        np.testing.assert_array_equal(np.concatenate([b["image"].numpy() for b in batches]), want["image"])
        np.testing.assert_array_equal(np.concatenate([b["label"].numpy() for b in batches]), want["label"])
    assert L.fresh_buffers >= 2 * len(L) - L.ring_size  # the kept buffers went to the user
    L.close()


@pytest.mark.parametrize("kind", sorted(ORDERS))
def test_keep_tuple_chw_and_slices(stores, kind):
    """A loop that keeps every batch (``ys = [y for _, y in loader]``), ``chw`` views and
    ``batch[0:2]`` slices keep their buffers too."""
    path = stores["big"]
    L = Loader(
        path, 8, ORDERS[kind](301), fields=("image", "idx"), as_tuple=True, chw=True, tuning=LoaderTuning(prefetch=2)
    )
    ys = [y for _, y in L]
    assert np.array_equal(torch.cat(ys).numpy(), ORDERS[kind](301).epoch(0))
    heads = [(x[0:2], y[0:2].numpy()) for x, y in L]  # a slice and a numpy view: the storage stays alive
    ids = np.concatenate([y for _, y in heads])
    e1 = ORDERS[kind](301).epoch(1)
    assert np.array_equal(ids, np.concatenate([e1[a : a + 2] for a in range(0, 301, 8)]))
    imgs = torch.cat([x for x, _ in heads])  # (N, 3, H, W) permuted views
    np.testing.assert_array_equal(imgs.permute(0, 2, 3, 1).numpy(), _expect(path, ids)["image"])
    L.close()


def test_drop_each_batch_reuses_the_ring(stores):
    """The common loop allocates nothing: no fresh buffer, the same ring_size
    addresses over three epochs (memory flat), whatever the order."""
    for kind, make in ORDERS.items():
        L = Loader(stores["big"], 16, make(301), tuning=LoaderTuning(prefetch=3, threads=2))
        ptrs = set()
        for _ in range(3):
            for batch in L:
                ptrs.add(batch["image"].data_ptr())
                x = batch["image"].float().mean()  # a copy: holds nothing of the ring
                assert x >= 0
        assert L.fresh_buffers == 0, kind
        assert len(ptrs) == L.ring_size == 3 + 1 + 1, kind
        L.close()


def test_written_batch_changes_only_that_batch(stores):
    L = Loader(stores["big"], 16, Sequential(301), fields=("idx",), tuning=LoaderTuning(prefetch=2))
    it = iter(L)
    first = next(it)
    first["idx"][:] = -1  # the user's batch now
    rest = [b["idx"].clone() for b in it]
    assert (first["idx"] == -1).all()
    assert np.array_equal(torch.cat(rest).numpy(), np.arange(16, 301))
    L.close()


def test_copy_true_uses_the_old_ring(stores):
    L = Loader(stores["big"], 16, Permutation(301, seed=1), copy=True, tuning=LoaderTuning(prefetch=2, hold=1))
    assert L.ring_size == 3
    kept = list(L)
    assert np.array_equal(np.concatenate([b["idx"].numpy() for b in kept]), Permutation(301, seed=1).epoch(0))
    assert L.fresh_buffers == 0
    L.close()


def test_unchecked_ring_would_overwrite(stores, monkeypatch):
    """The check is what keeps them: with it switched off (the old ring) a
    kept batch is overwritten, so the tests above can fail."""
    monkeypatch.setattr(Loader, "_check_kept", False)
    L = Loader(stores["big"], 16, Sequential(301), fields=("idx",), tuning=LoaderTuning(prefetch=2))
    ys = [b["idx"] for b in L]
    assert not np.array_equal(torch.cat(ys).numpy(), np.arange(301))
    L.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.lists(st.booleans(), min_size=19, max_size=19), prefetch=st.integers(1, 3),
       hold=st.integers(1, 2), seed=st.integers(0, 3))
def test_any_keep_pattern(stores, keep, prefetch, hold, seed):
    """Whichever batches a loop keeps (and for however long), they are intact at
    the end; buffers are renewed no more often than batches were kept."""
    path = stores["big"]
    L = Loader(
        path,
        16,
        Permutation(301, seed=seed),
        fields=("idx", "image"),
        tuning=LoaderTuning(prefetch=prefetch, hold=hold),
    )
    kept = []
    for k, b in enumerate(L):
        if keep[k]:
            kept.append((b, b["idx"].numpy().copy()))
    for b, ids in kept:
        assert np.array_equal(b["idx"].numpy(), ids)
        np.testing.assert_array_equal(b["image"].numpy(), _expect(path, ids)["image"])
    assert L.fresh_buffers <= sum(keep)
    del kept, b
    L.close()


def test_shared_memory_batch_gets_a_fresh_buffer(stores):
    """A yielded batch's ``share_memory_()`` (what ``torch.multiprocessing``'s
    ``Queue.put`` does) moves the memory of the storage the ring's tensors
    share into shared memory and frees the old one: the ring must not keep
    writing into the freed memory (heap corruption) nor yield the moved
    storage's stale rows."""
    path = stores["big"]
    L = Loader(path, 16, Sequential(301), fields=("idx", "label"), tuning=LoaderTuning(prefetch=2, threads=2))
    for b in L:
        b["idx"].share_memory_()
        del b
    for _ in range(2):
        ids = np.concatenate([b["idx"].numpy().copy() for b in L])
        assert np.array_equal(ids, np.arange(301))
    assert L.fresh_buffers >= L.ring_size
    L.close()


def test_without_torchs_use_count_every_buffer_is_renewed(stores, monkeypatch):
    """Where torch lacks the storage use count (a private API), kept-batch
    safety still holds: every refill takes a fresh buffer."""
    from mmstore.torch import _ring

    monkeypatch.setattr(_ring, "_USE_COUNT", None)
    L = Loader(stores["big"], 16, "sequential", fields=("idx",))
    kept = [b["idx"] for b in L]
    assert np.array_equal(torch.cat(kept).numpy(), np.arange(len(L.store)))
    assert L.fresh_buffers > 0
