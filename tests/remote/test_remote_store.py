"""Stores in object storage, against a real S3 server (SeaweedFS on loopback): push and pull
are byte-identical, a store opened from its URL reads exactly what the local store reads
(every entry point, every order, a subset, a resume), the cache limit holds on disk, and a
second open starts warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from remote.helpers import (
    assert_same_epoch,
    batches,
    finish,
    push_then_pull,
    python_child,
    same_files,
    written_image_store,
)
from support.stores import SMALL_SCHEMA, compact_store, write_parts, write_store

import mmstore
from mmstore.errors import FormatError, RemoteNotFoundError, StoreExistsError
from mmstore.order import OrderSpec
from mmstore.transfer import pull, push

pytest.importorskip("obstore")

BLOCK = 64 << 10  # small blocks: a small store has many


def _disk(path: str) -> int:
    total = 0
    for dp, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dp, f)).st_blocks * 512
            except OSError:
                pass
    return total


@pytest.mark.parametrize("kind", ["memmap", "lmdb", "holes", "merged", "compact"])
def test_push_then_pull_is_byte_identical(s3, tmp_path, kind):
    src = tmp_path / "src.store"
    if kind == "memmap":
        path = written_image_store(src, n=1500)
    elif kind == "lmdb":
        path = write_store(src, 300, backend="lmdb")
    elif kind == "holes":
        path = written_image_store(src, n=800, holes=(0, 17, 799))
    elif kind == "merged":
        parts = write_parts(tmp_path / "parts", 600, [200, 400])
        path = str(mmstore.merge(parts, src))
    else:
        path = compact_store(src, 120)
    url = s3.url("data/" + kind + ".store")
    push_then_pull(path, url, tmp_path / "pulled.store", block_bytes=BLOCK)


def test_a_url_store_reads_what_the_local_store_reads(s3, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=900, holes=(3, 400))
    url = s3.url("a/b/train.store")
    push(path, url, block_bytes=BLOCK)
    local = mmstore.open(path)
    with mmstore.open(url, cache_dir=tmp_path / "cache") as remote:
        assert remote.url == url and len(remote) == len(local) and remote.schema == local.schema
        assert remote.store_id == local.store_id and remote.skipped() == local.skipped()
        assert remote.replica.describe()["present"] < 0.1  # nothing read yet: headers only
        for i in (0, 5, 897, -1):
            r, want = remote[i], local[i]
            for k in want:
                np.testing.assert_array_equal(r[k], want[k])
        idx = np.random.default_rng(0).permutation(len(local))[:300]
        got, want = remote.read_batch(idx), local.read_batch(idx)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(remote.column("label"), local.column("label"))
        assert [remote.key(i) for i in range(5)] == [local.key(i) for i in range(5)]
        n = sum(1 for _ in remote)
        assert n == len(local) and remote.replica.complete()


@pytest.mark.parametrize("kind", ["sequential", "permutation", "block"])
def test_a_loader_epoch_from_the_url_equals_the_local_one(s3, tmp_path, kind):
    from mmstore.torch import Loader

    path = written_image_store(tmp_path / "src.store", n=2000)
    url = s3.url("train.store")
    push(path, url, block_bytes=BLOCK)
    remote = mmstore.open(url, cache_dir=tmp_path / "cache")
    local = mmstore.open(path)
    kw = {"block": 64, "window": 4} if kind == "block" else {}
    for epoch in (0, 1):
        a = Loader(remote, 96, OrderSpec(kind, seed=5, **kw))
        b = Loader(local, 96, OrderSpec(kind, seed=5, **kw))
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert_same_epoch(batches(a), batches(b))
        assert a.describe().remote["url"] == url
    assert remote.replica.describe()["fetched_blocks"] <= remote.replica.nblocks  # each block once
    # a subset, and a resume from the middle of an epoch
    subset = np.arange(100, 1700, 3)
    a = Loader(remote, 50, OrderSpec(kind, seed=2, **kw), indices=subset)
    b = Loader(local, 50, OrderSpec(kind, seed=2, **kw), indices=subset)
    it = iter(a)
    for _ in range(4):
        next(it)
    state = a.state_dict()
    del it
    a.close()
    c = Loader(remote, 50, OrderSpec(kind, seed=2, **kw), indices=subset)
    c.load_state_dict(state)
    assert_same_epoch(batches(c), batches(b)[4:])


def test_a_loader_in_a_helper_process_reads_the_url_through_the_cache(s3, tmp_path):
    """process=True over a store opened by URL: the helper opens the same URL
    with the same cache directory, fetches through the verified cache, and the
    batches equal the local store's; a second epoch fetches nothing new."""
    from mmstore.torch import Loader

    path = written_image_store(tmp_path / "src.store", n=600)
    url = s3.url("helper.store")
    push(path, url, block_bytes=BLOCK)
    remote = mmstore.open(url, cache_dir=tmp_path / "cache")
    spec = OrderSpec("block", seed=4, block=32, window=4)
    a = Loader(remote, 50, spec, process=True)
    b = Loader(mmstore.open(path), 50, spec)
    for _ in range(2):
        assert_same_epoch(batches(a), batches(b))
    a.close()
    again = mmstore.open(url, cache_dir=tmp_path / "cache")
    assert again.replica.complete()  # the helper filled this cache directory


