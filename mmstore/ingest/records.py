"""The per-record work of an ingest: one input -> the schema's arrays, written at its slot (runs in workers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..decode import decode_image, fit_array
from ..errors import RemoteError, SchemaError
from ..format.schema import Schema, coerce_ragged
from ..store.writer import SlotWriter
from ._listing import InputError, Source, reason_of
from .sources import DatasetSource, as_hwc, to_array

__all__ = ["BOX_DTYPE", "DST_DTYPE", "LABEL_DTYPE", "ORIG_SIZE_DTYPE", "RecordJob", "checked", "process_range",
           "schema_for"]

LABEL_DTYPE = "<i8"
ORIG_SIZE_DTYPE = "<i4"
BOX_DTYPE = "<i4"
DST_DTYPE = "<i4"


def schema_for(source: Source, spec: Any, first_item: Any) -> Schema:
    """The store's schema: ``image`` (the spec's record shape, or the first
    item's dtype and shape), ``label`` when there are labels, ``orig_size`` /
    ``box`` / ``dst`` when images are fitted to a target size (the transform
    of :mod:`mmstore.decode.geometry`), then the source's own fields (``fields``)."""
    fields: dict[str, Any] = {}
    if spec is not None:
        fields["image"] = ("|u1", spec.record_shape())
    else:
        arr = np.asarray(first_item)
        fields["image"] = (arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype, arr.shape)
    has_label = source.listing.labels is not None or getattr(source, "has_labels", False)
    if has_label:
        fields["label"] = (LABEL_DTYPE, ())
    if spec is not None:
        fields["orig_size"] = (ORIG_SIZE_DTYPE, (2,))
        fields["box"] = (BOX_DTYPE, (4,))
        fields["dst"] = (DST_DTYPE, (4,))
    extra = getattr(source, "fields", None)
    for f in extra or ():
        fields[f.name] = f
    shapes = spec.bucket_shapes if spec is not None else None
    return Schema(fields, buckets={"image": shapes} if shapes is not None else None)


def checked(schema: Schema, rec: dict[str, Any]) -> dict[str, np.ndarray]:
    """``rec`` as ``schema``'s arrays, as ``Schema.validate`` makes them: a
    cheap exact check when every fixed value already has its field's dtype,
    shape and layout (ragged and text entries converted one by one, with
    validate's rules), else ``Schema.validate`` itself (lossless
    conversions, ``SchemaError`` otherwise)."""
    if len(rec) == len(schema):
        ragged = []
        for f in schema:
            v = rec.get(f.name)
            if f.ragged and not f.shaped and v is not None:  # None (a name missing): validate says what
                ragged.append(f)
                continue
            if not (isinstance(v, np.ndarray) and v.dtype == f.dtype and v.shape == f.shape
                    and v.flags.c_contiguous):
                break
        else:
            if not ragged:
                return rec
            out = dict(rec)
            for f in ragged:
                out[f.name] = coerce_ragged(f, rec[f.name])
            return out
    return schema.validate(rec)


