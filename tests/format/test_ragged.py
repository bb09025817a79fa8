"""Ragged fields: a variable leading dimension, str and bytes, on the
offsets layout of encoded fields (format.py, "Ragged fields"), format 2.1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compare import store_bytes
from support.faults import edit_manifest
from support.stores import finish_resumed

import mmstore
from mmstore.check import convert_store, inspect_store, verify_store
from mmstore.errors import EntryDecodeError, FormatError, SchemaError, VersionError
from mmstore.format.ragged import Ragged
from mmstore.format.schema import Schema
from mmstore.ingest import from_dataset

N = 17
HOLES = (5,)
SCHEMA = {
    "image": ("|u1", (6, 5, 3)),
    "boxes": ("<f4", (None, 4)),
    "poly": ("<f8", (None, 2), "zstd:3"),
    "tokens": ("<i8", (None,)),
    "caption": "str",
    "blob": (bytes, None),
}


def make(slot: int) -> dict:
    rng = np.random.default_rng(slot)
    return {
        "image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
        "boxes": rng.random((slot % 4, 4)).astype(np.float32),  # slot 0, 4, 8...: zero boxes
        "poly": rng.standard_normal((slot % 3 * 2, 2)),
        "tokens": list(range(slot % 6)),  # a list of ints, cast safely to int64
        "caption": "" if slot % 5 == 0 else f"caption {slot}: caf\u00e9 \u2603" * (slot % 3 + 1),
        "blob": bytes(rng.integers(0, 256, slot % 7, dtype=np.uint8)),
    }


def write(path, order=None, backend="memmap", n=N, holes=HOLES) -> str:
    with mmstore.StoreWriter(path, SCHEMA, slots=n, backend=backend) as w:
        for s in range(n) if order is None else order:
            if s in holes:
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
            else:
                w.write(s, make(s), key=f"in/{s}")
    return str(path)


def same(got, want, field: str) -> bool:
    if field in ("caption", "blob"):
        return type(got) is type(want) and got == want
    want = np.asarray(want, SCHEMA[field][0]).reshape((-1, *SCHEMA[field][1][1:]))
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


RECORDS = [s for s in range(N) if s not in HOLES]


@pytest.fixture(scope="module", params=["memmap", "lmdb"])
def store(request, tmp_path_factory):
    return write(tmp_path_factory.mktemp("ragged") / "s", backend=request.param)


def test_schema_spelling_and_json_round_trip():
    s = Schema(SCHEMA)
    assert s.to_json()[1:] == [
        {"name": "boxes", "dtype": "<f4", "shape": [None, 4]},
        {"name": "poly", "dtype": "<f8", "shape": [None, 2], "codec": {"name": "zstd", "level": 3}},
        {"name": "tokens", "dtype": "<i8", "shape": [None]},
        {"name": "caption", "dtype": "str", "shape": [None]},
        {"name": "blob", "dtype": "bytes", "shape": [None]},
    ]
    assert Schema.from_json(s.to_json()) == s and Schema(s) == s
    assert [f.name for f in s.ragged_fields] == ["boxes", "poly", "tokens", "caption", "blob"]
    assert s["boxes"].row_bytes == 16 and s["caption"].kind == "str" and s.record_bytes == 90
    with pytest.raises(SchemaError, match="raw or with zstd, not jpeg:90"):
        Schema({"b": ("|u1", (None, 4, 4), "jpeg:90")})
    with pytest.raises(SchemaError, match="at least one byte"):
        Schema({"b": ("<f4", (None, 0))})
    with pytest.raises(SchemaError, match="shape must be a tuple of ints"):
        Schema({"b": ("<f4", (4, None))})


def test_manifest_is_2_1_and_requires_ragged(store):
    with open(os.path.join(store, "manifest.json")) as fh:
        m = json.load(fh)
    assert m["version"] == [2, 1] and m["requires"] == ["ragged"]
    assert {"name": "caption", "dtype": "str", "shape": [None]} in m["schema"]
    if m["backend"] == "memmap":
        assert {"boxes.bin", "boxes.offsets.npy", "caption.bin", "image.npy"} <= set(m["files"])
        offs = np.load(os.path.join(store, "boxes.offsets.npy"))
        sizes = np.diff(offs)
        assert [int(x) for x in sizes] == [0 if s in HOLES else 16 * (s % 4) for s in range(N)]
        with open(os.path.join(store, "caption.bin"), "rb") as fh:
            blob = fh.read()
        o = np.load(os.path.join(store, "caption.offsets.npy"))
        assert blob[o[3] : o[4]] == make(3)["caption"].encode("utf-8")  # UTF-8, nothing else


def test_store_getitem_gives_each_record_at_its_own_length(store):
    s = mmstore.open(store)
    assert len(s) == len(RECORDS)
    for i, slot in enumerate(RECORDS):
        rec, want = s[i], make(slot)
        assert list(rec) == list(SCHEMA)
        assert np.array_equal(rec["image"], want["image"])
        for f in ("boxes", "poly", "tokens", "caption", "blob"):
            assert same(rec[f], want[f], f), (slot, f)
    assert s[0]["boxes"].shape == (0, 4) and s[0]["caption"] == ""  # empty entries are valid


def test_read_batch_returns_ragged_in_the_requested_order(store):
    s = mmstore.open(store)
    idx = [7, 0, 3, 3, len(s) - 1, 1, 0]
    b = s.read_batch(idx)
    assert isinstance(b["boxes"], Ragged) and b["image"].shape == (7, 6, 5, 3)
    for f in ("boxes", "poly", "tokens", "caption", "blob"):
        r = b[f]
        assert len(r) == 7 and r.offsets.dtype == np.int64 and r.offsets[0] == 0
        assert r.offsets[-1] == len(r.values)
        for j, i in enumerate(idx):
            assert same(r[j], make(RECORDS[i])[f], f), (f, j)
        assert all(same(x, make(RECORDS[i])[f], f) for x, i in zip(r.split(), idx))
    boxes = b["boxes"]
    assert boxes.values.shape == (int(boxes.lengths.sum()), 4) and boxes.values.dtype == np.float32
    assert boxes.lengths.tolist() == [RECORDS[i] % 4 for i in idx]
    # out= keeps working for the fixed fields; a ragged field in out is refused
    out = {"image": np.zeros((7, 6, 5, 3), np.uint8)}
    got = s.read_batch(idx, out=out)
    assert got["image"] is out["image"] and np.array_equal(out["image"], b["image"])
    with pytest.raises(TypeError, match="ragged field"):
        s.read_batch(idx, out={"boxes": np.zeros((7, 4), np.float32)})
    assert len(s.read_batch([], fields="boxes")["boxes"]) == 0
    assert [r["caption"] for r in s] == [make(x)["caption"] for x in RECORDS]  # iteration
    assert s[2:5]["tokens"].split()[1].tolist() == list(range(RECORDS[3] % 6))


def test_write_batch_append_and_any_order_give_the_same_bytes(tmp_path, store):
    backend = mmstore.open(store).backend_name
    want = store_bytes(store)
    assert store_bytes(write(tmp_path / "rev", order=reversed(range(N)), backend=backend)) == want
    with mmstore.StoreWriter(tmp_path / "b", SCHEMA, slots=N, backend=backend) as w:
        recs = [make(s) for s in range(N)]
        w.slot_writer.write_batch(0, {f: [r[f] for r in recs] for f in SCHEMA})
        w.mark_written(range(N))
        for s in range(N):
            w.set_key(s, f"in/{s}")
            if s in HOLES:
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
    assert store_bytes(tmp_path / "b") == want


def test_resume_keeps_committed_slots_and_gives_the_same_bytes(tmp_path, store):
    backend = mmstore.open(store).backend_name
    dest = tmp_path / "k"
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = [{os.path.dirname(os.path.dirname(__file__))!r}, {os.path.dirname(__file__)!r}]
        import mmstore
        from test_ragged import SCHEMA, N, HOLES, make
        w = mmstore.StoreWriter({str(dest)!r}, SCHEMA, slots=N, backend={backend!r})
        for s in range(8):
            w.write(s, make(s)) if s not in HOLES else w.skip(s, "x", "r")
        w.sync()
        w.write(9, make(40))  # never committed: must not survive
        w.write(3, make(41))  # a rewrite after the commit, also lost
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    finish_resumed(dest, SCHEMA, N, HOLES, make, 8, backend)
    assert store_bytes(dest) == store_bytes(store)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("boxes", np.zeros((2, 3), np.float32), r"field 'boxes': expected rows of shape \(4,\)"),
    ("boxes", [[1, 2, 3, 4], [1, 2]], "field 'boxes'"),
    ("tokens", [0.5, 1.0], "field 'tokens': converting float64 to <i8 would change values"),
    ("caption", b"bytes", "field 'caption': expected str, found bytes"),
    ("caption", "\udcff", "field 'caption': text is not encodable as UTF-8"),
    ("blob", "text", "field 'blob': expected bytes, found str"),
    ("boxes", "1 2 3 4", "field 'boxes': expected rows of"),
])
def test_values_that_do_not_fit_are_refused_naming_field_and_slot(tmp_path, field, value, match):
    with mmstore.StoreWriter(tmp_path / "w", SCHEMA, slots=3) as w:
        rec = make(1)
        rec[field] = value
        with pytest.raises(SchemaError, match=f"record at slot 2: {match}"):
            w.write(2, rec)
        for s in range(3):
            w.write(s, make(s))
    ok = make(1)
    ok["tokens"] = np.array([1, 2], np.uint8)  # a safe cast
    ok["boxes"] = [[1, 2, 3, 4]]  # a list of rows, cast losslessly to float32
    assert Schema(SCHEMA).validate(ok)["tokens"].dtype == np.int64


def _copy(store, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(store, dst)
    return str(dst)


def _poke_bin(path, name, slot, data: bytes) -> None:
    """Overwrite the start of ``slot``'s entry of ``name`` (memmap store)."""
    o = np.load(os.path.join(path, f"{name}.offsets.npy"))
    with open(os.path.join(path, f"{name}.bin"), "r+b") as fh:
        fh.seek(int(o[slot]))
        fh.write(data)


