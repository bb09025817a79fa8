"""``verify``: check a store's structure and every record's checksum.

Structure (``quick=True`` stops here): the manifest parses and matches every
file (exact sizes, ``.npy`` dtypes and shapes), no file is missing or stray,
the checksums file hashes to the manifest's ``checksum.digest`` (a manifest
copied from another store is caught), key offsets start at 0, never decrease
and end at the blob size, and the index, ``errors.jsonl`` and the holes agree.

Content: every slot's packed bytes are hashed again (xxh3_64) and compared
with the stored checksum; holes must have checksum 0 and zero bytes (memmap)
or no key (lmdb), and an lmdb file may hold no key that is not a record.
Record data is read with ``os.preadv`` in large sequential chunks by a pool
of threads (the reads release the GIL), so the pass runs near the disk's
sequential speed. LMDB files are read by child processes
(:mod:`mmstore.check.verify_lmdb`): a damaged page that kills the reader
(SIGBUS) becomes a finding that names the records it hides.

Only regular files are read: a symbolic link in the store, or a store file
that is a FIFO, directory or device, is a problem and is not opened.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import IncompleteStoreError, ResourceLimitError
from ..format.layout import lmdb_file
from ..format.manifest import read_manifest
from ..remote.url import is_url, local_path
from ..store.reader import open_store
from .common import UsageError
from .verify_entries import content_variable, decode_packed
from .verify_lmdb import value_layout_arg, walk_range
from .verify_remote import verify_remote
from .verify_report import MAX_LISTED, BadRecord, Problem, VerifyReport
from .verify_structure import Ctx, check_structure

__all__ = ["BadRecord", "Problem", "VerifyReport", "verify_store"]

_CHUNK_BYTES = 8 << 20


# --------------------------------------------------------------------------
# content


def _hexs(v: int) -> str:
    return f"{int(v):016x}"


class _Collector:
    def __init__(self, ctx: Ctx, rep: VerifyReport) -> None:
        self.ctx, self.rep = ctx, rep
        self.lock = threading.Lock()

    def bad(self, slot: int, what: str, expected: str = "", found: str = "") -> None:
        with self.lock:
            self.rep.bad_count += 1
            if len(self.rep.bad_records) < MAX_LISTED:
                self.rep.bad_records.append(
                    BadRecord(slot, self.ctx.index_of(slot) if slot >= 0 else None,
                              self.ctx.key_of(slot) if slot >= 0 else "", what, expected, found)
                )


def _content_positional(ctx: Ctx, col: _Collector, threads: int, progress: Callable[[int], Any] | None) -> int:
    """Hash every record of a positional backend (memmap) from its fields'
    files, read in large chunks by ``threads`` threads."""
    fields = [f for f in ctx.schema if f.nbytes]
    rb = ctx.schema.record_bytes
    fds: list[int] = []  # the current segment's, one per field: segments are checked one after another
    try:
        per = max(1, _CHUNK_BYTES // max(rb, 1))
        local = threading.local()
        stored = ctx.checksums
        if stored is None:
            raise ValueError("verify: the content pass needs the checksums")

        def run(k: int, a: int, b: int) -> int:
            """Check global slots [a, b) of segment k."""
            bufs = getattr(local, "bufs", None)
            if bufs is None:
                bufs = local.bufs = [bytearray(per * f.nbytes) for f in fields]
            seg, first, _ = ctx.segments[k]
            views = []
            for fd, f, buf in zip(fds, fields, bufs):
                mv = memoryview(buf)[: (b - a) * f.nbytes]
                off = ctx.offsets[(f.name, seg)] + (a - first) * f.nbytes
                _pread_exact(fd, mv, off, ctx.cls.field_file(f.name, seg))
                views.append(mv)
            calc = _hash_rows(views, [f.nbytes for f in fields], b - a)
            want = stored[a:b]
            holes = ctx.holes[a:b]
            for k in np.flatnonzero((calc != want) & ~holes).tolist():
                col.bad(a + k, "checksum", _hexs(want[k]), _hexs(calc[k]))
            for k in np.flatnonzero(holes).tolist():
                if any(np.frombuffer(v[k * f.nbytes : (k + 1) * f.nbytes], np.uint8).any()
                       for v, f in zip(views, fields)):
                    col.bad(a + k, "hole-not-zero", "zero bytes", "non-zero bytes")
            n_bytes = (b - a) * rb
            if progress is not None:
                with col.lock:
                    progress(n_bytes)
            return n_bytes

        total = 0
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="mmstore-verify") as ex:
            for k, (seg, first, count) in enumerate(ctx.segments):
                if not count or not fields:
                    continue
                for f in fields:
                    fd = os.open(os.path.join(ctx.path, ctx.cls.field_file(f.name, seg)), os.O_RDONLY)
                    fds.append(fd)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                chunks = [(k, a, min(first + count, a + per)) for a in range(first, first + count, per)]
                if threads <= 1 or len(chunks) <= 1:
                    for c in chunks:
                        total += run(*c)
                else:
                    # bounded window of chunks in flight keeps the reads near-sequential
                    futs = []
                    try:
                        for c in chunks:
                            futs.append(ex.submit(run, *c))
                            if len(futs) >= 2 * threads:
                                total += futs.pop(0).result()
                    finally:
                        for fu in futs:  # every read of this segment ends before its files close
                            total += fu.result()
                while fds:
                    os.close(fds.pop())
        return total
    finally:
        for fd in fds:
            os.close(fd)


def _pread_exact(fd: int, mv: memoryview, off: int, name: str) -> None:
    """Fill ``mv`` from ``fd`` at ``off`` (``OSError`` naming ``name`` at its end)."""
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], off + got)
        if n <= 0:
            raise OSError(f"{name}: short read at offset {off + got}")
        got += n


def _hash_rows(views: list[memoryview], sizes: list[int], n: int) -> np.ndarray:
    """xxh3_64 of each of ``n`` records whose fields are rows of ``views``
    (row ``k`` of field ``i``: ``sizes[i]`` bytes at ``k * sizes[i]``)."""
    import xxhash

    calc = np.empty(n, np.uint64)
    if len(views) == 1:
        nb, v = sizes[0], views[0]
        h3 = xxhash.xxh3_64_intdigest
        for k in range(n):
            calc[k] = h3(v[k * nb : (k + 1) * nb])
        return calc
    h = xxhash.xxh3_64()
    for k in range(n):
        h.reset()
        for v, nb in zip(views, sizes):
            h.update(v[k * nb : (k + 1) * nb])
        calc[k] = h.intdigest()
    return calc


def _content_lmdb(ctx: Ctx, col: _Collector, rep: VerifyReport, threads: int,
                  progress: Callable[[int], Any] | None) -> int:
    """Check every LMDB record, reading the files in child processes (see
    :mod:`mmstore.check.verify_lmdb`: damaged pages kill the child, not verify)."""
    stored = ctx.checksums
    if stored is None:
        raise ValueError("verify: the content pass needs the checksums")
    rb = ctx.schema.record_bytes
    nvar = len(ctx.schema.variable_fields)
    layout = value_layout_arg(ctx.schema)
    seen = np.zeros(ctx.slots, dtype=bool)
    totals = {"done": 0, "pend": 0}
    deaths: dict[str, tuple[int, str]] = {}  # file -> (unreadable slots, first death)

    def task(k_seg: int, t: int, bounds: list[int]) -> None:
        seg, base, count = ctx.segments[k_seg]
        name = lmdb_file(seg)

        def on_record(key: bytes, vlen: int, h: int | None) -> None:
            s = int.from_bytes(key, "big") if len(key) == 8 else -1
            if s < 0 or s >= count:
                col.bad(-1, "extra-key", "no key", f"key {key.hex()}" + (f" in {name}" if ctx.segmented else ""))
            elif ctx.holes[s + base]:
                seen[s + base] = True
                col.bad(s + base, "hole-has-record", "no key", f"{vlen}-byte value")
            else:
                seen[s + base] = True
                if h is None:  # a 2.0 value whose lengths do not add up to its size
                    col.bad(s + base, "size", f"{rb} bytes of raw fields, {nvar} entry length(s) and the "
                            "entries", f"a {vlen}-byte value whose lengths do not add up")
                elif vlen != rb and not nvar:
                    col.bad(s + base, "size", f"{rb} bytes", f"{vlen} bytes")
                elif h != int(stored[s + base]):
                    col.bad(s + base, "checksum", _hexs(stored[s + base]), _hexs(h))
            with col.lock:
                totals["done"] += vlen
                totals["pend"] += vlen
                if progress is not None and totals["pend"] >= (4 << 20):
                    progress(totals["pend"])
                    totals["pend"] = 0

        def on_unreadable(a: int, b: int, death: str) -> None:
            seen[base + a : base + b] = True
            with col.lock:
                unread, first = deaths.get(name, (0, death))
                deaths[name] = (unread + b - a, first)
            if b - a == 1:
                col.bad(base + a, "unreadable", "a readable record", death)

        res = walk_range(os.path.join(ctx.path, name), bounds[t], bounds[t + 1], count, whole_start=t == 0,
                         whole_end=t == len(bounds) - 2, readahead=True, on_record=on_record,
                         on_missing=lambda s: None, on_unreadable=on_unreadable, layout=layout)
        if res.failure is not None:
            with col.lock:
                deaths.setdefault(name, (0, res.failure))

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="mmstore-verify") as ex:
        for k, (_, _, count) in enumerate(ctx.segments):
            parts = max(1, min(threads, count // 4096))
            bounds = np.linspace(0, count, parts + 1).astype(np.int64).tolist()
            list(ex.map(lambda t: task(k, t, bounds), range(parts)))  # noqa: B023 - consumed at once
    if progress is not None and totals["pend"]:
        progress(totals["pend"])
    for name, (unread, death) in sorted(deaths.items()):
        what = (f"{unread:,} record(s) could not be read (listed as 'unreadable')" if unread else
                "each record was then read by its key (keys that are not records may go unseen)")
        rep.problems.append(Problem(
            "lmdb-damaged", f"{name}: walking it failed ({death}): its pages are damaged; {what}. Restore the "
            "file from a copy or re-create the store", name))
    for s in np.flatnonzero(~seen & ~ctx.holes).tolist():
        col.bad(s, "missing", "a record", "no key")
    return int(totals["done"])


def _content_packed(ctx: Ctx, col: _Collector, progress: Callable[[int], Any] | None) -> int:
    """Hash every record as the backend itself reads it (``iter_packed``),
    one segment after another: for a backend that is neither positional nor
    walked in a child. Holes must be absent or zero bytes."""
    import xxhash

    stored = ctx.checksums
    if stored is None:
        raise ValueError("verify: the content pass needs the checksums")
    rb = ctx.schema.record_bytes
    total = pend = 0
    for seg, first, count in ctx.segments:
        part = ctx.cls(ctx.path, ctx.schema, count, ctx.m["files"], segment=seg)
        try:
            for s, v in part.iter_packed(0, count):
                g = first + s
                if v is None:
                    if not ctx.holes[g]:
                        col.bad(g, "missing", "a record", "no record")
                    continue
                if ctx.holes[g]:
                    if any(bytes(v)):
                        col.bad(g, "hole-not-zero", "zero bytes", "non-zero bytes")
                elif len(v) != rb and not ctx.schema.has_variable:
                    col.bad(g, "size", f"{rb} bytes", f"{len(v)} bytes")
                else:
                    h = xxhash.xxh3_64_intdigest(v)
                    if h != int(stored[g]):
                        col.bad(g, "checksum", _hexs(stored[g]), _hexs(h))
                total += len(v)
                pend += len(v)
                if progress is not None and pend >= _CHUNK_BYTES:
                    progress(pend)
                    pend = 0
        finally:
            part.close()
    if progress is not None and pend:
        progress(pend)
    return total


def _decode_lmdb(ctx: Ctx, col: _Collector, rep: VerifyReport, decode: bool = True) -> None:
    """``decode`` on an LMDB store (without ``decode``: the size check of
    shaped fields' entries): only when every file was walked without
    damage (reading a damaged LMDB file in this process could kill it)."""
    if any(p.kind == "lmdb-damaged" for p in rep.problems) or any(
            r.what == "unreadable" for r in rep.bad_records):
        rep.note = "entries not decoded: an LMDB file is damaged (see problems)"
        return
    decode_packed(ctx, col, {r.slot for r in rep.bad_records}, decode)


def verify_store(
    path: str | os.PathLike[str],
    *,
    quick: bool = False,
    decode: bool = False,
    threads: int | None = None,
    progress: Callable[[int], Any] | None = None,
    on_total: Callable[[int], Any] | None = None,
    deep: bool = False,
) -> VerifyReport:
    """Verify the store at ``path``; return a :class:`VerifyReport`.

    Parameters
    ----------
    quick
        Structure only (reads no record data).
    decode
        Also decode every entry of every variable-size (encoded) field with
        its codec; each entry that fails is a bad record (``decode``).
    threads
        Reader threads for the content pass (default: CPUs, at most 8).
    progress
        Called with a byte count after each chunk of the content pass.
    on_total
        Called once with the bytes the content pass will read.
    deep
        A store URL only: also fetch every block of every object straight
        from the bucket and check it against its digest
        (:mod:`mmstore.check.verify_remote`), before the record pass.

    Raises
    ------
    IncompleteStoreError
        Not a store (no manifest): the CLI's exit code 2.
    """
    if is_url(path):  # a store in object storage: its objects, then its (complete) local replica
        return _verify_url(os.fspath(path), deep, quick=quick, decode=decode, threads=threads, progress=progress,
                           on_total=on_total)
    if deep:
        raise UsageError("deep=True checks a store URL's objects block by block; a local store's verify reads "
                         "every record already")
    path = os.path.abspath(local_path(path))
    rep = VerifyReport(path=path, quick=quick)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise IncompleteStoreError(f"{path}: not a store (a store is a directory; this is a file)")
    if not os.path.isdir(path):
        read_manifest(path)  # raises IncompleteStoreError with the right message
    t0 = time.perf_counter()
    try:
        ctx = check_structure(path, rep)
    except IncompleteStoreError:
        raise
    except OSError as exc:  # permission denied, an I/O error: a finding, with the file it concerns
        where = os.path.basename(os.fsdecode(exc.filename)) if exc.filename else path
        rep.problems.append(Problem("read", f"{where}: cannot be read ({exc.strerror or exc}); check its "
                                    "permissions, or the disk (see the kernel log)", where))
        ctx = None
    if ctx is None or quick:
        rep.seconds = time.perf_counter() - t0
        return rep
    if not ctx.data_ok or ctx.checksums is None:
        rep.note = "record content not checked: the data or checksum files are damaged (see problems)"
        rep.seconds = time.perf_counter() - t0
        return rep
    threads = int(threads or min(8, os.cpu_count() or 1))
    rep.threads = threads
    if on_total is not None:
        on_total(ctx.slots * ctx.schema.record_bytes)
    col = _Collector(ctx, rep)
    t1 = time.perf_counter()
    try:
        if ctx.cls.positional and ctx.schema.has_variable:
            nbytes = content_variable(ctx, col, threads, progress, decode)
        elif ctx.cls.positional:
            nbytes = _content_positional(ctx, col, threads, progress)
        elif ctx.cls.crashes_on_damage:  # LMDB: walked in child processes
            nbytes = _content_lmdb(ctx, col, rep, threads, progress)
            if (decode and ctx.schema.has_variable) or ctx.schema.has_shaped:
                _decode_lmdb(ctx, col, rep, decode)
        else:
            nbytes = _content_packed(ctx, col, progress)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is a finding, not a crash
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):  # a limit, not damage
            raise ResourceLimitError(exc.errno, f"{path}: verify ran out of file descriptors ({exc.strerror}); "
                                     "raise the limit (ulimit -n) and run it again") from None
        rep.problems.append(Problem("read", f"reading the record data failed: {type(exc).__name__}: {exc}; "
                                    "the file is damaged or the disk has errors (see the kernel log)"))
        rep.seconds = time.perf_counter() - t1
        return rep
    rep.bad_records.sort(key=lambda r: r.slot)
    rep.content_checked = True
    rep.checked_slots = ctx.slots
    rep.checked_bytes = nbytes
    rep.seconds = time.perf_counter() - t1
    return rep


def _verify_url(url: str, deep: bool, **kw: Any) -> VerifyReport:
    """Verify the store at ``url``: its objects against its index (one
    listing; with ``deep`` every block by range GETs), and when they match,
    every block is fetched into the replica (``MMSTORE_CACHE_DIR``; each
    block checked against the push's digest on the way) and pinned, so that
    no other reader of the cache evicts one while it is checked; then the
    replica is verified as a local store."""
    bucket = verify_remote(url, deep=deep, progress=kw.get("progress"), on_total=kw.get("on_total"))
    if not bucket.ok:  # a reader would be refused: say which objects differ, and what repairs them
        return VerifyReport(path=url, store_id=bucket.store_id, backend=bucket.backend, records=bucket.records,
                            slots=bucket.slots, quick=kw.get("quick", False),
                            problems=list(bucket.problems), remote=bucket, seconds=bucket.seconds)
    with open_store(url) as store:
        replica = store.replica
        if replica is None:  # pragma: no cover - a URL always opens through a replica
            raise IncompleteStoreError(f"{url}: not a store URL")
        pin = None if kw.get("quick") else replica.acquire(np.arange(replica.nblocks))
        try:
            rep = verify_store(store.path, **kw)
        finally:
            if pin is not None:
                pin.release()
    rep.path = url
    rep.remote = bucket
    return rep
