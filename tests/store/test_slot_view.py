"""``Store.slot_view``: the slot-level view answers for every layout (memmap,
lmdb, merged, with holes); the ``Store`` spellings of its members that 0.3
kept with a warning are gone."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import xxhash
from support.stores import KEYS, SMALL_SCHEMA, write_merged, write_store

import mmstore
from mmstore.format.layout import CHECKSUMS_FILE, INDEX_FILE, KEYS_OFFSETS_FILE
from mmstore.store.slots import SlotView

N = 23
HOLES = (0, 4, 5, 17)
LAYOUTS = {  # name -> (backend, holes, merged)
    "memmap": ("memmap", (), False),
    "lmdb": ("lmdb", (), False),
    "merged": ("memmap", (), True),
    "holed": ("memmap", HOLES, False),
    "lmdb-merged-holed": ("lmdb", HOLES, True),
}
MOVED = ["backend", "index", "slots_of", "slot", "data_offset", "entry_sizes", "slot_key_bytes", "checksums"]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def store(request, tmp_path_factory):
    backend, holes, merged = LAYOUTS[request.param]
    path = os.path.join(tmp_path_factory.mktemp("slot_view"), request.param)
    if merged:
        write_merged(path, N, [6, 6, 15], backend=backend, holes=holes)
    else:
        write_store(path, N, backend, holes=holes)
    with mmstore.open(path) as s:
        yield s


def _live(s) -> list[int]:
    return [t for t in range(s.slots) if t not in (HOLES if s.records < s.slots else ())]


def test_slot_view_answers_for_every_layout(store):
    sv = store.slot_view
    assert isinstance(sv, SlotView)
    live = _live(store)
    assert len(store) == len(live)
    if store.records == store.slots:
        assert sv.index is None
    else:
        assert sv.index.tolist() == live
    assert sv.slots_of(np.arange(len(store))).tolist() == live
    assert sv.slots_of([-1]).tolist() == [live[-1]]
    assert [sv.slot(i) for i in range(len(store))] == live
    assert [sv.slot_key_bytes(t) for t in range(store.slots)] == [KEYS.format(t).encode() for t in range(store.slots)]
    with pytest.raises(IndexError):
        sv.slot_key_bytes(store.slots)
    # the checksums: 0 for a hole, else the hash of the record's checksummed bytes (what verify hashes)
    ck = sv.checksums()
    assert len(ck) == store.slots
    hashes = {t: xxhash.xxh3_64_intdigest(bytes(v)) for t, v in sv.backend.iter_packed(0, store.slots) if t in live}
    assert [int(c) for c in ck] == [hashes.get(t, 0) for t in range(store.slots)]
    nbytes = int(np.dtype(SMALL_SCHEMA["image"][0]).itemsize * np.prod(SMALL_SCHEMA["image"][1]))
    assert sv.entry_sizes("image").tolist() == [nbytes] * len(store)
    assert sv.entry_sizes("label", [0, -1]).tolist() == [8, 8]
    # data_offset: where each bookkeeping array starts in its file
    with open(os.path.join(store.path, CHECKSUMS_FILE), "rb") as fh:
        fh.seek(sv.data_offset(CHECKSUMS_FILE))
        assert np.array_equal(np.frombuffer(fh.read(), "<u8"), ck)
    with open(os.path.join(store.path, KEYS_OFFSETS_FILE), "rb") as fh:
        fh.seek(sv.data_offset(KEYS_OFFSETS_FILE))
        assert len(np.frombuffer(fh.read(), "<u8")) == store.slots + 1
    if store.records < store.slots:
        with open(os.path.join(store.path, INDEX_FILE), "rb") as fh:
            fh.seek(sv.data_offset(INDEX_FILE))
            assert np.frombuffer(fh.read(), "<u8").tolist() == live
    else:
        with pytest.raises(KeyError, match="not a bookkeeping array"):
            sv.data_offset(INDEX_FILE)
    assert set(sv.backend.data_paths()) <= set(store.data_paths())
    assert sv.backend.segmented == (store.segments is not None)


def test_slot_view_survives_pickling(store):
    """A store sent to another process (a DataLoader worker) reopens with its own view."""
    other = pickle.loads(pickle.dumps(store))
    try:
        assert other.slot_view.backend is not store.slot_view.backend
        assert other.slot_view.slots_of(np.arange(len(other))).tolist() == _live(store)
        assert np.array_equal(other.slot_view.checksums(), store.slot_view.checksums())
    finally:
        other.close()


def _call(obj, name):
    """What ``obj.name`` gives (called with sample arguments when a method)."""
    args = {"slots_of": ([2, -1],), "slot": (3,), "data_offset": (CHECKSUMS_FILE,), "entry_sizes": ("image", [1, 2]),
            "slot_key_bytes": (2,), "checksums": ()}
    attr = getattr(obj, name)
    return attr(*args[name]) if name in args else attr


@pytest.mark.parametrize("name", MOVED)
def test_the_old_store_spelling_is_gone_and_the_slot_view_answers(store, name):
    with pytest.raises(AttributeError, match=f"'Store' object has no attribute '{name}'"):
        getattr(store, name)
    _call(store.slot_view, name)  # the spelling that replaces it (what it gives: the tests above)
