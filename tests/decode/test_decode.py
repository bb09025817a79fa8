"""Tests for mmstore.decode: pixel-exact records, policies, bad input.

Expected records are rebuilt here with plain cv2/numpy calls following the
rules written in mmstore/decode/__init__.py's module docstring, and compared byte for
byte.  Test images are generated in memory or in tmp_path (Pillow is a test
dependency only).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from fractions import Fraction

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.images import encode
from support.images import marked_photo as photo

from mmstore.decode import Decoded, DecodeError, DecodeSpec, decode_image, fit_array, read_bytes, sniff_image

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageOps  # noqa: E402

# --------------------------------------------------------------------------
# helpers


def pil_bytes(img, fmt: str, **kw) -> bytes:
    if isinstance(img, np.ndarray):
        img = Image.fromarray(img)
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def cv_bytes(img_rgb: np.ndarray, ext: str, params=()) -> bytes:
    return encode(img_rgb, ext, params, rgb=True)


def npb(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


def rhu(fr: Fraction) -> int:
    """Round half up."""
    return int(fr + Fraction(1, 2)) if fr >= 0 else -int(-fr + Fraction(1, 2))


def ref_geometry(h, w, th, tw, policy):
    """Documented geometry, written independently with Fractions."""
    if policy in ("stretch", "none"):
        return (0, 0, w, h), (th, tw), (0, 0, tw, th)
    if policy == "center-crop":
        if Fraction(w, h) >= Fraction(tw, th):
            ch, cw = h, min(w, max(1, rhu(Fraction(h * tw, th))))
        else:
            cw, ch = w, min(h, max(1, rhu(Fraction(w * th, tw))))
        x0, y0 = (w - cw) // 2, (h - ch) // 2
        return (x0, y0, x0 + cw, y0 + ch), (th, tw), (0, 0, tw, th)
    if Fraction(w, h) >= Fraction(tw, th):
        nw, nh = tw, min(th, max(1, rhu(Fraction(h * tw, w))))
    else:
        nh, nw = th, min(tw, max(1, rhu(Fraction(w * th, h))))
    ox, oy = (tw - nw) // 2, (th - nh) // 2
    return (0, 0, w, h), (nh, nw), (ox, oy, ox + nw, oy + nh)


def ref_record(S: np.ndarray, order: str, spec: DecodeSpec):
    """Expected record from a source S (HxW gray or HxWx3 in `order`)."""
    if spec.channels == 1 and S.ndim == 3:
        S = cv2.cvtColor(S, cv2.COLOR_BGR2GRAY if order == "bgr" else cv2.COLOR_RGB2GRAY)
    h, w = S.shape[:2]
    th, tw = spec.size
    box, (nh, nw), dst = ref_geometry(h, w, th, tw, spec.resize)
    x0, y0, x1, y1 = box
    crop = S[y0:y1, x0:x1]
    if crop.shape[:2] != (nh, nw):
        if nh <= crop.shape[0] and nw <= crop.shape[1]:
            interp = cv2.INTER_AREA
        else:
            interp = cv2.INTER_CUBIC if spec.interp_up == "cubic" else cv2.INTER_LINEAR
        out = cv2.resize(crop, (nw, nh), interpolation=interp)
    else:
        out = crop.copy()
    if spec.resize == "pad":
        canvas = np.full((th, tw) + out.shape[2:], spec.pad_value, np.uint8)
        canvas[dst[1] : dst[3], dst[0] : dst[2]] = out
        out = canvas
    if spec.channels == 3:
        if out.ndim == 2:
            out = np.repeat(out[..., None], 3, axis=2)
        elif order != ("bgr" if spec.bgr else "rgb"):
            out = out[..., ::-1]
    elif out.ndim == 2:
        out = out[..., None]
    if spec.layout == "chw":
        out = out.transpose(2, 0, 1)
    return np.ascontiguousarray(out), (h, w), box, dst


def check_exact(got: Decoded, S, order, spec):
    exp, orig, box, dst = ref_record(S, order, spec)
    assert got.image.dtype == np.uint8
    assert got.image.shape == spec.record_shape()
    assert got.image.flags.c_contiguous
    assert got.orig_size == orig
    assert got.box == box
    assert got.dst == dst
    assert np.array_equal(got.image, exp)


def ref_jpeg_source(data: bytes, spec: DecodeSpec):
    """How the documented JPEG rules get S with plain cv2 flags."""
    if spec.channels == 1:
        return cv2.imdecode(npb(data), cv2.IMREAD_GRAYSCALE), "gray"
    if spec.bgr:
        return cv2.imdecode(npb(data), cv2.IMREAD_COLOR_BGR), "bgr"
    return cv2.imdecode(npb(data), cv2.IMREAD_COLOR_RGB), "rgb"


def composite(rgb: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Documented alpha rule: (c*a + 127) // 255."""
    return ((rgb.astype(np.int64) * a[..., None].astype(np.int64) + 127) // 255).astype(np.uint8)


def reason_of(fn, *a, **kw) -> str:
    with pytest.raises(DecodeError) as ei:
        fn(*a, **kw)
    r = ei.value.reason
    assert str(ei.value) == r
    assert isinstance(ei.value, ValueError)
    return r


CATEGORIES = {
    "empty", "not-an-image", "truncated", "corrupt", "too-large", "unreadable", "wrong-shape", "unsupported",
}


def category(r: str) -> str:
    c = r.split(":", 1)[0]
    assert c in CATEGORIES, r
    return c


SRC = photo(150, 230, seed=1)
JPEG = cv_bytes(SRC, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 92])
PNG = cv_bytes(SRC, ".png")

