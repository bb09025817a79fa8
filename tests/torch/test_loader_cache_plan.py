"""The Loader's read plan follows the page cache, epoch by epoch and within
an epoch (NOTE [warm vs cold reads] in ``mmstore/engine/reads.py``): built on
an evicted store it reads the first epoch as from disk (a piece per reader
thread, WILLNEED ahead) and, once the store is cached, as memory copies (one
piece per core, no hints), whatever the cache was when it was built.
``describe()["reads"]`` says which cut is in use; the batches stay exact
across a switch. (These loaders pass ``warm=False``: by default a loader
whose first epoch finds a store that fits out of the cache reads it
sequentially first, the last tests here.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.stores import indexed

from mmstore import _os
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning

N = 1200
BATCH = 16
SHAPE = (64, 64, 3)  # 3 pages a record: a record read brings no neighbour wholly into the cache
SCHEMA = {"image": ("|u1", SHAPE), "label": ("<i8", ()), "idx": ("<i8", ())}


@pytest.fixture
def store(tmp_path, build_store):
    return build_store(str(tmp_path / "s"), N, schema=SCHEMA)


def _image_file(loader: Loader) -> str:
    return os.path.join(loader.store.path, "image.npy")


def _evict(loader: Loader) -> None:
    loader.store.evict()
    res, size = _os.resident_bytes(_image_file(loader))
    if res > 0.05 * size:
        pytest.skip(f"the page cache keeps the store here ({res} of {size} bytes after eviction: tmpfs?)")


def _warm(loader: Loader) -> None:
    # the kernel may reclaim a page of it at once when other work (a parallel test) wants memory: warm
    # again a few times until every page is in, the state the tests that call this set out from
    for _ in range(5):
        _os.warm(loader.store.data_paths())
        res, size = _os.resident_bytes(_image_file(loader))
        if res == size:
            return
    assert res == size


def _check(batch) -> None:
    for j, i in enumerate(batch["idx"].tolist()):
        assert np.array_equal(batch["image"][j].numpy(), indexed(i, SHAPE)["image"]), i


def _epoch(loader: Loader, after=None) -> tuple[list[dict], list[int]]:
    """One epoch, every batch checked; the reads' state at each batch."""
    states, seen = [], []
    for k, b in enumerate(loader):
        states.append(dict(loader.describe()["reads"]))
        _check(b)
        seen += b["idx"].tolist()
        if after is not None and k == 1:
            after(loader)
    assert sorted(seen) == list(range(N))  # every record once, whatever the cut
    return states, seen


