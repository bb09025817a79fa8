"""Images of their own shape (format.py, "Images of their own shape").

A *shaped* field's entry is one image of its own height and width: encoded
(``jpeg``, ``png``: the image carries its size) or, ``raw`` / ``zstd``, the
C-ordered bytes of ``h x w x C``. Its size lives in the companion fixed
field ``<name>_hw`` (``<u4``, ``(2,)``), so any record's shape is known in
O(1) without reading its entry, and a raw entry can be reshaped. Every read
checks the entry against that size before it allocates or decodes
(:func:`shape_problem`), so a damaged ``<name>_hw`` or entry is an
:class:`~mmstore.errors.EntryDecodeError`, never a wrong picture or a huge
allocation.

A batch of a shaped field is a list of arrays, one per record, in the
requested order: the records have different shapes, so they cannot share one
array, and a list of numpy arrays is what every consumer (a crop, a resize,
``torch.from_numpy``) takes as it is.

A *bucketed* shaped field (format.py, "Aspect buckets") lists its shapes in
``Field.buckets``; every record's ``<name>_hw`` is one of them. A record whose
size is not a listed bucket is refused like any other size that does not
fit (:func:`shape_problem`), and :func:`bucket_ids` gives every record's
bucket from the sizes column alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import EntryDecodeError
from .layout import SHAPED_MAX_BYTES

__all__ = ["MAX_BUCKETS", "bucket_ids", "bucket_problem", "check_shaped", "decode_shaped", "entry_hw", "read_shaped",
           "shape_problem", "sort_buckets"]

MAX_BUCKETS = 1024  # the buckets one field may list (the manifest holds them)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _pixel_bytes(field: Any) -> int:
    return int(field.dtype.itemsize * math.prod(field.shape[2:]))


def bucket_problem(buckets: Any, pixel_bytes: int) -> str | None:
    """Why ``buckets`` is not a bucket list of a field whose pixels have
    ``pixel_bytes`` bytes, or None: it must be a non-empty list of at most
    :data:`MAX_BUCKETS` ``[h, w]`` pairs of positive ints, no pair twice, no
    two of one aspect (an image's bucket would be ambiguous), each at most
    ``SHAPED_MAX_BYTES`` bytes as a record."""
    if not isinstance(buckets, (list, tuple)) or not buckets:
        return f"a non-empty list of [h, w] pairs is expected, found {str(buckets)[:100]}"
    if len(buckets) > MAX_BUCKETS:
        return f"{len(buckets)} buckets, more than the {MAX_BUCKETS} a field may list"
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for b in buckets:
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in b)):
            return f"a bucket is an [h, w] pair of positive ints, found {str(b)[:60]}"
        h, w = int(b[0]), int(b[1])
        if h * w * pixel_bytes > SHAPED_MAX_BYTES:
            return (f"bucket {h}x{w} is larger than the {SHAPED_MAX_BYTES:,} bytes a record of an image of its own "
                    "shape may hold")
        g = math.gcd(h, w)
        aspect = (h // g, w // g)
        if aspect in seen:
            other = seen[aspect]
            return (f"bucket {h}x{w} is given twice" if other == (h, w) else
                    f"buckets {other[0]}x{other[1]} and {h}x{w} have one aspect ({aspect[1]}:{aspect[0]}), so "
                    "every image would go to the first: keep one")
        seen[aspect] = (h, w)
    return None


def _taller_first(a: tuple[int, int], b: tuple[int, int]) -> int:
    return a[1] * b[0] - b[1] * a[0]  # sign of w_a / h_a - w_b / h_b


def sort_buckets(buckets: Any) -> tuple[tuple[int, int], ...]:
    """``buckets`` as ``((h, w), ...)`` from the tallest to the widest (by
    ``w / h``, compared exactly): the order a store lists them in."""
    import functools

    pairs = [(int(b[0]), int(b[1])) for b in buckets]
    return tuple(sorted(pairs, key=functools.cmp_to_key(_taller_first)))


def bucket_ids(field: Any, hw: Any) -> np.ndarray:
    """The bucket of each record: ``hw`` (``(n, 2)``, the records'
    ``<name>_hw``) as indices into ``field.buckets`` (``int64``, ``(n,)``).

    Raises
    ------
    EntryDecodeError
        ``field`` lists no buckets, or a size is none of them (a damaged
        ``<name>_hw``); the message names the first such row and size.
    """
    if not getattr(field, "buckets", None):
        raise EntryDecodeError(f"field {field.name!r} lists no buckets (not an image field with aspect buckets)")
    sizes = np.asarray(hw, np.int64).reshape(-1, 2)
    keys = sizes[:, 0] * (1 << 32) + sizes[:, 1]
    table = np.array([h * (1 << 32) + w for h, w in field.buckets], np.int64)
    order = np.argsort(table, kind="stable")
    pos = np.searchsorted(table[order], keys)
    pos = np.minimum(pos, len(table) - 1)
    ids = order[pos]
    bad = np.flatnonzero(table[ids] != keys)
    if bad.size:
        j = int(bad[0])
        raise EntryDecodeError(f"field {field.name!r}, row {j}: {field.hw_name!r} says {sizes[j, 0]} x {sizes[j, 1]}, "
                               f"which is none of its buckets {[list(b) for b in field.buckets]} "
                               f"({bad.size} such row(s))", field=field.name, reason="not a bucket")
    return ids.astype(np.int64)


def entry_hw(field: Any, data: Any) -> tuple[int, int] | None:
    """The ``(h, w)`` an entry of shaped ``field`` says it has, read from its
    header without decoding (jpeg: the frame header; png: ``IHDR``), or None
    for ``raw`` / ``zstd`` entries, which do not carry it."""
    name = field.codec.name
    if name == "jpeg":
        import simplejpeg

        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as exc:
            raise EntryDecodeError(f"not a JPEG ({exc})") from None
        return int(h), int(w)
    if name == "png":
        head = bytes(data[:24])
        if len(head) < 24 or head[:8] != _PNG_SIGNATURE or head[12:16] != b"IHDR":
            raise EntryDecodeError("not a PNG (no signature and IHDR chunk at its start)")
        return int.from_bytes(head[20:24], "big"), int.from_bytes(head[16:20], "big")
    return None


def shape_problem(field: Any, data: Any, hw: Any) -> str | None:
    """Why entry ``data`` of shaped ``field`` does not have the size ``hw``
    (its record's ``<name>_hw``) says, found without decoding: a raw entry's
    byte count, a zstd frame's content size, a JPEG's or PNG's header; or
    None when it fits. Also refuses an ``hw`` with a zero side (a hole's, or a
    damaged one) for an entry that is not empty."""
    h, w = int(hw[0]), int(hw[1])
    if h < 1 or w < 1:
        return (f"its size field {field.hw_name!r} says {h} x {w} pixels (no image), but the entry has "
                f"{len(data):,} bytes")
    if h * w * _pixel_bytes(field) > SHAPED_MAX_BYTES:
        return (f"{field.hw_name!r} says {h} x {w} pixels, more than the {SHAPED_MAX_BYTES:,} bytes a record of a "
                "shaped field may decode to")
    buckets = getattr(field, "buckets", None)
    if buckets and (h, w) not in buckets:
        return (f"{field.hw_name!r} says {h} x {w} pixels, which is none of the field's buckets "
                f"{[list(b) for b in buckets]}")
    name = field.codec.name
    if name in ("raw", "zstd"):
        want = h * w * _pixel_bytes(field)
        if name == "raw":
            got = len(data)
        else:
            import zstandard

            if len(data) == 0:
                return "empty zstd entry"
            try:
                got = int(zstandard.frame_content_size(data))
            except zstandard.ZstdError as exc:
                return f"not a zstd frame ({exc})"
        if got != want:
            return (f"an entry of {got:,} bytes{' decompressed' if name == 'zstd' else ''}, but {field.hw_name!r} "
                    f"says {h} x {w} pixels ({want:,} bytes of {field.dtype.str} {[h, w, *field.shape[2:]]})")
        return None
    if len(data) == 0:
        return f"empty {name} entry"
    try:
        got_hw = entry_hw(field, data)
    except EntryDecodeError as exc:
        return exc.reason or str(exc)
    if got_hw != (h, w):
        return f"a {name.upper()} of {got_hw[0]} x {got_hw[1]} pixels, but {field.hw_name!r} says {h} x {w}"  # type: ignore[index]
    return None


def _bad(field: Any, slot: int, reason: str) -> EntryDecodeError:
    return EntryDecodeError(f"field {field.name!r}, slot {slot}: {reason}", field=field.name, slot=int(slot),
                            reason=reason)


def decode_shaped(field: Any, data: Any, hw: Any, slot: int = -1) -> np.ndarray:
    """One stored entry of shaped ``field`` whose record's size is ``hw``
    -> a new array of ``(h, w)`` or ``(h, w, C)``, the field's dtype.

    Raises
    ------
    EntryDecodeError
        The entry does not have the size ``hw`` says (checked before any
        allocation), or does not decode; ``field`` and ``slot`` are set.
    """
    why = shape_problem(field, data, hw)
    if why is not None:
        raise _bad(field, slot, why)
    out = np.empty((int(hw[0]), int(hw[1]), *field.shape[2:]), field.dtype)
    try:
        field.codec.decode_into(data, out)
    except EntryDecodeError as exc:
        raise _bad(field, slot, exc.reason or str(exc)) from None
    return out


def check_shaped(field: Any, data: Any, hw: Any, decode: bool = True) -> None:
    """Prove one stored entry of shaped ``field`` valid for its size ``hw``
    (``verify``): its size always, its pixels too with ``decode``. Raises
    ``EntryDecodeError`` with the reason alone."""
    why = shape_problem(field, data, hw)
    if why is not None:
        raise EntryDecodeError(why)
    if decode:
        try:
            decode_shaped(field, data, hw)
        except EntryDecodeError as exc:
            raise EntryDecodeError(exc.reason) from None


def read_shaped(store: Any, name: str, slots: np.ndarray, sorted_slots: np.ndarray, rows: np.ndarray,
                hw: np.ndarray, entries: list[bytes] | None = None) -> list[np.ndarray]:
    """``Store.read_batch``'s shaped field ``name``: records ``slots`` (the
    caller's order) as a list of arrays. ``hw``: their sizes, ``(n, 2)`` in
    the caller's order. ``entries``: their stored entries, already read in
    the caller's order (a backend with ``ragged_lists``); else they are
    gathered in ascending slot order (``sorted_slots``; ``rows[j]`` says
    where slot ``sorted_slots[j]`` goes). A bad entry's error names the
    record, its slot and key."""
    field = store.schema[name]
    n = len(slots)
    try:
        if entries is None:
            flat, sizes = store.slot_view.backend.gather_entries(name, sorted_slots)
            starts = np.zeros(len(sizes) + 1, np.int64)
            np.cumsum(sizes, out=starts[1:])
            entries = [b""] * n
            for j in range(len(sizes)):
                entries[int(rows[j])] = flat[int(starts[j]) : int(starts[j + 1])]
        return [decode_shaped(field, entries[j], hw[j], int(slots[j])) for j in range(n)]
    except EntryDecodeError as exc:
        located = store._located(exc)
        if located is exc:
            raise
        raise located from None
