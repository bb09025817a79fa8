"""Where the Loader meets a training script: ranks, epoch ends, checkpoints.

Each test here is a result a user would not notice going wrong: records read
twice or never across ranks, a resume that skips or re-runs batches, a
Loader argument silently changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmstore
from mmstore.errors import LoaderResumeError, RecordIndexError
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning


def _ids(loader_or_iter, k=None):
    """The idx of the batches of an epoch (of its first ``k``: no batch past them is taken)."""
    if k is None:
        return [b["idx"].clone() for b in loader_or_iter]
    it = iter(loader_or_iter)
    return [next(it)["idx"].clone() for _ in range(k)]


def _cat(batches):
    return torch.cat(batches).numpy() if batches else np.zeros(0, np.int64)


# -- the block shuffle's order does not depend on the memory a rank measures ------------

def test_block_order_is_the_same_on_ranks_with_different_memory(stores):
    """Two ranks whose memory budgets differ (one has loaded its model) build
    one global order: their slices cover every record exactly once."""
    path = stores["big"]
    seen = []
    for rank, budget in ((0, 2 << 20), (1, 4 << 20)):
        L = Loader(
            path,
            8,
            OrderSpec("block", block=6, rank=rank, world_size=2, seed=5),
            fields=("image", "idx"),
            tuning=LoaderTuning(mem_bytes=budget),
        )
        seen.append(_cat(_ids(L)))
        L.close()
    both = np.concatenate(seen)
    assert np.array_equal(np.sort(both), np.arange(301)), "records read twice or never across the ranks"


def test_block_resume_in_a_process_with_other_memory(stores):
    """A block-order state resumes in a process that measures other memory
    (a restarted job): the rest of the epoch, not a LoaderResumeError."""
    path = stores["big"]
    A = Loader(
        path, 8, OrderSpec("block", block=6, seed=2), fields=("image", "idx"), tuning=LoaderTuning(mem_bytes=2 << 20)
    )
    full = A.order.epoch(0)
    it = iter(A)
    head = _ids(it, 7)
    state = A.state_dict()
    del it
    B = Loader(
        path, 8, OrderSpec("block", block=6, seed=2), fields=("image", "idx"), tuning=LoaderTuning(mem_bytes=4 << 20)
    )
    B.load_state_dict(state)
    assert np.array_equal(np.concatenate([_cat(head), _cat(_ids(B))]), full)


def test_memory_too_small_for_the_windows_says_so(stores):
    """Memory that cannot hold two windows of the shared order is said, with
    a window that fits; the order is not changed behind the user's back."""
    path = stores["big"]
    with pytest.warns(UserWarning, match=r"read-ahead holds two.*Pass (block=\d+, )?window=\d+"):
        L = Loader(
            path, 8, OrderSpec("block", block=6), fields=("image", "idx"), tuning=LoaderTuning(mem_bytes=500_000)
        )
    big = Loader(path, 8, OrderSpec("block", block=6), fields=("image", "idx"), tuning=LoaderTuning(mem_bytes=64 << 20))
    assert L.order == big.order


# -- state_dict() is the position reached ----------------------------------------------

@pytest.mark.parametrize("leave", ["break", "exception"])
def test_state_after_leaving_the_loop_is_the_position_reached(stores, leave):
    """A state taken after a ``break`` (or a caught exception) resumes the
    rest of the epoch: no batch skipped, none repeated."""
    path = stores["big"]
    L = Loader(path, 16, fields=("idx",), order=OrderSpec("permutation", seed=1))
    full = L.order.epoch(0)
    got = []
    try:
        for b in L:
            got.append(b["idx"].clone())
            if len(got) == 6:
                if leave == "break":
                    break
                raise KeyboardInterrupt  # e.g. a signal handler or a NaN check
    except KeyboardInterrupt:
        pass
    state = L.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 6)
    M = Loader(path, 16, fields=("idx",), order=OrderSpec("permutation", seed=1))
    M.load_state_dict(state)
    assert np.array_equal(np.concatenate([_cat(got), _cat(_ids(M))]), full)


@pytest.mark.parametrize("script", ["state epoch", "own epoch", "own epoch + 1", "no set_epoch"])
def test_checkpoint_at_the_last_batch_runs_each_epoch_once(stores, script):
    """A job checkpointing every batch is killed right after the last batch of
    epoch 1; the restarted job's natural loop (start at the checkpoint's
    epoch, ``set_epoch`` each epoch) delivers epochs 2.. only: no epoch twice."""
    path, E = stores["big"], 4
    mk = lambda: Loader(path, 16, fields=("idx",), order=OrderSpec("permutation", seed=4))  # noqa: E731
    ref = mk()
    want = [ref.order.epoch(e) for e in range(E)]
    L, ckpt, got = mk(), None, []
    for epoch in range(2):
        L.set_epoch(epoch)
        for b in L:
            got.append(b["idx"].clone())
            ckpt = {"epoch": epoch, "loader": L.state_dict()}  # the user's own epoch, and the loader's
    assert ckpt["loader"]["epoch"] == 1 and ckpt["loader"]["batches"] == len(L)
    M = mk()
    M.load_state_dict(ckpt["loader"])
    start = {"state epoch": ckpt["loader"]["epoch"], "own epoch": ckpt["epoch"],
             "own epoch + 1": ckpt["epoch"] + 1, "no set_epoch": ckpt["epoch"] + 1}[script]
    for epoch in range(start, E):
        if script != "no set_epoch":
            M.set_epoch(epoch)
        got += _ids(M)
    assert np.array_equal(_cat(got), np.concatenate(want))