def test_invalid_utf8_and_odd_sizes_raise_naming_record_field_and_key(tmp_path):
    path = _copy(write(tmp_path / "s"), tmp_path)
    _poke_bin(path, "caption", 6, b"\xff")
    s = mmstore.open(path)
    i = RECORDS.index(6)
    with pytest.raises(EntryDecodeError, match=f"record {i} \\(slot 6, key 'in/6'\\): field 'caption'.*UTF-8"):
        s[i]
    with pytest.raises(EntryDecodeError, match=f"record {i} \\(slot 6, key 'in/6'\\): field 'caption'"):
        s.read_batch([0, i])
    assert s.read_batch([0, 1])["caption"][1] == make(1)["caption"]  # the others still read
    # a cut inside a character: the next entry starts with a continuation byte
    o = np.load(os.path.join(path, "caption.offsets.npy"), mmap_mode="r+")
    a = int(o[8]) + make(8)["caption"].encode().index("\u00e9".encode()) + 1
    o[9] = a  # slot 8's entry now ends inside its 'é', slot 9's starts there
    o.flush()
    del o
    r = mmstore.open(path)
    with pytest.raises(EntryDecodeError, match="record \\d+ \\(slot (8|9), key 'in/(8|9)'\\): field 'caption'.*UTF-8"):
        r.read_batch([RECORDS.index(8), RECORDS.index(9)])
    # an entry that is not a whole number of rows
    o = np.load(os.path.join(path, "boxes.offsets.npy"), mmap_mode="r+")
    o[3] += 4
    o.flush()
    del o
    with pytest.raises(EntryDecodeError, match="slot (2|3).*field 'boxes'.*not a whole number of 16-byte rows"):
        mmstore.open(path)[RECORDS.index(3)]
    rep = verify_store(path, decode=True)
    kinds = {(b.slot, b.what) for b in rep.bad_records}
    assert (6, "decode") in kinds and (6, "checksum") in kinds and (3, "decode") in kinds


