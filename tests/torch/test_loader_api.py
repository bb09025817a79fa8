"""The Loader's arguments: sixteen of them, the order's parameters in an
``OrderSpec``, the tuning in a ``LoaderTuning``. The 0.2 keywords (kept with
a ``DeprecationWarning`` through 0.3) are gone: each is Python's own
``TypeError`` naming it."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

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
    assert not [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert len(params) <= 17, list(params)
    for gone in ("seed", "rank", "world_size", "rank_drop_last", "rank_pad", "threads", "prefetch"):
        assert gone not in params


# each keyword of 0.2 with its 0.4 spelling (in the CHANGELOG's 0.4.0 entry)
OLD_KEYWORDS = {
    "seed": ({"seed": 5}, dict(order=OrderSpec("permutation", seed=5))),
    "rank": ({"rank": 1, "world_size": 3}, dict(order=OrderSpec("permutation", rank=1, world_size=3))),
    "rank_drop_last": ({"rank_drop_last": True}, dict(order=OrderSpec("permutation", drop_last=True))),
    "rank_pad": ({"rank_pad": True}, dict(order=OrderSpec("permutation", pad=True))),
    "block": ({"block": 4, "window": 2}, dict(order=OrderSpec("block", block=4, window=2))),
    "threads": ({"threads": 2}, dict(tuning=LoaderTuning(threads=2))),
    "prefetch": ({"prefetch": 1}, dict(tuning=LoaderTuning(prefetch=1))),
    "hold": ({"hold": 2}, dict(tuning=LoaderTuning(hold=2))),
}


@pytest.mark.parametrize("old", sorted(OLD_KEYWORDS))
def test_a_keyword_of_0_2_is_a_type_error_naming_it_and_its_new_spelling_works(store, old):
    kw, new = OLD_KEYWORDS[old]
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
        Loader(store, 4, **kw)
    with Loader(store, 4, **new) as L:
        assert len(_epoch(L)) > 0


def test_an_order_spec_carries_the_seed_rank_split_and_padding(store):
    a = Loader(store, 4, OrderSpec("permutation", seed=5, rank=1, world_size=3, pad=True))
    b = Loader(store, 4, OrderSpec("permutation", seed=6, rank=1, world_size=3, pad=True))
    assert (a.order.seed, a.order.rank, a.order.world_size, a.order.pad) == (5, 1, 3, True)
    assert len(_epoch(a)) == -(-N // 3) and not np.array_equal(_epoch(a), _epoch(b))
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


def test_an_order_object_is_built_for_its_rank_and_kept_by_a_pickled_copy(store):
    order = dataclasses.replace(Permutation(N, seed=4), rank=1, world_size=2)
    with Loader(store, 4, order) as L:
        assert (L.order.rank, L.order.world_size, L.order.seed) == (1, 2, 4)
        copy = pickle.loads(pickle.dumps(L))  # no warning either (the suite turns warnings into errors)
    assert copy.order == L.order and np.array_equal(_epoch(copy), _epoch(L))
    copy.close()


def test_bad_arguments_are_refused_with_what_was_expected(store):
    with pytest.raises(TypeError, match="unexpected keyword argument 'sed'"):
        Loader(store, 4, sed=3)
    with pytest.raises(TypeError, match="OrderSpec"):
        Loader(store, 4, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        OrderSpec("shuffle")
    with pytest.raises(ValueError, match="block shuffle"):
        OrderSpec("permutation", window=3)
    with pytest.raises((ValueError, TypeError), match="seed"):
        OrderSpec("block", seed=-1)
