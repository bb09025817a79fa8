"""Stores at ``az://``, ``gs://`` and ``http(s)://`` URLs against real servers on loopback: Azurite's
blob service for ``az://`` (``support.azurite``), fake-gcs-server for ``gs://`` (``support.gcs``),
and for ``http://`` a bucket of the SeaweedFS test server read through its filer's HTTP port, as a
bucket's public endpoint serves it (``support.scheme_fixtures``). The same assertions as the S3
tests make: push then pull is byte-identical, an epoch from the URL equals the local store's batch
for batch, a damaged object is caught and never reaches a batch, a missing store is a one-line
typed error; and an ``http(s)://`` URL reads without ever listing, and refuses writes with a typed
error. The GCS emulator takes no upload of the XML API that obstore's GCS client writes with, so a
``gs://`` store is placed in its bucket as a push leaves it, and everything after the upload (open,
read, pull, a push that finds the store up to date, the checking tools) runs against it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from remote.helpers import assert_same_epoch, batches, push_then_pull, same_files, written_image_store
from support.proc import run_cli
from support.stores import write_store

import mmstore
from mmstore.errors import (
    ChecksumError,
    FormatError,
    RemoteAccessError,
    RemoteChangedError,
    RemoteChecksumError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    StoreExistsError,
)
from mmstore.order import OrderSpec
from mmstore.transfer import pull, push

pytest.importorskip("obstore")

BLOCK = 64 << 10  # small blocks: a small store has many


def _epochs_equal(url: str, path: str, cache, kinds=("sequential", "permutation")) -> None:
    from mmstore.torch import Loader

    remote = mmstore.open(url, cache_dir=cache)
    local = mmstore.open(path)
    try:
        assert len(remote) == len(local) and remote.schema == local.schema and remote.store_id == local.store_id
        for kind in kinds:
            for epoch in (0, 1):
                a, b = Loader(remote, 64, OrderSpec(kind, seed=3)), Loader(local, 64, OrderSpec(kind, seed=3))
                a.set_epoch(epoch)
                b.set_epoch(epoch)
                assert_same_epoch(batches(a), batches(b))
                assert a.describe().remote["url"] == url
        assert remote.replica.complete()
        assert remote.replica.describe()["fetched_blocks"] <= remote.replica.nblocks  # each block once
    finally:
        remote.close()


def _record_of(path: str, field: str, pos: int) -> int:
    """The record whose bytes of ``field`` hold byte ``pos`` of its ``.npy`` file."""
    arr = np.load(os.path.join(path, f"{field}.npy"), mmap_mode="r")
    return (pos - int(arr.offset)) // int(np.prod(arr.shape[1:]) * arr.dtype.itemsize)


def _the_tools_take(url: str, slots: int, tmp_path, monkeypatch, capsys) -> None:
    """``mmstore inspect`` and ``mmstore verify`` of ``url`` (a store of ``slots`` records) succeed,
    through a cache of their own."""
    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cache"))
    rc, out, err = run_cli(["inspect", url, "--json"], capsys)
    assert rc == 0, err
    rc, out, err = run_cli(["verify", url, "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["ok"] and rep["checked_slots"] == slots and rep["path"] == url


def _index_vouching_for_the_damage(bucket, prefix: str, url: str, path: str, bad: int, tmp_path) -> None:
    """The store's index rewritten to vouch for its damaged ``image.npy`` (as bit rot under an
    unchanged etag): the block digests still refuse record ``bad`` (never its bytes), a good
    record reads right, and a pull is refused leaving nothing."""
    from mmstore.remote.client import Remote

    etag = Remote(url).head("image.npy")["etag"]
    index = json.loads(bucket.read(f"{prefix}/_remote.json"))
    index["files"]["image.npy"]["etag"] = etag
    bucket.write(f"{prefix}/_remote.json", json.dumps(index).encode())
    _damage_refused(url, path, _record_of(path, "image", 2 * BLOCK), bad, tmp_path / "vouched", tmp_path)


def _damage_refused(url: str, path: str, good: int, bad: int, cache, tmp_path, tries: int = 1) -> None:
    """Through a cache at ``cache``: record ``good`` of the store at ``url`` reads as the local
    store's at ``path``, record ``bad`` is refused ``tries`` times in a row (fetched again each
    time, never its bytes) and nothing unverified stays cached; a pull is refused leaving nothing."""
    local = mmstore.open(path)
    with mmstore.open(url, cache_dir=cache) as store:
        np.testing.assert_array_equal(store[good]["image"], local[good]["image"])
        for _ in range(tries):
            with pytest.raises(RemoteChecksumError, match="image.npy"):
                store[bad]
        assert store.replica.verify_present() == 0
    with pytest.raises(ChecksumError, match="image.npy"):
        pull(url, tmp_path / "dest.store")
    assert not os.path.lexists(tmp_path / "dest.store")


def _no_store_is_a_one_line_error(url: str, tmp_path, monkeypatch, capsys) -> None:
    """No store at ``url``: the library and the CLI (inspect, pull) say so in one line; nothing is left."""
    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cli-cache"))
    with pytest.raises(RemoteNotFoundError, match="no store at this URL"):
        mmstore.open(url, cache_dir=tmp_path / "cache")
    with pytest.raises(RemoteNotFoundError, match="no store at this URL"):
        pull(url, tmp_path / "dest.store")
    for args in (["inspect", url, "--sample", "0"], ["pull", url, str(tmp_path / "dest.store")]):
        rc, out, err = run_cli(args, capsys)
        assert rc == 2 and out == "", err
        _one_line(err, url, "no store at this URL")
    assert not os.path.lexists(tmp_path / "dest.store")


def _one_line(err: str, *names: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in names:
        assert n in lines[0], (n, lines[0])


# -- az:// (Azurite) ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_az_push_then_pull_is_byte_identical(az, tmp_path, backend):
    src = tmp_path / "src.store"
    if backend == "memmap":
        path = written_image_store(src, n=900, seed=11, classes=7)
    else:
        path = write_store(src, 300, backend="lmdb")
    url = az.url("data/train.store")
    got = push_then_pull(path, url, tmp_path / "pulled.store", block_bytes=BLOCK)
    # the other spelling of the scheme names the same objects
    again = pull(az.url("data/train.store", scheme="azure"), tmp_path / "again.store")
    assert again["store_id"] == got["store_id"]
    same_files(path, str(tmp_path / "again.store"))


def test_az_a_loader_epoch_from_the_url_equals_the_local_one(az, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=1500, seed=11, classes=7)
    url = az.url("train.store")
    push(path, url, block_bytes=BLOCK)
    _epochs_equal(url, path, tmp_path / "cache")


def test_az_another_store_at_the_url_needs_overwrite(az, tmp_path):
    a = written_image_store(tmp_path / "a.store", n=200, seed=11, classes=7)
    b = write_store(tmp_path / "b.store", 40)
    url = az.url("moving.store")
    push(a, url, block_bytes=BLOCK)
    with pytest.raises(StoreExistsError):
        push(b, url, block_bytes=BLOCK)
    push(b, url, block_bytes=BLOCK, overwrite=True)
    with mmstore.open(url, cache_dir=tmp_path / "cache") as s:
        assert len(s) == 40 and s.schema == mmstore.open(b).schema


def test_az_a_flipped_byte_is_refused_never_data(az, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=900, seed=11, classes=7)
    prefix = "bad/flip.store"
    url = az.url(prefix)
    push(path, url, block_bytes=BLOCK)
    pos = 5 * BLOCK + 777
    data = bytearray(az.read(f"{prefix}/image.npy"))
    data[pos] ^= 0x5A
    az.write(f"{prefix}/image.npy", bytes(data))  # a new etag: the index no longer vouches for it
    bad = _record_of(path, "image", pos)
    with pytest.raises(RemoteChangedError):  # refused at the open, before any record
        with mmstore.open(url, cache_dir=tmp_path / "fresh") as store:
            store[bad]
    _index_vouching_for_the_damage(az, prefix, url, path, bad, tmp_path)


def test_az_a_missing_store_or_container_is_a_one_line_error(az, tmp_path, monkeypatch, capsys):
    src = write_store(tmp_path / "src.store", 20)
    nostore = az.url("nothing/here.store")
    nocontainer = f"az://no-such-container-{os.getpid()}/a.store"
    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cli-cache"))
    with pytest.raises(RemoteNotFoundError, match="no store at this URL"):
        mmstore.open(nostore, cache_dir=tmp_path / "cache")
    with pytest.raises(RemoteNotFoundError, match="no such container"):  # an az:// URL names a container
        mmstore.open(nocontainer, cache_dir=tmp_path / "cache")
    for url in (nostore, nocontainer):
        rc, out, err = run_cli(["inspect", url, "--sample", "0"], capsys)
        assert rc == 2 and out == "", err
        _one_line(err, url)
        rc, _, err = run_cli(["pull", url, str(tmp_path / "dest.store")], capsys)
        assert rc == 2 and not os.path.lexists(tmp_path / "dest.store"), err
        _one_line(err, url)
    with pytest.raises(RemoteNotFoundError, match="no such container"):
        push(src, nocontainer)


def test_az_the_checking_tools_take_a_url(az, tmp_path, monkeypatch, capsys):
    path = written_image_store(tmp_path / "src.store", n=300, seed=11, classes=7)
    url = az.url("tools.store")
    push(path, url, block_bytes=BLOCK)
    _the_tools_take(url, 300, tmp_path, monkeypatch, capsys)


def test_az_without_the_emulator_setting_is_a_typed_error(az, tmp_path, monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_USE_EMULATOR")
    monkeypatch.setenv("MMSTORE_REMOTE_RETRIES", "0")
    with pytest.raises(mmstore.errors.RemoteError, match="AZURE_"):
        mmstore.open(az.url("x.store"), cache_dir=tmp_path / "cache")


# -- gs:// (fake-gcs-server) -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_gs_a_store_reads_pulls_byte_identical_and_pushes_up_to_date(gs, tmp_path, backend):
    src = tmp_path / "src.store"
    if backend == "memmap":
        path = written_image_store(src, n=900, seed=11, classes=7)
    else:
        path = write_store(src, 300, backend="lmdb")
    url = gs.place_store(path, "data/train.store", BLOCK)
    local = mmstore.open(path)
    with mmstore.open(url, cache_dir=tmp_path / "cache") as remote:
        assert remote.store_id == local.store_id and len(remote) == len(local) and remote.schema == local.schema
        idx = np.random.default_rng(0).permutation(len(local))
        got, want = remote.read_batch(idx), local.read_batch(idx)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    rep = pull(url, tmp_path / "pulled.store")
    assert rep["verified_records"] == len(local) and rep["store_id"] == local.store_id
    same_files(path, str(tmp_path / "pulled.store"))
    assert pull(url, tmp_path / "pulled.store")["up_to_date"]
    # a push of the same store lists the bucket, finds each object as the index says, and uploads nothing
    rep = push(path, url, block_bytes=BLOCK)
    assert rep["up_to_date"] and rep["uploaded_bytes"] == 0


def test_gs_a_loader_epoch_from_the_url_equals_the_local_one(gs, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=1500, seed=11, classes=7)
    url = gs.place_store(path, "train.store", BLOCK)
    _epochs_equal(url, path, tmp_path / "cache")


def test_gs_a_flipped_byte_is_refused_never_data(gs, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=900, seed=11, classes=7)
    prefix = "bad/flip.store"
    url = gs.place_store(path, prefix, BLOCK)
    pos = 5 * BLOCK + 777
    data = bytearray(gs.read(f"{prefix}/image.npy"))
    data[pos] ^= 0x5A
    gs.write(f"{prefix}/image.npy", bytes(data))  # a new etag: the index no longer vouches for it
    bad = _record_of(path, "image", pos)
    # GCS answers the read's If-Match with 412 (RemoteChangedError); the emulator ignores If-Match, and
    # the block's digest refuses the bytes: never data either way
    with pytest.raises((RemoteChangedError, RemoteChecksumError)):
        with mmstore.open(url, cache_dir=tmp_path / "fresh") as store:
            store[bad]
    with pytest.raises((RemoteChangedError, RemoteChecksumError)):
        pull(url, tmp_path / "dest.store")
    assert not os.path.lexists(tmp_path / "dest.store")
    _index_vouching_for_the_damage(gs, prefix, url, path, bad, tmp_path)


def test_gs_a_missing_store_is_a_one_line_error(gs, tmp_path, monkeypatch, capsys):
    _no_store_is_a_one_line_error(gs.url("nothing/here.store"), tmp_path, monkeypatch, capsys)


def test_gs_the_checking_tools_take_a_url(gs, tmp_path, monkeypatch, capsys):
    path = written_image_store(tmp_path / "src.store", n=300, seed=11, classes=7)
    url = gs.place_store(path, "tools.store", BLOCK)
    _the_tools_take(url, 300, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("how", ["key file", "GOOGLE_BASE_URL", "GOOGLE_BASE_URL/", "gcs_base_url/"])
def test_gs_the_endpoint_and_key_come_from_the_environment(gs, tmp_path, monkeypatch, how):
    """The emulator is reached through each way the environment names a key and an endpoint: a key
    file (``GOOGLE_SERVICE_ACCOUNT``), ``GOOGLE_BASE_URL`` beside a key that names none, and an
    endpoint written with a trailing slash (in ``GOOGLE_BASE_URL`` or the key's ``gcs_base_url``),
    which is the same endpoint, never ``//BUCKET/...`` (no such bucket: "no store at this URL")."""
    path = write_store(tmp_path / "src.store", 20)
    url = gs.place_store(path, "env.store", BLOCK)
    key = json.loads(gs.server.service_account_key())
    endpoint = key.pop("gcs_base_url")
    monkeypatch.delenv("GOOGLE_SERVICE_ACCOUNT_KEY")
    monkeypatch.setenv("MMSTORE_REMOTE_RETRIES", "0")
    if how == "key file":
        key_file = tmp_path / "key.json"
        key_file.write_text(json.dumps({**key, "gcs_base_url": endpoint}))
        monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(key_file))
    elif how.startswith("GOOGLE_BASE_URL"):
        monkeypatch.setenv("GOOGLE_BASE_URL", endpoint + how[len("GOOGLE_BASE_URL"):])
        monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps(key))
    else:
        monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps({**key, "gcs_base_url": endpoint + "/"}))
    local = mmstore.open(path)
    with mmstore.open(url, cache_dir=tmp_path / "cache") as store:
        assert len(store) == 20 and store.store_id == local.store_id
        got, want = store.read_batch(np.arange(20)), local.read_batch(np.arange(20))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


