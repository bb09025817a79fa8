"""Compact records: variable-size encoded fields through StoreWriter,
the 2.0 format on disk, and every read path (format.py, "Encoded fields")."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compare import store_bytes
from support.faults import edit_manifest, sync_manifest
from support.images import photo
from support.stores import finish_resumed

import mmstore
from mmstore.errors import EntryDecodeError, FormatError, SchemaError, VersionError
from mmstore.format import layout as fmt
from mmstore.format.codecs import parse_codec
from mmstore.format.schema import Schema
from mmstore.store.writer import SlotWriter

N = 23
HOLES = (4, 17)
SCHEMA = {
    "image": ("|u1", (20, 24, 3), "jpeg:90"),
    "label": ("<i8", ()),
    "depth": ("<u2", (10, 12), "png:1"),
    "emb": ("<f4", (3, 5), "zstd:3"),
    "ids": ("<i8", (7,), "zstd"),
}


def make(slot: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(slot)
    return {
        "image": photo(rng, 20, 24),
        "label": np.int64(slot * 3),
        "depth": rng.integers(0, 65536, (10, 12), dtype=np.uint16),
        "emb": rng.standard_normal((3, 5)).astype(np.float32),
        "ids": rng.integers(-(2**62), 2**62, 7, dtype=np.int64),
    }


def write(path, order=None, schema=SCHEMA, n=N, holes=HOLES, **kw) -> str:
    with mmstore.StoreWriter(path, schema, slots=n, **kw) as w:
        for s in (range(n) if order is None else order):
            if s in holes:
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
            else:
                w.write(s, make(s), key=f"in/{s}")
    return str(path)


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def raw_entries(path, field):
    """Entries of ``field`` read as a reader without mmstore would: numpy and
    the .bin (memmap), or the lmdb values' layout (format.py)."""
    if os.path.exists(os.path.join(path, "records.mdb")):
        return _lmdb_entries(path, field)
    offs = np.load(os.path.join(path, f"{field}.offsets.npy"))
    with open(os.path.join(path, f"{field}.bin"), "rb") as fh:
        blob = fh.read()
    return [blob[int(offs[s]) : int(offs[s + 1])] for s in range(len(offs) - 1)]


