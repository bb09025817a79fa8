"""Ragged fields on the torch side: ``StoreDataset``, the collate
functions and the ``Loader`` give each record's boxes / tokens at their own
length (a list of tensors, or padded values + lengths) and ``str`` / ``bytes``
as Python objects, exactly what ``store[i]`` gives, on memmap, lmdb and
merged stores, for every order."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.stores import write_every_layout
from torch.utils.data import DataLoader, default_collate

import mmstore
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning, Padded, StoreDataset, collate

SCHEMA = {"image": ("|u1", (6, 5, 3)), "idx": ("<i8", ()), "boxes": ("<f4", (None, 4)),
          "tokens": ("<i8", (None,)), "cap": "str", "blob": "bytes"}
N = 61
HOLES = (3, 40)
RAGGED = ("boxes", "tokens", "cap", "blob")


def make(slot: int) -> dict:
    rng = np.random.default_rng(slot)
    k = slot % 4  # zero boxes every fourth record
    return {"image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8), "idx": np.int64(slot),
            "boxes": rng.random((k, 4), dtype=np.float32) * 100, "tokens": np.arange(slot % 5, dtype=np.int64) + slot,
            "cap": "é" * (slot % 3) + str(slot), "blob": bytes([slot % 256]) * (slot % 6)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("raggedtorch")
    return write_every_layout(root, N, [20, 20, 45], holes=HOLES, schema=SCHEMA, make=make, keys="k{}",
                              reason="hole")


@pytest.fixture(scope="module", params=["memmap", "lmdb", "merged"])
def store(request, paths):
    return mmstore.open(paths[request.param])


def check_record(got: dict, want: dict, fields=None) -> None:
    """``got`` (torch forms of one record) is exactly ``want`` (``store[i]``)."""
    for f in fields or want:
        g, w = got[f], want[f]
        if isinstance(w, (str, bytes)):
            assert type(g) is type(w) and g == w, f
        else:
            assert isinstance(g, torch.Tensor) and tuple(g.shape) == np.shape(w), f
            assert np.array_equal(g.numpy(), np.asarray(w)), f


def rows_of(batch: dict, f: str, j: int):
    """Record ``j`` of a batched ragged field, list or Padded form."""
    v = batch[f]
    if isinstance(v, Padded):
        n = int(v.lengths[j])
        return v.values[j, :n]
    return v[j]


def check_batch(store, batch: dict, mode: str, pad_value=0, fields=None) -> list[int]:
    """Every record of ``batch`` equals ``store[i]``; the padding is ``pad_value``; the records' idx."""
    idx = [int(i) for i in batch["idx"]]
    for j, i in enumerate(idx):
        want = _by_idx(store)[i]
        check_record({f: rows_of(batch, f, j) for f in (fields or want)}, want, fields)
    for f in fields or RAGGED:
        v = batch[f]
        if f in ("cap", "blob"):
            assert isinstance(v, list) and all(isinstance(x, (str, bytes)) for x in v)
        elif mode == "pad":
            assert isinstance(v, Padded) and v.lengths.dtype == torch.int64
            width = v.values.shape[1]
            assert width == (int(v.lengths.max()) if len(idx) else 0)
            for j in range(len(idx)):
                assert (v.values[j, int(v.lengths[j]):] == pad_value).all()
        else:
            assert isinstance(v, list) and len(v) == len(idx)
    return idx


_CACHE: dict = {}


def _by_idx(store) -> dict:
    """record's idx -> store[i], per store."""
    key = store.path
    if key not in _CACHE:
        _CACHE[key] = {int(store[i]["idx"]): store[i] for i in range(len(store))}
    return _CACHE[key]


def live_idx():
    return sorted(set(range(N)) - set(HOLES))


# -- StoreDataset ---------------------------------------------------------------------------


