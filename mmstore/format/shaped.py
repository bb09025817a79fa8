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
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import EntryDecodeError
from .layout import SHAPED_MAX_BYTES

__all__ = ["check_shaped", "decode_shaped", "entry_hw", "read_shaped", "shape_problem"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _pixel_bytes(field: Any) -> int:
    return int(field.dtype.itemsize * math.prod(field.shape[2:]))


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
