"""Geometry that follows the resize: map points and boxes between source pixels and stored pixels.

An ingest that resizes stores, per record, the transform its decode used
(see the "Box convention" of :mod:`mmstore.decode`):

* ``box`` (``<i4`` ``(4,)``): the source region ``(x0, y0, x1, y1)`` that was
  resampled, integer pixel *edges* in the oriented, full-resolution source
  (``x1``/``y1`` exclusive);
* ``dst`` (``<i4`` ``(4,)``): the edges of the stored rectangle that region
  landed in: the whole record, except for ``--resize pad`` where it is the
  picture area inside the letterbox.

The mapping is an axis-aligned scale plus offset per axis, in edge
coordinates (pixel ``i`` covers ``[i, i + 1)``; its centre is ``i + 0.5``)::

    u = dst_x0 + (x - x0) * (dst_x1 - dst_x0) / (x1 - x0)
    v = dst_y0 + (y - y0) * (dst_y1 - dst_y0) / (y1 - y0)

:func:`to_stored` applies it, :func:`to_source` inverts it. Both take points
``(..., 2)`` (x, y) or boxes ``(..., 4)`` (x0, y0, x1, y1, "xyxy"), compute in
float64 and return float64 arrays of the same shape (cast to ``float32``
yourself for storage; a COCO store keeps ``boxes`` as ``<f4``).

Annotations are in the pixels of the *oriented* image: the picture mmstore
decodes after applying the EXIF orientation (``orig_size`` is its ``(h, w)``).
COCO's own boxes follow the same rule when its ``width``/``height`` are the
oriented size.

Clip and drop rule
------------------
Stored boxes and polygons are clipped to the stored *picture area* ``dst``
(not to the record: the letterbox border of ``pad`` holds no picture). A box
whose clipped width or height is below ``min_size`` stored pixels (default
:data:`MIN_BOX_SIZE` = 1; ``--min-box-size``), or is not positive (a box
wholly outside the picture, even with ``min_size`` 0), is dropped, with its
polygons;
a box that lost area to the clip but is kept counts as *clipped*. A polygon
is clipped to ``dst`` exactly (Sutherland-Hodgman against the four edges);
one left with fewer than 3 points is dropped.

Stores written before ``dst`` existed have ``orig_size`` and ``box`` only;
:func:`transform_of` derives ``dst`` from ``orig_size`` and the decode spec in
the store's provenance (the decode plan makes ``dst`` a function of those
two alone, so this is exact), and raises :class:`GeometryError` when the
store does not say how it was decoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..errors import GeometryError

__all__ = [
    "MIN_BOX_SIZE",
    "GeometryError",
    "Transform",
    "clip_boxes",
    "clip_polygon",
    "derive_dst",
    "to_source",
    "to_stored",
    "transform_of",
]

MIN_BOX_SIZE = 1.0  # stored pixels: a clipped box narrower or lower than this is dropped


class Transform(NamedTuple):
    """One record's transform: source region ``box`` -> stored rectangle ``dst`` (edges, xyxy)."""

    box: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]

    @classmethod
    def identity(cls, h: int, w: int) -> Transform:
        """The transform of an image stored at its own size (``h x w``)."""
        return cls((0, 0, int(w), int(h)), (0, 0, int(w), int(h)))


def derive_dst(orig_size: Any, spec: Any) -> tuple[int, int, int, int]:
    """``dst`` of a source of ``orig_size`` ``(h, w)`` decoded with ``spec``
    (a :class:`~mmstore.decode.DecodeSpec` or its ``to_dict()``): exactly
    what the decode's plan gives, for any decode path (``fast_decode`` changes
    ``box`` by less than its scale factor, never ``dst``)."""
    from . import DecodeSpec
    from .pixels import _plan

    if isinstance(spec, Mapping):
        spec = DecodeSpec.from_dict(dict(spec))
    h, w = (int(v) for v in np.asarray(orig_size).reshape(-1)[:2])
    return tuple(int(v) for v in _plan(h, w, spec)[2])  # type: ignore[return-value]


