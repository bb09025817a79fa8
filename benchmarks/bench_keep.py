#!/usr/bin/env python
"""Benchmark: what the kept-batch check costs a loop that drops each batch.

Usage::

    python benchmarks/bench_keep.py                      # 2,000 records of 224x224x3, batch 128
    python benchmarks/bench_keep.py --shape 32x32x3 --records 20000 --batch 64   # many small batches
    python benchmarks/bench_keep.py --workdir /var/tmp/mmbench_keep --keep

The ``Loader`` checks, before refilling a ring buffer, whether a batch of it
is still referenced (NOTE [kept batches] in ``mmstore/torch/_ring.py``) and
keeps one more buffer for the loop variable. This runs the common loop
(``for batch in loader: touch(batch)``, nothing kept) over warm epochs with
the check (the default) and without it (``Loader._check_kept = False``: the
ring of before, where a kept batch was overwritten), alternating the two in
one process so that the machine's noise hits both alike, and prints the
samples/s of each, the ratio (checked / unchecked; target: >= 0.95) and
``fresh_buffers`` (0 expected: nothing allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning


def make_store(path: str, n: int, shape: tuple[int, ...]) -> None:
    if os.path.exists(os.path.join(path, "manifest.json")):
        return
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(path, {"image": ("|u1", shape), "label": ("<i8", ())}, slots=n, overwrite=True) as w:
        for i in range(n):
            w.write(i, {"image": rng.integers(0, 256, shape, dtype=np.uint8), "label": i % 1000}, key=f"{i:06d}")


def epoch_rate(loader: Loader) -> float:
    """Samples/s of one epoch of the drop-each-batch loop."""
    n = 0
    t0 = time.perf_counter()
    for batch in loader:
        n += int(batch["label"].shape[0])
        batch["image"][0, 0, 0, 0].item()  # touch it, keep nothing
    return n / (time.perf_counter() - t0)


def med_or(out: dict[str, Any], name: str) -> float:
    return float(out["median_samples_per_s"][name])


def claim_cost(loader: Loader, n: int = 20000) -> float:
    """Microseconds of the check itself (``Ring.claim`` of a free buffer: the
    storage reference counts of its fields), measured alone."""
    ring = loader._res.ring
    t0 = time.perf_counter()
    for i in range(n):
        ring.claim(i % len(ring))
    return 1e6 * (time.perf_counter() - t0) / n


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = tuple(int(x) for x in args.shape.split("x"))
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"keep_{args.records}_{args.shape}")
    make_store(path, args.records, shape)
    mmstore.open(path).warm()
    loaders = {}
    for name, check in (("checked", True), ("unchecked", False)):
        Loader._check_kept = check
        loaders[name] = Loader(
            path, args.batch, OrderSpec("permutation", seed=0), tuning=LoaderTuning(threads=args.threads)
        )
    Loader._check_kept = True
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    for _name, L in loaders.items():  # one warm-up epoch each
        epoch_rate(L)
    for r in range(args.rounds):
        for name in (("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")):
            rates[name].append(epoch_rate(loaders[name]))
    out = {
        "records": args.records, "shape": shape, "batch": args.batch, "rounds": args.rounds, "threads": args.threads,
        "ring_size": {k: L.ring_size for k, L in loaders.items()},
        "fresh_buffers": {k: L.fresh_buffers for k, L in loaders.items()},
        "median_samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "rates": rates,
    }
    # paired ratios: round r of each, adjacent in time
    ratios = [c / u for c, u in zip(rates["checked"], rates["unchecked"])]
    out["ratio_median"] = statistics.median(ratios)
    out["ratio_of_medians"] = out["median_samples_per_s"]["checked"] / out["median_samples_per_s"]["unchecked"]
    out["claim_us"] = claim_cost(loaders["checked"])
    out["batch_us_checked"] = 1e6 * args.batch / med_or(out, "checked")
    for L in loaders.values():
        L.close()
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--shape", default="224x224x3")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mmbench_keep"))
    ap.add_argument("--keep", action="store_true", help="keep the store for the next run")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    med = res["median_samples_per_s"]
    print(f"{res['records']} records {args.shape}, batch {res['batch']}, {res['rounds']} warm epochs each, "
          f"alternating; ring {res['ring_size']}")
    print(f"  checked (default)  {med['checked']:>10,.0f} samples/s")
    print(f"  unchecked (before) {med['unchecked']:>10,.0f} samples/s")
    print(f"  ratio checked/unchecked: median of paired rounds {res['ratio_median']:.3f}, "
          f"of medians {res['ratio_of_medians']:.3f}; fresh_buffers {res['fresh_buffers']}")
    print(f"  the check alone: {res['claim_us']:.2f} us per batch, against {res['batch_us_checked']:,.0f} us "
          f"per batch ({100 * res['claim_us'] / res['batch_us_checked']:.3f} %)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