def test_offsets_of_a_ragged_field_are_checked_at_open(tmp_path):
    path = _copy(write(tmp_path / "s"), tmp_path)
    with open(os.path.join(path, "boxes.bin"), "ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(FormatError, match="boxes.bin"):
        mmstore.open(path)


def test_verify_inspect_convert_keep_ragged_fields(store, tmp_path):
    assert verify_store(store, decode=True).ok
    rep = inspect_store(store)
    lens = {r["name"]: r for r in rep.ragged_lengths}
    want = [RECORDS_len % 4 for RECORDS_len in RECORDS]
    assert lens["boxes"]["min"] == 0 and lens["boxes"]["max"] == 3 and lens["boxes"]["total"] == sum(want)
    assert lens["boxes"]["empty"] == want.count(0) and lens["boxes"]["mean"] == round(np.mean(want), 2)
    assert lens["poly"]["total"] == sum(s % 3 * 2 for s in RECORDS)  # zstd: decoded
    assert lens["caption"]["unit"] == "bytes"
    assert lens["caption"]["total"] == sum(len(make(s)["caption"].encode()) for s in RECORDS)
    src = mmstore.open(store)
    other = "lmdb" if src.backend_name == "memmap" else "memmap"
    dst = convert_store(store, tmp_path / "c", backend=other, codecs={"boxes": "zstd:5", "poly": "raw"}).dest
    c = mmstore.open(dst)
    assert c.schema["boxes"].codec.spec == "zstd:5" and c.schema["poly"].codec.raw and c.schema["poly"].ragged
    assert verify_store(dst, decode=True).ok
    a, b = src.read_batch(np.arange(len(src))), c.read_batch(np.arange(len(c)))
    for f in SCHEMA:
        if f == "image":
            assert np.array_equal(a[f], b[f])
        else:
            assert np.array_equal(a[f].values, b[f].values) and np.array_equal(a[f].offsets, b[f].offsets)
    back = convert_store(dst, tmp_path / "back", backend=src.backend_name,
                         codecs={"boxes": "raw", "poly": "zstd:3"}).dest
    assert store_bytes(back) == store_bytes(store)


def split_into_segments(path, counts) -> None:
    """A memmap store made segmented by hand (format.py, "Segments"): each
    segment's ``<field>.<k>.bin`` / ``.offsets.npy`` (local offsets) or
    ``<field>.<k>.npy``; the bookkeeping files stay as they are."""
    with open(os.path.join(path, "manifest.json")) as fh:
        m = json.load(fh)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    files = {n: v for n, v in m["files"].items() if n.startswith("_") or n == "errors.jsonl"}
    for f in Schema.from_json(m["schema"]):
        if f.variable:
            offs = np.load(os.path.join(path, f"{f.name}.offsets.npy"))
            with open(os.path.join(path, f"{f.name}.bin"), "rb") as fh:
                blob = fh.read()
            for k in range(len(counts)):
                a, b = bounds[k], bounds[k + 1]
                with open(os.path.join(path, f"{f.name}.{k:05d}.bin"), "wb") as fh:
                    fh.write(blob[int(offs[a]) : int(offs[b])])
                np.save(os.path.join(path, f"{f.name}.{k:05d}.offsets.npy"), (offs[a : b + 1] - offs[a]).astype("<u8"))
            os.unlink(os.path.join(path, f"{f.name}.bin"))
            os.unlink(os.path.join(path, f"{f.name}.offsets.npy"))
        else:
            arr = np.load(os.path.join(path, f"{f.name}.npy"))
            for k in range(len(counts)):
                np.save(os.path.join(path, f"{f.name}.{k:05d}.npy"), arr[bounds[k] : bounds[k + 1]])
            os.unlink(os.path.join(path, f"{f.name}.npy"))
    for n in os.listdir(path):
        if n not in files and n != "manifest.json":
            files[n] = os.path.getsize(os.path.join(path, n))
    edit_manifest(path, lambda m: m.update(files=files, segments=list(counts)))


def test_a_segmented_ragged_store_reads_like_the_single_one(tmp_path):
    one = mmstore.open(write(tmp_path / "one"))
    seg_path = write(tmp_path / "seg")
    split_into_segments(seg_path, [6, 0, 11])
    seg = mmstore.open(seg_path)
    assert seg.slot_view.backend.segmented
    idx = np.random.default_rng(3).permutation(len(one))
    a, b = one.read_batch(idx), seg.read_batch(idx)
    for f in SCHEMA:
        x, y = a[f], b[f]
        assert np.array_equal(x, y) if f == "image" else (np.array_equal(x.values, y.values)
                                                          and np.array_equal(x.offsets, y.offsets))
    assert all(same(seg[i]["poly"], make(s)["poly"], "poly") for i, s in enumerate(RECORDS))
    assert verify_store(seg_path, decode=True).ok


def test_an_unknown_required_feature_is_a_version_error_and_ragged_needs_2_1(tmp_path):
    path = write(tmp_path / "s")
    p2 = _copy(path, tmp_path)
    edit_manifest(p2, lambda m: m.update(requires=["ragged", "holograms"]))
    with pytest.raises(VersionError, match="requires feature\\(s\\) \\['holograms'\\].*upgrade mmstore"):
        mmstore.open(p2)
    edit_manifest(p2, lambda m: m.update(requires=[]))
    with pytest.raises(FormatError, match="need format version 2.1 and 'requires'"):
        mmstore.open(p2)
    edit_manifest(p2, lambda m: m.update(requires=["ragged"], version=[2, 0]))
    with pytest.raises(FormatError, match="need format version 2.1"):
        mmstore.open(p2)


class _Items:
    def __init__(self, n: int, bad: int = -1) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        r = make(i)
        item = {"image": r["image"], "label": i % 3, "boxes": r["boxes"].tolist(), "tokens": r["tokens"],
                "caption": r["caption"]}
        if i == self.bad:
            item["boxes"] = [[1.0, 2.0]]
        return item


FIELDS = {"boxes": ("<f4", (None, 4)), "tokens": ("<i8", (None,)), "caption": "str"}


def test_from_dataset_stores_ragged_fields_the_same_for_any_worker_count(tmp_path):
    a = str(tmp_path / "a")
    from_dataset(_Items(12, bad=4), a, workers=0, fields=FIELDS)
    b = str(tmp_path / "b")
    from_dataset(_Items(12, bad=4), b, workers=2, fields=FIELDS)
    assert store_bytes(a) == store_bytes(b)
    s = mmstore.open(a)
    assert s.schema.names == ("image", "label", "boxes", "tokens", "caption") and len(s) == 11
    (hole,) = s.skipped()
    assert hole["slot"] == 4 and "field 'boxes': expected rows of shape (4,)" in hole["reason"]
    for i, slot in enumerate([x for x in range(12) if x != 4]):
        rec = s[i]
        for f in FIELDS:
            assert same(rec[f], make(slot)[f], f)
    b = s.read_batch(np.arange(len(s)))
    assert b["boxes"].lengths.tolist() == [x % 4 for x in range(12) if x != 4]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), dtype=st.sampled_from(["<f4", "<i8", "|u1", "<u2", "|b1", "<c8"]),
       row=st.sampled_from([(), (2,), (3, 2)]), codec=st.sampled_from([None, "zstd:1"]),
       backend=st.sampled_from(["memmap", "lmdb"]))
