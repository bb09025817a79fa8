"""The DCT-scaled decode of jpeg records under a crop (NOTE [DCT-scaled decode] in mmstore/engine/crop.py):
on variants of a real photograph of 300-1,000 px stored as jpeg:90 of their own shape, the scaled path's
batches against the whole-decode path's (the same boxes): a median PSNR of at least 35 dB and no crop under
30 dB; the whole-decode path pixel-exact against an OpenCV reference; the scale chosen is the largest that
keeps the box at least the output, and simplejpeg decodes at exactly that scale (a property over sizes,
boxes and outputs, and real decodes of small JPEGs)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.engine.crop import DCT_DENOMS, CenterCrop, CropReader, RandomResizedCrop, crop_boxes, dct_scale, scaled_box

cv2 = pytest.importorskip("cv2")
simplejpeg = pytest.importorskip("simplejpeg")
cbook = pytest.importorskip("matplotlib.cbook")
pytest.importorskip("torch")

from mmstore.torch import Loader, LoaderTuning  # noqa: E402

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
N = 12


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Variants of a real photograph (a crop of 50-100 % of each side, long side 300-1,000 px), JPEG q95
    files ingested as jpeg:90 at their own shape (``max_side=1000`` keeps every one)."""
    root = tmp_path_factory.mktemp("dct")
    os.makedirs(root / "a")
    rng = np.random.default_rng(3)
    H, W = PHOTO.shape[:2]
    for k in range(N):
        h, w = int(H * rng.uniform(0.5, 1.0)), int(W * rng.uniform(0.5, 1.0))
        y, x = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
        side = int(rng.integers(300, 1001))
        s = side / max(h, w)
        img = cv2.resize(np.ascontiguousarray(PHOTO[y : y + h, x : x + w]), (round(w * s), round(h * s)),
                         interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_CUBIC)
        cv2.imwrite(str(root / "a" / f"{k:02d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    dest = str(tmp_path_factory.mktemp("s") / "jpeg")
    mmstore.ingest(str(root), dest, max_side=1000, codecs=["image=jpeg:90"], workers=0, quiet=True)
    return dest


def rows(path, crop, epochs=(0, 1, 2)):
    loader = Loader(path, 5, order=mmstore.order.OrderSpec("permutation", seed=21), crop=crop,
                    tuning=LoaderTuning(threads=2))
    out, recs = [], []
    for e in epochs:
        loader.set_epoch(e)
        out += [b["image"].numpy().copy() for b in loader]
        recs.append(loader.order.epoch(e))
    return loader, np.concatenate(out), recs


def psnr(a, b):
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(1)
    return 10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-12))


@pytest.mark.parametrize("make", [lambda **kw: RandomResizedCrop(224, flip=True, **kw),
                                  lambda **kw: RandomResizedCrop(112, scale=(0.3, 1.0), **kw),
                                  lambda **kw: CenterCrop(224, **kw)],
                         ids=["rrc224", "rrc112", "center224"])
def test_scaled_decode_against_whole_decode(store, make):
    fast, full = make(), make(dct_scale=False)
    lf, got, recs = rows(store, fast)
    lw, want, recs_w = rows(store, full)
    assert "jpeg DCT-scaled decode" in lf.describe()["crop"]["path"]
    assert lw.describe()["crop"]["path"].startswith("full jpeg decode")
    s = mmstore.open(store)
    hw = s.column("image_hw")
    scales = []
    for e, r in enumerate(recs):
        assert np.array_equal(r, recs_w[e])
        boxes = crop_boxes(fast, hw[r], 21, e, r)
        assert np.array_equal(boxes, crop_boxes(full, hw[r], 21, e, r))  # the same boxes and flips
        oh, ow = fast.size
        scales += [dct_scale(h, w, bh, bw, oh, ow) for (h, w), (_, _, bh, bw, _) in zip(hw[r].tolist(), boxes.tolist())]
    scales = np.array(scales)
    scaled = scales > 1
    assert scaled.sum() >= 5, np.unique(scales, return_counts=True)  # the scaled path ran, on several records
    p = psnr(got[scaled], want[scaled])
    assert np.median(p) >= 35 and p.min() >= 30, (np.median(p), p.min(), np.unique(scales, return_counts=True))
    assert np.array_equal(got[~scaled], want[~scaled])  # a record decoded whole is exactly the whole path's