def _spec_of_store(store: Any) -> Any:
    prov = store.provenance if hasattr(store, "provenance") else {}
    dec = (prov.get("ingest") or {}).get("params", {}).get("decode") if isinstance(prov, Mapping) else None
    if not isinstance(dec, Mapping):
        raise GeometryError(
            f"{getattr(store, 'path', 'the store')}: records have no 'dst' field and the provenance has no "
            "decode spec to derive it from (provenance.ingest.params.decode); the stored-pixel geometry is "
            "unknown: re-ingest with a current mmstore, or pass the transform explicitly"
        )
    return dec


def transform_of(t: Any, store: Any = None) -> Transform:
    """The :class:`Transform` of ``t``: a ``Transform``, a ``(box, dst)``
    pair, a :class:`~mmstore.decode.Decoded`, or a record (a mapping with
    ``box`` and ``dst``, such as ``store[i]``). A record without ``dst`` (a
    store written before it existed) needs ``store`` (or ``orig_size`` in the
    record and a ``store`` to read the decode spec from): ``dst`` is derived;
    else :class:`GeometryError`."""
    if isinstance(t, Transform):
        return t
    if isinstance(t, Mapping):
        if "box" not in t:
            raise GeometryError(f"expected a record with 'box' and 'dst' fields, found fields {sorted(t)}")
        box = t["box"]
        if "dst" in t:
            dst = t["dst"]
        elif store is not None and "orig_size" in t:
            dst = derive_dst(t["orig_size"], _spec_of_store(store))
        else:
            raise GeometryError(
                "the record has no 'dst' field (a store written before mmstore stored it): pass the store too, "
                "transform_of(record, store), to derive it from orig_size and the store's decode spec"
            )
    elif hasattr(t, "box") and hasattr(t, "dst"):
        box, dst = t.box, t.dst
    else:
        try:
            box, dst = t
        except (TypeError, ValueError):
            raise GeometryError(
                f"expected a Transform, a (box, dst) pair or a record, found {type(t).__name__}"
            ) from None
    b = tuple(int(v) for v in np.asarray(box).reshape(-1))
    d = tuple(int(v) for v in np.asarray(dst).reshape(-1))
    if len(b) != 4 or len(d) != 4:
        raise GeometryError(f"box and dst must be 4 edges (x0, y0, x1, y1), found box {b}, dst {d}")
    if not (b[2] > b[0] and b[3] > b[1] and d[2] > d[0] and d[3] > d[1]):
        raise GeometryError(f"box {b} and dst {d} must both have a positive width and height")
    return Transform(b, d)


