"""Pixel-exact records through the whole pipeline, against plain cv2 calls."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mmstore

cv2 = pytest.importorskip("cv2")


def _interp(rh, rw, oh, ow, up=cv2.INTER_LINEAR):
    return cv2.INTER_AREA if oh <= rh and ow <= rw else up


def ref_center_crop(S, th, tw):
    h, w = S.shape[:2]
    if w * th >= h * tw:
        ch, cw = h, min(w, max(1, round(h * tw / th)))
    else:
        cw, ch = w, min(h, max(1, round(w * th / tw)))
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    reg = S[y0 : y0 + ch, x0 : x0 + cw]
    out = reg if (ch, cw) == (th, tw) else cv2.resize(reg, (tw, th), interpolation=_interp(ch, cw, th, tw))
    return out, (x0, y0, x0 + cw, y0 + ch)


def ref_stretch(S, th, tw):
    h, w = S.shape[:2]
    return cv2.resize(S, (tw, th), interpolation=_interp(h, w, th, tw)), (0, 0, w, h)


def ref_pad(S, th, tw, v=0):
    h, w = S.shape[:2]
    if w * th >= h * tw:
        nw, nh = tw, min(th, max(1, round(h * tw / w)))
    else:
        nh, nw = th, min(tw, max(1, round(w * th / h)))
    r = cv2.resize(S, (nw, nh), interpolation=_interp(h, w, nh, nw))
    ox, oy = (tw - nw) // 2, (th - nh) // 2
    out = cv2.copyMakeBorder(r, oy, th - nh - oy, ox, tw - nw - ox, cv2.BORDER_CONSTANT, value=(v, v, v, v))
    return out, (0, 0, w, h)


@pytest.mark.parametrize("policy", ["center-crop", "stretch", "pad"])
def test_resize_policies_pixel_exact(tmp_path, h, policy):
    root = tmp_path / "p"
    root.mkdir()
    rng = np.random.default_rng(10)
    shapes = [(40, 60), (60, 40), (20, 20), (16, 50), (33, 17)]  # wide, tall, square-up, mixed
    for k, (hh, ww) in enumerate(shapes):
        h.write_image(str(root / f"{k}.png"), h.photo(rng, hh, ww), ".png")  # lossless: exact source
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", str(root), dest, "--size", "24x32", "--resize", policy, "--workers", "2", "-q",
                 "--pad-value", "7") == 0
    s = mmstore.open(dest)
    for k in range(len(shapes)):
        S = cv2.cvtColor(cv2.imread(str(root / f"{k}.png")), cv2.COLOR_BGR2RGB)
        if policy == "center-crop":
            ref, box = ref_center_crop(S, 24, 32)
        elif policy == "stretch":
            ref, box = ref_stretch(S, 24, 32)
        else:
            ref, box = ref_pad(S, 24, 32, 7)
        rec = s[k]
        assert np.array_equal(rec["image"], ref), (policy, shapes[k])
        assert tuple(rec["box"]) == box
        assert tuple(rec["orig_size"]) == shapes[k]
        x0, y0, x1, y1 = rec["dst"].tolist()
        if policy != "pad":
            assert (x0, y0, x1, y1) == (0, 0, 32, 24)
        else:  # the picture area: the source's aspect, centred; only the letterbox outside it
            hh, ww = shapes[k]
            nw, nh = (32, int(hh * 32 / ww + 0.5)) if ww * 24 >= hh * 32 else (int(ww * 24 / hh + 0.5), 24)
            assert (x1 - x0, y1 - y0) == (nw, nh) and (x0, y0) == ((32 - nw) // 2, (24 - nh) // 2)
            border = np.ones((24, 32), bool)
            border[y0:y1, x0:x1] = False
            assert np.all(ref[border] == 7)


def test_none_policy_and_wrong_shape_hole(tmp_path, h):
    root = tmp_path / "n"
    root.mkdir()
    rng = np.random.default_rng(11)
    a = h.photo(rng, 16, 16)
    h.write_image(str(root / "a.png"), a, ".png")
    h.write_image(str(root / "b.png"), h.photo(rng, 16, 17), ".png")
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", str(root), dest, "--size", "16x16", "--resize", "none", "-q") == 0
    s = mmstore.open(dest)
    assert len(s) == 1 and np.array_equal(s[0]["image"], cv2.cvtColor(a, cv2.COLOR_BGR2RGB))
    assert s.skipped()[0]["reason"].startswith("wrong-shape")


def test_jpeg_layout_chw_bgr_gray(tmp_path, h):
    root = tmp_path / "j"
    root.mkdir()
    rng = np.random.default_rng(12)
    h.write_image(str(root / "c.jpg"), h.photo(rng, 30, 30))
    data = (root / "c.jpg").read_bytes()
    buf = np.frombuffer(data, np.uint8)
    for extra, ref in [
        (["--layout", "chw"], cv2.resize(cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB), (15, 15),
                                         interpolation=cv2.INTER_AREA).transpose(2, 0, 1)),
        (["--bgr"], cv2.resize(cv2.imdecode(buf, cv2.IMREAD_COLOR_BGR), (15, 15), interpolation=cv2.INTER_AREA)),
        (["--channels", "1"],
         cv2.resize(cv2.imdecode(buf, cv2.IMREAD_GRAYSCALE), (15, 15), interpolation=cv2.INTER_AREA)[..., None]),
    ]:
        dest = str(tmp_path / ("s" + "".join(extra)))
        assert h.cli("ingest", str(root), dest, "--size", "15x15", "-q", "--workers", "1", *extra) == 0
        assert np.array_equal(mmstore.open(dest)[0]["image"], ref), extra


def test_orientation_alpha_16bit_gray_cmyk(tmp_path, h):
    pytest.importorskip("PIL")
    from PIL import Image, ImageOps

    root = tmp_path / "k"
    root.mkdir()
    rng = np.random.default_rng(13)
    base = h.photo(rng, 20, 30)  # RGB
    # 1. EXIF orientation 6 (rotate 90 CW) on a JPEG
    im = Image.fromarray(base)
    exif = Image.Exif()
    exif[0x0112] = 6
    im.save(root / "a_orient.jpg", quality=95, exif=exif.tobytes())
    # 2. RGBA PNG: composited over black
    rgba = np.dstack([base, rng.integers(0, 256, base.shape[:2], dtype=np.uint8)])
    Image.fromarray(rgba, "RGBA").save(root / "b_alpha.png")
    # 3. 16-bit gray PNG
    g16 = (rng.integers(0, 65536, (20, 30))).astype(np.uint16)
    cv2.imwrite(str(root / "c_16bit.png"), g16)
    # 4. grayscale JPEG
    cv2.imwrite(str(root / "d_gray.jpg"), base[..., 0])
    # 5. CMYK JPEG
    Image.fromarray(base).convert("CMYK").save(root / "e_cmyk.jpg", quality=95)
    dest = str(tmp_path / "s.store")
    assert h.cli("ingest", str(root), dest, "--size", "20x30", "--resize", "stretch", "-q", "--workers", "2") == 0
    s = mmstore.open(dest)
    assert len(s) == 5, s.skipped()
    keys = [s.key(i) for i in range(5)]
    assert keys == ["a_orient.jpg", "b_alpha.png", "c_16bit.png", "d_gray.jpg", "e_cmyk.jpg"]

    def st(S):
        return ref_stretch(S, 20, 30)[0]

    # orientation: the oriented source is 30x20 (tall); compare with PIL's transpose
    pil = np.asarray(ImageOps.exif_transpose(Image.open(root / "a_orient.jpg")).convert("RGB"))
    assert tuple(s[0]["orig_size"]) == (30, 20)
    assert np.abs(s[0]["image"].astype(int) - st(pil).astype(int)).max() <= 2
    a = rgba[..., 3:].astype(np.uint32)
    comp = ((rgba[..., :3].astype(np.uint32) * a + 127) // 255).astype(np.uint8)
    assert np.array_equal(s[1]["image"], st(comp))
    g8 = (g16 >> 8).astype(np.uint8)
    assert np.array_equal(s[2]["image"], cv2.cvtColor(st(g8), cv2.COLOR_GRAY2RGB))
    gj = cv2.imread(str(root / "d_gray.jpg"), cv2.IMREAD_GRAYSCALE)
    assert np.array_equal(s[3]["image"], cv2.cvtColor(st(gj), cv2.COLOR_GRAY2RGB))
    cm = np.asarray(Image.open(root / "e_cmyk.jpg").convert("RGB"))
    assert np.abs(s[4]["image"].astype(int) - st(cm).astype(int)).max() <= 3


def test_fast_decode_close_to_exact(tmp_path, h):
    root = tmp_path / "f"
    root.mkdir()
    rng = np.random.default_rng(14)
    for k in range(3):
        h.write_image(str(root / f"{k}.jpg"), h.photo(rng, 200, 260))
    exact, fast = str(tmp_path / "e"), str(tmp_path / "f.store")
    assert h.cli("ingest", str(root), exact, "--size", "32x32", "-q") == 0
    assert h.cli("ingest", str(root), fast, "--size", "32x32", "-q", "--fast-decode") == 0
    a = mmstore.open(exact).column("image").astype(int)
    b = mmstore.open(fast).column("image").astype(int)
    assert np.abs(a - b).mean() < 3
    assert mmstore.open(fast).provenance["ingest"]["params"]["decode"]["fast_decode"] is True
    assert os.path.exists(fast)
