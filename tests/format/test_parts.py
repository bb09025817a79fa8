"""Stores joined from parts (format.py, "Parts"): any split of the same rows into parts gives
the store one ingest of the rows gives; a manifest naming files outside its parts, or parts
without their version and feature, is refused; an older reader refuses such a store; verify
finds damage inside a part; merge takes a store with parts as a part."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compare import assert_reads_same
from support.faults import edit_manifest, flip_bit
from support.images import encode, photo

import mmstore
from mmstore.check.verify import verify_store
from mmstore.errors import FormatError, IngestError, VersionError
from mmstore.format import layout
from mmstore.ingest import merge
from mmstore.ingest.options import make_spec
from mmstore.ingest.parts import commit_parts
from mmstore.ingest.pipeline import run_ingest
from mmstore.ingest.rows import RowsSource

SPEC = make_spec((16, 16))


def _rows(n, bad=(), seed=0):
    rng = np.random.default_rng(seed)
    images = [b"broken %d" % i if i in bad else encode(photo(rng, 20 + i % 7, 18 + i % 5), ".png")
              for i in range(n)]
    return {"image": images, "label": [i % 3 for i in range(n)], "key": [f"r{i:03d}" for i in range(n)]}


def _slice(cols, a, b):
    return {k: v[a:b] for k, v in cols.items()}


def _ingest(cols, dest, part=False, **kw):
    src = RowsSource(cols, label_names=["a", "b", "c"])
    return run_ingest(src, dest, SPEC, workers=0, quiet=True, part=part, **kw)


def _joined(cols, dest, cuts):
    """The rows written as parts cut at ``cuts``, committed as one store at ``dest``."""
    bounds = [0, *cuts, len(cols["image"])]
    ids = [f"{k:06d}-t" for k in range(len(bounds) - 1) if bounds[k + 1] > bounds[k]]  # as a task with no rows
    os.makedirs(os.path.join(dest + ".partial", "parts"))
    for pid in ids:
        k = int(pid[:6])
        _ingest(_slice(cols, bounds[k], bounds[k + 1]), os.path.join(dest + ".partial", "parts", pid), part=True)
    commit_parts(dest, ids, provenance={"test": True}, label_names=["a", "b", "c"])
    return ids


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 14), data=st.data())
def test_any_split_reads_as_one_ingest(tmp_path_factory, n, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    bad = set(data.draw(st.lists(st.integers(0, n - 1), max_size=3)))
    if len(bad) == n:
        bad.discard(0)
    cols = _rows(n, bad)
    tmp = str(tmp_path_factory.mktemp("split"))
    ref, out = os.path.join(tmp, "ref.store"), os.path.join(tmp, "parts.store")
    _ingest(cols, ref)
    ids = _joined(cols, out, cuts)
    assert_reads_same(out, ref)
    s = mmstore.open(out)
    assert s.parts == ids and s.segments == [int(c) for c in np.diff([0, *cuts, n]) if c]
    assert verify_store(out).ok
    assert sorted(os.listdir(os.path.join(out, "parts"))) == ids


@pytest.fixture
def joined(tmp_path):
    out = str(tmp_path / "j.store")
    _joined(_rows(9, bad={4}), out, [3, 6])
    return out


def _refused(store, exc, match, fn):
    edit_manifest(store, fn)
    with pytest.raises(exc, match=match):
        mmstore.open(store)


@pytest.mark.parametrize("name", ["parts/000000-t/../../etc/passwd", "parts/unknown/image.npy", "other/image.npy",
                                  "/etc/passwd", "parts/000000-t/sub/image.npy", "parts//image.npy"])
def test_a_name_outside_the_parts_is_refused(joined, name):
    def add(m):
        m["files"][name] = 10
    _refused(joined, FormatError, "unsafe file", add)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(requires=[]), "needs format version 2.2"),
    (lambda m: m.update(version=[2, 1]), "needs format version 2.2"),
    (lambda m: m.update(parts=m["parts"][:2]), "they pair up"),
    (lambda m: m.update(parts=[m["parts"][0]] * 3), "distinct part ids"),
    (lambda m: m.update(parts=["..", "a", "b"]), "distinct part ids"),
    (lambda m: m.pop("parts"), "no 'parts'"),
])
def test_bad_parts_are_refused(joined, edit, match):
    _refused(joined, FormatError, match, edit)


def test_an_older_reader_refuses_a_store_with_parts(joined, monkeypatch):
    monkeypatch.setattr(layout, "KNOWN_FEATURES", (layout.RAGGED_FEATURE,))  # a 2.1 reader
    with pytest.raises(VersionError, match=r"requires feature\(s\) \['parts'\].*upgrade mmstore"):
        mmstore.open(joined)


def test_verify_finds_damage_in_a_part(joined):
    s = mmstore.open(joined)
    pid = s.parts[1]
    s.close()
    image = os.path.join(joined, "parts", pid, "image.npy")
    flip_bit(image, os.path.getsize(image) - 5)
    rep = verify_store(joined)
    assert not rep.problems and [(b.what, b.slot, b.key) for b in rep.bad_records] == [("checksum", 5, "r005")]
    with open(os.path.join(joined, "parts", pid, "notes.txt"), "w") as f:
        f.write("mine")
    os.makedirs(os.path.join(joined, "parts", "stray-dir"))
    rep = verify_store(joined)
    kinds = {(p.kind, p.file) for p in rep.problems}
    assert ("stray", f"parts/{pid}/notes.txt") in kinds and ("stray", "parts/stray-dir") in kinds
    os.unlink(image)
    assert ("missing", f"parts/{pid}/image.npy") in {(p.kind, p.file) for p in verify_store(joined).problems}
    with pytest.raises(FormatError):
        mmstore.open(joined)


def test_merge_takes_a_store_with_parts(joined, tmp_path):
    other = str(tmp_path / "o.store")
    _ingest(_rows(4, seed=5), other)
    out = str(tmp_path / "m.store")
    merge([joined, other], out)
    a, b, m = mmstore.open(joined), mmstore.open(other), mmstore.open(out)
    assert len(m) == len(a) + len(b) and m.parts is None and len(m.segments) == 4
    for i in range(len(a)):
        assert np.array_equal(m[i]["image"], a[i]["image"]) and m.key(i) == a.key(i)
    assert np.array_equal(m[len(a)]["image"], b[0]["image"])
    assert verify_store(out).ok


def test_parts_that_disagree_are_not_joined(tmp_path):
    out = str(tmp_path / "d.store")
    os.makedirs(os.path.join(out + ".partial", "parts"))
    _ingest(_rows(3), os.path.join(out + ".partial", "parts", "a"), part=True)
    src = RowsSource({"image": [np.zeros((4, 4), np.uint8)] * 2})
    run_ingest(src, os.path.join(out + ".partial", "parts", "b"), None, workers=0, quiet=True, part=True)
    with pytest.raises(IngestError, match="part b has schema"):
        commit_parts(out, ["a", "b"], provenance={})
    assert not os.path.exists(out)


def test_a_damaged_part_manifest_digest_is_caught(tmp_path):
    out = str(tmp_path / "x.store")
    os.makedirs(os.path.join(out + ".partial", "parts"))
    part = os.path.join(out + ".partial", "parts", "a")
    _ingest(_rows(5), part, part=True)
    with open(os.path.join(part, "_keys.bin"), "r+b") as f:
        f.write(b"X")
    with pytest.raises(FormatError, match="does not match the part's manifest"):
        commit_parts(out, ["a"], provenance={})


@pytest.mark.parametrize("threads", [2, 3])
def test_decoding_on_threads_writes_the_same_store(tmp_path, threads):
    """A Ray write task decodes its rows on threads: the part equals one decoded on one thread
    (many small ranges, bad inputs among them), and a failure stops every thread."""
    cols = _rows(40, bad={3, 17, 18, 39})
    ref, out = str(tmp_path / "one.store"), str(tmp_path / "many.store")
    _ingest(cols, ref, chunk=3)
    res = _ingest(cols, out, chunk=3, threads=threads)
    assert (res.records, res.skipped) == (36, 4)
    assert_reads_same(out, ref)
    with pytest.raises(IngestError, match="broken|decode|corrupt"):
        _ingest(cols, str(tmp_path / "fail.store"), chunk=3, threads=threads, on_error="fail")
    assert not os.path.exists(tmp_path / "fail.store")
    with pytest.raises(IngestError, match="max"):
        _ingest(cols, str(tmp_path / "few.store"), chunk=1, threads=threads, max_errors=1)
    assert not os.path.exists(tmp_path / "few.store")
