"""Batch-wise image helpers that run wherever the batch is (GPU or CPU).

uint8 crosses the bus; converting to float, normalising and flipping happen
on the device, once per batch, not per sample in a worker. These are
:mod:`mmstore.torch.augment`'s functions (kept here by their first names);
``augment`` has the rest (random resized crop, random crop, colour jitter,
a seeded :class:`~mmstore.torch.augment.Pipeline`).
"""

from __future__ import annotations

from .augment import normalize, random_flip, to_chw

__all__ = ["normalize", "random_flip", "to_chw"]
