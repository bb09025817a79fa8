"""verify: clean stores pass; damage of every kind is found and named."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from support.faults import flip_bit, flip_lmdb_bits, sync_manifest
from support.proc import run_cli, run_json, run_sub
from support.stores import image_store, write_store

import mmstore
from mmstore.check.repair import repair_store
from mmstore.check.verify import verify_store


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """10,000 records of 16x16x3, three holes (built once)."""
    d = tmp_path_factory.mktemp("big")
    path, imgs = image_store(d / "big.store", n=10_000, holes=(10, 500, 9000))
    return path


def test_clean_store_passes_both_backends(tmp_path, backend, capsys):
    p = write_store(tmp_path / "s", 300, backend=backend, holes=(4, 77))
    rc, rep = run_json(["verify", p], capsys)
    assert rc == 0 and rep["ok"] and rep["content_checked"]
    assert rep["problems"] == [] and rep["bad_records"] == [] and rep["checked_slots"] == 300
    rc, out, _ = run_cli(["verify", p], capsys)
    assert rc == 0 and "OK" in out


def test_single_flipped_bit_in_10000_records_is_named(big, tmp_path, capsys):
    p = str(tmp_path / "copy")
    shutil.copytree(big, p)
    s = mmstore.open(p)
    index = 6789
    slot = s.slot_view.slot(index)
    key = s.key(index)
    path, off, nb = s.slot_view.backend.field_location("image")
    s.close()
    flip_bit(path, off + slot * nb + 137, bit=5)
    rep = verify_store(p, threads=2)
    assert not rep.ok and rep.bad_count == 1
    (b,) = rep.bad_records
    assert (b.index, b.slot, b.key, b.what) == (index, slot, key, "checksum")
    rc, j = run_json(["verify", p], capsys)
    assert rc == 1 and j["bad_records"][0]["index"] == index and j["bad_records"][0]["key"] == "img/06791.png"
    rc, out, _ = run_cli(["verify", p], capsys)
    assert rc == 1 and "index 6789" in out and "img/06791.png" in out
    # --quick does not read records: passes
    rc, out, _ = run_cli(["verify", p, "--quick"], capsys)
    assert rc == 0


def test_flipped_bit_lmdb(tmp_path):
    p = write_store(tmp_path / "l", 200, backend="lmdb", holes=(3,))
    flip_lmdb_bits(p, [150], 10)
    rep = verify_store(p)
    assert [(b.slot, b.index, b.what) for b in rep.bad_records] == [(150, 149, "checksum")]


def test_lmdb_extra_key_and_hole_with_record(tmp_path):
    p = write_store(tmp_path / "l", 50, backend="lmdb", holes=(7,))
    import lmdb

    with mmstore.open(p) as s:
        rb = s.schema.record_bytes
    env = lmdb.open(os.path.join(p, "records.mdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put((7).to_bytes(8, "big"), bytes(rb))
        txn.put((999).to_bytes(8, "big"), bytes(rb))
    env.close()
    sync_manifest(p, "records.mdb")
    rep = verify_store(p)
    whats = sorted(b.what for b in rep.bad_records)
    assert whats == ["extra-key", "hole-has-record"]
    assert [pr.kind for pr in rep.problems] == ["lmdb-keys"]  # key count differs from records
    rr = repair_store(p, rep)  # dropping the two keys needs no source
    assert rr.attempted and rr.failed == []
    assert verify_store(p).ok


@pytest.mark.parametrize("change", ["truncate", "extend"])
@pytest.mark.parametrize("name", ["image.npy", "_checksums.npy", "_keys.bin"])
def test_truncated_or_extended_file(tmp_path, name, change, capsys):
    p = write_store(tmp_path / "s", 40)
    fp = os.path.join(p, name)
    size = os.path.getsize(fp)
    with open(fp, "r+b") as fh:
        if change == "truncate":
            fh.truncate(size - 3)
        else:
            fh.seek(size)
            fh.write(b"xyz")
    rc, rep = run_json(["verify", p], capsys)
    assert rc == 1
    assert any(pr["kind"] == "size" and pr["file"] == name for pr in rep["problems"])


def test_manifest_from_another_store(tmp_path, capsys):
    a = write_store(tmp_path / "a", 40)
    b = write_store(tmp_path / "b", 40, make=lambda i: {"image": np.full((8, 6, 3), i % 200, np.uint8),
                                                         "label": np.int64(1), "score": np.zeros(2, np.float32)})
    shutil.copy(os.path.join(b, "manifest.json"), os.path.join(a, "manifest.json"))
    rc, rep = run_json(["verify", a, "--quick"], capsys)
    assert rc == 1 and [pr["kind"] for pr in rep["problems"]] == ["digest"]


def test_stray_and_missing_files(tmp_path, capsys):
    p = write_store(tmp_path / "s", 40, holes=(2,))
    with open(os.path.join(p, "notes.txt"), "w") as fh:
        fh.write("hi")
    os.unlink(os.path.join(p, "errors.jsonl"))
    rc, rep = run_json(["verify", p], capsys)
    kinds = {(pr["kind"], pr["file"]) for pr in rep["problems"]}
    assert rc == 1 and ("stray", "notes.txt") in kinds and ("missing", "errors.jsonl") in kinds


def test_index_and_keys_consistency(tmp_path):
    p = write_store(tmp_path / "s", 40, holes=(2, 5))
    s = mmstore.open(p)
    off = s._ix_offset
    ko = s._ko_offset
    s.close()
    # index: swap two entries -> not strictly increasing
    ip = os.path.join(p, "_index.npy")
    arr = np.fromfile(ip, dtype="<u8", offset=off)
    arr[[3, 4]] = arr[[4, 3]]
    with open(ip, "r+b") as fh:
        fh.seek(off)
        fh.write(arr.tobytes())
    # keys: make offsets decrease
    kp = os.path.join(p, "_keys_offsets.npy")
    ko_arr = np.fromfile(kp, dtype="<u8", offset=ko)
    ko_arr[10] = ko_arr[12] + 1
    with open(kp, "r+b") as fh:
        fh.seek(ko)
        fh.write(ko_arr.tobytes())
    rep = verify_store(p, quick=True)
    kinds = {pr.kind for pr in rep.problems}
    assert {"index", "keys"} <= kinds


def test_nonzero_hole_memmap(tmp_path):
    p = write_store(tmp_path / "s", 30, holes=(9,))
    s = mmstore.open(p)
    path, off, nb = s.slot_view.backend.field_location("score")
    s.close()
    flip_bit(path, off + 9 * nb)
    rep = verify_store(p)
    assert [(b.slot, b.index, b.what) for b in rep.bad_records] == [(9, None, "hole-not-zero")]


def test_not_a_store_is_exit_2(tmp_path, capsys):
    rc, _, err = run_cli(["verify", tmp_path / "nothing"], capsys)
    assert rc == 2 and "no such store" in err
    os.makedirs(tmp_path / "empty")
    rc, _, _ = run_cli(["verify", tmp_path / "empty"], capsys)
    assert rc == 2


def test_garbled_manifest_is_a_problem(tmp_path, capsys):
    p = write_store(tmp_path / "s", 10)
    with open(os.path.join(p, "manifest.json"), "w") as fh:
        fh.write("{not json")
    rc, rep = run_json(["verify", p], capsys)
    assert rc == 1 and rep["problems"][0]["kind"] == "manifest"


def test_subprocess_verify(tmp_path):
    p = write_store(tmp_path / "s", 20)
    r = run_sub(["verify", p, "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    flip_bit(os.path.join(p, "label.npy"), os.path.getsize(os.path.join(p, "label.npy")) - 1)
    r = run_sub(["verify", p])
    assert r.returncode == 1 and "index 19" in r.stdout


def test_flipped_bit_in_keys_is_a_digest_problem(tmp_path, capsys):
    p = write_store(tmp_path / "s", 40)
    with mmstore.open(p) as s:  # the writer records a digest of each bookkeeping file
        assert set(s.manifest["digests"]) == {"_keys.bin", "_keys_offsets.npy"}
    flip_bit(os.path.join(p, "_keys.bin"), 17, bit=2)
    rc, rep = run_json(["verify", p, "--quick"], capsys)
    assert rc == 1 and any(pr["kind"] == "digest" and pr["file"] == "_keys.bin" for pr in rep["problems"])


def test_lmdb_many_records_across_transaction_chunks(tmp_path):
    p = write_store(tmp_path / "l", 5000, backend="lmdb", holes=(1024, 4999))
    assert verify_store(p, threads=2).ok and verify_store(p, threads=3).checked_slots == 5000
    flip_lmdb_bits(p, (1023, 1025, 2500, 4998), -1)
    for threads in (1, 2, 3):
        rep = verify_store(p, threads=threads)
        assert [b.slot for b in rep.bad_records] == [1023, 1025, 2500, 4998]
        assert [b.index for b in rep.bad_records] == [1023, 1024, 2499, 4997]
