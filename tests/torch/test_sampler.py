"""OrderSampler / OrderBatchSampler: epochs, coverage, DDP split x workers."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import mmstore
from mmstore.order import BlockShuffle, Permutation
from mmstore.torch import OrderBatchSampler, OrderSampler, StoreDataset


def test_set_epoch_determinism_and_coverage():
    s = OrderSampler(1000, seed=3)
    a = list(s)
    s.set_epoch(0)
    assert list(s) == a  # set_epoch(0): the same epoch again
    b = list(s)  # iterated to the end: epoch 1 next (NOTE [epoch rules])
    assert a != b
    assert sorted(a) == sorted(b) == list(range(1000))  # RandomSampler's coverage
    s2 = OrderSampler(1000, seed=3)
    s2.set_epoch(1)
    assert list(s2) == b
    assert len(s) == 1000
    assert list(OrderSampler(10, "sequential")) == list(range(10))


def test_block_sampler_from_store(stores):
    st = mmstore.open(stores["big"])
    s = OrderSampler(st, "block", block=8, window=4, seed=2)
    assert isinstance(s.order, BlockShuffle)
    assert sorted(s) == list(range(len(st)))
    auto = OrderSampler(StoreDataset(st), "block")  # sized from the record size
    assert sorted(auto) == list(range(len(st)))


def test_permutation_split_matches_distributed_sampler():
    # the same global order cut the same way as DistributedSampler
    n, w = 103, 3
    for r in range(w):
        ours = OrderSampler(n, seed=5, rank=r, world_size=w)
        glob = Permutation(n, seed=5).global_order(0).tolist()
        ds = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=False)
        assert list(ours) == [glob[i] for i in ds]
        assert len(ours) == len(ds)


def test_order_object_made_for_rank():
    s = OrderSampler(50, Permutation(50, seed=1), rank=1, world_size=2)
    assert (s.order.rank, s.order.world_size) == (1, 2)
    with pytest.raises(ValueError):
        OrderSampler(51, Permutation(50))


@pytest.mark.parametrize(
    "kind,world,drop_last",
    [("permutation", 2, False), ("permutation", 3, True), ("permutation", 4, False),
     ("block", 2, True), ("block", 3, False), ("block", 4, True)],
)
def test_ddp_ranks_times_workers_exactly_once(stores, world, kind, drop_last):
    st = mmstore.open(stores["big"])
    n = len(st)
    ds = StoreDataset(st, fields=("idx",))
    kw = {"block": 7, "window": 3} if kind == "block" else {}
    for epoch in ((0, 1) if world == 2 else (1,)):
        got = []
        for r in range(world):
            sm = OrderSampler(ds, kind, seed=4, rank=r, world_size=world, drop_last=drop_last, **kw)
            sm.set_epoch(epoch)
            dl = DataLoader(ds, batch_size=16, sampler=sm, num_workers=2, multiprocessing_context="fork")
            ids = np.concatenate([b["idx"].numpy() for b in dl])
            assert len(ids) == len(sm)  # equal length on every rank
            got.append(ids)
        allids = np.concatenate(got)
        if drop_last:
            assert len(allids) == (n // world) * world
            assert len(np.unique(allids)) == len(allids)  # disjoint
        else:
            assert set(allids.tolist()) == set(range(n))  # all covered
            assert len(allids) == -(-n // world) * world  # padded like DistributedSampler
            assert len(allids) - len(np.unique(allids)) == len(allids) - n


def test_batch_sampler_equals_batchsampler():
    s = OrderSampler(37, seed=9)
    for dl in (False, True):
        s.set_epoch(2)
        ours = list(OrderBatchSampler(s, 8, drop_last=dl))
        s.set_epoch(2)
        ref = list(BatchSampler(s, 8, drop_last=dl))
        assert ours == ref
        assert len(OrderBatchSampler(s, 8, drop_last=dl)) == len(ref)


def test_block_sampler_over_a_subset(stores):
    # order="block" sized automatically: a Subset of a StoreDataset was refused ("needs block= and
    # window=, or a store"), although it is the documented way to read a split
    from torch.utils.data import Subset

    from mmstore.torch.sampler import build_order

    ds = StoreDataset(mmstore.open(stores["big"]))
    train, _val = mmstore.split(ds, 0.2, seed=1)
    sub = Subset(Subset(ds, list(range(len(ds)))), train.tolist())
    s = OrderSampler(sub, "block", seed=4)
    ref = build_order("block", len(train), seed=4, record_bytes=ds.store.stored_record_bytes())
    assert s.order.describe() == ref.describe()
    e = s.order.epoch(0)
    assert np.array_equal(np.sort(e), np.arange(len(train)))  # positions in the subset, each once
