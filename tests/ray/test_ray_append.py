"""``mmstore.ray.write(..., append=True)``: a Ray Dataset's rows appended to a store as new
parts, under the rules of ``mmstore.append``: the result equals one write of the old and new
rows record for record; decode options, labels and keys are checked against the store's; a
reader of the old store keeps reading it; a driver killed before the publish leaves the old
store and a rerun completes; into a URL only the new parts and the small files go up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from support.compare import assert_reads_same
from support.images import make_folder

from mmstore.check.verify import verify_store
from mmstore.errors import AppendMismatchError, DuplicateKeysError
from mmstore.remote.client import Remote

pytestmark = pytest.mark.usefixtures("ray_cluster")

SIZE = (32, 32)


def _items(root, rels, names):
    """Rows of encoded photos with their class's number in ``names`` and their path as key."""
    out = []
    for rel in rels:
        with open(os.path.join(root, rel), "rb") as f:
            out.append({"image": f.read(), "label": names.index(rel.split("/")[0]), "key": rel})
    return out


def _ds(ray, items, blocks=2):
    return ray.data.from_items(items, override_num_blocks=blocks)


def _photos(tmp_path):
    """Old rows (ant, bee) and new rows (bee, cat: a class the store lacks), and a broken new row."""
    root = str(tmp_path / "src")
    old = make_folder(root, ("ant", "bee"), per_class=3, sizes=(24, 60))
    new = make_folder(root, ("bee", "cat"), per_class=2, seed=1, name="new{:03d}", sizes=(24, 60))
    return root, old, new


def test_append_equals_one_write_of_old_and_new_rows(ray_cluster, tmp_path):
    import mmstore.ray

    root, old, new = _photos(tmp_path)
    dest = str(tmp_path / "s.store")
    mmstore.ray.write(_ds(ray_cluster, _items(root, old, ["ant", "bee"])), dest, SIZE, label_names=["ant", "bee"],
                      quiet=True, part_rows=None)
    reader = mmstore.open(dest)  # a reader of the old store, opened before the append
    first = [np.asarray(reader[i]["image"]).copy() for i in range(len(reader))]
    # the new rows numbered by their own names (bee 0, cat 1), one of them broken; no decode option given
    new_items = _items(root, new, ["bee", "cat"]) + [{"image": b"<html>404</html>", "label": 0, "key": "bee/zz.jpg"}]
    res = mmstore.ray.write(_ds(ray_cluster, new_items), dest, append=True, label_names=["bee", "cat"],
                            quiet=True, part_rows=None)
    assert (res.records, res.skipped) == (10, 1)
    # the reference: one write of the old and new rows, numbered by the merged names
    names = ["ant", "bee", "cat"]
    ref_items = _items(root, old, names) + _items(root, new, names) + [
        {"image": b"<html>404</html>", "label": 1, "key": "bee/zz.jpg"}]
    ref = str(tmp_path / "ref.store")
    mmstore.ray.write(_ds(ray_cluster, ref_items, 1), ref, SIZE, label_names=names, quiet=True)
    assert_reads_same(dest, ref)  # records, labels, keys, holes, checksums: byte for byte
    with mmstore.open(dest) as s:
        assert s.label_names == names and [int(s[i]["label"]) for i in range(6, 10)] == [1, 1, 2, 2]
        assert s.segments is not None and len(s.segments) == len(s.parts) >= 3
        assert s.provenance["appended"][-1]["records"] == 4
    assert verify_store(dest).ok
    assert not os.path.exists(dest + ".partial")
    # the old reader still reads the old store
    assert len(reader) == 6 and all(np.array_equal(reader[i]["image"], first[i]) for i in range(6))
    reader.close()


