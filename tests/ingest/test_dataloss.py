"""Data loss, through ``mmstore ingest``: --overwrite never deletes the inputs
or a folder that is not a store, CSV integer labels stay the integers they
are, names that are not UTF-8 work end to end, and a refused run leaves no
DEST.lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.errors import IngestError
from mmstore.ingest import ListSource, ingest


def _tree(root: str) -> dict[bytes, bytes]:
    out = {}
    for dirpath, _, names in os.walk(os.fsencode(root)):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, os.fsencode(root))] = fh.read()
    return out


def _ingest(h, *argv) -> int:
    return h.cli("ingest", *argv, "--size", "8x8", "--workers", "0", "--quiet")


# -- --overwrite never deletes the inputs or a folder that is not a store ---------------


def test_overwrite_refuses_source_folder(h, folder, capsys):
    root, _ = folder
    before = _tree(root)
    assert _ingest(h, root, root, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "is the input" in err and "Traceback" not in err
    assert _tree(root) == before
    assert not os.path.exists(root + ".lock") and not os.path.exists(root + ".partial")


def test_overwrite_refuses_a_folder_containing_the_source(h, tmp_path, capsys):
    proj = tmp_path / "proj"
    root = str(proj / "images")
    h.make_folder(root, per_class=2)
    (proj / "notes").mkdir()
    (proj / "notes" / "thesis.txt").write_text("years of work")
    before = _tree(str(proj))
    assert _ingest(h, root, proj, "--overwrite") == 2
    assert "contains the input" in capsys.readouterr().err
    assert _ingest(h, root, os.path.join(root, "cat", "x.store")) == 2  # inside: it would become a class
    assert "inside the input" in capsys.readouterr().err
    assert _tree(str(proj)) == before


def test_overwrite_refuses_a_folder_that_is_not_a_store(h, folder, tmp_path, capsys):
    root, _ = folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert _ingest(h, root, other, "--overwrite") == 2
    assert "not an mmstore store" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "mine"
    # a list's image root is protected too (DEST may not be or contain it)
    lst = tmp_path / "l.csv"
    lst.write_text("path\n" + "\n".join(f"{root}/cat/img000.jpg" for _ in range(1)) + "\n")
    assert h.cli("ingest", lst, tmp_path, "--root", root, "--size", "8x8", "--workers", "0", "-q", "--overwrite") == 2


def test_overwrite_replaces_a_store_and_resume_never_touches_a_foreign_partial(h, folder, tmp_path):
    root, rels = folder
    dest = str(tmp_path / "s")
    assert _ingest(h, root, dest) == 0
    assert _ingest(h, root, dest, "--overwrite", "--resize", "stretch") == 0
    assert mmstore.open(dest).records == len(rels)
    assert sorted(os.listdir(tmp_path)) == ["imgs", "s"]
    foreign = str(tmp_path / "t.partial")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "draft.txt"), "w") as fh:
        fh.write("not ours")
    for extra in (["--resume"], ["--overwrite"], []):
        assert _ingest(h, root, tmp_path / "t", *extra) == 2
    assert os.listdir(foreign) == ["draft.txt"]
    assert not os.path.exists(tmp_path / "t") and not os.path.exists(tmp_path / "t.lock")


# -- CSV integer labels stay the integers they are --------------------------------------


def _list(tmp_path, h, labels, name="l.csv") -> str:
    rng = np.random.default_rng(0)
    d = tmp_path / "li"
    d.mkdir(exist_ok=True)
    rows = ["path,label"]
    for i, lab in enumerate(labels):
        h.write_image(str(d / f"{i}.png"), h.photo(rng, 12, 12), ".png")
        rows.append(f"{i}.png,{lab}")
    p = d / name
    p.write_text("\n".join(rows) + "\n")
    return str(p)


def test_csv_integer_labels_are_not_renumbered(h, tmp_path, capsys):
    lst = _list(tmp_path, h, ["5", "10", "2", "", "7.0", "nan"])
    dest = str(tmp_path / "s")
    assert h.cli("ingest", lst, dest, "--size", "8x8", "--workers", "0") == 0
    err = capsys.readouterr().err
    s = mmstore.open(dest)
    assert s.label_names is None
    assert s.column("label").tolist() == [5, 10, 2, 7]
    assert [s.key(i) for i in range(s.records)] == ["0.png", "1.png", "2.png", "4.png"]
    assert [(e["slot"], e["key"], e["reason"].split(":")[0]) for e in s.skipped()] == [
        (3, "3.png", "bad-label"), (5, "5.png", "bad-label")]
    assert "bad-label 2" in err and "2 inputs skipped for a blank or invalid label" in err
    # with --missing-label class they are a class of their own: -1
    dest2 = str(tmp_path / "s2")
    assert h.cli("ingest", lst, dest2, "--size", "8x8", "--workers", "0", "--missing-label", "class") == 0
    assert mmstore.open(dest2).column("label").tolist() == [5, 10, 2, -1, 7, -1]
    assert "kept as a class of their own" in capsys.readouterr().err


def test_csv_missing_label_class_refuses_when_minus_one_is_a_real_label(h, tmp_path, capsys):
    """Blank cells kept as a class get label -1: when the column already uses
    -1, that would merge them into a real class."""
    lst = _list(tmp_path, h, ["-1", "10", "", "2"])
    dest = tmp_path / "s"
    assert h.cli("ingest", lst, dest, "--size", "8x8", "--workers", "0", "-q", "--missing-label", "class") == 2
    assert "already uses -1" in capsys.readouterr().err
    assert not os.path.exists(dest) and not os.path.exists(str(dest) + ".partial")
    assert h.cli("ingest", lst, dest, "--size", "8x8", "--workers", "0", "-q") == 0  # the blank row: a hole
    s = mmstore.open(dest)
    assert s.column("label").tolist() == [-1, 10, 2] and s.skipped()[0]["slot"] == 2


def test_csv_mixed_label_column_is_refused_unless_told(h, tmp_path, capsys):
    lst = _list(tmp_path, h, ["5", "cat", "2"])
    assert h.cli("ingest", lst, tmp_path / "s", "--size", "8x8", "--workers", "0", "-q") == 2
    assert "mixes integers" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(tmp_path / "s.partial")
    assert h.cli("ingest", lst, tmp_path / "i", "--size", "8x8", "--workers", "0", "-q", "--label-type", "int") == 0
    s = mmstore.open(tmp_path / "i")
    assert s.column("label").tolist() == [5, 2] and "not an integer" in s.skipped()[0]["reason"]
    assert h.cli("ingest", lst, tmp_path / "n", "--size", "8x8", "--workers", "0", "-q", "--label-type", "names") == 0
    s = mmstore.open(tmp_path / "n")
    assert s.label_names == ["2", "5", "cat"] and s.column("label").tolist() == [1, 2, 0]


def test_csv_named_labels_blank_cell_is_an_error_or_a_class(h, tmp_path):
    lst = _list(tmp_path, h, ["dog", "", "cat"])
    src = ListSource(lst)
    lab = src.scan()
    assert lab.label_names == ["cat", "dog"] and lab.labels[[0, 2]].tolist() == [1, 0]
    assert list(lab.label_errors) == [1]
    lab = ListSource(lst, missing_label="class").scan()
    assert lab.label_names == ["", "cat", "dog"] and lab.labels.tolist() == [2, 0, 1] and not lab.label_errors


def _cell(v: int, style: int) -> str:
    return [str(v), f"{v}.0", f" {v} ", f"+{v}" if v >= 0 else str(v)][style]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(0, 3)),
                          st.sampled_from(["", "nan", "NaN", "<NA>", "null"])), min_size=1, max_size=30))
def test_csv_integer_labels_property(tmp_path, cells):
    """Every integer cell (in any pandas-ish spelling) is stored as exactly
    that integer; exactly the blank cells are the label errors."""
    p = tmp_path / "p.csv"
    texts = [_cell(*c) if isinstance(c, tuple) else c for c in cells]
    p.write_text("path,label\n" + "".join(f"x{i}.png,{t}\n" for i, t in enumerate(texts)))
    if not any(isinstance(c, tuple) for c in cells):
        return  # no integer at all: a named column (covered above)
    lab = ListSource(str(p)).scan()
    assert lab.label_names is None
    for i, c in enumerate(cells):
        if isinstance(c, tuple):
            assert int(lab.labels[i]) == c[0] and i not in lab.label_errors
        else:
            assert lab.label_errors[i].startswith("bad-label")


def test_csv_changed_integer_label_changes_the_fingerprint(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text("path,label\na.png,5\nb.png,10\n")
    fp = ListSource(str(p)).scan().fingerprint
    p.write_text("path,label\na.png,7\nb.png,10\n")  # same shape of ids: the old hash missed it
    assert ListSource(str(p)).scan().fingerprint != fp


def test_csv_label_beyond_int64_is_a_row_error(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text(f"path,label\na.png,5\nb.png,{1 << 64}\n")
    lab = ListSource(str(p)).scan()
    assert lab.labels[0] == 5 and "64-bit" in lab.label_errors[1]


# -- names that are not UTF-8 -----------------------------------------------------------


def _bytes_folder(h, root: bytes) -> dict[bytes, bytes]:
    """Class folders and files whose names are not UTF-8; returns {relpath: data}."""
    rng = np.random.default_rng(1)
    out = {}
    for c in (b"caf\xe9", b"d\xffg", b"plain"):
        os.makedirs(os.path.join(root, c))
        for i in range(2):
            rel = os.path.join(c, b"im\xfe%d.png" % i)
            out[rel] = h.write_image(os.path.join(root, rel), h.photo(rng, 14, 14), ".png")
    bad = os.path.join(b"plain", b"broken\xe9.jpg")
    with open(os.path.join(root, bad), "wb") as fh:
        fh.write(b"not a jpeg")
    out[bad] = b"not a jpeg"
    return out


def test_non_utf8_names_work_end_to_end(h, tmp_path):
    root = os.path.join(os.fsencode(str(tmp_path)), b"src\xe9")
    files = _bytes_folder(h, root)
    src = os.fsdecode(root)
    ref = str(tmp_path / "ref")
    assert _ingest(h, src, ref) == 0
    # interrupted, then resumed: same bytes
    dest = str(tmp_path / "s")
    r = h.cli_subprocess("ingest", src, dest, "--size", "8x8", "--workers", "0", "-q", "--chunk", "2",
                         env={"MMSTORE_CRASH_AT": "commit:2"}, stderr=subprocess.PIPE)
    r.communicate(timeout=120)
    assert r.returncode == 77 and os.path.isdir(dest + ".partial")
    assert _ingest(h, src, dest, "--resume", "--chunk", "2") == 0
    h.assert_same_store(ref, dest)
    s = mmstore.open(dest)
    assert [os.fsencode(n) for n in s.label_names] == [b"caf\xe9", b"d\xffg", b"plain"]
    keys = [os.fsencode(s.key(i)) for i in range(s.records)]
    assert keys == sorted(k for k in files if not k.startswith(b"plain/broken"))
    for i, k in enumerate(keys):
        assert os.fsencode(s.label_names[int(s[i]["label"])]) == k.split(b"/")[0]
    assert [os.fsencode(e["key"]) for e in s.skipped()] == [b"plain/broken\xe9.jpg"]
    assert os.fsencode(s.provenance["source"]["path"]) == root
    # every JSON file of the store is valid UTF-8 (the bytes are \udcXX escapes)
    for name in ("manifest.json", "errors.jsonl"):
        with open(os.path.join(dest, name), "rb") as fh:
            raw = fh.read()
        raw.decode("utf-8")
        assert b"\\udce9" in raw
    # inspect: text escapes the bytes, --json round-trips them
    env = dict(os.environ, PYTHONPATH=h.REPO, PYTHONIOENCODING="utf-8:strict")
    r = subprocess.run([sys.executable, "-m", "mmstore", "inspect", dest, "--sample", "2"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "caf\\xe9" in r.stdout and "d\\xffg" in r.stdout and "broken\\xe9" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mmstore", "inspect", dest, "--json", "--sample", "2"], env=env,
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.decode("utf-8"))
    assert [os.fsencode(n) for n in rep["label_names"]] == [b"caf\xe9", b"d\xffg", b"plain"]
    assert os.fsencode(rep["provenance"]["source"]["path"]) == root
    # convert and merge carry the names over unchanged
    out = str(tmp_path / "c")
    assert h.cli("convert", dest, out, "--backend", "lmdb", "--no-progress") == 0
    c = mmstore.open(out)
    assert c.label_names == s.label_names
    assert [c.key(i) for i in range(c.records)] == [s.key(i) for i in range(s.records)]
    assert c.skipped() == s.skipped()


def test_non_utf8_csv_paths_and_label_names(h, tmp_path):
    d = os.fsencode(str(tmp_path / "li"))
    os.makedirs(d)
    rng = np.random.default_rng(2)
    rows = [b"path,label"]
    for i, lab in enumerate([b"caf\xe9", b"th\xe9", b"caf\xe9"]):
        name = b"p\xff%d.png" % i
        h.write_image(os.path.join(d, name), h.photo(rng, 12, 12), ".png")
        rows.append(name + b"," + lab)
    with open(os.path.join(d, b"l.csv"), "wb") as fh:
        fh.write(b"\n".join(rows) + b"\n")
    dest = str(tmp_path / "s")
    assert _ingest(h, os.fsdecode(os.path.join(d, b"l.csv")), dest) == 0
    s = mmstore.open(dest)
    assert [os.fsencode(n) for n in s.label_names] == [b"caf\xe9", b"th\xe9"]
    assert s.column("label").tolist() == [0, 1, 0]
    assert os.fsencode(s.key(1)) == b"p\xff1.png"


def test_refused_ingest_leaves_no_lock_file(h, folder, tmp_path):
    root, _ = folder
    dest = str(tmp_path / "s")
    assert _ingest(h, root, dest) == 0
    assert _ingest(h, root, dest) == 2  # exists, no --overwrite: a usage error
    assert not os.path.exists(dest + ".lock")
    with pytest.raises(IngestError):
        ingest(str(tmp_path / "nothing-here"), dest, (8, 8), workers=0, quiet=True)
    assert sorted(os.listdir(tmp_path)) == ["imgs", "s"]
    shutil.rmtree(dest)


def test_npz_uint64_labels_that_do_not_fit_are_refused_not_wrapped(tmp_path):
    p = str(tmp_path / "a.npz")
    np.savez(p, x=np.zeros((3, 2, 2), np.uint8), y=np.array([1, 2, (1 << 63) + 5], np.uint64))
    with pytest.raises(IngestError, match="would wrap around"):
        ingest(p, str(tmp_path / "s"), workers=0, quiet=True)
    np.savez(p, x=np.zeros((3, 2, 2), np.uint8), y=np.array([1, 2, (1 << 63) - 1], np.uint64))
    ingest(p, str(tmp_path / "s"), workers=0, quiet=True)
    assert mmstore.open(str(tmp_path / "s")).column("label").tolist() == [1, 2, (1 << 63) - 1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@given(st.binary(min_size=1, max_size=20).filter(lambda b: b"\0" not in b))
@settings(max_examples=40, deadline=None)
def test_resume_hint_quotes_any_name_so_it_can_be_pasted(raw):
    from mmstore.cli.ingest import shell_quote

    out = subprocess.run(["bash", "-c", "printf %s " + shell_quote(os.fsdecode(raw))], capture_output=True, timeout=30)
    assert out.stdout == raw
