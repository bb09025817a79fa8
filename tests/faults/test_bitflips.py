"""Single-bit flips in record data: verify detects every one and names the record."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.faults import flip_bit
from support.stores import write_store

import mmstore
from mmstore.check import verify_store

N = 300
SCHEMA = {"image": ("|u1", (16, 16, 3)), "label": ("<i8", ()), "box": ("<f4", (4,))}


def _rec(i):
    rng = np.random.default_rng(1000 + i)
    return {"image": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "label": i % 10,
            "box": rng.random(4, dtype=np.float32)}


def _store(path, backend, holes=(7, 150)):
    return write_store(path, N, backend, holes, schema=SCHEMA, make=_rec, keys="src/{}.jpg", reason="corrupt: test")


def test_100_random_flips_in_memmap_data_files_each_named(tmp_path):
    path = _store(str(tmp_path / "s"), "memmap")
    store = mmstore.open(path)
    assert verify_store(path, threads=1).ok
    rng = np.random.default_rng(0)
    fields = list(SCHEMA)
    for trial in range(100):
        name = fields[int(rng.integers(0, len(fields)))]
        fpath, off0, entry = store.slot_view.backend.field_location(name)
        slot = int(rng.integers(0, N))
        offset = off0 + slot * entry + int(rng.integers(0, entry))
        bit = int(rng.integers(0, 8))
        flip_bit(fpath, offset, bit)
        try:
            rep = verify_store(path, threads=1)
            assert not rep.ok, f"trial {trial}: flip in {name} slot {slot} not detected"
            assert [r.slot for r in rep.bad_records] == [slot], (trial, rep.bad_records)
            bad = rep.bad_records[0]
            assert bad.key == f"src/{slot}.jpg"
            if slot in (7, 150):
                assert bad.index is None and bad.what == "hole-not-zero"
            else:
                assert bad.index == store.slot_view.slots_of(np.arange(len(store))).tolist().index(slot)
                assert bad.what == "checksum"
        finally:
            flip_bit(fpath, offset, bit)
    assert verify_store(path, threads=2).ok


def test_flips_in_lmdb_values_each_named(tmp_path):
    path = _store(str(tmp_path / "s"), "lmdb")
    store = mmstore.open(path)
    mdb = os.path.join(path, "records.mdb")
    with open(mdb, "rb") as fh:
        raw = fh.read()
    rng = np.random.default_rng(1)
    live = [s for s in range(N) if s not in (7, 150)]
    for trial in range(30):
        slot = live[int(rng.integers(0, len(live)))]
        rec = _rec(slot)
        packed = rec["image"].tobytes() + np.int64(rec["label"]).tobytes() + rec["box"].tobytes()
        where = raw.find(packed)
        assert where >= 0
        offset = where + int(rng.integers(0, len(packed)))
        bit = int(rng.integers(0, 8))
        flip_bit(mdb, offset, bit)
        try:
            rep = verify_store(path, threads=1)
            assert [r.slot for r in rep.bad_records] == [slot], (trial, rep.bad_records, rep.problems)
            assert rep.bad_records[0].index == live.index(slot)
            assert rep.bad_records[0].key == f"src/{slot}.jpg"
        finally:
            flip_bit(mdb, offset, bit)
    store.close()
    assert verify_store(path).ok


@pytest.mark.parametrize("target", ["_checksums.npy", "_keys.bin", "_keys_offsets.npy", "_index.npy"])
def test_flips_in_bookkeeping_files_never_pass(tmp_path, target):
    path = _store(str(tmp_path / "s"), "memmap")
    p = os.path.join(path, target)
    size = os.path.getsize(p)
    rng = np.random.default_rng(2)
    start = 128 if target.endswith(".npy") else 0
    for _ in range(10):
        off = int(rng.integers(start, size))
        bit = int(rng.integers(0, 8))
        flip_bit(p, off, bit)
        try:
            rep = verify_store(path, threads=1)
            assert not rep.ok, f"flip at {target}:{off} bit {bit} passed verify"
        except mmstore.FormatError:
            pass  # refused outright is fine too
        finally:
            flip_bit(p, off, bit)
