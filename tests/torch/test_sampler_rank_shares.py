"""What the DDP guide says of ``OrderSampler`` on two ranks holds: 203 records
over 2 ranks, the ranks' index sets compared for each order and option."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from mmstore.order import OrderSpec  # noqa: E402
from mmstore.torch import Loader, OrderSampler  # noqa: E402

N, WORLD = 203, 2
KINDS = {"permutation": {}, "sequential": {}, "block": {"block": 8, "window": 2}}


def _shares(kind: str, **kw) -> list[list[int]]:
    return [[int(i) for i in OrderSampler(N, kind, seed=3, rank=r, world_size=WORLD, **KINDS[kind], **kw)]
            for r in range(WORLD)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_by_default_it_pads_as_distributed_sampler_one_record_on_both_ranks(kind):
    a, b = _shares(kind)
    assert len(a) == len(b) == -(-N // WORLD)  # ceil(203 / 2) = 102 each
    assert len(set(a) & set(b)) == 1  # the one record of the wrap-around, read on both ranks
    assert set(a) | set(b) == set(range(N))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pad_false_with_the_batch_size_reads_each_record_once(kind):
    a, b = _shares(kind, pad=False, batch_size=4)
    assert not set(a) & set(b) and len(a) + len(b) == N and set(a) | set(b) == set(range(N))
    assert -(-len(a) // 4) == -(-len(b) // 4)  # the same number of batches of 4 on each rank


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_drop_last_gives_disjoint_equal_shares_without_the_tail(kind):
    a, b = _shares(kind, drop_last=True)
    assert len(a) == len(b) == N // WORLD and not set(a) & set(b)


def test_pad_false_without_a_batch_size_says_what_to_pass():
    with pytest.raises(TypeError, match=r"pad=False\) needs batch_size="):
        OrderSampler(N, "permutation", rank=0, world_size=WORLD, pad=False)
    with pytest.raises(TypeError, match="pad must be True or False"):
        OrderSampler(N, "permutation", pad="no")


def test_the_loader_reads_each_record_once_over_the_ranks(tmp_path):
    import numpy as np

    import mmstore

    src = tmp_path / "a.npy"
    np.save(src, np.arange(N, dtype=np.int32).reshape(N, 1))
    mmstore.ingest(str(src), str(tmp_path / "s.store"), quiet=True, workers=0)
    seen = []
    for rank in range(WORLD):
        loader = Loader(str(tmp_path / "s.store"), 8, OrderSpec("permutation", seed=3, rank=rank, world_size=WORLD))
        field = loader.fields[0]
        seen.append([int(v) for batch in loader for v in batch[field].reshape(-1)])
        loader.close()
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(N))
