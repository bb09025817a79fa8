"""The sparse replica: a store in object storage, cached locally block by block.

The cache of a store at a URL is the store's own files, at their own sizes,
under ``CACHE_DIR/<url key>/<push>.<layout>/store/``: a plain local store that a
``Store`` opens as it opens any other, so a read of a cached block is today's
local read (page cache, ``preadv``, O_DIRECT). The small files (manifest,
checksums, keys, index, offsets of encoded fields, an LMDB file, any file of
at most one block) are fetched whole when the replica is made; the record
data files are *sparse*: created at their size with nothing in them, filled
one block (``block_bytes`` of the remote index, 1 MiB by default) at a time
by range GETs, several in flight, each verified against its digest in the
remote index before it is marked present, given back to the file system (a
punched hole) when the cache limit needs the room. From ``s3://`` the bytes
are written into the file as they arrive and hashed on the way (NOTE [the
lean range GET] in :mod:`mmstore.remote.rangeget`), while the block is
still being fetched (NOTE [block states]: nobody reads it); a fetch that
fails, a digest that does not match twice included, punches its blocks'
bytes out again. From other schemes a block is verified first, then written.

``<push>`` is the remote index's identity: a store pushed again at the same
URL has another index, so another replica; the two are never mixed, and the
old one is deleted once no process has it open. ``<layout>`` is the version
of this cache's own bookkeeping (``_LAYOUT``): a cache made by a version that
keeps it otherwise is another directory, dropped the same way.

NOTE [block states]: ``blocks.map`` holds one byte per block of the sparse
files (0 absent, 1 present and verified, 2 being fetched) and ``blocks.use``
its last use (monotonic ns, 1 = consumed: evict first). Both are shared
mappings, so every process on the node sees one state. Who may do what is
decided by open-file-description locks on the block's byte of ``blocks.map``
(``mmstore._os.sparse``), each taken through a descriptor of its own:

* a *fetch* takes the block's lock exclusively (without waiting: a reader
  may hold the block pinned while its batch waits for this fetch; when the
  lock is taken it waits for a shared one instead, which a fetch in progress
  holds off) from before it looks at the state until the verified bytes
  are written and the state is 1, then converts it to shared: a block is
  fetched once however many readers want it, and a block that looks present
  is complete (a fetcher that dies releases its lock with its descriptors;
  a state 2 whose lock is free is stale and reset);
* a *reader* pins the blocks it reads with shared locks (the fetch's own
  shared lock, or a new one after it saw state 1) and releases them once the
  bytes are copied out;
* an *eviction* takes a block's lock exclusively without waiting, so a
  pinned block is never evicted, and never a block being fetched.

NOTE [a complete replica]: an epoch that finds every block present pins
them all with one shared lock over the whole of ``blocks.map`` for as long
as its reads run, and reads as from a local store, with no window pass: no
lock per run of blocks, no hand-over per batch. Nobody can evict a block
meanwhile (an eviction's exclusive lock is refused), so another process
whose cache limit is smaller than the store waits for that epoch's end or
goes over its limit by what is pinned, as with any pin.

NOTE [accounting]: the disk the replica uses is the whole files plus the
present and fetching blocks. ``acct.lock`` holds that sum of the blocks and a
"dirty" word, in a shared mapping, changed only under an ``flock`` of the
same file together with every change of a block between absent and not
absent: the dirty word is set first and cleared last, so a holder killed in
between leaves it set and the next holder counts the states again (they are
the truth; the sum only saves counting them on every fetch). A fetch
reserves its block's bytes first, evicting unpinned blocks, consumed ones
first, then least recently used (from a short list of candidates chosen in
one pass, not a sort of every block per fetch). A fetch the reader waits for
now may go over the limit by what is pinned; a fetch ahead never does (it
waits for the room the reader frees as it consumes).

NOTE [full cache disk]: ``blocks.map`` and ``blocks.use`` are written
through shared mappings, and the first store into a page of a sparse file
on a full file system is a bus error that kills the process. Both tables
are therefore allocated (``posix_fallocate``) when they are made, and again
when a process attaches to a cache made without it: a full disk is an
``ENOSPC`` there, never a signal. A block's bytes are written with
``pwrite``; one refused for lack of space gives back what it wrote (a
punched hole), leaves the block absent and raises ``CacheFullError``, which
names the cache directory, the bytes needed, the ``cache_limit``, and what
to do. The reader process lives on: the same call succeeds once there is
room.

NOTE [crash and power loss]: a block is written with ``pwrite`` and marked
present without ``fsync``: a killed process leaves its written pages in the
page cache, where every later reader finds them. Only a power loss can lose
them, and then the boot id changes: the first open after a reboot checks
every block marked present against its digest and marks the bad ones absent.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .._os.io import atomic_write, fallocate, fmt_bytes, free_bytes, pwrite_all
from .._os.sparse import boot_id, lock_range, punch_hole, unlock_range
from ..errors import (
    CacheFullError,
    CacheSetupError,
    ClaimedSizeError,
    IncompleteStoreError,
    MmstoreError,
    RemoteChecksumError,
    RemoteNotFoundError,
)
from ..format.layout import (
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    PART_TABLE_FILE,
    REMOTE_INDEX_FILE,
)
from ..format.manifest import expand_manifest, parse_manifest, part_table_limit
from .client import Remote
from .index import DIGEST_BYTES, RemoteIndex, block_digest, index_max_bytes, parse_index
from .url import parse_url

__all__ = ["CONSUMED", "KEEP", "Pin", "Replica", "default_cache_dir", "open_replica", "parse_bytes",
           "read_remote_manifest", "remote_parts"]

_FETCH_THREADS = 16
_FETCH_RUN_BYTES = 8 << 20  # one range request fetches up to this many bytes of consecutive blocks
_ABSENT, _PRESENT, _FETCHING = 0, 1, 2
_CONSUMED = 1  # blocks.use of a block the epoch is done with: evicted first
CONSUMED = _CONSUMED
KEEP = np.uint64(2**63)  # minus the window that reads it again: above every monotonic time, kept longest
_ROOM_POLL_S = 0.02
_ACCT_BYTES = 16  # acct.lock: int64 bytes of not-absent blocks, int64 dirty (NOTE [accounting])
_EVICT_CANDIDATES = 256  # the least one pass of eviction picks
# the cache's own layout under cache_dir (not the store format): a replica of
# another layout is another directory, deleted like an old push's
_LAYOUT = 2
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write refused for lack of space (or quota)
_OFFSETS_SUFFIX = ".offsets.npy"  # a variable-size field's offsets file (format.layout.variable_files)
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str | None) -> int | None:
    """A cache limit: bytes as an int, or a size such as ``"200GB"``, ``"1.5GiB"``,
    ``"500M"`` (decimal units; ``Ki``/``Mi``/... binary). None: no limit."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"cache_limit={value!r}: expected a number of bytes or a size like '200GB'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"cache_limit={value!r}: expected a positive number of bytes")
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"cache_limit={value!r}: expected bytes or a size like '200GB', '1.5GiB', '500M'")
    num, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = " kmgtp".index(unit) if unit else 0
    out = int(num * (1024 if binary else 1000) ** power)
    if out <= 0:
        raise ValueError(f"cache_limit={value!r}: expected a positive size")
    return out


