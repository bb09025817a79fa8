"""Golden stores: stores written once per format version (``golden/``, by
``golden/make_golden.py``) read back exactly the values ``golden/expected.json``
says, through every read path, and verify as intact; a newer major version
is refused. Each test reads a copy in ``tmp_path``: the files in the
repository are never opened for writing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import mmstore
from mmstore.check.verify import verify_store
from mmstore.errors import VersionError
from mmstore.format import (
    MANIFEST_FILE,
    PLAIN_VERSION,
    RAGGED_VERSION,
    READ_MAJORS,
    SEGMENTED_VERSION,
    VARIABLE_VERSION,
    manifest_version,
)

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
with open(os.path.join(GOLDEN, "expected.json"), encoding="utf-8") as _fh:
    EXPECTED: dict[str, Any] = json.load(_fh)
NAMES = sorted(EXPECTED)
REPO = os.path.dirname(os.path.dirname(GOLDEN))


def _name_version(name: str) -> tuple[int, int]:
    """``v<major>_<minor>_...``: the version a golden store's name says."""
    major, minor = name[1:].split("_")[:2]
    return int(major), int(minor)


@pytest.fixture(params=NAMES)
def golden(request, tmp_path) -> tuple[str, dict[str, Any]]:
    """(path of a copy of the golden store, its expected.json entry)."""
    name = request.param
    dst = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), dst)
    return str(dst), EXPECTED[name]


def _spec(exp: dict[str, Any], field: str) -> dict[str, Any]:
    return next(f for f in exp["schema"] if f["name"] == field)


def _as_numpy(got: Any) -> Any:
    """A torch tensor as a numpy array; anything else as it is."""
    if hasattr(got, "numpy") and not isinstance(got, np.ndarray):
        return got.numpy()
    return got


def _check(got: Any, want: Any, spec: dict[str, Any], where: str) -> None:
    """``got`` (one record's value of the field ``spec``) is exactly ``want``
    (its expected.json form: nested lists, a str, or bytes as hex)."""
    got = _as_numpy(got)
    if spec["dtype"] == "str":
        assert type(got) is str and got == want, where
        return
    if spec["dtype"] == "bytes":
        assert type(got) is bytes and got == bytes.fromhex(want), where
        return
    shape = spec["shape"]
    w = np.array(want, dtype=spec["dtype"])
    w = w.reshape((-1, *shape[1:])) if shape[:1] == [None] else w.reshape(shape)
    got = np.asarray(got)
    assert got.dtype == w.dtype, (where, got.dtype, w.dtype)
    assert got.shape == w.shape, (where, got.shape, w.shape)
    assert np.array_equal(got, w), where


def _check_record(rec: Any, exp: dict[str, Any], j: int, where: str) -> None:
    item = exp["items"][j]
    assert set(rec) == set(item["values"]), where
    for spec in exp["schema"]:
        f = spec["name"]
        _check(rec[f], item["values"][f], spec, f"{where}: record {j} field {f}")


def _is_ragged(spec: dict[str, Any]) -> bool:
    return spec["shape"][:1] == [None]


