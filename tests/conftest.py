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