# --------------------------------------------------------------------------
# module hygiene and DecodeSpec


def test_import_does_not_load_cv2_or_torch():
    code = "import sys, mmstore.decode; print('cv2' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ).stdout.split()
    assert out == ["False", "False"]


def test_all_sorted_and_public():
    import mmstore.decode as m

    assert m.__all__ == sorted(m.__all__)
    for name in m.__all__:
        assert getattr(m, name).__doc__


def test_spec_record_shape_and_roundtrip():
    s = DecodeSpec((32, 48), resize="pad", channels=1, layout="chw", pad_value=9, fast_decode=True)
    assert s.record_shape() == (1, 32, 48)
    assert DecodeSpec((32, 48)).record_shape() == (32, 48, 3)
    assert DecodeSpec((32, 48), channels=1).record_shape() == (32, 48, 1)
    d = json.loads(json.dumps(s.to_dict()))
    assert DecodeSpec.from_dict(d) == s
    assert DecodeSpec([5, 6]).size == (5, 6)
    with pytest.raises(ValueError, match="unknown"):
        DecodeSpec.from_dict({**d, "sise": [1, 2]})


@pytest.mark.parametrize(
    "kw",
    [
        {"size": (0, 5)}, {"size": (5,)}, {"size": None}, {"size": (5, 5.0)},
        {"size": (5, 5), "resize": "crop"}, {"size": (5, 5), "channels": 4},
        {"size": (5, 5), "layout": "nhwc"}, {"size": (5, 5), "interp_up": "nearest"},
        {"size": (5, 5), "pad_value": 256}, {"size": (5, 5), "max_pixels": -1},
        {"size": (5, 5), "bgr": 1},
    ],
)
def test_spec_validation(kw):
    with pytest.raises(ValueError):
        DecodeSpec(**kw)


# --------------------------------------------------------------------------
# sniffing


def test_sniff_formats():
    rgb = photo(20, 30)
    rgba = np.dstack([rgb, np.full(rgb.shape[:2], 200, np.uint8)])
    cases = {
        "jpeg": JPEG, "png": PNG, "gif": pil_bytes(rgb, "GIF"), "bmp": cv_bytes(rgb, ".bmp"),
        "webp": cv_bytes(rgb, ".webp"), "tiff": cv_bytes(rgb, ".tiff"), "pnm": cv_bytes(rgb, ".ppm"),
        "jp2": cv_bytes(photo(64, 64), ".jp2"), "sunras": cv_bytes(rgb, ".ras"),
        "hdr": cv_bytes(rgb.astype(np.float32) / 255, ".hdr"),
        "pfm": cv_bytes(rgb.astype(np.float32) / 255, ".pfm"),
        "exr": b"\x76\x2f\x31\x01" + bytes(28),
        "heic": b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic",
        "psd": b"8BPS\x00\x01" + bytes(26),
    }
    cases["tiff_be"] = pil_bytes(rgb, "TIFF")  # may be II or MM
    try:
        cases["avif"] = pil_bytes(rgba, "AVIF")
    except (KeyError, OSError, ValueError):
        pass
    for want, data in cases.items():
        assert sniff_image(data[:32]) == want.split("_")[0], want
    assert sniff_image(cv_bytes(rgb[..., 0], ".pgm")) == "pnm"
    junks = (b"", b"<!DOCTYPE html><html>", b"hello world", b"BM not a bitmap header", b"P9 x", bytes(64))
    for junk in junks:
        assert sniff_image(junk) is None
    assert sniff_image(npb(PNG)) == "png"  # ndarray input


# --------------------------------------------------------------------------
# pixel-exact records: every policy x layout x channels x bgr


