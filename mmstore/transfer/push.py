"""``push``: upload a finished local store to a URL, so that it can be pulled
or opened from there (format.py, "A store in object storage").

Files go up in parallel (``jobs`` at a time), large ones in parts of
``PART_BYTES`` several at a time, each hashed as it is read (the bytes sent
are the bytes hashed: one read of the store). The remote index goes up after
every other file, the manifest last: until the manifest is there, the prefix
is not a store. A push over another store at the URL deletes that store's
manifest first, so that no reader ever sees a mix.

NOTE [what a push deletes]: one listing of the prefix says what is there,
and each object is one of: the store's own (listed by the manifest or the
remote index found at the URL, the objects of an unfinished push to the
URL, as the mark it leaves beside them (``_push.json``, deleted once the
manifest is up) or this machine's journal names them, or those the caller
vouches for: a Ray write's parts), or not. What the bucket's manifest, index
or mark claims counts only where it is a name a store's file can have
(:func:`mmstore.format.layout.is_store_file_name`): they may be anyone's, and
carry any store id (ids are public). Each is read no further than its limit
allows, before its body arrives: the index no further than a store of the
manifest found there can have (with no manifest of ours there, a store of
the objects listed under the prefix); a larger one is read as no index. Zero-byte "folder" objects (keys ending
in ``/``) are no one's and are left alone. An object that is not the store's own
(another store under the prefix, a README, anything) makes the push refuse
with ``ForeignObjectsError`` naming it, with or without ``overwrite``: a
push never deletes or overwrites it. A *different* store at the URL (its
manifest or its index names another store) is replaced only with
``overwrite``; then the objects its index (or manifest) lists that the new
store does not are deleted, and nothing else. A store that the pushed one grew from
(``mmstore append``: its id among the pushed manifest's ``appended``
``to_store`` ids, format.py "Parts") is not a different store: it is
replaced without ``overwrite``, and the objects of the part files both
share that still match its index are kept, not uploaded again. The same store is updated in
place: its objects are compared with its index, sizes and etags from the
same listing, and every object missing, of another size or with another
etag (damaged, replaced, truncated, deleted) is uploaded again, then the
index and the manifest; a store whose objects all match uploads nothing.
Before the index and the manifest go up, the prefix is listed again: an
object of this push with another etag, or an object that appeared or
changed meanwhile, is another writer pushing to the URL at the same time,
and the push stops with ``RemoteChangedError`` instead of replacing it
unseen (object storage has no lock: two pushes that pass this check within
the same instant can still race; the last manifest wins whole).

NOTE [resuming a push]: the push keeps a journal under the cache directory
(``push/<url key>.json``): each file uploaded, with its size, digests and the
etag the server gave it, and each multipart upload under way, by its id. A
rerun after a kill skips the files whose object still has that size and
etag; a large file to ``s3://`` goes on with its upload: the server lists the
parts it holds, each part whose MD5 (the ETag S3 gives a part) matches the
file's bytes there is kept, and only the others are sent
(:mod:`mmstore.remote.multipart`). An upload whose file changed
since (size or modification time), or of a journal for another store, is
aborted and started again; so is an upload of one of the store's objects
that the journal does not name (a push interrupted on another machine).
The journal is deleted once the manifest is up. For other schemes the file
is the unit of resumption: an upload stopped midway is started again. A
push stopped and never rerun leaves its parts on the server (S3 charges for
them until they are aborted: :func:`abort_uploads`, a rerun, or a bucket
lifecycle rule for incomplete uploads removes them).

Interrupting a push (Ctrl-C) stops it at once, whatever is in flight (NOTE
[stopping a transfer] in :mod:`mmstore._os.threads`): the journal
holds what is done.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from .._os.io import atomic_write
from .._os.threads import Pool, Stopped, call, wait_all
from ..check.verify_remote import compare_objects, without_folder_markers
from ..errors import (
    ForeignObjectsError,
    FormatError,
    IncompleteStoreError,
    RemoteChangedError,
    RemoteError,
    RemoteNotFoundError,
    RemoteTooLargeError,
    StoreExistsError,
    spell_option,
)
from ..format.layout import (
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    PARTS_DIR,
    PUSH_MARK_FILE,
    REMOTE_INDEX_FILE,
    is_store_file_name,
)
from ..format.manifest import parse_manifest, read_manifest
from ..remote.client import Remote
from ..remote.index import (
    DEFAULT_BLOCK_BYTES,
    BlockHasher,
    FileEntry,
    RemoteIndex,
    check_block_bytes,
    index_max_bytes,
    index_max_bytes_of,
    parse_index,
)
from ..remote.multipart import S3Multipart, multipart_available, part_bytes_for
from ..remote.replica import default_cache_dir, remote_parts
from ..remote.url import StoreURL, local_path, parse_url

__all__ = ["PART_BYTES", "abort_uploads", "check_destination", "push"]

PART_BYTES = 16 << 20  # a multipart upload's part
_READ_BYTES = 4 << 20
_FILE_JOBS = 4  # files uploaded at once (each in up to jobs parts in flight)
_NAMED = 5  # objects named in a refusal
_MARK_FORMAT = "mmstore-push"


class _HashingReader:
    """A file read in order by the uploader, hashed and counted on the way;
    a read after the push's stop event is set raises :class:`Stopped`."""

    def __init__(self, path: str, hasher: BlockHasher, progress: Callable[[int], Any] | None,
                 stop: threading.Event) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.hasher = hasher
        self.progress = progress
        self.stop = stop
        self.pos = 0
        self.sequential = True

    def read(self, n: int = -1) -> bytes:
        if self.stop.is_set():
            raise Stopped
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