def test_property_ragged_round_trip_in_any_order(tmp_path_factory, data, dtype, row, codec, backend):
    n = data.draw(st.integers(1, 12))
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    texts = data.draw(st.lists(st.text(max_size=6), min_size=n, max_size=n))
    rng = np.random.default_rng(n)
    vals = [(rng.standard_normal((k, *row)) * 50).astype(dtype) for k in lengths]
    path = tmp_path_factory.mktemp("prop") / "s"
    with mmstore.StoreWriter(path, {"v": (dtype, (None, *row), codec), "t": "str"}, slots=n, backend=backend) as w:
        for s in reversed(range(n)):
            w.write(s, {"v": vals[s], "t": texts[s]})
    st_ = mmstore.open(path)
    idx = data.draw(st.lists(st.integers(0, n - 1), max_size=20))
    b = st_.read_batch(idx)
    assert b["v"].lengths.tolist() == [lengths[i] for i in idx] and b["t"].split() == [texts[i] for i in idx]
    for j, i in enumerate(idx):
        got = b["v"][j]
        assert got.dtype == np.dtype(dtype) and got.shape == vals[i].shape and got.tobytes() == vals[i].tobytes()
    for i in range(n):
        assert st_[i]["v"].tobytes() == vals[i].tobytes() and st_[i]["t"] == texts[i]


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_shards_merged_read_like_one_run_and_verify(tmp_path, backend):
    from mmstore.ingest.merge import merge

    ref = str(tmp_path / "ref")
    from_dataset(_Items(14, bad=9), ref, workers=0, fields=FIELDS, backend=backend)
    parts = []
    for k in range(3):
        parts.append(str(tmp_path / f"p{k}"))
        from_dataset(_Items(14, bad=9), parts[-1], workers=0, fields=FIELDS, backend=backend, shard=(k, 3))
    out = merge([parts[2], parts[0], parts[1]], tmp_path / "m")
    a, m = mmstore.open(ref), mmstore.open(out)
    assert m.segments is not None and len(m) == len(a) == 13 and m.manifest["version"] == (2, 1)
    idx = np.random.default_rng(0).permutation(len(a))
    x, y = a.read_batch(idx), m.read_batch(idx)
    for f in FIELDS:
        assert np.array_equal(x[f].values, y[f].values) and np.array_equal(x[f].offsets, y[f].offsets)
    assert all(same(m[i]["boxes"], a[i]["boxes"], "boxes") for i in range(len(a)))
    assert verify_store(out, decode=True).ok
    assert np.array_equal(m.slot_view.checksums(), a.slot_view.checksums())


