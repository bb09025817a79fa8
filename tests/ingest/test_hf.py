"""A Hugging Face ``datasets.Dataset`` as an ingest source: a small dataset built here from crops of a real
photograph, its ``Image`` feature holding the JPEG bytes or the files' paths, a ``ClassLabel`` and a caption;
records pixel-equal to a folder ingest of the same files, the ClassLabel names kept, no PIL decode by the
dataset; a selection honoured; the same bytes whatever the workers and after a SIGKILL with resume; null
and corrupt images listed with their row; refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support.compare import assert_same_files
from support.proc import REPO, cli_env

import mmstore
from mmstore.errors import SourceError

datasets = pytest.importorskip("datasets")
cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

N = 10
NAMES = ["ant", "bee", "wasp"]


def write_photos(folder: str) -> list[str]:
    """N JPEG crops of the photograph in ``folder`` (000.jpg ...); their paths in order."""
    photo = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
    rng = np.random.default_rng(1)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(N):
        h, w = (int(v) for v in rng.integers(60, 200, 2))
        y, x = int(rng.integers(0, photo.shape[0] - h)), int(rng.integers(0, photo.shape[1] - w))
        p = os.path.join(folder, f"{i:03d}.jpg")
        cv2.imwrite(p, photo[y : y + h, x : x + w], [cv2.IMWRITE_JPEG_QUALITY, 90])
        paths.append(p)
    return paths


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def make_dataset(paths: list[str], as_bytes: bool = True, images=None):
    """The dataset: ``image`` (bytes or paths), ``label`` (ClassLabel), ``caption``."""
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES),
                               "caption": datasets.Value("string")})
    if images is None:
        images = [{"bytes": _read(p), "path": None} if as_bytes else p for p in paths]
    return datasets.Dataset.from_dict({"image": images, "label": [i % 3 for i in range(len(paths))],
                                       "caption": [f"photo {i}" for i in range(len(paths))]}, features=feats)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """(paths of the JPEGs, the folder's store at 32x32)."""
    root = tmp_path_factory.mktemp("hf")
    paths = write_photos(str(root / "folder"))
    ref = str(root / "ref")
    mmstore.ingest(str(root / "folder"), ref, size=32, workers=0, quiet=True)
    return paths, ref


@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "paths"])
def test_dataset_is_the_folder_pixel_for_pixel_with_its_class_names(tmp_path, photos, as_bytes):
    paths, ref = photos
    ds = make_dataset(paths, as_bytes)
    dest = str(tmp_path / "s")
    r = mmstore.from_hf(ds, dest, size=32, caption_column="caption", workers=0, quiet=True)
    assert (r.records, r.skipped) == (N, 0)
    a, b = mmstore.open(dest), mmstore.open(ref)
    assert a.manifest["label_names"] == NAMES
    assert a.schema.names == ("image", "label", "orig_size", "box", "dst", "text")
    for i in range(N):
        for f in ("image", "orig_size", "box", "dst"):
            assert np.array_equal(a[i][f], b[i][f]), (i, f)
        assert int(a[i]["label"]) == i % 3 and a[i]["text"] == f"photo {i}" and a.key(i) == str(i)
    # mmstore.ingest takes the dataset too, with the same result
    same = str(tmp_path / "same")
    mmstore.ingest(ds, same, size=32, caption_column="caption", workers=0, quiet=True)
    assert_same_files(dest, same)


def test_rows_are_read_as_arrow_never_decoded_by_the_dataset(tmp_path, photos, monkeypatch):
    paths, _ = photos
    ds = make_dataset(paths)

    def no_pil(*a, **kw):
        raise AssertionError("the dataset decoded an image")

    monkeypatch.setattr(datasets.Image, "decode_example", no_pil)
    r = mmstore.from_hf(ds, str(tmp_path / "s"), size=16, workers=0, quiet=True)
    assert r.records == N


