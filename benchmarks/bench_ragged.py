#!/usr/bin/env python3
"""Ragged fields measured: ``read_batch`` with and without a ragged boxes field.

    python benchmarks/bench_ragged.py [--dir /var/tmp/bench_ragged] [--records 2048] [--batch 256]
                                 [--rounds 7] [--backend memmap] [--json OUT]

Two memmap stores of the same ``--records`` records: ``image`` (224x224x3 uint8, random
pixels) and ``label`` (int64), and the same plus ``boxes`` (float32, shape (None, 4), 0-20
boxes per record, uniformly drawn). Each is read warm (every file read once first) with
``read_batch`` of ``--batch`` random indices into reused ``out=`` buffers for the fixed fields
(what the Loader does), one batch after another over a permutation of all records; a round
reads every record once. Rounds alternate between the two stores in one process, and the
figure is the ratio of the medians of the per-round times (with boxes / without), so the
machine's noise hits both sides alike. The target: at most 1.3x.

Loader row (``--loader``, default on): ``mmstore.torch.Loader(store, --batch, order="permutation")``
epochs over each store (image + label vs image + label + boxes, boxes yielded as a list of
tensors; ``--ragged pad`` for padded + lengths), epochs alternating, ratio of the median epoch
times. Item row: ``StoreDataset(store)[i]`` over every record of the boxes store, through
``store[i]`` (the one-record path, what ``__getitem__`` uses when every field is read) vs
``read_batch([i])`` (what it used before), rounds alternating, ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore


def _write(path: str, n: int, boxes: bool, backend: str) -> None:
    schema = {"image": ("|u1", (224, 224, 3)), "label": ("<i8", ())}
    if boxes:
        schema["boxes"] = ("<f4", (None, 4))
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(path, schema, slots=n, backend=backend, overwrite=True) as w:
        for s in range(n):
            rec = {"image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8), "label": np.int64(s % 1000)}
            if boxes:
                rec["boxes"] = rng.random((int(rng.integers(0, 21)), 4), dtype=np.float32) * 224
            w.write(s, rec)


def _round(store: mmstore.Store, order: np.ndarray, batch: int, out: dict[str, np.ndarray]) -> float:
    t = time.perf_counter()
    for a in range(0, len(order) - batch + 1, batch):
        b = store.read_batch(order[a : a + batch], out=out)
        if "boxes" in b:
            assert len(b["boxes"]) == batch
    return time.perf_counter() - t


def _torch_rows(stores: dict[str, mmstore.Store], args: argparse.Namespace) -> dict[str, object]:
    """The Loader row and the StoreDataset item row (module docstring)."""
    import torch  # noqa: F401 - only here: the read_batch row needs numpy alone

    from mmstore.torch import Loader, StoreDataset

    loaders = {k: Loader(s, args.batch, order="permutation", ragged=args.ragged) for k, s in stores.items()}

    def epoch(k: str) -> float:
        t = time.perf_counter()
        for b in loaders[k]:
            got = b["boxes"].lengths if k == "boxes" and args.ragged == "pad" else b.get("boxes", b["label"])
            if len(got) != len(b["label"]):
                raise SystemExit(f"a batch of {len(b['label'])} records gave {len(got)} boxes entries")
        return time.perf_counter() - t

    for k in loaders:  # warm: threads, ring, pages
        epoch(k)
    lt: dict[str, list[float]] = {k: [] for k in loaders}
    for r in range(args.rounds):
        for k in ("plain", "boxes") if r % 2 == 0 else ("boxes", "plain"):
            lt[k].append(epoch(k))
    for ld in loaders.values():
        ld.close()
    nb = -(-args.records // args.batch)
    lmed = {k: statistics.median(v) for k, v in lt.items()}
    out: dict[str, object] = {
        "loader_ms_per_batch": {k: round(1000 * v / nb, 3) for k, v in lmed.items()},
        "loader_ratio_boxes_over_plain": round(lmed["boxes"] / lmed["plain"], 3), "loader_ragged": args.ragged,
    }
    print(f"Loader batch {args.batch} ({args.backend}, permutation, ragged={args.ragged!r}): "
          f"{out['loader_ms_per_batch']['plain']} ms a batch without boxes, "  # type: ignore[index]
          f"{out['loader_ms_per_batch']['boxes']} ms with: ratio {out['loader_ratio_boxes_over_plain']}x "  # type: ignore[index]
          f"(target <= 1.3x; medians of {args.rounds} alternating epochs)")
    ds = StoreDataset(stores["boxes"])
    n = min(len(ds), 1024)

    def items(whole: bool) -> float:
        ds._whole = whole  # the path __getitem__ takes: store[i] (True) or read_batch([i])
        t = time.perf_counter()
        for i in range(n):
            ds[i]
        return (time.perf_counter() - t) / n

    it: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for w in (True, False) if r % 2 == 0 else (False, True):
            it[w].append(items(w))
    imed = {w: statistics.median(v) for w, v in it.items()}
    out["item_us"] = {"store_getitem": round(1e6 * imed[True], 1), "read_batch_one": round(1e6 * imed[False], 1)}
    out["item_speedup"] = round(imed[False] / imed[True], 2)
    print(f"StoreDataset[i] (image + label + boxes, {n} records): {out['item_us']['store_getitem']} us through "  # type: ignore[index]
          f"store[i], {out['item_us']['read_batch_one']} us through read_batch([i]): "  # type: ignore[index]
          f"{out['item_speedup']}x faster")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/bench_ragged")
    ap.add_argument("--records", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="memmap", choices=("memmap", "lmdb"))
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument("--no-loader", action="store_true", help="skip the torch Loader and StoreDataset rows")
    ap.add_argument("--ragged", default="list", choices=("list", "pad"), help="the Loader's ragged= (default list)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    paths = {"plain": os.path.join(args.dir, "plain"), "boxes": os.path.join(args.dir, "boxes")}
    try:
        for k, p in paths.items():
            _write(p, args.records, k == "boxes", args.backend)
        stores = {k: mmstore.open(p) for k, p in paths.items()}
        out = {"image": np.empty((args.batch, 224, 224, 3), np.uint8), "label": np.empty(args.batch, np.int64)}
        rng = np.random.default_rng(1)
        for s in stores.values():  # warm: every file read once
            _round(s, np.arange(len(s)), args.batch, out)
        times: dict[str, list[float]] = {k: [] for k in stores}
        for _ in range(args.rounds):
            order = rng.permutation(args.records)
            for k in ("plain", "boxes") if _ % 2 == 0 else ("boxes", "plain"):
                times[k].append(_round(stores[k], order, args.batch, out))
        batches = args.records // args.batch
        med = {k: statistics.median(v) for k, v in times.items()}
        res = {
            "records": args.records, "batch": args.batch, "rounds": args.rounds, "backend": args.backend,
            "ms_per_batch": {k: round(1000 * v / batches, 3) for k, v in med.items()},
            "boxes_per_record_mean": round(float(stores["boxes"].read_batch(
                np.arange(args.records), fields="boxes")["boxes"].lengths.mean()), 2),
            "ratio_boxes_over_plain": round(med["boxes"] / med["plain"], 3),
            "target": 1.3,
        }
        print(f"read_batch of {args.batch} ({args.backend}, warm, out= for the fixed fields): "
              f"{res['ms_per_batch']['plain']} ms without boxes, {res['ms_per_batch']['boxes']} ms with "
              f"(mean {res['boxes_per_record_mean']} boxes/record): ratio {res['ratio_boxes_over_plain']}x "
              f"(target <= 1.3x; medians of {args.rounds} alternating rounds of {batches} batches)")
        if not args.no_loader:
            res.update(_torch_rows(stores, args))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
    finally:
        if not args.keep:
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