def default_cache_dir() -> str:
    """``MMSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mmstore``, else ``~/.cache/mmstore``."""
    env = os.environ.get("MMSTORE_CACHE_DIR")
    if env:
        return os.path.abspath(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "mmstore")


def _sparse_name(name: str, size: int, block_bytes: int) -> bool:
    """A record data file (filled block by block): a field's ``.npy`` or an
    encoded field's ``.bin``, of more than one block; bookkeeping files
    (``_*``), offsets, LMDB files and small files are fetched whole."""
    if size <= block_bytes or name.startswith("_") or name.endswith(".offsets.npy"):
        return False
    return name.endswith((".npy", ".bin"))


def _sparse_blocks(index: RemoteIndex) -> int:
    """The blocks of the files a replica fills block by block."""
    B = index.block_bytes
    return sum(e.nblocks(B) for n, e in index.files.items() if _sparse_name(n, e.size, B))


def _cache_full(home: str, url: str, need: int, limit: int | None, used: int) -> CacheFullError:
    """The error of a cache whose disk is full (NOTE [full cache disk]):
    where, how much was needed, and what to do."""
    cache_dir = os.path.dirname(os.path.dirname(home))
    try:
        free = free_bytes(cache_dir)
    except OSError:
        free = 0
    fits = used + free - (1 << 20)  # what the disk holds for this cache now, less a margin
    smaller = (f"set a cache_limit of at most {fmt_bytes(fits)} (what this disk holds for the cache now), "
               if fits > 0 and (limit is None or fits < limit) else "")
    err = CacheFullError(
        f"{cache_dir}: no space left on the disk of the cache of {url}: {fmt_bytes(need)} more were needed, "
        f"{fmt_bytes(free)} are free, the cache holds {fmt_bytes(used)} "
        f"(cache_limit {'not set' if limit is None else fmt_bytes(limit)}); free space on that disk, "
        f"{smaller}or open the URL with another cache_dir")
    err.errno = errno.ENOSPC
    return err


def read_remote_manifest(remote: Remote) -> tuple[RemoteIndex, dict[str, Any], bytes]:
    """The remote index and the manifest of the store at ``remote``, checked
    against each other; typed errors for a missing or half-pushed store. The
    manifest is read first: the index is read only up to the size a store of
    that manifest's files can give it (:func:`~mmstore.remote.index.index_max_bytes`;
    sizes before bytes: untrusted)."""
    try:
        raw_manifest = remote.get_small(MANIFEST_FILE, MANIFEST_MAX_BYTES)
    except RemoteNotFoundError as exc:
        if remote.head(REMOTE_INDEX_FILE) is not None:
            raise RemoteNotFoundError(
                f"{remote.url}: the store is not complete (no {MANIFEST_FILE} yet): a push is under way or was "
                "stopped: rerun `mmstore push` to finish it") from exc
        remote.list()  # a missing bucket: its own error (client.missing_root), the one every command gives
        raise RemoteNotFoundError(f"{remote.url}: no store at this URL (no {MANIFEST_FILE}): check the prefix, "
                                  "or push one with `mmstore push STORE URL`") from exc
    manifest = remote_parts(remote, parse_manifest(raw_manifest, remote.loc.object_url(MANIFEST_FILE)))
    try:
        raw_index = remote.get_small(REMOTE_INDEX_FILE, index_max_bytes(manifest, raw_manifest))
    except RemoteNotFoundError as exc:
        how = ("push it with `mmstore push STORE URL`" if remote.writable else
               "push it to the bucket this server publishes with `mmstore push STORE s3://...`")
        raise RemoteNotFoundError(
            f"{remote.url}: a store's files are here but no {REMOTE_INDEX_FILE}: it was copied by another tool; "
            f"{how} (which records what a reader verifies)") from exc
    index = parse_index(raw_index, remote.url)
    index.check_manifest(manifest, raw_manifest, remote.url)
    return index, manifest, raw_manifest


def remote_parts(remote: Remote, manifest: dict[str, Any]) -> dict[str, Any]:
    """The (parsed) manifest of the store at ``remote`` with its parts listed
    (:func:`~mmstore.format.manifest.expand_manifest`): a store with a part
    table has it fetched, no more than the size its manifest lists (which
    parsing bounded by what its parts can take), and checked whole (digest,
    every rule). Others are returned as they are."""
    if manifest.get("part_table") is None:
        return manifest
    raw = remote.get_small(PART_TABLE_FILE, part_table_limit(manifest))
    return expand_manifest(manifest, raw, remote.loc.object_url(PART_TABLE_FILE))


class Pin:
    """Shared locks on blocks being read: the blocks stay present until
    :meth:`release` (see NOTE [block states])."""

    __slots__ = ("_replica", "_locks", "_pid", "_whole", "blocks")

    def __init__(self, replica: Replica, locks: list[tuple[int, int, int]], blocks: np.ndarray,
                 whole: bool = False) -> None:
        self._replica = replica
        self._pid = os.getpid()
        self._whole = whole  # every block, by pin_complete
        self._locks = locks  # (fd, first block, count)
        self.blocks = blocks

    def release(self, consumed: bool = False) -> None:
        """Unpin; ``consumed``: this reader is done with the blocks for the
        epoch (they are evicted first)."""
        locks, self._locks = self._locks, []
        r = self._replica
        if self._pid != os.getpid():
            return  # a forked child's copy: the locks are the parent's (its descriptors, shared by fork)
        if self._whole:
            self._whole = False
            with r._mu:
                r._whole_pins -= 1
        if consumed and len(self.blocks):
            r.use[self.blocks] = _CONSUMED
        r.unlock_all(locks)
        if r.cache_limit is not None and r.disk_bytes() > r.cache_limit:
            r.trim()  # a fetch the reads waited for went over the limit: back under it

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self._locks or self._whole:
            try:
                self.release()
            except Exception:  # noqa: BLE001 - a finalizer never raises
                pass


