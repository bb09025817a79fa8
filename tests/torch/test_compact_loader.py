"""Compact records through the torch layer: StoreDataset and Loader
decode variable-size fields in the reader threads, straight into the batch
buffer, and return exactly what ``store[i]`` returns, in every order."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from support.images import photo
from support.stores import write_every_layout, write_store
from torch.utils.data import DataLoader

import mmstore
from mmstore.engine import reads as _reads
from mmstore.errors import EntryDecodeError
from mmstore.order import BlockShuffle, Permutation, Sequential
from mmstore.torch import Loader, LoaderTuning, OrderSampler, StoreDataset

SCHEMA = {"image": ("|u1", (24, 32, 3), "jpeg:90"), "label": ("<i8", ()), "idx": ("<i8", ()),
          "feat": ("<f4", (6,), "zstd:3")}
HOLES = (0, 9, 40, 41, 88)
N = 90


def make(slot):
    rng = np.random.default_rng(slot)
    return {"image": photo(rng, 24, 32), "label": np.int64(slot % 4), "idx": np.int64(slot),
            "feat": rng.standard_normal(6).astype(np.float32)}


@pytest.fixture(scope="module")
def compact(tmp_path_factory):
    root = tmp_path_factory.mktemp("compact")
    return write_every_layout(root, N, [30, 30, 61], holes=HOLES, schema=SCHEMA, make=make, keys="k{}",
                              reason="test hole")


def _truth(path):
    s = mmstore.open(path)
    return [s[i] for i in range(len(s))]


@pytest.mark.parametrize("name", ["memmap", "lmdb", "merged"])
@pytest.mark.parametrize("kind", ["permutation", "block", "sequential"])
def test_loader_and_dataset_equal_store_getitem(compact, name, kind):
    path = compact[name]
    truth = _truth(path)
    n = len(truth)
    order = {"permutation": Permutation(n, seed=3), "block": BlockShuffle(n, 5, 3, seed=3),
             "sequential": Sequential(n)}[kind]
    loader = Loader(path, 16, order, tuning=LoaderTuning(prefetch=2, threads=3, piece_bytes=4096))
    ds = StoreDataset(path)
    sm = OrderSampler(ds, order)
    seen = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        sm.set_epoch(epoch)
        ours = [{k: v.clone() for k, v in b.items()} for b in loader]
        ref = list(DataLoader(ds, batch_size=16, sampler=sm))
        assert len(ours) == len(ref) == len(loader)
        for a, b in zip(ours, ref):
            assert all(torch.equal(a[k], b[k]) for k in SCHEMA)
            for j, i in enumerate(a["idx"].tolist()):
                rec = truth[int(np.searchsorted(mmstore.open(path).slot_view.index, i))]
                assert all(np.array_equal(a[k][j].numpy(), rec[k]) for k in SCHEMA)
        seen.append(sorted(torch.cat([b["idx"] for b in ours]).tolist()))
    want = sorted(s for s in range(N) if s not in HOLES)
    assert seen == [want, want]  # every record exactly once per epoch
    loader.close()


def test_dataset_getitem_equals_store(compact):
    ds = StoreDataset(compact["memmap"])
    truth = _truth(compact["memmap"])
    for i in (0, 5, len(ds) - 1):
        item = ds[i]
        assert all(np.array_equal(item[k].numpy(), truth[i][k]) for k in SCHEMA)


def test_variable_fields_are_not_preadv_and_the_window_pass_does_not_decode(compact, monkeypatch):
    path = compact["merged"]
    s = mmstore.open(path)
    files = _reads.open_field_files(s, list(SCHEMA), "pread")
    assert set(files) == {"label", "idx"}  # encoded fields are decoded by Store.read_batch
    for ff in files.values():
        ff.close()
    paths = _reads.data_paths(s, ["image", "idx"])
    assert sum(p.endswith(".bin") for p in paths) == 3 and sum(p.endswith("idx.00000.npy") for p in paths) == 1
    # the cold block-shuffle path (window pass): exact batches, entries not decoded twice
    n = len(s)
    order = BlockShuffle(n, 4, 3, seed=7)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    decoded = []
    orig = s.schema["image"].codec.decode_into.__func__
    monkeypatch.setattr(type(s.schema["image"].codec), "decode_into",
                        lambda self, data, out: (decoded.append(1), orig(self, data, out)))
    L = Loader(path, 10, order, tuning=LoaderTuning(prefetch=2, threads=3, method="mmap", window_prefetch="read"))
    got = [{k: v.clone() for k, v in b.items()} for b in L]
    assert len(decoded) == 2 * n  # image and feat: each entry decoded once, by its batch
    truth = _truth(path)
    for b in got:
        for j, i in enumerate(b["idx"].tolist()):
            rec = truth[int(np.searchsorted(s.slot_view.index, i))]
            assert np.array_equal(b["image"][j].numpy(), rec["image"])
    L.close()


def test_a_bad_entry_surfaces_from_the_loader(tmp_path):
    p = write_store(str(tmp_path / "b"), 20, schema=SCHEMA, make=make, keys="k{}")
    o = np.load(os.path.join(p, "image.offsets.npy"), mmap_mode="r+")
    o[7] = o[8] + 5  # decreasing pair at slot 7; slot 6's entry now runs 5 bytes past entry 7's end
    o.flush()
    del o
    L = Loader(p, 4, Sequential(20), tuning=LoaderTuning(threads=2))
    with pytest.raises(EntryDecodeError, match="record 6 \\(slot 6, key 'k6'\\): field 'image'.*trailing bytes"):
        list(L)
    L.close()


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_decode_bound_epochs_decode_one_piece_per_core_at_a_time(compact, monkeypatch, cores):
    """Warm epochs that decode run at most one decoding task per usable core
    (NOTE [decode-bound reads] in mmstore/engine/reads.py), the batch in one contiguous piece
    per core, whatever ``threads`` is; the batches stay exact."""
    import threading

    path = compact["memmap"]
    monkeypatch.setattr(_reads._os, "usable_cores", lambda: cores)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 1.0)  # warm
    s = mmstore.open(path)
    busy, peak, pieces, lock = [0], [0], [], threading.Lock()
    orig = mmstore.Store.read_batch

    def counted(self, idx, *a, **kw):
        with lock:
            busy[0] += 1
            peak[0] = max(peak[0], busy[0])
            pieces.append(len(idx))
        try:
            return orig(self, idx, *a, **kw)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(mmstore.Store, "read_batch", counted)
    L = Loader(path, 12, Permutation(len(s), seed=1), tuning=LoaderTuning(prefetch=4, threads=16))
    got = [b["idx"].clone() for b in L]
    L.close()
    assert sorted(torch.cat(got).tolist()) == sorted(int(s[i]["idx"]) for i in range(len(s)))
    assert peak[0] <= cores
    assert max(pieces) == -(-12 // cores) and len(pieces) == sum(-(-len(b) // -(-12 // cores)) for b in got)
    # a cold permutation keeps every thread (queue depth for the page faults)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    reads = _reads.EpochReads(s, list(SCHEMA), {}, L.tuning, batch_size=12, shuffled=True, block=False)
    assert reads.decode_gate is None
