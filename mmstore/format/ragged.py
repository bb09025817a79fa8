"""Ragged fields: entries with their own number of rows, ``str`` and ``bytes``
(format.py, "Ragged fields").

A batch of a ragged field is a :class:`Ragged`: one flat array of every
record's rows back to back plus the offsets where each record's rows start,
so reading a batch makes no Python object per record. ``Ragged.split()``
gives the list of per-record arrays (or ``str`` / ``bytes``) when wanted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import EntryDecodeError
from .layout import RAGGED_ZSTD_MAX_BYTES

__all__ = ["Ragged", "check_entry", "decode_entries", "decode_entry", "entry_bytes", "read_ragged"]


class Ragged:
    """A batch of a ragged field: ``values`` holds the rows of every record
    back to back (shape ``(total, *row)``, the field's dtype; ``|u1`` bytes
    for ``str`` and ``bytes`` fields), and record ``j``'s rows are
    ``values[offsets[j]:offsets[j + 1]]`` (``offsets``: int64, ``len + 1``
    entries, in rows). ``kind`` is ``"array"``, ``"str"`` or ``"bytes"``:
    what ``batch[j]`` and :meth:`split` give per record."""

    __slots__ = ("kind", "offsets", "values")

    def __init__(self, values: np.ndarray, offsets: np.ndarray, kind: str = "array") -> None:
        self.values = values
        self.offsets = offsets
        self.kind = kind

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Rows (for ``str`` / ``bytes``: bytes) of each record, int64."""
        return np.diff(self.offsets)

    def __getitem__(self, j: int) -> Any:
        """Record ``j``'s entry: a view of its rows, or its ``str`` / ``bytes``."""
        n = len(self)
        if not -n <= j < n:
            raise IndexError(f"index {j} is out of range for a batch of {n} records")
        j = j + n if j < 0 else j
        part = self.values[int(self.offsets[j]) : int(self.offsets[j + 1])]
        if self.kind == "str":
            return part.tobytes().decode("utf-8")
        if self.kind == "bytes":
            return part.tobytes()
        return part

    def split(self) -> list[Any]:
        """Every record's entry, in order: views of ``values`` (arrays), or
        ``str`` / ``bytes``."""
        if self.kind == "array":
            return np.split(self.values, self.offsets[1:-1]) if len(self) else []
        return [self[j] for j in range(len(self))]

    def __iter__(self) -> Any:
        return iter(self.split())

    def __repr__(self) -> str:
        return (f"Ragged({len(self)} records, {self.kind}, values {self.values.dtype.str} "
                f"{list(self.values.shape)})")


def _bad(field: Any, slot: int, reason: str) -> EntryDecodeError:
    return EntryDecodeError(f"field {field.name!r}, slot {slot}: {reason}", field=field.name, slot=int(slot),
                            reason=reason)


