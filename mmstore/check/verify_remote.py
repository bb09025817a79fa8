"""``verify`` of a store URL: the bucket's objects against the store's remote
index (``_remote.json``, format.py "A store in object storage").

One listing of the prefix gives every object's size and etag; each file the
index names must be there with the size the index gives and the etag the
push recorded (an object replaced, truncated, deleted or damaged in the
bucket has another etag or size). ``deep`` also fetches every block of every
object by range GETs straight from the bucket, no cache in between, and
checks it against the block digest the push recorded, naming each block
that differs, and each whole object against the whole-file digest the push
recorded: an object whose every block matches while the whole does not
means the index disagrees with itself. The range GETs run on daemon
threads (NOTE [stopping a transfer] in :mod:`mmstore._os.threads`), so a
Ctrl-C stops a deep check at once; at most two spans per thread are held in
memory, waiting for their turn in the whole-object digest. Objects under the
prefix that the index does not list are reported apart: they are not the
store's (a push never deletes them, and refuses to write where they are).

:func:`compare_objects` is the check itself, shared with ``push``, which
re-uploads what it finds different (NOTE [what a push deletes] in
:mod:`mmstore.transfer.push`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .._os.threads import Pool
from ..errors import FormatError, RemoteNotFoundError
from ..format.layout import MANIFEST_FILE, MANIFEST_MAX_BYTES, PART_TABLE_FILE, PUSH_MARK_FILE, REMOTE_INDEX_FILE
from ..format.manifest import parse_manifest
from ..remote.client import Remote
from ..remote.index import (
    FileEntry,
    RemoteIndex,
    block_digest,
    disagreeing_index,
    index_max_bytes,
    parse_index,
)
from ..remote.url import StoreURL, parse_url
from .verify_report import Problem

__all__ = ["RemoteVerifyReport", "compare_objects", "verify_remote", "without_folder_markers"]

_SPAN_BYTES = 8 << 20  # one range GET of --deep: whole blocks up to this much
_LISTED_BLOCKS = 8  # bad blocks named per object


def _object_problem(name: str, entry: FileEntry, obj: Mapping[str, Any] | None, where: StoreURL) -> Problem | None:
    url = where.object_url(name)
    if obj is None:
        return Problem("missing", f"{url}: missing (the index lists {entry.size:,} bytes)", name)
    if int(obj["size"]) != entry.size:
        return Problem("size", f"{url}: {int(obj['size']):,} bytes, the index says {entry.size:,} (truncated or "
                       "replaced)", name)
    if entry.etag and obj.get("etag") and obj["etag"] != entry.etag:
        return Problem("etag", f"{url}: etag {obj['etag']}, the push recorded {entry.etag} (the object was "
                       "written again since the push: replaced or damaged)", name)
    return None


def without_folder_markers(remote: Remote, listing: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``listing`` without the zero-byte "folder" objects (keys ending in
    ``/``, as the S3 console, rclone and s3fs make them): they hold nothing,
    belong to no one's store and are never deleted. The listing shows such a
    key without its ``/`` (the prefix's own as ``""``), so a zero-byte
    object is asked for by name: a folder's is not there."""
    out = dict(listing)
    for name, obj in listing.items():
        if int(obj["size"]) != 0:
            continue
        if name in ("", ".") or name.endswith("/") or remote.head(name) is None:
            del out[name]
    return out


def compare_objects(index: RemoteIndex, listing: Mapping[str, Mapping[str, Any]], where: StoreURL) -> list[Problem]:
    """The objects of ``index`` (but the manifest, which has no recorded
    etag) that ``listing`` (name -> size and etag, one listing of the
    prefix) shows missing, of another size or with another etag."""
    out = []
    for name, entry in sorted(index.files.items()):
        if name == MANIFEST_FILE:
            continue
        p = _object_problem(name, entry, listing.get(name), where)
        if p is not None:
            out.append(p)
    return out


