"""The ingest plan: scan the source once; derive the schema, fingerprints, run state and provenance."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..decode import float_to_uint8
from ..errors import DecodeError, SchemaError, SourceError, spell_option
from ..format.codecs import library_versions
from ..format.schema import Schema
from .options import shard_range
from .records import schema_for
from .sources import DatasetSource, Source, to_array

__all__ = ["Plan", "fingerprint", "make_plan", "mismatch_message"]


def fingerprint(listing_fp: str, params: dict[str, Any]) -> str:
    """The fingerprint of a listing and the parameters that change an output byte."""
    return xxhash.xxh3_128(listing_fp.encode() + json.dumps(params, sort_keys=True).encode()).hexdigest()


@dataclass
class Plan:
    """What one ingest run will write: inputs ``lo..hi`` of ``listing`` as ``schema``."""

    listing: Any
    lo: int
    hi: int
    schema: Schema
    state: dict[str, Any]  # saved in DEST.partial; a resume must match its fingerprint
    provenance: dict[str, Any]  # goes into the manifest
    spec: Any = None  # the decode spec the run uses (buckets="auto" resolved to its shapes)

    @property
    def slots(self) -> int:
        return self.hi - self.lo

    @property
    def fingerprint(self) -> str:
        return str(self.state["fingerprint"])


def _first_item(source: Source, spec: Any, index: int) -> Any:
    """Item ``index`` when the schema needs it (arrays stored as they are);
    notes on a dataset source whether its items carry labels. With a target
    size, a float image there that cannot become uint8 (values outside
    ``[0, 1]``: normalised) refuses the run before any work (``SchemaError``)."""
    if not source.decoded:
        return None
    item = source.reader().load(index)
    if isinstance(source, DatasetSource):
        img, lab = source.split(item)
        source.has_labels = lab is not None
        if spec is None:
            return to_array(img)
        try:
            img = to_array(img)
        except Exception:  # noqa: BLE001 - not an image: the worker makes it a hole with its reason
            return None
    elif spec is None:
        return item
    else:
        img = item
    if isinstance(img, np.ndarray) and img.dtype.kind == "f":
        try:
            float_to_uint8(img)
        except DecodeError as exc:
            where = source.path or "the dataset"
            raise SchemaError(f"{where}: item {index}: {exc.reason}; nothing was created") from None
    return None


def make_plan(source: Source, spec: Any, backend: str, shard: tuple[int, int] | None,
              codecs: dict[str, Any] | None = None) -> Plan:
    """Scan ``source`` and plan the run (``IngestError`` when it has no inputs;
    ``SchemaError`` when ``codecs`` names a field the store will not have or a
    codec that does not fit its field)."""
    listing = source.scan()
    n_total = len(listing)
    if n_total == 0:
        raise SourceError(f"{source.path or 'the dataset'}: no inputs found (empty source); nothing was created")
    if listing.none_found:
        raise SourceError(listing.none_found)
    lo, hi = shard_range(n_total, shard)
    auto: str | None = None
    auto_report: dict[str, Any] = {}
    if spec is not None and spec.resize == "buckets" and spec.bucket_shapes is None:
        # every input, whatever the shard: all parts must choose the same shapes
        from .aspects import choose_buckets

        auto = str(spec.buckets)
        spec, auto_report = choose_buckets(source, spec)
    schema = schema_for(source, spec, _first_item(source, spec, lo if hi > lo else 0))
    if codecs:
        schema = Schema(schema, codecs=codecs)
    libraries = library_versions(f.codec for f in schema.variable_fields)
    desc = source.describe()
    params = {
        # where a class mapping came from is provenance only: the mapping is label_names below
        "source": {k: v for k, v in desc.items() if k not in ("path", "root", "classes_from")},
        "decode": spec.to_dict() if spec is not None else None,
        "schema": schema.to_json(),
        "backend": backend,
        "inputs": n_total,
        "label_names": listing.label_names,
    }
    if libraries:  # the encoders make the bytes: another version is another store
        params["codec_libraries"] = libraries
    inputs_fp = fingerprint(listing.fingerprint, params)
    shard_l = list(shard) if shard else None
    run_fp = fingerprint(inputs_fp, {"shard": shard_l, "range": [lo, hi]})
    state = {
        "fingerprint": run_fp,
        "inputs_fingerprint": inputs_fp,
        "listing_fingerprint": listing.fingerprint,
        "params": params,
        "shard": shard_l,
        "range": [lo, hi],
        "slots": hi - lo,
    }
    provenance = {
        "source": desc,
        "resize": spec.resize if spec is not None else None,
        "size": list(spec.size) if spec is not None else None,
        **({"buckets": {"auto": auto, **auto_report}} if auto is not None else {}),
        "ingest": {"fingerprint": run_fp, "inputs_fingerprint": inputs_fp, "inputs": n_total, "shard": shard_l,
                   "range": [lo, hi], "params": params},
    }
    if libraries:
        provenance["codecs"] = {f.name: f.codec.spec for f in schema.variable_fields}
        provenance["codec_libraries"] = libraries
    return Plan(listing, lo, hi, schema, state, provenance, spec)


_UNSET = object()


def _leaf_changes(old: Any, new: Any, path: str) -> list[tuple[str, Any, Any]]:
    """``(dotted path, old, new)`` of every value that differs between two
    run parameters (dicts by key; lists of named entries, a schema, by name)."""
    def named(v: Any) -> dict[str, Any] | None:
        if isinstance(v, list) and all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in v):
            return {e["name"]: {k: x for k, x in e.items() if k != "name"} for e in v}
        return None

    if named(old) is not None and named(new) is not None:
        old, new = named(old), named(new)
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(old) | set(new), key=str):
            out += _leaf_changes(old.get(k, _UNSET), new.get(k, _UNSET), f"{path}.{k}" if path else str(k))
        return out
    return [] if old == new else [(path, old, new)]


def _shown(path: str, v: Any) -> str:
    if v is _UNSET or v is None:
        return "not set"
    if path.endswith("size") and isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return f"{v[0]}x{v[1]}"
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def mismatch_message(partial: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    """Why the interrupted run in ``partial`` (state ``old``) cannot be resumed
    as ``new``: each parameter that changed, as ``size was 224x224, now 128x128``."""
    changes = _leaf_changes(old.get("params", {}), new["params"], "")
    if any(p.startswith("decode.") for p, _, _ in changes):  # the fields' shapes follow from the decode options
        changes = [c for c in changes if not (c[0].startswith("schema.") and c[0].endswith(".shape"))]
    diffs = []
    for path, was, now in changes:
        name = path.removeprefix("decode.").removeprefix("source.")
        diffs.append(f"{name} was {_shown(path, was)}, now {_shown(path, now)}")
    if old.get("shard") != new["shard"] or old.get("range") != new["range"]:
        diffs.append(f"shard was {old.get('shard')} (inputs {old.get('range')}), now {new['shard']} "
                     f"(inputs {new['range']})")
    if not diffs and old.get("listing_fingerprint") != new["listing_fingerprint"]:
        diffs.append("the input files changed (names, sizes, modification times or labels differ)")
    what = "; ".join(diffs) or "the fingerprint differs"
    return (
        f"{partial}: cannot resume: the interrupted ingest used other inputs or parameters: {what}; "
        f"rerun with exactly the original inputs and options, or pass {spell_option('overwrite=True', '--overwrite')} "
        "to start over"
    )
