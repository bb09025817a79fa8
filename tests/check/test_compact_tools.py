"""Every tool on compact stores: convert between codecs and
backends, merge of encoded parts, verify (--decode, --repair), inspect, show,
warm/evict."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.compare import store_bytes
from support.faults import edit_manifest, flip_bit, flip_lmdb_bits, sync_manifest
from support.proc import cli, run_cli, run_json
from support.stores import COMPACT_SCHEMA, compact_sample, compact_store

import mmstore
from mmstore.check.convert import convert_store
from mmstore.errors import ChecksumError, SchemaError
from mmstore.format.codecs import library_versions, parse_codec

pytest.importorskip("cv2")
pytest.importorskip("simplejpeg")
pytest.importorskip("zstandard")

N = 40
HOLES = (3, 17)


@pytest.fixture(scope="module")
def jpeg_store(tmp_path_factory):
    return compact_store(tmp_path_factory.mktemp("c") / "jpeg.store", N, holes=HOLES)


@pytest.fixture(scope="module")
def raw_store(tmp_path_factory):
    return compact_store(tmp_path_factory.mktemp("r") / "raw.store", N, codecs=(), holes=HOLES)


def _entries(path, field):
    offs = np.load(os.path.join(path, f"{field}.offsets.npy"))
    with open(os.path.join(path, f"{field}.bin"), "rb") as fh:
        blob = fh.read()
    return [blob[int(offs[s]) : int(offs[s + 1])] for s in range(len(offs) - 1)]


def _assert_decodes_like(a, b):
    """Stores a and b hold the same records (decoded), keys and holes."""
    sa, sb = mmstore.open(a), mmstore.open(b)
    assert len(sa) == len(sb) and sa.slots == sb.slots and sa.skipped() == sb.skipped()
    ra, rb = sa.read_batch(np.arange(len(sa))), sb.read_batch(np.arange(len(sb)))
    for f in sa.fields:
        assert np.array_equal(ra[f], rb[f]), f
    assert [sa.key(i) for i in range(len(sa))] == [sb.key(i) for i in range(len(sb))]


# -- convert ---------------------------------------------------------------------------


def test_convert_raw_to_jpeg_encodes_the_raw_pixels(tmp_path, raw_store, capsys):
    dest = str(tmp_path / "q90")
    rc, rep = run_json(["convert", raw_store, dest, "--codec", "image=jpeg:90", "--no-progress"], capsys)
    assert rc == 0 and rep["codecs"] == {"image": "jpeg:90", "label": "raw", "box": "raw"}
    r, c = mmstore.open(raw_store), mmstore.open(dest)
    assert c.manifest["version"] == (2, 0) and c.schema["image"].codec == parse_codec("jpeg:90")
    assert c.skipped() == r.skipped() and len(c) == len(r) == N - len(HOLES)
    jpeg, entries = parse_codec("jpeg:90"), _entries(dest, "image")
    for i in range(len(r)):
        s = r.slot_view.slot(i)
        assert entries[s] == jpeg.encode(r[i]["image"])  # the raw pixels, encoded
        assert np.array_equal(c[i]["label"], r[i]["label"]) and np.array_equal(c[i]["box"], r[i]["box"])
    assert all(entries[s] == b"" for s in HOLES)
    prov = c.provenance
    assert prov["converted_from"]["codecs"]["image"] == "raw"
    assert prov["converted_to"]["codecs"]["image"] == "jpeg:90"
    assert prov["codec_libraries"] == library_versions(["jpeg:90"])


def test_convert_jpeg_to_raw_decodes_equal_to_the_jpeg_store(tmp_path, jpeg_store):
    dest = str(tmp_path / "raw")
    assert cli("convert", jpeg_store, dest, "--codec", "image=raw", "--no-progress") == 0
    out = mmstore.open(dest)
    assert out.manifest["version"] == (1, 0) and not out.schema.has_variable
    assert "codec_libraries" not in out.provenance
    _assert_decodes_like(jpeg_store, dest)


def test_convert_raw_zstd_raw_is_byte_identical(tmp_path, raw_store):
    mid, back = str(tmp_path / "z"), str(tmp_path / "back")
    assert cli("convert", raw_store, mid, "--codec", "image=zstd:5", "--codec", "box=zstd", "--no-progress") == 0
    z = mmstore.open(mid)
    assert [f.codec.spec for f in z.schema] == ["zstd:5", "raw", "zstd:3"]
    assert sorted(os.listdir(mid)) == sorted(["manifest.json", "image.bin", "image.offsets.npy", "label.npy",
                                              "box.bin", "box.offsets.npy", "_checksums.npy", "_keys.bin",
                                              "_keys_offsets.npy", "_index.npy", "errors.jsonl"])
    _assert_decodes_like(raw_store, mid)
    assert cli("convert", mid, back, "--codec", "image=raw", "--codec", "box=raw", "--no-progress") == 0
    assert store_bytes(back) == store_bytes(raw_store)  # data files, checksums, keys, index, errors


@pytest.mark.parametrize("cuts", [None, (13, 30)])
def test_convert_between_backends_keeps_the_encoded_entries(tmp_path, cuts):
    src = compact_store(tmp_path / "src", N, codecs=("image=jpeg:85", "box=zstd"), holes=HOLES, cuts=cuts)
    lm, back = str(tmp_path / "lm"), str(tmp_path / "back")
    assert cli("convert", src, lm, "--backend", "lmdb", "--no-progress") == 0
    s, m = mmstore.open(src), mmstore.open(lm)
    assert m.backend_name == "lmdb" and m.schema == s.schema
    assert np.array_equal(np.asarray(m.slot_view.checksums()), np.asarray(s.slot_view.checksums()))  # same stored bytes
    assert m.provenance["codec_libraries"] == s.provenance.get("codec_libraries", m.provenance["codec_libraries"])
    _assert_decodes_like(src, lm)
    assert cli("convert", lm, back, "--backend", "memmap", "--no-progress") == 0
    ref = compact_store(tmp_path / "ref", N, codecs=("image=jpeg:85", "box=zstd"), holes=HOLES)
    assert store_bytes(back) == store_bytes(ref)  # the single-run store, byte for byte


def test_convert_lmdb_jpeg_to_raw_memmap(tmp_path):
    src = compact_store(tmp_path / "src", 12, backend="lmdb", holes=(4,))
    dest = str(tmp_path / "dest")
    assert cli("convert", src, dest, "--backend", "memmap", "--codec", "image=raw", "--no-progress") == 0
    _assert_decodes_like(src, dest)


def test_convert_refuses_bad_codecs_and_writes_nothing(tmp_path, raw_store, capsys):
    for spec, what in (("nope=jpeg", "unknown field"), ("box=jpeg:90", "jpeg"), ("image=jpeg:101", "quality"),
                       ("image", "FIELD=CODEC")):
        dest = str(tmp_path / "d")
        rc, _, err = run_cli(["convert", raw_store, dest, "--codec", spec, "--no-progress"], capsys)
        assert rc == 2 and what in err, (spec, err)
        assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")
    with pytest.raises(SchemaError):
        convert_store(raw_store, tmp_path / "e", codecs={"label": "png"})
    rc, _, err = run_cli(["convert", raw_store, str(tmp_path / "f")], capsys)
    assert rc == 2 and "--codec" in err


def test_convert_stops_at_a_damaged_entry(tmp_path):
    src = compact_store(tmp_path / "src", 10)
    entries = _entries(src, "image")
    offs = np.load(os.path.join(src, "image.offsets.npy"))
    flip_bit(os.path.join(src, "image.bin"), int(offs[6]) + len(entries[6]) // 2)
    for codecs in (None, {"image": "raw"}):
        with pytest.raises(ChecksumError, match="slot 6"):
            convert_store(src, tmp_path / "d", "lmdb", codecs=codecs)
        assert not os.path.exists(tmp_path / "d") and not os.path.exists(str(tmp_path / "d") + ".partial")


# -- merge -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder with a broken input, ingested with image=jpeg:90 and box-less
    defaults in one run and as 3 shards."""
    from support.images import make_folder

    d = tmp_path_factory.mktemp("sh")
    root = str(d / "photos")
    make_folder(root, per_class=7, seed=5)
    with open(os.path.join(root, "dog", "zz-broken.jpg"), "wb") as fh:
        fh.write(b"not a jpeg")
    args = ["--size", "20x24", "-q", "--workers", "0", "--codec", "image=jpeg:90"]
    single = str(d / "single")
    assert cli("ingest", root, single, *args) == 0
    parts = []
    for k in (2, 0, 1):
        p = str(d / f"part{k}")
        assert cli("ingest", root, p, *args, "--shard", f"{k}/3") == 0
        parts.append(p)
    return single, parts


