"""``mmstore append DEST SRC``: add the records of a new source to an existing
store as a new part, without rewriting or copying the store's data."""

from __future__ import annotations

import argparse
import sys
from typing import Any

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

_SPEC_FLAGS = ("size", "max_side", "short_side", "buckets", "upscale", "resize", "channels", "layout", "bgr",
               "interp_up", "pad_value", "fast_decode", "max_pixels", "strict_jpeg", "alpha")
_SOURCE_FLAGS = ("labels", "root", "path_column", "label_column", "path_template", "delimiter", "header",
                 "label_type", "missing_label", "image_key", "label_key", "min_box_size", "tags_column", "tags_sep",
                 "text_column", "tag_names", "json_keys", "image_column", "caption_column", "columns")


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
    g = p.add_argument_group("decode (default: the store's; a different value is refused)")
    g.add_argument("--size", metavar="HxW")
    g.add_argument("--max-side", type=int, metavar="N")
    g.add_argument("--short-side", type=int, metavar="N")
    g.add_argument("--buckets", metavar="HxW,HxW,...")
    g.add_argument("--upscale", action="store_const", const=True, default=None)
    g.add_argument("--resize", choices=["center-crop", "stretch", "pad", "none"])
    g.add_argument("--channels", type=int, choices=[1, 3])
    g.add_argument("--layout", choices=["hwc", "chw"])
    g.add_argument("--bgr", action="store_const", const=True, default=None)
    g.add_argument("--interp-up", choices=["linear", "cubic"])
    g.add_argument("--pad-value", type=int)
    g.add_argument("--fast-decode", action="store_const", const=True, default=None)
    g.add_argument("--max-pixels", type=int)
    g.add_argument("--no-strict-jpeg", dest="strict_jpeg", action="store_const", const=False, default=None)
    g.add_argument("--alpha", choices=["black", "white", "drop"])
    g.add_argument("--codec", action="append", default=None, metavar="FIELD=CODEC[:PARAM]")
    g.add_argument("--backend", choices=["memmap", "lmdb"])
    s = p.add_argument_group("source (as mmstore ingest)")
    s.add_argument("--labels", choices=["auto", "folders", "none"])
    s.add_argument("--root")
    s.add_argument("--path-column")
    s.add_argument("--label-column")
    s.add_argument("--path-template")
    s.add_argument("--delimiter")
    s.add_argument("--no-header", dest="header", action="store_const", const=False, default=None)
    s.add_argument("--label-type", choices=["auto", "int", "names"])
    s.add_argument("--missing-label", choices=["error", "class"])
    s.add_argument("--image-key")
    s.add_argument("--label-key")
    s.add_argument("--min-box-size", type=float)
    s.add_argument("--tags-column")
    s.add_argument("--tags-sep")
    s.add_argument("--text-column")
    s.add_argument("--tag-names")
    s.add_argument("--json-keys", metavar="K1,K2")
    s.add_argument("--image-column", metavar="COL")
    s.add_argument("--caption-column", metavar="COL")
    s.add_argument("--columns", metavar="C1,C2")
    r = p.add_argument_group("run")
    r.add_argument("--duplicate-keys", choices=["error", "keep"], default="error",
                   help="a new record whose key the store has: refuse the append (error, default) or keep it")
    r.add_argument("--workers", type=int, default=None, help="decoder processes (default: CPU cores; 0: none)")
    r.add_argument("--on-error", choices=["skip", "fail"], default="skip",
                   help="skip: a bad input becomes a hole; fail: stop at the first (default %(default)s)")
    r.add_argument("--max-errors", metavar="N|P%", default=None, help="stop once more than N (or P%%) inputs failed")
    r.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    r.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..ingest.append import append  # lazy: NOTE [lazy commands]

    opts: dict[str, Any] = {k: getattr(args, k) for k in _SPEC_FLAGS + _SOURCE_FLAGS if getattr(args, k) is not None}
    if args.codec is not None:
        opts["codecs"] = args.codec
    if args.backend is not None:
        opts["backend"] = args.backend
    try:
        res = append(args.dest, args.source, duplicate_keys=args.duplicate_keys, workers=args.workers,
                     on_error=args.on_error, max_errors=args.max_errors, quiet=args.quiet, chunk=args.chunk,
                     **opts)
    except KeyboardInterrupt:
        print(f"mmstore append: interrupted; {args.dest} is unchanged, and the work done is kept in "
              f"{args.dest}.partial: run the same command again to finish it", file=sys.stderr)
        return 130
    if not args.quiet:
        print(res.summary(), file=sys.stderr)
    return 0