def _rows(batch: dict[str, Any], exp: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``read_batch`` result as one dict per record (a ragged field's
    ``Ragged`` split into its records)."""
    n = len(next(iter(batch.values())))
    cols = {}
    for spec in exp["schema"]:
        v = batch[spec["name"]]
        cols[spec["name"]] = v.split() if _is_ragged(spec) else v
        assert len(cols[spec["name"]]) == n
    return [{f: c[j] for f, c in cols.items()} for j in range(n)]


def test_every_golden_store_is_listed():
    """Every directory under golden/ has its expected values, and the other
    way round; each name says its version."""
    dirs = sorted(d for d in os.listdir(GOLDEN) if os.path.isdir(os.path.join(GOLDEN, d)) and d != "__pycache__")
    assert dirs == NAMES
    for name in NAMES:
        assert tuple(EXPECTED[name]["version"]) == _name_version(name)
    # one store at least of every version a writer writes
    assert {PLAIN_VERSION, SEGMENTED_VERSION, VARIABLE_VERSION, RAGGED_VERSION} <= {_name_version(n) for n in NAMES}


def test_manifest_and_store_attributes(golden):
    path, exp = golden
    with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as fh:
        raw = json.load(fh)
    assert raw["version"] == exp["version"]
    assert raw["schema"] == exp["schema"]
    s = mmstore.open(path)
    version = tuple(exp["version"])
    assert s.manifest["version"] == version == _name_version(os.path.basename(path))
    # what this mmstore writes for such a store is still that version
    assert manifest_version(s.schema.has_variable, s.segments is not None, s.schema.has_ragged,
                            s.parts is not None) == version
    assert s.backend_name == exp["backend"]
    assert (len(s), s.records, s.slots) == (exp["records"], exp["records"], exp["slots"])
    assert s.segments == exp["segments"]
    assert s.label_names == exp["label_names"]
    assert list(s.fields) == [f["name"] for f in exp["schema"]]
    assert len(exp["items"]) == exp["records"]


def test_getitem(golden):
    path, exp = golden
    s = mmstore.open(path)
    for j in range(len(s)):
        _check_record(s[j], exp, j, "store[i]")
    _check_record(s[-1], exp, len(s) - 1, "store[-1]")


def test_read_batch(golden):
    path, exp = golden
    s = mmstore.open(path)
    n = len(s)
    for idx in (list(range(n)), [n - 1, 0, n // 2, 0, n - 1]):
        rows = _rows(s.read_batch(idx), exp)
        assert len(rows) == len(idx)
        for rec, j in zip(rows, idx):
            _check_record(rec, exp, j, f"read_batch({idx})")
    # one field at a time
    for spec in exp["schema"]:
        got = s.read_batch(list(range(n)), fields=spec["name"])
        assert list(got) == [spec["name"]]


def test_iteration(golden):
    path, exp = golden
    recs = list(mmstore.open(path))
    assert len(recs) == exp["records"]
    for j, rec in enumerate(recs):
        _check_record(rec, exp, j, "iteration")


def test_column(golden):
    path, exp = golden
    s = mmstore.open(path)
    for spec in exp["schema"]:
        f = spec["name"]
        col = s.column(f)
        values = col.split() if _is_ragged(spec) else col
        assert len(values) == exp["records"]
        if not _is_ragged(spec):
            assert col.shape == (exp["records"], *spec["shape"])
        for j, v in enumerate(values):
            _check(v, exp["items"][j]["values"][f], spec, f"column({f!r})[{j}]")


def test_keys_slots_and_skipped(golden):
    path, exp = golden
    s = mmstore.open(path)
    for j, item in enumerate(exp["items"]):
        assert s.key(j) == item["key"]
        assert s.slot_view.slot(j) == item["slot"]
    for hole in exp["skipped"]:
        assert s.slot_view.slot_key_bytes(hole["slot"]) == hole["key"].encode("utf-8")
    assert s.skipped() == exp["skipped"]
    assert s.skipped_annotations() == []


def test_verify_reports_intact(golden):
    path, exp = golden
    rep = verify_store(path, decode=True)
    assert rep.ok, rep.summary()
    assert rep.content_checked
    assert (rep.records, rep.slots) == (exp["records"], exp["slots"])


def test_cli_inspect_and_verify(golden):
    path, exp = golden
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-m", "mmstore", "inspect", "--json", path],
                       capture_output=True, text=True, check=False, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["format_version"] == exp["version"]
    assert (rep["records"], rep["slots"]) == (exp["records"], exp["slots"])
    r = subprocess.run([sys.executable, "-m", "mmstore", "verify", "--no-progress", "--decode", path],
                       capture_output=True, text=True, check=False, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_torch_dataset(golden):
    pytest.importorskip("torch")
    from mmstore.torch import StoreDataset

    path, exp = golden
    ds = StoreDataset(path)
    assert len(ds) == exp["records"]
    for j in range(len(ds)):
        _check_record(ds[j], exp, j, "StoreDataset[i]")
    seen = []
    for a in range(0, len(ds), 4):
        idx = list(range(a, min(a + 4, len(ds))))
        batch = ds.__getitems__(idx)
        assert len(batch) == len(idx)
        for k, j in enumerate(idx):
            _check_record(batch[k], exp, j, "StoreDataset.__getitems__ sample")
            _check_record({f: batch.data[f][k] for f in ds.fields}, exp, j, "StoreDataset.__getitems__ data")
        seen += idx
    assert seen == list(range(exp["records"]))


def test_torch_loader(golden):
    pytest.importorskip("torch")
    from mmstore.torch import Loader

    path, exp = golden
    j = 0
    with Loader(path, 4, "sequential") as loader:
        for batch in loader:
            n = len(batch[exp["schema"][0]["name"]])
            assert n == min(4, exp["records"] - j)
            for k in range(n):
                _check_record({f: batch[f][k] for f in batch}, exp, j, "Loader")
                j += 1
    assert j == exp["records"]  # every record once, in order


@pytest.mark.parametrize("name", NAMES)
def test_newer_major_version_is_refused(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), dst)
    mpath = dst / MANIFEST_FILE
    m = json.loads(mpath.read_text(encoding="utf-8"))
    newer = max(READ_MAJORS) + 1
    for major in (newer, 99):
        m["version"] = [major, 0]
        mpath.write_text(json.dumps(m), encoding="utf-8")
        with pytest.raises(VersionError):
            mmstore.open(dst)
