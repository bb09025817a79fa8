"""The Loader's arguments: sixteen of them, the order's parameters in an
``OrderSpec``, the tuning in a ``LoaderTuning``; the spellings of 0.2 still
work, each with a ``DeprecationWarning`` that names the new one, and give
the same loader."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from support.stores import write_indexed

from mmstore.order import BlockShuffle, OrderSpec, Permutation
from mmstore.torch import Loader, LoaderTuning

N = 53


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_indexed(str(tmp_path_factory.mktemp("api") / "s"), N)


def _epoch(loader, epoch=0):
    loader.set_epoch(epoch)
    return np.concatenate([b["idx"].numpy() for b in loader])


def test_the_signature_is_small_and_names_every_argument():
    params = inspect.signature(Loader).parameters
    named = [p for p in params.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 16, [p.name for p in named]
    for gone in ("seed", "rank", "world_size", "rank_drop_last", "rank_pad", "threads", "prefetch"):
        assert gone not in params


@pytest.mark.parametrize("kind", ["permutation", "block", "sequential"])
def test_an_order_spec_reads_what_the_old_keywords_read(store, kind):
    old = dict(seed=5, rank=1, world_size=3, rank_pad=True)
    with pytest.warns(DeprecationWarning, match=r"pass order=OrderSpec\("):
        a = Loader(store, 4, kind, **old)
    b = Loader(store, 4, OrderSpec(kind, seed=5, rank=1, world_size=3, pad=True))
    assert a.order == b.order
    for e in range(2):
        assert np.array_equal(_epoch(a, e), _epoch(b, e))
    a.close()
    b.close()


def test_the_ranks_of_an_order_spec_read_every_record_once(store):
    seen = []
    for r in range(3):
        with Loader(store, 4, OrderSpec("block", seed=2, rank=r, world_size=3, block=4, window=2)) as L:
            assert isinstance(L.order, BlockShuffle) and (L.order.block, L.order.window) == (4, 2)
            seen.append(_epoch(L, 1))
    assert sorted(np.concatenate(seen).tolist()) == list(range(N))
    assert len({len(s) for s in seen}) <= 2  # 18, 18, 17: exactly once, not padded


def test_old_tuning_keywords_warn_and_give_the_same_tuning(store):
    with pytest.warns(DeprecationWarning, match=r"pass tuning=LoaderTuning\(threads=2, prefetch=1\)"):
        a = Loader(store, 8, threads=2, prefetch=1)
    b = Loader(store, 8, tuning=LoaderTuning(threads=2, prefetch=1))
    assert a.tuning == b.tuning and a.ring_size == b.ring_size
    a.close()
    b.close()


def test_an_order_object_takes_only_a_rank_from_the_old_keywords(store):
    order = Permutation(N, seed=4)
    with pytest.warns(DeprecationWarning, match="build the order for its rank"):
        L = Loader(store, 4, order, rank=1, world_size=2)
    assert (L.order.rank, L.order.world_size, L.order.seed) == (1, 2, 4)
    L.close()
    with pytest.raises(TypeError, match="cannot change an Order object"):
        Loader(store, 4, order, seed=3)


def test_bad_arguments_are_refused_with_what_was_expected(store):
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        Loader(store, 4, sed=3)
    with pytest.raises(TypeError, match="OrderSpec"):
        Loader(store, 4, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        OrderSpec("shuffle")
    with pytest.raises(ValueError, match="block shuffle"):
        OrderSpec("permutation", window=3)
    with pytest.raises((ValueError, TypeError), match="seed"):
        OrderSpec("block", seed=-1)
