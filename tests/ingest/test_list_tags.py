"""A list's multi-label tags column (ragged ``tags`` with tag names) and captions column (``str`` ``text``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.errors import LabelMappingError, ResumeMismatchError
from mmstore.ingest import ingest, merge
from mmstore.ingest.lists import ListSource


def _list(tmp_path, h, rows, name="l.csv", n_images=None, header="path,label,tags,caption"):
    """Write photos p0.jpg ... and a list of ``rows`` (cells after the path) into tmp_path."""
    rng = np.random.default_rng(3)
    for k in range(n_images if n_images is not None else len(rows)):
        p = tmp_path / f"p{k}.jpg"
        if not p.exists():
            h.write_image(str(p), h.photo(rng, 20, 24))
    with open(tmp_path / name, "w", encoding="utf-8", errors="surrogateescape", newline="") as fh:
        fh.write(header + "\n")
        for k, cells in enumerate(rows):
            fh.write(",".join([f"p{k}.jpg", *cells]) + "\n")
    return str(tmp_path / name)


ROWS = [
    ("a", "cat;animal", "A cat on a mat."),
    ("b", " dog ; animal;dog", ""),
    ("a", "", '"Zoë, 猫 and a ""quote"""'),
    ("b", "cat;;", "  spaces kept  "),
    ("a", "animal", "x"),
]


def test_tags_and_text_columns_beside_labels(tmp_path, h, capsys):
    lst = _list(tmp_path, h, ROWS)
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", lst, dest, "--size", "8x8", "--workers", "0", "--tags-column", "tags",
                 "--text-column", "caption") == 0
    err = capsys.readouterr().err
    assert "note: 1 inputs whose tags cell repeats a tag" in err
    assert "note: 1 inputs whose tags cell has an empty tag" in err
    assert "note: 1 inputs with an empty tags cell" in err
    s = mmstore.open(dest)
    f = s.schema["tags"]
    # tag names sorted by code point, numbered from 0, kept in the schema
    assert (f.dtype.str, f.shape) == ("<i4", (None,))
    assert f.class_names == {0: "animal", 1: "cat", 2: "dog"}
    assert s.schema["text"].kind == "str"
    assert s.label_names == ["a", "b"]
    # ids in the order the cell writes them, trimmed, a repeat kept once, empty cell = no tags
    assert [s[i]["tags"].tolist() for i in range(5)] == [[1, 0], [2, 0], [], [1], [0]]
    assert [s[i]["text"] for i in range(5)] == ["A cat on a mat.", "", 'Zoë, 猫 and a "quote"', "  spaces kept  ", "x"]
    assert s.column("label").tolist() == [0, 1, 0, 1, 0]
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        man = json.load(fh)
    ent = next(e for e in man["schema"] if e["name"] == "tags")
    assert ent["classes"] == [[0, "animal"], [1, "cat"], [2, "dog"]]
    assert man["provenance"]["source"]["tags_column"] == "tags"
    assert man["provenance"]["source"]["tags_sep"] == ";"
    b = s.read_batch(np.array([3, 0, 2]))
    assert b["tags"].split()[0].tolist() == [1] and b["tags"].lengths.tolist() == [1, 2, 0]
    assert b["text"].split() == ["  spaces kept  ", "A cat on a mat.", 'Zoë, 猫 and a "quote"']


def test_tag_cell_was_one_class_before(tmp_path, h):
    """The bug this fixes: a tag column read as a label made one class per cell
    ('cat;animal'); as a tags column every tag is a name of its own."""
    lst = _list(tmp_path, h, [("x", "cat;animal", "c"), ("x", "cat", "c")])
    old = str(tmp_path / "old.store")
    ingest(lst, old, (8, 8), label_column="tags", workers=0, quiet=True)
    assert mmstore.open(old).label_names == ["cat", "cat;animal"]
    new = str(tmp_path / "new.store")
    ingest(lst, new, (8, 8), tags_column="tags", workers=0, quiet=True)
    s = mmstore.open(new)
    assert s.schema["tags"].class_names == {0: "animal", 1: "cat"}
    assert [s[i]["tags"].tolist() for i in range(2)] == [[1, 0], [1]]


