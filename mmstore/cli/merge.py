"""``mmstore merge STORE... DEST``: join stores into one, without copying
record data: the parts of ``ingest --shard K/N`` jobs, or any stores with the
same backend, schema and label names."""

from __future__ import annotations

import argparse
import sys

from ..store.reader import open_store

EXAMPLE = """examples:
  # the parts of one sharded ingest: ordered by shard number whatever the
  # order given, and checked to be all N parts of the same ingest
  for k in 0 1 2 3; do mmstore ingest photos/ part$k.store --size 224x224 --shard $k/4; done
  mmstore merge part0.store part1.store part2.store part3.store photos.store

  # any stores with the same backend, schema and label names (say, two
  # ImageFolders with the same class folders, ingested separately), joined
  # in the order given: records of 2019.store first
  mmstore ingest photos-2019/ 2019.store --size 224x224
  mmstore ingest photos-2020/ 2020.store --size 224x224
  mmstore merge 2019.store 2020.store all.store

Parts of a sharded ingest and stores written without --shard cannot be mixed.
No record data is copied: each store's data files are hard-linked into DEST as
one segment (DEST must be on the same file system; --copy copies them
otherwise), and only the small bookkeeping files (checksums, keys, index) are
written. The sharded parts merged read exactly like a single ingest without
--shard. The inputs can be deleted afterwards: DEST holds its own links to the
data.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="join stores into one: the parts of ingest --shard, or any with the same schema and labels",
        description="Join stores into one store at DEST, without copying record data: the parts written by "
                    "`mmstore ingest --shard K/N` (ordered by K), or any stores with the same backend, schema "
                    "and label names (in the order given).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("parts", nargs="+", metavar="STORE",
                   help="the stores to join: shard parts (any order), or other stores (in this order)")
    p.add_argument("dest", help="store directory to create")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it is an mmstore store (and our left-over DEST.partial); "
                        "anything else is refused")
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