@pytest.mark.parametrize("copy", [False, True])
def test_merge_encoded_shards_reads_like_a_single_run(tmp_path, shards, copy):
    single, parts = shards
    dest = str(tmp_path / "merged")
    assert cli("merge", *parts, dest, "-q", *(["--copy"] if copy else [])) == 0
    m, s = mmstore.open(dest), mmstore.open(single)
    assert m.manifest["version"] == (2, 0) and len(m.manifest["segments"]) == 3
    assert m.schema == s.schema and m.schema["image"].codec == parse_codec("jpeg:90")
    assert m.provenance["codec_libraries"] == s.provenance["codec_libraries"]
    ordered = sorted(parts)  # part0, part1, part2
    for k, part in enumerate(ordered):
        for src, name in (("image.bin", f"image.{k:05d}.bin"), ("image.offsets.npy", f"image.{k:05d}.offsets.npy"),
                          ("label.npy", f"label.{k:05d}.npy")):
            a, b = os.stat(os.path.join(part, src)), os.stat(os.path.join(dest, name))
            assert (a.st_ino == b.st_ino) is (not copy), name
            with open(os.path.join(part, src), "rb") as fa, open(os.path.join(dest, name), "rb") as fb:
                assert fa.read() == fb.read()
    assert not os.path.exists(os.path.join(dest, "image.bin"))
    for name in ("_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl"):
        with open(os.path.join(dest, name), "rb") as fa, open(os.path.join(single, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    _assert_decodes_like(single, dest)
    assert np.array_equal(m.slot_view.entry_sizes("image"), s.slot_view.entry_sizes("image"))
    assert cli("verify", dest) == 0


# -- verify ----------------------------------------------------------------------------


def _bad(rep):
    return [(r["slot"], r["what"]) for r in rep["bad_records"]]


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("cuts", [None, (9,)])
def test_verify_sound_compact_store(tmp_path, backend, cuts, capsys):
    src = compact_store(tmp_path / "s", 20, codecs=("image=jpeg:90", "box=zstd"), holes=(2, 11), cuts=cuts)
    if backend == "lmdb":
        from mmstore.check.convert import convert_store as cs

        cs(src, tmp_path / "l", "lmdb")
        src = str(tmp_path / "l")
    for extra in ([], ["--decode"]):
        rc, rep = run_json(["verify", src, "--no-progress", *extra], capsys)
        assert rc == 0 and rep["ok"] and rep["checked_slots"] == 20, rep


def _entry_at(path, field, slot):
    offs = np.load(os.path.join(path, f"{field}.offsets.npy"))
    return int(offs[slot]), int(offs[slot + 1])


def test_verify_names_a_flipped_entry_and_decode_names_the_undecodable(tmp_path, capsys):
    src = compact_store(tmp_path / "s", 20, codecs=("image=jpeg:90", "box=zstd"), holes=(2,))
    a, b = _entry_at(src, "image", 7)
    flip_bit(os.path.join(src, "image.bin"), (a + b) // 2, 3)  # inside the scan data: decodes, wrong pixels
    a, b = _entry_at(src, "box", 12)
    with open(os.path.join(src, "box.bin"), "r+b") as fh:  # the zstd frame's magic: does not decode
        fh.seek(a)
        fh.write(b"\0\0\0\0")
    rc, rep = run_json(["verify", src, "--no-progress"], capsys)
    assert rc == 1 and _bad(rep) == [(7, "checksum"), (12, "checksum")]
    assert rep["bad_records"][0]["key"] == "in/00007.jpg" and rep["bad_records"][0]["index"] == 6
    rc, rep = run_json(["verify", src, "--no-progress", "--decode"], capsys)
    assert rc == 1 and sorted(_bad(rep)) == [(7, "checksum"), (12, "checksum"), (12, "decode")]
    dec = [r for r in rep["bad_records"] if r["what"] == "decode"][0]
    assert "'box'" in dec["expected"] and "zstd" in dec["expected"] and dec["found"]
    rc, out, _ = run_cli(["verify", src, "--no-progress", "--decode"], capsys)
    assert "key 'in/00012.jpg': decode" in out


def test_verify_checks_every_offset(tmp_path, capsys):
    src = compact_store(tmp_path / "s", 20, holes=(2,))
    path = os.path.join(src, "image.offsets.npy")
    offs = np.load(path)
    size = os.path.getsize(os.path.join(src, "image.bin"))
    data_at = os.path.getsize(path) - 8 * len(offs)
    damaged = offs.copy()
    damaged[5], damaged[6] = offs[6], offs[5]  # slot 5 decreasing; slots 4 and 6 wrong entries
    damaged[14] = size + 1000  # slots 13 and 14 past the end
    with open(path, "r+b") as fh:
        fh.seek(data_at)
        fh.write(damaged.astype("<u8").tobytes())
    with pytest.raises(Exception):  # noqa: B017 - the reader refuses the entries it reads (typed)
        mmstore.open(src).read_batch(np.arange(19))
    rc, rep = run_json(["verify", src, "--no-progress"], capsys)
    assert rc == 1
    probs = [p["message"] for p in rep["problems"] if p["kind"] == "offsets"]
    assert len(probs) == 3, probs
    for s in (5, 13, 14):
        assert any(f"field 'image', slot {s} (key 'in/{s:05d}.jpg')" in m for m in probs), (s, probs)
    # every other record is checked: 4 and 6 have the wrong bytes
    assert _bad(rep) == [(4, "checksum"), (5, "offsets"), (6, "checksum"), (13, "offsets"), (14, "offsets")]
    # first and last offsets
    damaged = offs.copy()
    damaged[0], damaged[-1] = 1, size - 1
    with open(path, "r+b") as fh:
        fh.seek(data_at)
        fh.write(damaged.astype("<u8").tobytes())
    rc, rep = run_json(["verify", src, "--no-progress"], capsys)
    msgs = " ".join(p["message"] for p in rep["problems"] if p["kind"] == "offsets")
    assert rc == 1 and "the first offset is 1" in msgs and f"the last offset is {size - 1}" in msgs


def test_verify_lmdb_value_lengths(tmp_path, capsys):
    import lmdb

    src = compact_store(tmp_path / "s", 10, codecs=("image=jpeg:90", "box=zstd"), backend="lmdb")
    env = lmdb.open(os.path.join(src, "records.mdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        v = bytearray(txn.get((4).to_bytes(8, "big")))
        rb = 8  # label; then the lengths of image and box
        v[rb : rb + 8] = (int.from_bytes(v[rb : rb + 8], "little") + 5).to_bytes(8, "little")
        txn.put((4).to_bytes(8, "big"), bytes(v))
        v = bytearray(txn.get((6).to_bytes(8, "big")))
        v[-1] ^= 0xFF  # the box entry's last byte: checksum
        txn.put((6).to_bytes(8, "big"), bytes(v))
    env.close()
    sync_manifest(src, "records.mdb")
    rc, rep = run_json(["verify", src, "--no-progress", "--decode"], capsys)
    assert rc == 1
    assert sorted(set(_bad(rep)) - {(6, "decode")}) == [(4, "size"), (6, "checksum")], _bad(rep)


# -- verify --repair -------------------------------------------------------------------


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    from support.images import make_folder

    root = str(tmp_path_factory.mktemp("pf") / "photos")
    make_folder(root, per_class=5, seed=3)
    return root


def _ingest(folder, dest, *extra):
    assert cli("ingest", folder, dest, "--size", "20x24", "-q", "--workers", "0", "--codec", "image=jpeg:90",
               *extra) == 0
    return dest


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_repair_reencodes_a_damaged_entry_and_proves_it(tmp_path, photo_folder, backend, capsys):
    ref = _ingest(photo_folder, str(tmp_path / "ref"), "--backend", backend)
    st = _ingest(photo_folder, str(tmp_path / "st"), "--backend", backend)
    if backend == "memmap":
        a, b = _entry_at(st, "image", 4)
        flip_bit(os.path.join(st, "image.bin"), (a + b) // 2, 2)
        a, b = _entry_at(st, "image", 8)
        flip_bit(os.path.join(st, "image.bin"), a, 0)  # the JPEG marker: does not decode
    else:
        flip_lmdb_bits(st, [4], -3)
        flip_lmdb_bits(st, [8], 30)
    rc, rep = run_json(["verify", st, "--no-progress", "--decode", "--repair"], capsys)
    assert rc == 0 and rep["ok"], rep
    assert rep["repair"]["repaired"] == [4, 8]
    if backend == "memmap":
        assert store_bytes(st) == store_bytes(ref)  # the original bytes, proven by the checksums
    else:
        _assert_decodes_like(ref, st)
        assert np.array_equal(np.asarray(mmstore.open(st).slot_view.checksums()),
                              np.asarray(mmstore.open(ref).slot_view.checksums()))


def test_repair_refuses_with_another_encoder_version(tmp_path, photo_folder, capsys):
    st = _ingest(photo_folder, str(tmp_path / "st"))
    edit_manifest(st, lambda m: m["provenance"].__setitem__("codec_libraries", {"jpeg": "simplejpeg 0.0.1"}))
    a, b = _entry_at(st, "image", 3)
    flip_bit(os.path.join(st, "image.bin"), (a + b) // 2, 1)
    # the entry is re-encoded by this machine's encoder; its bytes are those of the store (the same
    # library here), so the checksum proves them: written back
    rc, rep = run_json(["verify", st, "--no-progress", "--repair"], capsys)
    assert rc == 0 and rep["repair"]["repaired"] == [3]
    # a record whose re-encoded bytes differ (its stored checksum is of other bytes) is refused and
    # the message names both versions
    ck = os.path.join(st, "_checksums.npy")
    flip_bit(os.path.join(st, "image.bin"), (a + b) // 2, 1)
    flip_bit(ck, os.path.getsize(ck) - 8 * (mmstore.open(st).slots - 3), 5)
    sync_manifest(st, "_checksums.npy")
    edit_manifest(st, lambda m: m.__setitem__("checksum", {"algorithm": "xxh3_64", "digest": __import__(
        "mmstore.store.writer", fromlist=["x"]).file_digest(ck, os.path.getsize(ck) - 8 * m["slots"])}))
    rc, rep = run_json(["verify", st, "--no-progress", "--repair"], capsys)
    assert rc == 1 and rep["repair"]["repaired"] == []
    why = rep["repair"]["failed"][0]["reason"]
    assert "simplejpeg 0.0.1" in why and "this machine has" in why and "install" in why


def test_repair_refuses_damaged_offsets_and_says_how_to_rebuild(tmp_path, photo_folder, capsys):
    st = _ingest(photo_folder, str(tmp_path / "st"))
    path = os.path.join(st, "image.offsets.npy")
    offs = np.load(path)
    offs[3], offs[4] = offs[4], offs[3]
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) - 8 * len(offs))
        fh.write(offs.astype("<u8").tobytes())
    before = store_bytes(st)
    rc, out, _ = run_cli(["verify", st, "--no-progress", "--repair"], capsys)
    assert rc == 1 and "offsets index is damaged" in out and "re-ingested" in out and "--codec" in out
    assert store_bytes(st) == before


# -- inspect, show, warm / evict -------------------------------------------------------


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_inspect_reports_codecs_sizes_and_ratios(tmp_path, backend, capsys):
    src = compact_store(tmp_path / "s", 30, codecs=("image=jpeg:90", "box=zstd"), holes=(5,), backend=backend)
    s = mmstore.open(src)
    rc, rep = run_json(["inspect", src, "--sample", "0"], capsys)
    assert rc == 0
    rows = {r["name"]: r for r in rep["field_sizes"]}
    sizes = s.slot_view.entry_sizes("image")
    assert len(sizes) == 29 and rows["image"]["codec"] == "jpeg:90" and rows["image"]["raw_bytes"] == 16 * 12 * 3
    assert rows["image"]["stored_min"] == sizes.min() and rows["image"]["stored_max"] == sizes.max()
    assert rows["image"]["stored_mean"] == round(float(sizes.mean()), 1)
    assert rows["image"]["ratio"] == round(576 / sizes.mean(), 2)
    assert rows["label"] == {"name": "label", "codec": "raw", "raw_bytes": 8, "stored_mean": 8.0, "stored_min": 8,
                             "stored_max": 8, "ratio": 1.0}
    box = s.slot_view.entry_sizes("box")
    assert rows["box"]["codec"] == "zstd:3" and rows["box"]["stored_max"] == box.max()
    assert rep["raw_data_bytes"] == 29 * (576 + 8 + 16)
    assert rep["data_bytes"] == round(float(sizes.sum()) + 29 * 8 + float(box.sum()))
    assert rep["compression"] == pytest.approx(rep["raw_data_bytes"] / rep["data_bytes"])
    if backend == "memmap":  # against the raw store of the same records
        raw = str(tmp_path / "raw")
        convert_store(src, raw, codecs={"image": "raw", "box": "raw"})
        on_disk = sum(os.path.getsize(os.path.join(raw, n)) for n in os.listdir(raw) if n != "manifest.json")
        files = {n: v for n, v in rep["files"].items() if n != "manifest.json"}
        assert rep["raw_equivalent_bytes"] - rep["files"]["manifest.json"] == on_disk
        assert rep["bytes_on_disk"] - rep["files"]["manifest.json"] == sum(files.values())
    rc, out, _ = run_cli(["inspect", src, "--sample", "0"], capsys)
    assert rc == 0 and "jpeg:90" in out and "x smaller" in out and "as raw it would be about" in out
    rc, rep = run_json(["inspect", str(tmp_path / "s") if backend == "memmap" else src, "--sample", "5"], capsys)
    assert rc == 0 and rep["image_sample"] == 5  # channel statistics over decoded images


def test_inspect_raw_store_has_no_compact_line(raw_store, capsys):
    rc, rep = run_json(["inspect", raw_store, "--sample", "0"], capsys)
    assert rc == 0 and rep["compression"] == 1.0 and all(r["ratio"] == 1.0 for r in rep["field_sizes"])
    rc, out, _ = run_cli(["inspect", raw_store, "--sample", "0"], capsys)
    assert "compact" not in out


def test_show_decodes_the_encoded_images(tmp_path, jpeg_store):
    import cv2

    raw = str(tmp_path / "raw")
    convert_store(jpeg_store, raw, codecs={"image": "raw"})
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    assert cli("show", jpeg_store, "-o", a, "-n", "6", "--scale", "1") == 0
    assert cli("show", raw, "-o", b, "-n", "6", "--scale", "1") == 0
    ga, gb = cv2.imread(a), cv2.imread(b)
    assert np.array_equal(ga, gb)  # the decoded pixels, exactly
    from mmstore.check.show import show_store

    rep = show_store(jpeg_store, str(tmp_path / "c.png"), indices=[0, 5], scale=1)
    grid = cv2.imread(str(tmp_path / "c.png"))[..., ::-1]
    s = mmstore.open(jpeg_store)
    for t in rep.tiles:
        assert np.array_equal(grid[t.y : t.y + 16, t.x : t.x + 12], s[t.index]["image"])


def test_warm_and_evict_count_the_entry_files(tmp_path, capsys):
    src = compact_store(tmp_path / "s", 200, cuts=(90,))
    s = mmstore.open(src)
    names = {os.path.basename(p) for p in s.data_paths()}
    assert {"image.00000.bin", "image.00001.bin", "image.00000.offsets.npy", "image.00001.offsets.npy"} <= names
    total = sum(os.path.getsize(p) for p in s.data_paths())
    rc, rep = run_json(["warm", src], capsys)
    assert rc == 0 and rep["bytes_total"] == total
    rc, rep = run_json(["inspect", src, "--sample", "0"], capsys)
    assert rep["cache_bytes_total"] == total and {"image.00000.bin", "image.00001.offsets.npy"} <= set(
        rep["cache_resident"])


def test_merge_of_encoded_stores_not_from_shards_keeps_the_encoders(tmp_path):
    from support.stores import write_parts

    from mmstore.ingest import merge

    raw_parts = write_parts(tmp_path / "raw", 20, (6, 15), holes=(4,), schema=COMPACT_SCHEMA, make=compact_sample)
    parts = []
    for k, p in enumerate(raw_parts):  # convert notes the encoders in each part's provenance
        parts.append(str(tmp_path / f"part{k}"))
        convert_store(p, parts[-1], codecs={"image": "png:1", "box": "zstd"})
    dest = merge(parts, str(tmp_path / "m"))
    ref = compact_store(tmp_path / "r", 20, codecs=("image=png:1", "box=zstd"), holes=(4,))
    m = mmstore.open(dest)
    assert m.manifest["version"] == (2, 0) and m.segments == [6, 9, 5]
    assert m.provenance["codec_libraries"] == library_versions(["png:1", "zstd:3"])
    for name in ("_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl"):
        with open(os.path.join(dest, name), "rb") as fa, open(os.path.join(ref, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    _assert_decodes_like(ref, dest)
    assert np.array_equal(m.read_batch(np.arange(len(m)))["image"],
                          np.stack([compact_sample(s)["image"] for s in range(20) if s != 4]))  # lossless
    assert cli("verify", dest, "--decode", "--no-progress") == 0
