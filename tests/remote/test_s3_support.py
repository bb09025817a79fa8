"""The S3 test server, the fault proxy and the fixtures, exercised with obstore itself: what the
other remote tests rely on (the environment reaches the bucket, multipart and range reads work,
injected faults reach the client the way the server's own failures would, data survives a
restart, and each kind of wrong request fails in its own way)."""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import threading
import time
from datetime import timedelta

import pytest
from support.s3 import LIMITED, NO_METADATA, UNKNOWN, FaultProxy, sign

obstore = pytest.importorskip("obstore")
from obstore.exceptions import GenericError, PermissionDeniedError  # noqa: E402
from obstore.store import S3Store, from_url  # noqa: E402

FAST = timedelta(milliseconds=5)
NO_RETRY = {"max_retries": 0}


def retries(n: int) -> dict:
    return {"max_retries": n, "backoff": {"init_backoff": FAST, "max_backoff": FAST}}


def get(store, path: str) -> bytes:
    return bytes(obstore.get(store, path).bytes())


def test_the_fixture_environment_reaches_the_bucket(s3, monkeypatch):
    assert s3.url("a/b.bin") == f"s3://{s3.bucket}/a/b.bin" and s3.url() == f"s3://{s3.bucket}/"
    payload = b"written by obstore from the environment alone"
    obstore.put(S3Store(s3.bucket), "a/b.bin", payload)  # endpoint, keys, region, http: all from AWS_*
    assert get(from_url(s3.url()), "a/b.bin") == payload
    assert s3.server.get_object_raw(s3.bucket, "a/b.bin") == payload
    s3.server.put_object_raw(s3.bucket, "odd name+1.bin", b"raw")  # the test's own signer, a key to quote
    assert get(S3Store(s3.bucket), "odd name+1.bin") == b"raw"
    assert sorted(m["path"] for m in obstore.list(S3Store(s3.bucket)).collect()) == ["a/b.bin", "odd name+1.bin"]

    monkeypatch.delenv("AWS_ALLOW_HTTP")  # an http:// endpoint is refused unless the environment allows it
    with pytest.raises(GenericError, match="builder error"):
        get(S3Store(s3.bucket, retry_config=NO_RETRY), "a/b.bin")


def test_multipart_put_and_range_reads_through_the_proxy(s3_faulty):
    data = random.Random(7).randbytes(20 << 20)
    proxy = s3_faulty.proxy
    put = obstore.put(s3_faulty.store(), "big.bin", data, use_multipart=True, chunk_size=5 << 20, max_concurrency=4)
    assert put["e_tag"] is not None and put["e_tag"].endswith('-4"')  # assembled from 4 parts
    calls = sorted((e.method, e.target.split("?", 1)[1].split("=", 1)[0]) for e in proxy.events)
    assert calls == [("POST", "uploadId"), ("POST", "uploads"), *[("PUT", "partNumber")] * 4]
    assert proxy.forwarded == proxy.requests == 6 and proxy.faults == proxy.resets == 0

    assert obstore.head(s3_faulty.store(), "big.bin")["size"] == len(data)  # a HEAD: a length, no body
    direct = s3_faulty.store(endpoint=s3_faulty.server.endpoint)
    assert get(direct, "big.bin") == data
    starts = [0, 5 << 20, (5 << 20) - 3, len(data) - 7]
    ends = [10, (5 << 20) + 4096, (5 << 20) + 3, len(data)]
    got = obstore.get_ranges(s3_faulty.store(), "big.bin", starts=starts, ends=ends)
    assert [bytes(g) for g in got] == [data[a:b] for a, b in zip(starts, ends)]
    assert bytes(obstore.get_range(s3_faulty.store(), "big.bin", start=123_456, length=1000)) == data[123_456:124_456]


