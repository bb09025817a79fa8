"""``mmstore.ray.write`` straight into object storage (the real S3 server of the tests): the
store at the URL reads, pulls and verifies as ``mmstore ingest`` of the same inputs; a task
killed mid-write leaves no object the store does not list; a store with parts is read from the
URL through the sparse replica."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support import rayfaults
from support.compare import assert_reads_same
from support.images import make_folder, make_source

import mmstore
from mmstore.check.verify import verify_store
from mmstore.errors import StoreExistsError
from mmstore.remote.client import Remote
from mmstore.transfer import pull

pytestmark = pytest.mark.usefixtures("ray_cluster")

SIZE = (32, 32)
CLASSES = ["ant", "bee"]


def _args(s3):
    """The write tasks reach the bucket with the test's environment (a real cluster's nodes have their own)."""
    return {"runtime_env": {"env_vars": dict(s3.env)}}


def _only_store_objects(url):
    """Every object under the URL is one the store lists (no attempt, no part's own bookkeeping)."""
    with _opened(url) as s:
        listed = set(s.manifest["files"]) | {"manifest.json", "_remote.json"}
    have = set(Remote(url).list())
    assert have == listed, (sorted(have - listed), sorted(listed - have))


class _opened:
    """The store at ``url``, opened with a cache directory of its own (removed on exit)."""

    def __init__(self, url):
        self.url = url

    def __enter__(self):
        import tempfile

        self.tmp = tempfile.mkdtemp()
        self.s = mmstore.open(self.url, cache_dir=self.tmp)
        return self.s

    def __exit__(self, *exc):
        import shutil

        self.s.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.mark.slow  # a whole job of several processes: CI's step for slow tests
def test_write_to_s3_equals_ingest(ray_cluster, s3, tmp_path):
    import mmstore.ray

    root = make_source(str(tmp_path / "src"), n_per_class=6)
    ref = str(tmp_path / "ref.store")
    mmstore.ingest(root, ref, size=SIZE, workers=0, quiet=True)
    ds = ray_cluster.data.read_binary_files(root, include_paths=True)
    ds = ds.map(lambda r: {**r, "label": CLASSES.index(os.path.basename(os.path.dirname(r["path"])))})
    url = s3.url("stores/ray.store")
    res = mmstore.ray.write(ds.repartition(3), url, SIZE, image="bytes", root=root, label_names=CLASSES,
                            quiet=True, ray_remote_args=_args(s3), staging=str(tmp_path / "staging"),
                            part_rows=None)
    assert (res.records, res.skipped) == (12, 2)
    assert os.listdir(tmp_path / "staging") == []  # each task's local part is gone once uploaded
    _only_store_objects(url)
    # read from the URL (sparse replica), then pulled: both as the ingest
    with _opened(url) as s:
        r = mmstore.open(ref)
        assert len(s) == len(r) and s.parts is not None and len(s.parts) == 3
        for i in range(len(r)):
            a, b = s[i], r[i]
            assert all(np.array_equal(a[f], b[f]) for f in r.fields) and s.key(i) == r.key(i)
        assert np.array_equal(s.slot_view.checksums(), r.slot_view.checksums())
        r.close()
    assert verify_store(url).ok
    dest = str(tmp_path / "pulled.store")
    pull(url, dest)
    assert_reads_same(dest, ref)
    assert verify_store(dest).ok
    with pytest.raises(StoreExistsError):
        mmstore.ray.write(ds, url, SIZE, image="bytes", quiet=True, ray_remote_args=_args(s3))


@pytest.mark.slow  # a whole job of several processes: CI's step for slow tests
def test_task_killed_mid_write_to_s3(ray_cluster, s3, tmp_path):
    """A task SIGKILLed in the middle of its part on its first attempt: retried, and the bucket
    ends with the ingest's store and nothing else (the killed attempt's objects are removed)."""
    import mmstore.ray

    rayfaults.register()
    root = str(tmp_path / "src")
    rels = make_folder(root, CLASSES, per_class=6, sizes=(24, 60))
    ref = str(tmp_path / "ref.store")
    mmstore.ingest(root, ref, size=SIZE, workers=0, quiet=True)
    marker = str(tmp_path / "fired")
    items = []
    for j, rel in enumerate(rels):
        p = os.path.join(root, rel)
        cell = rayfaults.FaultyPath(p, marker, "kill") if j == 7 else rayfaults.PlainPath(p)
        items.append({"image": cell, "label": CLASSES.index(rel.split("/")[0]), "key": rel})
    url = s3.url("k.store")
    staging = str(tmp_path / "staging")
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=3), url, SIZE, label_names=CLASSES,
                      quiet=True, ray_remote_args=_args(s3), staging=staging)
    assert os.path.exists(marker)
    # the killed attempt's local part is removed by the next task of this node that stages one
    mmstore.ray.write(ray_cluster.data.from_items(items[:2]), s3.url("k2.store"), SIZE, quiet=True,
                      ray_remote_args=_args(s3), staging=staging)
    assert os.listdir(staging) == []
    _only_store_objects(url)
    dest = str(tmp_path / "pulled.store")
    pull(url, dest)
    assert_reads_same(dest, ref)


def test_overwrite_a_store_in_s3(ray_cluster, s3, tmp_path):
    import mmstore.ray

    url = s3.url("o.store")
    items = [{"image": np.full((4, 4), i, np.uint8), "label": i} for i in range(20)]
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=2), url, quiet=True,
                      ray_remote_args=_args(s3))
    mmstore.ray.write(ray_cluster.data.from_items(items[:5], override_num_blocks=2), url, overwrite=True,
                      quiet=True, ray_remote_args=_args(s3))
    with _opened(url) as s:
        assert [int(s[i]["label"]) for i in range(len(s))] == list(range(5))
    _only_store_objects(url)


def test_a_write_into_a_folder_of_stores_refuses_and_leaves_every_object_byte_identical(ray_cluster, s3, tmp_path):
    """``mmstore.ray.write(ds, "s3://bucket/datasets")`` (the folder, not a store's own prefix) next
    to another store and a README: refused before any task runs, with or without overwrite,
    and every object there stays as it was."""
    import obstore

    import mmstore.ray
    from mmstore.errors import ForeignObjectsError
    from mmstore.transfer import push

    other = str(tmp_path / "other.store")
    mmstore.from_dataset([{"image": np.full((4, 4), i, np.uint8), "label": i} for i in range(10)], other)
    push(other, s3.url("datasets/train.store"))
    s3.server.put_object_raw(s3.bucket, "datasets/README.md", b"# datasets\n")
    store = s3.store(endpoint=s3.server.endpoint)

    def everything():
        keys = [str(m["path"]) for chunk in obstore.list(store) for m in chunk]
        return {k: bytes(obstore.get(store, k).bytes()) for k in keys}

    before = everything()
    items = [{"image": np.full((4, 4), i, np.uint8), "label": i} for i in range(6)]
    for overwrite in (False, True):
        with pytest.raises(ForeignObjectsError, match="README.md"):
            mmstore.ray.write(ray_cluster.data.from_items(items), s3.url("datasets"), overwrite=overwrite,
                              quiet=True, ray_remote_args=_args(s3))
        assert everything() == before
