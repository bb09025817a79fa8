"""inspect, show, warm/evict, doctor, bench, convert; --help and subprocess runs."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from support.compare import assert_reads_same
from support.faults import flip_bit
from support.proc import cli, run_cli, run_json, run_sub
from support.stores import image_store, write_parts, write_store

import mmstore
from mmstore._os import disk_info
from mmstore.check.cache import evict_store, warm_store
from mmstore.cli import COMMANDS

TOOLS = ("inspect", "verify", "show", "warm", "evict", "doctor", "bench", "convert")


@pytest.fixture(scope="module")
def img_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    path, imgs = image_store(d / "img.store", n=600, holes=(3, 50), label_names=list("abcde"),
                          provenance={"source": {"kind": "folder", "path": "/nowhere"}})
    return path


@pytest.mark.parametrize("cmd", TOOLS)
def test_help_has_an_example(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        cli(cmd, "--help")
    assert e.value.code == 0
    assert "example" in capsys.readouterr().out


def test_registered():
    for m in ("inspect", "verify", "show", "warm", "doctor", "bench", "convert"):
        assert m in COMMANDS


@pytest.mark.parametrize("cmd", ["inspect", "show", "warm", "evict", "doctor", "bench"])
def test_not_a_store_exit_2(cmd, tmp_path, capsys):
    extra = {"show": ["-o", str(tmp_path / "x.png")], "doctor": ["--budget", "1"], "bench": ["--samples", "8"]}
    rc, _, err = run_cli([cmd, tmp_path / "missing", *extra.get(cmd, [])], capsys)
    assert rc == 2 and "no such store" in err


def test_inspect(img_store, capsys):
    rc, rep = run_json(["inspect", img_store, "--sample", "100"], capsys)
    assert rc == 0
    assert rep["records"] == 598 and rep["slots"] == 600 and rep["backend"] == "memmap"
    assert rep["format_version"] == [1, 0]
    assert rep["skipped"] == 2 and rep["skipped_reasons"][0] == {"reason": "corrupt", "count": 2,
                                                                 "example": "img/00003.png: corrupt: test"}
    hist = {h["name"]: h["count"] for h in rep["label_histogram"]}
    with mmstore.open(img_store) as s:
        labels = s.column("label")
    assert hist == {n: int((labels == k).sum()) for k, n in enumerate("abcde")}
    assert rep["image_sample"] == 100 and len(rep["channel_mean"]) == 3
    assert 100 < rep["channel_mean"][0] < 155 and 60 < rep["channel_std"][0] < 90
    assert rep["cache_resident_bytes"] is not None and rep["mem_available"] > 0
    assert rep["files"]["image.npy"] == os.path.getsize(os.path.join(img_store, "image.npy"))
    rc, out, _ = run_cli(["inspect", img_store], capsys)
    assert rc == 0 and "page cache" in out and "corrupt" in out


def _read_png(path):
    import cv2

    return cv2.imread(str(path), cv2.IMREAD_UNCHANGED)


@pytest.mark.parametrize("channels,layout", [(3, "hwc"), (1, "hwc"), (3, "chw"), (1, "chw")])
def test_show_tiles_equal_records(tmp_path, channels, layout, capsys):
    p, imgs = image_store(tmp_path / "s", n=40, channels=channels, layout=layout, label_names=list("vwxyz"))
    out = tmp_path / "grid.png"
    rc, rep = run_json(["show", p, "-o", out, "-n", "6", "--seed", "2", "--scale", "2"], capsys)
    assert rc == 0
    png = _read_png(out)
    assert png.shape[:2] == (rep["height"], rep["width"]) and len(rep["tiles"]) == 6
    for t in rep["tiles"]:
        want = imgs[t["slot"]]
        want = np.moveaxis(want, 0, -1) if layout == "chw" else want
        want = np.repeat(np.repeat(want, 2, 0), 2, 1)
        got = png[t["y"]: t["y"] + t["h"], t["x"]: t["x"] + t["w"]]
        if channels == 3:
            assert np.array_equal(got[..., ::-1], want)
        else:
            assert np.array_equal(got[..., 0], want[..., 0]) and np.array_equal(got[..., 2], want[..., 0])
        assert t["key"] == f"img/{t['slot']:05d}.png" and t["label_name"] == "vwxyz"[t["slot"] % 5]


def test_show_indices_and_errors(img_store, tmp_path, capsys):
    rc, rep = run_json(["show", img_store, "-o", tmp_path / "g.png", "--indices", "0,5,597"], capsys)
    assert rc == 0 and [t["index"] for t in rep["tiles"]] == [0, 5, 597]
    rc, _, err = run_cli(["show", img_store, "-o", tmp_path / "g.png", "--indices", "9999"], capsys)
    assert rc == 2
    p = write_store(tmp_path / "noimg", 5, schema={"x": ("<f4", (3,))},
                    make=lambda i: {"x": np.zeros(3, np.float32)})
    rc, _, err = run_cli(["show", p, "-o", tmp_path / "g2.png"], capsys)
    assert rc == 2 and "no image field" in err


def _evict_exit_code(store) -> int:
    """What ``evict --sync`` of a store no process has mapped must return:
    0 (every page dropped), or 1 where the file system keeps its pages (tmpfs)."""
    return 1 if disk_info(store)["tmpfs"] else 0


def test_warm_evict(img_store, tmp_path, capsys):
    store = shutil.copytree(img_store, tmp_path / "copy")  # pages of a copy nothing has mapped
    files = sum(os.path.getsize(p) for p in mmstore.open(store).data_paths())
    rc, rep = run_json(["evict", store, "--sync"], capsys)
    assert rep["action"] == "evict" and rep["bytes_total"] == files and rep["resident_before"] > 0
    assert rc == _evict_exit_code(store), rep
    if rc == 0:
        assert rep["resident_after"] == 0 and rep["warnings"] == []
    else:
        assert rep["resident_after"] == files and "tmpfs" in rep["warnings"][0]
    rc, rep = run_json(["warm", store], capsys)
    assert rc == 0 and rep["complete"] and rep["bytes_read"] == rep["bytes_total"] == files
    assert rep["resident_after"] == files and rep["warnings"] == []
    with mmstore.open(store) as s:
        s.evict(sync=True)
        w = s.warm()
        assert w.complete and w.bytes_read == files
        assert w.resident_before == (0 if _evict_exit_code(store) == 0 else files)


def test_warm_does_not_fit(img_store, tmp_path):
    """A budget (here ~24 bytes) below what is not yet cached stops the pass
    and says so; a store that is all cached already fits any budget."""
    store = str(shutil.copytree(img_store, tmp_path / "copy"))
    ev = evict_store(store, sync=True)
    files = ev.bytes_total
    rep = warm_store(store, max_fraction=1e-9)
    if _evict_exit_code(store) == 0:  # evicted (opening it reads a little back): it does not fit
        assert ev.resident_after == 0 and rep.resident_before < files // 2
        assert not rep.complete and rep.bytes_read < files
        assert "not yet resident" in rep.reason
        assert rep.warnings == [f"the store does not fit in memory; stopped: {rep.reason}"]
    else:  # tmpfs: its pages stay, so the store is all cached
        assert rep.complete and rep.resident_before == files
    rep = warm_store(store, max_fraction=None)
    assert rep.complete and rep.bytes_read == files and rep.resident_after == files and rep.warnings == []
    rep = warm_store(store, max_fraction=1e-9)
    assert rep.complete and rep.reason is None and rep.warnings == [] and rep.resident_before == files


def test_doctor(img_store, capsys):
    rc, rep = run_json(["doctor", img_store, "--budget", "2", "--samples", "64", "--seq-mb", "8"], capsys)
    assert rc == 0
    assert rep["seq_mb_per_s"] > 0 and rep["warm_reads_per_s"] > 0 and rep["cold_reads_per_s"] > 0
    orders = [p["order"] for p in rep["predictions"]]
    assert orders[0] == "full shuffle, cold" and any(o.startswith("block shuffle") for o in orders)
    assert rep["recommendation"] and rep["seconds"] < 20
    rc, out, _ = run_cli(["doctor", img_store, "--budget", "1", "--samples", "32", "--no-cold"], capsys)
    assert rc == 0 and "advice" in out


def test_bench(img_store, tmp_path, capsys):
    rc, rep = run_json(["bench", img_store, "--samples", "128", "--batch-size", "32", "--max-seconds", "2",
                        "--workers", "0"], capsys)
    assert rc == 0
    paths = {c["path"] for c in rep["cases"]}
    assert "read_batch" in paths
    assert {"DataLoader", "Loader"} <= paths or rep["torch"].startswith("not run")
    assert {c["order"] for c in rep["cases"]} == {"sequential", "permutation", "block"}
    assert {c["cache"] for c in rep["cases"]} == {"cold", "warm"}
    for c in rep["cases"]:
        if c["path"] == "read_batch":
            assert c["samples"] == 128 and c["samples_per_s"] > 0
    assert set(rep["quality"]) == {"sequential", "permutation", "block"}
    assert rep["quality"]["sequential"]["mean_abs_displacement"] == 0.0


def test_bench_plot_and_source(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import cv2

    src = tmp_path / "src"
    os.makedirs(src / "img")
    p, imgs = image_store(tmp_path / "s", n=50)
    for s in range(50):
        cv2.imwrite(str(src / "img" / f"{s:05d}.png"), imgs[s][..., ::-1])
    rc, rep = run_json(["bench", p, "--samples", "20", "--paths", "read_batch", "--orders", "permutation",
                        "--source", src, "--plot", tmp_path / "b.png", "--workers", "1"], capsys)
    assert rc == 0 and os.path.getsize(tmp_path / "b.png") > 1000
    assert {c["path"] for c in rep["cases"]} == {"read_batch", "source"}
    assert all(c["samples"] == 20 for c in rep["cases"])


def test_convert_roundtrip(tmp_path, capsys):
    a = write_store(tmp_path / "a", 300, holes=(0, 17, 299), label_names=list("abcdefg"),
                    provenance={"source": "x"})
    rc, rep = run_json(["convert", a, tmp_path / "b", "--backend", "lmdb"], capsys)
    assert rc == 0 and rep["backend"] == "lmdb" and rep["holes"] == 3
    rc, _ = run_json(["convert", tmp_path / "b", tmp_path / "c", "--backend", "memmap"], capsys)
    assert rc == 0
    with mmstore.open(a) as sa, mmstore.open(tmp_path / "b") as sb, mmstore.open(tmp_path / "c") as sc:
        for other in (sb, sc):
            assert len(other) == len(sa) and other.label_names == sa.label_names
            assert other.skipped() == sa.skipped()
            x, y = sa[:], other[:]
            assert all(np.array_equal(x[k], y[k]) for k in x)
            assert [other.key(i) for i in range(len(sa))] == [sa.key(i) for i in range(len(sa))]
        assert sb.provenance["converted_from"]["store_id"] == sa.store_id
        assert sb.provenance["source"] == "x"
    for n in os.listdir(a):
        if n != "manifest.json":
            with open(os.path.join(a, n), "rb") as f1, open(tmp_path / "c" / n, "rb") as f2:
                assert f1.read() == f2.read(), n
    with open(os.path.join(a, "_checksums.npy"), "rb") as f1, open(tmp_path / "b" / "_checksums.npy", "rb") as f2:
        assert f1.read() == f2.read()
    rc, _, _ = run_cli(["verify", tmp_path / "b"], capsys)
    assert rc == 0
    rc, _, err = run_cli(["convert", a, tmp_path / "b", "--backend", "lmdb"], capsys)
    assert rc == 2 and "exists" in err


def test_convert_refuses_damaged_source(tmp_path, capsys):
    a = write_store(tmp_path / "a", 30)
    flip_bit(os.path.join(a, "label.npy"), os.path.getsize(os.path.join(a, "label.npy")) - 2)
    rc, _, err = run_cli(["convert", a, tmp_path / "b", "--backend", "lmdb"], capsys)
    assert rc == 1 and "damaged" in err and not os.path.exists(tmp_path / "b")
    assert not os.path.exists(str(tmp_path / "b") + ".partial")


@pytest.mark.parametrize("argv", [
    ["inspect", "{s}", "--json", "--sample", "10"],
    ["show", "{s}", "-o", "{t}/g.png", "--json", "-n", "4"],
    ["warm", "{s}", "--json"],
    ["evict", "{s}", "--json", "--sync"],
    ["doctor", "{s}", "--json", "--budget", "1", "--samples", "16", "--seq-mb", "4"],
    ["bench", "{s}", "--json", "--samples", "32", "--paths", "read_batch", "--max-seconds", "1"],
    ["convert", "{s}", "{t}/conv", "--backend", "lmdb", "--json"],
])
def test_subprocess(img_store, tmp_path, argv):
    store, want = img_store, 0
    if argv[0] == "evict":  # a copy nothing has mapped: every page can be dropped (but on tmpfs)
        store = str(shutil.copytree(img_store, tmp_path / "copy"))
        want = _evict_exit_code(store)
    r = run_sub([a.format(s=store, t=tmp_path) for a in argv])
    assert r.returncode == want, (r.stdout, r.stderr)
    rep = json.loads(r.stdout)  # a report about this store
    assert rep.get("path", rep.get("source")) == str(store), rep
    assert rep.get("records", 598) == 598 and rep.get("bytes_total", 1) > 0, rep


def test_every_command_on_a_merged_store(tmp_path, capsys):
    """A segmented store (mmstore merge) works with every tool; convert turns
    it back into a plain store that reads the same."""
    parts = write_parts(tmp_path / "p", 60, [10, 20, 30, 45], holes={4, 30})
    ref = write_store(tmp_path / "ref", 60, holes={4, 30})
    m = str(tmp_path / "m")
    rc, _, err = run_cli(["merge", *parts, m], capsys)
    assert rc == 0 and "60 slots" not in err and "58 records (2 skipped) from 5 parts" in err
    rc, out, _ = run_cli(["inspect", m], capsys)
    assert rc == 0 and "segments     5 (merged from 5 parts; 10 to 15 slots each)" in out
    assert "image.*.npy (5 files)" in out
    rc, rep = run_json(["inspect", m], capsys)
    assert rep["segments"] == [10, 10, 10, 15, 15] and rep["format_version"] == [1, 1]
    rc, rep = run_json(["verify", m], capsys)
    assert rc == 0 and rep["ok"] and rep["checked_slots"] == 60
    rc, rep = run_json(["show", m, "-o", tmp_path / "g.png", "--indices", "0,9,10,57"], capsys)
    assert rc == 0 and [t["slot"] for t in rep["tiles"]] == [0, 10, 11, 59]
    for cmd in (["warm", m], ["evict", m], ["doctor", m, "--budget", "1", "--samples", "16", "--seq-mb", "1"],
                ["bench", m, "--samples", "16", "--max-seconds", "1"]):
        rc, _, err = run_cli(cmd, capsys)
        assert rc == 0, (cmd, err)
    for backend in ("lmdb", "memmap"):
        out = tmp_path / f"plain-{backend}"
        rc, _ = run_json(["convert", m, out, "--backend", backend], capsys)
        assert rc == 0 and mmstore.open(out).segments is None
        assert_reads_same(ref, out)
