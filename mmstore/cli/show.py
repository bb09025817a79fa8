"""``mmstore show STORE -o grid.png``: look at some records."""

from __future__ import annotations

import argparse

from ..check.common import UsageError
from ..errors import MmstoreError
from ..format.names import printable
from ._common import add_common, emit_json, subparser, usage_error

EXAMPLE = """examples:
  mmstore show /data/landmarks.store -o grid.png                 # 16 random records
  mmstore show STORE -o grid.png -n 64 --seed 3
  mmstore show STORE -o grid.png --indices 0,17,4711 --scale 4
  mmstore show coco.store -o grid.png --no-boxes                  # boxes are drawn unless told not to

exit codes: 0 written, 1 no image field or unreadable records, 2 not a store or bad arguments
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "show", "write a captioned grid image of some records",
        "Write a PNG grid of records (random with --seed, or --indices), each captioned with its "
        "index, label name and source key; other fields are summarised (tag names and captions first). "
        "A 'boxes' field (x0, y0, x1, y1 in stored pixels) is drawn on the tiles, named by the 'category' "
        "field's class names. Works for 1- and 3-channel images in HWC or CHW layout.",
        EXAMPLE,
    )
    add_common(p)
    p.add_argument("-o", "--output", required=True, help="the image to write (.png)")
    p.add_argument("-n", type=int, default=16, help="records to show (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice (default 0)")
    p.add_argument("--indices", help="comma-separated dataset indices (instead of random)")
    p.add_argument("--cols", type=int, default=None, help="tiles per row (default: square grid)")
    p.add_argument("--scale", type=int, default=None, help="enlarge tiles by this integer factor (default: auto)")
    p.add_argument("--image-field", help="the image field (default: detected)")
    p.add_argument("--label-field", help="the label field (default: detected)")
    p.add_argument("--no-boxes", action="store_true",
                   help="do not draw a 'boxes' field (xyxy, stored pixels) and its 'category' names on the tiles")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.show import show_store

    indices = None
    if args.indices:
        try:
            indices = [int(x) for x in args.indices.replace(" ", "").split(",") if x]
        except ValueError:
            return usage_error("show", f"--indices must be comma-separated integers, got {args.indices!r}")
    if args.n < 1 or (args.scale is not None and args.scale < 1) or (args.cols is not None and args.cols < 1):
        return usage_error("show", "-n, --scale and --cols must be >= 1")
    try:
        rep = show_store(args.store, args.output, n=args.n, seed=args.seed, indices=indices, cols=args.cols,
                         scale=args.scale, image_field=args.image_field, label_field=args.label_field,
                         boxes=not args.no_boxes)
    except (IndexError, UsageError) as exc:
        return usage_error("show", str(exc))
    except KeyError as exc:  # a field the store does not have
        return usage_error("show", str(exc.args[0]) if exc.args else repr(exc))
    except ValueError as exc:
        if isinstance(exc, MmstoreError):  # a damaged store ...: cli.main maps it by its type
            raise
        return usage_error("show", str(exc))  # the store has nothing this can draw
    if args.json:
        emit_json(rep)
    else:
        print(f"wrote      {rep.output}: {rep.width}x{rep.height}, {len(rep.tiles)} records of field "
              f"{rep.image_field!r} ({rep.layout}, {rep.channels} channel(s), x{rep.scale})")
        for t in rep.tiles[:64]:
            name = f" ({printable(t.label_name)})" if t.label_name else ""
            lab = "" if t.label is None else f" label {t.label}{name}"
            drawn = f"  {len(t.boxes)} box(es)" if t.boxes else ""
            print(f"  #{t.index:<8} slot {t.slot:<8}{lab}  {printable(t.key)}{drawn}")
    return 0
