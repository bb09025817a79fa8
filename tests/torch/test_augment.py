"""Batch augmentation against per-image references written with
plain torch ops after torchvision's definitions; parameter properties;
reproducibility across pipelines, processes and devices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore.torch import Loader, gpu
from mmstore.torch import augment as A
from mmstore.torch.augment.geometry import _padding4, _rrc_params

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def images(n=6, h=29, w=41, c=3, seed=0):
    return torch.randint(0, 256, (n, h, w, c), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- per-image references (CHW, torchvision's definitions) ------------------------------------


def ref_resized_crop(img, box, size):
    t, l, h, w = box
    x = img[:, t:t + h, l:l + w].float()[None]
    y = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=False)[0]
    return y.round().clamp(0, 255).to(img.dtype) if img.dtype == torch.uint8 else y


def ref_pad(img, l, t, r, b, mode, fill):
    if mode == "symmetric":  # torchvision's own mode: mirror including the edge pixel
        x = torch.cat([img[:, :, :l].flip(2), img, img[:, :, img.shape[2] - r:].flip(2)], dim=2)
        return torch.cat([x[:, :t].flip(1), x, x[:, x.shape[1] - b:].flip(1)], dim=1)
    if mode == "constant":
        out = torch.empty(img.shape[0], img.shape[1] + t + b, img.shape[2] + l + r, dtype=img.dtype)
        out[:] = torch.as_tensor(fill, dtype=img.dtype).view(-1, 1, 1)
        out[:, t:t + img.shape[1], l:l + img.shape[2]] = img
        return out
    padded = F.pad(img[None].float(), (l, r, t, b), mode={"edge": "replicate", "reflect": "reflect"}[mode])
    return padded[0].to(img.dtype)


def ref_grey(img):
    r, g, b = img.float().unbind(0)
    return (0.2989 * r + 0.587 * g + 0.114 * b).to(img.dtype)[None]


def ref_blend(img1, img2, ratio):
    bound = 1.0 if img1.is_floating_point() else 255
    return (ratio * img1.float() + (1.0 - ratio) * img2.float()).clamp(0, bound).to(img1.dtype)


def ref_jitter(img, factors, order):
    for k in order:
        f = float(factors[k])
        if k == 0:
            img = ref_blend(img, torch.zeros_like(img), f)
        elif k == 1:
            mean = ref_grey(img).float().mean(dim=(-3, -2, -1), keepdim=True)
            img = ref_blend(img, mean, f)
        else:
            img = ref_blend(img, ref_grey(img), f)
    return img


# -- batched == per-image reference -----------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHWC", "NCHW", "NCHW-view"])
def test_random_resized_crop_matches_reference(layout):
    x = images()
    g = torch.Generator().manual_seed(3)
    boxes = A.random_resized_crop_params(len(x), 29, 41, generator=g)
    inp = {"NHWC": x, "NCHW": x.permute(0, 3, 1, 2).contiguous(), "NCHW-view": x.permute(0, 3, 1, 2)}[layout]
    lay = layout[:4]
    y = A.resized_crop(inp, boxes, (17, 23), layout=lay)
    yc = y if lay == "NCHW" else y.permute(0, 3, 1, 2)
    assert yc.shape == (6, 3, 17, 23) and y.dtype == torch.uint8
    assert y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last)
    for n in range(len(x)):
        ref = ref_resized_crop(x[n].permute(2, 0, 1), boxes[n].tolist(), (17, 23))
        assert (yc[n].int() - ref.int()).abs().max() <= 1  # within 1/255 (rounding order)
    # same draws through random_resized_crop
    g2 = torch.Generator().manual_seed(3)
    assert torch.equal(A.random_resized_crop(inp, (17, 23), generator=g2, layout=lay), y)


def test_resized_crop_float_matches_interpolate():
    x = torch.rand(5, 3, 31, 22, generator=torch.Generator().manual_seed(1))
    boxes = torch.tensor([[0, 0, 31, 22], [3, 4, 10, 9], [30, 21, 1, 1], [5, 0, 20, 22], [0, 7, 31, 15]])
    for size in [(8, 8), (40, 13), (31, 22)]:
        y = A.resized_crop(x, boxes, size, layout="NCHW")
        for n in range(5):
            torch.testing.assert_close(y[n], ref_resized_crop(x[n], boxes[n].tolist(), size), atol=1e-5, rtol=1e-5)


def test_resized_crop_rejects_boxes_outside():
    x = images(2)
    with pytest.raises(ValueError, match="not inside"):
        A.resized_crop(x, [[0, 0, 29, 41], [1, 0, 29, 41]], 8)
    with pytest.raises(ValueError, match="shape"):
        A.resized_crop(x, [[0, 0, 29, 41]], 8)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "symmetric"])
@pytest.mark.parametrize("padding", [None, 3, (2, 5), (1, 2, 3, 4)])
def test_random_crop_matches_reference(mode, padding):
    x = images(7, 9, 11)
    fill = (10, 200, 77)
    size = (8, 10) if padding is None else (12, 13)
    y = A.random_crop(x, size, padding, fill=fill, padding_mode=mode, generator=torch.Generator().manual_seed(5))
    l, t, r, b = _padding4(padding)
    offs = A.random_crop_params(7, 9 + t + b, 11 + l + r, size, torch.Generator().manual_seed(5))
    assert len(set(map(tuple, offs.tolist()))) > 1  # per-image offsets
    for n in range(7):
        p = ref_pad(x[n].permute(2, 0, 1), l, t, r, b, mode, fill)
        i, j = offs[n].tolist()
        assert torch.equal(y[n].permute(2, 0, 1), p[:, i:i + size[0], j:j + size[1]])  # exact


def test_random_crop_pad_if_needed_and_errors():
    x = images(4, 5, 6)
    g = torch.Generator().manual_seed(0)
    y = A.random_crop(x, (9, 8), pad_if_needed=True, fill=7, generator=g)
    assert y.shape == (4, 9, 8, 3)
    offs = A.random_crop_params(4, 5 + 8, 6 + 4, (9, 8), torch.Generator().manual_seed(0))
    for n in range(4):
        p = ref_pad(x[n].permute(2, 0, 1), 2, 4, 2, 4, "constant", 7)
        i, j = offs[n].tolist()
        assert torch.equal(y[n].permute(2, 0, 1), p[:, i:i + 9, j:j + 8])
    with pytest.raises(ValueError, match="pad_if_needed"):
        A.random_crop(x, 6)
    with pytest.raises(ValueError, match="padding_mode"):
        A.random_crop(x, 4, padding_mode="wrap")
    # the whole image: offset 0
    assert torch.equal(A.random_crop(x, (5, 6)), x)


@pytest.mark.parametrize("mode", ["reflect", "symmetric", "edge"])
def test_random_crop_pad_if_needed_pads_in_stages(mode):
    """torchvision pads ``padding`` first, then the missing width, then the missing height,
    each a mirror of the image padded so far."""
    x = images(3, 4, 5)
    y = A.random_crop(x, (10, 11), padding=1, pad_if_needed=True, padding_mode=mode,
                      generator=torch.Generator().manual_seed(1))
    offs = A.random_crop_params(3, 4 + 2 + 8, 5 + 2 + 8, (10, 11), torch.Generator().manual_seed(1))
    for n in range(3):
        p = ref_pad(x[n].permute(2, 0, 1), 1, 1, 1, 1, mode, 0)
        p = ref_pad(p, 4, 0, 4, 0, mode, 0)
        p = ref_pad(p, 0, 4, 0, 4, mode, 0)  # each side by the whole missing amount, as torchvision
        i, j = offs[n].tolist()
        assert torch.equal(y[n].permute(2, 0, 1), p[:, i:i + 10, j:j + 11])


def test_inputs_are_never_modified():
    x = images(4, 20, 24)
    xf = x.float() / 255
    keep, keepf = x.clone(), xf.clone()
    A.color_jitter(xf, 0.5, 0.5, 0.5, torch.Generator().manual_seed(0), order="fixed")
    A.adjust_colors(xf, torch.full((4, 3), 0.5), (1, 2, 0))
    A.imagenet_train(16, jitter=0.4)(x)
    A.Pipeline([A.RandomCrop(16, padding=2), A.HorizontalFlip(1.0), A.ColorJitter(0.3, 0.3, 0.3)])(xf)
    assert torch.equal(x, keep) and torch.equal(xf, keepf)


def test_horizontal_flip_exact_and_gpu_alias():
    x = images(16)
    y = A.horizontal_flip(x, 0.5, torch.Generator().manual_seed(2))
    mask = torch.rand(16, generator=torch.Generator().manual_seed(2)) < 0.5
    for n in range(16):
        assert torch.equal(y[n], x[n].flip(1) if mask[n] else x[n])
    assert 0 < int(mask.sum()) < 16
    assert gpu.random_flip is A.random_flip and gpu.normalize is A.normalize  # one implementation
    yc = A.horizontal_flip(x.permute(0, 3, 1, 2), 0.5, torch.Generator().manual_seed(2), layout="NCHW")
    assert torch.equal(yc, y.permute(0, 3, 1, 2))


@pytest.mark.parametrize("order", ["batch", "fixed"])
def test_color_jitter_matches_reference(order):
    x = images(8)
    x[0] = 255  # saturated and flat images
    x[1] = 0
    g = torch.Generator().manual_seed(9)
    y = A.color_jitter(x, 0.4, 0.5, (0.2, 1.9), g, order=order)
    factors, perm = A.color_jitter_params(8, 0.4, 0.5, (0.2, 1.9), torch.Generator().manual_seed(9), order)
    assert sorted(perm) == [0, 1, 2] and (order == "batch" or perm == (0, 1, 2))
    assert float(factors[:, 0].min()) >= 0.6 and float(factors[:, 0].max()) <= 1.4
    assert float(factors[:, 2].min()) >= 0.2 and float(factors[:, 2].max()) <= 1.9
    assert len(set(factors[:, 1].tolist())) == 8  # per image
    for n in range(8):
        ref = ref_jitter(x[n].permute(2, 0, 1), factors[n], perm)
        assert (y[n].permute(2, 0, 1).int() - ref.int()).abs().max() <= 1
    # float images in [0, 1]: the same formulas, clamped to 1, no truncation
    xf = x.permute(0, 3, 1, 2).float() / 255
    yf = A.adjust_colors(xf, factors, perm, layout="NCHW")
    for n in range(8):
        torch.testing.assert_close(yf[n], ref_jitter(xf[n], factors[n], perm), atol=1e-5, rtol=1e-5)
    # every order of the three adjustments is reached over batches
    perms = {A.color_jitter_params(2, 0.1, 0.1, 0.1, torch.Generator().manual_seed(s))[1] for s in range(60)}
    assert len(perms) == 6


def test_color_jitter_identity_and_errors():
    x = images(3)
    assert torch.equal(A.color_jitter(x), x)
    assert torch.equal(A.adjust_colors(x, torch.ones(3, 3)), x)
    with pytest.raises(ValueError):
        A.color_jitter(x, brightness=-1)
    with pytest.raises(ValueError):
        A.color_jitter(x, 0.1, order="per-image")
    with pytest.raises(ValueError):
        A.adjust_colors(images(3, c=4), torch.ones(3, 3))


def test_resize_and_center_crop_match_reference():
    x = images(3, 30, 40)
    y = A.resize(x, 20)  # shorter side 20, aspect kept
    assert y.shape == (3, 20, 26, 3)
    ref = F.interpolate(x.permute(0, 3, 1, 2).float(), size=(20, 26), mode="bilinear", align_corners=False,
                        antialias=True)
    assert (y.permute(0, 3, 1, 2).float() - ref.round()).abs().max() <= 1
    c = A.center_crop(x, (10, 15))
    assert torch.equal(c, x[:, 10:20, 12:27])
    with pytest.raises(ValueError):
        A.center_crop(x, 31)


# -- parameter distributions ------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    h=st.integers(1, 80), w=st.integers(1, 80),
    s=st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)).map(sorted),
    r=st.tuples(st.floats(0.2, 5.0), st.floats(0.2, 5.0)).map(sorted),
    seed=st.integers(0, 2**31),
)
def test_rrc_params_properties(h, w, s, r, seed):
    boxes, ok = _rrc_params(32, h, w, s, r, torch.Generator().manual_seed(seed))
    top, left, bh, bw = boxes.unbind(1)
    assert bool(((bh >= 1) & (bw >= 1) & (top >= 0) & (left >= 0) & (top + bh <= h) & (left + bw <= w)).all())
    # an attempt succeeded: within scale and ratio up to the rounding of sides
    for _t, _l, hh, ww in boxes[ok].tolist():
        assert (hh - 0.5) * (ww - 0.5) <= s[1] * h * w + 1e-9
        assert (hh + 0.5) * (ww + 0.5) >= s[0] * h * w - 1e-9
        assert (ww - 0.5) / (hh + 0.5) <= r[1] + 1e-9 and (ww + 0.5) / (hh - 0.5) >= r[0] - 1e-9
    for t, l, hh, ww in boxes[~ok].tolist():  # the center-crop fallback
        assert abs(t - (h - hh) // 2) == 0 and abs(l - (w - ww) // 2) == 0
        assert hh == h or ww == w


def test_rrc_params_known_cases():
    # one possible size: every attempt succeeds with it, positions vary
    boxes, ok = _rrc_params(200, 100, 100, (0.5, 0.5), (1, 1), torch.Generator().manual_seed(0))
    assert bool(ok.all()) and set(boxes[:, 2].tolist()) == {71} and set(boxes[:, 3].tolist()) == {71}
    assert len(set(boxes[:, 0].tolist())) > 20 and int(boxes[:, 0].max()) <= 29
    # impossible attempts: the fallback, cut to the ratio range (wide image -> h * max ratio)
    boxes, ok = _rrc_params(5, 10, 100, (2.0, 3.0), (0.5, 2.0), torch.Generator().manual_seed(0))
    assert not bool(ok.any()) and boxes.tolist() == [[0, 40, 10, 20]] * 5
    boxes, ok = _rrc_params(5, 100, 10, (2.0, 3.0), (0.5, 2.0), torch.Generator().manual_seed(0))
    assert boxes.tolist() == [[40, 0, 20, 10]] * 5
    boxes, ok = _rrc_params(3, 20, 30, (2.0, 3.0), (0.5, 2.0), torch.Generator().manual_seed(0))
    assert boxes.tolist() == [[0, 0, 20, 30]] * 3
    with pytest.raises(ValueError):
        _rrc_params(3, 20, 30, (0.9, 0.1), (0.5, 2.0), None)


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 40), w=st.integers(1, 40), th=st.integers(1, 40), tw=st.integers(1, 40),
       seed=st.integers(0, 2**31))
def test_random_crop_params_inside(h, w, th, tw, seed):
    if th > h or tw > w:
        with pytest.raises(ValueError):
            A.random_crop_params(4, h, w, (th, tw))
        return
    offs = A.random_crop_params(64, h, w, (th, tw), torch.Generator().manual_seed(seed))
    assert bool((offs >= 0).all()) and bool((offs[:, 0] <= h - th).all()) and bool((offs[:, 1] <= w - tw).all())


# -- pipeline: forms, reproducibility --------------------------------------------------------------


def test_pipeline_reproducible_and_batch_forms():
    x = images(8, 40, 48)
    labels = torch.arange(8)
    p = A.imagenet_train(24, seed=7, jitter=0.3)
    a = p({"image": x, "label": labels})
    assert set(a) == {"image", "label"} and a["label"] is labels
    assert a["image"].shape == (8, 3, 24, 24) and a["image"].dtype == torch.float32
    b = p({"image": x, "label": labels})  # the next batch: other parameters
    assert not torch.equal(a["image"], b["image"])
    q = A.imagenet_train(24, seed=7, jitter=0.3)
    assert torch.equal(q(x), a["image"])  # tensor form, batch 0 of epoch 0
    assert torch.equal(q((x, labels))[0], b["image"])  # tuple form, batch 1
    assert torch.equal(q(x, epoch=0, batch_index=0), a["image"])
    r = A.imagenet_train(24, seed=7, jitter=0.3, image=1)
    assert torch.equal(r([labels, x], epoch=0, batch_index=1)[1], b["image"])
    q.set_epoch(1)
    assert not torch.equal(q(x), a["image"])  # another epoch
    assert not torch.equal(A.imagenet_train(24, seed=8, jitter=0.3)(x), a["image"])  # another seed
    with pytest.raises(KeyError, match="image="):
        p({"img": x})
    with pytest.raises(TypeError):
        p("not a batch")


def test_pipeline_state_dict_resume():
    x = images(4, 33, 35)
    p = A.Pipeline([A.RandomCrop(30, padding=2), A.HorizontalFlip(), A.ColorJitter(0.2, 0.2, 0.2)], seed=3)
    p.set_epoch(2)
    p(x)
    state = p.state_dict()
    assert state == {"seed": 3, "epoch": 2, "batch": 1}
    expect = [p(x) for _ in range(3)]
    q = A.Pipeline([A.RandomCrop(30, padding=2), A.HorizontalFlip(), A.ColorJitter(0.2, 0.2, 0.2)], seed=3)
    q.load_state_dict(state)
    for e in expect:
        assert torch.equal(q(x), e)
    with pytest.raises(ValueError, match="seed"):
        A.Pipeline([], seed=4).load_state_dict(state)


def test_pipeline_same_in_a_new_process(tmp_path):
    """The draws depend on (seed, epoch, batch) only: a fresh process with another global seed agrees."""
    code = (
        "import sys, torch\n"
        "torch.manual_seed(12345)\n"
        "from mmstore.torch import augment as A\n"
        "x = torch.randint(0, 256, (6, 29, 41, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))\n"
        "p = A.imagenet_train(16, seed=5, jitter=0.4)\n"
        "p.load_state_dict({'seed': 5, 'epoch': 3, 'batch': 11})\n"
        "torch.save(p(x), sys.argv[1])\n"
    )
    out = str(tmp_path / "aug.pt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code, out], check=True, env=env, timeout=300)
    torch.manual_seed(0)
    ref = A.imagenet_train(16, seed=5, jitter=0.4)(images(), epoch=3, batch_index=11)
    assert torch.equal(torch.load(out), ref)
    g1, g2 = A.batch_generator(5, 3, 11), A.batch_generator(5, 3, 12)
    assert torch.equal(torch.rand(4, generator=A.batch_generator(5, 3, 11)), torch.rand(4, generator=g1))
    assert not torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_pipeline_on_loader_batches(stores):
    """Loader's dict, tuple and chw forms; labels untouched, images cropped from their own record."""
    path = stores["big"]  # 24x32x3 images
    p = A.Pipeline([A.RandomResizedCrop((12, 16)), A.HorizontalFlip()], seed=1)
    q = A.Pipeline([A.RandomResizedCrop((12, 16)), A.HorizontalFlip()], seed=1, layout="NCHW")
    with Loader(path, 16, "sequential", copy=True) as L:
        dicts = list(L)
    with Loader(path, 16, "sequential", chw=True, copy=True) as L:
        chw = list(L)
    for k, (b, c) in enumerate(zip(dicts, chw)):
        out = p(b)
        assert out["image"].shape == (len(b["idx"]), 12, 16, 3) and out["idx"] is b["idx"]
        outc = q(c, epoch=0, batch_index=k)
        assert torch.equal(outc["image"].permute(0, 2, 3, 1), out["image"])
        g = A.batch_generator(1, 0, k)
        boxes = A.random_resized_crop_params(len(b["idx"]), 24, 32, generator=g)
        flip = torch.rand(len(b["idx"]), generator=g) < 0.5
        for n in range(len(b["idx"])):
            ref = ref_resized_crop(b["image"][n].permute(2, 0, 1), boxes[n].tolist(), (12, 16))
            ref = ref.flip(2) if flip[n] else ref
            assert (out["image"][n].permute(2, 0, 1).int() - ref.int()).abs().max() <= 1


