"""``mmstore pull URL DEST``: download a store from object storage, verified."""

from __future__ import annotations

import argparse
import sys

from ._common import emit_json, progress_bar, subparser, usage_error

EXAMPLE = """examples:
  mmstore pull s3://my-bucket/datasets/train.store /nvme/train.store
  mmstore pull s3://my-bucket/datasets/train.store /nvme/train.store --json | jq .bytes_per_s

Every block is checked against the digests the push recorded as it arrives,
every file whole at the end, then every record's checksum; until then the
download is DEST.partial. Killed? Run the same command again: blocks already
written are kept. To train without downloading first, open the URL
(mmstore.open(URL, cache_dir=..., cache_limit=...)).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(sub, "pull", help="download a store from object storage, verified",
                  description="Download the store at URL to DEST, verified and resumable.", example=EXAMPLE)
    p.add_argument("url", metavar="URL", help="the store: s3://BUCKET/PREFIX/NAME.store (or gs://, az://, https://)")
    p.add_argument("dest", metavar="DEST", help="the local store directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace another store at DEST")
    p.add_argument("--jobs", type=int, default=16, help="range requests in flight (default 16)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..remote.url import local_dest, parse_url
    from ..transfer import pull

    parse_url(args.url)  # StoreURLError (exit 2) for what is not a store URL, saying what one looks like
    local_dest(args.dest)  # a local directory: a URL here is refused, never taken as ./s3:/...
    if args.jobs < 1:
        return usage_error("pull", "--jobs must be >= 1")
    bar = progress_bar(not (args.quiet or args.json), "pull")

    def total(n: int) -> None:
        bar.total = n

    try:
        rep = pull(args.url, args.dest, overwrite=args.overwrite, jobs=args.jobs, progress=bar.update, on_total=total)
    finally:
        bar.close()
    if args.json:
        emit_json(rep)
    elif not args.quiet:
        if rep["up_to_date"]:
            print(f"{rep['store']}: already holds this store; nothing downloaded", file=sys.stderr)
        else:
            rate = rep.get("bytes_per_s") or 0
            print(f"{rep['store']}: pulled {rep['url']} ({rep['downloaded_bytes'] / 1e6:,.1f} MB in "
                  f"{rep['seconds']:.1f} s, {rate / 1e6:,.1f} MB/s; {rep.get('verified_records', 0):,} records "
                  "verified)", file=sys.stderr)
    return 0
