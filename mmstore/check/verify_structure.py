"""Structure checks of ``verify`` (no record data is read): the manifest
against every file, stray and missing files, the checksums digest, keys,
index, ``errors.jsonl`` and the holes. See :mod:`mmstore.check.verify`."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import FormatError, IncompleteStoreError
from ..format.layout import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    LMDB_FILE,
    MANIFEST_FILE,
    PART_TABLE_FILE,
    PARTS_DIR,
    lmdb_file,
)
from ..format.manifest import expand_manifest, read_manifest, read_part_table
from ..store.backends import data_file_names
from ..store.backends.base import check_npy
from ..store.writer import file_digest
from .verify_context import Ctx
from .verify_entries import check_offsets, report_offsets
from .verify_lmdb import lmdb_entries
from .verify_report import Problem, VerifyReport

__all__ = ["Ctx", "check_structure"]  # Ctx: re-exported, the result of check_structure

def _load_u8(path: str, offset: int, count: int) -> np.ndarray:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return np.fromfile(fh, dtype=KEY_DTYPE, count=count)


def check_structure(path: str, rep: VerifyReport) -> Ctx | None:
    ctx = _read_manifest(path, rep)
    if ctx is None:
        return None
    data_names, bad_files, on_disk = _check_listing(ctx, rep)
    npy = _NpyCheck(ctx, rep, bad_files)
    _check_data_files(ctx, rep, data_names, bad_files, npy)
    _check_checksums(ctx, rep, npy)
    _check_keys(ctx, rep, bad_files, npy)
    for name, want in sorted((ctx.m.get("digests") or {}).items()):
        if name in bad_files or name not in on_disk:
            continue
        got = file_digest(os.path.join(path, name), 0)
        if got != want:
            rep.problems.append(Problem("digest", f"{name}: content hashes to {got} but the manifest says {want}: "
                                        "the file was changed or damaged since the store was written", name))
            if name in (KEYS_OFFSETS_FILE, KEYS_BLOB_FILE):
                ctx.key_offsets = ctx.key_blob = None
    _check_index(ctx, rep, bad_files, npy)
    report_offsets(ctx, rep)  # after the keys and holes: each problem names its slot's key
    if ctx.checksums is not None:
        nz = np.flatnonzero(ctx.holes & (ctx.checksums != 0))
        for s in nz[:100].tolist():
            rep.problems.append(Problem("hole", f"slot {s} is a hole but its checksum is "
                                        f"{int(ctx.checksums[s]):016x}, expected 0", CHECKSUMS_FILE))
        if len(nz) > 100:
            rep.problems.append(Problem("hole", f"... and {len(nz) - 100} more holes with a non-zero checksum",
                                        CHECKSUMS_FILE))
    return ctx


def _read_manifest(path: str, rep: VerifyReport) -> Ctx | None:
    """The store's manifest as a :class:`Ctx`, or None (a problem noted)."""
    prob = rep.problems
    mpath = os.path.join(path, MANIFEST_FILE)
    if os.path.lexists(mpath) and not stat.S_ISREG(os.lstat(mpath).st_mode):
        prob.append(Problem("manifest", f"{MANIFEST_FILE}: {_file_kind(mpath)}, expected a regular file "
                            "(not read: a store holds regular files only)", MANIFEST_FILE))
        return None
    try:
        m = read_manifest(path, expand=False)
    except IncompleteStoreError:
        raise
    except (FormatError, ValueError, RecursionError) as exc:  # ValueError: e.g. an int of 5,000 digits
        prob.append(Problem("manifest", " ".join(str(exc).split()) or type(exc).__name__, MANIFEST_FILE))
        return None
    if m["part_table"] is not None:
        try:
            m = expand_manifest(m, read_part_table(path, m), os.path.join(path, PART_TABLE_FILE))
        except FormatError as exc:
            prob.append(Problem("part-table", " ".join(str(exc).split()), PART_TABLE_FILE))
            return None
    ctx = Ctx(path, m)
    rep.store_id, rep.backend, rep.records, rep.slots = m["store_id"], m["backend"], m["records"], m["slots"]
    return ctx


