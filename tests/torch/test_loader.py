"""Loader: same batches as DataLoader, buffer contract, hints, warm, errors."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import mmstore
from mmstore.engine import reads as _reads
from mmstore.order import BlockShuffle, OrderSpec, Permutation, Sequential
from mmstore.torch import Loader, LoaderTuning, OrderSampler, StoreDataset


def _dl_batches(path, order, batch_size, drop_last, epoch):
    ds = StoreDataset(path)
    sm = OrderSampler(ds, order)
    sm.set_epoch(epoch)
    dl = DataLoader(ds, batch_size=batch_size, sampler=sm, drop_last=drop_last)
    return [{k: v.clone() for k, v in b.items()} for b in dl]


@pytest.mark.parametrize("name,method", [("big", "auto"), ("big", "pread"), ("small", "auto"),
                                         ("small", "pread"), ("holes", "pread"), ("lmdb", "auto"),
                                         ("merged", "pread"), ("merged", "mmap"), ("merged_lmdb", "auto")])
@pytest.mark.parametrize("kind", ["permutation", "block", "sequential"])
def test_loader_equals_dataloader(stores, name, method, kind):
    path = stores[name]
    n = len(mmstore.open(path))
    order = {
        "permutation": Permutation(n, seed=11),
        "block": BlockShuffle(n, 5, 4, seed=11),
        "sequential": Sequential(n),
    }[kind]
    for drop_last in (False, True):
        loader = Loader(
            path,
            24,
            order,
            drop_last=drop_last,
            tuning=LoaderTuning(prefetch=3, threads=4, piece_bytes=4096, method=method),
        )
        for epoch in (0, 2):
            loader.set_epoch(epoch)
            ours = list(b.copy() for b in _cloned(loader))
            ref = _dl_batches(path, order, 24, drop_last, epoch)
            assert len(ours) == len(ref) == len(loader)
            for a, b in zip(ours, ref):
                assert a.keys() == b.keys()
                for k in a:
                    assert a[k].dtype == b[k].dtype
                    assert torch.equal(a[k], b[k])
        loader.close()


@pytest.mark.parametrize("method", ["pread", "mmap"])
def test_merged_store_loads_like_the_single_store(stores, method):
    """Batches of a merged store (records scattered over segments within a
    batch) equal those of the single store with the same records."""
    n = len(mmstore.open(stores["merged_ref"]))
    kw = dict(tuning=LoaderTuning(prefetch=2, threads=3, piece_bytes=1 << 16, method=method))  # a batch: one read task
    for order in (Permutation(n, seed=5), BlockShuffle(n, 6, 3, seed=5)):
        a = [{k: v.clone() for k, v in b.items()} for b in Loader(stores["merged"], 13, order, **kw)]
        b = [{k: v.clone() for k, v in b.items()} for b in Loader(stores["merged_ref"], 13, order, **kw)]
        assert len(a) == len(b) == -(-n // 13)
        for x, y in zip(a, b):
            assert all(torch.equal(x[k], y[k]) for k in x)
        assert (sorted(torch.cat([x["idx"] for x in a]).tolist())
                == sorted(mmstore.open(stores["merged_ref"]).column("idx").tolist()))


def _cloned(loader):
    for b in loader:
        yield {k: v.clone() for k, v in b.items()}


def test_epoch_auto_increment_and_set_epoch(stores):
    n = len(mmstore.open(stores["small"]))
    L = Loader(stores["small"], 50, Permutation(n, seed=0), fields=("idx",), tuning=LoaderTuning(threads=2))
    e0 = np.concatenate([b["idx"].numpy().copy() for b in L])
    e1 = np.concatenate([b["idx"].numpy().copy() for b in L])
    assert not np.array_equal(e0, e1)
    assert np.array_equal(e0, Permutation(n, seed=0).epoch(0))
    assert np.array_equal(e1, Permutation(n, seed=0).epoch(1))
    L.set_epoch(0)
    again = np.concatenate([b["idx"].numpy().copy() for b in L])
    assert np.array_equal(again, e0)
    L.close()


def test_ring_reused_when_only_hold_batches_are_kept(stores):
    """A loop that keeps at most `hold` batches alive (the loop variable's
    included) reuses the ring: no fresh buffer, addresses cycle with period
    ring_size, every kept batch intact."""
    path = stores["big"]
    st = mmstore.open(path)
    for hold in (1, 2, 3):
        L = Loader(path, 16, "permutation", tuning=LoaderTuning(prefetch=3, hold=hold, threads=4, piece_bytes=2048))
        kept: list[tuple[dict, np.ndarray]] = []
        ptrs = []
        for b in L:
            ids = b["idx"].numpy().copy()
            ptrs.append(b["image"].data_ptr())
            kept = [*kept, (b, ids)][-hold:]  # hold batches referenced in all, the loop variable's included
            time.sleep(0.002)  # slow consumer: the readers run ahead
            for bb, ii in kept:
                assert np.array_equal(bb["idx"].numpy()[: len(ii)], ii)
                ref = st.read_batch(np.searchsorted(st.slot_view.slots_of(np.arange(len(st))), ii))
                np.testing.assert_array_equal(bb["image"].numpy()[: len(ii)], ref["image"])
        assert L.ring_size == 3 + hold + 1 and L.fresh_buffers == 0
        assert len(set(ptrs)) == L.ring_size
        assert all(ptrs[i] == ptrs[i + L.ring_size] for i in range(len(ptrs) - L.ring_size))
        L.close()


def test_kept_batch_is_not_overwritten(stores):
    """A batch kept past its buffer's turn stays intact."""
    L = Loader(stores["big"], 16, Permutation(301, seed=1), fields=("idx",), tuning=LoaderTuning(prefetch=2, threads=2))
    it = iter(L)
    first = next(it)
    saved = first["idx"].clone()
    for _ in range(6):
        next(it)
    assert torch.equal(first["idx"], saved) and L.fresh_buffers == 1
    L.close()


