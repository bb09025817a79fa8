"""OrderSampler / OrderBatchSampler: the epoch rules and mid-epoch resume
(state_dict / load_state_dict, torchdata's StatefulDataLoader convention)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import mmstore
from mmstore.errors import StateMismatchError
from mmstore.torch import OrderBatchSampler, OrderSampler, StoreDataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_epochs_advance_by_themselves_and_set_epoch_wins():
    s = OrderSampler(200, seed=3)
    e0 = list(s)
    e1 = list(s)  # iterated to the end: the next iteration is epoch 1
    assert e0 != e1
    assert e0 == OrderSampler(200, seed=3).order.epoch(0).tolist()
    assert e1 == s.order.epoch(1).tolist()
    assert s.epoch == 2
    s.set_epoch(0)  # set_epoch always wins
    assert list(s) == e0
    assert s.epoch == 1  # ... and the counter moves on from it
    # DistributedSampler habit: set_epoch before every epoch
    for e in range(3):
        s.set_epoch(e)
        assert list(s) == s.order.epoch(e).tolist()
    # an epoch left early, past its first batch, is used: the next iteration moves on
    s.set_epoch(5)
    it = iter(s)
    [next(it) for _ in range(10)]
    del it
    assert list(s) == s.order.epoch(6).tolist()
    # a peek (one index) does not use the epoch up
    it = iter(s)
    next(it)
    del it
    assert list(s) == s.order.epoch(7).tolist()
    assert list(s) == s.order.epoch(8).tolist()
    # a set_epoch made while an epoch runs is kept when that epoch ends
    it = iter(s)
    next(it), next(it)
    s.set_epoch(2)
    list(it)
    assert list(s) == s.order.epoch(2).tolist()


def test_batch_sampler_peek_and_break_follow_the_loader_rule():
    s = OrderSampler(40, seed=4)
    bs = OrderBatchSampler(s, 8)
    it = iter(bs)
    next(it)  # a peek: one batch
    del it
    assert [i for b in bs for i in b] == s.order.epoch(0).tolist()
    it = iter(bs)
    next(it), next(it)  # past the first batch, then break
    del it
    assert [i for b in bs for i in b] == s.order.epoch(2).tolist()
    # after a resume, a peek keeps the resume (the Loader's rule): the next loop yields the
    # rest of the resumed epoch; two batches handed out use it
    bs.load_state_dict({**bs.state_dict(), "epoch": 3, "yielded": 8})
    it = iter(bs)
    assert next(it) == s.order.epoch(3).tolist()[8:16]
    del it
    assert [i for b in bs for i in b] == s.order.epoch(3).tolist()[8:]
    assert [i for b in bs for i in b] == s.order.epoch(4).tolist()
    bs.load_state_dict({**bs.state_dict(), "epoch": 3, "yielded": 8})
    it = iter(bs)
    next(it), next(it)
    del it
    assert [i for b in bs for i in b] == s.order.epoch(4).tolist()
    s.load_state_dict({**s.state_dict(), "epoch": 3, "yielded": 5})
    it = iter(s)
    assert next(it) == s.order.epoch(3).tolist()[5]
    del it
    assert list(s) == s.order.epoch(3).tolist()[5:]


def test_batch_sampler_shares_the_epoch_counter():
    s = OrderSampler(37, seed=9)
    bs = OrderBatchSampler(s, 8)
    a = [i for b in bs for i in b]
    b = [i for bb in bs for i in bb]
    assert a == s.order.epoch(0).tolist() and b == s.order.epoch(1).tolist()
    assert s.epoch == 2


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    world=st.integers(1, 3),
    bs=st.integers(1, 9),
    drop_last=st.booleans(),
    kind=st.sampled_from(["permutation", "block", "sequential"]),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_resume_yields_exactly_the_rest(n, world, bs, drop_last, kind, epoch, data):
    kw = {"block": 4, "window": 2} if kind == "block" else {}
    rank = data.draw(st.integers(0, world - 1))

    def make():
        return OrderSampler(n, kind, seed=7, rank=rank, world_size=world, drop_last=drop_last, **kw)

    # per index
    s = make()
    s.set_epoch(epoch)
    full = list(s)
    k = data.draw(st.integers(0, len(full)))
    s.set_epoch(epoch)
    it = iter(s)
    head = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(s.state_dict()))  # JSON-able
    r = make()
    r.load_state_dict(state)
    assert head + list(r) == full
    assert list(r) == r.order.epoch(epoch + 1).tolist()  # then the next epoch
    # per batch
    b = OrderBatchSampler(make(), bs, drop_last=drop_last)
    b.set_epoch(epoch)
    batches = list(b)
    kb = data.draw(st.integers(0, len(batches)))
    b.set_epoch(epoch)
    it = iter(b)
    head = [next(it) for _ in range(kb)]
    rb = OrderBatchSampler(make(), bs, drop_last=drop_last)
    rb.load_state_dict(b.state_dict())
    assert head + list(rb) == batches
    # consumed= (a plain DataLoader with workers reads ahead) gives the same state
    b2 = OrderBatchSampler(make(), bs, drop_last=drop_last)
    b2.set_epoch(epoch)
    list(iter(b2))  # read to the end, as a prefetching DataLoader may have
    b2.set_epoch(epoch)
    it2 = iter(b2)
    [next(it2) for _ in range(len(batches))]
    st2 = b2.state_dict(consumed=kb)
    rb2 = OrderBatchSampler(make(), bs, drop_last=drop_last)
    rb2.load_state_dict(st2)
    assert list(rb2) == batches[kb:]


def test_state_between_epochs_points_at_the_next_one():
    s = OrderSampler(30, seed=1)
    list(s)
    st_ = s.state_dict()
    assert (st_["epoch"], st_["yielded"]) == (1, 0)
    r = OrderSampler(30, seed=1)
    r.load_state_dict(st_)
    assert list(r) == r.order.epoch(1).tolist()
    # set_epoch of the saved epoch keeps the position; another epoch wins over it
    s.set_epoch(4)
    it = iter(s)
    [next(it) for _ in range(11)]
    sd = s.state_dict()
    r = OrderSampler(30, seed=1)
    r.load_state_dict(sd)
    r.set_epoch(4)
    assert list(r) == r.order.epoch(4).tolist()[11:]
    r.load_state_dict(sd)
    warned = r"set_epoch\(2\) drops the resume .*epoch 4, 11 indices.*set_epoch\(4\)"
    with pytest.warns(UserWarning, match=warned):
        r.set_epoch(2)
    assert list(r) == r.order.epoch(2).tolist()
    # a state taken at the very end of an epoch (the last index handed out, the iterator not yet
    # exhausted) has nothing left to resume: set_epoch of the next epoch drops nothing, no warning
    makers = (lambda: OrderSampler(30, seed=1),
              lambda: OrderBatchSampler(OrderSampler(30, seed=1), 8, drop_last=True))
    for make in makers:
        src = make()
        it = iter(src)
        [next(it) for _ in range(len(src))]
        end = src.state_dict()
        assert end["epoch"] == 0 and end["yielded"] == (30 if len(src) == 30 else 24)
        del it
        r = make()
        r.load_state_dict(end)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r.set_epoch(end["epoch"] + 1)


@pytest.mark.parametrize(
    "other,key",
    [
        (lambda: OrderSampler(31, seed=1), "n"),
        (lambda: OrderSampler(30, seed=2), "seed"),
        (lambda: OrderSampler(30, "sequential"), "kind"),
        (lambda: OrderSampler(30, seed=1, rank=1, world_size=2), "rank"),
    ],
)
def test_state_from_another_sampler_is_refused(other, key):
    s = OrderSampler(30, seed=1)
    it = iter(s)
    next(it)
    r = other()
    with pytest.raises(StateMismatchError, match=key):
        r.load_state_dict(s.state_dict())
    assert list(r) == r.order.epoch(0).tolist()  # nothing changed
    b = OrderBatchSampler(OrderSampler(30, seed=1), 4)
    with pytest.raises(StateMismatchError, match="batch_size"):
        OrderBatchSampler(OrderSampler(30, seed=1), 5).load_state_dict(b.state_dict())
    with pytest.raises(StateMismatchError, match="state_dict"):
        s.load_state_dict({"epoch": 0})


_CHILD = r"""
import json, sys
import mmstore
from torch.utils.data import DataLoader
from mmstore.torch import OrderBatchSampler, OrderSampler, StoreDataset
path, kind, state = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ds = StoreDataset(mmstore.open(path), fields=("idx",))
kw = {"block": 8, "window": 3} if kind == "block" else {}
bs = OrderBatchSampler(OrderSampler(ds, kind, seed=11, **kw), 16, drop_last=False)
bs.load_state_dict(state)
print(json.dumps([b["idx"].tolist() for b in DataLoader(ds, batch_sampler=bs, num_workers=0)]))
"""


@pytest.mark.parametrize("kind", ["permutation", "block"])
def test_plain_dataloader_resumes_in_a_new_process(stores, kind):
    path = stores["big"]
    ds = StoreDataset(mmstore.open(path), fields=("idx",))
    kw = {"block": 8, "window": 3} if kind == "block" else {}
    bs = OrderBatchSampler(OrderSampler(ds, kind, seed=11, **kw), 16, drop_last=False)
    bs.set_epoch(2)
    full = [b["idx"].tolist() for b in DataLoader(ds, batch_sampler=bs, num_workers=0)]
    bs.set_epoch(2)
    got = []
    for k, b in enumerate(DataLoader(ds, batch_sampler=bs, num_workers=0)):
        got.append(b["idx"].tolist())
        if k == 6:
            state = bs.state_dict()
            break
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _CHILD, path, kind, json.dumps(state)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    rest = json.loads(out.stdout)
    assert got + rest == full
    assert sorted(i for b in full for i in b) == list(range(len(ds)))


def test_stateful_dataloader_with_workers(stores):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = StoreDataset(mmstore.open(stores["big"]), fields=("idx",))

    def make():
        bs = OrderBatchSampler(OrderSampler(ds, seed=5), 8)
        return sdl.StatefulDataLoader(ds, batch_sampler=bs, num_workers=2, multiprocessing_context="fork")

    dl = make()
    full = [b["idx"].tolist() for b in dl]
    dl = make()
    got, state = [], None
    for k, b in enumerate(dl):
        got.append(b["idx"].tolist())
        if k == 9:
            state = dl.state_dict()
            break
    state = json.loads(json.dumps(state))
    r = make()
    r.load_state_dict(state)
    rest = [b["idx"].tolist() for b in r]
    assert got + rest == full
    nxt = [b["idx"].tolist() for b in r]  # then the next epoch
    assert [i for b in nxt for i in b] == OrderSampler(ds, seed=5).order.epoch(1).tolist()
    assert np.array_equal(np.sort(np.concatenate(nxt)), np.arange(len(ds)))


class _Idx:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("per_batch", [True, False])
def test_consumed_counts_in_the_epoch_workers_read_to_its_end(per_batch):
    # A DataLoader with workers reads the sampler to its end while the loop still
    # has batches to receive; state_dict(consumed=k) saved at every k must resume
    # exactly after batch k of that epoch (it pointed at the next epoch, skipping
    # the tail of this one and the head of the next).
    n, bs = 42, 4

    def make():
        s = OrderSampler(n, seed=9)
        return (OrderBatchSampler(s, bs), s) if per_batch else (s, s)

    src, s = make()
    list(src)  # epoch 0 to its end: the loop below runs epoch 1 without set_epoch
    kw = {"batch_sampler": src} if per_batch else {"sampler": src, "batch_size": bs}
    dl = DataLoader(_Idx(n), num_workers=2, prefetch_factor=4, multiprocessing_context="fork", **kw)
    got, states = [], []
    for k, b in enumerate(dl, 1):
        got.append(b.tolist())
        states.append(json.loads(json.dumps(src.state_dict(consumed=k if per_batch else k * bs))))
    e1 = s.order.epoch(1).tolist()
    assert [i for b in got for i in b] == e1
    assert (states[-1]["epoch"], states[-1]["yielded"]) == (2, 0)  # all received: the next epoch's start
    for k, state in enumerate(states, 1):
        r, rs = make()
        r.load_state_dict(state)
        rest = [i for x in r for i in (x if per_batch else [x])]
        if k < len(got):
            assert [i for b in got[:k] for i in b] + rest == e1
            rest = [i for x in r for i in (x if per_batch else [x])]
        assert rest == rs.order.epoch(2).tolist()  # then the next epoch


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 60),
    world=st.integers(1, 3),
    bs=st.integers(1, 9),
    drop_last=st.booleans(),
    kind=st.sampled_from(["permutation", "block", "sequential"]),
    data=st.data(),
)
def test_consumed_after_read_ahead_to_the_end(n, world, bs, drop_last, kind, data):
    # the workers read the whole epoch before the loop received it: consumed=k of that epoch
    # resumes after its k-th batch; k = all of it resumes at the next epoch's start
    kw = {"block": 4, "window": 2} if kind == "block" else {}
    rank = data.draw(st.integers(0, world - 1))

    def make():
        s = OrderSampler(n, kind, seed=7, rank=rank, world_size=world, drop_last=drop_last, **kw)
        return OrderBatchSampler(s, bs, drop_last=drop_last)

    b = make()
    epoch = data.draw(st.integers(0, 2))
    if data.draw(st.booleans()):
        b.set_epoch(epoch)
    else:
        for _ in range(epoch):
            list(b)
    batches = list(b)  # read to its end
    k = data.draw(st.integers(1, max(1, len(batches))))
    state = json.loads(json.dumps(b.state_dict(consumed=k)))
    r = make()
    r.load_state_dict(state)
    rest = list(r)
    if k < len(batches):
        assert batches[:k] + rest == batches
        rest = list(r)
    ref = make()
    ref.set_epoch(epoch + 1)
    assert rest == list(ref)  # then the next epoch


_EVERY_CHILD = r"""
import json, sys
from mmstore.torch import OrderBatchSampler, OrderSampler
out = []
for kind, st_ in json.loads(sys.stdin.read()):
    kw = {"block": 5, "window": 3} if kind == "block" else {}
    b = OrderBatchSampler(OrderSampler(53, kind, seed=2, rank=1, world_size=2, **kw), 4)
    b.load_state_dict(st_)
    out.append([list(b), list(b)])
print(json.dumps(out))
"""


def test_state_at_every_position_in_a_fresh_process():
    jobs, want = [], []
    for kind in ("permutation", "block", "sequential"):
        kw = {"block": 5, "window": 3} if kind == "block" else {}
        b = OrderBatchSampler(OrderSampler(53, kind, seed=2, rank=1, world_size=2, **kw), 4)
        b.set_epoch(3)
        full = list(b)
        nxt = list(b)
        b.set_epoch(3)
        states = [b.state_dict()]
        for _ in b:
            states.append(b.state_dict())
        states.append(b.state_dict())  # after the end
        for k, st_ in enumerate(states):
            jobs.append((kind, st_))
            k = min(k, len(full))
            want.append([full[k:], nxt] if k < len(full) or st_["epoch"] == 3 else [nxt, None])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _EVERY_CHILD], input=json.dumps(jobs), env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    for (kind, st_), g, w in zip(jobs, got, want):
        assert g[0] == w[0], (kind, st_)
        if w[1] is not None:
            assert g[1] == w[1], (kind, st_)
