"""``mmstore convert SRC DEST --backend lmdb|memmap``."""

from __future__ import annotations

import argparse
import os

from .._names import printable
from ..format import SUPPORTED_BACKENDS
from ..tools._common import fmt_bytes
from ._common import emit_json, progress_bar, subparser, usage_error

EXAMPLE = """examples:
  mmstore convert /data/lm.store /data/lm-lmdb.store --backend lmdb
  mmstore convert /data/lm-lmdb.store /data/lm.store --backend memmap --overwrite

Both stores read identically record for record; the checksums file is byte-identical.
exit codes: 0 converted, 1 the source is damaged (nothing written), 2 not a store or bad arguments
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "convert", "rewrite a store in the other backend (memmap <-> lmdb)",
        "Write every slot of SRC into a new store DEST with the chosen backend: holes, keys, label "
        "names and provenance carry over (with a converted_from note), every record's checksum is "
        "checked on the way.",
        EXAMPLE,
    )
    p.add_argument("src", metavar="SRC", help="the store to read")
    p.add_argument("dest", metavar="DEST", help="the store to write")
    p.add_argument("--backend", required=True, choices=SUPPORTED_BACKENDS, help="backend of DEST")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it is an mmstore store (anything else is refused)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..tools.convert import convert_store

    if os.path.realpath(args.src) == os.path.realpath(args.dest):
        return usage_error("convert", "DEST must differ from SRC")
    bar = progress_bar(not args.no_progress and not args.json, "convert")
    try:
        rep = convert_store(args.src, args.dest, args.backend, overwrite=args.overwrite, progress=bar.update)
    finally:  # DestinationError, StoreExistsError: exit 2 (cli.main)
        bar.close()
    if args.json:
        emit_json(rep)
    else:
        print(f"converted  {printable(rep.source)} ({rep.source_backend}) -> {printable(rep.dest)} ({rep.backend})")
        print(f"           {rep.records:,} records, {rep.holes:,} holes, {fmt_bytes(rep.bytes_written)} in "
              f"{rep.seconds:.2f} s")
    return 0