def test_whole_decode_is_pixel_exact_against_opencv(store):
    crop = RandomResizedCrop(224, flip=True, dct_scale=False)
    loader, got, recs = rows(store, crop, epochs=(4,))
    s = mmstore.open(store)
    for j, i in enumerate(recs[0].tolist()):
        flat, _ = s.slot_view.backend.gather_entries("image", np.array([s.slot_view.slot(i)]))
        img = cv2.imdecode(flat, cv2.IMREAD_COLOR_RGB)
        t, le, ch, cw, fl = crop_boxes(crop, np.array([img.shape[:2]]), 21, 4, [i])[0].tolist()
        ref = cv2.resize(np.ascontiguousarray(img[t : t + ch, le : le + cw]), (224, 224),
                         interpolation=cv2.INTER_LINEAR if ch < 224 or cw < 224 else cv2.INTER_AREA)
        assert np.array_equal(got[j], ref[:, ::-1] if fl else ref), i


def test_scaled_decode_of_a_small_output_and_a_gray_store(store, tmp_path):
    s = mmstore.open(store)
    crop = CenterCrop(64)
    recs = np.arange(N)
    out = np.zeros((N, 64, 64, 3), np.uint8)
    CropReader(s, "image", crop, 0, 0).read(recs, out)
    ref = np.zeros_like(out)
    CropReader(s, "image", CenterCrop(64, dct_scale=False), 0, 0).read(recs, ref)
    assert np.median(psnr(out, ref)) >= 35
    # gray: one channel, decoded at the reduced scale too
    root = tmp_path / "g"
    os.makedirs(root / "a")
    cv2.imwrite(str(root / "a" / "0.png"), cv2.cvtColor(PHOTO, cv2.COLOR_BGR2GRAY))
    mmstore.ingest(str(root), str(tmp_path / "gs"), max_side=600, channels=1, codecs=["image=jpeg:90"], workers=0,
                   quiet=True)
    g = mmstore.open(str(tmp_path / "gs"))
    assert g.schema["image"].shape[2:] in ((1,), ())
    gout = np.zeros((1, 32, 32, *g.schema["image"].shape[2:]), np.uint8)
    gref = np.zeros_like(gout)
    CropReader(g, "image", CenterCrop(32), 0, 0).read(np.array([0]), gout)
    CropReader(g, "image", CenterCrop(32, dct_scale=False), 0, 0).read(np.array([0]), gref)
    assert dct_scale(*g[0]["image_hw"].tolist(), 525, 525, 32, 32) == 8  # 1/8: the scaled box 1.6x the output
    assert psnr(gout, gref)[0] >= 30


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 3000), st.data())
def test_the_scale_is_the_largest_that_keeps_the_box_at_least_the_output(h, w, data):
    bh, bw = data.draw(st.integers(1, h)), data.draw(st.integers(1, w))
    oh, ow = data.draw(st.integers(1, 600)), data.draw(st.integers(1, 600))
    top, left = data.draw(st.integers(0, h - bh)), data.draw(st.integers(0, w - bw))
    d = dct_scale(h, w, bh, bw, oh, ow)
    fits = [k for k in DCT_DENOMS if bh >= k * oh and bw >= k * ow]
    if max(h, w) >= 8:  # simplejpeg picks 1/d exactly: no smaller scale gives the same size
        assert d == (fits[0] if fits else 1)
    else:
        assert d in (*fits, 1) and (d == 1 or d == fits[0] or d < fits[0])
    if d > 1:
        assert bh >= d * oh and bw >= d * ow
        t0, l0, t1, l1 = scaled_box(top, left, bh, bw, d)
        assert 0 <= t0 and t1 <= -(-h // d) and 0 <= l0 and l1 <= -(-w // d)  # within the scaled image
        assert t1 - t0 >= oh and l1 - l0 >= ow  # still at least the output
        assert abs(t0 - top / d) <= 0.5 and abs(t1 - (top + bh) / d) <= 0.5  # each edge to the nearest


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from(DCT_DENOMS))
def test_simplejpeg_decodes_at_exactly_the_scale_asked(h, w, d):
    img = np.random.default_rng(h * 100 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    data = simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB", colorsubsampling="420")
    want = (-(-h // d), -(-w // d))
    got = simplejpeg.decode_jpeg(data, "RGB", min_height=want[0], min_width=want[1])
    assert got.shape[0] >= want[0] and got.shape[1] >= want[1]
    if max(h, w) >= 8:  # no smaller scale gives that size: simplejpeg takes 1/d itself
        assert got.shape[:2] == want
        assert dct_scale(h, w, h, w, max(1, h // d), max(1, w // d)) == d or min(h, w) < d