def test_copy_true_gives_independent_batches(stores):
    L = Loader(stores["big"], 16, Permutation(301, seed=1), copy=True, tuning=LoaderTuning(prefetch=2, threads=2))
    batches = list(L)
    ids = np.concatenate([b["idx"].numpy() for b in batches])
    assert np.array_equal(ids, Permutation(301, seed=1).epoch(0))
    assert len({b["image"].data_ptr() for b in batches}) == len(batches)
    L.close()


def test_tuple_chw_and_fields(stores):
    st = mmstore.open(stores["big"])
    L = Loader(st, 10, "sequential", fields=("image", "label"), as_tuple=True, chw=True, tuning=LoaderTuning(threads=2))
    img, lab = next(iter(L))
    assert img.shape == (10, 3, 24, 32) and img.dtype == torch.uint8
    np.testing.assert_array_equal(img.permute(0, 2, 3, 1).numpy(), st[:10]["image"])
    np.testing.assert_array_equal(lab.numpy(), st[:10]["label"])
    L.close()


def test_ddp_ranks_disjoint(stores):
    n = len(mmstore.open(stores["big"]))
    got = [
        np.concatenate(
            [
                b["idx"].numpy().copy()
                for b in Loader(
                    stores["big"],
                    32,
                    OrderSpec("block", rank=r, world_size=3, drop_last=True, block=6, window=2),
                    fields=("idx",),
                )
            ]
        )
        for r in range(3)
    ]
    allids = np.concatenate(got)
    assert len(allids) == (n // 3) * 3 and len(np.unique(allids)) == len(allids)


def test_break_mid_epoch_and_restart(stores):
    L = Loader(stores["big"], 8, "permutation", tuning=LoaderTuning(prefetch=4, threads=4))
    for i, _ in enumerate(L):
        if i == 3:
            break
    # a new iteration cancels the old one's reads; all batches complete and correct
    L.set_epoch(5)
    ids = np.concatenate([b["idx"].numpy().copy() for b in L])
    assert np.array_equal(ids, L.order.epoch(5))
    L.close()
    L.close()


def test_read_errors_propagate(stores, monkeypatch):
    L = Loader(stores["big"], 8, "permutation", tuning=LoaderTuning(threads=2))

    def boom(*a, **k):
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(_reads.EpochReads, "read", boom)
    with pytest.raises(OSError, match="simulated"):
        list(L)
    monkeypatch.undo()
    assert len(list(L)) == len(L)  # usable again
    L.close()


def test_warm_and_hints(stores):
    L = Loader(stores["big"], 32, "permutation", tuning=LoaderTuning(warm=True, threads=2))
    n = sum(len(b["idx"]) for b in L)
    assert n == 301
    assert L.warm_report is not None and L.warm_report.complete
    L.close()
    L2 = Loader(stores["big"], 32, "permutation", tuning=LoaderTuning(warm="background", threads=2))
    assert sum(len(b["idx"]) for b in L2) == 301
    L2.close()


def test_pread_and_mmap_methods_agree(stores):
    a = [
        b["image"].clone()
        for b in Loader(stores["holes"], 9, Permutation(115, seed=2), tuning=LoaderTuning(method="pread", threads=3))
    ]
    b = [
        b["image"].clone()
        for b in Loader(stores["holes"], 9, Permutation(115, seed=2), tuning=LoaderTuning(method="mmap", threads=3))
    ]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def test_threads_really_overlap(stores):
    # several batches are in flight: with prefetch=4 the readers fill the ring
    L = Loader(stores["big"], 8, "permutation", tuning=LoaderTuning(prefetch=4, threads=4))
    it = iter(L)
    next(it)
    deadline = time.monotonic() + 10
    while True:  # the 4 batches after the first are read without the consumer asking
        done = [f is not None and all(x.done() for x in f) for f in it.inflight.futs]
        if sum(done) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert sum(done) >= 4
    it.close()
    L.close()


def test_pin_memory_cpu(stores):
    if torch.cuda.is_available():
        L = Loader(stores["big"], 8, "permutation", pin_memory=True, tuning=LoaderTuning(threads=2))
        b = next(iter(L))
        assert b["image"].is_pinned()
        L.close()
    else:
        with pytest.warns(UserWarning, match="pin_memory"):
            L = Loader(stores["big"], 8, "permutation", pin_memory=True, tuning=LoaderTuning(threads=2))
        assert sum(len(b["idx"]) for b in L) == 301
        L.close()


def test_bad_arguments(stores):
    with pytest.raises(ValueError):
        Loader(stores["big"], 0)
    with pytest.raises(ValueError):
        Loader(stores["big"], 8, tuning=LoaderTuning(prefetch=0))
    with pytest.raises(ValueError):
        Loader(stores["big"], 8, tuning=LoaderTuning(method="x"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            Loader(stores["big"], 8, device="cuda")


def test_no_thread_leak(stores):
    before = threading.active_count()
    for _ in range(3):
        with Loader(stores["big"], 32, OrderSpec("block", block=5, window=3), tuning=LoaderTuning(threads=3)) as L:
            list(L)
    time.sleep(0.05)
    assert threading.active_count() <= before + 1


@pytest.mark.parametrize("name,mode", [("big", "willneed"), ("big", "read"), ("holes", "read"), ("lmdb", True),
                                       ("merged", "read"), ("merged", "willneed")])
def test_cold_paths_window_prefetch_and_willneed(stores, name, mode, monkeypatch):
    """Force the 'store not resident' branch: window thread + WILLNEED hints."""
    path = stores[name]
    n = len(mmstore.open(path))
    order = BlockShuffle(n, 4, 3, seed=7)
    L = Loader(path, 10, order, tuning=LoaderTuning(prefetch=2, threads=3, piece_bytes=4096, window_prefetch=mode))
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    windows = []
    orig = _reads.WindowPrefetch.read_window
    monkeypatch.setattr(_reads.WindowPrefetch, "read_window", lambda w, idx: (windows.append(len(idx)), orig(w, idx)))
    hinted = []
    orig_hint = _reads.EpochReads.hint
    monkeypatch.setattr(_reads.EpochReads, "hint", lambda r, idx: (hinted.append(len(idx)), orig_hint(r, idx)))
    for epoch in (0, 1):
        L.set_epoch(epoch)
        ours = [b["idx"].clone() for b in L]
        ref = [b["idx"] for b in _dl_batches(path, order, 10, False, epoch)]
        assert all(torch.equal(a, b) for a, b in zip(ours, ref)) and len(ours) == len(ref)
    assert sum(windows) == 2 * n  # every record read once per epoch by the window pass
    # the window pass reads later batches' records in long requests: no
    # per-record WILLNEED racing it with small ones
    assert not hinted
    L.close()
    P = Loader(path, 10, Permutation(n, seed=7), tuning=LoaderTuning(prefetch=2, threads=3, piece_bytes=4096))
    assert len([b for b in P]) == -(-n // 10)
    if name != "lmdb":
        assert hinted  # a permutation still hints the records of later batches
    P.close()


def test_equal_tuning_objects_make_the_same_loader(stores):
    """Two equal ``tuning=LoaderTuning(...)``: one configuration, the same
    batches (pixel exact); the order's sizes reach the order; pickling keeps
    both."""
    path, ref = stores["big"], mmstore.open(stores["big"])
    t = LoaderTuning(prefetch=2, hold=2, threads=3, method="pread", piece_bytes=4096, window_prefetch=True)
    a = Loader(path, 16, Permutation(301, seed=4), tuning=t)
    b = Loader(
        path,
        16,
        Permutation(301, seed=4),
        tuning=LoaderTuning(prefetch=2, hold=2, threads=3, method="pread", piece_bytes=4096, window_prefetch=True),
    )
    assert a.tuning == b.tuning == t and t.window_prefetch == "willneed"
    # ring_size: + 1 for the kept-batch check
    assert (a.prefetch, a.tuning.hold, a.tuning.threads, a.tuning.method, a.ring_size) == (2, 2, 3, "pread", 5)
    assert not hasattr(a, "hold")  # the 0.2 spelling (loader.hold) is gone: loader.tuning.hold
    got_a = [{k: v.clone() for k, v in x.items()} for x in a]
    got_b = [{k: v.clone() for k, v in x.items()} for x in b]
    assert np.array_equal(np.concatenate([x["idx"].numpy() for x in got_a]), Permutation(301, seed=4).epoch(0))
    assert len(got_a) == len(got_b) == 19
    for x, y in zip(got_a, got_b):
        want = ref.read_batch(x["idx"].numpy())
        for f in ref.fields:
            assert torch.equal(x[f], y[f]) and np.array_equal(x[f].numpy(), want[f])
    c = Loader(path, 16, OrderSpec("block", block=5, window=3), tuning=dataclasses.replace(t, prefetch=5))
    assert c.tuning == dataclasses.replace(t, prefetch=5) and c.ring_size == 8
    assert isinstance(c.order, BlockShuffle) and (c.order.block, c.order.window) == (5, 3)
    d = pickle.loads(pickle.dumps(c))
    assert d.tuning == c.tuning and d.order == c.order
    for L in (a, b, c, d):
        L.close()
    with pytest.raises(ValueError, match="prefetch and hold"):
        LoaderTuning(hold=0)
    with pytest.raises(ValueError, match="window_prefetch"):
        Loader(path, 8, tuning=dataclasses.replace(t, window_prefetch="sometimes"))
    with pytest.raises(TypeError, match="LoaderTuning"):
        Loader(path, 8, tuning={"prefetch": 2})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.prefetch = 3  # type: ignore[misc]
