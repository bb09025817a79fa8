"""Transforms and resume: ``Loader(transform=)`` and mid-epoch resume
(``state_dict`` / ``load_state_dict``), in this process and in a new one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmstore.errors import LoaderResumeError, LoaderStateError
from mmstore.order import OrderSpec, Permutation
from mmstore.torch import Loader, LoaderTuning, augment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _aug():
    return augment.Pipeline([augment.RandomResizedCrop(12), augment.HorizontalFlip()], seed=7)


def _loader(path, kind="permutation", **kw):
    kw.setdefault("fields", ("image", "idx"))
    return Loader(path, 16, OrderSpec(kind, seed=3), transform=_aug(), **kw, tuning=LoaderTuning(prefetch=2, threads=2))


def _run(it, n=None):
    """(ids, images) of the next ``n`` batches (all when None), copied."""
    ids, imgs = [], []
    for k, b in enumerate(it):
        ids.append(b["idx"].clone())
        imgs.append(b["image"].clone())
        if n is not None and k + 1 == n:
            break
    return ids, imgs


def test_transform_protocol(stores):
    """A transform taking epoch= and batch_index= gets them; a plain one gets
    the batch only; both run on what would be yielded (tuple here)."""
    seen = []

    def with_pos(batch, *, epoch, batch_index):
        seen.append((epoch, batch_index, type(batch).__name__))
        return batch[1] * 2

    L = Loader(stores["big"], 50, "sequential", fields=("image", "idx"), as_tuple=True, transform=with_pos)
    out = [x.clone() for x in L] + [x.clone() for x in L]
    assert seen == [(e, k, "tuple") for e in (0, 1) for k in range(7)]
    assert np.array_equal(torch.cat(out[:7]).numpy(), 2 * np.arange(301))
    plain = Loader(stores["big"], 50, "sequential", fields=("idx",), transform=lambda b: b["idx"] + 1)
    assert np.array_equal(torch.cat(list(plain)).numpy(), np.arange(1, 302))
    with pytest.raises(TypeError, match="callable"):
        Loader(stores["big"], 50, transform=3)
    # a transform taking one of the two keywords gets that one (it was called f(batch): TypeError)
    got = []
    only_epoch = Loader(stores["big"], 50, "sequential", fields=("idx",),
                        transform=lambda b, epoch: got.append(("e", epoch)) or b)
    only_index = Loader(stores["big"], 50, "sequential", fields=("idx",),
                        transform=lambda b, batch_index: got.append(("k", batch_index)) or b)
    only_epoch.set_epoch(3)
    assert len(list(only_epoch)) == 7 and len(list(only_index)) == 7
    assert got == [("e", 3)] * 7 + [("k", k) for k in range(7)]


def test_transform_batch_numbers_are_distinct_across_ranks(stores):
    """Under DDP each rank's batches get their own numbers (j * world + rank),
    so ranks sharing one pipeline seed draw different parameters."""
    seen = {}
    for rank in (0, 1, 2):
        got = []
        L = Loader(stores["big"], 16, OrderSpec("permutation", rank=rank, world_size=3), fields=("idx",),
                   transform=lambda b, *, epoch, batch_index, got=got: got.append(batch_index) or b)
        list(L)
        seen[rank] = got
    assert seen[0] == [0, 3, 6, 9, 12, 15, 18] and seen[1] == [1, 4, 7, 10, 13, 16, 19] and seen[2][:2] == [2, 5]
    assert len(set(sum(seen.values(), []))) == sum(len(v) for v in seen.values())


def test_transform_draws_follow_epoch_and_batch(stores):
    """A Pipeline as transform draws from (seed, epoch, batch index): the
    same batch is augmented the same way in another loader."""
    a, b = _loader(stores["big"]), _loader(stores["big"])
    a.set_epoch(2)
    b.set_epoch(2)
    _, xa = _run(a)
    _, xb = _run(b)
    assert all(torch.equal(x, y) for x, y in zip(xa, xb)) and len(xa) == 19
    assert xa[0].shape == (16, 12, 12, 3)
    assert not torch.equal(xa[0], xa[1][: len(xa[0])])


@pytest.mark.parametrize("kind", ["permutation", "block", "sequential"])
def test_resume_in_process(stores, kind):
    """Stop after k batches, save, a fresh loader loads: the rest of the
    epoch, then the next epoch, equal an uninterrupted run."""
    path = stores["big"]
    ref = _loader(path, kind)
    r_ids, r_img = _run(ref)
    r2_ids, r2_img = _run(ref)
    for k in (1, 5, 18):
        L = _loader(path, kind)
        it = iter(L)
        ids, img = _run(it, k)
        state = L.state_dict()
        assert (state["epoch"], state["batches"]) == (0, k)
        del it
        M = _loader(path, kind)
        M.load_state_dict(json.loads(json.dumps(state)))  # survives json
        ids2, img2 = _run(M)
        assert len(ids) + len(ids2) == len(r_ids)
        for x, y in zip(ids + ids2, r_ids):
            assert torch.equal(x, y)
        for x, y in zip(img + img2, r_img):
            assert torch.equal(x, y)
        n_ids, n_img = _run(M)  # then epoch 1
        assert all(torch.equal(x, y) for x, y in zip(n_ids + n_img, r2_ids + r2_img))
        L.close()
        M.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(0, 19), epoch=st.integers(0, 3), world=st.sampled_from([(0, 1), (1, 2), (2, 3)]))
def test_resume_any_point(stores, k, epoch, world):
    """Any number of delivered batches, any epoch, any rank: the resumed
    loader yields exactly the batches not yet delivered."""
    path = stores["big"]
    rank, ws = world
    mk = lambda: Loader(
        path,
        7,
        OrderSpec("permutation", seed=1, rank=rank, world_size=ws),
        fields=("idx",),
        tuning=LoaderTuning(prefetch=2, threads=2),
    )
    full = mk().order.epoch(epoch)
    L = mk()
    L.set_epoch(epoch)
    it = iter(L)
    got = []
    for _ in range(min(k, len(L))):
        got.append(next(it)["idx"].clone())
    state = L.state_dict()
    del it
    M = mk()
    M.load_state_dict(state)
    rest = [b["idx"].clone() for b in M]
    if k < len(L):
        assert np.array_equal(torch.cat(got + rest).numpy(), full)
        assert (M.state_dict()["epoch"], M.state_dict()["batches"]) == (epoch, len(M))  # the epoch is complete
    else:  # everything was delivered: the state says so, and the next loop runs the next epoch
        assert (state["epoch"], state["batches"]) == (epoch, len(L))
        assert np.array_equal(torch.cat(got).numpy(), full)
        assert np.array_equal(torch.cat(rest).numpy(), M.order.epoch(epoch + 1))
    L.close()
    M.close()


def test_state_between_epochs_and_set_epoch(stores):
    path = stores["big"]
    L = _loader(path)
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (0, 0)
    for _ in L:
        last = L.state_dict()
    assert (last["epoch"], last["batches"]) == (0, 19)  # taken at the last batch: epoch 0, all delivered
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (0, 19)  # after the loop: the same
    it = iter(L)
    _run(it, 3)
    s = L.state_dict()
    with pytest.raises(LoaderStateError, match="being iterated"):
        L.load_state_dict(s)
    del it
    M = _loader(path)
    M.load_state_dict(s)
    assert M.state_dict()["batches"] == 3
    M.set_epoch(1)  # the state's epoch: the resume holds
    assert len(_run(M)[0]) == 19 - 3
    M.load_state_dict(s)
    warned = r"set_epoch\(4\) drops the resume .*epoch 1, 3 of 19 batches.*set_epoch\(1\)"
    with pytest.warns(UserWarning, match=warned):
        M.set_epoch(4)  # another epoch wins (with a warning): a whole epoch 4
    ids, _ = _run(M)
    assert np.array_equal(torch.cat(ids).numpy(), M.order.epoch(4))


def test_refuses_other_states(stores, tmp_path):
    path = stores["big"]
    L = _loader(path)
    s = L.state_dict()
    bad = {
        "batch_size": Loader(path, 8, OrderSpec("permutation", seed=3)),
        "order": Loader(path, 16, OrderSpec("permutation", seed=4)),
        "store": Loader(stores["small"], 16, OrderSpec("permutation", seed=3)),
        "subset": Loader(path, 16, OrderSpec("permutation", seed=3), indices=np.arange(301)),
    }
    for key, other in bad.items():
        with pytest.raises(LoaderResumeError, match=key):
            other.load_state_dict(s)
    with pytest.raises(LoaderResumeError, match="drop_last"):
        Loader(path, 16, OrderSpec("permutation", seed=3), drop_last=True).load_state_dict(s)
    with pytest.raises(LoaderResumeError, match="order"):
        Loader(path, 16, OrderSpec("block", seed=3)).load_state_dict(s)
    with pytest.raises(LoaderResumeError, match="order"):
        Loader(path, 16, OrderSpec("permutation", seed=3, rank=1, world_size=2), ).load_state_dict(s)
    with pytest.raises(LoaderResumeError, match="version"):
        L.load_state_dict({**s, "version": 99})
    with pytest.raises(LoaderResumeError, match="batches"):
        L.load_state_dict({**s, "batches": 40})
    assert isinstance(LoaderResumeError("x"), ValueError)
    L.load_state_dict(s)  # its own state: fine


CHILD = r"""
import sys, numpy as np, torch
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning, augment
path, kind, mode, out = sys.argv[1:5]
ws = int(sys.argv[5]); rank = int(sys.argv[6])
aug = augment.Pipeline([augment.RandomResizedCrop(12), augment.HorizontalFlip()], seed=7)
L = Loader(path, 16, OrderSpec(kind, seed=3, rank=rank, world_size=ws), fields=("image", "idx"), transform=aug)
ids, imgs = [], []
if mode == "first":
    for k, b in enumerate(L):
        ids.append(b["idx"].clone()); imgs.append(b["image"].clone())
        if k == 4:
            torch.save(L.state_dict(), out + ".state")
            break
