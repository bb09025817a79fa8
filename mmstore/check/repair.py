"""``verify --repair``: re-ingest the bad records of a store from its source.

Where the source is and how it was decoded comes from the provenance the
ingest writes (``provenance.source``: kind, path and options;
``provenance.ingest.params.decode``: the :class:`mmstore.decode.DecodeSpec`).
A bad slot's key leads back to its input the way the ingest's sources read
it (folder: ``root/key``; list: ``root/path_template(key)``; lmdb: the
value of ``key``; arrays: item ``int(key)``; coco: ``root/key``), which is
decoded again with the same spec. A COCO record's annotation fields are
derived again from the annotation file the provenance names (parsed once),
exactly as the ingest did. Fields the decoder does not produce (the label) keep their stored
bytes, and when those are damaged too every label value is tried.

The re-decoded record is written only when its xxh3_64 equals the checksum
stored at ingest time: that proves it is the original record byte for byte,
so the repaired store is byte-identical to a fresh ingest. A record whose
source is gone, or decodes to other bytes (the file changed), is left as it
is and reported.

A positional backend (memmap, see ``BackendReader.positional``): each
field's entry is written in place, then fsynced (``BackendReader.rewrite_entries``).
Other backends (lmdb: rewriting a value in place would change the page layout): the data
files of each segment concerned are rebuilt the way a writer builds them
(``Backend.rebuild``: for lmdb the same keys in the same order, same transactions), and
replace the old ones atomically (the manifest's size entries are updated if they differ).

A store may come from someone else, so its provenance is untrusted input:
repair writes only to regular files directly inside the store or one of its
parts' directories, reached through no symbolic link (opened with
``O_NOFOLLOW``; its work directory is inside the store too), and bounds what
the provenance can ask for before it allocates or opens anything: the decode
spec must produce exactly the store's image shape (with at most the default
pixel limit), a ``path_template`` may only index the key and pad it to at
most :data:`MAX_TEMPLATE_WIDTH` characters, and a key may not lead out of
the source root (an absolute path or ``..``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .._os.io import atomic_write, fsync_dir
from ..errors import EntryDecodeError, FormatError
from ..format.codecs import library_versions
from ..format.layout import MANIFEST_FILE, PARTS_DIR, decode_key
from ..format.names import json_bytes
from ..store.backends.base import packed_record, unpack_record
from ..store.reader import Store, open_store
from .verify import VerifyReport

__all__ = ["RepairReport", "repair_store"]

REPAIRABLE = ("checksum", "hole-not-zero", "missing", "size", "hole-has-record", "extra-key", "decode", "shape")
MAX_TEMPLATE_WIDTH = 255  # the widest field a provenance path_template may pad to
MAX_LABELS = 100_000  # label values tried for a record whose stored label is damaged
LABEL_SEARCH_BYTES = 2 << 30  # record bytes the label search of one repair may hash (bounded time)
MAX_SOURCE_PATH = 4096  # bytes of a source path built from the provenance and a key
_TEMPLATE_FIELD = re.compile(r"(id|0|)(\[\d{1,4}\])*")
_TEMPLATE_SPEC = re.compile(r"(.?[<>=^])?[-+ ]?0?(\d{1,3})?s?")


@dataclass
class RepairReport:
    attempted: bool = False
    repaired: list[int] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    source: str | None = None
    message: str = ""


class SourceGone(Exception):
    """The source is not reachable (or not re-readable at all)."""


def check_template(tmpl: Any) -> str | None:
    """A provenance ``path_template``, if it only names the key (``{id}``,
    ``{id[0]}``, ``{}``, ``{0}``) with at most a small width; else
    :class:`SourceGone` (a crafted ``{id:>3000000000}`` would allocate 3 GB)."""
    import string

    if tmpl is None:
        return None
    if not isinstance(tmpl, str) or len(tmpl) > MAX_SOURCE_PATH:
        raise SourceGone(f"the provenance's path_template is not a short string ({type(tmpl).__name__})")
    try:
        parts = list(string.Formatter().parse(tmpl))
    except ValueError as exc:
        raise SourceGone(f"the provenance's path_template {tmpl[:80]!r} is not a template ({exc})") from None
    for _, name, spec, conv in parts:
        if name is None:
            continue
        m = _TEMPLATE_SPEC.fullmatch(spec or "")
        if (not _TEMPLATE_FIELD.fullmatch(name) or conv is not None or m is None
                or int(m.group(2) or 0) > MAX_TEMPLATE_WIDTH):
            raise SourceGone(f"the provenance's path_template {tmpl[:80]!r} asks for {{{name}"
                             + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}: repair only "
                             f"expands {{id}}, {{id[N]}} padded to at most {MAX_TEMPLATE_WIDTH} characters")
    return tmpl


def _inside(root: bytes, rel: bytes) -> bytes:
    """``root/rel``, or ValueError if ``rel`` leads out of ``root``."""
    parts = rel.split(b"/")
    if rel.startswith(b"/") or b".." in parts or b"\x00" in rel or len(root) + len(rel) > MAX_SOURCE_PATH:
        raise ValueError(f"the key {os.fsdecode(rel)[:120]!r} leads outside the source folder; not repaired")
    return os.path.join(root, rel)


class _Source:
    """Reads one input again, by key, the way the ingest's source did."""

    def __init__(self, prov: dict[str, Any], image_shape: tuple[int, ...] | None = None) -> None:
        src = prov.get("source")
        if not isinstance(src, dict) or "kind" not in src:
            raise SourceGone("the provenance does not say where the records came from (no source); "
                             "the store was not written by `mmstore ingest`")
        self.kind = src["kind"]
        path = src.get("path")
        self.src = src
        ing = prov.get("ingest") or {}
        params = ing.get("params") or {} if isinstance(ing, dict) else {}
        dec = params.get("decode", prov.get("decode")) if isinstance(params, dict) else None
        self.spec = None
        if dec:
            self.spec = _bounded_spec(dec, image_shape)
        self.template = check_template(src.get("path_template")) if self.kind == "list" else None
        for name in ("path", "root"):
            if src.get(name) is not None and (not isinstance(src[name], str) or len(src[name]) > MAX_SOURCE_PATH
                                              or "\x00" in src[name]):
                raise SourceGone(f"the provenance's source {name} is not a path: {str(src[name])[:80]!r}")
        if self.kind == "dataset":
            raise SourceGone(f"the records came from a Python dataset ({src.get('type')}), which cannot be "
                             "re-read from here; re-create the store with from_dataset()")
        if self.kind == "ray":
            raise SourceGone("the records came from a Ray Data write (mmstore.ray.write), whose rows cannot be read "
                             "again from here; restore the store from a copy, or write it again")
        if self.kind not in ("folder", "list", "lmdb", "arrays", "coco"):
            raise SourceGone(f"unknown source kind {self.kind!r} in the provenance")
        if not path or not os.path.exists(path):
            raise SourceGone(f"the source {path!r} ({self.kind}) is gone; restore it, or restore the store "
                             "from a copy")
        self.path: str = path
        # a list's tags/text fields of (key, slot), derived again from the list (set by repair())
        self.list_fields: Callable[[bytes, int], dict[str, bytes]] | None = None
        self._env: Any = None
        self._arr: Any = None
        self._coco: Any = None  # the COCO source, scanned at its first record
        rng = ing.get("range") if isinstance(ing, dict) else None
        self.lo = int(rng[0]) if isinstance(rng, list) and rng and isinstance(rng[0], int) else 0
        if self.kind == "lmdb":
            import lmdb

            try:
                self._env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, subdir=True, max_dbs=0)
            except lmdb.Error as exc:
                raise SourceGone(f"the source LMDB {self.path!r} cannot be opened ({exc}); restore it, or "
                                 "restore the store from a copy") from None

    def describe(self) -> str:
        return f"{self.kind} {self.path}"

    def load(self, key: bytes) -> Any:
        """Encoded bytes (uint8 array) or the array item of ``key``."""
        from ..decode import read_bytes
        from ..format.layout import decode_key

        if self.kind == "folder":
            return read_bytes(_inside(os.fsencode(self.path), bytes(key)))
        if self.kind == "coco":
            root = self.src.get("root") or os.path.dirname(self.path)
            return read_bytes(_inside(os.fsencode(root), bytes(key)))
        if self.kind == "list":
            k = decode_key(key)
            try:
                rel = self.template.format(k, id=k) if self.template else k
            except (IndexError, KeyError, ValueError) as exc:
                raise ValueError(f"the path_template does not fit the key {k[:80]!r} ({exc})") from None
            root = self.src.get("root") or os.path.dirname(self.path)
            return read_bytes(_inside(os.fsencode(root), os.fsencode(rel)))
        if self.kind == "lmdb":
            with self._env.begin() as txn:
                val = txn.get(bytes(key))
            if val is None:
                raise FileNotFoundError(f"key {key!r} is no longer in the source LMDB")
            return np.frombuffer(val, np.uint8)
        # arrays
        if self._arr is None:
            if self.path.lower().endswith(".npz"):
                z = np.load(self.path, allow_pickle=False)
                ik = self.src.get("image_key") or next(
                    (n for n in ("image", "images", "x", "data", "arr_0") if n in z.files), None)
                self._arr = z[ik]
            else:
                self._arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
        return np.asarray(self._arr[int(decode_key(key))])

    def _coco_source(self) -> Any:
        """The COCO source of the provenance, its JSON parsed once (the
        annotation fields are derived from it as the ingest did)."""
        if self._coco is None:
            from ..errors import IngestError
            from ..ingest.coco import CocoSource

            mbs = self.src.get("min_box_size")
            try:
                self._coco = CocoSource(self.path, root=self.src.get("root"),
                                        min_box_size=mbs if isinstance(mbs, (int, float)) else None)
                self._coco.scan()
            except (IngestError, ValueError) as exc:
                raise SourceGone(f"the source annotation file cannot be read again ({exc})") from None
        return self._coco

    def decode(self, key: bytes, slot: int | None = None) -> dict[str, np.ndarray]:
        raw = self.load(key)
        out: dict[str, np.ndarray] = {}
        if self.kind == "arrays":
            if self.spec is None:
                return {"image": raw}
            from ..decode import fit_array

            d = fit_array(raw, self.spec)
        else:
            from ..decode import decode_image

            if self.spec is None:
                raise SourceGone("the provenance has no decode spec for encoded inputs")
            d = decode_image(raw, self.spec)
        out["image"] = d.image
        if self.spec is not None and self.spec.shaped:  # an image of its own shape: its size beside it
            out["image_hw"] = np.asarray(d.image.shape[:2], "<u4")
        if getattr(d, "orig_size", None) is not None:
            out["orig_size"] = np.asarray(d.orig_size)
        if getattr(d, "box", None) is not None:
            out["box"] = np.asarray(d.box)
        if getattr(d, "dst", None) is not None:
            out["dst"] = np.asarray(d.dst)
        if self.kind == "coco":
            coco = self._coco_source()
            i = self.lo + int(slot if slot is not None else -1)
            if slot is None or not 0 <= i < len(coco.listing) or coco.listing.key(i) != bytes(key):
                raise ValueError("the annotation file no longer lists this record's image at its place (the "
                                 "file changed since the ingest)")
            out.update(coco.record_fields(i, d))
        return out

    def close(self) -> None:
        if self._env is not None:
            self._env.close()


