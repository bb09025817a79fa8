"""Fixtures for stores at ``az://``, ``gs://`` and ``http(s)://`` URLs, against real servers on loopback.

* ``azurite_server``: Azurite's blob service (``support.azurite``), started once per test run,
  stopped by its pid, its directory removed; ``az``: a fresh container on it per test, the
  standard Azure environment set to reach it (``AZURE_STORAGE_USE_EMULATOR``,
  ``AZURITE_BLOB_STORAGE_URL``; every other ``AZURE_*`` of the caller's shell removed).
* ``gcs_server``: fake-gcs-server, a Google Cloud Storage emulator (``support.gcs``), started
  once per test run, stopped by its pid; ``gs``: a fresh bucket on it per test, the standard
  Google environment set to reach it (``GOOGLE_SERVICE_ACCOUNT_KEY`` naming its endpoint; every
  other ``GOOGLE_*`` of the caller's shell removed).
* ``web``: a store published over HTTP: a fresh bucket on the S3 test server (``s3``), read back
  through the same SeaweedFS server's filer port, which serves the bucket's objects at
  ``http://127.0.0.1:PORT/buckets/BUCKET/KEY`` with ``Range``, ``HEAD``, ``ETag`` and
  ``If-Match``, as a bucket's public HTTP endpoint does.

Where a server cannot be installed or started the tests that use it are skipped, and the skip
says why; with ``MMSTORE_AZURITE_REQUIRED=1`` (``.ci/run`` sets it where npm is present) Azurite
that cannot start fails the test instead, and with ``MMSTORE_GCS_REQUIRED=1`` (``.ci/run`` sets
it) so does a GCS emulator that cannot start.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from dataclasses import dataclass

import pytest

from support.azurite import AzuriteError, AzuriteServer, ensure_azurite
from support.gcs import GcsError, GcsServer, find_fake_gcs
from support.s3 import Bucket

_containers = itertools.count()


def _unavailable(reason: str, required: str = "MMSTORE_AZURITE_REQUIRED") -> None:
    if os.environ.get(required) == "1":
        pytest.fail(f"{required}=1 and {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory):
    """The Azurite server of this test run."""
    try:
        binary = ensure_azurite()
    except AzuriteError as e:
        _unavailable(f"Azurite cannot be installed: {e}")
    yield from _running(AzuriteServer, binary, str(tmp_path_factory.mktemp("azurite")), AzuriteError, "Azurite",
                        "MMSTORE_AZURITE_REQUIRED")


def _running(cls, binary: str, root: str, error: type[Exception], what: str, required: str):
    """A fixture's server: started (else skipped, or failed where ``required`` is set), then
    stopped by its own pid and its files removed."""
    server = None
    try:
        try:
            server = cls(root, binary)
            server.start()
        except (error, OSError) as e:
            server = None
            _unavailable(f"{what} cannot start: {e}", required)
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Container:
    """A fresh container on the emulator and helpers."""

    server: AzuriteServer
    container: str

    def url(self, path: str = "", scheme: str = "az") -> str:
        """``az://container/path`` (or another of the Azure schemes)."""
        return f"{scheme}://{self.container}/{path.lstrip('/')}"

    def read(self, key: str) -> bytes:
        return self.server.get_blob(self.container, key)

    def write(self, key: str, data: bytes) -> None:
        self.server.put_blob(self.container, key, data)


@pytest.fixture
def az(azurite_server, monkeypatch):
    """A fresh container, the Azure environment set to reach it."""
    name = f"t{next(_containers):04d}-{uuid.uuid4().hex[:10]}"
    azurite_server.create_container(name)
    for key in list(os.environ):
        if key.startswith(("AZURE_", "AZURITE_")):
            monkeypatch.delenv(key)
    for key, value in azurite_server.env().items():
        monkeypatch.setenv(key, value)
    yield Container(azurite_server, name)
    azurite_server.delete_container(name)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The GCS emulator of this test run."""
    try:
        binary = find_fake_gcs()
    except GcsError as e:
        _unavailable(f"no GCS emulator: {e}", "MMSTORE_GCS_REQUIRED")
    yield from _running(GcsServer, binary, str(tmp_path_factory.mktemp("gcs")), GcsError, "the GCS emulator",
                        "MMSTORE_GCS_REQUIRED")


@dataclass
class GcsBucket:
    """A fresh bucket on the GCS emulator and helpers."""

    server: GcsServer
    bucket: str

    def url(self, path: str = "") -> str:
        """``gs://bucket/path``."""
        return f"gs://{self.bucket}/{path.lstrip('/')}"

    def read(self, key: str) -> bytes:
        return self.server.get_object(self.bucket, key)

    def write(self, key: str, data: bytes) -> None:
        self.server.put_object(self.bucket, key, data)

    def place_store(self, path: str, prefix: str, block_bytes: int) -> str:
        """The store at ``path`` put under ``prefix`` as a push leaves it (``GcsServer.place_store``:
        the emulator takes no XML upload, so ``push`` cannot); its URL."""
        self.server.place_store(path, self.bucket, prefix, block_bytes)
        return self.url(prefix)


@pytest.fixture
def gs(gcs_server, monkeypatch):
    """A fresh bucket, the Google environment set to reach it."""
    name = f"t{next(_containers):04d}-{uuid.uuid4().hex[:10]}"
    gcs_server.create_bucket(name)
    for key in list(os.environ):
        if key.startswith("GOOGLE_"):
            monkeypatch.delenv(key)
    for key, value in gcs_server.env().items():
        monkeypatch.setenv(key, value)
    yield GcsBucket(gcs_server, name)
    gcs_server.delete_bucket(name)


@dataclass
class Web:
    """A bucket of the S3 test server (``s3``, to push to and to damage objects through) and
    the HTTP address its objects are served at."""

    s3: Bucket
    root: str

    def url(self, path: str = "") -> str:
        """``http://127.0.0.1:FILER/buckets/BUCKET/path``: what ``s3.url(path)`` holds, over HTTP."""
        return f"{self.root}/{path.lstrip('/')}"


@pytest.fixture
def web(s3):
    """A store published over HTTP: push to ``web.s3.url(p)``, read at ``web.url(p)``."""
    port = s3.server.ports["filer"]
    return Web(s3, f"http://127.0.0.1:{port}/buckets/{s3.bucket}")
