"""``mmstore verify STORE``: check structure and every record's checksum."""

from __future__ import annotations

import argparse
import sys

from ..check.common import fmt_bytes
from ..format.names import printable
from ..remote.url import is_url
from ._common import add_common, emit_json, off_main, progress_bar, subparser, usage_error

EXAMPLE = """examples:
  mmstore verify /data/landmarks.store            # structure + every record (parallel)
  mmstore verify /data/landmarks.store --quick    # structure only, seconds on any size
  mmstore verify /data/landmarks.store --repair   # re-ingest bad records from the source
  mmstore verify /data/lm-q90.store --decode      # also decode every jpeg/png/zstd entry
  mmstore verify STORE --json | jq '.bad_records[] | {index, slot, key}'
  mmstore verify s3://bucket/train.store --quick  # the objects' sizes and etags against the index
  mmstore verify s3://bucket/train.store --deep   # also every block of every object, from the bucket

exit codes: 0 the store is sound, 1 a problem was found (listed), 2 not a store
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "verify", "check a store's files, index, keys and every record's checksum",
        "Check that the manifest matches every file (sizes, dtypes, shapes), that no file is "
        "missing or stray, that the checksums file belongs to this manifest, that index, keys and "
        "errors.jsonl agree, then recompute every record's xxh3_64 checksum in parallel and name "
        "each bad record by dataset index, slot and source key.",
        EXAMPLE,
    )
    add_common(p)
    p.add_argument("--quick", action="store_true", help="structure only: read no record data")
    p.add_argument("--decode", action="store_true",
                   help="also decode every entry of each encoded field (jpeg, png, zstd) and list those that fail")
    p.add_argument("--deep", action="store_true",
                   help="a store URL: also fetch every block of every object from the bucket and check it "
                        "against the digest the push recorded, naming each block that differs")
    p.add_argument("--repair", action="store_true",
                   help="re-ingest the bad records from their source files (needs the source), then verify again")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="reader threads (default: CPUs, max 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--max-listed", type=int, default=20, metavar="N",
                   help="bad records listed in the text output (default 20; --json lists all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.verify import verify_store

    if args.quick and args.decode:
        return usage_error("verify", "--decode reads every entry; drop --quick")
    if args.quick and args.repair:
        return usage_error("verify", "--repair needs the content check; drop --quick")
    if args.threads is not None and args.threads < 1:
        return usage_error("verify", "--threads must be >= 1")
    if args.deep and not is_url(args.store):
        return usage_error("verify", "--deep is for a store URL (s3://...): a local store's verify reads every "
                           "record already")
    rep = _verify(args, verify_store)
    if args.repair and not rep.ok:
        from ..check.repair import repair_store

        rr = repair_store(args.store, rep)
        rep.repair = rr
        if not args.json:
            print(render(rep, args.max_listed))
            print(render_repair(rr))
        if rr.attempted:
            rep2 = _verify(args, verify_store)
            rep2.repair = rr
            rep = rep2
        else:
            rep.repair = rr
        if args.json:
            emit_json(rep)
        else:
            if rr.attempted:
                print("after repair:")
                print(render(rep, args.max_listed))
    elif args.json:
        emit_json(rep)
    else:
        print(render(rep, args.max_listed))
    return 0 if rep.ok else 1


def _verify(args: argparse.Namespace, verify_store):  # noqa: ANN001, ANN202
    bar = progress_bar(not args.no_progress and not args.json and not args.quick, "verify")

    def on_total(n: int) -> None:
        bar.total = n

    try:
        return off_main(args.store, verify_store, args.store, quick=args.quick, decode=args.decode,
                        threads=args.threads, progress=bar.update, on_total=on_total, deep=args.deep)
    finally:
        bar.close()


def render(rep, max_listed: int = 20) -> str:  # noqa: ANN001
    out = [f"store      {rep.path}"]
    if rep.store_id:
        out.append(f"id         {rep.store_id}   backend {rep.backend}   "
                   f"{rep.records:,} records in {rep.slots:,} slots")
    for p in rep.problems:  # messages quote names found in the store: escape what a terminal would act on
        out.append(f"PROBLEM    [{p.kind}] {printable(p.message)}")
    if rep.content_checked:
        out.append(f"content    {rep.checked_slots:,} slots, {fmt_bytes(rep.checked_bytes)} in {rep.seconds:.2f} s "
                   f"({rep.mb_per_s:,.0f} MB/s, {rep.threads} threads)")
    elif rep.quick:
        out.append("content    not checked (--quick)")
    if rep.note:
        out.append(f"note       {rep.note}")
    if rep.bad_count:
        out.append(f"bad        {rep.bad_count:,} record(s):")
        for r in rep.bad_records[:max_listed]:
            where = f"index {r.index}" if r.index is not None else "hole"
            detail = f" (expected {r.expected}, found {r.found})" if r.expected or r.found else ""
            slot = f"slot {r.slot}" if r.slot >= 0 else "no slot"
            out.append(f"  {where:>14}  {slot:<12}  key {r.key!r}: {r.what}{printable(detail)}")
        if rep.bad_count > max_listed:
            out.append(f"  ... and {rep.bad_count - max_listed:,} more (--json lists them all)")
    remote = getattr(rep, "remote", None)
    if remote is not None and remote.foreign:
        shown = ", ".join(printable(n) for n in remote.foreign[:5])
        out.append(f"note       {len(remote.foreign)} object(s) under the URL are not the store's: {shown}"
                   + (" ..." if len(remote.foreign) > 5 else "") + " (a push refuses to write beside them)")
    out.append(rep.summary())
    if not rep.ok and remote is not None and remote.next:
        out.append(f"next       {remote.next}")
    elif not rep.ok and rep.repair is None:
        if any(p.kind != "lmdb-keys" for p in rep.problems):  # what --repair refuses (benchmarks/repair.py)
            out.append("next       restore the files named above from a copy, or re-create the store "
                       "(`mmstore verify --repair` restores records, not these files)")
        else:
            out.append("next       `mmstore verify --repair` re-ingests bad records from the source when it is "
                       "still there; otherwise restore the store from a copy or re-create it")
    return "\n".join(out)


def render_repair(rr) -> str:  # noqa: ANN001
    lines = [f"repair     {printable(rr.message)}"]
    for s in rr.failed[:20]:
        lines.append(f"  not repaired: slot {s['slot']} key {s['key']!r}: {printable(s['reason'])}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
