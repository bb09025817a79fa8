"""What a push may delete, how it repairs a damaged store, and ``verify`` of a URL, against a
real S3 server (SeaweedFS on loopback).

The rules (NOTE [what a push deletes] in mmstore/transfer/push.py): nothing under the prefix
that is not the store's own is ever deleted or overwritten, with or without ``overwrite``; a
push of the same store re-uploads exactly the objects that differ from its index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from remote.helpers import BLOCK, same_files, written_image_store
from support.stores import SMALL_SCHEMA, write_store

import mmstore
from mmstore.errors import (
    ForeignObjectsError,
    RemoteChangedError,
    RemoteChecksumError,
    RemoteNotFoundError,
    StoreExistsError,
)
from mmstore.transfer import pull, push

pytest.importorskip("obstore")


def _objects(s3) -> dict[str, bytes]:
    """Every object of the bucket: key -> its bytes, read straight from the server (keys as
    stored: a folder marker's with its ``/``)."""
    import xml.etree.ElementTree as ET

    status, _, body = s3.server.request("GET", f"/{s3.bucket}", query={"list-type": "2", "max-keys": "1000"})
    assert status == 200, body
    root = ET.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    assert root.findtext(f"{ns}IsTruncated") != "true"
    keys = [e.text or "" for e in root.iter(f"{ns}Key")]
    return {k: s3.server.get_object_raw(s3.bucket, k) for k in keys}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmstore", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ)


def test_a_push_into_a_folder_of_stores_refuses_and_leaves_every_object_byte_identical(s3, tmp_path):
    a = written_image_store(tmp_path / "a.store", n=40)
    b = write_store(tmp_path / "b.store", 30, schema=SMALL_SCHEMA)
    push(a, s3.url("datasets/train.store"), block_bytes=BLOCK)
    s3.server.put_object_raw(s3.bucket, "datasets/README.md", b"# our datasets\n")
    before = _objects(s3)
    assert len(before) > 5
    for overwrite in (False, True):  # --overwrite is for a store at the URL, never for what is beside it
        with pytest.raises(ForeignObjectsError) as got:
            push(b, s3.url("datasets"), block_bytes=BLOCK, overwrite=overwrite)
        msg = str(got.value)
        assert "README.md" in msg and "train.store/manifest.json" in msg and f"{len(before)} object" in msg
        assert "another store" in msg
        assert _objects(s3) == before
    out = _cli("push", b, s3.url("datasets"), "--overwrite")
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "README.md" in out.stderr and "NAME.store" in out.stderr
    assert _objects(s3) == before
    push(b, s3.url("datasets/b.store"), block_bytes=BLOCK)  # its own prefix: fine, and the rest untouched
    after = _objects(s3)
    assert {k: v for k, v in after.items() if not k.startswith("datasets/b.store/")} == before
    same_files(a, str(pull(s3.url("datasets/train.store"), tmp_path / "a2.store")["store"]))


def test_a_store_url_with_a_stray_object_is_refused_and_the_object_kept(s3, tmp_path):
    a = written_image_store(tmp_path / "a.store", n=40)
    b = write_store(tmp_path / "b.store", 30, schema=SMALL_SCHEMA)
    url = s3.url("x.store")
    push(a, url, block_bytes=BLOCK)
    s3.server.put_object_raw(s3.bucket, "x.store/notes.txt", b"mine")
    with pytest.raises(ForeignObjectsError, match="notes.txt"):
        push(b, url, block_bytes=BLOCK, overwrite=True)
    assert s3.server.get_object_raw(s3.bucket, "x.store/notes.txt") == b"mine"
    assert len(mmstore.open(url, cache_dir=tmp_path / "c")) == 40  # the store there is untouched too


def test_a_prefix_of_someone_elses_files_named_like_a_stores_is_not_overwritten(s3, tmp_path):
    b = write_store(tmp_path / "b.store", 30, schema=SMALL_SCHEMA)
    s3.server.put_object_raw(s3.bucket, "p/manifest.json", b'{"not": "mmstore"}')
    with pytest.raises(ForeignObjectsError, match="manifest.json"):
        push(b, s3.url("p"), block_bytes=BLOCK, overwrite=True)
    assert s3.server.get_object_raw(s3.bucket, "p/manifest.json") == b'{"not": "mmstore"}'


def test_overwrite_deletes_the_old_stores_objects_only(s3, tmp_path):
    a = written_image_store(tmp_path / "a.store", n=40)  # image.npy, label.npy ...
    b = write_store(tmp_path / "b.store", 30, schema=SMALL_SCHEMA)  # other field files
    url = s3.url("m.store")
    push(a, url, block_bytes=BLOCK)
    with pytest.raises(StoreExistsError, match="another store"):
        push(b, url, block_bytes=BLOCK)
    rep = push(b, url, block_bytes=BLOCK, overwrite=True)
    want = {f"m.store/{n}" for n in [*mmstore.open(b).manifest["files"], "manifest.json", "_remote.json"]}
    assert set(_objects(s3)) == want
    assert rep["deleted"] == len(set(mmstore.open(a).manifest["files"]) - set(mmstore.open(b).manifest["files"]))
    same_files(b, str(pull(url, tmp_path / "b2.store")["store"]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "delete-small", "replace-small"])
def test_a_plain_push_repairs_a_damaged_store_and_the_readers_advice_works(s3, tmp_path, damage):
    src = written_image_store(tmp_path / "src.store", n=120)
    url = s3.url("r/x.store")
    push(src, url, block_bytes=BLOCK)
    local = mmstore.open(src)
    key = "r/x.store/image.npy" if not damage.endswith("-small") else "r/x.store/label.npy"
    data = bytearray(s3.server.get_object_raw(s3.bucket, key))
    if damage == "flip":
        data[len(data) // 2] ^= 0x5A
        s3.server.put_object_raw(s3.bucket, key, bytes(data))
    elif damage == "truncate":
        s3.server.put_object_raw(s3.bucket, key, bytes(data[: len(data) - 1000]))
    elif damage.startswith("delete"):
        import obstore

        obstore.delete(s3.store(endpoint=s3.server.endpoint), key)
    else:
        s3.server.put_object_raw(s3.bucket, key, bytes(len(data)))  # same size, other bytes
    # a reader is refused, and told what to do
    with pytest.raises((RemoteChangedError, RemoteChecksumError, FileNotFoundError)) as got:
        with mmstore.open(url, cache_dir=tmp_path / "cache") as s:
            s.read_batch(np.arange(len(s)))
    if isinstance(got.value, RemoteChangedError):
        assert "mmstore verify" in str(got.value) and "mmstore push" in str(got.value)
    if damage.startswith("delete"):
        # the object, not the bucket, is missing: a reader and a pull say so, and what to do
        # (a small file is fetched whole when the cache is made, a data file block by block)
        with pytest.raises(RemoteNotFoundError) as pulled:
            pull(url, tmp_path / "pulled.store")
        for err in (got.value, pulled.value):
            msg = str(err)
            assert isinstance(err, RemoteNotFoundError), repr(err)
            assert f"{s3.url(key)}: not in the bucket" in msg and "no such bucket" not in msg, msg
            assert f"mmstore verify {url}" in msg and "mmstore push" in msg, msg
    # verify names the object, exits 1 and says what to do
    out = _cli("verify", url, "--json")
    assert out.returncode == 1, out.stderr
    rep = json.loads(out.stdout)
    assert not rep["ok"] and rep["remote"]["damaged"] == [key.rsplit("/", 1)[1]]
    out = _cli("verify", url)
    assert out.returncode == 1 and "mmstore push" in out.stdout and key.rsplit("/", 1)[1] in out.stdout
    # the advice: push the good copy again; only the damaged object goes up
    rep = push(src, url, block_bytes=BLOCK)
    size = os.path.getsize(os.path.join(src, key.rsplit("/", 1)[1]))
    assert not rep["up_to_date"] and rep["repaired"] == [key.rsplit("/", 1)[1]]
    assert rep["uploaded_bytes"] == size + os.path.getsize(os.path.join(src, "manifest.json"))
    assert push(src, url, block_bytes=BLOCK)["up_to_date"]
    assert _cli("verify", url, "--quick").returncode == 0
    # the same cache directory, opened afresh, reads the store right
    with mmstore.open(url, cache_dir=tmp_path / "cache") as s:
        got_all = s.read_batch(np.arange(len(s)))
    want = local.read_batch(np.arange(len(local)))
    assert all(np.array_equal(got_all[f], want[f]) for f in want)


def test_verify_deep_finds_damage_the_listing_cannot_see(s3, tmp_path):
    """Damage under an etag the index vouches for (bit rot on a server whose etags do not follow
    the bytes): the listing check passes, ``--deep`` names the block."""
    import obstore

    src = written_image_store(tmp_path / "src.store", n=120)
    url = s3.url("deep.store")
    push(src, url, block_bytes=BLOCK)
    key = "deep.store/image.npy"
    data = bytearray(s3.server.get_object_raw(s3.bucket, key))
    pos = 3 * BLOCK + 17
    data[pos] ^= 0xFF
    s3.server.put_object_raw(s3.bucket, key, bytes(data))
    raw = json.loads(s3.server.get_object_raw(s3.bucket, "deep.store/_remote.json"))
    raw["files"]["image.npy"]["etag"] = obstore.head(s3.store(endpoint=s3.server.endpoint), key)["e_tag"]
    s3.server.put_object_raw(s3.bucket, "deep.store/_remote.json", json.dumps(raw).encode())
    from mmstore.check.verify_remote import verify_remote

    assert verify_remote(url).ok
    deep = verify_remote(url, deep=True)
    assert not deep.ok and deep.damaged == ["image.npy"] and deep.bad_blocks == 1
    assert "block 3" in deep.problems[0].message
    assert deep.checked_blocks == sum(-(-os.path.getsize(os.path.join(src, n)) // BLOCK)
                                      for n in mmstore.open(src).manifest["files"])
    out = _cli("verify", url, "--deep", "--quick")
    assert out.returncode == 1 and "block 3" in out.stdout, out.stdout + out.stderr


def test_verify_of_a_url_without_a_store_is_a_usage_error(s3, tmp_path):
    out = _cli("verify", s3.url("nothing.store"))
    assert out.returncode == 2 and "no store at this URL" in out.stderr
    out = _cli("verify", str(tmp_path), "--deep")
    assert out.returncode == 2 and "--deep" in out.stderr


def test_what_an_unfinished_push_of_another_store_left_is_replaced_only_with_overwrite(s3, tmp_path, monkeypatch):
    """Objects an interrupted push left (no manifest, no index: only the mark beside them, as
    format.py specifies it), pushed from a machine whose journal does not know them: the same
    store finishes over them; another store needs ``overwrite``, and then removes them."""
    import obstore

    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "elsewhere"))  # no journal of that push here
    a = written_image_store(tmp_path / "a.store", n=40)
    b = write_store(tmp_path / "b.store", 30, schema=SMALL_SCHEMA)
    url = s3.url("u.store")
    push(a, url, block_bytes=BLOCK)
    store = s3.store(endpoint=s3.server.endpoint)
    obstore.delete(store, "u.store/manifest.json")
    obstore.delete(store, "u.store/_remote.json")
    files = sorted(mmstore.open(a).manifest["files"])
    mark = {"format": "mmstore-push", "store_id": mmstore.open(a).manifest["store_id"], "files": files}
    s3.server.put_object_raw(s3.bucket, "u.store/_push.json", json.dumps(mark).encode())
    with pytest.raises(StoreExistsError, match="unfinished push of another store"):
        push(b, url, block_bytes=BLOCK)
    rep = push(b, url, block_bytes=BLOCK, overwrite=True)
    want = {f"u.store/{n}" for n in [*mmstore.open(b).manifest["files"], "manifest.json", "_remote.json"]}
    assert set(_objects(s3)) == want  # the mark is gone too
    assert rep["deleted"] == len(set(files) - set(mmstore.open(b).manifest["files"]))
    same_files(b, str(pull(url, tmp_path / "b2.store")["store"]))


@pytest.mark.parametrize("claimant", ["_remote.json", "_push.json", "manifest.json"])
def test_a_crafted_index_mark_or_manifest_never_makes_a_foreign_object_the_stores(s3, tmp_path, claimant):
    """What a bucket's bookkeeping names counts as the store's own only where a store can hold
    that name: a claim on a README, carrying the pushed store's own (public) store_id, is refused
    and the README kept, with or without ``overwrite``."""
    a = write_store(tmp_path / "a.store", 20, schema=SMALL_SCHEMA)
    push(a, s3.url("ref.store"), block_bytes=BLOCK)
    raw = s3.server.get_object_raw(s3.bucket, f"ref.store/{claimant if claimant != '_push.json' else 'manifest.json'}")
    obj = json.loads(raw)
    if claimant == "_push.json":
        obj = {"format": "mmstore-push", "store_id": obj["store_id"], "files": ["README"]}
    elif claimant == "_remote.json":
        obj["files"]["README"] = {**next(iter(obj["files"].values())), "size": 8}
    else:
        obj["files"]["README"] = 8
    s3.server.put_object_raw(s3.bucket, "c.store/README", b"precious")
    s3.server.put_object_raw(s3.bucket, f"c.store/{claimant}", json.dumps(obj).encode())
    before = _objects(s3)
    for overwrite in (False, True):
        with pytest.raises(ForeignObjectsError, match="README"):
            push(a, s3.url("c.store"), block_bytes=BLOCK, overwrite=overwrite)
        assert _objects(s3) == before


def test_a_push_that_another_writer_overtook_refuses_to_write_its_manifest(s3, tmp_path, monkeypatch):
    """Two pushes of different stores to one empty URL: the one that finishes second sees the
    other's objects in its listing before its index and manifest and refuses, typed, instead of
    silently replacing the other; what it says to do works."""
    a = written_image_store(tmp_path / "a.store", n=40)
    b = write_store(tmp_path / "b.store", 30, schema=SMALL_SCHEMA)
    url = s3.url("race.store")

    def other_writer(_total: int) -> None:  # after a's listing, before its first upload
        monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "other-machine"))
        try:
            push(b, url, block_bytes=BLOCK)
        finally:
            monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "this-machine"))

    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "this-machine"))
    with pytest.raises(RemoteChangedError, match="another writer pushed to this URL") as got:
        push(a, url, block_bytes=BLOCK, on_total=other_writer)
    assert "--overwrite" in str(got.value) or "overwrite=True" in str(got.value)
    with open(os.path.join(b, "manifest.json"), "rb") as f:
        assert s3.server.get_object_raw(s3.bucket, "race.store/manifest.json") == f.read()  # b's, not a's
    push(a, url, block_bytes=BLOCK, overwrite=True)  # the advice
    same_files(a, str(pull(url, tmp_path / "a2.store")["store"]))
    assert set(_objects(s3)) == {f"race.store/{n}" for n in
                                 [*mmstore.open(a).manifest["files"], "manifest.json", "_remote.json"]}