def test_the_cache_limit_holds_on_disk_during_epochs(s3, tmp_path):
    from mmstore.torch import Loader

    path = written_image_store(tmp_path / "src.store", n=4000)  # ~7 MB of records
    url = s3.url("big.store")
    push(path, url, block_bytes=BLOCK)
    limit = 2_500_000  # a third of the store
    cache = tmp_path / "cache"
    remote = mmstore.open(url, cache_dir=cache, cache_limit=limit)
    local = mmstore.open(path)
    spec = OrderSpec("block", seed=1)  # sized by the Loader for the limit
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _disk(str(cache)))
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        for epoch in (0, 1):
            a = Loader(remote, 64, spec)
            b = Loader(local, 64, a.order)
            window = a.order.block * a.order.window * (24 * 24 * 3 + 8)
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            assert_same_epoch(batches(a), batches(b))
    finally:
        stop.set()
        t.join()
    d = remote.replica.describe()
    assert d["evicted_blocks"] > 0 and d["disk_bytes"] <= limit
    # on disk: the limit, plus one window and the blocks it straddles, plus the replica's
    # small state files (block states, lock files) and file-system rounding
    slack = window + 2 * BLOCK + 4 * BLOCK + 64 * 1024
    assert peak[0] <= limit + slack, (peak[0], limit + slack)