# -- http:// (a bucket's objects served over HTTP) ---------------------------------------------


def test_http_a_url_store_reads_what_the_local_store_reads(web, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=1500, seed=11, classes=7)
    push(path, web.s3.url("pub/train.store"), block_bytes=BLOCK)
    url = web.url("pub/train.store")
    local = mmstore.open(path)
    with mmstore.open(url, cache_dir=tmp_path / "c0") as remote:
        assert remote.url == url and len(remote) == len(local)
        idx = np.random.default_rng(0).permutation(len(local))[:200]
        got, want = remote.read_batch(idx), local.read_batch(idx)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    _epochs_equal(url, path, tmp_path / "cache")


def test_http_reads_never_list(web, tmp_path, monkeypatch):
    from mmstore.remote.client import Remote

    path = written_image_store(tmp_path / "src.store", n=300, seed=11, classes=7)
    push(path, web.s3.url("nolist.store"), block_bytes=BLOCK)

    def refuse(self):
        raise AssertionError("an http(s):// store was listed")

    monkeypatch.setattr(Remote, "list", refuse)
    with mmstore.open(web.url("nolist.store"), cache_dir=tmp_path / "cache") as s:
        s.replica.fill()
        assert s.replica.complete()
    pull(web.url("nolist.store"), tmp_path / "pulled.store")
    same_files(path, str(tmp_path / "pulled.store"))