def test_other_separator_and_tags_only(tmp_path, h):
    lst = _list(tmp_path, h, [("cat|big cat| animal",), ("",)], header="path,tags")
    dest = str(tmp_path / "s.store")
    ingest(lst, dest, (8, 8), tags_column="tags", tags_sep="|", workers=0, quiet=True)
    s = mmstore.open(dest)
    assert "label" not in s.schema and "text" not in s.schema
    assert s.schema["tags"].class_names == {0: "animal", 1: "big cat", 2: "cat"}
    assert [s[i]["tags"].tolist() for i in range(2)] == [[2, 1, 0], []]
    # a tags column named 'label' is not also the default label column
    lab = _list(tmp_path, h, [("cat|big cat| animal",), ("",)], name="lab.csv", header="path,label")
    ingest(lab, str(tmp_path / "lab.store"), (8, 8), tags_column="label", tags_sep="|", workers=0, quiet=True)
    s = mmstore.open(str(tmp_path / "lab.store"))
    assert "label" not in s.schema and s[0]["tags"].tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="tags_sep"):
        ingest(lst, str(tmp_path / "x"), (8, 8), tags_sep="|", quiet=True)
    with pytest.raises(ValueError, match="tags_sep"):
        ingest(lst, str(tmp_path / "x"), (8, 8), tags_column="tags", tags_sep="; ", quiet=True)


def test_bad_utf8_cells_are_holes(tmp_path, h):
    rows = [("a", "cat", "ok"), ("a", "cat", "caf\udce9"), ("a", "\udcffdog", "ok"), ("a", "dog", "fine")]
    lst = _list(tmp_path, h, rows)
    dest = str(tmp_path / "s.store")
    res = ingest(lst, dest, (8, 8), tags_column="tags", text_column="caption", workers=0, quiet=True)
    assert "bad-text 1" in res.summary() and "bad-tags 1" in res.summary()
    s = mmstore.open(dest)
    assert s.slots == 4 and len(s) == 2
    reasons = {e["key"]: e["reason"] for e in s.skipped()}
    assert reasons["p1.jpg"].startswith("bad-text: the text cell is not valid UTF-8 (byte 0xe9")
    assert reasons["p2.jpg"].startswith("bad-tags: the tags cell is not valid UTF-8 (byte 0xff")
    # a bad cell names no tag: 'dog' comes from row 3 alone
    assert s.schema["tags"].class_names == {0: "cat", 1: "dog"}
    assert [s[i]["text"] for i in range(2)] == ["ok", "fine"]


def test_same_bytes_whatever_the_workers_and_backend(tmp_path, h):
    rows = [(("a", "b")[k % 2], ";".join(f"t{(k * 7 + j) % 5}" for j in range(k % 4)), f"caption {k} é")
            for k in range(12)]
    lst = _list(tmp_path, h, rows)
    for backend in ("memmap", "lmdb"):
        ref = str(tmp_path / f"ref-{backend}")
        ingest(lst, ref, (8, 8), tags_column="tags", text_column="caption", workers=0, quiet=True, backend=backend)
        other = str(tmp_path / f"two-{backend}")
        ingest(lst, other, (8, 8), tags_column="tags", text_column="caption", workers=2, chunk=2, quiet=True,
               backend=backend)
        h.assert_same_store(ref, other)
        s = mmstore.open(ref)
        assert [s[k]["text"] for k in range(12)] == [r[2] for r in rows]