def test_dataset_item_is_the_record_at_its_own_length(store):
    ds = StoreDataset(store)
    for i in range(len(store)):
        got, want = ds[i], store[i]
        check_record(got, want)
        assert got["idx"].shape == () and got["boxes"].dtype == torch.float32
    sub = StoreDataset(store, fields=("tokens", "idx"), as_tuple=True)  # the read_batch path
    for i in (0, 5, len(store) - 1):
        t, x = sub[i]
        assert np.array_equal(t.numpy(), store[i]["tokens"]) and int(x) == int(store[i]["idx"])


@pytest.mark.parametrize("mode", ["list", "pad"])
def test_dataset_batches_list_and_pad(store, mode):
    ds = StoreDataset(store, ragged=mode, pad_value=-7, chw=True)
    order = np.random.default_rng(0).permutation(len(store))[:23]
    batch = default_collate(ds.__getitems__(order.tolist()))
    assert batch["image"].shape == (23, 3, 6, 5)  # chw: images only, ragged fields untouched
    idx = check_batch(store, {**batch, "image": batch["image"].permute(0, 2, 3, 1)}, mode, -7)
    assert idx == [int(store[int(i)]["idx"]) for i in order]
    # an all-empty batch: zero-row entries only
    empty = [i for i in range(len(store)) if len(store[i]["boxes"]) == 0][:3]
    b = collate(ds.__getitems__(empty))
    if mode == "pad":
        assert b["boxes"].values.shape == (3, 0, 4) and b["boxes"].lengths.tolist() == [0, 0, 0]
    else:
        assert [tuple(t.shape) for t in b["boxes"]] == [(0, 4)] * 3


def test_dataloader_default_collate_two_workers(paths):
    st = mmstore.open(paths["merged"])
    ds = StoreDataset(st)
    seen = []
    g = torch.Generator().manual_seed(3)
    for batch in DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, generator=g):
        assert isinstance(batch["boxes"], list) and isinstance(batch["cap"][0], str)
        seen += check_batch(st, batch, "list")
    assert sorted(seen) == live_idx()


@pytest.mark.parametrize("mode", ["list", "pad"])
def test_per_sample_transform_with_ds_collate(store, mode):
    ds = StoreDataset(store, transform=lambda s: {**s, "idx": s["idx"] + 0}, ragged=mode, pad_value=5)
    seen = []
    for batch in DataLoader(ds, batch_size=9, collate_fn=ds.collate):
        seen += check_batch(store, batch, mode, 5)
    assert sorted(seen) == live_idx()
    # tuples: the ragged positions
    dt = StoreDataset(store, fields=("idx", "boxes", "cap"), as_tuple=True, transform=tuple, ragged=mode)
    idx, boxes, cap = dt.collate([dt[i] for i in range(6)])
    assert idx.tolist() == [int(store[i]["idx"]) for i in range(6)] and cap == [store[i]["cap"] for i in range(6)]
    assert isinstance(boxes, Padded if mode == "pad" else list)


def test_module_collate_keeps_ragged_values_as_lists(store):
    samples = [StoreDataset(store)[i] for i in range(5)]
    b = collate(samples)
    assert b["image"].shape == (5, 6, 5, 3) and b["idx"].shape == (5,)  # stacked
    assert isinstance(b["boxes"], list) and isinstance(b["cap"], list) and isinstance(b["blob"], list)
    p = collate(samples, ragged_fields=("boxes", "tokens", "cap", "blob"), ragged="pad", pad_value=-1)
    check_batch(store, p, "pad", -1)
    with pytest.raises(ValueError, match="ragged="):
        StoreDataset(store, ragged="nested")
    with pytest.raises(ValueError, match="pad_value=0.5 is not a value of .* int64"):
        StoreDataset(store, fields=("tokens",), ragged="pad", pad_value=0.5).__getitems__([1, 2])
    with pytest.raises(ValueError, match="pad_value=300"):
        collate([{"b": torch.zeros(1, dtype=torch.uint8)}, {"b": torch.zeros(2, dtype=torch.uint8)}],
                ragged_fields=("b",), ragged="pad", pad_value=300)


