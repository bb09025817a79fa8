"""Augmentation on whole batches, on the CPU or a CUDA device.

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
  antialias=False)`` on each crop, one call per image into one output batch:
  faster on the CPU than a batched gather); torchvision's tensor path antialiases by default, which matters
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

from ._base import IMAGENET_MEAN, IMAGENET_STD
from .color import adjust_colors, color_jitter, color_jitter_params, normalize, to_chw
from .geometry import (
    center_crop,
    crop,
    horizontal_flip,
    random_crop,
    random_crop_params,
    random_flip,
    random_resized_crop,
    random_resized_crop_params,
    resize,
    resized_crop,
)
from .pipeline import (
    CenterCrop,
    ColorJitter,
    HorizontalFlip,
    Normalize,
    Pipeline,
    RandomCrop,
    RandomResizedCrop,
    Resize,
    batch_generator,
    imagenet_eval,
    imagenet_train,
)

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