def test_shards_merged_read_as_one_run(tmp_path, h):
    """Each shard numbers the tags of the whole list: the parts merge, and read as the single run."""
    rows = [("a", ";".join(f"t{(k * 3 + j) % 7}" for j in range(k % 3)), f"c{k}") for k in range(9)]
    lst = _list(tmp_path, h, rows)
    opts = {"tags_column": "tags", "text_column": "caption", "workers": 0, "quiet": True}
    ref = str(tmp_path / "ref")
    ingest(lst, ref, (8, 8), **opts)
    parts = [str(tmp_path / f"part{k}") for k in range(3)]
    for k, p in enumerate(parts):
        ingest(lst, p, (8, 8), shard=(k, 3), **opts)
        # a shard's tag names are the whole list's, though its rows name fewer
        assert mmstore.open(p).schema["tags"].classes == mmstore.open(ref).schema["tags"].classes
    out = str(tmp_path / "merged")
    merge(parts, out)
    m, r = mmstore.open(out), mmstore.open(ref)
    assert m.schema == r.schema and np.array_equal(m.slot_view.checksums(), r.slot_view.checksums())
    idx = np.array([4, 0, 8, 3, 3, 7])
    a, b = m.read_batch(idx), r.read_batch(idx)
    assert np.array_equal(a["image"], b["image"])
    for f in ("tags", "text"):
        assert np.array_equal(a[f].values, b[f].values) and np.array_equal(a[f].offsets, b[f].offsets)
    assert [m[i]["tags"].tolist() for i in range(9)] == [r[i]["tags"].tolist() for i in range(9)]


def test_resume_refuses_changed_tags_or_text(tmp_path, h, capsys):
    rows = [("a", "cat;dog", "one"), ("b", "dog", "two"), ("a", "cat", "three")]
    lst = _list(tmp_path, h, rows, n_images=2)  # p2.jpg is missing ...
    (tmp_path / "p2.jpg").write_bytes(b"junk")  # ... a bad image: --on-error fail stops there
    dest = str(tmp_path / "d")
    flags = ["--size", "8x8", "--tags-column", "tags", "--text-column", "caption", "-q", "--workers", "0",
             "--chunk", "1"]
    assert h.cli("ingest", lst, dest, *flags, "--on-error", "fail") == 1
    assert os.path.isdir(dest + ".partial")
    err = capsys.readouterr().err  # the resume command it prints repeats the tags and text flags
    assert "--tags-column tags" in err and "--text-column caption" in err and "--resume" in err
    for changed in ([("a", "cat;dog", "one"), ("b", "dog", "TWO"), ("a", "cat", "three")],
                    [("a", "cat;dog", "one"), ("b", "cat", "two"), ("a", "cat", "three")]):
        _list(tmp_path, h, changed, n_images=0)
        assert h.cli("ingest", lst, dest, *flags, "--resume") == 2
        assert "changed" in capsys.readouterr().err
        with pytest.raises(ResumeMismatchError):
            ingest(lst, dest, (8, 8), tags_column="tags", text_column="caption", resume=True, quiet=True,
                   workers=0)
    _list(tmp_path, h, rows, n_images=0)
    assert h.cli("ingest", lst, dest, *flags, "--resume") == 0
    ref = str(tmp_path / "ref")
    assert h.cli("ingest", lst, ref, *flags) == 0
    h.assert_same_store(ref, dest)


