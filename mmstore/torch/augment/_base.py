"""Layout helpers, parameter checks and the random draws the augmentations share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