def _unzstd(data: Any) -> bytes:
    """One zstd frame (with its content size) of a ragged entry, decompressed."""
    import zstandard

    if len(data) == 0:
        raise EntryDecodeError("empty zstd entry (a zstd entry is one frame, also for zero rows)")
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise EntryDecodeError(f"not a zstd frame ({exc})") from None
    if size < 0 or size > RAGGED_ZSTD_MAX_BYTES:
        raise EntryDecodeError(f"zstd frame content size {size} is unknown or above {RAGGED_ZSTD_MAX_BYTES}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(size, 1), allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise EntryDecodeError(f"corrupt zstd frame ({exc})") from None
    if len(raw) != size:
        raise EntryDecodeError(f"zstd frame decoded to {len(raw)} bytes, its header says {size}")
    return raw


def entry_bytes(field: Any, data: Any) -> bytes | Any:
    """The decoded bytes of one stored entry of ragged ``field`` (raw: the
    entry itself; zstd: decompressed). Raises ``EntryDecodeError``."""
    return _unzstd(data) if field.codec.name == "zstd" else data


def decode_entry(field: Any, data: Any, slot: int = -1) -> Any:
    """One stored entry of ragged ``field`` -> its array of ``(n, *row)``
    (a new array), ``str`` or ``bytes``.

    Raises
    ------
    EntryDecodeError
        A size that is not a whole number of rows, invalid UTF-8 in a
        ``str`` field, a bad zstd frame; ``slot`` and ``field`` are set.
    """
    try:
        raw = entry_bytes(field, data)
    except EntryDecodeError as exc:
        raise _bad(field, slot, str(exc)) from None
    if field.kind == "bytes":
        return bytes(raw)
    if field.kind == "str":
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad(field, slot, f"the text is not valid UTF-8 ({exc})") from None
    rb = field.row_bytes
    if len(raw) % rb:
        raise _bad(field, slot, f"an entry of {len(raw)} bytes is not a whole number of {rb}-byte rows "
                   f"of {field.dtype.str} {list(field.row_shape)}")
    return np.frombuffer(bytes(raw), field.dtype).reshape((-1, *field.row_shape))


def decode_entries(field: Any, flat: np.ndarray, sizes: np.ndarray, slots: np.ndarray) -> Ragged:
    """Stored entries of ragged ``field`` back to back (``flat``, uint8) with
    their ``sizes`` (int64; the entry of ``slots[j]``) -> a :class:`Ragged`.
    Raw entries are checked and reinterpreted at once (no object per record);
    zstd entries are decompressed one by one. ``str`` entries are proven
    valid UTF-8 each: the whole buffer is valid and no entry starts with a
    continuation byte, so none was cut inside a character."""
    sizes = np.asarray(sizes, np.int64)
    if field.codec.name == "zstd":
        starts = np.concatenate(([0], np.cumsum(sizes)))
        parts = []
        for j in range(len(sizes)):
            try:
                parts.append(_unzstd(flat[int(starts[j]) : int(starts[j + 1])]))
            except EntryDecodeError as exc:
                raise _bad(field, int(slots[j]), str(exc)) from None
        flat = np.frombuffer(b"".join(parts), np.uint8)
        sizes = np.array([len(p) for p in parts], np.int64)
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if field.kind in ("str", "bytes"):
        if field.kind == "str" and len(flat):
            _check_utf8(field, flat, offsets, slots)
        return Ragged(flat, offsets, field.kind)
    rb = field.row_bytes
    odd = np.flatnonzero(sizes % rb)
    if len(odd):
        j = int(odd[0])
        raise _bad(field, int(slots[j]), f"an entry of {int(sizes[j])} bytes is not a whole number of {rb}-byte "
                   f"rows of {field.dtype.str} {list(field.row_shape)}")
    values = flat.view(field.dtype).reshape((-1, *field.row_shape)) if len(flat) else \
        np.empty((0, *field.row_shape), field.dtype)
    return Ragged(values, offsets // rb, "array")


def _check_utf8(field: Any, flat: np.ndarray, offsets: np.ndarray, slots: np.ndarray) -> None:
    starts = offsets[:-1]
    nonempty = offsets[1:] > starts
    cont = np.zeros(len(starts), bool)
    cont[nonempty] = (flat[starts[nonempty]] & 0xC0) == 0x80
    bad = -1
    if cont.any():
        bad = int(np.flatnonzero(cont)[0])
    else:
        try:
            flat.tobytes().decode("utf-8")
            return
        except UnicodeDecodeError as exc:
            bad = int(np.searchsorted(offsets, exc.start, side="right")) - 1
    try:
        flat[int(offsets[bad]) : int(offsets[bad + 1])].tobytes().decode("utf-8")
        reason = "the text is not valid UTF-8 (it starts inside a character)"
    except UnicodeDecodeError as exc:
        reason = f"the text is not valid UTF-8 ({exc})"
    raise _bad(field, int(slots[bad]), reason)


def check_entry(field: Any, data: Any, scratch: np.ndarray | None = None) -> None:
    """Decode one stored entry of variable-size ``field`` only to prove it
    valid (``verify --decode``, ``convert``): a ragged field's by its rules,
    another's with its codec into ``scratch`` (the field's dtype and shape).
    Raises ``EntryDecodeError`` with the reason alone."""
    if not field.ragged:
        field.codec.decode_into(data, scratch)
        return
    try:
        decode_entry(field, data)
    except EntryDecodeError as exc:
        raise EntryDecodeError(exc.reason) from None


def read_ragged(store: Any, name: str, slots: np.ndarray, sorted_slots: np.ndarray, rows: np.ndarray,
                entries: list[bytes] | None = None) -> Ragged:
    """``Store.read_batch``'s ragged field ``name``: records ``slots`` (the
    caller's order) as a :class:`Ragged`. ``entries``: their stored entries,
    already read in the caller's order (a backend with ``ragged_lists``);
    else they are gathered in ascending slot order (``sorted_slots``, where
    ``rows[j]`` says where slot ``sorted_slots[j]`` goes) and put back in the
    caller's order with one vectorised gather. A bad entry's error names the
    record, its slot and key (``Store._located``)."""
    try:
        if entries is not None:
            sizes = np.fromiter(map(len, entries), np.int64, len(entries))
            # a bytearray: the values are the batch's own writable memory (torch takes them without a copy)
            return decode_entries(store.schema[name], np.frombuffer(bytearray().join(entries), np.uint8), sizes,
                                  slots)
        flat, sizes = store.slot_view.backend.gather_entries(name, sorted_slots)
        n = len(sizes)
        if n > 1 and not np.array_equal(rows, np.arange(n)):
            order = np.empty(n, np.int64)
            order[rows] = np.arange(n)  # caller's position p holds sorted entry order[p]
            starts = np.zeros(n, np.int64)
            np.cumsum(sizes[:-1], out=starts[1:])
            sizes = sizes[order]
            new = np.zeros(n, np.int64)
            np.cumsum(sizes[:-1], out=new[1:])
            idx = np.repeat(starts[order] - new, sizes)
            idx += np.arange(int(sizes.sum()), dtype=np.int64)
            flat = flat[idx]
            sorted_slots = sorted_slots[order]
        return decode_entries(store.schema[name], flat, sizes, sorted_slots)
    except EntryDecodeError as exc:
        located = store._located(exc)
        if located is exc:
            raise
        raise located from None
