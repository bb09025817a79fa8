"""Train-time crops into a fixed output: :class:`RandomResizedCrop` and
:class:`CenterCrop`, run by the Loader's reader threads.

A crop turns one image field of a batch (images of their own shape, or a
fixed-shape image field) into ``(batch, out_h, out_w[, C])``: each record is
read (a raw entry in place; a ``jpeg`` / ``png`` / ``zstd`` entry decoded
into a scratch buffer of the reader thread, a ``jpeg`` one of a local store
read from the mapped data file without a copy, and at a reduced scale where
the crop allows: NOTE [DCT-scaled decode]), its crop box taken,
and the box resized with one ``cv2.resize`` straight into the batch buffer's
row (OpenCV and libjpeg-turbo, through simplejpeg, release the GIL). The
channel count and dtype are the field's.

NOTE [crop parameters]: the box of record ``r`` in epoch ``e`` is a
function of ``(seed, epoch, record)`` alone (``seed`` the order's): its
random numbers are ``DRAWS`` uniforms in [0, 1) from a counter-based hash
(:func:`crop_uniforms`): ``key = mix(mix(mix(seed ^ C) ^ epoch) ^ record)``
with ``mix`` splitmix64's finaliser over uint64 and ``C =
0x6A09E667F3BCC909``; draw ``k`` (0-based) is ``mix(key + (k + 1) *
0x9E3779B97F4A7C15) >> 11`` times ``2**-53``. No timing, thread, rank or
batch enters it, so a run, a resumed run (in another process) and every rank
crop a record the same way, a record read twice in an epoch (``pad=True``)
gets the same box twice, and a whole batch's boxes are drawn at once.

``RandomResizedCrop`` draws its box as torchvision's
``RandomResizedCrop.get_params`` does: for attempt ``i`` of 10, ``target_area
= area * (lo + (hi - lo) * u[2i])`` (``scale``) and ``aspect = exp(log(r0) +
(log(r1) - log(r0)) * u[2i + 1])`` (``ratio``), ``w = round(sqrt(target_area
* aspect))``, ``h = round(sqrt(target_area / aspect))`` (round half to even,
as Python's ``round``); the first attempt with ``0 < w <= W`` and ``0 < h <=
H`` gives ``top = floor(u[20] * (H - h + 1))`` and ``left = floor(u[21] * (W
- w + 1))``; after 10 failures the fallback is the centre crop clamped to the
ratio range (the whole image when its aspect is inside it, else the full
width with ``h = round(w / min(ratio))``, or the full height with ``w =
round(h * max(ratio))``; ``top = (H - h) // 2``, ``left = (W - w) // 2``; a
side of the fallback box is at least 1 pixel, where torchvision's would be 0
for a 1-pixel side against a ratio above 2). The uniforms are float64
(torchvision draws float32 ones: the same distribution up to float32
rounding). With ``flip``, ``u[22] < p`` says whether the output is mirrored
left to right.

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

NOTE [DCT-scaled decode]: a ``jpeg`` record of its own shape (``H x W``)
whose box ``(top, left, h, w)`` is at least ``d`` times the output ``(oh,
ow)`` in both sides (``h >= d * oh`` and ``w >= d * ow``) is decoded at
scale ``1/d``, ``d`` the largest of 8, 4, 2 that fits (libjpeg-turbo
scales in the DCT domain: less inverse-DCT, upsampling and colour work per
pixel; its 3/8, 5/8, 3/4 and 7/8 scales are slower than a whole decode and
never used). The decoded image is ``ceil(H / d) x ceil(W / d)`` (libjpeg's
rounding), asked of simplejpeg as ``min_height=ceil(H / d), min_width=ceil(W
/ d)``: simplejpeg takes the smallest of its scales 1/8, 1/4, 3/8, ... 7/8
whose image is at least that, which is ``1/d`` unless a smaller scale gives
the same size (a record under 8 pixels in both sides): :func:`dct_scale`
checks that and then tries the next ``d`` (and a decode that comes out at
another size is redone whole). Scaled pixel ``i`` covers the record's
pixels ``[i d, (i + 1) d)``, so the box keeps its exact place: where the
scaled box is less than twice the output in both sides (``h < 2 d oh`` and
``w < 2 d ow``, always so for ``d`` 2 and 4), one ``cv2.warpAffine``
(``INTER_LINEAR``) samples output pixel ``(i, k)`` at the record's point
``(top + (i + 1/2) h / oh, left + (k + 1/2) w / ow)`` divided by ``d``
(sub-pixel exact); else (``d`` 8 and a box of 16 times the output or more)
the box's edges are rounded to the scaled grid, each ``floor(edge / d +
1/2)`` (:func:`scaled_box`: within the scaled image and at least the
output), then one ``cv2.resize`` (``INTER_AREA``). Either writes the batch's
row. The box, the flip and the output are those of the whole decode; the
pixels differ from it by the scaled decode's filtering (a PSNR of 35 dB or
more on photographs). Rows outside the box are still decoded:
libjpeg-turbo's ``jpeg_crop_scanline`` / ``jpeg_skip_scanlines`` are not
reachable through simplejpeg or OpenCV. ``dct_scale=False`` (on the crop)
decodes every record whole, pixel-exact against a whole decode, crop and
resize.

NOTE [boxes follow the crop]: with ``boxes=NAME`` (a ragged field of xyxy
boxes in the cropped image's pixels, COCO's ``boxes``), each record's boxes
are mapped through its crop as its pixels are: ``x' = (x - left) * out_w /
box_w``, ``y' = (y - top) * out_h / box_h`` (float64), then, for a
mirrored output, ``x' -> out_w - x'`` (the two x edges swapped), then
clipped to the output ``[0, out_w] x [0, out_h]``; a box whose clipped width
or height is not positive (wholly outside the crop, or empty), or not finite,
is dropped, and with it its row of every field of ``box_fields`` (fields
with one row per box, checked per record). With ``polygons`` (COCO's
points, points per polygon and box row of each polygon), each polygon's
points are mapped the same way and clipped to the output exactly
(:func:`mmstore.decode.geometry.clip_polygon`); a polygon of a dropped box,
or left with fewer than 3 points, is dropped, and the box rows are
renumbered to the boxes kept (the ingest's rule for a resize). The values
keep the fields' dtypes.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import EntryDecodeError, SchemaError, StoreChangedError
from ..format.layout import SHAPED_MAX_BYTES, note_identity, open_store_file
from ..format.shaped import shape_problem

__all__ = [
    "DRAWS", "CenterCrop", "CropReader", "RandomResizedCrop", "crop_box", "crop_field", "crop_uniforms",
    "dct_scale", "follow_crop", "resample_scaled", "resize_into", "scaled_box",
]

ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params
DRAWS = 2 * ATTEMPTS + 3  # per record: (area, aspect) per attempt, then top, left, flip
CROP_DTYPES = ("|u1", "<u2", "<f4")  # what cv2.resize takes
DCT_DENOMS = (8, 4, 2)  # libjpeg-turbo's fast DCT scales 1/8, 1/4, 1/2, the smallest first
# simplejpeg's candidate scales (num, denom), in the order it tries them (then 1/1)
_TJ_SCALES = ((1, 8), (1, 4), (3, 8), (1, 2), (5, 8), (3, 4), (7, 8))
_GOLDEN = 0x9E3779B97F4A7C15
_SEED_SALT = 0x6A09E667F3BCC909
_U64 = (1 << 64) - 1


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, (bool, np.bool_)):
        hw = (int(size), int(size))
    elif (isinstance(size, (tuple, list)) and len(size) == 2
          and all(isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in size)):
        hw = (int(size[0]), int(size[1]))
    else:
        raise TypeError(f"a crop's size must be an int or a pair of ints (h, w), got {size!r}")
    if min(hw) < 1:
        raise ValueError(f"a crop's size is the output's (h, w) in pixels, each at least 1, got {hw[0]} x {hw[1]}")
    return hw


def _pair(name: str, value: Any) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"RandomResizedCrop: {name} must be a pair of numbers (low, high), got {value!r}") from None
    if not (0 < a <= b) or not math.isfinite(b):
        raise ValueError(f"RandomResizedCrop: {name} must be a pair (low, high) of finite numbers with "
                         f"0 < low <= high, got {value!r}")
    return a, b


def _flip(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)):
        return 0.5 if value else 0.0
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip must be True, False or a probability in [0, 1], got {value!r}")
    return p


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (a bijection; wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def crop_uniforms(seed: int, epoch: int, records: Any) -> np.ndarray:
    """``(len(records), DRAWS)`` float64 uniforms in [0, 1): the random
    numbers of each record's crop in ``epoch`` (NOTE [crop parameters])."""
    recs = np.asarray(records, np.int64).reshape(-1).astype(np.uint64)
    head = np.array([(int(seed) & _U64) ^ _SEED_SALT], np.uint64)
    head = _mix(_mix(head) ^ np.uint64(int(epoch) & _U64))
    keys = _mix(head ^ recs)
    ctr = np.arange(1, DRAWS + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    v = _mix(keys[:, None] + ctr[None, :])
    return (v >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)


def _follow(boxes: Any, box_fields: Any, polygons: Any) -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    if boxes is not None and not isinstance(boxes, str):
        raise TypeError(f"boxes= is the name of one ragged field of xyxy boxes, got {boxes!r}")
    fields = (box_fields,) if isinstance(box_fields, str) else tuple(box_fields)
    if not all(isinstance(f, str) for f in fields):
        raise TypeError(f"box_fields= is a sequence of field names, got {box_fields!r}")
    if fields and boxes is None:
        raise ValueError(f"box_fields={list(fields)} go with boxes=: name the ragged field of boxes they belong to")
    poly: tuple[str, ...] = ()
    if polygons is not None:
        poly = tuple(polygons) if not isinstance(polygons, str) else (polygons,)
        if len(poly) != 3 or not all(isinstance(f, str) for f in poly):
            raise ValueError(f"polygons= is three field names (points, points per polygon, box row per polygon), "
                             f"e.g. COCO's ('polygon_points', 'polygon_sizes', 'polygon_box'), got {polygons!r}")
        if boxes is None:
            raise ValueError("polygons= go with boxes=: name the ragged field of boxes they belong to")
    return boxes, fields, poly


class _Crop:
    size: tuple[int, int]
    flip: float
    field: str | None
    dct_scale: bool
    boxes_field: str | None
    box_fields: tuple[str, ...]
    polygons: tuple[str, ...]

    def boxes(self, hw: np.ndarray, u: np.ndarray | None) -> np.ndarray:
        """``(n, 5)`` int64 rows ``(top, left, box_h, box_w, flipped)`` for
        records of sizes ``hw`` (``(n, 2)``) and uniforms ``u``
        (``crop_uniforms``; None for a crop that draws nothing)."""
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
        The output's ``(h, w)`` in pixels, each at least 1 (an int: square).
    scale : (float, float), default (0.08, 1.0)
        The range ``(low, high)`` of the box's area, as a fraction of the
        record's: ``0 < low <= high <= 1``.
    ratio : (float, float), default (3/4, 4/3)
        The range ``(low, high)`` of the box's aspect (width / height), drawn
        log-uniformly: ``0 < low <= high``, finite.
    flip : bool or float, default False
        Mirror the output left to right with probability 0.5 (``True``) or
        the probability given, drawn from the record's generator.
    field : str, optional
        The image field to crop (default: the one image field read).
    dct_scale : bool, default True
        Decode a ``jpeg`` record at the reduced scale its box allows
        (NOTE [DCT-scaled decode]); False: decode it whole (pixel-exact
        against a whole decode, crop and resize). The boxes are the same.
    boxes : str, optional
        A ragged field of xyxy boxes ``(None, 4)`` in the image's pixels
        (COCO's ``boxes``) that follows the crop: NOTE [boxes follow the
        crop].
    box_fields : sequence of str, default ()
        Ragged fields with one row per box (COCO's ``category``,
        ``iscrowd``, ``annotation_id``): a box dropped by the crop drops
        its row of each.
    polygons : (str, str, str), optional
        The ragged fields of the boxes' polygons, COCO's layout
        ``("polygon_points", "polygon_sizes", "polygon_box")`` (all points,
        points per polygon, the box row each belongs to): mapped and
        clipped with the boxes.
    """

    def __init__(self, size: Any, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, flip: bool | float = False,
                 field: str | None = None, dct_scale: bool = True, boxes: str | None = None,
                 box_fields: Sequence[str] = (),
                 polygons: Sequence[str] | None = None) -> None:
        self.size = _size(size)
        self.scale = _pair("scale", scale)
        if self.scale[1] > 1.0:
            raise ValueError(f"RandomResizedCrop: scale is a fraction (low, high) of the record's area, "
                             f"0 < low <= high <= 1, got {scale!r}")
        self.ratio = _pair("ratio", ratio)
        self.flip = _flip(flip)
        self.field = field
        self.dct_scale = bool(dct_scale)
        self.boxes_field, self.box_fields, self.polygons = _follow(boxes, box_fields, polygons)

    def boxes(self, hw: np.ndarray, u: np.ndarray | None) -> np.ndarray:
        if u is None:
            raise TypeError("RandomResizedCrop.boxes needs the records' uniforms (crop_uniforms(seed, epoch, records))")
        hw = np.asarray(hw, np.int64).reshape(-1, 2)
        n = len(hw)
        out = np.zeros((n, 5), np.int64)
        if n == 0:
            return out
        H, W = hw[:, 0:1].astype(np.float64), hw[:, 1:2].astype(np.float64)
        s0, s1 = self.scale
        lr0, lr1 = math.log(self.ratio[0]), math.log(self.ratio[1])
        target = H * W * (s0 + (s1 - s0) * u[:, 0 : 2 * ATTEMPTS : 2])
        aspect = np.exp(lr0 + (lr1 - lr0) * u[:, 1 : 2 * ATTEMPTS : 2])
        cw = np.round(np.sqrt(target * aspect))
        ch = np.round(np.sqrt(target / aspect))
        ok = (cw > 0) & (cw <= W) & (ch > 0) & (ch <= H)
        first = ok.argmax(axis=1)
        hit = ok[np.arange(n), first]
        rows = np.arange(n)
        bh = ch[rows, first].astype(np.int64)
        bw = cw[rows, first].astype(np.int64)
        h, w = hw[:, 0], hw[:, 1]
        top = np.minimum(np.floor(u[:, 2 * ATTEMPTS] * (h - bh + 1)).astype(np.int64), h - bh)
        left = np.minimum(np.floor(u[:, 2 * ATTEMPTS + 1] * (w - bw + 1)).astype(np.int64), w - bw)
        if not hit.all():  # the fallback: the centre box clamped to the ratio range
            miss = ~hit
            fh, fw = h[miss], w[miss]
            in_ratio = fw / fh
            lo, hi = min(self.ratio), max(self.ratio)
            narrow, wide = in_ratio < lo, in_ratio > hi
            # at least 1 pixel: torchvision's rule gives an empty box for a side of 1 pixel
            # against a ratio range above 2 (round(1 / 2.5) = 0)
            gh = np.where(narrow, np.maximum(1, np.round(fw / lo)).astype(np.int64), fh)
            gw = np.where(wide, np.maximum(1, np.round(fh * hi)).astype(np.int64), fw)
            bh[miss], bw[miss] = gh, gw
            top[miss], left[miss] = (fh - gh) // 2, (fw - gw) // 2
        out[:, 0], out[:, 1], out[:, 2], out[:, 3] = top, left, bh, bw
        if self.flip:
            out[:, 4] = u[:, 2 * ATTEMPTS + 2] < self.flip
        return out

    def __repr__(self) -> str:
        return (f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip}"
                + (f", field={self.field!r}" if self.field else "") + _follow_repr(self))


class CenterCrop(_Crop):
    """The centre box of side ``int(ratio * short side)``, resized to ``size``
    (FFCV's validation crop; the rule is the module docstring's).

    Parameters
    ----------
    size : int or (int, int)
        The output's ``(h, w)`` in pixels, each at least 1 (an int: square).
    ratio : float, default 224/256
        The box's side as a fraction of the record's short side, in (0, 1].
        The box is relative to the record, so it always fits: a record
        smaller than ``size`` gives a smaller box, enlarged to ``size``.
    field : str, optional
        The image field to crop (default: the one image field read).
    dct_scale, boxes, box_fields, polygons
        As :class:`RandomResizedCrop`'s.
    """

    def __init__(self, size: Any, ratio: float = 224 / 256, *, field: str | None = None,
                 dct_scale: bool = True, boxes: str | None = None, box_fields: Sequence[str] = (),
                 polygons: Sequence[str] | None = None) -> None:
        self.size = _size(size)
        r = float(ratio)
        if not 0.0 < r <= 1.0:
            raise ValueError(f"CenterCrop: ratio is the box's side over the record's short side, in (0, 1], "
                             f"got {ratio!r}")
        self.ratio = r
        self.flip = 0.0
        self.field = field
        self.dct_scale = bool(dct_scale)
        self.boxes_field, self.box_fields, self.polygons = _follow(boxes, box_fields, polygons)

    @property
    def random(self) -> bool:
        return False

    def boxes(self, hw: np.ndarray, u: np.ndarray | None = None) -> np.ndarray:
        hw = np.asarray(hw, np.int64).reshape(-1, 2)
        out = np.zeros((len(hw), 5), np.int64)
        for j, (h, w) in enumerate(hw.tolist()):
            out[j, :4] = self.box(h, w)
        return out

    def box(self, h: int, w: int) -> tuple[int, int, int, int]:
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
        return (f"CenterCrop(size={self.size}, ratio={self.ratio}" + (f", field={self.field!r}" if self.field else "")
                + _follow_repr(self))


def _follow_repr(crop: _Crop) -> str:
    return ((", dct_scale=False" if not crop.dct_scale else "")
            + (f", boxes={crop.boxes_field!r}" if crop.boxes_field else "")
            + (f", box_fields={list(crop.box_fields)}" if crop.box_fields else "")
            + (f", polygons={crop.polygons}" if crop.polygons else "") + ")")


def crop_boxes(crop: _Crop, hw: np.ndarray, seed: int, epoch: int, records: Any) -> np.ndarray:
    """``(n, 5)`` rows ``(top, left, box_h, box_w, flipped)``: what ``crop``
    does to ``records`` (sizes ``hw``) in ``epoch`` of a loader with order
    seed ``seed``, the same in every process (NOTE [crop parameters])."""
    u = crop_uniforms(seed, epoch, records) if crop.random else None
    return crop.boxes(hw, u)


def crop_box(crop: _Crop, h: int, w: int, seed: int, epoch: int, record: int) -> tuple[int, int, int, int, bool]:
    """``(top, left, box_h, box_w, flipped)`` of one record (:func:`crop_boxes`)."""
    t, le, bh, bw, fl = crop_boxes(crop, np.array([[h, w]]), seed, epoch, [record])[0].tolist()
    return t, le, bh, bw, bool(fl)


def _tj_pick(h: int, w: int, min_h: int, min_w: int) -> tuple[int, int]:
    """The scale ``(num, denom)`` simplejpeg decodes an ``h x w`` JPEG at for
    ``min_height=min_h, min_width=min_w`` (its rule, restated)."""
    min_h, min_w = min(h, min_h), min(w, min_w)
    for num, den in _TJ_SCALES:
        if -(-w * num // den) >= min_w and -(-h * num // den) >= min_h:
            return num, den
    return 1, 1


def dct_scale(h: int, w: int, box_h: int, box_w: int, out_h: int, out_w: int) -> int:
    """The ``d`` of the scale ``1/d`` a ``jpeg`` record of ``h x w`` pixels
    is decoded at for a box of ``box_h x box_w`` resized to ``out_h x
    out_w`` (NOTE [DCT-scaled decode]): the largest of 8, 4, 2 with
    ``box_h >= d * out_h`` and ``box_w >= d * out_w`` that simplejpeg
    decodes at exactly ``1/d`` when asked for ``ceil(h / d) x ceil(w /
    d)``; else 1 (a whole decode)."""
    for d in DCT_DENOMS:
        if box_h >= d * out_h and box_w >= d * out_w and _tj_pick(h, w, -(-h // d), -(-w // d)) == (1, d):
            return d
    return 1


def scaled_box(top: int, left: int, box_h: int, box_w: int, d: int) -> tuple[int, int, int, int]:
    """``(top, left, bottom, right)`` of a box in the image decoded at
    ``1/d``: each edge ``floor(edge / d + 1/2)`` (NOTE [DCT-scaled decode])."""
    def edge(x: int) -> int:
        return (2 * x + d) // (2 * d)

    return edge(top), edge(left), edge(top + box_h), edge(left + box_w)


def resample_scaled(src: np.ndarray, box: tuple[int, int, int, int], d: int, dst: np.ndarray,
                    flip: bool = False) -> None:
    """Box ``(top, left, box_h, box_w)`` of a record, out of ``src`` (the
    record decoded at ``1/d``), into ``dst`` (NOTE [DCT-scaled decode]), then
    mirrored when ``flip``."""
    import cv2

    t, le, bh, bw = box
    oh, ow = dst.shape[:2]
    if not (bh < 2 * d * oh and bw < 2 * d * ow):
        t0, l0, t1, l1 = scaled_box(t, le, bh, bw, d)
        resize_into(src[t0:t1, l0:l1], dst, flip)
        return
    ky, kx = bh / (d * oh), bw / (d * ow)
    # output pixel centre i + 1/2 -> the record's top + (i + 1/2) * ky * d -> scaled pixel centres at integers
    m = np.array([[kx, 0.0, le / d + 0.5 * kx - 0.5], [0.0, ky, t / d + 0.5 * ky - 0.5]])
    if src.ndim == 3 and src.shape[2] == 1:  # OpenCV drops a last axis of 1: warp the plane
        src, dst = src[..., 0], dst[..., 0]
    got = cv2.warpAffine(src, m, (ow, oh), dst=dst, flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                         borderMode=cv2.BORDER_REPLICATE)
    if got is not dst and not np.shares_memory(got, dst):  # OpenCV allocated anew: never silently lost
        dst[...] = got.reshape(dst.shape)
    if flip:
        got = cv2.flip(dst, 1, dst=dst)
        if got is not dst and not np.shares_memory(got, dst):
            dst[...] = got


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

    _check_follow(schema, fields, crop)
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


def _check_follow(schema: Any, fields: Sequence[str], crop: _Crop) -> None:
    """``boxes`` / ``box_fields`` of ``crop``: read, ragged, boxes ``(None, 4)`` of floats."""
    if crop.boxes_field is None:
        return
    for f in (crop.boxes_field, *crop.box_fields, *crop.polygons):
        if f not in fields:
            raise SchemaError(f"{crop!r}: field {f!r} is not among the fields read {list(fields)}; add it to fields=")
        if not schema[f].ragged:
            raise SchemaError(f"{crop!r}: field {f!r} ({schema[f].dtype.str} {list(schema[f].shape)}) is not a "
                              "ragged field (one row per box); boxes= and box_fields= name ragged fields")
    fd = schema[crop.boxes_field]
    if fd.dtype.kind != "f" or tuple(fd.shape[1:]) != (4,):
        raise SchemaError(f"{crop!r}: field {crop.boxes_field!r} ({fd.dtype.str} {list(fd.shape)}) is not boxes: "
                          "expected xyxy rows of floats, shape (None, 4)")
    if crop.polygons:
        pts, sizes, owner = (schema[f] for f in crop.polygons)
        if (pts.dtype.kind != "f" or tuple(pts.shape[1:]) != (2,) or sizes.dtype.kind not in "iu"
                or sizes.shape != (None,) or owner.dtype.kind not in "iu" or owner.shape != (None,)):
            raise SchemaError(f"{crop!r}: polygons= {list(crop.polygons)} must be points (None, 2) of floats, then "
                              "points per polygon and the box row of each polygon, (None,) integers (COCO's layout)")


def follow_crop(ragged: Any, reader: CropReader | None) -> Any:
    """The Loader's per-batch reader of ragged fields (``ragged(idx)`` ->
    the batch's fields in its form), with the crop's box fields mapped
    through each record's crop (NOTE [boxes follow the crop]) when
    ``reader``'s crop asks for it; else ``ragged`` itself."""
    if reader is None or not reader.follows:
        return ragged
    return _FollowCrop(ragged, reader)


class _FollowCrop:
    def __init__(self, inner: Any, reader: CropReader) -> None:
        self.inner, self.reader = inner, reader
        self.store, self.fields, self.mode = inner.store, inner.fields, inner.mode

    def __call__(self, idx: np.ndarray) -> dict[str, Any]:
        return self.inner.form(self.reader.follow(idx, self.store.read_batch(idx, fields=self.fields)))

    def form(self, got: dict[str, Any]) -> dict[str, Any]:
        return self.inner.form(got)

    def piece(self, got: dict[str, Any]) -> dict[str, Any]:  # never: the Loader reads them per batch
        raise TypeError("a crop's box fields are read per batch, not with its pieces")

    def join(self, parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return self.inner.join(parts)


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


class _Mapped:
    """A raw shaped field's data file mapped read-only, with the descriptor
    that proves it did not shrink (NOTE [truncated under a mapping] in
    mmstore/store/backends/memmap.py: a resize out of a truncated mapping
    would fault, so each piece checks the size first)."""

    def __init__(self, path: str, size: int, ident: Any) -> None:
        self.fd = open_store_file(path, missing=f"{path}: missing; the store was moved or deleted while open",
                                  ident=ident)
        try:
            st = os.fstat(self.fd)
            note_identity(ident, path, st)
            if st.st_size != size:
                raise StoreChangedError(f"{path}: {st.st_size} bytes, expected {size}: the file changed since the "
                                        "store was opened; reopen the store")
            self.data = np.frombuffer(mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ), np.uint8) if size else \
                np.zeros(0, np.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.path, self.size = path, size
        weakref.finalize(self, os.close, self.fd)

    def check(self) -> None:
        if os.fstat(self.fd).st_size < self.size:
            raise StoreChangedError(f"{self.path}: shorter than {self.size} bytes: the file was truncated while the "
                                    "store was open; reopen the store")


# a backend's mapped raw fields, kept for as long as the backend (every epoch's reader shares them)
_mapped: weakref.WeakKeyDictionary[Any, dict[str, _Mapped]] = weakref.WeakKeyDictionary()
_mapped_lock = threading.Lock()


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
        self.dct = bool(self.shaped and self.codec == "jpeg" and crop.dct_scale)
        self._chans = tuple(fd.shape[2:])
        self._pix = int(np.prod(self._chans, dtype=np.int64)) * fd.dtype.itemsize
        be = store.slot_view.backend
        self._local = bool(be.positional and store.replica is None and be.segment_count() == 1)

    @property
    def follows(self) -> bool:
        """Whether box fields follow the crop (:meth:`follow`)."""
        return self.crop.boxes_field is not None

    def follow(self, records: np.ndarray, got: dict[str, Any]) -> dict[str, Any]:
        """``got`` (the ragged fields of ``records``, ``Store.read_batch``'s
        :class:`~mmstore.format.ragged.Ragged`) with the crop's box field
        mapped through each record's crop and clipped to the output, the
        boxes left with no area dropped with their rows of ``box_fields``
        (NOTE [boxes follow the crop])."""
        from ..decode.geometry import clip_boxes
        from ..format.ragged import Ragged

        name = self.crop.boxes_field
        if name is None or len(records) == 0:
            return got
        field = self.store.schema[self.field]
        if self.shaped:
            hw = np.asarray(self.store.read_batch(records, fields=[field.hw_name])[field.hw_name], np.int64)
        else:
            hw = np.tile(np.asarray(field.shape[:2], np.int64), (len(records), 1))
        bx = self.boxes(records, hw).astype(np.float64)
        rag = got[name]
        lengths = rag.lengths
        row_rec = np.repeat(np.arange(len(records)), lengths)
        t, le, bh, bw, fl = (bx[row_rec, k] for k in range(5))
        oh, ow = self.crop.size
        v = np.asarray(rag.values, np.float64).reshape(-1, 4)
        sx, sy = ow / np.maximum(bw, 1), oh / np.maximum(bh, 1)
        x0, x1 = (v[:, 0] - le) * sx, (v[:, 2] - le) * sx
        y0, y1 = (v[:, 1] - t) * sy, (v[:, 3] - t) * sy
        flip = fl > 0
        x0, x1 = np.where(flip, ow - x1, x0), np.where(flip, ow - x0, x1)
        mapped, keep, _ = clip_boxes(np.stack([x0, y0, x1, y1], axis=1), (0.0, 0.0, float(ow), float(oh)), 0.0)
        offsets = np.zeros(len(records) + 1, np.int64)
        np.cumsum(np.bincount(row_rec[keep], minlength=len(records)), out=offsets[1:])
        out = dict(got)
        out[name] = Ragged(mapped[keep].astype(rag.values.dtype), offsets, rag.kind)
        for f in self.crop.box_fields:
            other = got[f]
            if not np.array_equal(other.lengths, lengths):
                j = int(np.flatnonzero(other.lengths != lengths)[0])
                raise SchemaError(f"{self.crop!r}: record {int(records[j])} has {int(other.lengths[j])} rows of "
                                  f"{f!r} and {int(lengths[j])} boxes of {name!r}: box_fields= names fields with "
                                  "one row per box")
            out[f] = Ragged(other.values[keep], offsets.copy(), other.kind)
        if self.crop.polygons:
            self._follow_polygons(records, got, out, bx, keep, lengths)
        return out

    def _follow_polygons(self, records: np.ndarray, got: dict[str, Any], out: dict[str, Any], bx: np.ndarray,
                         keep: np.ndarray, lengths: np.ndarray) -> None:
        """The polygons of NOTE [boxes follow the crop], record by record."""
        from ..decode.geometry import clip_polygon
        from ..format.ragged import Ragged

        pn, sn, bn = self.crop.polygons
        P, S, B = got[pn], got[sn], got[bn]
        oh, ow = self.crop.size
        area = (0.0, 0.0, float(ow), float(oh))
        starts = np.zeros(len(records) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        parts: list[np.ndarray] = []
        sizes_out: list[int] = []
        owner_out: list[int] = []
        counts = np.zeros((2, len(records)), np.int64)  # points, polygons per record
        for j in range(len(records)):
            pts = np.asarray(P[j], np.float64).reshape(-1, 2)
            sz, own = np.asarray(S[j], np.int64), np.asarray(B[j], np.int64)
            nb = int(lengths[j])
            if (len(sz) != len(own) or int(sz.sum()) != len(pts) or (sz < 0).any() or (own < 0).any()
                    or (own >= nb).any()):
                raise SchemaError(f"{self.crop!r}: record {int(records[j])}: {len(sz)} polygon sizes summing to "
                                  f"{int(sz.sum())}, {len(pts)} points and {len(own)} box rows among {nb} boxes do not "
                                  f"fit together: polygons= names COCO's (points, points per polygon, box row) fields")
            k_rec = keep[starts[j] : starts[j + 1]]
            new_row = np.cumsum(k_rec) - 1
            t, le, bh, bw, fl = bx[j].tolist()
            q = (pts - (le, t)) * (ow / max(bw, 1.0), oh / max(bh, 1.0))
            if fl:
                q[:, 0] = ow - q[:, 0]
            at = 0
            for size, o in zip(sz.tolist(), own.tolist()):
                poly, at = q[at : at + size], at + size
                if not k_rec[o]:
                    continue
                c = clip_polygon(poly, area)
                if len(c) >= 3:
                    parts.append(c)
                    sizes_out.append(len(c))
                    owner_out.append(int(new_row[o]))
                    counts[0, j] += len(c)
                    counts[1, j] += 1
        for f, rag, vals, n in ((pn, P, np.concatenate(parts) if parts else np.zeros((0, 2)), counts[0]),
                                (sn, S, np.array(sizes_out), counts[1]), (bn, B, np.array(owner_out), counts[1])):
            offs = np.zeros(len(records) + 1, np.int64)
            np.cumsum(n, out=offs[1:])
            out[f] = Ragged(np.asarray(vals).astype(rag.values.dtype).reshape(-1, *rag.values.shape[1:]), offs,
                            rag.kind)

    @property
    def path(self) -> str:
        """What runs per record (``Loader.describe()``)."""
        tail = f"; boxes {self.crop.boxes_field!r} follow the crop" if self.follows else ""
        if self.dct:
            return ("jpeg DCT-scaled decode (at 1/8, 1/4 or 1/2 where the box is at least 8, 4 or 2 times the "
                    "output, else whole), crop, one cv2.warpAffine (scaled) or cv2.resize into the batch" + tail)
        how = "a view of the stored pixels" if self.codec == "raw" else f"full {self.codec} decode"
        return f"{how}, crop, one cv2.resize into the batch{tail}"

    def boxes(self, records: np.ndarray, hw: np.ndarray) -> np.ndarray:
        """Each record's box: ``(n, 5)`` rows ``(top, left, box_h, box_w, flipped)``."""
        return crop_boxes(self.crop, hw, self.seed, self.epoch, records)

    def read(self, records: np.ndarray, out: np.ndarray) -> None:
        """Records ``records`` (the store's record indices), cropped and
        resized into ``out[j]``."""
        if len(records) == 0:
            return
        if not self.shaped:
            src = self.store.read_batch(records, fields=[self.field])[self.field]
            h, w = src.shape[1:3]
            boxes = self.boxes(records, np.tile([h, w], (len(records), 1))).tolist()
            for j, (t, le, ch, cw, fl) in enumerate(boxes):
                resize_into(src[j, t : t + ch, le : le + cw], out[j], bool(fl))
            return
        field = self.store.schema[self.field]
        hw = np.asarray(self.store.read_batch(records, fields=[field.hw_name])[field.hw_name], np.int64)
        slots = self.store.slot_view.slots_of(records)
        boxes = self.boxes(records, hw)
        if self.codec == "raw" and self._local:
            self._read_mapped(field, records, slots, hw, boxes, out)
            return
        if self.codec == "jpeg":
            self._read_jpeg(field, records, slots, hw, boxes, out)
            return
        self._read_each(field, records, slots, hw, boxes, out)

    def _read_each(self, field: Any, records: np.ndarray, slots: np.ndarray, hw: np.ndarray, boxes: np.ndarray,
                   out: np.ndarray, entry: np.ndarray | None = None) -> None:
        """The encoded (or non-local raw) records of a shaped field, each
        checked against its size, decoded and resized into its row
        (``entry``: the one record's stored entry, already read)."""
        chans = self._chans
        oh, ow = self.crop.size
        bl = boxes.tolist()
        for j, data in enumerate(self._entries(slots) if entry is None else (entry,)):
            why = shape_problem(field, data, hw[j])
            if why is not None:
                raise _bad(field.name, int(slots[j]), int(records[j]), why)
            h, w = int(hw[j, 0]), int(hw[j, 1])
            t, le, ch, cw, fl = bl[j]
            if self.codec == "raw":
                img = data.view(field.dtype).reshape(h, w, *chans)
            else:
                d = dct_scale(h, w, ch, cw, oh, ow) if self.dct else 1
                if d > 1:
                    scaled = self._decode_scaled(field, data, h, w, d, int(slots[j]), int(records[j]))
                    if scaled is not None:
                        resample_scaled(scaled, (t, le, ch, cw), d, out[j], bool(fl))
                        continue
                n = h * w * self._pix
                img = _scratch("pixels", n)[:n].view(field.dtype).reshape(h, w, *chans)
                try:
                    field.codec.decode_into(data, img)
                except EntryDecodeError as exc:
                    raise _bad(field.name, int(slots[j]), int(records[j]), exc.reason or str(exc)) from None
            resize_into(img[t : t + ch, le : le + cw], out[j], bool(fl))

    def _read_jpeg(self, field: Any, records: np.ndarray, slots: np.ndarray, hw: np.ndarray, boxes: np.ndarray,
                   out: np.ndarray) -> None:
        """:meth:`_read_each` for ``jpeg`` records, each decoded straight into
        the thread's pixel buffer without parsing its header twice.

        The sizes are proven for the whole piece first (a side of 0, more
        than ``SHAPED_MAX_BYTES``, not a bucket: the piece goes record by
        record, which names the first bad one). A record whose decode needs
        a larger buffer has its header checked against its size before the
        buffer grows; otherwise the decode itself is the check: a JPEG
        larger than its size does not fit the buffer, one of another size
        decodes to another shape. Any record that is not exactly as its size
        says (or lacks its end-of-image marker, or does not decode) is read
        again by :meth:`_read_each`'s steps, which raise its error."""
        import cv2
        import simplejpeg

        pix = self._pix
        hs, ws = hw[:, 0], hw[:, 1]
        bad = (hs < 1) | (ws < 1) | (hs * ws * pix > SHAPED_MAX_BYTES)
        buckets = getattr(field, "buckets", None)
        if buckets:  # shape_problem's bucket rule, for the whole piece
            known = np.array([h * (1 << 32) + w for h, w in buckets], np.int64)
            bad |= ~np.isin(hs * (1 << 32) + ws, known)
        chans = self._chans
        if bad.any() or chans not in ((), (1,), (3,)) or field.dtype != np.uint8:
            self._read_each(field, records, slots, hw, boxes, out)
            return
        oh, ow = self.crop.size
        gray = len(chans) == 0 or chans[0] == 1
        colorspace = "GRAY" if gray else "RGB"
        decode = simplejpeg.decode_jpeg
        resize, flip_lr = cv2.resize, cv2.flip
        area, linear = cv2.INTER_AREA, cv2.INTER_LINEAR
        plane = len(chans) == 1 and chans[0] == 1  # OpenCV drops a last axis of 1: resize the plane
        entries = self._mapped_entries(slots) if self._local else None
        if entries is None:  # not local, or an offset pair out of its file: read (and refused) in order
            entries = self._entries(slots)
        buf = _scratch("pixels", 0)
        for j, (data, (h, w), (t, le, ch, cw, fl)) in enumerate(zip(entries, hw.tolist(), boxes.tolist())):
            if self.dct:
                d = dct_scale(h, w, ch, cw, oh, ow)
                if d > 1:
                    self._read_each(field, records[j : j + 1], slots[j : j + 1], hw[j : j + 1], boxes[j : j + 1],
                                    out[j : j + 1], data)
                    continue
            n = h * w * pix
            if n > len(buf):
                if shape_problem(field, data, (h, w)) is None:
                    buf = _scratch("pixels", n)
            got = None
            if n <= len(buf) and len(data) >= 2 and data[-2] == 0xFF and data[-1] == 0xD9:
                try:
                    got = decode(data, colorspace=colorspace, fastdct=False, fastupsample=False, buffer=buf,
                                 strict=True)
                except (ValueError, RuntimeError):
                    got = None
            if got is None or got.shape[0] != h or got.shape[1] != w:
                self._read_each(field, records[j : j + 1], slots[j : j + 1], hw[j : j + 1], boxes[j : j + 1],
                                out[j : j + 1], data)
                continue
            src = got[t : t + ch, le : le + cw]
            dst = out[j]
            if plane:
                src, dst = src[..., 0], dst[..., 0]
            elif not chans:
                src = src[..., 0]
            r = resize(src, (ow, oh), dst=dst, interpolation=linear if oh > ch or ow > cw else area)
            if r is not dst and not np.shares_memory(r, dst):  # OpenCV allocated anew: never silently lost
                dst[...] = r
            if fl:
                r = flip_lr(dst, 1, dst=dst)
                if r is not dst and not np.shares_memory(r, dst):
                    dst[...] = r

    def _mapped_entries(self, slots: np.ndarray) -> Iterator[np.ndarray] | None:
        """The stored entries of ``slots`` of a local store as views of the
        mapped data file (no copy), every offset pair proven in range and
        the file's size checked first (as :meth:`_read_mapped`); None when a
        pair is not (:meth:`_entries` then names it in its turn)."""
        mapped = self._mapping()
        offs = self.store.slot_view.backend.entry_offsets(self.field)
        a, b = np.asarray(offs[slots]), np.asarray(offs[slots + 1])
        if not ((a >= 0) & (a <= b) & (b <= mapped.size)).all():
            return None
        mapped.check()
        data = mapped.data
        return (data[lo:hi] for lo, hi in zip(a.tolist(), b.tolist()))

    def _decode_scaled(self, field: Any, data: np.ndarray, h: int, w: int, d: int, slot: int,
                       record: int) -> np.ndarray | None:
        """JPEG ``data`` (``h x w``, its header checked) decoded at ``1/d``
        into the thread's pixel buffer; None when simplejpeg gave another
        size (then the caller decodes it whole)."""
        import simplejpeg

        sh, sw = -(-h // d), -(-w // d)
        n = sh * sw * self._pix
        buf = _scratch("pixels", n)[:n]
        if bytes(data[-2:]) != b"\xff\xd9":  # what the whole decode refuses (format/codecs.py)
            try:
                field.codec.decode_into(data, np.empty((h, w, *self._chans), field.dtype))
            except EntryDecodeError as exc:
                raise _bad(field.name, slot, record, exc.reason or str(exc)) from None
        gray = len(self._chans) == 0 or self._chans[0] == 1
        try:
            got = simplejpeg.decode_jpeg(data, colorspace="GRAY" if gray else "RGB", fastdct=False,
                                         fastupsample=False, min_height=sh, min_width=sw, buffer=buf, strict=True)
        except (ValueError, RuntimeError) as exc:
            raise _bad(field.name, slot, record, f"corrupt JPEG ({exc})") from None
        if got.shape[:2] != (sh, sw) or got.ctypes.data != buf.ctypes.data:
            return None
        return buf.view(field.dtype).reshape(sh, sw, *self._chans)

    def _read_mapped(self, field: Any, records: np.ndarray, slots: np.ndarray, hw: np.ndarray, boxes: np.ndarray,
                     out: np.ndarray) -> None:
        """Raw records of a local store: each box resized straight out of the
        mapped data file (no copy of the entry), every offset pair and size
        proven first, for the whole piece at once."""
        mapped = self._mapping()
        be = self.store.slot_view.backend
        offs = be.entry_offsets(self.field)
        size = mapped.size
        a = offs[slots].astype(np.int64)
        b = offs[slots + 1].astype(np.int64)
        h, w = hw[:, 0], hw[:, 1]
        nb = b - a
        row = np.maximum(w, 1) * self._pix
        good = (a >= 0) & (a <= b) & (b <= size) & (h >= 1) & (w >= 1) & (nb % row == 0) & (nb // row == h)
        if not good.all():
            j = int(np.flatnonzero(~good)[0])
            s, r = int(slots[j]), int(records[j])
            if not 0 <= a[j] <= b[j] <= size:
                raise EntryDecodeError(f"field {self.field!r}, slot {s}: its offsets {a[j]}..{b[j]} are not an "
                                       f"increasing pair within the {size:,}-byte data file (run mmstore verify)",
                                       field=self.field, slot=s)
            why = shape_problem(field, mapped.data[a[j] : b[j]], hw[j]) or f"{h[j]} x {w[j]} pixels: no image"
            raise _bad(field.name, s, r, why)
        mapped.check()
        data, dtype, chans = mapped.data, field.dtype, self._chans
        for j, (lo, hi, hh, ww, (t, le, ch, cw, fl)) in enumerate(zip(a.tolist(), b.tolist(), h.tolist(), w.tolist(),
                                                                     boxes.tolist())):
            img = data[lo:hi].view(dtype).reshape(hh, ww, *chans)
            resize_into(img[t : t + ch, le : le + cw], out[j], bool(fl))

    def _mapping(self) -> _Mapped:
        be = self.store.slot_view.backend
        with _mapped_lock:
            per = _mapped.setdefault(be, {})
            m = per.get(self.field)
            if m is None:
                path = be.entry_spans(self.field, 0, 0)[0][0]
                m = per[self.field] = _Mapped(path, be.entry_data_size(self.field), getattr(be, "ident", None))
            return m

    def _gathered(self, be: Any, slots: np.ndarray) -> Iterator[np.ndarray]:
        """The stored entries of ``slots``, in that order, from one backend
        ``gather_entries`` call (which reads them in slot order)."""
        order = np.argsort(slots, kind="stable")
        flat, sizes = be.gather_entries(self.field, slots[order])
        starts = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=starts[1:])
        at = np.empty(len(slots), np.int64)
        at[order] = np.arange(len(slots))
        for j in range(len(slots)):
            k = int(at[j])
            yield flat[int(starts[k]) : int(starts[k + 1])]

    def _entries(self, slots: np.ndarray) -> Iterator[np.ndarray]:
        """The stored entries of ``slots``, one at a time, in that order.

        A local memmap store of one segment: each entry ``preadv``-d from the
        field's data file into the reader thread's buffer (GIL released), at
        the offsets index's pair, proven in range first. Otherwise (LMDB, a
        merged store, a store opened from a URL, whose blocks the backend
        fetches and verifies): the backend's ``gather_entries``."""
        be = self.store.slot_view.backend
        if not self._local:
            yield from self._gathered(be, slots)
            return
        offs = be.entry_offsets(self.field)  # proven pair by pair below (format.py, "Variable-size entries")
        size = be.entry_data_size(self.field)
        path = be.entry_spans(self.field, 0, 0)[0][0]
        # every pair of the piece at once (one gather each, not two index lookups per record)
        starts, ends = np.asarray(offs[slots]), np.asarray(offs[slots + 1])
        fits = (starts >= 0) & (starts <= ends) & (ends <= size)
        lens = np.where(fits, ends - starts, 0)
        buf = _scratch("entry", int(lens.max()) if len(lens) else 0)
        view = memoryview(buf)  # type: ignore[arg-type]
        preadv = os.preadv
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for s, a, b, ok in zip(slots.tolist(), starts.tolist(), ends.tolist(), fits.tolist()):
                if not ok:
                    raise EntryDecodeError(f"field {self.field!r}, slot {s}: its offsets {a}..{b} are not an "
                                           f"increasing pair within the {size:,}-byte data file (run mmstore verify)",
                                           field=self.field, slot=s)
                n = b - a
                pos = got = preadv(fd, [view[:n]], a) if n else 0
                while 0 < got and pos < n:
                    got = preadv(fd, [view[pos:n]], a + pos)
                    pos += max(got, 0)
                # a short read (the file shrank under the store) gives a short entry, refused by its size check
                yield buf[: max(pos, 0)]
        finally:
            os.close(fd)


def _bad(name: str, slot: int, record: int, reason: str) -> EntryDecodeError:
    return EntryDecodeError(f"field {name!r}, record {record}, slot {slot}: {reason}", field=name, slot=slot,
                            index=record, reason=reason)