def test_mismatch_and_duplicates_are_refused_and_the_store_is_unchanged(ray_cluster, tmp_path):
    import mmstore.ray

    root, old, new = _photos(tmp_path)
    dest = str(tmp_path / "s.store")
    old_items = _items(root, old, ["ant", "bee"])
    mmstore.ray.write(_ds(ray_cluster, old_items), dest, SIZE, label_names=["ant", "bee"], quiet=True)
    with open(os.path.join(dest, "manifest.json"), "rb") as f:
        manifest = f.read()
    new_items = _items(root, new, ["bee", "cat"])
    for kw, named in (({"size": (48, 48)}, "size"), ({"resize": "pad"}, "resize"), ({"channels": 1}, "channels"),
                      ({"codecs": ["image=jpeg:90"]}, "codecs"), ({"backend": "lmdb"}, "backend")):
        with pytest.raises(AppendMismatchError, match=named):
            mmstore.ray.write(_ds(ray_cluster, new_items), dest, append=True, label_names=["bee", "cat"],
                              quiet=True, **kw)
    # the same rows again: their keys are the store's
    with pytest.raises(DuplicateKeysError, match="ant/img000"):
        mmstore.ray.write(_ds(ray_cluster, old_items), dest, append=True, quiet=True)
    with open(os.path.join(dest, "manifest.json"), "rb") as f:
        assert f.read() == manifest
    assert not os.path.exists(dest + ".partial")
    # ... unless told: then they are appended (the rows' labels are the store's numbers)
    mmstore.ray.write(_ds(ray_cluster, old_items), dest, append=True, duplicate_keys="keep", quiet=True)
    with mmstore.open(dest) as s:
        assert len(s) == 12 and s.label_names == ["ant", "bee"] and s.key(6) == s.key(0)
    # labels named for a store whose labels have none
    plain = str(tmp_path / "plain.store")
    mmstore.ray.write(_ds(ray_cluster, old_items), plain, SIZE, quiet=True)
    with pytest.raises(AppendMismatchError, match="no names"):
        mmstore.ray.write(_ds(ray_cluster, new_items), plain, append=True, label_names=["bee", "cat"], quiet=True)
    with pytest.raises(TypeError, match="overwrite"):
        mmstore.ray.write(_ds(ray_cluster, new_items), dest, append=True, overwrite=True, quiet=True)


_DRIVER = r"""
import os, signal, sys
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import logging, ray, mmstore.ray, mmstore.ray.append as app
ray.init(address=sys.argv[2], logging_level=logging.WARNING, log_to_driver=False)  # the test's running cluster
ray.data.DataContext.get_current().enable_progress_bars = False
import numpy as np
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
app.publish = die  # killed with the appended store written in DEST.partial, before it replaces DEST
items = [{"image": np.full((6, 6), 100 + i, np.uint8), "label": i, "key": f"n{i}"} for i in range(20)]
mmstore.ray.write(ray.data.from_items(items, override_num_blocks=2), sys.argv[1], append=True, quiet=True,
                  part_rows=None)
"""


@pytest.mark.slow  # a driver run to its kill and a rerun: CI's step for slow tests
def test_driver_killed_before_publish_leaves_the_old_store_and_a_rerun_completes(ray_cluster, tmp_path):
    import mmstore.ray

    dest = str(tmp_path / "a.store")
    items = [{"image": np.full((6, 6), i, np.uint8), "label": i, "key": f"o{i}"} for i in range(30)]
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=2), dest, quiet=True)
    with open(os.path.join(dest, "manifest.json"), "rb") as f:
        manifest = f.read()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cluster = ray_cluster.get_runtime_context().gcs_address
    r = subprocess.run([sys.executable, "-c", _DRIVER, dest, cluster], env=env, capture_output=True, timeout=180)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    with open(os.path.join(dest, "manifest.json"), "rb") as f:
        assert f.read() == manifest  # the old store, as it was
    assert len(mmstore.open(dest)) == 30 and verify_store(dest).ok
    assert os.path.exists(os.path.join(dest + ".partial", "manifest.json"))  # killed with its work done
    new = [{"image": np.full((6, 6), 100 + i, np.uint8), "label": i, "key": f"n{i}"} for i in range(20)]
    mmstore.ray.write(ray_cluster.data.from_items(new, override_num_blocks=2), dest, append=True, quiet=True)
    with mmstore.open(dest) as s:
        assert len(s) == 50 and [s.key(i) for i in (0, 29, 30, 49)] == ["o0", "o29", "n0", "n19"]
        assert [int(s[i]["label"]) for i in range(50)] == list(range(30)) + list(range(20))
    assert verify_store(dest).ok and not os.path.exists(dest + ".partial")