class Replica:
    """The local sparse replica of the store at ``url`` (see the module
    docstring). Made by :func:`open_replica`; picklable (a child process
    re-attaches to the same directory, without the network)."""

    def __init__(self, remote: Remote, index: RemoteIndex, home: str, cache_limit: int | None) -> None:
        self.remote = remote
        self.url = remote.url
        self.index = index
        self.home = home
        self.store_dir = os.path.join(home, "store")
        self.cache_limit = cache_limit
        B = self.block_bytes = index.block_bytes
        names = sorted(n for n, e in index.files.items() if _sparse_name(n, e.size, B))
        self.sparse = names
        self.whole_bytes = sum(e.size for n, e in index.files.items() if n not in names)
        first, sizes, digests = {}, [], []
        g = 0
        for n in names:
            e = index.files[n]
            k = e.nblocks(B)
            first[n] = g
            full = np.full(k, B, dtype=np.int64)
            full[-1] = e.size - (k - 1) * B
            sizes.append(full)
            digests.append(e.blocks)
            g += k
        self.first = first
        self.nblocks = g
        self.sizes = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        self.owner = np.concatenate([np.full(index.files[n].nblocks(B), i, np.int32)
                                     for i, n in enumerate(names)]) if names else np.zeros(0, np.int32)
        self._digests = b"".join(digests)
        self.sparse_bytes = int(self.sizes.sum())
        # the first block of each .npy file holds its header, which every open
        # reads: fetched when the replica is opened and never evicted
        self.sticky = np.array([first[n] for n in names if n.endswith(".npy")], dtype=np.int64)
        self._evictable = np.ones(self.nblocks, dtype=bool)
        self._evictable[self.sticky] = False
        self._attach()

    # -- process-local state ------------------------------------------------------
    def _attach(self) -> None:
        self._pid = os.getpid()
        self._mu = threading.Lock()
        self._fds: list[int] = []
        self._whole_pins = 0
        self._data_fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.fetched_bytes = 0
        self.fetched_blocks = 0
        self.refetched = 0
        self.evicted_blocks = 0
        self.waited_s = 0.0
        self.fetch_counts = np.zeros(self.nblocks, np.uint32)  # fetches of each block by this process
        map_path = os.path.join(self.home, "blocks.map")
        use_path = os.path.join(self.home, "blocks.use")
        n = max(1, self.nblocks)
        self._map_fd = os.open(map_path, os.O_RDWR | os.O_CLOEXEC)
        self._use_fd = os.open(use_path, os.O_RDWR | os.O_CLOEXEC)
        # NOTE [full cache disk]: a cache made before its tables were allocated gets them now
        self._allocate_tables(n)
        self._mm = mmap.mmap(self._map_fd, n)
        self._um = mmap.mmap(self._use_fd, 8 * n)
        self.state = np.frombuffer(self._mm, dtype=np.uint8)[: self.nblocks]
        self.use = np.frombuffer(self._um, dtype=np.uint64)[: self.nblocks]
        self._acct_fd = os.open(os.path.join(self.home, "acct.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if os.fstat(self._acct_fd).st_size < _ACCT_BYTES:
            fcntl.flock(self._acct_fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._acct_fd).st_size < _ACCT_BYTES:
                    os.pwrite(self._acct_fd, struct.pack("<qq", 0, 1), 0)  # dirty: counted on first use
            finally:
                fcntl.flock(self._acct_fd, fcntl.LOCK_UN)
        self._am = mmap.mmap(self._acct_fd, _ACCT_BYTES)
        self._acct_words = np.frombuffer(self._am, dtype="<i8")
        self._cands = np.zeros(0, np.int64)
        self._cand_pos = 0
        self._cand_max_use = 0
        # held shared while this process uses the replica: an old push's
        # replica is deleted only when nobody holds its open.lock
        self._open_fd = os.open(os.path.join(self.home, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._open_fd, fcntl.LOCK_SH)

    def _allocate_tables(self, n: int) -> None:
        try:
            for fd, path, size in ((self._map_fd, "blocks.map", n), (self._use_fd, "blocks.use", 8 * n)):
                fallocate(fd, 0, size, os.path.join(self.home, path))
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            for fd in (self._map_fd, self._use_fd):
                os.close(fd)
            raise _cache_full(self.home, self.url, 9 * n, self.cache_limit, self.whole_bytes) from None

    def _full(self, need: int) -> CacheFullError:
        """The error of a write of ``need`` bytes into the cache refused for
        lack of space (NOTE [full cache disk])."""
        return _cache_full(self.home, self.url, need, self.cache_limit, self.disk_bytes())

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # a forked child: descriptors and locks of its own
            self._attach()

    def __getstate__(self) -> dict[str, Any]:
        return {"remote": self.remote, "index": self.index.raw, "home": self.home, "limit": self.cache_limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        index = parse_index(state["index"], state["remote"].url)
        self.__init__(state["remote"], index, state["home"], state["limit"])  # type: ignore[misc]

    def close(self) -> None:
        """Release this process's descriptors (pins must be released first)."""
        if self._pid != os.getpid():
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in [*self._fds, *self._data_fds.values(), self._acct_fd, self._open_fd, self._map_fd, self._use_fd]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self._data_fds = [], {}

    def identities(self) -> dict[str, tuple[int, int, int, int]]:
        """The sparse files' identities for a ``Store`` over the replica:
        device, inode and size; their modification time changes as blocks
        are written, so it is not part of it (-1)."""
        out = {}
        for name in self.sparse:
            path = os.path.join(self.store_dir, name)
            st = os.stat(path)
            out[path] = (st.st_dev, st.st_ino, st.st_size, -1)
        return out

    # -- facts ----------------------------------------------------------------------
    def present_fraction(self) -> float:
        if self.nblocks == 0:
            return 1.0
        return float(self.sizes[self.state == _PRESENT].sum()) / max(1, self.sparse_bytes)

    def complete(self) -> bool:
        return self.nblocks == 0 or bool(np.all(self.state == _PRESENT))

    def disk_bytes(self) -> int:
        """What the replica's files take by the accounting: whole files +
        present and fetching blocks (NOTE [accounting]; read without the
        lock, so a moment old)."""
        words = self._acct_words
        if words[1]:
            return self.whole_bytes + self._count_blocks()
        return self.whole_bytes + int(words[0])

    def accounting(self) -> dict[str, int]:
        """The accounting as it stands (NOTE [accounting]): ``sum``, the
        running sum of the not-absent blocks' bytes; ``dirty``, 1 while a
        change is under way (or its holder died in it); ``counted``, the same
        bytes counted from the block states now."""
        words = self._acct_words
        return {"sum": int(words[0]), "dirty": int(words[1]), "counted": self._count_blocks()}

    def _count_blocks(self) -> int:
        return int(self.sizes[self.state != _ABSENT].sum())

    def _blocks_bytes_locked(self) -> int:
        """The accounted bytes of not-absent blocks (the caller holds the
        accounting lock); counted again from the states after a holder died
        mid-change."""
        words = self._acct_words
        if words[1]:
            words[0] = self._count_blocks()
            words[1] = 0
        return int(words[0])

    def _mark_locked(self, g: int, state: int, delta: int) -> None:
        """Block ``g`` to ``state`` and its ``delta`` bytes into the sum, as
        one change (the caller holds the accounting lock)."""
        words = self._acct_words
        words[1] = 1
        self.state[g] = state
        words[0] += delta
        words[1] = 0

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url, "cache_dir": os.path.dirname(os.path.dirname(self.home)), "replica": self.home,
            "cache_limit": self.cache_limit, "block_bytes": self.block_bytes, "blocks": self.nblocks,
            "present": round(self.present_fraction(), 4), "disk_bytes": self.disk_bytes(),
            "fetched_bytes": self.fetched_bytes, "fetched_blocks": self.fetched_blocks,
            "refetched_blocks": self.refetched, "evicted_blocks": self.evicted_blocks,
            "waited_s": round(self.waited_s, 3), "remote_retries": self.remote.retried(),
        }

    # -- descriptors --------------------------------------------------------------
    def take_fd(self) -> int:
        """A descriptor of ``blocks.map`` with no locks on it (each lock
        holder needs its own: OFD locks belong to the open file)."""
        self._check_pid()
        with self._mu:
            if self._fds:
                return self._fds.pop()
        return os.open(os.path.join(self.home, "blocks.map"), os.O_RDWR | os.O_CLOEXEC)

    def give_fd(self, fd: int) -> None:
        if self._pid != os.getpid():
            return
        with self._mu:
            self._fds.append(fd)

    def _data_fd(self, name: str) -> int:
        fd = self._data_fds.get(name)
        if fd is None:
            with self._mu:
                fd = self._data_fds.get(name)
                if fd is None:
                    fd = os.open(os.path.join(self.store_dir, name), os.O_RDWR | os.O_CLOEXEC)
                    self._data_fds[name] = fd
        return fd

    def _fetch_pool(self) -> ThreadPoolExecutor:
        self._check_pid()
        pool = self._pool
        if pool is None:
            with self._mu:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="mmstore-fetch")
                pool = self._pool
        return pool

    # -- which blocks -------------------------------------------------------------
    def blocks_of(self, spans: Iterable[tuple[str, np.ndarray, np.ndarray]]) -> np.ndarray:
        """The sorted block numbers that byte ranges ``[starts, ends)`` of
        files (``(name, starts, ends)``; names of files fetched whole are
        ignored) fall in."""
        B = self.block_bytes
        out = []
        for name, starts, ends in spans:
            g0 = self.first.get(name)
            if g0 is None:
                continue
            if len(starts) == 1 and len(ends) == 1:  # one range (one record): in integers
                a0, e0 = int(starts[0]), int(ends[0])
                if e0 > a0:
                    out.append(np.arange(g0 + a0 // B, g0 + (e0 - 1) // B + 1, dtype=np.int64))
                continue
            starts = np.asarray(starts, dtype=np.int64)
            ends = np.asarray(ends, dtype=np.int64)
            keep = ends > starts
            if not keep.all():
                starts, ends = starts[keep], ends[keep]
            if not len(starts):
                continue
            a = starts // B
            b = (ends - 1) // B
            if np.all(a == b):
                out.append(a + g0)
            else:
                lens = b - a + 1
                rep = np.repeat(a, lens)
                offs = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
                out.append(rep + offs + g0)
        if not out:
            return np.zeros(0, np.int64)
        if len(out) == 1 and len(out[0]) <= 1:
            return out[0]
        return np.unique(np.concatenate(out))

    # -- pinning and fetching -----------------------------------------------------
    def acquire(self, blocks: np.ndarray, *, ahead: bool = False, evict: bool = True) -> Pin | None:
        """Make ``blocks`` present and pin them. A reader's acquire (``ahead``
        False) waits for fetches and may go over the limit by what is
        pinned; an acquire ahead of the reads returns None, having pinned
        nothing, when the room is not there yet. ``evict`` False: evict
        nothing to make room (the caller made it, :meth:`evict`)."""
        self._check_pid()
        blocks = np.asarray(blocks, dtype=np.int64)
        locks: list[tuple[int, int, int]] = []
        try:
            absent = self._pin_present(blocks, locks)
            if len(absent):
                if ahead and evict and not self._room_for(absent):
                    self.unlock_all(locks)
                    return None
                pool = self._fetch_pool()
                futs = [pool.submit(self._fetch_run, g, n, evict) for g, n in self._fetch_runs(absent)]
                err: BaseException | None = None
                i = 0
                while i < len(futs):
                    f = futs[i]
                    try:
                        locks.extend(f.result())
                    except BaseException as exc:  # noqa: BLE001 - the first error is raised after all are done
                        err = err or exc
                        if not f.done():
                            # Ctrl-C (or an exit) while waiting: the fetches not started are dropped; those in
                            # flight on the lean path are cut (never waited out), and waited for again
                            for g in futs:
                                g.cancel()
                            if self.remote.abort_reads():
                                continue
                    i += 1
                if err is not None:
                    raise err
        except BaseException:
            self.unlock_all(locks)
            raise
        now = time.monotonic_ns()
        if len(blocks):
            self.use[blocks] = now
        return Pin(self, locks, blocks)

    def pin_complete(self) -> Pin | None:
        """Pin every block with one lock, if every block is present (NOTE
        [a complete replica]); None, having pinned nothing, when one is not."""
        self._check_pid()
        if not self.complete():
            return None
        if self.nblocks:
            fd = self.take_fd()
            lock_range(fd, 0, self.nblocks, shared=True, wait=True)  # waits out an eviction in progress
            locks = [(fd, 0, self.nblocks)]
            if not self.complete():  # a block was evicted before the lock was granted
                self.unlock_all(locks)
                return None
            self.use[:] = time.monotonic_ns()
        with self._mu:
            self._whole_pins += 1
        return Pin(self, locks if self.nblocks else [], np.zeros(0, np.int64), whole=True)

    def pinned_whole(self) -> bool:
        """Whether this process holds every block pinned (:meth:`pin_complete`):
        a read needs no pin of its own then."""
        return self._whole_pins > 0 and self._pid == os.getpid()

    def unlock_all(self, locks: list[tuple[int, int, int]]) -> None:
        """Drop the locks ``(fd, first, count)`` and return their descriptors (once each)."""
        fds: list[int] = []
        for fd, a, n in locks:
            try:
                unlock_range(fd, a, n)
            except OSError:
                pass
            if fd not in fds:
                fds.append(fd)
        for fd in fds:
            self.give_fd(fd)
        locks.clear()

    def _pin_present(self, blocks: np.ndarray, locks: list[tuple[int, int, int]]) -> np.ndarray:
        """Shared-lock the runs of ``blocks`` that are present (one
        descriptor for all: unlocking one run of it leaves the others); the
        blocks still absent once the locks are held."""
        if not len(blocks):
            return blocks
        st = self.state[blocks]
        present = blocks[st == _PRESENT]
        absent = blocks[st != _PRESENT]
        if len(present):
            fd = self.take_fd()
            runs_a, runs_n = _runs(present)
            for a, n in zip(runs_a.tolist(), runs_n.tolist()):
                lock_range(fd, a, n, shared=True, wait=True)  # waits out an eviction or a fetch in progress
                locks.append((fd, a, n))
            gone = present[self.state[present] != _PRESENT]  # evicted before the lock was granted
            if len(gone):
                for g in gone.tolist():
                    unlock_range(fd, g, 1)
                absent = np.union1d(absent, gone)
        return absent

    def _room_for(self, absent: np.ndarray) -> bool:
        """Whether the limit has room for ``absent``'s bytes now (evicting
        unpinned blocks), for a fetch ahead of the reads."""
        if self.cache_limit is None:
            return True
        need = int(self.sizes[absent].sum())
        with self._acct():
            return self._reserve_locked(need, overshoot=False, wait=False)

    def _fetch_runs(self, absent: np.ndarray) -> list[tuple[int, int]]:
        """``absent`` (sorted blocks) as runs ``(first, count)`` of consecutive
        blocks of one file, each at most ``_FETCH_RUN_BYTES`` (NOTE [runs of
        blocks])."""
        if not len(absent):
            return []
        most = max(1, _FETCH_RUN_BYTES // self.block_bytes)
        cut = np.flatnonzero((np.diff(absent) != 1) | (np.diff(self.owner[absent]) != 0)) + 1
        out = []
        for a, b in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(absent)])).tolist()):
            first, n = int(absent[a]), b - a
            parts = -(-n // most)  # pieces of equal length, not a long run and a short rest
            for k in range(parts):
                lo, hi = k * n // parts, (k + 1) * n // parts
                out.append((first + lo, hi - lo))
        return out

    def _fetch_run(self, g0: int, n: int, evict: bool = True) -> list[tuple[int, int, int]]:
        """Fetch the absent blocks ``g0 .. g0 + n - 1`` (consecutive, of one
        file) and pin them; their shared locks ``(fd, g, 1)``.

        NOTE [runs of blocks]: a block is the unit of verification, pinning
        and eviction, but one range request per block costs the client and
        the server as much per request as per byte: consecutive absent blocks
        are fetched with one request of up to ``_FETCH_RUN_BYTES``. The run
        is the longest prefix whose blocks this fetcher locks exclusively at
        once and finds absent (the rule of a single block's fetch, for each);
        each block's bytes are checked against its own digest, and a block
        that does not match is fetched again alone. A block where no such
        prefix starts (present, or locked by another fetch) goes alone
        (:meth:`_fetch`), and the next prefix is tried after it. An error
        releases every block the run pinned before it."""
        got: list[tuple[int, int, int]] = []
        try:
            g, end = g0, g0 + n
            while g < end:
                run = self._fetch_prefix(g, end - g, got, evict) if end - g > 1 else 0
                if run:  # the rest may still come in one request
                    g += run
                    continue
                got.append(self._fetch(g, evict))
                g += 1
        except RemoteNotFoundError as exc:  # an object the index lists is gone from the bucket
            self.unlock_all(got)
            raise self.remote.missing(self.sparse[int(self.owner[g0])], exc) from exc
        except BaseException:
            self.unlock_all(got)  # what this run pinned before the error
            raise
        return got

    def _fetch_prefix(self, g0: int, n: int, got: list[tuple[int, int, int]], evict: bool = True) -> int:
        """The longest prefix of ``g0 .. g0 + n - 1`` this fetcher locks
        exclusively at once and finds absent, fetched with one request and
        pinned into ``got``, if it has two blocks or more; its length (0 when
        nothing was fetched)."""
        fd = self.take_fd()
        run = 0
        for g in range(g0, g0 + n):
            if not lock_range(fd, g, 1, shared=False, wait=False):
                break
            if self.state[g] == _PRESENT:
                unlock_range(fd, g, 1)
                break
            run += 1
        if run < 2:
            if run:
                unlock_range(fd, g0, 1)
            self.give_fd(fd)
            return 0
        try:
            sizes = self.sizes[g0 : g0 + run]
            marked: list[int] = []
            try:
                with self._acct():
                    fresh = [g for g in range(g0, g0 + run) if self.state[g] == _ABSENT]  # else a dead fetcher's
                    if evict:
                        self._reserve_locked(int(self.sizes[fresh].sum()) if fresh else 0, overshoot=True,
                                             wait=False)
                    for g in fresh:
                        self._mark_locked(g, _FETCHING, int(self.sizes[g]))
                        marked.append(g)
                self._fill_run(g0, run, int(sizes.sum()))
            except BaseException:
                with self._acct():
                    for g in marked:
                        self._mark_locked(g, _ABSENT, -int(self.sizes[g]))
                raise
            self.state[g0 : g0 + run] = _PRESENT
            lock_range(fd, g0, run, shared=True, wait=True)  # converts: now pins like any reader's
        except BaseException:
            try:
                unlock_range(fd, g0, run)
            finally:
                self.give_fd(fd)
            raise
        got.extend((fd, g, 1) for g in range(g0, g0 + run))
        return run

    def _fill_run(self, g0: int, run: int, size: int) -> None:
        """Blocks ``g0 .. g0 + run - 1`` (``size`` bytes) in one request; each
        checked against its digest (one that does not match is fetched again
        alone, once), and written only once every one of them matched."""
        name = self.sparse[int(self.owner[g0])]
        etag = self.index.files[name].etag
        start = (g0 - self.first[name]) * self.block_bytes
        if self._land(name, etag, start, size, g0, run):
            return
        data = self.remote.get_range(name, start, start + size, etag)
        B = self.block_bytes
        pieces = []
        again = False
        for i in range(run):
            g, a, b = g0 + i, i * B, min((i + 1) * B, size)
            want = self._digests[g * DIGEST_BYTES : (g + 1) * DIGEST_BYTES]
            piece = data[a:b]
            if block_digest(piece) != want:
                self.refetched += 1
                again = True
                piece, _ = self.remote.get_verified(name, start + a, start + b, etag, want, tries=1)
            pieces.append(piece)
        fd = self._data_fd(name)
        try:
            if not again:
                pwrite_all(fd, data, start)  # the run as it came: one write
            for i, piece in enumerate(pieces if again else ()):
                pwrite_all(fd, piece, start + i * B)
        except OSError as exc:
            raise self._write_failed(exc, fd, start, size) from None
        self.fetched_bytes += size
        self.fetched_blocks += run
        self.fetch_counts[g0 : g0 + run] += 1

    def _fetch(self, g: int, evict: bool = True) -> tuple[int, int, int]:
        """Fetch block ``g`` unless present; return its shared lock ``(fd, g, 1)``.

        The exclusive lock is only ever tried, never waited for: other
        readers may hold the block pinned for as long as their batches take
        (a batch may wait for this very fetch). When the try fails, a shared
        lock is waited for instead (it waits out a fetch or an eviction in
        progress, not the pins); then the block is present, or it is tried
        again."""
        fd = self.take_fd()
        try:
            while True:
                if lock_range(fd, g, 1, shared=False, wait=False):
                    if self.state[g] != _PRESENT:
                        size = int(self.sizes[g])
                        with self._acct():
                            if self.state[g] == _ABSENT:  # else a dead fetcher's block: counted already
                                # never wait for room here, holding the block's lock: a
                                # reader may need this block to make progress. A fetch
                                # ahead checked the room before (Replica.acquire)
                                if evict:
                                    self._reserve_locked(size, overshoot=True, wait=False)
                                self._mark_locked(g, _FETCHING, size)
                        try:
                            self._fill_block(g, size)
                        except BaseException:
                            with self._acct():
                                self._mark_locked(g, _ABSENT, -size)
                            raise
                        self.state[g] = _PRESENT
                    lock_range(fd, g, 1, shared=True, wait=True)  # converts: now a pin like any reader's
                    return (fd, g, 1)
                t0 = time.monotonic()
                lock_range(fd, g, 1, shared=True, wait=True)
                self.waited_s += time.monotonic() - t0
                if self.state[g] == _PRESENT:
                    return (fd, g, 1)
                unlock_range(fd, g, 1)  # a fetch that failed, or an eviction: try again
                time.sleep(0.001)
        except BaseException:
            try:
                unlock_range(fd, g, 1)
            finally:
                self.give_fd(fd)
            raise

    def _fill_block(self, g: int, size: int) -> None:
        name = self.sparse[int(self.owner[g])]
        k = g - self.first[name]
        start = k * self.block_bytes
        want = self._digests[g * DIGEST_BYTES : (g + 1) * DIGEST_BYTES]
        if self._land(name, self.index.files[name].etag, start, size, g, 1):
            return
        try:
            data, again = self.remote.get_verified(name, start, start + size, self.index.files[name].etag, want)
        except RemoteChecksumError:
            self.refetched += 1  # the second fetch was refused too
            raise
        self.refetched += again
        fd = self._data_fd(name)
        try:
            pwrite_all(fd, data, start)
        except OSError as exc:
            raise self._write_failed(exc, fd, start, size) from None
        self.fetched_bytes += size
        self.fetched_blocks += 1
        self.fetch_counts[g] += 1

    def _land(self, name: str, etag: str | None, start: int, size: int, g0: int, run: int) -> bool:
        """Blocks ``g0 .. g0 + run - 1`` (bytes ``[start, start + size)`` of
        file ``name``, the caller holding them in state 2) through the lean
        range GET, written into the file as they arrive and hashed on the way
        (NOTE [the lean range GET] in :mod:`mmstore.remote.rangeget`); a
        block whose digest does not match is fetched again alone, once, then
        ``RemoteChecksumError``. Whatever fails gives back what was written
        (a punched hole): the blocks stay absent, as the caller marks them.
        False, having fetched nothing, where that path does not serve the URL."""
        if self.remote.lean() is None:
            return False
        B = self.block_bytes
        fd = self._data_fd(name)
        full: list[OSError] = []

        def land_at(base: int) -> Any:
            def land(piece: memoryview, offset: int) -> None:
                try:
                    pwrite_all(fd, piece, base + offset)
                except OSError as exc:
                    full.append(exc)
                    raise
            return land

        try:
            got = self.remote.get_range_into(name, start, start + size, etag, B, land_at(start))
            want = self._digests
            for i, digest in enumerate(got or ()):
                g = g0 + i
                if digest == want[g * DIGEST_BYTES : (g + 1) * DIGEST_BYTES]:
                    continue
                self.refetched += 1
                a, b = start + i * B, start + min((i + 1) * B, size)
                again = self.remote.get_range_into(name, a, b, etag, B, land_at(a)) or []
                if again != [want[g * DIGEST_BYTES : (g + 1) * DIGEST_BYTES]]:
                    raise self.remote.damaged(name, a, b)
        except BaseException as exc:
            punch_hole(fd, start, size)  # nothing unverified stays in the file, nor takes its disk
            if full and exc is full[0]:
                raise self._write_failed(full[0], fd, start, size) from None
            raise
        self.fetched_bytes += size
        self.fetched_blocks += run
        self.fetch_counts[g0 : g0 + run] += 1
        return True

    def _write_failed(self, exc: OSError, fd: int, start: int, size: int) -> OSError:
        """The error to raise for a block write that failed: on a full disk
        the pages it did write are given back and a ``CacheFullError`` says
        what to do; any other error as it was."""
        if exc.errno not in _FULL:
            return exc
        punch_hole(fd, start, size)
        return self._full(size)

    # -- accounting ---------------------------------------------------------------
    def _acct(self) -> _AcctLock:
        return _AcctLock(self)

    def _reserve_locked(self, need: int, *, overshoot: bool, wait: bool) -> bool:
        """Make room for ``need`` more bytes under the limit (the caller holds
        the accounting lock). ``overshoot``: go over when the pinned blocks
        leave no room; ``wait``: wait for room (releasing the lock meanwhile);
        else return whether there is room."""
        limit = self.cache_limit
        if limit is None:
            return True
        whole = self.whole_bytes
        while True:
            used = whole + self._blocks_bytes_locked()
            if used + need <= limit:
                return True
            self._evict(used + need - limit)
            if whole + self._blocks_bytes_locked() + need > limit:
                self._clear_stale()  # a fetcher that died may hold room
            if whole + self._blocks_bytes_locked() + need <= limit or overshoot:
                return True
            if not wait:
                return False
            self._acct_release()
            t0 = time.monotonic()
            time.sleep(_ROOM_POLL_S)
            self.waited_s += time.monotonic() - t0
            self._acct_take()

    def evict(self, blocks: np.ndarray) -> int:
        """Give back those of ``blocks`` that are present and not pinned (a
        plan's choice, in its order); the bytes freed."""
        if not len(blocks):
            return 0
        freed = 0
        fd = self.take_fd()
        try:
            with self._acct():
                for g in np.asarray(blocks, dtype=np.int64).tolist():
                    if self.state[g] != _PRESENT or not self._evictable[g]:
                        continue
                    freed += self._evict_block(fd, g)
        finally:
            self.give_fd(fd)
        return freed

    def _evict_block(self, fd: int, g: int) -> int:
        """Give back block ``g`` if it is present and nobody pins it (a reader
        of the cache, or a fetch, holds its lock); the bytes freed (the
        caller holds the accounting lock)."""
        if not lock_range(fd, g, 1, shared=False, wait=False):
            return 0
        try:
            if self.state[g] != _PRESENT:
                return 0
            self._give_back(g)
            self.evicted_blocks += 1
            return int(self.sizes[g])
        finally:
            unlock_range(fd, g, 1)

    def trim(self) -> None:
        """Evict unpinned blocks until the replica is within its limit."""
        if self.cache_limit is not None:
            with self._acct():
                self._reserve_locked(0, overshoot=True, wait=False)

    def _clear_stale(self) -> None:
        """Blocks left in state 2 by a fetcher that died (its lock is free)."""
        stale = np.flatnonzero(self.state == _FETCHING)
        if not len(stale):
            return
        fd = self.take_fd()
        try:
            for g in stale.tolist():
                if lock_range(fd, g, 1, shared=False, wait=False):
                    try:
                        if self.state[g] == _FETCHING:
                            self._give_back(g)
                    finally:
                        unlock_range(fd, g, 1)
        finally:
            self.give_fd(fd)

    def _evict(self, free: int) -> None:
        """Give back at least ``free`` bytes of unpinned present blocks,
        consumed and least recently used first (the caller holds the
        accounting lock)."""
        fd = self.take_fd()
        freed = 0
        try:
            for fresh in (False, True):
                if fresh or self._cand_pos >= len(self._cands):
                    self._pick_candidates(free - freed)
                cands, use = self._cands, self.use
                pos, top = self._cand_pos, self._cand_max_use
                while pos < len(cands) and freed < free:
                    g = int(cands[pos])
                    pos += 1
                    if self.state[g] != _PRESENT or int(use[g]) > top:
                        continue  # gone, or used again since it was picked
                    freed += self._evict_block(fd, g)
                self._cand_pos = pos
                if freed >= free:
                    return
        finally:
            self.give_fd(fd)

    def _pick_candidates(self, free: int) -> None:
        """The next blocks to evict, in order: the unpinned-or-not present
        blocks of least last use (consumed ones first), enough for ``free``
        bytes and at least ``_EVICT_CANDIDATES`` (one pass over the states,
        a sort of the few picked)."""
        present = np.flatnonzero((self.state == _PRESENT) & self._evictable)
        k = max(_EVICT_CANDIDATES, 2 * (free // max(1, self.block_bytes) + 1))
        use = self.use[present]
        if k < len(present):
            part = np.argpartition(use, k - 1)[:k]
            present, use = present[part], use[part]
        order = np.argsort(use, kind="stable")
        self._cands = present[order]
        self._cand_pos = 0
        self._cand_max_use = int(use[order[-1]]) if len(order) else 0

    def _give_back(self, g: int) -> None:
        """Block ``g`` absent, its disk given back (the caller holds its lock
        and the accounting lock)."""
        self._mark_locked(g, _ABSENT, -int(self.sizes[g]))
        name = self.sparse[int(self.owner[g])]
        start = (g - self.first[name]) * self.block_bytes
        size = int(self.sizes[g])
        fd = self._data_fd(name)
        if not punch_hole(fd, start, size):
            os.pwrite(fd, bytes(size), start)  # no holes here: at least no stale bytes stay (disk is not freed)

    def _acct_take(self) -> None:
        fcntl.flock(self._acct_fd, fcntl.LOCK_EX)

    def _acct_release(self) -> None:
        fcntl.flock(self._acct_fd, fcntl.LOCK_UN)

    # -- the whole store ----------------------------------------------------------
    def verify_present(self) -> int:
        """Check every present block against its digest; mark bad ones
        absent. Returns how many were bad."""
        bad = 0
        fd_lock = self.take_fd()
        try:
            for g in np.flatnonzero(self.state == _PRESENT).tolist():
                if not lock_range(fd_lock, g, 1, shared=False, wait=False):
                    continue
                try:
                    name = self.sparse[int(self.owner[g])]
                    start = (g - self.first[name]) * self.block_bytes
                    data = os.pread(self._data_fd(name), int(self.sizes[g]), start)
                    if block_digest(data) != self._digests[g * DIGEST_BYTES : (g + 1) * DIGEST_BYTES]:
                        with self._acct():
                            self._give_back(g)
                        bad += 1
                finally:
                    unlock_range(fd_lock, g, 1)
        finally:
            self.give_fd(fd_lock)
        return bad

    def fill(self, blocks: Sequence[int] | np.ndarray | None = None) -> None:
        """Fetch ``blocks`` (default: all) ahead, in order, as the limit allows."""
        todo = np.arange(self.nblocks) if blocks is None else np.asarray(blocks, dtype=np.int64)
        step = 64
        for a in range(0, len(todo), step):
            pin = self.acquire(todo[a : a + step])
            if pin is not None:
                pin.release(consumed=self.cache_limit is not None)


class _AcctLock:
    """The accounting lock: this process's threads, then other processes."""

    def __init__(self, replica: Replica) -> None:
        self.r = replica

    def __enter__(self) -> None:
        self.r._check_pid()
        _ACCT_THREADS.acquire()
        try:
            self.r._acct_take()
        except BaseException:
            _ACCT_THREADS.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.r._acct_release()
        finally:
            _ACCT_THREADS.release()


_ACCT_THREADS = threading.Lock()


def _new_locks_after_fork() -> None:
    # a fork while another thread held the lock would leave it held for ever in the child
    global _ACCT_THREADS
    _ACCT_THREADS = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


def _runs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``blocks`` as runs: (first, count) arrays."""
    if len(blocks) <= 1:
        return blocks, np.ones(len(blocks), np.int64)
    cut = np.flatnonzero(np.diff(blocks) != 1) + 1
    firsts = blocks[np.concatenate(([0], cut))]
    counts = np.diff(np.concatenate(([0], cut, [len(blocks)])))
    return firsts, counts


# -- making and opening replicas -----------------------------------------------------

def _url_key(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:24]


def open_replica(url: str, *, cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | str | None = None) -> Replica:
    """The replica of the store at ``url`` under ``cache_dir`` (made, or
    re-used when this push is cached already; a replica of an older push of
    the same URL is deleted once no process has it open)."""
    limit = parse_bytes(cache_limit)
    loc = parse_url(url)
    remote = Remote(loc)
    index, manifest, raw_manifest = read_remote_manifest(remote)
    root = os.path.abspath(os.fspath(cache_dir)) if cache_dir is not None else default_cache_dir()
    base = os.path.join(root, _url_key(loc.url))
    home = os.path.join(base, f"{index.identity[:24]}.{_LAYOUT}")
    whole = sum(e.size for n, e in index.files.items()
                if not _sparse_name(n, e.size, index.block_bytes))
    if limit is not None and whole + index.block_bytes > limit:
        raise ValueError(
            f"{loc.url}: cache_limit {fmt_bytes(limit)} is below what the cache needs at least: "
            f"{fmt_bytes(whole)} of files fetched whole (manifest, checksums, keys, offsets, LMDB files) plus "
            f"one block of {fmt_bytes(index.block_bytes)}; raise the limit")
    try:
        os.makedirs(base, exist_ok=True)
        _make(remote, index, raw_manifest, home)
    except MmstoreError:
        raise  # typed already (a request to the bucket, a claimed size)
    except OSError as exc:
        if exc.errno not in _FULL:
            raise _setup_failed(exc, home, loc.url) from exc
        raise _cache_full(home, loc.url, whole + 9 * _sparse_blocks(index), limit, 0) from None
    replica = Replica(remote, index, home, limit)
    try:
        _check_boot(replica)
        pin = replica.acquire(replica.sticky)  # the .npy headers, which the open reads
        if pin is not None:
            pin.release()
    except BaseException:
        replica.close()
        raise
    _drop_old(base, home)
    return replica


def _setup_failed(exc: OSError, home: str, url: str) -> CacheSetupError:
    """The typed error of a cache whose files could not be created."""
    what = f"{exc.filename}: " if exc.filename else ""
    err = CacheSetupError(
        f"{home}: cannot create the cache of {url}: {what}{exc.strerror or exc}; open the URL with another "
        "cache_dir (or MMSTORE_CACHE_DIR) on a file system that can hold the store and that you may write")
    err.errno = exc.errno
    return err


def _make(remote: Remote, index: RemoteIndex, raw_manifest: bytes, home: str) -> None:
    """Create the replica directory once (under its setup lock)."""
    os.makedirs(home, exist_ok=True)
    lock_fd = os.open(os.path.join(home, "setup.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(home, "ready")):
            return
        try:
            _setup(remote, index, raw_manifest, home)
        except OSError as exc:
            if exc.errno in _FULL:
                _unmake(home)  # what the setup wrote: given back to the full disk
            raise
    finally:
        os.close(lock_fd)


def _setup(remote: Remote, index: RemoteIndex, raw_manifest: bytes, home: str) -> None:
    """The files of a new replica (the caller holds its setup lock)."""
    store = os.path.join(home, "store")
    if os.path.isdir(store):
        shutil.rmtree(store)  # a setup that was killed: start it over
    os.makedirs(store)
    B = index.block_bytes
    sparse = sorted(n for n, e in index.files.items() if _sparse_name(n, e.size, B))
    nblocks = sum(index.files[n].nblocks(B) for n in sparse)
    for name in {os.path.dirname(n) for n in index.files if "/" in n}:
        os.makedirs(os.path.join(store, name), exist_ok=True)  # a store with parts (format.py)
    whole = [n for n in index.files if n not in sparse and n != MANIFEST_FILE]
    # the offsets files first: they give the size of each file of entries of any size, checked before it is made
    offsets = [n for n in whole if _offsets_of(n) is not None]
    _fetch_files(remote, index, store, offsets)
    for name in offsets:
        _check_entries_size(remote.url, index, store, name)
    for table, size in (("blocks.map", max(1, nblocks)), ("blocks.use", 8 * max(1, nblocks))):
        with open(os.path.join(home, table), "wb") as f:
            fallocate(f.fileno(), 0, size, f.name)  # NOTE [full cache disk]
    for name in sparse:
        with open(os.path.join(store, name), "wb") as f:
            f.truncate(index.files[name].size)
    _fetch_files(remote, index, store, [n for n in whole if n not in offsets])
    atomic_write(os.path.join(store, MANIFEST_FILE), raw_manifest)
    atomic_write(os.path.join(home, "remote.json"), index.raw)
    atomic_write(os.path.join(home, "ready"), json.dumps({"url": remote.url, "boot": boot_id()}).encode())


def _fetch_files(remote: Remote, index: RemoteIndex, store: str, names: list[str]) -> None:
    """Fetch the files ``names`` whole into ``store``, several at once."""
    if not names:
        return
    pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="mmstore-fetch")
    try:
        futs: list[Future[None]] = [pool.submit(_fetch_whole, remote, index, n, os.path.join(store, n))
                                    for n in names]
        for fut in futs:
            fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _offsets_of(name: str) -> str | None:
    """The file of entries whose offsets file is ``name`` (format.py: a
    variable-size field's ``.bin``, the keys), or None."""
    base, _, file = name.rpartition("/")
    where = base + "/" if base else ""
    if file == KEYS_OFFSETS_FILE:
        return where + KEYS_BLOB_FILE
    if file.endswith(_OFFSETS_SUFFIX):
        return where + file[: -len(_OFFSETS_SUFFIX)] + ".bin"
    return None


def _check_entries_size(url: str, index: RemoteIndex, store: str, name: str) -> None:
    """The file of entries of offsets file ``name`` (fetched, verified) is
    the size its last offset gives (format.py), before it is made:
    ``ClaimedSizeError`` otherwise. A file no offsets give (a claimed size
    the schema allows) is left to the store's own checks at open."""
    data = _offsets_of(name)
    entry = index.files.get(data) if data is not None else None
    if data is None or entry is None:
        return
    with open(os.path.join(store, name), "rb") as f:
        f.seek(-8, os.SEEK_END)
        last = int.from_bytes(f.read(8), "little")
    if entry.size != last:
        raise ClaimedSizeError(
            f"{url}: {data}: the store claims {fmt_bytes(entry.size)} ({entry.size:,} bytes), its {name} gives "
            f"{last:,} bytes; nothing was created: the store at this URL is damaged or was not written by mmstore: "
            "push it again from a good copy", name=data, claimed=entry.size, expected=last)


def _unmake(home: str) -> None:
    """Remove what a setup that failed wrote (the next one starts over)."""
    shutil.rmtree(os.path.join(home, "store"), ignore_errors=True)
    for table in ("blocks.map", "blocks.use"):
        try:
            os.unlink(os.path.join(home, table))
        except OSError:
            pass


def _fetch_whole(remote: Remote, index: RemoteIndex, name: str, path: str) -> None:
    """Fetch file ``name`` whole into ``path``, block by block, each verified."""
    e = index.files[name]
    B = index.block_bytes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        # written in order from its first byte, never made at the size the index claims first: a claim
        # no object bears out fails at its first short block, having written only what arrived
        for k in range(e.nblocks(B)):
            a, b = k * B, min(e.size, (k + 1) * B)
            try:
                data = remote.get_verified(name, a, b, e.etag, e.block(k))[0]
            except RemoteNotFoundError as exc:  # an object the index lists is gone from the bucket
                raise remote.missing(name, exc) from exc
            pwrite_all(fd, data, a)
    finally:
        os.close(fd)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        got = json.loads(f.read())
    if not isinstance(got, dict):
        raise ValueError(f"{path}: not a JSON object")
    return got


def _check_boot(replica: Replica) -> None:
    """After a reboot, blocks marked present may never have reached the disk:
    check them (NOTE [crash and power loss])."""
    ready = os.path.join(replica.home, "ready")
    try:
        info = _read_json(ready)
    except (OSError, ValueError):
        raise IncompleteStoreError(f"{replica.home}: the cache entry is damaged (no readable 'ready'); "
                                   "delete this directory and open the URL again") from None
    now = boot_id()
    if info.get("boot") == now or not now:
        return
    lock_fd = os.open(os.path.join(replica.home, "setup.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        info = _read_json(ready)
        if info.get("boot") != now:
            replica.verify_present()
            # the files fetched whole were written without fsync too
            for name, e in replica.index.files.items():
                if name in replica.first or name == MANIFEST_FILE:
                    continue
                path = os.path.join(replica.store_dir, name)
                try:
                    with open(path, "rb") as f:
                        ok = all(block_digest(f.read(replica.block_bytes)) == e.block(k)
                                 for k in range(e.nblocks(replica.block_bytes)))
                except OSError:
                    ok = False
                if not ok:
                    _fetch_whole(replica.remote, replica.index, name, path)
            info["boot"] = now
            atomic_write(ready, json.dumps(info).encode())
    finally:
        os.close(lock_fd)


def _drop_old(base: str, keep: str) -> None:
    """Delete replicas of older pushes of this URL that nobody has open."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for n in names:
        path = os.path.join(base, n)
        if path == keep or not os.path.isdir(path):
            continue
        try:
            fd = os.open(os.path.join(path, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue
            raise
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


