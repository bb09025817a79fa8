"""``mmstore.ray.write`` on a local Ray cluster: the store it writes equals ``mmstore ingest``
of the same inputs in the same order (bookkeeping byte for byte, every record through every
read path), whatever the number of blocks; bad inputs are listed with their keys; a task
killed or failing mid-write is retried and the store is still exactly once; a driver killed
before the commit leaves nothing the next write does not clean up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from support import rayfaults
from support.compare import assert_reads_same
from support.images import make_folder, make_source

import mmstore
from mmstore.check.verify import verify_store
from mmstore.errors import AllInputsFailedError, IngestError, SourceError, StoreExistsError
from mmstore.torch import Loader

pytestmark = pytest.mark.usefixtures("ray_cluster")

SIZE = (32, 32)
CLASSES = ["ant", "bee"]


def _ingest(src, dest, **kw):
    return mmstore.ingest(src, dest, size=SIZE, workers=0, quiet=True, **kw)


def _labelled(ray, root, blocks):
    """``read_binary_files`` of an ImageFolder, with the class folder's label, in ``blocks`` blocks."""
    ds = ray.data.read_binary_files(root, include_paths=True)
    ds = ds.map(lambda r: {**r, "label": CLASSES.index(os.path.basename(os.path.dirname(r["path"])))})
    return ds.repartition(blocks)


def _write(ds, dest, root, **kw):
    import mmstore.ray

    kw.setdefault("part_rows", None)  # a part per block: several parts from few rows
    return mmstore.ray.write(ds, dest, SIZE, image="bytes", root=root, label_names=CLASSES, quiet=True, **kw)


def _no_leftovers(dest):
    assert not os.path.exists(dest + ".partial")
    parts = os.path.join(dest, "parts")
    with mmstore.open(dest) as s:
        assert sorted(os.listdir(parts)) == sorted(s.parts)  # only the committed parts
    for pid in os.listdir(parts):  # each holding only its data files
        assert sorted(os.listdir(os.path.join(parts, pid))) == ["box.npy", "dst.npy", "image.npy", "label.npy",
                                                                 "orig_size.npy"]


@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_binary_files_equal_ingest(ray_cluster, tmp_path, blocks):
    root = make_source(str(tmp_path / "src"), n_per_class=6)  # 12 images and 2 broken files
    ref = str(tmp_path / "ref.store")
    _ingest(root, ref)
    out = str(tmp_path / "ray.store")
    res = _write(_labelled(ray_cluster, root, blocks), out, root)
    assert_reads_same(out, ref)
    assert (res.records, res.skipped) == (12, 2)
    assert sorted(res.reasons) == sorted(e["reason"] for e in mmstore.open(ref).skipped())
    s = mmstore.open(out)
    assert s.label_names == CLASSES and [e["key"] for e in s.skipped()] == ["ant/zz_empty.jpg", "bee/zz_html.jpg"]
    assert s.manifest["version"] == (2, 2) and s.manifest["requires"] == ["parts"]
    assert len(s.parts) == len(s.segments) and 1 <= len(s.parts) <= blocks
    assert verify_store(out).ok
    _no_leftovers(out)


@pytest.mark.parametrize("kind,wide", [("bytes", False), ("path", False), ("path", True)])
def test_from_items_with_labels_equals_ingest(ray_cluster, tmp_path, kind, wide):
    """``wide``: write tasks of 2 CPUs, which decode on 2 threads (and the same records)."""
    root = str(tmp_path / "src")
    rels = make_folder(root, CLASSES, per_class=5, sizes=(24, 70))
    ref = str(tmp_path / "ref.store")
    _ingest(root, ref)
    items = []
    for rel in rels:
        p = os.path.join(root, rel)
        with open(p, "rb") as f:
            image = f.read() if kind == "bytes" else p
        items.append({"image": image, "label": CLASSES.index(rel.split("/")[0]), "key": rel})
    import mmstore.ray

    out = str(tmp_path / "ray.store")
    res = mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=4), out, SIZE,
                            label_names=CLASSES, quiet=True, part_rows=None,
                            ray_remote_args={"num_cpus": 2} if wide else None)
    assert_reads_same(out, ref)
    assert res.parts == 4


def test_threads_must_be_a_positive_integer(ray_cluster, tmp_path):
    import mmstore.ray

    ds = ray_cluster.data.from_items([{"image": b"x"}])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            mmstore.ray.write(ds, str(tmp_path / "s.store"), SIZE, threads=bad, quiet=True)
    assert not os.path.exists(tmp_path / "s.store") and not os.path.exists(tmp_path / "s.store.partial")


