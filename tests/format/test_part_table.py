"""The part table (format 2.4, "The part table"): a store of many parts lists them in
``_parts.bin`` instead of the manifest. It round-trips; a store with it reads exactly as the
same store in the JSON form; an open reads no part file (each part's files are checked at that
part's first read, and by verify); every kind of damage to the table is a typed error at open,
at the first read or in verify, never a wrong record; an older reader refuses it; the writers
(the join of parts, append, merge) and the whole-store tools work on it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compare import assert_reads_same
from support.faults import edit_manifest, flip_bit
from support.images import encode, photo
from support.proc import REPO, cli_env
from support.stores import write_many_parts

import mmstore
from mmstore.check.verify import verify_store
from mmstore.errors import FormatError, VersionError
from mmstore.format import layout
from mmstore.format.manifest import read_manifest
from mmstore.format.parttable import decode_part_table, encode_part_table, part_table_bytes
from mmstore.ingest import merge
from mmstore.ingest.append import append
from mmstore.ingest.options import make_spec
from mmstore.ingest.parts import commit_parts
from mmstore.ingest.pipeline import run_ingest
from mmstore.ingest.rows import RowsSource
from mmstore.store.writer import file_digest

TABLE = layout.PART_TABLE_FILE
SPEC = make_spec((16, 16))


def _rows(n, bad=(), seed=0):
    rng = np.random.default_rng(seed)
    images = [b"broken %d" % i if i in bad else encode(photo(rng, 20 + i % 7, 18 + i % 5), ".png")
              for i in range(n)]
    return {"image": images, "label": [i % 3 for i in range(n)], "key": [f"r{i:03d}" for i in range(n)]}


@pytest.fixture
def always_table(monkeypatch):
    """Writers list every store's parts in a part table, however few."""
    monkeypatch.setattr(layout, "PART_TABLE_MIN_PARTS", 1)


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(st.tuples(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True),
                                st.integers(0, 50), st.integers(0, 2**40)), min_size=1, max_size=20,
                      unique_by=lambda p: p[0]))
def test_the_table_round_trips(parts):
    ids = [p[0] for p in parts]
    counts = [p[1] for p in parts]
    sizes = [[p[2], p[1] * 8 + 128] for p in parts]
    raw = encode_part_table(ids, counts, sizes)
    assert len(raw) == part_table_bytes(len(ids), 2, sum(len(i) for i in ids))
    import xxhash

    t = decode_part_table(raw, parts=len(ids), files_per_part=2, slots=sum(counts),
                          digest=xxhash.xxh3_64(raw).hexdigest(), path="t")
    assert t.ids() == ids and [t.id(k) for k in range(len(ids))] == ids
    assert t.counts() == counts and t.sizes.tolist() == sizes
    assert t.firsts.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()


def test_a_store_with_a_table_reads_as_its_json_form(tmp_path):
    a, b = str(tmp_path / "table.store"), str(tmp_path / "json.store")
    ids = write_many_parts(a, 50, per=7)
    assert write_many_parts(b, 50, per=7, table=False) == ids
    with open(os.path.join(a, "manifest.json")) as fh:
        raw = json.load(fh)
    with open(os.path.join(b, "manifest.json")) as fh:
        raw_b = json.load(fh)
    assert raw["version"] == [2, 4] and raw["requires"] == ["parts", "part_table"]
    assert raw["part_table"] == {"file": TABLE, "parts": 8}
    assert "parts" not in raw and "segments" not in raw and not any("/" in n for n in raw["files"])
    assert TABLE in raw["digests"] and TABLE not in raw_b["files"]
    assert_reads_same(a, b)
    s, j = mmstore.open(a), mmstore.open(b)
    assert s.parts == j.parts == ids and s.segments == j.segments == [7] * 7 + [1]
    assert s.manifest["files"] == {**j.manifest["files"], TABLE: os.path.getsize(os.path.join(a, TABLE))}
    assert read_manifest(a)["parts"] == ids and read_manifest(a, expand=False)["parts"] is None
    assert [s.key(i) for i in (0, 49)] == ["k0", "k49"]
    assert verify_store(a).ok