def test_concurrent_atomic_writes_of_one_journal_never_collide(tmp_path):
    """Pushes from one machine write the same journal: each write is whole, none fails on
    another's temp file."""
    import threading

    from mmstore._os.io import atomic_write

    path = str(tmp_path / "j.json")
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(150):
                atomic_write(path, json.dumps({"writer": k, "i": i}).encode() * 50, unique=True)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert os.listdir(tmp_path) == ["j.json"]
    with open(path, "rb") as f:
        data = f.read()
    assert data == data[: len(data) // 50] * 50


def test_folder_markers_are_neither_foreign_nor_deleted(s3, tmp_path):
    """Zero-byte keys ending in ``/`` (the S3 console's "Create folder", rclone, s3fs) hold
    nothing: a push beside or into them goes ahead and keeps them; a real zero-byte object is
    still foreign."""
    a = write_store(tmp_path / "a.store", 20, schema=SMALL_SCHEMA)
    for key in ("folder/", "folder/new.store/", "folder/new.store/sub/"):
        s3.server.put_object_raw(s3.bucket, key, b"")
    push(a, s3.url("folder/new.store"), block_bytes=BLOCK)
    got = _objects(s3)
    assert all(k in got and got[k] == b"" for k in ("folder/", "folder/new.store/", "folder/new.store/sub/"))
    rep = _cli("verify", s3.url("folder/new.store"), "--json")
    assert rep.returncode == 0 and json.loads(rep.stdout)["remote"]["foreign"] == [], rep.stdout + rep.stderr
    assert push(a, s3.url("folder/new.store"), block_bytes=BLOCK)["up_to_date"]
    s3.server.put_object_raw(s3.bucket, "folder/new.store/_SUCCESS", b"")  # a real empty object
    before = _objects(s3)
    with pytest.raises(ForeignObjectsError, match="_SUCCESS") as err:
        push(a, s3.url("folder/new.store"), block_bytes=BLOCK)
    assert "sub" not in str(err.value) and "''" not in str(err.value)
    assert _objects(s3) == before


def test_the_refusal_advises_deleting_only_what_is_no_stores(s3, tmp_path):
    a = write_store(tmp_path / "a.store", 20, schema=SMALL_SCHEMA)
    push(a, s3.url("d/one.store"), block_bytes=BLOCK)
    with pytest.raises(ForeignObjectsError) as got:
        push(a, s3.url("d"), block_bytes=BLOCK)
    msg = str(got.value)
    assert "another store" in msg and "another URL" in msg and "delete them" not in msg and "interrupted" not in msg
    s3.server.put_object_raw(s3.bucket, "d/stray.npy", b"x")
    with pytest.raises(ForeignObjectsError) as got:
        push(a, s3.url("d"), block_bytes=BLOCK)
    msg = str(got.value)
    assert "If stray.npy is what a push interrupted on another machine left, delete it (" in msg
    assert "another URL" in msg


def test_verify_of_a_swapped_manifest_advises_overwrite_and_the_advice_works(s3, tmp_path):
    a = write_store(tmp_path / "a.store", 20, schema=SMALL_SCHEMA)
    b = written_image_store(tmp_path / "b.store", n=30)
    url = s3.url("s.store")
    push(a, url, block_bytes=BLOCK)
    with open(os.path.join(b, "manifest.json"), "rb") as f:
        s3.server.put_object_raw(s3.bucket, "s.store/manifest.json", f.read())  # another store's manifest
    out = _cli("verify", url, "--quick")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "None" not in out.stdout and "backend memmap" in out.stdout and "30 records" in out.stdout
    advice = [line for line in out.stdout.splitlines() if line.startswith("next")]
    assert advice and f"mmstore push STORE {url} --overwrite" in advice[0], out.stdout
    assert f"the manifest of store {mmstore.open(b).manifest['store_id']}, over the _remote.json of store" in out.stdout
    with pytest.raises(StoreExistsError):  # why a plain push is not the advice
        push(a, url, block_bytes=BLOCK)
    done = _cli("push", a, url, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert _cli("verify", url, "--quick").returncode == 0
    same_files(a, str(pull(url, tmp_path / "a2.store")["store"]))
