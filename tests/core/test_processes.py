"""A Store opened (and read) in the parent works in fork, forkserver and spawn children."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

import mmstore
from storetest import write_store


def _child_read(store, idx):
    b = store.read_batch(idx)
    return {k: v.tobytes() for k, v in b.items()}, os.getpid()


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_children_read_what_the_parent_reads(tmp_path, backend, method):
    path = write_store(os.path.join(tmp_path, "s"), 64, backend, holes=(7,))
    store = mmstore.open(path)
    idx = np.random.default_rng(3).integers(0, 63, 50)
    want = {k: v.tobytes() for k, v in store.read_batch(idx).items()}  # parent touches it first
    ctx = mp.get_context(method)
    with ctx.Pool(2) as pool:
        results = pool.starmap(_child_read, [(store, idx)] * 4)
    for got, pid in results:
        assert pid != os.getpid()
        assert got == want
    assert {k: v.tobytes() for k, v in store.read_batch(idx).items()} == want
