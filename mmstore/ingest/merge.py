"""``merge``: join the stores of ``--shard K/N`` jobs into one store, without
copying record data.

The merged store is a *segmented* store (format 1.1, or 2.0 with encoded
fields; see "Segments" in ``mmstore/format/__init__.py``): each part's data files
(``<field>.npy``, an encoded field's ``<field>.bin`` and
``<field>.offsets.npy``, or ``records.mdb``) become one segment of DEST
(``<field>.<k>.npy``, ``<field>.<k>.bin`` ...) as **hard links** to the same
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
import uuid
from typing import Any

import numpy as np

from .._os.crash import crash_point
from .._os.io import check_space, describe_write_error, fmt_bytes, fsync_dir
from ..errors import DestinationError, IngestError, SourceError, StoreExistsError, spell_option
from ..format.layout import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    PARTIAL_SUFFIX,
    encode_key,
    npy_header,
    segment_ids,
)
from ..format.manifest import read_manifest
from ..remote.url import local_dest
from ..store.backends import backend_class, data_file_names
from ..store.dest import check_dest, is_own_partial
from ..store.reader import Store, open_store
from ..store.writer import (
    FileAppender,
    acquire_lock,
    errors_jsonl,
    publish,
    release_lock,
    write_durable,
    write_manifest,
)
from .pipeline import all_failed_error
from .plan import fingerprint

__all__ = ["merge"]

MERGING_MARK = "_merging"
# errnos meaning "this file system will not hard-link these files here"
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOSYS)


def _copy_range(src: str, src_off: int, n: int, out: FileAppender, name: str) -> None:
    """Append ``n`` bytes of file ``src`` from ``src_off`` to ``out``'s file ``name``."""
    fd = os.open(src, os.O_RDONLY)
    try:
        done = out.copy(name, fd, src_off, n)
    finally:
        os.close(fd)
    if done < n:
        raise IngestError(f"{src}: ended at byte {src_off + done}, expected {n - done} more; the part "
                          "changed while merging (run `mmstore verify` on it)")


def _copy_file(src: str, dst: str) -> None:
    """Copy a whole file (``_copy_range``), then fsync it."""
    name = os.path.basename(dst)
    out = FileAppender(os.path.dirname(dst), [name])
    ok = False
    try:
        _copy_range(src, 0, os.path.getsize(src), out, name)
        ok = True
    finally:
        out.close(sync=ok)


def _order(stores: list[Store], paths: list[str]) -> list[int]:
    infos = [s.provenance.get("ingest") or {} for s in stores]
    shards = [i.get("shard") for i in infos]
    known = [sh for sh in shards if sh is not None]
    if len(known) == len(shards):  # every part is a shard
        ns = {sh[1] for sh in known}
        fps = {i.get("inputs_fingerprint") for i in infos}
        if len(ns) != 1 or len(fps) != 1:
            raise SourceError(
                "the parts come from different ingests (their inputs, parameters or shard counts differ): "
                + ", ".join(f"{p}: shard {sh}" for p, sh in zip(paths, known))
            )
        n = ns.pop()
        ks = sorted(sh[0] for sh in known)
        if ks != list(range(n)):
            missing = sorted(set(range(n)) - set(ks))
            dup = sorted({k for k in ks if ks.count(k) > 1})
            raise SourceError(
                f"expected the {n} parts 0..{n - 1} of one ingest; "
                + (f"missing shard(s) {missing}" if missing else "")
                + (f" duplicate shard(s) {dup}" if dup else "")
            )
        return sorted(range(len(stores)), key=lambda j: known[j][0])
    if known:
        raise SourceError("some parts were written with --shard and some were not; merge the parts of one ingest")
    return list(range(len(stores)))


def _check_dest(dest: str, paths: list[str], overwrite: bool) -> None:
    check_dest(dest, overwrite=overwrite, sources=paths)
    if os.path.lexists(dest) and not overwrite:
        raise StoreExistsError(f"{dest}: already exists; pass {spell_option('overwrite=True', '--overwrite')} to "
                               "replace it")


