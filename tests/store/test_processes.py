"""A Store opened (and read) in the parent works in fork, forkserver and spawn children."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from support.stores import SMALL_SCHEMA, sample, write_store

import mmstore


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


def test_regression_lmdb_fork_while_a_parent_thread_reads(tmp_path):
    """Bug: a forked child closed the LMDB environment it inherited, which hung
    when another parent thread held a read transaction at fork time. Children
    now reuse the inherited (read-only, lock-free) environment."""
    import threading

    path = write_store(os.path.join(tmp_path, "s"), 200, "lmdb")
    store = mmstore.open(path)
    want = store.read_batch(np.arange(0, 200, 7))["image"].tobytes()
    stop = threading.Event()

    def reader():
        s = mmstore.open(path)
        while not stop.is_set():
            s.read_batch(np.arange(200))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                ok = False
                try:
                    got = mmstore.open(path).read_batch(np.arange(0, 200, 7))["image"].tobytes()
                    ok = got == want and store.read_batch(np.arange(0, 200, 7))["image"].tobytes() == want
                finally:
                    os._exit(0 if ok else 3)
            assert _wait(pid, timeout=20) == 0
    finally:
        stop.set()
        t.join()


def _wait(pid, timeout):
    """Exit code of child ``pid``; a hung child is killed and fails the test
    (instead of hanging the suite)."""
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("a forked child hung reading the store")
        time.sleep(0.005)


def test_lmdb_store_recreated_at_the_same_path_reads_the_new_file(tmp_path):
    path = os.path.join(tmp_path, "s")
    old = mmstore.open(write_store(path, 5, "lmdb"))
    old.read_batch([0])  # keeps the first file's environment open
    with mmstore.StoreWriter(path, SMALL_SCHEMA, slots=3, backend="lmdb", overwrite=True) as w:
        for i in range(3):
            w.write(i, {k: np.zeros_like(v) for k, v in sample(i).items()})
    new = mmstore.open(path)
    assert len(new) == 3 and int(new[0]["image"].sum()) == 0

