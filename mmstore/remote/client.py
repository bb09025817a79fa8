"""One store's objects in object storage, through obstore.

:class:`Remote` is picklable (it holds the URL only) and makes its client
lazily, once per process, so a DataLoader worker or a torchrun rank started
with spawn makes its own on first use; a process *forked* after its parent
made requests cannot use obstore at all and reads through
:mod:`mmstore.remote.forked` (NOTE [a client per process] there).

Configuration comes from the standard environment, nothing is hard-coded for
one provider. For ``s3://``: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``),
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an S3-compatible server
(an ``http://`` endpoint allows plain HTTP), and where the keys are not in the
environment, the shared files ``~/.aws/credentials`` and ``~/.aws/config``
(``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``, profile ``AWS_PROFILE``);
otherwise obstore's own chain (instance metadata, web identity).

``az://CONTAINER/...`` (also ``azure://``, ``abfs://``, ``abfss://``) reads
obstore's ``AZURE_*`` variables: ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY``, a SAS (``AZURE_STORAGE_SAS_KEY``), a service
principal (``AZURE_CLIENT_ID``, ``AZURE_CLIENT_SECRET``, ``AZURE_TENANT_ID``)
or a managed identity; ``AZURE_STORAGE_ENDPOINT`` for another endpoint (an
``http://`` one allows plain HTTP), and ``AZURE_STORAGE_USE_EMULATOR=true``
for the Azurite emulator (at ``AZURITE_BLOB_STORAGE_URL``, default
``http://127.0.0.1:10000``, account ``devstoreaccount1``).

``gs://BUCKET/...`` reads obstore's ``GOOGLE_*`` variables:
``GOOGLE_SERVICE_ACCOUNT`` (a key file's path), ``GOOGLE_SERVICE_ACCOUNT_KEY``
(its JSON), ``GOOGLE_APPLICATION_CREDENTIALS``, and ``GOOGLE_BASE_URL`` (or a
key file's ``gcs_base_url``) for another endpoint (an ``http://`` one allows
plain HTTP).

``http://`` and ``https://`` name a store published read-only by a web
server or a bucket's public HTTP(S) endpoint: a server that answers ``GET``
with ``Range`` and ``HEAD``, nothing else (no listing, no credentials). The
manifest and ``_remote.json`` name every object, so a reader never lists;
writing (``mmstore push``) is refused with ``RemoteAccessError``: push to
``s3://``, ``gs://`` or ``az://`` and publish that. The etags in
``_remote.json`` are those of the server the store was pushed to, and
another server (a web server serving a copy) has its own: a reader of an
``http(s)://`` store checks its reads against the etag the server itself
gave on the first read of each object in this process (a file replaced
under an open reader is refused), and every block against the push's
digests, as always.

A replica's block reads from ``s3://`` go through the lean range GET of
:mod:`mmstore.remote.rangeget` (:meth:`Remote.get_range_into`): its own
HTTP/1.1 client, which lands the body where the cache wants it and hashes
it on the way, with the same settings, retries and typed errors. It signs
with static keys (the environment's or the shared files', a session token
included); without them (instance metadata, web identity), with a proxy or
an S3 setting of obstore's it does not implement (``AWS_SKIP_SIGNATURE``,
virtual-hosted requests to an endpoint, requester pays, ...), and with
``MMSTORE_REMOTE_LEAN=0``, obstore reads.

Retries: every request is retried on 5xx answers (``503 SlowDown`` among
them), connection errors and timeouts, and a read also on an answer cut in
its body and on a range request answered with the whole object (``200``
instead of ``206``, which a server, proxy or CDN under load may give):
``MMSTORE_REMOTE_RETRIES`` times (default 10) within
``MMSTORE_REMOTE_RETRY_TIMEOUT`` seconds (default 120); one request may take
``MMSTORE_REMOTE_TIMEOUT`` seconds (default 120), a connection
``MMSTORE_REMOTE_CONNECT_TIMEOUT`` (default 10). Then the request fails with
a typed error (``mmstore.errors.RemoteError`` and its kinds) naming the URL
and the object. NOTE [read retries]: reads (``get_range``, ``get_small``,
``head``) are retried here, not inside obstore, so that each retry is
counted (:attr:`Remote.retries`, shown by a replica's ``describe()``) and
the wait is known: before retry ``k`` (from 1) it waits ``min(15, 0.25 *
2 ** (k - 1))`` seconds times a random factor in [0.5, 1], so the default
ten retries ride out an outage of 38-76 s. Writes and listings are retried
by obstore's own loop (the same limits; its waits are shorter).
"""

from __future__ import annotations

