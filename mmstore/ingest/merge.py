"""``merge``: join the stores of ``--shard K/N`` jobs into one store, without
copying record data.

The merged store is a *segmented* store (format 1.1, see "Segments" in
``mmstore/format.py``): each part's data files (``<field>.npy`` or
``records.mdb``) become one segment of DEST as **hard links** to the same
inodes, so merging a terabyte costs a few metadata operations and no extra
space. Only the bookkeeping files are written anew: the checksums, the keys,
the index and ``errors.jsonl``, concatenated with slots renumbered (8 bytes
per record plus the keys). Stores are never modified after they are written,
so sharing inodes is safe: deleting the parts afterwards frees nothing until
DEST is deleted too, and re-creating a part (``--overwrite``) makes new files
and leaves DEST's alone. (``verify --repair`` rewrites a damaged memmap record
in place, but only with bytes proven to be the original ones, so a part
sharing that file is repaired with it, never altered.)

Hard links need DEST on the same file system as the parts. Across file
systems (``EXDEV``), or where the file system refuses links, merge stops with
a message; ``copy=True`` (``--copy``) then copies the data files instead, with
``os.copy_file_range`` (kernel-side, and extent sharing on XFS/Btrfs).

Shard K of N covers the contiguous input range ``[K*n//N, (K+1)*n//N)`` of the
sorted listing, so the parts in K order *are* the single-run store: the
merged store reads exactly like an ``ingest`` of the same inputs without
``--shard``, its checksums, keys, index and ``errors.jsonl`` are
byte-identical to that store's, and each segment's data file is
byte-identical to the same slot range of that store's data file.

Parts written by ``ingest --shard`` are checked to come from the same inputs
and parameters (their ``inputs_fingerprint``), to be all N of them, and are
ordered by K whatever the order given. Stores without shard provenance are
joined in the order given (same backend, schema and labels required). A part
that is itself a merged store contributes its segments.

Crash safety: everything is built in ``DEST.partial`` (marked as a merge's
by a ``_merging`` file, or by its finished manifest) under the destination lock, and published by one
rename after the manifest is durable. A merge killed at any point leaves no
DEST; running it again removes its own left-over ``DEST.partial`` and starts
over (it takes seconds). A ``DEST.partial`` left by an *ingest* is never
removed without ``overwrite``.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import numpy as np

from .._io import crash_point, fsync_dir, fsync_file
from ..backends import backend_class, data_file_names
from ..errors import IngestError, StoreExistsError
from ..format import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    PARTIAL_SUFFIX,
    npy_header,
    read_manifest,
)
from ..reader import Store, open_store
from ..tools._common import fmt_bytes
from ..writer import _release_lock, acquire_lock, errors_jsonl, publish, write_durable, write_manifest

__all__ = ["merge"]

MERGING_MARK = "_merging"
# errnos meaning "this file system will not hard-link these files here"
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOSYS)


def _copy_file(src: str, dst: str) -> None:
    """Copy a whole file kernel-side (``copy_file_range``; read/write where
    the kernel cannot), then fsync it."""
    sfd = os.open(src, os.O_RDONLY)
    try:
        n = os.fstat(sfd).st_size
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            use_cfr = hasattr(os, "copy_file_range")
            while done < n:
                if use_cfr:
                    try:
                        w = os.copy_file_range(sfd, dfd, n - done, done, done)
                    except OSError as exc:
                        if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                            use_cfr = False
                            continue
                        raise
                else:
                    buf = os.pread(sfd, min(n - done, 8 << 20), done)
                    w = os.pwrite(dfd, buf, done) if buf else 0
                if w == 0:
                    raise OSError(errno.EIO, f"{src}: copying stopped at byte {done} of {n} (file shrank?)")
                done += w
            fsync_file(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _order(stores: list[Store], paths: list[str]) -> list[int]:
    infos = [s.provenance.get("ingest") or {} for s in stores]
    shards = [i.get("shard") for i in infos]
    if all(sh is not None for sh in shards):
        ns = {sh[1] for sh in shards}
        fps = {i.get("inputs_fingerprint") for i in infos}
        if len(ns) != 1 or len(fps) != 1:
            raise IngestError(
                "the parts come from different ingests (their inputs, parameters or shard counts differ): "
                + ", ".join(f"{p}: shard {sh}" for p, sh in zip(paths, shards))
            )
        n = ns.pop()
        ks = sorted(sh[0] for sh in shards)
        if ks != list(range(n)):
            missing = sorted(set(range(n)) - set(ks))
            dup = sorted({k for k in ks if ks.count(k) > 1})
            raise IngestError(
                f"expected the {n} parts 0..{n - 1} of one ingest; "
                + (f"missing shard(s) {missing}" if missing else "")
                + (f" duplicate shard(s) {dup}" if dup else "")
            )
        return sorted(range(len(stores)), key=lambda j: shards[j][0])
    if any(sh is not None for sh in shards):
        raise IngestError("some parts were written with --shard and some were not; merge the parts of one ingest")
    return list(range(len(stores)))


def _check_dest(dest: str, paths: list[str], overwrite: bool) -> None:
    real_dest = os.path.realpath(dest)
    for p in paths:
        rp = os.path.realpath(p)
        if real_dest == rp or real_dest.startswith(rp + os.sep) or rp.startswith(real_dest + os.sep):
            raise IngestError(f"{dest}: the destination is (or is inside, or contains) part {p}; choose another DEST")
    if os.path.exists(dest) and not overwrite:
        raise StoreExistsError(f"{dest}: already exists; pass overwrite=True (--overwrite) to replace it")


def _provenance(first: Store, paths: list[str], total: int) -> dict[str, Any]:
    prov = dict(first.provenance)
    ing = dict(prov.get("ingest") or {})
    if ing.get("shard") is not None:
        from .pipeline import _fingerprint

        # the fingerprint a single run over all inputs records
        ing["fingerprint"] = _fingerprint(
            str(ing.get("inputs_fingerprint")), {"shard": None, "range": [0, ing.get("inputs", total)]}
        )
        ing["shard"] = None
        ing["range"] = [0, ing.get("inputs", total)]
        prov["ingest"] = ing
    prov["merged_from"] = [os.path.abspath(p) for p in paths]
    prov.pop("time", None)
    prov.pop("tool", None)
    return prov


def _segments_of(s: Store) -> list[tuple[int, list[str]]]:
    """``(slot count, [data file paths])`` of each segment of ``s``."""
    cls = backend_class(s.backend_name)
    if s.segments is None:
        return [(s.slots, [os.path.join(s.path, n) for n in cls.data_file_names(s.schema)])]
    return [(c, [os.path.join(s.path, n) for n in cls.data_file_names(s.schema, k)])
            for k, c in enumerate(s.segments)]


def merge(
    parts: list[str | os.PathLike[str]],
    dest: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    copy: bool = False,
) -> str:
    """Join stores ``parts`` into one store at ``dest``; return its path.

    Parameters
    ----------
    parts
        Part stores, in any order when they were written by ``ingest --shard``.
    dest
        The store to create.
    overwrite
        Replace an existing ``dest`` (and an ingest's left-over ``dest.partial``).
    copy
        Copy the data files instead of hard-linking them (DEST on another file
        system than the parts).

    Raises
    ------
    IngestError
        Parts of different ingests, a missing or duplicate shard, different
        backends, schemas or label names; hard links refused by the file
        system (the message suggests ``copy=True``).
    StoreExistsError
        ``dest`` exists (without ``overwrite``).
    LockedError
        Another process is writing ``dest``.
    """
    paths = [os.fspath(p) for p in parts]
    if not paths:
        raise IngestError("merge needs at least one part")
    dest = os.path.abspath(os.fspath(dest))
    stores = [open_store(p) for p in paths]
    try:
        order = _order(stores, paths)
        stores = [stores[j] for j in order]
        paths = [paths[j] for j in order]
        first = stores[0]
        for p, s in zip(paths, stores):
            if s.backend_name != first.backend_name:
                raise IngestError(f"{p}: a {s.backend_name} store, but {paths[0]} is {first.backend_name}; "
                                  "convert one of them first (mmstore convert)")
            if s.schema != first.schema:
                raise IngestError(f"{p}: schema {s.schema!r} differs from {paths[0]}'s {first.schema!r}")
            if s.label_names != first.label_names:
                raise IngestError(f"{p}: label names differ from {paths[0]}'s")
        _check_dest(dest, paths, overwrite)
        lock = acquire_lock(dest)
        try:
            _build(stores, paths, dest, overwrite=overwrite, copy=copy)
        finally:
            _release_lock(dest, lock, unlink=True)
    finally:
        for s in stores:
            s.close()
    return dest


def _build(stores: list[Store], paths: list[str], dest: str, *, overwrite: bool, copy: bool) -> None:
    partial = dest + PARTIAL_SUFFIX
    if os.path.exists(partial):
        if not (overwrite or _left_by_merge(partial)):
            raise StoreExistsError(
                f"{partial}: an unfinished ingest is here; finish it with `mmstore ingest ... --resume`, "
                "or pass --overwrite to discard it"
            )
        shutil.rmtree(partial)
    os.makedirs(partial)
    write_durable(os.path.join(partial, MERGING_MARK), b"")
    first = stores[0]
    backend = first.backend_name
    schema = first.schema
    total = sum(s.slots for s in stores)
    # 1. record data: each part's segments, linked (or copied) in order
    counts: list[int] = []
    for s in stores:
        for count, srcs in _segments_of(s):
            k = len(counts)
            for src, name in zip(srcs, backend_class(backend).data_file_names(schema, k)):
                dst = os.path.join(partial, name)
                if copy:
                    _copy_file(src, dst)
                    continue
                try:
                    os.link(src, dst)
                except OSError as exc:
                    if exc.errno in _NO_LINK:
                        shutil.rmtree(partial, ignore_errors=True)
                        raise IngestError(
                            f"cannot hard-link {src} into {dest} ({os.strerror(exc.errno)}): merge links the "
                            "parts' data files, which needs DEST on the same file system as the parts (and "
                            "one that allows hard links); choose such a DEST, or pass --copy (copy=True) to "
                            f"copy the {fmt_bytes(_data_bytes(stores))} of record data instead"
                        ) from None
                    raise
            counts.append(count)
            crash_point("merge")
    # 2. bookkeeping: concatenated, slots renumbered
    ck = np.zeros(total, KEY_DTYPE)
    key_offsets = np.zeros(total + 1, KEY_DTYPE)
    blobs: list[bytes] = []
    blob_len = 0
    holes = np.zeros(total, bool)
    skips: list[tuple[int, bytes, str]] = []
    base = 0
    for s in stores:
        n = s.slots
        ck[base : base + n] = s.checksums()
        offs, blob = s._keys()
        if n:
            key_offsets[base + 1 : base + n + 1] = np.asarray(offs[1:], dtype=KEY_DTYPE) + np.uint64(blob_len)
            blobs.append(bytes(blob[: int(offs[-1])]))
            blob_len += int(offs[-1])
        for e in s.skipped():
            slot = int(e["slot"])
            holes[base + slot] = True
            skips.append((base + slot, s.slot_key_bytes(slot), str(e["reason"])))
        base += n
    j = lambda n: os.path.join(partial, n)  # noqa: E731
    write_durable(j(CHECKSUMS_FILE), npy_header(KEY_DTYPE, (total,)), ck)
    write_durable(j(KEYS_OFFSETS_FILE), npy_header(KEY_DTYPE, (total + 1,)), key_offsets)
    write_durable(j(KEYS_BLOB_FILE), b"".join(blobs))
    names = data_file_names(backend, schema, counts) + [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
    records = int(total - holes.sum())
    if records < total:
        index = np.flatnonzero(~holes).astype(KEY_DTYPE)
        write_durable(j(INDEX_FILE), npy_header(KEY_DTYPE, (records,)), index)
        write_durable(j(ERRORS_FILE), errors_jsonl(sorted(skips)))
        names += [INDEX_FILE, ERRORS_FILE]
    fsync_dir(partial)
    crash_point("merge")
    write_manifest(partial, names, backend=backend, records=records, slots=total, schema=schema,
                   label_names=first.label_names, provenance=_provenance(first, paths, total), segments=counts)
    publish(dest)  # removes the _merging mark (not in the manifest), then renames


def _left_by_merge(partial: str) -> bool:
    """A ``.partial`` a killed merge left: the mark, or (killed inside
    ``publish``, which removes the mark) a finished merged manifest."""
    if os.path.exists(os.path.join(partial, MERGING_MARK)):
        return True
    try:
        return "merged_from" in read_manifest(partial)["provenance"]
    except (OSError, ValueError):
        return False


def _data_bytes(stores: list[Store]) -> int:
    return sum(os.path.getsize(p) for s in stores for p in s.backend.data_paths())
