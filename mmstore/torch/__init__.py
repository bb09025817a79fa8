"""PyTorch integration: the only part of mmstore that imports torch.

- :class:`StoreDataset`: a map-style Dataset (``__getitems__`` reads a whole
  batch in one call; ``default_collate`` passes it through without copies).
- :class:`Padded`: a ragged field's batch as padded values + lengths
  (``ragged="pad"``; the default is a list of tensors); :func:`multi_hot`:
  multi-label targets from a batch of tag ids.
- :class:`OrderSampler`, :class:`OrderBatchSampler`: Samplers over the
  torch-free orders of :mod:`mmstore.order` (``set_epoch``, DDP split).
- :class:`Loader`: batches read by threads into a ring of reusable (pinned)
  buffers, optional asynchronous copy to the GPU; no worker processes.
  :class:`LoaderTuning`: its tuning knobs in one object.
  :class:`RandomResizedCrop`, :class:`CenterCrop`: its ``crop=``, each
  record cropped and resized into the batch by the reader threads
  (:mod:`mmstore.engine.crop`; torch-free, re-exported here).
- :class:`BucketLoader`: what ``Loader`` is over a field with aspect buckets
  (and over any image field of its own shape when built by name): batches
  of one shape each, the shapes interleaved;
  :class:`BucketBatchSampler`: the same batches as a DataLoader
  ``batch_sampler`` (:mod:`mmstore.torch.buckets`).
- :func:`classification_loader`: a ``Loader`` yielding ``(images, target)``
  (float, normalised, CHW, on the device; int64 labels) with the ImageNet
  training or evaluation transform.
- :mod:`mmstore.torch.gpu`: ``normalize``, ``random_flip`` batch-wise on any device.
- :mod:`mmstore.torch.augment`: torchvision-style augmentation of whole
  batches (random resized crop, random crop, flip, colour jitter,
  normalize) on any device, and a seeded, resumable ``Pipeline``.
"""

from __future__ import annotations

from ..engine.crop import CenterCrop, RandomResizedCrop
from ..engine.tuning import LoaderTuning
from . import augment, gpu
from ._ragged import Padded, multi_hot
from .buckets import BucketBatchSampler, BucketLoader, bucket_schedule
from .dataset import StoreBatch, StoreDataset, collate
from .loader import Loader
from .presets import ClassificationTransform, classification_loader
from .sampler import OrderBatchSampler, OrderSampler, build_order

__all__ = [
    "BucketBatchSampler",
    "BucketLoader",
    "CenterCrop",
    "ClassificationTransform",
    "Loader",
    "LoaderTuning",
    "OrderBatchSampler",
    "OrderSampler",
    "Padded",
    "RandomResizedCrop",
    "StoreBatch",
    "StoreDataset",
    "augment",
    "bucket_schedule",
    "build_order",
    "classification_loader",
    "collate",
    "gpu",
    "multi_hot",
]
