"""WebDataset tar shards in object storage: naming them, reading them by large ranges, and the saved index.

The source itself (samples, fields, holes) is :mod:`mmstore.ingest.webdataset`;
this module holds what differs when its shards are URLs.

* :func:`expand_urls` turns a pattern of URLs into shard objects, each with
  its size and etag, before any work: one listing of the folder the shards
  share (``s3://``, ``gs://``, ``az://``), or one ``HEAD`` per shard
  (``http(s)://``, which cannot be listed, and where globs are refused).
* :class:`RangeReader` serves the tar walk of the index from ranged GETs of
  :data:`WINDOW` bytes, so indexing a shard costs about its size divided by
  :data:`WINDOW` requests.
* :class:`Windows` serves the workers: the members of consecutive samples of
  one shard come from one ranged GET of at most :data:`WINDOW` bytes (more
  only for a single sample larger than that), never beyond the slot range
  the worker was given, so a worker holds at most one window in memory.
* :func:`save_index` / :func:`load_index`: the index of every shard, kept in
  ``DEST.partial`` so that a resumed ingest reads no byte of a shard whose
  records are committed (a shard whose size or etag changed is indexed again,
  and then the run's fingerprint refuses the resume).
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import posixpath
import zipfile
from array import array
from typing import Any

import numpy as np
import xxhash

from .._os.io import atomic_write
from ..errors import RemoteChangedError, RemoteError, SourceError
from ..remote.url import StoreURL, parse_url

__all__ = ["INDEX_FILE", "WINDOW", "IndexLog", "RangeReader", "ShardObjects", "Windows", "expand_urls", "load_index",
           "save_index"]

WINDOW = 8 << 20  # bytes of one ranged GET (index walk and worker reads)
INDEX_FILE = "_webdataset_index.npz"  # in DEST.partial; removed when the store is published
HEAD_THREADS = 16
LISTED = ("s3", "gs", "az", "azure", "abfs", "abfss")


class ShardObjects:
    """The shard objects of one pattern: a :class:`~mmstore.remote.client.Remote`
    of the folder they share, each shard's name under it, size and etag."""

    def __init__(self, remote: Any, folder_url: str, names: list[str], sizes: list[int],
                 etags: list[str | None]) -> None:
        self.remote, self.folder_url, self.names, self.sizes, self.etags = remote, folder_url, names, sizes, etags

    def url(self, k: int) -> str:
        return f"{self.folder_url}/{self.names[k]}"


