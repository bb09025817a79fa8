"""Ready-made loaders: :func:`classification_loader` gives ``(images,
labels)`` batches the way a torchvision classification script expects them.

``for images, target in classification_loader("train.store", 256, device="cuda"):``
yields ``images`` float32 ``(N, C, size, size)``, normalised (ImageNet mean
and std), on the device, and ``target`` int64 ``(N,)``: the training
transform of the PyTorch ImageNet example (``RandomResizedCrop(size)``,
``RandomHorizontalFlip()``, ``Normalize``) with ``train=True``, the
evaluation one (``Resize(size / 0.875)``, ``CenterCrop(size)``,
``Normalize``) with ``train=False``. Both run on whole batches after the
copy to the device (:mod:`mmstore.torch.augment`), seeded per ``(seed,
epoch, batch)``, so a resumed run (``Loader.load_state_dict``) draws the
same crops and flips.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import SchemaError
from ..order import OrderSpec
from ..store.reader import Store
from . import augment
from ._source import resolve_source
from .dataset import image_fields
from .loader import Loader

__all__ = ["ClassificationTransform", "classification_fields", "classification_loader"]

# one channel: the mean of ImageNet's three channel means and stds
GRAY_MEAN = (float(np.mean(augment.IMAGENET_MEAN)),)
GRAY_STD = (float(np.mean(augment.IMAGENET_STD)),)


def classification_fields(store: Store, image: str | None = None, label: str | None = None) -> tuple[str, str]:
    """``(image field, label field)`` of a store: the given names, else the
    one HWC image field (1 or 3 channels) and the field named ``"label"``
    (else the one integer scalar field other than ``"idx"``);
    :class:`~mmstore.errors.SchemaError` when that is not one field each."""
    schema = store.schema
    names = list(schema.names)
    desc = ", ".join(f"{n} {schema[n].dtype}{tuple(schema[n].shape)}" for n in names)
    if image is None:
        found = sorted(image_fields(store, names))
        if len(found) != 1:
            raise SchemaError(
                f"{store.path}: classification_loader needs one image field (H, W, 1 or 3), found "
                f"{found or 'none'} among: {desc}; name it with image="
            )
        image = found[0]
    if image not in schema.names:
        raise SchemaError(f"{store.path}: no field {image!r}; the fields are: {desc}")
    shape = tuple(schema[image].shape)
    if len(shape) != 3 or shape[-1] not in (1, 3):
        raise SchemaError(
            f"{store.path}: field {image!r} has shape {shape}; classification_loader reads (H, W, 1) or "
            "(H, W, 3) images. For RGBA images: ingest the image files again (`mmstore ingest` writes RGB; "
            "--alpha black|white|drop), or keep this store and pass Loader(store, batch_size, "
            f"fields=({image!r}, label), as_tuple=True, transform=f) with f dropping the 4th channel"
        )
    if label is None:
        ints = [n for n in names if schema[n].shape == () and np.dtype(schema[n].dtype).kind in "iu"]
        cands = ["label"] if "label" in ints else [n for n in ints if n != "idx"]
        if len(cands) != 1:
            raise SchemaError(
                f"{store.path}: classification_loader needs one integer label field (shape ()), found "
                f"{cands or 'none'} among: {desc}; name it with label="
            )
        label = cands[0]
    if label not in schema.names or schema[label].shape != () or np.dtype(schema[label].dtype).kind not in "iu":
        raise SchemaError(
            f"{store.path}: label field {label!r} must be an integer scalar field; the fields are: {desc}"
        )
    return image, label


class ClassificationTransform:
    """A Loader ``transform`` for ``(images, labels)`` tuples: ``pipeline``
    on the images (drawn from ``(seed, epoch, batch_index)``), labels as
    int64. Called by the Loader as ``t(batch, epoch=e, batch_index=k)``."""

    def __init__(self, pipeline: augment.Pipeline) -> None:
        self.pipeline = pipeline

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor], *, epoch: int = 0,
                 batch_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        return self.pipeline(images, epoch=epoch, batch_index=batch_index), labels.to(torch.int64)

    def __repr__(self) -> str:
        return f"ClassificationTransform({self.pipeline!r})"


def classification_loader(
    store: Any,
    batch_size: int,
    *,
    train: bool = True,
    size: int = 224,
    device: str | torch.device | None = None,
    seed: int = 0,
    order: Any = None,
    image: str | None = None,
    label: str | None = None,
    jitter: float | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    **loader_kw: Any,
) -> Loader:
    """A :class:`Loader` yielding ``(images, target)`` for a classifier.

    Parameters
    ----------
    store : path, Store, StoreDataset or Subset
        As for :class:`Loader` (``indices=`` also works).
    batch_size : int
    train : bool, default True
        ``True``: ``augment.imagenet_train(size)`` (random resized crop, flip,
        optional colour ``jitter``), order ``"permutation"``. ``False``:
        ``augment.imagenet_eval(size)`` (resize to ``size / 0.875``, centre
        crop), order ``"sequential"``.
    size : int, default 224
        Output height and width.
    device : optional
        Where the batches are transformed and yielded (``"cuda"``: uint8
        crosses the bus, the crops run on the GPU).
    seed : int
        Seeds the augmentation draws, and the order when it is a kind name.
    order : optional
        Overrides the order (a kind name, an :class:`mmstore.order.OrderSpec`
        with its own seed, rank and world size, or an
        :class:`mmstore.order.Order`).
    image, label : str, optional
        Field names (default: found from the schema, see
        :func:`classification_fields`).
    mean, std : optional
        Normalisation (default ImageNet's; one-channel images: their means,
        ``(0.449,)`` and ``(0.226,)``).
    **loader_kw
        Any other :class:`Loader` keyword (``drop_last``, ``indices``,
        ``tuning`` ...).

    Each batch is ``(images, target)``: ``images`` float32 ``(N, C, size,
    size)`` normalised (channels-last strides), ``target`` int64 ``(N,)``.
    The transform is ``loader.transform`` (a :class:`ClassificationTransform`).
    """
    for k in ("fields", "as_tuple", "chw", "transform"):
        if k in loader_kw:
            raise TypeError(f"classification_loader sets {k}= itself; use Loader(...) for another layout")
    src = resolve_source(store, loader_kw.get("indices"))
    image, label = classification_fields(src.store, image, label)
    channels = src.store.schema[image].shape[-1]
    if mean is None:
        mean = augment.IMAGENET_MEAN if channels == 3 else GRAY_MEAN
    if std is None:
        std = augment.IMAGENET_STD if channels == 3 else GRAY_STD
    if train:
        pipe = augment.imagenet_train(size, seed=seed, image=0, jitter=jitter, mean=mean, std=std)
    else:
        pipe = augment.imagenet_eval(size, image=0, mean=mean, std=std)
    if order is None:
        order = "permutation" if train else "sequential"
    if isinstance(order, str):
        order = OrderSpec(order, seed=seed)
    arg = src.store if src.own else store  # a path was opened here: the loader owns that store
    loader = Loader(arg, batch_size, order, fields=(image, label), as_tuple=True, chw=False, device=device,
                    transform=ClassificationTransform(pipe), **loader_kw)
    if src.own:
        loader._own_store = True
    return loader
