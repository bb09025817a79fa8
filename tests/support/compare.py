"""Store comparisons: the same files byte for byte, the same reads through
every public read path."""

from __future__ import annotations

import os

import numpy as np

import mmstore

BOOKKEEPING = ("_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl")


def store_bytes(path) -> dict[str, bytes]:
    """Every file of a store but the manifest (which holds a time and a random id)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name != "manifest.json":
            with open(os.path.join(path, name), "rb") as fh:
                out[name] = fh.read()
    return out


def assert_same_files(a, b) -> None:
    """Stores ``a`` and ``b`` hold the same file names, and every file but the
    manifest has the same bytes."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)), (sorted(os.listdir(a)), sorted(os.listdir(b)))
    fa, fb = store_bytes(a), store_bytes(b)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a} and {b}"


def _assert_same_bookkeeping(a, b) -> None:
    for name in BOOKKEEPING:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        assert os.path.exists(pa) == os.path.exists(pb), name
        if os.path.exists(pa):
            with open(pa, "rb") as fa, open(pb, "rb") as fb:
                assert fa.read() == fb.read(), name


def _assert_same_reads(sa, sb, seed) -> None:
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
    first = "idx" if "idx" in sa.fields else sa.fields[0]
    assert [r[first].tobytes() for r in sa] == [r[first].tobytes() for r in sb]


def assert_reads_same(a, b, seed=0) -> None:
    """Stores ``a`` and ``b`` read identically through every public read path,
    and their bookkeeping files are byte-identical."""
    sa, sb = mmstore.open(a), mmstore.open(b)
    try:
        assert (len(sa), sa.slots, sa.schema, sa.label_names) == (len(sb), sb.slots, sb.schema, sb.label_names)
        _assert_same_bookkeeping(a, b)
        _assert_same_reads(sa, sb, seed)
        assert sa.skipped() == sb.skipped()
        assert np.array_equal(sa.slot_view.checksums(), sb.slot_view.checksums())
    finally:
        sa.close()
        sb.close()
