"""Same-bucket batches (``BucketLoader``, what ``Loader`` is over declared buckets, and
``BucketBatchSampler``) on crops of a real photograph in three exact sizes, stored raw and as JPEG: every
batch one size, its pixels those of ``store[i]``, every record once per epoch, a seeded interleaving that
changes with the epoch, DDP ranks with equal step counts, an exact resume in a new process, ``len``
exact, ``drop_last``, and the same batches through a DataLoader with and without a worker."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.errors import SchemaError
from mmstore.order import OrderSpec

torch = pytest.importorskip("torch")
cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

from torch.utils.data import DataLoader, Subset  # noqa: E402

from mmstore.torch import BucketBatchSampler, BucketLoader, CenterCrop, Loader, StoreDataset  # noqa: E402
from mmstore.torch.buckets import bucket_schedule  # noqa: E402

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
SHAPES = [(40, 56), (56, 40), (48, 48)]
N = 29  # 13 + 8 + 8 records


def _write_folder(root: str) -> None:
    os.makedirs(os.path.join(root, "a"))
    rng = np.random.default_rng(3)
    for k in range(N):
        h, w = SHAPES[0] if k % 9 < 4 else SHAPES[1 + k % 2]
        y, x = int(rng.integers(0, PHOTO.shape[0] - 260)), int(rng.integers(0, PHOTO.shape[1] - 260))
        side = int(rng.integers(120, 260))
        img = cv2.resize(PHOTO[y : y + side, x : x + side], (w, h), interpolation=cv2.INTER_AREA)
        cv2.imwrite(os.path.join(root, "a", f"{k:02d}.png"), img)  # lossless: the stored sizes are these


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """``raw`` and ``jpeg`` stores of the same photographs, each its own size (max_side keeps them)."""
    d = tmp_path_factory.mktemp("buckets")
    _write_folder(str(d / "src"))
    mmstore.ingest(str(d / "src"), str(d / "raw.store"), max_side=64, workers=0, quiet=True)
    mmstore.ingest(str(d / "src"), str(d / "jpeg.store"), max_side=64, codecs=["image=jpeg:90"], workers=0,
                   quiet=True)
    return {"raw": str(d / "raw.store"), "jpeg": str(d / "jpeg.store")}


def _ids(store):
    """Each record's pixels -> its index (every crop is its own picture)."""
    out = {}
    for i in range(len(store)):
        out[store[i]["image"].tobytes()] = i
    assert len(out) == len(store)
    return out


def _records(batch, ids):
    im = batch["image"].numpy()
    return [ids[np.ascontiguousarray(im[j]).tobytes()] for j in range(len(im))]  # KeyError: pixels differ


def _epoch(loader, ids):
    return [_records(b, ids) for b in loader]


@pytest.mark.parametrize("kind", ["raw", "jpeg"])
def test_every_record_once_per_epoch_in_batches_of_one_size_with_its_stored_pixels(stores, kind):
    store = mmstore.open(stores[kind])
    ids = _ids(store)
    hw = store.column("image_hw")
    loader = BucketLoader(store, 3, fields=["image", "image_hw"])
    assert isinstance(loader, BucketLoader) and loader.shapes == [(40, 56), (48, 48), (56, 40)]
    for _ in range(2):
        seen = []
        for batch in loader:
            im = batch["image"]
            assert im.dtype == torch.uint8 and im.ndim == 4 and im.shape[0] <= 3
            recs = _records(batch, ids)  # every row is pixel for pixel some record's store[i]["image"]
            assert {tuple(hw[r]) for r in recs} == {tuple(im.shape[1:3])}
            assert (batch["image_hw"].numpy() == im.shape[1:3]).all()
            seen += recs
        assert sorted(seen) == list(range(N))
    d = loader.describe()
    assert [b["batches"] for b in d["buckets"]] == [5, 3, 3] == loader.counts and len(loader) == 11
    assert "no resize" in d["path"]


