"""``mmstore push STORE URL``: upload a store to object storage."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from ._common import emit_json, progress_bar, subparser, usage_error

EXAMPLE = """examples:
  export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=eu-west-1
  mmstore push train.store s3://my-bucket/datasets/train.store
  # an S3-compatible server (MinIO, SeaweedFS, R2 ...):
  AWS_ENDPOINT_URL=http://10.0.0.5:8333 mmstore push train.store s3://data/train.store

  mmstore push --abort-uploads s3://my-bucket/datasets/train.store

Files go up in parallel, large ones in parts; the manifest goes last, so the
URL is a store only once everything is there. URL is the store's own prefix:
a push refuses a prefix that holds anything else (another store, a README),
and never deletes or overwrites it; --overwrite replaces another store at URL
and deletes only that store's objects. Interrupted (Ctrl-C, SIGTERM, killed)?
Run the same command again: files already uploaded are kept, and a large file
to s3:// goes on from the parts the server holds; or drop the unfinished
uploads with --abort-uploads URL. Pushing the same store again uploads only
the objects that differ from the store's index at URL (damaged, replaced,
deleted): that repairs a damaged store; nothing when all match. Then train
from the URL (mmstore.open(URL, cache_dir=...)) or pull it.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(sub, "push", help="upload a store to object storage (s3://, gs://, az://)",
                  description="Upload the store at STORE to URL, verified and resumable.", example=EXAMPLE)
    p.add_argument("store", metavar="STORE", nargs="?", help="the local store directory")
    p.add_argument("url", metavar="URL", nargs="?",
                   help="where to put it: s3://BUCKET/PREFIX/NAME.store (or gs://, az://)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace another store at URL (never anything that is not a store)")
    p.add_argument("--abort-uploads", metavar="URL", default=None,
                   help="instead of pushing: list and abort the unfinished multipart uploads of the store at URL "
                        "(s3://)")
    p.add_argument("--jobs", type=int, default=8, help="parts of a large file uploaded at once (default 8)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..remote.url import parse_url
    from ..transfer import push

    if args.abort_uploads is not None:
        if args.store is not None:
            return usage_error("push", "--abort-uploads takes the URL alone (no STORE)")
        parse_url(args.abort_uploads)
        return _with_signals(lambda: _abort(args))
    if args.store is None or args.url is None:
        return usage_error("push", "expected STORE and URL (mmstore push STORE URL)")
    parse_url(args.url)  # StoreURLError (exit 2), worded as every command words it
    if args.jobs < 1:
        return usage_error("push", "--jobs must be >= 1")
    bar = progress_bar(not (args.quiet or args.json), "push")

    def total(n: int) -> None:
        bar.total = n

    def go() -> int:
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
                repaired = rep.get("repaired") or []
                fixed = (f"; repaired {len(repaired)} object(s) that differed from the index: "
                         f"{', '.join(repaired[:5])}" if repaired else "")
                print(f"{rep['url']}: pushed {rep['store']} ({rep['uploaded_bytes'] / 1e6:,.1f} MB in "
                      f"{rep['seconds']:.1f} s, {rate / 1e6:,.1f} MB/s; {rep['skipped_files']} files already "
                      f"there{kept}){fixed}", file=sys.stderr)
        return 0

    return _with_signals(go, resume=f"run the same command again to go on (what is uploaded is kept), or "
                                    f"`mmstore push --abort-uploads {args.url}` to drop the unfinished uploads")


def _abort(args: argparse.Namespace) -> int:
    from ..transfer.push import abort_uploads

    rep = abort_uploads(args.abort_uploads)
    if args.json:
        emit_json(rep)
    elif not args.quiet:
        for u in rep["aborted"]:
            print(f"aborted  {rep['url']}/{u['name']}  (upload {u['upload_id'][:16]}..., started {u['initiated']})",
                  file=sys.stderr)
        more = (f"; {len(rep['kept'])} upload(s) of other stores under deeper prefixes left alone"
                if rep["kept"] else "")
        print(f"{rep['url']}: {len(rep['aborted'])} unfinished upload(s) aborted{more}", file=sys.stderr)
    return 0


def _with_signals(go: Callable[[], int], resume: str = "") -> int:
    """Run ``go`` with SIGINT and SIGTERM raising ``KeyboardInterrupt`` in it
    (NOTE [stopping a transfer] in mmstore/_os/threads.py: the push
    stops at once); exit code 130. A second signal while the first is
    handled ends the process at once, also 130, with no traceback."""
    state = {"hit": False}

    def handler(signum: int, frame: object) -> None:
        if state["hit"]:
            os._exit(130)
        state["hit"] = True
        raise KeyboardInterrupt

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: the caller's handlers stay
            break
    try:
        return go()
    except KeyboardInterrupt:
        state["hit"] = True
        print("mmstore push: interrupted" + (f"; {resume}" if resume else ""), file=sys.stderr)
        sys.stderr.flush()
        return 130
    finally:
        for sig, h in old.items():
            # interrupted: further signals are ignored on the way out (the interpreter's exit would put the
            # default action back for a handler of ours, and a late Ctrl-C would end it by the signal)
            signal.signal(sig, signal.SIG_IGN if state["hit"] else h)
