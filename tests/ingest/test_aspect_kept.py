"""Aspect-kept records (``ingest --max-side N`` / ``--short-side N``): every record is its image at its
own aspect, pixel-exact against an OpenCV reference computed here from the documented rules, on crops of
a real photograph (EXIF-rotated, gray, RGBA, 16-bit too); raw, png, zstd and jpeg stores; the rounding
rule; images smaller than N; byte-identical stores whatever the workers and after SIGKILL + resume; COCO
boxes mapped back; the Loader's refusal; inspect, show, convert, merge and verify of such stores."""

from __future__ import annotations

import math
import os
import signal
import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compare import assert_same_files
from support.proc import popen_cli, run_cli, run_json

import mmstore
from mmstore.decode.geometry import to_source
from mmstore.decode.pixels import aspect_size
from mmstore.errors import AllInputsFailedError, SourceError
from mmstore.format.codecs import parse_codec
from mmstore.ingest import ingest, merge

cv2 = pytest.importorskip("cv2")
Image = pytest.importorskip("PIL.Image")
cbook = pytest.importorskip("matplotlib.cbook")


def ref_hw(h: int, w: int, n: int, short: bool = False, upscale: bool = False) -> tuple[int, int]:
    """The documented size rule, computed with exact fractions: the long (short) side becomes n, the other
    is rounded half up, at least 1; an image whose side is at most n is kept unless upscale."""
    side = min(h, w) if short else max(h, w)
    if side == n or (side < n and not upscale):
        return h, w
    s = Fraction(n, side)
    return max(1, math.floor(h * s + Fraction(1, 2))), max(1, math.floor(w * s + Fraction(1, 2)))