import configparser
import json
import os
import random
import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteChecksumError,
    RemoteError,
    RemoteNotFoundError,
    RemoteTooLargeError,
    RemoteUnavailableError,
)
from .index import block_digest
from .url import StoreURL, parse_url

__all__ = ["RETRY_KINDS", "ObjectInfo", "Remote", "client_available", "missing_root", "retry_kind", "retry_wait"]

HTTP_SCHEMES = ("http", "https")
AZURE_SCHEMES = ("az", "azure", "abfs", "abfss")
_TRUE = ("1", "true", "yes", "on")
_KEY_FILE_MAX = 1 << 20  # a service-account key file is a few KiB

# what a retried read met (NOTE [read retries]): a 503 / SlowDown answer, another 5xx answer, a
# connection refused, reset or timed out (or an answer cut in its body), a range request answered
# with the whole object
RETRY_KINDS = ("throttled", "server_error", "connection", "not_partial")
_RETRY_BASE_S, _RETRY_MAX_S = 0.25, 15.0

_INSTALL = "object storage needs the optional client: pip install 'mmstore[remote]' (obstore)"


def client_available() -> bool:
    """obstore can be imported."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def _obstore() -> Any:
    try:
        import obstore
        import obstore.store  # noqa: F401
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return obstore


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number >= 0")
    return value


def _aws_profile_files() -> dict[str, str]:
    """Keys, region and endpoint of the AWS profile in the shared files."""
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    out: dict[str, str] = {}
    creds = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    conf = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    for path, section in ((conf, profile if profile == "default" else f"profile {profile}"), (creds, profile)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError, OSError):
            continue
        if parser.has_section(section):
            for key in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region", "endpoint_url"):
                if parser.has_option(section, key):
                    out[key] = parser.get(section, key).strip()
    return out


def _s3_config() -> tuple[dict[str, Any], bool]:
    """obstore S3 settings from the environment and the shared files; whether HTTP is allowed."""
    env = os.environ
    files = _aws_profile_files()
    cfg: dict[str, Any] = {}
    key = env.get("AWS_ACCESS_KEY_ID") or files.get("aws_access_key_id")
    secret = env.get("AWS_SECRET_ACCESS_KEY") or files.get("aws_secret_access_key")
    if key and secret:
        cfg["access_key_id"], cfg["secret_access_key"] = key, secret
        token = env.get("AWS_SESSION_TOKEN") if env.get("AWS_ACCESS_KEY_ID") else files.get("aws_session_token")
        if token:
            cfg["session_token"] = token
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or files.get("region") or "us-east-1"
    cfg["region"] = region
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or files.get("endpoint_url")
    allow_http = False
    if endpoint:
        cfg["endpoint"] = endpoint.rstrip("/")
        allow_http = endpoint.lower().startswith("http://")
    return cfg, allow_http


def _azure_allow_http() -> bool:
    """The Azure endpoint of the environment is plain HTTP (an emulator's, or
    ``AZURE_STORAGE_ENDPOINT=http://...``)."""
    env = os.environ
    endpoint = (env.get("AZURE_STORAGE_ENDPOINT") or env.get("AZURE_ENDPOINT") or "").strip()
    if endpoint:
        return endpoint.lower().startswith("http://")
    if env.get("AZURE_STORAGE_USE_EMULATOR", "").strip().lower() in _TRUE:
        return (env.get("AZURITE_BLOB_STORAGE_URL") or "http://").strip().lower().startswith("http://")
    return False


def _gcs_base_url() -> str:
    """The GCS endpoint of the environment: ``GOOGLE_BASE_URL``, else the
    ``gcs_base_url`` of the service-account key named there, else ''."""
    env = os.environ
    base = (env.get("GOOGLE_BASE_URL") or "").strip()
    if base:
        return base
    texts: list[str] = []
    if env.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        texts.append(env["GOOGLE_SERVICE_ACCOUNT_KEY"])
    for var in ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_APPLICATION_CREDENTIALS"):
        path = env.get(var)
        if path:
            try:
                with open(path, "rb") as f:
                    texts.append(f.read(_KEY_FILE_MAX).decode("utf-8", "replace"))
            except OSError:
                continue  # obstore says what is wrong with it
    for text in texts:
        try:
            got = json.loads(text)
        except ValueError:
            continue
        if isinstance(got, dict) and isinstance(got.get("gcs_base_url"), str):
            return str(got["gcs_base_url"]).strip()
    return ""


def retry_wait(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (from 1) of a read (NOTE [read retries])."""
    return min(_RETRY_MAX_S, _RETRY_BASE_S * 2 ** min(attempt - 1, 30)) * random.uniform(0.5, 1.0)


def retry_kind(exc: BaseException) -> str | None:
    """Which of :data:`RETRY_KINDS` an obstore error of a read is, or None
    when the read must not be retried (not found, access denied, the object
    changed, a bad request)."""
    text = str(exc)
    low = text.lower()
    name = type(exc).__name__
    if "notpartial" in low or "non-partial" in low:
        return "not_partial"
    if name in ("NotFoundError", "PermissionDeniedError", "UnauthenticatedError", "PreconditionError",
                "NotModifiedError", "InvalidPathError", "NotSupportedError"):
        return None
    status = re.search(r"status(?: code)?:?\s*(\d{3})\b", low)
    if status:
        code = int(status.group(1))
        if code in (429, 503) or "slowdown" in low:
            return "throttled"
        if code >= 500:
            return "server_error"
        return None  # a 4xx answer: asking again gets the same
    if "slowdown" in low:
        return "throttled"
    return "connection"  # no answer: refused, reset, timed out, or cut in its body


# the pid of the process whose requests made obstore's runtime (one per process,
# shared by every client): a process with another pid was forked after it
_RUNTIME_PID = [0]


def _etag(value: Any) -> str | None:
    """An etag in its quoted form, whichever way the request gave it (Azure's
    listing gives them bare, its headers quoted), so that one object's etags
    compare equal."""
    if not value:
        return None
    text = str(value).strip()
    if text.startswith(('"', "W/")):
        return text
    return f'"{text}"'


class _LandFailed(BaseException):
    """Where a lean read's ``land`` failed: past the retries (a BaseException), to
    :meth:`Remote.get_range_into`, which raises what ``land`` raised."""


class ObjectInfo(dict[str, Any]):
    """``{"size": int, "etag": str | None}`` of one object."""


class Remote:
    """The objects of one store URL. Picklable; the client is per process."""

    def __init__(self, url: str | StoreURL) -> None:
        self.loc = url if isinstance(url, StoreURL) else parse_url(url)
        self.url = self.loc.url
        self._lock = threading.Lock()
        self._client: tuple[int, Any] | None = None
        self._reader: tuple[int, Any] | None = None
        self._forked: tuple[int, Any] | None = None
        self._lean: tuple[int, Any] | None = None
        # the reads retried by this process, by kind (NOTE [read retries])
        self.retries: dict[str, int] = dict.fromkeys(RETRY_KINDS, 0)
        # http(s): the etag the server gave on this process's first read of each object
        self._served_etags: dict[str, str | None] = {}

    @property
    def writable(self) -> bool:
        """Objects can be written and deleted here (``http(s)://`` stores are read-only)."""
        return self.loc.scheme not in HTTP_SCHEMES

    def check_writable(self, doing: str = "write") -> None:
        """``RemoteAccessError`` for a store that cannot be written (``http(s)://``)."""
        if not self.writable:
            raise RemoteAccessError(
                f"{self.url}: cannot {doing} a store over {self.loc.scheme}://: an HTTP(S) URL is read-only (a web "
                "server or a bucket's public endpoint cannot be listed or written through it); push the store to "
                "s3://, gs:// or az:// and read it at that bucket's http(s):// address")

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    # -- the client ---------------------------------------------------------
    def client(self) -> Any:
        """This process's client for the store's prefix, made on first use.
        A process forked after its parent made requests reads through
        :mod:`mmstore.remote.forked` instead (NOTE [a client per process]
        there): :meth:`forked` says when."""
        got = self._client
        pid = os.getpid()
        if got is not None and got[0] == pid:
            return got[1]
        with self._lock:
            got = self._client
            if got is None or got[0] != pid:
                _RUNTIME_PID[0] = _RUNTIME_PID[0] or pid
                got = (pid, self._make_client())
                self._client = got
        return got[1]

    def read_client(self) -> Any:
        """This process's client for reads: obstore retries nothing there,
        :meth:`_read` does (NOTE [read retries])."""
        got = self._reader
        pid = os.getpid()
        if got is not None and got[0] == pid:
            return got[1]
        with self._lock:
            got = self._reader
            if got is None or got[0] != pid:
                _RUNTIME_PID[0] = _RUNTIME_PID[0] or pid
                got = (pid, self._make_client(retries=False))
                self._reader = got
        return got[1]

    def retried(self) -> dict[str, int]:
        """The reads this process retried, by kind (:data:`RETRY_KINDS`), and
        their ``total``: what a replica's ``describe()`` shows."""
        counts = dict(self.retries)
        forked = self._forked
        if forked is not None and forked[0] == os.getpid():
            for k, v in forked[1].retries.items():
                counts[k] = counts.get(k, 0) + v
        counts["total"] = sum(counts.values())
        return counts

    def _read(self, name: str, doing: str, call: Any) -> Any:
        """``call()``, a read of object ``name``, retried on what
        :func:`retry_kind` says may pass (NOTE [read retries]); the typed
        error once the retries are spent."""
        most = int(_env_number("MMSTORE_REMOTE_RETRIES", 10))
        budget = _env_number("MMSTORE_REMOTE_RETRY_TIMEOUT", 120)
        t0 = time.monotonic()
        attempt = 0
        while True:
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classified, then retried or translated to a typed error
                kind = retry_kind(exc)
                err = self.error(exc, name, doing)
                if kind is None or not isinstance(err, RemoteUnavailableError):
                    raise err from exc
                attempt += 1
                wait = retry_wait(attempt)
                if attempt > most or time.monotonic() - t0 + wait > budget:
                    if kind == "not_partial":
                        err = RemoteUnavailableError(
                            f"{self.loc.object_url(name) if name else self.url}: could not {_doing_it(doing)}: "
                            f"asked for a range of bytes {attempt} times, the server (or a proxy or CDN in front of "
                            "it) answered with the whole object every time; check the endpoint and whatever stands "
                            "between (a proxy or cache must pass Range requests through), then run again")
                    raise err from exc
                with self._lock:
                    self.retries[kind] += 1
                time.sleep(wait)

    def forked(self) -> Any:
        """The standard-library reader of a process forked after this
        process's parent ran requests through obstore, else None."""
        if not _RUNTIME_PID[0] or _RUNTIME_PID[0] == os.getpid():
            return None
        got = self._forked
        if got is not None and got[0] == os.getpid():
            return got[1]
        with self._lock:
            if self.loc.scheme != "s3":
                raise RemoteError(
                    f"{self.url}: this process was forked after its parent read from object storage, and a "
                    f"{self.loc.scheme}:// store can only be read there by a process of its own: start the "
                    "workers with spawn or forkserver (DataLoader(multiprocessing_context='spawn'))")
            from .forked import ForkedReader

            cfg, _ = _s3_config()
            reader = ForkedReader(
                self.loc.bucket, self.loc.prefix, cfg, url=self.url,
                retries=int(_env_number("MMSTORE_REMOTE_RETRIES", 10)),
                retry_timeout=_env_number("MMSTORE_REMOTE_RETRY_TIMEOUT", 120),
                timeout=_env_number("MMSTORE_REMOTE_TIMEOUT", 120),
                connect_timeout=_env_number("MMSTORE_REMOTE_CONNECT_TIMEOUT", 10), wait=retry_wait)
            self._forked = (os.getpid(), reader)
        return reader

    def _refuse_forked(self, doing: str) -> None:
        if _RUNTIME_PID[0] and _RUNTIME_PID[0] != os.getpid():
            raise RemoteError(f"{self.url}: cannot {doing} from a process forked after its parent used object "
                              "storage (NOTE [a client per process] in mmstore/remote/forked.py): do it in the "
                              "parent, or start this process with spawn or forkserver")

    def _make_client(self, retries: bool = True) -> Any:
        obs = _obstore()
        retry = {
            "max_retries": int(_env_number("MMSTORE_REMOTE_RETRIES", 10)) if retries else 0,
            "retry_timeout": timedelta(seconds=_env_number("MMSTORE_REMOTE_RETRY_TIMEOUT", 120)),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
                        "base": 2},
        }
        options: dict[str, Any] = {
            "timeout": timedelta(seconds=_env_number("MMSTORE_REMOTE_TIMEOUT", 120)),
            "connect_timeout": timedelta(seconds=_env_number("MMSTORE_REMOTE_CONNECT_TIMEOUT", 10)),
        }
        loc = self.loc
        try:
            if loc.scheme == "s3":
                cfg, allow_http = _s3_config()
                if allow_http:
                    options["allow_http"] = True
                return obs.store.S3Store(loc.bucket, prefix=loc.prefix, config=cfg, client_options=options,
                                         retry_config=retry)
            if loc.scheme in HTTP_SCHEMES:
                options["allow_http"] = loc.scheme == "http"
                return obs.store.HTTPStore.from_url(loc.url, client_options=options, retry_config=retry)
            if loc.scheme in AZURE_SCHEMES:
                if _azure_allow_http():
                    options["allow_http"] = True
                return obs.store.from_url(loc.url, client_options=options, retry_config=retry)
            if loc.scheme == "gs":
                base = _gcs_base_url()
                if base.lower().startswith("http://"):
                    options["allow_http"] = True
                # obstore puts a "/" between the endpoint and the bucket: an endpoint written with a
                # trailing "/" would ask for //BUCKET/..., a bucket that is not there
                config = {"base_url": base.rstrip("/")} if base else None
                return obs.store.from_url(loc.url, config=config, client_options=options, retry_config=retry)
            return obs.store.from_url(loc.url, client_options=options, retry_config=retry)
        except Exception as exc:  # noqa: BLE001 - obstore raises its own classes for configuration errors
            raise RemoteError(f"{loc.url}: cannot make an object-store client: {_first_line(exc)}; "
                              f"check the URL and {_HINTS.get(loc.scheme, _HINTS['s3'])['settings']}") from exc

    # -- requests -------------------------------------------------------------
    def error(self, exc: BaseException, name: str, doing: str) -> RemoteError:
        """The typed error for ``exc``, raised by a request about object ``name``."""
        return translate(exc, self.loc.object_url(name) if name else self.url, doing, scheme=self.loc.scheme)

    def get(self, name: str) -> bytes:
        """The whole object ``name``, whatever its size: for what the index
        bounds; an object of untrusted size is read with :meth:`get_small`."""
        forked = self.forked()
        if forked is not None:
            return bytes(forked.get(name))
        obs = _obstore()
        return bytes(self._read(name, "read", lambda: obs.get(self.read_client(), name).bytes()))

    def get_small(self, name: str, limit: int, listed: int | None = None) -> bytes:
        """The whole object ``name``, which may not be larger than ``limit``
        bytes: one range request for its first ``limit + 1`` bytes, so no
        more than that is ever downloaded, whatever the object's size;
        ``RemoteTooLargeError`` (naming the object, its size and the limit)
        when there are more. For ``manifest.json``, ``_remote.json`` and any
        file of a bucket read whole before its size is known. ``listed``:
        the object's size in a listing of the prefix; above ``limit`` it is
        refused with no request at all (it may have grown since the listing:
        the request stays bounded)."""
        if listed is not None and listed > limit:
            raise self._too_large(name, listed, limit)
        forked = self.forked()
        if forked is not None:
            data, size = forked.get_head(name, limit + 1)
        else:
            data, size = self._get_small(name, limit)
        if len(data) > limit or size > limit:
            raise self._too_large(name, max(size, len(data)), limit)
        return bytes(data)

    def _too_large(self, name: str, size: int, limit: int) -> RemoteTooLargeError:
        return RemoteTooLargeError(
            f"{self.loc.object_url(name)}: {size:,} bytes, more than the {limit:,} this file may have (refused "
            "before more than that was downloaded): the store at this URL is damaged or not an mmstore store; push "
            "it again from a good copy, or check the URL", size=size, limit=limit)

    def _get_small(self, name: str, limit: int) -> tuple[Any, int]:
        obs = _obstore()

        def call() -> tuple[Any, int]:
            try:
                res = obs.get(self.read_client(), name, options={"range": (0, limit + 1)})
            except Exception as exc:  # noqa: BLE001 - an empty object has no byte 0: 416
                if _UNSATISFIABLE.search(str(exc).lower()):
                    return b"", 0
                raise
            size = int(res.meta.get("size") or 0)
            if size > limit:
                return b"", size  # its answer's head says enough: no byte of the body is read
            return res.bytes(), size

        return self._read(name, "read", call)

    def get_range(self, name: str, start: int, end: int, etag: str | None = None) -> memoryview:
        """Bytes ``[start, end)`` of object ``name``; with ``etag``, only of
        that version of it (``RemoteChangedError`` when it was replaced)."""
        forked = self.forked()
        if forked is not None:
            got: Any = forked.get(name, start, end, etag)
        else:
            got = self._get_range(name, start, end, etag)
        view = memoryview(got)
        if len(view) != end - start:
            raise self._short(name, start, end, len(view))
        return view

    def get_verified(self, name: str, start: int, end: int, etag: str | None, digest: bytes,
                     tries: int = 2) -> tuple[memoryview, int]:
        """Bytes ``[start, end)`` of object ``name`` whose block digest is
        ``digest`` (the remote index's); fetched up to ``tries`` times while
        they do not match, then ``RemoteChecksumError``. Returns them and how
        many fetches were repeated."""
        for attempt in range(1, max(1, tries) + 1):
            data = self.get_range(name, start, end, etag)
            if block_digest(data) == digest:
                return data, attempt - 1
        raise self.damaged(name, start, end)

    def damaged(self, name: str, start: int, end: int) -> RemoteChecksumError:
        """The error of bytes ``[start, end)`` of object ``name`` that did
        not match their digest on a second fetch either."""
        return RemoteChecksumError(
            f"{self.loc.object_url(name)}: bytes {start}-{end} do not match the digest the push recorded for them "
            "(fetched twice): the object in the bucket is damaged; push the store again from a good copy "
            "(`mmstore verify` the source first)")

    def missing(self, name: str, exc: RemoteNotFoundError) -> RemoteNotFoundError:
        """The error of object ``name``, which the store's index lists, not
        found in the bucket (``exc``); a missing bucket stays as it was."""
        if _names_missing_root(exc):
            return exc
        return RemoteNotFoundError(
            f"{self.loc.object_url(name)}: not in the bucket, though the store's index lists it: the store at "
            f"{self.url} was deleted, or damaged by something else, after it was pushed (`mmstore verify "
            f"{self.url}` names every object that differs; `mmstore push` of a good copy to that URL uploads "
            "them again; then open it again)")

    def lean(self) -> Any:
        """This process's lean range reader (NOTE [the lean range GET] in
        :mod:`mmstore.remote.rangeget`), or None where it does not serve this
        URL (another scheme, credentials it cannot sign with,
        ``MMSTORE_REMOTE_LEAN=0``): :meth:`get_range_into` says so."""
        got = self._lean
        pid = os.getpid()
        if got is not None and got[0] == pid:
            return got[1]
        with self._lock:
            got = self._lean
            if got is None or got[0] != pid:
                from .rangeget import LeanS3, lean_settings

                reader = None
                if self.loc.scheme == "s3":
                    cfg, _ = _s3_config()
                    if lean_settings(self.loc.scheme, self.loc.bucket, cfg) is None:
                        reader = LeanS3(self.loc.bucket, self.loc.prefix, cfg,
                                        timeout=_env_number("MMSTORE_REMOTE_TIMEOUT", 120),
                                        connect_timeout=_env_number("MMSTORE_REMOTE_CONNECT_TIMEOUT", 10))
                got = (pid, reader)
                self._lean = got
        return got[1]

    def abort_reads(self) -> bool:
        """Cut the lean reads this process has in flight (a Ctrl-C: never
        wait for a held answer); each ends with
        :class:`mmstore.remote.rangeget.ReadAborted`, unretried. Whether
        this process reads through the lean path (obstore's reads run to
        their end or their timeout)."""
        got = self._lean
        if got is not None and got[0] == os.getpid() and got[1] is not None:
            got[1].abort()
            return True
        return False

    def get_range_into(self, name: str, start: int, end: int, etag: str | None, block: int,
                       land: Any) -> list[bytes] | None:
        """Bytes ``[start, end)`` of object ``name`` (of version ``etag``)
        through the lean reader, handed to ``land(piece, offset)`` as they
        arrive (NOTE [the lean range GET]), retried as any read (NOTE [read
        retries]; a retry lands them again from offset 0); the ``xxh3_128``
        digests of each ``block`` bytes of them. None, having asked nothing,
        where the lean reader does not serve this URL (read with
        :meth:`get_range`). An exception of ``land`` ends the read at once,
        unretried."""
        lean = self.lean()
        if lean is None:
            return None
        landed: list[BaseException] = []

        def guarded(piece: memoryview, offset: int) -> None:
            try:
                land(piece, offset)
            except BaseException as exc:
                landed.append(exc)
                raise _LandFailed from exc

        try:
            n, digests = self._read(name, f"read bytes {start}-{end} of",
                                    lambda: lean.get_into(name, start, end, etag, block, guarded))
        except _LandFailed:
            raise landed[0] from None
        if n != end - start:
            raise self._short(name, start, end, n)
        return list(digests)

    def _short(self, name: str, start: int, end: int, got: int) -> RemoteChangedError:
        return RemoteChangedError(
            f"{self.loc.object_url(name)}: asked for bytes {start}-{end}, got {got}: the object is "
            "shorter than the store's index says: it was pushed again (open the store again), or replaced or "
            "truncated by something else (`mmstore verify` of the store's URL names every object that differs, "
            "`mmstore push` of a good copy to that URL uploads them again)")

    def _get_range(self, name: str, start: int, end: int, etag: str | None) -> Any:
        obs = _obstore()

        def call() -> Any:
            if self.loc.scheme in HTTP_SCHEMES:
                return self._get_served_range(obs, name, start, end)
            if etag:
                return obs.get(self.read_client(), name, options={"range": (start, end), "if_match": etag}).bytes()
            return obs.get_range(self.read_client(), name, start=start, end=end)

        return self._read(name, f"read bytes {start}-{end} of", call)

    def _get_served_range(self, obs: Any, name: str, start: int, end: int) -> Any:
        """A range of an object of an ``http(s)://`` store, under the etag
        the server gave on this process's first read of it (see the module
        doc: the index's etags are the push target's)."""
        known = self._served_etags.get(name)
        options: dict[str, Any] = {"range": (start, end)}
        if known:
            options["if_match"] = known
        res = obs.get(self.read_client(), name, options=options)
        if name not in self._served_etags:
            tag = _etag(res.meta.get("e_tag"))
            # a weak etag never matches If-Match (strong comparison): only the digests check such a server
            self._served_etags.setdefault(name, None if tag is None or tag.startswith("W/") else tag)
        return res.bytes()

    def head(self, name: str) -> ObjectInfo | None:
        """Size and etag of object ``name``, or None when it does not exist."""
        self._refuse_forked("look up objects")
        obs = _obstore()
        try:
            meta = self._read(name, "look up", lambda: obs.head(self.read_client(), name))
        except RemoteNotFoundError:
            return None
        return ObjectInfo(size=int(meta["size"]), etag=_etag(meta.get("e_tag")))

    def list(self) -> dict[str, ObjectInfo]:
        """Every object under the store's prefix: name -> size and etag.
        An ``http(s)://`` server has no listing: nothing is asked, and the
        answer is empty (readers never need one; writing there is refused)."""
        self._refuse_forked("list objects")
        if self.loc.scheme in HTTP_SCHEMES:
            return {}
        obs = _obstore()
        out: dict[str, ObjectInfo] = {}
        try:
            for chunk in obs.list(self.client(), None, chunk_size=1000):
                for meta in chunk:
                    out[str(meta["path"])] = ObjectInfo(size=int(meta["size"]), etag=_etag(meta.get("e_tag")))
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            err = self.error(exc, "", "list")
            if isinstance(err, RemoteNotFoundError) and not _names_missing_root(err):
                return out
            if isinstance(err, RemoteNotFoundError):
                raise missing_root(self.loc) from exc
            raise err from exc
        return out

    def put(self, name: str, data: Any, *, size: int | None = None, chunk: int = 16 << 20,
            concurrency: int = 8) -> str | None:
        """Write object ``name`` from bytes or a binary file object (in
        parts of ``chunk`` bytes, ``concurrency`` at a time, when it is larger
        than one part); its new etag."""
        self._refuse_forked("write objects")
        self.check_writable("write objects of")
        obs = _obstore()
        multipart = size is not None and size > chunk
        try:
            got = obs.put(self.client(), name, data, use_multipart=multipart, chunk_size=chunk,
                          max_concurrency=concurrency)
        except Exception as exc:  # noqa: BLE001 - translated to a typed error
            raise self.error(exc, name, "write") from exc
        return _etag(got.get("e_tag")) if isinstance(got, dict) else None

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects ``names`` (absent ones are fine)."""
        self._refuse_forked("delete objects")
        self.check_writable("delete objects of")
        obs = _obstore()
        for name in names:
            try:
                obs.delete(self.client(), name)
            except Exception as exc:  # noqa: BLE001 - translated to a typed error
                err = self.error(exc, name, "delete")
                if not isinstance(err, RemoteNotFoundError):
                    raise err from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # obstore's messages nest the causes; the innermost one says most
    useful = [ln for ln in lines if ln.lower().startswith(("source:", "caused by", "error"))]
    head = lines[0] if lines else text
    tail = useful[-1] if useful else ""
    out = head if not tail or tail in head else f"{head} ({tail})"
    return out[:400]


# what to tell the user to check, by scheme: the settings, the credentials, the endpoint, and
# what the top of a URL is called
_S3 = {"settings": "the AWS_* settings", "root": "bucket",
       "credentials": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile in ~/.aws)",
       "endpoint": "the endpoint (AWS_ENDPOINT_URL)",
       "no_credentials": "none in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws, and no instance metadata "
                         "service answered; set them (or AWS_PROFILE), then run again"}
_AZ = {"settings": "the AZURE_* settings (AZURE_STORAGE_ACCOUNT_NAME, ...)", "root": "container",
       "credentials": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY or "
                      "AZURE_CLIENT_ID / AZURE_CLIENT_SECRET / AZURE_TENANT_ID",
       "endpoint": "the endpoint (AZURE_STORAGE_ENDPOINT, or AZURITE_BLOB_STORAGE_URL with "
                   "AZURE_STORAGE_USE_EMULATOR)",
       "no_credentials": "no AZURE_STORAGE_ACCOUNT_KEY, SAS or service principal in the environment, and no "
                         "managed identity answered; set them (AZURE_STORAGE_ACCOUNT_NAME and "
                         "AZURE_STORAGE_ACCOUNT_KEY, say), then run again"}
_GS = {"settings": "the GOOGLE_* settings", "root": "bucket",
       "credentials": "GOOGLE_SERVICE_ACCOUNT / GOOGLE_SERVICE_ACCOUNT_KEY / GOOGLE_APPLICATION_CREDENTIALS",
       "endpoint": "the endpoint (GOOGLE_BASE_URL)",
       "no_credentials": "no GOOGLE_SERVICE_ACCOUNT, GOOGLE_SERVICE_ACCOUNT_KEY or GOOGLE_APPLICATION_CREDENTIALS "
                         "in the environment, and no metadata server answered; set one, then run again"}
_HTTP = {"settings": "that the URL is the store's http(s):// address", "root": "server",
         "credentials": "",
         "endpoint": "the host and port in the URL",
         "no_credentials": "the server refuses to serve these files, and an http(s):// store is read without "
                           "credentials: publish them, or read the store at its s3:// / gs:// / az:// URL"}
_HINTS = {"s3": _S3, "gs": _GS, "http": _HTTP, "https": _HTTP, **{k: _AZ for k in AZURE_SCHEMES}}


# a 416 answer (a range request for an empty object), as obstore's messages give the status: never
# the digits 416 in a port, a bucket name or a request id of another error's message
_UNSATISFIABLE = re.compile(r"range not satisfiable|invalidrange|\(416\b|status(?: code)?:?\s*416\b")

# a 401 or 403 answer, as obstore's messages give the status (not a port or a duration that holds 403)
_DENIED_STATUS = re.compile(r"status(?: code)?:?\s*40[13]\b")


def missing_root(loc: StoreURL) -> RemoteNotFoundError:
    """The error of a URL whose bucket (container) does not exist: one
    sentence for every command that finds it missing."""
    root = _HINTS.get(loc.scheme, _S3)["root"]
    return RemoteNotFoundError(f"{loc.url}: no such {root} {loc.bucket!r}: check the URL")


def _doing_it(doing: str) -> str:
    """``doing`` ("read", "look up", ...) with its object: "read it", "look it up"."""
    verb, _, particle = doing.partition(" ")
    return f"{verb} it {particle}" if particle in ("up", "out", "over") else f"{doing} it"


def _names_missing_root(err: RemoteError) -> bool:
    """``err`` says that the bucket (container) itself is missing."""
    text = str(err)
    return "no such bucket" in text or "no such container" in text


def translate(exc: BaseException, where: str, doing: str, *, scheme: str = "s3") -> RemoteError:
    """The typed mmstore error for an obstore exception about ``where``, a
    URL of scheme ``scheme`` (which settings the message names)."""
    if isinstance(exc, RemoteError):
        return exc
    hints = _HINTS.get(scheme, _S3)
    name = type(exc).__name__
    text = str(exc)
    low = text.lower()
    why = _first_line(exc)
    if name == "PreconditionError" or "precondition" in low or "conditionnotmet" in low \
            or "412" in low.split("status")[-1][:8]:
        return RemoteChangedError(  # type: ignore[return-value]
            f"{where}: the object changed since the store was opened (its etag no longer matches the store's "
            "index): either the store at this URL was pushed again (open it again: it opens as the new one), or "
            "the object was replaced or damaged by something else (`mmstore verify` of the store's URL names "
            "every object that differs, `mmstore push` of a good copy to that URL uploads them again; then open "
            "it again)")
    if ("/latest/api/token" in low or "169.254.169.254" in low or "/latest/meta-data" in low
            or "computemetadata" in low or "/metadata/identity" in low):
        return RemoteAccessError(f"{where}: no credentials: {hints['no_credentials']}")
    if (name in ("NotFoundError",) or "nosuchbucket" in low or "nosuchkey" in low or "not found" in low
            or "containernotfound" in low or "blobnotfound" in low):
        if "containernotfound" in low:
            what = "container"
        elif "nosuchbucket" in low or "specified bucket does not exist" in low or "bucket not found" in low:
            what = "bucket"  # (an object's "Not Found" whose name holds "bucket" is an object's)
        else:
            what = "object"
        return RemoteNotFoundError(f"{where}: no such {what} ({why}); check the URL ({hints['root']}, prefix, "
                                   "store name)")
    if (name in ("PermissionDeniedError", "UnauthenticatedError") or "accessdenied" in low
            or "invalidaccesskeyid" in low or "signaturedoesnotmatch" in low or "forbidden" in low
            or "authorizationfailure" in low or "authenticationfailed" in low
            or _DENIED_STATUS.search(low)):
        if scheme in HTTP_SCHEMES:
            return RemoteAccessError(f"{where}: access denied ({why}); {hints['no_credentials']}")
        return RemoteAccessError(
            f"{where}: access denied ({why}); check {hints['credentials']}, and that they may "
            + doing.split()[0] + f" this {hints['root']}")
    return RemoteUnavailableError(
        f"{where}: could not {_doing_it(doing)} after retries ({why}); check {hints['endpoint']}, the "
        "network and the server, then run again (MMSTORE_REMOTE_RETRIES / MMSTORE_REMOTE_RETRY_TIMEOUT "
        "set how long to keep trying)")
