"""Ingest into compact records: ``--codec FIELD=CODEC[:PARAM]``,
``ingest(codecs=)``, ``from_dataset``; byte-identical output for any worker
count and across SIGKILL + resume; codecs in the fingerprint and provenance."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
from support.compare import store_bytes

import mmstore
from mmstore.errors import ResumeMismatchError, SchemaError
from mmstore.format.codecs import library_versions, parse_codec
from mmstore.ingest import from_dataset, ingest

cv2 = pytest.importorskip("cv2")


@pytest.fixture
def photos(tmp_path, h):
    root = str(tmp_path / "photos")
    h.make_folder(root, per_class=9, seed=11)
    with open(os.path.join(root, "cat", "bad.jpg"), "wb") as fh:
        fh.write(b"not a jpeg")
    return root


def _entries(path, field):
    offs = np.load(os.path.join(path, f"{field}.offsets.npy"))
    with open(os.path.join(path, f"{field}.bin"), "rb") as fh:
        blob = fh.read()
    return [blob[int(offs[s]) : int(offs[s + 1])] for s in range(len(offs) - 1)]


def test_jpeg_entries_are_the_raw_ingest_encoded_for_any_worker_count(tmp_path, h, photos):
    raw = str(tmp_path / "raw")
    assert h.cli("ingest", photos, raw, "--size", "24x32", "--workers", "0", "-q") == 0
    ref = str(tmp_path / "w1")
    assert h.cli("ingest", photos, ref, "--size", "24x32", "--workers", "1", "-q", "--codec", "image=jpeg:90",
                 "--codec", "box=zstd:3") == 0
    for i, extra in enumerate((["--workers", "2"], ["--workers", "3", "--chunk", "2"], ["--workers", "0"])):
        d = str(tmp_path / f"s{i}")
        assert h.cli("ingest", photos, d, "--size", "24x32", "-q", "--codec", "image=jpeg:90",
                     "--codec", "box=zstd:3", *extra) == 0
        h.assert_same_store(ref, d)
    r, c = mmstore.open(raw), mmstore.open(ref)
    assert c.manifest["version"] == (2, 0) and c.schema["image"].codec == parse_codec("jpeg:90")
    assert len(r) == len(c) == r.slots - 1 and c.skipped()[0]["key"].endswith("bad.jpg")
    jpeg = parse_codec("jpeg:90")
    entries = _entries(ref, "image")
    for i in range(len(r)):
        raw_rec, rec = r[i], c[i]
        assert entries[c.slot_view.slot(i)] == jpeg.encode(raw_rec["image"])  # encoded from the decoded, resized pixels
        assert np.array_equal(rec["box"], raw_rec["box"]) and np.array_equal(rec["label"], raw_rec["label"])
        assert np.abs(rec["image"].astype(int) - raw_rec["image"]).mean() < 8
    prov = c.provenance
    assert prov["codecs"] == {"image": "jpeg:90", "box": "zstd:3"}
    assert prov["codec_libraries"] == library_versions(["jpeg:90", "zstd:3"])
    assert "simplejpeg" in prov["codec_libraries"]["jpeg"]


def test_lossless_png_ingest_equals_the_raw_ingest(tmp_path, h, photos):
    raw, png = str(tmp_path / "raw"), str(tmp_path / "png")
    ingest(photos, raw, (20, 20), workers=0, quiet=True)
    ingest(photos, png, (20, 20), workers=2, quiet=True, codecs={"image": "png:1"}, backend="lmdb")
    a, b = mmstore.open(raw), mmstore.open(png)
    assert b.backend_name == "lmdb" and b.schema["image"].codec.name == "png"
    ra, rb = a[:], b[:]
    assert all(np.array_equal(ra[f], rb[f]) for f in ra)


def test_a_codec_that_does_not_fit_is_refused_before_any_work(tmp_path, photos):
    dest = str(tmp_path / "d")
    with pytest.raises(SchemaError, match="field 'orig_size': codec jpeg:90 stores uint8 images.*<i4 \\[2\\]"):
        ingest(photos, dest, (16, 16), quiet=True, codecs={"orig_size": "jpeg:90"})
    with pytest.raises(SchemaError, match="unknown field.*'labels'.*the schema has"):
        ingest(photos, dest, (16, 16), quiet=True, codecs=["labels=zstd"])
    with pytest.raises(SchemaError, match="FIELD=CODEC"):
        ingest(photos, dest, (16, 16), quiet=True, codecs=["image:jpeg"])
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")


def test_cli_refuses_a_misfit_codec_with_a_message(tmp_path, h, photos, capsys):
    dest = str(tmp_path / "d")
    rc = h.cli("ingest", photos, dest, "--size", "16x16", "-q", "--codec", "label=jpeg")
    err = capsys.readouterr().err
    assert rc != 0 and "field 'label'" in err and "zstd" in err, err
    assert not os.path.exists(dest + ".partial")


def test_from_dataset_with_zstd_and_the_codec_in_the_fingerprint(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((37, 4, 6)).astype(np.float32)
    ds = [(data[i], i % 3) for i in range(len(data))]
    dest = str(tmp_path / "f")
    from_dataset(ds, dest, workers=2, quiet=True, codecs={"image": "zstd:5"})
    s = mmstore.open(dest)
    assert s.schema["image"].codec == parse_codec("zstd:5")
    assert np.array_equal(s[:]["image"], data) and s[:]["label"].tolist() == [i % 3 for i in range(37)]
    # an interrupted run resumed with another codec would mix two stores: refused
    class Stops(list):
        armed = True

        def __getitem__(self, i):
            if i == 20 and self.armed:
                raise KeyboardInterrupt
            return ds[i]

    part, src = str(tmp_path / "p"), Stops(ds)
    with pytest.raises(KeyboardInterrupt):
        from_dataset(src, part, workers=0, quiet=True, codecs={"image": "zstd:5"}, chunk=4)
    assert os.path.isdir(part + ".partial")
    src.armed = False
    with pytest.raises(ResumeMismatchError, match="schema"):
        from_dataset(src, part, workers=0, quiet=True, resume=True, codecs={"image": "zstd:6"})
    from_dataset(src, part, workers=0, quiet=True, resume=True, codecs={"image": "zstd:5"})
    assert store_bytes(part) == store_bytes(dest)


def test_sigkill_then_resume_is_byte_identical(tmp_path, h):
    root = str(tmp_path / "k")
    h.make_folder(root, per_class=200, seed=8)  # enough work (about 0.3 s) for a kill to land mid-run
    args = ("--size", "32x32", "-q", "--codec", "image=jpeg:85", "--chunk", "2")
    ref = str(tmp_path / "ref")
    p = h.cli_subprocess("ingest", root, ref, "--workers", "2", *args)
    assert p.wait(120) == 0
    killed_mid = 0
    for trial, delay in enumerate((0.02, 0.08, 0.2)):
        dest = str(tmp_path / f"t{trial}")
        p = h.cli_subprocess("ingest", root, dest, "--workers", "2", *args)
        deadline = time.monotonic() + 60
        while not os.path.isdir(dest + ".partial") and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait(60)
        time.sleep(0.2)  # the workers die with their parent (PDEATHSIG)
        if os.path.isdir(dest + ".partial"):
            killed_mid += 1
        q = h.cli_subprocess("ingest", root, dest, "--workers", str(1 + trial % 3), "--resume", *args)
        assert q.wait(120) == 0
        h.assert_same_store(ref, dest)
    assert killed_mid >= 1


def test_crash_points_then_resume_is_byte_identical(tmp_path, h):
    root = str(tmp_path / "c")
    h.make_folder(root, per_class=5, seed=9)
    args = ("--size", "8x8", "-q", "--codec", "image=jpeg:90", "--codec", "orig_size=zstd")
    ref = str(tmp_path / "ref")
    assert h.cli("ingest", root, ref, "--workers", "0", *args) == 0
    crashed = 0
    for k in (1, 5, 14, 30, 60, 120):
        dest = str(tmp_path / f"c{k}")
        p = h.cli_subprocess("ingest", root, dest, "--workers", "0", "--chunk", "3", "--resume", *args,
                             env={"MMSTORE_CRASH_AT": f"any:{k}"}, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=120)
        if p.returncode == 0:
            break
        assert p.returncode == 77, err
        crashed += 1
        q = h.cli_subprocess("ingest", root, dest, "--workers", "2", "--resume", *args)
        assert q.wait(120) == 0
        h.assert_same_store(ref, dest)
    assert crashed >= 3
