"""An ingest whose every input failed is a failure, never an empty store; float
images (what ``ToTensor()`` gives) are stored as exact uint8, normalised ones
are refused with what was found."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.proc import run_sub

import mmstore
from mmstore.decode import DecodeSpec, fit_array, float_to_uint8
from mmstore.errors import AllInputsFailedError, DecodeError, IngestError, SchemaError
from mmstore.ingest import from_dataset, ingest, merge

cv2 = pytest.importorskip("cv2")


def _images(n: int, h: int = 12, w: int = 14, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]
    out[0][0, :3] = [[0, 0, 0], [255, 255, 255], [128, 127, 1]]  # the ends of the range in item 0
    return out


def _reference(x: np.ndarray) -> np.ndarray:
    """The documented conversion, in plain numpy: round(x * 255), ties to even, in float64."""
    return np.rint(x.astype(np.float64) * 255).astype(np.uint8)


class _Items:
    """A map-style dataset of ``(make(uint8 image), label)``."""

    def __init__(self, imgs, make, labels=True):
        self.imgs, self.make, self.labels = imgs, make, labels

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        x = self.make(self.imgs[i], i)
        return (x, i % 3) if self.labels else x


def _to_tensor(u, i=0):
    """What torchvision's ``ToTensor()`` does to an HWC uint8 image: CHW float32 / 255."""
    import torch

    return torch.from_numpy(u).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


# -- the conversion ------------------------------------------------------------------------------


def test_every_uint8_level_comes_back_from_its_float32_and_torch_division():
    torch = pytest.importorskip("torch")
    levels = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert np.array_equal(float_to_uint8(levels.astype(np.float32) / np.float32(255)), levels)
    assert np.array_equal(float_to_uint8(levels / 255.0), levels)  # float64
    assert np.array_equal(float_to_uint8(torch.from_numpy(levels).float().div(255).numpy()), levels)
    assert np.array_equal(float_to_uint8((levels.astype(np.float16) / np.float16(255)).astype(np.float16)), levels)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float16, np.float32, np.float64]), hnp.array_shapes(min_dims=2, max_dims=3),
                  elements=st.floats(0, 1, width=16)))
def test_float_to_uint8_is_the_documented_rounding(x):
    got = float_to_uint8(x)
    assert got.dtype == np.uint8 and got.shape == x.shape and got.flags.c_contiguous
    assert np.array_equal(got, _reference(x))
    assert np.all(np.abs(got - x.astype(np.float64) * 255) <= 0.5)


def test_ties_round_to_even_and_the_ends_are_exact():
    x = np.array([[0.0, 1.0, 0.5, np.nextafter(np.float32(0), np.float32(1)), np.nextafter(np.float32(1), 0)]],
                 np.float32)
    assert float_to_uint8(x).tolist() == [[0, 255, 128, 0, 255]]  # 127.5 -> 128 (even)


@pytest.mark.parametrize("bad, found", [
    (np.array([[-0.5, 0.25]], np.float32), "min -0.5, max 0.25"),
    (np.array([[0.0, 1.5]], np.float64), "min 0, max 1.5"),
    (np.array([[0.0, 200.0]], np.float32), "min 0, max 200"),
    (np.array([[0.0, np.nan]], np.float32), "1 NaN or infinite value(s), finite min 0, max 0"),
])
def test_floats_outside_0_1_are_refused_with_what_was_found(bad, found):
    with pytest.raises(DecodeError) as ei:
        float_to_uint8(bad)
    msg = ei.value.reason
    assert msg.startswith(f"unsupported: {bad.dtype} pixels outside [0, 1] ({found})"), msg
    assert ("Normalize" in msg) == (found.startswith("min -")), msg
    assert ("divide by 255" in msg) == ("200" in found), msg


def test_fit_array_converts_float_before_the_resize():
    u = _images(1, 40, 30)[0]
    x = u.astype(np.float32) / np.float32(255)
    spec = DecodeSpec((16, 16))
    assert np.array_equal(fit_array(x, spec).image, fit_array(u, spec).image)


# -- from_dataset over floats ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_from_dataset_stores_to_tensor_images_pixel_exactly(tmp_path, workers):
    pytest.importorskip("torch")
    imgs = _images(5)
    dest = str(tmp_path / "s")
    res = from_dataset(_Items(imgs, _to_tensor), dest, (12, 14), resize="none", workers=workers, quiet=True)
    assert (res.records, res.skipped) == (5, 0)
    with mmstore.open(dest) as s:
        assert s.schema["image"].dtype == np.uint8 and s.schema["image"].shape == (12, 14, 3)
        for i, u in enumerate(imgs):
            assert np.array_equal(s[i]["image"], u), i
            assert int(s[i]["label"]) == i % 3