def _bounded_spec(dec: Any, image_shape: tuple[int, ...] | None) -> Any:
    """The provenance's decode spec, if it makes records of the store's image
    shape with at most the default pixel limit (a crafted spec must not make
    repair allocate more than one record, or decode a decompression bomb)."""
    from ..decode import DecodeSpec

    if not isinstance(dec, dict):
        raise ValueError(f"the decode spec is a {type(dec).__name__}, not an object")
    try:
        spec = DecodeSpec.from_dict(dec)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    limit = cast(int, DecodeSpec.__dataclass_fields__["max_pixels"].default)  # an int field with a default
    if not 0 < spec.max_pixels <= limit:
        spec = dataclasses.replace(spec, max_pixels=limit)
    if image_shape is not None and spec.record_shape() != tuple(image_shape):
        raise ValueError(f"it makes records of shape {spec.record_shape()}, the store's image field is "
                         f"{tuple(image_shape)}")
    return spec


def _packed(store: Store, arrays: dict[str, np.ndarray | bytes]) -> bytes:
    """The record's checksummed bytes; an encoded field's value is its
    entry (bytes) or an array, which is encoded with the field's codec."""
    if store.schema.has_variable:
        fixed = {f.name: np.ascontiguousarray(np.asarray(arrays[f.name]), dtype=f.dtype).reshape(f.shape)
                 for f in store.schema.fixed_fields}
        entries = {}
        for f in store.schema.variable_fields:
            v = arrays[f.name]
            a = v if isinstance(v, bytes) else np.ascontiguousarray(np.asarray(v), dtype=f.dtype)
            entries[f.name] = a if isinstance(a, bytes) else f.codec.encode(a if f.ragged else a.reshape(f.shape))
        return bytes(packed_record(store.schema, fixed, entries))
    parts = []
    for f in store.schema:
        a = np.ascontiguousarray(np.asarray(arrays[f.name]), dtype=f.dtype)
        if a.shape != f.shape:
            a = a.reshape(f.shape)
        parts.append(a.tobytes())
    return b"".join(parts)