POLICIES = ["center-crop", "stretch", "pad"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", ["hwc", "chw"])
@pytest.mark.parametrize("channels,bgr", [(3, False), (3, True), (1, False)])
@pytest.mark.parametrize("size", [(64, 64), (200, 120)])  # shrink / enlarge
def test_exact_jpeg_png_array(policy, layout, channels, bgr, size):
    spec = DecodeSpec(size, resize=policy, channels=channels, layout=layout, bgr=bgr, pad_value=17)
    S, order = ref_jpeg_source(JPEG, spec)
    check_exact(decode_image(JPEG, spec), S, order, spec)
    # non-JPEG path: IMREAD_UNCHANGED gives BGR
    check_exact(decode_image(PNG, spec), cv2.imdecode(npb(PNG), cv2.IMREAD_UNCHANGED), "bgr", spec)
    # already-decoded arrays are RGB
    check_exact(fit_array(SRC, spec), SRC, "rgb", spec)


@pytest.mark.parametrize("interp_up", ["linear", "cubic"])
def test_interp_up_and_mixed_case(interp_up):
    # 150x230 -> 300x100: width shrinks, height grows (mixed) -> interp_up
    spec = DecodeSpec((300, 100), resize="stretch", interp_up=interp_up)
    got = fit_array(SRC, spec)
    flag = cv2.INTER_CUBIC if interp_up == "cubic" else cv2.INTER_LINEAR
    assert np.array_equal(got.image, cv2.resize(SRC, (100, 300), interpolation=flag))
    up = fit_array(SRC, DecodeSpec((300, 460), resize="stretch", interp_up=interp_up))
    assert np.array_equal(up.image, cv2.resize(SRC, (460, 300), interpolation=flag))
    down = fit_array(SRC, DecodeSpec((75, 115), resize="stretch", interp_up=interp_up))
    assert np.array_equal(down.image, cv2.resize(SRC, (115, 75), interpolation=cv2.INTER_AREA))


def test_center_crop_is_one_resize_of_an_integer_crop():
    got = fit_array(SRC, DecodeSpec((100, 100)))  # 150x230 source, target square
    # crop 150x150 at x0 = 40, one INTER_AREA resize
    assert got.box == (40, 0, 190, 150)
    assert np.array_equal(got.image, cv2.resize(SRC[:, 40:190], (100, 100), interpolation=cv2.INTER_AREA))


def test_pad_letterbox_values_and_dst():
    got = fit_array(SRC, DecodeSpec((100, 100), resize="pad", pad_value=200))
    assert got.box == (0, 0, 230, 150)
    assert got.dst == (0, 17, 100, 82)  # nh = round(150*100/230) = 65, oy = 17
    assert (got.image[:17] == 200).all() and (got.image[82:] == 200).all()
    inner = cv2.resize(SRC, (100, 65), interpolation=cv2.INTER_AREA)
    assert np.array_equal(got.image[17:82], inner)


def test_none_policy_and_wrong_shape():
    spec = DecodeSpec((150, 230), resize="none")
    got = decode_image(PNG, spec)
    assert np.array_equal(got.image, SRC) and got.box == (0, 0, 230, 150)
    r = reason_of(decode_image, PNG, DecodeSpec((224, 224), resize="none"))
    assert r == "wrong-shape: expected WxH 224x224, found 230x150"
    r = reason_of(fit_array, SRC, DecodeSpec((150, 229), resize="none"))
    assert category(r) == "wrong-shape"


def test_fit_array_does_not_alias_and_accepts_views():
    src = SRC.copy()
    got = fit_array(src, DecodeSpec((150, 230), resize="none"))
    got.image[:] = 0
    assert np.array_equal(src, SRC)
    view = SRC[10:110:1, 20:220]  # non-contiguous view
    g2 = fit_array(view, DecodeSpec((100, 200), resize="none"))
    assert np.array_equal(g2.image, view) and g2.image.base is None
    g3 = fit_array(SRC[..., 0], DecodeSpec((150, 230), resize="none", channels=1, layout="chw"))
    assert g3.image.shape == (1, 150, 230) and not np.shares_memory(g3.image, SRC)
    # crop without resize must not keep a view of the big source alive
    g4 = fit_array(SRC, DecodeSpec((150, 150)))
    assert not np.shares_memory(g4.image, SRC)


def test_fit_array_inputs():
    assert reason_of(fit_array, np.zeros((4, 4, 5), np.uint8), DecodeSpec((2, 2))).startswith("wrong-shape")
    assert reason_of(fit_array, np.full((4, 4), -1.0, np.float32), DecodeSpec((2, 2))).startswith("unsupported")
    assert reason_of(fit_array, np.zeros((0, 4), np.uint8), DecodeSpec((2, 2))).startswith("empty")
    a16 = (np.arange(12 * 10 * 3, dtype=np.uint16).reshape(12, 10, 3) * 181)
    got = fit_array(a16, DecodeSpec((12, 10), resize="none"))
    assert np.array_equal(got.image, (a16 >> 8).astype(np.uint8))
    g1 = fit_array(SRC[..., :1], DecodeSpec((150, 230), resize="none", channels=3))
    assert np.array_equal(g1.image, np.repeat(SRC[..., :1], 3, axis=2))


# hypothesis: random source and target sizes, exactness and invariants

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.integers(1, 700), w=st.integers(1, 700), th=st.integers(1, 300), tw=st.integers(1, 300),
    policy=st.sampled_from(POLICIES), channels=st.sampled_from([1, 3]),
    layout=st.sampled_from(["hwc", "chw"]), bgr=st.booleans(), cubic=st.booleans(),
)
def test_hypothesis_fit_array(h, w, th, tw, policy, channels, layout, bgr, cubic):
    src = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    spec = DecodeSpec((th, tw), resize=policy, channels=channels, layout=layout, bgr=bgr,
                      interp_up="cubic" if cubic else "linear", pad_value=3)
    got = fit_array(src, spec)
    x0, y0, x1, y1 = got.box
    assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
    dx0, dy0, dx1, dy1 = got.dst
    assert 0 <= dx0 < dx1 <= tw and 0 <= dy0 < dy1 <= th
    if policy == "center-crop":
        # crop aspect equals target aspect to within one source pixel
        assert (x1 - x0 == w) or (y1 - y0 == h)
        assert abs((x1 - x0) * th - (y1 - y0) * tw) <= max(th, tw)
    if policy == "pad":
        assert (dx1 - dx0 == tw) or (dy1 - dy0 == th)
    check_exact(got, src, "rgb", spec)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 400), w=st.integers(1, 400), th=st.integers(1, 120), tw=st.integers(1, 120),
       policy=st.sampled_from(POLICIES), channels=st.sampled_from([1, 3]))
