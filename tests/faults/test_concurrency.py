"""Many readers at once: 16 processes (fork, forkserver, spawn) reading random
batches while verify runs; LMDB with more concurrent readers than its default
limit; a second ingest into the same destination is refused."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
from support.images import make_source
from support.proc import killable_cli

import mmstore
from mmstore.check import verify_store
from mmstore.store.writer import acquire_lock

N = 400
SCHEMA = {"image": ("|u1", (16, 16, 3)), "label": ("<i8", ())}


def _make(path, backend):
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(path, SCHEMA, slots=N, backend=backend) as w:
        w.write_batch(0, {"image": rng.integers(0, 256, (N, 16, 16, 3), dtype=np.uint8), "label": np.arange(N)})
    return path


def _batches(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, N, 64) for _ in range(30)]


def _digest(store, seed):
    h = hashlib.sha256()
    for idx in _batches(seed):
        b = store.read_batch(idx)
        h.update(b["image"].tobytes())
        h.update(b["label"].tobytes())
    return h.hexdigest()


def _reader(store, seed, conn):
    conn.send((seed, _digest(store, seed)))
    conn.close()


def _read_in_processes(method, store, seeds, timeout=120.0):
    """``_digest`` of each seed in a process of its own (``method``: fork, forkserver, spawn);
    a process that dies or hangs fails the test with its exit code instead of blocking it."""
    ctx = mp.get_context(method)
    procs = []
    for seed in seeds:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_reader, args=(store, seed, send), daemon=True)
        p.start()
        send.close()
        procs.append((seed, p, recv))
    out = {}
    deadline = time.monotonic() + timeout
    try:
        for seed, p, recv in procs:
            if not recv.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"{method} reader {seed}: no result within {timeout:.0f} s "
                                     f"(alive: {p.is_alive()}, exit code: {p.exitcode})")
            try:
                got = recv.recv()
            except EOFError:
                p.join(10)
                why = f"{method} reader {seed} ended with exit code {p.exitcode} and no result"
                raise AssertionError(why) from None
            out[got[0]] = got[1]
    finally:
        for _, p, recv in procs:
            recv.close()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return out


@pytest.mark.soak  # 16 processes of three start methods at once: CI's soak step
@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_16_reader_processes_while_verify_runs(tmp_path, backend):
    path = _make(str(tmp_path / "s"), backend)
    store = mmstore.open(path)
    want = {seed: _digest(store, seed) for seed in range(16)}  # single-process truth; parent touched it
    stop = threading.Event()
    reports = []

    def verifier():
        while not stop.is_set():
            reports.append(verify_store(path, threads=2))

    t = threading.Thread(target=verifier)
    t.start()
    try:
        results = {}
        for method, seeds in (("fork", range(0, 6)), ("forkserver", range(6, 11)), ("spawn", range(11, 16))):
            results.update(_read_in_processes(method, store, seeds))
    finally:
        stop.set()
        t.join()
    assert results == want
    assert reports and all(r.ok for r in reports)


def test_lmdb_more_readers_than_the_default_limit(tmp_path):
    path = _make(str(tmp_path / "l"), "lmdb")
    store = mmstore.open(path)
    env = store.slot_view.backend.env()
    txns = [env.begin() for _ in range(200)]  # LMDB's default max_readers is 126
    try:
        vals = {txn.get((7).to_bytes(8, "big"))[:16] for txn in txns}
        assert len(vals) == 1
        b = store.read_batch([7])
        assert b["image"].tobytes()[:16] in vals
    finally:
        for t in txns:
            t.abort()
    errs = []

    def worker(i):
        try:
            s = mmstore.open(path)
            for _ in range(5):
                idx = np.random.default_rng(i).integers(0, N, 32)
                np.testing.assert_array_equal(s.read_batch(idx)["label"], idx)
        except Exception as exc:  # noqa: BLE001 - collected and re-raised below
            errs.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs, errs[:3]


def test_second_ingest_into_the_same_destination_is_refused(tmp_path):
    src = make_source(str(tmp_path / "src"), n_per_class=2)
    dest = str(tmp_path / "d")
    fd = acquire_lock(dest)  # a live ingest holds the lock
    try:
        p = killable_cli(["ingest", src, dest, "--size", "16x16", "--workers", "0"])
        _, err = p.communicate()
        assert p.returncode != 0 and b"another process" in err, err
        assert not os.path.exists(dest)
    finally:
        os.close(fd)
    p = killable_cli(["ingest", src, dest, "--size", "16x16", "--workers", "0", "--quiet"])
    p.communicate()
    assert p.returncode == 0 and len(mmstore.open(dest)) == 4
