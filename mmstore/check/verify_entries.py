"""verify's checks of variable-size (encoded) fields (format.py, "Encoded fields").

Structure: every ``<field>.offsets.npy`` is read in full (the reader checks
only its first and last offset at open): ``offsets[0] == 0``, each slot's
pair ``offsets[s] <= offsets[s + 1] <= size of <field>.bin`` and
``offsets[-1] ==`` that size; each problem names the field, the slot and its
key. A slot whose offsets do not place its entry inside the ``.bin`` is also
a bad record (``offsets``), so ``--repair`` sees it.

Content: each record's checksummed bytes (the fixed fields' bytes and each
entry's ``<u8`` length and stored bytes, in schema order) are hashed from
large sequential reads, by threads; with ``decode`` every entry is also
decoded with its field's codec and each one that fails is a bad record
(``decode``, the codec's reason). An entry of a shaped field (format.py,
"Images of their own shape") is checked against its record's ``<field>_hw``
in every full pass, without decoding (``shape``: a raw entry's size, a zstd
frame's content size, a JPEG's or PNG's header). LMDB stores are hashed by verify's child
processes (:mod:`mmstore.check.verify_lmdb`); their entries are decoded
afterwards, in this process, through the backend (:func:`decode_packed`),
only when walking every file succeeded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import EntryDecodeError
from ..format.layout import KEY_DTYPE, variable_files
from ..format.ragged import check_entry
from ..format.shaped import check_shaped
from .verify_context import Ctx
from .verify_report import Problem, VerifyReport

__all__ = ["check_offsets", "check_shaped_entry", "content_variable", "decode_packed", "report_offsets"]

MAX_NAMED = 10  # offsets problems named one by one per file (the rest are counted)
_CHUNK_BYTES = 8 << 20


def check_offsets(ctx: Ctx, rep: VerifyReport, name: str, seg: int | str | None, first: int, count: int,
                  bad_files: set[str], npy: Callable[..., int | None]) -> None:
    """Read the whole offsets index of field ``name`` in segment ``seg`` and
    note what is wrong with it (named by :func:`report_offsets`, once the
    keys are known); mark the data unreadable when the file itself is bad."""
    data, offs_name = variable_files(name, seg)
    off = npy(offs_name, KEY_DTYPE, (count + 1,))
    if off is None or data in bad_files:
        ctx.data_ok = False
        return
    with open(os.path.join(ctx.path, offs_name), "rb") as fh:
        fh.seek(off)
        offs = np.fromfile(fh, dtype=KEY_DTYPE, count=count + 1)
    size = os.lstat(os.path.join(ctx.path, data)).st_size
    if len(offs) != count + 1:  # shrank since its size was checked
        rep.problems.append(Problem("offsets", f"{offs_name}: short read; the file changed during verify", offs_name))
        ctx.data_ok = False
        return
    ctx.entries[(name, seg)] = (offs, size)
    bad = (offs[:-1] > offs[1:]) | (offs[1:] > np.uint64(size))
    if int(offs[0]) != 0:
        ctx.offset_findings.append((name, offs_name, first, np.zeros(0, np.int64),
                                    f"the first offset is {int(offs[0])}, expected 0"))
    if int(offs[-1]) != size:
        ctx.offset_findings.append((name, offs_name, first, np.zeros(0, np.int64),
                                    f"the last offset is {int(offs[-1])}, but {data} has {size:,} bytes (they "
                                    "must be equal)"))
    if bad.any():
        local = np.flatnonzero(bad)
        ctx.bad_entries.setdefault(name, np.zeros(ctx.slots, dtype=bool))[first + local] = True
        ctx.offset_findings.append((name, offs_name, first, local, ""))


def report_offsets(ctx: Ctx, rep: VerifyReport) -> None:
    """One problem per finding of :func:`check_offsets`, each bad slot named
    with its key (the first ``MAX_NAMED`` of a file; the rest counted)."""
    for name, file, first, local, what in ctx.offset_findings:
        seg = _segment_of(ctx, first)
        offs, size = ctx.entries[(name, seg)]
        data = variable_files(name, seg)[0]
        if what:
            rep.problems.append(Problem("offsets", f"{file}: field {name!r}: {what}; the offsets index is damaged",
                                        file))
            continue
        for j in local[:MAX_NAMED].tolist():
            s = first + j
            a, b = int(offs[j]), int(offs[j + 1])
            rep.problems.append(Problem(
                "offsets", f"{file}: field {name!r}, slot {s} (key {ctx.key_of(s)!r}): its entry's offsets "
                f"{a}..{b} are not an increasing pair within the {size:,}-byte {data}", file))
        if len(local) > MAX_NAMED:
            rep.problems.append(Problem("offsets", f"{file}: field {name!r}: ... and {len(local) - MAX_NAMED:,} "
                                        "more slots with offsets out of order or past the end", file))


def _segment_of(ctx: Ctx, first: int) -> int | str | None:
    for seg, f, _ in ctx.segments:
        if f == first:
            return seg
    return None


def _pread(fd: int, n: int, off: int, name: str) -> memoryview:
    """``n`` bytes of ``fd`` at ``off`` (``OSError`` naming ``name`` when the file ends first)."""
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [mv[got:]], off + got)
        if k <= 0:
            raise OSError(f"{name}: short read at offset {off + got}")
        got += k
    return mv


class _Segment:
    """The open files of one segment while its records are checked."""

    def __init__(self, ctx: Ctx, seg: int | str | None) -> None:
        self.fds: dict[str, int] = {}
        self.names: dict[str, str] = {}
        try:
            for f in ctx.schema:
                if f.variable:
                    name = variable_files(f.name, seg)[0]
                elif f.nbytes:
                    name = ctx.cls.field_file(f.name, seg)
                else:
                    continue
                fd = os.open(os.path.join(ctx.path, name), os.O_RDONLY)
                self.fds[f.name], self.names[f.name] = fd, name
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])


def content_variable(ctx: Ctx, col: Any, threads: int, progress: Callable[[int], Any] | None,
                     decode: bool) -> int:
    """Hash (and with ``decode`` decode) every record of a positional store
    with variable-size fields; return the bytes read. ``col`` collects bad
    records (verify's ``_Collector``)."""
    import xxhash

    stored = ctx.checksums
    if stored is None:
        raise ValueError("verify: the content pass needs the checksums")
    schema = ctx.schema
    local = threading.local()
    total = 0

    def scratch(name: str) -> np.ndarray | None:
        bufs = getattr(local, "bufs", None)
        if bufs is None:
            bufs = local.bufs = {f.name: np.empty(f.shape, f.dtype) for f in schema.variable_fields if not f.ragged}
        return bufs.get(name)

    def run(files: _Segment, seg: int | str | None, first: int, a: int, b: int) -> int:
        n = b - a
        fixed = {f.name: _pread(files.fds[f.name], n * f.nbytes, ctx.offsets[(f.name, seg)] + (a - first) * f.nbytes,
                                files.names[f.name]) for f in schema.fixed_fields if f.nbytes}
        entries = {f.name: _read_entries(files, ctx.entries[(f.name, seg)], f.name, a - first, b - first)
                   for f in schema.variable_fields}
        h = xxhash.xxh3_64()
        nbytes = sum(len(v) for v in fixed.values())
        for j in range(n):
            s = a + j
            rec = {k: v[j] for k, v in entries.items()}
            nbytes += sum(len(e) for e in rec.values() if e is not None)
            broken = [k for k, e in rec.items() if e is None]
            if broken:
                col.bad(s, "offsets", "an entry inside the data file",
                        f"field {broken[0]!r}: offsets out of order or past the end")
                continue
            if ctx.holes[s]:
                zero = all(not np.frombuffer(v[j * schema[k].nbytes : (j + 1) * schema[k].nbytes], np.uint8).any()
                           for k, v in fixed.items())
                if not zero or any(len(e) for e in rec.values() if e is not None):
                    col.bad(s, "hole-not-zero", "zero bytes and empty entries", "bytes stored for a hole")
                continue
            h.reset()
            for f in schema:
                if f.variable:
                    e = rec[f.name]
                    if e is None:  # pragma: no cover - a broken entry is reported above
                        continue
                    h.update(len(e).to_bytes(8, "little"))
                    h.update(e)
                elif f.nbytes:
                    h.update(fixed[f.name][j * f.nbytes : (j + 1) * f.nbytes])
            got = h.intdigest()
            if got != int(stored[s]):
                col.bad(s, "checksum", f"{int(stored[s]):016x}", f"{got:016x}")
            for f in schema.shaped_fields:
                hw = np.frombuffer(fixed[f.hw_name][j * 8 : (j + 1) * 8], "<u4")
                check_shaped_entry(col, s, f, rec[f.name], hw, decode)
            if decode:
                for f in schema.variable_fields:
                    if f.shaped:
                        continue
                    try:
                        check_entry(f, rec[f.name], scratch(f.name))
                    except EntryDecodeError as exc:
                        col.bad(s, "decode", f"field {f.name!r}: a {f.codec.spec} entry of {f.dtype.str} "
                                f"{list(f.shape)}", str(exc))
        if progress is not None:
            with col.lock:
                progress(nbytes)
        return nbytes

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="mmstore-verify") as ex:
        for seg, first, count in ctx.segments:
            if not count:
                continue
            avg = sum(ctx.entries[(f.name, seg)][1] for f in schema.variable_fields) // count
            per = max(1, min(1 << 16, _CHUNK_BYTES // max(1, schema.record_bytes + avg)))
            files = _Segment(ctx, seg)
            try:
                futs = []
                try:
                    for a in range(first, first + count, per):
                        futs.append(ex.submit(run, files, seg, first, a, min(first + count, a + per)))
                        if len(futs) >= 2 * max(1, threads):
                            total += futs.pop(0).result()
                finally:
                    for fu in futs:  # every read of this segment ends before its files close
                        total += fu.result()
            finally:
                files.close()
    return total


def _read_entries(files: _Segment, where: tuple[np.ndarray, int], name: str, la: int,
                  lb: int) -> list[memoryview | None]:
    """The stored entries of local slots ``[la, lb)`` (None: offsets out of
    range), read in one piece when their offsets are sound."""
    offs, size = where
    o = offs[la : lb + 1]
    ok = (o[:-1] <= o[1:]) & (o[1:] <= np.uint64(size))
    fd, fname = files.fds[name], files.names[name]
    if ok.all():
        start = int(o[0])
        mv = _pread(fd, int(o[-1]) - start, start, fname)
        rel = (o - np.uint64(start)).tolist()
        return [mv[rel[j] : rel[j + 1]] for j in range(lb - la)]
    out: list[memoryview | None] = []
    for j in range(lb - la):
        out.append(_pread(fd, int(o[j + 1]) - int(o[j]), int(o[j]), fname) if ok[j] else None)
    return out


def check_shaped_entry(col: Any, slot: int, f: Any, entry: Any, hw: Any, decode: bool) -> None:
    """Note slot ``slot`` bad when its entry of shaped field ``f`` does not
    have the size ``hw`` says (``shape``) or, with ``decode``, does not
    decode (``decode``)."""
    try:
        check_shaped(f, entry, hw, decode=False)
    except EntryDecodeError as exc:
        col.bad(slot, "shape", f"field {f.name!r}: an entry of the {int(hw[0])} x {int(hw[1])} pixels its "
                f"{f.hw_name!r} says", str(exc))
        return
    if decode:
        try:
            check_shaped(f, entry, hw)
        except EntryDecodeError as exc:
            col.bad(slot, "decode", f"field {f.name!r}: a {f.codec.spec} entry of {f.dtype.str} "
                    f"{[int(hw[0]), int(hw[1]), *f.shape[2:]]}", str(exc))


def decode_packed(ctx: Ctx, col: Any, skip: set[int], decode: bool = True) -> None:
    """Decode every entry of every record through the backend (lmdb), slots
    in ``skip`` (already bad) and holes left out; each failure is a
    ``decode`` bad record, and a record the backend refuses to read is one
    too (named with the backend's reason). Without ``decode`` only the
    entries of shaped fields are checked, against their sizes."""
    schema = ctx.schema
    scratch = {f.name: np.empty(f.shape, f.dtype) for f in schema.variable_fields if not f.ragged}
    skip_all = skip | _holes(ctx)
    for seg, first, count in ctx.segments:
        part = ctx.cls(ctx.path, schema, count, ctx.m["files"], segment=seg)
        try:
            pos = 0
            while pos < count:
                done = pos - 1
                try:
                    for s in _decode_range(part, pos, count, first, skip_all, scratch, schema, col, decode):
                        done = s
                    pos = count
                except Exception as exc:  # noqa: BLE001 - e.g. a value off its layout: that slot is bad
                    bad = done + 1
                    if first + bad not in skip_all:  # else reported already (by the checksum pass)
                        col.bad(first + bad, "decode", "a record whose entries can be read",
                                " ".join(str(exc).split())[:300])
                    pos = bad + 1
        finally:
            part.close()


def _holes(ctx: Ctx) -> set[int]:
    return set(np.flatnonzero(ctx.holes).tolist())


def _decode_range(part: Any, a: int, b: int, first: int, skip: set[int], scratch: dict[str, np.ndarray],
                  schema: Any, col: Any, decode: bool = True) -> Any:
    """Decode the entries of local slots ``[a, b)``; yield each local slot
    once done (so a failure is known to be at the next one)."""
    from ..store.backends.base import unpack_record

    for s, packed in part.iter_packed(a, b):
        g = first + s
        if packed is not None and g not in skip:
            parts = unpack_record(schema, packed)
            entries = parts[1] if parts is not None else {}
            for f in schema.shaped_fields if parts is not None else ():
                check_shaped_entry(col, g, f, entries[f.name], parts[0][f.hw_name], decode)  # type: ignore[index]
            for f in schema.variable_fields if parts is not None and decode else ():
                if f.shaped:
                    continue
                try:
                    check_entry(f, entries[f.name], scratch.get(f.name))
                except EntryDecodeError as exc:
                    col.bad(g, "decode", f"field {f.name!r}: a {f.codec.spec} entry of {f.dtype.str} "
                            f"{list(f.shape)}", str(exc))
        yield s
