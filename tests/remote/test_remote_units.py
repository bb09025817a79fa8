"""The parts of object-storage support that need no server: store URLs, cache-limit sizes,
the remote index (every byte of it untrusted), and the byte-range locks and holes the
replica is built on."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore._os.sparse import lock_range, punch_hole, unlock_range
from mmstore.errors import FormatError, VersionError
from mmstore.remote import is_url, local_path, parse_bytes, parse_url
from mmstore.remote.index import BlockHasher, FileEntry, RemoteIndex, block_digest, parse_index


@pytest.mark.parametrize("url", ["s3://b/x.store", "S3://b/p/q", "gs://b/x", "az://c/x", "https://h/x", "http://h/x"])
def test_store_urls_are_urls(url):
    assert is_url(url)


@pytest.mark.parametrize("text", ["train.store", "/data/train.store", "file:///data/train.store", "ftp://h/x", "", 3])
def test_paths_are_not_urls(text):
    assert not is_url(text)


def test_a_file_url_is_a_local_path():
    assert local_path("file:///data/my%20train.store") == "/data/my train.store"
    assert local_path("train.store") == "train.store"


@pytest.mark.parametrize("bad, why", [("s3:///x", "no bucket"), ("s3://bucket", "not the bucket itself"),
                                      ("s3://b/", "not the bucket itself"), ("s3://b/a/../c", "'..'"),
                                      ("s3://b/x?v=1", "no query")])
def test_a_bad_url_says_what_is_wrong(bad, why):
    with pytest.raises(ValueError, match=why.replace(".", r"\.").replace("?", r"\?")):
        parse_url(bad)


def test_a_url_names_its_bucket_and_prefix():
    u = parse_url("s3://my-bucket//datasets/train.store/")
    assert (u.scheme, u.bucket, u.prefix, u.url) == ("s3", "my-bucket", "datasets/train.store",
                                                     "s3://my-bucket/datasets/train.store")
    assert u.object_url("manifest.json") == "s3://my-bucket/datasets/train.store/manifest.json"


@pytest.mark.parametrize("text, n", [("200GB", 200 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("500M", 500 * 10**6),
                                     ("4096", 4096), (" 3 kib ", 3072), (10**9, 10**9), (None, None)])
def test_cache_limits_are_bytes_or_sizes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "lots", "-5GB", "1.5.5G", 0, -1, True, "5XB"])
def test_a_bad_cache_limit_is_refused(bad):
    with pytest.raises(ValueError, match="cache_limit"):
        parse_bytes(bad)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=5000), st.lists(st.integers(1, 900), max_size=8))
def test_block_digests_do_not_depend_on_how_the_bytes_arrive(data, cuts):
    B = 1024
    whole = BlockHasher(B)
    whole.update(data)
    pieces = BlockHasher(B)
    pos = 0
    for c in cuts:
        pieces.update(data[pos : pos + c])
        pos += c
    pieces.update(data[pos:])
    a, b = whole.finish(), pieces.finish()
    assert a == b
    digests = a[1]
    assert len(digests) == 16 * -(-len(data) // B)
    for k in range(len(digests) // 16):
        assert digests[16 * k : 16 * (k + 1)] == block_digest(data[k * B : (k + 1) * B])


def _index() -> RemoteIndex:
    B = 64 << 10
    man = b'{"x": 1}'
    h = BlockHasher(B)
    h.update(man)
    md, mb = h.finish()
    data = os.urandom(3 * B + 5)
    h = BlockHasher(B)
    h.update(data)
    dd, db = h.finish()
    return RemoteIndex("0" * 32, B, {"manifest.json": FileEntry(len(man), md, mb, None),
                                     "image.npy": FileEntry(len(data), dd, db, '"etag-1"')})


def test_the_remote_index_round_trips():
    idx = _index()
    got = parse_index(idx.to_json(), "s3://b/x")
    assert got.files == idx.files and got.block_bytes == idx.block_bytes and got.store_id == idx.store_id
    assert got.identity == parse_index(idx.to_json(), "s3://b/x").identity


@pytest.mark.parametrize("mutate, why", [
    (lambda o: o.update(format="other"), "format"),
    (lambda o: o.update(block_bytes=1000), "block_bytes"),
    (lambda o: o.update(store_id="xyz"), "store_id"),
    (lambda o: o.update(digest="md5"), "digest"),
    (lambda o: o["files"].pop("manifest.json"), "manifest.json"),
    (lambda o: o["files"].update({"../evil": o["files"]["image.npy"]}), "not a store file name"),
    (lambda o: o["files"]["image.npy"].update(size=-1), "size"),
    (lambda o: o["files"]["image.npy"].update(blocks="!!"), "base64"),
    (lambda o: o["files"]["image.npy"].update(blocks=base64.b64encode(b"x" * 16).decode()), "block digests"),
    (lambda o: o["files"]["image.npy"].update(digest="zz"), "digest"),
])
def test_a_damaged_remote_index_is_a_format_error(mutate, why):
    obj = json.loads(_index().to_json())
    mutate(obj)
    with pytest.raises(FormatError, match=why):
        parse_index(json.dumps(obj).encode(), "s3://b/x")


def test_a_newer_remote_index_is_refused():
    obj = json.loads(_index().to_json())
    obj["version"] = [2, 0]
    with pytest.raises(VersionError, match="upgrade"):
        parse_index(json.dumps(obj).encode(), "s3://b/x")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_as_a_remote_index_parse_or_fail_cleanly(raw):
    try:
        parse_index(raw, "s3://b/x")
    except FormatError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_mutated_remote_index_parses_or_fails_cleanly(data):
    raw = bytearray(_index().to_json())
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        parse_index(bytes(raw), "s3://b/x")
    except FormatError:
        pass


def test_range_locks_conflict_between_descriptors_and_convert(tmp_path):
    p = tmp_path / "map"
    p.write_bytes(bytes(16))
    a, b = os.open(p, os.O_RDWR), os.open(p, os.O_RDWR)
    try:
        assert lock_range(a, 3, 2, shared=False, wait=False)
        assert not lock_range(b, 4, 1, shared=True, wait=False)  # another open file: conflicts
        assert lock_range(b, 5, 1, shared=True, wait=False)  # outside the range
        lock_range(a, 3, 2, shared=True, wait=False)  # exclusive -> shared
        assert lock_range(b, 4, 1, shared=True, wait=False)
        assert not lock_range(b, 3, 1, shared=False, wait=False)
        unlock_range(a, 3, 2)
        unlock_range(b, 4, 2)
        assert lock_range(b, 3, 3, shared=False, wait=False)
    finally:
        os.close(a)
        os.close(b)


def test_a_punched_hole_reads_zeros_keeps_the_size_and_frees_the_disk(tmp_path):
    p = tmp_path / "data"
    p.write_bytes(np.full(8 << 20, 7, np.uint8).tobytes())
    fd = os.open(p, os.O_RDWR)
    try:
        before = os.fstat(fd).st_blocks
        if not punch_hole(fd, 0, 4 << 20):
            pytest.skip("this file system cannot punch holes")
        st_ = os.fstat(fd)
        assert st_.st_size == 8 << 20 and st_.st_blocks * 512 <= before * 512 - (4 << 20) + 65536
        assert os.pread(fd, 16, 0) == bytes(16) and os.pread(fd, 1, 4 << 20) == b"\x07"
    finally:
        os.close(fd)


@given(size=st.integers(0, 50 << 40), least=st.sampled_from([5 << 20, 16 << 20, 64 << 20]))
def test_a_part_size_keeps_any_file_within_the_parts_s3_allows(size, least):
    from mmstore.remote.multipart import MAX_PARTS, part_bytes_for

    pb = part_bytes_for(size, least)
    assert pb >= least and -(-size // pb) <= MAX_PARTS
    assert pb == least or pb % (1 << 20) == 0
    assert pb == least or -(-size // (pb - (1 << 20))) > MAX_PARTS  # the least whole MiB that does
