"""``mmstore warm STORE`` / ``mmstore evict STORE``: the page cache."""

from __future__ import annotations

import argparse

from ..check.common import fmt_bytes
from ._common import add_common, emit_json, progress_bar, subparser, usage_error

WARM_EXAMPLE = """examples:
  mmstore warm /data/landmarks.store          # before training: epoch 1 runs at epoch-2 speed
  mmstore warm STORE --max-fraction 0.5       # leave more memory to the training process

exit codes: 0 warmed, 1 it did not fit (partly warmed; see the warning), 2 not a store
The same from Python: mmstore.open(path).warm()
"""

EVICT_EXAMPLE = """examples:
  mmstore evict /data/landmarks.store         # measure a cold first epoch
  mmstore evict STORE --sync --json

exit codes: 0 dropped, 1 some pages stayed resident (tmpfs, mapped, dirty), 2 not a store
The same from Python: mmstore.open(path).evict()
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "warm", "pull a whole store into the page cache with one sequential read",
        "Read every file of the store once, sequentially, so the page cache holds it: shuffled "
        "reads then cost a memory copy. Warns and stops when the store does not fit in the "
        "available memory (MemAvailable and the cgroup limit).",
        WARM_EXAMPLE,
    )
    add_common(p)
    p.add_argument("--max-fraction", type=float, default=0.9, metavar="F",
                   help="use at most this fraction of the available memory (default 0.9)")
    p.add_argument("--force", action="store_true", help="no fit check: read everything")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_warm)
    q = subparser(
        sub, "evict", "drop a store from the page cache (POSIX_FADV_DONTNEED)",
        "Ask the kernel to drop the store's pages from the page cache (to measure cold reads, or "
        "to give the memory back).",
        EVICT_EXAMPLE,
    )
    add_common(q)
    q.add_argument("--sync", action="store_true", help="fdatasync first, so recently written pages can be dropped")
    q.set_defaults(func=run_evict)


def run_warm(args: argparse.Namespace) -> int:
    from ..check.cache import warm_store  # lazy: NOTE [lazy commands]

    if not 0 < args.max_fraction <= 1:
        return usage_error("warm", "--max-fraction must be in (0, 1]")
    bar = progress_bar(not args.no_progress and not args.json, "warm")

    def prog(done: int, planned: int) -> None:
        if bar.total is None:
            bar.total = planned
        bar.update(done - getattr(bar, "n", 0) if hasattr(bar, "n") else 0)

    try:
        rep = warm_store(args.store, progress=prog, max_fraction=None if args.force else args.max_fraction)
    finally:
        bar.close()
    if args.json:
        emit_json(rep)
    else:
        print(f"warm       {rep.path}")
        print(f"read       {fmt_bytes(rep.bytes_read)} of {fmt_bytes(rep.bytes_total)} in {rep.seconds:.2f} s "
              f"({rep.mb_per_s:,.0f} MB/s); {fmt_bytes(rep.resident_before)} was already cached")
        if rep.resident_after is not None:
            print(f"resident   {fmt_bytes(rep.resident_after)} of {fmt_bytes(rep.bytes_total)} now in the page cache"
                  f"; available memory {fmt_bytes(rep.available)}")
        for w in rep.warnings:
            print(f"WARNING    {w}")
    return 0 if rep.complete and not rep.warnings else 1


def run_evict(args: argparse.Namespace) -> int:
    from ..check.cache import evict_store  # lazy: NOTE [lazy commands]

    rep = evict_store(args.store, sync=args.sync)
    if args.json:
        emit_json(rep)
    else:
        after = "unknown" if rep.resident_after is None else fmt_bytes(rep.resident_after)
        print(f"evict      {rep.path}: {fmt_bytes(rep.resident_before)} was resident, {after} now")
        for w in rep.warnings:
            print(f"WARNING    {w}")
    return 0 if not rep.warnings else 1
