"""Ragged fields on the torch side (README, "Ragged fields", "Reading with torch").

A ragged field (a variable leading dimension, ``str``, ``bytes``:
``mmstore/ragged.py``) has no one shape, so it never goes into a batch
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

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..ragged import Ragged

__all__ = ["RAGGED_MODES", "Padded", "RaggedReader", "check_mode", "concat", "pad_list", "ragged_batch", "sample_of", "split_fields",
           "tensors_of", "to_device"]

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


def split_fields(store: Any, fields: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``fields`` as (fixed-shape ones, ragged ones), each in the given order."""
    ragged = tuple(f for f in fields if store.schema[f].ragged)
    return tuple(f for f in fields if f not in ragged), ragged


def _values_tensor(r: Ragged) -> torch.Tensor:
    v = r.values
    if not v.flags.writeable:  # a view of immutable bytes (lmdb): the batch's own copy
        v = v.copy()
    return torch.from_numpy(v)


def ragged_batch(r: Ragged, mode: str, pad_value: Any = 0) -> list[Any] | Padded:
    """A :class:`~mmstore.ragged.Ragged` as the torch form of ``mode``."""
    if r.kind != "array":
        return r.split()
    t = _values_tensor(r)
    lengths = r.lengths
    if mode == "list":
        return list(t.split(lengths.tolist())) if len(lengths) else []
    n = len(lengths)
    width = int(lengths.max()) if n else 0
    values = torch.full((n, width, *t.shape[1:]), pad_value, dtype=t.dtype)
    if len(t):
        rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
        cols = np.arange(len(t), dtype=np.int64) - np.repeat(r.offsets[:-1], lengths)
        values[torch.from_numpy(rows), torch.from_numpy(cols)] = t
    return Padded(values, torch.from_numpy(lengths))


class RaggedReader:
    """A batch's ragged ``fields`` of ``store`` in ``mode`` (the Loader's
    per-batch task, run by a reader thread): one ``Store.read_batch`` of the
    record indices, then :func:`ragged_batch` per field."""

    def __init__(self, store: Any, fields: Sequence[str], mode: str, pad_value: Any) -> None:
        self.store, self.fields, self.mode, self.pad_value = store, tuple(fields), mode, pad_value

    def __call__(self, idx: np.ndarray) -> dict[str, Any]:
        return self.form(self.store.read_batch(idx, fields=self.fields))

    def form(self, got: dict[str, Ragged]) -> dict[str, Any]:
        """Each field's :class:`~mmstore.ragged.Ragged` in this reader's torch form."""
        return {f: ragged_batch(got[f], self.mode, self.pad_value) for f in self.fields}


def concat(parts: Sequence[Ragged]) -> Ragged:
    """Consecutive pieces of a batch's ragged field as one :class:`~mmstore.ragged.Ragged`."""
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([p.lengths for p in parts])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Ragged(np.concatenate([p.values for p in parts]), offsets, parts[0].kind)


def pad_list(items: Sequence[torch.Tensor], pad_value: Any = 0) -> Padded:
    """Per-record tensors ``(n_j, *row)`` as a :class:`Padded` (the collate path)."""
    lengths = torch.tensor([len(x) for x in items], dtype=torch.int64)
    width = int(lengths.max()) if len(items) else 0
    first = items[0]
    values = torch.full((len(items), width, *first.shape[1:]), pad_value, dtype=first.dtype)
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


def to_device(value: Any, device: torch.device) -> Any:
    """A batched value on ``device`` (``str`` / ``bytes`` stay as they are)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Padded):
        return Padded(value.values.to(device, non_blocking=True), value.lengths.to(device, non_blocking=True))
    if isinstance(value, list):
        return [x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x for x in value]
    return value
