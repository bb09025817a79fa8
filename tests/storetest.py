"""Helpers for tests: small synthetic stores (importable as ``storetest``)."""

from __future__ import annotations

import os

import numpy as np
import mmstore

SMALL_SCHEMA = {"image": ("|u1", (8, 6, 3)), "label": ("<i8", ()), "score": ("<f4", (2,))}


def sample(i: int) -> dict[str, np.ndarray]:
    """Deterministic record i of SMALL_SCHEMA."""
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 256, (8, 6, 3), dtype=np.uint8),
        "label": np.int64(i % 7),
        "score": rng.random(2, dtype=np.float32),
    }


def write_store(path, n, backend="memmap", holes=(), order=None, schema=SMALL_SCHEMA, make=sample, **kw):
    """Write n slots (holes skipped) in ``order`` (default ascending); return path."""
    slots = list(range(n)) if order is None else list(order)
    with mmstore.StoreWriter(path, schema, slots=n, backend=backend, **kw) as w:
        for s in slots:
            if s in holes:
                w.skip(s, f"in/{s:05d}.jpg", f"corrupt: test hole {s}")
            else:
                w.write(s, make(s), key=f"in/{s:05d}.jpg")
    return str(path)


def assert_same_files(a, b):
    na, nb = sorted(os.listdir(a)), sorted(os.listdir(b))
    assert na == nb
    for name in na:
        if name == "manifest.json":
            continue
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name


def drop_dac_override():
    """As root, in a child before exec: drop CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH from the bounding set, so the exec'd process (still
    uid 0) obeys file permissions like a normal user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")


def write_parts(root, n, cuts, backend="memmap", holes=(), schema=SMALL_SCHEMA, make=sample):
    """Write slots [0, n) as consecutive part stores cut at ``cuts`` (each
    part's local slot j holds global record ``lo + j``, with its key and hole
    status), so merging the parts in order must read like
    ``write_store(path, n, holes=holes)``. Returns the part paths."""
    os.makedirs(str(root), exist_ok=True)
    bounds = [0, *sorted(cuts), n]
    paths = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        p = os.path.join(str(root), f"part{k}")
        with mmstore.StoreWriter(p, schema, slots=hi - lo, backend=backend) as w:
            for s in range(lo, hi):
                if s in holes:
                    w.skip(s - lo, f"in/{s:05d}.jpg", f"corrupt: test hole {s}")
                else:
                    w.write(s - lo, make(s), key=f"in/{s:05d}.jpg")
        paths.append(p)
    return paths


BOOKKEEPING = ("_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl")


def assert_reads_same(a, b, seed=0):
    """Stores ``a`` and ``b`` read identically through every public read path,
    and their bookkeeping files are byte-identical."""
    sa, sb = mmstore.open(a), mmstore.open(b)
    try:
        assert (len(sa), sa.slots, sa.schema, sa.label_names) == (len(sb), sb.slots, sb.schema, sb.label_names)
        for name in BOOKKEEPING:
            pa, pb = os.path.join(a, name), os.path.join(b, name)
            assert os.path.exists(pa) == os.path.exists(pb), name
            if os.path.exists(pa):
                with open(pa, "rb") as fa, open(pb, "rb") as fb:
                    assert fa.read() == fb.read(), name
        n = len(sa)
        rng = np.random.default_rng(seed)
        for idx in (np.arange(n), rng.integers(-n, n, 3 * n) if n else np.zeros(0, np.int64), np.arange(n)[::-1]):
            ra, rb = sa.read_batch(idx), sb.read_batch(idx)
            for f in sa.fields:
                assert np.array_equal(ra[f], rb[f]), f
        for i in range(n):
            ra, rb = sa[i], sb[i]
            assert all(np.array_equal(ra[f], rb[f]) for f in sa.fields)
            assert sa.key(i) == sb.key(i)
        for f in sa.fields:
            assert np.array_equal(sa.column(f), sb.column(f))
        assert [r["idx" if "idx" in r else sa.fields[0]].tobytes() for r in sa] == \
            [r["idx" if "idx" in r else sb.fields[0]].tobytes() for r in sb]
        assert sa.skipped() == sb.skipped()
        assert np.array_equal(sa.checksums(), sb.checksums())
    finally:
        sa.close()
        sb.close()