def test_503_is_seen_without_retries_and_survived_with_them(s3_faulty):
    proxy = s3_faulty.proxy
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "small", b"abc")

    proxy.fail_next(1, method="GET")
    with pytest.raises(GenericError, match="(?s)503 Service Unavailable.*<Code>SlowDown</Code>"):
        get(s3_faulty.store(retry_config=NO_RETRY), "small")
    assert proxy.faults == 1

    proxy.fail_next(3, method="GET")
    assert get(s3_faulty.store(retry_config=retries(5)), "small") == b"abc"
    assert [e.outcome for e in proxy.events][-4:] == ["fail", "fail", "fail", "forwarded"]
    assert proxy.faults == 4

    proxy.fail_next(100, path="/small$")
    with pytest.raises(GenericError, match="(?s)after 2 retries.*503 Service Unavailable"):
        get(s3_faulty.store(retry_config=retries(2)), "small")
    assert proxy.faults == 7
    proxy.clear()

    proxy.fail_next(2, method="PUT")  # the filter: the GET after it is not failed
    obstore.put(s3_faulty.store(retry_config=retries(5)), "small", b"new")
    assert get(s3_faulty.store(retry_config=NO_RETRY), "small") == b"new"
    assert proxy.faults == 9


def test_the_fail_rate_is_a_seeded_draw_per_request(s3_faulty):
    proxy = s3_faulty.proxy
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "small", b"abc")
    proxy.fail_rate(0.5, seed=3, method="GET")
    store = s3_faulty.store(retry_config=retries(30))
    for _ in range(12):
        assert get(store, "small") == b"abc"
    draws, expected = random.Random(3), []
    while expected.count("forwarded") < 12:
        expected.append("fail" if draws.random() < 0.5 else "forwarded")
    assert [e.outcome for e in proxy.events] == expected
    assert proxy.faults == expected.count("fail") > 0


def test_a_connection_reset_is_seen_without_retries_and_survived_with_them(s3_faulty):
    proxy = s3_faulty.proxy
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "small", b"abc")

    proxy.reset_next(1, method="GET")
    with pytest.raises(GenericError, match="(?s)error sending request.*ConnectionReset"):
        get(s3_faulty.store(retry_config=NO_RETRY), "small")
    assert proxy.resets == 1

    proxy.reset_next(2, method="GET")
    assert get(s3_faulty.store(retry_config=retries(3)), "small") == b"abc"
    proxy.reset_next(2, method="PUT")  # a PUT whose connection dies is sent again
    obstore.put(s3_faulty.store(retry_config=retries(3)), "small", b"new")
    assert get(s3_faulty.store(retry_config=NO_RETRY), "small") == b"new"
    assert proxy.resets == 5


def test_a_delay_longer_than_the_client_timeout_times_out(s3_faulty):
    proxy = s3_faulty.proxy
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "small", b"abc")
    impatient = s3_faulty.store(retry_config=NO_RETRY, client_options={"timeout": "200ms"})
    proxy.set_delay(1.0, method="GET")
    with pytest.raises(GenericError, match="(?s)kind: Timeout.*TimedOut"):
        get(impatient, "small")
    proxy.set_delay(0)
    assert get(impatient, "small") == b"abc"


def test_objects_survive_a_restart_and_a_stopped_server_refuses(s3):
    server = s3.server
    data = random.Random(1).randbytes(100_000)
    obstore.put(S3Store(s3.bucket), "keep.bin", data)
    endpoint = server.endpoint
    server.stop()
    try:
        assert not server.running
        with pytest.raises(GenericError, match="(?s)tcp connect error.*Connection refused"):
            get(S3Store(s3.bucket, retry_config=NO_RETRY), "keep.bin")
    finally:
        server.start()
    assert server.endpoint == endpoint  # what restart() does: the same ports, the same data
    assert get(S3Store(s3.bucket, retry_config=NO_RETRY), "keep.bin") == data


