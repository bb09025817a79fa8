"""mmstore as a contender of the peers harness (``run_bench.py`` in the shared peers folder).

Written against the public API a user has: ``mmstore.StoreWriter`` and its
``write_batch`` to write, ``store[i]`` and ``store.read_batch(idx)`` to read.
The harness folder is read-only; to run it, copy it and register this class
(``REPO`` is this repository's root, ``PEERS`` the harness folder)::

    cp -r "$PEERS" /tmp/peers && cd /tmp/peers
    cat >> contenders.py <<EOF
    import sys as _sys
    _sys.path[:0] = ["$REPO/tools", "$REPO"]
    from peers_contender import register as _register
    _register(CONTENDERS)
    EOF
    python run_bench.py --only mmstore,npy,lmdb --n 2000 --out /tmp/peers/results.md --skip-raw

``MmStore`` is the memmap backend, ``MmStoreLmdb`` the lmdb backend. The
reader's ``get(i)`` is the public per-sample API (``store[i]``), its
``get_batch(idx)`` is ``store.read_batch(idx)`` (a fresh batch each call: the
DataLoader rows hand the arrays to torch), and the native loader is a
``BatchSampler`` of shuffled indices with one ``read_batch`` per batch.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np

# The module is imported from inside the harness's contenders.py (at its end),
# so these names already exist there.
from contenders import SHAPE, Contender, Reader, _batched_loader  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

SCHEMA = {"image": ("|u1", SHAPE), "label": ("<i8", ())}
WRITE_BATCH = 256  # records per write_batch call (about 38 MB of 224x224x3 images)


class _MmReader(Reader):
    def __init__(self, out: str):
        import mmstore
        self.store = mmstore.open(out)
        self.store.slot_view.backend  # noqa: B018 - open this process's mappings / environment now

    def __len__(self):
        return len(self.store)

    def get(self, i):
        d = self.store[i]
        return d["image"], int(d["label"])

    def get_batch(self, idx):
        d = self.store.read_batch(idx)
        return d["image"], d["label"]

    def close(self):
        self.store.close()
        self.store = None


class MmStore(Contender):
    name, title = "mmstore", "mmstore (memmap backend)"
    backend = "memmap"
    native_title = "BatchSampler + read_batch"
    native_workers = (0, 2)

    @property
    def notes(self):  # type: ignore[override]
        return [f"mmstore.StoreWriter(backend={self.backend!r}).write_batch of {WRITE_BATCH} decoded "
                "records at a time (fsync included); get(i) = store[i] (a copy through read_batch); "
                "batched and native = store.read_batch(idx), which sorts the slots and copies each "
                "record once (memmove), into a new batch array."]

    def warmup_imports(self):
        import mmstore  # noqa: F401

    def write(self, src, out):
        import mmstore

        if os.path.exists(out):
            shutil.rmtree(out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        n = len(src.labels)
        labels = np.asarray(src.labels, dtype=np.int64)
        with mmstore.StoreWriter(out, SCHEMA, slots=n, backend=self.backend) as w:
            for a in range(0, n, WRITE_BATCH):
                b = min(n, a + WRITE_BATCH)
                w.write_batch(a, {"image": src.images[a:b], "label": labels[a:b]})

    def open(self, out):
        return _MmReader(out)

    def native_loader(self, out, batch_size, num_workers, seed):
        return _batched_loader(self, out, batch_size, num_workers, seed)


class MmStoreLmdb(MmStore):
    name, title = "mmstore-lmdb", "mmstore (lmdb backend)"
    backend = "lmdb"

    def warmup_imports(self):
        import lmdb  # noqa: F401

        import mmstore  # noqa: F401


def register(contenders: dict) -> None:
    """Add both mmstore contenders to the harness's ``CONTENDERS``."""
    for c in (MmStore(), MmStoreLmdb()):
        contenders[c.name] = c