@dataclass
class RemoteVerifyReport:
    """What ``verify`` found in the bucket at ``url``: ``problems`` (kinds
    ``manifest``, ``index``, ``missing``, ``size``, ``etag``, ``digest``),
    the objects the index does not list (``foreign``), and with ``deep`` the
    blocks checked and found bad, and the objects whose every block matches
    while the whole-file digest does not (``disagreeing``: the index
    disagrees with itself)."""

    url: str
    store_id: str | None = None
    backend: str | None = None  # the manifest's, as it says
    records: int = 0
    slots: int = 0
    index_store_id: str | None = None  # the index's, where it names another store than the manifest
    objects: int = 0
    bytes: int = 0
    deep: bool = False
    problems: list[Problem] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    checked_blocks: int = 0
    bad_blocks: int = 0
    checked_bytes: int = 0
    disagreeing: list[str] = field(default_factory=list)
    seconds: float = 0.0

    _json_extra = ("ok", "damaged", "next")

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged(self) -> list[str]:
        """The objects that differ from the index, by name."""
        return sorted({p.file for p in self.problems if p.file})

    @property
    def next(self) -> str | None:
        """What to do about what was found."""
        if self.ok:
            return None
        if self.index_store_id is not None:  # another store's manifest over this one's index: push refuses it
            return (f"the manifest at the URL is another store's (store_id {self.store_id}) than its index "
                    f"({self.index_store_id}): push the store meant to be here again, replacing what is there: "
                    f"`mmstore push STORE {self.url} --overwrite` (`mmstore verify STORE` it first); readers "
                    "that had the store open open it again")
        if self.disagreeing:  # a push compares the objects with this index and finds them the same
            return disagreeing_index(self.url, "verify the URL again")
        return (f"push the store again from a good copy (`mmstore verify STORE` it first): `mmstore push STORE "
                f"{self.url}` re-uploads the objects that differ from the index and nothing else; readers that "
                "had the store open open it again")

    def summary(self) -> str:
        if self.ok:
            what = f"{self.checked_blocks:,} blocks" if self.deep else "sizes and etags"
            return f"OK: {self.objects} objects match the index ({what})"
        return f"FAILED: {len(self.damaged) or len(self.problems)} object(s) differ from the index"


