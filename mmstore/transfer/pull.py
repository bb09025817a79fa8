"""``pull``: download a store from a URL into a local directory, verified.

The store is written into ``DEST.partial`` (under the writer lock of DEST,
as an ingest is) block by block, ``jobs`` range GETs in flight, each block
checked against its digest in the remote index before it is written; then
every file's whole digest is checked, the manifest is written last, every
record's checksum is verified (``verify_store``), and ``DEST.partial`` is
published as ``DEST`` (format.py, "Replacing a store").

NOTE [resuming a pull]: ``DEST.partial`` holds, beside the store's files,
``_pull.json`` (which push of which URL it is a copy of) and ``_pull.blocks``
(a byte per block: 1 once the block is written). A rerun after a kill keeps
the blocks marked done and fetches the rest; a partial of another push is
started over. A kill leaves written pages in the page cache, so a block
marked done is there for the rerun; the files are fsynced before the
manifest is written.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from .._os.io import atomic_write, fsync_dir, fsync_file, pwrite_all
from .._os.lock import acquire_lock, release_lock
from ..errors import ChecksumError, DestinationError, RemoteChecksumError, StoreExistsError, spell_option
from ..format.layout import MANIFEST_FILE, PARTIAL_SUFFIX
from ..format.manifest import read_manifest
from ..remote.client import Remote
from ..remote.replica import read_remote_manifest
from ..remote.url import local_path, parse_url
from ..store.dest import PARTIAL_MARK, is_own_partial, is_store, make_partial
from ..store.writer import publish

__all__ = ["pull"]

_STATE = "_pull.json"
_BLOCKS = "_pull.blocks"
_READ_BYTES = 8 << 20


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
    dest = os.path.abspath(local_path(dest))
    partial = dest + PARTIAL_SUFFIX
    index, manifest, raw_manifest = read_remote_manifest(remote)
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
        elif os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
            raise DestinationError(f"{dest}: exists and is not an mmstore store; choose another DEST")
        elif os.path.isdir(dest):
            os.rmdir(dest)  # an empty directory: simply used
        identity = {"url": loc.url, "index": index.identity}
        state_path = os.path.join(partial, _STATE)
        resume = False
        if os.path.isdir(partial):
            try:
                with open(state_path, "rb") as f:
                    resume = json.loads(f.read()) == identity
            except (OSError, ValueError):
                resume = False
            if not resume:
                if not is_own_partial(partial):
                    raise DestinationError(f"{partial}: exists and was not made by mmstore; move it away")
                shutil.rmtree(partial)
        elif os.path.lexists(partial):
            raise DestinationError(f"{partial}: exists and is not a directory; move it away")
        B = index.block_bytes
        names = sorted(index.files)
        first: dict[str, int] = {}
        g = 0
        for n in names:
            first[n] = g
            g += index.files[n].nblocks(B)
        nblocks = g
        if not resume:
            make_partial(partial)
            for n in {os.path.dirname(n) for n in names if "/" in n}:
                os.makedirs(os.path.join(partial, n), exist_ok=True)  # a store with parts (format.py)
            for n in names:
                if n == MANIFEST_FILE:
                    continue
                with open(os.path.join(partial, n), "wb") as out:
                    out.truncate(index.files[n].size)
            with open(os.path.join(partial, _BLOCKS), "wb") as out:
                out.truncate(max(1, nblocks))
            atomic_write(state_path, json.dumps(identity).encode("utf-8"))
        bfd = os.open(os.path.join(partial, _BLOCKS), os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(bfd, max(1, nblocks))
            marks = np.frombuffer(mm, dtype=np.uint8)[:nblocks]
            manifest_blocks = np.arange(first[MANIFEST_FILE], first[MANIFEST_FILE] +
                                        index.files[MANIFEST_FILE].nblocks(B))
            marks[manifest_blocks] = 1  # written from the copy already read, last
            todo = np.flatnonzero(marks == 0)
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
            need = int(sizes[todo].sum())
            report["resumed_bytes"] = int(sizes.sum()) - need - len(raw_manifest)
            if on_total is not None:
                on_total(need + len(raw_manifest))
            fds = {n: os.open(os.path.join(partial, n), os.O_RDWR | os.O_CLOEXEC) for n in names if n != MANIFEST_FILE}
            mu = threading.Lock()
            counted = [0]
            try:
                def fetch(gb: int) -> None:
                    name = names[int(owner[gb])]
                    e = index.files[name]
                    k = gb - first[name]
                    a = k * B
                    view, _ = remote.get_verified(name, a, a + int(sizes[gb]), e.etag, e.block(k))
                    pwrite_all(fds[name], view, a)
                    marks[gb] = 1
                    with mu:
                        counted[0] += len(view)
                    if progress is not None:
                        progress(len(view))

                if len(todo):
                    with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="mmstore-pull") as pool:
                        futs = [pool.submit(fetch, int(gb)) for gb in todo.tolist()]
                        err: BaseException | None = None
                        for fut in futs:
                            try:
                                fut.result()
                            except BaseException as exc:  # noqa: BLE001 - the first error, once all have ended
                                err = err or exc
                                for other in futs:
                                    other.cancel()
                        if err is not None:
                            raise err
                for fd in fds.values():
                    fsync_file(fd)
            finally:
                for fd in fds.values():
                    os.close(fd)
            mm.flush()  # (the mapping goes with the last view of it)
        finally:
            os.close(bfd)
        report["downloaded_bytes"] = counted[0]
        # every file whole, against the push's digest
        for n in names:
            if n == MANIFEST_FILE:
                continue
            h = xxhash.xxh3_128()
            with open(os.path.join(partial, n), "rb") as f:
                while True:
                    chunk = f.read(_READ_BYTES)
                    if not chunk:
                        break
                    h.update(chunk)
            if h.hexdigest() != index.files[n].digest:
                os.unlink(os.path.join(partial, _BLOCKS))  # nothing of it can be trusted: fetch all again
                raise RemoteChecksumError(f"{loc.object_url(n)}: the downloaded file does not match its digest; "
                                          "run the pull again")
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
    finally:
        release_lock(dest, lock)
    secs = time.monotonic() - t0
    report.update(seconds=round(secs, 3),
                  bytes_per_s=round(report["downloaded_bytes"] / secs) if secs > 0 else None)
    return report