def test_epochs_differ_and_a_seed_reproduces_them(stores):
    store = mmstore.open(stores["raw"])
    ids = _ids(store)

    def run(seed):
        loader = BucketLoader(store, 4, OrderSpec("permutation", seed=seed))
        return [_epoch(loader, ids) for _ in range(2)]

    a, b, c = run(0), run(0), run(1)
    assert a == b
    assert a[0] != a[1] and a[0] != c[0]
    shapes_of = [[tuple(store[r[0]]["image"].shape[:2]) for r in ep] for ep in a]
    assert shapes_of[0] != shapes_of[1]  # the interleaving itself changes with the epoch


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ddp_ranks_disjoint_equal_steps_same_bucket_each_step(stores, world, drop_last):
    store = mmstore.open(stores["raw"])
    ids = _ids(store)
    hw = store.column("image_hw")
    runs, lens, repeated = [], [], 0
    for r in range(world):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = BucketLoader(store, 2, OrderSpec("permutation", seed=5, rank=r, world_size=world),
                            drop_last=drop_last)
        twice = sum(p.order.repeated() for p in loader._parts) if not drop_last else 0
        assert len(caught) == (1 if twice else 0) and (not twice or "read twice" in str(caught[0].message))
        ep = _epoch(loader, ids)
        assert len(ep) == len(loader)
        lens.append(len(loader))
        runs.append(ep)
        repeated = twice  # over all ranks, the same on each
        if drop_last:
            assert all(len(b) == 2 for b in ep)
    assert len(set(lens)) == 1 and lens[0] > 0
    for t in range(lens[0]):  # every rank reads the same bucket at every step
        assert len({tuple(hw[runs[r][t][0]]) for r in range(world)}) == 1
    flat = [i for ep in runs for b in ep for i in b]
    if drop_last:
        assert len(set(flat)) == len(flat)  # disjoint; the tails dropped
        assert len(flat) >= N - len(SHAPES) * (2 * world - 1)
    else:
        assert sorted(set(flat)) == list(range(N)) and len(flat) == N + repeated


RESUME = r"""
import hashlib, json, sys
import mmstore
from mmstore.order import OrderSpec
from mmstore.torch import BucketLoader
state = json.loads(sys.stdin.read())
loader = BucketLoader(mmstore.open(sys.argv[1]), 3, OrderSpec("block", seed=2, block=2))
loader.load_state_dict(state)
loader.set_epoch(state["epoch"])
print(json.dumps([[hashlib.sha1(b["image"][j].numpy().tobytes()).hexdigest() for j in range(len(b["image"]))]
                  for b in loader]))
"""


def _digests(ep):
    return [[hashlib.sha1(b["image"][j].numpy().tobytes()).hexdigest() for j in range(len(b["image"]))] for b in ep]


def test_resume_mid_epoch_in_a_new_process_gives_exactly_the_remaining_batches(stores):
    store = mmstore.open(stores["raw"])
    full = BucketLoader(store, 3, OrderSpec("block", seed=2, block=2))
    full.set_epoch(1)
    want = _digests(list(full))
    loader = BucketLoader(store, 3, OrderSpec("block", seed=2, block=2))
    loader.set_epoch(1)
    it = iter(loader)
    got = _digests([next(it) for _ in range(4)])
    state = loader.state_dict()
    del it
    assert state["epoch"] == 1 and state["batches"] == 4 and got == want[:4]
    out = subprocess.run([sys.executable, "-c", RESUME, stores["raw"]], input=json.dumps(state), text=True,
                         capture_output=True, timeout=120, check=True)
    assert json.loads(out.stdout) == want[4:]
    # and a state of another order is refused
    other = BucketLoader(store, 3, OrderSpec("block", seed=3, block=2))
    with pytest.raises(mmstore.errors.LoaderResumeError):
        other.load_state_dict(state)


def test_resume_in_this_process_then_the_next_epoch(stores):
    store = mmstore.open(stores["jpeg"])
    ids = _ids(store)
    ref = BucketLoader(store, 4)
    e0, e1 = _epoch(ref, ids), _epoch(ref, ids)
    loader = BucketLoader(store, 4)
    it = iter(loader)
    first = [_records(next(it), ids) for _ in range(3)]
    state = loader.state_dict()
    it.close()
    again = BucketLoader(store, 4)
    again.load_state_dict(state)
    assert first + _epoch(again, ids) == e0
    assert _epoch(again, ids) == e1