@pytest.mark.parametrize("make", [
    pytest.param(lambda u, i: u.astype(np.float64) / 255, id="numpy-hwc-float64"),
    pytest.param(lambda u, i: np.ascontiguousarray(u.transpose(2, 0, 1)).astype(np.float32) / np.float32(255),
                 id="numpy-chw-float32"),
    pytest.param(lambda u, i: np.random.default_rng(i).random(u.shape, np.float32), id="numpy-any-float"),
])
def test_from_dataset_float_arrays_hwc_and_chw_resized(tmp_path, make):
    imgs = _images(4, 30, 22)
    dest = str(tmp_path / "s")
    spec = DecodeSpec((16, 16))
    from_dataset(_Items(imgs, make, labels=False), dest, (16, 16), workers=0, quiet=True)
    with mmstore.open(dest) as s:
        assert len(s) == 4
        for i, u in enumerate(imgs):
            x = make(u, i)
            hwc = x.transpose(1, 2, 0) if x.shape[0] == 3 else x
            want = fit_array(_reference(hwc), spec)  # the documented conversion, then the uint8 rules
            got = s[i]
            assert np.array_equal(got["image"], want.image), i
            assert got["orig_size"].tolist() == [30, 22] and got["box"].tolist() == list(want.box)


def test_normalized_floats_are_refused_before_anything_is_created(tmp_path):
    pytest.importorskip("torch")
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)

    def normalized(u, i):
        return (_to_tensor(u) - _t(mean)) / _t(std)

    dest = str(tmp_path / "s")
    with pytest.raises(SchemaError) as ei:
        from_dataset(_Items(_images(3), normalized), dest, (12, 14), workers=0, quiet=True)
    msg = str(ei.value)
    x = normalized(_images(3)[0], 0).numpy()
    assert f"item 0: unsupported: float32 pixels outside [0, 1] (min {x.min():.6g}, max {x.max():.6g})" in msg
    assert "Normalize" in msg and "nothing was created" in msg
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")


def _t(a):
    import torch

    return torch.from_numpy(a)[:, None, None]


def test_a_later_normalized_item_is_a_hole_with_what_was_found(tmp_path):
    imgs = _images(4)

    def make(u, i):
        x = u.astype(np.float32) / np.float32(255)
        return (x - 0.5) / 0.25 if i == 2 else x

    dest = str(tmp_path / "s")
    res = from_dataset(_Items(imgs, make), dest, (12, 14), resize="none", workers=0, quiet=True)
    assert (res.records, res.skipped) == (3, 1)
    with mmstore.open(dest) as s:
        (hole,) = s.skipped()
        x = make(imgs[2], 2)
        assert hole["key"] == "2"
        assert hole["reason"].startswith(f"unsupported: float32 pixels outside [0, 1] (min {x.min():.6g}, "
                                         f"max {x.max():.6g})")
        assert [np.array_equal(s[i]["image"], imgs[j]) for i, j in enumerate((0, 1, 3))] == [True] * 3


def test_from_dataset_whose_every_item_fails_raises(tmp_path):
    dest = str(tmp_path / "s")
    ds = _Items(_images(3), lambda u, i: u.reshape(-1))  # 1-D: not an image
    with pytest.raises(AllInputsFailedError) as ei:
        from_dataset(ds, dest, (12, 14), workers=0, quiet=True)
    e = ei.value
    assert isinstance(e, IngestError)
    assert "all 3 inputs failed; most common reason: wrong-shape (3 of 3), e.g. input '0': wrong-shape" in str(e)
    assert (e.failed, e.key, sum(e.reasons.values())) == (3, "0", 3)
    assert not os.path.exists(dest)
    with open(e.errors_path) as fh:
        assert [json.loads(ln)["key"] for ln in fh] == ["0", "1", "2"]
    assert e.errors_path == os.path.join(dest + ".partial", "errors.jsonl") and e.errors_path in str(e)


# -- folders of broken files ----------------------------------------------------------------------


