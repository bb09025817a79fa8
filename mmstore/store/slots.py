"""``Store.slot_view``: a store seen slot by slot, the low-level view for tools.

A *slot* is one position of a store's data files (format spec, "Slots,
records, holes"): the files are arrays of ``slots`` entries, each written
once at its position. A slot whose input failed to decode is a *hole*; the
*records* are the other slots, in slot order, and dataset index ``i`` (what
``store[i]`` takes) maps to slot ``_index.npy[i]`` when the store has holes,
else to slot ``i``. A merged store's slots run through its segments in order.

``Store`` speaks in dataset indices; checking, repairing, merging and the
batch engine need the slots, the per-slot bookkeeping arrays and the backend
that reads the data files. :class:`SlotView` gathers those in one place: it
holds no data of its own (every answer comes from the ``Store``'s mappings,
opened once per process, see NOTE [fork safety] in ``reader.py``), so it costs
nothing to keep and is safe to use in any process the store was pickled to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..errors import EntryDecodeError
    from .backends import BackendReader

__all__ = ["SlotView"]


class _SlotSource(Protocol):
    """What a ``SlotView`` reads from: the ``Store``'s own machinery (named
    here rather than imported, so that ``reader.py`` can import this module)."""

    path: str
    slots: int

    def _b(self) -> BackendReader: ...
    def _slot_index(self) -> np.ndarray | None: ...
    def _slots_of(self, indices: Any) -> np.ndarray: ...
    def _checksums(self) -> np.ndarray: ...
    def _slot_key_bytes(self, slot: int) -> bytes: ...
    def _entry_sizes(self, name: str, indices: Any = None) -> np.ndarray: ...
    def _data_offset(self, name: str) -> int: ...
    def _entry_error(self, exc: EntryDecodeError, slot: int) -> EntryDecodeError: ...


class SlotView:
    """The slot-level view of one :class:`~mmstore.store.reader.Store`
    (``store.slot_view``): slots, their bookkeeping arrays, their keys and
    this process's backend. Meant for tools (verify, repair, merge, the batch
    engine); a training loop needs only the ``Store`` itself."""

    __slots__ = ("_store",)

    def __init__(self, store: _SlotSource) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"<mmstore SlotView of {self._store.path!r} slots={self._store.slots}>"

    @property
    def backend(self) -> BackendReader:
        """This process's backend: what reads the data files (see
        ``BackendReader``; its capabilities say what else it allows)."""
        return self._store._b()

    @property
    def index(self) -> np.ndarray | None:
        """dataset index -> slot (a mapped ``<u8`` array of ``_index.npy``),
        or None when the store has no holes (the map is the identity)."""
        return self._store._slot_index()

    def slots_of(self, indices: Any) -> np.ndarray:
        """The slots (int64) of dataset ``indices`` (any order, duplicates,
        negatives counted from the end)."""
        return self._store._slots_of(indices)

    def slot(self, i: int) -> int:
        """The slot of dataset index ``i``."""
        return int(self._store._slots_of([i])[0])

    def checksums(self) -> np.ndarray:
        """The stored per-slot checksums (a mapped ``<u8`` array, holes 0)."""
        return self._store._checksums()

    def slot_key_bytes(self, slot: int) -> bytes:
        """The raw source-key bytes of ``slot`` (holes included)."""
        return self._store._slot_key_bytes(slot)

    def entry_sizes(self, name: str, indices: Any = None) -> np.ndarray:
        """Stored (encoded) bytes of field ``name`` for dataset ``indices``
        (default: every record), int64, from the offsets index (no entry is
        read). For a raw field every size is its entry's bytes."""
        return self._store._entry_sizes(name, indices)

    def data_offset(self, name: str) -> int:
        """Where the array of bookkeeping file ``name`` starts in it (the size
        of its ``.npy`` header): ``_checksums.npy``, ``_keys_offsets.npy``, and
        ``_index.npy`` when the store has holes. Checked at open."""
        return self._store._data_offset(name)

    def entry_error(self, exc: EntryDecodeError, slot: int) -> EntryDecodeError:
        """``exc`` (an entry of ``slot`` that does not decode; its ``field``
        set) as a store read raises it: the record's dataset index and source
        key added to the message and the attributes."""
        return self._store._entry_error(exc, slot)
