#!/usr/bin/env python3
"""Merge benchmark: ``mmstore merge`` of ``--shard`` parts, and reading the
merged (segmented) store vs the single store of the same records.

What it does
------------
* Writes ``--records`` records of 224x224x3 uint8 + int64 label (150 KB) as
  ``--parts`` part stores (consecutive slot ranges, a few holes) and as one
  single store of the same records, in ``--dir`` (default: a fresh directory
  on a real disk, never tmpfs; removed at the end unless ``--keep``).
* Merge cost, interleaved over ``--reps`` repetitions: ``merge`` (hard links,
  the default) vs ``merge --copy`` (copy_file_range of every data file) vs
  ``shutil.copyfile`` of the same bytes (what any copying merge costs at
  least). Page cache warm for all three; the extra disk space each leaves is
  measured from ``st_blocks`` of files that are not hard links.
* Reads, warm, interleaved: one fully shuffled epoch of ``read_batch`` in
  batches of ``--batch`` from the merged and from the single store, and one
  ``mmstore.torch.Loader`` epoch (method "pread" and "mmap") of each, when
  torch is installed, and one Loader epoch after evicting the store from
  the page cache ("cold"); and ``verify`` of each. Ratios single time /
  merged time (1.00: the same speed). The store is warmed again after the
  cold contender.

All figures are medians over repetitions; ratios come from the same run only.

    .venv/bin/python benchmarks/bench_merge.py --quick
    .venv/bin/python benchmarks/bench_merge.py --records 8000 --parts 8 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore  # noqa: E402
from mmstore.check.verify import verify_store  # noqa: E402
from mmstore.ingest import merge  # noqa: E402
from mmstore.torch import LoaderTuning

SCHEMA = {"image": ("|u1", (224, 224, 3)), "label": ("<i8", ())}


def _write(path: str, lo: int, hi: int, holes: set[int]) -> None:
    rng = np.random.default_rng(lo)
    base = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    with mmstore.StoreWriter(path, SCHEMA, slots=hi - lo) as w:
        for a in range(lo, hi, 256):
            b = min(hi, a + 256)
            imgs = np.broadcast_to(base, (b - a, 224, 224, 3)).copy()
            imgs[:, 0, 0, 0] = np.arange(a, b) % 256  # every record differs
            imgs[:, 0, 1, 0] = np.arange(a, b) // 256 % 256
            w.write_batch(a - lo, {"image": imgs, "label": np.arange(a, b) % 1000},
                          keys=[f"img/{s:08d}.jpg" for s in range(a, b)])
        for s in sorted(holes):
            if lo <= s < hi:
                w.skip(s - lo, f"img/{s:08d}.jpg", "corrupt: benchmark hole")


def _extra_bytes(store: str) -> int:
    """Disk space of files that are not shared (link count 1)."""
    tot = 0
    for n in os.listdir(store):
        st = os.stat(os.path.join(store, n))
        if st.st_nlink == 1:
            tot += st.st_blocks * 512
    return tot


def _warm(path: str) -> None:
    with mmstore.open(path) as s:
        s.warm(max_fraction=None)


def _epoch_read_batch(path: str, idx: np.ndarray, batch: int) -> float:
    with mmstore.open(path) as s:
        out = {"image": np.empty((batch, 224, 224, 3), np.uint8), "label": np.empty(batch, np.int64)}
        t0 = time.perf_counter()
        for a in range(0, len(idx) - batch + 1, batch):
            s.read_batch(idx[a : a + batch], out=out)
        return time.perf_counter() - t0


def _epoch_loader(path: str, batch: int, method: str, cold: bool = False) -> float:
    from mmstore.torch import Loader

    if cold:  # every data file out of the page cache (the parts' files for a merged store)
        with mmstore.open(path) as s:
            s.evict(sync=True)
    with Loader(path, batch, "permutation", drop_last=True, tuning=LoaderTuning(method=method)) as L:
        t0 = time.perf_counter()
        for _ in L:
            pass
        return time.perf_counter() - t0


def _verify_seconds(path: str) -> float:
    t0 = time.perf_counter()
    verify_store(path)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to write (default: a new dir on a real disk)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--records", type=int, default=8000)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="1,000 records, 4 parts, 2 reps")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.records, args.parts, args.reps = 1000, 4, 2
    root = args.dir or tempfile.mkdtemp(prefix="mmstore-bench-merge-", dir=os.path.expanduser("~"))
    os.makedirs(root, exist_ok=True)
    n, k = args.records, args.parts
    holes = {0, n // k, n - 1}  # at part edges
    try:
        bounds = [i * n // k for i in range(k + 1)]
        parts = []
        for i in range(k):
            p = os.path.join(root, f"part{i}")
            _write(p, bounds[i], bounds[i + 1], holes)
            parts.append(p)
        single = os.path.join(root, "single")
        _write(single, 0, n, holes)
        data_bytes = sum(os.path.getsize(p) for s in parts for p in mmstore.open(s).slot_view.backend.data_paths())
        for p in [*parts, single]:
            _warm(p)
        t: dict[str, list[float]] = {"merge (hard links)": [], "merge --copy": [], "copyfile of the data": []}
        space: dict[str, int] = {}
        for r in range(args.reps):
            for name in list(t)[r % 3 :] + list(t)[: r % 3]:
                dest = os.path.join(root, f"m-{r}-{name.split()[0]}{'-c' if 'copy' in name else ''}")
                t0 = time.perf_counter()
                if name == "merge (hard links)":
                    merge(parts, dest)
                elif name == "merge --copy":
                    merge(parts, dest, copy=True)
                else:
                    os.makedirs(dest)
                    for i, s in enumerate(parts):
                        for p in mmstore.open(s).slot_view.backend.data_paths():
                            shutil.copyfile(p, os.path.join(dest, f"{i}-{os.path.basename(p)}"))
                t[name].append(time.perf_counter() - t0)
                space[name] = _extra_bytes(dest)
                if r < args.reps - 1 or name != "merge (hard links)":
                    shutil.rmtree(dest)
                else:
                    merged = dest
        med = {name: statistics.median(v) for name, v in t.items()}
        # reads
        _warm(merged)
        rng = np.random.default_rng(0)
        nrec = len(mmstore.open(single))
        reads: dict[str, list[float]] = {}
        contenders = [("read_batch", lambda p, idx: _epoch_read_batch(p, idx, args.batch))]
        try:
            import torch  # noqa: F401

            contenders += [(f"Loader {m}", lambda p, idx, m=m: _epoch_loader(p, args.batch, m))
                           for m in ("pread", "mmap")]
            contenders.append(("Loader cold", lambda p, idx: _epoch_loader(p, args.batch, "pread", cold=True)))
        except ImportError:
            pass
        contenders.append(("verify", lambda p, idx: _verify_seconds(p)))
        for r in range(args.reps):
            idx = rng.permutation(nrec)
            for cname, fn in contenders:
                pair = [("merged", merged), ("single", single)]
                if r % 2:
                    pair.reverse()
                for which, p in pair:
                    reads.setdefault(f"{cname} {which}", []).append(fn(p, idx))
                    if cname == "Loader cold":
                        _warm(p)
        rmed = {kk: statistics.median(v) for kk, v in reads.items()}
        res = {
            "machine": f"{platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                       f"numpy {np.__version__}",
            "records": n, "parts": k, "data_bytes": data_bytes, "reps": args.reps,
            "merge_seconds": med, "extra_disk_bytes": space,
            "merge_speedup_vs_copy": med["merge --copy"] / med["merge (hard links)"],
            "read_seconds": rmed,
            "read_ratio_merged_over_single": {c: rmed[f"{c} single"] / rmed[f"{c} merged"] for c, _ in contenders},
        }
        print(f"{n:,} records of 150 KB ({data_bytes / 1e9:.2f} GB of data) in {k} parts; medians of {args.reps}")
        for name, v in med.items():
            print(f"  {name:<22} {v * 1000:9.1f} ms   extra disk space {space[name] / 1e6:10.1f} MB")
        print(f"  merge is {res['merge_speedup_vs_copy']:.0f}x faster than merge --copy")
        print("reads, warm, merged vs single store (throughput ratio, 1.00 = same speed):")
        for c, _ in contenders:
            print(f"  {c:<14} merged {rmed[f'{c} merged'] * 1000:8.1f} ms  single {rmed[f'{c} single'] * 1000:8.1f} ms"
                  f"  ratio {res['read_ratio_merged_over_single'][c]:.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
