"""Channel-first conversion, normalisation and colour jitter of whole batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._base import _dense, _layout, _rand, _undense
from .geometry import _check_range

# -- flips, normalisation ------------------------------------------------------------


def to_chw(batch: torch.Tensor) -> torch.Tensor:
    """NHWC -> NCHW as a view (channels-last strides; no copy)."""
    if batch.dim() != 4:
        raise ValueError(f"expected a 4-D NHWC batch, got shape {tuple(batch.shape)}")
    return batch.permute(0, 3, 1, 2)


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
    """:func:`normalize` of a dense NHWC batch on the CPU, faster than broadcasting
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
    perm: tuple[int, ...] = (0, 1, 2)
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