def _on_disk(path: str, parts: list[str] | None) -> set[str]:
    """The names in the store's directory, as ``files`` names them: a store
    with parts lists the entries of each part's directory as
    ``parts/<id>/<name>`` (and a directory under ``parts`` that is no part as
    ``parts/<name>``)."""
    names = set(os.listdir(path))
    top = os.path.join(path, PARTS_DIR)
    if parts is None or PARTS_DIR not in names or os.path.islink(top) or not os.path.isdir(top):
        return names
    names.discard(PARTS_DIR)
    known = set(parts)
    for pid in os.listdir(top):
        d = os.path.join(top, pid)
        if pid in known and os.path.isdir(d):
            names.update(f"{PARTS_DIR}/{pid}/{n}" for n in os.listdir(d))
        else:
            names.add(f"{PARTS_DIR}/{pid}")
    return names


def _check_listing(ctx: Ctx, rep: VerifyReport) -> tuple[list[str], set[str], set[str]]:
    """The manifest's file list against the files the store needs and the
    directory: ``(data file names, names not to be read, names on disk)``."""
    prob = rep.problems
    files: dict[str, int] = ctx.m["files"]
    j = lambda n: os.path.join(ctx.path, n)  # noqa: E731
    data_names = data_file_names(ctx.backend, ctx.schema, ctx.m.get("segments"), ctx.m.get("parts"))
    needed = data_names + [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
    if ctx.m.get("part_table") is not None:
        needed.append(PART_TABLE_FILE)
    if ctx.records < ctx.slots:
        needed += [INDEX_FILE, ERRORS_FILE]
    elif ERRORS_FILE in files:  # no holes, skipped annotations only (format.py)
        needed += [ERRORS_FILE]
    for n in needed:
        if n not in files:
            prob.append(Problem("manifest", f"the manifest's 'files' does not list {n}, which this store needs", n))
    for n in sorted(set(files) - set(needed)):
        prob.append(Problem("manifest", f"the manifest's 'files' lists {n}, which does not belong in this store", n))
    on_disk = _on_disk(ctx.path, ctx.m.get("parts"))
    for n in sorted(on_disk - set(files) - {MANIFEST_FILE}):
        what = "directory" if os.path.isdir(j(n)) else "file"
        prob.append(Problem("stray", f"{n}: a stray {what} that is not part of the store (remove it)", n))
    bad_files = _check_file_types(ctx.path, on_disk, set(needed), prob)
    for n in needed:
        if n in bad_files:
            continue
        if n not in on_disk:
            prob.append(Problem("missing", f"{n}: missing; the store needs it (restore it or re-create the store)", n))
            bad_files.add(n)
            continue
        size = os.lstat(j(n)).st_size
        want = files.get(n)
        if want is not None and size != want:
            what = "truncated" if size < want else "extended (bytes appended)"
            prob.append(Problem("size", f"{n}: the manifest says {want:,} bytes, found {size:,}: {what}", n))
            bad_files.add(n)
    return data_names, bad_files, on_disk


class _NpyCheck:
    """Check one ``.npy`` file of the store: its data offset, or None (a
    ``header`` problem noted, the file marked bad)."""

    def __init__(self, ctx: Ctx, rep: VerifyReport, bad_files: set[str]) -> None:
        self.ctx, self.rep, self.bad_files = ctx, rep, bad_files

    def __call__(self, name: str, dtype: Any, shape: tuple[int, ...]) -> int | None:
        if name in self.bad_files:
            return None
        try:
            return check_npy(os.path.join(self.ctx.path, name), np.dtype(dtype), shape, self.ctx.m["files"].get(name))
        except FormatError as exc:
            self.rep.problems.append(Problem("header", str(exc), name))
            self.bad_files.add(name)
            return None


def _check_data_files(ctx: Ctx, rep: VerifyReport, data_names: list[str], bad_files: set[str],
                      npy: _NpyCheck) -> None:
    """The record data files, as the backend's capabilities allow without
    reading records: a positional backend's field files are ``.npy`` files of
    one shape each; LMDB files (``crashes_on_damage``) have their keys counted
    in a child process; any other backend checks its own files."""
    if ctx.cls.positional:
        for seg, first, count in ctx.segments:
            for f in ctx.schema:
                if f.variable:
                    check_offsets(ctx, rep, f.name, seg, first, count, bad_files, npy)
                    continue
                off = npy(ctx.cls.field_file(f.name, seg), f.dtype, (count, *f.shape))
                if off is None:
                    ctx.data_ok = False
                else:
                    ctx.offsets[(f.name, seg)] = off
    elif set(data_names) & bad_files:
        ctx.data_ok = False
    elif ctx.cls.crashes_on_damage:
        _check_lmdb_quick(ctx, rep)
    else:
        _check_with_backend(ctx, rep)


def _check_with_backend(ctx: Ctx, rep: VerifyReport) -> None:
    """Each segment's data files as its backend checks them on open."""
    try:
        ctx.cls.check_available()
    except ImportError as exc:
        rep.problems.append(Problem("backend", f"cannot check the {ctx.backend} data files: {exc}"))
        ctx.data_ok = False
        return
    for seg, _, count in ctx.segments:
        part = ctx.cls(ctx.path, ctx.schema, count, ctx.m["files"], segment=seg)
        try:
            part.check()
        except FormatError as exc:
            rep.problems.append(Problem("header", str(exc), ctx.cls.data_file_names(ctx.schema, seg)[0]))
            ctx.data_ok = False
        finally:
            part.close()


def _check_checksums(ctx: Ctx, rep: VerifyReport, npy: _NpyCheck) -> None:
    path = os.path.join(ctx.path, CHECKSUMS_FILE)
    ck_off = npy(CHECKSUMS_FILE, KEY_DTYPE, (ctx.slots,))
    if ck_off is None:
        ctx.data_ok = False
        return
    ctx.checksums = _load_u8(path, ck_off, ctx.slots)
    dig = file_digest(path, ck_off)
    if dig != ctx.m["checksum_digest"]:
        rep.problems.append(Problem(
            "digest",
            f"{CHECKSUMS_FILE} hashes to {dig} but the manifest says {ctx.m['checksum_digest']}: the "
            "manifest belongs to another store, or the checksums file was changed",
            CHECKSUMS_FILE,
        ))


def _check_keys(ctx: Ctx, rep: VerifyReport, bad_files: set[str], npy: _NpyCheck) -> None:
    prob = rep.problems
    ko_off = npy(KEYS_OFFSETS_FILE, KEY_DTYPE, (ctx.slots + 1,))
    if ko_off is None or KEYS_BLOB_FILE in bad_files:
        return
    offs = _load_u8(os.path.join(ctx.path, KEYS_OFFSETS_FILE), ko_off, ctx.slots + 1)
    with open(os.path.join(ctx.path, KEYS_BLOB_FILE), "rb") as fh:
        blob = fh.read()
    ok = True
    if len(offs) and int(offs[0]) != 0:
        prob.append(Problem("keys", f"{KEYS_OFFSETS_FILE}: the first offset is {int(offs[0])}, expected 0",
                            KEYS_OFFSETS_FILE))
        ok = False
    dec = np.flatnonzero(offs[1:] < offs[:-1])
    if len(dec):
        prob.append(Problem("keys", f"{KEYS_OFFSETS_FILE}: offsets decrease at slot(s) {dec[:10].tolist()}",
                            KEYS_OFFSETS_FILE))
        ok = False
    if len(offs) and int(offs[-1]) != len(blob):
        prob.append(Problem(
            "keys", f"{KEYS_OFFSETS_FILE}: the last offset is {int(offs[-1])} but {KEYS_BLOB_FILE} has "
            f"{len(blob)} bytes (key files from different stores?)", KEYS_OFFSETS_FILE))
        ok = False
    if ok:
        ctx.key_offsets, ctx.key_blob = offs, blob


def _file_kind(p: str) -> str:
    mode = os.lstat(p).st_mode
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(p)!r}"
        except OSError:
            return "a symbolic link"
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _check_file_types(path: str, on_disk: set[str], needed: set[str], prob: list[Problem]) -> set[str]:
    """Flag every symbolic link in the store, and every file of the store that
    is not a regular file; return the names not to be read. A store holds
    regular files only: a link could make a command read (a FIFO that never
    ends, ``/dev/zero``) or write (``verify --repair``) outside the store."""
    bad: set[str] = set()
    for n in sorted(on_disk):
        p = os.path.join(path, n)
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            prob.append(Problem("symlink", f"{n}: {_file_kind(p)}; a store holds regular files only (a link can "
                                "lead reads and writes outside the store): replace it with a copy of the file", n))
            bad.add(n)
        elif n in needed and not stat.S_ISREG(mode):
            prob.append(Problem("not-regular", f"{n}: {_file_kind(p)}, expected a regular file (not read)", n))
            bad.add(n)
    return bad