def _coeffs(box: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-axis (scale, offset) so that ``stored = source * scale + offset``,
    as ``(..., 2)`` arrays in (x, y) order; ``box``/``dst`` are ``(..., 4)``."""
    box = np.asarray(box, np.float64)
    dst = np.asarray(dst, np.float64)
    scale = (dst[..., 2:] - dst[..., :2]) / (box[..., 2:] - box[..., :2])
    offset = dst[..., :2] - box[..., :2] * scale
    return scale, offset, box, dst


def _as_coords(a: Any) -> np.ndarray:
    arr = np.asarray(a, np.float64)
    if arr.ndim == 0 or arr.shape[-1] not in (2, 4):
        raise GeometryError(f"expected points (n, 2) or boxes (n, 4), found shape {arr.shape}")
    return arr


def _map(arr: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    if arr.shape[-1] == 4:
        scale = np.concatenate([scale, scale], axis=-1)
        offset = np.concatenate([offset, offset], axis=-1)
    return arr * scale + offset


def _pair(t: Any, store: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(t, tuple) and len(t) == 2 and np.asarray(t[0]).ndim == 2:  # per-row (n, 4) box and dst
        return np.asarray(t[0]), np.asarray(t[1])
    tr = transform_of(t, store)
    return np.asarray(tr.box), np.asarray(tr.dst)


def to_stored(coords: Any, transform: Any, store: Any = None) -> np.ndarray:
    """Source-pixel points ``(..., 2)`` or xyxy boxes ``(..., 4)`` -> stored
    pixels (float64, same shape). ``transform``: see :func:`transform_of`;
    also ``(box, dst)`` as two ``(n, 4)`` arrays, one transform per row. Not
    clipped (:func:`clip_boxes`, :func:`clip_polygon`)."""
    arr = _as_coords(coords)
    scale, offset, _, _ = _coeffs(*_pair(transform, store))
    return _map(arr, scale, offset)


def to_source(coords: Any, transform: Any, store: Any = None) -> np.ndarray:
    """Stored-pixel points ``(..., 2)`` or xyxy boxes ``(..., 4)`` -> source
    pixels of the oriented image (float64, same shape): the inverse of
    :func:`to_stored` (e.g. a model's predicted boxes, for COCO evaluation)."""
    arr = _as_coords(coords)
    scale, offset, _, _ = _coeffs(*_pair(transform, store))
    return _map(arr, 1.0 / scale, -offset / scale)


def clip_boxes(boxes: Any, area: Any, min_size: float = MIN_BOX_SIZE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clip stored-pixel xyxy ``boxes`` ``(n, 4)`` to ``area`` (``dst``: one
    ``(4,)`` or one per box ``(n, 4)``); return ``(clipped boxes float64,
    keep, clipped)``: ``keep`` is False for a box whose clipped width or
    height is below ``min_size``, or not positive (whatever ``min_size``: a
    box wholly outside ``area``), or not finite, ``clipped`` True for a kept
    box that lost area to the clip."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    a = np.asarray(area, np.float64)
    lo, hi = a[..., :2], a[..., 2:]
    out = np.empty_like(b)
    out[:, :2] = np.clip(b[:, :2], lo, hi)
    out[:, 2:] = np.clip(b[:, 2:], lo, hi)
    size = out[:, 2:] - out[:, :2]
    with np.errstate(invalid="ignore"):
        keep = np.all((size >= float(min_size)) & (size > 0), axis=1) & np.all(np.isfinite(out), axis=1)
        clipped = keep & np.any(out != b, axis=1)
    return out, keep, clipped


def clip_polygon(points: Any, area: Any) -> np.ndarray:
    """The polygon ``points`` ``(n, 2)`` (stored pixels) clipped to the
    rectangle ``area`` ``(x0, y0, x1, y1)``: exact (Sutherland-Hodgman against
    each edge); float64 ``(m, 2)``, ``m`` may be 0."""
    p = np.asarray(points, np.float64).reshape(-1, 2)
    x0, y0, x1, y1 = (float(v) for v in np.asarray(area).reshape(-1))
    if len(p) and p[:, 0].min() >= x0 and p[:, 0].max() <= x1 and p[:, 1].min() >= y0 and p[:, 1].max() <= y1:
        return p.copy()
    for axis, bound, keep_ge in ((0, x0, True), (0, x1, False), (1, y0, True), (1, y1, False)):
        if len(p) == 0:
            break
        c = p[:, axis]
        inside = c >= bound if keep_ge else c <= bound
        if inside.all():
            continue
        out = []
        n = len(p)
        for i in range(n):
            cur, prev = p[i], p[i - 1]
            cin, pin = inside[i], inside[i - 1]
            if cin != pin:  # the edge crosses the boundary: add the crossing
                t = (bound - prev[axis]) / (cur[axis] - prev[axis])
                x = prev + t * (cur - prev)
                x[axis] = bound
                out.append(x)
            if cin:
                out.append(cur)
        p = np.array(out, np.float64).reshape(-1, 2)
    return p
