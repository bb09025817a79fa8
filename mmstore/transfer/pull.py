"""``pull``: download a store from a URL into a local directory, verified.

The store is written into ``DEST.partial`` (under the writer lock of DEST,
as an ingest is) block by block, ``jobs`` range GETs in flight, each block
checked against its digest in the remote index before it is written; then
every file's whole digest is checked, the manifest is written last, every
record's checksum is verified (``verify_store``), and ``DEST.partial`` is
published as ``DEST`` (format.py, "Replacing a store"); a store replaced
there may hold nothing its manifest does not list (``check_dest``). Every
request runs on a daemon thread, so a Ctrl-C or SIGTERM stops the pull at
once, even while a request is stalled (NOTE [stopping a transfer] in
mmstore/_os/threads.py); the rerun resumes it.

NOTE [resuming a pull]: ``DEST.partial`` holds, beside the store's files,
``_pull.json`` (which push of which URL it is a copy of) and ``_pull.blocks``
(a byte per block: 1 once the block is written). A rerun after a kill keeps
the blocks marked done and fetches the rest; a partial of another push, or
one whose files or ``_pull.blocks`` are not all there at their sizes, is
started over. A kill leaves written pages in the page cache, so a block
marked done is there for the rerun; the files are fsynced before the
manifest is written. A power loss may still lose pages of blocks marked
done: a file whose whole digest then differs is checked block by block
against the push's digests, and the blocks that differ are fetched again in
the same run. A file whose every block matches while the whole does not
means the bucket's index disagrees with itself: a typed error that says
how to repair the bucket (and a rerun says the same, never a bare
``FileNotFoundError``).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from .._os.io import (
    atomic_write,
    check_space,
    describe_write_error,
    fmt_bytes,
    free_bytes,
    fsync_dir,
    fsync_file,
    pwrite_all,
)
from .._os.lock import acquire_lock, release_lock
from .._os.threads import Pool, Stopped, call, wait_all
from ..errors import (
    ChecksumError,
    DestinationError,
    MmstoreError,
    RemoteChecksumError,
    RemoteNotFoundError,
    ResourceLimitError,
    StoreExistsError,
    spell_option,
)
from ..format.layout import MANIFEST_FILE, PARTIAL_SUFFIX, REMOTE_INDEX_FILE
from ..format.manifest import read_manifest
from ..remote.client import Remote
from ..remote.index import RemoteIndex, block_digest, disagreeing_index
from ..remote.replica import read_remote_manifest
from ..remote.url import local_dest, parse_url
from ..store.dest import PARTIAL_MARK, check_dest, is_own_partial, is_store, make_partial
from ..store.writer import publish

__all__ = ["pull"]

_STATE = "_pull.json"
_BLOCKS = "_pull.blocks"
_READ_BYTES = 8 << 20
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # a write refused for lack of space (or quota)


def _resumable(partial: str, identity: dict[str, str], index: RemoteIndex, marks_bytes: int) -> bool:
    """``partial`` is a pull of this push with everything a rerun needs:
    its state, ``_pull.blocks`` and every file at its size (NOTE [resuming
    a pull]); else it is started over."""
    try:
        with open(os.path.join(partial, _STATE), "rb") as f:
            if json.loads(f.read()) != identity:
                return False
        if os.stat(os.path.join(partial, _BLOCKS)).st_size != marks_bytes:
            return False
        for n, e in index.files.items():
            if n != MANIFEST_FILE and os.stat(os.path.join(partial, n)).st_size != e.size:
                return False
    except (OSError, ValueError):
        return False
    return True


def _fetch_all(fetch: Callable[[int], None], blocks: np.ndarray, jobs: int) -> None:
    """``fetch`` every block of ``blocks``, ``jobs`` at a time on daemon
    threads; the first error once every fetch has ended or been cancelled
    (nothing more starts after an error). A signal stops the wait at once
    (NOTE [stopping a transfer] in mmstore/_os/threads.py): the fetches in flight are
    abandoned, and a block is marked done only once it is written."""
    if not len(blocks):
        return
    failed = threading.Event()

    def one(gb: int) -> None:
        if failed.is_set():
            raise Stopped  # ends its future (a cancelled one would never count as done for wait_all)
        try:
            fetch(gb)
        except BaseException:
            failed.set()
            raise

    with Pool(jobs, "mmstore-pull", threading.Event()) as pool:
        wait_all([pool.submit(one, int(gb)) for gb in blocks.tolist()])


def _digest(fd: int) -> str:
    """The whole-file digest of the file open at ``fd``."""
    h = xxhash.xxh3_128()
    pos = 0
    while True:
        chunk = os.pread(fd, _READ_BYTES, pos)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        pos += len(chunk)


def _bad_blocks(fd: int, index: RemoteIndex, name: str) -> np.ndarray:
    """The blocks of file ``name`` (open at ``fd``) whose bytes do not match
    their digests in the index (numbered within the file)."""
    e = index.files[name]
    B = index.block_bytes
    return np.array([k for k in range(e.nblocks(B))
                     if block_digest(os.pread(fd, min(B, e.size - k * B), k * B)) != e.block(k)], dtype=np.int64)


def _disagrees(url: str, where: str, blocks_differ: bool) -> RemoteChecksumError:
    """The error of a file whose whole digest still differs after its blocks were checked."""
    if blocks_differ:  # fetched again, verified as they arrived, and read back otherwise
        return RemoteChecksumError(
            f"{where}: blocks fetched again and verified as they arrived read back differently from the disk; "
            "check the disk under the destination (`dmesg`), then run the pull again: it fetches those blocks")
    return RemoteChecksumError(
        f"{where}: every block matches the digest the push recorded, the whole file does not: the bucket's "
        f"{REMOTE_INDEX_FILE} disagrees with itself (damaged, or written by another tool). Repair the bucket: "
        + disagreeing_index(url, "run the pull again"))


def pull(url: str, dest: str | os.PathLike[str], *, overwrite: bool = False, jobs: int = 16, verify: bool = True,
         progress: Callable[[int], Any] | None = None, on_total: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Download the store at ``url`` to ``dest``; return a report.

    ``overwrite``: replace a different store at ``dest``; a copy of the same
    push already there is left as it is. ``verify``: check every record's
    checksum before publishing (the blocks and files are always checked
    against the push's digests)."""
    t0 = time.monotonic()
    loc = parse_url(url)
    remote = Remote(loc)
    dest = os.path.abspath(local_dest(dest))
    partial = dest + PARTIAL_SUFFIX
    # on a daemon thread, as every request of the pull: a stalled server never holds off a Ctrl-C
    index, manifest, raw_manifest = call(read_remote_manifest, remote)
    report: dict[str, Any] = {"url": loc.url, "store": dest, "store_id": index.store_id,
                              "bytes": sum(e.size for e in index.files.values()), "downloaded_bytes": 0,
                              "resumed_bytes": 0, "up_to_date": False}
    if os.path.islink(dest):
        raise DestinationError(f"{dest}: is a symbolic link; pull to a real path")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    lock = acquire_lock(dest)
    try:
        if is_store(dest):
            with open(os.path.join(dest, MANIFEST_FILE), "rb") as f:
                if f.read() == raw_manifest:
                    report.update(up_to_date=True, seconds=round(time.monotonic() - t0, 3))
                    return report
            if not overwrite:
                flag = spell_option("overwrite=True", "--overwrite")
                raise StoreExistsError(f"{dest}: holds another store; pass {flag} to replace it, or pull elsewhere")
            check_dest(dest, overwrite=True)  # never a user's file put inside the old store
        elif os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
            raise DestinationError(f"{dest}: exists and is not an mmstore store; choose another DEST")
        elif os.path.isdir(dest):
            os.rmdir(dest)  # an empty directory: simply used
        identity = {"url": loc.url, "index": index.identity}
        state_path = os.path.join(partial, _STATE)
        B = index.block_bytes
        names = sorted(index.files)
        first: dict[str, int] = {}
        g = 0
        for n in names:
            first[n] = g
            g += index.files[n].nblocks(B)
        nblocks = g
        resume = False
        if os.path.isdir(partial):
            resume = _resumable(partial, identity, index, max(1, nblocks))
            if not resume:
                if not is_own_partial(partial):
                    raise DestinationError(f"{partial}: exists and was not made by mmstore; move it away")
                shutil.rmtree(partial)
        elif os.path.lexists(partial):
            raise DestinationError(f"{partial}: exists and is not a directory; move it away")
        if not resume:
            make_partial(partial)
            for n in {os.path.dirname(n) for n in names if "/" in n}:
                os.makedirs(os.path.join(partial, n), exist_ok=True)  # a store with parts (format.py)
            for n in names:
                if n == MANIFEST_FILE:
                    continue
                with open(os.path.join(partial, n), "wb") as out:
                    try:
                        out.truncate(index.files[n].size)
                    except OSError as exc:
                        if exc.errno != errno.EFBIG:
                            raise
                        raise ResourceLimitError(
                            f"{out.name}: the file system cannot hold a file of {fmt_bytes(index.files[n].size)} "
                            f"({index.files[n].size:,} bytes), the size the store at {loc.url} gives it: pull to "
                            "a file system that holds files that large (ext4 holds at most 16 TiB per file; XFS "
                            "and btrfs more)") from None
            with open(os.path.join(partial, _BLOCKS), "wb") as out:
                out.truncate(max(1, nblocks))
            atomic_write(state_path, json.dumps(identity).encode("utf-8"))
        owner = np.zeros(nblocks, np.int32)
        for i, n in enumerate(names):
            owner[first[n]: first[n] + index.files[n].nblocks(B)] = i
        sizes = np.zeros(nblocks, np.int64)
        for n in names:
            e = index.files[n]
            k = e.nblocks(B)
            if k:
                sizes[first[n]: first[n] + k] = B
                sizes[first[n] + k - 1] = e.size - (k - 1) * B
        counted = [0]
        bfd = os.open(os.path.join(partial, _BLOCKS), os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(bfd, max(1, nblocks))
            marks = np.frombuffer(mm, dtype=np.uint8)[:nblocks]
            manifest_blocks = np.arange(first[MANIFEST_FILE], first[MANIFEST_FILE] +
                                        index.files[MANIFEST_FILE].nblocks(B))
            marks[manifest_blocks] = 1  # written from the copy already read, last
            todo = np.flatnonzero(marks == 0)
            need = int(sizes[todo].sum())
            # a pull that cannot fit stops before its first request (one that fills the disk
            # meanwhile stops typed below, keeping what it wrote for a rerun)
            check_space(partial, need, f"pulling {loc.url} into {dest}")
            report["resumed_bytes"] = int(sizes.sum()) - need - len(raw_manifest)
            if on_total is not None:
                on_total(need + len(raw_manifest))
            fds = {n: os.open(os.path.join(partial, n), os.O_RDWR | os.O_CLOEXEC) for n in names if n != MANIFEST_FILE}
            mu = threading.Lock()
            try:
                def fetch(gb: int) -> None:
                    name = names[int(owner[gb])]
                    e = index.files[name]
                    k = gb - first[name]
                    a = k * B
                    try:
                        view, _ = remote.get_verified(name, a, a + int(sizes[gb]), e.etag, e.block(k))
                    except RemoteNotFoundError as exc:  # an object the index lists is gone from the bucket
                        raise remote.missing(name, exc) from exc
                    pwrite_all(fds[name], view, a)
                    marks[gb] = 1
                    with mu:
                        counted[0] += len(view)
                    if progress is not None:
                        progress(len(view))

                _fetch_all(fetch, todo, jobs)
                for fd in fds.values():
                    fsync_file(fd)
                # every file whole, against the push's digest (NOTE [resuming a pull]): the blocks of a
                # file that differs are checked one by one, and those that differ are fetched again, once
                for again in (True, False):
                    bad = [n for n in names if n != MANIFEST_FILE and _digest(fds[n]) != index.files[n].digest]
                    if not bad:
                        break
                    redo = np.concatenate([first[n] + _bad_blocks(fds[n], index, n) for n in bad])
                    marks[redo] = 0  # what a rerun fetches, should this run stop
                    if not len(redo) or not again:
                        raise _disagrees(loc.url, loc.object_url(bad[0]), bool(len(redo)))
                    _fetch_all(fetch, redo, jobs)
                    for n in bad:
                        fsync_file(fds[n])
            except KeyboardInterrupt:
                # fetches abandoned in flight may still write: their files stay open (a number closed
                # here could name another file by then) until the process, interrupted, ends
                fds.clear()
                raise
            finally:
                for fd in fds.values():
                    os.close(fd)
            mm.flush()  # (the mapping goes with the last view of it)
        finally:
            os.close(bfd)
        report["downloaded_bytes"] = counted[0]
        atomic_write(os.path.join(partial, MANIFEST_FILE), raw_manifest)
        # the finished manifest marks the partial as ours from now on (is_own_partial)
        for extra in (_BLOCKS, _STATE, PARTIAL_MARK):
            try:
                os.unlink(os.path.join(partial, extra))
            except FileNotFoundError:
                pass
        fsync_dir(partial)
        if verify:
            from ..check.verify import verify_store

            rep = verify_store(partial)
            if not rep.ok:
                raise ChecksumError(f"{loc.url}: the pulled store fails verification ({rep.summary()}); the store "
                                    "in the bucket is damaged: push it again from a good copy")
            report["verified_records"] = int(read_manifest(partial)["records"])
        publish(dest)
    except OSError as exc:
        if exc.errno not in _FULL or isinstance(exc, MmstoreError):
            raise
        raise ResourceLimitError(
            exc.errno, f"{dest}: {describe_write_error(exc)}; what was pulled is kept in {partial}: free some "
            f"space on its disk ({fmt_bytes(free_bytes(os.path.dirname(dest)))} free now) and run the same pull "
            "again, which resumes, or pull to another destination") from None
    finally:
        release_lock(dest, lock)
    secs = time.monotonic() - t0
    report.update(seconds=round(secs, 3),
                  bytes_per_s=round(report["downloaded_bytes"] / secs) if secs > 0 else None)
    return report
