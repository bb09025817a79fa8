"""mmstore as a contender of the peers harness (shared/peers/run_bench.py).

The harness folder is read-only; to run it, copy it and register this class::

    cp -r ../shared/peers /tmp/peers && cd /tmp/peers
    cat >> contenders.py <<'EOF'
    import sys as _sys
    _sys.path[:0] = ["/work/main/tools", "/work/main"]
    from peers_contender import register as _register
    _register(CONTENDERS)
    EOF
    /work/main/.venv/bin/python run_bench.py --only mmstore,npy,lmdb --n 2000 \\
        --out /tmp/peers/results.md --skip-raw

``MmStore`` is the memmap backend, ``MmStoreLmdb`` the lmdb backend. The
reader's ``get(i)`` is the public per-sample API (``store[i]``), its
``get_batch(idx)`` is ``store.read_batch(idx)`` (a fresh batch each call: the
DataLoader rows hand the arrays to torch), and the native loader is a
``BatchSampler`` of shuffled indices with one ``read_batch`` per batch.
"""

from __future__ import annotations

import os
import sys

import numpy as np

# The module is imported from inside the harness's contenders.py (at its end),
# so these names already exist there.
from contenders import SHAPE, Contender, Reader, _batched_loader  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

SCHEMA = {"image": ("|u1", SHAPE), "label": ("<i8", ())}


class _MmReader(Reader):
    def __init__(self, out: str):
        import mmstore
        self.store = mmstore.open(out)
        self.store.backend  # noqa: B018 - open this process's mappings / environment now

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
        return [f"mmstore.StoreWriter(backend={self.backend!r}) from the decoded records (fsync "
                "included); get(i) = store[i] (a copy through read_batch); batched and native = "
                "store.read_batch(idx), which sorts the slots and copies each record once "
                "(memmove), into a new batch array."]

    def warmup_imports(self):
        import mmstore  # noqa: F401

    def write(self, src, out):
        import mmstore
        if os.path.exists(out):
            import shutil
            shutil.rmtree(out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        n = len(src.labels)
        labels = np.asarray(src.labels, dtype=np.int64)
        with mmstore.StoreWriter(out, SCHEMA, slots=n, backend=self.backend) as w:
            sw = w.slot_writer
            for i in range(n):
                sw.write_arrays(i, {"image": np.ascontiguousarray(src.images[i]),
                                    "label": labels[i : i + 1].reshape(())})
            w.mark_written(np.arange(n))
            w.set_keys(np.zeros(n + 1, np.uint64), b"")

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
