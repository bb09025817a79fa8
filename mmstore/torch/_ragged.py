"""Ragged fields on the torch side (README, "Ragged fields", "Reading with torch").

A ragged field (a variable leading dimension, ``str``, ``bytes``:
``mmstore/format/ragged.py``) has no one shape, so it never goes into a batch
buffer. A batch of one is given in one of two forms (``ragged=``):

* ``"list"`` (default): a list of tensors, record ``j``'s of shape
  ``(n_j, *row)``: views of one fresh tensor of the batch's rows (split in
  one call, no copy per record);
* ``"pad"``: a :class:`Padded` ``(values, lengths)``: ``values`` of shape
  ``(batch, max n_j, *row)`` filled with ``pad_value`` past each record's
  rows, ``lengths`` int64 ``(batch,)`` (filled with one vectorised scatter).

``str`` and ``bytes`` fields are a list of Python ``str`` / ``bytes`` in both
modes. Every batch's ragged tensors are fresh (nothing of them is reused).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..format.ragged import Ragged

__all__ = [
    "refuse_shaped",
    "RAGGED_MODES",
    "Padded",
    "RaggedReader",
    "check_mode",
    "concat",
    "multi_hot",
    "pad_list",
    "check_pad",
    "pad_of",
    "ragged_batch",
    "sample_of",
    "split_fields",
    "tensors_of",
    "to_device",
]

RAGGED_MODES = ("list", "pad")


class Padded(NamedTuple):
    """A ragged field's batch with ``ragged="pad"``: ``values`` ``(batch,
    max_len, *row)`` (``pad_value`` past each record's rows) and ``lengths``
    (int64, ``(batch,)``). Unpacks as ``values, lengths = batch["boxes"]``."""

    values: torch.Tensor
    lengths: torch.Tensor


def check_mode(mode: str) -> str:
    if mode not in RAGGED_MODES:
        raise ValueError(f"ragged= must be one of {RAGGED_MODES} (a list of tensors, or padded values + lengths), "
                         f"got {mode!r}")
    return mode


def refuse_shaped(store: Any, fields: Sequence[str], who: str) -> None:
    """Raise :class:`~mmstore.errors.SchemaError` when ``fields`` include a
    field of images of their own shape (``(None, None, C)``): their records
    have no one shape, so ``who`` (a batch) cannot stack them. The message
    says what to do instead."""
    shaped = [f for f in fields if store.schema[f].shaped]
    if not shaped:
        return
    from ..errors import SchemaError

    rest = [f for f in fields if f not in shaped]
    raise SchemaError(
        f"{who} cannot stack field(s) {shaped}: they hold images of their own shape (each record its own "
        f"height and width, see its {store.schema[shaped[0]].hw_name!r} field), and a batch has one shape. "
        f"Crop them to one shape as they are read (Loader(..., crop=RandomResizedCrop(224)) or "
        f"crop=CenterCrop(224), from mmstore.torch), leave them out with fields={rest!r}, or read them one "
        "record at a time (store[i], dataset[i]) or with store.read_batch (a list of arrays)")


def split_fields(store: Any, fields: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``fields`` as (fixed-shape ones, ragged ones), each in the given order."""
    ragged = tuple(f for f in fields if store.schema[f].ragged)
    return tuple(f for f in fields if f not in ragged), ragged


def _values_tensor(r: Ragged) -> torch.Tensor:
    v = r.values
    if not v.flags.writeable:  # a view of immutable bytes (lmdb): the batch's own copy
        v = v.copy()
    return torch.from_numpy(v)


def pad_of(pad_value: Any, dtype: np.dtype | type[np.generic], field: str | None = None) -> Any:
    """``pad_value`` as a value of ``dtype`` (a mapping: the entry of
    ``field``, default 0); one that would change (``0.5`` or ``nan`` into an
    integer field, ``-1`` or ``300`` into uint8) is refused, naming the field
    and values that fit."""
    if isinstance(pad_value, Mapping):
        pad_value = pad_value.get(field, 0)
    dtype = np.dtype(dtype)
    try:
        with np.errstate(invalid="ignore", over="ignore"):
            cast = np.asarray(pad_value).astype(dtype)
        same = cast.shape == () and bool(cast == pad_value or (np.isnan(cast) and np.isnan(pad_value)))
    except (TypeError, ValueError, OverflowError):
        same = False
    if not same:
        if dtype.kind == "u":
            fits = f"0 .. {np.iinfo(dtype).max}"
        elif dtype.kind == "i":
            fits = f"{np.iinfo(dtype).min} .. {np.iinfo(dtype).max}"
        elif dtype.kind == "b":
            fits = "False or True"
        else:
            fits = "a number"
        name = "a ragged field" if field is None else f"the ragged field {field!r}"
        per_field = "" if field is None else f", or one per field: pad_value={{{field!r}: 0, ...}}"
        raise ValueError(f"pad_value={pad_value!r} is not a value of {name} of dtype {dtype} (it would change "
                         f"when stored in it); give a value in {fits}{per_field}")
    return cast.item()


def check_pad(store: Any, fields: Sequence[str], mode: str, pad_value: Any) -> Any:
    """``pad_value`` checked against the ragged ``fields`` it pads (mode
    ``"pad"``), before any batch is read; a mapping names unknown fields."""
    if isinstance(pad_value, Mapping):
        unknown = sorted(set(pad_value) - set(fields))
        if unknown:
            raise ValueError(f"pad_value names {unknown}, which are not ragged fields read here "
                             f"(those are {sorted(fields)})")
    if mode == "pad":
        for f in fields:
            if store.schema[f].kind == "array":
                pad_of(pad_value, store.schema[f].dtype, f)
    return pad_value


def ragged_batch(r: Ragged, mode: str, pad_value: Any = 0, field: str | None = None) -> list[Any] | Padded:
    """A :class:`~mmstore.format.ragged.Ragged` as the torch form of ``mode`` (``field``: its name, for
    a per-field ``pad_value`` and the messages)."""
    if r.kind != "array":
        return r.split()
    lengths = r.lengths
    if mode == "list":
        return list(_values_tensor(r).split(lengths.tolist())) if len(lengths) else []
    v = r.values
    n = len(lengths)
    width = int(lengths.max()) if n else 0
    padded = np.full((n * width, *v.shape[1:]), pad_of(pad_value, v.dtype, field), dtype=v.dtype)
    if len(v):  # row i of record j goes to j * width + i: one numpy scatter (torch's index_put is much slower)
        starts = np.arange(n, dtype=np.int64) * width - r.offsets[:-1]
        padded[np.repeat(starts, lengths) + np.arange(len(v), dtype=np.int64)] = v
    return Padded(torch.from_numpy(padded.reshape(n, width, *v.shape[1:])), torch.from_numpy(lengths))


class RaggedReader:
    """A batch's ragged ``fields`` of ``store`` in ``mode`` (the Loader's
    per-batch task, run by a reader thread): one ``Store.read_batch`` of the
    record indices, then :func:`ragged_batch` per field."""

    def __init__(self, store: Any, fields: Sequence[str], mode: str, pad_value: Any) -> None:
        self.store, self.fields, self.mode, self.pad_value = store, tuple(fields), mode, pad_value

    def __call__(self, idx: np.ndarray) -> dict[str, Any]:
        return self.form(self.store.read_batch(idx, fields=self.fields))

    def form(self, got: dict[str, Ragged]) -> dict[str, Any]:
        """Each field's :class:`~mmstore.format.ragged.Ragged` in this reader's torch form."""
        return {f: ragged_batch(got[f], self.mode, self.pad_value, f) for f in self.fields}

    def piece(self, got: dict[str, Ragged]) -> dict[str, Any]:
        """A piece of a batch (read by a reader thread with its fixed fields):
        already in list form when the mode is ``"list"`` (so the consumer only
        joins lists); as it is for ``"pad"`` (the width is the whole batch's)."""
        return self.form(got) if self.mode == "list" else got

    def join(self, parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The batch from its pieces' :meth:`piece` results, in row order."""
        if self.mode == "list":
            return {f: [x for p in parts for x in p[f]] for f in self.fields}
        return self.form({f: concat([p[f] for p in parts]) for f in self.fields})


def concat(parts: Sequence[Ragged]) -> Ragged:
    """Consecutive pieces of a batch's ragged field as one :class:`~mmstore.format.ragged.Ragged`."""
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([p.lengths for p in parts])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Ragged(np.concatenate([p.values for p in parts]), offsets, parts[0].kind)


def _check_ids(values: torch.Tensor) -> None:
    """Refuse tag ids that are not integers (never rounded); an empty tensor
    of any dtype is no tags."""
    if values.numel() and (values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool):
        raise TypeError(f"tag ids must be integers, found {values.dtype} values: read the tags field as it "
                        "is stored (an integer field), or convert exact values with .long()")


def multi_hot(tags: Any, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Multi-label targets from a batch of tag ids: ``(batch, num_classes)``
    of ``dtype``, 1 where record ``j`` has tag ``k``, else 0 (a tag written
    twice counts once). ``tags`` is a batch of a ragged integer field in any
    of its forms: a list of tensors or arrays (``ragged="list"``), a
    :class:`Padded` (``ragged="pad"``), a :class:`~mmstore.format.ragged.Ragged`
    (``Store.read_batch``). On the device of the tensors given.

    Raises
    ------
    ValueError
        A tag id outside ``0 .. num_classes - 1`` (named, with its record).
    TypeError
        Tag ids that are not integers (a float or bool tensor): they are
        never rounded.
    """
    if isinstance(tags, Ragged):
        values = torch.as_tensor(np.ascontiguousarray(tags.values)).reshape(-1)
        lengths = torch.as_tensor(tags.lengths)
    elif isinstance(tags, Padded):
        width = tags.values.shape[1] if tags.values.dim() > 1 else 0
        keep = torch.arange(width, device=tags.values.device)[None, :] < tags.lengths.to(tags.values.device)[:, None]
        values, lengths = tags.values[keep], tags.lengths
    else:
        parts = [torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).reshape(-1) for x in tags]
        for p in parts:
            _check_ids(p)
        parts = [p if p.numel() else p.to(torch.int64) for p in parts]  # torch.tensor([]) is float32
        device = parts[0].device if parts else None
        values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        lengths = torch.tensor([len(x) for x in parts], dtype=torch.int64, device=device)
    n = len(lengths)
    lengths = lengths.to(values.device)
    out = torch.zeros((n, int(num_classes)), dtype=dtype, device=values.device)
    _check_ids(values)
    if len(values):
        values = values.to(torch.int64)
        bad = (values < 0) | (values >= num_classes)
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0])
            row = int(torch.searchsorted(torch.cumsum(lengths, 0), torch.tensor(k, device=lengths.device),
                                         right=True))
            raise ValueError(f"tag id {int(values[k])} of record {row} is outside 0 .. {num_classes - 1} "
                             f"(num_classes={num_classes}): pass the number of tag names")
        rows = torch.repeat_interleave(torch.arange(n, device=values.device), lengths)
        out[rows, values] = 1
    return out


def pad_list(items: Sequence[torch.Tensor], pad_value: Any = 0, field: str | None = None) -> Padded:
    """Per-record tensors ``(n_j, *row)`` as a :class:`Padded` (the collate path)."""
    lengths = torch.tensor([len(x) for x in items], dtype=torch.int64)
    width = int(lengths.max()) if len(items) else 0
    first = items[0]
    pad = pad_of(pad_value, first.numpy().dtype if first.device.type == "cpu" else np.float64, field)
    values = torch.full((len(items), width, *first.shape[1:]), pad, dtype=first.dtype)
    for j, x in enumerate(items):
        values[j, : len(x)] = x
    return Padded(values, lengths)


def sample_of(value: Any, i: int) -> Any:
    """Record ``i`` of a batched value: a tensor row, a list item, or a
    :class:`Padded` row cut to its length."""
    if isinstance(value, Padded):
        return value.values[i, : int(value.lengths[i])]
    return value[i]


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a batched value (a tensor, a list of them, a Padded)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for x in value:
            if isinstance(x, torch.Tensor):
                yield x


def to_device(value: Any, device: torch.device | None) -> Any:
    """A batched value on ``device`` (``str`` / ``bytes`` stay as they are)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Padded):
        return Padded(value.values.to(device, non_blocking=True), value.lengths.to(device, non_blocking=True))
    if isinstance(value, list):
        return [x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x for x in value]
    return value
