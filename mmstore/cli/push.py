"""``mmstore push STORE URL``: upload a store to object storage."""

from __future__ import annotations

import argparse
import sys

from ._common import emit_json, progress_bar, subparser, usage_error

EXAMPLE = """examples:
  export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=eu-west-1
  mmstore push train.store s3://my-bucket/datasets/train.store
  # an S3-compatible server (MinIO, SeaweedFS, R2 ...):
  AWS_ENDPOINT_URL=http://10.0.0.5:8333 mmstore push train.store s3://data/train.store

Files go up in parallel, large ones in parts; the manifest goes last, so the
URL is a store only once everything is there. Killed? Run the same command
again: files already uploaded are kept, and a large file to s3:// goes on from
the parts the server holds. Pushing the same store again uploads nothing.
Then train from the URL (mmstore.open(URL, cache_dir=...)) or pull it.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(sub, "push", help="upload a store to object storage (s3://, gs://, az://)",
                  description="Upload the store at STORE to URL, verified and resumable.", example=EXAMPLE)
    p.add_argument("store", metavar="STORE", help="the local store directory")
    p.add_argument("url", metavar="URL", help="where to put it: s3://BUCKET/PREFIX/NAME.store (or gs://, az://)")
    p.add_argument("--overwrite", action="store_true", help="replace another store at URL")
    p.add_argument("--jobs", type=int, default=8, help="parts of a large file uploaded at once (default 8)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..remote.url import is_url
    from ..transfer import push

    if not is_url(args.url):
        return usage_error("push", f"{args.url!r} is not an object-storage URL (s3://BUCKET/PREFIX, gs://, az://)")
    if args.jobs < 1:
        return usage_error("push", "--jobs must be >= 1")
    bar = progress_bar(not (args.quiet or args.json), "push")

    def total(n: int) -> None:
        bar.total = n

    try:
        rep = push(args.store, args.url, overwrite=args.overwrite, jobs=args.jobs, progress=bar.update,
                   on_total=total)
    finally:
        bar.close()
    if args.json:
        emit_json(rep)
    elif not args.quiet:
        if rep["up_to_date"]:
            print(f"{rep['url']}: already holds this store; nothing uploaded", file=sys.stderr)
        else:
            rate = rep.get("bytes_per_s") or 0
            resumed = rep.get("resumed_bytes") or 0
            kept = f", {resumed / 1e6:,.1f} MB of parts already there" if resumed else ""
            print(f"{rep['url']}: pushed {rep['store']} ({rep['uploaded_bytes'] / 1e6:,.1f} MB in "
                  f"{rep['seconds']:.1f} s, {rate / 1e6:,.1f} MB/s; {rep['skipped_files']} files already there{kept})",
                  file=sys.stderr)
    return 0
