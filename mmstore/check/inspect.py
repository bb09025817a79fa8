"""``inspect``: what is in a store, where it came from, and how much of it is
in the page cache right now."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import EntryDecodeError
from ..format.layout import npy_header
from ..store.reader import open_store
from .common import find_image_field, find_label_field, sample_indices, to_hwc

__all__ = ["InspectReport", "inspect_store", "reason_category"]


@dataclass
class InspectReport:
    path: str
    store_id: str
    format_version: list[int]
    backend: str
    records: int
    slots: int
    record_bytes: int
    schema: list[dict[str, Any]]
    files: dict[str, int]
    bytes_on_disk: int
    provenance: dict[str, Any]
    skipped: int = 0
    skipped_reasons: list[dict[str, Any]] = field(default_factory=list)
    label_field: str | None = None
    label_names: list[str] | None = None
    segments: list[int] | None = None
    label_histogram: list[dict[str, Any]] | None = None
    image_field: str | None = None
    image_layout: str | None = None
    image_sample: int = 0
    channel_mean: list[float] | None = None
    channel_std: list[float] | None = None
    cache_resident: dict[str, int] | None = None
    cache_resident_bytes: int | None = None
    cache_bytes_total: int = 0
    mem_available: int | None = None
    mem_effective_available: int | None = None
    field_sizes: list[dict[str, Any]] = field(default_factory=list)
    data_bytes: int = 0
    raw_data_bytes: int = 0
    raw_equivalent_bytes: int = 0
    sizes_sampled: int | None = None
    image_shapes: dict[str, Any] | None = None
    """An image field of its own shape (``(None, None, C)``): its records'
    heights and widths over every record, from its ``<field>_hw`` column:
    ``{"field", "min_h", "median_h", "max_h", "min_w", "median_w", "max_w",
    "distinct"}`` (``distinct``: the number of distinct ``(h, w)``)."""
    image_buckets: list[dict[str, Any]] | None = None
    """An image field with aspect buckets: one entry per bucket, from the
    tallest to the widest, over every record: ``{"h", "w", "records",
    "crop_mean", "crop_max"}``; ``crop_*``: the share of the source's pixels
    its centre crop cut away (``1 - box area / orig_size area``), the mean
    and the largest over the bucket's records (None without those fields or
    records)."""
    ragged_lengths: list[dict[str, Any]] = field(default_factory=list)
    """Per ragged field: rows (str/bytes: bytes) per record, min/mean/max, the
    total, and how many records have none (over ``sizes_sampled`` when set)."""
    notes: list[str] = field(default_factory=list)

    _json_extra = ("cache_fraction", "fits_in_memory", "compression")

    @property
    def compression(self) -> float:
        """How many times smaller the records' stored bytes are than raw (1.0 for a raw store)."""
        return self.raw_data_bytes / self.data_bytes if self.data_bytes else 1.0

    @property
    def cache_fraction(self) -> float | None:
        if self.cache_resident_bytes is None:
            return None
        return self.cache_resident_bytes / self.cache_bytes_total if self.cache_bytes_total else 1.0

    @property
    def fits_in_memory(self) -> bool | None:
        avail = self.mem_effective_available or self.mem_available
        if avail is None:
            return None
        return self.cache_bytes_total - (self.cache_resident_bytes or 0) <= 0.9 * avail


def reason_category(reason: str) -> str:
    """First word of a skip reason (``corrupt: ...`` -> ``corrupt``)."""
    head = str(reason).strip().split(None, 1)[0] if str(reason).strip() else "unknown"
    return head.rstrip(":;,.")


SIZES_SAMPLE_LMDB = 10_000  # lmdb: entry sizes need one lookup per record; more than this are sampled