def _read_journal(path: str, url: str) -> dict[str, Any]:
    """The journal of an unfinished push to ``url`` ({} when there is none
    or it cannot be read: it only saves work)."""
    try:
        with open(path, "rb") as f:
            j = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(j, dict) or j.get("url") != url:
        return {}
    for key in ("files", "uploads"):
        if not isinstance(j.get(key), dict):
            j[key] = {}
    return j


def _grown_from(manifest: dict[str, Any]) -> list[str]:
    """The ids of the stores that ``manifest``'s store was appended to
    (format.py, "Parts": its provenance's ``appended`` entries)."""
    prov = manifest.get("provenance")
    entries = prov.get("appended") if isinstance(prov, dict) else None
    if not isinstance(entries, list):
        return []
    return [str(e["to_store"]) for e in entries if isinstance(e, dict) and isinstance(e.get("to_store"), str)]


@dataclass
class _There:
    """What one listing of the prefix and the small objects found there say
    (NOTE [what a push deletes])."""

    listing: dict[str, Any]
    raw_manifest: bytes | None = None  # an mmstore manifest at the URL
    manifest: dict[str, Any] | None = None
    index: RemoteIndex | None = None  # a remote index at the URL, parsed
    mark: dict[str, Any] | None = None  # the mark of an unfinished push (PUSH_MARK_FILE), parsed
    own: set[str] = field(default_factory=set)

    def store_id(self) -> str | None:
        if self.manifest is not None:
            return str(self.manifest.get("store_id"))
        if self.index is not None:
            return self.index.store_id
        return str(self.mark["store_id"]) if self.mark is not None else None