def ref_resize(src: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """One cv2.resize to (h, w): INTER_AREA when no side grows, else INTER_LINEAR; none when the size is kept."""
    if src.shape[:2] == hw:
        return src.copy()
    grow = hw[0] > src.shape[0] or hw[1] > src.shape[1]
    return cv2.resize(src, (hw[1], hw[0]), interpolation=cv2.INTER_LINEAR if grow else cv2.INTER_AREA)


PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A folder of crops of a real photograph: landscape, portrait and square JPEGs, a JPEG with EXIF
    orientation 6, a gray JPEG, an RGBA PNG, a 16-bit PNG, an image smaller than N and a 1 x 300 strip.
    Returns (folder, {file name: the source S the documented rules decode it to, RGB or gray})."""
    root = str(tmp_path_factory.mktemp("photos"))
    p = PHOTO
    want: dict[str, np.ndarray] = {}

    def jpg(name, rgb, **kw):
        Image.fromarray(rgb).save(os.path.join(root, name), quality=95, **kw)
        want[name] = cv2.imread(os.path.join(root, name), cv2.IMREAD_COLOR_RGB)  # EXIF applied by OpenCV

    jpg("a_wide.jpg", p[100:220, 0:480])
    jpg("b_tall.jpg", p[0:600, 100:300])
    jpg("c_square.jpg", p[200:350, 150:300])
    ex = Image.Exif()
    ex[0x0112] = 6  # rotate 90 clockwise to show
    jpg("d_exif.jpg", p[50:130, 60:300], exif=ex.tobytes())
    assert want["d_exif.jpg"].shape == (240, 80, 3)  # shown turned: the oriented size
    gray = cv2.cvtColor(p[300:420, 0:330], cv2.COLOR_RGB2GRAY)
    Image.fromarray(gray).save(os.path.join(root, "e_gray.jpg"), quality=95)
    want["e_gray.jpg"] = np.repeat(cv2.imread(os.path.join(root, "e_gray.jpg"), cv2.IMREAD_GRAYSCALE)[..., None], 3, 2)
    rgb = p[400:500, 200:360]
    a = np.tile(np.linspace(0, 255, 160).astype(np.uint8), (100, 1))
    cv2.imwrite(os.path.join(root, "f_rgba.png"), np.dstack([rgb[..., ::-1], a]))
    want["f_rgba.png"] = ((rgb.astype(np.int64) * a[..., None] + 127) // 255).astype(np.uint8)  # over black
    deep = p[0:90, 300:512].astype(np.uint16) * 257 + 3
    cv2.imwrite(os.path.join(root, "g_16bit.png"), deep[..., ::-1])
    want["g_16bit.png"] = (deep >> 8).astype(np.uint8)
    jpg("h_small.jpg", p[0:30, 0:40])
    cv2.imwrite(os.path.join(root, "i_strip.png"), np.ascontiguousarray(p[0:1, 0:300, ::-1]))
    want["i_strip.png"] = p[0:1, 0:300].copy()
    return root, want


@pytest.mark.parametrize("codec", ["raw", "png", "zstd"])
def test_max_side_records_are_exact_against_opencv(tmp_path, photos, codec):
    root, want = photos
    dest = str(tmp_path / "s")
    codecs = None if codec == "raw" else [f"image={codec}"]
    ingest(root, dest, max_side=64, codecs=codecs, workers=0, quiet=True)
    s = mmstore.open(dest)
    m = s.manifest
    assert m["version"] == (2, 3) and m["requires"] == ["shapes"] and len(s) == len(want)
    assert s.schema["image"].shape == (None, None, 3) and s.schema.names[:2] == ("image", "image_hw")
    for i in range(len(s)):
        r, name = s[i], s.key(i)
        S = want[name]
        hw = ref_hw(*S.shape[:2], 64)
        assert r["image"].shape == (*hw, 3) and r["image_hw"].tolist() == list(hw), name
        assert np.array_equal(r["image"], ref_resize(S, hw)), name
        assert r["orig_size"].tolist() == list(S.shape[:2])
        assert r["box"].tolist() == [0, 0, S.shape[1], S.shape[0]] and r["dst"].tolist() == [0, 0, hw[1], hw[0]]
    shapes = {s.key(i): s[i]["image"].shape[:2] for i in range(len(s))}
    assert shapes["h_small.jpg"] == (30, 40)  # smaller than N: kept at its own size
    assert shapes["i_strip.png"] == (1, 64) and shapes["a_wide.jpg"] == (16, 64)
    # a batch: a list of arrays in the requested order (duplicates too); out= refused for the field
    order = [3, 0, 3, 7]
    b = s.read_batch(order)
    assert isinstance(b["image"], list) and [x.shape[:2] for x in b["image"]] == [shapes[s.key(i)] for i in order]
    assert all(np.array_equal(x, s[i]["image"]) for x, i in zip(b["image"], order))
    assert list(s.read_batch([1], fields="image")) == ["image"]
    with pytest.raises(TypeError, match="images of their own shape"):
        s.read_batch([0, 1], out={"image": np.empty((2, 64, 64, 3), np.uint8)})
    # every file still opens with plain numpy
    for f in os.listdir(dest):
        if f.endswith(".npy"):
            np.load(os.path.join(dest, f), allow_pickle=False)
    hws = np.load(os.path.join(dest, "image_hw.npy"))
    assert hws.dtype == np.dtype("<u4") and hws.tolist() == [list(shapes[s.key(i)]) for i in range(len(s))]
    offs = np.load(os.path.join(dest, "image.offsets.npy"))
    if codec == "raw":  # the entry is the C-ordered bytes of h x w x 3
        blob = np.fromfile(os.path.join(dest, "image.bin"), np.uint8)
        assert np.array_equal(blob[offs[2] : offs[3]].reshape(*hws[2], 3), s[2]["image"])
    rep = mmstore.verify(dest, decode=True)
    assert rep.ok, rep


def test_jpeg_records_are_the_reencoded_reference(tmp_path, photos):
    root, want = photos
    dest = str(tmp_path / "j")
    ingest(root, dest, max_side=100, codecs=["image=jpeg:90"], workers=0, quiet=True, backend="lmdb")
    s = mmstore.open(dest)
    jpeg = parse_codec("jpeg:90")
    for i in range(len(s)):
        S = want[s.key(i)]
        ref = ref_resize(S, ref_hw(*S.shape[:2], 100))
        assert np.array_equal(s[i]["image"], jpeg.decode(jpeg.encode(ref), np.uint8, ref.shape)), s.key(i)
    assert mmstore.verify(dest, decode=True).ok


def test_short_side_and_upscale(tmp_path, photos):
    root, want = photos
    for up in (False, True):
        dest = str(tmp_path / f"s{up}")
        ingest(root, dest, short_side=48, upscale=up, workers=0, quiet=True)
        s = mmstore.open(dest)
        for i in range(len(s)):
            S = want[s.key(i)]
            hw = ref_hw(*S.shape[:2], 48, short=True, upscale=up)
            assert np.array_equal(s[i]["image"], ref_resize(S, hw)), s.key(i)
        got = {s.key(i): s[i]["image"].shape[:2] for i in range(len(s))}
        assert got["h_small.jpg"] == ((48, 64) if up else (30, 40))  # enlarged only when asked
        assert got["i_strip.png"] == ((48, 14400) if up else (1, 300))
        assert got["a_wide.jpg"] == (48, 192)
    dest = str(tmp_path / "big")
    ingest(root, dest, max_side=256, upscale=True, workers=0, quiet=True)
    s = mmstore.open(dest)
    got = {s.key(i): s[i]["image"].shape[:2] for i in range(len(s))}
    assert got["h_small.jpg"] == (192, 256) and got["i_strip.png"] == (1, 256)


def test_extreme_aspect_1_by_5000(tmp_path):
    root = str(tmp_path / "x")
    os.makedirs(root)
    strip = np.ascontiguousarray(np.resize(PHOTO[:, :, ::-1], (1, 5000, 3)))
    cv2.imwrite(os.path.join(root, "strip.png"), strip)
    ingest(root, str(tmp_path / "s"), max_side=256, workers=0, quiet=True)
    r = mmstore.open(str(tmp_path / "s"))[0]
    assert r["image"].shape == (1, 256, 3) and r["image_hw"].tolist() == [1, 256]
    assert np.array_equal(r["image"], cv2.resize(strip[..., ::-1], (256, 1), interpolation=cv2.INTER_AREA))
    # enlarged by its short side to 256 x 1,280,000 pixels: more than max_pixels allows, refused, not made
    with pytest.raises(AllInputsFailedError, match="too-large"):
        ingest(root, str(tmp_path / "u"), short_side=256, upscale=True, max_pixels=10**6, workers=0, quiet=True)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 1024), st.booleans(), st.booleans())
def test_rounding_rule(h, w, n, short, up):
    got = aspect_size(h, w, n, short, up)
    assert got == ref_hw(h, w, n, short, up)
    side = min(got) if short else max(got)
    assert side == n or (got == (h, w) and (min(h, w) if short else max(h, w)) < n and not up)
    assert min(got) >= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 80), st.integers(1, 80), st.integers(1, 64), st.booleans(), st.booleans(), st.booleans())
def test_fit_array_follows_the_rule_pixel_exactly(h, w, n, short, up, gray):
    from mmstore.decode import DecodeSpec, fit_array

    src = np.ascontiguousarray(PHOTO[:h, :w, 0] if gray else PHOTO[:h, :w])
    spec = DecodeSpec((n, n), resize="short-side" if short else "max-side", upscale=up, channels=1 if gray else 3)
    d = fit_array(src, spec)
    hw = ref_hw(h, w, n, short, up)
    want = ref_resize(src, hw)
    assert np.array_equal(d.image, want[..., None] if gray else want)
    assert d.box == (0, 0, w, h) and d.dst == (0, 0, hw[1], hw[0]) and d.orig_size == (h, w)


def test_options_exclude_each_other(tmp_path, photos, capsys):
    root, _ = photos
    for kw, pick in [({"size": 32, "max_side": 32}, "size=(H, W)"), ({"max_side": 3, "short_side": 3}, "max_side=N"),
                     ({"max_side": 32, "resize": "pad"}, "resize='pad'"), ({"size": 32, "upscale": True}, "upscale"),
                     ({"short_side": 32, "layout": "chw"}, "layout='chw'")]:
        with pytest.raises(SourceError, match="pick one|goes with|enlarges|is for records of one") as exc:
            ingest(root, str(tmp_path / "n"), workers=0, quiet=True, **kw)
        assert pick in str(exc.value)
    assert not os.path.exists(tmp_path / "n") and not os.path.exists(tmp_path / "n.partial")
    rc, _, err = run_cli(["ingest", root, str(tmp_path / "n"), "--size", "32", "--max-side", "32"], capsys)
    assert rc == 2 and "--size HxW and --max-side N exclude each other: pick one" in err
    rc, _, err = run_cli(["ingest", root, str(tmp_path / "n"), "--max-side", "0"], capsys)
    assert rc == 2 and "positive number of pixels" in err


def test_byte_identical_whatever_the_workers_and_after_sigkill(tmp_path, photos):
    root, _ = photos
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ["--max-side", "80", "--codec", "image=jpeg:90", "-q"]
    assert popen_cli(["ingest", root, a, "--workers", "1", *args]).wait(120) == 0
    assert popen_cli(["ingest", root, b, "--workers", "2", "--chunk", "1", *args]).wait(120) == 0
    assert_same_files(a, b)
    # a crash mid-run (the process dies at its 3rd commit), then a real SIGKILL, each resumed
    c = str(tmp_path / "c")
    p = popen_cli(["ingest", root, c, "--workers", "1", "--chunk", "1", *args], env={"MMSTORE_CRASH_AT": "commit:3"})
    assert p.wait(120) == 77 and os.path.isdir(c + ".partial")
    assert popen_cli(["ingest", root, c, "--workers", "2", "--resume", *args]).wait(120) == 0
    assert_same_files(a, c)
    d = str(tmp_path / "d")
    p = popen_cli(["ingest", root, d, "--workers", "1", "--chunk", "1", *args])
    deadline = time.monotonic() + 60
    while not os.path.isdir(d + ".partial") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    assert popen_cli(["ingest", root, d, "--workers", "1", "--resume", *args]).wait(120) == 0
    assert_same_files(a, d)


def test_shards_merge_and_convert(tmp_path, photos, capsys):
    root, _ = photos
    full = str(tmp_path / "full")
    ingest(root, full, max_side=50, workers=0, quiet=True)
    parts = [str(tmp_path / f"p{k}") for k in range(2)]
    for k, p in enumerate(parts):
        ingest(root, p, max_side=50, shard=(k, 2), workers=0, quiet=True)
    m = merge(parts, str(tmp_path / "m"))
    a, b = mmstore.open(full), mmstore.open(m)
    assert np.array_equal(a.slot_view.checksums(), b.slot_view.checksums())
    assert all(np.array_equal(a[i]["image"], b[i]["image"]) for i in range(len(a)))
    for spec in ("image=png", "image=zstd:5", "image=jpeg:80"):
        out = str(tmp_path / spec.replace(":", "_").replace("=", "_"))
        rc, _, err = run_cli(["convert", m, out, "--codec", spec, "--backend", "lmdb"], capsys)
        assert rc == 0, err
        c = mmstore.open(out)
        assert c.schema["image"].codec.spec.startswith(spec.split("=")[1].split(":")[0])
        for i in range(len(a)):
            assert c[i]["image"].shape == a[i]["image"].shape
            if "jpeg" not in spec:
                assert np.array_equal(c[i]["image"], a[i]["image"])
        assert mmstore.verify(out, decode=True).ok
    rc, rep = run_json(["inspect", full], capsys)
    sh = rep["image_shapes"]
    hw = a.column("image_hw")
    assert rc == 0 and sh["field"] == "image" and sh["max_h"] == int(hw[:, 0].max()) == 50
    assert sh["min_w"] == int(hw[:, 1].min()) and sh["distinct"] == len({tuple(x) for x in hw.tolist()})
    rc, _, err = run_cli(["show", full, "-o", str(tmp_path / "grid.png")], capsys)
    assert rc == 0 and os.path.getsize(tmp_path / "grid.png") > 0, err


def test_verify_finds_a_damaged_size(tmp_path, photos, capsys):
    root, _ = photos
    for codec in ("raw", "jpeg"):
        dest = str(tmp_path / codec)
        ingest(root, dest, max_side=40, codecs=[f"image={codec}"], workers=0, quiet=True)
        hw = np.load(os.path.join(dest, "image_hw.npy"), mmap_mode="r+")
        slot = 1
        if codec == "raw":
            hw[slot, 0] ^= 1  # another size: the entry's byte count no longer fits
        else:
            hw[slot] = hw[slot][::-1].copy()  # h and w swapped: the JPEG's header says otherwise
        hw.flush()
        del hw
        s = mmstore.open(dest)
        with pytest.raises(mmstore.errors.EntryDecodeError, match=r"record 1 .*field 'image'.*image_hw"):
            s[1]
        with pytest.raises(mmstore.errors.EntryDecodeError, match="record 1 "):
            s.read_batch([0, 1])
        rc, rep = run_json(["verify", dest], capsys)
        found = {(b["what"], b["slot"]) for b in rep["bad_records"]}
        assert rc == 1 and ("shape", slot) in found and ("checksum", slot) in found, rep


def test_coco_boxes_map_back(tmp_path):
    from ingest.test_coco import _check_boxes_against_pixels, make_coco

    path, imgs, rects = make_coco(str(tmp_path / "coco"), bad=False)
    for n, up in ((40, False), (100, False), (100, True)):
        dest = str(tmp_path / f"s{n}{up}")
        ingest(path, dest, max_side=n, upscale=up, root=imgs, workers=0, quiet=True)
        s = mmstore.open(dest)
        assert _check_boxes_against_pixels(s, rects) == 5
        for i in range(len(s)):
            r = s[i]
            h, w = r["image"].shape[:2]
            corner = to_source(np.array([[0.0, 0.0, w, h]]), r)[0]
            assert np.allclose(corner, [0, 0, r["orig_size"][1], r["orig_size"][0]])


def test_loader_refuses_and_dataset_reads_own_shape(tmp_path, photos):
    torch = pytest.importorskip("torch")
    from mmstore.torch import Loader, StoreDataset

    root, _ = photos
    dest = str(tmp_path / "s")
    ingest(root, dest, max_side=40, workers=0, quiet=True)
    with pytest.raises(mmstore.errors.SchemaError, match=r"cannot stack field\(s\) \['image'\].*fields=\["):
        Loader(dest, batch_size=2)
    batch = next(iter(Loader(dest, batch_size=3, fields=["image_hw", "orig_size"], order="sequential")))
    assert batch["image_hw"].tolist() == mmstore.open(dest).column("image_hw")[:3].tolist()
    ds = StoreDataset(dest)
    assert isinstance(ds[0]["image"], torch.Tensor) and tuple(ds[0]["image"].shape) == (*ds[0]["image_hw"].tolist(), 3)
    with pytest.raises(mmstore.errors.SchemaError, match="cannot stack"):
        ds.__getitems__([0, 1])


def test_push_pull_and_reads_from_a_url(tmp_path, photos, s3):
    pytest.importorskip("obstore")
    from mmstore.transfer import pull, push

    root, _ = photos
    dest = str(tmp_path / "s")
    ingest(root, dest, max_side=60, codecs=["image=jpeg:90"], workers=0, quiet=True)
    url = s3.url("own.store")
    push(dest, url, block_bytes=64 << 10)
    local = mmstore.open(dest)
    with mmstore.open(url, cache_dir=tmp_path / "cache") as remote:
        assert remote.schema == local.schema
        assert all(np.array_equal(remote[i]["image"], local[i]["image"]) for i in range(len(local)))
        got = remote.read_batch([4, 1])["image"]
        assert all(np.array_equal(g, local[i]["image"]) for g, i in zip(got, (4, 1)))
    rep = pull(url, tmp_path / "pulled")
    assert rep["verified_records"] == len(local)
    assert_same_files(dest, str(tmp_path / "pulled"))
