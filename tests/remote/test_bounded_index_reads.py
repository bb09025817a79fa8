"""Every read of a bucket's index is bounded by what a store of the manifest beside it can have,
before the index's body is received: in ``verify`` of a URL, in a push's comparison of the
store at its URL, and in a Ray write's commit of its parts (real S3 server on loopback, bytes
counted by the fault proxy in front of it)."""

from __future__ import annotations

import json

import pytest
from remote.helpers import BLOCK, image_store

from mmstore.check.verify_remote import verify_remote
from mmstore.errors import RemoteTooLargeError
from mmstore.format.manifest import parse_manifest
from mmstore.remote.index import index_max_bytes
from mmstore.transfer import push

pytest.importorskip("obstore")

_PAD = 4 << 20  # what the padding adds beyond the bound: read whole, the reads could not stay under it
_SLACK = 64 << 10  # the listing's and the small answers' bodies


def _pad_index(s3, prefix: str) -> tuple[int, int]:
    """Pad the index at ``prefix`` past the bound its manifest gives; (the bound, the manifest's bytes)."""
    raw_manifest = s3.server.get_object_raw(s3.bucket, f"{prefix}/manifest.json")
    bound = index_max_bytes(parse_manifest(raw_manifest, prefix), raw_manifest)
    index = json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/_remote.json"))
    index["pad"] = "x" * (bound + _PAD)  # a key readers ignore: read whole, the index parses
    s3.server.put_object_raw(s3.bucket, f"{prefix}/_remote.json", json.dumps(index).encode())
    return bound, len(raw_manifest)


def _read_bytes(proxy, fn):
    """``fn()``: (what it returned or None, what it raised or None, the body bytes the proxy relayed)."""
    proxy.settle()
    before = proxy.body_bytes
    got, exc = None, None
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        exc = e
    proxy.settle()
    return got, exc, proxy.body_bytes - before


def test_verify_reports_a_padded_index_having_read_no_more_than_the_bound(s3_faulty, tmp_path):
    src = image_store(tmp_path / "src.store", n=50)
    prefix = "verify/padded.store"
    url = s3_faulty.url(prefix)
    push(src, url, block_bytes=BLOCK)
    bound, manifest_bytes = _pad_index(s3_faulty, prefix)
    rep, exc, read = _read_bytes(s3_faulty.proxy, lambda: verify_remote(url))
    assert exc is None, exc
    assert not rep.ok and [p.kind for p in rep.problems] == ["index"], rep.problems
    message = rep.problems[0].message
    assert "_remote.json" in message and f"{bound:,}" in message, message  # the object, its limit
    assert read <= manifest_bytes + bound + 1 + _SLACK, (read, bound)


def test_a_push_over_a_padded_index_reads_no_more_than_the_bound_and_repairs_it(s3_faulty, tmp_path):
    src = image_store(tmp_path / "src.store", n=50)
    prefix = "push/padded.store"
    url = s3_faulty.url(prefix)
    push(src, url, block_bytes=BLOCK)
    good = s3_faulty.server.get_object_raw(s3_faulty.bucket, f"{prefix}/_remote.json")
    bound, manifest_bytes = _pad_index(s3_faulty, prefix)
    rep, exc, read = _read_bytes(s3_faulty.proxy, lambda: push(src, url, block_bytes=BLOCK))
    assert exc is None, exc
    # the padded index was never taken for this store's: the store goes up again, with an index of its own
    assert not rep["up_to_date"] and rep["uploaded_bytes"] > 0, rep
    assert read <= manifest_bytes + bound + 1 + _SLACK, (read, bound)
    now = s3_faulty.server.get_object_raw(s3_faulty.bucket, f"{prefix}/_remote.json")
    assert len(now) == len(good) and b'"pad"' not in now
    assert verify_remote(url).ok


def test_a_ray_commit_refuses_a_padded_part_index_before_reading_more_than_the_bound(s3_faulty, tmp_path):
    pytest.importorskip("ray")
    from mmstore.ray.sink import _commit_remote

    src = image_store(tmp_path / "src.store", n=50)
    pid = "000000-0123456789ab"  # a write task's part, as the write names it
    prefix = f"ray/padded.store/parts/{pid}"
    push(src, s3_faulty.url(prefix), block_bytes=BLOCK)
    bound, manifest_bytes = _pad_index(s3_faulty, prefix)
    dest = s3_faulty.url("ray/padded.store")
    _, exc, read = _read_bytes(s3_faulty.proxy, lambda: _commit_remote(dest, [pid], {}, None, False, str(tmp_path)))
    assert isinstance(exc, RemoteTooLargeError), exc
    assert exc.limit == bound and exc.size > bound and "_remote.json" in str(exc)
    assert read <= manifest_bytes + bound + 1 + _SLACK, (read, bound)
