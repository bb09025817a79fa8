"""Crops, resizes and flips of whole batches (torchvision's semantics; see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._base import (
    _PAD_MODES,
    _boxes,
    _check_inside,
    _dense,
    _finish,
    _hw,
    _image_view,
    _layout,
    _pair,
    _rand,
    _randint_below,
    _undense,
)


def resized_crop(
    batch: torch.Tensor, boxes: Any, size: int | Sequence[int], *, layout: str = "NHWC",
) -> torch.Tensor:
    """Crop box ``boxes[n]`` of image ``n`` and resize it to ``size``, bilinear, no antialias.

    ``boxes``: ``(N, 4)`` ``(top, left, height, width)`` inside the image.
    Per image, ``F.interpolate(img[..., top:top+h, left:left+w], size,
    mode="bilinear", align_corners=False, antialias=False)`` into one output
    batch (uint8 on the CPU through PyTorch's uint8 kernel, other cases in
    float, integers rounded): faster on the CPU than computing the whole
    batch as two gathers (``benchmarks/bench_augment.py`` measures it).
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
        # a dense channels-last crop takes PyTorch's vectorised uint8 kernel on the CPU (much faster)
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
