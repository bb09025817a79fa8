"""``append``: add the records of a new source to an existing store as a new
part (format.py, "Parts"), without rewriting or copying the store's data.

How an append works, under the destination's writer lock:

1. The store's decode options (size, ``max_side`` / ``short_side`` /
   ``buckets``, resize, channels, layout, ...), its codecs and its backend
   are read from its manifest (its provenance and schema). Options given to
   the append default to them; one given that differs is refused before any
   work, naming each difference (``AppendMismatchError``).
2. The new records are ingested (the ordinary ingest, with its workers,
   holes and commit log) into ``DEST.partial/parts/<id>/``: a complete
   store of its own, labelled by the store's class names, a class the store
   does not know numbered after them (``new_classes="append"``).
3. The store's data files are hard-linked into ``DEST.partial`` as parts
   (the part ids of a store with parts are kept; a plain or segmented
   store's segments become parts ``<k>-<8 hex digits of its store id>``);
   the bookkeeping (checksums, keys, index, errors: 16 bytes and the key
   per slot) is written anew for all slots, then the manifest.
4. ``DEST.partial`` replaces ``DEST`` by the atomic exchange of "Replacing a
   store" (format.py): a reader that opens ``DEST`` sees the old store or
   the new one, never a mix (an open that meets the exchange starts over on
   the new one). The old directory is then deleted; its data files live on
   in the new store (the same inodes).

Readers of the old store: a ``Store`` that has read from the old store keeps
reading the old records: its mapped data files are the same inodes in the
new store, and the files it has open or mapped stay valid when the old
directory is deleted. A ``Store`` opened before the exchange that maps a
bookkeeping file only after it raises ``StoreChangedError`` (the store was
replaced; reopen it): it never reads the new store's files under the old
manifest.

A killed append leaves ``DEST`` as it was (the new store is published by one
exchange) and ``DEST.partial`` marked as an append's (``_appending.json``:
the store it appends to and what it appends). The same append run again
resumes it: the new part's ingest goes on from its commit log, the rest is
redone (it takes seconds); an append of something else, or to a store that
changed meanwhile, discards it and starts again. An append killed after the
exchange is complete: running it again is refused because its keys are in
the store now.

Keys: the keys of the new records (their paths relative to the source, or
their ids) must not be keys of the store's records already; an append that
would repeat one is refused (``DuplicateKeysError``, before anything is
published), so the same source appended twice is caught.
``duplicate_keys="keep"`` appends them anyway (two sources whose relative
paths repeat, such as two crawls with the same layout).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._os.crash import crash_point
from .._os.io import atomic_write, fsync_dir
from .._os.lock import acquire_lock, release_lock
from ..errors import (
    AllInputsFailedError,
    AppendMismatchError,
    DestinationError,
    DuplicateKeysError,
    IngestError,
    LabelMappingError,
    ResumeMismatchError,
    SourceError,
    StoreExistsError,
    spell_option,
)
from ..format.layout import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    PARTIAL_SUFFIX,
    PARTS_DIR,
    decode_key,
    part_file,
    segment_ids,
)
from ..format.manifest import read_manifest
from ..remote.url import local_dest
from ..store.backends import backend_class
from ..store.dest import APPEND_MARK, remove_replaced
from ..store.reader import Store, open_store
from ..store.writer import FileAppender, errors_jsonl, publish, write_manifest
from .merge import _append_part, _skipped_annotations, _write_bookkeeping
from .options import SPEC_OPTIONS, make_spec
from .parts import PartBook, put_books, put_headers
from .pipeline import PLAN_CHECK, IngestResult

__all__ = ["APPEND_MARK", "AppendResult", "append", "append_parts", "check_append_options", "check_new_records"]

_SIZE_OPTIONS = ("size", "max_side", "short_side", "buckets")


@dataclass
class AppendResult:
    """What an append did."""

    path: str
    part: str
    records: int  # the store's records after the append
    added: int  # records added
    skipped: int  # inputs of the source that became holes
    new_labels: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    ingest: IngestResult | None = None

    def summary(self) -> str:
        """One paragraph for the command line."""
        out = (f"{self.path}: {self.added} records appended as part {self.part} ({self.skipped} skipped), "
               f"{self.records} records in all, {self.elapsed:.1f} s")
        if self.ingest is not None and self.ingest.resumed:
            out += f" ({self.ingest.resumed} inputs done by an earlier run)"
        if self.new_labels:
            out += f"; new classes {self.new_labels}"
        return out


def store_options(s: Store) -> dict[str, Any]:
    """The ingest options that give the decode of store ``s`` (none for
    arrays stored as they are; ``"unknown": True`` when its provenance does
    not say), with its ``codecs`` and ``backend``."""
    prov: Any = s.provenance if isinstance(s.provenance, dict) else {}
    ing: Any = prov.get("ingest") if isinstance(prov.get("ingest"), dict) else {}
    params: Any = ing.get("params") if isinstance(ing.get("params"), dict) else {}
    out: dict[str, Any] = {"backend": s.backend_name}
    codecs = {f.name: f.codec.spec for f in s.schema.fields if not f.codec.raw}
    out["codecs"] = codecs or None
    if "decode" in params:
        dec = params["decode"]  # None: arrays stored as they are
    elif isinstance(prov.get("decode"), dict):
        dec = prov["decode"]  # a Ray write's (mmstore.ray)
    elif isinstance(prov.get("size"), list) and isinstance(prov.get("resize"), str):
        dec = {"size": prov["size"], "resize": prov["resize"]}  # a writer that records these two alone (Ray)
    else:
        out["unknown"] = True  # the store does not say how it was decoded (a StoreWriter's)
        return out
    if not isinstance(dec, dict):
        return out
    from ..decode import DecodeSpec

    try:
        spec = DecodeSpec.from_dict(dict(dec))
    except (TypeError, ValueError) as exc:
        raise SourceError(f"{s.path}: the decode options in its provenance do not parse ({exc}); the store "
                          "cannot be appended to") from None
    if spec.resize == "max-side":
        out["max_side"] = spec.size[0]
    elif spec.resize == "short-side":
        out["short_side"] = spec.size[0]
    elif spec.resize == "buckets":
        out["buckets"] = [list(b) for b in spec.bucket_shapes or ()]
    else:
        out["size"] = list(spec.size)
        out["resize"] = spec.resize
    for name in SPEC_OPTIONS:
        if name == "resize" or (name == "upscale" and not spec.aspect_kept):
            continue
        out[name] = getattr(spec, name)
    return out


def _check_options(path: str, own: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``own`` (the store's options) with ``given`` checked against them; a
    difference is refused, naming each one."""
    diffs: list[str] = []
    if "backend" in given and given["backend"] != own["backend"]:
        diffs.append(f"backend {given['backend']!r} (the store's: {own['backend']!r})")
    if "codecs" in given:
        from ..format.codecs import parse_codec_specs

        want = {k: v.spec for k, v in parse_codec_specs(given["codecs"]).items() if not v.raw}
        if want != (own["codecs"] or {}):
            diffs.append(f"codecs {want} (the store's: {own['codecs'] or 'every field raw'})")
    dec_given = {k: v for k, v in given.items() if k in _SIZE_OPTIONS or k in SPEC_OPTIONS}
    own_sizes = {k: own[k] for k in _SIZE_OPTIONS if k in own}
    if own.get("unknown"):
        pass  # nothing to check them against: the new records' schema is checked after their ingest
    elif dec_given and not own_sizes:
        diffs.append(f"decode options {sorted(dec_given)} (the store holds arrays stored as they are, not decoded)")
    elif dec_given:
        kw = {k: v for k, v in own.items() if k in SPEC_OPTIONS}
        sizes = own_sizes
        if any(k in dec_given for k in _SIZE_OPTIONS):
            sizes = {k: dec_given[k] for k in _SIZE_OPTIONS if k in dec_given}
            if "resize" not in dec_given and "size" not in sizes:
                kw.pop("resize", None)
            if "upscale" not in dec_given and not ("max_side" in sizes or "short_side" in sizes):
                kw.pop("upscale", None)
        kw.update({k: v for k, v in dec_given.items() if k in SPEC_OPTIONS})
        if not ("max_side" in sizes or "short_side" in sizes):
            kw.pop("upscale", None)
        if "buckets" in sizes:
            kw.pop("resize", None)
        theirs = make_spec(sizes.get("size"), max_side=sizes.get("max_side"), short_side=sizes.get("short_side"),
                           buckets=sizes.get("buckets"), **kw)
        ours = make_spec(own_sizes.get("size"), max_side=own_sizes.get("max_side"),
                         short_side=own_sizes.get("short_side"), buckets=own_sizes.get("buckets"),
                         **{k: v for k, v in own.items() if k in SPEC_OPTIONS})
        a = theirs.to_dict() if theirs is not None else {}
        b = ours.to_dict() if ours is not None else {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                diffs.append(f"{k} {a.get(k)!r} (the store's: {b.get(k)!r})")
    if diffs:
        raise AppendMismatchError(
            f"{path}: an append decodes new records as the store's own were decoded, but "
            + "; ".join(diffs) + " differ; leave those options out (they default to the store's), or ingest "
            "the source into a store of its own")
    return own


def check_append_options(where: str, store: Store, given: dict[str, Any]) -> dict[str, Any]:
    """The options that decode new records as ``store``'s were decoded
    (:func:`store_options`), with the options ``given`` to an append checked
    against them: a difference is refused, naming each one
    (``AppendMismatchError``). ``where``: the store, for messages."""
    return _check_options(where, store_options(store), given)


_KEY_CHUNK = 1 << 20  # slots of key offsets read at a time


def _key_table(s: Store) -> tuple[np.ndarray, Any]:
    """The key offsets (mapped) and the key blob (mapped, or b"") of ``s``."""
    import mmap

    offs = np.load(os.path.join(s.path, KEYS_OFFSETS_FILE), mmap_mode="r")
    with open(os.path.join(s.path, KEYS_BLOB_FILE), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        blob: Any = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    if offs.shape != (s.slots + 1,) or (s.slots and int(offs[-1]) != size):
        raise IngestError(f"{s.path}/{KEYS_OFFSETS_FILE}: not the key offsets of {s.slots} slots; "
                          "`mmstore verify` the store")
    return offs, blob


def _record_keys(s: Store) -> set[bytes]:
    """The raw keys of the records (not the holes) of ``s`` (the new part: small)."""
    offs, blob = _key_table(s)
    try:
        o = np.asarray(offs, dtype=np.int64).tolist()
        holes = {int(e["slot"]) for e in s.skipped()} if s.records < s.slots else set()
        return {bytes(blob[o[j]:o[j + 1]]) for j in range(s.slots) if j not in holes}
    finally:
        if not isinstance(blob, bytes):
            blob.close()


def _repeated_keys(s: Store, keys: set[bytes]) -> list[bytes]:
    """The ``keys`` that records of ``s`` have: one pass over its key table,
    in chunks, only keys of a length among ``keys``' compared (memory: the
    new keys, not the store's)."""
    if not keys or not s.slots:
        return []
    holes = {int(e["slot"]) for e in s.skipped()} if s.records < s.slots else set()
    lengths = np.array(sorted({len(k) for k in keys}), dtype=np.int64)
    offs, blob = _key_table(s)
    found = []
    try:
        for a in range(0, s.slots, _KEY_CHUNK):
            o = np.asarray(offs[a:min(s.slots, a + _KEY_CHUNK) + 1], dtype=np.int64)
            for j in np.flatnonzero(np.isin(np.diff(o), lengths)).tolist():
                k = bytes(blob[int(o[j]):int(o[j + 1])])
                if k in keys and a + j not in holes:
                    found.append(k)
    finally:
        if not isinstance(blob, bytes):
            blob.close()
    return found


def _request(source: Any, options: dict[str, Any], duplicate_keys: str) -> dict[str, Any]:
    """What an append appends (its mark compares it with a rerun's)."""
    src = os.path.abspath(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else repr(type(source))
    return {"source": src, "options": {k: v for k, v in sorted(options.items())},
            "duplicate_keys": duplicate_keys}


def _read_mark(partial: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(partial, APPEND_MARK), "rb") as fh:
            mark = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) else None


def _start(dest: str, base_id: str, request: dict[str, Any], nseg: int) -> tuple[str, str, bool]:
    """``DEST.partial`` for this append: the one a killed run of the same
    append left (resumed), or a fresh one. Returns (partial, part id, resumed)."""
    partial = dest + PARTIAL_SUFFIX
    parent, base = os.path.split(partial)
    for name in os.listdir(parent):  # what killed appends left while starting or discarding (we hold the lock)
        if name.startswith(base + ".discard-") or name.startswith(base + ".appending-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    remove_replaced(dest)  # a store a killed publish set aside (even if this append is then refused)
    if os.path.lexists(partial):
        mark = _read_mark(partial) if os.path.isdir(partial) and not os.path.islink(partial) else None
        done = _finished_manifest(partial, base_id) if mark is None and os.path.isdir(partial) else None
        if done is not None:  # an append of this store stopped inside publish (which removed its mark first)
            entry = done["provenance"]["appended"][-1]
            src = entry.get("source") if isinstance(entry.get("source"), dict) else {}
            if src.get("path") == request["source"] and isinstance(entry.get("part"), str):
                return partial, entry["part"], True  # this very append: published by the caller
            publish(dest)
            raise StoreExistsError(
                f"{partial}: held a finished append of {src.get('path') or 'another source'} to {dest}, stopped "
                f"while it was being published; it is published now ({dest} has its records). Run this append "
                "again")
        if mark is None:
            raise StoreExistsError(
                f"{partial}: exists and is not an append's (an unfinished ingest or merge into {dest}?); an "
                "append never discards it: finish that run, or move it away, then append again")
        pid = mark.get("part")
        if (mark.get("store_id") == base_id and mark.get("request") == json.loads(json.dumps(request, default=str))
                and isinstance(pid, str)):
            return partial, pid, True
        trash = f"{partial}.discard-{uuid.uuid4().hex[:8]}"
        os.rename(partial, trash)
        shutil.rmtree(trash, ignore_errors=True)
    pid = f"{nseg:05d}-{uuid.uuid4().hex[:8]}"
    tmp = f"{partial}.appending-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(tmp, PARTS_DIR))
    mark = {"format": "mmstore-append", "store_id": base_id, "part": pid, "request": request}
    atomic_write(os.path.join(tmp, APPEND_MARK), json.dumps(mark, sort_keys=True, default=str).encode() + b"\n")
    fsync_dir(tmp)
    os.rename(tmp, partial)
    fsync_dir(os.path.dirname(partial))
    return partial, pid, False


def _old_parts(s: Store) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """``(part id, slots, [(file in s, name in the appended store)])`` of each
    segment of ``s``: a store with parts keeps its ids; a plain or segmented
    store's segment ``k`` becomes part ``<k>-<its store id's first 8 digits>``."""
    cls = backend_class(s.backend_name)
    ids = segment_ids(s.manifest)
    counts = s.segments if s.segments is not None else [s.slots]
    out = []
    for k, count in enumerate(counts):
        seg = None if ids is None else ids[k]
        pid = seg if isinstance(seg, str) else f"{k:05d}-{s.store_id[:8]}"
        pairs = [(os.path.join(s.path, old), new) for old, new in
                 zip(cls.data_file_names(s.schema, seg), cls.data_file_names(s.schema, pid))]
        out.append((pid, int(count), pairs))
    return out


def append(
    dest: str | os.PathLike[str],
    source: Any,
    size: Any = None,
    *,
    duplicate_keys: str = "error",
    workers: int | None = None,
    on_error: str = "skip",
    max_errors: str | int | None = None,
    quiet: bool = False,
    chunk: int | None = None,
    progress_interval: float = 10.0,
    **options: Any,
) -> AppendResult:
    """Add the records of ``source`` to the store ``dest`` as a new part.

    Parameters
    ----------
    dest
        An existing local store (memmap or lmdb; plain, merged or with parts).
    source
        Any ingest source (a folder, a list, an LMDB, arrays, a COCO ``.json``,
        a :class:`~mmstore.ingest.Source`); see :func:`mmstore.ingest`.
    size
        As :func:`mmstore.ingest`; None: the store's.
    duplicate_keys
        ``"error"``: refuse new records whose keys the store's records have
        (:class:`DuplicateKeysError`); ``"keep"``: append them anyway.
    workers, on_error, max_errors, quiet, chunk, progress_interval
        As :func:`mmstore.ingest`, for the new records.
    **options
        Other options of :func:`mmstore.ingest`: decode options
        (``max_side``, ``buckets``, ``resize``, ``channels``, ...),
        ``codecs`` and ``backend`` default to the store's and may only repeat
        them; source options (``labels``, ``root``, ``path_column``, ...)
        describe the new source. Labels are numbered by the store's class
        names; a class it does not have gets the next number.

    Returns
    -------
    AppendResult
        The part added, the records added and skipped, the new class names.

    Raises
    ------
    AppendMismatchError
        A decode option, codec or backend differs from the store's (each
        difference named), or the new records' schema differs.
    DuplicateKeysError
        New records repeat keys of the store's (``duplicate_keys="error"``).
    StoreExistsError
        ``DEST.partial`` holds an unfinished ingest or merge.
    LockedError
        Another process is writing ``dest``.
    """
    from . import check_source_arg

    t0 = time.monotonic()
    check_source_arg(source, "append")
    if duplicate_keys not in ("error", "keep"):
        raise ValueError(f"duplicate_keys must be 'error' or 'keep', got {duplicate_keys!r}")
    dest = os.path.abspath(local_dest(dest))
    for bad in ("resume", "overwrite", "shard", "classes_from", "label_names", "new_classes"):
        if options.get(bad) not in (None, False):
            raise TypeError(f"append() does not take {bad}: an append resumes by itself and numbers labels by the "
                            "store's class names")
    given = {k: v for k, v in options.items() if v is not None and k not in ("resume", "overwrite", "shard")}
    if size is not None:
        given["size"] = size
    if os.path.islink(dest):  # publish replaces DEST by a rename, which would replace the link, never the store
        raise DestinationError(f"{dest}: is a symbolic link (to {os.readlink(dest)}); append to the store itself: "
                               f"`mmstore append {os.path.realpath(dest)} ...`")
    if not os.path.isdir(dest):
        raise DestinationError(f"{dest}: no store there to append to; create it with `mmstore ingest` first")
    lock = acquire_lock(dest)
    try:
        return _append_locked(dest, source, given, duplicate_keys, t0,
                              dict(workers=workers, on_error=on_error, max_errors=max_errors, quiet=quiet,
                                   chunk=chunk, progress_interval=progress_interval))
    finally:
        release_lock(dest, lock)


def _append_locked(dest: str, source: Any, given: dict[str, Any], duplicate_keys: str, t0: float,
                   run: dict[str, Any]) -> AppendResult:
    from . import ingest

    with open_store(dest) as old:
        base_id = old.store_id
        own = _check_options(dest, store_options(old), given)
        nseg = len(old.segments) if old.segments is not None else 1
        request = _request(source, {k: v for k, v in given.items() if k not in ("codecs",)}, duplicate_keys)
        partial, pid, resumed = _start(dest, base_id, request, nseg)
        part_dir = os.path.join(partial, PARTS_DIR, pid)
        done = _finished_manifest(partial, base_id)
        if done is None:
            src_opts = {k: v for k, v in given.items() if k not in own and k not in _SIZE_OPTIONS
                        and k not in SPEC_OPTIONS and k not in ("codecs", "backend")}
            dec = {k: v for k, v in own.items() if k not in ("codecs", "backend", "unknown")}
            if own.get("unknown"):  # the options given, as they are
                dec = {k: v for k, v in given.items() if k in _SIZE_OPTIONS or k in SPEC_OPTIONS}
            if old.label_names is not None and given.get("labels") != "none":  # (none: refused below, named)
                src_opts.update(label_names=list(old.label_names), new_classes="append")
            res = None
            keys_checked = [False]  # the listing's keys passed: the records' (a subset) need no second pass
            if not os.path.exists(os.path.join(part_dir, MANIFEST_FILE)):  # else: ingested by a killed run
                def refuse_repeats(plan: Any) -> None:  # before any decode: the same inputs appended again
                    if duplicate_keys != "error":
                        return
                    lst, failed = plan.listing, plan.listing.label_errors or {}
                    keys = {lst.key(i) for i in range(plan.lo, plan.hi) if i not in failed}
                    dup = set(_repeated_keys(old, keys))
                    if dup:
                        raise _repeats_error(dest, dup, len(keys))
                    keys_checked[0] = True

                def part() -> Any:
                    token = PLAN_CHECK.set(refuse_repeats)
                    try:
                        return ingest(source, part_dir, **dec, codecs=own["codecs"], backend=own["backend"],
                                      resume=True, resume_hint="run the same append again", **run, **src_opts)
                    finally:
                        PLAN_CHECK.reset(token)

                try:
                    try:
                        res = part()
                    except ResumeMismatchError:  # the source changed since a killed or failed try: start it over
                        shutil.rmtree(part_dir + ".partial", ignore_errors=True)
                        res = part()
                except (SourceError, LabelMappingError) as exc:  # refused before any work: nothing to keep
                    if not resumed:
                        shutil.rmtree(partial, ignore_errors=True)
                    mapped = "label_names" in src_opts and not {"classes", "classes_from", "new_classes"} & set(given)
                    if isinstance(exc, SourceError) and mapped and "do(es) not apply" in str(exc):
                        kind = str(exc).split(": is ", 1)[-1].split(";", 1)[0]
                        raise AppendMismatchError(
                            f"{dest}: the store numbers its records' labels by class names "
                            f"({_names(old.label_names)}); {source} is {kind}, whose labels name no class, so they "
                            "cannot be numbered as the store's: ingest it into a store of its own") from None
                    if isinstance(exc, LabelMappingError) and "holds integer labels" in str(exc):
                        raise AppendMismatchError(
                            f"{dest}: {source} labels its inputs with integers; an append numbers the new "
                            f"records by the store's class names ({_names(old.label_names)}): write the labels as "
                            "those names (a new name becomes a new class)") from None
                    raise
                except AllInputsFailedError as exc:  # said in the append's terms: the store, not the part
                    raise AllInputsFailedError(
                        f"{dest}: nothing appended: all {exc.failed:,} inputs of {source} failed"
                        f"{_most_common(exc)}; the store is unchanged. Every failure (slot, key, reason) is listed "
                        f"in {exc.errors_path}; fix the inputs and run the same append again, or remove "
                        f"{partial}", exc.failed, dict(exc.reasons or {}), exc.key, exc.errors_path) from None
            crash_point("append")
            try:
                added, skipped, new_labels = _commit(old, partial, part_dir, pid,
                                                     "keep" if keys_checked[0] else duplicate_keys)
            except (AppendMismatchError, DuplicateKeysError):
                shutil.rmtree(partial, ignore_errors=True)  # nothing of it can be appended
                raise
        else:
            res = None
            prov = done["provenance"].get("appended", [{}])[-1]
            added, skipped, new_labels = int(prov.get("records", 0)), int(prov.get("skipped", 0)), []
    _drop_part_bookkeeping(partial, pid)
    crash_point("append")
    publish(dest)
    crash_point("append")  # (the fault tests: killed once the append is published)
    records = read_manifest(dest)["records"]
    return AppendResult(dest, pid, records, added, skipped, new_labels, time.monotonic() - t0, res)


def _names(names: list[str] | None, show: int = 8) -> str:
    names = list(names or [])
    return ", ".join(names[:show]) + (f" and {len(names) - show:,} more" if len(names) > show else "")


def _most_common(exc: AllInputsFailedError) -> str:
    """``; most common reason: R (k of n), e.g. input 'KEY'`` of a failed part's ingest, or ``""``."""
    if not exc.reasons:
        return ""
    reason, count = max(exc.reasons.items(), key=lambda kv: kv[1])
    return f"; most common reason: {reason} ({count:,} of {exc.failed:,})" + (f", e.g. input {exc.key!r}"
                                                                              if exc.key else "")


def _finished_manifest(partial: str, base_id: str) -> dict[str, Any] | None:
    """The manifest of a killed run of this append that got as far as writing it."""
    if not os.path.exists(os.path.join(partial, MANIFEST_FILE)):
        return None
    try:
        m = read_manifest(partial)
    except (OSError, ValueError):
        return None
    app = m["provenance"].get("appended") if isinstance(m.get("provenance"), dict) else None
    if isinstance(app, list) and app and isinstance(app[-1], dict) and app[-1].get("to_store") == base_id:
        return m
    return None


def check_new_records(old: Store, where: str, schema: Any, backend: str, label_names: list[str] | None,
                      keys: set[bytes], count: int) -> None:
    """Refuse new records that cannot be appended to ``old``: another schema
    or backend, labels not numbered by the store's class names (its names
    first), or any of their ``keys`` (raw; empty when duplicates are kept)
    a key of the store's records. ``where``: the store, for messages;
    ``count``: the new records."""
    if schema != old.schema or backend != old.backend_name:
        lacking = [f for f in old.schema.names if f not in schema.names]
        extra = [f for f in schema.names if f not in old.schema.names]
        hint = ""
        if lacking or extra:
            hint = (f" (the new records lack {lacking or 'nothing'} and add {extra or 'nothing'}: give the source "
                    "options that made the store's fields, such as --json-keys, --text-column, --caption-column "
                    "or --columns, as at its ingest")
            if extra == ["label"] and not lacking:
                hint += "; the store's records have no label: pass --labels none (labels='none')"
            elif lacking == ["label"] and not extra:
                hint += "; the store's records have labels: leave out --labels none, or give the source's labels"
            hint += ")"
        if not hint and repr(schema) == repr(old.schema):  # alike but for what the repr does not show
            diff = [f"{f.name!r} names its classes {dict(f.classes or ())}, the store's "
                    f"{dict(old.schema[f.name].classes or ())}"
                    for f in schema if f.name in old.schema and f.classes != old.schema[f.name].classes]
            if diff:
                hint = f" (field {'; field '.join(diff)})"
        raise AppendMismatchError(f"{where}: the new records have schema {schema!r} ({backend}), "
                                  f"the store {old.schema!r} ({old.backend_name}){hint}; a store holds records "
                                  "of one schema: ingest the source into a store of its own")
    olds, news = old.label_names, label_names
    if olds != news and (olds is None or news is None or news[:len(olds)] != olds):
        raise AppendMismatchError(f"{where}: the new records are labelled {news!r}, the store {olds!r}; "
                                  "an append keeps the store's label numbers")
    dup = set(_repeated_keys(old, keys)) if keys else set()
    if dup:
        raise _repeats_error(where, dup, count)


def _repeats_error(where: str, dup: set[bytes], count: int) -> DuplicateKeysError:
    """The refusal of new records (``count``) some of whose keys (``dup``) the store's records have."""
    first = decode_key(min(dup))
    return DuplicateKeysError(
        f"{where}: {len(dup)} of the {count} new records have keys the store's records have "
        f"already (such as {first!r}): the same inputs appended again? Nothing was appended. To add only "
        f"the inputs the store lacks, append a source that holds only those; if they are other inputs that "
        f"share names, pass {spell_option('duplicate_keys=' + repr('keep'), '--duplicate-keys keep')} to "
        "append them anyway")


def _link_data(segs: list[tuple[str, int, list[tuple[str, str]]]], partial: str) -> list[str]:
    """Hard-link the data files of ``segs`` (:func:`_old_parts`) into ``partial``; their names there."""
    names: list[str] = []
    for opid, _, pairs in segs:
        os.makedirs(os.path.join(partial, PARTS_DIR, opid), exist_ok=True)
        for src, name in pairs:
            try:
                os.link(src, os.path.join(partial, name))
            except OSError as exc:
                raise IngestError(f"cannot hard-link {src} into {partial} ({exc.strerror}): an append links the "
                                  "store's data files into the appended store, which needs a file system "
                                  "that allows hard links") from None
            names.append(name)
    return names


def _appended_provenance(old: Store, source: Any, parts: list[str], records: int, skipped: int) -> dict[str, Any]:
    """``old``'s provenance with this append's entry added to ``appended`` (format.py, "Parts")."""
    prov = dict(old.provenance)
    entry = {"source": source, "part": parts[0], "records": records, "skipped": skipped, "from_slot": old.slots,
             "to_store": old.store_id, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if len(parts) > 1:
        entry["parts"] = list(parts)
    prov["appended"] = [*(prov.get("appended") or []), entry]
    return prov


def append_parts(old: Store, out_dir: str, books: list[PartBook], *, source: Any, duplicate_keys: str = "error",
                 local: bool = True) -> dict[str, Any]:
    """Write into ``out_dir`` the bookkeeping and the manifest of the store
    ``old`` with the parts ``books`` (complete parts, :mod:`mmstore.ingest.parts`,
    in slot order) appended as new parts after its records: the commit of a
    distributed append (``mmstore.ray.write(..., append=True)``), under the
    rules of :func:`append` (:func:`check_new_records`; ``source``: what the
    new records came from, for the provenance).

    ``local``: ``out_dir`` is ``DEST.partial`` of the local store ``old``,
    whose data files are hard-linked into it (``books``' data files are in
    its ``parts/`` already). Else ``old`` is a store in object storage (its
    replica) with parts, whose data files keep their names, and the manifest
    gives every data file's size (none is in ``out_dir``).

    Returns ``{"records", "slots", "added", "skipped", "reasons"}``.
    """
    if not books:
        raise IngestError(f"{old.url or old.path}: nothing to append (the dataset has no rows); the store is unchanged")
    where = old.url or old.path
    keys: set[bytes] = set()
    for b in books:
        holes = {s for s, _, _ in b.holes()}
        if duplicate_keys == "error":
            offsets, blob = b.keys()
            o = offsets.astype(np.int64).tolist()
            keys |= {blob[o[j]:o[j + 1]] for j in range(b.slots) if j not in holes}
        check_new_records(old, where, b.schema, b.backend, b.label_names, set(), b.records)
    added = sum(b.records for b in books)
    check_new_records(old, where, books[0].schema, books[0].backend, books[0].label_names, keys, added)
    segs = _old_parts(old)
    if local:
        names = _link_data(segs, out_dir)
        sizes = None
    else:
        if old.parts is None:
            raise AppendMismatchError(
                f"{where}: a store of one segment (written by mmstore ingest, then pushed): an append into object "
                "storage adds parts to a store made of parts (one that mmstore.ray.write or mmstore append made). "
                "Pull the store, append to the local copy, then push it")
        names = [name for _, _, pairs in segs for _, name in pairs]
        sizes = {name: int(old.manifest["files"][name]) for name in names}
    new_names = [part_file(b.id, n) for b in books for n in b.data_names]
    sizes = None if sizes is None else {**sizes, **{part_file(b.id, n): int(b.manifest["files"][n]) for b in books
                                                    for n in b.data_names}}
    new_slots = sum(b.slots for b in books)
    total, records = old.slots + new_slots, old.records + added
    notes = _skipped_annotations([old])
    book = [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
    if records < total:
        book.append(INDEX_FILE)
    if records < total or notes:
        book.append(ERRORS_FILE)
    holes_all: list[tuple[int, bytes, str]] = []
    out = FileAppender(out_dir, book)
    ok = False
    try:
        put_headers(out, total, records)
        blob_len = _append_part(out, old, 0, 0, records < total)
        put_books(out, books, base=old.slots, blob=blob_len, index=records < total)
        if records < total:
            base = old.slots
            for b in books:
                hs = [(base + s, k, r) for s, k, r in b.holes()]
                if hs:
                    out.put(ERRORS_FILE, errors_jsonl(hs))
                holes_all += hs
                base += b.slots
        if notes:
            out.put(ERRORS_FILE, errors_jsonl((), notes))
        ok = True
    finally:
        out.close(sync=ok)
    fsync_dir(out_dir)
    crash_point("append")
    prov = _appended_provenance(old, source, [b.id for b in books], added, new_slots - added)
    labels = books[0].label_names if books[0].label_names is not None else old.label_names
    write_manifest(out_dir, names + new_names + book, backend=old.backend_name, records=records, slots=total,
                   schema=books[0].schema, label_names=labels, provenance=prov,
                   segments=[c for _, c, _ in segs] + [b.slots for b in books],
                   parts=[p for p, _, _ in segs] + [b.id for b in books], sizes=sizes)
    return {"records": records, "slots": total, "added": added, "skipped": new_slots - added,
            "reasons": Counter(r for _, _, r in holes_all)}


def _commit(old: Store, partial: str, part_dir: str, pid: str, duplicate_keys: str) -> tuple[int, int, list[str]]:
    """Check the new part against ``old``, link ``old``'s data into
    ``partial``, write the joined bookkeeping and the manifest."""
    parts_dir = os.path.join(partial, PARTS_DIR)
    for name in os.listdir(parts_dir):  # the part ingest's lock and anything a killed run left
        if name != pid:
            p = os.path.join(parts_dir, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    for name in os.listdir(partial):  # what a killed run of this append wrote besides the part
        if name not in (PARTS_DIR, APPEND_MARK):
            p = os.path.join(partial, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    new = open_store(part_dir)
    try:
        new_keys = _record_keys(new) if duplicate_keys == "error" and new.records else set()
        check_new_records(old, old.path, new.schema, new.backend_name, new.label_names, new_keys, new.records)
        olds, news = old.label_names, new.label_names
        segs = _old_parts(old)
        names = _link_data(segs, partial)
        new_names = backend_class(new.backend_name).data_file_names(new.schema, pid)
        names += new_names
        total, records = old.slots + new.slots, old.records + new.records
        book = [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
        notes = _skipped_annotations([old, new])
        if records < total:
            book.append(INDEX_FILE)
        if records < total or notes:
            book.append(ERRORS_FILE)
        label_names = news if news is not None else olds
        prov = _appended_provenance(old, new.provenance.get("source"), [pid], new.records, new.slots - new.records)
        schema, backend = new.schema, old.backend_name  # the same fields; the new one carries the merged names
        _write_bookkeeping([old, new], partial, book, total, records, notes)
        fsync_dir(partial)
        crash_point("append")
        write_manifest(partial, names + book, backend=backend, records=records, slots=total, schema=schema,
                       label_names=label_names, provenance=prov,
                       segments=[c for _, c, _ in segs] + [new.slots], parts=[p for p, _, _ in segs] + [pid])
        added, skipped = new.records, new.slots - new.records
        new_labels = list(news[len(olds or []):]) if news is not None else []
    finally:
        new.close()
    return added, skipped, new_labels


def _drop_part_bookkeeping(partial: str, pid: str) -> None:
    """The new part's own manifest and bookkeeping: the store's cover it now."""
    part_dir = os.path.join(partial, PARTS_DIR, pid)
    m = read_manifest(partial)
    keep = {n.split("/", 2)[2] for n in m["files"] if n.startswith(f"{PARTS_DIR}/{pid}/")}
    for name in os.listdir(part_dir):
        if name not in keep:
            p = os.path.join(part_dir, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    fsync_dir(part_dir)
