"""``push``: upload a finished local store to a URL, so that it can be pulled
or opened from there (format.py, "A store in object storage").

Files go up in parallel (``jobs`` at a time), large ones in parts of
``PART_BYTES`` several at a time, each hashed as it is read (the bytes sent
are the bytes hashed: one read of the store). The remote index goes up after
every other file, the manifest last: until the manifest is there, the prefix
is not a store. A push over another store at the URL deletes that store's
manifest first, so that no reader ever sees a mix.

NOTE [resuming a push]: the push keeps a journal under the cache directory
(``push/<url key>.json``): each file uploaded, with its size, digests and the
etag the server gave it, and each multipart upload under way, by its id. A
rerun after a kill skips the files whose object still has that size and
etag; a large file to ``s3://`` goes on with its upload: the server lists the
parts it holds, each part whose MD5 (the ETag S3 gives a part) matches the
file's bytes there is kept, and only the others are sent
(:mod:`mmstore.remote.multipart`). An upload whose file changed
since (size or modification time), or of a journal for another store, is
aborted and started again. The journal is deleted once the manifest is up.
For other schemes the file is the unit of resumption: an upload stopped
midway is started again. A push stopped and never rerun leaves its parts on
the server (S3 charges for them until they are aborted: a rerun, or a
bucket lifecycle rule for incomplete uploads, removes them).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from typing import Any

from .._os.io import atomic_write
from ..errors import (
    FormatError,
    IncompleteStoreError,
    RemoteError,
    RemoteNotFoundError,
    StoreExistsError,
    spell_option,
)
from ..format.layout import MANIFEST_FILE, REMOTE_INDEX_FILE
from ..format.manifest import read_manifest
from ..remote.client import Remote
from ..remote.index import DEFAULT_BLOCK_BYTES, BlockHasher, FileEntry, RemoteIndex, check_block_bytes, parse_index
from ..remote.multipart import S3Multipart, multipart_available, part_bytes_for
from ..remote.replica import default_cache_dir
from ..remote.url import local_path, parse_url

__all__ = ["PART_BYTES", "push"]

PART_BYTES = 16 << 20  # a multipart upload's part
_READ_BYTES = 4 << 20
_FILE_JOBS = 4  # files uploaded at once (each in up to jobs parts in flight)


class _HashingReader:
    """A file read in order by the uploader, hashed and counted on the way."""

    def __init__(self, path: str, hasher: BlockHasher, progress: Callable[[int], Any] | None) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.hasher = hasher
        self.progress = progress
        self.pos = 0
        self.sequential = True

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n is not None and n >= 0 else -1)
        if self.f.tell() - len(data) != self.pos:
            self.sequential = False
        self.hasher.update(data)
        self.pos = self.f.tell()
        if self.progress is not None and data:
            self.progress(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.f.close()


def _hash_file(path: str, block_bytes: int) -> tuple[str, bytes, int]:
    hasher = BlockHasher(block_bytes)
    with open(path, "rb") as f:
        while True:
            data = f.read(_READ_BYTES)
            if not data:
                break
            hasher.update(data)
    digest, blocks = hasher.finish()
    return digest, blocks, hasher.size


def _journal_path(url: str) -> str:
    key = hashlib.sha256(url.encode("utf-8")).hexdigest()[:24]
    return os.path.join(default_cache_dir(), "push", f"{key}.json")


def push(store: str | os.PathLike[str], url: str, *, overwrite: bool = False, jobs: int = 8,
         block_bytes: int = DEFAULT_BLOCK_BYTES, progress: Callable[[int], Any] | None = None,
         on_total: Callable[[int], Any] | None = None,
         present: dict[str, FileEntry] | None = None) -> dict[str, Any]:
    """Upload the store at ``store`` to ``url``; return a report.

    ``overwrite``: replace a different store at the URL (its manifest is
    deleted first); without it that is a ``StoreExistsError``. Pushing a
    store that is already there unchanged uploads nothing. ``progress`` is
    called with byte counts as they are read for upload, ``on_total`` once
    with the bytes to upload. ``block_bytes``: the unit in which a cache of
    the URL fetches, verifies and evicts the record data (a multiple of 4096
    from 64 KiB to 1 GiB; default 1 MiB). ``present``: files of the manifest that are at
    the URL already (their remote-index entries: the data files of parts
    uploaded one by one, format.py "Parts"); they need not exist locally,
    are checked against the bucket's listing and are kept, while every other
    object under the URL that the store does not list is deleted."""
    t0 = time.monotonic()
    check_block_bytes(block_bytes)  # before anything is uploaded: a reader refuses any other
    path = os.path.abspath(local_path(store))
    manifest = read_manifest(path)  # IncompleteStoreError / FormatError for what is not a finished store
    with open(os.path.join(path, MANIFEST_FILE), "rb") as f:
        raw_manifest = f.read()
    loc = parse_url(url)
    remote = Remote(loc)
    remote.check_writable("push")
    names = sorted(manifest["files"])
    sizes = {n: int(manifest["files"][n]) for n in names}
    present = dict(present or {})
    for n, e in present.items():
        if sizes.get(n) != e.size:
            raise FormatError(f"{path}: {n} is listed as present at the URL with {e.size} bytes, but the manifest "
                              f"says {sizes.get(n)}")
    for n in names:
        if n in present:
            continue
        try:
            st = os.stat(os.path.join(path, n))
        except OSError:
            raise IncompleteStoreError(f"{path}: {n} is missing; the store is damaged: `mmstore verify` it") from None
        if st.st_size != sizes[n]:
            raise FormatError(f"{path}: {n} is {st.st_size} bytes, the manifest says {sizes[n]}: "
                              "`mmstore verify` the store before pushing it")
    report: dict[str, Any] = {"store": path, "url": loc.url, "store_id": manifest["store_id"], "files": len(names) + 2,
                              "bytes": sum(sizes.values()) + len(raw_manifest), "uploaded_bytes": 0,
                              "resumed_bytes": 0, "skipped_files": 0, "up_to_date": False}

    # what is at the URL now
    there = remote.head(MANIFEST_FILE)
    if there is not None:
        try:
            same = remote.get(MANIFEST_FILE) == raw_manifest
        except FileNotFoundError:
            same = False
        if same:
            try:
                parse_index(remote.get(REMOTE_INDEX_FILE), loc.url)
                report.update(up_to_date=True, seconds=round(time.monotonic() - t0, 3))
                return report
            except (FileNotFoundError, FormatError):
                pass  # the same manifest over a damaged index: push again
        elif not overwrite:
            flag = spell_option("overwrite=True", "--overwrite")
            raise StoreExistsError(f"{loc.url}: holds another store already; pass {flag} to replace it, or push to "
                                   "another URL")
        remote.delete([MANIFEST_FILE])  # no reader may open a mix from now on

    journal_path = _journal_path(loc.url)
    done: dict[str, FileEntry] = {}
    uploads: dict[str, dict[str, Any]] = {}  # multipart uploads under way: name -> id, size, mtime, part size
    multipart = S3Multipart(loc, _FILE_JOBS * max(1, jobs)) if loc.scheme == "s3" and multipart_available() else None
    try:
        with open(journal_path, "rb") as f:
            j = json.loads(f.read())
        ours = (j.get("store_id") == manifest["store_id"] and j.get("block_bytes") == block_bytes
                and j.get("manifest") == hashlib.sha256(raw_manifest).hexdigest())
        got = j.get("uploads", {})
        if isinstance(got, dict):
            uploads = {n: u for n, u in got.items()
                       if n in sizes and isinstance(u, dict) and isinstance(u.get("upload_id"), str)}
        if ours:
            for n, e in j.get("files", {}).items():
                if n in sizes and e.get("size") == sizes[n]:
                    done[n] = FileEntry(int(e["size"]), str(e["digest"]), base64.b64decode(e["blocks"]), e["etag"])
        elif multipart is not None:
            for n, u in uploads.items():  # another store's uploads at this URL: their parts are of no use
                try:
                    multipart.abort(n, u["upload_id"])
                except RemoteError:
                    pass  # left to the bucket's own clean-up of incomplete uploads
            uploads = {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        done, uploads = {}, {}
    if present:
        listing = remote.list()
        for n, e in present.items():
            obj = listing.get(n)
            if obj is None or obj["size"] != e.size or (e.etag and obj["etag"] and obj["etag"] != e.etag):
                raise RemoteNotFoundError(f"{loc.object_url(n)}: expected a {e.size}-byte object"
                                          + (f" (etag {e.etag})" if e.etag else "") + ", found "
                                          + ("none" if obj is None else f"{obj['size']} bytes, etag {obj['etag']}")
                                          + "; the part was changed or deleted: write the store again")
        done.update(present)
    if len(done) > len(present):
        listing = remote.list()
        for n in [n for n in done if n not in present]:
            obj = listing.get(n)
            if obj is None or obj["size"] != done[n].size or (done[n].etag and obj["etag"] != done[n].etag):
                del done[n]
    stale = [n for n in remote.list() if n not in sizes and n not in (MANIFEST_FILE, REMOTE_INDEX_FILE)]
    if stale:
        remote.delete(stale)  # files of an older store at this URL

    todo = [n for n in names if n not in done]
    report["skipped_files"] = len(names) - len(todo)
    total = sum(sizes[n] for n in todo) + len(raw_manifest)
    if on_total is not None:
        on_total(total)
    jlock = threading.Lock()

    def save_journal() -> None:
        obj = {"url": loc.url, "store_id": manifest["store_id"], "block_bytes": block_bytes,
               "manifest": hashlib.sha256(raw_manifest).hexdigest(),
               "files": {n: {"size": e.size, "digest": e.digest, "etag": e.etag,
                             "blocks": base64.b64encode(e.blocks).decode("ascii")} for n, e in done.items()},
               "uploads": uploads}
        os.makedirs(os.path.dirname(journal_path), exist_ok=True)
        atomic_write(journal_path, json.dumps(obj).encode("utf-8"))

    def upload(name: str) -> None:
        src = os.path.join(path, name)
        size = sizes[name]
        hasher = BlockHasher(block_bytes)
        if size <= PART_BYTES:
            with open(src, "rb") as f:
                data = f.read()
            if len(data) != size:
                raise FormatError(f"{src}: changed while it was pushed ({len(data)} bytes, expected {size})")
            hasher.update(data)
            etag = remote.put(name, data, size=size)
            if progress is not None:
                progress(size)
            digest, blocks = hasher.finish()
        elif multipart is not None:
            digest, blocks, etag = upload_parts(multipart, name)
        else:
            reader = _HashingReader(src, hasher, progress)
            try:
                etag = remote.put(name, reader, size=size, chunk=part_bytes_for(size, PART_BYTES),
                                  concurrency=max(1, jobs))
            finally:
                reader.close()
            digest, blocks = hasher.finish()
            if not reader.sequential or hasher.size != size:
                digest, blocks, got = _hash_file(src, block_bytes)  # the client read out of order: hash again
                if got != size:
                    raise FormatError(f"{src}: changed while it was pushed ({got} bytes, expected {size})")
        with jlock:
            done[name] = FileEntry(size, digest, blocks, etag)
            save_journal()

    resumed = [0]

    def upload_parts(mp: S3Multipart, name: str) -> tuple[str, bytes, str | None]:
        """Upload a large file part by part, going on with the upload the
        journal names (NOTE [resuming a push]); its digests and etag."""
        src = os.path.join(path, name)
        size = sizes[name]
        st = os.stat(src)
        ident = {"size": size, "mtime_ns": st.st_mtime_ns, "part_bytes": part_bytes_for(size, PART_BYTES)}
        with jlock:
            entry = uploads.get(name)
        held: dict[int, tuple[str, int]] = {}
        if entry is not None:
            listed = None
            if {k: entry.get(k) for k in ident} == ident:
                listed = mp.parts(name, entry["upload_id"])
            else:
                mp.abort(name, entry["upload_id"])  # the file changed since: its parts are not this file's
            if listed is None:
                entry = None
            else:
                held = listed
        if entry is None:
            entry = {**ident, "upload_id": mp.create(name)}
            with jlock:
                uploads[name] = entry
                save_journal()
        uid, pb = str(entry["upload_id"]), int(ident["part_bytes"])
        nparts = max(1, -(-size // pb))
        etags = [""] * nparts
        hasher = BlockHasher(block_bytes)

        def send(k: int, data: bytes) -> None:
            etags[k] = mp.put_part(name, uid, k + 1, data)
            if progress is not None:
                progress(len(data))

        inflight: set[Future[None]] = set()
        kept = 0
        with open(src, "rb") as f, ThreadPoolExecutor(max(1, jobs), thread_name_prefix="mmstore-part") as pool:
            try:
                for k in range(nparts):
                    want = min(pb, size - k * pb)
                    data = f.read(want)  # in order: the bytes hashed are the bytes sent
                    if len(data) != want:
                        raise FormatError(f"{src}: changed while it was pushed (part {k + 1} has {len(data)} bytes, "
                                          f"expected {want})")
                    hasher.update(data)
                    have = held.get(k + 1)
                    if (have is not None and have[1] == want
                            and have[0].strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest()):
                        etags[k] = have[0]  # on the server already, the same bytes
                        kept += want
                        if progress is not None:
                            progress(want)
                        continue
                    while len(inflight) >= max(1, jobs):  # a slot as soon as any part is up
                        finished, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            fut.result()
                    inflight.add(pool.submit(send, k, data))
                for fut in as_completed(inflight):
                    fut.result()
            finally:
                for fut in inflight:
                    fut.cancel()
        after = os.stat(src)
        if (after.st_size, after.st_mtime_ns) != (size, st.st_mtime_ns):
            raise FormatError(f"{src}: changed while it was pushed; push the store again once it is finished")
        etag = mp.complete(name, uid, etags)
        obj = remote.head(name)
        if obj is None or obj["size"] != size:
            raise FormatError(f"{loc.object_url(name)}: the completed upload is "
                              f"{'missing' if obj is None else str(obj['size']) + ' bytes'}, expected {size}; "
                              "push again")
        with jlock:
            uploads.pop(name, None)
            resumed[0] += kept
        digest, blocks = hasher.finish()
        return digest, blocks, obj.get("etag") or etag

    if todo:
        with ThreadPoolExecutor(min(_FILE_JOBS, len(todo)), thread_name_prefix="mmstore-push") as pool:
            futs = [pool.submit(upload, n) for n in sorted(todo, key=lambda n: -sizes[n])]
            err: BaseException | None = None
            for fut in futs:
                try:
                    fut.result()
                except BaseException as exc:  # noqa: BLE001 - the first error, once every upload has ended
                    err = err or exc
            if err is not None:
                raise err

    hasher = BlockHasher(block_bytes)
    hasher.update(raw_manifest)
    mdigest, mblocks = hasher.finish()
    files = dict(done)
    files[MANIFEST_FILE] = FileEntry(len(raw_manifest), mdigest, mblocks, None)
    index = RemoteIndex(manifest["store_id"], block_bytes, files)
    remote.put(REMOTE_INDEX_FILE, index.to_json())
    remote.put(MANIFEST_FILE, raw_manifest)  # last: from now on the URL is this store
    if progress is not None:
        progress(len(raw_manifest))
    try:
        os.unlink(journal_path)
    except OSError:
        pass
    secs = time.monotonic() - t0
    sent = total - resumed[0]
    report.update(uploaded_bytes=sent, resumed_bytes=resumed[0], seconds=round(secs, 3),
                  bytes_per_s=round(sent / secs) if secs > 0 else None)
    return report
