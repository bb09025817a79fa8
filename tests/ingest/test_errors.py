"""Bad input: every kind is reported in errors.jsonl, leaves a hole, never crashes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from support.faults import drop_dac_override

import mmstore
from mmstore.errors import IngestError

cv2 = pytest.importorskip("cv2")


def _png_chunk(t: bytes, d: bytes) -> bytes:
    return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)


def make_bad_folder(root, h) -> dict[str, str]:
    """Good and bad inputs; returns {key: expected reason category} of the bad ones."""
    os.makedirs(root)
    rng = np.random.default_rng(20)
    img = h.photo(rng, 48, 48)
    jpg = h.write_image(os.path.join(root, "good1.jpg"), img)
    png = h.write_image(os.path.join(root, "good2.png"), img, ".png")
    bad = {}

    def put(name, data, cat):
        with open(os.path.join(root, name), "wb") as fh:
            fh.write(data)
        bad[name] = cat

    put("zero.jpg", b"", "empty")
    put("page.jpg", b"<!DOCTYPE html><html><body>404 Not Found</body></html>", "not-an-image")
    put("text.png", b"just some text\n" * 10, "not-an-image")
    put("trunc.jpg", jpg[: len(jpg) // 2], "truncated")
    put("trunc.png", png[: len(png) // 2], "truncated")
    c = bytearray(png)
    i = png.find(b"IDAT")
    c[i + 10] ^= 0xFF
    put("crc.png", bytes(c), "corrupt")
    c = bytearray(jpg)
    sos = jpg.find(b"\xff\xda")
    mid = (sos + len(jpg)) // 2
    c[mid : mid + 2] = b"\xff\xd3"
    put("scan.jpg", bytes(c), "corrupt")
    ihdr = struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0)
    put("huge.png", b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + _png_chunk(b"IEND", b""), "too-large")
    os.symlink(os.path.join(root, "does-not-exist.jpg"), os.path.join(root, "broken.jpg"))
    bad["broken.jpg"] = "unreadable"
    os.symlink("loop_b.jpg", os.path.join(root, "loop_a.jpg"))
    os.symlink("loop_a.jpg", os.path.join(root, "loop_b.jpg"))
    bad["loop_a.jpg"] = bad["loop_b.jpg"] = "unreadable"
    os.mkfifo(os.path.join(root, "fifo.jpg"))
    bad["fifo.jpg"] = "unreadable"
    return bad


def test_every_bad_input_kind_is_a_hole(tmp_path, h, capsys):
    root = str(tmp_path / "bad")
    bad = make_bad_folder(root, h)
    dest = str(tmp_path / "s.store")
    rc = h.cli("ingest", root, dest, "--size", "16x16", "--workers", "2", "--log-interval", "0")
    assert rc == 0
    err = capsys.readouterr().err
    s = mmstore.open(dest)
    assert len(s) == 2 and s.slots == 2 + len(bad)
    got = {e["key"]: e["reason"] for e in s.skipped()}
    assert set(got) == set(bad)
    for k, cat in bad.items():
        assert got[k].split(":")[0] == cat, (k, got[k])
    # errors.jsonl lines: slot, key, reason; holes are zero with checksum 0
    with open(os.path.join(dest, "errors.jsonl")) as fh:
        lines = [json.loads(x) for x in fh]
    assert [x["slot"] for x in lines] == sorted(x["slot"] for x in lines)
    ck = s.slot_view.checksums()
    img = np.load(os.path.join(dest, "image.npy"), mmap_mode="r")
    for x in lines:
        assert ck[x["slot"]] == 0 and not img[x["slot"]].any()
    assert "broken symlink" in got["broken.jpg"]
    # the summary names ok / skipped / reasons
    assert "2 records" in err and f"{len(bad)} skipped" in err and "unreadable" in err


def test_unreadable_file(tmp_path, h):
    root = str(tmp_path / "imgs")
    os.mkdir(root)
    rng = np.random.default_rng(21)
    h.write_image(os.path.join(root, "a.jpg"), h.photo(rng, 20, 20))
    h.write_image(os.path.join(root, "secret.jpg"), h.photo(rng, 20, 20))
    os.chmod(os.path.join(root, "secret.jpg"), 0)
    dest = str(tmp_path / "s.store")
    env = dict(os.environ, PYTHONPATH=h.REPO)
    try:
        p = subprocess.run([sys.executable, "-m", "mmstore", "ingest", root, dest, "--size", "8x8", "-q"],
                           preexec_fn=drop_dac_override if os.geteuid() == 0 else None, env=env,
                           capture_output=True, text=True, timeout=120)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"cannot drop root's file-permission override here: {exc}")
    assert p.returncode == 0, p.stderr
    s = mmstore.open(dest)
    assert len(s) == 1
    assert s.skipped()[0]["key"] == "secret.jpg"
    assert "Permission denied" in s.skipped()[0]["reason"]


def test_max_errors_and_on_error_fail(tmp_path, h, capsys):
    root = str(tmp_path / "bad")
    bad = make_bad_folder(root, h)  # 2 good, len(bad) bad
    n = 2 + len(bad)
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", root, dest, "--size", "8x8", "--on-error", "fail", "-q", "--workers", "1",
                 "--chunk", "1") == 1
    err = capsys.readouterr().err
    assert "--resume" in err and "max-errors" in err
    assert os.path.isdir(dest + ".partial") and not os.path.exists(dest)
    # a limit above the count passes (resuming the stopped run: limits are not part of the fingerprint)
    assert h.cli("ingest", root, dest, "--size", "8x8", "--max-errors", str(len(bad)), "-q", "--resume") == 0
    assert mmstore.open(dest).slots == n
    d2 = str(tmp_path / "t.store")
    assert h.cli("ingest", root, d2, "--size", "8x8", "--max-errors", str(len(bad) - 1), "-q") == 1
    assert h.cli("ingest", root, d2, "--size", "8x8", "--max-errors", "50%", "-q", "--overwrite") == 1
    assert h.cli("ingest", root, d2, "--size", "8x8", "--max-errors", "90%", "-q", "--overwrite") == 0
    with pytest.raises(IngestError, match="max-errors"):
        from mmstore.ingest import ingest

        ingest(root, str(tmp_path / "u"), 8, on_error="fail", workers=0, quiet=True)


def test_csv_dir_named_like_image_and_missing(tmp_path, h):
    (tmp_path / "d.jpg").mkdir()
    rng = np.random.default_rng(22)
    h.write_image(str(tmp_path / "ok.jpg"), h.photo(rng, 20, 20))
    lst = tmp_path / "l.csv"
    lst.write_text("path\nok.jpg\nd.jpg\ngone.jpg\n")
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", str(lst), dest, "--size", "8x8", "-q") == 0
    s = mmstore.open(dest)
    r = {e["key"]: e["reason"] for e in s.skipped()}
    assert "Is a directory" in r["d.jpg"] and "No such file" in r["gone.jpg"]


def test_dataset_item_errors_are_holes(tmp_path):
    from mmstore.ingest import from_dataset

    class DS:
        def __len__(self):
            return 5

        def __getitem__(self, i):
            if i == 1:
                raise KeyError("boom")
            if i == 3:
                return np.zeros((3, 3), np.uint8)  # wrong shape
            return np.full((4, 4), i, np.uint8)

    dest = str(tmp_path / "d.store")
    res = from_dataset(DS(), dest, workers=2, quiet=True)
    assert res.records == 3 and res.skipped == 2
    s = mmstore.open(dest)
    r = {e["slot"]: e["reason"] for e in s.skipped()}
    assert "KeyError" in r[1] and r[3].startswith("wrong-shape")


class _Crashy:
    """Item 2 kills the process that decodes it (like a segfaulting decoder)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 2 and os.getpid() != _Crashy.parent:
            os.kill(os.getpid(), 9)
        return np.full((4, 4), i, np.uint8)


def test_decoder_crash_becomes_a_hole(tmp_path):
    from mmstore.ingest import from_dataset

    _Crashy.parent = os.getpid()
    dest = str(tmp_path / "c.store")
    res = from_dataset(_Crashy(), dest, workers=2, chunk=3, quiet=True)
    assert res.records == 5 and res.skipped == 1
    s = mmstore.open(dest)
    e = s.skipped()[0]
    assert e["slot"] == 2 and "crashed the worker" in e["reason"] and "signal 9" in e["reason"]
    assert s.column("image")[:, 0, 0].tolist() == [0, 1, 3, 4, 5]


def test_progress_log_lines_when_not_a_terminal(tmp_path, h, capsys):
    root = str(tmp_path / "p")
    h.make_folder(root, per_class=3)
    assert h.cli("ingest", root, str(tmp_path / "s"), "--size", "8x8", "--log-interval", "0", "--chunk", "1",
                 "--workers", "1") == 0
    err = capsys.readouterr().err
    assert "ingest: 1/6" in err and "ETA" in err and "errors" in err
    assert h.cli("ingest", root, str(tmp_path / "q"), "--size", "8x8", "--log-interval", "0", "-q") == 0
    assert capsys.readouterr().err == ""