def test_tag_names_from_a_store_or_a_file(tmp_path, h, capsys):
    train = _list(tmp_path, h, [("a", "cat;dog", "x"), ("a", "bird", "y")], name="train.csv")
    tdest = str(tmp_path / "train.store")
    ingest(train, tdest, (8, 8), tags_column="tags", workers=0, quiet=True)
    assert mmstore.open(tdest).schema["tags"].class_names == {0: "bird", 1: "cat", 2: "dog"}
    val = _list(tmp_path, h, [("a", "dog", "x"), ("a", "cat;emu", "y")], name="val.csv")
    # a tag the mapping lacks is refused, nothing created
    with pytest.raises(LabelMappingError, match="'emu'"):
        ingest(val, str(tmp_path / "v0"), (8, 8), tags_column="tags", tag_names=tdest, quiet=True)
    assert not os.path.exists(tmp_path / "v0")
    vdest = str(tmp_path / "val.store")
    assert h.cli("ingest", val, vdest, "--size", "8x8", "--workers", "0", "--tags-column", "tags",
                 "--tag-names", tdest, "--new-classes", "append") == 0
    assert "not found here" in capsys.readouterr().err  # 'bird' keeps its id
    s = mmstore.open(vdest)
    assert s.schema["tags"].class_names == {0: "bird", 1: "cat", 2: "dog", 3: "emu"}
    assert [s[i]["tags"].tolist() for i in range(2)] == [[2], [1, 3]]
    names = tmp_path / "tags.txt"
    names.write_text("emu\ndog\ncat\n")
    fdest = str(tmp_path / "val2.store")
    ingest(val, fdest, (8, 8), tags_column="tags", tag_names=str(names), workers=0, quiet=True)
    s = mmstore.open(fdest)
    assert s.schema["tags"].class_names == {0: "emu", 1: "dog", 2: "cat"}
    assert [s[i]["tags"].tolist() for i in range(2)] == [[1], [2, 0]]
    plain = str(tmp_path / "plain.store")
    ingest(val, plain, (8, 8), workers=0, quiet=True)
    with pytest.raises(LabelMappingError, match="--tag-names .* no tags field"):
        ingest(val, str(tmp_path / "v1"), (8, 8), tags_column="tags", tag_names=plain, quiet=True)
    # --classes-from stays the label column's mapping
    with pytest.raises(LabelMappingError, match="no label column; .* numbered by --tag-names"):
        ingest(val, str(tmp_path / "v2"), (8, 8), tags_column="tags", label_column="", classes_from=tdest,
               quiet=True)


_TAG = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=0, max_size=6).filter(
    lambda t: not set(t) & set(';\t\n\r"')  # no separator, and nothing the TSV itself would split or quote
) | st.sampled_from(["0", "1", "2", "10", " 3 ", "07", "65535", "65536"])  # integer tags (and near misses)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_TAG, max_size=5), min_size=1, max_size=8))
def test_tag_cells_property(tmp_path_factory, cells):
    """Any tag cells: each record's ids name its distinct trimmed tags in the
    order written; the names are every tag of the list, sorted by code point
    (or, when every tag is a plain integer, the integers are the ids)."""
    d = tmp_path_factory.mktemp("prop")
    lst = d / "l.tsv"
    rows = [";".join(c) for c in cells]
    with open(lst, "w", encoding="utf-8", newline="") as fh:
        fh.write("path\ttags\n")
        fh.writelines(f"p{k}.jpg\t{r}\n" for k, r in enumerate(rows))
    src = ListSource(str(lst), tags_column="tags")
    src.scan()
    want = []
    for c in cells:
        seen: list[str] = []
        for t in (p.strip() for p in c):
            if t and t not in seen:
                seen.append(t)
        want.append(seen)
    found = sorted({t for w in want for t in w})
    if found and all(t.isascii() and t.isdigit() and (t == "0" or t[0] != "0") and int(t) <= 65535 for t in found):
        names = {k: str(k) for k in range(max(int(t) for t in found) + 1)}  # integer tags: their own ids
    else:
        names = dict(enumerate(found))
    (f,) = src.fields
    assert f.class_names == names
    for k, w in enumerate(want):
        assert [names[int(t)] for t in src.record_fields(k)["tags"]] == w


def test_a_caption_longer_than_the_csv_modules_default_cell_limit_is_kept(tmp_path):
    """The csv module refuses cells over 128 Ki characters by default; a list
    reads longer ones (up to ``MAX_CELL_CHARS``) and leaves the process-wide
    limit as it was."""
    import csv

    import cv2

    from mmstore.ingest.lists import MAX_CELL_CHARS

    cv2.imwrite(str(tmp_path / "a.png"), np.full((8, 8, 3), 9, np.uint8))
    caption = "long caption " * 20_000  # 260,000 characters
    with open(tmp_path / "list.csv", "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([["path", "caption"], ["a.png", caption]])
    before = csv.field_size_limit()
    ingest(str(tmp_path / "list.csv"), str(tmp_path / "s"), size=8, text_column="caption")
    assert csv.field_size_limit() == before < len(caption) < MAX_CELL_CHARS
    assert mmstore.open(tmp_path / "s")[0]["text"] == caption
