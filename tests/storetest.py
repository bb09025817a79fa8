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