def _provenance(stores: list[Store], paths: list[str], total: int) -> dict[str, Any]:
    first = stores[0]
    ing = dict(first.provenance.get("ingest") or {})
    if ing.get("shard") is None:
        # not the parts of one ingest: no single source, parameters or
        # fingerprint describes the result (a resume or repair must not
        # take the first part's for all of them)
        out: dict[str, Any] = {
            "merged_from": [os.path.abspath(p) for p in paths],
            "merged_store_ids": [s.store_id for s in stores],
        }
        libs = [s.provenance.get("codec_libraries") for s in stores]
        if libs[0] and all(v == libs[0] for v in libs):  # the encoders of every part's entries (repair needs them)
            out["codec_libraries"] = libs[0]
        decodes = [_decode_of(s) for s in stores]
        if decodes[0] is not None and all(d == decodes[0] for d in decodes):
            out["decode"] = decodes[0]  # one decode made every record: an append or a repair decodes so too
        return out
    prov = dict(first.provenance)
    # the fingerprint a single run over all inputs records
    ing["fingerprint"] = fingerprint(
        str(ing.get("inputs_fingerprint")), {"shard": None, "range": [0, ing.get("inputs", total)]}
    )
    ing["shard"] = None
    ing["range"] = [0, ing.get("inputs", total)]
    prov["ingest"] = ing
    prov["merged_from"] = [os.path.abspath(p) for p in paths]
    prov.pop("time", None)
    prov.pop("tool", None)
    return prov


def _decode_of(s: Store) -> dict[str, Any] | None:
    """The decode options a store's provenance records (an ingest's, or a writer's own ``decode``), or None."""
    prov = s.provenance if isinstance(s.provenance, dict) else {}
    ing = prov.get("ingest")
    params = ing.get("params") if isinstance(ing, dict) else None
    dec = params.get("decode") if isinstance(params, dict) else prov.get("decode")
    return dec if isinstance(dec, dict) else None