else:
    L.load_state_dict(torch.load(out + ".state"))
    for _ in range(2):  # the rest of the epoch, then the next one
        for b in L:
            ids.append(b["idx"].clone()); imgs.append(b["image"].clone())
torch.save({"ids": ids, "imgs": imgs}, out)
"""


@pytest.mark.parametrize("kind,ws,rank", [("block", 1, 0), ("permutation", 2, 1)])
def test_resume_in_a_new_process(stores, tmp_path, kind, ws, rank):
    """Two processes: the first runs 5 batches and saves the state, the second
    loads it and finishes; indices and augmented pixels equal an uninterrupted
    run of this epoch and the next."""
    path = stores["big"]
    out = str(tmp_path / "out.pt")
    env = {**os.environ, "PYTHONPATH": ROOT}
    for mode in ("first", "rest"):
        subprocess.run([sys.executable, "-c", CHILD, path, kind, mode, out + mode, str(ws), str(rank)],
                       check=True, env=env, timeout=120)
        if mode == "first":
            os.replace(out + "first.state", out + "rest.state")
    a, b = torch.load(out + "first"), torch.load(out + "rest")
    ref = Loader(path, 16, OrderSpec(kind, seed=3, rank=rank, world_size=ws), fields=("image", "idx"), transform=_aug())
    r_ids, r_img = _run(ref)
    r2_ids, r2_img = _run(ref)
    ids, img = a["ids"] + b["ids"], a["imgs"] + b["imgs"]
    assert len(ids) == len(r_ids) + len(r2_ids)
    assert all(torch.equal(x, y) for x, y in zip(ids, r_ids + r2_ids))
    assert all(torch.equal(x, y) for x, y in zip(img, r_img + r2_img))
    assert np.array_equal(torch.cat(r_ids).numpy(), ref.order.epoch(0))
    assert ref.order == Loader(path, 16, OrderSpec(kind, seed=3, rank=rank, world_size=ws), ).order
    assert isinstance(ref.order, Permutation) == (kind == "permutation")


@pytest.mark.parametrize("mode", ["page cache windows", "O_DIRECT windows", "sequential windows"])
def test_resume_with_the_window_pass(stores, monkeypatch, mode):
    """A resumed epoch whose store is read ahead in windows (the pass starts
    at the window of the first batch left): the remaining records exact."""
    from mmstore import open as open_store
    from mmstore.engine import reads as _reads
    from mmstore.order import BlockShuffle
    from mmstore.torch import loader as loader_mod

    path = stores["big"]
    ref = open_store(path)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)  # not cached: the window pass runs
    order = "sequential" if mode.startswith("sequential") else BlockShuffle(len(ref), 5, 4, seed=2)
    kw: dict = {}
    if mode.startswith("O_DIRECT"):
        monkeypatch.setattr(loader_mod, "DIRECT_MIN_CACHE", 0)
        rec = sum(ref.schema[f].nbytes for f in ref.fields)
        kw = {"mem_bytes": 128 * rec}  # room for the two windows of 20 records the read-ahead holds
    mk = lambda: Loader(path, 7, order, tuning=LoaderTuning(threads=3, **kw))
    L = mk()
    assert L.describe()["readahead"] == "windows"
    assert L.describe()["window_direct"] == mode.startswith("O_DIRECT")
    for k in (3, 20):
        it = iter(L)
        head = [next(it)["idx"].clone() for _ in range(k)]
        state = L.state_dict()
        del it
        M = mk()
        M.load_state_dict(state)
        got = [{f: v.clone() for f, v in b.items()} for b in M]
        ids = torch.cat(head + [g["idx"] for g in got]).numpy()
        assert np.array_equal(ids, L.order.epoch(state["epoch"]))
        for g in got:
            want = ref.read_batch(g["idx"].numpy())
            assert np.array_equal(g["image"].numpy(), want["image"])
        M.close()
        L.close()


def test_peek_after_load_keeps_the_resume(stores):
    """``next(iter(loader))`` after ``load_state_dict`` (a shape check before
    the training loop) is a peek like any other: the loop after it still
    yields every remaining batch of the resumed epoch, then the next epoch;
    a loop that took two batches used the epoch (the next loop moves on)."""
    path = stores["big"]
    ref = _loader(path)
    e0, e1 = _run(ref)[0], _run(ref)[0]
    L = _loader(path)
    it = iter(L)
    _run(it, 5)
    state = L.state_dict()
    del it
    assert (state["epoch"], state["batches"]) == (0, 5)
    R = _loader(path)
    R.load_state_dict(state)
    peek = next(iter(R))
    assert torch.equal(peek["idx"], e0[5])
    assert (R.state_dict()["epoch"], R.state_dict()["batches"]) == (0, 5)
    rest = _run(R)[0]
    assert len(rest) == len(e0) - 5 and all(torch.equal(a, b) for a, b in zip(rest, e0[5:]))
    nxt = _run(R)[0]
    assert len(nxt) == len(e1) and all(torch.equal(a, b) for a, b in zip(nxt, e1))
    R = _loader(path)
    R.load_state_dict(state)
    _run(R, 2)  # two batches of the resumed epoch: used (the state is the position reached)
    assert (R.state_dict()["epoch"], R.state_dict()["batches"]) == (0, 7)
    nxt = _run(R)[0]
    assert all(torch.equal(a, b) for a, b in zip(nxt, e1)) and len(nxt) == len(e1)
