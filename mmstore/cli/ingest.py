"""``mmstore ingest SOURCE DEST``: decode a dataset once into a store."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import IngestError, cli_wording
from ..format.names import printable
from ..ingest.options import RUN_DEFAULTS, SOURCE_OPTIONS, SPEC_DEFAULTS, SPEC_OPTIONS  # light (the option tables)
from ._ingest_flags import add_ingest_flags

EXAMPLE = """examples:
  mmstore ingest photos/ photos.store --size 224x224            # ImageFolder or flat folder
  mmstore ingest train.csv gld.store --size 256x256 --root images/ \\
      --path-column id --label-column landmark_id --path-template '{id[0]}/{id[1]}/{id[2]}/{id}.jpg'
  mmstore ingest bedroom_train_lmdb/ lsun.store --size 128x128 --resize center-crop
  mmstore ingest features.npy feats.store
  mmstore ingest instances_val2017.json coco.store --root val2017/ --size 512x512 --resize pad
  mmstore ingest 'shards/{00000..00099}.tar' laion.store --size 256x256 --json-keys width,height,similarity
  mmstore ingest 's3://bucket/shards/{00000..00099}.tar' laion.store --size 256x256   # read in place
  mmstore ingest 'data/*.parquet' laion.store --size 256x256 --image-column jpg --caption-column caption \\
      --columns similarity,width
  mmstore ingest photos/ photos.store --max-side 512 --codec image=jpeg:90   # each image at its own aspect
  mmstore ingest photos/ photos.store --buckets auto:512   # aspect buckets of about 512x512 chosen from the data
  mmstore ingest photos/ photos.store --buckets 256x256,192x320,320x192   # the nearest of these shapes each
  mmstore ingest photos/ part0.store --size 224x224 --shard 0/4 --resume   # one of 4 jobs; then
  mmstore merge part0.store part1.store part2.store part3.store photos.store
  sbatch --array=0-3 --wrap 'mmstore ingest photos/ part$SLURM_ARRAY_TASK_ID.store --size 224x224 --shard auto --resume'

Interrupted (Ctrl-C, SIGTERM, SIGKILL, disk full)? Rerun the same command with
--resume: it continues from the last committed chunk and ends byte-identical to
an uninterrupted run (a command that always passes --resume is safe to requeue).

Folder rule: hidden names are skipped; files with an image extension are always
inputs (broken ones become holes listed in errors.jsonl); other files are
included only when their content is an image; directories are always walked.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ingest",
        help="decode images (folder, csv/tsv list, LMDB, .npy/.npz, COCO .json, WebDataset .tar shards, Parquet) "
        "once into a store",
        description="Decode SOURCE once into fixed-shape records at DEST (or, with --max-side or "
        "--short-side, records that keep each image's own aspect; with --buckets, records of a few shapes, each "
        "image at the one nearest its aspect). SOURCE is recognised from "
        "what it is: a directory of images (ImageFolder layout gives labels), a .csv/.tsv list, an "
        "LMDB directory of encoded images, a .npy/.npz file, a COCO instances .json (boxes, categories, "
        "polygons; images under --root), or WebDataset .tar shards in img2dataset's layout (one .tar, a brace "
        "pattern 'shards/{00000..00099}.tar' or a glob; quote it; local or s3:// gs:// az:// http(s):// URLs), "
        "or Parquet files of image bytes (a .parquet "
        "or a glob of them, 'data/*.parquet': img2dataset's output, Hugging Face's exports).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="image folder, .csv/.tsv list, LMDB directory, .npy/.npz file, COCO .json, "
                   ".tar shards (a brace pattern or glob, local or URLs), or .parquet files (a glob)")
    p.add_argument("dest", help="store directory to create")
    add_ingest_flags(p, append=False)
    p.set_defaults(func=run)


def resume_command(args: argparse.Namespace, changes: Mapping[str, str] | None = None) -> str:
    """The command that resumes this ingest, with ``changes`` (option -> value) made."""
    args = argparse.Namespace(**{**vars(args), **(changes or {})})
    # the options that must be repeated for a resume (they enter the fingerprint); one at its default is left out
    repeat = ("size", "max_side", "short_side", "buckets", *SPEC_OPTIONS, *SOURCE_OPTIONS, "shard", "backend", "codec",
              "workers", "on_error", "max_errors", "quiet")
    defaults = {**SPEC_DEFAULTS, **RUN_DEFAULTS}
    argv = ["mmstore", "ingest", args.source, args.dest]
    for k in repeat:
        v = getattr(args, k, None)
        if k == "header":
            argv += ["--no-header"] if v is False else []
            continue
        if k == "codec":
            for c in v or []:
                argv += ["--codec", str(c)]
            continue
        if v is None or (k in defaults and v == defaults[k]):
            continue
        if isinstance(v, bool):  # a switch: --bgr, --no-strict-jpeg
            argv.append(("--" if v else "--no-") + k.replace("_", "-"))
            continue
        argv += ["--" + k.replace("_", "-"), str(v)]
    argv.append("--resume")
    return " ".join(shell_quote(a) for a in argv)


def shell_quote(arg: str) -> str:
    """``shlex.quote``, except that an argument holding bytes that are not UTF-8
    (or control characters) is written as bash ``$'...'`` with ``\\xNN``
    escapes, so the printed resume command can be pasted as it is."""
    if arg.isprintable():
        return shlex.quote(arg)
    out = []
    for b in os.fsencode(arg):
        ch = chr(b)
        out.append(ch if 0x20 <= b < 0x7F and ch not in "\\'" else f"\\x{b:02x}")
    return "$'" + "".join(out) + "'"


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The decode and source options of ``ingest()`` from the parsed flags."""
    opts = {k: getattr(args, k) for k in SPEC_OPTIONS}
    opts.update({k: getattr(args, k) for k in SOURCE_OPTIONS if getattr(args, k) is not None})
    return opts


def run(args: argparse.Namespace) -> int:
    from ..ingest import ingest  # lazy: NOTE [lazy commands]

    hint = f"resume with: {resume_command(args)}"
    old_term = None
    try:
        old_term = signal.signal(signal.SIGTERM, _term_to_interrupt)
    except ValueError:  # not the main thread
        pass
    try:
        res = ingest(
            args.source,
            args.dest,
            args.size,
            max_side=args.max_side,
            short_side=args.short_side,
            buckets=args.buckets,
            workers=args.workers,
            on_error=args.on_error,
            max_errors=args.max_errors,
            resume=args.resume,
            overwrite=args.overwrite,
            shard=args.shard,
            quiet=args.quiet,
            backend=args.backend,
            codecs=args.codec,
            chunk=args.chunk,
            progress_interval=args.log_interval,
            resume_hint=lambda changes: f"resume with: {resume_command(args, changes)}",
            **_options(args),
        )
    except KeyboardInterrupt:
        print(f"mmstore ingest: interrupted; the committed work is kept in {args.dest}.partial\n{hint}",
              file=sys.stderr)
        return 130
    except (ValueError, TypeError) as exc:
        if isinstance(exc, IngestError) or type(exc).__module__.startswith("mmstore"):
            raise
        print(f"mmstore ingest: {printable(cli_wording(str(exc)))}", file=sys.stderr)
        return 2
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    if not args.quiet:
        print(res.summary(), file=sys.stderr)
    return 0


def _term_to_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
