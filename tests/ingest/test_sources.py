"""Every source kind through the CLI / library, keys, labels, scan rules."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mmstore
from mmstore.errors import IngestError
from mmstore.ingest import from_dataset, ingest

cv2 = pytest.importorskip("cv2")


def test_imagefolder_labels_keys_fields(folder, tmp_path, h):
    root, rels = folder
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", root, dest, "--size", "24x32", "--workers", "1", "--quiet") == 0
    s = mmstore.open(dest)
    assert len(s) == len(rels) and s.slots == len(rels)
    assert s.label_names == ["cat", "dog"]
    assert [s.key(i) for i in range(len(s))] == rels
    assert s.column("label").tolist() == [0] * 6 + [1] * 6
    assert s.schema["image"].shape == (24, 32, 3) and s.schema["image"].dtype == np.uint8
    assert s.schema.names == ("image", "label", "orig_size", "box", "dst")
    assert s.schema["orig_size"].dtype.str == "<i4" and s.schema["box"].shape == (4,)
    assert s.schema["dst"].dtype.str == "<i4" and s.schema["dst"].shape == (4,)
    img = cv2.imread(os.path.join(root, rels[0]), cv2.IMREAD_UNCHANGED)
    assert tuple(s[0]["orig_size"]) == img.shape[:2]
    assert s[0]["dst"].tolist() == [0, 0, 32, 24]  # center-crop fills the record
    prov = s.provenance
    assert prov["resize"] == "center-crop" and prov["size"] == [24, 32]
    assert len(prov["ingest"]["fingerprint"]) == 32
    assert not os.path.exists(dest + ".partial") and not os.path.exists(dest + ".lock")


def test_flat_folder_recursive_no_labels_and_scan_rules(tmp_path, h):
    root = tmp_path / "flat"
    (root / "sub" / "deeper").mkdir(parents=True)
    rng = np.random.default_rng(1)
    h.write_image(str(root / "a.jpg"), h.photo(rng, 30, 40))
    h.write_image(str(root / "sub" / "b.png"), h.photo(rng, 30, 40), ".png")
    h.write_image(str(root / "sub" / "deeper" / "c.jpeg"), h.photo(rng, 30, 40))
    # a PNG named .jpg is an image; a PNG without extension is sniffed in
    h.write_image(str(root / "png_named.jpg"), h.photo(rng, 30, 40), ".png")
    h.write_image(str(root / "noext"), h.photo(rng, 30, 40), ".png")
    (root / "README.txt").write_text("not an image")
    (root / "labels.csv").write_text("a,b\n")
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / ".git").mkdir()
    h.write_image(str(root / ".git" / "hidden.jpg"), h.photo(rng, 30, 40))
    (root / "dir.jpg").mkdir()  # a directory named like an image is walked, not read
    h.write_image(str(root / "dir.jpg" / "inside.jpg"), h.photo(rng, 30, 40))
    dest = str(tmp_path / "s.store")
    res = ingest(str(root), dest, (16, 16), workers=0, quiet=True)
    s = mmstore.open(dest)
    keys = [s.key(i) for i in range(len(s))]
    assert keys == ["a.jpg", "dir.jpg/inside.jpg", "noext", "png_named.jpg", "sub/b.png", "sub/deeper/c.jpeg"]
    assert "label" not in s.schema and s.label_names is None
    assert res.skipped == 0
    assert res.warnings.get("ignored (not an image by content)") == 2


def test_folder_byte_sorted_order(tmp_path, h):
    root = tmp_path / "o"
    root.mkdir()
    rng = np.random.default_rng(2)
    names = ["B.jpg", "a.jpg", "_x.jpg", "Z.jpg", "é.jpg", "10.jpg", "9.jpg"]
    for n in names:
        h.write_image(str(root / n), h.photo(rng, 20, 20))
    dest = str(tmp_path / "s.store")
    ingest(str(root), dest, 8, workers=0, quiet=True)
    s = mmstore.open(dest)
    assert [s.key(i) for i in range(len(s))] == sorted(names, key=os.fsencode)


def test_non_utf8_file_names_round_trip(tmp_path, h):
    root = os.fsencode(str(tmp_path / "raw"))
    os.mkdir(root)
    rng = np.random.default_rng(3)
    names = [b"caf\xe9.jpg", b"\xff\xfe.png", b"ok.jpg"]
    for n in names:
        h.write_image(os.path.join(root, n), h.photo(rng, 20, 20), ".png" if n.endswith(b".png") else ".jpg")
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", os.fsdecode(root), dest, "--size", "8x8", "--workers", "2", "-q") == 0
    s = mmstore.open(dest)
    assert [os.fsencode(s.key(i)) for i in range(len(s))] == sorted(names)
    for i in range(len(s)):
        assert os.path.isfile(os.path.join(root, os.fsencode(s.key(i))))


def test_csv_string_labels_root_and_missing_rows(tmp_path, h):
    imgs = tmp_path / "pics"
    imgs.mkdir()
    rng = np.random.default_rng(4)
    for n in ["x1.jpg", "x2.jpg", "x3.png"]:
        h.write_image(str(imgs / n), h.photo(rng, 25, 30), os.path.splitext(n)[1])
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\nx2.jpg,zebra\nx1.jpg,ant\nmissing.jpg,ant\nx3.png,zebra\npics,ant\n")
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", str(lst), dest, "--size", "8x8", "--root", str(imgs), "-q", "--workers", "1") == 0
    s = mmstore.open(dest)
    # list order is kept (it is the user's order); string labels sorted -> ints
    assert s.label_names == ["ant", "zebra"]
    assert s.slots == 5 and len(s) == 3
    assert [s.key(i) for i in range(3)] == ["x2.jpg", "x1.jpg", "x3.png"]
    assert s.column("label").tolist() == [1, 0, 1]
    errs = s.skipped()
    assert [e["key"] for e in errs] == ["missing.jpg", "pics"]
    assert all(e["reason"].startswith("unreadable") for e in errs)


def test_tsv_int_labels_and_path_template(tmp_path, h):
    # Google Landmarks 2020 layout: id abcdef... lives at a/b/c/abcdef....jpg
    root = tmp_path / "train"
    rng = np.random.default_rng(5)
    ids = ["abc123", "0f9e8d", "abd000"]
    for i in ids:
        d = root / i[0] / i[1] / i[2]
        d.mkdir(parents=True, exist_ok=True)
        h.write_image(str(d / f"{i}.jpg"), h.photo(rng, 30, 30))
    lst = tmp_path / "train.tsv"
    lst.write_text("id\tlandmark_id\n" + "".join(f"{i}\t{k * 1000 + 7}\n" for k, i in enumerate(ids)))
    dest = str(tmp_path / "s.store")
    rc = h.cli("ingest", str(lst), dest, "--size", "16x16", "--root", str(root), "--path-column", "id",
               "--label-column", "landmark_id", "--path-template", "{id[0]}/{id[1]}/{id[2]}/{id}.jpg", "-q")
    assert rc == 0
    s = mmstore.open(dest)
    assert len(s) == 3 and s.label_names is None
    assert s.column("label").tolist() == [7, 1007, 2007]
    assert [s.key(i) for i in range(3)] == ids


def test_lmdb_source_keys_kept(tmp_path, h):
    lmdb = pytest.importorskip("lmdb")
    path = str(tmp_path / "bedroom_lmdb")
    rng = np.random.default_rng(6)
    env = lmdb.open(path, map_size=1 << 26)
    blobs = {}
    with env.begin(write=True) as txn:
        for k in [b"f00d", b"0abc", b"beef"]:
            ok, buf = cv2.imencode(".webp", h.photo(rng, 30, 40), [cv2.IMWRITE_WEBP_QUALITY, 80])
            blobs[k] = buf.tobytes()
            txn.put(k, blobs[k])
        txn.put(b"zz_bad", b"garbage")
    env.close()
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", path, dest, "--size", "16x16", "-q", "--workers", "2") == 0
    s = mmstore.open(dest)
    assert s.slots == 4 and len(s) == 3
    assert [s.key(i) for i in range(3)] == ["0abc", "beef", "f00d"]
    assert s.skipped()[0]["key"] == "zz_bad"
    from mmstore.decode import DecodeSpec, decode_image

    ref = decode_image(blobs[b"beef"], DecodeSpec((16, 16))).image
    assert np.array_equal(s[1]["image"], ref)


def test_npy_and_npz_sources(tmp_path, h):
    arr = np.arange(5 * 4 * 3, dtype=np.float32).reshape(5, 4, 3)
    np.save(tmp_path / "a.npy", arr)
    dest = str(tmp_path / "a.store")
    assert h.cli("ingest", str(tmp_path / "a.npy"), dest, "-q") == 0
    s = mmstore.open(dest)
    assert s.schema.names == ("image",) and s.schema["image"].dtype.str == "<f4"
    assert np.array_equal(s.column("image"), arr)
    imgs = np.random.default_rng(0).integers(0, 255, (6, 20, 30, 3), dtype=np.uint8)
    np.savez(tmp_path / "b.npz", images=imgs, labels=np.arange(6) % 2)
    dest2 = str(tmp_path / "b.store")
    assert h.cli("ingest", str(tmp_path / "b.npz"), dest2, "--size", "10x10", "-q", "--resize", "stretch") == 0
    s2 = mmstore.open(dest2)
    assert s2.column("label").tolist() == [0, 1, 0, 1, 0, 1]
    ref = cv2.resize(imgs[2], (10, 10), interpolation=cv2.INTER_AREA)
    assert np.array_equal(s2[2]["image"], ref)
    assert s2[2]["orig_size"].tolist() == [20, 30]


class _DS:
    classes = ["even", "odd"]

    def __init__(self, n=7, kind="numpy"):
        self.n = n
        self.kind = kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = np.full((12, 10, 3), i * 10, np.uint8)
        img[0, 0] = (1, 2, 3)
        if self.kind == "tensor":
            import torch

            return torch.from_numpy(img).permute(2, 0, 1).contiguous(), torch.tensor(i % 2)
        if self.kind == "pil":
            from PIL import Image

            return Image.fromarray(img), i % 2
        if self.kind == "bare":
            return img
        return img, i % 2


@pytest.mark.parametrize("kind", ["numpy", "tensor", "pil", "bare"])
def test_from_dataset(tmp_path, kind):
    if kind == "tensor":
        pytest.importorskip("torch")
    if kind == "pil":
        pytest.importorskip("PIL")
    dest = str(tmp_path / "d.store")
    res = from_dataset(_DS(kind=kind), dest, workers=2 if kind != "tensor" else 0, quiet=True)
    s = mmstore.open(dest)
    assert res.records == 7 and len(s) == 7
    assert s.schema["image"].shape == (12, 10, 3)
    want = _DS()[3][0]
    assert np.array_equal(s[3]["image"], want)
    if kind == "bare":
        assert "label" not in s.schema
    else:
        assert s.column("label").tolist() == [i % 2 for i in range(7)]
        assert s.label_names == ["even", "odd"]
    assert s.key(4) == "4"


def test_from_dataset_with_size_fits(tmp_path):
    dest = str(tmp_path / "d.store")
    from_dataset(_DS(), dest, (6, 6), resize="stretch", workers=0, quiet=True)
    s = mmstore.open(dest)
    ref = cv2.resize(_DS()[5][0], (6, 6), interpolation=cv2.INTER_AREA)
    assert np.array_equal(s[5]["image"], ref) and s[5]["orig_size"].tolist() == [12, 10]


def test_empty_source_is_an_error_and_creates_nothing(tmp_path, h, capsys):
    root = tmp_path / "empty"
    root.mkdir()
    (root / "notes.txt").write_text("x")
    dest = tmp_path / "out" / "s.store"
    assert h.cli("ingest", str(root), str(dest), "--size", "8x8") == 2
    assert "no inputs found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(IngestError):
        ingest(str(root), str(dest), 8)
    assert not (tmp_path / "out").exists()
    lst = tmp_path / "l.csv"
    lst.write_text("path\n")
    assert h.cli("ingest", str(lst), str(dest), "--size", "8x8", "-q") == 2
    assert not (tmp_path / "out").exists()


def test_usage_errors(tmp_path, h, capsys):
    root = tmp_path / "i"
    h.make_folder(str(root), per_class=1)
    assert h.cli("ingest", str(root), str(tmp_path / "x"), "-q") == 2  # no --size
    assert "--size" in capsys.readouterr().err
    assert h.cli("ingest", str(root), str(tmp_path / "x"), "--size", "abc") == 2
    assert h.cli("ingest", str(root), str(tmp_path / "x"), "--size", "8x8", "--root", "r") == 2  # list-only option
    assert h.cli("ingest", str(tmp_path / "nope"), str(tmp_path / "x"), "--size", "8x8") == 2
    assert h.cli("ingest", str(root), str(tmp_path / "x"), "--size", "8x8", "--shard", "4/4") == 2


def test_directory_symlink_loop_not_followed_and_dir_symlink_followed(tmp_path, h):
    root = tmp_path / "loops"
    (root / "a").mkdir(parents=True)
    other = tmp_path / "elsewhere"
    other.mkdir()
    rng = np.random.default_rng(30)
    h.write_image(str(root / "a" / "x.jpg"), h.photo(rng, 20, 20))
    h.write_image(str(other / "y.jpg"), h.photo(rng, 20, 20))
    os.symlink("..", root / "a" / "up")  # a loop back to the root
    os.symlink(str(other), root / "linked")  # a symlinked directory is walked
    dest = str(tmp_path / "s.store")
    res = ingest(str(root), dest, 8, workers=0, quiet=True, labels="none")
    s = mmstore.open(dest)
    assert [s.key(i) for i in range(len(s))] == ["a/x.jpg", "linked/y.jpg"]
    assert res.warnings.get("directory symlink loops not followed") == 1


def test_headerless_txt_list(tmp_path, h):
    rng = np.random.default_rng(31)
    for n in ["p1.jpg", "p2.jpg"]:
        h.write_image(str(tmp_path / n), h.photo(rng, 20, 20))
    (tmp_path / "files.txt").write_text("p2.jpg\np1.jpg\nnope.jpg\n")
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", str(tmp_path / "files.txt"), dest, "--size", "8x8", "-q") == 0
    s = mmstore.open(dest)
    assert s.slots == 3 and [s.key(i) for i in range(2)] == ["p2.jpg", "p1.jpg"]
    assert "label" not in s.schema
    # forced: the first row is data even when it is not a file
    (tmp_path / "ids.csv").write_text("gone.jpg\np1.jpg\n")
    d2 = str(tmp_path / "t.store")
    assert h.cli("ingest", str(tmp_path / "ids.csv"), d2, "--size", "8x8", "-q", "--no-header") == 0
    assert mmstore.open(d2).slots == 2


def test_npz_arrays_not_stored_are_named(tmp_path):
    """Arrays of a .npz other than the image and label ones are not stored;
    the result says which, instead of dropping them silently."""
    from mmstore.ingest import ingest

    imgs = np.random.default_rng(1).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "c.npz", images=imgs, labels=np.arange(4), thumb=imgs[:, :2, :2], meta=np.arange(3))
    res = ingest(str(tmp_path / "c.npz"), str(tmp_path / "c.store"), quiet=True)
    notes = [k for k in res.warnings if "not stored" in k]
    assert notes == ["array(s) of the .npz not stored (only 'images' and 'labels' are read): 'thumb', 'meta'"]
    assert res.warnings[notes[0]] == 2
    assert "note: 2 array(s) of the .npz not stored" in res.summary()
    np.savez(tmp_path / "d.npz", images=imgs, labels=np.arange(4))
    res = ingest(str(tmp_path / "d.npz"), str(tmp_path / "d.store"), quiet=True)
    assert not [k for k in res.warnings if "not stored" in k]


def test_a_row_label_outside_the_label_names_is_a_hole_with_its_reason(tmp_path):
    """Rows (what mmstore.ray.write ingests) with ``label_names``: a label that numbers none of them is a
    hole listed with its reason, never a record whose label has no name."""
    import cv2

    from mmstore.ingest.rows import RowsSource

    rng = np.random.default_rng(0)
    images = [cv2.imencode(".png", rng.integers(0, 256, (12, 10, 3), dtype=np.uint8))[1].tobytes() for _ in range(4)]
    cols = {"image": images, "label": [0, 2, 7, -1], "key": ["a", "b", "c", "d"]}
    r = ingest(RowsSource(cols, label_names=["cat", "dog", "fox"]), str(tmp_path / "s"), size=8, workers=0,
               quiet=True)
    with mmstore.open(r.path) as s:
        assert len(s) == 2 and s.column("label").tolist() == [0, 2] and s.label_names == ["cat", "dog", "fox"]
        reasons = {e["key"]: e["reason"] for e in s.skipped()}
    assert reasons == {"c": "bad-label: 7 is not a number of the 3 label names (0..2)",
                       "d": "bad-label: -1 is not a number of the 3 label names (0..2)"}