def test_wrong_credentials_and_missing_buckets_and_objects_fail_each_their_way(s3, monkeypatch):
    obstore.put(S3Store(s3.bucket), "obj", b"abc")
    with pytest.raises(PermissionDeniedError, match="(?s)403 Forbidden.*InvalidAccessKeyId"):
        get(s3.store(credentials=UNKNOWN, retry_config=NO_RETRY), "obj")
    with pytest.raises(PermissionDeniedError, match="(?s)403 Forbidden.*<Code>AccessDenied</Code>"):
        get(s3.store(credentials=LIMITED, retry_config=NO_RETRY), "obj")  # a valid key without the right
    with pytest.raises(PermissionDeniedError, match="(?s)403 Forbidden.*<Code>AccessDenied</Code>"):
        obstore.put(s3.store(credentials=LIMITED, retry_config=NO_RETRY), "obj", b"x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch"):
        get(S3Store(s3.bucket, retry_config=NO_RETRY), "obj")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env["AWS_SECRET_ACCESS_KEY"])

    missing = S3Store(s3.bucket + "-missing", retry_config=NO_RETRY)
    with pytest.raises(FileNotFoundError, match="(?s)404 Not Found.*NoSuchBucket"):
        get(missing, "obj")
    with pytest.raises(FileNotFoundError, match="(?s)404 Not Found.*NoSuchBucket"):
        obstore.put(missing, "obj", b"x")  # no bucket made on the fly
    with pytest.raises(GenericError, match="(?s)404 Not Found.*NoSuchBucket"):
        obstore.list(missing).collect()
    with pytest.raises(FileNotFoundError, match="(?s)404 Not Found.*NoSuchKey"):
        get(S3Store(s3.bucket, retry_config=NO_RETRY), "no-such-object")

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(GenericError, match=f"{NO_METADATA}/latest/api/token"):  # asks the metadata service
        get(S3Store(s3.bucket, retry_config=NO_RETRY), "obj")


def _exchange(f, sock: socket.socket, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send one request on ``sock``; read one Content-Length response from ``f``."""
    sock.sendall(head + body)
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, f.read(length)


def test_the_proxy_answers_expect_continue_and_keeps_the_connection(s3_faulty):
    host = s3_faulty.endpoint.split("://", 1)[1]
    path = f"/{s3_faulty.bucket}/expect.bin"
    body = b"x" * 100_000
    target, headers = sign("PUT", host, path, body=body)
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "expect": "100-continue"}.items())
    with socket.create_connection(("127.0.0.1", s3_faulty.proxy.port), timeout=10) as sock, \
            sock.makefile("rb") as f:
        sock.sendall(f"PUT {target} HTTP/1.1\r\n{head}\r\n".encode())
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
        status, _ = _exchange(f, sock, b"", body)
        assert status == 200
        target, headers = sign("GET", host, path)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        assert _exchange(f, sock, f"GET {target} HTTP/1.1\r\n{head}\r\n".encode()) == (200, body)
    assert s3_faulty.server.get_object_raw(s3_faulty.bucket, "expect.bin") == body
    assert s3_faulty.proxy.forwarded == 2


class _Framings(http.server.BaseHTTPRequestHandler):
    """Responses framed every way HTTP/1.1 allows, for the proxy to relay."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")
        elif self.path == "/until-close":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"no length, the end is the close")
            self.close_connection = True
        else:
            self.send_response(204)
            self.end_headers()

    def log_message(self, format, *args):
        pass


def test_the_proxy_relays_chunked_and_close_delimited_responses():
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Framings)
    serving = threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    proxy = FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        try:
            for path, status, body in [("/chunked", 200, b"hello chunked world"), ("/empty", 204, b""),
                                       ("/chunked", 200, b"hello chunked world"),
                                       ("/until-close", 200, b"no length, the end is the close")]:
                conn.request("GET", path)
                resp = conn.getresponse()
                assert (resp.status, resp.read()) == (status, body)
        finally:
            conn.close()
        assert proxy.forwarded == 4
    finally:
        proxy.stop()
        upstream.shutdown()
        upstream.server_close()
        serving.join()


