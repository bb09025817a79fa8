"""The flags of ``mmstore ingest`` and ``mmstore append``, defined once.

Both commands decode a source the same way, so they take the same decode,
source and run flags, added to their parsers by :func:`add_ingest_flags`
(the option names are the keyword options of ``mmstore.ingest``, listed in
:mod:`mmstore.ingest.options`). The two lists cannot drift apart: a flag
added here is a flag of both. For ``append`` the decode flags default to
the store's own (None here), and the flags that cannot apply to an append
(:data:`NOT_FOR_APPEND`) are accepted by the parser and refused by
:func:`refused_for_append` with the reason, so that a user who copies an
ingest command line learns what to leave out.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType

from ..format.layout import SUPPORTED_BACKENDS
from ..ingest.options import RUN_DEFAULTS, SPEC_DEFAULTS  # light (the option tables)

__all__ = ["NOT_FOR_APPEND", "add_ingest_flags", "refused_for_append"]

# the ingest flags an append refuses (dest -> why), in the order they are checked
NOT_FOR_APPEND: Mapping[str, str] = MappingProxyType({
    "classes_from": "an append numbers labels by the store's own class names (a class it lacks gets the next "
                    "number)",
    "label_names": "an append numbers labels by the store's own class names (a class it lacks gets the next "
                   "number)",
    "new_classes": "an append always gives a class the store lacks the next number after the store's",
    "resume": "an append resumes by itself: run the same command again",
    "overwrite": "an append adds to the store; to replace it, use mmstore ingest --overwrite",
    "shard": "an append adds one part: append each part's source in turn, or ingest shards and mmstore merge them",
})


def add_ingest_flags(p: argparse.ArgumentParser, *, append: bool) -> None:
    """Add the decode, source and run flags of ``mmstore ingest`` to ``p``;
    ``append``: the decode flags default to None (the store's own), and
    the help says which flags an append refuses."""
    _decode_flags(p, append)
    _source_flags(p, append)
    _run_flags(p, append)


def refused_for_append(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags of an append, or None: the first flag given
    that cannot apply to an append (:data:`NOT_FOR_APPEND`), with why."""
    for dest, why in NOT_FOR_APPEND.items():
        if getattr(args, dest, None) not in (None, False):
            flag = "--" + dest.replace("_", "-")
            return f"{flag} does not apply to mmstore append: {why}; leave it out"
    return None


def _refused(append: bool, dest: str, text: str) -> str:
    return f"not taken by append ({NOT_FOR_APPEND[dest]})" if append else text


def _decode_flags(p: argparse.ArgumentParser, append: bool) -> None:
    # ingest: DecodeSpec's defaults (a switch is the opposite of its option's default); append: None, the store's
    d: Mapping[str, object] = {k: None for k in SPEC_DEFAULTS} if append else SPEC_DEFAULTS
    on = {"action": "store_const", "const": True, "default": None} if append else {"action": "store_true"}
    title = "decode (default: the store's; a different value is refused)" if append else "decode"
    g = p.add_argument_group(title)
    ds = "the store's" if append else "%(default)s"
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
    g.add_argument("--upscale", **on, help="with --max-side/--short-side: enlarge images whose side is below N too")
    g.add_argument("--resize", choices=["center-crop", "stretch", "pad", "none"], default=d["resize"],
                   help=f"how a source becomes the target size (default {ds})")
    g.add_argument("--channels", type=int, choices=[1, 3], default=d["channels"],
                   help=f"output channels (default {ds})")
    g.add_argument("--layout", choices=["hwc", "chw"], default=d["layout"], help=f"record layout (default {ds})")
    g.add_argument("--bgr", **on, help="store BGR instead of RGB")
    g.add_argument("--interp-up", choices=["linear", "cubic"], default=d["interp_up"],
                   help=f"kernel when enlarging (shrinking uses area; default {ds})")
    g.add_argument("--pad-value", type=int, default=d["pad_value"],
                   help=f"letterbox fill for --resize pad (default {ds})")
    g.add_argument("--fast-decode", **on,
                   help="let libjpeg decode at 1/2..1/8 scale when the target is small (faster, approximate)")
    g.add_argument("--max-pixels", type=int, default=d["max_pixels"],
                   help=f"reject sources with more pixels (default {ds}; 0: no limit)")
    if append:
        g.add_argument("--no-strict-jpeg", dest="strict_jpeg", action="store_const", const=False, default=None,
                       help="accept JPEGs whose scan data is corrupt")
    else:
        g.add_argument("--no-strict-jpeg", dest="strict_jpeg", action="store_false",
                       help="accept JPEGs whose scan data is corrupt")
    g.add_argument("--alpha", choices=["black", "white", "drop"], default=d["alpha"],
                   help="transparent images (RGBA, gray+alpha, palette with transparency): composite over black "
                   f"or white, or drop the alpha channel as PIL's convert('RGB') does (default {ds})")
    g.add_argument("--codec", action="append", default=None if append else RUN_DEFAULTS["codecs"],
                   metavar="FIELD=CODEC[:PARAM]",
                   help="store FIELD encoded (repeatable): image=jpeg:90 (lossy, ~7-10x smaller), image=png:1 "
                   "(lossless), FIELD=zstd:3 (lossless, any array), FIELD=raw (default)")
    g.add_argument("--backend", choices=SUPPORTED_BACKENDS, default=None if append else RUN_DEFAULTS["backend"],
                   help=f"store backend (default {ds})")


def _source_flags(p: argparse.ArgumentParser, append: bool) -> None:
    s = p.add_argument_group("source (as mmstore ingest)" if append else "source")
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
                   help=_refused(append, "classes_from", "folder or list of class names: label the classes with the "
                                 "class -> id mapping of an existing store (e.g. the training store), so both stores "
                                 "agree"))
    s.add_argument("--label-names", metavar="FILE",
                   help=_refused(append, "label_names", "folder or list of class names: label the classes by a "
                                 "mapping file, one class name per line (line k, from 0, is label k)"))
    s.add_argument("--new-classes", choices=["error", "append"], default=None,
                   help=_refused(append, "new_classes", "with --classes-from/--label-names: a class not in the "
                                 "mapping is an error (default) or gets the next ids after the mapping's (append)"))
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


