"""Every damaged or foreign store is refused on open with the right error, naming the file."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.faults import edit_manifest
from support.stores import write_store

import mmstore
import mmstore.format.layout as fmt
from mmstore.errors import FormatError, IncompleteStoreError, VersionError
from mmstore.format.manifest import parse_manifest

N = 10


@pytest.fixture
def store(tmp_path, backend):
    return write_store(os.path.join(tmp_path, "s"), N, backend, holes=(4,))


def test_missing_manifest_says_incomplete(store):
    os.unlink(os.path.join(store, "manifest.json"))
    with pytest.raises(IncompleteStoreError, match="not a finished mmstore store"):
        mmstore.open(store)


def test_partial_left_over_says_resume(tmp_path):
    dest = os.path.join(tmp_path, "x")
    with pytest.raises(RuntimeError):
        with mmstore.StoreWriter(dest, {"a": ("<i8", ())}, slots=3) as w:
            w.write(0, {"a": 1})
            raise RuntimeError("boom")
    assert os.path.isdir(dest + ".partial") and not os.path.exists(dest)
    with pytest.raises(IncompleteStoreError, match="resume"):
        mmstore.open(dest)
    assert isinstance(IncompleteStoreError("x"), FileNotFoundError)


def test_no_such_store(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such store"):
        mmstore.open(os.path.join(tmp_path, "nothing"))


def test_unknown_major_version(store):
    edit_manifest(store, lambda m: m.update(version=[3, 0]))
    with pytest.raises(VersionError, match="version 3.0"):
        mmstore.open(store)


def test_newer_minor_version_opens(store):
    edit_manifest(store, lambda m: m.update(version=[1, 7], new_optional_key={"x": 1}))
    assert len(mmstore.open(store)) == N - 1


@pytest.mark.parametrize("name", ["image.npy", "label.npy", "_checksums.npy", "_keys_offsets.npy", "_index.npy"])
@pytest.mark.parametrize("how", ["minus1", "plus_junk", "to_header", "to_zero", "minus_record"])
def test_npy_size_damage(tmp_path, name, how):
    store = write_store(os.path.join(tmp_path, "s"), N, "memmap", holes=(4,))
    p = os.path.join(store, name)
    size = os.path.getsize(p)
    header = 128
    if how == "plus_junk":
        with open(p, "ab") as fh:
            fh.write(b"junk")
    else:
        rec = (size - header) // (N if name != "_keys_offsets.npy" else N + 1)
        if name == "_index.npy":
            rec = (size - header) // (N - 1)
        new = {"minus1": size - 1, "to_header": header, "to_zero": 0, "minus_record": size - rec}[how]
        os.truncate(p, new)
    with pytest.raises(FormatError, match=name.replace(".", r"\.")):
        mmstore.open(store)


def test_lmdb_file_truncated_or_extended(tmp_path):
    store = write_store(os.path.join(tmp_path, "s"), N, "lmdb")
    p = os.path.join(store, "records.mdb")
    size = os.path.getsize(p)
    os.truncate(p, size - 1)
    with pytest.raises(FormatError, match=r"records\.mdb.*truncated"):
        mmstore.open(store)
    os.truncate(p, size + 4096)
    with pytest.raises(FormatError, match=r"records\.mdb"):
        mmstore.open(store)


def test_header_edited_to_claim_fewer_rows(tmp_path):
    store = write_store(os.path.join(tmp_path, "s"), N, "memmap")
    p = os.path.join(store, "image.npy")
    with open(p, "r+b") as fh:
        head = fh.read(128)
        edited = head.replace(b"'shape': (10, ", b"'shape': (9,  ")
        assert edited != head and len(edited) == len(head)
        fh.seek(0)
        fh.write(edited)
    # numpy alone would silently give 9 rows here
    assert np.load(p, mmap_mode="r").shape[0] == 9
    with pytest.raises(FormatError, match=r"image\.npy.*shape \(9, 8, 6, 3\)"):
        mmstore.open(store)


def test_wrong_dtype_in_manifest(store):
    def f(m):
        m["schema"][1]["dtype"] = "<i4"

    edit_manifest(store, f)
    with pytest.raises(FormatError):
        mmstore.open(store)


def test_wrong_schema_shape(store):
    def f(m):
        m["schema"][0]["shape"] = [8, 6, 4]

    edit_manifest(store, f)
    with pytest.raises(FormatError):
        mmstore.open(store)


def test_counts_disagree_with_files(store):
    edit_manifest(store, lambda m: m.update(records=m["records"] - 1))
    with pytest.raises(FormatError):
        mmstore.open(store)
    edit_manifest(store, lambda m: m.update(records=m["records"] + 1, slots=m["slots"] + 1))
    with pytest.raises(FormatError):
        mmstore.open(store)


def test_missing_field_file(tmp_path):
    store = write_store(os.path.join(tmp_path, "s"), N, "memmap")
    os.unlink(os.path.join(store, "score.npy"))
    with pytest.raises(FormatError, match=r"score\.npy.*missing"):
        mmstore.open(store)


@pytest.mark.parametrize("bad", ["../escape.npy", "a/b", "..", "manifest.json"])
def test_unsafe_names_in_files(store, bad):
    edit_manifest(store, lambda m: m["files"].update({bad: 1}))
    with pytest.raises(FormatError, match="unsafe"):
        mmstore.open(store)


def test_unsafe_field_name(store):
    def f(m):
        m["schema"][0]["name"] = "../../etc"

    edit_manifest(store, f)
    with pytest.raises(FormatError, match="field name"):
        mmstore.open(store)


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b"\xff\xfe", b"null", b'{"format": "mmstore"}'])
def test_garbled_manifest(store, content):
    with open(os.path.join(store, "manifest.json"), "wb") as fh:
        fh.write(content)
    with pytest.raises(FormatError, match="manifest.json"):
        mmstore.open(store)


def test_manifest_size_capped_before_parsing(store, monkeypatch):
    monkeypatch.setattr(fmt, "MANIFEST_MAX_BYTES", 100)
    with pytest.raises(FormatError, match="limit"):
        mmstore.open(store)


def test_key_files_from_another_store(tmp_path):
    a = write_store(os.path.join(tmp_path, "a"), N, "memmap")
    b = os.path.join(tmp_path, "b")
    schema = {"image": ("|u1", (8, 6, 3)), "label": ("<i8", ()), "score": ("<f4", (2,))}
    with mmstore.StoreWriter(b, schema, slots=N) as w:
        for i in range(N):
            w.write(i, {"image": np.zeros((8, 6, 3), np.uint8), "label": 0, "score": [0, 0]}, key="x" * (i + 20))
    shutil.copy(os.path.join(b, "_keys_offsets.npy"), os.path.join(a, "_keys_offsets.npy"))
    with pytest.raises(FormatError, match="_keys"):
        mmstore.open(a)


def _valid_manifest(tmp_path_factory):
    p = write_store(os.path.join(tmp_path_factory.mktemp("m"), "s"), 3, "memmap")
    with open(os.path.join(p, "manifest.json"), "rb") as fh:
        return json.loads(fh.read())


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**65) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["format", "version", "store_id", "backend", "records", "slots", "schema", "checksum",
                            "files", "label_names", "provenance", None]),
       value=JSON, raw=st.binary(max_size=64))
def test_fuzzed_manifests_only_raise_format_errors(tmp_path_factory, key, value, raw):
    base = getattr(test_fuzzed_manifests_only_raise_format_errors, "_base", None)
    if base is None:
        base = test_fuzzed_manifests_only_raise_format_errors._base = _valid_manifest(tmp_path_factory)
    if key is None:  # 64 bytes cannot hold a valid manifest
        with pytest.raises((FormatError, VersionError)):
            parse_manifest(raw)
        return
    m = json.loads(json.dumps(base))
    m[key] = value
    try:
        out = parse_manifest(json.dumps(m).encode())
    except (FormatError, VersionError):
        return
    _assert_normalised(out)


def _assert_normalised(m):
    """What parse_manifest promises about anything it accepts."""
    assert m["format"] == "mmstore" and m["version"][0] in (1, 2) and len(m["version"]) == 2
    assert isinstance(m["records"], int) and isinstance(m["slots"], int) and 0 <= m["records"] <= m["slots"]
    assert m["schema"] and len({f[0] for f in m["schema"]}) == len(m["schema"])
    for name, dtype, shape, codec in m["schema"]:
        assert codec.raw or m["version"][0] == 2
        assert isinstance(name, str) and isinstance(dtype, np.dtype) and isinstance(shape, tuple)
        assert all(isinstance(d, int) and d >= 0 for d in shape)
    assert all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in m["files"].items())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzzed_schema_entries(data):
    ent = data.draw(st.fixed_dictionaries({
        "name": JSON | st.text(max_size=5),
        "dtype": JSON | st.sampled_from(["<f4", "|u1", "<U3", "O", ">i4", "<i4"]),
        "shape": JSON,
    }))
    m = {"format": "mmstore", "version": [1, 0], "store_id": "0" * 32, "backend": "memmap", "records": 0,
         "slots": 0, "schema": [ent], "checksum": {"algorithm": "xxh3_64", "digest": "0" * 16}, "files": {}}
    try:
        out = parse_manifest(json.dumps(m).encode())
    except FormatError:
        return
    _assert_normalised(out)
    assert out["schema"][0][0] == ent["name"] and out["schema"][0][1] == np.dtype(ent["dtype"])