def _corrupt_jpegs(root: str, h, good: int = 0) -> list[str]:
    """Real JPEGs made unreadable three ways (truncated, header cut, garbage scan); ``good`` intact ones."""
    os.makedirs(root)
    rng = np.random.default_rng(7)
    names = []
    for k in range(3):
        data = h.write_image(os.path.join(root, f"bad{k}.jpg"), h.photo(rng, 40, 48))
        sos = data.find(b"\xff\xda")
        broken = (data[: len(data) // 2], data[:sos - 40], data[: sos + 20] + b"\xff\xd9")[k]
        with open(os.path.join(root, f"bad{k}.jpg"), "wb") as fh:
            fh.write(broken)
        names.append(f"bad{k}.jpg")
    for k in range(good):
        h.write_image(os.path.join(root, f"good{k}.jpg"), h.photo(rng, 40, 48))
    return names


def test_cli_exits_1_when_every_file_of_a_folder_is_corrupt(tmp_path, h):
    src, dest = str(tmp_path / "bad"), str(tmp_path / "out.store")
    _corrupt_jpegs(src, h)
    p = run_sub(["ingest", src, dest, "--size", "16x16", "--workers", "2"])
    assert p.returncode == 1, (p.returncode, p.stderr)
    err = p.stderr.strip().splitlines()[-1]
    assert err.startswith(f"mmstore ingest: {dest}: no input became a record: all 3 inputs failed; most common "
                          "reason: "), err
    assert "e.g. input 'bad" in err and f"{dest}.partial/errors.jsonl" in err and "--overwrite" in err
    assert not os.path.exists(dest)  # no store of 0 records that looks complete
    with open(os.path.join(dest + ".partial", "errors.jsonl")) as fh:
        assert sorted(json.loads(ln)["key"] for ln in fh) == ["bad0.jpg", "bad1.jpg", "bad2.jpg"]
    # a resume finds the same failures again, quickly, and still publishes nothing
    p = run_sub(["ingest", src, dest, "--size", "16x16", "--resume"])
    assert p.returncode == 1 and "all 3 inputs failed" in p.stderr and not os.path.exists(dest)
    # the Python call raises the same error
    with pytest.raises(AllInputsFailedError) as ei:
        ingest(src, dest, (16, 16), workers=0, quiet=True, overwrite=True)
    assert ei.value.failed == 3 and ei.value.key in ("bad0.jpg", "bad1.jpg", "bad2.jpg")
    # an empty folder is an input error (exit 2), as it was refused before: nothing is created
    os.makedirs(str(tmp_path / "empty"))
    p = run_sub(["ingest", str(tmp_path / "empty"), str(tmp_path / "e.store"), "--size", "16x16"])
    assert p.returncode == 2 and "no inputs found (empty source); nothing was created" in p.stderr
    assert not os.path.exists(str(tmp_path / "e.store")) and not os.path.exists(str(tmp_path / "e.store.partial"))


def test_overwrite_run_that_fails_entirely_keeps_the_old_store(tmp_path, h):
    good, bad, dest = str(tmp_path / "good"), str(tmp_path / "bad"), str(tmp_path / "out.store")
    h.make_folder(good, classes=("",), per_class=3)
    ingest(good, dest, (16, 16), workers=0, quiet=True)
    before = h.store_files(dest)
    _corrupt_jpegs(bad, h)
    p = run_sub(["ingest", bad, dest, "--size", "16x16", "--overwrite", "--workers", "0"])
    assert p.returncode == 1, p.stderr
    assert f"{dest} (the store there before) is unchanged" in p.stderr
    assert h.store_files(dest) == before
    with mmstore.open(dest) as s:
        assert len(s) == 3


def test_one_good_image_among_corrupt_ones_succeeds(tmp_path, h):
    src, dest = str(tmp_path / "src"), str(tmp_path / "out.store")
    _corrupt_jpegs(src, h, good=1)
    p = run_sub(["ingest", src, dest, "--size", "16x16"])
    assert p.returncode == 0, p.stderr
    with mmstore.open(dest) as s:
        assert (len(s), s.slots) == (1, 4) and s.key(0) == "good0.jpg"


def test_npy_of_float_images_in_0_1_is_stored_exactly(tmp_path):
    imgs = np.stack(_images(3))
    path = str(tmp_path / "x.npy")
    np.save(path, imgs.astype(np.float32) / np.float32(255))
    dest = str(tmp_path / "s")
    p = run_sub(["ingest", path, dest, "--size", "12x14", "--resize", "none", "-q"])
    assert p.returncode == 0, p.stderr
    with mmstore.open(dest) as s:
        assert len(s) == 3 and all(np.array_equal(s[i]["image"], imgs[i]) for i in range(3))


def test_a_shard_of_failures_is_published_and_the_merge_of_only_failures_raises(tmp_path, h):
    src = str(tmp_path / "bad")
    _corrupt_jpegs(src, h)
    parts = [str(tmp_path / f"p{k}") for k in range(2)]
    for k, part in enumerate(parts):
        res = ingest(src, part, (16, 16), shard=(k, 2), workers=0, quiet=True)
        assert res.records == 0 and res.slots == len(range(3)[k * 3 // 2:(k + 1) * 3 // 2])
        assert any("every one of this shard's" in w for w in res.warnings), res.warnings
    merged = str(tmp_path / "merged")
    with pytest.raises(AllInputsFailedError) as ei:
        merge(parts, merged)
    assert "all 3 inputs failed" in str(ei.value) and "Nothing was created" in str(ei.value)
    assert not os.path.exists(merged) and not os.path.exists(merged + ".partial")
    p = run_sub(["merge", *parts, merged])
    assert p.returncode == 1 and "no input became a record" in p.stderr, p.stderr


def test_the_error_is_one_line_naming_the_reasons(tmp_path, h):
    """Several reasons: the most common is named with its count, the others after it."""
    src = str(tmp_path / "mixed")
    _corrupt_jpegs(src, h)
    for k in range(3):
        with open(os.path.join(src, f"page{k}.jpg"), "wb") as fh:
            fh.write(b"<html>404</html>")
    p = run_sub(["ingest", src, str(tmp_path / "o"), "--size", "16x16"], stdin=subprocess.DEVNULL)
    assert p.returncode == 1
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("mmstore ingest:")]
    assert "all 6 inputs failed; most common reason: not-an-image (3 of 6), e.g. input 'page0.jpg'" in line, line
    assert "; other reasons: " in line
