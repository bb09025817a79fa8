"""A block shuffle from a URL under a small ``cache_limit``, against a real S3 server
(SeaweedFS on loopback, counted at the relay in front of it): every epoch fetches each block at
most once (the first one from an empty cache: exactly the store's bytes), the same bytes in
two runs with the same seed, at a third and a quarter of the store; a limit too small to do so
is refused with the smallest that works, and that one works."""

from __future__ import annotations

import re

import numpy as np
import pytest
from remote.helpers import BLOCK, written_image_store

import mmstore
from mmstore.errors import CacheLimitError
from mmstore.order import OrderSpec
from mmstore.transfer import push

pytest.importorskip("obstore")
pytest.importorskip("torch")

N = 8600  # 24x24x3 images: 14.9 MB of records, 227 blocks of 64 KiB


@pytest.fixture
def pushed(s3_faulty, tmp_path):
    src = written_image_store(tmp_path / "src.store", n=N)
    url = s3_faulty.url("limit.store")
    push(src, url, block_bytes=BLOCK)
    return s3_faulty, src, url


def _labels(loader, epoch: int) -> np.ndarray:
    loader.set_epoch(epoch)
    return np.concatenate([b["label"].numpy() for b in loader])


def _epochs(bucket, url: str, cache, limit: int, src: str) -> list[dict]:
    """Two epochs of a block shuffle from ``url`` under ``limit`` (each the same batches as
    the same order over the local store): per epoch the bytes the server sent, the bytes the
    replica fetched and how often each block was fetched at most."""
    from mmstore.torch import Loader

    store = mmstore.open(url, cache_dir=cache, cache_limit=limit)
    rep = store.replica
    loader = Loader(store, 64, OrderSpec("block", seed=5))
    local = Loader(mmstore.open(src), 64, loader.order)
    want = [_labels(local, e) for e in range(2)]
    out = []
    try:
        for epoch in range(2):
            sent, fetched, counts = bucket.proxy.body_bytes, rep.fetched_bytes, rep.fetch_counts.copy()
            assert np.array_equal(_labels(loader, epoch), want[epoch])
            out.append({"sent": bucket.proxy.body_bytes - sent, "fetched": rep.fetched_bytes - fetched,
                        "most": int((rep.fetch_counts - counts).max()), "disk": rep.disk_bytes()})
        out.append({"sparse": rep.sparse_bytes, "opened": int(rep.sizes[rep.sticky].sum()),
                    "block": loader.order.block, "window": loader.order.window})
    finally:
        loader.close()
        store.close()
    return out


def test_each_block_is_fetched_once_an_epoch_the_same_in_every_run(pushed, tmp_path):
    bucket, src, url = pushed
    for part in (3, 4):  # a third and a quarter of the store
        limit = N * (24 * 24 * 3 + 8) // part
        runs = [_epochs(bucket, url, tmp_path / f"cache{part}-{r}", limit, src) for r in range(2)]
        for run in runs:
            first, second, sizes = run
            assert first["most"] == 1 and second["most"] <= 1, run  # no block fetched twice in an epoch
            assert first["fetched"] + sizes["opened"] == sizes["sparse"], run  # from empty: the whole store once
            assert first["sent"] == first["fetched"] and second["sent"] == second["fetched"], run
            assert second["fetched"] <= sizes["sparse"], run
            assert max(first["disk"], second["disk"]) <= limit, run
        assert runs[0][:2] == runs[1][:2], runs  # the same bytes in both runs


def test_a_limit_too_small_is_refused_with_the_smallest_that_works(pushed, tmp_path):
    from mmstore.torch import Loader

    bucket, src, url = pushed
    small = mmstore.open(url, cache_dir=tmp_path / "c0", cache_limit=800_000)
    with pytest.raises(CacheLimitError, match="cache_limit") as info:
        Loader(small, 64, OrderSpec("block", seed=5))
    small.close()
    m = re.search(r"at least ([0-9,]+) bytes", str(info.value))
    assert m, str(info.value)
    least = int(m.group(1).replace(",", ""))
    assert 800_000 < least < N * 1736
    store = mmstore.open(url, cache_dir=tmp_path / "c1", cache_limit=least)
    loader = Loader(store, 64, OrderSpec("block", seed=5))
    counts = store.replica.fetch_counts.copy()
    local = Loader(mmstore.open(src), 64, loader.order)
    assert np.array_equal(_labels(loader, 0), _labels(local, 0))
    assert int((store.replica.fetch_counts - counts).max()) == 1
    assert store.replica.disk_bytes() <= least
    # sizes given by hand: a block is kept (the window sized for the limit), a window too wide refused
    given = Loader(store, 64, OrderSpec("block", seed=5, block=loader.order.block))
    assert given.order.block == loader.order.block and given.order.window == loader.order.window
    with pytest.raises(CacheLimitError, match=f"block={loader.order.block}, window=8"):
        Loader(store, 64, OrderSpec("block", seed=5, block=loader.order.block, window=8))
    given.close()
    loader.close()
    store.close()
