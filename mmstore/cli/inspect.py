"""``mmstore inspect STORE``: what is in a store and where it came from."""

from __future__ import annotations

import argparse
import re

from ..check.common import fmt_bytes, table
from ..format.names import json_text, printable
from ._common import add_common, emit_json, off_main, subparser, usage_error

EXAMPLE = """examples:
  mmstore inspect /data/landmarks.store
  mmstore inspect /data/landmarks.store --sample 5000 --json | jq .channel_mean

exit codes: 0 ok, 2 not a store (or a usage error), 1 the store cannot be opened
(damaged: run `mmstore verify` for the full list)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "inspect", "describe a store: schema, sizes, provenance, labels, cache residency",
        "Print the format version, backend, record and slot counts, schema, bytes per file, "
        "provenance, skipped inputs and their reasons, labels with a histogram, per-channel "
        "image mean/std from a sample, and how much of the store is in the page cache.",
        EXAMPLE,
    )
    add_common(p)
    p.add_argument("--sample", type=int, default=1000, metavar="N",
                   help="images sampled for the channel mean/std (default 1000; 0 to skip)")
    p.add_argument("--seed", type=int, default=0, help="seed of the image sample (default 0)")
    p.add_argument("--image-field", help="the image field (default: detected)")
    p.add_argument("--label-field", help="the label field (default: a scalar integer field named label)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.inspect import inspect_store  # lazy: NOTE [lazy commands]

    if args.sample < 0:
        return usage_error("inspect", "--sample must be >= 0")
    rep = off_main(args.store, inspect_store, args.store, sample=args.sample, seed=args.seed,
                   image_field=args.image_field, label_field=args.label_field)
    if args.json:
        emit_json(rep)  # names that are not UTF-8 as \udcXX escapes (mmstore/format/names.py)
    else:
        print(printable(render(rep), keep_newlines=True))  # ... and as \xXX here
    return 0


def render(rep) -> str:  # noqa: ANN001
    out = [f"store        {printable(rep.path)}",
           f"id           {rep.store_id}   format {'.'.join(map(str, rep.format_version))}   backend {rep.backend}",
           f"records      {rep.records:,} in {rep.slots:,} slots ({rep.skipped:,} skipped), "
           f"{fmt_bytes(rep.record_bytes)} per record",
           "schema"]
    sizes = {r["name"]: r for r in rep.field_sizes}
    rows = []
    for f in rep.schema:
        r = sizes.get(f["name"])
        row = [f["name"], f["dtype"], "x".join("n" if d is None else str(d) for d in f["shape"]) or "scalar"]
        if r is not None and any(x["codec"] != "raw" for x in rep.field_sizes):
            row += [r["codec"], f"{fmt_bytes(r['stored_mean'])}/record (min {fmt_bytes(r['stored_min'])}, max "
                    f"{fmt_bytes(r['stored_max'])})", f"{r['ratio']:.1f}x smaller" if r["ratio"] else "-"]
        rows.append(row)
    out.append(table(rows))
    if any(r["codec"] != "raw" for r in rep.field_sizes):
        what = f" (sizes from a sample of {rep.sizes_sampled:,} records)" if rep.sizes_sampled else ""
        out.append(f"compact      records hold {fmt_bytes(rep.data_bytes)}, {rep.compression:.1f}x less than raw "
                   f"({fmt_bytes(rep.raw_data_bytes)}); the store is {fmt_bytes(rep.bytes_on_disk)}, as raw it "
                   f"would be about {fmt_bytes(rep.raw_equivalent_bytes)}{what}")
    for r in rep.ragged_lengths:
        what = f" (from a sample of {rep.sizes_sampled:,} records)" if rep.sizes_sampled else ""
        out.append(f"ragged       {r['name']}: {r['min']:,} to {r['max']:,} {r['unit']} per record, mean "
                   f"{r['mean']:,}, {r['total']:,} in all, {r['empty']:,} records with none{what}")
    out.append(f"files        {fmt_bytes(rep.bytes_on_disk)} in all")
    if rep.segments is not None:
        parts = (rep.provenance or {}).get("merged_from") or []
        engine = (rep.provenance or {}).get("engine") or {}
        appended = (rep.provenance or {}).get("appended")
        grew = f", grown by {len(appended):,} append(s)" if isinstance(appended, list) and appended else ""
        how = (f"joined from parts, written by {engine.get('name')}" if engine.get("name")
               else "merged" + (f" from {len(parts):,} parts" if parts else "") if parts or not grew
               else "the first ingest") + grew
        out.append(f"segments     {len(rep.segments):,} ({how}; {min(rep.segments):,} to {max(rep.segments):,} "
                   "slots each)")
    out.append(table([[n, f"{s:,}", fmt_bytes(s)] for n, s in _file_rows(rep)]))
    prov = rep.provenance or {}
    out.append("provenance")
    rows = []
    for k in ("source", "source_type", "resize", "size", "decode", "tool", "time", "converted_from"):
        if k in prov:
            rows.append([k, _short(prov[k])])
    dec = (prov.get("ingest") or {}).get("params", {}).get("decode") if isinstance(prov.get("ingest"), dict) else None
    if isinstance(dec, dict) and "decode" not in prov:
        rows.append(["decode", _short({k: v for k, v in dec.items() if k not in ("max_pixels",)}, 120)])
    for k, v in prov.items():
        if k not in {r[0] for r in rows}:
            rows.append([k, _short(v)])
    out.append(table(rows) if rows else "  (none)")
    if rep.skipped:
        out.append(f"skipped      {rep.skipped:,} inputs; top reasons:")
        out.append(table([[r["count"], r["reason"], _short(r["example"], 70)] for r in rep.skipped_reasons]))
    if rep.label_histogram is not None:
        out.append(f"labels       field {rep.label_field!r}, {len(rep.label_histogram)} distinct values")
        top = max((r["count"] for r in rep.label_histogram), default=1)
        hist = rep.label_histogram if len(rep.label_histogram) <= 30 else sorted(
            rep.label_histogram, key=lambda r: -r["count"])[:30]
        out.append(table([[r["label"], printable(r["name"] or ""), f"{r['count']:,}",
                            "#" * max(1, round(30 * r["count"] / top))] for r in hist]))
        if len(rep.label_histogram) > 30:
            out.append(f"  ... {len(rep.label_histogram) - 30} more labels (see --json)")
    elif rep.label_names:
        out.append(f"labels       {len(rep.label_names)} names, no label field found")
    if rep.image_shapes is not None:
        sh = rep.image_shapes
        out.append(f"shapes       field {sh['field']!r}, each image its own: h {sh['min_h']}..{sh['max_h']} (median "
                   f"{sh['median_h']:g}), w {sh['min_w']}..{sh['max_w']} (median {sh['median_w']:g}); "
                   f"{sh['distinct']:,} distinct shapes")
    if rep.image_buckets is not None:
        out.append(f"buckets      {len(rep.image_buckets)} aspect buckets (h x w), each record centre-cropped to the "
                   "one nearest its aspect; cropped: the share of the source's pixels cut away")
        out.append(table([[f"{b['h']}x{b['w']}", f"{b['records']:,}",
                            "-" if b["crop_mean"] is None else f"mean {100 * b['crop_mean']:.1f}%",
                            "-" if b["crop_max"] is None else f"max {100 * b['crop_max']:.1f}%"]
                           for b in rep.image_buckets]))
    if rep.channel_mean is not None:
        out.append(f"images       field {rep.image_field!r} ({rep.image_layout}); from a sample of "
                   f"{rep.image_sample:,}: mean {rep.channel_mean} std {rep.channel_std} (0-255 scale)")
    if rep.cache_resident_bytes is not None:
        frac = rep.cache_fraction or 0.0
        avail = rep.mem_effective_available or rep.mem_available
        fits = rep.fits_in_memory
        hint = "" if fits is None else (
            "  (fits: `mmstore warm` pulls it in)" if fits and frac < 0.99 else
            "" if fits else "  (larger than available memory: use a block shuffle)")
        out.append(f"page cache   {fmt_bytes(rep.cache_resident_bytes)} of {fmt_bytes(rep.cache_bytes_total)} "
                   f"resident ({100 * frac:.0f}%); available memory {fmt_bytes(avail)}{hint}")
    for n in rep.notes:
        out.append(f"note         {n}")
    return "\n".join(out)


def _file_rows(rep) -> list[tuple[str, int]]:  # noqa: ANN001
    """File sizes; a segmented store's data files one row per field (``image.*.npy``)."""
    if rep.segments is None or len(rep.segments) <= 3:
        return sorted(rep.files.items())
    rows: dict[str, int] = {}
    counts: dict[str, int] = {}
    for n, size in rep.files.items():
        m = re.fullmatch(r"(.+)\.\d{5,}\.((?:offsets\.)?npy|mdb|bin)", n)
        key = f"{m.group(1)}.*.{m.group(2)}" if m else n
        rows[key] = rows.get(key, 0) + size
        counts[key] = counts.get(key, 0) + 1
    return sorted((k if counts[k] == 1 else f"{k} ({counts[k]:,} files)", v) for k, v in rows.items())


def _short(v, n: int = 90) -> str:  # noqa: ANN001
    s = printable(v) if isinstance(v, str) else json_text(v)
    return s if len(s) <= n else s[: n - 3] + "..."