def test_a_selection_is_honoured_and_workers_do_not_change_a_byte(tmp_path, photos):
    paths, _ = photos
    ds = make_dataset(paths).select([7, 2, 5, 0])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mmstore.from_hf(ds, a, size=32, workers=0, quiet=True)
    mmstore.from_hf(ds, b, size=32, workers=2, chunk=1, quiet=True)
    assert_same_files(a, b)
    s = mmstore.open(a)
    ref = mmstore.open(photos[1])
    assert [int(s[k]["label"]) for k in range(4)] == [7 % 3, 2 % 3, 5 % 3, 0]
    assert all(np.array_equal(s[k]["image"], ref[i]["image"]) for k, i in enumerate([7, 2, 5, 0]))


_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from ingest.test_hf import make_dataset
import mmstore
paths = {paths!r}
mmstore.from_hf(make_dataset(paths), {dest!r}, size=32, caption_column="caption", workers=1, chunk=1,
                quiet=True, resume=True)
"""


@pytest.mark.slow  # a whole job of several processes: CI's step for slow tests
def test_sigkill_then_resume_gives_the_same_store(tmp_path, photos):
    paths, _ = photos
    a = str(tmp_path / "a")
    mmstore.from_hf(make_dataset(paths), a, size=32, caption_column="caption", workers=0, quiet=True)

    def run(dest, env=None):
        code = _SCRIPT.format(tests=os.path.join(REPO, "tests"), paths=paths, dest=dest)
        return subprocess.Popen([sys.executable, "-c", code], env=cli_env(**(env or {})), cwd=REPO)

    c = str(tmp_path / "c")
    assert run(c, {"MMSTORE_CRASH_AT": "commit:3"}).wait(120) == 77 and os.path.isdir(c + ".partial")
    assert run(c).wait(120) == 0
    assert_same_files(a, c)
    d = str(tmp_path / "d")
    p = run(d)
    log = os.path.join(d + ".partial", "_ingest_commits.log")
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline and not (os.path.exists(log) and os.path.getsize(log)):
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    assert run(d).wait(120) == 0
    assert_same_files(a, d)


def test_null_and_corrupt_images_are_holes_naming_their_row(tmp_path, photos):
    paths, _ = photos
    images = [{"bytes": _read(p), "path": None} for p in paths]
    images[3] = None
    images[6] = {"bytes": b"not a picture", "path": None}
    ds = make_dataset(paths, images=images)
    dest = str(tmp_path / "s")
    r = mmstore.from_hf(ds, dest, size=16, workers=0, quiet=True)
    assert (r.records, r.skipped) == (N - 2, 2)
    with open(os.path.join(dest, "errors.jsonl"), encoding="utf-8") as fh:
        errs = {e["key"]: e["reason"] for e in map(json.loads, fh)}
    assert errs["3"] == "missing: the image is null (column 'image', row 3)"
    assert set(errs) == {"3", "6"}


def test_refusals(tmp_path, photos):
    paths, _ = photos
    ds = make_dataset(paths)
    with pytest.raises(SourceError, match=r"pass one split, e.g. ds\['train'\]"):
        mmstore.from_hf(datasets.DatasetDict({"train": ds}), str(tmp_path / "x"), size=16)
    with pytest.raises(SourceError, match="load it without streaming=True"):
        mmstore.ingest(ds.to_iterable_dataset(), str(tmp_path / "x"), size=16)
    with pytest.raises(SourceError, match=r"options \['path_column'\] do not apply"):
        mmstore.ingest(ds, str(tmp_path / "x"), size=16, path_column="x")
    with pytest.raises(SourceError, match="no column 'nope'"):
        mmstore.from_hf(ds, str(tmp_path / "x"), size=16, columns=["nope"])
    # no labels when asked for none
    r = mmstore.from_hf(ds, str(tmp_path / "nolabel"), size=16, label_column="", workers=0, quiet=True)
    assert "label" not in mmstore.open(r.path).schema
    assert not os.path.exists(tmp_path / "x")


def test_import_mmstore_needs_neither_pyarrow_nor_datasets():
    code = textwrap.dedent("""
        import sys
        import mmstore
        bad = [m for m in ("pyarrow", "datasets") if m in sys.modules]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], env=cli_env(), check=True, timeout=60)
