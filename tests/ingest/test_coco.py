"""COCO instances JSON source: boxes and polygons in stored pixels (checked against the stored
images' pixels), categories, skipped annotations in errors.jsonl, holes, summary counts,
workers/resume/lmdb byte-identity, verify and --repair."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from support.compare import assert_same_files
from support.faults import flip_bit, rewrite_file
from support.proc import run_cli, run_json

import mmstore
from mmstore.decode.geometry import to_source
from mmstore.errors import IngestError
from mmstore.ingest import ingest

cv2 = pytest.importorskip("cv2")
PIL = pytest.importorskip("PIL.Image")

CATS = [{"id": 1, "name": "person"}, {"id": 3, "name": "car"}, {"id": 7, "name": "unused"}]


def _draw(h, w, rects):
    img = np.zeros((h, w, 3), np.uint8)
    for x, y, bw, bh in rects:
        img[y:y + bh, x:x + bw] = 255
    return img


def _write_exif_jpeg(path, oriented):
    """A JPEG whose pixels are ``oriented`` turned back, with EXIF orientation 6 (rotate 90 CW to show)."""
    from PIL import Image

    raw = np.ascontiguousarray(np.rot90(oriented, 1))  # 90 CCW: the decode's 90 CW turn gives ``oriented``
    ex = Image.Exif()
    ex[0x0112] = 6
    Image.fromarray(raw).save(path, quality=100, subsampling=0, exif=ex.tobytes())


def make_coco(root, bad=True):
    """A small COCO: rectangles drawn where their boxes say. Returns (json path, image dir, {ann id: rect})."""
    imgs = os.path.join(root, "images")
    os.makedirs(imgs)
    spec = [  # file, id, (h, w), [(ann id, cat, rect x y w h, crowd)]
        ("a.png", 11, (60, 80), [(101, 1, (10, 5, 30, 20), 0), (102, 3, (50, 30, 20, 25), 0)]),
        ("b.png", 12, (90, 50), [(103, 1, (0, 0, 20, 40), 0), (104, 3, (28, 58, 22, 32), 1)]),
        ("c.png", 13, (40, 40), []),
        ("d.jpg", 14, (40, 70), [(105, 3, (40, 10, 20, 20), 0)]),  # EXIF orientation 6
        ("e.png", 15, (30, 30), [(106, 1, (1, 1, 5, 5), 0)]),  # file missing: a hole
        ("f.png", 16, (50, 50), [(107, 1, (1, 1, 5, 5), 0)]),  # JSON says 50x50, file is 40x60: a hole
    ]
    images, anns, rects = [], [], {}
    for fn, iid, (h, w), objs in spec:
        images.append({"id": iid, "file_name": fn, "width": w, "height": h})
        img = _draw(h, w, [o[2] for o in objs])
        if fn == "d.jpg":
            _write_exif_jpeg(os.path.join(imgs, fn), img)
        elif fn == "f.png":
            cv2.imwrite(os.path.join(imgs, fn), _draw(40, 60, []))
        elif fn != "e.png":
            cv2.imwrite(os.path.join(imgs, fn), img)
        for aid, cat, (x, y, bw, bh), crowd in objs:
            seg = ({"counts": [0, 5], "size": [h, w]} if crowd else
                   [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]])
            anns.append({"id": aid, "image_id": iid, "category_id": cat, "bbox": [x, y, bw, bh],
                         "iscrowd": crowd, "segmentation": seg, "area": bw * bh})
            rects[aid] = (x, y, x + bw, y + bh)
    if bad:
        anns += [
            {"id": 201, "image_id": 99, "category_id": 1, "bbox": [1, 1, 2, 2]},        # unknown image
            {"id": 202, "image_id": 11, "category_id": 5, "bbox": [1, 1, 2, 2]},        # unknown category
            {"id": 203, "image_id": 11, "category_id": 1, "bbox": [1, 1, -2, 2]},       # negative width
            {"id": 204, "image_id": 12, "category_id": 1, "bbox": [1, float("nan"), 2, 2]},  # not finite
            {"id": 205, "image_id": 12, "category_id": 1},                               # no bbox
            {"id": 206, "image_id": "11", "category_id": 1, "bbox": [1, 1, 2, 2]},      # wrong type
            7,                                                                           # not an object
        ]
    # images listed out of order: records follow the sorted file names
    doc = {"images": images[::-1], "annotations": anns, "categories": CATS}
    path = os.path.join(root, "instances.json")
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return path, imgs, rects


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    return make_coco(str(tmp_path_factory.mktemp("coco")))


def _pixel_box(img, want):
    """The bounding box of the bright pixels near ``want`` (xyxy, stored pixels)."""
    mask = img.max(axis=-1) >= 128
    x0, y0 = (max(0, int(np.floor(v)) - 2) for v in want[:2])
    x1, y1 = (int(np.ceil(v)) + 2 for v in want[2:])
    ys, xs = np.nonzero(mask[y0:y1, x0:x1])
    return np.array([xs.min() + x0, ys.min() + y0, xs.max() + 1 + x0, ys.max() + 1 + y0], float)


def _check_boxes_against_pixels(store, rects):
    n = 0
    for i in range(len(store)):
        r = store[i]
        for box, aid in zip(r["boxes"], r["annotation_id"]):
            assert np.all(np.abs(_pixel_box(r["image"], box) - box) <= 1.0), (store.key(i), aid, box)
            # mapped back: the annotation's source box (no clipping happened at this size)
            assert np.allclose(to_source(box.astype(np.float64)[None], r)[0], rects[int(aid)], atol=1e-3)
            n += 1
    return n


def test_cli_pad_boxes_polygons_errors_summary(tmp_path, coco, capsys):
    path, imgs, rects = coco
    dest = str(tmp_path / "pad")
    rc, _, err = run_cli(["ingest", path, dest, "--root", imgs, "--size", "32x32", "--resize", "pad",
                          "--workers", "0"], capsys)
    assert rc == 0, err
    s = mmstore.open(dest)
    assert s.schema.names == ("image", "orig_size", "box", "dst", "image_id", "boxes", "category", "iscrowd",
                              "annotation_id", "polygon_points", "polygon_sizes", "polygon_box")
    assert s.schema["category"].class_names == {1: "person", 3: "car", 7: "unused"}
    assert s.schema["boxes"].dtype.str == "<f4" and s.schema["boxes"].shape == (None, 4)
    assert [s.key(i) for i in range(len(s))] == ["a.png", "b.png", "c.png", "d.jpg"]
    assert [int(s[i]["image_id"]) for i in range(len(s))] == [11, 12, 13, 14]
    assert s.slots == 6 and s.records == 4
    # letterbox: dst is the picture area, not the record (a.png 60x80 -> 24x32 at rows 4..28)
    assert s[0]["dst"].tolist() == [0, 4, 32, 28] and s[1]["dst"].tolist() == [7, 0, 25, 32]
    assert s[3]["orig_size"].tolist() == [40, 70]  # the EXIF-oriented size
    assert _check_boxes_against_pixels(s, rects) == 5
    assert s[2]["boxes"].shape == (0, 4) and len(s[2]["category"]) == 0  # kept with zero boxes
    b = s[1]
    assert b["category"].tolist() == [1, 3] and b["iscrowd"].tolist() == [0, 1]
    assert b["annotation_id"].tolist() == [103, 104]
    # polygons: the crowd's RLE mask is not stored; the others' outlines equal their boxes here
    assert b["polygon_sizes"].tolist() == [4] and b["polygon_box"].tolist() == [0]
    pts = b["polygon_points"]
    assert np.allclose(pts.min(0), b["boxes"][0][:2]) and np.allclose(pts.max(0), b["boxes"][0][2:])
    a = s[0]
    assert a["polygon_sizes"].tolist() == [4, 4] and a["polygon_box"].tolist() == [0, 1]
    # holes
    holes = {e["key"]: e["reason"] for e in s.skipped()}
    assert set(holes) == {"e.png", "f.png"}
    assert holes["f.png"].startswith("wrong-shape: the annotation file says 50x50") and "60x40" in holes["f.png"]
    # errors.jsonl: the holes by slot, then the skipped annotations in JSON order
    with open(os.path.join(dest, "errors.jsonl")) as fh:
        lines = [json.loads(x) for x in fh]
    assert [ln["slot"] for ln in lines[:2]] == [4, 5] and all("annotation" not in ln for ln in lines[:2])
    ann = lines[2:]
    assert [(x["annotation"], x["id"], x["slot"], x["key"], x["reason"].split(":")[0]) for x in ann] == [
        (7, 201, None, None, "unknown-image"),
        (8, 202, 0, "a.png", "unknown-category"),
        (9, 203, 0, "a.png", "bad-box"),
        (10, 204, 1, "b.png", "bad-box"),
        (11, 205, 1, "b.png", "malformed"),
        (12, 206, None, None, "malformed"),
        (13, None, None, None, "malformed"),
    ]
    assert "no 'bbox'" in ann[4]["reason"] and "not finite" in ann[3]["reason"]
    for want in ("4 records, 2 skipped", "note: 2 annotations skipped, bad-box",
                 "note: 3 annotations skipped, malformed", "note: 1 annotations skipped, unknown-category",
                 "note: 1 annotations skipped, unknown-image",
                 "note: 1 crowd annotations whose RLE mask is not stored"):
        assert want in err, err
    assert "clipped" not in err and "dropped" not in err  # pad keeps every box whole
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 0 and rep["ok"], rep


@pytest.mark.parametrize(("policy", "size"), [("stretch", (24, 40)), ("center-crop", (40, 24)),
                                             ("center-crop", (20, 36)), ("pad", (40, 24))])
def test_boxes_follow_each_resize(tmp_path, coco, policy, size):
    """At other sizes and aspects (boxes cut by a crop included) every stored box is where its
    rectangle's pixels landed, and maps back inside the JSON's box."""
    path, imgs, rects = coco
    dest = str(tmp_path / "s")
    res = ingest(path, dest, size=size, resize=policy, root=imgs, workers=0, quiet=True)
    s = mmstore.open(dest)
    n = 0
    for i in range(len(s)):
        r = s[i]
        x0, y0, x1, y1 = r["dst"].tolist()
        for box, aid in zip(r["boxes"], r["annotation_id"]):
            assert x0 <= box[0] < box[2] <= x1 and y0 <= box[1] < box[3] <= y1
            assert np.all(np.abs(_pixel_box(r["image"], box) - box) <= 1.0), (s.key(i), aid, box)
            back, want = to_source(box.astype(np.float64)[None], r)[0], np.array(rects[int(aid)], float)
            assert np.all(back[:2] >= want[:2] - 1e-3) and np.all(back[2:] <= want[2:] + 1e-3)
            n += 1
    clipped = res.warnings.get("boxes clipped to the picture area", 0)
    dropped = sum(v for k, v in res.warnings.items() if k.startswith("boxes dropped"))
    assert n + dropped == 5 and (clipped > 0) == (policy == "center-crop") and (dropped > 0) == (size == (20, 36))


def test_malformed_json_and_top_level(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"images": [\n  {"id": 1, "file_name": "x.png"},\n  oops\n]}')
    with pytest.raises(IngestError, match=r"line 3 column 3"):
        ingest(str(bad), str(tmp_path / "o"), size=16, quiet=True)
    no_images = tmp_path / "noimg.json"
    no_images.write_text('{"annotations": [], "categories": []}')
    with pytest.raises(IngestError, match="'images' list"):
        ingest(str(no_images), str(tmp_path / "o"), size=16, quiet=True)
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps({"images": [{"id": 1, "file_name": "x.png"}], "annotations": [],
                               "categories": [{"id": 1, "name": "a"}, {"id": 1, "name": "b"}]}))
    with pytest.raises(IngestError, match="category id 1 appears twice"):
        ingest(str(dup), str(tmp_path / "o"), size=16, quiet=True)
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(str(tmp_path / "o") + ".partial")


def _crop_coco(root):
    """One 64x64 image, three boxes against a 32 (h) x 16 (w) center crop (source columns 16..48)."""
    os.makedirs(os.path.join(root, "im"))
    rects = [(20, 5, 10, 10), (40, 30, 20, 10), (50, 20, 14, 10)]  # inside, clipped, outside (dropped)
    cv2.imwrite(os.path.join(root, "im", "g.png"), _draw(64, 64, rects))
    doc = {"images": [{"id": 1, "file_name": "g.png", "width": 64, "height": 64}],
           "annotations": [{"id": k + 1, "image_id": 1, "category_id": 1, "bbox": list(r),
                            "segmentation": [[r[0], r[1], r[0] + r[2], r[1], r[0], r[1] + r[3]]]}
                           for k, r in enumerate(rects)],
           "categories": [{"id": 1, "name": "thing"}]}
    path = os.path.join(root, "g.json")
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return path, os.path.join(root, "im")


def test_center_crop_clip_and_drop_counted(tmp_path):
    path, imgs = _crop_coco(str(tmp_path))
    res = ingest(path, str(tmp_path / "c"), size=(32, 16), resize="center-crop", root=imgs, workers=0, quiet=True)
    r = mmstore.open(str(tmp_path / "c"))[0]
    assert r["box"].tolist() == [16, 0, 48, 64] and r["dst"].tolist() == [0, 0, 16, 32]
    assert r["annotation_id"].tolist() == [1, 2]  # the box outside the crop is dropped with its polygon
    assert r["boxes"].tolist() == [[2, 2.5, 7, 7.5], [12, 15, 16, 20]]  # scale 0.5, clipped at x = 16
    assert r["polygon_box"].tolist() == [0, 1] and r["polygon_sizes"].tolist() == [3, 4]  # cut triangle: 4 points
    assert float(r["polygon_points"][:, 0].max()) == 16.0
    assert res.warnings["boxes clipped to the picture area"] == 1
    assert res.warnings["boxes dropped (under 1 stored pixel(s) wide or high after the clip)"] == 1
    assert "note: 1 boxes clipped" in res.summary()
    # --min-box-size: the clipped box (4 px wide) is dropped too at 5
    res = ingest(path, str(tmp_path / "c5"), size=(32, 16), resize="center-crop", root=imgs, workers=0,
                 quiet=True, min_box_size=5)
    assert mmstore.open(str(tmp_path / "c5"))[0]["annotation_id"].tolist() == [1]
    assert res.warnings["boxes dropped (under 5 stored pixel(s) wide or high after the clip)"] == 2


def test_resize_none_is_the_identity(tmp_path):
    path, imgs = _crop_coco(str(tmp_path))
    ingest(path, str(tmp_path / "n"), size=64, resize="none", root=imgs, workers=0, quiet=True)
    r = mmstore.open(str(tmp_path / "n"))[0]
    assert r["box"].tolist() == r["dst"].tolist() == [0, 0, 64, 64]
    assert r["boxes"].tolist() == [[20, 5, 30, 15], [40, 30, 60, 40], [50, 20, 64, 30]]
    with pytest.raises(IngestError, match="need a target size"):
        ingest(path, str(tmp_path / "x"), root=imgs, workers=0, quiet=True)


def test_workers_resume_and_lmdb_identical(tmp_path, coco, h):
    path, imgs, _ = coco
    one = str(tmp_path / "w1")
    ingest(path, one, size=(24, 20), resize="stretch", root=imgs, workers=0, quiet=True)
    two = str(tmp_path / "w2")
    ingest(path, two, size=(24, 20), resize="stretch", root=imgs, workers=2, chunk=1, quiet=True)
    assert_same_files(one, two)
    # crash after the first commits, then resume (another worker count): the same store
    for k in (1, 3):
        dest = str(tmp_path / f"crash{k}")
        p = h.cli_subprocess("ingest", path, dest, "--root", imgs, "--size", "24x20", "--resize", "stretch",
                             "--workers", "0", "--chunk", "1", "-q", env={"MMSTORE_CRASH_AT": f"commit:{k}"},
                             stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 77, err
        p = h.cli_subprocess("ingest", path, dest, "--root", imgs, "--size", "24x20", "--resize", "stretch",
                             "--workers", "2", "-q", "--resume")
        assert p.wait(120) == 0
        assert_same_files(one, dest)
    lm = str(tmp_path / "lm")
    ingest(path, lm, size=(24, 20), resize="stretch", root=imgs, workers=2, backend="lmdb", quiet=True)
    a, b = mmstore.open(one), mmstore.open(lm)
    assert len(a) == len(b) == 4 and a.skipped() == b.skipped()
    for i in range(len(a)):
        for f in a.schema.names:
            assert np.array_equal(a[i][f], b[i][f]), f
    with open(os.path.join(one, "errors.jsonl"), "rb") as x, open(os.path.join(lm, "errors.jsonl"), "rb") as y:
        assert x.read() == y.read()


def test_resume_refused_when_the_json_changed(tmp_path):
    path, imgs = _crop_coco(str(tmp_path))
    dest = str(tmp_path / "r")
    ingest(path, dest, size=16, root=imgs, workers=0, quiet=True)
    with open(path) as fh:
        doc = json.load(fh)
    doc["annotations"][0]["bbox"] = [21, 5, 10, 10]
    with open(path, "w") as fh:
        json.dump(doc, fh)
    with pytest.raises(mmstore.errors.StoreExistsError):  # another ingest: not "already complete"
        ingest(path, dest, size=16, root=imgs, workers=0, quiet=True, resume=True)


def test_verify_catches_a_damaged_annotation_line(tmp_path, coco, capsys):
    path, imgs, _ = coco
    dest = str(tmp_path / "v")
    ingest(path, dest, size=16, root=imgs, workers=0, quiet=True)
    with open(os.path.join(dest, "errors.jsonl"), "rb") as fh:
        lines = fh.read().splitlines()
    good = b"\n".join(lines) + b"\n"
    for bad_line, what in ((b'{"slot": 0, "key": "b.png", "annotation": 8, "id": 202, "reason": "x"}', "differs"),
                           (b'{"slot": null, "key": "a.png", "annotation": 7, "id": 201, "reason": "x"}', "has a key"),
                           (b'{"slot": null, "key": null, "annotation": "7", "id": 201, "reason": "x"}',
                            "not a valid")):
        damaged = b"\n".join(lines[:2] + [bad_line] + lines[3:]) + b"\n"
        rewrite_file(dest, "errors.jsonl", damaged, digest=True)
        rc, rep = run_json(["verify", dest], capsys)
        assert rc == 1 and any(what in p["message"] for p in rep["problems"]), rep
    rewrite_file(dest, "errors.jsonl", good, digest=True)
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 0, rep


def test_no_holes_but_skipped_annotations(tmp_path, capsys):
    """errors.jsonl exists for skipped annotations alone (no holes, no _index.npy); verify agrees."""
    path, imgs = _crop_coco(str(tmp_path))
    with open(path) as fh:
        doc = json.load(fh)
    doc["annotations"].append({"id": 9, "image_id": 1, "category_id": 2, "bbox": [0, 0, 4, 4]})
    with open(path, "w") as fh:
        json.dump(doc, fh)
    dest = str(tmp_path / "n")
    ingest(path, dest, size=16, root=imgs, workers=0, quiet=True)
    s = mmstore.open(dest)
    assert s.records == s.slots == 1 and s.skipped() == [] and not os.path.exists(os.path.join(dest, "_index.npy"))
    with open(os.path.join(dest, "errors.jsonl")) as fh:
        assert json.loads(fh.read())["reason"].startswith("unknown-category: category_id 2")
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 0, rep


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_repair_rederives_the_record(tmp_path, coco, backend, capsys):
    path, imgs, _ = coco
    dest = str(tmp_path / "s")
    ingest(path, dest, size=(24, 24), resize="pad", root=imgs, workers=0, backend=backend, quiet=True)
    fresh = str(tmp_path / "fresh")
    shutil.copytree(dest, fresh)
    with mmstore.open(dest) as s:
        slot = s.slot_view.slot(1)
        if backend == "memmap":
            p, off, nb = s.slot_view.backend.field_location("image")
    if backend == "memmap":
        flip_bit(p, off + slot * nb + 5, bit=2)
    else:
        from support.faults import flip_lmdb_bits

        flip_lmdb_bits(dest, [slot], 7, mask=8)
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 1 and rep["bad_records"][0]["key"] == "b.png"
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 0 and rep["repair"]["repaired"] == [slot], rep
    assert_same_files(dest, fresh)


def test_guide_snippet_runs(tmp_path, coco, monkeypatch):
    """The COCO guide snippet, unchanged, on the synthetic COCO."""
    pytest.importorskip("torch")
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = os.path.join(root, "docs", "guides", "coco.md")
    with open(readme, encoding="utf-8") as fh:
        m = re.search(r"<!-- test: coco -->\n```python\n(.*?)```", fh.read(), re.DOTALL)
    assert m, "the guide's COCO snippet is missing"
    path, imgs, rects = coco
    monkeypatch.chdir(tmp_path)
    ingest(path, "coco_val.store", size=(48, 64), resize="pad", root=imgs, workers=0, quiet=True)
    ns: dict = {}
    exec(compile(m.group(1), "docs/guides/coco.md", "exec"), ns)  # noqa: S102 - the README snippet is the test
    assert ns["names"] == {1: "person", 3: "car", 7: "unused"}
    assert len(ns["results"]) == 5
    # the stored boxes mapped back are the JSON's boxes (to float32 rounding), as COCO's [x, y, w, h]
    ann = {(11, 1): 101, (11, 3): 102, (12, 1): 103, (12, 3): 104, (14, 3): 105}  # (image, category) -> id
    for r in ns["results"]:
        x0, y0, x1, y1 = rects[ann[(r["image_id"], r["category_id"])]]
        assert np.allclose(r["bbox"], [x0, y0, x1 - x0, y1 - y0], atol=1e-3), r


def test_shards_merge_and_convert_keep_the_annotation_lines(tmp_path, coco):
    path, imgs, _ = coco
    kw = {"size": (16, 16), "root": imgs, "workers": 0, "quiet": True}
    one = str(tmp_path / "one")
    ingest(path, one, **kw)
    parts = [str(tmp_path / f"p{k}") for k in range(6)]
    for k, p in enumerate(parts):
        ingest(path, p, shard=(k, 6), **kw)
    # each part lists the skipped annotations of its own images; those of no image only part 0
    counts = []
    for p in parts:
        with mmstore.open(p) as st:
            counts.append(len(st.skipped_annotations()))
    assert counts == [5, 2, 0, 0, 0, 0]
    merged = str(tmp_path / "merged")
    mmstore.merge(parts, merged)
    conv = str(tmp_path / "conv")
    from mmstore.check.convert import convert_store

    convert_store(one, conv, backend="lmdb")

    def read(d):
        with open(os.path.join(d, "errors.jsonl"), "rb") as fh:
            return fh.read()

    for other in (merged, conv):
        assert read(other) == read(one), other
        with mmstore.open(one) as a, mmstore.open(other) as b:
            assert a.skipped() == b.skipped() and len(a) == len(b)
            assert a.skipped_annotations() == b.skipped_annotations() and len(a.skipped_annotations()) == 7
            for i in range(len(a)):
                assert all(np.array_equal(a[i][f], b[i][f]) for f in a.schema.names)