def test_imagenet_eval():
    x = images(2, 64, 80)
    y = A.imagenet_eval(32)(x)
    r = A.resize(x, 36)
    c = A.center_crop(r, 32)
    assert torch.equal(y, A.normalize(c, A.IMAGENET_MEAN, A.IMAGENET_STD))
    assert y.shape == (2, 3, 32, 32)


# -- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.cuda
def test_pipeline_on_cuda_matches_cpu():
    x = images(16, 64, 72)
    # the resize's float arithmetic rounds to the other level now and then on the GPU: one level at most
    # (a later ColorJitter scales such a difference by its factors, so it is checked on equal input below)
    p = A.imagenet_train(32, seed=2)
    r = A.Pipeline([A.RandomResizedCrop(32)], seed=2)
    j = A.Pipeline([A.ColorJitter(0.4, 0.4, 0.4)], seed=2)
    q = A.Pipeline([A.RandomCrop(60, padding=4, padding_mode="reflect"), A.HorizontalFlip()], seed=2)
    for b in range(3):
        cpu = p(x, epoch=0, batch_index=b)
        gpu_ = p(x.cuda(), epoch=0, batch_index=b)
        assert gpu_.is_cuda
        assert float((gpu_.cpu() - cpu).abs().max()) <= 1.5 / 255 / 0.224  # one level before normalizing, +rounding
        resized = (r(x.cuda(), epoch=0, batch_index=b).cpu().int() - r(x, epoch=0, batch_index=b).int()).abs()
        assert int(resized.max()) <= 1
        assert torch.equal(j(x.cuda(), epoch=0, batch_index=b).cpu(), j(x, epoch=0, batch_index=b))  # exact
        assert torch.equal(q(x.cuda(), epoch=0, batch_index=b).cpu(), q(x, epoch=0, batch_index=b))  # exact
    g = torch.Generator(device="cuda").manual_seed(0)  # a CUDA generator works too
    assert A.random_resized_crop(x.cuda(), 16, generator=g).is_cuda
    assert A.color_jitter(x.cuda(), 0.4, 0.4, 0.4, g).is_cuda