@pytest.mark.slow  # a Ray write into a bucket and its append: CI's step for slow tests
def test_append_into_a_url_uploads_only_the_new_parts_and_small_files(ray_cluster, s3, tmp_path):
    import mmstore.ray
    from mmstore.transfer import pull, push

    args = {"runtime_env": {"env_vars": dict(s3.env)}}
    root, old, new = _photos(tmp_path)
    url = s3.url("stores/grown.store")
    mmstore.ray.write(_ds(ray_cluster, _items(root, old, ["ant", "bee"])), url, SIZE, label_names=["ant", "bee"],
                      quiet=True, ray_remote_args=args, part_rows=None)
    remote = Remote(url)
    before = remote.list()
    kept = sorted(n for n in before if n.startswith("parts/"))
    assert kept
    mmstore.ray.write(_ds(ray_cluster, _items(root, new, ["bee", "cat"])), url, append=True,
                      label_names=["bee", "cat"], quiet=True, ray_remote_args=args, part_rows=None)
    after = remote.list()
    for n in kept:  # the store's data objects were not uploaded again
        assert after[n]["etag"] == before[n]["etag"] and after[n].get("last_modified") == before[n].get(
            "last_modified"), n
    got = str(tmp_path / "pulled.store")
    pull(url, got)
    with mmstore.open(got) as s:
        assert set(after) == set(s.manifest["files"]) | {"manifest.json", "_remote.json"}  # nothing else
        assert len(s) == 10 and s.label_names == ["ant", "bee", "cat"]
    names = ["ant", "bee", "cat"]
    ref = str(tmp_path / "ref.store")
    mmstore.ray.write(_ds(ray_cluster, _items(root, old, names) + _items(root, new, names), 1), ref, SIZE,
                      label_names=names, quiet=True)
    assert_reads_same(got, ref)
    # a store of one segment at a URL (ingested, then pushed) is refused, saying what to do
    plain = str(tmp_path / "plain.store")
    mmstore.ingest(os.path.join(root), plain, size=SIZE, workers=0, quiet=True)
    purl = s3.url("stores/plain.store")
    push(plain, purl)
    with pytest.raises(AppendMismatchError, match="Pull the store"):
        mmstore.ray.write(_ds(ray_cluster, _items(root, new, ["bee", "cat"])), purl, append=True,
                          label_names=["bee", "cat"], quiet=True, ray_remote_args=args)


def test_an_append_decodes_as_the_store_whatever_its_options(ray_cluster, tmp_path):
    """A store written with options other than the defaults (one channel, padded): an append
    that gives none decodes the new rows the same way, and one that repeats them is taken."""
    import mmstore.ray

    root, old, new = _photos(tmp_path)
    dest = str(tmp_path / "gray.store")
    kw = {"channels": 1, "resize": "pad", "pad_value": 7}
    mmstore.ray.write(_ds(ray_cluster, _items(root, old, ["ant", "bee"])), dest, SIZE, label_names=["ant", "bee"],
                      quiet=True, **kw)
    half = len(new) // 2
    mmstore.ray.write(_ds(ray_cluster, _items(root, new[:half], ["bee"])), dest, append=True, label_names=["bee"],
                      quiet=True)
    mmstore.ray.write(_ds(ray_cluster, _items(root, new[half:], ["cat"])), dest, SIZE, append=True,
                      label_names=["cat"], quiet=True, **kw)
    names = ["ant", "bee", "cat"]
    ref = str(tmp_path / "ref.store")
    mmstore.ray.write(_ds(ray_cluster, _items(root, old, names) + _items(root, new, names), 1), ref, SIZE,
                      label_names=names, quiet=True, **kw)
    assert_reads_same(dest, ref)
    with mmstore.open(dest) as s:
        assert s.schema["image"].shape == (32, 32, 1) and len(s) == 10
