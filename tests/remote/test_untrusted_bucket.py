"""Someone else's bucket, against a real S3 server (SeaweedFS on loopback): every byte from it is
untrusted. A manifest far over its limit is refused before more than the limit is downloaded; an
index claiming a file of 17 TiB is refused before anything is created; a pull whose partial was
damaged after an interruption repairs itself on the rerun, and a bucket whose index disagrees with
itself fails typed, the same way on every rerun, with advice that repairs it."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
import xxhash
from remote.helpers import BLOCK, image_store, same_files
from support.proc import run_cli

import mmstore
from mmstore.errors import ClaimedSizeError, RemoteChecksumError, RemoteTooLargeError
from mmstore.format.layout import MANIFEST_MAX_BYTES
from mmstore.remote.client import Remote
from mmstore.transfer import pull, push

pytest.importorskip("obstore")

TIB = 1 << 40


def _index(s3, prefix: str) -> dict:
    return json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/_remote.json"))


def _put_index(s3, prefix: str, index: dict) -> None:
    s3.server.put_object_raw(s3.bucket, f"{prefix}/_remote.json", json.dumps(index).encode())


# -- sizes before bytes ------------------------------------------------------------------------


def test_a_200_mb_manifest_is_refused_before_more_than_its_limit_is_downloaded(s3_faulty, tmp_path, capsys,
                                                                              monkeypatch):
    src = image_store(tmp_path / "src.store", n=50)
    prefix = "huge/manifest.store"
    url = s3_faulty.url(prefix)
    push(src, url, block_bytes=BLOCK)
    huge = 200_000_000
    s3_faulty.server.put_object_raw(s3_faulty.bucket, f"{prefix}/manifest.json", b" " * huge)
    proxy = s3_faulty.proxy
    index_bytes = len(s3_faulty.server.get_object_raw(s3_faulty.bucket, f"{prefix}/_remote.json"))
    most = MANIFEST_MAX_BYTES + 1 + index_bytes  # the manifest's limit + 1 (and never more than the index)

    proxy.settle()
    before = proxy.body_bytes
    with pytest.raises(RemoteTooLargeError, match="manifest.json") as info:
        mmstore.open(url, cache_dir=tmp_path / "cache")
    assert info.value.size == huge and info.value.limit == MANIFEST_MAX_BYTES
    assert f"{huge:,}" in str(info.value) and f"{MANIFEST_MAX_BYTES:,}" in str(info.value)
    proxy.settle()
    assert proxy.body_bytes - before <= most, proxy.body_bytes - before

    before = proxy.body_bytes
    dest = tmp_path / "dest.store"
    with pytest.raises(RemoteTooLargeError, match="manifest.json"):
        pull(url, dest)
    proxy.settle()
    assert proxy.body_bytes - before <= most
    assert not os.path.lexists(dest) and not os.path.lexists(f"{dest}.partial")

    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cli-cache"))
    before = proxy.body_bytes
    rc, out, err = run_cli(["inspect", url], capsys)
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1 and "manifest.json" in err, err
    proxy.settle()
    assert proxy.body_bytes - before <= most


def test_a_padded_index_is_refused_after_no_more_than_the_manifest_allows(s3_faulty, tmp_path):
    """An index is read up to the largest a store of the manifest's files can have: a padded index
    from someone else's bucket was read whole up to 1 GiB (and parsed: three times its size in
    memory, in every process that opens the URL)."""
    from mmstore.format.manifest import parse_manifest
    from mmstore.remote.index import index_max_bytes

    src = image_store(tmp_path / "src.store", n=50)
    prefix = "padded/index.store"
    url = s3_faulty.url(prefix)
    push(src, url, block_bytes=BLOCK)
    raw_manifest = s3_faulty.server.get_object_raw(s3_faulty.bucket, f"{prefix}/manifest.json")
    bound = index_max_bytes(parse_manifest(raw_manifest, url), raw_manifest)
    index = _index(s3_faulty, prefix)
    assert len(json.dumps(index, indent=1)) <= bound < 1 << 20  # a real index fits, with little to spare
    index["pad"] = "x" * (bound + (4 << 20))
    _put_index(s3_faulty, prefix, index)
    proxy = s3_faulty.proxy
    most = len(raw_manifest) + bound + 1
    for attempt in (lambda: mmstore.open(url, cache_dir=tmp_path / "cache"), lambda: pull(url, tmp_path / "d")):
        proxy.settle()
        before = proxy.body_bytes
        with pytest.raises(RemoteTooLargeError, match="_remote.json") as info:
            attempt()
        assert info.value.limit == bound
        proxy.settle()
        assert proxy.body_bytes - before <= most, (proxy.body_bytes - before, most)


def test_a_small_object_is_read_with_one_request_for_at_most_its_limit_plus_one_bytes(s3_faulty):
    prefix = "small/objects"
    for name, size in (("empty", 0), ("exact", 1000), ("over", 1001), ("big", 5_000_000)):
        s3_faulty.server.put_object_raw(s3_faulty.bucket, f"{prefix}/{name}", bytes(range(256)) * (size // 256)
                                        + bytes(size % 256))
    remote = Remote(s3_faulty.url(prefix))
    proxy = s3_faulty.proxy
    assert remote.get_small("empty", 1000) == b""
    assert len(remote.get_small("exact", 1000)) == 1000
    for name, size in (("over", 1001), ("big", 5_000_000)):
        proxy.settle()
        before = proxy.body_bytes
        with pytest.raises(RemoteTooLargeError, match=f"{name}: {size:,} bytes, more than the 1,000") as info:
            remote.get_small(name, 1000)
        assert (info.value.size, info.value.limit) == (size, 1000)
        proxy.settle()
        assert proxy.body_bytes - before <= 1001


# -- claimed sizes checked against the schema ----------------------------------------------------


def _claim(s3, src: str, prefix: str, name: str, claimed: int) -> None:
    """Make the bucket's manifest and index agree that ``name`` has ``claimed`` bytes: an index of
    1 GiB blocks (the largest a reader takes, so the digests of a 17 TiB file fit its limit),
    every other file's digests true."""
    manifest = json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/manifest.json"))
    manifest["files"][name] = claimed
    raw_manifest = json.dumps(manifest).encode()
    index = _index(s3, prefix)
    block = 1 << 30
    index["block_bytes"] = block
    for n, e in index["files"].items():
        if n == "manifest.json":
            data = raw_manifest
        elif n == name:
            e["size"] = claimed
            e["blocks"] = base64.b64encode(bytes(16) * -(-claimed // block)).decode()
            continue
        else:
            with open(os.path.join(src, n), "rb") as f:
                data = f.read()
        e["size"] = len(data)
        e["digest"] = xxhash.xxh3_128(data).hexdigest()
        e["blocks"] = base64.b64encode(xxhash.xxh3_128(data).digest() if data else b"").decode()
    s3.server.put_object_raw(s3.bucket, f"{prefix}/manifest.json", raw_manifest)
    _put_index(s3, prefix, index)


def test_an_index_claiming_a_17_tib_file_is_refused_before_anything_is_created(s3, tmp_path, capsys, monkeypatch):
    src = image_store(tmp_path / "src.store", n=50)
    prefix = "claims/huge.store"
    url = s3.url(prefix)
    push(src, url, block_bytes=BLOCK)
    real = os.path.getsize(os.path.join(src, "image.npy"))
    _claim(s3, src, prefix, "image.npy", 17 * TIB)

    cache = tmp_path / "cache"
    with pytest.raises(ClaimedSizeError, match="image.npy") as info:
        mmstore.open(url, cache_dir=cache)
    err = info.value
    assert (err.name, err.claimed, err.expected) == ("image.npy", 17 * TIB, real)
    assert f"{17 * TIB:,}" in str(err) and f"{real:,}" in str(err) and url in str(err)
    made = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert not any(os.path.getsize(p) > 1 << 20 for p in made), made  # no file at the claimed size, sparse or not

    dest = tmp_path / "dest.store"
    with pytest.raises(ClaimedSizeError, match="image.npy"):
        pull(url, dest)
    assert not os.path.lexists(f"{dest}.partial") and not os.path.lexists(dest)
    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cli-cache"))
    rc, out, err_text = run_cli(["inspect", url], capsys)
    assert rc == 1 and len(err_text.strip().splitlines()) == 1 and "image.npy" in err_text, err_text


# -- a pull never gets stuck ---------------------------------------------------------------------


class _Stop(Exception):
    pass


def _interrupted_pull(url: str, dest, after: int) -> None:
    """A pull stopped once ``after`` bytes have arrived (its partial is left for a rerun)."""
    got = [0]

    def progress(n: int) -> None:
        got[0] += n
        if got[0] >= after:
            raise _Stop

    with pytest.raises(_Stop):
        pull(url, dest, jobs=1, progress=progress)


def _done_blocks(partial: str) -> np.ndarray:
    with open(os.path.join(partial, "_pull.blocks"), "rb") as f:
        return np.flatnonzero(np.frombuffer(f.read(), np.uint8))


def test_a_partial_damaged_after_an_interrupted_pull_is_repaired_by_the_rerun(s3, tmp_path):
    src = image_store(tmp_path / "src.store")  # image.npy: 28 blocks of 64 KiB
    url = s3.url("pull/damaged.store")
    push(src, url, block_bytes=BLOCK)
    dest = tmp_path / "dest.store"
    partial = f"{dest}.partial"
    _interrupted_pull(url, dest, 10 * BLOCK)
    assert len(_done_blocks(partial)) >= 10
    # a power loss took pages of blocks marked done: their bytes on disk are not what was fetched
    with open(os.path.join(partial, "image.npy"), "r+b") as f:
        for pos in (2 * BLOCK + 5, 3 * BLOCK + 77):
            f.seek(pos)
            f.write(b"\xff\x00\xff")
    rep = pull(url, dest)
    assert rep["resumed_bytes"] > 0
    same_files(src, str(dest))
    assert not os.path.lexists(partial)


def test_a_partial_left_without_its_block_marks_starts_over(s3, tmp_path):
    src = image_store(tmp_path / "src.store")
    url = s3.url("pull/nomarks.store")
    push(src, url, block_bytes=BLOCK)
    dest = tmp_path / "dest.store"
    partial = f"{dest}.partial"
    _interrupted_pull(url, dest, 5 * BLOCK)
    os.unlink(os.path.join(partial, "_pull.blocks"))  # what an older pull left after a digest mismatch
    rep = pull(url, dest)
    assert rep["resumed_bytes"] == 0 and rep["downloaded_bytes"] > 0
    same_files(src, str(dest))


def test_a_bucket_whose_index_disagrees_with_itself_fails_typed_every_time_and_the_advice_repairs_it(
        s3, tmp_path, capsys):
    src = image_store(tmp_path / "src.store")
    prefix = "pull/disagrees.store"
    url = s3.url(prefix)
    push(src, url, block_bytes=BLOCK)
    index = _index(s3, prefix)
    index["files"]["image.npy"]["digest"] = "0" * 32  # every block digest right, the whole file's wrong
    _put_index(s3, prefix, index)

    dest = tmp_path / "dest.store"
    for _ in range(2):  # a rerun fails the same way: never a bare FileNotFoundError
        with pytest.raises(RemoteChecksumError, match="disagrees with itself") as info:
            pull(url, dest)
        assert "image.npy" in str(info.value) and f"delete {url}/_remote.json" in str(info.value)
    rc, _, err = run_cli(["pull", url, str(dest)], capsys)
    assert rc == 1 and "disagrees with itself" in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.lexists(dest)

    # the advice: delete the index, push again from a good copy, pull again
    status, _, body = s3.server.request("DELETE", f"/{s3.bucket}/{prefix}/_remote.json")
    assert status == 204, body
    push(src, url, block_bytes=BLOCK)
    pull(url, dest)
    same_files(src, str(dest))
