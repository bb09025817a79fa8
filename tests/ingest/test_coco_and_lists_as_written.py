"""COCO and tagged-list inputs as a user writes them, broken in the ways real files break.
Each test is a regression test for a defect or a behaviour such inputs rely on."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support.proc import run_cli

import mmstore
from mmstore.errors import IngestError
from mmstore.ingest import ingest

cv2 = pytest.importorskip("cv2")

CATS = [{"id": 1, "name": "person"}, {"id": 2, "name": "car"}]


def _coco(root, images, anns, cats=CATS):
    """Write images ``[(file_name, id, h, w)]`` (grey PNGs) and the JSON; return (json path, image dir)."""
    imgs = os.path.join(root, "images")
    os.makedirs(imgs, exist_ok=True)
    for fn, _iid, h, w in images:
        cv2.imwrite(os.path.join(imgs, fn), np.full((h, w, 3), 90, np.uint8))
    doc = {"images": [{"id": iid, "file_name": fn, "width": w, "height": h} for fn, iid, h, w in images],
           "annotations": anns, "categories": cats}
    path = os.path.join(root, "instances.json")
    with open(path, "w") as fh:
        fh.write(json.dumps(doc))
    return path, imgs


def _ann(aid, **kw):
    a = {"id": aid, "image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10]}
    a.update(kw)
    return a


def _errors(dest):
    with open(os.path.join(dest, "errors.jsonl")) as fh:
        return [json.loads(x) for x in fh]


BIG = 10**400  # a JSON integer Python parses exactly, beyond float64 and int64


def test_huge_integers_are_skipped_annotations_not_a_crash(tmp_path, capsys):
    """Integers beyond int64 / float64 (JSON allows any) were an OverflowError that ended the
    ingest ("unexpected ... please report it"); now each such annotation is skipped with its reason,
    and a finite box whose x + w overflows float64 is clipped away like any box off the picture."""
    anns = [
        _ann(1),
        _ann(2, bbox=[BIG, 1, 2, 3]),
        _ann(3, bbox=[1, 1, BIG, 3]),
        _ann(2**70),
        _ann(5, category_id=-(2**64)),
        _ann(6, segmentation=[[1, 2, 3, BIG, 5, 6]]),
        _ann(7, bbox=[10**308, 1, 10**308, 3]),  # each finite; x + w is not (the box lies off the picture)
        _ann(8, bbox=[1e308, 1e308, 1, 1]),  # finite, far off the picture: dropped by the clip
        _ann(9, segmentation=[[1, 2, 3, 4, 5, 10**20]]),  # large but finite: kept
    ]
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 40, 40)], anns)
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", path, dest, "--root", imgs, "--size", "40", "--workers", "0"], capsys)
    assert rc == 0, err
    assert "unexpected" not in err and "Traceback" not in err
    lines = {e["annotation"]: e for e in _errors(dest)}
    assert sorted(lines) == [1, 2, 3, 4, 5]
    assert lines[1]["reason"].startswith("bad-box: a 'bbox' coordinate is not finite") and lines[1]["id"] == 2
    assert lines[2]["reason"].startswith("bad-box") and lines[2]["id"] == 3
    assert lines[3]["reason"].startswith("malformed: 'id' must be an integer") and lines[3]["id"] is None
    assert lines[4]["reason"].startswith("malformed: 'category_id' must be an integer")
    assert lines[5]["reason"] == "malformed: a 'segmentation' polygon must be finite x, y pairs"
    r = mmstore.open(dest)[0]
    assert r["annotation_id"].tolist() == [1, 9]  # 7 and 8 dropped by the clip (off the picture), counted
    assert "note: 2 boxes dropped" in err


@pytest.mark.parametrize("where", ["image id", "category id", "width"])
def test_huge_integers_in_images_or_categories_are_an_ingest_error(tmp_path, where):
    images, cats = [("a.png", 1, 20, 20)], [dict(c) for c in CATS]
    path, imgs = _coco(str(tmp_path), images, [], cats)
    with open(path) as fh:
        doc = json.load(fh)
    if where == "image id":
        doc["images"][0]["id"] = 2**63
    elif where == "category id":
        doc["categories"][0]["id"] = -(2**63) - 1
    else:
        doc["images"][0]["width"] = 2**64
    with open(path, "w") as fh:
        json.dump(doc, fh)
    with pytest.raises(IngestError, match="64-bit|2\\*\\*31"):
        ingest(path, str(tmp_path / "s"), size=20, root=imgs, workers=0, quiet=True)


def test_image_size_written_as_a_whole_float_is_read(tmp_path):
    """``"width": 640.0`` (what some exporters write) refused the whole JSON; a whole float is the
    integer it names (and checked against the decoded size as any), a fraction is still refused."""
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 30), ("b.png", 2, 20, 30)], [_ann(1)])
    with open(path) as fh:
        doc = json.load(fh)
    doc["images"][0].update(width=30.0, height=20.0)
    doc["images"][1].update(width=30.0, height=21.0)  # not the decoded size: a hole, as for an int
    with open(path, "w") as fh:
        json.dump(doc, fh)
    dest = str(tmp_path / "s")
    ingest(path, dest, size=20, root=imgs, workers=0, quiet=True)
    s = mmstore.open(dest)
    assert len(s) == 1 and s[0]["annotation_id"].tolist() == [1]
    assert s.skipped()[0]["reason"].startswith("wrong-shape: the annotation file says 30x21")
    doc["images"][0]["width"] = 30.5
    with open(path, "w") as fh:
        json.dump(doc, fh)
    with pytest.raises(IngestError, match="whole numbers"):
        ingest(path, str(tmp_path / "t"), size=20, root=imgs, workers=0, quiet=True)


def test_json_with_a_byte_order_mark_is_read(tmp_path):
    """A UTF-8 BOM (what Windows tools write) was refused as "not valid JSON (Unexpected UTF-8 BOM
    (decode using utf-8-sig))" at line 1 column 1, advice a CLI user cannot follow; RFC 8259 lets
    a parser ignore it, and the records are the same as without it."""
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 20)], [_ann(1)])
    with open(path, "rb") as fh:
        raw = fh.read()
    bom = str(tmp_path / "bom.json")
    with open(bom, "wb") as fh:
        fh.write(b"\xef\xbb\xbf" + raw)
    for p, d in ((path, "plain"), (bom, "bom")):
        ingest(p, str(tmp_path / d), size=20, root=imgs, workers=0, quiet=True)
    a, b = mmstore.open(str(tmp_path / "plain"))[0], mmstore.open(str(tmp_path / "bom"))[0]
    assert b["annotation_id"].tolist() == [1] and np.array_equal(a["boxes"], b["boxes"])


def _tag_list(tmp_path, rows, header="image_name,tags"):
    """Grey images p0.png ... and a CSV of ``rows`` (cells after the path, written as given)."""
    for k in range(len(rows)):
        cv2.imwrite(str(tmp_path / f"p{k}.png"), np.full((12, 10, 3), 40 + 10 * k, np.uint8))
    path = tmp_path / "train.csv"
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(header + "\n" + "".join(",".join([f"p{k}.png", *r]) + "\n" for k, r in enumerate(rows)))
    return str(path)


@pytest.mark.parametrize(("sep", "cells"), [(" ", ["haze primary", "clear  primary water ", "cloudy", ""]),
                                            ("\t", ['"haze\tprimary"', '"clear\t\tprimary\twater"', "cloudy", ""])])
def test_whitespace_tag_separator(tmp_path, capsys, sep, cells):
    """Space-separated tags (Kaggle's Planet list: ``train_0,haze primary``) were refused ("tags_sep
    must be a non-blank separator"); a whitespace separator now splits, a run of it counting as one
    (no "empty tag" note for it)."""
    lst = _tag_list(tmp_path, [(c,) for c in cells])
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", lst, dest, "--size", "8", "--workers", "0", "--tags-column", "tags",
                          "--tags-sep", sep], capsys)
    assert rc == 0, err
    assert "has an empty tag" not in err and "note: 1 inputs with an empty tags cell" in err
    s = mmstore.open(dest)
    names = s.schema["tags"].class_names
    assert names == {0: "clear", 1: "cloudy", 2: "haze", 3: "primary", 4: "water"}
    assert [[names[t] for t in s[i]["tags"].tolist()] for i in range(4)] == [
        ["haze", "primary"], ["clear", "primary", "water"], ["cloudy"], []]


def test_integer_tags_keep_their_values(tmp_path, capsys):
    """Tags written as integers (``1;5;12``) were renumbered by code point ({0: '1', 1: '10',
    2: '12', 3: '2', 4: '5'}: tag 12 got id 2), so ``multi_hot(tags, 13)`` set the wrong columns,
    unlike an integer label column, which keeps its values. Now the integers are the ids, every id
    up to the largest is named, and a validation list numbered by ``--tag-names train.store``
    agrees; a list mixing names and integers is named as before."""
    import torch

    from mmstore.torch import multi_hot

    lst = _tag_list(tmp_path, [("1;5;12",), ("2; 10",), ("5",), ("",)])
    train = str(tmp_path / "train.store")
    rc, _, err = run_cli(["ingest", lst, train, "--size", "8", "--workers", "0", "--tags-column", "tags"], capsys)
    assert rc == 0, err
    assert "note: 5 distinct tags, all integers: each tag's id is its value (tag names '0' .. '12')" in err
    s = mmstore.open(train)
    assert s.schema["tags"].class_names == {k: str(k) for k in range(13)}
    assert [s[i]["tags"].tolist() for i in range(4)] == [[1, 5, 12], [2, 10], [5], []]
    target = multi_hot([torch.tensor(s[i]["tags"]) for i in range(4)], 13)
    assert target[0].nonzero().flatten().tolist() == [1, 5, 12]
    # a validation list with other integers: the same ids, by the train store's names or by the rule
    val_dir = tmp_path / "val"
    val_dir.mkdir()
    val = _tag_list(val_dir, [("12;3",), ("0",)])
    for extra, d in ((["--tag-names", train], "v1"), ([], "v2")):
        rc, _, err = run_cli(["ingest", val, str(val_dir / d), "--size", "8", "--workers", "0", "--tags-column",
                              "tags", *extra], capsys)
        assert rc == 0, err
        v = mmstore.open(str(val_dir / d))
        assert [v[i]["tags"].tolist() for i in range(2)] == [[12, 3], [0]]
    # not plain integers: named and sorted by code point, as before
    mixed_dir = tmp_path / "mixed"
    mixed_dir.mkdir()
    mixed = _tag_list(mixed_dir, [("1;cat",), ("07",)])
    ingest(mixed, str(mixed_dir / "m"), 8, tags_column="tags", workers=0, quiet=True)
    assert mmstore.open(str(mixed_dir / "m")).schema["tags"].class_names == {0: "07", 1: "1", 2: "cat"}
    # integers too large to be ids: named, and the summary says so
    big_dir = tmp_path / "big"
    big_dir.mkdir()
    big = _tag_list(big_dir, [("3;70000",), ("12",)])
    rc, _, err = run_cli(["ingest", big, str(big_dir / "b"), "--size", "8", "--workers", "0", "--tags-column",
                          "tags"], capsys)
    assert rc == 0 and "note: 3 distinct tags, all integers but some over 65535: numbered as names" in err
    assert mmstore.open(str(big_dir / "b")).schema["tags"].class_names == {0: "12", 1: "3", 2: "70000"}


def test_repeated_annotation_ids_are_kept_and_counted(tmp_path, capsys):
    """Two annotations with one id (a merged or hand-edited JSON) were kept without a word; tools
    that index annotations by id (pycocotools) keep only one of them, so the summary now says so."""
    anns = [_ann(1), _ann(1, bbox=[4, 4, 6, 6]), _ann(2), _ann(2, image_id=2), _ann(3)]
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 20), ("b.png", 2, 20, 20)], anns)
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", path, dest, "--root", imgs, "--size", "20", "--workers", "0"], capsys)
    assert rc == 0, err
    assert "note: 2 annotations whose id repeats an earlier annotation's" in err
    s = mmstore.open(dest)
    assert s[0]["annotation_id"].tolist() == [1, 1, 2, 3] and s[1]["annotation_id"].tolist() == [2]
    assert s[0]["boxes"].tolist()[1] == [4, 4, 10, 10]


def test_images_sharing_a_file_name_are_counted(tmp_path, capsys):
    """Two ``images`` entries with one file_name (a merged JSON) become two records with one key,
    each with its own annotations; the summary says so (it said nothing)."""
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 20), ("a.png", 2, 20, 20), ("b.png", 3, 20, 20)],
                       [_ann(1, image_id=2), _ann(2, image_id=3)])
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", path, dest, "--root", imgs, "--size", "20", "--workers", "0"], capsys)
    assert rc == 0, err
    assert "note: 1 'images' entries whose file_name another entry also has" in err
    s = mmstore.open(dest)
    assert [(s.key(i), int(s[i]["image_id"]), s[i]["annotation_id"].tolist()) for i in range(3)] == [
        ("a.png", 1, []), ("a.png", 2, [1]), ("b.png", 3, [2])]


def test_min_box_size_zero_drops_boxes_wholly_outside_the_crop(tmp_path, capsys):
    """With ``--min-box-size 0`` a box wholly outside a center crop was kept as a zero-width box on
    the crop's edge (``[0, 8, 0, 14]``) and counted as "clipped": a box no input may hold (a
    non-positive size is a bad-box), which makes IoU losses divide by zero. It is dropped now;
    a box partly inside is kept, clipped, at any size."""
    anns = [_ann(1, bbox=[1, 5, 6, 6]),  # x 1..7 of a 40-wide image cropped to x 10..30: outside
            _ann(2, bbox=[8, 5, 2.5, 6]),  # x 8..10.5: 0.5 source px inside the crop
            _ann(3, bbox=[12, 5, 6, 6])]  # inside
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 40)], anns)
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", path, dest, "--root", imgs, "--size", "20", "--resize", "center-crop",
                          "--min-box-size", "0", "--workers", "0"], capsys)
    assert rc == 0, err
    r = mmstore.open(dest)[0]
    assert r["box"].tolist() == [10, 0, 30, 20]
    assert r["annotation_id"].tolist() == [2, 3]
    assert r["boxes"].tolist() == [[0, 5, 0.5, 11], [2, 5, 8, 11]]
    assert "note: 1 boxes clipped to the picture area" in err and "note: 1 boxes dropped" in err


@pytest.mark.parametrize("tail", ["\n", ""])
def test_a_quote_left_open_is_an_error_not_a_swallowed_list(tmp_path, tail):
    """A caption whose quote is never closed made every later line part of that one cell: 3 rows
    became 1 record, without a word (the docstring of ``_csv_rows`` promised an error, which came
    only past 128 KiB). Now it is an ``IngestError`` naming the row; nothing is created."""
    lst = _tag_list(tmp_path, [("cat", "A cat"), ("dog", '"a dog, never closed'), ("bird", "A bird")],
                    header="image_name,tags,caption")
    with open(lst) as fh:
        text = fh.read().rstrip("\n") + tail
    with open(lst, "w") as fh:
        fh.write(text)
    dest = str(tmp_path / "s")
    with pytest.raises(IngestError, match=r"train\.csv:3: a quote .* is never closed"):
        ingest(lst, dest, 8, tags_column="tags", text_column="caption", workers=0, quiet=True)
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")
    # closed quotes spanning lines, and a last row without a line end, are read as written
    with open(lst, "w") as fh:
        fh.write('image_name,tags,caption\np0.png,cat,"two\nlines"\np1.png,dog,"x, y"')
    ingest(lst, dest, 8, tags_column="tags", text_column="caption", workers=0, quiet=True)
    s = mmstore.open(dest)
    assert [s[i]["text"] for i in range(len(s))] == ["two\nlines", "x, y"]


def test_verify_does_not_advise_a_repair_it_refuses(tmp_path, capsys):
    """A damaged errors.jsonl (the skipped annotations' lines) is a structural problem: verify
    advised `mmstore verify --repair`, which then refused ("repair only restores records"). The
    advice now names what works; a damaged record still gets the --repair advice."""
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 20)], [_ann(1), _ann(2, category_id=9)])
    dest = str(tmp_path / "s")
    ingest(path, dest, size=20, root=imgs, workers=0, quiet=True)
    errors = os.path.join(dest, "errors.jsonl")
    with open(errors, "r+b") as fh:
        fh.seek(3)
        fh.write(b"X")
    rc, out, _ = run_cli(["verify", dest], capsys)
    assert rc != 0 and "[digest] errors.jsonl" in out
    assert "next       restore the files named above from a copy" in out and "verify --repair` re-ingests" not in out
    rc, out, _ = run_cli(["verify", "--repair", dest], capsys)
    assert rc != 0 and "refused" in out


def test_a_short_row_is_named_by_its_line_after_multi_line_captions(tmp_path):
    """"row has 2 columns" named the row's number, not its line: after a caption of three lines
    the line given was two short of the row the user has to fix."""
    lst = tmp_path / "l.csv"
    lst.write_text('path,tags,caption\np0.png,cat,"one\ntwo\nthree"\np1.png,dog\n', encoding="utf-8")
    with pytest.raises(IngestError, match=r"l\.csv:5: row has 2 columns, expected 3"):
        ingest(str(lst), str(tmp_path / "s"), 8, tags_column="tags", text_column="caption", workers=0, quiet=True)


def test_a_mistyped_root_is_an_error_not_an_empty_store(tmp_path):
    """``--root val2071/`` (no such folder) made every image a hole "unreadable" and ended with
    exit code 0 and a store of 0 records; it is refused before anything is created."""
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 20)], [_ann(1)])
    dest = str(tmp_path / "s")
    with pytest.raises(IngestError, match=r"\(--root\) is not a directory"):
        ingest(path, dest, size=20, root=imgs + "-typo", workers=0, quiet=True)
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")


def test_iscrowd_written_as_a_boolean_is_kept(tmp_path, capsys):
    """``"iscrowd": false`` (a JSON boolean, which pycocotools reads as 0) skipped the whole
    annotation, box and all, as malformed; true/false and 1.0/0.0 now mean 1/0, other values are
    still skipped."""
    anns = [_ann(1, iscrowd=False), _ann(2, iscrowd=True), _ann(3, iscrowd=1.0), _ann(4, iscrowd=0),
            _ann(5, iscrowd=2), _ann(6, iscrowd="0"), _ann(7, iscrowd=0.5)]
    path, imgs = _coco(str(tmp_path), [("a.png", 1, 20, 20)], anns)
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", path, dest, "--root", imgs, "--size", "20", "--workers", "0"], capsys)
    assert rc == 0, err
    r = mmstore.open(dest)[0]
    assert r["annotation_id"].tolist() == [1, 2, 3, 4] and r["iscrowd"].tolist() == [0, 1, 1, 0]
    assert [e["id"] for e in _errors(dest)] == [5, 6, 7]
    assert "note: 3 annotations skipped, malformed" in err


@pytest.mark.parametrize("kind", ["list", "coco"])
def test_a_root_where_no_input_exists_is_an_error_before_the_run(tmp_path, kind):
    """A mistyped --root (or path template) would make every input a hole and
    leave an empty store after the whole run: refused at the scan, naming the
    first path and the folder; one existing input is enough to run."""
    img = tmp_path / "imgs"
    img.mkdir()
    (tmp_path / "other").mkdir()
    cv2.imwrite(str(img / "a.png"), np.zeros((8, 8, 3), np.uint8))
    if kind == "list":
        src = tmp_path / "list.csv"
        src.write_text("path\na.png\nmissing.png\n")
    else:
        src = tmp_path / "ann.json"
        src.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png", "width": 8, "height": 8},
                                              {"id": 2, "file_name": "missing.png", "width": 8, "height": 8}],
                                   "annotations": [], "categories": []}))
    with pytest.raises(IngestError, match=r"none of its 2 files exists \(the first would be .*/other/a\.png"):
        ingest(str(src), str(tmp_path / "s"), size=8, root=str(tmp_path / "other"))
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(str(tmp_path / "s") + ".partial")
    res = ingest(str(src), str(tmp_path / "s"), size=8, root=str(img))
    assert mmstore.open(tmp_path / "s").records == 1 and res.skipped == 1
