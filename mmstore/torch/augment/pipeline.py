"""Seeded, reproducible chains of batch augmentations (:class:`Pipeline`) and the ImageNet ones."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._base import _PAD_MODES, IMAGENET_MEAN, IMAGENET_STD, _layout, _pair
from .color import color_jitter, color_jitter_params, normalize
from .geometry import _check_range, _padding4, center_crop, horizontal_flip, random_crop, random_resized_crop, resize

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