def _lmdb_entries(path, field):
    import lmdb

    m = _manifest(path)
    var = [f["name"] for f in m["schema"] if "codec" in f]
    rb = sum(np.dtype(f["dtype"]).itemsize * int(np.prod(f["shape"])) for f in m["schema"] if "codec" not in f)
    out = []
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp()  # py-lmdb opens a file once per process: read a copy
    shutil.copy(os.path.join(path, "records.mdb"), os.path.join(tmp, "r.mdb"))
    env = lmdb.open(os.path.join(tmp, "r.mdb"), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        for s in range(m["slots"]):
            v = txn.get(s.to_bytes(8, "big"))
            if v is None:
                out.append(b"")
                continue
            lens = np.frombuffer(v, "<u8", len(var), rb).tolist()
            assert rb + 8 * len(var) + sum(lens) == len(v)
            k = var.index(field)
            a = rb + 8 * len(var) + sum(lens[:k])
            out.append(v[a : a + lens[k]])
    env.close()
    shutil.rmtree(tmp)
    return out


def _fixed(path, field):
    """Raw field ``field`` of every slot (memmap file, or the lmdb value's head)."""
    if not os.path.exists(os.path.join(path, "records.mdb")):
        return np.load(os.path.join(path, f"{field}.npy"))
    s = mmstore.open(path)
    out = np.zeros((s.slots, *s.schema[field].shape), s.schema[field].dtype)
    out[s.slot_view.index] = s.column(field)
    return out


@pytest.fixture(scope="module", params=["memmap", "lmdb"])
def store(tmp_path_factory, request):
    order = np.random.default_rng(5).permutation(N).tolist()
    return write(tmp_path_factory.mktemp("c") / "s", order=order, backend=request.param)


def _backend(path):
    return _manifest(path)["backend"]


def test_manifest_and_files_of_a_compact_store(store):
    m = _manifest(store)
    if m["backend"] == "lmdb":
        assert sorted(os.listdir(store)) == sorted(["manifest.json", "_checksums.npy", "_keys_offsets.npy", "_keys.bin",
                                                    "_index.npy", "errors.jsonl", "records.mdb"])
        return
    assert m["version"] == [2, 0]
    assert [f.get("codec") for f in m["schema"]] == [
        {"name": "jpeg", "quality": 90}, None, {"name": "png", "level": 1}, {"name": "zstd", "level": 3},
        {"name": "zstd", "level": 3}]
    assert sorted(os.listdir(store)) == sorted([
        "manifest.json", "_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl",
        "label.npy", "image.bin", "image.offsets.npy", "depth.bin", "depth.offsets.npy", "emb.bin",
        "emb.offsets.npy", "ids.bin", "ids.offsets.npy"])
    s = mmstore.open(store)
    assert len(s) == N - len(HOLES) and s.slots == N
    assert s.schema.record_bytes == 8 and [f.name for f in s.schema.fixed_fields] == ["label"]


def test_entries_are_the_codec_bytes_and_decode_as_the_library_does(store):
    import simplejpeg

    jpeg = parse_codec("jpeg:90")
    s = mmstore.open(store)
    entries = {f: raw_entries(store, f) for f in ("image", "depth", "emb", "ids")}
    for slot in range(N):
        if slot in HOLES:
            assert all(entries[f][slot] == b"" for f in entries)
            continue
        want = make(slot)
        i = int(np.searchsorted(s.slot_view.index, slot))
        got = s[i]
        assert entries["image"][slot] == jpeg.encode(want["image"])
        ref = simplejpeg.decode_jpeg(entries["image"][slot], colorspace="RGB", fastdct=False, fastupsample=False)
        assert np.array_equal(got["image"], ref)
        # jpeg:90 (4:2:0) of a tiny photo; garbage is ~85
        assert np.abs(got["image"].astype(int) - want["image"]).mean() < 16
        for f in ("label", "depth", "emb", "ids"):  # lossless: exact
            assert got[f].dtype == want[f].dtype and np.array_equal(got[f], want[f]), f
        assert s.key(i) == f"in/{slot}"
    assert s.slot_view.entry_sizes("image").tolist() == [len(entries["image"][t]) for t in s.slot_view.index.tolist()]
    assert s.slot_view.entry_sizes("label").tolist() == [8] * len(s)


def test_store_writer_records_the_encoders_it_used(tmp_path):
    """A store written with StoreWriter directly names its encoder libraries
    (repair re-encodes with them), keeps a caller's own record, and a store
    without encoded fields names none."""
    from mmstore.check.repair import encoder_mismatch
    from mmstore.format.codecs import library_versions

    s = mmstore.open(write(tmp_path / "a", n=3, holes=()))
    assert s.provenance["codec_libraries"] == library_versions(["jpeg:90", "png:1", "zstd:3"])
    assert encoder_mismatch(s) == ""
    given = {"jpeg": "simplejpeg 0.0 (elsewhere)"}
    s = mmstore.open(write(tmp_path / "b", n=3, holes=(), provenance={"codec_libraries": given}))
    assert s.provenance["codec_libraries"] == given and "simplejpeg 0.0" in encoder_mismatch(s)
    with mmstore.StoreWriter(tmp_path / "c", {"label": ("<i8", ())}) as w:
        w.append({"label": np.int64(1)})
    assert "codec_libraries" not in mmstore.open(tmp_path / "c").provenance


def test_checksums_follow_the_format_rule(store):
    s = mmstore.open(store)
    entries = {f: raw_entries(store, f) for f in ("image", "depth", "emb", "ids")}
    labels = _fixed(store, "label")
    for slot in range(N):
        h = xxhash.xxh3_64()
        for f in SCHEMA:
            if f == "label":
                h.update(labels[slot].tobytes())
            else:
                h.update(len(entries[f][slot]).to_bytes(8, "little") + entries[f][slot])
        assert int(s.slot_view.checksums()[slot]) == (0 if slot in HOLES else h.intdigest())
    packed = dict(s.slot_view.backend.iter_packed(0, N))  # what verify hashes
    assert all(xxhash.xxh3_64_intdigest(bytes(packed[t])) == int(s.slot_view.checksums()[t])
               for t in range(N) if t not in HOLES)


def test_read_batch_decodes_into_out_in_any_order(store):
    s = mmstore.open(store)
    idx = np.random.default_rng(1).integers(-len(s), len(s), 40)
    out = {f.name: np.full((len(idx), *f.shape), 7, f.dtype) for f in s.schema}
    ptrs = {k: v.ctypes.data for k, v in out.items()}
    res = s.read_batch(idx, out=out)
    assert {k: v.ctypes.data for k, v in res.items()} == ptrs
    for j, i in enumerate(idx.tolist()):
        one = s[i]
        for f in s.fields:
            assert np.array_equal(res[f][j], one[f])
    part = s.read_batch([3, 1], fields=["image"])
    assert list(part) == ["image"] and np.array_equal(part["image"][1], s[1]["image"])
    assert np.array_equal(s[2:6]["emb"], np.stack([s[i]["emb"] for i in range(2, 6)]))


def test_same_bytes_for_any_order_rewrites_append_batches_and_writers(tmp_path, store):
    want = store_bytes(store)
    backend = _backend(store)
    # written again with other data first, then the right data: the last write wins
    with mmstore.StoreWriter(tmp_path / "a", SCHEMA, slots=N, backend=backend) as w:
        for s in range(N):
            w.write(s, make(s + 100), key="x")
        for s in reversed(range(N)):
            if s in HOLES:
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
            else:
                w.write(s, make(s), key=f"in/{s}")
    assert store_bytes(tmp_path / "a") == want
    # append + a hole written over an entry
    with mmstore.StoreWriter(tmp_path / "b", SCHEMA, backend=backend) as w:
        for s in range(N):
            if s in HOLES:
                w.append(make(s), key="x")
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
            else:
                assert w.append(make(s), key=f"in/{s}") == s
    assert store_bytes(tmp_path / "b") == want
    # write_batch, and two SlotWriters (the ingest's workers) on disjoint slots
    recs = [make(s) for s in range(N)]
    with mmstore.StoreWriter(tmp_path / "c", SCHEMA, slots=N, backend=backend) as w:
        cols = {f: np.stack([r[f] for r in recs]) for f in SCHEMA}
        sums = w.slot_writer.write_batch(0, cols)
        w.mark_written(range(N))
        workers = [SlotWriter(w.partial), SlotWriter(w.partial)]
        for s in range(N):
            workers[s % 2].write(s, recs[s])
        for sw in workers:
            sw.close()
        for s in range(N):
            w.set_key(s, f"in/{s}")
            if s in HOLES:
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
    assert store_bytes(tmp_path / "c") == want
    ck = mmstore.open(tmp_path / "c").slot_view.checksums()
    assert [int(x) for i, x in enumerate(sums) if i not in HOLES] == [int(ck[i]) for i in range(N) if i not in HOLES]


def test_sigkill_then_resume_gives_the_same_bytes(tmp_path, store):
    """A writer killed after committing (sync) slots 0..9 and writing more;
    a resume keeps the committed slots and writes the rest again."""
    dest = tmp_path / "k"
    backend = _backend(store)
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = [{os.path.dirname(os.path.dirname(__file__))!r}, {os.path.dirname(__file__)!r}]
        import mmstore
        from test_compact_store import SCHEMA, N, HOLES, make
        w = mmstore.StoreWriter({str(dest)!r}, SCHEMA, slots=N, backend={backend!r})
        for s in range(10):
            w.write(s, make(s)) if s not in HOLES else w.skip(s, "x", "r")
        w.sync()
        for s in range(10, 16):
            w.write(s, make(s + 50))  # never committed: must not survive
        w.write(3, make(99))          # a rewrite after the commit, also lost
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not os.path.exists(dest) and os.path.isdir(str(dest) + ".partial")
    finish_resumed(dest, SCHEMA, N, HOLES, make, 10, backend)
    assert store_bytes(dest) == store_bytes(store)


def test_a_record_slot_without_its_entry_is_refused_at_close(tmp_path):
    w = mmstore.StoreWriter(tmp_path / "m", SCHEMA, slots=2)
    w.write(0, make(0))
    w.mark_written([1])
    with pytest.raises(SchemaError, match="no stored entry of field 'image'.*\\[1\\]"):
        w.close()
    assert not os.path.exists(tmp_path / "m")


def test_lmdb_and_memmap_hold_the_same_records_and_checksums(tmp_path):
    a = write(tmp_path / "m", backend="memmap")
    b = write(tmp_path / "l", backend="lmdb")
    for name in ("_checksums.npy", "_keys.bin", "_keys_offsets.npy", "_index.npy", "errors.jsonl"):
        assert store_bytes(a)[name] == store_bytes(b)[name], name
    for f in ("image", "depth", "emb", "ids"):
        assert raw_entries(a, f) == raw_entries(b, f)
    sa, sb = mmstore.open(a), mmstore.open(b)
    ra, rb = sa[:], sb[:]
    assert all(np.array_equal(ra[f], rb[f]) for f in SCHEMA)
    assert np.array_equal(sa.slot_view.entry_sizes("emb"), np.array([len(e) for e in raw_entries(a, "emb") if e]))


def test_lmdb_value_of_the_wrong_size_is_refused_before_slicing(tmp_path):
    import lmdb

    p = write(tmp_path / "l", backend="lmdb", holes=())
    env = lmdb.open(os.path.join(p, "records.mdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        v = txn.get((3).to_bytes(8, "big"))
        txn.put((3).to_bytes(8, "big"), v[:-1])  # one byte short of what its lengths add up to
    env.close()
    sync_manifest(p, "records.mdb")
    s = mmstore.open(p)
    assert np.array_equal(s[2]["ids"], make(2)["ids"])
    with pytest.raises(FormatError, match="slot 3 has .* bytes, which does not match its layout"):
        s[3]


# -- opening: O(1) checks --------------------------------------------------------


@pytest.fixture
def copy(tmp_path_factory):
    order = np.random.default_rng(5).permutation(N).tolist()
    return write(tmp_path_factory.mktemp("m") / "copy", order=order)


def _offsets(path, field="image"):
    return np.load(os.path.join(path, f"{field}.offsets.npy"), mmap_mode="r+")


def test_open_refuses_a_truncated_bin(copy):
    p = os.path.join(copy, "image.bin")
    os.truncate(p, os.path.getsize(p) - 1)
    with pytest.raises(FormatError, match="image.bin: expected .* bytes, found"):
        mmstore.open(copy)
    sync_manifest(copy, "image.bin")  # a crafted manifest that agrees with the short file
    with pytest.raises(FormatError, match="image.offsets.npy: offsets run from 0 to .*expected 0 to"):
        mmstore.open(copy)


def test_open_refuses_offsets_not_starting_at_zero_or_a_short_offsets_file(copy):
    o = _offsets(copy, "emb")
    o[0] = 1
    o.flush()
    del o
    with pytest.raises(FormatError, match="emb.offsets.npy: offsets run from 1 to"):
        mmstore.open(copy)
    p = os.path.join(copy, "emb.offsets.npy")
    os.truncate(p, os.path.getsize(p) - 8)
    sync_manifest(copy, "emb.offsets.npy")
    with pytest.raises(FormatError, match="emb.offsets.npy"):
        mmstore.open(copy)


def test_bad_offsets_inside_open_in_o1_and_fail_at_read_naming_the_record(copy):
    s0 = mmstore.open(copy)
    i = 5
    slot = s0.slot_view.slot(i)
    other = s0[i + 2]["image"]
    o = _offsets(copy)
    o[slot + 1] = o[slot] - 1  # a decreasing pair
    o.flush()
    del o
    s = mmstore.open(copy)  # the middle of the index is not read at open
    assert np.array_equal(s[i + 2]["image"], other)
    with pytest.raises(EntryDecodeError) as ei:
        s[i]
    msg = str(ei.value)
    for part in (f"record {i}", f"slot {slot}", f"key 'in/{slot}'", "'image'", "verify --decode"):
        assert part in msg, (part, msg)
    # the same as typed attributes, kept by a copy of the error (one from a child process)
    for err in (ei.value, pickle.loads(pickle.dumps(ei.value))):
        assert (err.field, err.slot, err.index, err.key) == ("image", slot, i, f"in/{slot}"), err
        assert "not an increasing pair" in err.reason and err.reason in str(err)
    with pytest.raises(EntryDecodeError, match=f"slot {slot}"):
        s.read_batch([0, i, 1])
    with pytest.raises(EntryDecodeError, match="not an increasing pair"):
        list(s.slot_view.backend.iter_packed(0, N))
    o = _offsets(copy)
    o[slot + 1] = 2**63  # past the end of the .bin
    o.flush()
    del o
    with pytest.raises(EntryDecodeError, match=f"record {i} \\(slot {slot}.*within the"):
        mmstore.open(copy)[i]


def test_a_corrupt_entry_raises_never_garbage(copy):
    s0 = mmstore.open(copy)
    for field, i in (("image", 2), ("depth", 3), ("emb", 6)):
        slot = s0.slot_view.slot(i)
        o = np.load(os.path.join(copy, f"{field}.offsets.npy"))
        a, b = int(o[slot]), int(o[slot + 1])
        with open(os.path.join(copy, f"{field}.bin"), "r+b") as fh:
            fh.seek(a)
            fh.write(bytes(np.random.default_rng(i).integers(0, 256, b - a, dtype=np.uint8)))
        s = mmstore.open(copy)
        with pytest.raises(EntryDecodeError, match=f"record {i} \\(slot {slot}, key 'in/{slot}'\\): field '{field}'"):
            s.read_batch([i])


# -- versions ------------------------------------------------------------------------


def test_raw_stores_stay_1_0_and_1x_manifests_still_open(tmp_path):
    with mmstore.StoreWriter(tmp_path / "r", {"x": ("<f4", (3,))}, slots=2) as w:
        w.write(0, {"x": [1, 2, 3]})
        w.write(1, {"x": [4, 5, 6]})
    p = str(tmp_path / "r")
    assert _manifest(p)["version"] == [1, 0]
    edit_manifest(p, lambda m: m.update(version=[1, 1]))
    assert mmstore.open(p)[1]["x"].tolist() == [4, 5, 6]
    edit_manifest(p, lambda m: m["schema"][0].update(codec={"name": "raw"}))
    assert mmstore.open(p)[0]["x"].tolist() == [1, 2, 3]


def test_codec_fields_need_version_2_and_a_known_codec(copy):
    edit_manifest(copy, lambda m: m.update(version=[1, 0]))
    with pytest.raises(FormatError, match="needs format version 2.0"):
        mmstore.open(copy)
    edit_manifest(copy, lambda m: m.update(version=[2, 3]))
    assert len(mmstore.open(copy)) == N - len(HOLES)  # a newer minor version opens
    edit_manifest(copy, lambda m: m["schema"][0].update(codec={"name": "webp", "level": 3}))
    with pytest.raises(FormatError, match="codec 'webp'.*upgrade mmstore"):
        mmstore.open(copy)
    edit_manifest(copy, lambda m: m["schema"][0].update(codec={"name": "jpeg", "quality": 90}, dtype="<f4"))
    with pytest.raises(FormatError, match="jpeg:90 stores uint8"):
        mmstore.open(copy)


def test_a_reader_of_1x_only_refuses_a_2_0_store(store, monkeypatch):
    monkeypatch.setattr(fmt, "READ_MAJORS", (1,))
    with pytest.raises(VersionError, match="version 2.0.*reads 1.x"):
        mmstore.open(store)


# -- schema ----------------------------------------------------------------------------


def test_schema_codecs():
    s = Schema({"image": ("|u1", (8, 8, 3)), "label": ("<i8", ())}, codecs={"image": "jpeg:80"})
    assert s["image"].variable and not s["label"].variable and s["image"].codec.param == 80
    assert s.to_json()[0]["codec"] == {"name": "jpeg", "quality": 80} and "codec" not in s.to_json()[1]
    assert Schema.from_json(s.to_json()) == s
    assert s.record_bytes == 8 and s.offset("label") == 0
    assert Schema({"x": ("<f8", (2,), "zstd:5")}) != Schema({"x": ("<f8", (2,))})
    with pytest.raises(SchemaError, match="field 'x'.*jpeg:90 stores uint8.*<f4.*zstd"):
        Schema({"x": ("<f4", (8, 8, 3), "jpeg:90")})
    with pytest.raises(SchemaError, match="unknown codec 'lz5'"):
        Schema({"x": ("<f4", (3,))}, codecs={"x": "lz5"})
    with pytest.raises(SchemaError, match="unknown field"):
        Schema({"x": ("<f4", (3,))}, codecs={"y": "zstd"})
    with pytest.raises(SchemaError, match="png:1 stores uint8 or uint16"):
        Schema({"x": ("|u1", (8, 8, 2))}, codecs=["x=png"])


def test_import_mmstore_loads_no_codec_library():
    code = ("import sys, mmstore, mmstore.store.writer, mmstore.store.reader, mmstore.store.spill; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('simplejpeg', 'zstandard', 'cv2')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# -- segments (format.py, "Segments") -----------------------------------------------


def split_into_segments(path, counts) -> None:
    """Turn a memmap compact store into a segmented one by hand: each
    segment's ``<field>.<k>.bin``/``.offsets.npy`` (local offsets) and
    ``<field>.<k>.npy``; the bookkeeping files stay as they are."""
    m = _manifest(path)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    files = {n: v for n, v in m["files"].items() if n.startswith("_") or n == "errors.jsonl"}
    for f in m["schema"]:
        name = f["name"]
        if "codec" in f:
            offs = np.load(os.path.join(path, f"{name}.offsets.npy"))
            with open(os.path.join(path, f"{name}.bin"), "rb") as fh:
                blob = fh.read()
            for k in range(len(counts)):
                a, b = bounds[k], bounds[k + 1]
                local = (offs[a : b + 1] - offs[a]).astype("<u8")
                with open(os.path.join(path, f"{name}.{k:05d}.bin"), "wb") as fh:
                    fh.write(blob[int(offs[a]) : int(offs[b])])
                np.save(os.path.join(path, f"{name}.{k:05d}.offsets.npy"), local)
            os.unlink(os.path.join(path, f"{name}.bin"))
            os.unlink(os.path.join(path, f"{name}.offsets.npy"))
        else:
            arr = np.load(os.path.join(path, f"{name}.npy"))
            for k in range(len(counts)):
                np.save(os.path.join(path, f"{name}.{k:05d}.npy"), arr[bounds[k] : bounds[k + 1]])
            os.unlink(os.path.join(path, f"{name}.npy"))
    for n in os.listdir(path):
        if n not in files and n != "manifest.json":
            files[n] = os.path.getsize(os.path.join(path, n))

    def edit(m):
        m.update(files=files, segments=list(counts))

    edit_manifest(path, edit)


def test_a_segmented_compact_store_reads_like_the_single_one(tmp_path):
    one = mmstore.open(write(tmp_path / "one", order=np.random.default_rng(5).permutation(N).tolist()))
    seg_path = write(tmp_path / "seg", order=range(N))
    split_into_segments(seg_path, [7, 0, 9, 7])
    seg = mmstore.open(seg_path)
    assert seg.slot_view.backend.segmented and seg.manifest["version"] == (2, 0) and len(seg) == len(one)
    idx = np.random.default_rng(3).permutation(len(one))
    a, b = one.read_batch(idx), seg.read_batch(idx)
    assert all(np.array_equal(a[f], b[f]) for f in SCHEMA)
    assert all(np.array_equal(one[i]["image"], seg[i]["image"]) for i in range(len(one)))
    assert seg.slot_view.entry_sizes("image").tolist() == one.slot_view.entry_sizes("image").tolist()
    assert {s: bytes(v) for s, v in seg.slot_view.backend.iter_packed(0, N) if v is not None} == \
        {s: bytes(v) for s, v in one.slot_view.backend.iter_packed(0, N) if v is not None}
    spans = seg.slot_view.backend.entry_spans("image", 5, 18)  # segments 0, 2 and 3 (1 is empty)
    assert [os.path.basename(p) for p, _, _ in spans] == ["image.00000.bin", "image.00002.bin", "image.00003.bin"]
    assert sum(n for _, _, n in spans) == int(one.slot_view.entry_sizes("image", [i for i in range(len(one))
                                                                       if 5 <= one.slot_view.slot(i) < 18]).sum())
    # a damaged pair in segment 2 names the global slot
    o = np.load(os.path.join(seg_path, "emb.00002.offsets.npy"), mmap_mode="r+")
    o[3] = o[4] + 1
    o.flush()
    del o
    slot = 7 + 3
    i = int(np.searchsorted(seg.slot_view.index, slot))
    with pytest.raises(EntryDecodeError, match=f"record {i} \\(slot {slot}, key 'in/{slot}'\\): field 'emb'"):
        mmstore.open(seg_path).read_batch([0, i, len(one) - 1])


def test_a_segmented_store_refuses_a_truncated_segment_bin_at_open(tmp_path):
    p = write(tmp_path / "seg", order=range(N))
    split_into_segments(p, [10, 13])
    path = os.path.join(p, "depth.00001.bin")
    os.truncate(path, os.path.getsize(path) - 3)
    sync_manifest(p, "depth.00001.bin")
    with pytest.raises(FormatError, match="depth.00001.offsets.npy: offsets run from 0 to"):
        mmstore.open(p)


def _truncate_then_read(path, name, new_size):
    s = mmstore.open(path)
    s.read_batch(np.arange(len(s)))  # maps the files
    os.truncate(os.path.join(path, name), new_size)
    return s.read_batch(np.arange(len(s)))["image"].sum()


@pytest.mark.parametrize("name", ["image.bin", "image.offsets.npy"])
def test_a_file_truncated_under_the_mapping_is_typed_not_sigbus(copy, name):
    from support.proc import in_child

    res = in_child(_truncate_then_read, copy, name, 64)
    assert res.raised("StoreChangedError") and f"{name}: truncated to 64 bytes" in res.value[1], res


# -- property: any dtype, shape, codec, order, holes -----------------------------------

_DTYPES = ["|u1", "|i1", "<u2", "<i4", "<i8", "<f2", "<f4", "<f8", "|b1", "<c8"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), dtype=st.sampled_from(_DTYPES), shape=st.lists(st.integers(0, 4), max_size=3),
       n=st.integers(1, 9), codec=st.sampled_from(["zstd:1", "zstd:19", "raw"]))
def test_property_any_order_and_holes_round_trip_and_same_bytes(tmp_path_factory, data, dtype, shape, n, codec):
    rng = np.random.default_rng(n)
    schema = {"x": (dtype, tuple(shape), codec), "y": ("<i2", (2,))}
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, (n, *shape, dt.itemsize), dtype=np.uint8)
    xs = np.ascontiguousarray(raw).view(dt).reshape(n, *shape) if dt != np.bool_ else raw[..., 0].reshape(
        n, *shape) % 2 == 1
    holes = set(data.draw(st.lists(st.integers(0, n - 1), max_size=n // 2)))
    order = data.draw(st.permutations(range(n)))
    root = tmp_path_factory.mktemp("p")
    paths = []
    for k, slots in enumerate((range(n), order)):
        with mmstore.StoreWriter(root / f"s{k}", schema, slots=n) as w:
            for s in slots:
                if s in holes:
                    w.skip(s, f"k{s}", "r")
                else:
                    w.write(s, {"x": xs[s], "y": [s, -s]}, key=f"k{s}")
        paths.append(root / f"s{k}")
    assert store_bytes(paths[0]) == store_bytes(paths[1])
    st_ = mmstore.open(paths[1])
    keep = [s for s in range(n) if s not in holes]
    got = st_[:]
    assert got["x"].dtype == dt and got["x"].tobytes() == xs[keep].tobytes()  # bit-exact, NaNs included
    assert got["y"][:, 0].tolist() == keep
