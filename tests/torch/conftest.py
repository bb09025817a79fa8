"""Fixtures for the torch layer: small stores whose records say who they are."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mmstore

SCHEMA = {"image": ("|u1", (12, 10, 3)), "label": ("<i8", ()), "idx": ("<i8", ())}
# a field of >= 2 KiB per record, so the Loader's preadv path is exercised
BIG_SCHEMA = {"image": ("|u1", (24, 32, 3)), "label": ("<i8", ()), "idx": ("<i8", ())}


def record(slot: int, shape=(12, 10, 3)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(slot)
    return {
        "image": rng.integers(0, 256, shape, dtype=np.uint8),
        "label": np.int64(slot % 10),
        "idx": np.int64(slot),
    }


def build(path: str, n: int, backend: str = "memmap", holes=(), schema=SCHEMA) -> str:
    shape = schema["image"][1]
    with mmstore.StoreWriter(path, schema, slots=n, backend=backend) as w:
        for s in range(n):
            if s in holes:
                w.skip(s, f"k{s}", "test hole")
            else:
                w.write(s, record(s, shape), key=f"k{s}")
    return path


def build_merged(path: str, n: int, cuts, backend: str = "memmap", holes=(), schema=SCHEMA) -> str:
    """The store ``build(path, n, ...)`` would write, as a merged (segmented)
    store of parts cut at ``cuts``."""
    from mmstore.ingest import merge

    shape = schema["image"][1]
    bounds = [0, *cuts, n]
    parts = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        p = f"{path}.part{k}"
        with mmstore.StoreWriter(p, schema, slots=hi - lo, backend=backend) as w:
            for s in range(lo, hi):
                if s in holes:
                    w.skip(s - lo, f"k{s}", "test hole")
                else:
                    w.write(s - lo, record(s, shape), key=f"k{s}")
        parts.append(p)
    return merge(parts, path)


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """Paths of a few small stores, built once per session."""
    root = tmp_path_factory.mktemp("torchstores")
    j = lambda n: os.path.join(str(root), n)  # noqa: E731
    return {
        "small": build(j("small"), 203),
        "big": build(j("big"), 301, schema=BIG_SCHEMA),
        "holes": build(j("holes"), 120, holes=(0, 7, 8, 55, 119), schema=BIG_SCHEMA),
        "lmdb": build(j("lmdb"), 150, backend="lmdb", schema=BIG_SCHEMA),
        # merged from parts: reads cross segment boundaries (one part empty)
        "merged": build_merged(j("merged"), 120, [31, 31, 77], holes=(0, 7, 30, 31, 119), schema=BIG_SCHEMA),
        "merged_ref": build(j("merged_ref"), 120, holes=(0, 7, 30, 31, 119), schema=BIG_SCHEMA),
        "merged_lmdb": build_merged(j("merged_lmdb"), 150, [64, 100], backend="lmdb", schema=BIG_SCHEMA),
    }


@pytest.fixture(scope="session")
def build_store():
    """``build`` above, for tests that need stores of their own sizes."""
    return build