def test_an_older_reader_refuses_the_table(tmp_path, monkeypatch):
    a = str(tmp_path / "t.store")
    write_many_parts(a, 4)
    monkeypatch.setattr(layout, "KNOWN_FEATURES", (layout.RAGGED_FEATURE, layout.PARTS_FEATURE,
                                                   layout.SHAPES_FEATURE))  # a 2.3 reader
    with pytest.raises(VersionError, match=r"requires feature\(s\) \['part_table'\].*upgrade mmstore"):
        mmstore.open(a)


def test_open_reads_no_part_file_and_a_part_is_checked_at_its_first_read(tmp_path):
    """5,000 parts: with the whole ``parts`` directory moved away the store still opens and
    says its length (nothing of a part is touched); a read of any part then fails with a
    typed error naming the part's file. Back in place, every record reads right."""
    a = str(tmp_path / "many.store")
    write_many_parts(a, 5000)
    os.rename(os.path.join(a, "parts"), str(tmp_path / "away"))
    s = mmstore.open(a)
    assert len(s) == 5000 and s.key(4999) == "k4999"
    with pytest.raises(FormatError, match=r"parts/04321-p/idx.npy: missing"):
        s[4321]
    s.close()
    os.rename(str(tmp_path / "away"), os.path.join(a, "parts"))
    with mmstore.open(a) as s:  # closed: each part read holds its file open until then
        assert int(s[4321]["idx"]) == 4321
        assert np.array_equal(s.read_batch(np.arange(0, 5000, 97))["idx"], np.arange(0, 5000, 97))


def test_a_truncated_part_file_is_found_at_that_parts_first_read_and_by_verify(tmp_path):
    a = str(tmp_path / "t.store")
    write_many_parts(a, 30, per=10)
    path = os.path.join(a, "parts", "00001-p", "idx.npy")
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 8)
    s = mmstore.open(a)  # the part's files are not looked at yet
    assert int(s[3]["idx"]) == 3 and int(s[25]["idx"]) == 25
    for i in (10, 19):
        with pytest.raises(FormatError, match=r"00001-p/idx.npy: expected \d+ bytes \(10 rows\), found"):
            s[i]
    rep = verify_store(a)
    assert not rep.ok and any(p.file == "parts/00001-p/idx.npy" for p in rep.problems)


def _table_edit(store, edit):
    """Change the part table's bytes with ``edit`` and list its new size and digest in the
    manifest, as a crafted store would (so the rule itself is what is checked)."""
    path = os.path.join(store, TABLE)
    with open(path, "rb") as fh:
        raw = edit(bytearray(fh.read()))
    with open(path, "wb") as fh:
        fh.write(raw)

    def fix(m):
        m["files"][TABLE] = len(raw)
        m["digests"][TABLE] = file_digest(path)
    edit_manifest(store, fix)


def _u8(raw, at, value):
    raw[at:at + 8] = int(value).to_bytes(8, "little")
    return raw