@pytest.mark.parametrize(("ent", "match"), [
    ({"name": "b", "dtype": "<f4", "shape": [4, None]}, "shape must be a list of ints"),
    # two variable dimensions: an image of its own shape (format 2.3), which needs its size field b_hw
    ({"name": "b", "dtype": "<f4", "shape": [None, None]}, "companion field 'b_hw'"),
    ({"name": "b", "dtype": "<f4", "shape": [None, None, None]}, "\\[null, null, C\\] with C from 1 to 4"),
    ({"name": "b", "dtype": "str", "shape": [None, 2]}, "a str field has shape \\[null\\]"),
    ({"name": "b", "dtype": "bytes", "shape": [3]}, "a ragged field's shape must be \\[null"),
    ({"name": "b", "dtype": "<f4", "shape": [None, 0]}, "at least one byte"),
    ({"name": "b", "dtype": "<f4", "shape": [None, 4], "codec": {"name": "png", "level": 1}}, "raw or with zstd"),
    ({"name": "b", "dtype": "f4", "shape": [None, 4]}, "is not explicit"),
])
def test_manifest_schema_of_ragged_fields_is_checked(tmp_path, ent, match):
    from mmstore import format as fmt

    path = write(tmp_path / "s", n=2, holes=())
    with open(os.path.join(path, "manifest.json")) as fh:
        m = json.load(fh)
    m["schema"][1] = ent
    with pytest.raises(FormatError, match=match):
        fmt.parse_manifest(json.dumps(m).encode())


def test_inspect_cli_prints_lengths(store, capsys):
    from mmstore.cli import main

    assert main(["inspect", store]) == 0
    out = capsys.readouterr().out
    n0 = sum(1 for s in RECORDS if s % 4 == 0)
    assert f"ragged       boxes: 0 to 3 rows per record, mean {round(np.mean([s % 4 for s in RECORDS]), 2)}" in out
    assert f"{sum(s % 4 for s in RECORDS)} in all, {n0} records with none" in out
    assert [ln.split()[:3] for ln in out.splitlines() if ln.split()[:1] == ["boxes"]] == [["boxes", "<f4", "nx4"]]