def _field_sizes(store: Any, rep: InspectReport, sample: int, seed: int) -> None:
    """Codec and stored bytes per record of each field (mean, min, max over
    the records; an lmdb store's over a sample), the ratio to raw, and the
    records' stored bytes against what a raw store would hold."""
    n = store.records
    idx = None
    if store.schema.has_variable and not store.slot_view.backend.positional and n > SIZES_SAMPLE_LMDB:
        idx = sample_indices(n, SIZES_SAMPLE_LMDB, seed)
        rep.sizes_sampled = len(idx)
    stored = {}
    ragged_raw = _ragged_lengths(store, rep, idx)
    lo: float  # a ragged field's raw size is a mean
    hi: float
    for f in store.schema:
        raw = f.nbytes if not f.ragged else ragged_raw.get(f.name, 0)
        if f.variable and n:
            sizes = store.slot_view.entry_sizes(f.name, idx)
            mean, lo, hi = float(sizes.mean()), int(sizes.min()), int(sizes.max())
            stored[f.name] = int(sizes.sum()) if idx is None else int(round(mean * n))
        else:
            mean, lo, hi = float(raw), raw, raw
            stored[f.name] = raw * n
        rep.field_sizes.append({
            "name": f.name, "codec": f.codec.spec, "raw_bytes": raw, "stored_mean": round(mean, 1),
            "stored_min": lo, "stored_max": hi, "ratio": round(raw / mean, 2) if mean else None,
        })
    rep.data_bytes = sum(stored.values())
    rep.raw_data_bytes = n * sum(f.nbytes for f in store.schema) + round(n * sum(ragged_raw.values()))
    # a raw store of the same records: every file as it is but the encoded
    # fields' data, which would be slots x raw bytes (memmap: in .npy files
    # with their headers, without offsets files)
    rep.raw_equivalent_bytes = rep.bytes_on_disk
    segments = len(store.segments or [0])
    for f in store.schema.variable_fields:
        if f.ragged:  # a ragged field has no fixed-size form: as it is
            continue
        rep.raw_equivalent_bytes += store.slots * f.nbytes - stored[f.name]
        if store.slot_view.backend.positional:
            rep.raw_equivalent_bytes += segments * len(npy_header(f.dtype, (store.slots, *f.shape)))
    if store.slot_view.backend.positional:
        ragged = tuple(f"{f.name}." for f in store.schema.ragged_fields)
        rep.raw_equivalent_bytes -= sum(v for k, v in rep.files.items()
                                        if k.endswith(".offsets.npy") and not k.startswith(ragged))


def _ragged_lengths(store: Any, rep: InspectReport, idx: Any) -> dict[str, float]:
    """Fill ``rep.ragged_lengths``; return each ragged field's mean decoded
    bytes per record. Raw entries' lengths come from the offsets index alone
    (entry size / row bytes); zstd entries are read and decoded."""
    out: dict[str, float] = {}
    n = store.records
    for f in store.schema.ragged_fields:
        if not n:
            lengths = np.zeros(0, np.int64)
        elif f.shaped:  # pixels per record, from its sizes column (no entry read)
            hw = store.column(f.hw_name).astype(np.int64).reshape(-1, 2)
            lengths = (hw[:, 0] * hw[:, 1]) if idx is None else (hw[:, 0] * hw[:, 1])[np.asarray(idx)]
        elif f.codec.raw:
            lengths = store.slot_view.entry_sizes(f.name, idx) // f.row_bytes
        else:
            which = np.arange(n) if idx is None else np.asarray(idx)
            lengths = np.concatenate([store.read_batch(which[a : a + 4096], fields=f.name)[f.name].lengths
                                      for a in range(0, len(which), 4096)])
        k = len(lengths)
        rep.ragged_lengths.append({
            "name": f.name, "kind": f.kind,
            "unit": "bytes" if f.kind != "array" else "pixels" if f.shaped else "rows",
            "min": int(lengths.min()) if k else 0, "mean": round(float(lengths.mean()), 2) if k else 0.0,
            "max": int(lengths.max()) if k else 0,
            "total": int(lengths.sum()) if idx is None else round(float(lengths.mean()) * n) if k else 0,
            "empty": int((lengths == 0).sum()) if idx is None else round(float((lengths == 0).mean()) * n) if k else 0,
        })
        out[f.name] = float(lengths.mean()) * f.row_bytes if k else 0.0
    return out


def _shapes(store: Any, f: Any) -> dict[str, Any]:
    """``InspectReport.image_shapes`` of shaped field ``f``, from its sizes column."""
    hw = store.column(f.hw_name).astype(np.int64).reshape(-1, 2)
    h, w = hw[:, 0], hw[:, 1]
    return {"field": f.name, "min_h": int(h.min()), "median_h": float(np.median(h)), "max_h": int(h.max()),
            "min_w": int(w.min()), "median_w": float(np.median(w)), "max_w": int(w.max()),
            "distinct": int(len(np.unique(hw, axis=0)))}


def _buckets(store: Any, f: Any) -> list[dict[str, Any]]:
    """``InspectReport.image_buckets`` of bucketed field ``f``, from its
    sizes column and the ``orig_size`` / ``box`` columns (no entry read)."""
    from ..format.shaped import bucket_ids

    ids = bucket_ids(f, store.column(f.hw_name)) if store.records else np.zeros(0, np.int64)
    share = None
    if "orig_size" in store.schema and "box" in store.schema and store.records:
        orig = store.column("orig_size").astype(np.float64).reshape(-1, 2)
        box = store.column("box").astype(np.float64).reshape(-1, 4)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = 1.0 - (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1]) / (orig[:, 0] * orig[:, 1])
    out = []
    for k, (h, w) in enumerate(f.buckets):
        mine = ids == k
        n = int(mine.sum())
        cut = share[mine] if share is not None and n else None
        out.append({"h": int(h), "w": int(w), "records": n,
                    "crop_mean": None if cut is None else round(float(cut.mean()), 4),
                    "crop_max": None if cut is None else round(float(cut.max()), 4)})
    return out