def _stored_fields(store: Store, slot: int) -> dict[str, np.ndarray | bytes]:
    """The stored (possibly damaged) fields of ``slot``; zeros where absent.
    An encoded field's value is its stored entry (bytes)."""
    out: dict[str, Any] = {f.name: np.zeros(f.shape, f.dtype) if not f.variable else b"" for f in store.schema}
    if store.schema.has_variable:
        try:
            for _, packed in store.slot_view.backend.iter_packed(slot, slot + 1):
                parts = unpack_record(store.schema, packed) if packed is not None else None
                if parts is not None:
                    out.update({k: np.array(v) for k, v in parts[0].items()})
                    out.update({k: bytes(v) for k, v in parts[1].items()})
        except (EntryDecodeError, FormatError):  # offsets or an lmdb value off its layout: nothing usable
            pass
        return out
    for _, packed in store.slot_view.backend.iter_packed(slot, slot + 1):
        if packed is not None and len(packed) == store.schema.record_bytes:
            pos = 0
            for f in store.schema:
                out[f.name] = np.frombuffer(bytes(packed[pos : pos + f.nbytes]), f.dtype).reshape(f.shape)
                pos += f.nbytes
    return out


def _rebuild(store: Store, src: _Source, slot: int, want: int, label_range: int, budget: list[int],
             encoders: str = "", src_slot: int | None = None) -> bytes:
    """The original packed record of ``slot`` (checksum ``want``) or raise.
    ``budget[0]``: bytes the label search may still hash in this repair;
    ``encoders``: :func:`encoder_mismatch` (said when nothing matches);
    ``src_slot``: the slot as its source numbers it (an appended part's
    first slot is its source's 0), ``slot`` when None."""
    import xxhash

    key = store.slot_view.slot_key_bytes(slot)
    if not key:
        raise ValueError("the slot has no source key")
    at = slot if src_slot is None else src_slot
    try:
        fresh = src.decode(key, at)
    except SourceGone:
        raise
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise ValueError(f"the source input cannot be read or decoded again ({reason})") from None
    rec = _stored_fields(store, slot)
    for k, v in fresh.items():
        if k in rec:
            rec[k] = v
    if src.list_fields is not None:
        rec.update(src.list_fields(key, at))  # entries (bytes), kept as they are below
    if store.schema.has_variable:  # encode once; the label search below only changes raw bytes
        rec = _encoded(store, rec)
    packed = _packed(store, rec)
    if xxhash.xxh3_64_intdigest(packed) == want:
        return packed
    lab = next((f for f in store.schema if f.name == "label" and f.shape == ()), None)
    if lab is not None:
        for cand in range(label_range):
            budget[0] -= len(packed)
            if budget[0] < 0:
                raise ValueError("the decoded image does not match, and the label search of this repair has "
                                 f"used its {LABEL_SEARCH_BYTES >> 30} GiB; not repaired")
            rec["label"] = np.asarray(cand, lab.dtype)
            packed = _packed(store, rec)
            if xxhash.xxh3_64_intdigest(packed) == want:
                return packed
    if encoders:
        raise ValueError(f"the re-encoded record does not match its checksum, and {encoders}; install that "
                         "version and run the repair again, or re-ingest the store")
    raise ValueError("the source decodes to other bytes than the ones checksummed at ingest (the input or the "
                     "decoder changed since); not repaired")


