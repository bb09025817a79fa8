"""Stale readers: a Store reads the store it opened, or fails naming the
change, in every process; a file truncated under an open store is a typed
error naming the file, never SIGBUS or zeros. Every read
that could crash runs in a forked child (``support.proc.in_child``)."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
from support.proc import in_child
from support.stores import sample, write_parts, write_store

import mmstore
from mmstore.errors import StoreChangedError
from mmstore.ingest.merge import merge

N = 12
HOLES = (3, 7)


def _other(i):
    """Record i of the replacing store: same schema and size, other pixels (as --bgr would give)."""
    rec = sample(i)
    rec["image"] = rec["image"][..., ::-1].copy()
    return rec


def _replace(path, backend, via="rename"):
    """Put another store of the same shape at ``path``: written next to it and
    renamed in (as ``ingest --overwrite`` does), or deleted and re-created in
    place (inode numbers are then often reused)."""
    if via == "rename":
        new = path + ".new"
        write_store(new, N, backend=backend, holes=HOLES, make=_other)
        os.rename(path, path + ".old")
        os.rename(new, path)
        shutil.rmtree(path + ".old")
    else:
        shutil.rmtree(path)
        write_store(path, N, backend=backend, holes=HOLES, make=_other)


def _old_images():
    keep = [s for s in range(N) if s not in HOLES]
    return np.stack([sample(s)["image"] for s in keep])


@pytest.mark.parametrize("via", ["rename", "recreate"])
def test_store_opened_not_read_then_replaced_raises_store_changed(tmp_path, backend, via):
    path = write_store(str(tmp_path / "s"), N, backend=backend, holes=HOLES)
    store = mmstore.open(path)
    _replace(path, backend, via)

    def read():
        return store.read_batch(np.arange(len(store)))["image"]

    res = in_child(read)
    assert res.raised("StoreChangedError"), res
    assert os.path.join(path, "") in res.value[1] and "Reopen it" in res.value[1]
    with pytest.raises(StoreChangedError):
        store[0]
    with pytest.raises(StoreChangedError):
        store.key(0)
    fresh = mmstore.open(path)  # reopening reads the new store
    np.testing.assert_array_equal(fresh.read_batch(np.arange(len(fresh)))["image"], _old_images()[..., ::-1])


def test_fork_worker_after_replace_raises_parent_keeps_reading_what_it_opened(tmp_path, backend):
    path = write_store(str(tmp_path / "s"), N, backend=backend, holes=HOLES)
    store = mmstore.open(path)
    epoch1 = store.read_batch(np.arange(len(store)))["image"]  # "epoch 1": the parent maps the files
    np.testing.assert_array_equal(epoch1, _old_images())
    assert store.key(0) == "in/00000.jpg"  # ... and the keys
    _replace(path, backend)

    def worker_epoch2():  # a fork worker opens its own mappings, as DataLoader workers do
        return store.read_batch(np.arange(len(store)))["image"]

    res = in_child(worker_epoch2)
    assert res.raised("StoreChangedError"), res
    # the parent's mappings are of the files it opened: still exactly the old store (a file it
    # had not mapped yet would be a StoreChangedError, as in the child)
    np.testing.assert_array_equal(store.read_batch(np.arange(len(store)))["image"], _old_images())
    assert [store.key(i) for i in range(2)] == ["in/00000.jpg", "in/00001.jpg"]


def test_pickled_store_reopened_after_replace_raises(tmp_path, backend):
    path = write_store(str(tmp_path / "s"), N, backend=backend, holes=HOLES)
    blob = pickle.dumps(mmstore.open(path))
    np.testing.assert_array_equal(pickle.loads(blob)[0]["image"], sample(0)["image"])
    _replace(path, backend)
    with pytest.raises(StoreChangedError, match="replaced"):
        pickle.loads(blob)


def test_file_rewritten_in_place_is_a_change(tmp_path):
    """``cp -r new/. old/`` keeps the inodes and sizes; the modification time tells."""
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    store = mmstore.open(path)
    new = write_store(str(tmp_path / "n"), N, holes=HOLES, make=_other)
    os.utime(os.path.join(new, "image.npy"), ns=(1, 1))  # another mtime, whatever the clock's resolution
    with open(os.path.join(new, "image.npy"), "rb") as src, open(os.path.join(path, "image.npy"), "r+b") as dst:
        dst.write(src.read())
    os.utime(os.path.join(path, "image.npy"), ns=(1, 1))
    res = in_child(lambda: store[0]["image"])
    assert res.raised("StoreChangedError") and "image.npy" in res.value[1], res


def test_dataloader_fork_workers_see_the_change(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from mmstore.torch import StoreDataset

    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    ds = StoreDataset(path)
    dl = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")

    def epoch():
        return torch.cat([b["image"] for b in dl]).numpy()

    np.testing.assert_array_equal(epoch(), _old_images())
    _replace(path, "memmap")
    res = in_child(epoch)  # the DataLoader re-raises its worker's error in the main process
    assert res.raised("StoreChangedError"), res


# -- truncated after open ----------------------------------------------------
def _truncate_then_read(path, name, new_size, read):
    store = mmstore.open(path)
    read(store)  # maps the files
    os.truncate(os.path.join(path, name), new_size)
    return read(store)


def _read_all(store):
    return {k: v.copy() for k, v in store.read_batch(np.arange(len(store))).items()}


@pytest.mark.parametrize("name,cut", [
    ("image.npy", "one-record"), ("image.npy", "to-header"), ("label.npy", "8-bytes"), ("score.npy", "one-record"),
    ("_index.npy", "8-bytes"),
])
@pytest.mark.parametrize("how", ["read_batch", "column", "[i]"])
def test_memmap_file_truncated_after_open_is_typed_not_sigbus(tmp_path, name, cut, how):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    size = os.path.getsize(os.path.join(path, name))
    entry = {"image.npy": 8 * 6 * 3, "score.npy": 8}.get(name, 8)
    if name == "label.npy":
        assert size <= 4096  # one page: a cut within it used to read as zeros, not SIGBUS
    new = {"one-record": size - entry, "to-header": 128, "8-bytes": size - 8}[cut]
    field = {"image.npy": "image", "score.npy": "score"}.get(name, "label")
    read = {"read_batch": _read_all, "column": lambda s: s.column(field).copy(),
            "[i]": lambda s: s[len(s) - 1]}[how]
    res = in_child(_truncate_then_read, path, name, new, read)
    assert res.raised("StoreChangedError"), res
    assert f"{name}: truncated to {new} bytes" in res.value[1]


def test_merged_segment_truncated_after_open(tmp_path):
    parts = write_parts(str(tmp_path / "p"), N, (5, 9), holes=HOLES)
    path = merge(parts, str(tmp_path / "m"))
    seg = "image.00001.npy"
    res = in_child(_truncate_then_read, path, seg, 128, _read_all)
    assert res.raised("StoreChangedError") and f"{seg}: truncated" in res.value[1], res


def test_lmdb_file_truncated_after_open(tmp_path):
    path = write_store(str(tmp_path / "s"), N, backend="lmdb", holes=HOLES)
    size = os.path.getsize(os.path.join(path, "records.mdb"))
    res = in_child(_truncate_then_read, path, "records.mdb", size - 4096, _read_all)
    assert res.raised("StoreChangedError") and "records.mdb: truncated" in res.value[1], res


def test_keys_truncated_after_open(tmp_path):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    size = os.path.getsize(os.path.join(path, "_keys.bin"))
    res = in_child(_truncate_then_read, path, "_keys.bin", size - 3, lambda s: [s.key(i) for i in range(len(s))])
    assert res.raised("StoreChangedError") and "_keys.bin: truncated" in res.value[1], res