# -- Loader -----------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["permutation", "block", "sequential"])
@pytest.mark.parametrize("mode", ["list", "pad"])
def test_loader_every_order_every_record_once_exact(store, order, mode):
    kw = {"block": 4, "window": 3} if order == "block" else {}
    with Loader(store, 8, order=OrderSpec(order, seed=1, **kw), ragged=mode, pad_value=-2) as L:
        for epoch in range(2):
            seen = []
            for batch in L:
                seen += check_batch(store, batch, mode, -2)
            assert sorted(seen) == live_idx(), epoch


@pytest.mark.parametrize("mode", ["list", "pad"])
def test_loader_batches_cut_in_pieces(store, mode):
    # tiny pieces: a batch is read by several tasks (lmdb: the ragged fields come with
    # each piece's fixed ones and are joined per batch)
    L = Loader(store, 9, ragged=mode, tuning=LoaderTuning(piece_bytes=64), order=OrderSpec("permutation", seed=2))
    seen = []
    for batch in L:
        seen += check_batch(store, batch, mode)
    assert sorted(seen) == live_idx()


def test_loader_as_tuple_fields_indices_transform_copy(store):
    fields = ("boxes", "idx", "cap")
    want = [0, 2, 5, 9, 12, 30, 44]
    calls = []

    def tf(batch, epoch, batch_index):
        calls.append((epoch, batch_index))
        return batch

    L = Loader(store, 3, fields=fields, as_tuple=True, indices=want, transform=tf, copy=True, order="sequential")
    got = list(L)
    assert calls == [(0, 0), (0, 1), (0, 2)]
    flat = [(b, i, c) for boxes, idx, cap in got for b, i, c in zip(boxes, idx, cap)]
    assert len(flat) == len(want)
    for (b, i, c), r in zip(flat, want):
        rec = store[r]
        assert int(i) == int(rec["idx"]) and c == rec["cap"] and np.array_equal(b.numpy(), rec["boxes"])


def test_loader_only_ragged_fields_and_dataset_defaults(store):
    ds = StoreDataset(store, fields=("tokens", "blob"), ragged="pad", pad_value=9)
    L = Loader(ds, 16, order="sequential", drop_last=True)
    assert (L.ragged, L.pad_value) == ("pad", 9)
    batches = list(L)
    assert len(batches) == len(store) // 16
    for k, b in enumerate(batches):
        assert set(b) == {"tokens", "blob"} and isinstance(b["tokens"], Padded)
        for j in range(16):
            rec = store[k * 16 + j]
            assert np.array_equal(rows_of(b, "tokens", j).numpy(), rec["tokens"]) and b["blob"][j] == rec["blob"]


def test_loader_kept_batches_stay_intact(store):
    L = Loader(store, 4, tuning=LoaderTuning(prefetch=1, hold=1))
    kept = list(L)  # every batch kept: the ring renews, ragged tensors are fresh anyway
    seen = []
    for b in kept:
        seen += check_batch(store, b, "list")
    assert sorted(seen) == live_idx()


@pytest.mark.parametrize("mode", ["list", "pad"])
def test_loader_resume_mid_epoch(store, mode):
    def run(L):
        return [check_batch(store, b, mode) for b in L]

    L = Loader(store, 6, ragged=mode, order=OrderSpec("permutation", seed=4))
    full = run(L)  # epoch 0
    it = iter(L)  # epoch 1, stopped after 3 batches
    first = [check_batch(store, next(it), mode) for _ in range(3)]
    state = json.loads(json.dumps(L.state_dict()))
    del it
    M = Loader(store, 6, ragged=mode, order=OrderSpec("permutation", seed=4))
    M.load_state_dict(state)
    rest = run(M)
    assert len(first) + len(rest) == len(full)
    assert sorted(i for b in first + rest for i in b) == live_idx()
    N2 = Loader(store, 6, ragged=mode, order=OrderSpec("permutation", seed=4))
    N2.set_epoch(1)
    assert first + rest == run(N2)  # the same epoch's batches, in order