def test_len_exact_and_one_epoch_at_a_time(stores):
    store = mmstore.open(stores["raw"])
    for b in (1, 2, 5, 13, 40):
        for drop in (False, True):
            loader = BucketLoader(store, b, drop_last=drop)
            assert len(list(loader)) == len(loader)
    loader = BucketLoader(store, 2)
    it = iter(loader)
    next(it)
    with pytest.raises(mmstore.errors.LoaderStateError):
        iter(loader)
    it.close()
    assert len(list(loader)) == len(loader)


def test_threads_shared_and_bounded(stores):
    store = mmstore.open(stores["raw"])
    from mmstore.torch import LoaderTuning

    before = set(threading.enumerate())
    loader = BucketLoader(store, 2, tuning=LoaderTuning(threads=3))
    new = set()
    for _ in loader:
        new |= set(threading.enumerate()) - before
    assert 1 <= len(new) <= 3 and all(t.name.startswith("mmstore-buckets") for t in new), new
    loader.close()
    assert not any(t.is_alive() for t in new)


def test_crop_wins_and_a_store_without_declared_buckets_keeps_the_refusal(stores):
    store = mmstore.open(stores["raw"])
    loader = Loader(store, 4, crop=CenterCrop(32))
    assert not isinstance(loader, BucketLoader)
    assert next(iter(loader))["image"].shape == (4, 32, 32, 3)
    with pytest.raises(SchemaError):
        Loader(store, 4)  # no declared buckets: today's refusal, which says what to do
    with pytest.raises(TypeError):
        BucketLoader(store, 4, crop=CenterCrop(32))
    with pytest.raises(SchemaError):
        BucketLoader(store, 4, fields=["label"])  # no image field of its own shape to group


def test_subset_chw_as_tuple_and_pickle(stores):
    import pickle

    store = mmstore.open(stores["raw"])
    ids = _ids(store)
    idx = np.arange(0, N, 2)
    loader = BucketLoader(store, 3, indices=idx, chw=True, fields=["image", "image_hw"], as_tuple=True)
    seen = []
    for im, hw in loader:
        assert im.shape[1] == 3 and (hw.numpy() == im.shape[2:]).all()
        seen += _records({"image": im.permute(0, 2, 3, 1)}, ids)
    assert sorted(seen) == idx.tolist()
    copy = pickle.loads(pickle.dumps(BucketLoader(store, 3)))
    assert isinstance(copy, BucketLoader) and _epoch(copy, ids) == _epoch(BucketLoader(store, 3), ids)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(0, 30), max_size=7), seed=st.integers(0, 2**31), epoch=st.integers(0, 99))
def test_schedule_holds_each_bucket_its_count_and_is_a_function_of_seed_and_epoch(counts, seed, epoch):
    s = bucket_schedule(counts, seed, epoch)
    assert np.bincount(s, minlength=len(counts)).tolist() == counts if len(s) else sum(counts) == 0
    assert (bucket_schedule(counts, seed, epoch) == s).all()
    assert (bucket_schedule(counts, seed, epoch, interleave=False) == np.sort(s)).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch=st.integers(1, 9), world=st.integers(1, 4), drop_last=st.booleans(),
       pad=st.booleans(), seed=st.integers(0, 1000))
def test_sampler_ranks_equal_counts_one_size_every_record(stores, data, batch, world, drop_last, pad, seed):
    store = mmstore.open(stores["raw"])
    hw = store.column("image_hw")
    keep = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=N, unique=True))  # random bucket sizes
    ds = Subset(StoreDataset(store), keep)
    per_rank = []
    for r in range(world):
        s = BucketBatchSampler(ds, batch, seed=seed, drop_last=drop_last, rank=r, world_size=world, pad=pad)
        bs = list(s)
        assert len(bs) == len(s)
        for b in bs:
            assert 1 <= len(b) <= batch and (not drop_last or len(b) == batch)
            assert len({tuple(hw[keep[i]]) for i in b}) == 1
        per_rank.append(bs)
    assert len({len(bs) for bs in per_rank}) == 1
    for t in range(len(per_rank[0])):
        assert len({tuple(hw[keep[bs[t][0]]]) for bs in per_rank}) == 1
    flat = [i for bs in per_rank for b in bs for i in b]
    if drop_last:
        assert len(set(flat)) == len(flat)
    elif not pad:
        assert sorted(set(flat)) == list(range(len(keep)))
        assert len(flat) == len(keep) + sum(o.repeated() for o in s.orders)
    else:
        assert sorted(set(flat)) == list(range(len(keep)))


