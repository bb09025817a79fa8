"""``mmstore merge PART... DEST``: join the stores of ``ingest --shard K/N`` jobs."""

from __future__ import annotations

import argparse
import sys

EXAMPLE = """example:
  for k in 0 1 2 3; do mmstore ingest photos/ part$k.store --size 224x224 --shard $k/4; done
  mmstore merge part0.store part1.store part2.store part3.store photos.store

The parts are ordered by their shard number whatever the order given, checked
to be all N parts of one ingest, and written into one ordinary store whose data
is byte-identical to a single ingest without --shard. The record bytes are
copied with copy_file_range (kernel-side, near disk speed; shared extents on
reflink file systems); the parts are left in place.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="join the parts written by ingest --shard into one store",
        description="Join stores written by `mmstore ingest --shard K/N` into one store at DEST.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("parts", nargs="+", metavar="PART", help="part stores (any order)")
    p.add_argument("dest", help="store directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace DEST (and a left-over DEST.partial)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..ingest import merge
    from ..reader import open_store

    try:
        path = merge(args.parts, args.dest, overwrite=args.overwrite)
    except OSError as exc:
        from ..errors import MmstoreError

        if isinstance(exc, MmstoreError):
            raise
        print(f"mmstore merge: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        with open_store(path) as s:
            print(f"{path}: {s.records} records ({s.slots - s.records} skipped) from {len(args.parts)} parts",
                  file=sys.stderr)
    return 0