def test_hypothesis_decode_png_and_jpeg(h, w, th, tw, policy, channels):
    src = photo(h, w, seed=h + w)
    spec = DecodeSpec((th, tw), resize=policy, channels=channels)
    png = cv_bytes(src, ".png")
    check_exact(decode_image(png, spec), cv2.imdecode(npb(png), cv2.IMREAD_UNCHANGED), "bgr", spec)
    jpg = cv_bytes(src, ".jpg")
    S, order = ref_jpeg_source(jpg, spec)
    check_exact(decode_image(jpg, spec), S, order, spec)


# --------------------------------------------------------------------------
# EXIF orientation


ORIENT_SRC = photo(40, 64, seed=3)  # not square, marker in one corner


def with_orientation(fmt: str, o: int) -> bytes:
    im = Image.fromarray(ORIENT_SRC)
    if fmt == "TIFF":
        return pil_bytes(im, "TIFF", tiffinfo={274: o})
    ex = Image.Exif()
    ex[0x0112] = o
    kw = {"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}
    return pil_bytes(im, fmt, exif=ex.tobytes(), **kw)


def test_opencv_orientation_behaviour_we_rely_on():
    d = npb(with_orientation("JPEG", 6))
    assert cv2.imdecode(d, cv2.IMREAD_COLOR_RGB).shape[:2] == (64, 40)  # applied
    assert cv2.imdecode(d, cv2.IMREAD_GRAYSCALE).shape[:2] == (64, 40)
    assert cv2.imdecode(d, cv2.IMREAD_REDUCED_COLOR_2).shape[:2] == (32, 20)  # applied, ceil
    assert cv2.imdecode(d, cv2.IMREAD_UNCHANGED).shape[:2] == (40, 64)  # NOT applied
    p = npb(with_orientation("PNG", 6))
    assert cv2.imdecode(p, cv2.IMREAD_UNCHANGED).shape[:2] == (40, 64)  # NOT applied


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
def test_all_eight_orientations_match_pillow(fmt):
    for o in range(1, 9):
        data = with_orientation(fmt, o)
        ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
        h, w = ref.shape[:2]
        assert (h, w) == ((40, 64) if o < 5 else (64, 40))
        got = decode_image(data, DecodeSpec((h, w), resize="none"))
        assert got.orig_size == (h, w)
        diff = np.abs(got.image.astype(int) - ref.astype(int))
        if fmt == "JPEG":  # same libjpeg-turbo family; allow decoder rounding
            assert diff.max() <= 3, (fmt, o)
        else:
            assert diff.max() == 0, (fmt, o)
        # the geometry is computed on the oriented image
        g2 = decode_image(data, DecodeSpec((16, 16)))
        assert g2.orig_size == (h, w)


# --------------------------------------------------------------------------
# sample types: gray, palette, 16-bit, alpha, CMYK, first frame / page


def test_gray_png_1_and_3_channels():
    g = SRC[..., 1].copy()
    data = pil_bytes(g, "PNG")
    one = decode_image(data, DecodeSpec((150, 230), resize="none", channels=1))
    assert np.array_equal(one.image[..., 0], g)
    three = decode_image(data, DecodeSpec((150, 230), resize="none", channels=3, layout="chw"))
    assert np.array_equal(three.image, np.stack([g, g, g]))
    # resized gray stays 1-channel through the resize, then is replicated
    spec = DecodeSpec((60, 60), channels=3)
    check_exact(decode_image(data, spec), g, "gray", spec)


def test_gray_jpeg_decodes_as_gray():
    g = SRC[..., 1].copy()
    data = cv_bytes(g, ".jpg")
    spec = DecodeSpec((70, 90), channels=3, bgr=True)
    check_exact(decode_image(data, spec), cv2.imdecode(npb(data), cv2.IMREAD_GRAYSCALE), "gray", spec)


def test_palette_png_with_and_without_transparency():
    p = Image.fromarray(SRC).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    data = pil_bytes(p, "PNG")
    got = decode_image(data, DecodeSpec((150, 230), resize="none"))
    assert np.array_equal(got.image, np.asarray(p.convert("RGB")))
    data_t = pil_bytes(p, "PNG", transparency=5)
    rgba = np.asarray(Image.open(io.BytesIO(data_t)).convert("RGBA"))
    assert (rgba[..., 3] == 0).any()
    got = decode_image(data_t, DecodeSpec((150, 230), resize="none"))
    assert np.array_equal(got.image, composite(rgba[..., :3], rgba[..., 3]))


def test_16bit_png_is_high_byte_exactly():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 65536, (33, 47, 3), dtype=np.uint16)
    ok, data = cv2.imencode(".png", a)  # BGR order on disk
    got = decode_image(data.tobytes(), DecodeSpec((33, 47), resize="none", bgr=True))
    assert np.array_equal(got.image, (a >> 8).astype(np.uint8))
    g = rng.integers(0, 65536, (33, 47), dtype=np.uint16)
    ok, data = cv2.imencode(".png", g)
    got = decode_image(data, DecodeSpec((33, 47), resize="none", channels=1))
    assert np.array_equal(got.image[..., 0], (g >> 8).astype(np.uint8))
    # 16-bit TIFF too
    ok, data = cv2.imencode(".tiff", g)
    got = decode_image(data, DecodeSpec((33, 47), resize="none", channels=1))
    assert np.array_equal(got.image[..., 0], (g >> 8).astype(np.uint8))
    # 16-bit RGBA: >> 8 first, then composite
    a4 = rng.integers(0, 65536, (20, 30, 4), dtype=np.uint16)
    ok, data = cv2.imencode(".png", a4)
    got = decode_image(data, DecodeSpec((20, 30), resize="none", bgr=True))
    a8 = (a4 >> 8).astype(np.uint8)
    assert np.array_equal(got.image, composite(a8[..., :3], a8[..., 3]))


