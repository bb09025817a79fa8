"""Train-time crops into a fixed output (``Loader(crop=RandomResizedCrop(...) / CenterCrop(...))``):
the crop boxes against an independent reimplementation of torchvision's published
``RandomResizedCrop.get_params`` fed the same random stream, and their distribution against the same
algorithm on another stream; batches pixel-exact against an OpenCV reference (cv2 decode, the same box,
cv2.resize) on crops of a real photograph, raw / jpeg / png / zstd records of their own shape and a
fixed-shape store (jpeg with ``dct_scale=False``; the DCT-scaled decode is tests/torch/test_crop_dct.py);
the same crops whatever the threads, after a resume in a new loader, and on every rank; bad input."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest

import mmstore
from mmstore.engine.crop import CenterCrop, RandomResizedCrop, crop_box, crop_boxes, crop_uniforms
from mmstore.errors import SchemaError

torch = pytest.importorskip("torch")
cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

from mmstore.torch import Loader, LoaderTuning  # noqa: E402

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
N = 14


def stream(seed, epoch, record):
    """The record's random stream (NOTE [crop parameters]) as torchvision's calls: ``uniform(a, b)``
    takes the attempts' draws 0..19 in turn, ``randint(lo, hi)`` the position's draws 20 and 21; and the
    flip's draw."""
    u = crop_uniforms(seed, epoch, [record])[0]
    att, pos = iter(u[:20].tolist()), iter(u[20:22].tolist())
    return (lambda a, b: a + (b - a) * next(att)), (lambda lo, hi: lo + math.floor(next(pos) * (hi - lo))), u[22]


def tv_get_params(h, w, scale, ratio, uniform, randint):
    """torchvision's RandomResizedCrop.get_params as published (transforms.py), written here from its
    description; ``uniform(a, b)`` and ``randint(lo, hi_exclusive)`` are the random stream."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * uniform(scale[0], scale[1])
        aspect_ratio = math.exp(uniform(log_ratio[0], log_ratio[1]))
        cw = int(round(math.sqrt(target_area * aspect_ratio)))
        ch = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            return randint(0, h - ch + 1), randint(0, w - cw + 1), ch, cw
    in_ratio = float(w) / float(h)
    if in_ratio < min(ratio):
        cw = w
        ch = int(round(cw / min(ratio)))
    elif in_ratio > max(ratio):
        ch = h
        cw = int(round(ch * max(ratio)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def ref_crop(img, box, size):
    """The OpenCV reference: the box, one cv2.resize (INTER_AREA unless a side grows), then the flip."""
    t, le, ch, cw, fl = box
    oh, ow = size
    grow = oh > ch or ow > cw
    out = cv2.resize(np.ascontiguousarray(img[t : t + ch, le : le + cw]), (ow, oh),
                     interpolation=cv2.INTER_LINEAR if grow else cv2.INTER_AREA)
    out = out.reshape(oh, ow, *img.shape[2:])
    return out[:, ::-1] if fl else out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Crops of a real photograph: landscape, portrait, square and a strip, saved as JPEG q95."""
    root = tmp_path_factory.mktemp("crops")
    os.makedirs(root / "a")
    rng = np.random.default_rng(5)
    for k in range(N):
        h, w = int(rng.integers(24, 400)), int(rng.integers(24, 400))
        if k == 0:
            h, w = 8, 300  # far outside the aspect range: the fallback
        y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
        cv2.imwrite(str(root / "a" / f"{k:02d}.jpg"), np.ascontiguousarray(PHOTO[y : y + h, x : x + w, ::-1]),
                    [cv2.IMWRITE_JPEG_QUALITY, 95])
    return str(root)


@pytest.fixture(scope="module")
def stores(folder, tmp_path_factory):
    out = {}
    for codec in ("raw", "jpeg:90", "png", "zstd"):
        dest = str(tmp_path_factory.mktemp("s") / codec.replace(":", ""))
        mmstore.ingest(folder, dest, max_side=64, codecs=None if codec == "raw" else [f"image={codec}"], workers=0,
                       quiet=True)
        out[codec.split(":")[0]] = dest
    return out