def _segments_of(s: Store) -> list[tuple[int, list[str]]]:
    """``(slot count, [data file paths])`` of each segment of ``s``."""
    cls = backend_class(s.backend_name)
    if s.segments is None:
        return [(s.slots, [os.path.join(s.path, n) for n in cls.data_file_names(s.schema)])]
    ids = segment_ids(s.manifest) or []
    return [(c, [os.path.join(s.path, n) for n in cls.data_file_names(s.schema, k)])
            for k, c in zip(ids, s.segments)]


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
        system (the message suggests ``copy=True``);
        :class:`~mmstore.errors.AllInputsFailedError` when the parts hold
        slots but not one record (nothing is created).
    StoreExistsError
        ``dest`` exists (without ``overwrite``).
    DestinationError
        ``dest`` is, contains or lies inside a part, or exists and is not a
        store (only a store is ever replaced, with ``overwrite``).
    LockedError
        Another process is writing ``dest``.
    """
    paths = [os.fspath(p) for p in parts]
    if not paths:
        raise SourceError("merge needs at least one part")
    dest = os.path.abspath(local_dest(dest))  # a URL is refused, never made ./s3:/...
    stores = [open_store(p) for p in paths]
    try:
        order = _order(stores, paths)
        stores = [stores[j] for j in order]
        paths = [paths[j] for j in order]
        first = stores[0]
        for p, s in zip(paths, stores):
            if s.backend_name != first.backend_name:
                raise SourceError(f"{p}: a {s.backend_name} store, but {paths[0]} is {first.backend_name}; "
                                  "convert one of them first (mmstore convert)")
            if s.schema != first.schema:
                raise SourceError(f"{p}: schema {s.schema!r} differs from {paths[0]}'s {first.schema!r}")
            if s.label_names != first.label_names:
                raise SourceError(f"{p}: label names differ from {paths[0]}'s")
        if sum(s.slots for s in stores) and not sum(s.records for s in stores):
            raise _no_records(dest, stores)
        _check_dest(dest, paths, overwrite)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        lock = acquire_lock(dest)
        try:
            _check_dest(dest, paths, overwrite)  # again under the lock: what DEST is now is what gets replaced
            _build(stores, paths, dest, overwrite=overwrite, copy=copy)
        finally:
            release_lock(dest, lock)
    finally:
        for s in stores:
            s.close()
    return dest


def _no_records(dest: str, stores: list[Store]) -> Exception:
    """The parts hold holes only: merging them would publish a store of no
    record (every input of the ingest failed)."""
    holes = [(str(e["key"]), str(e["reason"])) for s in stores for e in s.skipped()]
    return all_failed_error(dest, holes, ", ".join(os.path.join(s.path, ERRORS_FILE) for s in stores[:3]),
                            "Nothing was created; every failure is listed in the parts' errors.jsonl")


_CHUNK = 1 << 20  # slots per bookkeeping chunk (8 MiB of offsets)


def _file_ids(s: Store) -> dict[str, tuple[int, int, int, int]]:
    """Identity of every file of ``s``: (device, inode, size, mtime ns)."""
    out = {}
    for name in [*s.manifest["files"], MANIFEST_FILE]:
        st = os.stat(os.path.join(s.path, name))
        out[os.path.join(s.path, name)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _fresh_partial(dest: str, overwrite: bool) -> str:
    """Create an empty ``DEST.partial`` that carries the merge mark from the
    moment it exists (made aside, then renamed into place)."""
    partial = dest + PARTIAL_SUFFIX
    parent, base = os.path.split(partial)
    for name in os.listdir(parent):  # what killed merges left while cleaning up (we hold the lock)
        if name.startswith(base + ".discard-") or name.startswith(base + ".merging-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    if os.path.lexists(partial):
        if not is_own_partial(partial):
            raise DestinationError(f"{partial}: exists and was not made by mmstore; it is never discarded: move it "
                                   "away yourself, or choose another DEST")
        if not (overwrite or _left_by_merge(partial)):
            raise StoreExistsError(
                f"{partial}: an unfinished ingest is here; finish it with `mmstore ingest ... --resume`, "
                "or pass --overwrite to discard it"
            )
        trash = f"{partial}.discard-{uuid.uuid4().hex[:8]}"
        os.rename(partial, trash)
        shutil.rmtree(trash)
    tmp = f"{partial}.merging-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    write_durable(os.path.join(tmp, MERGING_MARK), b"")
    fsync_dir(tmp)
    os.rename(tmp, partial)
    fsync_dir(parent)
    return partial


def _read_u8(path: str, offset: int, count: int) -> np.ndarray:
    with open(path, "rb") as fh:
        fh.seek(offset)
        arr = np.fromfile(fh, dtype=KEY_DTYPE, count=count)
    if len(arr) != count:
        raise IngestError(f"{path}: short read; the part changed while merging")
    return arr


def _build(stores: list[Store], paths: list[str], dest: str, *, overwrite: bool, copy: bool) -> None:
    ids = [_file_ids(s) for s in stores]
    book = sum(8 * (2 * s.slots + 1) + int(s.manifest["files"][KEYS_BLOB_FILE]) for s in stores)
    check_space(os.path.dirname(dest), book + (_data_bytes(stores) if copy else 0), dest)
    partial = _fresh_partial(dest, overwrite)
    try:
        _fill(stores, paths, dest, partial, ids, copy)
    except BaseException as exc:
        # a merge's .partial holds nothing worth keeping (a rerun starts over)
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EFBIG):
            raise OSError(exc.errno, f"{dest}: {describe_write_error(exc)}; nothing was created (the parts are "
                          "untouched): free some space and run the merge again") from None
        raise


def _fill(stores: list[Store], paths: list[str], dest: str, partial: str,
          ids: list[dict[str, tuple[int, int, int, int]]], copy: bool) -> None:
    first = stores[0]
    backend, schema = first.backend_name, first.schema
    total = sum(s.slots for s in stores)
    records = sum(s.records for s in stores)
    counts, linked = _link_data(stores, dest, partial, copy)
    book = [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
    notes = _skipped_annotations(stores)
    if records < total:
        book += [INDEX_FILE]
    if records < total or notes:
        book += [ERRORS_FILE]
    names = data_file_names(backend, schema, counts) + book
    _write_bookkeeping(stores, partial, book, total, records, notes)
    fsync_dir(partial)
    crash_point("merge")
    _check_unchanged(stores, ids, linked, partial)
    write_manifest(partial, names, backend=backend, records=records, slots=total, schema=schema,
                   label_names=first.label_names, provenance=_provenance(stores, paths, total), segments=counts)
    publish(dest)  # removes the _merging mark (not in the manifest), then renames


def _link_data(stores: list[Store], dest: str, partial: str, copy: bool) -> tuple[list[int], list[tuple[str, str]]]:
    """Record data: each part's segments, hard-linked (or copied) in order;
    returns the segments' slot counts and the (source, link) pairs."""
    backend, schema = stores[0].backend_name, stores[0].schema
    counts: list[int] = []
    linked: list[tuple[str, str]] = []
    for s in stores:
        for count, srcs in _segments_of(s):
            for src, name in zip(srcs, backend_class(backend).data_file_names(schema, len(counts))):
                dst = os.path.join(partial, name)
                if copy:
                    _copy_file(src, dst)
                else:
                    _link(src, dst, dest, partial, stores)
                    linked.append((src, dst))
            counts.append(count)
            crash_point("merge")
    return counts, linked


def _link(src: str, dst: str, dest: str, partial: str, stores: list[Store]) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise IngestError(
            f"cannot hard-link {src} into {dest} ({os.strerror(exc.errno)}): merge links the "
            "parts' data files, which needs DEST on the same file system as the parts (and "
            f"one that allows hard links); choose such a DEST, or pass {spell_option('copy=True', '--copy')} to "
            f"copy the {fmt_bytes(_data_bytes(stores))} of record data instead"
        ) from None