@pytest.mark.parametrize("workers", [0, 1])
def test_bucket_batch_sampler_with_a_dataloader(stores, workers):
    store = mmstore.open(stores["jpeg"])
    ids = _ids(store)
    sampler = BucketBatchSampler(StoreDataset(store), 4, seed=1)
    dl = DataLoader(StoreDataset(store, fields=["image", "label"]), batch_sampler=sampler, num_workers=workers)
    seen = []
    for batch in dl:
        seen += _records(batch, ids)
    assert sorted(seen) == list(range(N)) and len(dl) == len(sampler) == 8
    sampler.set_epoch(0)
    again = [_records(b, ids) for b in dl]
    assert [i for b in again for i in b] == seen  # set_epoch(0): the same epoch, batch for batch
    state = sampler.state_dict(consumed=5)
    s2 = BucketBatchSampler(StoreDataset(store), 4, seed=1)
    s2.load_state_dict(state)
    assert [b for b in s2] == [b.tolist() for b in sampler.batches(0)[5:]]
    # the Loader's schedule and batches for the same arguments
    loader = BucketLoader(store, 4, OrderSpec("permutation", seed=1))
    assert [r for b in _epoch(loader, ids) for r in b] == seen


def test_a_batch_of_more_than_one_size_is_still_refused(stores):
    store = mmstore.open(stores["raw"])
    hw = store.column("image_hw")
    two = [0, int(np.flatnonzero((hw != hw[0]).any(axis=1))[0])]
    with pytest.raises(SchemaError):
        StoreDataset(store).__getitems__(two)


def test_a_field_that_declares_buckets_is_read_in_buckets_by_default(stores, tmp_path):
    src = os.path.join(os.path.dirname(stores["raw"]), "src")
    path = str(tmp_path / "declared.store")
    mmstore.ingest(src, path, buckets=[(56, 40), (40, 56), (48, 48)], workers=0, quiet=True)
    store = mmstore.open(path)
    declared = [tuple(b) for b in store.schema["image"].buckets]
    ids = _ids(store)
    loader = Loader(store, 4, fields=["image", "label"])
    assert isinstance(loader, BucketLoader) and loader.shapes == declared  # the field's own order
    seen = [r for b in _epoch(loader, ids) for r in b]
    assert sorted(seen) == list(range(N))
    plain = mmstore.open(stores["raw"])  # the same pictures, stored without resizing: the same pixels
    assert {k for k in _ids(plain)} == set(ids)
    crop = Loader(store, 4, crop=CenterCrop(24), fields=["image", "label"])  # crop= wins over the buckets
    assert not isinstance(crop, BucketLoader) and next(iter(crop))["image"].shape == (4, 24, 24, 3)


def test_transform_gets_the_epoch_and_the_step_across_ranks(stores):
    store = mmstore.open(stores["raw"])
    calls = []

    def tf(batch, epoch, batch_index):
        calls.append((epoch, batch_index))
        return batch

    loader = BucketLoader(store, 4, OrderSpec("permutation", rank=1, world_size=2), transform=tf)
    loader.set_epoch(3)
    n = len(list(loader))
    assert calls == [(3, 2 * t + 1) for t in range(n)]


def test_an_entry_whose_size_is_not_its_buckets_is_refused(stores, tmp_path):
    import shutil

    path = str(tmp_path / "damaged.store")
    shutil.copytree(stores["raw"], path)
    offs = np.load(os.path.join(path, "image.offsets.npy"), mmap_mode="r+")
    offs[5] += 3  # entry 4 three bytes longer, entry 5 three shorter: no longer their bucket's size
    offs.flush()
    del offs
    loader = BucketLoader(mmstore.open(path), 4, OrderSpec("sequential"))
    with pytest.raises(mmstore.errors.EntryDecodeError, match="bucket"):
        list(loader)