def _parse_mark(raw: bytes) -> dict[str, Any] | None:
    """A push's mark (untrusted): ``{"store_id", "files"}``, or None."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(obj, dict) and obj.get("format") == _MARK_FORMAT and isinstance(obj.get("store_id"), str)
            and isinstance(obj.get("files"), list)):
        return None
    files = [n for n in obj["files"] if isinstance(n, str)]
    return {"store_id": obj["store_id"], "files": files}


def _fetch_small(remote: Remote, name: str, size: int, limit: int) -> bytes | None:
    """A small object whose listed size is ``size``: None above ``limit``
    (not what a store holds: nothing of it is fetched, and it claims
    nothing) or when it went meanwhile."""
    try:
        return call(remote.get_small, name, limit, size)  # bounded: it may have grown since the listing
    except (RemoteNotFoundError, RemoteTooLargeError):
        return None


def _index_limit(there: _There) -> int:
    """The most bytes the index at the URL may have: what a store of the
    manifest there can give it; with no manifest of ours there, what the
    objects of a store's names under the prefix can (an index that lists
    more is read as no index: what it would claim stays foreign)."""
    if there.manifest is not None and there.raw_manifest is not None:
        return index_max_bytes(there.manifest, there.raw_manifest)
    sizes: dict[str, object] = {n: int(o["size"]) for n, o in there.listing.items()
                                if is_store_file_name(n) and n not in (REMOTE_INDEX_FILE, PUSH_MARK_FILE)}
    sizes[MANIFEST_FILE] = MANIFEST_MAX_BYTES
    return index_max_bytes_of(sizes)


def _survey(remote: Remote, listing: dict[str, Any], journal: dict[str, Any], vouched: Collection[str]) -> _There:
    there = _There(listing)
    loc = remote.loc
    if MANIFEST_FILE in listing:
        raw = _fetch_small(remote, MANIFEST_FILE, int(listing[MANIFEST_FILE]["size"]), MANIFEST_MAX_BYTES)
        if raw is not None:
            try:
                there.manifest = remote_parts(remote, parse_manifest(raw, loc.object_url(MANIFEST_FILE)))
                there.raw_manifest = raw
            except (FormatError, RemoteNotFoundError, RemoteTooLargeError):
                pass  # not a manifest of ours (or a damaged one: the index below may still claim it)
    if REMOTE_INDEX_FILE in listing:
        raw = _fetch_small(remote, REMOTE_INDEX_FILE, int(listing[REMOTE_INDEX_FILE]["size"]), _index_limit(there))
        if raw is not None:
            try:
                there.index = parse_index(raw, loc.url)
            except FormatError:
                pass
    if PUSH_MARK_FILE in listing:
        raw = _fetch_small(remote, PUSH_MARK_FILE, int(listing[PUSH_MARK_FILE]["size"]), MANIFEST_MAX_BYTES)
        there.mark = _parse_mark(raw) if raw is not None else None
    # what the bucket claims is the store's own only where it is a name a store can hold: a crafted
    # manifest, index or mark naming a README (with any store id: they are public) never claims it
    claimed: set[str] = set()
    if there.mark is not None:  # an unfinished push, from here or elsewhere
        claimed.update({PUSH_MARK_FILE, *there.mark["files"]})
    if there.manifest is not None:
        claimed.update({MANIFEST_FILE, *there.manifest["files"]})
        if REMOTE_INDEX_FILE in listing:
            claimed.add(REMOTE_INDEX_FILE)  # the store's, even damaged
    if there.index is not None:
        claimed.update({REMOTE_INDEX_FILE, *there.index.files})
    own = there.own
    own.update(n for n in claimed if is_store_file_name(n))
    own.update(journal.get("files", {}))
    own.update(journal.get("uploads", {}))
    own.update(vouched)
    return there


def _refuse_foreign(loc: StoreURL, foreign: list[str]) -> ForeignObjectsError:
    stores = sorted({n.rsplit("/", 1)[0] for n in foreign if n.endswith("/" + MANIFEST_FILE)})
    items = [f"{d}/{MANIFEST_FILE} (another store: {sum(n.startswith(d + '/') for n in foreign)} objects)"
             for d in stores]
    items += [n for n in foreign if not any(n.startswith(d + "/") for d in stores)]
    names = ", ".join(items[:_NAMED]) + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")
    flag = spell_option("overwrite=True", "--overwrite")
    msg = (f"{loc.url}: holds {len(foreign)} object(s) that are not this store's: {names}. A push never deletes "
           f"or overwrites them, {flag} or not: push to a prefix of the store's own (e.g. {loc.url}/NAME.store)")
    loose = [n for n in foreign if not any(n.startswith(d + "/") for d in stores)]
    if stores:
        msg += "; another store is kept where it is: push this one to another URL"
    if loose:  # only what is no store's may be the leftovers of an interrupted push
        shown = ", ".join(loose[:_NAMED]) + (f" and {len(loose) - _NAMED} more" if len(loose) > _NAMED else "")
        msg += (f". If {shown} {'is' if len(loose) == 1 else 'are'} what a push interrupted on another machine "
                f"left, delete {'it' if len(loose) == 1 else 'them'} (no {MANIFEST_FILE} or {REMOTE_INDEX_FILE} of "
                f"mmstore lists {'it' if len(loose) == 1 else 'them'}), then push again")
    return ForeignObjectsError(msg)


def _check_unchanged(remote: Remote, loc: StoreURL, before: Mapping[str, Any], files: Mapping[str, FileEntry],
                     mark_etag: str | None) -> None:
    """Refuse to write the index and the manifest when the prefix changed
    since this push listed it (another writer pushing to the URL at the same
    time): each file of the store must still have the size and etag its
    upload got, and nothing else may have appeared or changed."""
    now = call(without_folder_markers, remote, call(remote.list))
    changed = []
    for n, e in files.items():
        obj = now.get(n)
        if obj is None or int(obj["size"]) != e.size or (e.etag and obj.get("etag") and obj["etag"] != e.etag):
            changed.append(n)
    if mark_etag is not None and PUSH_MARK_FILE not in now:
        changed.append(PUSH_MARK_FILE)
    for n, obj in now.items():
        if n in files:
            continue
        if n == PUSH_MARK_FILE and mark_etag is not None:
            if mark_etag and obj.get("etag") and obj["etag"] != mark_etag:
                changed.append(n)
            continue
        old = before.get(n)
        if (n == MANIFEST_FILE or old is None or int(old["size"]) != int(obj["size"])
                or old.get("etag") != obj.get("etag")):
            changed.append(n)
    if changed:
        changed.sort()
        shown = ", ".join(changed[:_NAMED]) + (f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else "")
        flag = spell_option("overwrite=True", "--overwrite")
        raise RemoteChangedError(
            f"{loc.url}: another writer pushed to this URL while this push ran ({shown} changed or appeared "
            "after this push listed the prefix); this push wrote no index or manifest. See what is there with "
            f"`mmstore verify {loc.url}`, then push to another URL, or push again with {flag} to replace what "
            "the other writer left")


def check_destination(url: str, vouch: Callable[[str], bool] | None = None) -> None:
    """Refuse a URL whose prefix holds objects that are not a store's own
    (``ForeignObjectsError``, NOTE [what a push deletes]) before any work is
    done for a push there; ``vouch`` says which other objects the caller
    wrote (a Ray write's parts)."""
    loc = parse_url(url)
    remote = Remote(loc)
    listing = call(without_folder_markers, remote, call(remote.list))
    there = _survey(remote, listing, _read_journal(_journal_path(loc.url), loc.url),
                    {n for n in listing if vouch is not None and vouch(n)})
    foreign = sorted(n for n in listing if n not in there.own)
    if foreign:
        raise _refuse_foreign(loc, foreign)


def push(store: str | os.PathLike[str], url: str, *, overwrite: bool = False, jobs: int = 8,
         block_bytes: int = DEFAULT_BLOCK_BYTES, progress: Callable[[int], Any] | None = None,
         on_total: Callable[[int], Any] | None = None,
         present: Mapping[str, FileEntry] | None = None, vouched: Collection[str] = ()) -> dict[str, Any]:
    """Upload the store at ``store`` to ``url``; return a report.

    Parameters
    ----------
    store
        A finished local store.
    url
        Where to put it: ``s3://BUCKET/PREFIX``, ``gs://``, ``az://``. The
        prefix may hold this store (it is updated or repaired), another store
        (replaced only with ``overwrite``) or nothing; anything else under it
        is refused (NOTE [what a push deletes]).
    overwrite
        Replace a different store at the URL (its manifest is deleted first,
        then the objects of it the new store does not have).
    jobs
        Parts of a large file uploaded at once.
    block_bytes
        The unit in which a cache of the URL fetches, verifies and evicts the
        record data (a multiple of 4096 from 64 KiB to 1 GiB; default 1 MiB).
    progress, on_total
        Called with byte counts as they are read for upload, and once with
        the bytes to upload.
    present
        Files of the manifest that are at the URL already (their remote-index
        entries: the data files of parts uploaded one by one, format.py
        "Parts"); they need not exist locally, and are checked against the
        bucket's listing and kept.
    vouched
        Objects under the URL that the caller wrote and vouches for (a Ray
        write's task attempts): the store's own, deleted when it does not
        list them.

    Returns
    -------
    dict
        ``uploaded_bytes``, ``resumed_bytes``, ``skipped_files``,
        ``up_to_date`` (nothing to do), ``repaired`` (the objects of this
        store that differed from its index and were uploaded again),
        ``deleted`` (objects of an older store removed), ``seconds`` ...

    Raises
    ------
    ForeignObjectsError
        The prefix holds objects that are not this store's.
    StoreExistsError
        Another store is at the URL and ``overwrite`` is not set.
    KeyboardInterrupt
        Interrupted: the push stops at once; run it again to go on.
    """
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
                              "resumed_bytes": 0, "skipped_files": 0, "up_to_date": False, "repaired": [],
                              "deleted": 0}

    # what is at the URL now: one listing (NOTE [what a push deletes])
    journal_path = _journal_path(loc.url)
    journal = _read_journal(journal_path, loc.url)
    listing = call(without_folder_markers, remote, call(remote.list))
    there = _survey(remote, listing, journal, set(vouched) | set(present))
    foreign = sorted(n for n in listing if n not in there.own)
    if foreign:
        raise _refuse_foreign(loc, foreign)
    same = there.raw_manifest == raw_manifest
    grown = there.store_id() in _grown_from(manifest)  # the URL holds the store this one was appended to
    if not same and there.store_id() not in (None, manifest["store_id"]) and not grown and not overwrite:
        flag = spell_option("overwrite=True", "--overwrite")
        what = "another store" if there.manifest is not None else "what an unfinished push of another store left"
        raise StoreExistsError(f"{loc.url}: holds {what} already; pass {flag} to replace it, or push to "
                               "another URL")
    prev = there.index
    if prev is not None:
        try:
            prev.check_manifest(manifest, raw_manifest, loc.url)  # the index is this store's
        except FormatError:
            prev = None
    done: dict[str, FileEntry] = {}
    if prev is not None:
        differ = {p.file for p in compare_objects(prev, listing, loc)}
        if same and not differ:
            if PUSH_MARK_FILE in listing:  # a push that ended between its manifest and removing its mark
                call(remote.delete, [PUSH_MARK_FILE])
            report.update(up_to_date=True, seconds=round(time.monotonic() - t0, 3))
            return report
        # this store, some objects damaged, replaced or missing: those go up again, the rest is kept
        done = {n: e for n, e in prev.files.items() if n in sizes and n not in differ and n not in present}
        report["repaired"] = sorted(n for n in differ if n in sizes)
    elif (grown and there.index is not None and there.index.block_bytes == block_bytes
          and there.manifest is not None and there.raw_manifest is not None):
        # its parts are ours, byte for byte (format.py, "Parts"): each of their objects still as its index
        # says is kept; the rest (the new part, the bookkeeping) goes up
        try:
            there.index.check_manifest(there.manifest, there.raw_manifest, loc.url)
        except FormatError:
            pass  # an index that is not its manifest's: nothing is taken from it
        else:
            differ = {p.file for p in compare_objects(there.index, listing, loc)}
            done = {n: e for n, e in there.index.files.items() if n.startswith(PARTS_DIR + "/") and n not in differ
                    and n not in present and sizes.get(n) == e.size}
    if MANIFEST_FILE in listing:
        call(remote.delete, [MANIFEST_FILE])  # no reader may open a mix from now on

    uploads: dict[str, dict[str, Any]] = {}  # multipart uploads under way: name -> id, size, mtime, part size
    multipart = S3Multipart(loc, _FILE_JOBS * max(1, jobs)) if loc.scheme == "s3" and multipart_available() else None
    ours = (journal.get("store_id") == manifest["store_id"] and journal.get("block_bytes") == block_bytes
            and journal.get("manifest") == hashlib.sha256(raw_manifest).hexdigest())
    uploads = {n: u for n, u in journal.get("uploads", {}).items()
               if n in sizes and isinstance(u, dict) and isinstance(u.get("upload_id"), str)}
    if ours:
        try:
            for n, e in journal["files"].items():
                if n in sizes and e.get("size") == sizes[n]:
                    done[n] = FileEntry(int(e["size"]), str(e["digest"]), base64.b64decode(e["blocks"]), e["etag"])
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged journal only saves work
    elif multipart is not None:
        for n, u in uploads.items():  # another store's uploads at this URL: their parts are of no use
            try:
                call(multipart.abort, n, u["upload_id"])
            except RemoteError:
                pass  # left to the bucket's own clean-up of incomplete uploads
        uploads = {}
    if multipart is not None and listing and max(sizes.values(), default=0) > PART_BYTES:
        # a prefix written before, and a file that goes up in parts: uploads a lost journal left behind
        _abort_unknown_uploads(multipart, set(sizes) | there.own, {u["upload_id"] for u in uploads.values()})
    for n, e in present.items():
        obj = listing.get(n)
        if obj is None or obj["size"] != e.size or (e.etag and obj["etag"] and obj["etag"] != e.etag):
            raise RemoteNotFoundError(f"{loc.object_url(n)}: expected a {e.size}-byte object"
                                      + (f" (etag {e.etag})" if e.etag else "") + ", found "
                                      + ("none" if obj is None else f"{obj['size']} bytes, etag {obj['etag']}")
                                      + "; the part was changed or deleted: write the store again")
    done.update(present)
    for n in [n for n in done if n not in present]:
        obj = listing.get(n)
        if obj is None or obj["size"] != done[n].size or (done[n].etag and obj["etag"] != done[n].etag):
            del done[n]
    stale = sorted(n for n in there.own if n in listing and n not in sizes
                   and n not in (MANIFEST_FILE, REMOTE_INDEX_FILE, PUSH_MARK_FILE))
    if stale:
        call(remote.delete, stale)  # the objects of an older store at this URL, and nothing else
        report["deleted"] = len(stale)
    before = {n: o for n, o in listing.items() if n not in stale and n != MANIFEST_FILE}

    stop = threading.Event()
    try:
        return _upload(path, loc, remote, manifest, raw_manifest, names, sizes, done, uploads, multipart, report,
                       journal_path, jobs, block_bytes, progress, on_total, stop, t0, before)
    except BaseException:
        stop.set()  # the workers start nothing more; what is in flight is abandoned
        raise