def test_alpha_composited_over_black_exactly():
    # every (c, a) pair once: 256 x 256 image, c along x, a along y
    c = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    a = c.T.copy()
    rgba = np.dstack([c, 255 - c, c // 2, a])
    exp = composite(rgba[..., :3], a)
    assert np.array_equal(exp[..., 0], np.round(c.astype(np.float64) * a / 255).astype(np.uint8))
    assert np.array_equal(fit_array(rgba, DecodeSpec((256, 256), resize="none")).image, exp)
    png = pil_bytes(Image.fromarray(rgba, "RGBA"), "PNG")
    assert np.array_equal(decode_image(png, DecodeSpec((256, 256), resize="none")).image, exp)
    # lossless WebP may rewrite colours under alpha=0: those pixels are 0 anyway
    webp = pil_bytes(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True)
    ref = np.asarray(Image.open(io.BytesIO(webp)).convert("RGBA"))
    got = decode_image(webp, DecodeSpec((256, 256), resize="none")).image
    assert np.array_equal(got, composite(ref[..., :3], ref[..., 3]))
    assert (got[a == 0] == 0).all()
    # gray + alpha (LA)
    la = np.dstack([c, a])
    exp_la = composite(c[..., None], a)[..., 0]
    got_la = fit_array(la, DecodeSpec((256, 256), resize="none", channels=1))
    assert np.array_equal(got_la.image[..., 0], exp_la)
    png_la = pil_bytes(Image.fromarray(la, "LA"), "PNG")
    got_la = decode_image(png_la, DecodeSpec((256, 256), resize="none", channels=3))
    assert np.array_equal(got_la.image, np.repeat(exp_la[..., None], 3, axis=2))


def test_cmyk_jpeg_matches_pillow():
    data = pil_bytes(Image.fromarray(SRC).convert("CMYK"), "JPEG", quality=98)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    got = decode_image(data, DecodeSpec((150, 230), resize="none"))
    assert np.abs(got.image.astype(int) - ref).max() <= 3
    assert np.abs(got.image.astype(int) - SRC.astype(int)).mean() < 3
    g = decode_image(data, DecodeSpec((150, 230), resize="none", channels=1))
    ref_l = np.asarray(Image.open(io.BytesIO(data)).convert("L")).astype(int)
    assert np.abs(g.image[..., 0].astype(int) - ref_l).max() <= 4


def test_animated_gif_first_frame():
    frames = [Image.fromarray(SRC).quantize(64)] + [
        Image.fromarray(np.full_like(SRC, v)).quantize(4) for v in (30, 220)
    ]
    data = pil_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=40, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    got = decode_image(data, DecodeSpec((150, 230), resize="none"))
    assert np.array_equal(got.image, ref)


def test_multipage_tiff_first_page():
    pages = [Image.fromarray(np.full_like(SRC, v)) for v in (10, 240)]
    data = pil_bytes(Image.fromarray(SRC), "TIFF", save_all=True, append_images=pages)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    got = decode_image(data, DecodeSpec((150, 230), resize="none"))
    assert np.array_equal(got.image, SRC)


def test_other_formats_decode():
    for ext in (".bmp", ".ppm", ".ras", ".jp2", ".webp"):
        params = [cv2.IMWRITE_WEBP_QUALITY, 101] if ext == ".webp" else []
        data = cv_bytes(SRC, ext, params)
        got = decode_image(data, DecodeSpec((150, 230), resize="none"))
        plain = cv2.imdecode(npb(data), cv2.IMREAD_UNCHANGED)[..., ::-1]
        assert np.array_equal(got.image, plain), ext
        if ext != ".jp2":  # lossy by default
            assert np.array_equal(got.image, SRC), ext


# --------------------------------------------------------------------------
# bad input


def test_bad_inputs_in_tmp_path(tmp_path):
    def file_reason(name, data=None):
        p = tmp_path / name
        if data is not None:
            p.write_bytes(data)
        return reason_of(lambda: decode_image(read_bytes(p), DecodeSpec((32, 32))))

    assert file_reason("zero.jpg", b"") == "empty: zero bytes"
    r = file_reason("page.jpg", b"<!DOCTYPE html><html><body>404</body></html>")
    assert category(r) == "not-an-image" and "DOCTYPE" in r
    assert category(file_reason("text.png", b"just some text\n")) == "not-an-image"
    for cut in (len(JPEG) // 2, len(JPEG) - 2, len(JPEG) - 1, 100):
        assert category(file_reason(f"trunc{cut}.jpg", JPEG[:cut])) == "truncated", cut
    for cut in (len(PNG) // 2, len(PNG) - 12, len(PNG) - 4, 40, 20):
        assert category(file_reason(f"trunc{cut}.png", PNG[:cut])) == "truncated", cut
    for name, data in (
        ("t.gif", pil_bytes(SRC, "GIF")),
        ("t.bmp", cv_bytes(SRC, ".bmp")),
        ("t.webp", cv_bytes(SRC, ".webp")),
    ):
        assert category(file_reason(name, data[: len(data) * 3 // 4])) == "truncated", name
    # formats without a declared length: still rejected, as corrupt (not "unsupported")
    for ext in (".tiff", ".ppm", ".jp2"):
        data = cv_bytes(SRC, ext)
        assert category(file_reason("t" + ext, data[: len(data) * 3 // 4])) == "corrupt", ext


def png_chunk(typ: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + typ + data + struct.pack(">I", zlib.crc32(typ + data))


def test_png_crc_errors_are_corrupt():
    ihdr_crc = 8 + 8 + 13  # first byte of IHDR's CRC
    bad = bytearray(PNG)
    bad[ihdr_crc] ^= 0xFF
    r = reason_of(decode_image, bytes(bad), DecodeSpec((8, 8)))
    assert r == "corrupt: png CRC mismatch in chunk IHDR"
    idat = PNG.find(b"IDAT")
    (ln,) = struct.unpack(">I", PNG[idat - 4 : idat])
    bad = bytearray(PNG)
    bad[idat + 4 + ln] ^= 0x01  # IDAT CRC
    r = reason_of(decode_image, bytes(bad), DecodeSpec((8, 8)))
    assert r == "corrupt: png CRC mismatch in chunk IDAT"
    bad = bytearray(PNG)
    bad[idat + 4 + ln // 2] ^= 0xFF  # data byte: CRC wrong too
    assert category(reason_of(decode_image, bytes(bad), DecodeSpec((8, 8)))) == "corrupt"
    # damaged zlib data with a *valid* CRC
    sig = PNG[:8]
    raw = zlib.compress(b"\x00" + bytes(30))  # 1 row of 10 RGB pixels, then garble
    garbled = raw[:4] + bytes(b ^ 0x55 for b in raw[4:])
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 10, 1, 8, 2, 0, 0, 0))
    png = sig + ihdr + png_chunk(b"IDAT", garbled) + png_chunk(b"IEND", b"")
    assert category(reason_of(decode_image, png, DecodeSpec((8, 8)))) == "corrupt"


def garbled_jpegs():
    sos = JPEG.find(b"\xff\xda")
    mid = (sos + len(JPEG)) // 2
    rng = np.random.default_rng(1234)
    g1 = bytearray(JPEG)
    g1[mid : mid + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    g2 = JPEG[:mid] + b"\xff\xd9" + JPEG[mid + 2 :]  # premature EOI inside the scan
    g3 = JPEG[:mid] + JPEG[mid + 400 :]  # 400 bytes of scan data missing
    return {"random64": bytes(g1), "early-eoi": g2, "deleted400": g3}


@pytest.mark.parametrize("kind", ["random64", "early-eoi", "deleted400"])
def test_corrupt_jpeg_scan_data(kind, capfd):
    data = garbled_jpegs()[kind]
    specs = (DecodeSpec((32, 32)), DecodeSpec((32, 32), channels=1), DecodeSpec((32, 32), fast_decode=True))
    for spec in specs:
        r = reason_of(decode_image, data, spec)
        assert r.startswith("corrupt: jpeg data ("), r
    err = capfd.readouterr().err
    assert "Corrupt JPEG" not in err  # the libjpeg warning was consumed, not leaked
    # fd 2 is restored afterwards
    os.write(2, b"after-decode\n")
    assert "after-decode" in capfd.readouterr().err
    # non-strict: libjpeg conceals the damage, warning goes to stderr as usual
    got = decode_image(data, DecodeSpec((32, 32), strict_jpeg=False))
    assert got.image.shape == (32, 32, 3)
    assert "Corrupt JPEG data" in capfd.readouterr().err


def test_good_jpeg_strict_prints_nothing(capfd):
    decode_image(JPEG, DecodeSpec((32, 32)))
    assert capfd.readouterr().err == ""


def test_strict_decode_is_thread_safe():
    bad = garbled_jpegs()["random64"]
    spec = DecodeSpec((24, 24))
    expected = decode_image(JPEG, spec).image
    errors = []

    def work(i):
        try:
            for j in range(15):
                if (i + j) % 2:
                    with pytest.raises(DecodeError):
                        decode_image(bad, spec)
                else:
                    assert np.array_equal(decode_image(JPEG, spec).image, expected)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_strict_capture_in_forked_workers():
    bad = garbled_jpegs()["random64"]
    spec = DecodeSpec((16, 16))
    with pytest.raises(DecodeError):
        decode_image(bad, spec)  # the parent now has its capture file
    r, w = os.pipe()
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            ok = True
            try:
                for _ in range(10):
                    try:
                        decode_image(bad, spec)
                        ok = False
                    except DecodeError:
                        pass
                    ok = ok and decode_image(JPEG, spec).image.shape == (16, 16, 3)
            except BaseException:
                ok = False
            finally:
                os.write(w, b"1" if ok else b"0")
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(w)
    assert os.read(r, 16) == b"11"
    os.close(r)
    with pytest.raises(DecodeError):
        decode_image(bad, spec)
    assert decode_image(JPEG, spec).image.shape == (16, 16, 3)


def big_headers() -> dict[str, bytes]:
    n = 40000
    out = {}
    out["png"] = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", struct.pack(">IIBBBBB", n, n, 8, 2, 0, 0, 0))
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )
    small = cv_bytes(photo(16, 16), ".jpg")
    sof = small.find(b"\xff\xc0")
    out["jpeg"] = small[: sof + 5] + struct.pack(">HH", n, n) + small[sof + 9 :]
    gif = bytearray(pil_bytes(photo(16, 16), "GIF"))
    gif[6:10] = struct.pack("<HH", n, n)
    out["gif"] = bytes(gif)
    bmp = bytearray(cv_bytes(photo(16, 16), ".bmp"))
    bmp[18:26] = struct.pack("<ii", n, -n)
    out["bmp"] = bytes(bmp)
    webp = bytearray(pil_bytes(photo(16, 16), "WEBP", lossless=True))
    assert webp[12:16] == b"VP8L"
    bits = (16383) | (16383 << 14)
    webp[21:25] = struct.pack("<I", bits | (struct.unpack("<I", webp[21:25])[0] & ~((1 << 28) - 1)))
    out["webp"] = bytes(webp)
    out["tiff"] = (
        b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 2)
        + struct.pack("<HHII", 256, 4, 1, n) + struct.pack("<HHII", 257, 4, 1, n) + struct.pack("<I", 0)
    )
    out["pnm"] = b"P6\n# big\n40000 40000\n255\n" + bytes(16)
    return out


@pytest.mark.parametrize("fmt", ["png", "jpeg", "gif", "bmp", "webp", "tiff", "pnm"])
def test_too_large_header_rejected_before_decoding(fmt):
    data = big_headers()[fmt]
    assert sniff_image(data) == fmt
    t = time.perf_counter()
    r = reason_of(decode_image, data, DecodeSpec((32, 32)))
    assert time.perf_counter() - t < 0.05
    if fmt == "webp":
        assert r == "too-large: 16384x16384 = 2.7e8 pixels > limit 178956970 (DecodeSpec.max_pixels)"
    else:
        assert r == "too-large: 40000x40000 = 1.6e9 pixels > limit 178956970 (DecodeSpec.max_pixels)"


def test_max_pixels_setting():
    assert category(reason_of(decode_image, PNG, DecodeSpec((8, 8), max_pixels=150 * 230 - 1))) == "too-large"
    assert decode_image(PNG, DecodeSpec((8, 8), max_pixels=150 * 230)).image.shape == (8, 8, 3)
    assert decode_image(PNG, DecodeSpec((8, 8), max_pixels=0)).image.shape == (8, 8, 3)


def test_unsupported_formats():
    hdr = cv_bytes(SRC.astype(np.float32) / 255, ".hdr")
    assert reason_of(decode_image, hdr, DecodeSpec((8, 8))).startswith("unsupported: hdr")
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(100)
    assert category(reason_of(decode_image, heic, DecodeSpec((8, 8)))) == "unsupported"


def test_read_bytes_errors(tmp_path):
    p = tmp_path / "ok.png"
    p.write_bytes(PNG)
    assert read_bytes(p).tobytes() == PNG
    assert read_bytes(str(p)).dtype == np.uint8

    def r(path):
        return reason_of(read_bytes, path)

    assert r(tmp_path / "missing.jpg") == "unreadable: [Errno 2] No such file or directory"
    os.symlink(tmp_path / "nowhere.jpg", tmp_path / "broken.jpg")
    assert r(tmp_path / "broken.jpg") == "unreadable: [Errno 2] No such file or directory (broken symlink)"
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    assert r(tmp_path / "loop_a") == "unreadable: [Errno 40] Too many levels of symbolic links"
    (tmp_path / "adir.jpg").mkdir()
    assert r(tmp_path / "adir.jpg") == "unreadable: [Errno 21] Is a directory"
    os.mkfifo(tmp_path / "fifo.jpg")
    assert r(tmp_path / "fifo.jpg") == "unreadable: not a regular file"  # and does not block


def test_read_bytes_max_bytes_refuses_before_reading(tmp_path):
    p = tmp_path / "big.png"
    p.write_bytes(PNG)
    assert read_bytes(p, max_bytes=len(PNG)).tobytes() == PNG  # at the limit: read
    assert reason_of(read_bytes, p, max_bytes=len(PNG) - 1) == (
        f"too-large: file of {len(PNG)} bytes (limit {len(PNG) - 1})")
    # refused from its size before any buffer is made: a sparse 1 TiB file
    # (reading it would need a 1 TiB array) gives the reason at once
    huge = tmp_path / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    assert reason_of(read_bytes, huge, max_bytes=2 << 30) == f"too-large: file of {1 << 40} bytes (limit {2 << 30})"
    # a directory or FIFO is refused as before, whatever the limit
    (tmp_path / "adir.jpg").mkdir()
    assert reason_of(read_bytes, tmp_path / "adir.jpg", max_bytes=0) == "unreadable: [Errno 21] Is a directory"


def test_read_bytes_permission_denied(tmp_path):
    import subprocess
    import sys

    p = tmp_path / "secret.jpg"
    p.write_bytes(JPEG)
    p.chmod(0)
    code = (
        "import sys; from mmstore.decode import read_bytes; from mmstore.errors import DecodeError\n"
        "try:\n    read_bytes(sys.argv[1])\nexcept DecodeError as e:\n    print(e.reason)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo)
    from support.faults import drop_dac_override as _drop_dac

    try:
        r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, env=env,
                           preexec_fn=_drop_dac if os.geteuid() == 0 else None, timeout=60)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"cannot drop root's file-permission override here: {exc}")
    assert r.stdout.strip() == "unreadable: [Errno 13] Permission denied", r.stderr


def test_non_utf8_name_and_content_sniffing(tmp_path):
    name = os.fsencode(tmp_path) + b"/caf\xe9-\xff.jpg"
    with open(name, "wb") as f:
        f.write(JPEG)
    got = decode_image(read_bytes(name), DecodeSpec((150, 230), resize="none"))
    assert np.array_equal(got.image, cv2.imdecode(npb(JPEG), cv2.IMREAD_COLOR_RGB))
    # a PNG named .jpg is decoded as PNG, by content
    p = tmp_path / "really_a_png.jpg"
    p.write_bytes(PNG)
    got = decode_image(read_bytes(p), DecodeSpec((150, 230), resize="none"))
    assert got.source_format == "png" and np.array_equal(got.image, SRC)


def test_input_types():
    spec = DecodeSpec((20, 20))
    a = decode_image(JPEG, spec).image
    for data in (bytearray(JPEG), memoryview(JPEG), npb(JPEG), npb(JPEG).copy()):
        assert np.array_equal(decode_image(data, spec).image, a)
    with pytest.raises(TypeError):
        decode_image(npb(JPEG).astype(np.int16), spec)


def test_jpeg_with_trailing_data_and_exif_thumbnail_eoi_ok():
    spec = DecodeSpec((20, 20))
    ref = decode_image(JPEG, spec).image
    assert np.array_equal(decode_image(JPEG + b"\x00" * 5000 + b"TRAILER", spec).image, ref)
    # an EOI inside an APP segment (like an EXIF thumbnail) does not hide truncation
    app = b"\xff\xe1" + struct.pack(">H", 2 + 8) + b"\xff\xd8\xff\xd9THMB"
    with_app = JPEG[:2] + app + JPEG[2:]
    assert np.array_equal(decode_image(with_app, spec).image, ref)
    assert category(reason_of(decode_image, with_app[: len(with_app) // 2], spec)) == "truncated"


# --------------------------------------------------------------------------
# fast JPEG decode


BIG = photo(480, 640, seed=7)
BIG_JPEG = cv_bytes(BIG, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 90])


def test_reduced_decode_shape_is_ceil():
    for h, w in ((61, 93), (17, 18), (480, 640)):
        d = npb(cv_bytes(photo(h, w), ".jpg"))
        flags = (
            (2, cv2.IMREAD_REDUCED_COLOR_2),
            (4, cv2.IMREAD_REDUCED_COLOR_4),
            (8, cv2.IMREAD_REDUCED_GRAYSCALE_8),
        )
        for k, flag in flags:
            assert cv2.imdecode(d, flag).shape[:2] == (-(-h // k), -(-w // k))


@pytest.mark.parametrize(
    "size,policy,channels,k",
    [((64, 64), "center-crop", 3, 4), ((224, 224), "center-crop", 3, 2), ((60, 80), "stretch", 1, 8),
     ((100, 100), "pad", 3, 4), ((300, 300), "center-crop", 3, 1)],
)
def test_fast_decode_exact_reference_and_close_to_exact(size, policy, channels, k):
    spec = DecodeSpec(size, resize=policy, channels=channels, fast_decode=True, bgr=False)
    got = decode_image(BIG_JPEG, spec)
    exact = decode_image(BIG_JPEG, DecodeSpec(size, resize=policy, channels=channels))
    assert got.image.shape == exact.image.shape == spec.record_shape()
    assert got.orig_size == exact.orig_size == (480, 640)
    assert got.dst == exact.dst
    assert all(abs(a - b) < max(k, 1) for a, b in zip(got.box, exact.box))
    assert np.abs(got.image.astype(int) - exact.image.astype(int)).mean() < 3
    if k == 1:
        assert np.array_equal(got.image, exact.image)
        return
    # reproduce with plain cv2 calls: reduced decode, rounded crop, INTER_AREA
    flag = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}[k]
    if channels == 1:
        flag = {
            2: cv2.IMREAD_REDUCED_GRAYSCALE_2,
            4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
            8: cv2.IMREAD_REDUCED_GRAYSCALE_8,
        }[k]
    small = cv2.imdecode(npb(BIG_JPEG), flag)
    x0, y0, x1, y1 = got.box
    assert (x0 % k, y0 % k) == (0, 0)
    region = small[y0 // k : -(-y1 // k), x0 // k : -(-x1 // k)]
    dx0, dy0, dx1, dy1 = got.dst
    out = cv2.resize(region, (dx1 - dx0, dy1 - dy0), interpolation=cv2.INTER_AREA)
    if policy == "pad":
        canvas = np.zeros(size + out.shape[2:], np.uint8)
        canvas[dy0:dy1, dx0:dx1] = out
        out = canvas
    out = out[..., ::-1] if channels == 3 else out[..., None]
    assert np.array_equal(got.image, out)


def test_fast_decode_with_orientation():
    ex = Image.Exif()
    ex[0x0112] = 6
    data = pil_bytes(BIG, "JPEG", quality=90, exif=ex.tobytes())
    got = decode_image(data, DecodeSpec((64, 48), fast_decode=True))
    exact = decode_image(data, DecodeSpec((64, 48)))
    assert got.orig_size == exact.orig_size == (640, 480)
    assert np.abs(got.image.astype(int) - exact.image.astype(int)).mean() < 3