def test_options_are_checked_before_the_job(ray_cluster, tmp_path):
    import mmstore.ray

    ds = ray_cluster.data.from_items([{"image": b"x"}])
    out = str(tmp_path / "s.store")
    for kw, msg in [({"part_rows": 0}, "part_rows must be"), ({"part_rows": 2.5}, "part_rows must be"),
                    ({"concurrency": 0}, "concurrency must be")]:
        with pytest.raises(ValueError, match=msg):
            mmstore.ray.write(ds, out, SIZE, quiet=True, **kw)
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")


def test_one_task_in_flight_after_a_limit(ray_cluster, tmp_path):
    """A limit cuts the dataset inside a block and one task at a time runs
    (``concurrency=1``): the store holds the first rows, in order, once each."""
    import mmstore.ray

    items = [{"image": np.full((4, 4), i % 256, np.uint8), "label": i} for i in range(300)]
    out = str(tmp_path / "l.store")
    ds = ray_cluster.data.from_items(items, override_num_blocks=4).limit(130)
    res = mmstore.ray.write(ds, out, quiet=True, part_rows=50, concurrency=1)
    with mmstore.open(out) as s:
        assert [int(s[i]["label"]) for i in range(len(s))] == list(range(130))
        assert all(int(s[i]["image"][0, 0]) == i for i in range(130))
    assert res.parts == len(mmstore.open(out).segments) and verify_store(out).ok


def test_a_sliced_bundle_writes_its_slice(ray_cluster, tmp_path):
    """Ray may hand over a bundle that holds part of a block (its own ``RefBundle.slice``, as
    its bundler makes): the write task writes exactly the rows of the slice."""
    from mmstore.ray import sink

    items = [{"image": np.full((4, 4), i, np.uint8), "label": i} for i in range(40)]
    bundle = next(iter(ray_cluster.data.from_items(items, override_num_blocks=1).iter_internal_ref_bundles()))
    _, rest = bundle.slice(15)
    (ref, rows, cut), = list(sink._entries(rest))
    assert (rows, cut) == (40, (15, 40))
    job = sink._Job(str(tmp_path / "s.store"), None, image="image", label="label", key="key", path="path",
                    root=None, label_names=None, fields=None, on_error="skip", max_errors=None, overwrite=False,
                    backend="memmap", codecs=None, staging=None, part_rows=None, threads=None, cpus=1, decode={})
    lock = job.begin()
    try:
        r = ray_cluster.get(ray_cluster.remote(sink._write_task).remote(job, 0, [cut], ref))
        job.commit([r], 0.0)
    finally:
        job.end(lock)
    with mmstore.open(str(tmp_path / "s.store")) as s:
        assert [int(s[i]["label"]) for i in range(len(s))] == list(range(15, 40))


def test_a_task_failing_after_its_retries_fails_the_write(ray_cluster, tmp_path):
    """``on_error="fail"`` and no retries: the bad input's task fails, the others are
    cancelled, and no store, partial or lock is left; the next write works."""
    import cv2

    import mmstore.ray

    items = [{"image": cv2.imencode(".png", np.full((8, 8), i, np.uint8))[1].tobytes(), "label": i}
             for i in range(200)]
    items[150] = {"image": b"not an image", "label": 0}
    out = str(tmp_path / "f.store")
    ds = ray_cluster.data.from_items(items, override_num_blocks=4)
    with pytest.raises(Exception, match="not an image|decode|image"):
        mmstore.ray.write(ds, out, SIZE, on_error="fail", part_rows=50, quiet=True,
                          ray_remote_args={"max_retries": 0, "retry_exceptions": False})
    assert not os.path.exists(out) and not os.path.exists(out + ".partial") and not os.path.exists(out + ".lock")
    mmstore.ray.write(ds, out, SIZE, part_rows=50, quiet=True)
    with mmstore.open(out) as s:
        assert (s.slots, len(s)) == (200, 199) and [e["slot"] for e in s.skipped()] == [150]


