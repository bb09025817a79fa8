"""--classes-from / --label-names: a validation folder gets the training store's labels."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.errors import LabelMappingError, ResumeMismatchError
from mmstore.ingest import ingest


@pytest.fixture
def train_val(tmp_path, h):
    train = str(tmp_path / "train")
    val = str(tmp_path / "val")
    h.make_folder(train, ("ant", "bee", "cat", "dog"), per_class=2, sizes=(20, 30))
    h.make_folder(val, ("bee", "dog"), per_class=2, seed=1, sizes=(20, 30))  # missing ant and cat
    ingest(train, str(tmp_path / "train.store"), (16, 16), workers=0, quiet=True)
    return train, val, str(tmp_path / "train.store")


def _labels_by_class(path):
    st = mmstore.open(path)
    lab = st.column("label")
    return {st.key(i).split("/")[0]: int(lab[i]) for i in range(len(st))}, st.label_names


def test_without_mapping_the_labels_differ(tmp_path, train_val):
    # the silent failure the option exists for
    _, val, _ = train_val
    ingest(val, str(tmp_path / "v0"), (16, 16), workers=0, quiet=True)
    assert _labels_by_class(str(tmp_path / "v0"))[0] == {"bee": 0, "dog": 1}


def test_classes_from_cli_gives_the_training_ids_and_warns(tmp_path, train_val, h, capsys):
    _, val, tr = train_val
    dest = str(tmp_path / "val.store")
    assert h.cli("ingest", val, dest, "--size", "16x16", "--workers", "0", "--classes-from", tr) == 0
    err = capsys.readouterr().err
    assert f"note: 2 class(es) of {os.path.abspath(tr)} not found here" in err and "'ant', 'cat'" in err
    by_class, names = _labels_by_class(dest)
    assert by_class == {"bee": 1, "dog": 3}
    assert names == ["ant", "bee", "cat", "dog"] == mmstore.open(tr).label_names
    prov = mmstore.open(dest).provenance
    assert prov["source"]["classes_from"] == os.path.abspath(tr)
    assert prov["ingest"]["params"]["label_names"] == names


def test_label_names_file_and_list(tmp_path, train_val):
    _, val, _ = train_val
    f = tmp_path / "names.txt"
    f.write_bytes(b"dog\r\nbee\nzebra\n")
    r = ingest(val, str(tmp_path / "a"), (16, 16), workers=0, quiet=True, label_names=str(f))
    assert _labels_by_class(str(tmp_path / "a")) == ({"bee": 1, "dog": 0}, ["dog", "bee", "zebra"])
    assert any("'zebra'" in k for k in r.warnings)
    ingest(val, str(tmp_path / "b"), (16, 16), workers=0, quiet=True, label_names=["dog", "bee"])
    assert _labels_by_class(str(tmp_path / "b")) == ({"bee": 1, "dog": 0}, ["dog", "bee"])


def test_unknown_class_refused_or_appended(tmp_path, train_val, h, capsys):
    train, _, _ = train_val
    with pytest.raises(LabelMappingError, match=r"2 class folder\(s\) not in label_names.*'ant', 'cat'"):
        ingest(train, str(tmp_path / "x"), (16, 16), workers=0, quiet=True, label_names=["dog", "bee"])
    assert not os.path.exists(str(tmp_path / "x")) and not os.path.exists(str(tmp_path / "x.partial"))
    f = tmp_path / "n.txt"
    f.write_text("dog\nbee\n")
    ingest(train, str(tmp_path / "y"), (16, 16), workers=0, quiet=True, label_names=str(f), new_classes="append")
    assert _labels_by_class(str(tmp_path / "y")) == (
        {"dog": 0, "bee": 1, "ant": 2, "cat": 3}, ["dog", "bee", "ant", "cat"])
    rc = h.cli("ingest", train, str(tmp_path / "z"), "--size", "16x16", "--label-names", str(f))
    assert rc != 0
    assert "'ant', 'cat'" in capsys.readouterr().err


@pytest.mark.parametrize("names,match", [(["a", "a"], "repeated"), (["a", "b\nc"], "line break"),
                                         ("no/such.txt", "cannot read"), ([1, 2], "list of strings")])
def test_bad_mappings(tmp_path, train_val, names, match):
    _, val, _ = train_val
    with pytest.raises(LabelMappingError, match=match):
        ingest(val, str(tmp_path / "x"), (16, 16), workers=0, quiet=True, label_names=names)


def test_mapping_is_in_the_resume_fingerprint(tmp_path, train_val, h):
    _, val, tr = train_val
    dest = str(tmp_path / "v")
    env = {"MMSTORE_CRASH_AT": "commit:2"}
    argv = ["ingest", val, dest, "--size", "16x16", "--workers", "0", "--chunk", "1", "--classes-from", tr]
    p = h.cli_subprocess(*argv, env=env, stderr=subprocess.PIPE)
    p.communicate(timeout=120)
    if not os.path.isdir(dest + ".partial"):
        pytest.fail(f"the crash hook did not leave {dest}.partial (rc {p.returncode})")
    with pytest.raises(ResumeMismatchError, match="label_names"):
        ingest(val, dest, (16, 16), workers=0, quiet=True, resume=True, chunk=1, label_names=["dog", "bee"])
    ingest(val, dest, (16, 16), workers=0, quiet=True, resume=True, chunk=1, classes_from=tr)
    ref = str(tmp_path / "ref")
    ingest(val, ref, (16, 16), workers=0, quiet=True, chunk=1, classes_from=tr)
    a, b = mmstore.open(dest), mmstore.open(ref)
    assert np.array_equal(a.column("label"), b.column("label"))
    assert np.array_equal(a.column("image"), b.column("image"))
    assert json.dumps(a.label_names) == json.dumps(b.label_names)


def test_named_list_labels_follow_the_mapping(tmp_path, train_val):
    train, _, tr = train_val
    lst = tmp_path / "val.csv"
    lst.write_text("path,label\n" + "".join(f"{c}/img000.jpg,{c}\n" for c in ("dog", "bee")))
    dest = str(tmp_path / "l")
    r = ingest(str(lst), dest, (16, 16), workers=0, quiet=True, root=train, classes_from=tr)
    st = mmstore.open(dest)
    assert st.column("label").tolist() == [3, 1] and st.label_names == ["ant", "bee", "cat", "dog"]
    assert any("'ant', 'cat'" in k for k in r.warnings)
    bad = tmp_path / "bad.csv"
    bad.write_text("path,label\nant/img000.jpg,ant\nbee/img000.jpg,wasp\n")
    with pytest.raises(LabelMappingError, match=r"1 class name\(s\) in the list not in .*'wasp'"):
        ingest(str(bad), str(tmp_path / "m"), (16, 16), workers=0, quiet=True, root=train, classes_from=tr)
    ints = tmp_path / "ints.csv"
    ints.write_text("path,label\nant/img000.jpg,3\n")
    with pytest.raises(LabelMappingError, match="--label-type names"):
        ingest(str(ints), str(tmp_path / "n"), (16, 16), workers=0, quiet=True, root=train, classes_from=tr)
    ingest(str(ints), str(tmp_path / "n"), (16, 16), workers=0, quiet=True, root=train, classes_from=tr,
           label_type="names", new_classes="append")
    st = mmstore.open(str(tmp_path / "n"))
    assert st.label_names == ["ant", "bee", "cat", "dog", "3"] and st.column("label").tolist() == [4]


def test_names_file_bom_trailing_blanks_and_bytes(tmp_path, train_val, h):
    # a UTF-8 byte order mark became part of the first name ('\ufeffdog'), trailing blank
    # lines were refused as unnamed ids, a names file with a non-UTF-8 byte was refused
    # although such folder names are supported
    _, val, _ = train_val
    f = tmp_path / "bom.txt"
    f.write_bytes(b"\xef\xbb\xbfdog\r\nbee\r\n\r\n\n")
    ingest(val, str(tmp_path / "a"), (16, 16), workers=0, quiet=True, label_names=str(f))
    assert _labels_by_class(str(tmp_path / "a")) == ({"bee": 1, "dog": 0}, ["dog", "bee"])
    odd = tmp_path / "odd"
    h.make_folder(str(odd), ("x",), per_class=1, sizes=(20, 30))
    os.rename(str(odd / "x"), os.fsdecode(os.fsencode(str(odd)) + b"/caf\xe9 x"))
    g = tmp_path / "odd.txt"
    g.write_bytes(b"zero\ncaf\xe9 x\n")
    ingest(str(odd), str(tmp_path / "b"), (16, 16), workers=0, quiet=True, label_names=str(g))
    st = mmstore.open(str(tmp_path / "b"))
    assert st.label_names == ["zero", os.fsdecode(b"caf\xe9 x")] and st.column("label").tolist() == [1]
    # shown for people as the README's names rule says (\xe9, not the surrogate's \udce9)
    r = ingest(str(odd), str(tmp_path / "b2"), (16, 16), workers=0, quiet=True, label_names=["zero"],
               new_classes="append")
    assert any("'caf\\xe9 x'" in k for k in r.warnings), r.warnings
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"\xef\xbb\xbf\r\n\n")
    with pytest.raises(LabelMappingError, match="holds no class name"):
        ingest(val, str(tmp_path / "e"), (16, 16), workers=0, quiet=True, label_names=str(empty))
    blank = tmp_path / "blank.txt"
    blank.write_text("dog\n\nbee\n")
    with pytest.raises(LabelMappingError, match=r"line\(s\) \[2\] are blank, so label\(s\) \[1\].*remove the blank"):
        ingest(val, str(tmp_path / "c"), (16, 16), workers=0, quiet=True, label_names=str(blank))


def test_dict_mapping_and_near_miss_hint(tmp_path, train_val):
    _, val, _ = train_val
    # torchvision's class_to_idx: a dict was iterated as its keys, the ids silently ignored
    ingest(val, str(tmp_path / "a"), (16, 16), workers=0, quiet=True, label_names={"dog": 0, "bee": 2, "ant": 1})
    assert _labels_by_class(str(tmp_path / "a")) == ({"bee": 2, "dog": 0}, ["dog", "ant", "bee"])
    with pytest.raises(LabelMappingError, match=r"labels being 0 \.\. 1 once each; found labels \[0, 5\]"):
        ingest(val, str(tmp_path / "b"), (16, 16), workers=0, quiet=True, label_names={"dog": 0, "bee": 5})
    with pytest.raises(LabelMappingError, match=r"'bee' ~ 'bee '"):
        ingest(val, str(tmp_path / "c"), (16, 16), workers=0, quiet=True, label_names=["dog", "bee "])


@pytest.mark.parametrize("what", ["folder", "missing", "damaged", "file"])
def test_classes_from_not_a_store_names_the_option(tmp_path, train_val, h, capsys, what):
    train, val, tr = train_val
    src = {"folder": train, "missing": str(tmp_path / "nope.store"), "file": __file__,
           "damaged": str(tmp_path / "damaged.store")}[what]
    if what == "damaged":
        import shutil

        shutil.copytree(tr, src)
        with open(os.path.join(src, "manifest.json"), "w") as fh:
            fh.write('{"format": "mmstore", "version"')
    rc = h.cli("ingest", val, str(tmp_path / "v"), "--size", "16x16", "--workers", "0", "--classes-from", src)
    err = capsys.readouterr().err
    assert rc != 0 and f"--classes-from {src}: expected a finished store made by mmstore ingest" in err
    assert "--label-names FILE" in err
    assert not os.path.exists(str(tmp_path / "v")) and not os.path.exists(str(tmp_path / "v.partial"))
    assert not os.path.exists(str(tmp_path / "v.lock"))


def test_classes_from_a_store_with_the_missing_label_class(tmp_path, train_val, h):
    # a list ingested with --missing-label class names a class '' (mmstore's own convention);
    # --classes-from that store was refused ("empty ... remove the blank line(s)")
    train, val, _ = train_val
    tl, vl = tmp_path / "t.csv", tmp_path / "v.csv"
    files = sorted(os.listdir(os.path.join(train, "bee")))
    tl.write_text(f"path,label\n{train}/bee/{files[0]},bee\n{train}/bee/{files[1]},\n")
    ingest(str(tl), str(tmp_path / "t"), (16, 16), workers=0, quiet=True, missing_label="class")
    assert mmstore.open(str(tmp_path / "t")).label_names == ["", "bee"]
    vfiles = sorted(os.listdir(os.path.join(val, "dog")))
    vl.write_text(f"path,label\n{val}/dog/{vfiles[0]},\n{val}/dog/{vfiles[1]},dog\n")
    ingest(str(vl), str(tmp_path / "v"), (16, 16), workers=0, quiet=True, missing_label="class",
           classes_from=str(tmp_path / "t"), new_classes="append")
    v = mmstore.open(str(tmp_path / "v"))
    assert v.label_names == ["", "bee", "dog"] and v.column("label").tolist() == [0, 2]


_NAME = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(names=st.lists(_NAME, min_size=1, max_size=8, unique=True), crlf=st.booleans(), bom=st.booleans(),
       tail=st.integers(0, 2))
def test_names_file_round_trip(tmp_path_factory, names, crlf, bom, tail):
    # one name per line, any line end, optional BOM and blank lines at the end: the same names
    from mmstore.ingest.classes import load_class_names

    if names[0].startswith("\ufeff"):
        names[0] = "x" + names[0]
    nl = "\r\n" if crlf else "\n"
    f = tmp_path_factory.mktemp("n") / "names.txt"
    f.write_bytes((("\ufeff" if bom else "") + nl.join(names) + nl * (1 + tail)).encode("utf-8"))
    got, origin = load_class_names(label_names=str(f))
    assert got == names and origin == str(f)