def test_state_before_and_after_a_complete_epoch(stores):
    path = stores["big"]
    L = Loader(path, 16, fields=("idx",))
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (0, 0)
    _ids(L)
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (0, len(L))
    L.set_epoch(1)  # the loop moved on: the state says where the next iteration starts
    assert (L.state_dict()["epoch"], L.state_dict()["batches"]) == (1, 0)


# -- every record once over ranks, the same number of steps ------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["permutation", "block", "sequential"])
def test_ranks_read_every_record_exactly_once_by_default(stores, world, kind):
    """N = 203 over 2-4 ranks: every record once per epoch, and every rank the
    same number of batches (only the last batch's size differs)."""
    path = stores["small"]
    counts, seen = set(), []
    for rank in range(world):
        L = Loader(path, 16, OrderSpec(kind, rank=rank, world_size=world, seed=7), fields=("idx",), )
        batches = _ids(L)
        counts.add(len(batches))
        assert all(len(b) == 16 for b in batches[:-1])
        seen.append(_cat(batches))
        L.close()
    assert len(counts) == 1, f"ranks take different numbers of steps: {counts}"
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(203))


def test_rank_pad_pads_like_distributed_sampler(stores):
    path = stores["small"]
    seen = [
        _cat(_ids(Loader(path, 16, fields=("idx",), order=OrderSpec("permutation", rank=r, world_size=2, pad=True))))
        for r in (0, 1)
    ]
    assert len(seen[0]) == len(seen[1]) == 102
    assert set(np.concatenate(seen).tolist()) == set(range(203)) and len(np.concatenate(seen)) == 204


def test_equal_steps_need_a_repeat_only_when_no_split_gives_them(stores):
    """199 records, 3 ranks, batches of 11: rank 0 would get 67 records (7
    batches) and ranks 1-2 66 (6 batches): the shorter ranks each take one
    record twice, and the Loader says so."""
    path = stores["small"]
    idx = np.arange(199)
    with pytest.warns(UserWarning, match=r"2 record\(s\) are read twice"):
        loaders = [
            Loader(path, 11, fields=("idx",), indices=idx, order=OrderSpec("permutation", rank=r, world_size=3))
            for r in range(3)
        ]
    counts = [len(_ids(L)) for L in loaders]
    assert counts == [7, 7, 7]


# -- arguments that used to be changed silently -------------------------------------------

@pytest.mark.parametrize("bad", [8.5, True, "8", 8.0, None])
def test_batch_size_must_be_an_integer(stores, bad):
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        Loader(stores["small"], bad)


def test_numpy_integer_batch_size_is_fine(stores):
    assert Loader(stores["small"], np.int64(8)).batch_size == 8


def test_two_dimensional_indices_are_refused(stores):
    with pytest.raises(RecordIndexError, match=r"1-D .* shape \(2, 3\)"):
        Loader(stores["small"], 4, indices=np.arange(6).reshape(2, 3))


def test_resume_refuses_a_state_of_another_rank_split(stores):
    path = stores["small"]
    s = Loader(path, 16, order=OrderSpec("permutation", rank=0, world_size=2, pad=True)).state_dict()
    with pytest.raises(LoaderResumeError, match="order"):
        Loader(path, 16, order=OrderSpec("permutation", rank=0, world_size=2)).load_state_dict(s)


# -- pad_value against the fields it pads ---------------------------------------------------

@pytest.fixture(scope="module")
def coco_like(tmp_path_factory):
    """Boxes (float32) beside iscrowd (uint8), as every COCO store has them."""
    path = str(tmp_path_factory.mktemp("cocolike") / "s")
    schema = {"idx": ("<i8", ()), "boxes": ("<f4", (None, 4)), "iscrowd": ("|u1", (None,))}
    with mmstore.StoreWriter(path, schema) as w:
        for i in range(20):
            k = i % 3
            w.append({"idx": np.int64(i), "boxes": np.full((k, 4), i, np.float32),
                      "iscrowd": np.full(k, i % 2, np.uint8)})
    return path


def test_pad_value_a_field_cannot_hold_is_refused_at_construction_naming_it(coco_like):
    with pytest.raises(ValueError, match=r"pad_value=-1 .* field 'iscrowd' of dtype uint8.* 0 \.\. 255"):
        Loader(coco_like, 4, ragged="pad", pad_value=-1)


def test_pad_value_per_field(coco_like):
    L = Loader(coco_like, 4, "sequential", ragged="pad", pad_value={"boxes": -1, "iscrowd": 255})
    for b in L:
        for j, i in enumerate(b["idx"].tolist()):
            k = i % 3
            boxes, crowd = b["boxes"], b["iscrowd"]
            assert int(boxes.lengths[j]) == k and int(crowd.lengths[j]) == k
            assert (boxes.values[j, :k] == i).all() and (boxes.values[j, k:] == -1).all()
            assert (crowd.values[j, :k] == i % 2).all() and (crowd.values[j, k:] == 255).all()
    with pytest.raises(ValueError, match=r"names \['label'\], which are not ragged fields"):
        Loader(coco_like, 4, ragged="pad", pad_value={"label": 0})
