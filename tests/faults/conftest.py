"""Fixtures shared by the fault tests: a small source folder and the store an
uninterrupted ingest makes of it (modules that need other sizes define their own)."""

from __future__ import annotations

import pytest
from support.compare import store_bytes
from support.faults import ingest_argv, run_forked
from support.images import make_source


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_source(str(tmp_path_factory.mktemp("src")), n_per_class=3)


@pytest.fixture(scope="module")
def ref(src, tmp_path_factory):
    """The bytes of every file of the uninterrupted store."""
    dest = str(tmp_path_factory.mktemp("ref") / "s")
    assert run_forked(ingest_argv(src, dest)) == 0
    return store_bytes(dest)