def test_an_answer_cut_mid_body_is_seen_without_retries_and_survived_with_them(s3_faulty):
    proxy = s3_faulty.proxy
    data = random.Random(3).randbytes(300_000)
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "big", data)

    proxy.cut_next(1, method="GET", keep=0.5)
    with pytest.raises(GenericError, match="(?s)body error.*ConnectionReset"):
        get(s3_faulty.store(retry_config=NO_RETRY), "big")
    assert proxy.cuts == 1 and proxy.events[-1].outcome == "cut"

    proxy.cut_next(2, method="GET", keep=0.3)
    assert get(s3_faulty.store(retry_config=retries(3)), "big") == data
    proxy.cut_next(2, method="GET", keep=0.9)
    got = obstore.get_range(s3_faulty.store(retry_config=retries(3)), "big", start=1000, end=250_000)
    assert bytes(got) == data[1000:250_000]
    assert proxy.cuts == 5


def test_an_answer_that_stalls_mid_body_times_out(s3_faulty):
    proxy = s3_faulty.proxy
    data = random.Random(4).randbytes(200_000)
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "big", data)
    impatient = s3_faulty.store(retry_config=NO_RETRY, client_options={"timeout": "500ms"})
    proxy.cut_next(1, method="GET", keep=0.3, stall=5)
    t0 = time.monotonic()
    with pytest.raises(GenericError, match="(?s)body error.*TimedOut"):
        obstore.get_range(impatient, "big", start=0, end=150_000)
    assert time.monotonic() - t0 < 4
    assert bytes(obstore.get_range(impatient, "big", start=0, end=150_000)) == data[:150_000]


def test_storms_fail_that_many_requests_in_a_row_of_every_period(s3_faulty):
    proxy = s3_faulty.proxy
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "small", b"x" * 100)
    proxy.storm(2, 5, method="GET")
    store = s3_faulty.store(retry_config=NO_RETRY)
    outcomes = []
    for _ in range(10):
        try:
            get(store, "small")
            outcomes.append("ok")
        except GenericError as e:
            assert "503" in str(e) and "SlowDown" in str(e)
            outcomes.append("503")
    assert outcomes == ["503", "503", "ok", "ok", "ok"] * 2
    assert proxy.faults == 4


def test_a_range_request_answered_with_the_whole_object_is_a_200_that_obstore_refuses(s3_faulty):
    proxy = s3_faulty.proxy
    data = random.Random(5).randbytes(100_000)
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "big", data)
    proxy.whole_next(1)
    with pytest.raises(GenericError, match="non-partial"):
        obstore.get_range(s3_faulty.store(retry_config=NO_RETRY), "big", start=10, end=20)
    proxy.settle()
    assert proxy.wholes == 1
    # as a client that takes any answer sees it: the whole object, status 200, signed by the proxy
    proxy.whole_next(1)
    host = f"127.0.0.1:{proxy.port}"
    target, headers = sign("GET", host, f"/{s3_faulty.bucket}/big")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("GET", target, headers={**headers, "range": "bytes=0-9"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == data
    finally:
        conn.close()
    proxy.settle()
    assert proxy.wholes == 2 and proxy.events[-1].outcome == "whole"
    assert bytes(obstore.get_range(s3_faulty.store(retry_config=NO_RETRY), "big", start=10, end=20)) == data[10:20]


def test_a_dripped_answer_is_whole_and_slow_and_its_body_bytes_are_counted(s3_faulty):
    proxy = s3_faulty.proxy
    data = random.Random(6).randbytes(40_000)
    obstore.put(s3_faulty.store(endpoint=s3_faulty.server.endpoint), "big", data)
    proxy.settle()
    before = proxy.body_bytes
    proxy.drip_next(1, chunk=1000, pause=0.01)
    t0 = time.monotonic()
    assert get(s3_faulty.store(retry_config=NO_RETRY), "big") == data
    assert time.monotonic() - t0 >= 0.3  # 40 pauses of 10 ms
    proxy.settle()
    assert proxy.drips == 1 and proxy.body_bytes - before == len(data)