# 4 parts of 3 slots, one file each: ends at 32, sizes at 64, id ends at 96, ids ("00000-p", ...) at 128
DAMAGE = {
    "truncated": (lambda s: os.truncate(os.path.join(s, TABLE), 100), "expected 156 bytes"),
    "bit flip": (lambda s: flip_bit(os.path.join(s, TABLE), 40), "its digest is"),
    "bit flip in an id": (lambda s: flip_bit(os.path.join(s, TABLE), 130), "its digest is"),
    "wrong count": (lambda s: edit_manifest(s, lambda m: m["part_table"].update(parts=3)),
                    "the table holds 4 parts, the manifest says 3"),
    "non-monotonic segments": (lambda s: _table_edit(s, lambda r: _u8(r, 48, 5)),
                               "part 2 ends at slot 5, before part 1 \\(slot 6\\)"),
    "ends past the slots": (lambda s: _table_edit(s, lambda r: _u8(r, 56, 13)), "the parts end at slot 13"),
    "bad id": (lambda s: _table_edit(s, lambda r: r[:140] + b"/" + r[141:]), "id b'00001/p' is not a part id"),
    "id ends": (lambda s: _table_edit(s, lambda r: _u8(r, 96, 0)), "the part ids' ends must rise"),
    "oversized claim": (lambda s: edit_manifest(s, lambda m: m["files"].update({TABLE: 10**12})),
                        "_parts.bin' in 'files' \\(at most"),
    "oversized ids": (lambda s: _table_edit(s, lambda r: _u8(r, 24, 10**9)), "claims 1000000000 bytes of part ids"),
    "not a table": (lambda s: _table_edit(s, lambda r: b"PK" + r[2:]), "expected a part table starting"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_to_the_table_is_a_typed_error_never_a_wrong_record(tmp_path, kind):
    a = str(tmp_path / "t.store")
    write_many_parts(a, 12, per=3)
    assert os.path.getsize(os.path.join(a, TABLE)) == 128 + 4 * 7  # the offsets above hold
    damage, match = DAMAGE[kind]
    damage(a)
    with pytest.raises(FormatError, match=match):  # at open, or at the first read: before any record
        s = mmstore.open(a)
        s[0]
    rep = verify_store(a)
    assert not rep.ok and any(re.search(match, p.message) for p in rep.problems), rep.problems


def _plain_ingest(cols, dest, part=False):
    return run_ingest(RowsSource(cols), dest, SPEC, workers=0, quiet=True, part=part)


def test_the_writers_write_the_table(tmp_path, always_table):
    """The join of parts (``mmstore.ray.write``'s commit) and append write the table; merge
    of a store with one reads each part's files from it."""
    cols = _rows(9, bad={4})
    ref, out = str(tmp_path / "ref.store"), str(tmp_path / "t.store")
    _plain_ingest(cols, ref)
    ids = ["000000-t", "000001-t", "000002-t"]
    os.makedirs(os.path.join(out + ".partial", "parts"))
    for k, pid in enumerate(ids):
        _plain_ingest({c: v[3 * k : 3 * k + 3] for c, v in cols.items()},
                      os.path.join(out + ".partial", "parts", pid), part=True)
    commit_parts(out, ids, provenance={"test": True})
    assert read_manifest(out, expand=False)["part_table"] == {"file": TABLE, "parts": 3}
    assert_reads_same(out, ref)
    assert mmstore.open(out).parts == ids and verify_store(out).ok
    more = _rows(4, seed=3)
    more["key"] = [f"m{i}" for i in range(4)]
    append(out, RowsSource(more), size=(16, 16), workers=0, quiet=True)
    m = read_manifest(out, expand=False)
    assert m["part_table"]["parts"] == 4 and m["records"] == 12 and verify_store(out).ok
    s = mmstore.open(out)
    assert s.parts[:3] == ids and [s.key(i) for i in range(8, 12)] == more["key"]
    merged = str(tmp_path / "m.store")
    merge([out, ref], merged)
    g = mmstore.open(merged)
    assert len(g) == 20 and all(np.array_equal(g[i]["image"], s[i]["image"]) for i in range(12))


def test_inspect_and_verify_see_every_part(tmp_path):
    a = str(tmp_path / "t.store")
    write_many_parts(a, 40, per=4)
    out = subprocess.run([sys.executable, "-m", "mmstore", "inspect", a], capture_output=True, text=True,
                         env=cli_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "segments     10" in out.stdout
    path = os.path.join(a, "parts", "00007-p", "idx.npy")
    flip_bit(path, os.path.getsize(path) - 1)
    rep = verify_store(a)
    assert [(b.what, b.slot) for b in rep.bad_records] == [("checksum", 31)]