def inspect_store(
    path: str | os.PathLike[str],
    *,
    sample: int = 1000,
    seed: int = 0,
    cache: bool = True,
    image_field: str | None = None,
    label_field: str | None = None,
) -> InspectReport:
    """Describe the store at ``path`` (opens it: a damaged store raises
    ``FormatError``; use :func:`verify_store` to list every problem).

    ``sample`` images (random, ``seed``) give the per-channel mean/std;
    the label histogram reads the whole label column.
    """
    store = open_store(path)
    try:
        m = store.manifest
        files = {n: int(s) for n, s in m["files"].items()}
        files["manifest.json"] = os.stat(os.path.join(store.path, "manifest.json")).st_size
        rep = InspectReport(
            path=store.url or store.path,
            store_id=store.store_id,
            format_version=list(m["version"]),
            backend=store.backend_name,
            records=store.records,
            slots=store.slots,
            record_bytes=store.stored_record_bytes(),
            schema=store.schema.to_json(),
            files=files,
            bytes_on_disk=sum(files.values()),
            provenance=store.provenance,
            label_names=store.label_names,
            segments=store.segments,
        )
        _field_sizes(store, rep, sample, seed)
        skipped = store.skipped()
        rep.skipped = store.slots - store.records
        if skipped:
            cats: Counter[str] = Counter()
            example: dict[str, str] = {}
            for e in skipped:
                c = reason_category(e.get("reason", ""))
                cats[c] += 1
                example.setdefault(c, f"{e.get('key', '')}: {e.get('reason', '')}")
            rep.skipped_reasons = [{"reason": c, "count": n, "example": example[c]} for c, n in cats.most_common(10)]
        lf = find_label_field(store.schema, label_field)
        if lf is not None and store.records:
            rep.label_field = lf.name
            col = store.column(lf.name).astype(np.int64)
            vals, counts = np.unique(col, return_counts=True)
            names = store.label_names or []
            rep.label_histogram = [
                {"label": int(v), "name": names[v] if 0 <= v < len(names) else None, "count": int(c)}
                for v, c in zip(vals.tolist(), counts.tolist())
            ]
            if names and len(vals) and (vals.min() < 0 or vals.max() >= len(names)):
                rep.notes.append(f"labels outside 0..{len(names) - 1} appear; label_names does not cover them")
        found = find_image_field(store.schema, image_field)
        shaped = [g for g in store.schema.shaped_fields if found is None or g.name == found[0].name]
        if shaped and store.records:
            rep.image_shapes = _shapes(store, shaped[0])
        if shaped and shaped[0].buckets:
            try:
                rep.image_buckets = _buckets(store, shaped[0])
            except EntryDecodeError as exc:  # a damaged sizes column: say so, describe the rest
                rep.notes.append(f"{exc}; run mmstore verify")
        if found is not None and store.records and sample > 0:
            f, lay = found
            rep.image_field, rep.image_layout = f.name, lay
            idx = sample_indices(store.records, sample, seed)
            channels = 1 if lay == "hw" else int(f.shape[2] if lay == "hwc" else f.shape[0])
            s1 = np.zeros(channels)  # per channel: the sum of the pixel values, and of their squares
            s2 = np.zeros(channels)
            npx = 0
            for a in range(0, len(idx), 256):
                got = store.read_batch(idx[a : a + 256], fields=[f.name])[f.name]
                for imgs in (got if f.shaped else [got]):  # images of their own shape: a list, one by one
                    imgs = to_hwc(imgs, lay)
                    px = imgs.reshape(-1, imgs.shape[-1]).astype(np.float64)
                    s1 += px.sum(0)
                    s2 += (px * px).sum(0)
                    npx += len(px)
            mean = s1 / npx
            var = np.maximum(s2 / npx - mean * mean, 0.0)
            rep.image_sample = len(idx)
            rep.channel_mean = [round(float(x), 3) for x in mean]
            rep.channel_std = [round(float(x), 3) for x in np.sqrt(var)]
        if cache:
            from .. import _os

            try:
                res = {}
                for p in store.data_paths():
                    r, size = _os.resident_bytes(p)
                    res[os.path.basename(p)] = r
                    rep.cache_bytes_total += size
                rep.cache_resident = res
                rep.cache_resident_bytes = sum(res.values())
            except (OSError, NotImplementedError) as exc:
                rep.notes.append(f"page-cache residency unavailable ({exc})")
            rep.mem_available = _os.mem_available()
            rep.mem_effective_available = _os.effective_available()
        return rep
    finally:
        store.close()
