"""Train-time crops into a fixed output: :class:`RandomResizedCrop` and
:class:`CenterCrop`, run by the Loader's reader threads.

A crop turns one image field of a batch (images of their own shape, or a
fixed-shape image field) into ``(batch, out_h, out_w[, C])``: each record is
read (a raw entry in place; a ``jpeg`` / ``png`` / ``zstd`` entry decoded
whole into a scratch buffer of the reader thread), its crop box taken, and
the box resized with one ``cv2.resize`` straight into the batch buffer's row
(OpenCV releases the GIL). The channel count and dtype are the field's.

NOTE [crop parameters]: the box of record ``r`` in epoch ``e`` is a
function of ``(seed, epoch, record)`` alone: its generator is
``numpy.random.Generator(Philox(SeedSequence([seed, epoch, record])))``
(:func:`crop_rng`), ``seed`` the order's. No timing, thread, rank or batch
enters it, so a run, a resumed run (in another process) and every rank
crop a record the same way, and a record read twice in an epoch
(``pad=True``) gets the same box twice.

``RandomResizedCrop`` draws its box as torchvision's
``RandomResizedCrop.get_params`` does, draw for draw: up to 10 attempts of
``target_area = area * U(scale)`` and ``aspect = exp(U(log ratio))``,
``w = round(sqrt(target_area * aspect))``, ``h = round(sqrt(target_area /
aspect))`` (Python's ``round``); the first attempt with ``0 < w <= W`` and
``0 < h <= H`` gives ``top = integers(0, H - h + 1)`` and ``left =
integers(0, W - w + 1)``; after 10 failures the fallback is the centre crop
clamped to the ratio range (the whole image when its aspect is inside it,
else the full width with ``h = round(w / min(ratio))``, or the full height
with ``w = round(h * max(ratio))``; ``top = (H - h) // 2``, ``left = (W - w)
// 2``; a side of the fallback box is at least 1 pixel, where torchvision's
would be 0 for a 1-pixel side against a ratio above 2). The uniforms are
float64 (torchvision draws float32 ones: the same distribution up to float32
rounding). With ``flip`` the next draw,
``random() < p``, says whether the output is mirrored left to right.

``CenterCrop`` is FFCV's validation crop: a centre box of side ``c =
int(ratio * min(H, W))`` (floored, at least 1), ``top = (H - c) // 2``,
``left = (W - c) // 2``, resized to the output. For an output that is not
square the box has the output's aspect: ``c_h = int(ratio * s * out_h)``,
``c_w = int(ratio * s * out_w)`` with ``s = min(H / out_h, W / out_w)``.
The box is relative to the record, so it always fits.

The resize (NOTE [crop resize]): ``INTER_AREA`` when no side of the box
grows (the box is at least the output in both sides), else ``INTER_LINEAR``
(torchvision uses bilinear with antialiasing, which is what ``INTER_AREA``
does for a shrink and what bilinear does for an enlargement). A box smaller
than the output (a small record, a small random box) is enlarged: never
padded, and never distorted beyond the box's own aspect against the
output's (exactly the random crop's aspect draw; a centre crop's box has
the output's aspect up to integer rounding).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import EntryDecodeError, SchemaError
from ..format.shaped import shape_problem

__all__ = [
    "CenterCrop", "CropReader", "RandomResizedCrop", "crop_box", "crop_field", "crop_rng", "resize_into",
]

ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params
CROP_DTYPES = ("|u1", "<u2", "<f4")  # what cv2.resize takes


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, (bool, np.bool_)):
        hw = (int(size), int(size))
    elif (isinstance(size, (tuple, list)) and len(size) == 2
          and all(isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in size)):
        hw = (int(size[0]), int(size[1]))
    else:
        raise TypeError(f"a crop's size must be an int or a pair of ints (h, w), got {size!r}")
    if min(hw) < 1:
        raise ValueError(f"a crop's size must be at least 1 x 1, got {hw[0]} x {hw[1]}")
    return hw


def _pair(name: str, value: Any) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"RandomResizedCrop: {name} must be a pair of numbers (low, high), got {value!r}") from None
    if not (0 < a <= b) or not math.isfinite(b):
        raise ValueError(f"RandomResizedCrop: {name} must be finite with 0 < low <= high, got {value!r}")
    return a, b


def _flip(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)):
        return 0.5 if value else 0.0
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip must be True, False or a probability in [0, 1], got {value!r}")
    return p


class _Crop:
    size: tuple[int, int]
    flip: float
    field: str | None

    def box(self, h: int, w: int, rng: np.random.Generator | None) -> tuple[int, int, int, int]:
        raise NotImplementedError

    @property
    def random(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, *sorted(vars(self).items())))


class RandomResizedCrop(_Crop):
    """A random box of the record, resized to ``size`` (torchvision's
    ``RandomResizedCrop``; the draws are the module's NOTE [crop parameters]).

    Parameters
    ----------
    size : int or (int, int)
        The output's ``(h, w)`` (an int: square).
    scale : (float, float), default (0.08, 1.0)
        The range of the box's area, as a fraction of the record's.
    ratio : (float, float), default (3/4, 4/3)
        The range of the box's aspect (width / height), drawn log-uniformly.
    flip : bool or float, default False
        Mirror the output left to right with probability 0.5 (``True``) or
        the probability given, drawn from the record's generator.
    field : str, optional
        The image field to crop (default: the one image field read).
    """

    def __init__(self, size: Any, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, flip: bool | float = False,
                 field: str | None = None) -> None:
        self.size = _size(size)
        self.scale = _pair("scale", scale)
        if self.scale[1] > 1.0:
            raise ValueError(f"RandomResizedCrop: scale is a fraction of the record's area, at most 1, got {scale!r}")
        self.ratio = _pair("ratio", ratio)
        self.flip = _flip(flip)
        self.field = field

    def box(self, h: int, w: int, rng: np.random.Generator | None) -> tuple[int, int, int, int]:
        """``(top, left, box_h, box_w)`` of a record of ``h x w`` pixels, drawn from ``rng``."""
        if rng is None:
            raise TypeError("RandomResizedCrop.box needs a generator (crop_rng(seed, epoch, record))")
        area = h * w
        lr0, lr1 = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(ATTEMPTS):
            target = area * rng.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rng.uniform(lr0, lr1))
            cw = int(round(math.sqrt(target * aspect)))
            ch = int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(rng.integers(0, h - ch + 1))
                left = int(rng.integers(0, w - cw + 1))
                return top, left, ch, cw
        in_ratio = w / h
        # at least 1 pixel: torchvision's rule gives an empty box for a side of 1 pixel
        # against a ratio range above 2 (round(1 / 2.5) = 0)
        if in_ratio < min(self.ratio):
            cw = w
            ch = max(1, int(round(cw / min(self.ratio))))
        elif in_ratio > max(self.ratio):
            ch = h
            cw = max(1, int(round(ch * max(self.ratio))))
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def __repr__(self) -> str:
        return (f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip}"
                + (f", field={self.field!r})" if self.field else ")"))


class CenterCrop(_Crop):
    """The centre box of side ``int(ratio * short side)``, resized to ``size``
    (FFCV's validation crop; the rule is the module docstring's).

    Parameters
    ----------
    size : int or (int, int)
        The output's ``(h, w)`` (an int: square).
    ratio : float, default 224/256
        The box's side as a fraction of the record's short side, in (0, 1].
    field : str, optional
        The image field to crop (default: the one image field read).
    """

    def __init__(self, size: Any, ratio: float = 224 / 256, *, field: str | None = None) -> None:
        self.size = _size(size)
        r = float(ratio)
        if not 0.0 < r <= 1.0:
            raise ValueError(f"CenterCrop: ratio is the box's side over the record's short side, in (0, 1], "
                             f"got {ratio!r}")
        self.ratio = r
        self.flip = 0.0
        self.field = field

    @property
    def random(self) -> bool:
        return False

    def box(self, h: int, w: int, rng: np.random.Generator | None = None) -> tuple[int, int, int, int]:
        """``(top, left, box_h, box_w)`` of a record of ``h x w`` pixels."""
        oh, ow = self.size
        if oh == ow:
            ch = cw = max(1, int(self.ratio * min(h, w)))
        else:
            s = min(h / oh, w / ow)
            ch = min(h, max(1, int(self.ratio * s * oh)))
            cw = min(w, max(1, int(self.ratio * s * ow)))
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size}, ratio={self.ratio}" + (f", field={self.field!r})" if self.field else ")")


def crop_rng(seed: int, epoch: int, record: int) -> np.random.Generator:
    """The generator of record ``record``'s crop in ``epoch`` (NOTE [crop parameters])."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([int(seed), int(epoch), int(record)])))


def crop_box(crop: _Crop, h: int, w: int, seed: int, epoch: int, record: int) -> tuple[int, int, int, int, bool]:
    """``(top, left, box_h, box_w, flipped)``: what ``crop`` does to record
    ``record`` (``h x w`` pixels) in ``epoch`` of a loader with order seed
    ``seed``, the same in every process (NOTE [crop parameters])."""
    if not crop.random:
        return (*crop.box(h, w, None), False)
    rng = crop_rng(seed, epoch, record)
    box = crop.box(h, w, rng)
    return (*box, bool(crop.flip and rng.random() < crop.flip))


def resize_into(src: np.ndarray, dst: np.ndarray, flip: bool = False) -> None:
    """Resize image ``src`` (``(h, w)`` or ``(h, w, C)``, any strides of a
    crop) into ``dst`` (the output's shape, C-contiguous) with one
    ``cv2.resize`` (NOTE [crop resize]), then mirror it when ``flip``."""
    import cv2

    oh, ow = dst.shape[:2]
    if src.ndim == 3 and src.shape[2] == 1:  # OpenCV drops a last axis of 1: resize the plane
        src, dst = src[..., 0], dst[..., 0]
    grow = oh > src.shape[0] or ow > src.shape[1]
    inter = cv2.INTER_LINEAR if grow else cv2.INTER_AREA
    got = cv2.resize(src, (ow, oh), dst=dst, interpolation=inter)
    if got is not dst and not np.shares_memory(got, dst):  # OpenCV allocated anew: never silently lost
        dst[...] = got
    if flip:
        got = cv2.flip(dst, 1, dst=dst)
        if got is not dst and not np.shares_memory(got, dst):
            dst[...] = got


def crop_field(store: Any, fields: Sequence[str], crop: Any) -> str:
    """The field ``crop`` applies to among ``fields`` (read by a loader of
    ``store``): its ``field``, else the one image field (a shaped field, else
    a fixed ``(H, W)`` / ``(H, W, C)`` one). Raises ``TypeError`` for a
    ``crop`` that is not a crop, :class:`~mmstore.errors.SchemaError` when no
    field (or more than one) can be cropped, naming the fields."""
    if not isinstance(crop, _Crop):
        raise TypeError(f"crop= must be a mmstore RandomResizedCrop or CenterCrop, got {type(crop).__name__}")
    schema = store.schema

    def croppable(f: str) -> bool:
        fd = schema[f]
        if fd.shaped:
            return fd.dtype.str in CROP_DTYPES
        return (not fd.ragged and fd.dtype.str in CROP_DTYPES and len(fd.shape) in (2, 3)
                and (len(fd.shape) == 2 or fd.shape[2] <= 4) and min(fd.shape[:2]) > 1)

    if crop.field is not None:
        if crop.field not in fields:
            raise SchemaError(f"{crop!r}: field {crop.field!r} is not among the fields read {list(fields)}; "
                              "add it to fields= or name one of them")
        if not croppable(crop.field):
            fd = schema[crop.field]
            raise SchemaError(f"{crop!r}: field {crop.field!r} ({fd.dtype.str} {list(fd.shape)}) is not an image "
                              f"a crop can resize: expected (H, W) or (H, W, C<=4) of dtype {' / '.join(CROP_DTYPES)}")
        return crop.field
    shaped = [f for f in fields if schema[f].shaped and croppable(f)]
    cands = shaped or [f for f in fields if croppable(f) and not schema[f].shaped]
    if len(cands) == 1:
        return cands[0]
    described = ", ".join(f"{f!r} {schema[f].dtype.str} {list(schema[f].shape)}" for f in fields)
    if not cands:
        raise SchemaError(f"{crop!r}: none of the fields read is an image to crop ({described}); a crop takes a "
                          f"field of images of their own shape or of shape (H, W) / (H, W, C<=4), dtype "
                          f"{' / '.join(CROP_DTYPES)}")
    raise SchemaError(f"{crop!r}: more than one field could be cropped ({cands}); name one with "
                      f"{type(crop).__name__}(..., field=NAME)")


def out_shape(store: Any, field: str, crop: _Crop) -> tuple[int, ...]:
    """The cropped field's record shape in a batch: ``(out_h, out_w)`` plus its channels."""
    return (*crop.size, *store.schema[field].shape[2:])


_tls = threading.local()  # each reader thread's buffers: an entry read, its decoded pixels


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """The calling thread's buffer ``name`` of at least ``nbytes`` (grown, never shrunk)."""
    buf = getattr(_tls, name, None)
    if buf is None or len(buf) < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        setattr(_tls, name, buf)
    return buf


class CropReader:
    """One epoch's crops of one field: :meth:`read` fills rows of a batch.

    ``seed``, ``epoch``: NOTE [crop parameters]. For a shaped field, each
    record's size comes from its ``<name>_hw`` field and its entry is
    checked against it before anything is decoded or cropped
    (:func:`mmstore.format.shaped.shape_problem`)."""

    def __init__(self, store: Any, field: str, crop: _Crop, seed: int, epoch: int) -> None:
        self.store = store
        self.field = field
        self.crop = crop
        self.seed = int(seed)
        self.epoch = int(epoch)
        fd = store.schema[field]
        self.shaped = bool(fd.shaped)
        self.codec = fd.codec.name if fd.variable else "raw"
        self.fields = (field,)

    @property
    def path(self) -> str:
        """What runs per record (``Loader.describe()``)."""
        how = "a view of the stored pixels" if self.codec == "raw" else f"full {self.codec} decode"
        return f"{how}, crop, one cv2.resize into the batch"

    def boxes(self, records: np.ndarray, hw: np.ndarray) -> list[tuple[int, int, int, int, bool]]:
        """Each record's ``crop_box``."""
        return [crop_box(self.crop, int(h), int(w), self.seed, self.epoch, int(r))
                for r, (h, w) in zip(records.tolist(), hw.tolist())]

    def read(self, records: np.ndarray, out: np.ndarray) -> None:
        """Records ``records`` (the store's record indices), cropped and
        resized into ``out[j]``."""
        if len(records) == 0:
            return
        if not self.shaped:
            src = self.store.read_batch(records, fields=[self.field])[self.field]
            h, w = src.shape[1:3]
            for j, (t, le, ch, cw, fl) in enumerate(self.boxes(records, np.tile([h, w], (len(records), 1)))):
                resize_into(src[j, t : t + ch, le : le + cw], out[j], fl)
            return
        field = self.store.schema[self.field]
        hw = np.asarray(self.store.read_batch(records, fields=[field.hw_name])[field.hw_name], np.int64)
        slots = self.store.slot_view.slots_of(records)
        chans = tuple(field.shape[2:])
        boxes = self.boxes(records, hw)
        for j, data in enumerate(self._entries(slots)):
            why = shape_problem(field, data, hw[j])
            if why is not None:
                raise _bad(field.name, int(slots[j]), int(records[j]), why)
            h, w = int(hw[j, 0]), int(hw[j, 1])
            if self.codec == "raw":
                img = data.view(field.dtype).reshape(h, w, *chans)
            else:
                n = h * w * int(np.prod(chans, dtype=np.int64)) * field.dtype.itemsize
                img = _scratch("pixels", n)[:n].view(field.dtype).reshape(h, w, *chans)
                try:
                    field.codec.decode_into(data, img)
                except EntryDecodeError as exc:
                    raise _bad(field.name, int(slots[j]), int(records[j]), exc.reason or str(exc)) from None
            t, le, ch, cw, fl = boxes[j]
            resize_into(img[t : t + ch, le : le + cw], out[j], fl)

    def _entries(self, slots: np.ndarray) -> Iterator[np.ndarray]:
        """The stored entries of ``slots``, one at a time, in that order.

        A local memmap store of one segment: each entry ``preadv``-d from the
        field's data file into the reader thread's buffer (GIL released), at
        the offsets index's pair, proven in range first. Otherwise (LMDB, a
        merged store, a store opened from a URL, whose blocks the backend
        fetches and verifies): the backend's ``gather_entries``."""
        be = self.store.slot_view.backend
        if not be.positional or self.store.replica is not None or len(be.segment_backends()) != 1:
            order = np.argsort(slots, kind="stable")
            flat, sizes = be.gather_entries(self.field, slots[order])
            starts = np.zeros(len(sizes) + 1, np.int64)
            np.cumsum(sizes, out=starts[1:])
            at = np.empty(len(slots), np.int64)
            at[order] = np.arange(len(slots))
            for j in range(len(slots)):
                k = int(at[j])
                yield flat[int(starts[k]) : int(starts[k + 1])]
            return
        offs = be.entry_offsets(self.field)  # proven pair by pair below (format.py, "Variable-size entries")
        size = be.entry_data_size(self.field)
        path = be.entry_spans(self.field, 0, 0)[0][0]
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for s in slots.tolist():
                a, b = int(offs[s]), int(offs[s + 1])
                if not 0 <= a <= b <= size:
                    raise EntryDecodeError(f"field {self.field!r}, slot {s}: its offsets {a}..{b} are not an "
                                           f"increasing pair within the {size:,}-byte data file (run mmstore verify)",
                                           field=self.field, slot=s)
                buf = _scratch("entry", b - a)
                pos = 0
                while pos < b - a:
                    got = os.preadv(fd, [memoryview(buf[pos : b - a])], a + pos)  # type: ignore[arg-type]
                    if got <= 0:  # the file shrank under the store: a short entry, refused by its size check
                        break
                    pos += got
                yield buf[:pos]
        finally:
            os.close(fd)


def _bad(name: str, slot: int, record: int, reason: str) -> EntryDecodeError:
    return EntryDecodeError(f"field {name!r}, record {record}, slot {slot}: {reason}", field=name, slot=slot,
                            index=record, reason=reason)
