"""DecodeSpec.alpha: black (default), white, drop: pixel-exact against a numpy/OpenCV reference."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest

from mmstore.decode import DecodeSpec, decode_image, fit_array

Image = pytest.importorskip("PIL.Image")

MODES = ("black", "white", "drop")


def ref_flatten(colour: np.ndarray, a: np.ndarray, mode: str) -> np.ndarray:
    """The documented rules in plain integer numpy (round half up; ties cannot occur)."""
    c = colour.astype(np.int64)
    a = a[..., None].astype(np.int64)
    if mode == "black":
        out = (2 * c * a + 255) // 510
    elif mode == "white":
        out = (2 * (c * a + 255 * (255 - a)) + 255) // 510
    else:
        out = c
    return out.astype(np.uint8)


def png(arr: np.ndarray, mode: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG", **kw)
    return buf.getvalue()


def all_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every (colour, alpha) pair once: colour along x, alpha along y."""
    c = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    return c, c.T.copy()


@pytest.mark.parametrize("mode", MODES)
def test_rgba_every_colour_alpha_pair(mode):
    c, a = all_pairs()
    rgba = np.dstack([c, 255 - c, c // 2, a])
    exp = ref_flatten(rgba[..., :3], a, mode)
    if mode == "white":
        assert np.array_equal(exp[..., 0], np.round(c * (a / 255) + 255 * (1 - a / 255)).astype(np.uint8))
        assert (exp[a == 0] == 255).all()
    spec = DecodeSpec((256, 256), resize="none", alpha=mode)
    assert np.array_equal(fit_array(rgba, spec).image, exp)
    got = decode_image(png(rgba, "RGBA"), spec).image
    assert np.array_equal(got, exp)
    if mode == "drop":  # what PIL's convert("RGB") (torchvision's ImageFolder loader) gives
        ref = np.asarray(Image.open(io.BytesIO(png(rgba, "RGBA"))).convert("RGB"))
        assert np.array_equal(got, ref)
    # bgr output and one channel follow the same flattening, then the usual conversions
    assert np.array_equal(decode_image(png(rgba, "RGBA"), DecodeSpec((256, 256), resize="none", alpha=mode,
                                                                     bgr=True)).image, exp[..., ::-1])
    g = decode_image(png(rgba, "RGBA"), DecodeSpec((256, 256), resize="none", alpha=mode, channels=1)).image
    assert np.array_equal(g[..., 0], cv2.cvtColor(np.ascontiguousarray(exp[..., ::-1]), cv2.COLOR_BGR2GRAY))


@pytest.mark.parametrize("mode", MODES)
def test_gray_alpha_and_resized(mode):
    c, a = all_pairs()
    la = np.dstack([c, a])
    exp = ref_flatten(c[..., None], a, mode)[..., 0]
    got = decode_image(png(la, "LA"), DecodeSpec((256, 256), resize="none", channels=1, alpha=mode)).image
    assert np.array_equal(got[..., 0], exp)
    if mode == "drop":
        assert np.array_equal(got[..., 0], np.asarray(Image.open(io.BytesIO(png(la, "LA"))).convert("L")))
    # the alpha rule happens at source resolution, before the resize (INTER_AREA when shrinking)
    rgba = np.dstack([c, 255 - c, c // 3, a])
    small = decode_image(png(rgba, "RGBA"), DecodeSpec((64, 96), resize="stretch", alpha=mode)).image
    assert np.array_equal(small, cv2.resize(ref_flatten(rgba[..., :3], a, mode), (96, 64),
                                            interpolation=cv2.INTER_AREA))


@pytest.mark.parametrize("mode", MODES)
def test_palette_with_transparency_and_16bit(mode):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    p = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    buf = io.BytesIO()
    p.save(buf, "PNG", transparency=3)
    data = buf.getvalue()
    rgba = np.asarray(Image.open(io.BytesIO(data)).convert("RGBA"))
    assert (rgba[..., 3] == 0).any() and (rgba[..., 3] == 255).any()
    got = decode_image(data, DecodeSpec((40, 50), resize="none", alpha=mode)).image
    assert np.array_equal(got, ref_flatten(rgba[..., :3], rgba[..., 3], mode))
    if mode == "drop":
        assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    a16 = rng.integers(0, 65536, (20, 30, 4), dtype=np.uint16)
    _, enc = cv2.imencode(".png", a16)  # BGRA on disk
    got = decode_image(enc.tobytes(), DecodeSpec((20, 30), resize="none", bgr=True, alpha=mode)).image
    a8 = (a16 >> 8).astype(np.uint8)
    assert np.array_equal(got, ref_flatten(a8[..., :3], a8[..., 3], mode))


@pytest.mark.parametrize("mode", MODES)
def test_gif_with_transparency(mode):
    # the documented exception of "drop": OpenCV's GIF decoder leaves the background colour
    # (palette entry 5 here) under transparent pixels, Pillow's convert("RGB") the transparent
    # entry's colour; the docstring claimed Pillow's result for every format
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 8, (30, 40), dtype=np.uint8)
    pal = rng.integers(0, 256, (8, 3), dtype=np.uint8)
    im = Image.fromarray(idx, "P")
    im.putpalette(pal.tobytes())
    buf = io.BytesIO()
    im.save(buf, "GIF", transparency=3, background=5)
    got = decode_image(buf.getvalue(), DecodeSpec((30, 40), resize="none", alpha=mode)).image
    clear = idx == 3
    assert clear.any() and (~clear).any()
    assert np.array_equal(got[~clear], pal[idx[~clear]])  # opaque pixels: the palette colour
    under = {"black": 0, "white": 255}.get(mode)
    if under is None:
        assert np.array_equal(got[clear], np.broadcast_to(pal[5], got[clear].shape))  # background colour
        pil = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
        assert np.array_equal(got[~clear], pil[~clear]) and not np.array_equal(got[clear], pil[clear])
    else:
        assert (got[clear] == under).all()


def test_spec_round_trip_and_default():
    assert DecodeSpec((8, 8)).alpha == "black"
    assert "alpha" not in DecodeSpec((8, 8)).to_dict()  # old stores' fingerprints unchanged
    for m in MODES:
        s = DecodeSpec((8, 8), alpha=m)
        assert DecodeSpec.from_dict(s.to_dict()) == s
    assert DecodeSpec((8, 8), alpha="white").to_dict()["alpha"] == "white"
    with pytest.raises(ValueError, match="alpha"):
        DecodeSpec((8, 8), alpha="grey")
    # opaque sources do not depend on it
    rgb = np.random.default_rng(0).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    outs = {m: fit_array(rgb, DecodeSpec((10, 12), resize="none", alpha=m)).image.tobytes() for m in MODES}
    assert len(set(outs.values())) == 1


def test_ingest_alpha_option_cli_and_fingerprint(tmp_path):
    import mmstore
    from mmstore.cli import main
    from mmstore.ingest import ingest

    src = tmp_path / "src"
    src.mkdir()
    c, a = all_pairs()
    rgba = np.dstack([c, 255 - c, c // 2, a])[::8, ::8].copy()
    (src / "x.png").write_bytes(png(rgba, "RGBA"))
    for m in MODES:
        assert main(["ingest", str(src), str(tmp_path / m), "--size", "32x32", "--resize", "none",
                     "--alpha", m, "--workers", "0", "--quiet"]) == 0
        st = mmstore.open(str(tmp_path / m))
        assert np.array_equal(st[0]["image"], ref_flatten(rgba[..., :3], rgba[..., 3], m))
        dec = st.provenance["ingest"]["params"]["decode"]
        assert dec.get("alpha", "black") == m
    fps = {mmstore.open(str(tmp_path / m)).provenance["ingest"]["fingerprint"] for m in MODES}
    assert len(fps) == 3
    r = ingest(str(src), str(tmp_path / "white"), (32, 32), resize="none", alpha="white", workers=0, quiet=True,
               resume=True)
    assert r.already_complete
