"""``convert``: rewrite a store in another backend and/or with other codecs.

The records' packed bytes are the same in both backends, so a conversion that
keeps every codec gives a checksums file byte-identical to the source's (an
encoded entry is copied as it is, never decoded and encoded again). A field
whose codec changes is decoded with the source's codec and encoded with the
new one (``raw`` stores the decoded pixels), so a ``jpeg`` store converted
to ``raw`` decodes exactly like the ``jpeg`` store, and a lossless round trip
(``raw -> zstd -> raw``) gives back the source's data files and checksums
byte for byte. Each source record's checksum is recomputed on the way and
compared with the stored one, so a damaged source record stops the
conversion instead of being copied.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import ChecksumError, EntryDecodeError, SchemaError
from ..format.codecs import Codec, library_versions, parse_codec_specs
from ..format.layout import SUPPORTED_BACKENDS, encode_key
from ..format.schema import Schema
from ..store.backends.base import unpack_record
from ..store.dest import check_dest
from ..store.reader import Store, open_store
from ..store.writer import StoreWriter

__all__ = ["ConvertReport", "convert_store"]


@dataclass
class ConvertReport:
    source: str
    dest: str
    source_backend: str
    backend: str
    records: int
    slots: int
    holes: int
    bytes_written: int
    seconds: float
    store_id: str
    codecs: dict[str, str] | None = None  # field -> codec spec of DEST

    _json_extra = ("mb_per_s",)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / self.seconds / 1e6 if self.seconds > 0 else 0.0


def convert_store(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    backend: str | None = None,
    *,
    codecs: Any = None,
    overwrite: bool = False,
    progress: Callable[[int], Any] | None = None,
) -> ConvertReport:
    """Write the store ``src`` again at ``dest`` with ``backend`` (None: the
    source's) and ``codecs`` (``{"image": "jpeg:90"}`` or ``["image=jpeg:90"]``;
    fields not named keep their codec, ``"raw"`` stores a field decoded).

    Slots, holes (with their keys and reasons), keys, label names and
    provenance carry over; the provenance gains ``converted_from`` (source,
    backend, codecs before and after) and ``codec_libraries`` names the
    encoder of each codec of ``dest``.

    Raises
    ------
    ValueError
        Unknown backend.
    SchemaError
        ``codecs`` names a field the store does not have, or a codec that
        does not fit its field (e.g. jpeg on a float field).
    DestinationError
        ``dest`` is, contains or lies inside ``src``, or exists and is not a
        store (only a store is ever replaced, with ``overwrite``).
    ChecksumError
        A source record does not match its stored checksum (run ``mmstore
        verify`` on the source); the partial output is discarded.
    EntryDecodeError
        A source entry whose codec changes does not decode (``mmstore verify
        --decode`` lists them); the partial output is discarded.
    """
    if backend is not None and backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"backend must be one of {SUPPORTED_BACKENDS}, got {backend!r}")
    t0 = time.perf_counter()
    store = open_store(src)
    try:
        backend = backend or store.backend_name
        wanted = parse_codec_specs(codecs)
        unknown = sorted(set(wanted) - set(store.schema.names))
        if unknown:
            raise SchemaError(f"--codec names unknown field(s) {unknown}; the store has {list(store.schema.names)}")
        schema = Schema(store.schema, codecs={k: c.spec for k, c in wanted.items()})
        check_dest(dest, overwrite=overwrite, sources=[store.path])
        prov = _provenance(store, schema, backend)
        w = StoreWriter(dest, schema, slots=store.slots, backend=backend, overwrite=overwrite,
                        label_names=store.label_names, provenance=prov, inputs=[store.path])
        w.annotation_errors = [{**e, "key": None if e.get("key") is None else encode_key(e["key"])}
                               for e in store.skipped_annotations()]  # COCO's skipped annotations stay listed
        try:
            _copy_records(store, w, progress)
            w.close()
        except BaseException:
            w.abort()
            import shutil

            shutil.rmtree(w.partial, ignore_errors=True)
            raise
        out = open_store(dest)
        rep = ConvertReport(store.path, out.path, store.backend_name, backend, out.records, out.slots,
                            out.slots - out.records, sum(out.manifest["files"].values()),
                            time.perf_counter() - t0, out.store_id,
                            {f.name: f.codec.spec for f in out.schema})
        out.close()
        return rep
    finally:
        store.close()


def _provenance(store: Store, schema: Schema, backend: str) -> dict[str, Any]:
    """The source's provenance with the conversion noted: what changed, and
    which library made the encoded bytes of each codec of the new store (a
    kept entry keeps the library that made it)."""
    prov = store.provenance
    old = {f.name: f.codec for f in store.schema}
    changed = {f.name for f in schema if f.codec != old[f.name]}
    prov["converted_from"] = {
        "path": store.path, "store_id": store.store_id, "backend": store.backend_name,
        "codecs": {k: c.spec for k, c in old.items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    prov["converted_to"] = {"backend": backend, "codecs": {f.name: f.codec.spec for f in schema}}
    before = store.provenance.get("codec_libraries")
    before = before if isinstance(before, dict) else {}
    libs: dict[str, str] = {}
    for f in schema.variable_fields:
        if f.name in changed or f.codec.name not in before:
            libs.update(library_versions([f.codec]))
        else:
            libs.setdefault(f.codec.name, str(before[f.codec.name]))
    if libs:
        prov["codec_libraries"] = libs
    else:
        prov.pop("codec_libraries", None)
    return prov


def _copy_records(store: Store, w: StoreWriter, progress: Callable[[int], Any] | None) -> None:
    """Every slot of ``store`` into ``w`` (whose schema may change codecs)."""
    src, dst = store.schema, w.schema
    holes = {int(e["slot"]): e for e in store.skipped()}
    stored = np.array(store.slot_view.checksums())
    offsets, blob = store._keys()
    w.set_keys(np.array(offsets), bytes(blob))
    sw = w.slot_writer
    recode = [f for f in dst if f.codec != src[f.name].codec]
    scratch = {f.name: np.empty(f.shape, f.dtype) for f in recode if not f.ragged}
    written: list[int] = []
    step = 1024
    for a in range(0, store.slots, step):
        b = min(store.slots, a + step)
        nbytes = 0
        for s, packed in store.slot_view.backend.iter_packed(a, b):
            if s in holes:
                w.skip(s, store.slot_view.slot_key_bytes(s), holes[s].get("reason", "skipped"))
                continue
            parts = unpack_record(src, packed) if packed is not None else None
            if packed is None or parts is None or xxhash.xxh3_64_intdigest(packed) != int(stored[s]):
                raise ChecksumError(_damaged(store, s, packed, stored))
            fixed, entries = parts
            for f in recode:
                if f.shaped:
                    _recode_shaped(store, s, src[f.name], f.codec, fixed, entries)
                elif f.ragged:
                    _recode_ragged(store, s, src[f.name], f.codec, entries)
                else:
                    _recode(store, s, f.name, src[f.name].codec, f.codec, fixed, entries, scratch[f.name])
            sw.write_encoded(s, {f.name: fixed[f.name] for f in dst.fixed_fields},
                             {f.name: entries[f.name] for f in dst.variable_fields})
            written.append(s)
            nbytes += len(packed)
        if written:
            w.mark_written(written)
            written = []
        if progress is not None:
            progress(nbytes)


def _recode(store: Store, slot: int, name: str, old: Codec, new: Codec, fixed: dict[str, Any],
            entries: dict[str, Any], scratch: np.ndarray) -> None:
    """Field ``name`` of one record from codec ``old`` to ``new``, in place
    in ``fixed`` / ``entries``."""
    if old.raw:
        arr = fixed.pop(name)
    else:
        try:
            old.decode_into(entries.pop(name), scratch)
        except EntryDecodeError as exc:  # name the record, slot and key
            exc.field = name
            raise store.slot_view.entry_error(exc, slot) from None
        arr = scratch
    if new.raw:
        fixed[name] = arr
    else:
        entries[name] = new.encode(arr)


def _recode_shaped(store: Store, slot: int, old: Any, new: Codec, fixed: dict[str, Any],
                   entries: dict[str, Any]) -> None:
    """Shaped field ``old`` of one record to codec ``new``, in place in
    ``entries``: decoded at its record's size (``fixed[<name>_hw]``, checked
    against the entry first) and encoded again."""
    from ..format.shaped import decode_shaped

    try:
        arr = decode_shaped(old, entries.pop(old.name), fixed[old.hw_name], slot)
    except EntryDecodeError as exc:  # name the record, slot and key
        exc.field = old.name
        raise store.slot_view.entry_error(exc, slot) from None
    entries[old.name] = new.encode(arr)


def _recode_ragged(store: Store, slot: int, old: Any, new: Codec, entries: dict[str, Any]) -> None:
    """Ragged field ``old`` of one record to codec ``new`` (raw <-> zstd), in
    place in ``entries``; the entry is proven valid first."""
    from ..format.ragged import check_entry, entry_bytes

    try:
        check_entry(old, entries[old.name])
        raw = entry_bytes(old, entries.pop(old.name))
    except EntryDecodeError as exc:  # name the record, slot and key
        exc.field = old.name
        raise store.slot_view.entry_error(exc, slot) from None
    entries[old.name] = new.encode(np.frombuffer(raw, np.uint8))


def _damaged(store: Store, slot: int, packed: Any, stored: np.ndarray) -> str:
    key = store.slot_view.slot_key_bytes(slot).decode("utf-8", "replace")
    if packed is None:
        what = "is not a hole but has no record"
    else:
        what = (f"has checksum {xxhash.xxh3_64_intdigest(packed):016x} but the store says "
                f"{int(stored[slot]):016x}")
    return (f"{store.path}: slot {slot} (key {key!r}) {what}: the source is damaged; run "
            "`mmstore verify --repair` on it first")