def test_a_second_open_and_a_second_process_start_warm(s3, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=600)
    url = s3.url("warm.store")
    push(path, url, block_bytes=BLOCK)
    cache = tmp_path / "cache"
    with mmstore.open(url, cache_dir=cache) as s:
        s.replica.fill()
        assert s.replica.complete()
    with mmstore.open(url, cache_dir=cache) as s:
        assert s.replica.complete()
        s.read_batch(np.arange(len(s)))
        assert s.replica.describe()["fetched_blocks"] == 0
    code = (
        "import json, sys, numpy as np, mmstore\n"
        f"s = mmstore.open({url!r}, cache_dir={str(cache)!r})\n"
        "b = s.read_batch(np.arange(len(s)))\n"
        "print(json.dumps({'fetched': s.replica.describe()['fetched_blocks'], 'sum': int(b['image'].sum())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["fetched"] == 0 and got["sum"] == int(mmstore.open(path).column("image").sum())


_TRIM_CHILD = (
    "import json, sys, mmstore\n"
    "s = mmstore.open(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))\n"
    "s.replica.trim()\n"
    "print(json.dumps({'evicted': s.replica.evicted_blocks, 'complete': s.replica.complete()}))\n"
)


def _trim_from_another_process(url: str, cache: str, limit: int) -> dict:
    out, err = finish(python_child(_TRIM_CHILD, url, cache, str(limit)), timeout=120)
    return json.loads(out.decode().strip().splitlines()[-1])


def test_an_epoch_over_a_complete_replica_holds_every_block_until_it_ends(s3, tmp_path):
    """A complete replica is read as a local store (no window pass) under one pin of every
    block: another process that trims the cache to a small limit evicts nothing while the
    epoch runs, and evicts once it has ended (finished, or abandoned and closed)."""
    from mmstore.torch import Loader

    path = written_image_store(tmp_path / "src.store", n=1500)
    url = s3.url("whole.store")
    push(path, url, block_bytes=BLOCK)
    cache = str(tmp_path / "cache")
    remote = mmstore.open(url, cache_dir=cache)
    remote.replica.fill()
    assert remote.replica.complete()
    spec = OrderSpec("block", seed=3, block=32, window=4)
    a, b = Loader(remote, 50, spec), Loader(mmstore.open(path), 50, spec)
    small = remote.replica.whole_bytes + 4 * BLOCK
    got = []
    for k, batch in enumerate(a):
        got.append({f: v.numpy().copy() for f, v in batch.items()})
        if k == 2:  # mid-epoch: every block is pinned by this process
            assert remote.replica.pinned_whole()
            seen = _trim_from_another_process(url, cache, small)
            assert seen == {"evicted": 0, "complete": True}
    assert_same_epoch(got, batches(b))
    assert a.describe().remote["windows"] == 0
    assert not remote.replica.pinned_whole()  # released when the epoch ended
    assert a.describe().remote["cost"].startswith("cached")

    # an abandoned epoch holds its pin until the loader is closed
    remote.replica.fill()
    it = iter(a)
    next(it)
    del it
    a.close()
    assert not remote.replica.pinned_whole()
    seen = _trim_from_another_process(url, cache, small)
    assert seen["evicted"] > 0 and not seen["complete"]
    # no longer complete: the next epoch fetches through the window pass and still reads the same
    before = remote.replica.describe()["fetched_blocks"]
    assert_same_epoch(batches(Loader(remote, 50, spec)), batches(Loader(mmstore.open(path), 50, spec)))
    assert remote.replica.describe()["fetched_blocks"] > before


def test_a_new_push_at_the_url_is_a_new_replica_and_the_old_one_goes(s3, tmp_path):
    a = written_image_store(tmp_path / "a.store", n=300)
    b = write_store(tmp_path / "b.store", 50)
    url = s3.url("moving.store")
    cache = tmp_path / "cache"
    push(a, url, block_bytes=BLOCK)
    with mmstore.open(url, cache_dir=cache) as s:
        first = s.replica.home
    with pytest.raises(StoreExistsError):
        push(b, url, block_bytes=BLOCK)
    push(b, url, block_bytes=BLOCK, overwrite=True)
    with mmstore.open(url, cache_dir=cache) as s:
        assert s.schema == mmstore.open(b).schema and len(s) == 50
        assert s.replica.home != first
    assert not os.path.exists(first)  # nobody had it open any more: deleted


def test_a_half_pushed_store_is_not_a_store(s3, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=200)
    url = s3.url("half.store")
    push(path, url, block_bytes=BLOCK)
    store = s3.store()
    import obstore

    obstore.delete(store, "half.store/manifest.json")  # as a push killed before its last upload leaves it
    with pytest.raises(RemoteNotFoundError, match="not complete"):
        mmstore.open(url, cache_dir=tmp_path / "cache")
    with pytest.raises(RemoteNotFoundError):
        pull(url, tmp_path / "out.store")
    assert not os.path.exists(tmp_path / "out.store")
    push(path, url, block_bytes=BLOCK)  # the rerun finishes it
    assert len(mmstore.open(url, cache_dir=tmp_path / "cache")) == 200


def test_a_damaged_remote_index_is_refused(s3, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=100)
    url = s3.url("idx.store")
    push(path, url, block_bytes=BLOCK)
    raw = json.loads(s3.server.get_object_raw(s3.bucket, "idx.store/_remote.json"))
    raw["files"]["image.npy"]["size"] += 1
    s3.server.put_object_raw(s3.bucket, "idx.store/_remote.json", json.dumps(raw).encode())
    with pytest.raises(FormatError, match="does not match"):
        mmstore.open(url, cache_dir=tmp_path / "cache")


def test_the_checking_tools_take_a_url(s3, tmp_path, monkeypatch):
    path = written_image_store(tmp_path / "src.store", n=300)
    url = s3.url("tools.store")
    push(path, url, block_bytes=BLOCK)
    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ}
    for args in (["inspect", url, "--json"], ["verify", url, "--json"], ["doctor", url, "--json"],
                 ["show", url, "-o", str(tmp_path / "grid.png")]):
        out = subprocess.run([sys.executable, "-m", "mmstore", *args], capture_output=True, text=True, timeout=300,
                             env=env)
        assert out.returncode == 0, (args, out.stderr)
    rep = json.loads(subprocess.run([sys.executable, "-m", "mmstore", "verify", url, "--json"], capture_output=True,
                                    text=True, timeout=300, env=env).stdout)
    assert rep["ok"] and rep["checked_slots"] == 300 and rep["path"] == url
    assert os.path.getsize(tmp_path / "grid.png") > 0


def test_the_cli_push_and_pull(s3, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=400)
    url = s3.url("cli.store")
    run = lambda *a: subprocess.run([sys.executable, "-m", "mmstore", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300, env=os.environ)
    out = run("push", path, url, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["uploaded_bytes"] > 0
    out = run("pull", url, str(tmp_path / "copy.store"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["verified_records"] == 400
    same_files(path, str(tmp_path / "copy.store"))
    out = run("push", path, url)
    assert out.returncode == 0 and "nothing uploaded" in out.stderr
    other = write_store(tmp_path / "other.store", 10, schema=SMALL_SCHEMA)
    out = run("push", other, url)
    assert out.returncode == 2 and "another store" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--overwrite" in out.stderr and "overwrite=True" not in out.stderr
    out = run("pull", s3.url("nothing-here.store"), str(tmp_path / "x.store"))
    assert out.returncode == 2 and "no store at this URL" in out.stderr
