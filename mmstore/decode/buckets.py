"""Aspect buckets: which shapes a bucketed store has, and which of them each image goes to.

The rules are written out in :mod:`mmstore.decode` ("Aspect buckets"); this
module holds them in code:

* :func:`parse_buckets`: an option value (``"auto"``, ``"auto:N"``,
  ``"256x256,192x320"``, or a list of ``(h, w)`` pairs) as a checked bucket
  list or an :class:`AutoBuckets`, with a ``ValueError`` that says the
  expected form otherwise;
* :func:`nearest_bucket`: the bucket an ``h x w`` image goes to (nearest in
  log-aspect, exactly, in integers; ties to the wider bucket);
* :func:`ladder` and :func:`auto_buckets`: the shapes ``auto`` chooses from
  the aspects of the data;
* :func:`header_size`: an image's oriented ``(h, w)`` from its header, without
  decoding it (the first pass of ``auto``).

The crop of a record in its bucket is the ``center-crop`` geometry of
:mod:`mmstore.decode` with the bucket as the target size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DecodeError, spell_option
from ..format.shaped import MAX_BUCKETS, bucket_problem, sort_buckets

__all__ = [
    "AUTO_MAX_BUCKETS",
    "AUTO_MIN_SHARE",
    "AUTO_SIDE",
    "AutoBuckets",
    "HEAD_BYTES",
    "Buckets",
    "auto_buckets",
    "crop_share",
    "header_size",
    "ladder",
    "nearest_bucket",
    "parse_buckets",
    "sort_buckets",
]

Buckets = tuple[tuple[int, int], ...]

AUTO_SIDE = 256  # "auto" alone: buckets of about 256 x 256 pixels
AUTO_MAX_BUCKETS = 9  # "auto" keeps at most this many shapes ...
AUTO_MIN_SHARE = 0.01  # ... each the nearest rung of at least this share of the images
LADDER_STEPS = 8  # rungs k = -8..8 of aspect w/h = 2 ** (k / 4): from 1:4 to 4:1
HEAD_BYTES = 64 << 10  # the first pass reads this much of a file (more only when its header is longer)

_FORM = spell_option("buckets='auto', 'auto:N' or a list of (h, w) pairs such as [(256, 256), (192, 320)]",
                     "--buckets auto, auto:N or HxW,HxW,... such as 256x256,192x320,320x192")


@dataclass(frozen=True)
class AutoBuckets:
    """``buckets="auto:N"``: the shapes are chosen from the data's aspects
    (:func:`auto_buckets`), each about ``side * side`` pixels."""

    side: int = AUTO_SIDE

    def __str__(self) -> str:
        return f"auto:{self.side}"


def parse_buckets(value: Any, pixel_bytes: int = 3) -> Buckets | AutoBuckets:
    """An option value as a bucket list (sorted, :func:`sort_buckets`) or an
    :class:`AutoBuckets`.

    ``value``: ``"auto"`` (:data:`AUTO_SIDE`), ``"auto:N"``, ``"HxW,HxW,..."``
    (``"256x256,192x320,320x192"``), or a list of ``(h, w)`` pairs (or of
    ``"HxW"`` texts). ``pixel_bytes``: the bytes of one pixel of a record, for
    the limit on a record's size.

    Raises
    ------
    ValueError
        A value that does not parse, a side that is not a positive int, a
        bucket given twice, two buckets of one aspect (every image would go
        to the first), more than ``MAX_BUCKETS`` buckets, or a bucket larger
        than a record of its own shape may be (``SHAPED_MAX_BYTES``); the
        message says the expected form.
    """
    if isinstance(value, AutoBuckets):
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto" or text.startswith("auto:"):
            side = text[5:].strip() if text.startswith("auto:") else str(AUTO_SIDE)
            if not side.isdigit() or int(side) < 1:
                raise ValueError(f"buckets: {value!r}: auto:N takes a positive side N in pixels (the buckets are "
                                 f"about N x N pixels each), such as auto:256; expected {_FORM}")
            return AutoBuckets(int(side))
        items: list[Any] = [t for t in text.split(",")]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"buckets: expected {_FORM}; got {type(value).__name__} {value!r}")
    if not items:
        raise ValueError(f"buckets: an empty list; expected {_FORM}")
    pairs: list[tuple[int, int]] = []
    for it in items:
        pairs.append(_pair(it, value))
    if len(pairs) > MAX_BUCKETS:
        raise ValueError(f"buckets: {len(pairs)} buckets, more than the {MAX_BUCKETS} a store may have; "
                         f"expected {_FORM}")
    why = bucket_problem(pairs, pixel_bytes)
    if why is not None:
        raise ValueError(f"buckets: {why}; expected {_FORM}")
    return sort_buckets(pairs)


def _pair(item: Any, whole: Any) -> tuple[int, int]:
    if isinstance(item, str):
        m = re.fullmatch(r"\s*(\d+)\s*[x*]\s*(\d+)\s*", item.lower())
        if m is None:
            raise ValueError(f"buckets: {item.strip()!r} in {whole!r} is not HxW (two positive ints such as "
                             f"256x256); expected {_FORM}")
        h, w = int(m.group(1)), int(m.group(2))
    elif isinstance(item, (list, tuple)) and len(item) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in item):
        h, w = int(item[0]), int(item[1])
    else:
        raise ValueError(f"buckets: {item!r} in {whole!r} is not an (h, w) pair of ints; expected {_FORM}")
    if h < 1 or w < 1:
        raise ValueError(f"buckets: {h}x{w} has a side of 0 pixels; every side is a positive int; expected {_FORM}")
    return h, w


def nearest_bucket(h: int, w: int, buckets: Buckets) -> int:
    """The index in ``buckets`` of the bucket an ``h x w`` image goes to:
    the one nearest its aspect in ``|log(w / h) - log(bw / bh)|``, which is
    the bucket whose centre crop cuts the smallest share of the picture.
    Computed exactly in integers: the distance is ``log(max(p, q) / min(p,
    q))`` with ``p = w * bh`` and ``q = h * bw``, and two such ratios are
    compared by cross-multiplying. A tie (an aspect exactly between two
    buckets) goes to the wider bucket (the larger ``bw / bh``)."""
    best = -1
    bn = bd = 0  # the best distance as the ratio bn / bd >= 1
    for k, (bh, bw) in enumerate(buckets):
        p, q = w * bh, h * bw
        n, d = (p, q) if p >= q else (q, p)
        if best < 0:
            best, bn, bd = k, n, d
            continue
        c = n * bd - bn * d
        if c < 0 or (c == 0 and bw * buckets[best][0] > buckets[best][1] * bh):
            best, bn, bd = k, n, d
    return best


def crop_share(h: int, w: int, bucket: tuple[int, int]) -> float:
    """The share of an ``h x w`` picture's pixels that its centre crop to
    ``bucket`` cuts away (the ``center-crop`` geometry's rounding)."""
    th, tw = bucket
    if w * th >= h * tw:
        ch, cw = h, min(w, max(1, (2 * h * tw + th) // (2 * th)))
    else:
        cw, ch = w, min(h, max(1, (2 * w * th + tw) // (2 * tw)))
    return 1.0 - (ch * cw) / (h * w)


def _multiple(side: int) -> int:
    return 64 if side >= 512 else 8


def ladder(side: int) -> Buckets:
    """The candidate shapes of ``auto:side``, one per rung ``k = -8..8`` of
    aspect ``r = 2 ** (k / 4)`` (1:4 to 4:1): ``w = side * sqrt(r)`` and
    ``h = side / sqrt(r)``, each rounded half up to a multiple of ``m`` (64
    when ``side >= 512``, as SDXL's shapes, else 8), at least ``m``. Rungs
    that round to a shape already made, or to the aspect of one, are left
    out; sorted from the tallest to the widest."""
    m = _multiple(side)
    out: list[tuple[int, int]] = []
    for k in range(-LADDER_STEPS, LADDER_STEPS + 1):
        s = 2.0 ** (k / 8)  # sqrt(2 ** (k / 4))
        h = max(m, int(math.floor(side / s / m + 0.5)) * m)
        w = max(m, int(math.floor(side * s / m + 0.5)) * m)
        if all(w * bh != bw * h for bh, bw in out):
            out.append((h, w))
    return sort_buckets(out)


def auto_buckets(sizes: Any, side: int = AUTO_SIDE, max_buckets: int = AUTO_MAX_BUCKETS,
                 min_share: float = AUTO_MIN_SHARE) -> Buckets:
    """The buckets ``auto:side`` chooses for images of ``sizes`` (``(n, 2)``
    of ``(h, w)``, oriented): each image votes for its nearest shape of
    :func:`ladder` (:func:`nearest_bucket`); the shapes with at least
    ``min_share`` of the votes (and at least one) are kept, at most
    ``max_buckets`` of them, the most voted first (a tie: the shape nearer
    to square, then the wider). An image whose shape was not kept goes, at
    ingest, to the nearest kept one. No sizes at all: the square
    ``side x side`` (rounded as the ladder rounds)."""
    rungs = ladder(side)
    sz = np.asarray(sizes, np.int64).reshape(-1, 2)
    votes = np.zeros(len(rungs), np.int64)
    for (h, w), c in zip(*np.unique(sz, axis=0, return_counts=True)):
        if h >= 1 and w >= 1:
            votes[nearest_bucket(int(h), int(w), rungs)] += int(c)
    total = int(votes.sum())
    square = nearest_bucket(1, 1, rungs)
    if total == 0:
        return (rungs[square],)
    need = max(1, math.ceil(min_share * total))
    order = sorted(range(len(rungs)), key=lambda k: (-votes[k], abs(k - square), -k))
    kept = [k for k in order if votes[k] >= need][:max_buckets] or order[:1]
    return sort_buckets(rungs[k] for k in kept)


def header_size(data: Any, read_all: Any = None) -> tuple[int, int] | None:
    """The oriented ``(h, w)`` of an encoded image from its header, without
    decoding it, or None when the header does not give it (or is not an
    image's). ``data``: the start of the file (:data:`HEAD_BYTES` is
    enough for most); ``read_all()``: the whole file, called when the
    header is longer than ``data`` (a JPEG with large EXIF or ICC segments,
    a WebP whose EXIF comes after its pixels).

    The EXIF orientation is applied as the decode applies it: a JPEG's
    (APP1), a PNG's (``eXIf``), a WebP's (``EXIF``), a TIFF's (IFD0);
    orientations 5 to 8 swap ``h`` and ``w``."""
    from .sniff import exif_orientation, probe, sniff_image

    mv = memoryview(bytes(data) if not isinstance(data, (bytes, bytearray)) else data)
    fmt = sniff_image(mv[:64])
    if fmt is None:
        return None
    try:
        hd = probe(mv, fmt)
    except DecodeError:
        if read_all is None:
            return None
        mv = memoryview(bytes(read_all()))
        read_all = None
        try:
            hd = probe(mv, fmt)
        except DecodeError:
            return None
    if hd.width is None or hd.height is None or hd.width < 1 or hd.height < 1:
        return None
    o = hd.orientation if fmt == "jpeg" else 1
    if fmt == "png":
        o = _png_orientation(mv)
    elif fmt == "webp":
        if read_all is not None:
            mv = memoryview(bytes(read_all()))
        o = _webp_orientation(mv)
    elif fmt == "tiff":
        o = exif_orientation(mv)
    h, w = int(hd.height), int(hd.width)
    return (w, h) if o >= 5 else (h, w)


def _png_orientation(mv: memoryview) -> int:
    from .sniff import exif_orientation

    pos, n = 8, len(mv)
    while pos + 8 <= n:
        size = int.from_bytes(mv[pos : pos + 4], "big")
        kind = bytes(mv[pos + 4 : pos + 8])
        if kind == b"eXIf":
            return exif_orientation(mv[pos + 8 : min(n, pos + 8 + size)])
        if kind in (b"IDAT", b"IEND"):
            break
        pos += 12 + size
    return 1


def _webp_orientation(mv: memoryview) -> int:
    from .sniff import exif_orientation

    pos, n = 12, len(mv)
    while pos + 8 <= n:
        kind = bytes(mv[pos : pos + 4])
        size = int.from_bytes(mv[pos + 4 : pos + 8], "little")
        if kind == b"EXIF":
            blob = mv[pos + 8 : min(n, pos + 8 + size)]
            if bytes(blob[:6]) == b"Exif\x00\x00":
                blob = blob[6:]
            return exif_orientation(blob)
        pos += 8 + size + (size & 1)
    return 1