def _run_flags(p: argparse.ArgumentParser, append: bool) -> None:
    rd = RUN_DEFAULTS
    r = p.add_argument_group("run")
    if append:
        r.add_argument("--duplicate-keys", choices=["error", "keep"], default="error",
                       help="a new record whose key the store has: refuse the append (error, default) or keep it")
    r.add_argument("--workers", type=int, default=rd["workers"],
                   help="decoder processes (default: CPU cores; 0: none)")
    r.add_argument("--on-error", choices=["skip", "fail"], default=rd["on_error"],
                   help="skip: a bad input becomes a hole; fail: stop at the first (default %(default)s)")
    r.add_argument("--max-errors", metavar="N|P%", default=rd["max_errors"],
                   help="stop once more than N (or P%%) inputs failed")
    r.add_argument("--resume", action="store_true",
                   help=_refused(append, "resume", "continue DEST.partial left by an interrupted run"))
    r.add_argument("--overwrite", action="store_true",
                   help=_refused(append, "overwrite", "replace DEST if it is an mmstore store (and discard our "
                                 "DEST.partial); anything else, or a DEST that is, contains or lies inside SOURCE, "
                                 "is refused"))
    r.add_argument("--shard", metavar="K/N|auto", default=rd["shard"],
                   help=_refused(append, "shard", "ingest only part K (from 0) of N; join parts with mmstore merge. "
                                 "auto: from the launcher, RANK/WORLD_SIZE (torchrun) or "
                                 "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (offset by SLURM_ARRAY_TASK_MIN)"))
    r.add_argument("--chunk", type=int, default=rd["chunk"], help=argparse.SUPPRESS)
    r.add_argument("--log-interval", type=float, default=rd["progress_interval"], help=argparse.SUPPRESS)
    r.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