class RecordJob:
    """Everything a worker needs to make records; inherited by fork, never pickled."""

    def __init__(self, source: Source, spec: Any, schema: Schema, lo: int, partial: str) -> None:
        self.source = source
        self.spec = spec
        self.schema = schema
        self.lo = lo
        self.partial = partial
        self.labels = source.listing.labels
        self.label_errors = source.listing.label_errors  # input -> hole reason (a list's bad label cells)
        self.has_label = "label" in schema
        self.full = "box" in schema  # image fields with orig_size / box / dst
        self.dataset = isinstance(source, DatasetSource)
        self.extra = isinstance(source, DatasetSource) and source.fields is not None  # from_dataset(fields=)
        # a source's own fields of input i beside image and label (a COCO image's annotations, a list's
        # tags/text): record_fields(i, decoded) -> {name: value}; raises InputError for a hole
        self.own_fields = getattr(source, "record_fields", None)

    def checked(self, rec: dict[str, Any]) -> dict[str, np.ndarray]:
        """``rec`` as the schema's arrays (:func:`checked`)."""
        return checked(self.schema, rec)

    def record(self, reader: Any, slot: int) -> dict[str, Any]:
        """The fields of the input at ``slot`` (raises for an input that becomes a hole)."""
        i = self.lo + slot
        if i in self.label_errors:
            raise InputError(self.label_errors[i])
        img, label, extras = self._load(reader, i)
        out: dict[str, Any] = {}
        d = None
        if not self.source.decoded:
            d = decode_image(img, self.spec)
        elif self.spec is not None:
            d = fit_array(as_hwc(img) if self.dataset else img, self.spec)  # float [0, 1] -> uint8 there
        out["image"] = img if d is None else d.image
        if self.has_label:
            out["label"] = self._label(i, label)
        if self.full and d is not None:  # d is None only without a decode spec (no transform to store)
            out["orig_size"] = np.array(d.orig_size, ORIG_SIZE_DTYPE)
            out["box"] = np.array(d.box, BOX_DTYPE)
            out["dst"] = np.array(d.dst, DST_DTYPE)
        if self.own_fields is not None:
            out.update(self.own_fields(i, d))
        out.update(extras)
        return out

    def _load(self, reader: Any, i: int) -> tuple[Any, Any, dict[str, Any]]:
        if not isinstance(self.source, DatasetSource):
            return reader.load(i), None, {}
        item = reader.load(i)
        img, label = self.source.split(item)
        if img is None:
            raise InputError("wrong-shape: dataset item has no image")
        return to_array(img), label, self.source.extras(item) if self.extra else {}

    def _label(self, i: int, label: Any) -> Any:
        if label is None:
            label = self.labels[i] if self.labels is not None else None
        if label is None:
            raise InputError("wrong-shape: item has no label")
        if hasattr(label, "item"):
            label = label.item()
        try:
            return np.array(label, LABEL_DTYPE) if float(label) == int(label) else label
        except (TypeError, ValueError, OverflowError):
            return label  # validate() reports it


def _hole_reason(exc: Exception) -> str:
    """Why an input became a hole, from the exception its record raised."""
    if isinstance(exc, OSError):  # a reading error that is not a decode error
        return f"unreadable: [Errno {exc.errno}] {exc.strerror or exc}"
    if isinstance(exc, SchemaError):
        return f"wrong-shape: {exc}"
    if isinstance(exc, MemoryError):
        return "too-large: out of memory while decoding"
    r = reason_of(exc)
    return r if r is not None else f"corrupt: {type(exc).__name__}: {str(exc)[:200]}"


def process_range(job: RecordJob, sw: SlotWriter, reader: Any, a: int, b: int) -> list[tuple[int, str]]:
    """Decode and write slots ``a..b``; return the holes (slot, reason).

    The data is not fsynced here: the parent's committer fsyncs the store's
    files (one fsync covers every chunk reported before it started) and only
    then appends the chunks to the commit log, off the decoders' path. An
    ``OSError`` from writing (a full disk) propagates: it ends the run; so
    does a failed read of object storage (``RemoteError``, once its retries
    are spent), which says nothing of the inputs.
    """
    errs: list[tuple[int, str]] = []
    prepare = getattr(reader, "prepare_range", None)
    if prepare is not None:  # a source read in large ranges (tar shards in a bucket)
        prepare(job.lo + a, job.lo + b)
    with sw.combined():  # the small fields and checksums of the range go out in a few writes
        for s in range(a, b):
            try:
                arrays = job.checked(job.record(reader, s))
            except RemoteError:
                raise  # object storage cannot be read (its retries spent): stop, resumable; the inputs are not bad
            except Exception as exc:  # noqa: BLE001 - a bad input must never stop the run
                errs.append((s, _hole_reason(exc)))
                sw.zero(s)
                continue
            sw.write_arrays(s, arrays)
    return errs
