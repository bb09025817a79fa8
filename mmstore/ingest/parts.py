"""Join parts into one store with parts (format.py, "Parts"), without copying
or linking their record data.

A *part* is a complete, unsegmented store written once by one writer (a task
attempt of a distributed engine, see ``mmstore.ray``), whose data files are,
or will be, at ``DEST/parts/<id>/``. :func:`join_parts` reads only each
part's bookkeeping (its manifest, checksums, keys, index and errors, from a
directory that holds at least those: the part itself, or a copy of them
fetched from object storage), checks them against the part's manifest
(sizes, digests), checks that the parts agree (backend, schema, label
names), and writes the joined bookkeeping files and the manifest into a
directory: the commit. The joined store reads exactly like one ingest of the
parts' inputs in part order: its checksums, keys, index and ``errors.jsonl``
are those of that ingest, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from typing import Any

import numpy as np

from .._os.io import fsync_dir
from ..errors import FormatError, IngestError
from ..format.layout import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    PARTIAL_SUFFIX,
    PARTS_DIR,
    encode_key,
    npy_header,
    part_file,
    read_npy_header,
)
from ..format.manifest import read_manifest
from ..format.schema import Schema
from ..store.backends import backend_class
from ..store.writer import FileAppender, errors_jsonl, hasher, publish, write_manifest
from .pipeline import all_failed_error

__all__ = ["BOOKKEEPING_FILES", "PartBook", "commit_parts", "drop_other_parts", "drop_part_bookkeeping", "join_parts",
           "put_books", "put_headers"]

BOOKKEEPING_FILES = (MANIFEST_FILE, CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE, INDEX_FILE, ERRORS_FILE)
"""The files of a part that the join reads (the last two only with holes or errors)."""


class PartBook:
    """The bookkeeping of part ``pid``, read from ``directory`` and checked
    against its manifest (every byte of it is untrusted)."""

    def __init__(self, pid: str, directory: str) -> None:
        self.id, self.dir = pid, directory
        m = self.manifest = read_manifest(directory)
        if m.get("segments") is not None:
            raise FormatError(f"{directory}: a part is one unsegmented store; this one has segments")
        self.slots: int = m["slots"]
        self.records: int = m["records"]
        self.backend: str = m["backend"]
        self.schema = Schema(m["schema"], classes=m["classes"], buckets=m["buckets"], label_names=m["label_names"])
        self.label_names: list[str] | None = m["label_names"]
        self.data_names = backend_class(self.backend).data_file_names(self.schema)
        missing = [n for n in self.data_names if n not in m["files"]]
        if missing:
            raise FormatError(f"{directory}/{MANIFEST_FILE}: 'files' does not list {missing}")

    def _read(self, name: str) -> bytes:
        path = os.path.join(self.dir, name)
        want = self.manifest["files"].get(name)
        try:
            with open(path, "rb") as f:
                data = f.read(want + 1 if want is not None else -1)
        except FileNotFoundError:
            raise FormatError(f"{path}: missing, but the part's manifest lists it") from None
        if want is None or len(data) != want:
            raise FormatError(f"{path}: {len(data)} bytes, the part's manifest says {want}")
        digest = self.manifest["digests"].get(name)
        if digest is not None and _digest(data) != digest:
            raise FormatError(f"{path}: its content does not match the part's manifest (digest); the part is damaged")
        return data

    def _npy(self, name: str, count: int) -> np.ndarray:
        data = self._read(name)
        import io

        dt, shape, off = read_npy_header(os.path.join(self.dir, name), io.BytesIO(data))
        if dt != KEY_DTYPE or shape != (count,) or len(data) != off + 8 * count:
            raise FormatError(f"{os.path.join(self.dir, name)}: expected {KEY_DTYPE.str} ({count},), found "
                              f"{dt.str} {shape} in {len(data)} bytes")
        return np.frombuffer(data, KEY_DTYPE, count, off)

    def checksums(self) -> np.ndarray:
        arr = self._npy(CHECKSUMS_FILE, self.slots)
        if _digest(arr.tobytes()) != self.manifest["checksum_digest"]:
            raise FormatError(f"{os.path.join(self.dir, CHECKSUMS_FILE)}: does not match the part's manifest "
                              "(checksum digest); the part is damaged")
        return arr

    def keys(self) -> tuple[np.ndarray, bytes]:
        offsets = self._npy(KEYS_OFFSETS_FILE, self.slots + 1)
        blob = self._read(KEYS_BLOB_FILE)
        if offsets[0] != 0 or offsets[-1] != len(blob) or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise FormatError(f"{os.path.join(self.dir, KEYS_OFFSETS_FILE)}: not the offsets of its key file")
        return offsets, blob

    def index(self) -> np.ndarray:
        if self.records == self.slots:
            return np.arange(self.slots, dtype=KEY_DTYPE)
        ix = self._npy(INDEX_FILE, self.records)
        if len(ix) and (np.any(np.diff(ix.astype(np.int64)) <= 0) or int(ix[-1]) >= self.slots):
            raise FormatError(f"{os.path.join(self.dir, INDEX_FILE)}: not strictly increasing slots of the part")
        return ix

    def holes(self) -> list[tuple[int, bytes, str]]:
        """``(slot, key bytes, reason)`` of each hole (``errors.jsonl``)."""
        if ERRORS_FILE not in self.manifest["files"]:
            if self.records < self.slots:
                raise FormatError(f"{self.dir}: holes but no {ERRORS_FILE}")
            return []
        out = []
        for lineno, line in enumerate(self._read(ERRORS_FILE).split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line.decode("utf-8", "surrogateescape"))
            except (ValueError, RecursionError):
                raise FormatError(f"{self.dir}/{ERRORS_FILE}: line {lineno} is not JSON") from None
            if not (isinstance(e, dict) and "annotation" not in e and isinstance(e.get("slot"), int)
                    and not isinstance(e["slot"], bool) and 0 <= e["slot"] < self.slots
                    and isinstance(e.get("key"), str) and isinstance(e.get("reason"), str)):
                raise FormatError(f"{self.dir}/{ERRORS_FILE}: line {lineno} is not a hole of the part")
            out.append((int(e["slot"]), encode_key(e["key"]), str(e["reason"])))
        if len(out) != self.slots - self.records:
            raise FormatError(f"{self.dir}/{ERRORS_FILE}: {len(out)} holes listed, the manifest says "
                              f"{self.slots - self.records}")
        return out


def _digest(data: bytes) -> str:
    h = hasher()
    h.update(data)
    return str(h.hexdigest())


def put_headers(out: FileAppender, total: int, records: int) -> None:
    """The ``.npy`` headers of a store's per-slot bookkeeping files, for
    ``total`` slots of which ``records`` hold a record (the index only when
    there are holes)."""
    out.put(CHECKSUMS_FILE, npy_header(KEY_DTYPE, (total,)))
    out.put(KEYS_OFFSETS_FILE, npy_header(KEY_DTYPE, (total + 1,)) + np.zeros(1, KEY_DTYPE).tobytes())
    if records < total:
        out.put(INDEX_FILE, npy_header(KEY_DTYPE, (records,)))


def put_books(out: FileAppender, books: list[PartBook], *, base: int, blob: int, index: bool) -> tuple[int, int]:
    """Append the parts' checksums, keys and (``index``) record slots to a
    store's bookkeeping, the parts starting at slot ``base`` after ``blob``
    bytes of keys; return ``(base, blob)`` past them."""
    for b in books:
        out.put(CHECKSUMS_FILE, b.checksums().tobytes())
        offsets, keys = b.keys()
        out.put(KEYS_OFFSETS_FILE, (offsets[1:] + np.uint64(blob)).tobytes())
        out.put(KEYS_BLOB_FILE, keys)
        if index:
            out.put(INDEX_FILE, (b.index() + np.uint64(base)).tobytes())
        base += b.slots
        blob += len(keys)
    return base, blob


def drop_other_parts(parts_dir: str, keep: list[str]) -> int:
    """Remove what ``parts_dir`` holds besides the parts ``keep`` (parts of
    failed, killed or repeated attempts); return the number of parts removed."""
    removed = 0
    for name in os.listdir(parts_dir):
        if name not in keep:
            p = os.path.join(parts_dir, name)
            if os.path.isdir(p) and not os.path.islink(p):
                removed += 1  # a part (or a killed attempt's .partial)
                shutil.rmtree(p)
            else:
                os.unlink(p)
    return removed


def drop_part_bookkeeping(books: list[PartBook]) -> None:
    """Remove each part's own bookkeeping: the joined store's covers it now."""
    for b in books:
        for name in os.listdir(b.dir):
            if name not in b.data_names:
                os.unlink(os.path.join(b.dir, name))
        fsync_dir(b.dir)


def join_parts(dest_dir: str, books: list[PartBook], *, provenance: dict[str, Any], where: str,
               label_names: list[str] | None = None) -> dict[str, Any]:
    """Write the bookkeeping files and ``manifest.json`` of the store joined
    from ``books`` (in slot order) into ``dest_dir``; the part data files are
    named ``parts/<id>/<name>`` and need not exist there. Return
    ``{"files": {name: size}, "records", "slots", "reasons": Counter}``.

    Raises ``IngestError`` when the parts disagree (backend, schema, label
    names), ``AllInputsFailedError`` when they hold slots but no record
    (``where``: the destination, for messages)."""
    if not books:
        raise IngestError(f"{where}: no inputs found (the dataset has no rows); nothing was created")
    first = books[0]
    for b in books[1:]:
        for what, mine, theirs in (("backend", b.backend, first.backend), ("schema", b.schema, first.schema),
                                   ("label names", b.label_names, first.label_names)):
            if mine != theirs:
                raise IngestError(f"{where}: part {b.id} has {what} {mine!r}, part {first.id} {theirs!r}; every "
                                  "part of a store needs the same (give images a size, or the same shape)")
    total = sum(b.slots for b in books)
    records = sum(b.records for b in books)
    holes = [(base + s, k, r) for base, b in zip(np.cumsum([0] + [b.slots for b in books]).tolist(), books)
             for s, k, r in b.holes()]
    if total and not records:
        raise all_failed_error(where, [(k.decode("utf-8", "surrogateescape"), r) for _, k, r in holes],
                               f"{where}/{ERRORS_FILE} (not published)",
                               "Nothing was created; fix the inputs and write the store again")
    book = [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE] + ([INDEX_FILE, ERRORS_FILE] if records < total else [])
    out = FileAppender(dest_dir, book)
    ok = False
    try:
        put_headers(out, total, records)
        put_books(out, books, base=0, blob=0, index=records < total)
        if records < total:
            out.put(ERRORS_FILE, errors_jsonl(holes))
        ok = True
    finally:
        out.close(sync=ok)
    sizes = {part_file(b.id, n): int(b.manifest["files"][n]) for b in books for n in b.data_names}
    names = list(sizes) + book
    write_manifest(dest_dir, names, backend=first.backend, records=records, slots=total, schema=first.schema,
                   label_names=label_names if label_names is not None else first.label_names,
                   provenance=provenance, segments=[b.slots for b in books], parts=[b.id for b in books],
                   sizes=sizes)
    return {"files": {n: s for n, s in read_manifest(dest_dir)["files"].items()}, "records": records,
            "slots": total, "reasons": Counter(r for _, _, r in holes)}


def commit_parts(dest: str, ids: list[str], *, provenance: dict[str, Any],
                 label_names: list[str] | None = None) -> tuple[dict[str, Any], int]:
    """Commit the parts ``ids`` (in slot order) of ``DEST.partial/parts/`` as
    the store ``dest``: join them (:func:`join_parts`), remove every other
    entry of ``parts/`` (attempts that are not committed, and what their
    writers left) and each part's own bookkeeping, then publish ``dest``
    (one rename; a store there is replaced). Called under the destination
    lock. Returns what :func:`join_parts` returns and the number of
    parts (and killed attempts) removed."""
    partial = dest + PARTIAL_SUFFIX
    parts_dir = os.path.join(partial, PARTS_DIR)
    books = [PartBook(pid, os.path.join(parts_dir, pid)) for pid in ids]
    joined = join_parts(partial, books, provenance=provenance, where=dest, label_names=label_names)
    removed = drop_other_parts(parts_dir, ids)
    drop_part_bookkeeping(books)
    fsync_dir(parts_dir)
    publish(dest)
    return joined, removed
