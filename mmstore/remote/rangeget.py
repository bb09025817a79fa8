"""Range GETs of S3 objects whose body lands where the caller says, hashed as it arrives.

NOTE [the lean range GET]: a cold epoch from an ``s3://`` URL is bound by the
CPU of its fetch path on a fast link: receive, verify, write into the cache,
read back. obstore hands a range's body over as a buffer of its own, which the
replica then hashes in a second pass and copies into the cache file. Here the
body is received (``recv_into``) a slice at a time into a small buffer of the
fetching thread, each slice is hashed while it is still in the CPU's cache
(each block's ``xxh3_128``, streamed) and handed to the caller's ``land``,
which writes it into the cache file at its place: one pass over the bytes
from the socket to the page cache, and the digests come with it. The caller
marks a block present only once its digest matched (NOTE [block states] in
:mod:`mmstore.remote.replica`).

It speaks HTTP/1.1 over one keep-alive connection per thread (``ssl`` for an
``https://`` endpoint), signs with AWS Signature Version 4 (static keys,
with a session token when one is set), and sends ``Range`` and ``If-Match``.
An answer is checked before a byte of its body is kept: ``206`` with the
``Content-Range`` and ``Content-Length`` asked for; a ``200`` for a range is
refused unread. Each attempt raises exceptions that
:func:`mmstore.remote.client.retry_kind` and
:func:`mmstore.remote.client.translate` classify as they do obstore's, so
:class:`~mmstore.remote.client.Remote` retries, counts and types them alike
(NOTE [read retries] there). One attempt may take ``timeout`` seconds in
all (a body dripped slowly is cut there), a connection ``connect_timeout``.
:meth:`LeanS3.abort` cuts the reads in flight (a Ctrl-C never waits for a
held answer). It needs the standard library only, so a process forked from
one that used obstore reads through it too, on connections of its own.

:func:`lean_settings` says whether this path serves a URL: ``s3://`` with
static credentials and no setting it does not implement (see there);
everything else reads through obstore.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import xxhash

__all__ = ["LEAN_ENV", "LeanS3", "NotFoundError", "NotPartialError", "PermissionDeniedError", "PreconditionError",
           "ReadAborted", "ResponseError", "lean_settings"]

LEAN_ENV = "MMSTORE_REMOTE_LEAN"
_OFF = ("0", "false", "no", "off")
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_SLICE = 512 << 10  # received, hashed and landed at a time: stays in the CPU's cache in between
_LOWAT = 128 << 10  # a receive waits for this much of a slice (SO_RCVLOWAT): fewer wake-ups on a slow link
_HEAD_MAX = 64 << 10  # an answer's status line and headers
_ERROR_BODY_MAX = 64 << 10  # what is read of an error answer's body (its message)
# settings of obstore's S3 client this path does not implement: where one is set, obstore reads
_UNSUPPORTED_ENV = ("AWS_SKIP_SIGNATURE", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_REQUEST_PAYER",
                    "AWS_S3_EXPRESS", "AWS_UNSIGNED_PAYLOAD", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE",
                    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


# Exceptions of one attempt, named and worded as obstore's are where retry_kind and translate
# (mmstore.remote.client) classify them: by class name, by "status NNN", by "non-partial".
class NotFoundError(Exception):
    """A ``404`` answer."""


class PermissionDeniedError(Exception):
    """A ``401`` or ``403`` answer."""


class PreconditionError(Exception):
    """A ``412`` answer: the object no longer has the etag asked for."""


class NotPartialError(Exception):
    """A ``200`` answer (the whole object) to a range request."""


class ResponseError(Exception):
    """Any other answer that is not the range asked for (``status NNN`` in the message)."""


class ReadAborted(BaseException):
    """A read cut by :meth:`LeanS3.abort` (a Ctrl-C in the thread that waited
    for it): a BaseException, so that no retry loop asks again."""


def lean_settings(scheme: str, bucket: str, config: dict[str, Any]) -> str | None:
    """Why the lean path cannot read this URL with obstore's settings
    ``config`` (from :func:`mmstore.remote.client.Remote`'s S3 settings), or
    None when it can. It reads ``s3://`` with the static keys (and session
    token) of the environment or the shared AWS files, at the default AWS
    endpoint or an ``AWS_ENDPOINT_URL`` one (path-style); ``MMSTORE_REMOTE_LEAN=0``
    turns it off."""
    env = os.environ
    if env.get(LEAN_ENV, "").strip().lower() in _OFF:
        return f"{LEAN_ENV} is off"
    if scheme != "s3":
        return f"{scheme}:// is read by obstore"
    if not (config.get("access_key_id") and config.get("secret_access_key")):
        return "no static credentials (instance metadata, web identity and the like are obstore's)"
    for name in _UNSUPPORTED_ENV:
        if env.get(name, "").strip():
            return f"{name} is set"
    endpoint = config.get("endpoint")
    if endpoint:
        parts = urlsplit(str(endpoint))
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            return f"endpoint {endpoint!r} is not a plain http(s) URL"
    elif "." in bucket:
        return "a bucket name with dots (virtual-hosted style over TLS)"
    return None


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()


def _close(sock: socket.socket, pid: int) -> None:
    if pid == os.getpid():  # a forked child's copy of the parent's connection is the parent's
        try:
            sock.close()
        except OSError:
            pass


class _Conn:
    __slots__ = ("sock", "pid", "used", "aborted", "__weakref__")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.used = False
        self.aborted = False
        # when the thread that kept it alive ends (or its reader goes), the connection goes with it
        weakref.finalize(self, _close, sock, self.pid)


class LeanS3:
    """Signed range GETs of the objects under ``prefix`` of one S3 bucket,
    received into the caller's place (NOTE [the lean range GET])."""

    def __init__(self, bucket: str, prefix: str, config: dict[str, Any], *, timeout: float,
                 connect_timeout: float) -> None:
        self.key = str(config["access_key_id"])
        self.secret = str(config["secret_access_key"])
        token = config.get("session_token")
        self.token = str(token) if token else None
        self.region = str(config.get("region") or "us-east-1")
        endpoint = config.get("endpoint")
        if endpoint:  # an S3-compatible server, or AWS at an address of its own: path-style
            parts = urlsplit(str(endpoint))
            self.https = parts.scheme == "https"
            self.hostname = str(parts.hostname)
            self.port = parts.port or (443 if self.https else 80)
            self.host = parts.netloc.rpartition("@")[2]
            base = parts.path.rstrip("/") + "/" + quote(bucket, safe="")
        else:
            self.https = True
            self.hostname = self.host = f"{bucket}.s3.{self.region}.amazonaws.com"
            self.port = 443
            base = ""
        self.base = base + "/" + (quote(prefix.strip("/"), safe="/-_.~") + "/" if prefix.strip("/") else "")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ssl = ssl.create_default_context() if self.https else None
        self._local = threading.local()
        self._signing: tuple[str, bytes] = ("", b"")
        self._busy: set[_Conn] = set()  # connections with a read in flight (abort cuts them)
        self._busy_lock = threading.Lock()

    def abort(self) -> None:
        """Cut every read in flight in this process: each raises
        :class:`ReadAborted` at once (reads started later run as usual)."""
        with self._busy_lock:
            busy = [c for c in self._busy if c.pid == os.getpid()]
        for conn in busy:
            conn.aborted = True
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # a receive waiting on it returns at once
            except OSError:
                pass

    # -- connections --------------------------------------------------------------
    def _conn(self) -> _Conn:
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is not None and conn.pid == os.getpid():
            return conn
        # (a forked child's inherited socket is the parent's: left alone, never used)
        sock = socket.create_connection((self.hostname, self.port), timeout=self.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self.hostname)
        except BaseException:
            sock.close()
            raise
        conn = _Conn(sock)
        self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn: _Conn | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and conn.pid == os.getpid():
            try:
                conn.sock.close()
            except OSError:
                pass

    # -- signing ------------------------------------------------------------------
    def request_bytes(self, name: str, start: int, end: int, etag: str | None = None,
                      now: datetime.datetime | None = None) -> bytes:
        """The signed request for bytes ``[start, end)`` of object ``name``
        (at time ``now``, default the present), as it is sent."""
        return self._request(self.base + quote(name, safe="/-_.~"), start, end, etag, now)

    def _request(self, path: str, start: int, end: int, etag: str | None,
                 now: datetime.datetime | None = None) -> bytes:
        now = now or datetime.datetime.now(datetime.timezone.utc)
        amz, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        signed = {"host": self.host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz}
        if self.token:
            signed["x-amz-security-token"] = self.token
        names = sorted(signed)
        canonical = "\n".join(["GET", path, "", *(f"{n}:{signed[n]}" for n in names), "", ";".join(names),
                               _EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        day_key = self._signing
        if day_key[0] != day:  # the signing key changes once a day
            k = _hmac(("AWS4" + self.secret).encode(), day)
            for part in (self.region, "s3", "aws4_request"):
                k = _hmac(k, part)
            day_key = self._signing = (day, k)
        sig = hmac.new(day_key[1], to_sign.encode(), hashlib.sha256).hexdigest()
        lines = [f"GET {path} HTTP/1.1", *(f"{n}: {signed[n]}" for n in names),
                 f"authorization: AWS4-HMAC-SHA256 Credential={self.key}/{scope}, "
                 f"SignedHeaders={';'.join(names)}, Signature={sig}",
                 f"range: bytes={start}-{end - 1}", "accept-encoding: identity", "user-agent: mmstore"]
        if etag:
            lines.append(f"if-match: {etag}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    # -- one attempt --------------------------------------------------------------
    def get_into(self, name: str, start: int, end: int, etag: str | None, block: int,
                 land: Callable[[memoryview, int], None]) -> tuple[int, list[bytes]]:
        """One range GET of bytes ``[start, end)`` of object ``name`` (of
        version ``etag`` when given). The body is handed to ``land(piece,
        offset)`` in order (``offset`` from 0, a slice at a time, the view
        valid during the call only) and hashed as it arrives, each ``block``
        bytes from ``start`` (the last may be shorter) by itself (``block``
        0: not hashed, no digests). Returns the body's length (shorter than
        asked when the object is) and the pieces' ``xxh3_128`` digests.
        Raises this module's exceptions for answers that are not the range,
        ``OSError`` (``TimeoutError`` among them) for a connection refused,
        reset, timed out or cut, :class:`ReadAborted` when :meth:`abort` cut it."""
        path = self.base + quote(name, safe="/-_.~")
        request = self._request(path, start, end, etag)
        deadline = time.monotonic() + self.timeout
        for fresh in (False, True):
            conn = self._conn()
            reused = conn.used
            try:
                with self._in_flight(conn, name, start, end):
                    conn.sock.settimeout(self._left(deadline))
                    conn.sock.sendall(request)
                    status, headers, rest = self._head(conn.sock, deadline)
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
                self._drop()
                if reused and not fresh:
                    continue  # a kept-alive connection the server had closed meanwhile: once more on a new one
                raise
            except BaseException:
                self._drop()
                raise
            break
        try:
            with self._in_flight(conn, name, start, end):
                if status == 206:
                    got = self._body(conn, name, start, end, headers, rest, deadline, block, land)
                    conn.used = True
                    if headers.get("connection", "").lower() == "close":
                        self._drop()
                    return got
                if status == 200:
                    raise NotPartialError(f"non-partial answer: status 200 (the whole object) to a request for "
                                          f"bytes {start}-{end - 1} of {name}")
                text = self._error_text(conn.sock, headers, rest, deadline)
            where = f"status {status} for bytes {start}-{end - 1} of {name}: {text}"
            if status == 404:
                raise NotFoundError(where)
            if status in (401, 403):
                raise PermissionDeniedError(where)
            if status == 412:
                raise PreconditionError(where)
            raise ResponseError(where)
        except BaseException:
            self._drop()  # whatever is left of that answer is never read as the next one
            raise

    @contextlib.contextmanager
    def _in_flight(self, conn: _Conn, name: str, start: int, end: int) -> Iterator[None]:
        """``conn`` is cut by :meth:`abort` meanwhile; what it raises then is :class:`ReadAborted`."""
        with self._busy_lock:
            self._busy.add(conn)
        try:
            yield
        except Exception:
            if conn.aborted:
                raise ReadAborted(f"the read of bytes {start}-{end - 1} of {name} was cut (interrupted)") from None
            raise
        finally:
            with self._busy_lock:
                self._busy.discard(conn)
        if conn.aborted:
            raise ReadAborted(f"the read of bytes {start}-{end - 1} of {name} was cut (interrupted)")

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out: the answer took longer than MMSTORE_REMOTE_TIMEOUT allows")
        return left

    def _head(self, sock: socket.socket, deadline: float) -> tuple[int, dict[str, str], bytes]:
        """The status and headers of an answer, and the body bytes received with them."""
        buf = bytearray()
        while True:
            cut = buf.find(b"\r\n\r\n")
            if cut >= 0:
                break
            if len(buf) > _HEAD_MAX:
                raise ConnectionError(f"an answer's head is over {_HEAD_MAX} bytes: not an S3 server's")
            sock.settimeout(self._left(deadline))
            more = sock.recv(65536)
            if not more:
                raise ConnectionResetError("the connection was closed before an answer came")
            buf += more
        lines = bytes(buf[:cut]).decode("latin-1").split("\r\n")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ConnectionError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                headers[k.strip().lower()] = v.strip()
        return int(parts[1]), headers, bytes(buf[cut + 4 :])

    def _error_text(self, sock: socket.socket, headers: dict[str, str], rest: bytes, deadline: float) -> str:
        """The start of an error answer's body (its code and message), read
        up to a bound in a short time."""
        want = headers.get("content-length", "")
        need = min(int(want), _ERROR_BODY_MAX) if want.isdigit() else _ERROR_BODY_MAX
        body = bytearray(rest)
        try:
            short = min(deadline, time.monotonic() + 2.0)
            while len(body) < need and "chunked" not in headers.get("transfer-encoding", ""):
                sock.settimeout(self._left(short))
                more = sock.recv(need - len(body))
                if not more:
                    break
                body += more
        except OSError:
            pass  # the status says what matters
        text = bytes(body[:600]).decode("utf-8", "replace")
        code = _xml_field(text, "Code")
        message = _xml_field(text, "Message")
        return f"{code}: {message}" if code else " ".join(text.split())[:300]

    def _body(self, conn: _Conn, name: str, start: int, end: int, headers: dict[str, str], rest: bytes,
              deadline: float, block: int, land: Callable[[memoryview, int], None]) -> tuple[int, list[bytes]]:
        crange = headers.get("content-range", "")
        length = headers.get("content-length", "")
        unit, _, span = crange.partition(" ")
        first, _, last_total = span.partition("-")
        last = last_total.partition("/")[0]
        if (unit != "bytes" or not first.isdigit() or not last.isdigit() or int(first) != start
                or not length.isdigit() or int(length) != int(last) - int(first) + 1 or int(length) > end - start):
            raise ConnectionError(f"the answer for bytes {start}-{end - 1} of {name} is another range (Content-Range "
                                  f"{crange!r}, Content-Length {length!r})")
        n = int(length)
        sock = conn.sock
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(_SLICE))
        digests: list[bytes] = []
        hasher = xxhash.xxh3_128()
        done = 0  # body bytes landed
        lowat = 1
        in_block = 0
        pending = rest[:n]
        while done < n:
            if pending:
                fill = len(pending)
                buf[:fill] = pending
                pending = b""
            else:
                fill = 0
            want = min(_SLICE, n - done)
            while fill < want:
                low = min(_LOWAT, want - fill)
                if low != lowat:  # wake up for a good part of a slice, not each packet (never past its end)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low)
                    lowat = low
                sock.settimeout(self._left(deadline))
                got = sock.recv_into(buf[fill:want])
                if not got:
                    raise ConnectionResetError(f"the answer was cut after {done + fill:,} of its {n:,} bytes")
                fill += got
            piece = buf[:fill]
            off = 0 if block > 0 else fill
            while off < fill:  # hashed while the slice is in the CPU's cache, each block by itself
                take = min(fill - off, block - in_block)
                hasher.update(piece[off : off + take])
                in_block += take
                off += take
                if in_block == block:
                    digests.append(hasher.digest())
                    hasher.reset()
                    in_block = 0
            land(piece, done)
            done += fill
        if lowat != 1:  # the next answer's head is short: waited for byte by byte again
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        if in_block:
            digests.append(hasher.digest())
        return n, digests


def _xml_field(text: str, tag: str) -> str:
    a = text.find(f"<{tag}>")
    b = text.find(f"</{tag}>", a + 1)
    return text[a + len(tag) + 2 : b].strip()[:200] if a >= 0 and b > a else ""