def _deep(remote: Remote, index: RemoteIndex, names: list[str], rep: RemoteVerifyReport, jobs: int,
          progress: Callable[[int], Any] | None) -> None:
    B = index.block_bytes
    per = max(1, _SPAN_BYTES // B)
    spans = []
    for name in names:
        e = index.files[name]
        n = e.nblocks(B)
        spans += [(name, k, min(n, k + per)) for k in range(0, n, per)]
    bad: dict[str, list[int]] = {}
    whole = {name: xxhash.xxh3_128() for name in names}

    def check(span: tuple[str, int, int]) -> tuple[memoryview, list[int]]:
        name, k0, k1 = span
        e = index.files[name]
        start, end = k0 * B, min(e.size, k1 * B)
        data = remote.get_range(name, start, end)
        wrong = [k for k in range(k0, k1)
                 if block_digest(data[(k - k0) * B:min(len(data), (k - k0 + 1) * B)]) != e.block(k)]
        if progress is not None:
            progress(end - start)
        return data, wrong

    # the spans are hashed whole in their order: a window of them in flight, so that memory stays bounded
    # however slow one of them is
    width = max(1, jobs)
    todo = iter(spans)
    flight: deque[tuple[tuple[str, int, int], Future[tuple[memoryview, list[int]]]]] = deque()
    with Pool(width, "mmstore-verify", threading.Event()) as pool:
        while True:
            while len(flight) < 2 * width:
                span = next(todo, None)
                if span is None:
                    break
                flight.append((span, pool.submit(check, span)))
            if not flight:
                break
            (name, k0, k1), fut = flight.popleft()
            data, wrong = fut.result()
            rep.checked_blocks += k1 - k0
            rep.checked_bytes += len(data)
            whole[name].update(data)
            if wrong:
                bad.setdefault(name, []).extend(wrong)
    for name, h in whole.items():
        if name not in bad and h.hexdigest() != index.files[name].digest:
            rep.disagreeing.append(name)
            rep.problems.append(Problem("digest", f"{remote.loc.object_url(name)}: every block matches the digest "
                                        "the push recorded, the whole object does not match the whole-file digest "
                                        f"it recorded: the bucket's {REMOTE_INDEX_FILE} disagrees with itself "
                                        "(damaged, or written by another tool)", name))
    for name, ks in sorted(bad.items()):
        rep.bad_blocks += len(ks)
        shown = ", ".join(str(k) for k in ks[:_LISTED_BLOCKS]) + (" ..." if len(ks) > _LISTED_BLOCKS else "")
        rep.problems.append(Problem("digest", f"{remote.loc.object_url(name)}: {len(ks):,} of "
                                    f"{index.files[name].nblocks(B):,} blocks ({B:,} bytes each) differ from the "
                                    f"digests the push recorded (block {shown})", name))


def verify_remote(url: str, *, deep: bool = False, jobs: int = 8, progress: Callable[[int], Any] | None = None,
                  on_total: Callable[[int], Any] | None = None) -> RemoteVerifyReport:
    """Check the objects of the store at ``url`` against its remote index.

    Parameters
    ----------
    url
        A store URL (``s3://``, ``gs://``, ``az://``; an ``http(s)://``
        server has no listing: there the index's objects are looked up one
        by one).
    deep
        Also fetch every block of every object of the right size (range
        GETs, ``jobs`` at a time) and check it against its digest.
    progress, on_total
        Called with byte counts of ``deep``'s reads, and once with their total.

    Returns
    -------
    RemoteVerifyReport
        ``ok`` when every object is as the index says; else the problems,
        one per object, and ``next``: what to do.

    Raises
    ------
    RemoteNotFoundError
        No store at ``url`` (no ``manifest.json``): the CLI's exit code 2.
    """
    t0 = time.monotonic()
    loc = parse_url(url)
    remote = Remote(loc)
    rep = RemoteVerifyReport(url=loc.url, deep=deep)
    web = not remote.writable  # http(s): no listing
    listing: dict[str, Any] = {} if web else without_folder_markers(remote, remote.list())
    if web:
        for name in (MANIFEST_FILE, REMOTE_INDEX_FILE):
            got = remote.head(name)
            if got is not None:
                listing[name] = got
    if MANIFEST_FILE not in listing:
        others = sorted(n for n in listing if n != REMOTE_INDEX_FILE)
        if REMOTE_INDEX_FILE in listing:
            raise RemoteNotFoundError(f"{loc.url}: no {MANIFEST_FILE}: a push to this URL did not finish (the "
                                      "manifest goes up last); run it again")
        held = f" (it holds {len(others)} other objects: {', '.join(others[:5])})" if others else ""
        raise RemoteNotFoundError(f"{loc.url}: no store at this URL{held}; check the URL")
    raw_manifest = remote.get_small(MANIFEST_FILE, MANIFEST_MAX_BYTES, listed=int(listing[MANIFEST_FILE]["size"]))
    try:
        manifest = parse_manifest(raw_manifest, loc.object_url(MANIFEST_FILE))
    except FormatError as exc:
        rep.problems.append(Problem("manifest", f"{exc}", MANIFEST_FILE))
        rep.seconds = round(time.monotonic() - t0, 3)
        return rep
    if manifest.get("part_table") is not None:
        from ..remote.replica import remote_parts

        try:
            manifest = remote_parts(remote, manifest)
        except FormatError as exc:
            rep.problems.append(Problem("part-table", f"{exc}", PART_TABLE_FILE))
            rep.seconds = round(time.monotonic() - t0, 3)
            return rep
    rep.store_id = str(manifest.get("store_id"))
    rep.backend = str(manifest.get("backend"))
    rep.records, rep.slots = int(manifest.get("records", 0)), int(manifest.get("slots", 0))
    index = None
    if REMOTE_INDEX_FILE not in listing:
        rep.problems.append(Problem("index", f"{loc.object_url(REMOTE_INDEX_FILE)}: missing", REMOTE_INDEX_FILE))
    else:
        try:
            # no more than a store of this manifest's files can have: sizes before bytes (untrusted)
            raw = remote.get_small(REMOTE_INDEX_FILE, index_max_bytes(manifest, raw_manifest),
                                   listed=int(listing[REMOTE_INDEX_FILE]["size"]))
            index = parse_index(raw, loc.url)
            if index.store_id != rep.store_id:
                rep.index_store_id = index.store_id
                raise FormatError(f"{loc.object_url(MANIFEST_FILE)}: the manifest of store {rep.store_id}, over "
                                  f"the {REMOTE_INDEX_FILE} of store {index.store_id} (replaced, or pushed by two "
                                  "writers at once)")
            index.check_manifest(manifest, raw_manifest, loc.url)
        except FormatError as exc:
            rep.problems.append(Problem("index", str(exc), REMOTE_INDEX_FILE))
            index = None
    if index is None:
        rep.seconds = round(time.monotonic() - t0, 3)
        return rep
    if web:
        for name in index.files:
            if name not in listing:
                got = remote.head(name)
                if got is not None:
                    listing[name] = got
    rep.objects = len(index.files)
    rep.bytes = sum(e.size for e in index.files.values())
    rep.problems += compare_objects(index, listing, loc)
    own = set(index.files) | {REMOTE_INDEX_FILE, PUSH_MARK_FILE}  # the mark: a push under way
    rep.foreign = sorted(n for n in listing if n not in own)
    if deep:
        sized = [n for n, e in sorted(index.files.items())
                 if n != MANIFEST_FILE and n in listing and int(listing[n]["size"]) == e.size]
        if on_total is not None:
            on_total(sum(index.files[n].size for n in sized))
        try:
            _deep(remote, index, sized, rep, jobs, progress)
        except RemoteNotFoundError as exc:  # deleted meanwhile
            rep.problems.append(Problem("missing", str(exc)))
    rep.seconds = round(time.monotonic() - t0, 3)
    return rep
