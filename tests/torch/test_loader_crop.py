"""Train-time crops into a fixed output (``Loader(crop=RandomResizedCrop(...) / CenterCrop(...))``):
the crop boxes against an independent reimplementation of torchvision's published
``RandomResizedCrop.get_params`` fed the same random stream, and their distribution against the same
algorithm on another stream; batches pixel-exact against an OpenCV reference (cv2 decode, the same box,
cv2.resize) on crops of a real photograph, raw / jpeg / png / zstd records of their own shape and a
fixed-shape store; the same crops whatever the threads, after a resume in a new loader, and on every
rank; bad input."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest

import mmstore
from mmstore.engine.crop import CenterCrop, RandomResizedCrop, crop_box, crop_rng
from mmstore.errors import SchemaError

torch = pytest.importorskip("torch")
cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

from mmstore.torch import Loader, LoaderTuning  # noqa: E402

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
N = 14


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
            for r in range(40):
                rng = crop_rng(7, 3, r)
                want = tv_get_params(h, w, crop.scale, crop.ratio, rng.uniform,
                                     lambda a, b, g=rng: int(g.integers(a, b)))
                got = crop_box(crop, h, w, 7, 3, r)
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
    crop = RandomResizedCrop(24, flip=True)
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
