"""Damaged stores, every file, both backends: refused on open or by verify with
a precise message; never a shorter array or wrong data returned silently."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from support.faults import edit_manifest
from support.stores import write_store

import mmstore
from mmstore.check import verify_store
from mmstore.errors import FormatError, IncompleteStoreError, VersionError

N = 12
SCHEMA = {"image": ("|u1", (8, 8, 3)), "label": ("<i8", ())}


def _make(path, backend, seed=0):
    rng = np.random.default_rng(seed)  # drawn in slot order

    def record(s):
        return {"image": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "label": s}

    return write_store(path, N, backend, holes=(5,), schema=SCHEMA, make=record, keys="k{}", reason="corrupt: test")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return {b: _make(str(tmp_path_factory.mktemp(b) / "s"), b) for b in ("memmap", "lmdb")}


def _damage(path, name, how):
    p = os.path.join(path, name)
    size = os.path.getsize(p)
    rec = {"image.npy": 192, "label.npy": 8, "_checksums.npy": 8, "_keys_offsets.npy": 8, "_index.npy": 8}.get(name)
    if how == "minus1":
        os.truncate(p, size - 1)
    elif how == "minus_record":  # one record (lmdb: one page; text files: half)
        os.truncate(p, size - rec if rec else size - 4096 if name.endswith(".mdb") else size // 2)
    elif how == "to_header":  # .npy: the header only; others: the first bytes
        os.truncate(p, 128 if name.endswith(".npy") else min(size - 1, 4096 if name.endswith(".mdb") else 1))
    elif how == "zero":
        os.truncate(p, 0)
    elif how == "junk":
        with open(p, "ab") as fh:
            fh.write(b"\x00junk" * 3)


def _refused(path):
    """Open must fail with FormatError, or verify must report a problem."""
    try:
        store = mmstore.open(path)
    except FormatError as exc:
        return str(exc)
    rep = verify_store(path, threads=1)
    assert not rep.ok, "a damaged store passed verify"
    store.close()
    return rep.summary()


FILES = {
    "memmap": ["image.npy", "label.npy", "_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy",
               "errors.jsonl"],
    "lmdb": ["records.mdb", "_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl"],
}
CASES = [(b, f, h) for b in FILES for f in FILES[b] for h in ("minus1", "minus_record", "to_header", "zero", "junk")]


@pytest.mark.parametrize("backend,name,how", CASES)
def test_every_file_truncated_or_extended(pristine, tmp_path, backend, name, how):
    path = str(tmp_path / "s")
    shutil.copytree(pristine[backend], path)
    _damage(path, name, how)
    msg = _refused(path)
    assert name in msg or "FAILED" in msg


MANIFEST_CASES = {
    "empty": lambda p: open(os.path.join(p, "manifest.json"), "w").close(),
    "truncated": lambda p: os.truncate(os.path.join(p, "manifest.json"),
                                       os.path.getsize(os.path.join(p, "manifest.json")) // 2),
    "wrong_schema_dtype": lambda p: edit_manifest(p, lambda m: m["schema"][1].update(dtype="<i4")),
    "wrong_schema_shape": lambda p: edit_manifest(p, lambda m: m["schema"][0].update(shape=[8, 8, 1])),
    "fewer_records": lambda p: edit_manifest(p, lambda m: m.update(records=m["records"] - 1)),
    "fewer_slots": lambda p: edit_manifest(p, lambda m: m.update(slots=m["slots"] - 1, records=m["records"] - 1)),
    "dotdot_file": lambda p: edit_manifest(p, lambda m: m["files"].update({"../x": 3})),
    "dotdot_field": lambda p: edit_manifest(p, lambda m: m["schema"][0].update(name="..")),
    "size_lie": lambda p: edit_manifest(p, lambda m: m["files"].update({"_keys.bin": m["files"]["_keys.bin"] + 1})),
}


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_damaged_manifest_refused_on_open(pristine, tmp_path, backend, case):
    path = str(tmp_path / "s")
    shutil.copytree(pristine[backend], path)
    MANIFEST_CASES[case](path)
    with pytest.raises(FormatError, match="manifest|npy|mdb|keys"):
        mmstore.open(path)


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_missing_and_wrong_version(pristine, tmp_path, backend):
    path = str(tmp_path / "s")
    shutil.copytree(pristine[backend], path)
    edit_manifest(path, lambda m: m.update(version=[9, 1]))
    with pytest.raises(VersionError, match="9.1"):
        mmstore.open(path)
    os.unlink(os.path.join(path, "manifest.json"))
    with pytest.raises(IncompleteStoreError):
        mmstore.open(path)


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_manifest_from_another_store_is_caught_by_verify(pristine, tmp_path, backend):
    other = _make(str(tmp_path / "other"), backend, seed=1)  # same schema and counts, other pixels
    path = str(tmp_path / "s")
    shutil.copytree(pristine[backend], path)
    shutil.copy(os.path.join(other, "manifest.json"), os.path.join(path, "manifest.json"))
    try:
        mmstore.open(path)
    except FormatError:
        return  # refused outright (e.g. lmdb file size differs)
    rep = verify_store(path, quick=True)
    assert not rep.ok and any(p.kind == "digest" for p in rep.problems), rep.problems


def test_stray_file_is_reported_by_verify(pristine, tmp_path):
    path = str(tmp_path / "s")
    shutil.copytree(pristine["memmap"], path)
    with open(os.path.join(path, "notes.txt"), "w") as fh:
        fh.write("hi")
    rep = verify_store(path, quick=True)
    assert not rep.ok and any("notes.txt" in p.message for p in rep.problems)
