"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(params=["memmap", "lmdb"])
def backend(request):
    return request.param


@pytest.fixture
def store_dir(tmp_path):
    return os.path.join(str(tmp_path), "s.store")


# the S3 server of the object-storage tests (tests/remote, tests/ray), one per test run
from support.s3_fixtures import s3, s3_faulty, s3_server  # noqa: E402, F401
