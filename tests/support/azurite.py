"""Azurite, Microsoft's Azure Blob Storage emulator, on a loopback port, for the tests of
``az://`` stores.

The emulator is an npm package pinned in ``tests/support/azurite/package.json`` and
``package-lock.json``; :func:`ensure_azurite` installs exactly that with ``npm ci`` into
``tests/support/azurite/node_modules`` (git-ignored) on first use, under a file lock, and reuses
it afterwards. ``MMSTORE_TEST_AZURITE`` names another ``azurite-blob`` to run instead. A client
reaches the server through the standard Azure environment (:meth:`AzuriteServer.env`):
``AZURE_STORAGE_USE_EMULATOR=true`` and ``AZURITE_BLOB_STORAGE_URL``, the emulator's
well-known account ``devstoreaccount1``; containers are made and deleted with requests signed
with that account's well-known key (Shared Key), since obstore makes none.
"""

from __future__ import annotations

import base64
import datetime
import fcntl
import hashlib
import hmac
import http.client
import os
import shutil
import subprocess

from .emulator import LocalServer

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "azurite")
ACCOUNT = "devstoreaccount1"
# the emulator's published development key (the same in every Azurite): not a secret
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
API_VERSION = "2021-08-06"
_INSTALL_TIMEOUT = 600.0
_START_TIMEOUT = 60.0


class AzuriteError(RuntimeError):
    """Azurite cannot be installed or started; the message says why."""


def _installed_binary() -> str:
    return os.path.join(HERE, "node_modules", ".bin", "azurite-blob")


def ensure_azurite() -> str:
    """The ``azurite-blob`` to run: ``MMSTORE_TEST_AZURITE``, else the pinned one under
    ``tests/support/azurite``, installed with ``npm ci`` first when it is not there.

    Raises
    ------
    AzuriteError
        No node or npm, or the install failed (the message ends with npm's output).
    """
    given = os.environ.get("MMSTORE_TEST_AZURITE")
    if given:
        if not os.access(given, os.X_OK):
            raise AzuriteError(f"MMSTORE_TEST_AZURITE={given!r} is not an executable azurite-blob")
        return given
    binary = _installed_binary()
    if os.access(binary, os.X_OK):
        return binary
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise AzuriteError("Azurite needs Node.js and npm, and " + ("node" if node is None else "npm")
                           + " is not on PATH (install them, or set MMSTORE_TEST_AZURITE to an azurite-blob)")
    with open(os.path.join(HERE, ".install.lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one install at a time (pytest-xdist, two checkouts' runs)
        if os.access(binary, os.X_OK):
            return binary
        log = os.path.join(HERE, "npm-ci.log")
        try:
            with open(log, "wb") as out:
                proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--prefix", HERE],
                                      cwd=HERE, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=_INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AzuriteError(f"`npm ci` of Azurite took over {_INSTALL_TIMEOUT:.0f} s; see {log}") from None
        if proc.returncode != 0 or not os.access(binary, os.X_OK):
            with open(log, "rb") as f:
                tail = f.read()[-1500:].decode("utf-8", "replace")
            raise AzuriteError(f"`npm ci` of Azurite failed (exit {proc.returncode}; is the npm registry "
                               f"reachable?):\n{tail}")
    return binary


def _shared_key(method: str, path: str, query: dict[str, str], headers: dict[str, str]) -> str:
    """The ``Authorization`` of a Shared Key request (the Blob service's rules, path-style URL)."""
    std = ["Content-Encoding", "Content-Language", "Content-Length", "Content-MD5", "Content-Type", "Date",
           "If-Modified-Since", "If-Match", "If-None-Match", "If-Unmodified-Since", "Range"]
    lower = {k.lower(): v for k, v in headers.items()}
    fields = [lower.get(k.lower(), "") for k in std]
    if fields[2] == "0":
        fields[2] = ""  # a zero Content-Length is signed as empty
    ms = "".join(f"{k}:{lower[k].strip()}\n" for k in sorted(lower) if k.startswith("x-ms-"))
    resource = f"/{ACCOUNT}{path}" + "".join(f"\n{k.lower()}:{query[k]}" for k in sorted(query))
    text = "\n".join([method, *fields]) + "\n" + ms + resource
    sig = hmac.new(base64.b64decode(ACCOUNT_KEY), text.encode("utf-8"), hashlib.sha256).digest()
    return f"SharedKey {ACCOUNT}:{base64.b64encode(sig).decode()}"


class AzuriteServer(LocalServer):
    """``azurite-blob`` on a free loopback port, its data under ``root``."""

    name = "Azurite"
    error = AzuriteError
    poll_s = 0.1

    def __init__(self, root: str, binary: str) -> None:
        super().__init__(root, binary, "azurite.out")
        self.data_dir = os.path.join(self.root, "data")
        os.makedirs(self.data_dir, exist_ok=True)

    def command(self) -> list[str]:
        return [self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", self.data_dir,
                "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]

    def answers(self) -> int:
        status, _, _ = self.request("GET", f"/{ACCOUNT}", {"comp": "list"}, timeout=2.0)
        return int(status)

    def start(self, timeout: float = _START_TIMEOUT) -> None:
        """Start it; return once it answers."""
        super().start(timeout)

    # -- clients

    def env(self) -> dict[str, str]:
        """The Azure environment a client needs to reach this emulator."""
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.endpoint}

    def request(self, method: str, path: str, query: dict[str, str] | None = None, body: bytes = b"",
                headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
        """A Shared Key request straight to the emulator; ``path`` starts with ``/devstoreaccount1``."""
        from urllib.parse import quote, urlencode

        query = dict(query or {})
        hdrs = {"x-ms-date": datetime.datetime.now(datetime.timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT"),
                "x-ms-version": API_VERSION, "Content-Length": str(len(body)), **(headers or {})}
        hdrs["Authorization"] = _shared_key(method, path, query, hdrs)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            target = quote(path) + (f"?{urlencode(query)}" if query else "")
            conn.request(method, target, body=body, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def create_container(self, name: str) -> None:
        status, _, body = self.request("PUT", f"/{ACCOUNT}/{name}", {"restype": "container"})
        if status != 201:
            raise AzuriteError(f"create container {name!r}: HTTP {status}: {body[:300]!r}")

    def delete_container(self, name: str) -> None:
        status, _, body = self.request("DELETE", f"/{ACCOUNT}/{name}", {"restype": "container"})
        if status not in (202, 404):
            raise AzuriteError(f"delete container {name!r}: HTTP {status}: {body[:300]!r}")

    def put_blob(self, container: str, name: str, data: bytes) -> None:
        """Write ``data`` at ``name`` as one Put Blob, past any client: for damaging what a store holds."""
        status, _, body = self.request("PUT", f"/{ACCOUNT}/{container}/{name}", body=data,
                                       headers={"x-ms-blob-type": "BlockBlob"})
        if status != 201:
            raise AzuriteError(f"put {container}/{name}: HTTP {status}: {body[:300]!r}")

    def get_blob(self, container: str, name: str) -> bytes:
        status, _, body = self.request("GET", f"/{ACCOUNT}/{container}/{name}")
        if status != 200:
            raise AzuriteError(f"get {container}/{name}: HTTP {status}: {body[:300]!r}")
        return body
