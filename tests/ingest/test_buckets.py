"""Aspect buckets at ingest (``ingest --buckets``): every record is the centre crop of its image to the
bucket nearest its aspect, pixel-exact against an OpenCV reference computed here from the documented
rules, on crops of a real photograph (landscape, portrait, square, EXIF-rotated, gray, RGBA, a strip,
images smaller than their bucket); raw, png, zstd and jpeg stores; the geometry fields map boxes back;
``auto`` on a skewed mix of aspects gives the documented shapes; bad lists and conflicting options are
refused; the extreme-aspect rule; inspect and show; the choice and the crop as a property."""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compare import assert_same_files
from support.proc import popen_cli, run_cli, run_json

import mmstore
from mmstore.check.inspect import inspect_store
from mmstore.decode import DecodeSpec, fit_array
from mmstore.decode.buckets import auto_buckets, crop_share, header_size, ladder, nearest_bucket, parse_buckets
from mmstore.decode.geometry import to_source, to_stored
from mmstore.errors import SourceError
from mmstore.format.codecs import parse_codec
from mmstore.ingest import from_dataset, ingest, make_spec, merge

cv2 = pytest.importorskip("cv2")
Image = pytest.importorskip("PIL.Image")
cbook = pytest.importorskip("matplotlib.cbook")

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
BUCKETS = [(64, 64), (48, 80), (80, 48), (32, 96)]


def ref_bucket(h: int, w: int, buckets) -> tuple[int, int]:
    """The documented choice with exact fractions: the bucket of the least |log(w/h) - log(bw/bh)|,
    a tie to the wider bucket."""
    def dist(b):
        r = Fraction(w * b[0], h * b[1])
        return max(r, 1 / r)
    best = min(dist(b) for b in buckets)
    return max((b for b in buckets if dist(b) == best), key=lambda b: Fraction(b[1], b[0]))


