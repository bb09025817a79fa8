"""Batch-wise image helpers that run wherever the batch is (GPU or CPU).

uint8 crosses the bus; converting to float, normalising and flipping happen
on the device, once per batch, not per sample in a worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["normalize", "random_flip", "to_chw"]


def _layout(batch: torch.Tensor, layout: str) -> str:
    if batch.dim() != 4:
        raise ValueError(f"expected a 4-D image batch, got shape {tuple(batch.shape)}")
    lay = layout.upper()
    if lay not in ("NHWC", "NCHW"):
        raise ValueError(f"layout must be 'NHWC' or 'NCHW', got {layout!r}")
    return lay


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
        ``(0.229, 0.224, 0.225)`` with the default ``scale=255``).
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
    inv = 1.0 / (s * scale)
    shift = m / s
    out = x.to(dtype)
    out.mul_(inv.view(1, -1, 1, 1)).sub_(shift.view(1, -1, 1, 1))
    return out


def random_flip(
    batch: torch.Tensor,
    p: float = 0.5,
    generator: torch.Generator | None = None,
    *,
    layout: str = "NHWC",
    dim: str = "horizontal",
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
        device (the draws are made on the generator's device and moved).
    dim : {"horizontal", "vertical"}

    Returns
    -------
    Tensor
        A new tensor, same shape, layout and device.
    """
    lay = _layout(batch, layout)
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if dim not in ("horizontal", "vertical"):
        raise ValueError(f"dim must be 'horizontal' or 'vertical', got {dim!r}")
    axis = {("NHWC", "horizontal"): 2, ("NHWC", "vertical"): 1,
            ("NCHW", "horizontal"): 3, ("NCHW", "vertical"): 2}[(lay, dim)]
    gdev = generator.device if generator is not None else batch.device
    draw = torch.rand(batch.shape[0], generator=generator, device=gdev) < float(p)
    mask = draw.to(batch.device).view(-1, 1, 1, 1)
    return torch.where(mask, batch.flip(axis), batch)
