"""verify --repair: bad records re-ingested from the source, byte-identically."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from support.compare import assert_reads_same, assert_same_files
from support.faults import flip_bit, flip_lmdb_bits
from support.images import make_folder
from support.proc import run_cli, run_json

import mmstore
from mmstore.errors import FormatError

cv2 = pytest.importorskip("cv2")
ingest_mod = pytest.importorskip("mmstore.ingest")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    make_folder(str(d), ("cat", "dog", "eel"), per_class=30, exts=(".png",), name="{:03d}")
    (d / "cat" / "broken.jpg").write_bytes(b"not an image")
    return str(d)


def _ingest(source, dest, backend):
    ingest_mod.ingest(source, dest, size=(16, 16), backend=backend, workers=0, quiet=True)
    return dest


def _damage(store_dir, index):
    with mmstore.open(store_dir) as s:
        slot = s.slot_view.slot(index)
        key = s.key(index)
        if s.backend_name == "memmap":
            path, off, nb = s.slot_view.backend.field_location("image")
        else:
            path = None
    if path is not None:
        flip_bit(path, off + slot * nb + 7, bit=3)
        # also damage the label of another record: repair must find the label again
        return slot, key
    flip_lmdb_bits(store_dir, [slot], 7, mask=8)
    return slot, key


def test_repair_restores_bytes(tmp_path, source, backend, capsys):
    dest = _ingest(source, str(tmp_path / "s"), backend)
    fresh = str(tmp_path / "fresh")
    shutil.copytree(dest, fresh)
    slot, key = _damage(dest, 41)
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 1 and rep["bad_records"][0]["key"] == key
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 0, rep
    assert rep["ok"] and rep["repair"]["repaired"] == [slot]
    assert_same_files(dest, fresh)


def test_repair_finds_a_damaged_label(tmp_path, source, capsys):
    dest = _ingest(source, str(tmp_path / "s"), "memmap")
    fresh = str(tmp_path / "fresh")
    shutil.copytree(dest, fresh)
    with mmstore.open(dest) as s:
        slot = s.slot_view.slot(70)
        path, off, nb = s.slot_view.backend.field_location("label")
    flip_bit(path, off + slot * nb, bit=1)
    rc, _ = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 0
    assert_same_files(dest, fresh)


def test_repair_refuses_when_source_is_gone(tmp_path, source, capsys):
    src = str(tmp_path / "src")
    shutil.copytree(source, src)
    dest = _ingest(src, str(tmp_path / "s"), "memmap")
    _damage(dest, 5)
    shutil.rmtree(src)
    rc, out, _ = run_cli(["verify", dest, "--repair"], capsys)
    assert rc == 1 and "refused" in out and "gone" in out


def test_repair_reports_a_changed_source_file(tmp_path, source, capsys):
    src = str(tmp_path / "src")
    shutil.copytree(source, src)
    dest = _ingest(src, str(tmp_path / "s"), "memmap")
    slot, key = _damage(dest, 5)
    cv2.imwrite(os.path.join(src, key), np.zeros((20, 24, 3), np.uint8))
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 1 and rep["repair"]["failed"][0]["slot"] == slot
    assert "other bytes" in rep["repair"]["failed"][0]["reason"]


def test_repair_merged_store(tmp_path, source, backend, capsys):
    """A store merged from --shard parts is repaired in its segment; it then
    reads exactly like a single ingest."""
    ref = _ingest(source, str(tmp_path / "ref"), backend)
    parts = []
    for k in range(3):
        p = str(tmp_path / f"part{k}")
        ingest_mod.ingest(source, p, size=(16, 16), backend=backend, workers=0, quiet=True, shard=(k, 3))
        parts.append(p)
    merged = ingest_mod.merge(parts, str(tmp_path / "merged"))
    with mmstore.open(merged) as s:
        index = 50
        slot, key = s.slot_view.slot(index), s.key(index)
        k = int(np.searchsorted(np.cumsum(s.segments), slot, side="right"))
        local = slot - ([0, *np.cumsum(s.segments).tolist()])[k]
        assert k == 1
        if backend == "memmap":
            seg = s.slot_view.backend.field_segments("image")[k]
            flip_bit(seg.path, seg.offset + local * seg.entry_bytes + 7, bit=3)
        else:
            flip_lmdb_bits(merged, [local], 7, mask=8, name=f"records.{k:05d}.mdb")
    rc, rep = run_json(["verify", merged], capsys)
    assert rc == 1 and [(r["slot"], r["key"]) for r in rep["bad_records"]] == [(slot, key)]
    rc, rep = run_json(["verify", merged, "--repair"], capsys)
    assert rc == 0 and rep["repair"]["repaired"] == [slot], rep
    assert_reads_same(ref, merged)
    if backend == "memmap":  # the part shares the repaired file
        rc, _ = run_json(["verify", parts[1]], capsys)
        assert rc == 0
    else:  # the rebuilt segment is a new file; the part keeps its own
        assert os.stat(os.path.join(merged, "records.00001.mdb")).st_ino != os.stat(
            os.path.join(parts[1], "records.mdb")).st_ino


def test_repair_a_store_with_a_part_table(tmp_path, source, backend, capsys, monkeypatch):
    """A store grown by append, its parts listed in a part table (format 2.4), is repaired in the part
    that holds the damage, from that part's own source: the record's bytes flipped in place in the part's
    file (its size unchanged, so the table still matches), in the first part and in the appended one;
    verify finds them, --repair rewrites them and the store then reads exactly as before the damage and
    verifies clean."""
    from mmstore.format import layout

    monkeypatch.setattr(layout, "PART_TABLE_MIN_PARTS", 1)
    more = tmp_path / "more"
    make_folder(str(more), ("cat", "dog"), per_class=6, exts=(".png",), name="m{:03d}", seed=5)
    dest = _ingest(source, str(tmp_path / "s"), backend)
    mmstore.append(dest, str(more), workers=0, quiet=True)
    assert os.path.exists(os.path.join(dest, layout.PART_TABLE_FILE))
    fresh = str(tmp_path / "fresh")
    shutil.copytree(dest, fresh)
    damaged = []
    with mmstore.open(dest) as s:
        assert len(s.parts) == 2
        for index in (10, len(s) - 3):  # one record of each part
            slot, key = s.slot_view.slot(index), s.key(index)
            firsts = s.slot_view.backend.firsts
            k = int(np.searchsorted(firsts, slot, side="right")) - 1
            local = slot - int(firsts[k])
            part = s.slot_view.backend.parts[k]
            if backend == "memmap":
                path, off, nb = part.field_location("image")
                at = off + local * nb + 7
            else:
                import lmdb

                path = part.data_paths()[0]
                env = lmdb.open(path, subdir=False, lock=False, readonly=True)
                with env.begin() as txn:
                    value = bytes(txn.get(int(local).to_bytes(8, "big")))
                env.close()
                with open(path, "rb") as fh:
                    raw = fh.read()
                assert raw.count(value) == 1
                at = raw.index(value) + 7
            damaged.append((slot, key, path, at))
    for _, _, path, at in damaged:
        flip_bit(path, at, bit=3)
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 1 and [(r["slot"], r["key"]) for r in rep["bad_records"]] == [(d[0], d[1]) for d in damaged]
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 0 and rep["repair"]["repaired"] == [d[0] for d in damaged], rep
    assert_reads_same(fresh, dest)
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 0 and rep["ok"], rep
    if backend == "memmap":  # the appended part's source gone: the other part is still repaired
        for _, _, path, at in damaged:
            flip_bit(path, at, bit=3)
        shutil.rmtree(more)
        rc, rep = run_json(["verify", dest, "--repair"], capsys)
        assert rc == 1 and rep["repair"]["repaired"] == [damaged[0][0]], rep
        assert [(f["slot"], "gone" in f["reason"]) for f in rep["repair"]["failed"]] == [(damaged[1][0], True)]


def test_repair_never_writes_through_a_linked_part_directory(tmp_path, source, capsys, monkeypatch):
    """A part directory that is a symbolic link (to files outside the store) is a structural problem: the
    store does not open, verify says so and repair writes nothing through it."""
    from mmstore.format import layout

    monkeypatch.setattr(layout, "PART_TABLE_MIN_PARTS", 1)
    more = tmp_path / "more"
    make_folder(str(more), ("cat", "dog"), per_class=3, exts=(".png",), name="m{:03d}", seed=6)
    dest = _ingest(source, str(tmp_path / "s"), "memmap")
    mmstore.append(dest, str(more), workers=0, quiet=True)
    with mmstore.open(dest) as s:
        pid = s.parts[0]
        path, off, nb = s.slot_view.backend.parts[0].field_location("image")
    outside = tmp_path / "outside"
    shutil.move(os.path.join(dest, "parts", pid), outside)
    os.symlink(outside, os.path.join(dest, "parts", pid))
    flip_bit(str(outside / os.path.basename(path)), off + 7, bit=3)
    before = (outside / os.path.basename(path)).read_bytes()
    rc, out, err = run_cli(["verify", dest, "--repair"], capsys)
    assert rc != 0 and "is a symbolic link" in out + err and "refused" in out + err
    assert (outside / os.path.basename(path)).read_bytes() == before
    with mmstore.open(dest) as s, pytest.raises(FormatError, match="part directories must be real directories"):
        s[0]  # the part table's parts are checked at their first read