def test_datasink_in_a_pipeline_equals_ingest(ray_cluster, tmp_path):
    """``write_datasink(MmstoreDatasink(...))`` with ``preserve_order``: Ray Data's own write
    operator, the same store as the ingest's; the result is on the sink."""
    from mmstore.ray import MmstoreDatasink

    root = make_source(str(tmp_path / "src"), n_per_class=6)
    ref = str(tmp_path / "ref.store")
    _ingest(root, ref)
    out = str(tmp_path / "sink.store")
    ctx = ray_cluster.data.DataContext.get_current()
    before = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    try:
        sink = MmstoreDatasink(out, SIZE, image="bytes", root=root, label_names=CLASSES, part_rows=None)
        _labelled(ray_cluster, root, 3).write_datasink(sink)
    finally:
        ctx.execution_options.preserve_order = before
    assert_reads_same(out, ref)
    assert sink.result is not None and (sink.result.records, sink.result.skipped) == (12, 2)
    _no_leftovers(out)


def test_datasink_failed_write_leaves_nothing(ray_cluster, tmp_path):
    """A write that fails (every task meets a bad input under ``on_error="fail"``): no store,
    no partial, no lock, and the next write to the destination works."""
    from mmstore.ray import MmstoreDatasink

    bad = [{"image": b"not an image", "label": 0, "key": "b0"}]
    out = str(tmp_path / "f.store")
    with pytest.raises(Exception, match="b0|not an image|decode"):
        ray_cluster.data.from_items(bad).write_datasink(
            MmstoreDatasink(out, SIZE, on_error="fail"), ray_remote_args={"max_retries": 0})
    assert not os.path.exists(out) and not os.path.exists(out + ".partial") and not os.path.exists(out + ".lock")
    good = [{"image": np.full((4, 4), 7, np.uint8), "label": 1}]
    ray_cluster.data.from_items(good).write_datasink(MmstoreDatasink(out))
    assert len(mmstore.open(out)) == 1


def test_read_images_equals_ingest(ray_cluster, tmp_path):
    """Decoded pixels (``read_images``: PNGs, which every decoder decodes to the same pixels)
    are fitted as ingest fits the decoded file."""
    root = str(tmp_path / "src")
    make_folder(root, [""], per_class=8, exts=(".png",), sizes=(20, 90))
    ref = str(tmp_path / "ref.store")
    _ingest(root, ref)
    import mmstore.ray

    out = str(tmp_path / "ray.store")
    ds = ray_cluster.data.read_images(root, include_paths=True, mode="RGB").repartition(3)
    mmstore.ray.write(ds, out, SIZE, root=root, quiet=True)
    assert_reads_same(out, ref)
    assert mmstore.open(out).key(0) == "img000.png"


def test_fields_and_codecs(ray_cluster, tmp_path):
    """More columns as fields (a ragged one), a codec on the image, a Loader epoch over the result."""
    rng = np.random.default_rng(3)
    items = []
    for i in range(40):
        img = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
        items.append({"image": img, "label": i % 4, "key": f"k{i:03d}",
                      "boxes": rng.random((i % 3, 4)).astype(np.float32), "caption": f"photo {i}"})
    import mmstore.ray

    out = str(tmp_path / "ray.store")
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=5), out, (16, 16),
                      fields={"boxes": ("<f4", (None, 4)), "caption": "str"}, codecs={"image": "png"}, quiet=True)
    s = mmstore.open(out)
    assert len(s) == 40 and s.manifest["requires"] == ["ragged", "parts"]
    for i in (0, 1, 2, 39):
        r = s[i]
        assert s.key(i) == f"k{i:03d}" and int(r["label"]) == i % 4
        assert np.array_equal(r["boxes"], items[i]["boxes"]) and r["caption"] == f"photo {i}"
        assert r["image"].shape == (16, 16, 3)
    labels = [int(v) for batch in Loader(out, 7, "block", fields=["label", "image"]) for v in batch["label"]]
    assert sorted(labels) == sorted(i % 4 for i in range(40))
    assert verify_store(out).ok


def test_loader_epoch_every_record_once(ray_cluster, tmp_path):
    items = [{"image": np.full((8, 8), i % 256, np.uint8), "label": i} for i in range(300)]
    import mmstore.ray

    out = str(tmp_path / "ray.store")
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=6), out, quiet=True, part_rows=None)
    s = mmstore.open(out)
    assert len(s.parts) == 6
    labels = []
    for batch in Loader(out, 32, "block"):
        labels.extend(int(v) for v in batch["label"])
    assert sorted(labels) == list(range(300))