def source(store, i, codec):
    """Record ``i``'s pixels decoded by OpenCV from its stored entry (raw: the entry itself)."""
    s = mmstore.open(store)
    if codec == "raw":
        return s[i]["image"]
    flat, _ = s.slot_view.backend.gather_entries("image", np.array([s.slot_view.slot(i)]))
    if codec == "zstd":
        import zstandard

        h, w = s[i]["image_hw"].tolist()
        return np.frombuffer(zstandard.ZstdDecompressor().decompress(flat.tobytes()), np.uint8).reshape(h, w, 3)
    return cv2.imdecode(flat, cv2.IMREAD_COLOR_RGB)


def epoch_rows(loader, epoch=None):
    if epoch is not None:
        loader.set_epoch(epoch)
    return np.concatenate([b["image"].numpy().copy() for b in loader])


def test_boxes_are_torchvisions_draw_for_draw():
    sizes = [(500, 375), (64, 48), (1, 300), (300, 1), (8, 300), (224, 224), (2, 2), (1, 1), (37, 999)]
    crops = [RandomResizedCrop(224), RandomResizedCrop(32, scale=(0.5, 0.9), ratio=(1.0, 2.0)),
             RandomResizedCrop(16, scale=(0.95, 1.0), ratio=(2.5, 3.0))]
    fallbacks = 0
    for crop in crops:
        for h, w in sizes:
            batch = crop_boxes(crop, np.tile([h, w], (40, 1)), 7, 3, np.arange(40))  # drawn at once
            for r in range(40):
                uniform, randint, _ = stream(7, 3, r)
                want = tv_get_params(h, w, crop.scale, crop.ratio, uniform, randint)
                got = crop_box(crop, h, w, 7, 3, r)
                assert tuple(batch[r].tolist()) == (*got[:4], 0)
                if 0 in want[2:]:  # torchvision's empty fallback box (a 1-pixel side, a ratio above 2): 1 pixel
                    ch, cw = max(1, want[2]), max(1, want[3])
                    want = ((h - ch) // 2, (w - cw) // 2, ch, cw)
                assert got == (*want, False), (crop, h, w, r)
                t, le, ch, cw, _ = got
                assert 0 <= t and 0 <= le and 1 <= ch and t + ch <= h and 1 <= cw and le + cw <= w
                fallbacks += (t, le) == ((h - ch) // 2, (w - cw) // 2)
    assert fallbacks > 40  # the strips and the tight ranges take the fallback
    # the flip is the next draw, p = 0.5: the same box, about half mirrored, a function of (seed, epoch, record)
    flip = RandomResizedCrop(224, flip=True)
    boxes = [crop_box(flip, 300, 400, 1, 2, r) for r in range(400)]
    assert [b[:4] for b in boxes] == [crop_box(RandomResizedCrop(224), 300, 400, 1, 2, r)[:4] for r in range(400)]
    assert 150 < sum(b[4] for b in boxes) < 250
    assert [b[4] for b in boxes] == [bool(stream(1, 2, r)[2] < 0.5) for r in range(400)]
    assert boxes == [crop_box(flip, 300, 400, 1, 2, r) for r in range(400)]
    assert boxes != [crop_box(flip, 300, 400, 1, 3, r) for r in range(400)]  # another epoch, other boxes


def _chi2(a, b, edges):
    """Two-sample chi-square statistic of samples a, b over ``edges``, and its degrees of freedom."""
    ca, _ = np.histogram(a, edges)
    cb, _ = np.histogram(b, edges)
    keep = (ca + cb) > 0
    ca, cb = ca[keep].astype(float), cb[keep].astype(float)
    ka, kb = math.sqrt(cb.sum() / ca.sum()), math.sqrt(ca.sum() / cb.sum())
    return float((((ka * ca - kb * cb) ** 2) / (ca + cb)).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("hw", [(480, 640), (100, 900)])
def test_box_distribution_matches_torchvision_on_another_stream(hw):
    h, w = hw
    crop = RandomResizedCrop(224)
    ours = np.array([crop_box(crop, h, w, 11, 0, r)[:4] for r in range(6000)], float)
    py = random.Random(1234)
    theirs = np.array([tv_get_params(h, w, crop.scale, crop.ratio, py.uniform, py.randrange) for _ in range(6000)],
                      float)
    for stat in (lambda b: b[:, 2] * b[:, 3] / (h * w), lambda b: np.log(b[:, 3] / b[:, 2]),
                 lambda b: (b[:, 0] + b[:, 2] / 2) / h, lambda b: (b[:, 1] + b[:, 3] / 2) / w):
        a, b = stat(ours), stat(theirs)
        x2, dof = _chi2(a, b, np.quantile(np.concatenate([a, b]), np.linspace(0, 1, 21)))
        assert x2 < dof + 5 * math.sqrt(2 * dof), (x2, dof)  # ~5 sigma: a wrong rule is far beyond
    area = ours[:, 2] * ours[:, 3] / (h * w)
    if h == 480:  # the whole area range is reached, the aspect stays in range (up to integer rounding)
        assert area.min() < 0.1 and area.max() > 0.95
        asp = ours[:, 3] / ours[:, 2]
        assert asp.min() > 0.7 and asp.max() < 1.4


@pytest.mark.parametrize("codec", ["raw", "jpeg", "png", "zstd"])
def test_random_crops_are_pixel_exact_against_opencv(stores, codec):
    crop = RandomResizedCrop(24, flip=True, dct_scale=False)
    loader = Loader(stores[codec], 4, order=mmstore.order.OrderSpec("permutation", seed=9), crop=crop,
                    tuning=LoaderTuning(threads=3))
    assert ("full" if codec != "raw" else "view") in loader.describe()["crop"]["path"]
    got = epoch_rows(loader, 2)
    order = loader.order.epoch(2)
    assert got.shape == (N, 24, 24, 3) and got.dtype == np.uint8
    for j, i in enumerate(order.tolist()):
        img = source(stores[codec], i, codec)
        box = crop_box(crop, *img.shape[:2], 9, 2, i)
        assert np.array_equal(got[j], ref_crop(img, box, (24, 24))), (codec, i)


def test_center_crop_is_ffcvs_rule_and_output_sizes(stores):
    s = mmstore.open(stores["png"])
    for crop, size in ((CenterCrop(40), (40, 40)), (CenterCrop((16, 30), ratio=1.0), (16, 30))):
        loader = Loader(stores["png"], 5, order="sequential", crop=crop, fields=["image", "label"])
        got = epoch_rows(loader)
        assert got.shape == (N, *size, 3)
        for i in range(N):
            img = s[i]["image"]
            h, w = img.shape[:2]
            if size[0] == size[1]:  # FFCV: side int(ratio * short side), centred
                c = max(1, int(224 / 256 * min(h, w)))
                box = ((h - c) // 2, (w - c) // 2, c, c, False)
            else:
                sc = min(h / size[0], w / size[1])
                ch, cw = min(h, max(1, int(sc * size[0]))), min(w, max(1, int(sc * size[1])))
                box = ((h - ch) // 2, (w - cw) // 2, ch, cw, False)
            assert crop_box(crop, h, w, 0, 0, i) == box
            assert np.array_equal(got[i], ref_crop(img, box, size)), i
    # a centre crop larger than the record (the 8 x 300 strip, 40 x 40 out): enlarged, never padded
    assert min(s[0]["image_hw"].tolist()) < 40


def test_crop_of_a_fixed_shape_store_and_a_gray_one(tmp_path):
    rgb = np.ascontiguousarray(PHOTO[:240, :320].reshape(1, 240, 320, 3).repeat(6, 0))
    rgb[1:] = np.roll(rgb[1:], 17, axis=2)
    gray = np.ascontiguousarray(cv2.cvtColor(PHOTO[:100, :150], cv2.COLOR_RGB2GRAY)[None, :, :, None].repeat(6, 0))
    for arr, name in ((rgb, "rgb"), (gray, "gray")):
        np.save(tmp_path / f"{name}.npy", arr)
        dest = str(tmp_path / name)
        mmstore.ingest(str(tmp_path / f"{name}.npy"), dest, workers=0, quiet=True)
        s = mmstore.open(dest)
        (field,) = [f for f in s.schema.names if s.schema[f].shape[:2] == arr.shape[1:3]]
        crop = RandomResizedCrop((12, 20), flip=True)
        loader = Loader(dest, 4, order="sequential", crop=crop, tuning=LoaderTuning(threads=2))
        got = np.concatenate([b[field].numpy().copy() for b in loader])
        assert got.shape == (6, 12, 20, arr.shape[3])  # the channel count kept (gray: 1)
        for i in range(6):
            box = crop_box(crop, *arr.shape[1:3], 0, 0, i)
            assert np.array_equal(got[i], ref_crop(arr[i], box, (12, 20))), (name, i)


def test_same_crops_whatever_threads_after_resume_and_on_every_rank(stores):
    path = stores["jpeg"]
    spec = RandomResizedCrop(20, flip=True)

    def loader(threads=2, **kw):
        return Loader(path, 3, order=mmstore.order.OrderSpec("permutation", seed=4, **kw), crop=spec,
                      tuning=LoaderTuning(threads=threads))

    base = loader(threads=1)
    e0, e1 = epoch_rows(base), epoch_rows(base)
    assert not np.array_equal(e0, e1)  # another epoch: another order and other boxes
    assert np.array_equal(epoch_rows(loader(threads=4), 1), e1)
    # resume: 2 batches of epoch 1 delivered, then a new loader from the state gives the rest
    first = loader()
    first.set_epoch(1)
    it = iter(first)
    head = [next(it)["image"].numpy().copy() for _ in range(2)]
    state = first.state_dict()
    del it
    second = loader(threads=3)
    second.load_state_dict(state)
    rest = [b["image"].numpy().copy() for b in second]
    assert np.array_equal(np.concatenate(head + rest), e1)
    # two ranks: each record's crop is the single process's (a function of seed, epoch, record)
    by_record = {int(r): e1[j] for j, r in enumerate(base.order.epoch(1).tolist())}
    seen = []
    for rank in (0, 1):
        lr = loader(rank=rank, world_size=2)
        rows = epoch_rows(lr, 1)
        recs = lr.order.epoch(1).tolist()
        seen += recs
        for j, r in enumerate(recs):
            assert np.array_equal(rows[j], by_record[r])
    assert sorted(seen) == list(range(N))  # every record exactly once per epoch


def test_bad_crop_input(stores):
    path = stores["raw"]
    with pytest.raises(SchemaError, match=r"none of the fields read is an image.*'label'"):
        Loader(path, 2, fields=["label", "image_hw"], crop=RandomResizedCrop(8))
    with pytest.raises(SchemaError, match="'orig_size'.*not an image"):
        Loader(path, 2, crop=CenterCrop(8, field="orig_size"))
    with pytest.raises(TypeError, match="RandomResizedCrop or CenterCrop"):
        Loader(path, 2, crop=(224, 224))
    with pytest.raises(ValueError, match="ratio"):
        CenterCrop(224, ratio=1.5)
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCrop(224, scale=(0.5, 2.0))
    with pytest.raises(TypeError, match="size"):
        RandomResizedCrop("224")
    # without crop= the field is still refused, and the loader says so
    with pytest.raises(SchemaError, match="cannot stack"):
        Loader(path, 2)


def test_bad_crop_parameters_say_the_expected_form():
    for bad in (0, -3, (224, 0), (-1, 5)):
        with pytest.raises(ValueError, match=r"output's \(h, w\) in pixels, each at least 1"):
            RandomResizedCrop(bad)
        with pytest.raises(ValueError, match=r"output's \(h, w\) in pixels, each at least 1"):
            CenterCrop(bad)
    for ratio in ((2.0, 1.0), (0.0, 1.0), (-1.0, 2.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match=r"ratio must be a pair \(low, high\) of finite numbers with 0 < low"):
            RandomResizedCrop(224, ratio=ratio)
    for scale in ((0.0, 1.0), (0.5, 0.2), (0.5, 1.5)):
        with pytest.raises(ValueError, match=r"scale .*0 < low <= high"):
            RandomResizedCrop(224, scale=scale)
    for r in (0.0, 1.01, -0.5):
        with pytest.raises(ValueError, match=r"ratio is the box's side over the record's short side, in \(0, 1\]"):
            CenterCrop(224, ratio=r)


def test_crop_on_a_store_of_no_images_names_its_fields(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(60, dtype=np.float32).reshape(6, 10))
    mmstore.ingest(str(tmp_path / "x.npy"), str(tmp_path / "s"), workers=0, quiet=True)
    s = mmstore.open(str(tmp_path / "s"))
    with pytest.raises(SchemaError, match=r"none of the fields read is an image to crop \(.*<f4 \[10\]"):
        Loader(s, 2, crop=RandomResizedCrop(8))


@pytest.mark.parametrize("codec", ["raw", "jpeg:90"])
def test_a_1_x_5000_record_and_a_centre_crop_larger_than_records(tmp_path, codec):
    """A 1 x 5000 strip crops to a valid box (the fallback: the full height, the widest box of the ratio
    range) and a centre crop of a record smaller than the output takes a box inside the record,
    enlarged: never padded."""
    root = tmp_path / "f"
    os.makedirs(root / "a")
    strip = cv2.resize(PHOTO[200:201], (5000, 1), interpolation=cv2.INTER_LINEAR)
    cv2.imwrite(str(root / "a" / "0.png"), np.ascontiguousarray(strip[..., ::-1]))
    cv2.imwrite(str(root / "a" / "1.png"), np.ascontiguousarray(PHOTO[100:112, 50:70, ::-1]))
    dest = str(tmp_path / "s")
    mmstore.ingest(str(root), dest, max_side=5000, codecs=None if codec == "raw" else [f"image={codec}"], workers=0,
                   quiet=True)
    s = mmstore.open(dest)
    assert [tuple(s[i]["image_hw"].tolist()) for i in range(2)] == [(1, 5000), (12, 20)]
    for crop in (RandomResizedCrop(32, flip=True), CenterCrop(32), CenterCrop((16, 48), ratio=1.0)):
        got = epoch_rows(Loader(dest, 2, order="sequential", crop=crop, fields=["image"]))
        assert got.shape == (2, *crop.size, 3)
        for i in range(2):
            img = source(dest, i, codec.split(":")[0])
            h, w = img.shape[:2]
            box = crop_box(crop, h, w, 0, 0, i)
            t, le, ch, cw, _ = box
            assert 0 <= t and t + ch <= h and 0 <= le and le + cw <= w and ch >= 1 and cw >= 1
            if i == 0 and isinstance(crop, RandomResizedCrop):  # the fallback: full height, width 1 * 4/3
                assert box[:4] == (0, (5000 - 1) // 2, 1, 1)
            if i == 1 and isinstance(crop, CenterCrop) and crop.size == (32, 32):  # smaller than the output
                assert box[:4] == (1, 5, 10, 10)
            assert np.array_equal(got[i], ref_crop(img, box, crop.size)), (crop, i)


def follow_ref(rec_boxes, box, size):
    """Boxes through a crop, computed directly box by box: scale + offset, the flip, the clip to the output,
    the boxes with no area left dropped; returns (kept boxes, kept row numbers)."""
    t, le, ch, cw, fl = box
    oh, ow = size
    kept, rows = [], []
    for k, (x0, y0, x1, y1) in enumerate(np.asarray(rec_boxes, np.float64).tolist()):
        x0, x1 = (x0 - le) * ow / cw, (x1 - le) * ow / cw
        y0, y1 = (y0 - t) * oh / ch, (y1 - t) * oh / ch
        if fl:
            x0, x1 = ow - x1, ow - x0
        x0, x1 = min(max(x0, 0), ow), min(max(x1, 0), ow)
        y0, y1 = min(max(y0, 0), oh), min(max(y1, 0), oh)
        if x1 > x0 and y1 > y0:
            kept.append((x0, y0, x1, y1))
            rows.append(k)
    return np.array(kept, np.float64).reshape(-1, 4), rows


@pytest.mark.parametrize("codec", ["raw", "jpeg:90"])
def test_boxes_follow_the_crop(tmp_path, codec):
    from ingest.test_coco import make_coco

    path, imgs, _ = make_coco(str(tmp_path / "coco"), bad=False)
    dest = str(tmp_path / "s")
    mmstore.ingest(path, dest, max_side=64, root=imgs, codecs=None if codec == "raw" else [f"image={codec}"],
                   workers=0, quiet=True)
    s = mmstore.open(dest)
    per_box = ["category", "iscrowd", "annotation_id"]
    fields = ["image", "boxes", *per_box]
    seen = {"kept": 0, "dropped": 0, "flipped": 0}
    for crop in (RandomResizedCrop((24, 32), scale=(0.1, 0.6), flip=True, boxes="boxes", box_fields=per_box),
                 CenterCrop(24, ratio=0.5, boxes="boxes", box_fields=per_box)):
        loader = Loader(dest, 2, order=mmstore.order.OrderSpec("permutation", seed=5), crop=crop, fields=fields,
                        ragged="list")
        assert "boxes 'boxes' follow the crop" in loader.describe()["crop"]["path"]
        for epoch in range(6 if crop.random else 1):
            loader.set_epoch(epoch)
            order = loader.order.epoch(epoch).tolist()
            batches = list(loader)
            got = {k: [x.numpy() for b in batches for x in b[k]] for k in fields[1:]}
            for j, i in enumerate(order):
                rec = s[i]
                box = crop_box(crop, *rec["image_hw"].tolist(), 5, epoch, i)
                want, rows = follow_ref(rec["boxes"], box, crop.size)
                assert got["boxes"][j].dtype == np.float32 and got["boxes"][j].shape == want.shape, (i, epoch)
                assert np.allclose(got["boxes"][j], want, atol=1e-4), (i, epoch, box)
                for f in per_box:  # the same rows dropped
                    assert np.array_equal(got[f][j], rec[f][rows]), (f, i)
                seen["kept"] += len(rows)
                seen["dropped"] += len(rec["boxes"]) - len(rows)
                seen["flipped"] += bool(box[4] and rows)
    assert min(seen.values()) > 0, seen  # boxes kept, dropped and mirrored
    # bad input: a box field not read, one that holds no boxes, box_fields without boxes
    with pytest.raises(SchemaError, match="'boxes' is not among the fields read"):
        Loader(dest, 2, crop=RandomResizedCrop(8, boxes="boxes"), fields=["image", "category"])
    with pytest.raises(SchemaError, match=r"'category'.*is not boxes: expected xyxy rows of floats"):
        Loader(dest, 2, crop=RandomResizedCrop(8, boxes="category"), fields=["image", "category"])
    with pytest.raises(ValueError, match="go with boxes="):
        RandomResizedCrop(8, box_fields=["category"])
    with pytest.raises(SchemaError, match="has 8 rows of 'polygon_points' and 2 boxes of 'boxes'"):  # not per box
        next(iter(Loader(dest, 6, order="sequential", crop=CenterCrop(8, boxes="boxes", box_fields=["polygon_points"]),
                         fields=["image", "boxes", "polygon_points"])))


def test_polygons_follow_the_crop(tmp_path):
    """COCO's polygons through the crop against a direct computation: each point mapped, flipped, the
    polygon clipped to the output exactly, dropped with its box or under 3 points, box rows renumbered."""
    from ingest.test_coco import make_coco

    from mmstore.decode.geometry import clip_polygon

    path, imgs, _ = make_coco(str(tmp_path / "coco"), bad=False)
    dest = str(tmp_path / "s")
    mmstore.ingest(path, dest, max_side=64, root=imgs, workers=0, quiet=True)
    s = mmstore.open(dest)
    poly = ("polygon_points", "polygon_sizes", "polygon_box")
    crop = RandomResizedCrop(16, scale=(0.2, 0.7), flip=True, boxes="boxes", polygons=poly)
    loader = Loader(dest, 3, order=mmstore.order.OrderSpec("permutation", seed=2), crop=crop,
                    fields=["image", "boxes", *poly], ragged="list")
    clipped = dropped = kept = 0
    for epoch in range(8):
        loader.set_epoch(epoch)
        order = loader.order.epoch(epoch).tolist()
        batches = list(loader)
        got = {k: [x.numpy() for b in batches for x in b[k]] for k in ("boxes", *poly)}
        for j, i in enumerate(order):
            rec = s[i]
            t, le, ch, cw, fl = box = crop_box(crop, *rec["image_hw"].tolist(), 2, epoch, i)
            _, rows = follow_ref(rec["boxes"], box, crop.size)
            pts, sizes, owner = [], [], []
            at = 0
            for size, o in zip(rec["polygon_sizes"].tolist(), rec["polygon_box"].tolist()):
                q = rec["polygon_points"][at : at + size].astype(np.float64)
                at += size
                q = np.stack([(q[:, 0] - le) * 16 / cw, (q[:, 1] - t) * 16 / ch], 1)
                if fl:
                    q[:, 0] = 16 - q[:, 0]
                if o not in rows:
                    dropped += 1
                    continue
                c = clip_polygon(q, (0, 0, 16, 16))
                if len(c) < 3:
                    dropped += 1
                    continue
                clipped += len(c) != len(q) or not np.allclose(c, q)
                pts.append(c)
                sizes.append(len(c))
                owner.append(rows.index(o))
            kept += len(sizes)
            want = np.concatenate(pts) if pts else np.zeros((0, 2))
            assert np.allclose(got["polygon_points"][j], want, atol=1e-4), (i, epoch)
            assert got["polygon_sizes"][j].tolist() == sizes and got["polygon_box"][j].tolist() == owner, (i, epoch)
    assert kept and dropped and clipped, (kept, dropped, clipped)
    with pytest.raises(ValueError, match="polygons= go with boxes="):
        CenterCrop(8, polygons=poly)


@pytest.mark.parametrize("codec", ["raw", "jpeg"])
def test_a_damaged_size_or_offset_is_refused_not_cropped(stores, tmp_path, codec):
    """A record whose size field disagrees with its entry, or whose offsets leave the data file, is an
    EntryDecodeError naming the record, never pixels read from the wrong place (raw records are resized
    straight out of the mapped data file; jpeg ones decoded at a reduced scale)."""
    import shutil

    from mmstore.errors import EntryDecodeError

    dest = str(tmp_path / "s")
    shutil.copytree(stores[codec], dest)
    hw = np.load(os.path.join(dest, "image_hw.npy"), mmap_mode="r+")
    hw[3] = (hw[3][0] + 1, hw[3][1])
    hw.flush()
    del hw
    crop = CenterCrop(8)
    with pytest.raises(EntryDecodeError, match=r"record 3, slot 3: .*(bytes|JPEG of)"):
        epoch_rows(Loader(dest, 4, order="sequential", crop=crop, fields=["image"]))
    shutil.rmtree(dest)
    shutil.copytree(stores[codec], dest)
    offs = np.load(os.path.join(dest, "image.offsets.npy"), mmap_mode="r+")
    offs[6] = offs[-1] + 10  # past the end of the data file
    offs.flush()
    del offs
    with pytest.raises(EntryDecodeError, match=r"slot 5: its offsets .* not an increasing pair"):
        epoch_rows(Loader(dest, 4, order="sequential", crop=crop, fields=["image"]))