def test_http_pull_is_byte_identical_and_the_tools_take_the_url(web, tmp_path, monkeypatch, capsys):
    path = written_image_store(tmp_path / "src.store", n=400, seed=11, classes=7)
    push(path, web.s3.url("tools.store"), block_bytes=BLOCK)
    url = web.url("tools.store")
    rep = pull(url, tmp_path / "pulled.store")
    assert rep["verified_records"] == 400
    same_files(path, str(tmp_path / "pulled.store"))
    assert pull(url, tmp_path / "pulled.store")["up_to_date"]
    _the_tools_take(url, 400, tmp_path, monkeypatch, capsys)
    rc, _, err = run_cli(["pull", url, str(tmp_path / "cli.store"), "--json"], capsys)
    assert rc == 0, err
    same_files(path, str(tmp_path / "cli.store"))


def test_http_a_flipped_byte_is_a_checksum_error_never_data(web, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=900, seed=11, classes=7)
    prefix = "bad/flip.store"
    push(path, web.s3.url(prefix), block_bytes=BLOCK)
    pos = 7 * BLOCK + 99
    data = bytearray(web.s3.server.get_object_raw(web.s3.bucket, f"{prefix}/image.npy"))
    data[pos] ^= 0x5A
    web.s3.server.put_object_raw(web.s3.bucket, f"{prefix}/image.npy", bytes(data))
    url = web.url(prefix)
    bad, good = _record_of(path, "image", pos), _record_of(path, "image", 2 * BLOCK)
    _damage_refused(url, path, good, bad, tmp_path / "cache", tmp_path, tries=2)  # fetched twice, refused each time