def _encoded(store: Store, rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` with each encoded field that holds an array encoded (bytes)."""
    out = dict(rec)
    for f in store.schema.variable_fields:
        v = out[f.name]
        if not isinstance(v, bytes):
            a = np.ascontiguousarray(np.asarray(v), dtype=f.dtype)
            out[f.name] = f.codec.encode(a if f.ragged else a.reshape(f.shape))
    return out


def encoder_mismatch(store: Store) -> str:
    """Why re-encoding may not reproduce the stored entries: the encoder
    library versions the provenance names that differ from the ones here
    ("" when they agree, or nothing is encoded)."""
    if not store.schema.has_variable:
        return ""
    here = library_versions(f.codec for f in store.schema.variable_fields)
    then = store.provenance.get("codec_libraries")
    then = then if isinstance(then, dict) else {}
    diff = [f"{k} entries were made by {str(then.get(k, 'an unrecorded version'))[:80]!r}, this machine has {v!r}"
            for k, v in sorted(here.items()) if then.get(k) != v]
    return "the store's " + "; its ".join(diff) if diff else ""


class _Sources:
    """The source of each slot: the store's own (``provenance.source``), or,
    for the slots of a part added by ``mmstore append``, the source that
    append read (``provenance.appended[k]``: its ``source``, its first slot
    ``from_slot`` and ``records``), decoded with the store's decode spec
    (append refuses other options). Each is opened at its first use; one
    that cannot be reached fails the slots it holds only."""

    def __init__(self, prov: dict[str, Any], image: tuple[int, ...] | None, schema: Any) -> None:
        self.prov, self.image, self.schema = prov, image, schema
        ing = prov.get("ingest")
        params = ing.get("params") if isinstance(ing, dict) else None
        decode = params.get("decode", prov.get("decode")) if isinstance(params, dict) else prov.get("decode")
        self.parts: list[tuple[int, int, dict[str, Any]]] = []  # (first slot, end, provenance of the part)
        appended = prov.get("appended")
        for e in appended if isinstance(appended, list) else []:
            lo, n = (e.get("from_slot"), e.get("records")) if isinstance(e, dict) else (None, None)
            if (isinstance(lo, int) and isinstance(n, int) and not isinstance(lo, bool) and lo >= 0 and n >= 0
                    and isinstance(e.get("source"), dict)):
                self.parts.append((lo, lo + n, {"source": e["source"],
                                                "ingest": {"params": {"decode": decode}, "range": [0, n]}}))
        self._open: dict[int, _Source | SourceGone] = {}

    def _which(self, slot: int) -> tuple[int, int]:
        """(-1, 0) for the store's own source, else (k, first slot) of appended part ``k``."""
        for k, (lo, hi, _) in enumerate(self.parts):
            if lo <= slot < hi:
                return k, lo
        return -1, 0

    def for_slot(self, slot: int) -> tuple[_Source, int]:
        """The source of ``slot`` and the slot as that source numbers it.

        Raises
        ------
        SourceGone
            That source is not reachable (or not re-readable at all).
        ValueError
            The provenance's decode spec is not usable here.
        """
        k, lo = self._which(slot)
        got = self._open.get(k)
        if got is None:
            prov = self.prov if k < 0 else self.parts[k][2]
            try:
                got = _Source(prov, self.image)
            except SourceGone as exc:
                got = exc
            else:  # a list's tags/text, derived again from the list (mmstore/ingest/tags.py)
                from ..ingest.lists import list_fields_for_repair

                got.list_fields = list_fields_for_repair(prov, self.schema)
            self._open[k] = got
        if isinstance(got, SourceGone):
            raise got
        return got, slot - lo

    def describe(self) -> str | None:
        used = [s.describe() for s in self._open.values() if isinstance(s, _Source)]
        return "; ".join(used) if used else None

    def close(self) -> None:
        for s in self._open.values():
            if isinstance(s, _Source):
                s.close()


def repair_store(path: str | os.PathLike[str], report: VerifyReport) -> RepairReport:
    """Repair the bad records ``report`` (a content :func:`verify_store`
    report of ``path``) names. Structural problems are not repaired."""
    rr = RepairReport()
    if any(p.kind == "offsets" for p in report.problems):
        rr.message = ("refused: an encoded field's offsets index is damaged, so the entries' positions are not "
                      "known and no entry can be proven and written back; the store must be re-ingested "
                      "(`mmstore ingest SOURCE STORE --codec ... --overwrite`, with the store's codecs) or "
                      "restored from a copy")
        return rr
    if any(p.kind != "lmdb-keys" for p in report.problems):  # a key count off is what a rebuild fixes
        kinds = sorted({p.kind for p in report.problems})
        rr.message = (f"refused: the store has structural problems ({', '.join(kinds)}); repair only restores "
                      "records. Restore the named files from a copy or re-create the store")
        return rr
    if not report.content_checked:
        rr.message = "refused: the record content was not checked (run verify without --quick)"
        return rr
    bad = [b for b in report.bad_records if b.what in REPAIRABLE]
    if not bad:
        rr.message = "nothing to repair"
        return rr
    if report.bad_count > len(report.bad_records):
        rr.message = f"refused: {report.bad_count:,} bad records is more than repair lists; re-create the store"
        return rr
    store = open_store(path)
    try:
        image = store.schema["image"].shape if "image" in store.schema else None
        sources = _Sources(store.provenance, image, store.schema)
        need = [b for b in bad if b.what in ("checksum", "missing", "size", "decode", "shape") and b.slot >= 0]
        gone: list[SourceGone] = []
        for b in need:  # every source the repair needs, opened before anything is written
            try:
                sources.for_slot(b.slot)
            except SourceGone as exc:
                gone.append(exc)
            except ValueError as exc:
                rr.message = f"refused: the provenance's decode spec is not usable here ({exc})"
                return rr
        if need and len(gone) == len(need):
            rr.message = f"refused: {gone[0]}"
            rr.failed = [{"slot": b.slot, "key": b.key, "reason": "source not reachable"} for b in bad]
            return rr
        rr.source = sources.describe()
        ck = np.array(store.slot_view.checksums())
        names = store.label_names or []
        label_range = min(MAX_LABELS, len(names))
        if "label" in store.schema and not label_range and store.records:
            col = store.column("label")
            label_range = int(min(MAX_LABELS, max(0, int(col.max()) + 1)))
        budget = [LABEL_SEARCH_BYTES]
        fixes: dict[int, bytes] = {}
        encoders = encoder_mismatch(store)
        hole = _hole_record(store)
        for b in bad:
            if b.slot < 0 or b.what in ("hole-has-record", "extra-key"):
                continue  # lmdb: dropped by the rebuild below
            if b.slot in fixes:
                continue  # named twice (checksum and decode)
            if b.what == "hole-not-zero":
                fixes[b.slot] = hole
                continue
            try:
                src, at = sources.for_slot(b.slot)
                fixes[b.slot] = _rebuild(store, src, b.slot, int(ck[b.slot]), label_range, budget, encoders, at)
            except (ValueError, SourceGone) as exc:
                rr.failed.append({"slot": b.slot, "key": b.key, "reason": str(exc)})
        sources.close()
        dropped = sum(b.what in ("hole-has-record", "extra-key") for b in bad)
        in_place = store.slot_view.backend.positional
        needs_rebuild = not in_place and bool(fixes or dropped)
        rr.attempted = bool(fixes) or needs_rebuild
        if in_place and store.schema.has_variable:
            for slot, reason in _write_encoded_in_place(store, fixes).items():
                key = decode_key(store.slot_view.slot_key_bytes(slot))
                rr.failed.append({"slot": slot, "key": key, "reason": reason})
                del fixes[slot]
            rr.attempted = bool(fixes)
        elif in_place:
            _write_in_place(store, fixes)
        elif needs_rebuild:
            _rebuild_segments(store, fixes, drop=bool(dropped))
        rr.repaired = sorted(fixes)
        fixed = len(fixes) + (dropped if needs_rebuild else 0)
        rr.message = (f"repaired {fixed} of {len(bad)} bad record(s)"
                      + (f" from {rr.source}" if rr.source and fixes else "")
                      + (f" (dropped {dropped} LMDB key(s) that are not records)" if dropped else "")
                      + (f"; {len(rr.failed)} could not be repaired" if rr.failed else ""))
        return rr
    finally:
        store.close()


def open_for_repair(store_path: str, path: str, flags: int) -> int:
    """Open ``path`` for writing only if it is a regular file directly inside
    the store directory: never through a symbolic link (``O_NOFOLLOW``), a
    FIFO or device, or into another directory. Raises :class:`FormatError`."""
    folder, name = os.path.split(os.path.abspath(path))
    if not _store_folder(store_path, folder) or name in ("", ".", ".."):
        raise FormatError(f"{path}: not a file of the store {store_path}; repair writes only inside the store")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(f"{path}: a symbolic link; repair does not write through links (they can lead "
                              "outside the store): replace it with a copy of the file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{path}: not a regular file; repair writes only to the store's own files")
    return fd


def _store_folder(store_path: str, folder: str) -> bool:
    """Whether ``folder`` is the store's directory or one of its parts'
    (``parts/<id>``, format.py "Parts"), reached through no symbolic link."""
    root = os.path.realpath(store_path)
    if os.path.realpath(folder) == root:
        return True
    parent, pid = os.path.split(os.path.abspath(folder))
    if pid in ("", ".", "..") or parent != os.path.join(os.path.abspath(store_path), PARTS_DIR):
        return False
    return os.path.realpath(folder) == os.path.join(root, PARTS_DIR, pid)  # neither is a link


def _writable(store: Store) -> Callable[[str], int]:
    """How repair opens a data file of ``store`` for writing (``open_for_repair``)."""
    return lambda path: open_for_repair(store.path, path, os.O_WRONLY)


def _write_in_place(store: Store, fixes: dict[int, bytes]) -> None:
    """Write each fixed record's fields at their positions (a positional backend)."""
    if not fixes:
        return
    for f in store.schema:
        if not f.nbytes:
            continue
        pos = store.schema.offset(f.name)
        entries = {s: memoryview(packed)[pos : pos + f.nbytes] for s, packed in fixes.items()}
        store.slot_view.backend.rewrite_entries(f.name, entries, _writable(store))


def _hole_record(store: Store) -> bytes:
    """The checksummed bytes a hole holds: zero raw fields, empty entries."""
    return bytes(packed_record(store.schema, {f.name: np.zeros(f.shape, f.dtype) for f in store.schema.fixed_fields},
                               {f.name: b"" for f in store.schema.variable_fields}))


def _write_encoded_in_place(store: Store, fixes: dict[int, bytes]) -> dict[int, str]:
    """A memmap store with encoded fields: write each fixed record's raw
    fields at their positions and each entry over its stored one, which
    must have the same length (the offsets index is never rewritten: it is
    shared with the parts of a merged store). Returns ``{slot: why not}``
    for the records left as they were."""
    failed: dict[int, str] = {}
    writes: dict[str, dict[int, Any]] = {}  # field -> {slot: its new entry}
    for part in store.slot_view.backend.segment_backends():
        lo = part.first or 0
        for s in sorted(x for x in fixes if lo <= x < lo + part.slots):
            parts = unpack_record(store.schema, fixes[s])
            if parts is None:  # cannot happen: built by _packed
                failed[s] = "internal error: the rebuilt record has no valid layout"
                continue
            mine: dict[str, Any] = {}
            for f in store.schema.variable_fields:
                offs, size = part.entry_offsets(f.name), part.entry_data_size(f.name)
                a, b = int(offs[s - lo]), int(offs[s - lo + 1])
                new = bytes(parts[1][f.name])
                if not a <= b <= size or b - a != len(new):
                    failed[s] = (f"field {f.name!r}: the proven entry has {len(new)} bytes but the slot holds "
                                 f"{max(0, b - a)} (its offsets are {a}..{b}); an entry cannot change size in "
                                 "place: re-ingest the store (`mmstore ingest ... --overwrite` with its codecs) "
                                 "or restore it from a copy")
                    break
                mine[f.name] = new
            else:
                for f in store.schema.fixed_fields:
                    if f.nbytes:
                        mine[f.name] = parts[0][f.name].tobytes()
                for name, data in mine.items():
                    writes.setdefault(name, {})[s] = data
    for name, entries in writes.items():
        store.slot_view.backend.rewrite_entries(name, entries, _writable(store))
    return failed


def _rewrite_part_table(store: Store, obj: dict[str, Any], sizes: dict[str, int]) -> None:
    """Write the store's part table again with the new ``sizes`` of some of
    its parts' files, and list its own new size and digest in ``obj`` (the
    manifest, written next)."""
    from ..format.layout import PART_TABLE_FILE, part_file
    from ..format.parttable import encode_part_table, part_data_names
    from ..store.writer import file_digest

    m = store.manifest
    names = part_data_names(m["backend"], m["schema"])
    files = {**m["files"], **sizes}
    rows = [[int(files[part_file(pid, n)]) for n in names] for pid in m["parts"]]
    path = os.path.join(store.path, PART_TABLE_FILE)
    atomic_write(path, encode_part_table(m["parts"], m["segments"], rows))
    obj["files"][PART_TABLE_FILE] = os.path.getsize(path)
    obj["digests"][PART_TABLE_FILE] = file_digest(path)


def _rebuild_segments(store: Store, fixes: dict[int, bytes], drop: bool) -> None:
    """Rebuild the data files of every segment that holds a fix, or (``drop``)
    an entry that is not a record; the others stay as they are (in a merged
    store they stay shared with the part they came from). The new files are
    all built before the first replaces its old one, then the manifest's
    sizes are updated."""
    holes = np.ones(store.slots, bool)
    holes[store.slot_view.slots_of(np.arange(store.records))] = False
    todo = []
    for part in store.slot_view.backend.segment_backends():
        lo, count = part.first or 0, part.slots
        need = any(lo <= s < lo + count for s in fixes)
        if drop and not need:  # does this segment hold an entry that is not a record?
            need = part.has_stray_entries(holes[lo : lo + count])
        if need:
            todo.append((part, lo, count))
    built: list[tuple[str, str]] = []  # (new file, the store's file it replaces)
    works: list[str] = []
    try:
        for part, lo, count in todo:
            work = os.path.join(store.path, f".repair-{uuid.uuid4().hex[:8]}")  # inside the store, never next to it
            os.mkdir(work)
            works.append(work)
            part.rebuild(work, holes[lo : lo + count], {s - lo: v for s, v in fixes.items() if lo <= s < lo + count})
            names = part.data_file_names(store.schema, part.segment)
            built += [(os.path.join(work, new), name) for new, name in zip(part.data_file_names(store.schema), names)]
        store.close()
        for new, name in built:
            # a new inode: a part store sharing the old file (merge) keeps it
            os.replace(new, os.path.join(store.path, name))
        fsync_dir(store.path)
        sizes = {name: os.path.getsize(os.path.join(store.path, name)) for _, name in built}
        if any(size != store.manifest["files"].get(name) for name, size in sizes.items()):
            mpath = os.path.join(store.path, MANIFEST_FILE)
            with open(mpath, "rb") as fh:
                obj = json.loads(fh.read())
            if obj.get("part_table") is not None:  # the parts' sizes live in the part table: a new one
                _rewrite_part_table(store, obj, sizes)
            else:
                obj["files"].update(sizes)
            atomic_write(mpath, json_bytes(obj, indent=1) + b"\n")
    finally:
        for work in works:
            shutil.rmtree(work, ignore_errors=True)
