"""A bucket that claims a huge size for a file of entries of any size (a variable-size field's
``.bin``, an LMDB ``records.mdb``), its manifest and index agreeing: the claim is checked against
what the format gives (the offsets file's last offset; at most what the records of an LMDB
file of fixed-size fields can take) before any file is made, and a cache whose files cannot be
made fails typed, naming its directory (real S3 server on loopback)."""

from __future__ import annotations

import base64
import json
import os

import pytest
import xxhash
from support.stores import compact_store, write_store

import mmstore
from mmstore.errors import CacheSetupError, ClaimedSizeError
from mmstore.transfer import push

pytest.importorskip("obstore")

TIB = 1 << 40
BLOCK = 64 << 10


def _claim(s3, src: str, prefix: str, name: str, claimed: int) -> None:
    """The bucket's manifest and index agree that ``name`` has ``claimed`` bytes (an index of
    1 GiB blocks, so the digests of a 17 TiB file are few; every other file's digests true)."""
    manifest = json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/manifest.json"))
    manifest["files"][name] = claimed
    raw_manifest = json.dumps(manifest).encode()
    index = json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/_remote.json"))
    block = 1 << 30
    index["block_bytes"] = block
    for n, e in index["files"].items():
        if n == name:
            e["size"] = claimed
            e["blocks"] = base64.b64encode(bytes(16) * -(-claimed // block)).decode()
            continue
        if n == "manifest.json":
            data = raw_manifest
        else:
            with open(os.path.join(src, n), "rb") as f:
                data = f.read()
        e["size"] = len(data)
        e["digest"] = xxhash.xxh3_128(data).hexdigest()
        e["blocks"] = base64.b64encode(xxhash.xxh3_128(data).digest() if data else b"").decode()
    s3.server.put_object_raw(s3.bucket, f"{prefix}/manifest.json", raw_manifest)
    s3.server.put_object_raw(s3.bucket, f"{prefix}/_remote.json", json.dumps(index).encode())


def _made(cache) -> list[tuple[str, int]]:
    return [(os.path.join(d, f), os.path.getsize(os.path.join(d, f))) for d, _, fs in os.walk(cache) for f in fs]


@pytest.mark.parametrize("kind", ["bin", "lmdb"])
def test_a_huge_claim_for_a_file_of_entries_is_refused_before_anything_is_made(s3, tmp_path, kind):
    src = str(tmp_path / "src.store")
    if kind == "bin":  # an encoded field: image.bin, given exactly by image.offsets.npy
        compact_store(src, 120)
        name = "image.bin"
    else:  # fixed-size fields in LMDB: records.mdb, at most what its records can take
        write_store(src, 300, backend="lmdb")
        name = "records.mdb"
    real = os.path.getsize(os.path.join(src, name))
    prefix = f"claims/{kind}.store"
    url = s3.url(prefix)
    push(src, url, block_bytes=BLOCK)
    _claim(s3, src, prefix, name, 17 * TIB)

    cache = tmp_path / "cache"
    with pytest.raises(ClaimedSizeError, match=name.replace(".", r"\.")) as info:
        mmstore.open(url, cache_dir=cache)
    err = info.value
    assert (err.name, err.claimed) == (name, 17 * TIB)
    assert f"{17 * TIB:,}" in str(err) and url in str(err)
    if kind == "bin":
        assert err.expected == real  # the offsets file's last offset
    else:
        assert real <= err.expected < 1 << 30  # what 300 records of this schema can take
    made = _made(cache)
    assert not any(size > 1 << 20 for _, size in made), made  # nothing at the claimed size, sparse or not


def test_a_cache_whose_files_cannot_be_made_fails_typed_naming_its_directory(s3, tmp_path):
    src = write_store(tmp_path / "src.store", 50)
    url = s3.url("setup/fails.store")
    push(src, url, block_bytes=BLOCK)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    cache = blocker / "cache"  # below a regular file: no directory can be made there
    with pytest.raises(CacheSetupError, match="cannot create the cache") as info:
        mmstore.open(url, cache_dir=cache)
    assert str(cache) in str(info.value) and "cache_dir" in str(info.value)
    assert info.value.errno is not None
    with mmstore.open(url, cache_dir=tmp_path / "cache") as store:  # the advice: another cache_dir
        assert len(store) == 50
