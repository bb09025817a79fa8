#!/usr/bin/env python
"""Benchmark of a shuffled epoch through Ray Data: ``mmstore.ray.read(order="permutation")``
against Ray's own shuffles of the same records stored as Parquet, side by side in one run on
a local Ray cluster.

Usage::

    .venv/bin/python benchmarks/bench_ray_read.py                  # 100,000 records, 3 rounds
    .venv/bin/python benchmarks/bench_ray_read.py --quick          # 8,000 records, 2 rounds
    .venv/bin/python benchmarks/bench_ray_read.py --n 100000 --out docs/benchmarks/data/ray-read.json

The records: ``image`` (random uint8 pixels of ``--shape``), ``label`` (``idx * 100 // n``:
the store written class by class, 100 classes, the worst case for an order that keeps
neighbours together) and ``idx``, written once as a store (``mmstore.from_dataset``) and once
as Parquet (one file per 2,000 records, the image a Ray tensor column). Each side is one
epoch iterated with ``iter_torch_batches(batch_size=256)`` to the end (every batch's ``idx``
kept, to measure the order):

- mmstore: ``mmstore.ray.read(store, order="permutation", seed=7, epoch=e)`` (a new epoch each round);
- (a) ``ray.data.read_parquet(dir).random_shuffle()`` (a new seed each round);
- (b) ``ray.data.read_parquet(dir)`` with ``iter_torch_batches(local_shuffle_buffer_size=n // 10)``;
- (c) ``ray.data.read_parquet(dir)``, unshuffled.

Ray is a local cluster of ``--cpus`` CPUs (default: the machine's), started once, and a first
epoch of each side is run and not timed (Ray's workers import their modules). The sides
alternate (ABCD ABCD ...); each figure is the median of the rounds' rows per second; the
ratios are mmstore's rate over each other side's. The shuffle quality of each side's epoch
is ``mmstore.order.shuffle_quality`` of the ``idx`` it delivered, in that order (batch 256):
``mean_abs_displacement`` (1/3 for a uniform permutation, 0 unshuffled) and
``same_label_pairs`` (1.0 as mixed as a uniform shuffle; about 100 for the class-sorted
order). Every side is checked to deliver every record exactly once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

BATCH = 256


def _records(n: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    idx = np.arange(n, dtype=np.int64)
    return {"image": rng.integers(0, 256, (n, *shape), dtype=np.uint8), "label": idx * 100 // n, "idx": idx}


def _write_store(path: str, cols: dict[str, np.ndarray]) -> None:
    import mmstore

    class Rows:
        def __len__(self) -> int:
            return len(cols["idx"])

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"image": cols["image"][i], "label": int(cols["label"][i]), "idx": cols["idx"][i]}

    mmstore.from_dataset(Rows(), path, fields={"idx": ("<i8", ())}, workers=0, quiet=True)


def _write_parquet(path: str, cols: dict[str, np.ndarray]) -> None:
    """The records as Parquet files of 2,000 rows, the image a Ray tensor column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    os.makedirs(path)
    n = len(cols["idx"])
    for k, lo in enumerate(range(0, n, 2000)):
        hi = min(n, lo + 2000)
        table = pa.table({"image": ArrowTensorArray.from_numpy(cols["image"][lo:hi]),
                          "label": pa.array(cols["label"][lo:hi]), "idx": pa.array(cols["idx"][lo:hi])})
        pq.write_table(table, os.path.join(path, f"part-{k:05d}.parquet"))


def _epoch(ds: Any, **iter_kw: Any) -> tuple[float, np.ndarray]:
    """Seconds to iterate ``ds`` with ``iter_torch_batches``, and the ``idx`` delivered."""
    seen = []
    t0 = time.perf_counter()
    for batch in ds.iter_torch_batches(batch_size=BATCH, **iter_kw):
        seen.append(batch["idx"].numpy())
    return time.perf_counter() - t0, np.concatenate(seen)


