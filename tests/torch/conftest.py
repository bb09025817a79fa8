"""Fixtures for the torch layer: small stores whose records say who they are
(``support.stores.indexed``: an ``idx`` field holds the record's slot)."""

from __future__ import annotations

import os

import pytest
from support.stores import IDX_BIG_SCHEMA, write_indexed


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """Paths of a few small stores, built once per session."""
    root = tmp_path_factory.mktemp("torchstores")
    j = lambda n: os.path.join(str(root), n)  # noqa: E731
    big = IDX_BIG_SCHEMA
    return {
        "small": write_indexed(j("small"), 203),
        "big": write_indexed(j("big"), 301, schema=big),
        "holes": write_indexed(j("holes"), 120, holes=(0, 7, 8, 55, 119), schema=big),
        "lmdb": write_indexed(j("lmdb"), 150, backend="lmdb", schema=big),
        # merged from parts: reads cross segment boundaries (one part empty)
        "merged": write_indexed(j("merged"), 120, holes=(0, 7, 30, 31, 119), schema=big, cuts=[31, 31, 77]),
        "merged_ref": write_indexed(j("merged_ref"), 120, holes=(0, 7, 30, 31, 119), schema=big),
        "merged_lmdb": write_indexed(j("merged_lmdb"), 150, backend="lmdb", schema=big, cuts=[64, 100]),
    }


@pytest.fixture(scope="session")
def build_store():
    """``write_indexed``, for tests that need stores of their own sizes."""
    return write_indexed