def _check_index(ctx: Ctx, rep: VerifyReport, bad_files: set[str], npy: Callable[..., int | None]) -> None:
    prob = rep.problems
    if ctx.records == ctx.slots:
        return
    j = lambda n: os.path.join(ctx.path, n)  # noqa: E731
    ix_off = npy(INDEX_FILE, KEY_DTYPE, (ctx.records,))
    index = None
    if ix_off is not None:
        index = _load_u8(j(INDEX_FILE), ix_off, ctx.records)
        if len(index) > 1 and np.any(index[1:] <= index[:-1]):
            at = int(np.flatnonzero(index[1:] <= index[:-1])[0])
            prob.append(Problem("index", f"{INDEX_FILE}: not strictly increasing (at index {at + 1})", INDEX_FILE))
            index = None
        elif len(index) and int(index[-1]) >= ctx.slots:
            prob.append(Problem("index", f"{INDEX_FILE}: slot {int(index[-1])} is out of range (slots: {ctx.slots})",
                                INDEX_FILE))
            index = None
    if index is not None:
        ctx.index = index.astype(np.int64)
        ctx.holes[:] = True
        ctx.holes[ctx.index] = False
    if ERRORS_FILE in bad_files:
        return
    err_slots: list[int] = []
    try:
        with open(j(ERRORS_FILE), "rb") as fh:
            lines = fh.read().split(b"\n")
    except OSError as exc:
        prob.append(Problem("errors", f"{ERRORS_FILE}: cannot read ({exc})", ERRORS_FILE))
        return
    annotations = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8", "surrogateescape"))
            if isinstance(obj, dict) and "annotation" in obj:
                why = _annotation_line_problem(obj, ctx)
                if why:
                    prob.append(Problem("errors", f"{ERRORS_FILE}: line {lineno}: {why}", ERRORS_FILE))
                    return
                annotations += 1
                continue
            if annotations:
                raise TypeError("a hole's line after a skipped annotation's (holes come first)")
            s, k = obj["slot"], obj["key"]
            if not isinstance(s, int) or not isinstance(k, str) or not isinstance(obj["reason"], str):
                raise TypeError("slot must be an int, key and reason strings")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            why = " ".join(str(exc).split())[:200] or type(exc).__name__
            prob.append(Problem("errors", f"{ERRORS_FILE}: line {lineno} is not a valid entry ({why})", ERRORS_FILE))
            return
        if ctx.key_offsets is not None and 0 <= s < ctx.slots and ctx.key_of(s) != k:
            prob.append(Problem("errors", f"{ERRORS_FILE}: line {lineno}: key {k!r} differs from slot {s}'s key "
                                f"{ctx.key_of(s)!r}", ERRORS_FILE))
        err_slots.append(s)
    if err_slots != sorted(set(err_slots)):
        prob.append(Problem("errors", f"{ERRORS_FILE}: entries are not sorted by slot or repeat a slot", ERRORS_FILE))
    if not err_slots and not annotations:
        prob.append(Problem("errors", f"{ERRORS_FILE}: present but empty (it lists holes and skipped "
                            "annotations only)", ERRORS_FILE))
    if len(err_slots) != ctx.slots - ctx.records:
        prob.append(Problem("errors", f"{ERRORS_FILE}: {len(err_slots)} entries, but the store has "
                            f"{ctx.slots - ctx.records} holes (slots - records)", ERRORS_FILE))
    if index is not None:
        holes = np.flatnonzero(ctx.holes).tolist()
        if sorted(set(err_slots)) != holes:
            diff = sorted(set(err_slots) ^ set(holes))[:10]
            prob.append(Problem("index", f"{INDEX_FILE} and {ERRORS_FILE} disagree on which slots are holes "
                                f"(e.g. slots {diff})", INDEX_FILE))


