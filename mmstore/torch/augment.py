"""Augmentation on whole batches, on the CPU or a CUDA device (issue 15).

The operations follow torchvision's definitions and parameters (torchvision
is not needed): :func:`random_resized_crop`, :func:`random_crop` (with
padding), :func:`horizontal_flip`, :func:`color_jitter`, :func:`normalize`,
plus :func:`resize` and :func:`center_crop` for evaluation. Each takes a
batch of images, ``(N, H, W, C)`` (``layout="NHWC"``, what the Loader
delivers) or ``(N, C, H, W)``, uint8 or float, on any device, and draws one
set of parameters per image from ``generator``.

How they differ from torchvision's per-image transforms:

- :func:`random_resized_crop` resizes with bilinear interpolation **without
  antialiasing** (``F.interpolate(..., mode="bilinear", align_corners=False,
  antialias=False)`` on each crop, computed for the whole batch in one pair of
  gathers); torchvision's tensor path antialiases by default, which matters
  only when a crop is shrunk by more than about 2x. :func:`resize` (one size
  for the whole batch) antialiases like torchvision.
- :func:`color_jitter` applies brightness, contrast and saturation in one
  random order per batch (``order="batch"``), or always in that order
  (``order="fixed"``); torchvision draws the order per image. A per-image
  order would need every adjustment computed for every image at every step
  (3x the work); the factors are still drawn per image.
- Parameters are drawn from ``generator`` on its device (default: torch's
  global CPU generator), so CPU draws give the same parameters whatever
  device the batch is on.

:class:`Pipeline` chains operations, takes and returns the Loader's batch
forms (a dict with an image field, a tuple/list, or a tensor) and is
reproducible: the draws for batch ``b`` of epoch ``e`` come from a CPU
generator seeded from ``(seed, e, b)`` only (:func:`batch_generator`), so the
same batch gets the same augmentation on any device and after a resume in a
new process. :func:`imagenet_train` and :func:`imagenet_eval` build the
standard ImageNet pipelines.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CenterCrop",
    "ColorJitter",
    "HorizontalFlip",
    "Normalize",
    "Pipeline",
    "RandomCrop",
    "RandomResizedCrop",
    "Resize",
    "adjust_colors",
    "batch_generator",
    "center_crop",
    "color_jitter",
    "color_jitter_params",
    "crop",
    "horizontal_flip",
    "imagenet_eval",
    "imagenet_train",
    "normalize",
    "random_crop",
    "random_crop_params",
    "random_flip",
    "random_resized_crop",
    "random_resized_crop_params",
    "resize",
    "resized_crop",
    "to_chw",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_PAD_MODES = ("constant", "edge", "reflect", "symmetric")


# -- layout helpers -------------------------------------------------------------------


def _layout(batch: torch.Tensor, layout: str) -> str:
    if not isinstance(batch, torch.Tensor) or batch.dim() != 4:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"expected a 4-D image batch (N, H, W, C) or (N, C, H, W), got {shape}")
    lay = str(layout).upper()
    if lay not in ("NHWC", "NCHW"):
        raise ValueError(f"layout must be 'NHWC' or 'NCHW', got {layout!r}")
    return lay


def _hw(batch: torch.Tensor, lay: str) -> tuple[int, int]:
    return (batch.shape[1], batch.shape[2]) if lay == "NHWC" else (batch.shape[2], batch.shape[3])


def _dense(batch: torch.Tensor, lay: str) -> tuple[torch.Tensor, str, bool]:
    """``(a contiguous tensor, its layout, whether it is an NHWC view of an NCHW batch)``.

    An NCHW view of channels-last memory (``Loader(chw=True)``, ``to_chw``)
    is worked on as the NHWC tensor it is, without a copy.
    """
    if lay == "NCHW" and not batch.is_contiguous() and batch.permute(0, 2, 3, 1).is_contiguous():
        return batch.permute(0, 2, 3, 1), "NHWC", True
    return batch.contiguous(), lay, False


def _undense(out: torch.Tensor, permuted: bool) -> torch.Tensor:
    return out.permute(0, 3, 1, 2) if permuted else out


def _pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(size, int):
        hw = (size, size)
    elif isinstance(size, Sequence) and len(size) == 1:
        hw = (int(size[0]), int(size[0]))
    elif isinstance(size, Sequence) and len(size) == 2:
        hw = (int(size[0]), int(size[1]))
    else:
        raise ValueError(f"{what} must be an int or (height, width), got {size!r}")
    if hw[0] < 1 or hw[1] < 1:
        raise ValueError(f"{what} must be positive, got {size!r}")
    return hw


def _rand(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """Uniform [0, 1) float64 draws on the generator's device, returned on the CPU."""
    dev = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=dev, dtype=torch.float64).cpu()


