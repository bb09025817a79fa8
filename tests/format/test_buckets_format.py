"""Aspect buckets in the format ("Aspect buckets" of format 2.3): a shaped field's ``buckets`` in the
schema and the manifest, checked as untrusted input; a record whose ``<name>_hw`` is not a listed bucket
is refused on read and reported by verify; a reader that ignores the key reads the same records."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mmstore
from mmstore.check.inspect import inspect_store
from mmstore.errors import EntryDecodeError, FormatError, SchemaError
from mmstore.format import parse_manifest
from mmstore.format.shaped import bucket_ids

BUCKETS = [(4, 8), (6, 6), (8, 4)]


def images(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for hw in [(6, 6), (4, 8), (8, 4), (4, 8), (6, 6)]]


def write(path, imgs, codec="raw", backend="memmap", buckets=BUCKETS) -> str:
    schema = mmstore.Schema({"image": ("|u1", (None, None, 3), codec), "label": ("<i8", ())},
                            buckets={"image": buckets})
    with mmstore.StoreWriter(path, schema, slots=len(imgs), backend=backend) as w:
        for i, im in enumerate(imgs):
            w.write(i, {"image": im, "label": i}, key=f"k{i}")
    return str(path)


@pytest.mark.parametrize(("codec", "backend"), [("raw", "memmap"), ("zstd:3", "lmdb"), ("png:1", "memmap"),
                                                ("jpeg:90", "memmap")])
def test_buckets_round_trip_in_schema_and_manifest(tmp_path, codec, backend):
    imgs = images()
    path = write(tmp_path / "s", imgs, codec, backend, buckets=[(8, 4), (4, 8), (6, 6)])
    s = mmstore.open(path)
    f = s.schema["image"]
    assert f.buckets == ((8, 4), (6, 6), (4, 8))  # listed from the tallest to the widest
    assert s.schema["image_hw"].buckets is None and s.schema["label"].buckets is None
    with open(os.path.join(path, "manifest.json")) as fh:
        m = json.load(fh)
    assert m["schema"][0]["buckets"] == [[8, 4], [6, 6], [4, 8]] and m["version"] == [2, 3]
    assert m["requires"] == ["shapes"]
    for i, im in enumerate(imgs):
        assert s[i]["image"].shape == im.shape
        if not codec.startswith("jpeg"):
            assert np.array_equal(s[i]["image"], im)
    assert bucket_ids(f, s.column("image_hw")).tolist() == [1, 2, 0, 2, 1]
    assert mmstore.verify(path, decode=True).ok
    # a reader that does not know the key (it drops it) reads the very same records
    m2 = dict(m, schema=[{k: v for k, v in e.items() if k != "buckets"} for e in m["schema"]])
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(m2, fh)
    t = mmstore.open(path)
    assert t.schema["image"].buckets is None
    assert all(np.array_equal(t[i]["image"], s[i]["image"]) for i in range(len(imgs)))


def test_schema_checks_buckets_and_refuses_other_sizes(tmp_path):
    for bad, match in [([(0, 4)], "positive ints"), ([(4, 8), (4, 8)], "given twice"),
                       ([(4, 8), (8, 16)], "one aspect"), ([], "non-empty"), ([(1 << 16, 1 << 16)], "larger than"),
                       ([(True, 4)], "positive ints")]:
        with pytest.raises(SchemaError, match=match):
            mmstore.Schema({"image": ("|u1", (None, None, 3))}, buckets={"image": bad})
    with pytest.raises(SchemaError, match="image field of its own shape"):
        mmstore.Schema({"image": ("|u1", (4, 8, 3))}, buckets={"image": BUCKETS})
    with pytest.raises(SchemaError, match="unknown field"):
        mmstore.Schema({"image": ("|u1", (None, None, 3))}, buckets={"img": BUCKETS})
    schema = mmstore.Schema({"image": ("|u1", (None, None, 3))}, buckets={"image": BUCKETS})
    assert mmstore.Schema(schema) == schema and mmstore.Schema(schema.fields) == schema  # kept through copies
    assert mmstore.Schema.from_json(schema.to_json()) == schema
    assert schema != mmstore.Schema({"image": ("|u1", (None, None, 3))})
    with pytest.raises(SchemaError, match="none of the field's buckets"):
        schema.validate({"image": np.zeros((5, 5, 3), np.uint8)})
    with pytest.raises(SchemaError, match="none of the field's buckets"), \
            mmstore.StoreWriter(str(tmp_path / "w"), schema, slots=1) as w:
        w.write(0, {"image": np.zeros((4, 9, 3), np.uint8)})


def test_bad_manifest_buckets_are_refused(tmp_path):
    path = write(tmp_path / "s", images())
    with open(os.path.join(path, "manifest.json")) as fh:
        m = json.load(fh)

    def with_buckets(value, field=0):
        doc = json.loads(json.dumps(m))
        doc["schema"][field]["buckets"] = value
        return doc

    bad = [
        (with_buckets("4x8"), "list of \\[h, w\\] pairs"),
        (with_buckets([[4, 8, 1]]), "list of \\[h, w\\] pairs"),
        (with_buckets([[0, 8]]), "positive ints"),
        (with_buckets([[4, -8]]), "positive ints"),
        (with_buckets([[4, 8.0]]), "positive ints"),
        (with_buckets([[4, True]]), "positive ints"),
        (with_buckets([]), "non-empty"),
        (with_buckets([[4, 8], [4, 8]]), "given twice"),
        (with_buckets([[4, 8], [2, 4]]), "one aspect"),
        (with_buckets([[4, 8], [8, 4]]), "tallest to the widest"),
        (with_buckets([[1 << 20, 1 << 20]]), "larger than"),
        (with_buckets([[2, 2]] * 2000), "more than the"),
        (with_buckets([[4, 8]], field=2), "belongs to an image field of its own shape"),
    ]
    for doc, match in bad:
        with pytest.raises(FormatError, match=match):
            parse_manifest(json.dumps(doc).encode())
    parse_manifest(json.dumps(m).encode())  # the original is fine


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_record_outside_the_buckets_is_refused_and_verify_reports_it(tmp_path, backend):
    """A writer that stored a record of another size (entry, size and checksum consistent with each
    other): reads refuse it, verify reports it, bucket_ids names it."""
    imgs = images()
    schema = mmstore.Schema({"image": ("|u1", (None, None, 3), "zstd:3"), "label": ("<i8", ())},
                            buckets={"image": BUCKETS})
    path = str(tmp_path / "s")
    odd = np.zeros((5, 7, 3), np.uint8)
    with mmstore.StoreWriter(path, schema, slots=len(imgs), backend=backend) as w:
        for i, im in enumerate(imgs):
            if i == 2:
                im = odd
            w.slot_writer.write_encoded(i, {"image_hw": np.array(im.shape[:2], "<u4"), "label": np.int64(i)},
                                        {"image": schema["image"].codec.encode(im)})
            w.set_key(i, f"k{i}")
        w.mark_written(list(range(len(imgs))))
    s = mmstore.open(path)
    with pytest.raises(EntryDecodeError, match=r"record 2 .*'image_hw' says 5 x 7 pixels, which is none of"):
        s[2]
    with pytest.raises(EntryDecodeError, match="none of the field's buckets"):
        s.read_batch([0, 2])
    assert s[1]["image"].shape == (4, 8, 3)
    rep = mmstore.verify(path)
    assert [(b.what, b.slot) for b in rep.bad_records] == [("shape", 2)], rep
    assert "none of the field's buckets" in rep.bad_records[0].found
    with pytest.raises(EntryDecodeError, match=r"row 2: 'image_hw' says 5 x 7.*1 such row"):
        bucket_ids(s.schema["image"], s.column("image_hw"))
    rep = inspect_store(path, sample=0, cache=False)  # inspect still describes the store, and says what is wrong
    assert rep.image_buckets is None and any("none of its buckets" in n for n in rep.notes), rep.notes
