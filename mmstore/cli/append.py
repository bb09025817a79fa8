"""``mmstore append DEST SRC``: add the records of a new source to an existing
store as a new part, without rewriting or copying the store's data."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..ingest.options import SIZE_OPTIONS, SOURCE_OPTIONS, SPEC_OPTIONS  # light (the option tables)
from ._common import usage_error
from ._ingest_flags import NOT_FOR_APPEND, add_ingest_flags, refused_for_append

EXAMPLE = """examples:
  mmstore ingest photos-2025/ photos.store --size 224x224
  mmstore append photos.store photos-2026/          # decoded as photos.store was
  mmstore verify photos.store

Decode options (--size, --max-side, --buckets, --resize, --channels, --codec,
--backend ...) default to the store's own; one given that differs is refused,
naming it. Labels are numbered by the store's class names; a new class gets the
next number. A new record whose key (its path relative to SRC, or its id) a
record of the store has already is refused, unless --duplicate-keys keep.
The store is replaced in one atomic step: a reader sees the old store or the
new one. A killed append leaves the old store as it was; run the same command
again to finish it.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "append",
        help="add the records of a new source to a store, as a new part (no record data copied)",
        description="Decode SRC (any ingest source) as the store DEST was decoded and add its records after "
                    "DEST's, as a new part: DEST's data files are not rewritten or copied, and DEST is replaced "
                    "in one atomic step.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dest", help="the store to append to")
    p.add_argument("source", help="the new records: any source `mmstore ingest` takes")
    add_ingest_flags(p, append=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refused = refused_for_append(args)
    if refused is not None:
        return usage_error("append", refused)
    from ..ingest.append import append  # lazy: NOTE [lazy commands]

    names = ("size", *SIZE_OPTIONS, *SPEC_OPTIONS, *(k for k in SOURCE_OPTIONS if k not in NOT_FOR_APPEND))
    opts: dict[str, Any] = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.codec is not None:
        opts["codecs"] = args.codec
    if args.backend is not None:
        opts["backend"] = args.backend
    try:
        res = append(args.dest, args.source, duplicate_keys=args.duplicate_keys, workers=args.workers,
                     on_error=args.on_error, max_errors=args.max_errors, quiet=args.quiet, chunk=args.chunk,
                     progress_interval=args.log_interval, **opts)
    except KeyboardInterrupt:
        print(f"mmstore append: interrupted; {args.dest} is unchanged, and the work done is kept in "
              f"{args.dest}.partial: run the same command again to finish it", file=sys.stderr)
        return 130
    if not args.quiet:
        print(res.summary(), file=sys.stderr)
    return 0