def test_the_cut_follows_the_cache_from_epoch_to_epoch(store):
    loader = Loader(store, BATCH, tuning=LoaderTuning(threads=8, warm=False), order=OrderSpec("permutation", seed=3))
    _evict(loader)  # built on a cached store (just written), evicted before the first epoch
    cold, _ = _epoch(loader)
    assert not cold[0]["cached"] and cold[0]["willneed"] > 0
    assert cold[0]["piece_rows"] <= -(-BATCH // 8)  # a piece per reader thread
    warm, _ = _epoch(loader)  # the first epoch left every record in the page cache
    assert warm[0]["cached"] and warm[0]["willneed"] == 0
    assert warm[0]["piece_rows"] >= -(-BATCH // max(2, os.cpu_count() or 2))  # one piece per core
    _evict(loader)
    again, _ = _epoch(loader)
    assert not again[0]["cached"] and again[0]["piece_rows"] == cold[0]["piece_rows"]
    loader.close()


def test_a_loader_built_on_an_evicted_store_reads_its_warm_epochs_as_cached(store):
    """The construction-time cache does not stay in the plan: built right
    after the eviction (as a training run starts), its later epochs read the
    cached store with the cut of a loader built on a warm store."""
    probe = Loader(store, BATCH, order=OrderSpec("permutation", seed=1))
    _evict(probe)
    probe.close()
    cold_built = Loader(store, BATCH, tuning=LoaderTuning(warm=False), order=OrderSpec("permutation", seed=1))
    first, _ = _epoch(cold_built)
    second, _ = _epoch(cold_built)
    warm_built = Loader(store, BATCH, order=OrderSpec("permutation", seed=1))
    ref, _ = _epoch(warm_built)
    assert not first[0]["cached"]
    for key in ("cached", "piece_rows", "willneed"):
        assert second[0][key] == ref[0][key], key
    cold_built.close()
    warm_built.close()


def test_an_epoch_switches_its_cut_when_the_store_is_warmed_while_it_runs(store):
    loader = Loader(store, BATCH, tuning=LoaderTuning(threads=8, warm=False), order=OrderSpec("permutation", seed=5))
    _evict(loader)
    states, _ = _epoch(loader, after=_warm)  # warmed by another reader after the second batch
    assert not states[0]["cached"]
    assert states[-1]["cached"] and states[-1]["willneed"] == 0 and states[-1]["switches"] == 1
    assert states[-1]["piece_rows"] > states[0]["piece_rows"]
    loader.close()


def test_an_epoch_switches_back_when_the_store_is_evicted_while_it_runs(store):
    loader = Loader(store, BATCH, tuning=LoaderTuning(threads=8, warm=False), order=OrderSpec("permutation", seed=7))
    _warm(loader)
    states, _ = _epoch(loader, after=_evict)
    assert states[0]["cached"]
    assert not states[-1]["cached"] and states[-1]["willneed"] > 0 and states[-1]["switches"] == 1
    loader.close()


# -- warm="auto" (the default): one sequential pass before a cold first epoch ------------------

def test_a_cold_store_that_fits_is_read_sequentially_before_the_first_batch(store):
    probe = Loader(store, BATCH, tuning=LoaderTuning(warm=False))
    _evict(probe)
    probe.close()
    loader = Loader(store, BATCH, order=OrderSpec("permutation", seed=2))
    it = iter(loader)
    first = next(it)
    assert loader.describe()["warm"] == "foreground"
    rep = loader.warm_report
    assert rep is not None and rep.complete and rep.bytes_read == rep.bytes_total > 0
    res, size = _os.resident_bytes(_image_file(loader))
    assert res == size  # every page, before the epoch read more than two batches
    assert loader.describe()["reads"]["cached"]  # so the epoch reads as memory copies
    _check(first)
    seen = first["idx"].tolist()
    for b in it:
        _check(b)
        seen += b["idx"].tolist()
    assert sorted(seen) == list(range(N))
    assert "warm: a sequential pass" in str(loader.describe())
    _epoch(loader)  # decided once: the second epoch does not warm again
    assert loader.describe()["warm"] == "foreground" and loader.warm_report is rep
    loader.close()


def test_no_warm_pass_when_the_store_is_cached_or_the_loader_reads_a_small_part(store):
    warm = Loader(store, BATCH)  # just written: in the page cache
    _epoch(warm)
    assert warm.describe()["warm"] == "none" and warm.warm_report is None
    warm.close()
    part = Loader(store, BATCH, indices=np.arange(0, N, 3), tuning=LoaderTuning(warm="auto"))  # a third of the records
    _evict(part)
    got = sorted(i for b in part for i in b["idx"].tolist())
    assert got == list(range(0, N, 3))
    assert part.describe()["warm"] == "none" and part.warm_report is None
    res, size = _os.resident_bytes(_image_file(part))
    assert res < size  # the other two thirds were not read
    part.close()
    off = Loader(store, BATCH, tuning=LoaderTuning(warm=False))
    _evict(off)
    _epoch(off)
    assert off.describe()["warm"] == "none" and off.warm_report is None
    off.close()


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "Background"])
def test_warm_takes_only_its_named_values(store, bad):
    with pytest.raises(ValueError, match="warm must be"):
        Loader(store, BATCH, tuning=LoaderTuning(warm=bad))