def test_http_a_file_replaced_under_an_open_reader_is_refused(web, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=900, seed=11, classes=7)
    prefix = "moving.store"
    push(path, web.s3.url(prefix), block_bytes=BLOCK)
    local = mmstore.open(path)
    first, later = _record_of(path, "image", BLOCK + 5), _record_of(path, "image", 9 * BLOCK + 5)
    with mmstore.open(web.url(prefix), cache_dir=tmp_path / "cache") as store:
        np.testing.assert_array_equal(store[first]["image"], local[first]["image"])  # the server's etag, noted
        raw = web.s3.server.get_object_raw(web.s3.bucket, f"{prefix}/image.npy")
        web.s3.server.put_object_raw(web.s3.bucket, f"{prefix}/image.npy", raw[:-1] + bytes([raw[-1] ^ 1]))
        with pytest.raises(RemoteChangedError):
            store[later]


def test_http_a_missing_store_is_a_one_line_error(web, tmp_path, monkeypatch, capsys):
    _no_store_is_a_one_line_error(web.url("nothing/here.store"), tmp_path, monkeypatch, capsys)


def test_http_a_server_that_is_not_there_is_a_typed_error(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("MMSTORE_REMOTE_RETRIES", "1")
    monkeypatch.setenv("MMSTORE_REMOTE_RETRY_TIMEOUT", "2")
    with pytest.raises(RemoteUnavailableError, match="host and port"):
        mmstore.open(f"http://127.0.0.1:{port}/a.store", cache_dir=tmp_path / "cache")


def test_http_push_is_refused_with_a_typed_error(web, tmp_path, capsys):
    path = write_store(tmp_path / "src.store", 30)
    url = web.url("pushed.store")
    with pytest.raises(RemoteAccessError, match="read-only"):
        push(path, url, block_bytes=BLOCK)
    rc, _, err = run_cli(["push", path, url], capsys)
    assert rc == 2, err
    _one_line(err, url, "read-only")
    # the bucket holds nothing: the server was never written to
    with pytest.raises(RemoteNotFoundError):
        mmstore.open(web.s3.url("pushed.store"), cache_dir=tmp_path / "cache")
    # a store there already (pushed through S3): replacing it over HTTP is refused too
    push(path, web.s3.url("there.store"), block_bytes=BLOCK)
    other = write_store(tmp_path / "other.store", 10)
    with pytest.raises(RemoteAccessError, match="read-only"):
        push(other, web.url("there.store"), block_bytes=BLOCK, overwrite=True)
    assert len(mmstore.open(web.url("there.store"), cache_dir=tmp_path / "cache")) == 30


def test_http_urls_are_checked(tmp_path):
    for bad, why in (("https://user:secret@example.org/a.store", "no user name"),
                     ("http://127.0.0.1:1/", "not the server's root")):
        with pytest.raises(ValueError, match=why) as got:
            mmstore.open(bad, cache_dir=tmp_path / "cache")
        assert "secret" not in str(got.value)


def test_a_store_from_the_http_endpoint_and_from_s3_is_the_same_store(web, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=200, seed=11, classes=7)
    push(path, web.s3.url("both.store"), block_bytes=BLOCK)
    with mmstore.open(web.url("both.store"), cache_dir=tmp_path / "c") as a, \
            mmstore.open(web.s3.url("both.store"), cache_dir=tmp_path / "c") as b:
        assert a.store_id == b.store_id
        got, want = a.read_batch(np.arange(200)), b.read_batch(np.arange(200))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_a_damaged_index_over_http_is_refused(web, tmp_path):
    path = written_image_store(tmp_path / "src.store", n=100, seed=11, classes=7)
    push(path, web.s3.url("idx.store"), block_bytes=BLOCK)
    raw = json.loads(web.s3.server.get_object_raw(web.s3.bucket, "idx.store/_remote.json"))
    raw["files"]["image.npy"]["size"] += 1
    web.s3.server.put_object_raw(web.s3.bucket, "idx.store/_remote.json", json.dumps(raw).encode())
    with pytest.raises(FormatError, match="does not match"):
        mmstore.open(web.url("idx.store"), cache_dir=tmp_path / "cache")
