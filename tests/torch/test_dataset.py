"""StoreDataset: per-sample and batched reads, collate, DataLoader workers."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

import mmstore
from mmstore.torch import OrderSampler, StoreBatch, StoreDataset, collate


def test_import_mmstore_does_not_import_torch_layer():
    import subprocess

    code = "import sys, mmstore; print('torch' in sys.modules, 'mmstore.torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_getitem_matches_store(stores):
    st = mmstore.open(stores["small"])
    ds = StoreDataset(st)
    assert len(ds) == len(st)
    for i in (0, 5, 202, -1):
        s = ds[i if i >= 0 else len(ds) - 1]
        ref = st[i if i >= 0 else len(st) - 1]
        assert set(s) == {"image", "label", "idx"}
        for k in s:
            assert isinstance(s[k], torch.Tensor)
            np.testing.assert_array_equal(s[k].numpy(), ref[k])
        assert s["image"].dtype == torch.uint8 and s["image"].shape == (12, 10, 3)


def test_tuple_chw_fields(stores):
    st = mmstore.open(stores["small"])
    ds = StoreDataset(stores["small"], fields=("image", "label"), as_tuple=True, chw=True)
    img, lab = ds[3]
    assert img.shape == (3, 12, 10)
    np.testing.assert_array_equal(img.permute(1, 2, 0).numpy(), st[3]["image"])
    assert int(lab) == int(st[3]["label"])
    imgs, labs = collate(ds.__getitems__([4, 1, 4]))
    assert imgs.shape == (3, 3, 12, 10)
    np.testing.assert_array_equal(imgs.permute(0, 2, 3, 1).numpy(), st.read_batch([4, 1, 4])["image"])
    np.testing.assert_array_equal(labs.numpy(), st.read_batch([4, 1, 4])["label"])


def test_getitems_default_collate_passthrough(stores):
    st = mmstore.open(stores["small"])
    ds = StoreDataset(st)
    idx = [9, 3, 200, 3, 0]
    b = ds.__getitems__(idx)
    assert isinstance(b, StoreBatch) and len(b) == 5
    ref = st.read_batch(idx)
    out = default_collate(b)  # what the DataLoader does by default
    assert out is b.data  # no stacking: the batch tensors themselves
    for k in ref:
        np.testing.assert_array_equal(out[k].numpy(), ref[k])
    assert collate(b) is b.data
    # a collate_fn that iterates samples still sees per-sample dicts
    np.testing.assert_array_equal(b[1]["image"].numpy(), ref["image"][1])
    # regrouped samples fall back to stacking, and stay correct
    sub = default_collate([b[4], b[0]])
    np.testing.assert_array_equal(sub["idx"].numpy(), ref["idx"][[4, 0]])


def test_transforms(stores):
    st = mmstore.open(stores["small"])
    ds = StoreDataset(st, transform=lambda s: {"x": s["image"].float().mean(), "y": s["label"]})
    out = default_collate(ds.__getitems__([1, 2]))
    np.testing.assert_allclose(out["x"].numpy(), st.read_batch([1, 2])["image"].reshape(2, -1).mean(1), rtol=1e-5)
    ds2 = StoreDataset(st, batch_transform=lambda d: (d["image"].float() / 255, d["label"]))
    x, y = default_collate(ds2.__getitems__([5, 6]))
    assert x.dtype == torch.float32 and x.shape == (2, 12, 10, 3)
    np.testing.assert_array_equal(y.numpy(), [5 % 10, 6 % 10])


def test_pickle_roundtrip_after_use(stores):
    ds = StoreDataset(stores["small"])
    ds[0]
    ds2 = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(ds2[7]["image"].numpy(), ds[7]["image"].numpy())


def _epoch_ids(dl, n_epochs=1):
    out = []
    st = mmstore.open(dl.dataset.store.path)
    all_slots = st.slot_view.slots_of(np.arange(len(st)))
    for e in range(n_epochs):
        dl.sampler.set_epoch(e) if hasattr(dl.sampler, "set_epoch") else None
        ids = []
        for b in dl:
            ids.append(b["idx"].numpy().copy())
            ref = st.read_batch(np.searchsorted(all_slots, b["idx"].numpy()))
            np.testing.assert_array_equal(b["image"].numpy(), ref["image"])
        out.append(np.concatenate(ids))
    return out


@pytest.mark.parametrize(
    "ctx,persistent",
    [(None, False), ("fork", False), ("forkserver", False), ("spawn", True), ("fork", True)],
)
def test_dataloader_workers_every_sample_once(stores, ctx, persistent):
    st = mmstore.open(stores["big"])
    st.read_batch([0, 1, 2])  # the parent touched the store first
    ds = StoreDataset(st)
    nw = 0 if ctx is None else 2
    dl = DataLoader(
        ds, batch_size=32, sampler=OrderSampler(ds, seed=1), num_workers=nw,
        multiprocessing_context=ctx, persistent_workers=persistent,
    )
    epochs = _epoch_ids(dl, 2 if persistent else 1)
    for ids in epochs:
        assert np.array_equal(np.sort(ids), np.arange(len(st)))
    if persistent:
        assert not np.array_equal(epochs[0], epochs[1])  # set_epoch reached the sampler


def test_dataloader_lmdb_and_holes(stores):
    for name in ("lmdb", "holes", "merged", "merged_lmdb"):
        st = mmstore.open(stores[name])
        st[0]
        ds = StoreDataset(st)
        dl = DataLoader(ds, batch_size=16, sampler=OrderSampler(ds), num_workers=2,
                        multiprocessing_context="fork")
        (ids,) = _epoch_ids(dl)
        slots = st.slot_view.slots_of(np.arange(len(st)))
        assert np.array_equal(np.sort(ids), slots)  # idx field holds the slot


def test_worker_batches_are_in_shared_memory(stores):
    ds = StoreDataset(stores["big"])
    dl = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="fork")
    b = next(iter(dl))
    assert b["image"].is_shared()

