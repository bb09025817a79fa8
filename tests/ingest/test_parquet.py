"""Parquet files as an ingest source: crops of a real photograph written with pyarrow into two files of
several row groups, in img2dataset's layout (image bytes in a ``jpg`` column, caption, metadata columns)
and in Hugging Face's export layout (an ``{bytes, path}`` image struct, a ClassLabel in the schema's
metadata); records pixel-equal to a folder ingest of the same JPEGs; captions, columns and labels; the
same bytes whatever the workers and after a crash and a SIGKILL with resume; null and corrupt images
listed with their file and row; refusals that say what to do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.compare import assert_same_files
from support.proc import cli_env, popen_cli, run_cli

import mmstore
from mmstore.errors import MissingExtraError, ResumeMismatchError, SchemaError, SourceError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
N = 12
CUT = 7  # rows of the first file


def _jpegs() -> list[bytes]:
    """N JPEGs of crops of the photograph, of several sizes and aspects."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(N):
        h, w = (int(v) for v in rng.integers(60, 200, 2))
        y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
        ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(PHOTO[y : y + h, x : x + w, ::-1]),
                               [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(buf.tobytes())
    return out


JPEGS = _jpegs()
CLASSES = ("cat", "dog", "bird")  # the named labels of img2dataset's layout (stored numbered by sorted name)


def _img2dataset(rows, images=None) -> pa.Table:
    images = JPEGS if images is None else images
    return pa.table({
        "key": [f"{i:09d}" for i in rows],
        "jpg": pa.array([images[i] for i in rows], pa.binary()),
        "caption": [f"a photo, number {i}" for i in rows],
        "similarity": pa.array([0.25 + i for i in rows], pa.float64()),
        "width": pa.array([10 * i for i in rows], pa.int32()),
        "label": [CLASSES[i % 3] for i in rows],
    })


def _hf(rows) -> pa.Table:
    t = pa.table({
        "image": pa.array([{"bytes": JPEGS[i], "path": f"{i:03d}.jpg"} for i in rows],
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "label": pa.array([i % 2 for i in rows], pa.int64()),
    })
    meta = {"info": {"features": {"image": {"_type": "Image"},
                                  "label": {"names": ["ant", "bee"], "_type": "ClassLabel"}}}}
    return t.replace_schema_metadata({b"huggingface": json.dumps(meta).encode()})


def _write(d, make) -> str:
    """Two files of several row groups (3 and 2 rows)."""
    os.makedirs(d)
    pq.write_table(make(range(CUT)), os.path.join(d, "part-00000.parquet"), row_group_size=3)
    pq.write_table(make(range(CUT, N)), os.path.join(d, "part-00001.parquet"), row_group_size=2)
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(img2dataset files, HF export files, a folder of the same JPEGs, the folder's store at 32x32)."""
    root = tmp_path_factory.mktemp("pq")
    folder = root / "folder"
    folder.mkdir()
    for i, b in enumerate(JPEGS):
        (folder / f"{i:03d}.jpg").write_bytes(b)
    ref = str(root / "ref")
    mmstore.ingest(str(folder), ref, size=32, workers=0, quiet=True)
    return _write(str(root / "i2d"), _img2dataset), _write(str(root / "hf"), _hf), str(folder), ref


I2D = dict(image_column="jpg", caption_column="caption", columns="similarity,width,key", label_column="label")


def _same_pixels(store, ref) -> None:
    a, b = mmstore.open(store), mmstore.open(ref)
    assert len(a) == len(b) == N
    for i in range(N):
        for f in ("image", "orig_size", "box", "dst"):
            assert np.array_equal(a[i][f], b[i][f]), (i, f)


def test_img2dataset_layout_is_the_folder_pixel_for_pixel(tmp_path, data):
    i2d, _, _, ref = data
    dest = str(tmp_path / "s")
    r = mmstore.ingest(os.path.join(i2d, "*.parquet"), dest, size=32, workers=0, quiet=True, **I2D)
    assert (r.records, r.skipped) == (N, 0)
    _same_pixels(dest, ref)
    s = mmstore.open(dest)
    assert s.schema.names == ("image", "label", "orig_size", "box", "dst", "text", "similarity", "width", "key")
    assert s.schema["similarity"].dtype == np.dtype("<f8") and s.schema["width"].dtype == np.dtype("<i4")
    assert s.manifest["label_names"] == sorted(CLASSES)
    for i in range(N):
        rec = s[i]
        assert rec["text"] == f"a photo, number {i}" and rec["key"] == f"{i:09d}"
        assert float(rec["similarity"]) == 0.25 + i and int(rec["width"]) == 10 * i
        assert sorted(CLASSES)[int(rec["label"])] == CLASSES[i % 3]
        f, row = (0, i) if i < CUT else (1, i - CUT)
        assert s.key(i) == f"part-{f:05d}.parquet:{row}"


def test_hf_export_layout_keeps_classlabel_names(tmp_path, data, capsys):
    _, hf, _, ref = data
    dest = str(tmp_path / "s")
    rc, _, err = run_cli(["ingest", hf, dest, "--size", "32", "--image-column", "image", "--workers", "0"], capsys)
    assert rc == 0, err
    _same_pixels(dest, ref)
    s = mmstore.open(dest)
    assert s.manifest["label_names"] == ["ant", "bee"]
    assert [int(s[i]["label"]) for i in range(N)] == [i % 2 for i in range(N)]
    # the image column and the ClassLabel column are found without being named
    auto = str(tmp_path / "auto")
    mmstore.ingest(os.path.join(hf, "*.parquet"), auto, size=32, workers=0, quiet=True)
    assert_same_files(dest, auto)


def test_same_bytes_whatever_the_workers(tmp_path, data):
    i2d = data[0]
    src = os.path.join(i2d, "*.parquet")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mmstore.ingest(src, a, size=32, workers=0, quiet=True, **I2D)
    mmstore.ingest(src, b, size=32, workers=2, chunk=2, quiet=True, **I2D)
    assert_same_files(a, b)


def test_crash_and_sigkill_then_resume_give_the_same_store(tmp_path, data):
    i2d = data[0]
    src = os.path.join(i2d, "*.parquet")
    a = str(tmp_path / "a")
    args = ["--size", "32", "--image-column", "jpg", "--caption-column", "caption", "--columns", "similarity",
            "--workers", "1", "--chunk", "1", "-q"]
    assert popen_cli(["ingest", src, a, *args]).wait(120) == 0
    c = str(tmp_path / "c")
    p = popen_cli(["ingest", src, c, *args], env={"MMSTORE_CRASH_AT": "commit:3"})
    assert p.wait(120) == 77 and os.path.isdir(c + ".partial")
    assert popen_cli(["ingest", src, c, *args, "--resume"]).wait(120) == 0
    assert_same_files(a, c)
    d = str(tmp_path / "d")
    p = popen_cli(["ingest", src, d, *args])
    log = os.path.join(d + ".partial", "_ingest_commits.log")
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline and not (os.path.exists(log) and os.path.getsize(log)):
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    assert popen_cli(["ingest", src, d, *args, "--resume"]).wait(120) == 0
    assert_same_files(a, d)


def test_null_and_corrupt_images_are_holes_naming_file_and_row(tmp_path):
    images = list(JPEGS)
    images[2] = None
    images[8] = JPEGS[8][: len(JPEGS[8]) // 3]  # cut short
    images[9] = b"<html>404</html>"
    d = str(tmp_path / "bad")
    _write(d, lambda rows: _img2dataset(rows, images))
    dest = str(tmp_path / "s")
    r = mmstore.ingest(os.path.join(d, "*.parquet"), dest, size=32, workers=0, quiet=True, image_column="jpg")
    assert (r.records, r.skipped) == (N - 3, 3)
    with open(os.path.join(dest, "errors.jsonl"), encoding="utf-8") as fh:
        errs = {e["key"]: e["reason"] for e in map(json.loads, fh)}
    assert set(errs) == {"part-00000.parquet:2", "part-00001.parquet:1", "part-00001.parquet:2"}
    assert errs["part-00000.parquet:2"] == "missing: the image is null (column 'jpg', part-00000.parquet, row 2)"
    assert errs["part-00001.parquet:1"].startswith(("corrupt", "truncated"))
    assert errs["part-00001.parquet:2"].startswith(("corrupt", "not-an-image", "unknown"))


def test_null_values_are_holes_and_labels_as_integers(tmp_path):
    t = _img2dataset(range(N))
    t = t.set_column(t.schema.get_field_index("caption"), "caption",
                     pa.array([None if i == 4 else f"c{i}" for i in range(N)], pa.string()))
    t = t.set_column(t.schema.get_field_index("label"), "label",
                     pa.array([None if i == 5 else 100 + i for i in range(N)], pa.int64()))
    d = tmp_path / "nulls"
    d.mkdir()
    pq.write_table(t, str(d / "x.parquet"), row_group_size=5)
    dest = str(tmp_path / "s")
    r = mmstore.ingest(str(d / "x.parquet"), dest, size=16, workers=0, quiet=True, image_column="jpg",
                       caption_column="caption", label_column="label")
    assert r.skipped == 2
    with open(os.path.join(dest, "errors.jsonl"), encoding="utf-8") as fh:
        errs = {e["key"]: e["reason"] for e in map(json.loads, fh)}
    assert errs == {"x.parquet:4": "missing: column 'caption' is null (x.parquet, row 4)",
                    "x.parquet:5": "bad-label: the label is null (column 'label', x.parquet, row 5)"}
    s = mmstore.open(dest)
    assert s.manifest["label_names"] is None
    assert [int(s[k]["label"]) for k in range(len(s))] == [100 + i for i in range(N) if i not in (4, 5)]


def test_list_bool_and_path_columns(tmp_path, data):
    folder = data[2]
    t = pa.table({
        "file": [f"{i:03d}.jpg" for i in range(4)],  # paths relative to root
        "emb": pa.array([[0.5 * i] * i for i in range(4)], pa.list_(pa.float32())),
        "xy": pa.array([[i, i + 1] for i in range(4)], pa.list_(pa.int16(), 2)),
        "box": [0] * 4,
        "nsfw": [i % 2 == 1 for i in range(4)],
        "meta": pa.array([{"a": i} for i in range(4)]),
    })
    path = str(tmp_path / "p.parquet")
    pq.write_table(t, path)
    dest = str(tmp_path / "s")
    mmstore.ingest(path, dest, size=32, workers=0, quiet=True, image_column="file", root=folder,
                   columns=["emb", "xy", "nsfw"])
    s, ref = mmstore.open(dest), mmstore.open(data[3])
    assert s.schema["emb"].shape == (None,) and s.schema["emb"].dtype == np.dtype("<f4")
    assert s.schema["xy"].shape == (2,) and s.schema["xy"].dtype == np.dtype("<i2")
    assert s.schema["nsfw"].dtype == np.dtype("|u1")
    for i in range(4):
        assert np.array_equal(s[i]["image"], ref[i]["image"])
        assert s[i]["emb"].tolist() == [0.5 * i] * i and s[i]["xy"].tolist() == [i, i + 1]
        assert int(s[i]["nsfw"]) == i % 2
    with pytest.raises(SourceError, match="column 'meta' is of type struct.*leave it out of columns="):
        mmstore.ingest(path, str(tmp_path / "x"), size=32, quiet=True, image_column="file", root=folder,
                       columns=["meta"])
    with pytest.raises(SchemaError, match="'box' is a field the ingest stores itself"):
        mmstore.ingest(path, str(tmp_path / "x"), size=32, quiet=True, image_column="file", root=folder,
                       columns=["box"])


def test_resume_refuses_a_changed_file(tmp_path, data):
    i2d = data[0]
    d = str(tmp_path / "copy")
    os.makedirs(d)
    for f in os.listdir(i2d):
        with open(os.path.join(i2d, f), "rb") as src, open(os.path.join(d, f), "wb") as dst:
            dst.write(src.read())
    dest = str(tmp_path / "s")
    p = popen_cli(["ingest", os.path.join(d, "*.parquet"), dest, "--size", "16", "--image-column", "jpg",
                   "--workers", "0", "--chunk", "1", "-q"], env={"MMSTORE_CRASH_AT": "commit:2"})
    assert p.wait(120) == 77
    pq.write_table(_img2dataset(range(CUT, N - 1)), os.path.join(d, "part-00001.parquet"))
    with pytest.raises(ResumeMismatchError, match="input files changed|inputs"):
        mmstore.ingest(os.path.join(d, "*.parquet"), dest, size=16, workers=0, quiet=True, resume=True,
                       image_column="jpg")


def test_refusals_say_what_to_do(tmp_path, data, capsys):
    i2d = data[0]
    src = os.path.join(i2d, "*.parquet")
    odd = str(tmp_path / "odd.parquet")
    pq.write_table(pa.table({"pixels": pa.array(JPEGS[:2], pa.binary())}), odd)
    with pytest.raises(SourceError, match=r"which column holds the images\?.*image_column="):
        mmstore.ingest(odd, str(tmp_path / "x"), size=16, workers=0, quiet=True)
    with pytest.raises(SourceError, match=r"no column 'nope' \(columns\)"):
        mmstore.ingest(src, str(tmp_path / "x"), size=16, workers=0, quiet=True, image_column="jpg", columns="nope")
    with pytest.raises(SourceError, match=r"image column 'caption' is of type string|expected encoded bytes"):
        mmstore.ingest(src, str(tmp_path / "x"), size=16, workers=0, quiet=True, image_column="similarity")
    with pytest.raises(SourceError, match="matches no Parquet file"):
        mmstore.ingest(str(tmp_path / "none" / "*.parquet"), str(tmp_path / "x"), size=16, quiet=True)
    other = str(tmp_path / "other")
    os.makedirs(other)
    pq.write_table(_img2dataset(range(3)), os.path.join(other, "a.parquet"))
    pq.write_table(_img2dataset(range(3)).drop_columns(["caption"]), os.path.join(other, "b.parquet"))
    with pytest.raises(SourceError, match="column 'caption' is missing, but .* has it as string"):
        mmstore.ingest(os.path.join(other, "*.parquet"), str(tmp_path / "x"), size=16, quiet=True,
                       image_column="jpg", caption_column="caption")
    rc, _, err = run_cli(["ingest", src, str(tmp_path / "x"), "--size", "16", "--image-column", "jpg",
                          "--path-column", "x"], capsys)
    assert rc == 2 and "--path-column do(es) not apply" in err
    assert not os.path.exists(tmp_path / "x")


def test_no_pyarrow_is_a_typed_error_naming_the_extra(tmp_path, data):
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "import mmstore\n"
            "from mmstore.errors import MissingExtraError\n"
            "try:\n"
            f"    mmstore.ingest({os.path.join(data[0], '*.parquet')!r}, {str(tmp_path / 'x')!r}, size=16,"
            " image_column='jpg')\n"
            "except MissingExtraError as e:\n"
            "    print('MISSING', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert "MISSING reading Parquet files needs pyarrow: pip install 'mmstore[parquet]'" in out.stdout, out.stderr
    assert issubclass(MissingExtraError, ImportError)