def _skipped_annotations(stores: list[Store]) -> list[dict[str, Any]]:
    """The parts' skipped-annotation lines (COCO), slots renumbered, in the
    annotation file's order (as one ingest of all parts lists them)."""
    out, base = [], 0
    for s in stores:
        for e in s.skipped_annotations():
            slot = e.get("slot")
            out.append({**e, "slot": None if slot is None else base + int(slot),
                        "key": None if e.get("key") is None else encode_key(e["key"])})
        base += s.slots
    out.sort(key=lambda e: (k if isinstance(k := e.get("annotation"), int) else -1))
    return out


def _write_bookkeeping(stores: list[Store], partial: str, names: list[str], total: int, records: int,
                       notes: list[dict[str, Any]] | None = None) -> None:
    """The parts' checksums, keys, index and errors laid end to end, slots and
    key offsets renumbered, streamed in chunks (memory does not grow with the store);
    then the skipped annotations ``notes``."""
    out = FileAppender(partial, names)
    ok = False
    try:
        out.put(CHECKSUMS_FILE, npy_header(KEY_DTYPE, (total,)))
        out.put(KEYS_OFFSETS_FILE, npy_header(KEY_DTYPE, (total + 1,)))
        out.put(KEYS_OFFSETS_FILE, np.zeros(1, KEY_DTYPE).tobytes())
        if records < total:
            out.put(INDEX_FILE, npy_header(KEY_DTYPE, (records,)))
        base = blob_len = 0
        for s in stores:
            blob_len += _append_part(out, s, base, blob_len, records < total)
            base += s.slots
            s.close()
        if notes:
            out.put(ERRORS_FILE, errors_jsonl((), notes))
        ok = True
    finally:
        out.close(sync=ok)


def _append_part(out: FileAppender, s: Store, base: int, blob_len: int, holes: bool) -> int:
    """Append part ``s`` (its slots start at ``base``); return its key blob's length."""
    n = s.slots
    _copy_range(os.path.join(s.path, CHECKSUMS_FILE), s.slot_view.data_offset(CHECKSUMS_FILE), 8 * n, out,
                CHECKSUMS_FILE)
    ko = os.path.join(s.path, KEYS_OFFSETS_FILE)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        offsets = _read_u8(ko, s.slot_view.data_offset(KEYS_OFFSETS_FILE) + 8 * (a + 1), b - a) + np.uint64(blob_len)
        out.put(KEYS_OFFSETS_FILE, offsets.tobytes())
    part_blob = int(s.manifest["files"][KEYS_BLOB_FILE])
    _copy_range(os.path.join(s.path, KEYS_BLOB_FILE), 0, part_blob, out, KEYS_BLOB_FILE)
    if holes:
        for a in range(0, s.records, _CHUNK):
            b = min(s.records, a + _CHUNK)
            if s.records == n:
                local = np.arange(a, b, dtype=KEY_DTYPE)
            else:
                local = _read_u8(os.path.join(s.path, INDEX_FILE), s.slot_view.data_offset(INDEX_FILE) + 8 * a, b - a)
            out.put(INDEX_FILE, (local + np.uint64(base)).tobytes())
        skipped = s.skipped()
        if skipped:
            out.put(ERRORS_FILE, errors_jsonl(
                (base + int(e["slot"]), encode_key(e["key"]), str(e["reason"])) for e in skipped))
    return part_blob


def _check_unchanged(stores: list[Store], ids: list[dict[str, tuple[int, int, int, int]]],
                     linked: list[tuple[str, str]], partial: str) -> None:
    """Nothing may have changed under us: a part re-created or rewritten since
    it was opened would leave its new data under its old checksums."""
    for s, before in zip(stores, ids):
        if _file_ids(s) != before:
            shutil.rmtree(partial, ignore_errors=True)
            raise IngestError(f"{s.path}: the part changed while it was being merged (re-created or written by "
                              "another process); run the merge again when nothing writes the parts")
    for src, dst in linked:
        a, b = os.stat(src), os.stat(dst)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            shutil.rmtree(partial, ignore_errors=True)
            raise IngestError(f"{src}: replaced while it was being merged; run the merge again")


def _left_by_merge(partial: str) -> bool:
    """A ``.partial`` a killed merge left: the mark, or (killed inside
    ``publish``, which removes the mark) a finished merged manifest."""
    if os.path.exists(os.path.join(partial, MERGING_MARK)) or not os.listdir(partial):
        return True  # ours, or empty: nothing to lose
    try:
        return "merged_from" in read_manifest(partial)["provenance"]
    except (OSError, ValueError):
        return False


def _data_bytes(stores: list[Store]) -> int:
    return sum(os.path.getsize(p) for s in stores for p in s.slot_view.backend.data_paths())