def _upload(path: str, loc: StoreURL, remote: Remote, manifest: dict[str, Any], raw_manifest: bytes,
            names: list[str], sizes: dict[str, int], done: dict[str, FileEntry], uploads: dict[str, dict[str, Any]],
            multipart: S3Multipart | None, report: dict[str, Any], journal_path: str, jobs: int, block_bytes: int,
            progress: Callable[[int], Any] | None, on_total: Callable[[int], Any] | None, stop: threading.Event,
            t0: float, before: Mapping[str, Any]) -> dict[str, Any]:
    """Upload what is not ``done``, then the index and the manifest, once
    the prefix shows nothing changed since ``before`` (its listing, less
    what this push deleted) but this push's uploads."""
    marked = PUSH_MARK_FILE in before
    mark_etag = None
    todo = [n for n in names if n not in done]
    report["skipped_files"] = len(names) - len(todo)
    total = sum(sizes[n] for n in todo) + len(raw_manifest)
    if on_total is not None:
        on_total(total)
    if todo:  # the names this push writes, for a rerun that has no journal (NOTE [what a push deletes])
        mark = {"format": _MARK_FORMAT, "store_id": manifest["store_id"], "files": sorted(todo)}
        mark_etag = call(remote.put, PUSH_MARK_FILE, json.dumps(mark).encode("utf-8")) or ""
    jlock = threading.Lock()

    def save_journal() -> None:
        obj = {"url": loc.url, "store_id": manifest["store_id"], "block_bytes": block_bytes,
               "manifest": hashlib.sha256(raw_manifest).hexdigest(),
               "files": {n: {"size": e.size, "digest": e.digest, "etag": e.etag,
                             "blocks": base64.b64encode(e.blocks).decode("ascii")} for n, e in done.items()},
               "uploads": uploads}
        os.makedirs(os.path.dirname(journal_path), exist_ok=True)
        atomic_write(journal_path, json.dumps(obj).encode("utf-8"), unique=True)  # other pushes from here

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
            reader = _HashingReader(src, hasher, progress, stop)
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

        failed = threading.Event()  # this file's parts: nothing more starts once one failed

        def send(k: int, data: bytes) -> None:
            if stop.is_set() or failed.is_set():
                raise Stopped
            etags[k] = mp.put_part(name, uid, k + 1, data)
            if progress is not None:
                progress(len(data))

        inflight: set[Future[None]] = set()
        kept = 0
        with open(src, "rb") as f, Pool(max(1, jobs), "mmstore-part", failed) as pool:
            for k in range(nparts):
                if stop.is_set():
                    raise Stopped
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
                    finished, inflight = wait(inflight, timeout=0.25, return_when=FIRST_COMPLETED)
                    if stop.is_set():
                        raise Stopped
                    for fut in finished:
                        fut.result()
                inflight.add(pool.submit(send, k, data))
            wait_all(inflight, stop)
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
        with Pool(min(_FILE_JOBS, len(todo)), "mmstore-push", stop) as pool:
            # the first error once every upload has ended (each saves what it did); an interrupt leaves at once
            wait_all([pool.submit(upload, n) for n in sorted(todo, key=lambda n: -sizes[n])])

    hasher = BlockHasher(block_bytes)
    hasher.update(raw_manifest)
    mdigest, mblocks = hasher.finish()
    _check_unchanged(remote, loc, before, done, mark_etag)
    files = dict(done)
    files[MANIFEST_FILE] = FileEntry(len(raw_manifest), mdigest, mblocks, None)
    index = RemoteIndex(manifest["store_id"], block_bytes, files)
    call(remote.put, REMOTE_INDEX_FILE, index.to_json())
    call(remote.put, MANIFEST_FILE, raw_manifest)  # last: from now on the URL is this store
    if todo or marked:
        call(remote.delete, [PUSH_MARK_FILE])
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


