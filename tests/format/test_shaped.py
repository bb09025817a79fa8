"""Fields of images of their own shape (format 2.3, "Images of their own shape"): the schema and its
companion ``<name>_hw`` field, every codec and backend, segments, plain numpy, what older readers and a
damaged manifest or entry give."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mmstore
from mmstore.errors import EntryDecodeError, FormatError, SchemaError, VersionError
from mmstore.format import layout
from mmstore.format.codecs import parse_codec
from mmstore.ingest import merge

cv2 = pytest.importorskip("cv2")
SIZES = [(5, 7), (9, 3), (1, 20), (16, 16)]


def images(channels: int | None, dtype=np.uint8, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    top = np.iinfo(dtype).max
    return [rng.integers(0, top, (h, w) if channels is None else (h, w, channels), dtype=dtype) for h, w in SIZES]


def write(path, imgs, shape, codec="raw", dtype="|u1", backend="memmap", holes=()) -> str:
    schema = mmstore.Schema({"image": (dtype, shape, codec), "label": ("<i8", ())})
    with mmstore.StoreWriter(path, schema, slots=len(imgs), backend=backend) as w:
        for i, im in enumerate(imgs):
            if i in holes:
                w.skip(i, f"k{i}", "test hole")
            else:
                w.write(i, {"image": im, "label": i}, key=f"k{i}")
    return str(path)


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize(("shape", "channels", "codec", "dtype"), [
    ((None, None, 3), 3, "raw", np.uint8), ((None, None), None, "zstd:3", np.uint8),
    ((None, None, 1), 1, "png:1", np.uint8), ((None, None, 4), 4, "png:1", np.uint16),
    ((None, None, 3), 3, "jpeg:95", np.uint8), ((None, None), None, "raw", np.float32),
])
def test_every_codec_and_backend_round_trips(tmp_path, backend, shape, channels, codec, dtype):
    if dtype == np.float32:
        imgs = [np.random.default_rng(1).random(hw, np.float32) for hw in SIZES]
    else:
        imgs = images(channels, dtype)
    path = write(tmp_path / "s", imgs, shape, codec, np.dtype(dtype).newbyteorder("<").str, backend, holes=(1,))
    s = mmstore.open(path)
    assert s.manifest["version"] == (2, 3) and s.manifest["requires"] == ["shapes"]
    kept = [im for i, im in enumerate(imgs) if i != 1]
    for i, im in enumerate(kept):
        got = s[i]["image"]
        assert got.shape == im.shape and got.dtype == im.dtype and s[i]["image_hw"].tolist() == list(im.shape[:2])
        if codec.startswith("jpeg"):
            c = parse_codec(codec)
            assert np.array_equal(got, c.decode(c.encode(im), np.uint8, im.shape))
        else:
            assert np.array_equal(got, im)
    b = s.read_batch([2, 0, 2, 1])
    assert [x.shape for x in b["image"]] == [kept[j].shape for j in (2, 0, 2, 1)]
    assert s.read_batch([], fields="image")["image"] == []
    assert [r["image"].shape for r in s] == [im.shape for im in kept]
    assert mmstore.verify(path, decode=True).ok


def test_schema_adds_and_checks_the_companion_field(tmp_path):
    s = mmstore.Schema({"image": ("|u1", (None, None, 3)), "y": ("<i8", ())})
    assert s.names == ("image", "image_hw", "y") and s["image_hw"].shape == (2,) and s["image"].shaped
    assert s.has_shaped and not s["image"].nbytes and s["image"].variable
    assert mmstore.Schema.from_json(s.to_json()) == s
    out = s.validate({"image": np.zeros((4, 6, 3), np.uint8), "y": 1})
    assert out["image_hw"].tolist() == [4, 6]
    with pytest.raises(SchemaError, match="is \\[4, 6\\]"):
        s.validate({"image": np.zeros((4, 6, 3), np.uint8), "image_hw": [6, 4], "y": 1})
    with pytest.raises(SchemaError, match="at least 1 x 1"):
        s.validate({"image": np.zeros((0, 6, 3), np.uint8), "y": 1})
    with pytest.raises(SchemaError, match="expected an image of shape \\(h, w, 3\\)"):
        s.validate({"image": np.zeros((4, 6), np.uint8), "y": 1})
    with pytest.raises(SchemaError, match="companion of the image field"):
        mmstore.Schema({"image": ("|u1", (None, None, 3)), "image_hw": ("<i8", (2,))})
    with pytest.raises(SchemaError, match="jpeg"):
        mmstore.Schema({"image": ("<f4", (None, None, 3), "jpeg:90")})
    with pytest.raises(SchemaError, match="C from 1 to 4"):
        mmstore.Schema({"image": ("|u1", (None, None, 5))})
    # write_batch fills the sizes from the images
    with mmstore.StoreWriter(tmp_path / "b", s, slots=2) as w:
        w.write_batch(0, {"image": [np.ones((2, 3, 3), np.uint8), np.ones((5, 1, 3), np.uint8)], "y": [0, 1]})
    assert mmstore.open(tmp_path / "b").column("image_hw").tolist() == [[2, 3], [5, 1]]


def test_segments_merge_and_plain_numpy(tmp_path):
    imgs = images(3)
    parts = [write(tmp_path / f"p{k}", imgs[2 * k : 2 * k + 2], (None, None, 3), "zstd:3") for k in range(2)]
    m = mmstore.open(merge(parts, str(tmp_path / "m")))
    assert m.segments == [2, 2] and [m[i]["image"].shape for i in range(4)] == [im.shape for im in imgs]
    for name in os.listdir(tmp_path / "m"):
        if name.endswith(".npy"):
            np.load(tmp_path / "m" / name, allow_pickle=False)
    assert mmstore.verify(str(tmp_path / "m"), decode=True).ok


def _manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def test_older_readers_and_bad_manifests_are_refused(tmp_path, monkeypatch):
    path = write(tmp_path / "s", images(3), (None, None, 3))
    m = _manifest(path)
    with monkeypatch.context() as mp:  # a 2.2 reader: it knows ragged fields and parts, not shapes
        mp.setattr(layout, "KNOWN_FEATURES", (layout.RAGGED_FEATURE, layout.PARTS_FEATURE))
        with pytest.raises(VersionError, match=r"requires feature\(s\) \['shapes'\].*upgrade mmstore"):
            mmstore.open(path)
    from mmstore.format import parse_manifest

    bad = [
        ({**m, "requires": []}, "need format version 2.3"),
        ({**m, "version": [2, 2]}, "need format version 2.3"),
        ({**m, "schema": [m["schema"][0], m["schema"][2]]}, "companion field 'image_hw'"),
        ({**m, "schema": [m["schema"][0], {**m["schema"][1], "dtype": "<i8"}, m["schema"][2]]}, "companion"),
        ({**m, "schema": [{**m["schema"][0], "shape": [None, None, 3, 1]}, *m["schema"][1:]]}, "C from 1 to 4"),
    ]
    for doc, match in bad:
        with pytest.raises(FormatError, match=match):
            parse_manifest(json.dumps(doc).encode())


def test_an_entry_is_checked_against_its_size(tmp_path):
    for codec in ("raw", "zstd", "png", "jpeg"):
        path = write(tmp_path / codec, images(3), (None, None, 3), codec)
        hw = np.load(os.path.join(path, "image_hw.npy"), mmap_mode="r+")
        hw[2] = [20, 1]  # the same pixel count, another shape: the codecs' headers say otherwise
        hw[3] = [16, 17]
        hw.flush()
        del hw
        s = mmstore.open(path)
        if codec in ("png", "jpeg"):
            with pytest.raises(EntryDecodeError, match=rf"record 2 .*'image'.*{codec.upper()} of 1 x 20"):
                s[2]
        else:  # raw and zstd entries carry no shape: a size with the same pixel count reads (verify's checksum)
            assert s[2]["image"].shape == (20, 1, 3)
        with pytest.raises(EntryDecodeError, match=r"record 3 .*'image_hw' says 16 x 17"):
            s.read_batch([3])
        rep = mmstore.verify(path)
        assert {(b.what, b.slot) for b in rep.bad_records} >= {("shape", 3), ("checksum", 3), ("checksum", 2)}


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_verify_finds_a_size_that_lies_under_a_valid_checksum(tmp_path, backend):
    """A writer that stored a wrong size (its checksum computed over it, so consistent): verify's full
    pass finds the entry that does not fit, and reads refuse it."""
    imgs = images(3)
    schema = mmstore.Schema({"image": ("|u1", (None, None, 3), "zstd:3"), "label": ("<i8", ())})
    path = str(tmp_path / "s")
    with mmstore.StoreWriter(path, schema, slots=len(imgs), backend=backend) as w:
        for i, im in enumerate(imgs):
            hw = np.array([im.shape[0] + (i == 2), im.shape[1]], "<u4")
            w.slot_writer.write_encoded(i, {"image_hw": hw, "label": np.int64(i)},
                                        {"image": schema["image"].codec.encode(im)})
            w.set_key(i, f"k{i}")
        w.mark_written(list(range(len(imgs))))
    rep = mmstore.verify(path)
    assert [(b.what, b.slot) for b in rep.bad_records] == [("shape", 2)], rep
    assert "60 bytes decompressed, but 'image_hw' says 2 x 20 pixels" in rep.bad_records[0].found  # really 1 x 20
    with pytest.raises(EntryDecodeError, match=r"record 2 .*'image_hw' says 2 x 20"):
        mmstore.open(path)[2]
    assert mmstore.open(path)[1]["image"].shape == imgs[1].shape
