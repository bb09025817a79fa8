"""``mmstore convert SRC DEST [--backend lmdb|memmap] [--codec FIELD=CODEC[:PARAM] ...]``."""

from __future__ import annotations

import argparse
import os

from ..check.common import fmt_bytes
from ..format.layout import SUPPORTED_BACKENDS
from ..format.names import printable
from ._common import emit_json, progress_bar, subparser, usage_error

EXAMPLE = """examples:
  mmstore convert /data/lm.store /data/lm-lmdb.store --backend lmdb
  mmstore convert /data/lm-lmdb.store /data/lm.store --backend memmap --overwrite
  mmstore convert /data/lm.store /data/lm-q90.store --codec image=jpeg:90
  mmstore convert /data/lm-q90.store /data/lm-raw.store --codec image=raw

Without --codec every field keeps its codec (encoded entries are copied as they are): both
stores read identically record for record and the checksums file is byte-identical. A field
whose codec changes is decoded and encoded again (jpeg is lossy: converting to raw stores what
the jpeg store decodes to; raw -> zstd -> raw gives back the same bytes).
exit codes: 0 converted, 1 the source is damaged (nothing written), 2 not a store or bad arguments
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "convert", "rewrite a store in another backend (memmap <-> lmdb) or with other codecs",
        "Write every slot of SRC into a new store DEST with the chosen backend and codecs: holes, keys, "
        "label names and provenance carry over (with a converted_from note and the encoder versions), "
        "every record's checksum is checked on the way.",
        EXAMPLE,
    )
    p.add_argument("src", metavar="SRC", help="the store to read")
    p.add_argument("dest", metavar="DEST", help="the store to write")
    p.add_argument("--backend", choices=SUPPORTED_BACKENDS, help="backend of DEST (default: the source's)")
    p.add_argument("--codec", action="append", default=[], metavar="FIELD=CODEC[:PARAM]",
                   help="store FIELD with CODEC in DEST (raw, jpeg:QUALITY, png:LEVEL, zstd:LEVEL); repeatable; "
                        "fields not named keep their codec")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it is an mmstore store (anything else is refused)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.convert import convert_store
    from ..errors import SchemaError

    if os.path.realpath(args.src) == os.path.realpath(args.dest):
        return usage_error("convert", "DEST must differ from SRC")
    if args.backend is None and not args.codec:
        return usage_error("convert", "give --backend and/or --codec (otherwise DEST would be a copy of SRC)")
    bar = progress_bar(not args.no_progress and not args.json, "convert")
    try:
        rep = convert_store(args.src, args.dest, args.backend, codecs=args.codec or None,
                           overwrite=args.overwrite, progress=bar.update)
    except SchemaError as exc:  # a --codec that names no field or does not fit its field
        return usage_error("convert", str(exc))
    finally:  # DestinationError, StoreExistsError: exit 2 (cli.main)
        bar.close()
    if args.json:
        emit_json(rep)
    else:
        print(f"converted  {printable(rep.source)} ({rep.source_backend}) -> {printable(rep.dest)} ({rep.backend})")
        codecs = ", ".join(f"{k}={v}" for k, v in (rep.codecs or {}).items())
        print(f"           codecs {codecs}")
        print(f"           {rep.records:,} records, {rep.holes:,} holes, {fmt_bytes(rep.bytes_written)} in "
              f"{rep.seconds:.2f} s")
    return 0