def ref_record(S: np.ndarray, bucket: tuple[int, int]) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """The documented crop, written from the rule: the largest centred region of the bucket's aspect (its
    size round(...) half up, from exact fractions), resized once (INTER_AREA when no side grows, else
    INTER_LINEAR)."""
    h, w = S.shape[:2]
    th, tw = bucket
    if Fraction(w, h) >= Fraction(tw, th):
        ch, cw = h, min(w, max(1, math.floor(Fraction(h * tw, th) + Fraction(1, 2))))
    else:
        cw, ch = w, min(h, max(1, math.floor(Fraction(w * th, tw) + Fraction(1, 2))))
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    region = S[y0 : y0 + ch, x0 : x0 + cw]
    if (ch, cw) != (th, tw):
        grow = th > ch or tw > cw
        region = cv2.resize(region, (tw, th), interpolation=cv2.INTER_LINEAR if grow else cv2.INTER_AREA)
    return region, (x0, y0, x0 + cw, y0 + ch)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Crops of a real photograph at several aspects (each at most 128 px): JPEGs, one with EXIF orientation
    6, a gray JPEG, an RGBA PNG, a strip, images smaller than their bucket. Returns (folder, {name: the
    source S the documented rules decode it to, RGB})."""
    root = str(tmp_path_factory.mktemp("photos"))
    p = PHOTO
    want: dict[str, np.ndarray] = {}

    def jpg(name, rgb, **kw):
        Image.fromarray(rgb).save(os.path.join(root, name), quality=95, **kw)
        want[name] = cv2.imread(os.path.join(root, name), cv2.IMREAD_COLOR_RGB)  # EXIF applied by OpenCV

    jpg("a_wide.jpg", p[100:172, 0:128])  # 72 x 128: between 48x80 and 32x96
    jpg("b_tall.jpg", p[0:128, 100:176])  # 128 x 76
    jpg("c_square.jpg", p[200:300, 150:250])
    ex = Image.Exif()
    ex[0x0112] = 6  # rotate 90 clockwise to show
    jpg("d_exif.jpg", p[50:110, 60:160], exif=ex.tobytes())
    assert want["d_exif.jpg"].shape == (100, 60, 3)  # shown turned: the oriented size
    gray = cv2.cvtColor(p[300:360, 0:120], cv2.COLOR_RGB2GRAY)
    Image.fromarray(gray).save(os.path.join(root, "e_gray.jpg"), quality=95)
    want["e_gray.jpg"] = np.repeat(cv2.imread(os.path.join(root, "e_gray.jpg"), cv2.IMREAD_GRAYSCALE)[..., None], 3, 2)
    rgb = p[400:450, 200:300]
    a = np.tile(np.linspace(0, 255, 100).astype(np.uint8), (50, 1))
    cv2.imwrite(os.path.join(root, "f_rgba.png"), np.dstack([rgb[..., ::-1], a]))
    want["f_rgba.png"] = ((rgb.astype(np.int64) * a[..., None] + 127) // 255).astype(np.uint8)  # over black
    jpg("g_small.jpg", p[0:20, 0:30])  # enlarged to its bucket
    cv2.imwrite(os.path.join(root, "h_strip.png"), np.ascontiguousarray(p[0:1, 0:120, ::-1]))
    want["h_strip.png"] = p[0:1, 0:120].copy()
    jpg("i_portrait.jpg", p[0:120, 0:45])
    return root, want


def check_store(dest: str, want: dict[str, np.ndarray], buckets, jpeg=None) -> mmstore.Store:
    s = mmstore.open(dest)
    f = s.schema["image"]
    assert f.shape == (None, None, 3) and f.buckets == tuple(sorted(buckets, key=lambda b: Fraction(b[1], b[0])))
    assert s.manifest["version"] == (2, 3) and s.manifest["requires"] == ["shapes"]
    with open(os.path.join(dest, "manifest.json")) as fh:
        raw = json.load(fh)
    assert [e for e in raw["schema"] if e["name"] == "image"][0]["buckets"] == [list(b) for b in f.buckets]
    assert len(s) == len(want)
    for i in range(len(s)):
        r, name = s[i], s.key(i)
        S = want[name]
        b = ref_bucket(*S.shape[:2], buckets)
        ref, box = ref_record(S, b)
        if jpeg is not None:
            ref = jpeg.decode(jpeg.encode(ref), np.uint8, ref.shape)
        assert r["image_hw"].tolist() == list(b) and r["image"].shape == (*b, 3), name
        assert np.array_equal(r["image"], ref), name
        assert r["orig_size"].tolist() == list(S.shape[:2]) and r["box"].tolist() == list(box), name
        assert r["dst"].tolist() == [0, 0, b[1], b[0]], name
        # the geometry maps the record back exactly: its corners are the box's, a source point lands and returns
        assert np.array_equal(to_source(np.array([[0.0, 0.0, b[1], b[0]]]), r)[0], np.array(box, np.float64))
        pt = np.array([[box[0] + 0.25 * (box[2] - box[0]), box[1] + 0.75 * (box[3] - box[1])]])
        assert np.allclose(to_source(to_stored(pt, r), r), pt, rtol=0, atol=1e-9)
    assert mmstore.verify(dest, decode=True).ok
    return s


@pytest.mark.parametrize("codec", ["raw", "png", "zstd"])
def test_records_are_exact_against_opencv(tmp_path, photos, codec):
    root, want = photos
    dest = str(tmp_path / "s")
    ingest(root, dest, buckets=BUCKETS, codecs=None if codec == "raw" else [f"image={codec}"], workers=0, quiet=True)
    s = check_store(dest, want, BUCKETS)
    got = {s.key(i): tuple(s[i]["image_hw"].tolist()) for i in range(len(s))}
    assert got["a_wide.jpg"] == (48, 80) and got["b_tall.jpg"] == (80, 48) and got["d_exif.jpg"] == (80, 48)
    assert got["h_strip.png"] == (32, 96) and got["g_small.jpg"] == (48, 80)
    # a batch of one bucket stacks; every file still opens with plain numpy
    same = [i for i in range(len(s)) if got[s.key(i)] == (48, 80)]
    assert np.stack(s.read_batch(same)["image"]).shape == (len(same), 48, 80, 3)
    hws = np.load(os.path.join(dest, "image_hw.npy"))
    assert {tuple(x) for x in hws.tolist()} <= set(BUCKETS)


def test_jpeg_records_are_the_reencoded_reference(tmp_path, photos):
    root, want = photos
    dest = str(tmp_path / "j")
    ingest(root, dest, buckets="64x64,48x80,80x48,32x96", codecs=["image=jpeg:90"], workers=0, quiet=True,
           backend="lmdb")
    check_store(dest, want, BUCKETS, jpeg=parse_codec("jpeg:90"))


def test_cli_ingest_inspect_show(tmp_path, photos, capsys):
    root, want = photos
    dest = str(tmp_path / "c")
    rc, _, err = run_cli(["ingest", root, dest, "--buckets", "64x64,48x80,80x48,32x96", "-q", "--workers", "1"],
                         capsys)
    assert rc == 0, err
    s = check_store(dest, want, BUCKETS)
    rc, rep = run_json(["inspect", dest], capsys)
    hw = [tuple(x) for x in s.column("image_hw").tolist()]
    orig, box = s.column("orig_size").astype(float), s.column("box").astype(float)
    share = 1 - (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1]) / (orig[:, 0] * orig[:, 1])
    assert rc == 0 and [(b["h"], b["w"]) for b in rep["image_buckets"]] == [(80, 48), (64, 64), (48, 80), (32, 96)]
    for b in rep["image_buckets"]:
        mine = [i for i, x in enumerate(hw) if x == (b["h"], b["w"])]
        assert b["records"] == len(mine) and b["records"] > 0
        assert b["crop_max"] == round(float(share[mine].max()), 4)
        assert b["crop_mean"] == round(float(share[mine].mean()), 4)
    strip = rep["image_buckets"][3]
    assert strip["crop_max"] > 0.9  # the 1 x 120 strip keeps 1 x 3 of its pixels
    rc, out, err = run_cli(["inspect", dest], capsys)
    assert rc == 0 and "4 aspect buckets" in out and "32x96" in out, out
    rc, rep = run_json(["show", dest, "-o", str(tmp_path / "grid.png"), "-n", "4"], capsys)
    assert rc == 0 and os.path.getsize(tmp_path / "grid.png") > 0
    shown = [tuple(s[t["index"]]["image_hw"].tolist()) for t in rep["tiles"]]
    assert shown == sorted(shown, key=lambda b: Fraction(b[1], b[0])) and set(shown) == set(BUCKETS)


def test_extreme_aspect_goes_to_the_most_extreme_bucket_cropped(tmp_path):
    root = str(tmp_path / "x")
    os.makedirs(root)
    strip = np.ascontiguousarray(np.resize(PHOTO[:, :, ::-1], (1, 5000, 3)))
    cv2.imwrite(os.path.join(root, "strip.png"), strip)
    cv2.imwrite(os.path.join(root, "tall.png"), np.ascontiguousarray(strip.transpose(1, 0, 2)))
    dest = str(tmp_path / "s")
    ingest(root, dest, buckets="256x256,192x320,320x192", workers=0, quiet=True)
    s = mmstore.open(dest)
    keys = [s.key(i) for i in range(len(s))]
    r = s[keys.index("strip.png")]
    # the documented example: bucket 192 x 320, the centre 1 x 2 pixels (cw = round(320 / 192) = 2, x0 = 2499)
    assert r["image_hw"].tolist() == [192, 320] and r["box"].tolist() == [2499, 0, 2501, 1]
    assert r["orig_size"].tolist() == [1, 5000] and r["dst"].tolist() == [0, 0, 320, 192]
    src = strip[..., ::-1]
    assert np.array_equal(r["image"], cv2.resize(src[:, 2499:2501], (320, 192), interpolation=cv2.INTER_LINEAR))
    t = s[keys.index("tall.png")]
    assert t["image_hw"].tolist() == [320, 192] and t["box"].tolist() == [0, 2499, 1, 2501]
    rep = inspect_store(dest, sample=0, cache=False)
    assert [b["records"] for b in rep.image_buckets] == [1, 0, 1] and rep.image_buckets[1]["crop_max"] is None
    assert rep.image_buckets[0]["crop_max"] == round(1 - 2 / 5000, 4)


def test_auto_on_a_skewed_mix_gives_the_documented_shapes(tmp_path):
    # 12 landscape 4:3, 5 portrait 3:4, 2 square, 1 panorama 3:1 (each a crop of a real photograph)
    root = str(tmp_path / "mix")
    os.makedirs(root)
    sizes = [(72, 96)] * 12 + [(96, 72)] * 5 + [(80, 80)] * 2 + [(40, 120)]
    for k, (h, w) in enumerate(sizes):
        y, x = 7 * k, 11 * k
        Image.fromarray(np.ascontiguousarray(PHOTO[y : y + h, x : x + w])).save(os.path.join(root, f"{k:02d}.jpg"),
                                                                               quality=90)
    # the ladder of auto:64 (multiples of 8, rounded half up): 17 rungs from 128x32 to 32x128
    rungs = ladder(64)
    assert len(rungs) == 17 and rungs[0] == (128, 32) and rungs[8] == (64, 64) and rungs[-1] == (32, 128)
    assert rungs[9:12] == ((56, 72), (56, 80), (48, 80))  # 2 ** (k / 4) for k = 1, 2, 3: 64 * 2 ** (1/8) = 69.8
    # 4:3 is nearest to 56x72 (9:7) here; 3:1 to 40x104; each shape with at least 1% of the votes is kept
    want = ((72, 56), (64, 64), (56, 72), (40, 104))
    assert auto_buckets(np.array(sizes), 64) == want
    dest = str(tmp_path / "s")
    ingest(root, dest, buckets="auto:64", workers=0, quiet=True)
    s = mmstore.open(dest)
    assert s.schema["image"].buckets == want
    prov = s.provenance["buckets"]
    assert prov["auto"] == "auto:64" and prov["inputs"] == 20 and prov["sizes_read"] == 20
    got = [tuple(x) for x in s.column("image_hw").tolist()]
    assert got == [ref_bucket(h, w, want) for h, w in sizes]
    # rare aspects (under 1%) are merged into their neighbour, at most 9 shapes are kept
    many = [(72, 96)] * 990 + [(96, 72)] * 9 + [(40, 120)]
    assert auto_buckets(np.array(many), 64) == ((56, 72),)
    spread = [(64, k) for k in range(16, 257)]
    assert len(auto_buckets(np.array(spread), 64)) == 9
    # an SDXL-like set: multiples of 64 at side 1024
    sdxl = auto_buckets(np.array([(768, 1024)] * 50 + [(1024, 768)] * 30 + [(1024, 1024)] * 20), 1024)
    assert sdxl == ((1216, 832), (1024, 1024), (832, 1216)) and all(v % 64 == 0 for b in sdxl for v in b)


def test_auto_reads_headers_only_with_the_orientation(tmp_path):
    ex = Image.Exif()
    ex[0x0112] = 6
    buf = os.path.join(tmp_path, "r.jpg")
    Image.fromarray(PHOTO[:40, :100]).save(buf, quality=90, exif=ex.tobytes())
    with open(buf, "rb") as fh:
        data = fh.read()
    assert header_size(data) == (100, 40)  # shown turned
    assert header_size(data[:200], lambda: data) == (100, 40)  # a header longer than what was read
    assert header_size(b"not an image") is None
    png = cv2.imencode(".png", PHOTO[:30, :50])[1].tobytes()
    assert header_size(png) == (30, 50)


def test_from_dataset_with_buckets_and_auto(tmp_path):
    items = [np.ascontiguousarray(PHOTO[:h, :w]) for h, w in [(60, 90), (90, 60), (50, 50), (40, 100)]]
    for b in (BUCKETS, "auto:48"):
        dest = str(tmp_path / f"d{len(str(b))}")
        from_dataset(items, dest, buckets=b, workers=0, quiet=True)
        s = mmstore.open(dest)
        buckets = s.schema["image"].buckets
        for i, src in enumerate(items):
            bkt = ref_bucket(*src.shape[:2], buckets)
            assert np.array_equal(s[i]["image"], ref_record(src, bkt)[0])


def test_bad_lists_and_conflicting_options_are_refused(tmp_path, photos, capsys):
    root, _ = photos
    bad = [("256x", "is not HxW"), ("0x256", "side of 0"), ("256x256,256x256", "given twice"),
           ("128x128,256x256", "have one aspect"), ("40000x40000", "larger than"), ("auto:0", "positive side"),
           ("auto:x", "positive side"), ("", "is not HxW"), ([(1, 2, 3)], "not an \\(h, w\\) pair"),
           ([(1.5, 2)], "not an \\(h, w\\) pair")]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            parse_buckets(value)
        with pytest.raises(ValueError, match="expected"):
            ingest(root, str(tmp_path / "n"), buckets=value, workers=0, quiet=True)
    for kw, match in [({"size": 64}, "exclude each other"), ({"max_side": 64}, "exclude each other"),
                      ({"short_side": 64}, "exclude each other"), ({"resize": "pad"}, "goes with"),
                      ({"upscale": True}, "leave it out"), ({"layout": "chw"}, "layout")]:
        with pytest.raises(SourceError, match=match):
            ingest(root, str(tmp_path / "n"), buckets=BUCKETS, workers=0, quiet=True, **kw)
    assert not os.path.exists(tmp_path / "n") and not os.path.exists(tmp_path / "n.partial")
    rc, _, err = run_cli(["ingest", root, str(tmp_path / "n"), "--buckets", "256x"], capsys)
    assert rc == 2 and "--buckets auto, auto:N or HxW,HxW,..." in err, err
    rc, _, err = run_cli(["ingest", root, str(tmp_path / "n"), "--buckets", "64x64", "--size", "64"], capsys)
    assert rc == 2 and "--buckets ... and --size HxW exclude each other" in err, err


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000),
       st.lists(st.tuples(st.integers(1, 600), st.integers(1, 600)), min_size=1, max_size=8))
def test_the_chosen_bucket_is_the_nearest_and_the_crop_the_least(h, w, raw):
    kept: list[tuple[int, int]] = []
    for b in raw:  # a valid list: no two of one aspect
        if all(Fraction(b[1], b[0]) != Fraction(c[1], c[0]) for c in kept):
            kept.append(b)
    buckets = parse_buckets(kept)
    k = nearest_bucket(h, w, buckets)
    assert buckets[k] == ref_bucket(h, w, buckets)
    d = [abs(math.log(w / h) - math.log(bw / bh)) for bh, bw in buckets]
    assert d[k] <= min(d) + 1e-12
    # the least crop: before rounding, the share cut is 1 - exp(-distance), smallest for the nearest bucket
    assert math.isclose(1 - math.exp(-d[k]), min(1 - math.exp(-x) for x in d), abs_tol=1e-12)
    # the record is the centre crop to that bucket: one whole side of the source, the other the bucket's
    # aspect rounded half up, centred
    spec = DecodeSpec((1, 1), resize="buckets", buckets=buckets)
    img = np.zeros((h, w), np.uint8) if h * w <= 250_000 else None
    from mmstore.decode.pixels import _plan

    box, out_hw, dst = _plan(h, w, spec)
    bh, bw = buckets[k]
    x0, y0, x1, y1 = box
    cw, ch = x1 - x0, y1 - y0
    assert out_hw == (bh, bw) and dst == (0, 0, bw, bh)
    def rounded(x: Fraction, side: int) -> int:  # half up, at least 1, at most the source's side
        return min(side, max(1, math.floor(x + Fraction(1, 2))))

    if Fraction(w, h) >= Fraction(bw, bh):  # at least as wide as the bucket: the whole height is kept
        assert (ch, cw) == (h, rounded(Fraction(h * bw, bh), w))
    else:
        assert (cw, ch) == (w, rounded(Fraction(w * bh, bw), h))
    assert (x0, y0) == ((w - cw) // 2, (h - ch) // 2)
    assert math.isclose(crop_share(h, w, (bh, bw)), 1 - cw * ch / (h * w))
    if img is not None and h * w <= 2000:
        assert fit_array(img, spec).image.shape == (bh, bw, 3)


def test_auto_is_the_same_for_every_shard_worker_count_and_resume(tmp_path, photos):
    root, _ = photos
    full = str(tmp_path / "full")
    ingest(root, full, buckets="auto:40", codecs=["image=jpeg:90"], workers=0, quiet=True)
    parts = [str(tmp_path / f"p{k}") for k in range(2)]
    for k, p in enumerate(parts):  # each part sees a few inputs, but chooses from all of them
        ingest(root, p, buckets="auto:40", codecs=["image=jpeg:90"], shard=(k, 2), workers=0, quiet=True)
    assert {mmstore.open(p).schema["image"].buckets for p in parts} == {mmstore.open(full).schema["image"].buckets}
    m = merge(parts, str(tmp_path / "m"))
    assert np.array_equal(mmstore.open(full).slot_view.checksums(), mmstore.open(m).slot_view.checksums())
    args = ["--buckets", "auto:40", "--codec", "image=jpeg:90", "-q"]
    b = str(tmp_path / "b")
    assert popen_cli(["ingest", root, b, "--workers", "2", "--chunk", "1", *args]).wait(120) == 0
    assert_same_files(full, b)
    c = str(tmp_path / "c")  # a crash at the 3rd commit, then a resume: the same shapes, the same store
    p = popen_cli(["ingest", root, c, "--workers", "1", "--chunk", "1", *args], env={"MMSTORE_CRASH_AT": "commit:3"})
    assert p.wait(120) == 77 and os.path.isdir(c + ".partial")
    assert popen_cli(["ingest", root, c, "--workers", "2", "--resume", *args]).wait(120) == 0
    assert_same_files(b, c)


def test_coco_boxes_follow_the_bucket_crop(tmp_path):
    from ingest.test_coco import _pixel_box, make_coco

    path, imgs, rects = make_coco(str(tmp_path / "coco"), bad=False)
    dest = str(tmp_path / "s")
    ingest(path, dest, buckets=[(40, 40), (30, 50), (50, 30)], root=imgs, workers=0, quiet=True)
    s = mmstore.open(dest)
    n = 0
    for i in range(len(s)):
        r = s[i]
        h, w = r["image"].shape[:2]
        assert np.array_equal(to_source(np.array([[0.0, 0.0, w, h]]), r)[0], r["box"].astype(np.float64))
        for box, aid in zip(r["boxes"], r["annotation_id"]):
            assert np.all(np.abs(_pixel_box(r["image"], box) - box) <= 1.0), (s.key(i), aid, box)
            # mapped back: the annotation's source box, clipped to the region the crop kept
            x0, y0, x1, y1 = r["box"].tolist()
            a0, b0, a1, b1 = rects[int(aid)]
            want = [max(a0, x0), max(b0, y0), min(a1, x1), min(b1, y1)]
            assert np.allclose(to_source(box.astype(np.float64)[None], r)[0], want, atol=1e-3), (s.key(i), aid)
            n += 1
    assert n >= 4


def test_the_spec_keeps_its_buckets_through_its_dict():
    spec = make_spec(buckets=np.array([[64, 64], [48, 80]]), channels=1)
    assert spec.resize == "buckets" and spec.bucket_shapes == ((64, 64), (48, 80)) and spec.size == (64, 80)
    assert spec.record_shape() == (None, None, 1)
    assert DecodeSpec.from_dict(spec.to_dict()) == spec and spec.to_dict()["buckets"] == [[64, 64], [48, 80]]
    auto = make_spec(buckets="AUTO")
    assert auto.bucket_shapes is None and auto.size == (256, 256) and auto.to_dict()["buckets"] == "auto:256"
    assert DecodeSpec.from_dict(auto.to_dict()) == auto
    assert "buckets" not in make_spec((8, 8)).to_dict()  # specs without buckets keep their fingerprints
    with pytest.raises(ValueError, match="has not chosen its shapes"):
        fit_array(np.zeros((4, 4, 3), np.uint8), auto)
