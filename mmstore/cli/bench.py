"""``mmstore bench STORE``: read throughput per order, warm and cold."""

from __future__ import annotations

import argparse

from ..check.common import fmt_bytes, table
from ..errors import IncompleteStoreError
from ._common import add_common, emit_json, subparser, usage_error

EXAMPLE = """examples:
  mmstore bench /data/landmarks.store
  mmstore bench STORE --source /data/landmarks-jpegs --plot bench.png
  mmstore bench STORE --samples 1024 --orders permutation,block --paths read_batch --json
  mmstore bench STORE --codecs                      # raw, jpeg:90, jpeg:95, png, zstd side by side
  mmstore bench STORE --codecs raw,jpeg:80 --paths Loader

Cold cases evict the whole store from the page cache first; warm cases read it all in first.
exit codes: 0 measured, 2 not a store or bad arguments
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = subparser(
        sub, "bench", "measure batch read throughput per order, warm and cold",
        "Read the first --samples indices of each order (sequential, full permutation, block "
        "shuffle) in batches through Store.read_batch, StoreDataset + DataLoader and "
        "mmstore.torch.Loader, cold and warm; with --source also decode the same samples from the "
        "source files. Prints samples/s, MB/s and each order's shuffle quality.",
        EXAMPLE,
    )
    add_common(p)
    p.add_argument("--samples", type=int, default=4096, help="samples per case (default 4096)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--orders", default="sequential,permutation,block", help="comma-separated orders")
    p.add_argument("--paths", default=None,
                   help="comma-separated read paths (default read_batch,DataLoader,Loader; none with --codecs)")
    p.add_argument("--codecs", nargs="?", const="raw,jpeg:90,jpeg:95,png,zstd", default=None, metavar="LIST",
                   help="measure these codecs on a sample of the store's records: size, encode and decode time, "
                        "decode rate on all cores, predicted samples/s (default list: raw,jpeg:90,jpeg:95,png,zstd)")
    p.add_argument("--cache", default="cold,warm", help="cold, warm or both (default both)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers / source decode threads")
    p.add_argument("--max-seconds", type=float, default=10.0, help="time limit per case (default 10)")
    p.add_argument("--source", metavar="DIR", help="also decode the same samples from the source files in DIR")
    p.add_argument("--plot", metavar="PNG", help="write a bar chart of samples/s, log scale (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.bench import ORDERS, bench_store, plot_bench

    orders = tuple(x for x in args.orders.split(",") if x)
    if args.paths is None:
        args.paths = "" if args.codecs else "read_batch,DataLoader,Loader"
    paths = tuple(x for x in args.paths.split(",") if x)
    codecs = None
    if args.codecs is not None:
        from ..errors import SchemaError
        from ..format.codecs import parse_codec

        try:
            codecs = tuple(parse_codec(c, where="--codecs").spec for c in args.codecs.split(",") if c.strip())
        except SchemaError as exc:
            return usage_error("bench", str(exc))
        if not codecs:
            return usage_error("bench", "--codecs needs at least one codec, e.g. raw,jpeg:90")
    caches = tuple(x for x in args.cache.split(",") if x)
    if not orders or any(o not in ORDERS for o in orders):
        return usage_error("bench", f"--orders must be among {','.join(ORDERS)}")
    if any(p not in ("read_batch", "DataLoader", "Loader") for p in paths):
        return usage_error("bench", "--paths must be among read_batch,DataLoader,Loader")
    if not caches or any(c not in ("cold", "warm") for c in caches):
        return usage_error("bench", "--cache must be cold, warm or cold,warm")
    if args.samples < 1 or args.batch_size < 1 or args.max_seconds <= 0:
        return usage_error("bench", "--samples, --batch-size and --max-seconds must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return usage_error("bench", "--plot needs matplotlib: pip install matplotlib")
        from ..check.common import check_output

        check_output(args.store, args.plot)  # before the measurement, not after it
    try:
        rep = bench_store(args.store, samples=args.samples, batch_size=args.batch_size, orders=orders,
                          caches=caches, paths=paths, workers=args.workers, max_seconds=args.max_seconds,
                          source=args.source, seed=args.seed, codecs=codecs)
    except FileNotFoundError as exc:
        if isinstance(exc, IncompleteStoreError):
            raise
        return usage_error("bench", str(exc))
    if args.plot:
        rep.plot = plot_bench(rep, args.plot)
    if args.json:
        emit_json(rep)
    else:
        print(render(rep))
    return 0


def render(rep) -> str:  # noqa: ANN001
    out = [f"store      {rep.path} ({rep.backend}, {rep.records:,} records of {fmt_bytes(rep.record_bytes)}); "
           f"{rep.samples:,} samples per case, batches of {rep.batch_size}"]
    if rep.torch:
        out.append(f"torch      {rep.torch}")
    if rep.source:
        out.append(f"source     {rep.source}")
    if rep.cases or rep.codecs is None:  # bench --codecs alone runs no read case
        rows = [[c.path, c.order, c.cache, f"{c.samples:,}", f"{c.samples_per_s:,.0f}", f"{c.mb_per_s:,.1f}", c.note]
                for c in rep.cases]
        out.append(table(rows, header=["path", "order", "cache", "samples", "samples/s", "MB/s", "note"]))
        from ..order.metrics import UNIFORM_DISPLACEMENT

        out.append(f"shuffle quality (displacement: 0 = sequential, {UNIFORM_DISPLACEMENT:.3f} = a uniform shuffle; "
                   "same-label pairs: 1.00 = as mixed as a uniform shuffle, more = clumped; "
                   "labels/batch: seen/uniform; runs = seeks per batch):")
        qrows = []
        for k, q in rep.quality.items():
            desc = rep.orders.get(k, {})
            extra = f" block {desc.get('block')} window {desc.get('window')}" if k == "block" else ""
            qrows.append([k + extra, f"{q['mean_abs_displacement']:.3f}", f"{q['same_label_pairs']:.2f}",
                          f"{q['labels_per_batch']:.1f}/{q['labels_per_batch_uniform']:.1f}",
                          f"{q['runs_per_batch']:.1f}", q["labels"]])
        out.append(table(qrows, header=["order", "displacement", "same-label pairs", "labels/batch", "runs/batch",
                                        "labels"]))
    for n in dict.fromkeys(rep.notes):
        out.append(f"note       {n}")
    if rep.plot:
        out.append(f"plot       {rep.plot}")
    from ..check.codec_advice import render_lines

    out.extend(render_lines(rep.codecs))
    out.append(f"(ran {rep.seconds:.1f} s)")
    return "\n".join(out)
