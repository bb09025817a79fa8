"""Smaller defects in the tools: one regression test each
(bench --source provenance, bench --plot log axis, inspect on a plain folder,
a StoreWriter's left-over .partial, no stray DEST.lock, merge of any stores
with the same schema and labels, the demo's stated run time)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
from support.proc import cli, run_cli, run_json
from support.stores import write_store

import mmstore
from mmstore.check.bench import BenchCase, BenchReport, _source_decoder, bench_figure
from mmstore.errors import IncompleteStoreError, LockedError, StoreExistsError
from mmstore.ingest import ingest, merge


def image_folder(root, classes=("cat", "dog"), per_class=3, seed=0) -> str:
    import cv2

    rng = np.random.default_rng(seed)
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for j in range(per_class):
            img = rng.integers(0, 256, (20 + 3 * j, 24, 3), dtype=np.uint8)
            cv2.imwrite(os.path.join(root, c, f"{j}.png"), img)
    return str(root)


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    root = tmp_path_factory.mktemp("ing")
    src = image_folder(root / "photos")
    dest = str(root / "photos.store")
    ingest(src, dest, (16, 12), workers=0, quiet=True, resize="center-crop")
    return src, dest


def help_text(cmd: str, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli(cmd, "--help")
    assert e.value.code == 0
    return capsys.readouterr().out


# -- bench --source: the decode spec ingest recorded ----------------------------------


def test_bench_source_uses_the_ingest_decode_spec(ingested):
    src, dest = ingested
    with mmstore.open(dest) as s:
        one, how = _source_decoder(s, src)
        assert "guessed" not in how and "decode spec" in how
        for i in range(len(s)):  # the spec found makes exactly the stored pixels
            assert np.array_equal(one(s.key(i)).image, s[i]["image"])


def test_bench_source_cli_says_no_guess(ingested, capsys):
    src, dest = ingested
    rc, rep = run_json(["bench", dest, "--samples", "4", "--paths", "read_batch", "--orders", "sequential",
                        "--source", src, "--cache", "warm", "--workers", "0"], capsys)
    assert rc == 0 and "guessed" not in rep["source"] and "the store's decode spec" in rep["source"]


def test_bench_source_without_a_spec_says_guessed(tmp_path):
    p = write_store(tmp_path / "s", 3, schema={"image": ("|u1", (8, 6, 3)), "label": ("<i8", ())},
                    make=lambda i: {"image": np.zeros((8, 6, 3), np.uint8), "label": i})
    with mmstore.open(p) as s:
        _, how = _source_decoder(s, str(tmp_path))
    assert "guessed" in how and "no spec in the provenance" in how


# -- bench --plot: a log axis ---------------------------------------------------------


def test_bench_plot_uses_a_log_axis(tmp_path):
    pytest.importorskip("matplotlib")
    rep = BenchReport(path=str(tmp_path / "s"), backend="memmap", records=10, record_bytes=100, batch_size=32,
                      samples=10, workers=0)
    rep.cases = [BenchCase("read_batch", "permutation", "warm", samples_per_s=50_000.0),
                 BenchCase("DataLoader", "permutation", "warm", samples_per_s=40.0),
                 BenchCase("source", "permutation", "cold", samples_per_s=3.0),
                 BenchCase("Loader", "permutation", "cold")]  # did not run: no bar
    fig = bench_figure(rep)
    try:
        ax = fig.axes[0]
        assert ax.get_yscale() == "log"
        lo, hi = ax.get_ylim()
        assert lo <= 3.0 and hi >= 50_000.0  # the smallest bar is inside the axis, not squashed to 0
        labels = [t.get_text() for t in ax.texts]
        assert "50,000" in labels and "40" in labels and "3" in labels
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# -- messages -------------------------------------------------------------------------


def test_inspect_on_a_plain_folder_suggests_ingest(tmp_path, capsys):
    src = image_folder(tmp_path / "photos")
    rc, _, err = run_cli(["inspect", src], capsys)
    assert rc == 2
    assert f"mmstore ingest {src} DEST.store" in err and "--resume" not in err
    with pytest.raises(IncompleteStoreError, match="plain folder"):
        mmstore.open(src)


def test_a_store_without_its_manifest_is_not_called_a_folder(tmp_path):
    p = write_store(tmp_path / "s", 3)
    os.unlink(os.path.join(p, "manifest.json"))
    with pytest.raises(IncompleteStoreError, match="manifest was deleted or not copied") as ei:
        mmstore.open(p)
    assert "mmstore ingest" not in str(ei.value)


def test_a_failed_store_writer_says_how_to_continue_it_in_python(tmp_path):
    dest = str(tmp_path / "x")
    with pytest.raises(RuntimeError), mmstore.StoreWriter(dest, {"a": ("<i8", ())}, slots=3) as w:
        w.write(0, {"a": 1})
        raise RuntimeError("boom")
    with pytest.raises(IncompleteStoreError) as ei:
        mmstore.open(dest)
    msg = str(ei.value)
    assert "StoreWriter" in msg and "resume=True" in msg and "overwrite=True" in msg
    assert "mmstore ingest" not in msg
    with mmstore.StoreWriter(dest, {"a": ("<i8", ())}, slots=3, resume=True) as w:  # what it says works
        w.mark_written([0])
        w.write(1, {"a": 2})
        w.write(2, {"a": 3})
    with mmstore.open(dest) as s:
        assert s.column("a").tolist() == [1, 2, 3]


def test_an_interrupted_ingest_still_says_resume(tmp_path):
    dest = str(tmp_path / "y")
    os.makedirs(dest + ".partial")
    open(os.path.join(dest + ".partial", "_ingest.json"), "w").close()
    with pytest.raises(IncompleteStoreError, match=r"mmstore ingest \.\.\. --resume"):
        mmstore.open(dest)


# -- no stray DEST.lock ---------------------------------------------------------------


def locks(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".lock"))


def test_refusing_ingests_leave_no_lock(ingested, tmp_path):
    src, dest = ingested
    parent = os.path.dirname(dest)
    with pytest.raises(StoreExistsError):
        ingest(src, dest, (16, 12), workers=0, quiet=True, resize="center-crop")  # exists
    assert locks(parent) == []
    r = ingest(src, dest, (16, 12), workers=0, quiet=True, resize="center-crop", resume=True)  # already complete
    assert r.records == 6 and locks(parent) == []
    with pytest.raises(StoreExistsError):
        mmstore.StoreWriter(dest, {"a": ("<i8", ())}, slots=1)
    assert locks(parent) == []
    m = str(tmp_path / "m.store")
    merge([dest], m)
    with pytest.raises(StoreExistsError):
        merge([dest], m)
    assert locks(parent) == [] and locks(tmp_path) == []


def test_a_stale_lock_is_removed_a_held_or_foreign_one_never(ingested):
    src, dest = ingested
    lock = dest + ".lock"
    # left by a killed ingest (empty, nobody holds it): the refusing run removes it
    open(lock, "w").close()
    with pytest.raises(StoreExistsError):
        ingest(src, dest, (16, 12), workers=0, quiet=True, resize="center-crop")
    assert not os.path.exists(lock)
    # held by another live writer: refused as locked, and left alone
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LockedError):
            ingest(src, dest, (16, 12), workers=0, quiet=True, resize="center-crop", resume=True)
        assert os.path.exists(lock)
    finally:
        os.close(fd)
        os.unlink(lock)
    # not an mmstore lock file (someone's notes): never removed
    with open(lock, "w") as fh:
        fh.write("my notes\n")
    try:
        with pytest.raises(mmstore.MmstoreError):
            ingest(src, dest, (16, 12), workers=0, quiet=True, resize="center-crop", resume=True)
        with open(lock) as fh:
            assert fh.read() == "my notes\n"
    finally:
        os.unlink(lock)


# -- merge: any stores with the same schema and labels --------------------------------


def test_merge_joins_separately_ingested_stores_in_the_given_order(tmp_path, capsys):
    a = image_folder(tmp_path / "photos-2019", seed=1)
    b = image_folder(tmp_path / "photos-2020", per_class=2, seed=2)
    sa, sb = str(tmp_path / "2019.store"), str(tmp_path / "2020.store")
    ingest(a, sa, (16, 12), workers=0, quiet=True)
    ingest(b, sb, (16, 12), workers=0, quiet=True)
    rc, _, _ = run_cli(["merge", sa, sb, str(tmp_path / "all.store")], capsys)
    assert rc == 0
    with mmstore.open(sa) as x, mmstore.open(sb) as y, mmstore.open(tmp_path / "all.store") as m:
        assert len(m) == len(x) + len(y) == 10 and m.label_names == x.label_names == ["cat", "dog"]
        want = np.concatenate([x[:]["image"], y[:]["image"]])
        assert np.array_equal(m[:]["image"], want)
        assert [m.key(i) for i in range(len(m))] == (
            [x.key(i) for i in range(len(x))] + [y.key(i) for i in range(len(y))])
    out = help_text("merge", capsys)
    assert "same backend, schema and label names" in " ".join(out.split()) and "2019.store 2020.store" in out


# -- demo: one stated run time --------------------------------------------------------


def test_demo_time_is_stated_the_same_in_the_help_and_the_readme(capsys):
    import re

    from mmstore.cli.demo import DEMO_TIME

    assert DEMO_TIME in " ".join(help_text("demo", capsys).split())
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
    with open(readme) as fh:
        head = " ".join(fh.read(3000).split())
    assert DEMO_TIME in head
    assert not re.search(r"\b35 s\b|two minutes", head)