def _annotation_line_problem(obj: dict[str, Any], ctx: Ctx) -> str | None:
    """What is wrong with a skipped annotation's ``errors.jsonl`` line (format.py), or None."""
    s, k, a, i, r = (obj.get(n, "?") for n in ("slot", "key", "annotation", "id", "reason"))

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (is_int(a) and a >= 0 and (i is None or is_int(i)) and isinstance(r, str)):
        return "not a valid skipped-annotation entry (annotation: int >= 0, id: int or null, reason: str)"
    if s is None:
        return None if k is None else "a skipped annotation without a slot has a key (expected null)"
    if not (is_int(s) and 0 <= s < ctx.slots and isinstance(k, str)):
        return f"not a valid skipped-annotation entry (slot: null or 0..{ctx.slots - 1}, key: str)"
    if ctx.key_offsets is not None and ctx.key_of(s) != k:
        return f"key {k!r} differs from slot {s}'s key {ctx.key_of(s)!r}"
    return None


def _check_lmdb_quick(ctx: Ctx, rep: VerifyReport) -> None:
    """Count the keys of every LMDB file, in a child process (a damaged
    page must not kill verify: see :mod:`mmstore.check.verify_lmdb`)."""
    try:
        ctx.cls.check_available()
    except ImportError:
        rep.problems.append(Problem("lmdb", "cannot check records.mdb: the 'lmdb' package is not installed "
                                    "(pip install lmdb)", LMDB_FILE))
        ctx.data_ok = False
        return
    entries = 0
    for seg, _, _ in ctx.segments:
        name = lmdb_file(seg)
        res = lmdb_entries(os.path.join(ctx.path, name))
        if res.failure is not None or res.entries is None:
            why = res.failure or "no answer"
            rep.problems.append(Problem("lmdb", f"{name}: not a readable LMDB environment ({why}); restore the "
                                        "file from a copy or re-create the store", name))
            ctx.data_ok = False
            return
        size = os.lstat(os.path.join(ctx.path, name)).st_size
        if res.pages_bytes is not None and res.pages_bytes > size:
            rep.problems.append(Problem("lmdb", f"{name}: its meta page says its pages use {res.pages_bytes:,} "
                                        f"bytes, but the file has {size:,}: it is truncated or damaged; restore "
                                        "it from a copy or re-create the store", name))
            ctx.data_ok = False
            return
        entries += res.entries
    if entries != ctx.records:
        what = LMDB_FILE if not ctx.segmented else f"the {len(ctx.segments)} LMDB segments"
        rep.problems.append(Problem("lmdb-keys", f"{what}: hold {entries:,} keys, the manifest says {ctx.records:,} "
                                    "records (missing or extra records)", lmdb_file(ctx.segments[0][0])))
