"""mmstore.split: deterministic, disjoint, complete, stratified train/val splits."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.order.splits import _count


def _check_partition(train, val, n):
    assert train.dtype == val.dtype == np.int64
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)  # sorted, no repeats
    assert len(np.intersect1d(train, val)) == 0
    assert np.array_equal(np.union1d(train, val), np.arange(n))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 400), fraction=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_plain_split_sizes_and_partition(n, fraction, seed):
    train, val = mmstore.split(n, fraction, seed=seed)
    _check_partition(train, val, n)
    want = int(np.floor(fraction * n + 0.5))
    if n >= 2 and 0 < fraction < 1:
        want = min(max(want, 1), n - 1)
    assert len(val) == want
    t2, v2 = mmstore.split(n, fraction, seed=seed)  # deterministic
    assert np.array_equal(t2, train) and np.array_equal(v2, val)


@settings(max_examples=150, deadline=None)
@given(
    labels=st.lists(st.integers(-3, 6), min_size=0, max_size=300),
    fraction=st.floats(0.01, 0.99),
    seed=st.integers(0, 1000),
)
def test_stratified_keeps_class_proportions(labels, fraction, seed):
    lab = np.array(labels, dtype=np.int64)
    n = len(lab)
    if n >= 2 and len(np.unique(lab)) == n:  # every class one sample: one side would be empty
        with pytest.raises(ValueError, match="side would be empty"):
            mmstore.split(n, fraction, seed=seed, stratify=lab)
        return
    train, val = mmstore.split(n, fraction, seed=seed, stratify=lab)
    _check_partition(train, val, n)
    for c in np.unique(lab):
        cnt = int((lab == c).sum())
        nv = int((lab[val] == c).sum())
        assert nv == _count(fraction, cnt)
        if 0.5 <= fraction * cnt <= cnt - 0.5:
            assert abs(nv - fraction * cnt) <= 0.5  # the class's share, rounded
        if cnt >= 2:
            assert 1 <= nv <= cnt - 1  # both sides get the class
        else:
            assert nv == (1 if fraction >= 0.5 else 0)


def test_string_labels_and_different_seeds():
    lab = np.array(["cat", "dog"] * 50)
    a = mmstore.split(100, 0.2, seed=1, stratify=lab)
    b = mmstore.split(100, 0.2, seed=2, stratify=lab)
    assert not np.array_equal(a[1], b[1])
    assert (lab[a[1]] == "cat").sum() == (lab[a[1]] == "dog").sum() == 10


def test_same_split_in_another_process():
    # pinned: PCG64(seed).random(n) is platform independent; this guards against the rule changing
    code = "import mmstore, numpy as np; t, v = mmstore.split(50, 0.2, seed=7); print(v.tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    _, v = mmstore.split(50, 0.2, seed=7)
    assert out.stdout.strip() == str(v.tolist())
    keys = np.random.Generator(np.random.PCG64(7)).random(50)
    assert v.tolist() == sorted(np.argsort(keys, kind="stable")[:10].tolist())


def test_store_field_and_both_reading_paths(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Subset

    from mmstore.torch import StoreDataset

    p = str(tmp_path / "s")
    labels = np.repeat(np.arange(5), 12)
    with mmstore.StoreWriter(p, {"idx": ("<i8", ()), "label": ("<i8", ())}, slots=60) as w:
        for i in range(60):
            w.write(i, {"idx": i, "label": labels[i]})
    store = mmstore.open(p)
    _train, val = mmstore.split(store, 0.25, seed=3, stratify="label")
    assert np.array_equal(mmstore.split(p, 0.25, seed=3, stratify="label")[1], val)  # a path works too
    assert np.array_equal(mmstore.split(60, 0.25, seed=3, stratify=labels)[1], val)
    assert all((labels[val] == c).sum() == 3 for c in range(5))
    ds = StoreDataset(store)
    got = torch.cat([b["idx"] for b in DataLoader(Subset(ds, val.tolist()), batch_size=7)])
    assert got.tolist() == val.tolist()
    with pytest.raises(ValueError, match="no field"):
        mmstore.split(store, 0.1, stratify="nope")
    with pytest.raises(TypeError, match="names a field"):
        mmstore.split(60, 0.1, stratify="label")
    with pytest.raises(ValueError, match="one label per sample"):
        mmstore.split(60, 0.1, stratify=labels[:10])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mmstore.split(60, 1.5)


def test_stratified_singletons_and_subsets(tmp_path):
    # every class one sample: the validation side was silently empty (fraction < 0.5) or the
    # training side (fraction >= 0.5); a Subset with stratify="label" was refused as "a count"
    torch = pytest.importorskip("torch")
    from torch.utils.data import Subset

    from mmstore.torch import StoreDataset

    for f, side in ((0.1, "validation"), (0.5, "training")):
        with pytest.raises(ValueError, match=f"the {side} side would be empty: all 5 classes have one sample"):
            mmstore.split(5, f, stratify=np.arange(5))
    p = str(tmp_path / "s")
    labels = np.array([0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4])
    with mmstore.StoreWriter(p, {"label": ("<i8", ())}, slots=len(labels)) as w:
        for i, v in enumerate(labels):
            w.write(i, {"label": v})
    ds = StoreDataset(mmstore.open(p))
    pos = [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    inner = Subset(Subset(ds, list(range(12))), pos)  # nested, as a second split would be
    tr, va = mmstore.split(inner, 0.5, seed=4, stratify="label")
    want = mmstore.split(len(pos), 0.5, seed=4, stratify=labels[pos])
    assert np.array_equal(tr, want[0]) and np.array_equal(va, want[1])
    _check_partition(tr, va, len(pos))
    assert sorted(labels[pos][va].tolist()) == [0, 1, 1, 2, 3, 3, 4]  # positions in the subset, per class
    with pytest.raises(TypeError, match="not list"):
        mmstore.split([1, 2, 3], 0.5, stratify="label")
    assert torch is not None