def _split(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of an object URL (checked as a store URL is; a ``?`` is a glob
    character here, not the start of a query)."""
    loc = parse_url(url.replace("?", "%3F"))
    return loc.scheme, loc.bucket, loc.prefix


def _remote(scheme: str, bucket: str, folder: str) -> tuple[Any, str]:
    from ..remote.client import Remote

    url = f"{scheme}://{bucket}" + (f"/{folder}" if folder else "")
    return Remote(StoreURL(scheme, bucket, folder, url)), url


def expand_urls(pattern: str, names: list[str]) -> ShardObjects:
    """The shard objects that ``names`` (``pattern``'s brace expansion) name.

    Raises
    ------
    SourceError
        Shards in more than one bucket, a glob over ``http(s)://``, a glob
        that matches nothing, shards that do not exist.
    RemoteError
        The bucket does not exist, the credentials are refused, the server
        cannot be reached (its typed kinds).
    """
    parts = [_split(n) for n in names]
    places = {(s, b) for s, b, _ in parts}
    if len(places) > 1:
        raise SourceError(f"{pattern}: names shards in {len(places)} buckets; ingest each bucket's shards "
                          "separately and merge the stores (mmstore merge)")
    scheme, bucket = parts[0][0], parts[0][1]
    magic = any(_has_magic(k) for _, _, k in parts)
    if magic and scheme not in LISTED:
        raise SourceError(f"{pattern}: a glob needs a listing, and an {scheme}:// server cannot be listed: name "
                          "the shards with a brace range instead ('https://HOST/shards/{00000..00099}.tar')")
    fixed = [k for _, _, k in parts]
    folder = posixpath.commonpath([posixpath.dirname(_literal_dir(k)) for k in fixed])
    remote, folder_url = _remote(scheme, bucket, folder)
    rel = [posixpath.relpath(k, folder) if folder else k for k in fixed]
    found: dict[str, tuple[int, str | None]] = {}
    if scheme in LISTED:
        for name, info in remote.list().items():
            found[name] = (int(info["size"]), info.get("etag"))
    out: list[str] = []
    seen: set[str] = set()
    missing: list[str] = []
    heads: list[str] = []
    for r in rel:
        if _has_magic(r):
            depth = r.count("/")
            hits = sorted((n for n in found if n.count("/") == depth and fnmatch.fnmatchcase(n, r)),
                          key=lambda n: n.encode("utf-8", "surrogateescape"))
            if not hits:
                raise SourceError(f"{pattern}: the glob {folder_url}/{r} matches no object; check the pattern "
                                  "(quote it so that the shell does not expand it)")
        else:
            hits = [r]
            if scheme in LISTED and r not in found:
                missing.append(r)
                continue
            if scheme not in LISTED:
                heads.append(r)
        for h in hits:
            if h not in seen:
                seen.add(h)
                out.append(h)
    if heads:
        from concurrent.futures import ThreadPoolExecutor  # not at import: `import mmstore` stays light

        with ThreadPoolExecutor(min(HEAD_THREADS, len(heads))) as ex:
            infos = list(ex.map(remote.head, heads))
        for h, info in zip(heads, infos):
            if info is None:
                missing.append(h)
            else:
                found[h] = (int(info["size"]), info.get("etag"))
    if missing:
        raise SourceError(f"{pattern}: {len(missing):,} shard(s) it names do not exist (the first: "
                          f"{folder_url}/{missing[0]}); nothing was created: fix the pattern's range or upload the "
                          "missing shards")
    out = [n for n in out if n in found]
    if not out:
        raise SourceError(f"{pattern}: names no shard")
    return ShardObjects(remote, folder_url, out, [found[n][0] for n in out], [found[n][1] for n in out])


def _has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def _literal_dir(key: str) -> str:
    """``key`` up to the last ``/`` before its first glob character (a glob's folder is listed)."""
    first = min((key.find(c) for c in "*?[" if c in key), default=-1)
    if first < 0:
        return key
    return key[:key.rfind("/", 0, first) + 1] + "x"


class RangeReader:
    """``read(size, offset)`` of one object, served from ranged GETs of
    :data:`WINDOW` bytes (the tar walk reads headers front to back)."""

    def __init__(self, remote: Any, name: str, end: int, etag: str | None) -> None:
        self.remote, self.name, self.end, self.etag = remote, name, end, etag
        self.start = 0
        self.data: memoryview = memoryview(b"")
        self.gets = 0

    def __call__(self, size: int, offset: int) -> bytes:
        if not (self.start <= offset and offset + size <= self.start + len(self.data)):
            stop = min(self.end, max(offset + size, offset + WINDOW))
            if stop <= offset:
                return b""
            self.data = self.remote.get_range(self.name, offset, stop, self.etag)
            self.start = offset
            self.gets += 1
        a = offset - self.start
        return bytes(self.data[a:a + size])


class Windows:
    """The worker side: member bytes from one window of consecutive samples.

    ``lo``/``hi`` are each sample's first and last byte in its shard (-1 for
    a sample with no member), ``shard`` its shard number.
    """

    def __init__(self, objects: ShardObjects, shard: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        self.objects, self.shard, self.lo, self.hi = objects, shard, lo, hi
        self.limit = len(shard)  # the end of the slot range being read (prepare)
        self.key = -1
        self.start = 0
        self.data: memoryview = memoryview(b"")

    def prepare(self, a: int, b: int) -> None:
        """Inputs ``a..b`` are read next, in order: no window reaches past ``b``."""
        self.limit = b
        self.key, self.data = -1, memoryview(b"")

    def read(self, i: int, off: int, size: int) -> memoryview:
        k = int(self.shard[i])
        if k == self.key and self.start <= off and off + size <= self.start + len(self.data):
            a = off - self.start
            return self.data[a:a + size]
        start = off if self.lo[i] < 0 else min(off, int(self.lo[i]))
        stop = off + size
        if int(self.hi[i]) - start <= WINDOW:  # the sample's other members come from the same GET
            stop = max(stop, int(self.hi[i]))
        j = i + 1
        limit = min(self.limit, len(self.shard)) if self.limit > i else len(self.shard)
        while j < limit and int(self.shard[j]) == k:
            h = int(self.hi[j])
            if h >= 0:
                if h - start > WINDOW:
                    break
                stop = max(stop, h)
            j += 1
        obj = self.objects
        self.data = memoryview(b"")  # the old window goes before the new one comes
        try:
            self.data = obj.remote.get_range(obj.names[k], start, stop, obj.etags[k])
        except RemoteChangedError as exc:  # stops the run (a RemoteError), never a hole per sample
            raise RemoteError(f"{obj.url(k)}: the shard changed since the ingest indexed it ({exc}); rerun the "
                              "ingest with --overwrite (a resume refuses the changed shard)") from exc
        self.key, self.start = k, start
        return self.data[off - start:off - start + size]


# -- the saved index ------------------------------------------------------------------------------


class IndexLog:
    """The walks of the shards, in shard order, as compact arrays (what :func:`save_index` writes)."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.blob = bytearray()
        self.name_end = array("q")
        self.offs = array("q")
        self.sizes = array("q")
        self.shards: list[dict[str, Any]] = []

    def add(self, name: str, size: int, etag: str | None, walk: tuple[list[tuple[bytes, int, int]], Any, int]) -> None:
        members, problem, skipped = walk
        self.counts.append(len(members))
        for n, o, s in members:
            self.blob += n
            self.name_end.append(len(self.blob))
            self.offs.append(o)
            self.sizes.append(s)
        p = None if problem is None else [problem.reason, problem.offset,
                                          None if problem.name is None else problem.name.hex()]
        self.shards.append({"name": name, "size": size, "etag": etag, "skipped": skipped, "problem": p})


def save_index(path: str, folder_url: str, log: IndexLog, extra: dict[str, Any]) -> None:
    """Write the shards' walks of ``log`` to ``path`` atomically."""
    meta = json.dumps({"version": 1, "folder": folder_url, "shards": log.shards, **extra}).encode()
    arrays: dict[str, np.ndarray] = {
        "counts": np.array(log.counts, np.int64), "offs": np.frombuffer(log.offs, np.int64),
        "sizes": np.frombuffer(log.sizes, np.int64), "name_end": np.frombuffer(log.name_end, np.int64),
        "blob": np.frombuffer(bytes(log.blob), np.uint8), "meta": np.frombuffer(meta, np.uint8)}
    buf = io.BytesIO()
    files: dict[str, Any] = {"digest": np.frombuffer(_digest(arrays), np.uint8), **arrays}
    np.savez(buf, **files)
    atomic_write(path, buf.getvalue())


def _digest(arrays: dict[str, np.ndarray]) -> bytes:
    """A digest of the saved arrays: a file damaged in a way its zip format does not catch is not used."""
    h = xxhash.xxh3_128()
    for name in _ARRAYS:
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode() + a.dtype.str.encode() + np.int64(a.size).tobytes())
        h.update(a.tobytes())
    return h.digest()


_ARRAYS = ("counts", "offs", "sizes", "name_end", "blob", "meta")


def load_index(path: str, objects: ShardObjects, make_problem: Any) -> tuple[list[Any], dict[str, Any]] | None:
    """The walks saved at ``path`` when they are of exactly these shard
    objects (names, sizes, etags), else None. The file is checked as
    untrusted: anything inconsistent is ignored (the shards are indexed again)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:  # read here: np.load leaves the file open when the zip is damaged
            raw = fh.read()
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            arrays = {name: z[name] for name in _ARRAYS}
            digest = z["digest"].tobytes()
        if digest != _digest(arrays):
            return None
        counts, offs, sizes = arrays["counts"], arrays["offs"], arrays["sizes"]
        name_end, blob, meta_raw = arrays["name_end"], arrays["blob"], arrays["meta"]
        meta = json.loads(meta_raw.tobytes())
        shards = meta["shards"]
        if meta.get("version") != 1 or meta.get("folder") != objects.folder_url or len(shards) != len(objects.names):
            return None
        for k, sh in enumerate(shards):
            if (sh["name"], sh["size"], sh["etag"]) != (objects.names[k], objects.sizes[k], objects.etags[k]):
                return None
        n = int(counts.sum()) if len(counts) else 0
        if counts.dtype != np.int64 or len(counts) != len(shards) or (counts < 0).any():
            return None
        if len(offs) != n or len(sizes) != n or len(name_end) != n:
            return None
        if n and (int(name_end[-1]) != len(blob) or int(name_end[0]) < 0 or (np.diff(name_end) < 0).any()):
            return None
        names = blob.tobytes()
        walks = []
        at = 0
        start = 0
        for k, sh in enumerate(shards):
            members = []
            for j in range(at, at + int(counts[k])):
                end = int(name_end[j])
                o, s = int(offs[j]), int(sizes[j])
                if not (0 <= o and 0 <= s and o + s <= objects.sizes[k]):
                    return None
                members.append((names[start:end], o, s))
                start = end
            at += int(counts[k])
            p = sh["problem"]
            problem = None if p is None else make_problem(str(p[0]), int(p[1]),
                                                          None if p[2] is None else bytes.fromhex(p[2]))
            walks.append((members, problem, int(sh["skipped"])))
        extra = {k: v for k, v in meta.items() if k not in ("version", "folder", "shards")}
        return walks, extra
    except (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, NotImplementedError,
            zipfile.BadZipFile):
        return None

