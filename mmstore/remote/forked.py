"""Reads from S3 in a process forked after the client was used.

NOTE [a client per process]: obstore runs the requests of a process on one
runtime (threads and a connection pool) made at its first request. A
process forked after that (a DataLoader worker under the default ``fork``)
inherits the runtime's memory but not its threads: any request there, even
through a new client, waits for ever. So :class:`mmstore.remote.client.Remote`
notes the pid of the process whose requests made the runtime, and a forked
child reads through this module instead: plain HTTP(S) range GETs from the
standard library, signed with AWS Signature Version 4, with the same
retries (backoff with jitter on 5xx, resets and timeouts) and the same
typed errors. It serves the reads a replica makes (``get`` and
``get_range``); anything else in such a child, and ``gs://`` / ``az://``
stores, raise a typed error that says to start the workers with ``spawn``
or ``forkserver``. Credentials are the static ones of the environment or
the shared files (a role from the instance metadata is not fetched here).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from ..errors import RemoteAccessError, RemoteChangedError, RemoteError, RemoteNotFoundError, RemoteUnavailableError

__all__ = ["ForkedReader"]

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_RETRY_STATUS = (500, 502, 503, 504)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()


class ForkedReader:
    """Signed range GETs of one S3 bucket's objects under ``prefix``."""

    def __init__(self, bucket: str, prefix: str, config: dict[str, Any], *, retries: int, retry_timeout: float,
                 timeout: float, connect_timeout: float, url: str, wait: Callable[[int], float]) -> None:
        key, secret = config.get("access_key_id"), config.get("secret_access_key")
        if not (key and secret):
            raise RemoteError(
                f"{url}: this process was forked after the parent's object-store client ran, and it has no static "
                "credentials to read with (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws): start the "
                "workers with spawn or forkserver (DataLoader(multiprocessing_context='spawn'))")
        self.key, self.secret = str(key), str(secret)
        self.token = config.get("session_token")
        self.region = str(config.get("region") or "us-east-1")
        endpoint = config.get("endpoint")
        self.bucket, self.prefix, self.url = bucket, prefix, url
        if endpoint:  # an S3-compatible server: path-style requests
            parts = urlsplit(str(endpoint))
            self.https = parts.scheme == "https"
            self.host = parts.netloc
            self.base = parts.path.rstrip("/") + "/" + quote(bucket, safe="")
        else:
            self.https = True
            self.host = f"{bucket}.s3.{self.region}.amazonaws.com"
            self.base = ""
        self.max_retries, self.retry_timeout = retries, retry_timeout
        self.timeout, self.connect_timeout = timeout, connect_timeout
        # the reads retried, by kind (NOTE [read retries] in mmstore/remote/client.py)
        self.wait = wait  # seconds before retry k (from 1)
        self.retries = {"throttled": 0, "server_error": 0, "connection": 0, "not_partial": 0}
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.https:
                conn = http.client.HTTPSConnection(self.host, timeout=self.connect_timeout,
                                                   context=ssl.create_default_context())
            else:
                conn = http.client.HTTPConnection(self.host, timeout=self.connect_timeout)
            self._local.conn = conn
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _headers(self, path: str) -> dict[str, str]:
        now = datetime.datetime.now(datetime.timezone.utc)
        amz, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": self.host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz}
        if self.token:
            headers["x-amz-security-token"] = str(self.token)
        names = sorted(headers)
        canonical = "\n".join(["GET", path, "", *(f"{n}:{headers[n]}" for n in names), "",
                               ";".join(names), _EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        k = _hmac(("AWS4" + self.secret).encode(), day)
        for part in (self.region, "s3", "aws4_request"):
            k = _hmac(k, part)
        sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.key}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={sig}")
        return headers

    def get(self, name: str, start: int | None = None, end: int | None = None, etag: str | None = None) -> bytes:
        """Object ``name`` (bytes ``[start, end)`` when given)."""
        return self._get(name, start, end, etag)[0]

    def get_head(self, name: str, n: int) -> tuple[bytes, int]:
        """The first ``n`` bytes of object ``name`` (all of it when it is
        shorter) and its size."""
        return self._get(name, 0, n, None, head=True)

    def _get(self, name: str, start: int | None, end: int | None, etag: str | None,
             head: bool = False) -> tuple[bytes, int]:
        path = self.base + "/" + quote(f"{self.prefix}/{name}", safe="/-_.~")
        where = f"{self.url}/{name}"
        ranged = start is not None and end is not None
        t0 = time.monotonic()
        attempt = 0
        while True:
            headers = self._headers(path)
            if ranged:
                headers["range"] = f"bytes={start}-{end - 1}"  # type: ignore[operator]
            if etag:
                headers["if-match"] = etag
            why = ""
            size = 0
            try:
                conn = self._conn()
                conn.timeout = self.timeout
                conn.request("GET", path, headers=headers)
                resp = conn.getresponse()
                status = resp.status
                if ranged and status == 200:
                    body = b""  # the whole object for a range: its body is not read (it may be any size)
                    self._drop_conn()
                else:
                    body = resp.read()
                    total = (resp.getheader("content-range") or "").rpartition("/")[2]
                    size = int(total) if total.isdigit() else len(body)
                    if resp.getheader("connection", "").lower() == "close":
                        self._drop_conn()
            except (TimeoutError, OSError, http.client.HTTPException) as exc:
                self._drop_conn()
                status, body, why = 0, b"", f"{type(exc).__name__}: {exc}"
            if status == 206 or (status == 200 and not ranged):
                return body, size
            if status == 416 and head:
                return b"", 0  # an empty object has no first byte
            text = body[:300].decode("utf-8", "replace")
            if status == 404:
                raise RemoteNotFoundError(f"{where}: no such object ({text}); check the URL")
            if status in (401, 403):
                raise RemoteAccessError(f"{where}: access denied ({text}); check AWS_ACCESS_KEY_ID / "
                                        "AWS_SECRET_ACCESS_KEY")
            if status == 412:
                raise RemoteChangedError(f"{where}: the object changed since the store was opened (its etag no "
                                         "longer matches): the store was pushed again (open it again), or the "
                                         "object was damaged (`mmstore verify` of the store's URL names what "
                                         "differs, `mmstore push` of a good copy repairs it)")
            attempt += 1
            if (status not in (0, 200, *_RETRY_STATUS) or attempt > self.max_retries
                    or time.monotonic() - t0 > self.retry_timeout):
                if status == 200:
                    why = "the whole object was sent for a range request, every time"
                raise RemoteUnavailableError(
                    f"{where}: could not read it after {attempt} tries ({why or f'HTTP {status}: {text}'}); check "
                    "the endpoint, the network and the server, then run again")
            kind = ("not_partial" if status == 200 else "connection" if status == 0
                    else "throttled" if status == 503 else "server_error")
            self.retries[kind] += 1
            time.sleep(self.wait(attempt))