def _randint_below(bound: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One integer in ``[0, bound)`` per entry of ``bound`` (int64, all >= 1)."""
    r = (_rand(tuple(bound.shape), generator) * bound).floor().long()
    return torch.minimum(r, bound - 1)


def _finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float results back to ``dtype``: integers rounded and clamped to range."""
    if dtype.is_floating_point:
        return out.to(dtype)
    info = torch.iinfo(dtype)
    return out.round_().clamp_(info.min, info.max).to(dtype)


def _boxes(boxes: Any, n: int) -> torch.Tensor:
    """``boxes`` as an ``(n, 4)`` int64 CPU tensor of ``(top, left, height, width)``."""
    b = torch.as_tensor(boxes).to("cpu", torch.int64)
    if b.shape != (n, 4):
        raise ValueError(f"boxes must have shape ({n}, 4) (top, left, height, width per image), got {tuple(b.shape)}")
    return b


def _check_inside(b: torch.Tensor, height: int, width: int) -> None:
    top, left, h, w = b.unbind(1)
    bad = (h < 1) | (w < 1) | (top < 0) | (left < 0) | (top + h > height) | (left + w > width)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(f"crop box {b[k].tolist()} (top, left, height, width) of image {k} is not inside "
                         f"the {height}x{width} image; boxes must have h, w >= 1 and lie inside the image")


def _image_view(x: torch.Tensor, k: int, nhwc: bool, t: int, l: int, h: int, w: int) -> torch.Tensor:
    """Box ``(t, l, h, w)`` of image ``k`` as a ``(1, C, h, w)`` view."""
    if nhwc:
        return x[k:k + 1, t:t + h, l:l + w].permute(0, 3, 1, 2)
    return x[k:k + 1, :, t:t + h, l:l + w]


def resized_crop(
    batch: torch.Tensor, boxes: Any, size: int | Sequence[int], *, layout: str = "NHWC",
) -> torch.Tensor:
    """Crop box ``boxes[n]`` of image ``n`` and resize it to ``size``, bilinear, no antialias.

    ``boxes``: ``(N, 4)`` ``(top, left, height, width)`` inside the image.
    Per image, ``F.interpolate(img[..., top:top+h, left:left+w], size,
    mode="bilinear", align_corners=False, antialias=False)`` into one output
    batch (uint8 on the CPU through PyTorch's uint8 kernel, other cases in
    float, integers rounded). Measured (``tools/bench_augment.py``) 16x
    faster on the CPU than computing the whole batch as two gathers.
    Returns a dense batch in the input's layout and dtype, on its device.
    """
    lay = _layout(batch, layout)
    oh, ow = _pair(size, "size")
    height, width = _hw(batch, lay)
    b = _boxes(boxes, batch.shape[0])
    _check_inside(b, height, width)
    x, lay_m, permuted = _dense(batch, lay)
    nhwc = lay_m == "NHWC"
    n, c = x.shape[0], x.shape[3 if nhwc else 1]
    out = torch.empty((n, oh, ow, c) if nhwc else (n, c, oh, ow), dtype=x.dtype, device=x.device)
    native = x.dtype in (torch.float32, torch.float64) or (x.dtype == torch.uint8 and x.device.type == "cpu")
    for k, (t, l, h, w) in enumerate(b.tolist()):
        # a dense channels-last crop takes PyTorch's vectorised uint8 kernel on the CPU (measured 3-9x faster)
        img = _image_view(x, k, nhwc, t, l, h, w).contiguous(memory_format=torch.channels_last)
        r = F.interpolate(img if native else img.float(), size=(oh, ow), mode="bilinear",
                          align_corners=False, antialias=False)[0]
        r = r if native else _finish(r, x.dtype)
        out[k] = r.permute(1, 2, 0) if nhwc else r
    return _undense(out, permuted)


def _stack_crops(x: torch.Tensor, hdim: int, tops: torch.Tensor, lefts: torch.Tensor,
                 size: tuple[int, int]) -> torch.Tensor:
    """Crops of one ``size`` at ``(tops[n], lefts[n])`` of dense ``x``, one copy per image."""
    shape = list(x.shape)
    shape[hdim], shape[hdim + 1] = size
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    for k, (t, l) in enumerate(zip(tops.tolist(), lefts.tolist())):
        out[k] = x[k].narrow(hdim - 1, t, size[0]).narrow(hdim, l, size[1])
    return out


def crop(batch: torch.Tensor, boxes: Any, *, layout: str = "NHWC") -> torch.Tensor:
    """Crop box ``boxes[n]`` (``(top, left, height, width)``, one size for all) out of image ``n``."""
    lay = _layout(batch, layout)
    b = _boxes(boxes, batch.shape[0])
    if batch.shape[0] and not (bool((b[:, 2] == b[0, 2]).all()) and bool((b[:, 3] == b[0, 3]).all())):
        raise ValueError("crop: every box of a batch must have the same height and width")
    _check_inside(b, *_hw(batch, lay))
    x, lay_m, permuted = _dense(batch, lay)
    size = (int(b[0, 2]), int(b[0, 3])) if len(b) else (1, 1)
    return _undense(_stack_crops(x, 1 if lay_m == "NHWC" else 2, b[:, 0], b[:, 1], size), permuted)


# -- random resized crop --------------------------------------------------------------


def _check_range(v: Sequence[float], what: str) -> tuple[float, float]:
    if len(v) != 2 or not float(v[0]) <= float(v[1]):
        raise ValueError(f"{what} must be (min, max) with min <= max, got {v!r}")
    return float(v[0]), float(v[1])


def _rrc_params(
    n: int, height: int, width: int, scale: Sequence[float], ratio: Sequence[float],
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(boxes (n, 4), ok (n,))``: ``ok`` is False where all 10 attempts failed (center crop)."""
    s0, s1 = _check_range(scale, "scale")
    r0, r1 = _check_range(ratio, "ratio")
    if s0 <= 0 or r0 <= 0:
        raise ValueError(f"scale and ratio must be positive, got scale={scale!r}, ratio={ratio!r}")
    area = float(height * width)
    target = area * (s0 + (s1 - s0) * _rand((n, 10), generator))
    lr0, lr1 = math.log(r0), math.log(r1)
    aspect = torch.exp(lr0 + (lr1 - lr0) * _rand((n, 10), generator))
    w = torch.sqrt(target * aspect).round().long()
    h = torch.sqrt(target / aspect).round().long()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    ok = fits.any(dim=1)
    first = fits.long().argmax(dim=1).view(-1, 1)  # the first attempt that fits
    h = h.gather(1, first).view(-1)
    w = w.gather(1, first).view(-1)
    # torchvision's fallback: the whole image, or its center cut to the ratio range
    in_ratio = width / height
    if in_ratio < r0:
        fh, fw = round(width / r0), width
    elif in_ratio > r1:
        fh, fw = height, round(height * r1)
    else:
        fh, fw = height, width
    fh, fw = max(fh, 1), max(fw, 1)  # torchvision would give a 0 side for a 1-pixel image and an extreme ratio
    h = torch.where(ok, h, torch.full_like(h, fh))
    w = torch.where(ok, w, torch.full_like(w, fw))
    top = _randint_below(height - h + 1, generator)
    left = _randint_below(width - w + 1, generator)
    top = torch.where(ok, top, (height - h) // 2)
    left = torch.where(ok, left, (width - w) // 2)
    return torch.stack([top, left, h, w], dim=1), ok


def random_resized_crop_params(
    n: int, height: int, width: int, scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3), generator: torch.Generator | None = None,
) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop.get_params`` for ``n`` images of ``height`` x ``width``.

    Per image: up to 10 attempts of an area fraction uniform in ``scale`` and
    a log-uniform aspect ratio (width / height) in ``ratio``, sides rounded;
    the first attempt that fits gives the box, at a uniform position. If none
    fits: the center crop of the whole image cut to the ratio range (at
    least 1 pixel a side, where torchvision's rounding could give 0).
    Returns ``(n, 4)`` int64 ``(top, left, height, width)`` on the CPU.
    """
    return _rrc_params(n, height, width, scale, ratio, generator)[0]


def random_resized_crop(
    batch: torch.Tensor, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3), generator: torch.Generator | None = None,
    *, layout: str = "NHWC",
) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` on each image of a batch.

    Bilinear, **antialias off** (see the module docstring); parameters per image
    (:func:`random_resized_crop_params`). Returns ``(N, size, size, C)`` (or
    ``(N, C, size, size)``), dense, same dtype and device.
    """
    lay = _layout(batch, layout)
    height, width = _hw(batch, lay)
    boxes = random_resized_crop_params(batch.shape[0], height, width, scale, ratio, generator)
    return resized_crop(batch, boxes, size, layout=lay)


# -- random crop with padding ---------------------------------------------------------


def _padding4(padding: int | Sequence[int] | None) -> tuple[int, int, int, int]:
    """torchvision's padding forms as ``(left, top, right, bottom)``."""
    if padding is None:
        return (0, 0, 0, 0)
    p = [padding] if isinstance(padding, int) else [int(v) for v in padding]
    if len(p) == 1:
        p = p * 4
    elif len(p) == 2:
        p = [p[0], p[1], p[0], p[1]]
    elif len(p) != 4:
        raise ValueError(f"padding must be an int or 1, 2 or 4 ints, got {padding!r}")
    if min(p) < 0:
        raise ValueError(f"padding must not be negative, got {padding!r}")
    return (p[0], p[1], p[2], p[3])


def _mirror(pos: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """Image positions for positions ``pos`` (outside ``[0, n)``) of a padded axis."""
    if mode == "edge":
        return pos.clamp(0, n - 1)
    if mode == "reflect":  # ... 2 1 | 0 1 2 ... n-1 | n-2 ...
        period = max(2 * n - 2, 1)
        m = pos.abs().remainder(period)
        return torch.where(m >= n, period - m, m)
    m = pos.remainder(2 * n)  # symmetric: ... 1 0 | 0 1 ... n-1 | n-1 n-2 ...
    return torch.where(m >= n, 2 * n - 1 - m, m)


def _fill_tensor(fill: float | Sequence[float], c: int, x: torch.Tensor, cdim: int) -> torch.Tensor:
    f = torch.as_tensor(fill, dtype=torch.float64).reshape(-1)
    if f.numel() not in (1, c):
        raise ValueError(f"fill needs 1 or {c} values, got {f.numel()}")
    shape = [1] * x.dim()
    shape[cdim] = f.numel()
    return _finish(f.view(shape).clone(), x.dtype).to(x.device)


def _pad(x: torch.Tensor, hdim: int, pad: tuple[int, int, int, int], fill: float | Sequence[float],
         mode: str) -> torch.Tensor:
    """Dense ``x`` padded by ``pad`` = ``(left, top, right, bottom)`` as torchvision's ``F.pad``."""
    l, t, r, b = pad
    if not any(pad):
        return x
    wdim = hdim + 1
    if mode == "constant":
        cdim = 3 if hdim == 1 else 1
        shape = list(x.shape)
        shape[hdim] += t + b
        shape[wdim] += l + r
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        out.copy_(_fill_tensor(fill, x.shape[cdim], x, cdim).expand(shape))
        out.narrow(hdim, t, x.shape[hdim]).narrow(wdim, l, x.shape[wdim]).copy_(x)
        return out
    for dim, before, after in ((wdim, l, r), (hdim, t, b)):
        n = x.shape[dim]
        lo = _mirror(torch.arange(-before, 0), n, mode).to(x.device)
        hi = _mirror(torch.arange(n, n + after), n, mode).to(x.device)
        x = torch.cat([x.index_select(dim, lo), x, x.index_select(dim, hi)], dim=dim)
    return x


def random_crop_params(
    n: int, height: int, width: int, size: int | Sequence[int], generator: torch.Generator | None = None,
) -> torch.Tensor:
    """torchvision's ``RandomCrop.get_params``: ``(n, 2)`` int64 ``(top, left)``, uniform, on the CPU."""
    th, tw = _pair(size, "size")
    if height < th or width < tw:
        raise ValueError(f"random_crop: the (padded) image is {height}x{width}, smaller than the crop "
                         f"{th}x{tw}; pass padding= or pad_if_needed=True")
    top = _randint_below(torch.full((n,), height - th + 1), generator)
    left = _randint_below(torch.full((n,), width - tw + 1), generator)
    return torch.stack([top, left], dim=1)


def random_crop(
    batch: torch.Tensor, size: int | Sequence[int], padding: int | Sequence[int] | None = None,
    pad_if_needed: bool = False, fill: float | Sequence[float] = 0, padding_mode: str = "constant",
    generator: torch.Generator | None = None, *, layout: str = "NHWC",
) -> torch.Tensor:
    """torchvision's ``RandomCrop`` on each image of a batch (one offset per image).

    ``padding`` (int, ``(left/right, top/bottom)`` or ``(left, top, right,
    bottom)``) is added first; with ``pad_if_needed`` a side shorter than
    ``size`` is then padded on both sides by the missing amount; ``fill`` (a
    value or one per channel) is used by ``padding_mode="constant"``; ``"edge"``,
    ``"reflect"`` and ``"symmetric"`` mirror as torchvision does (in the
    same stages, so a second mirror is taken of the padded image). The
    batch is padded once, then each image's crop is one copy.
    """
    lay = _layout(batch, layout)
    if padding_mode not in _PAD_MODES:
        raise ValueError(f"padding_mode must be one of {_PAD_MODES}, got {padding_mode!r}")
    th, tw = _pair(size, "size")
    x, lay_m, permuted = _dense(batch, lay)
    hdim = 1 if lay_m == "NHWC" else 2
    x = _pad(x, hdim, _padding4(padding), fill, padding_mode)
    height, width = x.shape[hdim], x.shape[hdim + 1]
    if pad_if_needed and width < tw:
        x = _pad(x, hdim, (tw - width, 0, tw - width, 0), fill, padding_mode)
    if pad_if_needed and height < th:
        x = _pad(x, hdim, (0, th - height, 0, th - height), fill, padding_mode)
    height, width = x.shape[hdim], x.shape[hdim + 1]
    offs = random_crop_params(batch.shape[0], height, width, (th, tw), generator)
    return _undense(_stack_crops(x, hdim, offs[:, 0], offs[:, 1], (th, tw)), permuted)


# -- resize and center crop (evaluation) ------------------------------------------------


def resize(
    batch: torch.Tensor, size: int | Sequence[int], *, antialias: bool = True, layout: str = "NHWC",
) -> torch.Tensor:
    """torchvision's ``Resize(size)``, bilinear: an int resizes the shorter side to ``size``
    (aspect kept, the other side truncated as torchvision does), a pair gives ``(h, w)``.
    One size for the whole batch, so it is one ``F.interpolate`` call (antialias on by default)."""
    lay = _layout(batch, layout)
    height, width = _hw(batch, lay)
    if isinstance(size, int) or (isinstance(size, Sequence) and len(size) == 1):
        s = _pair(size, "size")[0]
        short, long = min(height, width), max(height, width)
        new_long = int(s * long / short)
        oh, ow = (s, new_long) if height <= width else (new_long, s)
    else:
        oh, ow = _pair(size, "size")
    if (oh, ow) == (height, width):
        return batch
    x = batch.permute(0, 3, 1, 2) if lay == "NHWC" else batch
    native = x.dtype in (torch.float32, torch.float64) or (x.dtype == torch.uint8 and x.device.type == "cpu")
    out = F.interpolate(x if native else x.float(), size=(oh, ow), mode="bilinear", align_corners=False,
                        antialias=antialias)
    out = out if native else _finish(out, batch.dtype)
    return out.permute(0, 2, 3, 1).contiguous() if lay == "NHWC" else out


def center_crop(batch: torch.Tensor, size: int | Sequence[int], *, layout: str = "NHWC") -> torch.Tensor:
    """torchvision's ``CenterCrop`` (the crop must fit; no padding)."""
    lay = _layout(batch, layout)
    th, tw = _pair(size, "size")
    height, width = _hw(batch, lay)
    if th > height or tw > width:
        raise ValueError(f"center_crop: crop {th}x{tw} is larger than the {height}x{width} image")
    top = round((height - th) / 2.0)
    left = round((width - tw) / 2.0)
    x, lay_m, permuted = _dense(batch, lay)
    hdim = 1 if lay_m == "NHWC" else 2
    return _undense(x.narrow(hdim, top, th).narrow(hdim + 1, left, tw).contiguous(), permuted)


# -- flips, normalisation ------------------------------------------------------------


def to_chw(batch: torch.Tensor) -> torch.Tensor:
    """NHWC -> NCHW as a view (channels-last strides; no copy)."""
    if batch.dim() != 4:
        raise ValueError(f"expected a 4-D NHWC batch, got shape {tuple(batch.shape)}")
    return batch.permute(0, 3, 1, 2)


def _flip_mask(n: int, p: float, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    gdev = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=gdev) < float(p)


def random_flip(
    batch: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None,
    *, layout: str = "NHWC", dim: str = "horizontal",
) -> torch.Tensor:
    """Flip each image of the batch with probability ``p`` (one draw per image).

    Parameters
    ----------
    batch : Tensor
        ``(N, H, W, C)`` or ``(N, C, H, W)`` (``layout``), any dtype, any device.
    p : float
        Probability of flipping an image.
    generator : torch.Generator, optional
        For reproducible draws; it may live on the CPU or on the batch's
        device (the draws are made on the generator's device and moved;
        without one, on the batch's device).
    dim : {"horizontal", "vertical"}

    Returns
    -------
    Tensor
        A new tensor, same shape, layout and device.
    """
    lay = _layout(batch, layout)
    if dim not in ("horizontal", "vertical"):
        raise ValueError(f"dim must be 'horizontal' or 'vertical', got {dim!r}")
    axis = {("NHWC", "horizontal"): 2, ("NHWC", "vertical"): 1,
            ("NCHW", "horizontal"): 3, ("NCHW", "vertical"): 2}[(lay, dim)]
    draw = _flip_mask(batch.shape[0], p, generator, batch.device)
    if batch.device.type != "cpu":  # one kernel for the batch
        return torch.where(draw.to(batch.device).view(-1, 1, 1, 1), batch.flip(axis), batch)
    out = torch.empty_like(batch)  # on the CPU, image by image: each stays in the cache
    for k, f in enumerate(draw.tolist()):
        out[k] = batch[k].flip(axis - 1) if f else batch[k]
    return out


def horizontal_flip(
    batch: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None, *, layout: str = "NHWC",
) -> torch.Tensor:
    """torchvision's ``RandomHorizontalFlip(p)`` per image (see :func:`random_flip`)."""
    return random_flip(batch, p, generator, layout=layout, dim="horizontal")


def normalize(
    batch: torch.Tensor,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
    *,
    layout: str = "NHWC",
    scale: float = 255.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(batch / scale - mean) / std`` per channel, as ``dtype``, in NCHW.

    Parameters
    ----------
    batch : Tensor
        uint8 (or any numeric) images, ``(N, H, W, C)`` (``layout="NHWC"``,
        the store's layout) or ``(N, C, H, W)``.
    mean, std : sequence of C floats or a tensor
        In units of ``batch / scale`` (ImageNet: ``(0.485, 0.456, 0.406)``,
        ``(0.229, 0.224, 0.225)`` with the default ``scale=255``; for a float
        batch already in [0, 1] pass ``scale=1``).
    layout : {"NHWC", "NCHW"}
    scale : float, default 255
    dtype : torch.dtype, default float32

    Returns
    -------
    Tensor
        ``(N, C, H, W)`` on ``batch.device``; from an NHWC input it has
        channels-last strides (what convolutions prefer on GPUs); call
        ``.contiguous()`` for the default layout.
    """
    lay = _layout(batch, layout)
    x = batch.permute(0, 3, 1, 2) if lay == "NHWC" else batch
    c = x.shape[1]
    m = torch.as_tensor(mean, dtype=dtype, device=batch.device).reshape(-1)
    s = torch.as_tensor(std, dtype=dtype, device=batch.device).reshape(-1)
    if m.numel() not in (1, c) or s.numel() not in (1, c):
        raise ValueError(f"mean and std need 1 or {c} values, got {m.numel()} and {s.numel()}")
    if torch.any(s == 0):
        raise ValueError("std must not contain zeros")
    inv = (1.0 / (s * scale)).view(1, -1, 1, 1)
    shift = (m / s).view(1, -1, 1, 1)
    if lay == "NHWC" and batch.is_contiguous() and batch.device.type == "cpu":
        return _normalize_nhwc_cpu(batch, inv.view(-1), shift.view(-1), dtype)
    return x.to(dtype).mul_(inv).sub_(shift)


def _normalize_nhwc_cpu(x: torch.Tensor, inv: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`normalize` of a dense NHWC batch on the CPU, measured 3x faster than broadcasting
    over C: rows of ``W * C`` values against the per-channel factors repeated ``W`` times, a few
    images at a time (the passes stay in the cache)."""
    n, h, w, c = x.shape
    inv_row = inv.expand(c).repeat(w)
    shift_row = shift.expand(c).repeat(w)
    out = torch.empty((n, h, w, c), dtype=dtype)
    step = 8
    for i in range(0, n, step):
        o = out[i:i + step].view(-1, w * c)
        o.copy_(x[i:i + step].reshape(-1, w * c))
        o.mul_(inv_row).sub_(shift_row)
    return out.permute(0, 3, 1, 2)


# -- colour jitter ------------------------------------------------------------------


def _jitter_range(v: float | Sequence[float] | None, what: str) -> tuple[float, float] | None:
    """torchvision's ColorJitter argument: v -> [max(0, 1 - v), 1 + v]; a pair as is; 0/None: off."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        if v < 0:
            raise ValueError(f"{what} must be non-negative, got {v}")
        lo, hi = max(0.0, 1.0 - float(v)), 1.0 + float(v)
    else:
        lo, hi = _check_range(v, what)
        if lo < 0:
            raise ValueError(f"{what} range must be non-negative, got {v!r}")
    return None if lo == hi == 1.0 else (lo, hi)


_JITTER = ("brightness", "contrast", "saturation")


def color_jitter_params(
    n: int, brightness: float | Sequence[float] | None = 0, contrast: float | Sequence[float] | None = 0,
    saturation: float | Sequence[float] | None = 0, generator: torch.Generator | None = None,
    order: str = "batch",
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(factors (n, 3) float64, order)``: per-image brightness, contrast and
    saturation factors (1.0 where the adjustment is off), uniform in
    torchvision's ranges, and the order of the adjustments (indices into
    ``("brightness", "contrast", "saturation")``): one random permutation for
    the batch (``order="batch"``) or ``(0, 1, 2)`` (``order="fixed"``)."""
    if order not in ("batch", "fixed"):
        raise ValueError(f"order must be 'batch' or 'fixed', got {order!r}")
    ranges = [_jitter_range(v, k) for v, k in zip((brightness, contrast, saturation), _JITTER)]
    cols = []
    for rng in ranges:
        if rng is None:
            cols.append(torch.ones(n, dtype=torch.float64))
        else:
            cols.append(rng[0] + (rng[1] - rng[0]) * _rand((n,), generator))
    perm = (0, 1, 2)
    if order == "batch":
        dev = generator.device if generator is not None else torch.device("cpu")
        perm = tuple(int(i) for i in torch.randperm(3, generator=generator, device=dev).tolist())
    return torch.stack(cols, dim=1), perm


def _grey(x: torch.Tensor, cdim: int, integer: bool) -> torch.Tensor:
    """torchvision's ``rgb_to_grayscale`` (ITU-R 601-2 luma), kept with one channel;
    truncated like torchvision's cast back to an integer dtype."""
    r, g, b = x.unbind(cdim)
    l = (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(cdim)
    return l.floor_() if integer else l


def adjust_colors(
    batch: torch.Tensor, factors: Any, order: Sequence[int] = (0, 1, 2), *, layout: str = "NHWC",
) -> torch.Tensor:
    """Brightness, contrast and saturation by per-image ``factors`` (``(N, 3)``), in ``order``.

    torchvision's formulas: each is ``blend(img, other, f) = clamp(f * img +
    (1 - f) * other, 0, max)`` with ``other`` black (brightness), the mean of
    the grey image (contrast) or the grey image (saturation); an integer batch
    is truncated to integers after each step, as torchvision's cast does. A
    factor of 1 leaves the image unchanged. Grey-scale (1-channel) images skip
    saturation, and their contrast mean is the image mean.
    """
    lay = _layout(batch, layout)
    x, lay_m, permuted = _dense(batch, lay)
    cdim = 3 if lay_m == "NHWC" else 1
    c = x.shape[cdim]
    if c not in (1, 3):
        raise ValueError(f"color jitter needs 1 or 3 channels, got {c}")
    f = _factors(factors, x.shape[0]).to(x.device)
    integer = not x.dtype.is_floating_point
    bound = 255.0 if x.dtype == torch.uint8 else (1.0 if not integer else float(torch.iinfo(x.dtype).max))
    ftype = x.dtype if x.dtype == torch.float64 else torch.float32
    out = x.to(ftype, copy=True)  # never the caller's tensor: the steps work in place
    for k in order:
        fk = f[:, k].to(ftype).view(-1, 1, 1, 1)
        if bool((f[:, k] == 1.0).all()):
            continue
        if k == 0:
            other = None
        elif k == 1:
            g = _grey(out, cdim, integer) if c == 3 else out
            other = g.mean(dim=(1, 2, 3), keepdim=True)
        else:
            if c == 1:
                continue
            other = _grey(out, cdim, integer)
        out = out.mul_(fk) if other is None else out.mul_(fk).add_((1.0 - fk) * other)
        out = out.clamp_(0.0, bound)
        if integer:
            out = out.floor_()
    return _undense(out.to(x.dtype), permuted)


def _factors(factors: Any, n: int) -> torch.Tensor:
    f = torch.as_tensor(factors, dtype=torch.float64)
    if f.shape != (n, 3):
        raise ValueError(f"factors must have shape ({n}, 3) (brightness, contrast, saturation), got {tuple(f.shape)}")
    if bool((f < 0).any()):
        raise ValueError("colour factors must be non-negative")
    return f


def color_jitter(
    batch: torch.Tensor, brightness: float | Sequence[float] | None = 0,
    contrast: float | Sequence[float] | None = 0, saturation: float | Sequence[float] | None = 0,
    generator: torch.Generator | None = None, *, order: str = "batch", layout: str = "NHWC",
) -> torch.Tensor:
    """torchvision's ``ColorJitter(brightness, contrast, saturation)`` with per-image factors.

    ``order="batch"`` (default) draws one random order of the three
    adjustments per batch, ``"fixed"`` applies brightness, contrast,
    saturation (see the module docstring for why not per image). Hue is
    not supported.
    """
    lay = _layout(batch, layout)
    factors, perm = color_jitter_params(batch.shape[0], brightness, contrast, saturation, generator, order)
    return adjust_colors(batch, factors, perm, layout=lay)


# -- pipeline ---------------------------------------------------------------------


class _Op:
    """A pipeline step: ``apply(x, layout, generator) -> (x, layout)``."""

    def apply(self, x: torch.Tensor, layout: str, g: torch.Generator) -> tuple[torch.Tensor, str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class RandomResizedCrop(_Op):
    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.scale, self.ratio = _pair(size, "size"), tuple(scale), tuple(ratio)
        _check_range(self.scale, "scale")
        _check_range(self.ratio, "ratio")

    def apply(self, x, layout, g):
        return random_resized_crop(x, self.size, self.scale, self.ratio, g, layout=layout), layout


class RandomCrop(_Op):
    def __init__(self, size: int | Sequence[int], padding: int | Sequence[int] | None = None,
                 pad_if_needed: bool = False, fill: float | Sequence[float] = 0,
                 padding_mode: str = "constant") -> None:
        self.size, self.padding, self.pad_if_needed = _pair(size, "size"), padding, bool(pad_if_needed)
        self.fill, self.padding_mode = fill, padding_mode
        _padding4(padding)
        if padding_mode not in _PAD_MODES:
            raise ValueError(f"padding_mode must be one of {_PAD_MODES}, got {padding_mode!r}")

    def apply(self, x, layout, g):
        return random_crop(x, self.size, self.padding, self.pad_if_needed, self.fill, self.padding_mode,
                           g, layout=layout), layout


class HorizontalFlip(_Op):
    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = float(p)

    def apply(self, x, layout, g):
        return horizontal_flip(x, self.p, g, layout=layout), layout


class ColorJitter(_Op):
    def __init__(self, brightness: float | Sequence[float] | None = 0, contrast: float | Sequence[float] | None = 0,
                 saturation: float | Sequence[float] | None = 0, order: str = "batch") -> None:
        self.brightness, self.contrast, self.saturation, self.order = brightness, contrast, saturation, order
        color_jitter_params(0, brightness, contrast, saturation, None, "fixed")  # validates
        if order not in ("batch", "fixed"):
            raise ValueError(f"order must be 'batch' or 'fixed', got {order!r}")

    def apply(self, x, layout, g):
        return color_jitter(x, self.brightness, self.contrast, self.saturation, g,
                            order=self.order, layout=layout), layout


class Resize(_Op):
    def __init__(self, size: int | Sequence[int], antialias: bool = True) -> None:
        self.size, self.antialias = size, bool(antialias)
        _pair(size, "size")

    def apply(self, x, layout, g):
        return resize(x, self.size, antialias=self.antialias, layout=layout), layout


class CenterCrop(_Op):
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size, "size")

    def apply(self, x, layout, g):
        return center_crop(x, self.size, layout=layout), layout


class Normalize(_Op):
    """:func:`normalize`; the batch is NCHW afterwards."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 scale: float = 255.0, dtype: torch.dtype = torch.float32) -> None:
        self.mean, self.std, self.scale, self.dtype = tuple(mean), tuple(std), float(scale), dtype
        if any(float(s) == 0 for s in self.std):
            raise ValueError("std must not contain zeros")

    def apply(self, x, layout, g):
        return normalize(x, self.mean, self.std, layout=layout, scale=self.scale, dtype=self.dtype), "NCHW"


def batch_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The CPU generator of batch ``batch`` of epoch ``epoch`` under ``seed``.

    Rule: ``torch.Generator().manual_seed(s)`` with ``s`` the first 8 bytes
    (little-endian) of ``blake2b(b"mmstore.augment:<seed>:<epoch>:<batch>",
    digest_size=8)``, the three numbers in decimal. It depends on nothing
    else (not the device, process, worker or torch's global seed).
    """
    key = f"mmstore.augment:{int(seed)}:{int(epoch)}:{int(batch)}".encode()
    s = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(s)


class Pipeline:
    """Augmentation steps applied to batches, seeded and reproducible.

    Parameters
    ----------
    ops : sequence
        Steps (:class:`RandomResizedCrop`, :class:`RandomCrop`,
        :class:`HorizontalFlip`, :class:`ColorJitter`, :class:`Resize`,
        :class:`CenterCrop`, :class:`Normalize`), or callables ``f(tensor) ->
        tensor`` that keep the layout.
    seed : int
    image : str or int, default "image"
        Where the images are in a batch: the key of a dict batch, the index
        of a tuple/list batch. A tensor batch is the images.
    layout : {"NHWC", "NCHW"}
        The layout of the images given (``Loader`` yields NHWC; NCHW with
        ``chw=True``). After :class:`Normalize` the batch is NCHW.

    Calling ``pipe(batch)`` returns the batch in the same form (a new dict,
    tuple or list; other entries unchanged) with the images augmented, on
    their device. The draws of a call come from
    ``batch_generator(seed, epoch, b)`` (a CPU generator, so any device
    gets the same parameters): ``epoch`` and ``b`` are given as keywords,
    or else ``epoch`` is the last :meth:`set_epoch` (0 at first) and ``b``
    counts the calls since then. :meth:`state_dict` / :meth:`load_state_dict`
    carry that position across a resume in a new process.
    """

    def __init__(self, ops: Sequence[_Op | Callable[[torch.Tensor], torch.Tensor]], seed: int = 0,
                 *, image: str | int = "image", layout: str = "NHWC") -> None:
        self.ops = list(ops)
        self.seed = int(seed)
        self.image = image
        self.layout = str(layout).upper()
        if self.layout not in ("NHWC", "NCHW"):
            raise ValueError(f"layout must be 'NHWC' or 'NCHW', got {layout!r}")
        for op in self.ops:
            if not (isinstance(op, _Op) or callable(op)):
                raise TypeError(f"a pipeline step must be an augment op or a callable, got {type(op).__name__}")
        self.epoch = 0
        self.batch = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: the next call is its batch 0."""
        self.epoch, self.batch = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"seed", "epoch", "batch"}`` (the next call's batch number)."""
        return {"seed": self.seed, "epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"augment.Pipeline state has seed {state['seed']}, this pipeline has seed "
                             f"{self.seed}; build it with the seed of the run being resumed")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def images(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Apply the steps to an image tensor with ``generator``'s draws."""
        lay = _layout(x, self.layout)
        for op in self.ops:
            if isinstance(op, _Op):
                x, lay = op.apply(x, lay, generator)
            else:
                x = op(x)
        return x

    def __call__(self, batch: Any, *, epoch: int | None = None, batch_index: int | None = None) -> Any:
        if batch_index is None:
            if epoch is not None:
                raise ValueError("give batch_index= with epoch= (or neither, to count calls since set_epoch)")
            e, b = self.epoch, self.batch
            self.batch += 1
        else:
            e, b = (self.epoch if epoch is None else int(epoch)), int(batch_index)
        g = batch_generator(self.seed, e, b)
        if isinstance(batch, torch.Tensor):
            return self.images(batch, g)
        if isinstance(batch, Mapping):
            if self.image not in batch:
                raise KeyError(f"augment.Pipeline: the batch has no {self.image!r} entry (it has "
                               f"{sorted(map(str, batch))}); pass image= the image field's name")
            out = dict(batch)
            out[self.image] = self.images(batch[self.image], g)
            return out
        if isinstance(batch, (tuple, list)):
            k = self.image if isinstance(self.image, int) else 0
            items = list(batch)
            items[k] = self.images(items[k], g)
            return type(batch)(items) if isinstance(batch, list) or type(batch) is tuple else type(batch)(*items)
        raise TypeError(f"augment.Pipeline takes a tensor, a dict or a tuple/list batch, got {type(batch).__name__}")

    def __repr__(self) -> str:
        return f"Pipeline({self.ops!r}, seed={self.seed}, image={self.image!r}, layout={self.layout!r})"


def imagenet_train(
    size: int = 224, *, seed: int = 0, image: str | int = "image", layout: str = "NHWC",
    jitter: float | None = None, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
) -> Pipeline:
    """The ImageNet training transform of the PyTorch examples: ``RandomResizedCrop(size)``,
    ``RandomHorizontalFlip()``, (``ColorJitter(jitter, jitter, jitter)`` if given), ``Normalize``."""
    ops: list[_Op] = [RandomResizedCrop(size), HorizontalFlip(0.5)]
    if jitter:
        ops.append(ColorJitter(jitter, jitter, jitter))
    ops.append(Normalize(mean, std))
    return Pipeline(ops, seed, image=image, layout=layout)


def imagenet_eval(
    size: int = 224, *, resize_to: int | None = None, image: str | int = "image", layout: str = "NHWC",
    mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
) -> Pipeline:
    """The ImageNet evaluation transform: ``Resize(resize_to)`` (default ``int(size / 0.875)``,
    256 for 224; antialiased), ``CenterCrop(size)``, ``Normalize``. Draws nothing."""
    r = int(size / 0.875) if resize_to is None else int(resize_to)
    return Pipeline([Resize(r), CenterCrop(size), Normalize(mean, std)], 0, image=image, layout=layout)