def _abort_unknown_uploads(mp: S3Multipart, names: set[str], known: set[str]) -> None:
    """Abort the multipart uploads of the store's objects that no journal
    names (an interrupted push elsewhere, or one whose journal was lost):
    their parts cost storage and are of no use."""
    try:
        listed = call(mp.uploads)
    except RemoteError:
        return  # a server that does not list uploads: the bucket's clean-up rule removes them
    for name, uid, _ in listed:
        if name in names and uid not in known:
            try:
                call(mp.abort, name, uid)
            except RemoteError:
                pass


def abort_uploads(url: str) -> dict[str, Any]:
    """Abort the unfinished multipart uploads of the store at ``url``.

    Those of objects directly under the prefix and of a Ray write's parts
    (``parts/ID/NAME``) are aborted, not those of other stores under deeper
    prefixes. The journal of an unfinished push to the URL forgets them.

    Parameters
    ----------
    url
        An ``s3://`` store URL.

    Returns
    -------
    dict
        ``{"url", "aborted": [{"name", "upload_id", "initiated"}], "kept":
        [names of uploads under deeper prefixes, left alone]}``.

    Raises
    ------
    RemoteError
        Not an ``s3://`` URL, or the server refused the listing or an abort.
    """
    loc = parse_url(url)
    if loc.scheme != "s3":
        raise RemoteError(f"{loc.url}: listing unfinished uploads is for s3:// URLs; {loc.scheme}:// drops the "
                          "uncommitted blocks of an upload by itself (Azure after 7 days; on GCS set a lifecycle "
                          "rule)")
    Remote(loc).check_writable("abort uploads of")
    if not multipart_available():
        raise ImportError("aborting uploads needs boto3: pip install 'mmstore[remote]'")
    mp = S3Multipart(loc)
    aborted, kept = [], []
    for name, uid, initiated in call(mp.uploads):
        parts = name.split("/")
        if len(parts) == 1 or (len(parts) == 3 and parts[0] == "parts"):
            call(mp.abort, name, uid)
            aborted.append({"name": name, "upload_id": uid, "initiated": initiated})
        else:
            kept.append(name)
    journal_path = _journal_path(loc.url)
    journal = _read_journal(journal_path, loc.url)
    if journal.get("uploads"):
        journal["uploads"] = {}
        atomic_write(journal_path, json.dumps(journal).encode("utf-8"), unique=True)
    return {"url": loc.url, "aborted": aborted, "kept": sorted(kept)}