LABELS = {
    "mmstore": "mmstore.ray.read(order='permutation')",
    "random_shuffle": "(a) read_parquet(...).random_shuffle()",
    "local_shuffle_buffer": "(b) read_parquet, local_shuffle_buffer_size = 10 % of rows",
    "unshuffled": "(c) read_parquet, unshuffled",
}
TARGETS = {"random_shuffle": 3.0, "local_shuffle_buffer": 3.0, "unshuffled": 0.8}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} vCPU ({cpu}), {mem:.1f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def _record(args: Any, shape: tuple[int, ...], start_s: float, rate: dict[str, float],
            quality: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run as a benchmark record of the docs (``docs/gen/bench_pages.py``)."""
    import ray

    import mmstore

    rows = []
    for name, label in LABELS.items():
        q = quality[name]
        ratio = rate["mmstore"] / rate[name]
        target = TARGETS.get(name)
        rows.append([label, f"{rate[name]:,.0f}", "" if target is None else f"{ratio:.2f}",
                     "" if target is None else f">= {target}", "" if target is None else
                     ("yes" if ratio >= target else "no"), f"{q['mean_abs_displacement']:.3f}",
                     f"{q['same_label_pairs']:.2f}", f"{q['labels_per_batch']:.1f}"])
    cmd = "python benchmarks/bench_ray_read.py" + "".join(
        f" --{k} {v}" for k, v in (("n", args.n), ("shape", args.shape), ("rounds", args.rounds)))
    return {
        "title": "A shuffled epoch through Ray Data",
        "command": cmd,
        "machine": machine(),
        "versions": {"ray": ray.__version__, "mmstore": mmstore.__version__},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "sections": [{
            "heading": "mmstore.ray.read against Ray's shuffles of the same records in Parquet",
            "text": (f"{args.n:,} records (a {'x'.join(map(str, shape))} uint8 image, a label, an index: "
                     f"{int(np.prod(shape)) + 16:,} bytes), one epoch each iterated with "
                     f"iter_torch_batches(batch_size={BATCH}), {args.rounds} alternating rounds, median rows/s. "
                     f"Ray: a local cluster of {args.cpus} CPUs (started in {start_s:.1f} s, and a first epoch "
                     "of each side, not counted), read_parquet over files of 2,000 rows, at its defaults; "
                     "mmstore.ray.read at its defaults. Ratio: mmstore's rows/s over the side's. Shuffle "
                     "quality of the epoch each side delivered (mmstore.order.shuffle_quality, batches of "
                     f"{BATCH}, the labels 100 classes in stored order): mean displacement (1/3 for a uniform "
                     "permutation, 0 unshuffled) and same-label pairs in a batch over a uniform shuffle's "
                     "(1.0 is as mixed; about 100 for the stored order). Every side delivered every "
                     "record exactly once."),
            "table": {"columns": ["side", "rows/s", "mmstore over it", "target", "met", "displacement",
                                  "same-label pairs", "labels per batch"], "rows": rows},
        }],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100000)
    ap.add_argument("--shape", default="32,32,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--quick", action="store_true", help="8,000 records, 2 rounds")
    ap.add_argument("--out", default=None, help="write the run's record here (docs/benchmarks/data/ray-read.json)")
    args = ap.parse_args()
    if args.quick:
        args.n, args.rounds = 8000, 2
    shape = tuple(int(v) for v in args.shape.split(","))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import mmstore.ray
    from mmstore.order import shuffle_quality

    work = tempfile.mkdtemp(prefix="bench-ray-read-")
    try:
        cols = _records(args.n, shape)
        store = os.path.join(work, "data.store")
        _write_store(store, cols)
        t0 = time.perf_counter()
        ray.init(num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING, log_to_driver=False)
        start_s = time.perf_counter() - t0
        ray.data.DataContext.get_current().enable_progress_bars = False
        parquet = os.path.join(work, "parquet")
        _write_parquet(parquet, cols)
        del cols
        n = args.n
        buffer = n // 10

        def side(name: str, rnd: int) -> tuple[float, np.ndarray]:
            if name == "mmstore":
                return _epoch(mmstore.ray.read(store, order="permutation", seed=7, epoch=rnd))
            ds = ray.data.read_parquet(parquet)
            if name == "random_shuffle":
                return _epoch(ds.random_shuffle(seed=rnd))
            if name == "local_shuffle_buffer":
                return _epoch(ds, local_shuffle_buffer_size=buffer, local_shuffle_seed=rnd)
            return _epoch(ds)

        names = ["mmstore", "random_shuffle", "local_shuffle_buffer", "unshuffled"]
        for name in names:  # warm-up: Ray's workers import their modules
            side(name, 1000)
        times: dict[str, list[float]] = {k: [] for k in names}
        quality: dict[str, dict[str, Any]] = {}
        for rnd in range(args.rounds):
            for name in names:
                secs, seen = side(name, rnd)
                if len(seen) != n or not np.array_equal(np.sort(seen), np.arange(n)):
                    raise SystemExit(f"{name}: the epoch did not deliver every record exactly once")
                times[name].append(secs)
                if rnd == 0:
                    q = shuffle_quality(seen, batch_size=BATCH, n=n)
                    quality[name] = {k: q[k] for k in ("mean_abs_displacement", "same_label_pairs",
                                                       "labels_per_batch")}
                print(f"round {rnd} {name:>22}: {n / secs:>12,.0f} rows/s", file=sys.stderr)
        rate = {k: n / statistics.median(v) for k, v in times.items()}
        record = _record(args, shape, start_s, rate, quality)
        print(json.dumps(record["sections"][0]["table"], indent=1))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
            print(f"wrote {args.out}")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
