"""The lean range GET of ``s3://`` stores (mmstore.remote.rangeget): which URLs and settings it
serves (the rest reads through obstore), that the bytes it lands and the digests it computes on
the way are the object's, and that every fault the proxy in front of the real S3 server injects
is retried, counted and typed as on obstore's path, with nothing unverified left in a cache."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import numpy as np
import pytest
from remote.helpers import BLOCK, finish, image_store, python_child, wait_for

import mmstore
from mmstore.errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteChecksumError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from mmstore.remote.client import Remote
from mmstore.remote.index import block_digest
from mmstore.remote.rangeget import LEAN_ENV, lean_settings
from mmstore.transfer import push

pytest.importorskip("obstore")

SIZE = 300_001
DATA = np.random.default_rng(11).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def _put(s3, key: str = "lean/obj.bin", data: bytes = DATA) -> Remote:
    s3.server.put_object_raw(s3.bucket, key, data)
    return Remote(s3.url(key.rpartition("/")[0]))


def _get(remote: Remote, start: int, end: int, block: int = 1 << 16, etag: str | None = None,
         name: str = "obj.bin") -> tuple[bytes, list[bytes]]:
    out = bytearray(end - start)

    def land(piece: memoryview, offset: int) -> None:
        out[offset : offset + len(piece)] = piece

    digests = remote.get_range_into(name, start, end, etag, block, land)
    assert digests is not None, "the lean path does not serve this URL"
    return bytes(out), digests


def _fast_retries(monkeypatch, retries: int = 10, timeout: float = 20) -> None:
    monkeypatch.setenv("MMSTORE_REMOTE_RETRIES", str(retries))
    monkeypatch.setenv("MMSTORE_REMOTE_RETRY_TIMEOUT", str(timeout))


def test_it_serves_s3_with_static_keys_and_leaves_the_rest_to_obstore(s3, monkeypatch, tmp_path):
    url = s3.url("lean/x.store")
    assert Remote(url).lean() is not None
    monkeypatch.setenv(LEAN_ENV, "0")
    assert Remote(url).lean() is None
    monkeypatch.delenv(LEAN_ENV)
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "true")  # unsigned requests: obstore's
    assert Remote(url).lean() is None
    monkeypatch.delenv("AWS_SKIP_SIGNATURE")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:1")  # a proxy: obstore's
    assert Remote(url).lean() is None
    monkeypatch.delenv("HTTPS_PROXY")
    assert lean_settings("s3", "bucket.with.dots", {"access_key_id": "k", "secret_access_key": "s"})
    assert lean_settings("gs", "b", {"access_key_id": "k", "secret_access_key": "s"})
    assert Remote("http://127.0.0.1:1/x.store").lean() is None
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # no static keys: instance metadata is obstore's
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert Remote(url).lean() is None


@pytest.mark.parametrize(("start", "end", "block"), [
    (0, SIZE, 1 << 16),  # blocks of a replica, the last one short
    (7, SIZE, 4099),  # an odd block: block ends fall inside received slices and inside the answer's first bytes
    (100, 70_000, 1 << 20),  # one block longer than the range
    (5, 300, 7),  # many blocks in the bytes that come with the answer's head
])
def test_the_bytes_landed_and_their_digests_are_the_objects(s3, start, end, block):
    remote = _put(s3)
    got, digests = _get(remote, start, end, block)
    want = DATA[start:end]
    assert got == want
    assert digests == [block_digest(want[a : a + block]) for a in range(0, len(want), block)]
    assert _get(remote, start, end, block)[0] == want  # again, on the kept-alive connection
    assert remote.retried()["total"] == 0


@pytest.mark.parametrize(("fault", "kind"), [("slowdown", "throttled"), ("resets", "connection"),
                                             ("cut-bodies", "connection"), ("stalls", "connection"),
                                             ("whole-object", "not_partial"), ("drips", None)])
def test_each_fault_is_ridden_out_with_the_right_bytes_and_counted(s3_faulty, monkeypatch, fault, kind):
    _fast_retries(monkeypatch)
    monkeypatch.setenv("MMSTORE_REMOTE_TIMEOUT", "1")  # a stalled answer is given up after 1 s
    remote = _put(s3_faulty)
    _get(remote, 0, 10)  # the connection is made and kept alive: faults below meet a reused one too
    proxy = s3_faulty.proxy
    path = "obj.bin"
    if fault == "slowdown":
        proxy.fail_next(3, path=path)
    elif fault == "resets":
        proxy.reset_next(2, path=path)
    elif fault == "cut-bodies":
        proxy.cut_next(2, keep=0.5, path=path)
    elif fault == "stalls":
        proxy.cut_next(1, keep=0.3, stall=30, path=path)
    elif fault == "whole-object":
        proxy.whole_next(2, path=path)
    else:
        proxy.drip_next(1, chunk=16 << 10, pause=0.002, path=path)
    t0 = time.monotonic()
    got, digests = _get(remote, 3, SIZE, 1 << 16)
    assert time.monotonic() - t0 < 15
    assert got == DATA[3:]
    assert digests[0] == block_digest(DATA[3 : 3 + (1 << 16)])
    counts = remote.retried()
    assert counts[kind] >= 1 if kind else counts["total"] == 0, counts
    assert counts["total"] == counts.get(kind, 0), counts


def test_whole_objects_every_time_and_a_closed_port_are_typed_errors_in_bounded_time(s3_faulty, monkeypatch):
    _fast_retries(monkeypatch, retries=2, timeout=2)
    monkeypatch.setenv("MMSTORE_REMOTE_CONNECT_TIMEOUT", "1")
    remote = _put(s3_faulty)
    s3_faulty.proxy.whole_next(None, path="obj.bin")
    with pytest.raises(RemoteUnavailableError, match="whole object"):
        _get(remote, 0, 1000)
    assert remote.retried()["not_partial"] == 2
    s3_faulty.proxy.clear()

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens: refused at once
    gone = Remote(s3_faulty.url("lean"))
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match="obj.bin"):
        _get(gone, 0, 1000)
    assert time.monotonic() - t0 < 5
    assert gone.retried()["connection"] >= 1


def test_a_changed_object_a_missing_one_and_wrong_keys_are_typed(s3, monkeypatch):
    remote = _put(s3)
    etag = remote.head("obj.bin")["etag"]
    assert _get(remote, 0, 100, etag=etag)[0] == DATA[:100]
    _put(s3, data=DATA[::-1])  # replaced under the reader
    with pytest.raises(RemoteChangedError, match="obj.bin"):
        _get(remote, 0, 100, etag=etag)
    with pytest.raises(RemoteChangedError, match="shorter"):  # past the end of what is there now
        _get(remote, SIZE - 10, SIZE + 10)
    with pytest.raises(RemoteNotFoundError, match="no-such.bin"):
        _get(remote, 0, 100, name="no-such.bin")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteAccessError):
        _get(Remote(s3.url("lean")), 0, 100)
    assert remote.retried()["total"] == 0  # none of these is asked again


def test_a_failed_write_ends_the_read_unretried_as_it_was_raised(s3):
    remote = _put(s3)
    calls = []

    def land(piece: memoryview, offset: int) -> None:
        calls.append(offset)
        raise OSError(errno.ENOSPC, "no space left")

    with pytest.raises(OSError) as info:
        remote.get_range_into("obj.bin", 0, SIZE, None, 1 << 16, land)
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, RemoteUnavailableError)
    assert calls == [0] and remote.retried()["total"] == 0
    assert _get(remote, 0, 50)[0] == DATA[:50]  # the connection it left is not read as the next answer


def test_a_block_that_fails_its_digest_leaves_no_byte_in_the_cache(s3, tmp_path):
    """The lean path writes a run's bytes into the cache as they arrive, before the digests are
    known: when one block fails twice, the whole run is given back (a hole, read as zeros), never
    left as bytes of absent blocks."""
    src = image_store(tmp_path / "src.store", n=600)
    prefix = "lean/flip.store"
    url = s3.url(prefix)
    push(src, url, block_bytes=BLOCK)
    # one byte flipped in the bucket, the index made to vouch for it (bit rot under an unchanged etag)
    key = f"{prefix}/image.npy"
    data = bytearray(s3.server.get_object_raw(s3.bucket, key))
    data[6 * BLOCK + 10] ^= 0x5A
    s3.server.put_object_raw(s3.bucket, key, bytes(data))
    index = json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/_remote.json"))
    index["files"]["image.npy"]["etag"] = Remote(url).head("image.npy")["etag"]
    s3.server.put_object_raw(s3.bucket, f"{prefix}/_remote.json", json.dumps(index).encode())
    store = mmstore.open(url, cache_dir=tmp_path / "cache")
    try:
        rep = store.replica
        assert rep.remote.lean() is not None
        first = rep.first["image.npy"]
        with pytest.raises(RemoteChecksumError, match="image.npy"):
            rep.acquire(np.arange(first + 2, first + 9))  # one run, block 6 bad
        assert not rep.state[first + 2 : first + 9].any()
        assert rep.describe()["refetched_blocks"] == 1
        with open(os.path.join(rep.store_dir, "image.npy"), "rb") as f:
            f.seek(2 * BLOCK)
            assert not any(f.read(7 * BLOCK)), "bytes of a refused run stay in the cache file"
        assert rep.accounting()["sum"] == rep.accounting()["counted"]
        local = mmstore.open(src)
        good = np.arange(0, 100)  # records in blocks 0-2
        assert np.array_equal(store.read_batch(good)["image"], local.read_batch(good)["image"])
    finally:
        store.close()


@pytest.mark.parametrize("lean", ["1", "0"])
def test_a_store_reads_the_same_on_the_lean_path_and_through_obstore(s3, tmp_path, monkeypatch, lean):
    monkeypatch.setenv(LEAN_ENV, lean)
    src = image_store(tmp_path / "src.store", n=300)
    url = s3.url("lean/same.store")
    push(src, url, block_bytes=BLOCK)
    store = mmstore.open(url, cache_dir=tmp_path / "cache")
    try:
        assert (store.replica.remote.lean() is not None) == (lean == "1")
        idx = np.random.default_rng(3).permutation(len(store))
        local = mmstore.open(src).read_batch(idx)
        got = store.read_batch(idx)
        for k in local:
            assert np.array_equal(got[k], local[k])
        assert store.replica.verify_present() == 0
    finally:
        store.close()


def test_the_signature_is_the_one_botocore_computes_session_token_included(monkeypatch):
    """Signature Version 4 as an independent implementation (botocore's) signs the same request:
    a key that needs escaping, a prefix, a session token (which SeaweedFS, an STS-less server,
    cannot check end to end)."""
    import datetime

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from mmstore.remote.rangeget import LeanS3

    cfg = {"access_key_id": "AKIDEXAMPLE", "secret_access_key": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
           "session_token": "FQoGZXIvYXdzE//token+with/odd=chars", "region": "eu-west-3",
           "endpoint": "https://objects.example.net:9000"}
    lean = LeanS3("my-bucket", "team/data sets/x.store", cfg, timeout=5, connect_timeout=5)
    name = "part 1/image+a.npy"
    sent = lean.request_bytes(name, 0, 100).decode("latin-1").split("\r\n")
    path = sent[0].split()[1]
    assert path == "/my-bucket/team/data%20sets/x.store/part%201/image%2Ba.npy"
    headers = dict(line.split(": ", 1) for line in sent[1:] if line)
    assert headers["x-amz-security-token"] == cfg["session_token"]

    req = AWSRequest(method="GET", url=f"https://objects.example.net:9000{path}",
                     headers={"x-amz-content-sha256": headers["x-amz-content-sha256"],
                              "host": "objects.example.net:9000"})
    S3SigV4Auth(Credentials(cfg["access_key_id"], cfg["secret_access_key"], cfg["session_token"]), "s3",
                "eu-west-3").add_auth(req)
    when = datetime.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(
        tzinfo=datetime.timezone.utc)
    ours = lean.request_bytes(name, 0, 100, now=when).decode("latin-1").split("\r\n")
    ours_auth = dict(line.split(": ", 1) for line in ours[1:] if line)["authorization"]
    assert ours_auth == req.headers["Authorization"]


_READ_ALL = """
import sys, numpy as np, mmstore
store = mmstore.open(sys.argv[1], cache_dir=sys.argv[2])
print("open", flush=True)
store.read_batch(np.arange(len(store)))
"""


def test_ctrl_c_stops_a_reader_whose_range_gets_are_held(s3_faulty, tmp_path):
    """A reader whose block fetches the server holds ends at a Ctrl-C within a second or two:
    the reads in flight are cut, not waited out (obstore's run to their end or their timeout,
    and the interpreter's exit waits for them)."""
    src = image_store(tmp_path / "src.store", n=600)
    url = s3_faulty.url("lean/held.store")
    push(src, url, block_bytes=BLOCK)
    proxy = s3_faulty.proxy
    proc = python_child(_READ_ALL, url, str(tmp_path / "cache"))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
        proxy.set_delay(60.0, method="GET", path=r"/image\.npy$")
        wait_for("a held range GET", lambda: proxy._busy > 0, proc, timeout=30)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = finish(proc, timeout=30)
        took = time.monotonic() - t0
    finally:
        proxy.set_delay(0)
    assert proc.returncode != 0 and b"KeyboardInterrupt" in err, err[-2000:]
    assert b"ReadAborted" not in err, err[-2000:]  # the cut reads are not what the user is told
    assert took < 15.0, (took, err[-2000:])  # the held GETs last 60 s: waiting them out fails this


class _TLSRelay:
    """TLS on a loopback port in front of the plain S3 server (a certificate of its own, made here)."""

    def __init__(self, upstream: str, cert: str, key: str) -> None:
        import socket
        import ssl
        import threading
        from urllib.parse import urlsplit

        up = urlsplit(upstream)
        self.upstream = (str(up.hostname), int(up.port or 80))
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        import socket
        import threading

        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            try:
                tls = self.ctx.wrap_socket(raw, server_side=True)
            except OSError:
                raw.close()
                continue
            plain = socket.create_connection(self.upstream)
            for a, b in ((tls, plain), (plain, tls)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self.threads.append(t)

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_an_https_endpoint_is_read_over_tls_and_its_certificate_checked(s3, tmp_path, monkeypatch):
    import shutil
    import subprocess

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    _put(s3)
    relay = _TLSRelay(s3.server.endpoint, cert, key)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"https://localhost:{relay.port}")
        monkeypatch.setenv("MMSTORE_REMOTE_RETRIES", "0")
        untrusted = Remote(s3.url("lean"))
        assert untrusted.lean() is not None and untrusted.lean().https
        with pytest.raises(RemoteUnavailableError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted: refused
            _get(untrusted, 0, 100)
        monkeypatch.setenv("SSL_CERT_FILE", cert)  # trusted as the system's roots would be
        trusted = Remote(s3.url("lean"))
        got, digests = _get(trusted, 5, SIZE, 1 << 16)
        assert got == DATA[5:] and digests[0] == block_digest(DATA[5 : 5 + (1 << 16)])
        assert _get(trusted, 0, 10)[0] == DATA[:10]  # on the kept-alive TLS connection
    finally:
        relay.close()