def test_a_write_of_many_parts_lists_them_in_a_part_table(ray_cluster, tmp_path, monkeypatch):
    """From ``PART_TABLE_MIN_PARTS`` parts the commit writes a part table (format 2.4): the
    store reads every record once, through an epoch of the Loader as through ``store[i]``."""
    import json

    import mmstore.ray
    from mmstore.format import layout

    monkeypatch.setattr(layout, "PART_TABLE_MIN_PARTS", 6)  # the commit runs in this process, the driver
    items = [{"image": np.full((8, 8), i % 256, np.uint8), "label": i} for i in range(300)]
    out = str(tmp_path / "pt.store")
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=6), out, quiet=True, part_rows=None)
    with open(os.path.join(out, "manifest.json")) as fh:
        assert json.load(fh)["part_table"] == {"file": layout.PART_TABLE_FILE, "parts": 6}
    s = mmstore.open(out)
    assert len(s.parts) == 6 and [int(s[i]["label"]) for i in (0, 299)] == [0, 299]
    labels = [int(v) for batch in Loader(out, 32, "block") for v in batch["label"]]
    assert sorted(labels) == list(range(300)) and verify_store(out).ok


def test_part_rows_cuts_parts(ray_cluster, tmp_path):
    """Parts of ``part_rows`` rows cut across blocks, in order; the rows left at the end split
    evenly (300 rows, parts of 100, 2 CPUs: a part of 100, then 200 rows in 3 parts)."""
    items = [{"image": np.full((4, 4), i % 256, np.uint8), "label": i} for i in range(300)]
    import mmstore.ray

    out = str(tmp_path / "b.store")
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=7), out, quiet=True, part_rows=100)
    with mmstore.open(out) as s:
        assert s.segments == [100, 67, 67, 66] and [int(s[i]["label"]) for i in range(300)] == list(range(300))


def test_bad_inputs_all_failed_and_max_errors(ray_cluster, tmp_path):
    import mmstore.ray

    bad = [{"image": b"not an image %d" % i, "label": 0, "key": f"b{i}"} for i in range(6)]
    with pytest.raises(AllInputsFailedError):
        mmstore.ray.write(ray_cluster.data.from_items(bad, override_num_blocks=2), str(tmp_path / "a.store"),
                          SIZE, quiet=True)
    assert not os.path.exists(tmp_path / "a.store") and not os.path.exists(tmp_path / "a.store.partial")
    root = make_source(str(tmp_path / "src"), n_per_class=3)
    with pytest.raises(IngestError, match="max-errors 1"):
        _write(_labelled(ray_cluster, root, 2), str(tmp_path / "m.store"), root, max_errors=1)
    assert not os.path.exists(tmp_path / "m.store")
    res = _write(_labelled(ray_cluster, root, 2), str(tmp_path / "m.store"), root, max_errors=2)
    assert res.skipped == 2 and "skipped by reason" in res.summary() and "zz_html.jpg" not in res.summary()
    assert sorted(e["key"] for e in mmstore.open(str(tmp_path / "m.store")).skipped()) == [
        "ant/zz_empty.jpg", "bee/zz_html.jpg"]


def test_existing_store_and_overwrite(ray_cluster, tmp_path):
    import mmstore.ray

    out = str(tmp_path / "o.store")
    items = [{"image": np.full((4, 4), i, np.uint8), "label": i} for i in range(10)]
    mmstore.ray.write(ray_cluster.data.from_items(items), out, quiet=True)
    with pytest.raises(StoreExistsError):
        mmstore.ray.write(ray_cluster.data.from_items(items), out, quiet=True)
    mmstore.ray.write(ray_cluster.data.from_items(items[:4]), out, overwrite=True, quiet=True)
    assert len(mmstore.open(out)) == 4 and verify_store(out).ok


@pytest.mark.parametrize("action", ["kill", "raise"])
def test_task_fault_mid_write_is_retried_exactly_once(ray_cluster, tmp_path, action):
    """A task whose process is SIGKILLed (or that raises) in the middle of its part, on its first
    attempt: Ray runs it again, and the store is still the ingest's, with no left-over attempt."""
    rayfaults.register()
    root = str(tmp_path / "src")
    rels = make_folder(root, CLASSES, per_class=8, sizes=(24, 60))
    ref = str(tmp_path / "ref.store")
    _ingest(root, ref)
    marker = str(tmp_path / "fault-fired")
    items = []
    for j, rel in enumerate(rels):
        p = os.path.join(root, rel)
        cell = rayfaults.FaultyPath(p, marker, action) if j == 10 else rayfaults.PlainPath(p)
        items.append({"image": cell, "label": CLASSES.index(rel.split("/")[0]), "key": rel})
    import mmstore.ray

    out = str(tmp_path / "ray.store")
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=4), out, SIZE, label_names=CLASSES,
                      quiet=True)
    assert os.path.exists(marker)  # the fault fired
    assert_reads_same(out, ref)
    _no_leftovers(out)


