"""``mmstore merge PART... DEST``: join the stores of ``ingest --shard K/N`` jobs."""

from __future__ import annotations

import argparse
import sys

from ..reader import open_store

EXAMPLE = """example:
  for k in 0 1 2 3; do mmstore ingest photos/ part$k.store --size 224x224 --shard $k/4; done
  mmstore merge part0.store part1.store part2.store part3.store photos.store

The parts are ordered by their shard number whatever the order given, and
checked to be all N parts of one ingest. No record data is copied: each part's
data files are hard-linked into DEST as one segment (DEST must be on the same
file system as the parts; --copy copies them otherwise), and only the small
bookkeeping files (checksums, keys, index) are written. DEST reads exactly like
a single ingest without --shard. The parts can be deleted afterwards: DEST
holds its own links to the data.
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it is an mmstore store (and our left-over DEST.partial); anything else is refused")
    p.add_argument("--copy", action="store_true",
                   help="copy the data files instead of hard-linking them (DEST on another file system)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..ingest import merge  # lazy: NOTE [lazy commands]

    # DestinationError, StoreExistsError: exit 2; an OSError: 1 (cli.main)
    path = merge(args.parts, args.dest, overwrite=args.overwrite, copy=args.copy)
    if not args.quiet:
        with open_store(path) as s:
            how = "copied" if args.copy else "hard-linked, no record data copied"
            print(f"{path}: {s.records} records ({s.slots - s.records} skipped) from {len(args.parts)} parts "
                  f"({how})", file=sys.stderr)
    return 0
