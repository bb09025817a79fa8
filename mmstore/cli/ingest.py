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
from ..format.layout import SUPPORTED_BACKENDS
from ..format.names import printable
from ..ingest.options import RUN_DEFAULTS, SOURCE_OPTIONS, SPEC_DEFAULTS, SPEC_OPTIONS  # light (the option tables)

EXAMPLE = """examples:
  mmstore ingest photos/ photos.store --size 224x224            # ImageFolder or flat folder
  mmstore ingest train.csv gld.store --size 256x256 --root images/ \\
      --path-column id --label-column landmark_id --path-template '{id[0]}/{id[1]}/{id[2]}/{id}.jpg'
  mmstore ingest bedroom_train_lmdb/ lsun.store --size 128x128 --resize center-crop
  mmstore ingest features.npy feats.store
  mmstore ingest instances_val2017.json coco.store --root val2017/ --size 512x512 --resize pad
  mmstore ingest 'shards/{00000..00099}.tar' laion.store --size 256x256 --json-keys width,height,similarity
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
        "pattern 'shards/{00000..00099}.tar' or a glob; quote it), or Parquet files of image bytes (a .parquet "
        "or a glob of them, 'data/*.parquet': img2dataset's output, Hugging Face's exports).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="image folder, .csv/.tsv list, LMDB directory, .npy/.npz file, COCO .json, "
                   ".tar shards (a brace pattern or glob), or .parquet files (a glob)")
    p.add_argument("dest", help="store directory to create")
    # defaults: DecodeSpec's (SPEC_DEFAULTS) and RUN_DEFAULTS; a switch is the opposite of its option's default
    d = SPEC_DEFAULTS
    g = p.add_argument_group("decode")
    g.add_argument("--size", metavar="HxW",
                   help="target size: HxW such as 224x224, or N for NxN (images need it, --max-side or --short-side)")
    g.add_argument("--max-side", type=int, metavar="N",
                   help="instead of --size: keep each image's own aspect, its long side resized to N (smaller "
                   "images keep their size unless --upscale); records of their own shape, their (h, w) in "
                   "the field image_hw")
    g.add_argument("--short-side", type=int, metavar="N",
                   help="instead of --size: keep each image's own aspect, its short side resized to N "
                   "(LAION's convention; smaller images keep their size unless --upscale)")
    g.add_argument("--buckets", metavar="auto[:N]|HxW,HxW,...",
                   help="instead of --size: aspect buckets: each image goes to the listed shape nearest its aspect, "
                   "resized to cover it and centre-cropped (the crop in box/dst); auto[:N]: up to 9 shapes of about "
                   "NxN pixels (default 256) chosen from the images' aspects, read from their headers first")
    g.add_argument("--upscale", action="store_true",
                   help="with --max-side/--short-side: enlarge images whose side is below N too")
    g.add_argument("--resize", choices=["center-crop", "stretch", "pad", "none"], default=d["resize"],
                   help="how a source becomes the target size (default %(default)s)")
    g.add_argument("--channels", type=int, choices=[1, 3], default=d["channels"],
                   help="output channels (default %(default)s)")
    g.add_argument("--layout", choices=["hwc", "chw"], default=d["layout"], help="record layout (default %(default)s)")
    g.add_argument("--bgr", action="store_true", help="store BGR instead of RGB")
    g.add_argument("--interp-up", choices=["linear", "cubic"], default=d["interp_up"],
                   help="kernel when enlarging (shrinking uses area; default %(default)s)")
    g.add_argument("--pad-value", type=int, default=d["pad_value"],
                   help="letterbox fill for --resize pad (default %(default)s)")
    g.add_argument("--fast-decode", action="store_true",
                   help="let libjpeg decode at 1/2..1/8 scale when the target is small (faster, approximate)")
    g.add_argument("--max-pixels", type=int, default=d["max_pixels"],
                   help="reject sources with more pixels (default %(default)s; 0: no limit)")
    g.add_argument("--no-strict-jpeg", dest="strict_jpeg", action="store_false",
                   help="accept JPEGs whose scan data is corrupt")
    g.add_argument("--alpha", choices=["black", "white", "drop"], default=d["alpha"],
                   help="transparent images (RGBA, gray+alpha, palette with transparency): composite over black "
                   "or white, or drop the alpha channel as PIL's convert('RGB') does (default %(default)s)")
    s = p.add_argument_group("source")
    s.add_argument("--labels", choices=["auto", "folders", "none"], default=None,
                   help="folders: class sub-folders give labels; auto (default) decides from the layout")
    s.add_argument("--root", help="list or COCO .json: directory that relative paths start from (default: the "
                   "list's directory)")
    s.add_argument("--path-column", help="list: column name or 0-based index of the path/id")
    s.add_argument("--label-column", help="list: column of the label (default: 'label' if present; '' for none); "
                   "Parquet: column of the label (integers, or class names)")
    s.add_argument("--path-template", help="list: id -> relative path, e.g. '{id[0]}/{id[1]}/{id[2]}/{id}.jpg'")
    s.add_argument("--delimiter", help="list: field separator (default: tab for .tsv, else comma)")
    s.add_argument("--no-header", dest="header", action="store_const", const=False, default=None,
                   help="list: the first row is data (default: auto, a header unless its path cell is a file)")
    s.add_argument("--label-type", choices=["auto", "int", "names"], default=None,
                   help="list: auto (default): integer labels stay the integers they are when every non-blank cell "
                   "is one (7 or 7.0), a column without integers is named classes, a mix is refused; int: other "
                   "cells become holes; names: every distinct value is a named class")
    s.add_argument("--missing-label", choices=["error", "class"], default=None,
                   help="list: a blank label cell makes its input a hole listed in errors.jsonl (error, default) "
                   "or a class of its own (class: label -1, or the name '' in a named column)")
    s.add_argument("--tags-column", metavar="COL",
                   help="list: column of multi-label tags (cat;animal) -> ragged field 'tags' (tag ids, names kept)")
    s.add_argument("--tags-sep", metavar="SEP", help="list: separator of the tags in a cell (default ';')")
    s.add_argument("--tag-names", metavar="STORE|FILE",
                   help="list: number the tags by a store's tag names (e.g. the training store) or a file of one "
                   "tag per line, so train and val give a tag the same id")
    s.add_argument("--text-column", metavar="COL", help="list: column of a caption -> str field 'text'")
    s.add_argument("--classes-from", metavar="STORE",
                   help="folder or list of class names: label the classes with the class -> id mapping of an "
                   "existing store (e.g. the training store), so both stores agree")
    s.add_argument("--label-names", metavar="FILE",
                   help="folder or list of class names: label the classes by a mapping file, one class name per "
                   "line (line k, from 0, is label k)")
    s.add_argument("--new-classes", choices=["error", "append"], default=None,
                   help="with --classes-from/--label-names: a class not in the mapping is an error "
                   "(default) or gets the next ids after the mapping's (append)")
    s.add_argument("--min-box-size", type=float, default=None, metavar="PX",
                   help="COCO .json: drop a box narrower or lower than PX stored pixels once clipped to the "
                   "picture area (default 1)")
    s.add_argument("--json-keys", metavar="K1,K2",
                   help="WebDataset .tar shards: keys of each sample's .json stored as fields (numbers numeric, "
                   "strings text; a sample lacking one becomes a hole)")
    s.add_argument("--image-column", metavar="COL",
                   help="Parquet: column of the images: encoded bytes (img2dataset's jpg), a {bytes, path} struct "
                   "(Hugging Face's Image) or a path (default: the Image column, else jpg, png, webp or image)")
    s.add_argument("--caption-column", metavar="COL", help="Parquet: string column -> str field 'text'")
    s.add_argument("--columns", metavar="C1,C2",
                   help="Parquet: more columns stored as fields of their name (numbers, booleans, strings, lists "
                   "of numbers; a null value makes its row a hole)")
    s.add_argument("--image-key", help=".npz: name of the image array")
    s.add_argument("--label-key", help=".npz: name of the label array")
    rd = RUN_DEFAULTS
    r = p.add_argument_group("run")
    r.add_argument("--workers", type=int, default=rd["workers"],
                   help="decoder processes (default: CPU cores; 0: none)")
    r.add_argument("--on-error", choices=["skip", "fail"], default=rd["on_error"],
                   help="skip: a bad input becomes a hole; fail: stop at the first (default %(default)s)")
    r.add_argument("--max-errors", metavar="N|P%", default=rd["max_errors"],
                   help="stop once more than N (or P%%) inputs failed")
    r.add_argument("--resume", action="store_true", help="continue DEST.partial left by an interrupted run")
    r.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it is an mmstore store (and discard our DEST.partial); anything else, "
                   "or a DEST that is, contains or lies inside SOURCE, is refused")
    r.add_argument("--shard", metavar="K/N|auto", default=rd["shard"],
                   help="ingest only part K (from 0) of N; join parts with mmstore merge. auto: from the launcher, "
                   "RANK/WORLD_SIZE (torchrun) or SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (offset by "
                   "SLURM_ARRAY_TASK_MIN)")
    r.add_argument("--backend", choices=SUPPORTED_BACKENDS, default=rd["backend"],
                   help="store backend (default %(default)s)")
    g.add_argument("--codec", action="append", default=rd["codecs"], metavar="FIELD=CODEC[:PARAM]",
                   help="store FIELD encoded (repeatable): image=jpeg:90 (lossy, ~7-10x smaller), image=png:1 "
                   "(lossless), FIELD=zstd:3 (lossless, any array), FIELD=raw (default)")
    r.add_argument("--chunk", type=int, default=rd["chunk"], help=argparse.SUPPRESS)
    r.add_argument("--log-interval", type=float, default=rd["progress_interval"], help=argparse.SUPPRESS)
    r.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
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