_DRIVER = r"""
import os, signal, sys
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import logging, ray, mmstore.ray, mmstore.ray.sink as sink
ray.init(address=sys.argv[3], logging_level=logging.WARNING, log_to_driver=False)  # the test's running cluster
ray.data.DataContext.get_current().enable_progress_bars = False
import numpy as np
if sys.argv[2] == "kill":
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    sink.commit_parts = die
items = [{"image": np.full((6, 6), i, np.uint8), "label": i} for i in range(50)]
mmstore.ray.write(ray.data.from_items(items, override_num_blocks=5), sys.argv[1], quiet=True, part_rows=None)
"""


def test_driver_killed_before_commit_then_rerun(tmp_path, ray_cluster):
    """The driver SIGKILLed after every task wrote its part, before the commit: no store, and
    the next write (a new driver on the same running cluster) removes what was left and writes
    the store."""
    out = str(tmp_path / "d.store")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cluster = ray_cluster.get_runtime_context().gcs_address
    r = subprocess.run([sys.executable, "-c", _DRIVER, out, "kill", cluster], env=env, capture_output=True,
                       timeout=180)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    assert not os.path.exists(out)
    left = os.listdir(os.path.join(out + ".partial", "parts"))
    with open(os.path.join(out + ".partial", "_ray.json"), "rb") as f:
        assert len(left) == 5 and json.loads(f.read())["writer"] == "mmstore.ray"
    import mmstore.ray

    items = [{"image": np.full((6, 6), i, np.uint8), "label": i} for i in range(50)]
    mmstore.ray.write(ray_cluster.data.from_items(items, override_num_blocks=5), out, quiet=True, part_rows=None)
    s = mmstore.open(out)
    assert len(s) == 50 and [int(s[i]["label"]) for i in range(50)] == list(range(50))
    assert not set(left) & set(s.parts) and verify_store(out).ok
    assert not os.path.exists(out + ".partial")


def test_buckets_equal_ingest_and_auto_is_refused(ray_cluster, tmp_path):
    """``buckets=[...]`` (aspect buckets) writes what ``mmstore ingest`` does; ``auto`` (which needs every
    image's aspect before writing) is refused before any task, saying to pass the shapes."""
    import mmstore.ray

    root = make_source(str(tmp_path / "src"), n_per_class=3)
    ref = str(tmp_path / "ref.store")
    buckets = [(16, 16), (12, 20), (20, 12)]
    mmstore.ingest(root, ref, buckets=buckets, workers=0, quiet=True)
    out = str(tmp_path / "ray.store")
    mmstore.ray.write(_labelled(ray_cluster, root, 2), out, image="bytes", root=root, label_names=CLASSES,
                      quiet=True, part_rows=None, buckets=buckets)
    a, b = mmstore.open(ref), mmstore.open(out)
    assert a.schema == b.schema and b.schema["image"].buckets == ((20, 12), (16, 16), (12, 20))
    assert np.array_equal(a.slot_view.checksums(), b.slot_view.checksums())
    with pytest.raises(SourceError, match=r"buckets='auto'.*pass the shapes"):
        mmstore.ray.write(_labelled(ray_cluster, root, 2), str(tmp_path / "auto.store"), image="bytes", root=root,
                          quiet=True, buckets="auto")
    assert not os.path.exists(tmp_path / "auto.store")


def test_max_side_equals_ingest(ray_cluster, tmp_path):
    """``max_side=`` (records of each image's own aspect) writes what ``mmstore ingest`` does."""
    import mmstore.ray

    root = make_source(str(tmp_path / "src"), n_per_class=3)
    ref = str(tmp_path / "ref.store")
    mmstore.ingest(root, ref, max_side=20, codecs=["image=jpeg:90"], workers=0, quiet=True)
    out = str(tmp_path / "ray.store")
    mmstore.ray.write(_labelled(ray_cluster, root, 2), out, image="bytes", root=root, label_names=CLASSES,
                      quiet=True, part_rows=None, max_side=20, codecs=["image=jpeg:90"])
    a, b = mmstore.open(ref), mmstore.open(out)
    assert b.manifest["requires"] == ["parts", "shapes"] and a.schema == b.schema and len(a) == len(b) == 6
    assert np.array_equal(a.slot_view.checksums(), b.slot_view.checksums())
    assert all(np.array_equal(a[i]["image"], b[i]["image"]) and max(b[i]["image"].shape) == 20 for i in range(6))
