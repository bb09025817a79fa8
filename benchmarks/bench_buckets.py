#!/usr/bin/env python3
"""Same-bucket batches measured: the Loader over a raw bucketed store against the Loader over a
single-shape store of the same bytes, as a ratio in one run.

    python benchmarks/bench_buckets.py [--dir /var/tmp/bench_buckets] [--photos 1500] [--batch 64]
                                       [--rounds 3] [--json OUT]

Images: variants of the real photograph ``grace_hopper.jpg`` (matplotlib's sample data, 512 x 600): a random
crop of 40-100% of each side, a random flip, Gaussian noise of sigma 2 (a photograph's sensor noise), resized
(``INTER_AREA``) to one of four shapes of equal area, 192x256, 256x192, 128x384, 384x128 (49,152 pixels
each), saved as JPEG q95 files and ingested raw with ``buckets=`` those four shapes (every image is already
its bucket's size: nothing is resized or cropped), so ``Loader(store, batch)`` is a ``BucketLoader``. The
single-shape store holds the same records' bytes, each as a 192x256x3 record (``StoreWriter``), read with
``Loader(store, batch)``. Both stores are evicted from the page cache and read back in by one sequential
pass (``mmstore._os.warm``, the Loader's warm pass) before the run, so their pages are cached the same
way (how pages came into the cache changes how fast they copy: NOTE [sequential pages] in
``mmstore/_os/warmup.py``), then a warm-up epoch each; both loaders read ``image`` and ``label`` with
default settings, permutation order.

Rounds alternate the two cases; a case's figure is the median samples/s of its epochs. Target:
ratio >= 0.9. Prints a table and one JSON object (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compact_common as cc  # noqa: E402

import mmstore  # noqa: E402
from mmstore import _os  # noqa: E402

SHAPES = [(192, 256), (256, 192), (128, 384), (384, 128)]


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def build(d: str, n: int) -> tuple[str, str]:
    import cv2

    src, bucketed, single = os.path.join(d, "src"), os.path.join(d, "bucketed.store"), os.path.join(d, "single.store")
    if not os.path.exists(os.path.join(bucketed, "manifest.json")):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(src, "a"))
        from matplotlib import cbook

        photo = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
        rng = np.random.default_rng(0)
        ph, pw = photo.shape[:2]
        for i in range(n):
            ch, cw = int(ph * rng.uniform(0.4, 1.0)), int(pw * rng.uniform(0.4, 1.0))
            y, x = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
            crop = photo[y : y + ch, x : x + cw]
            if rng.integers(2):
                crop = crop[:, ::-1]
            h, w = SHAPES[int(rng.integers(len(SHAPES)))]
            img = cv2.resize(np.ascontiguousarray(crop), (w, h), interpolation=cv2.INTER_AREA).astype(np.float32)
            img = np.clip(img + rng.normal(0, 2, img.shape), 0, 255).astype(np.uint8)
            cv2.imwrite(os.path.join(src, "a", f"{i:06d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        say(f"ingesting {n} photos of {len(SHAPES)} sizes ...")
        mmstore.ingest(src, bucketed, buckets=SHAPES, quiet=True)
        with mmstore.open(bucketed) as s, mmstore.StoreWriter(
                single, {"image": ("|u1", (*SHAPES[0], 3)), "label": ("<i8", ())}) as w:
            for i in range(len(s)):
                w.append({"image": s[i]["image"].reshape(*SHAPES[0], 3), "label": np.int64(s[i]["label"])})
    return bucketed, single


def epoch(loader: Any, n: int) -> float:
    rows = 0
    t0 = time.perf_counter()
    for b in loader:
        rows += b["image"].shape[0]
    dt = time.perf_counter() - t0
    if rows != n:
        raise RuntimeError(f"an epoch read {rows} records of {n}")
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/bench_buckets")
    ap.add_argument("--photos", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    from mmstore.torch import BucketLoader, Loader

    bucketed, single = build(a.dir, a.photos)
    with mmstore.open(bucketed) as s:
        n = len(s)
        sizes = {tuple(int(v) for v in hw): int(c) for hw, c in zip(*np.unique(s.column("image_hw"), axis=0,
                                                                                 return_counts=True))}
    for path in (bucketed, single):  # the same page-cache state for both
        cc.evict_store(path)
        with mmstore.open(path) as s:
            _os.warm(s.slot_view.backend.data_paths())
    lb = Loader(bucketed, a.batch, fields=["image", "label"])
    if not isinstance(lb, BucketLoader):
        raise RuntimeError("the bucketed store's Loader is not a BucketLoader")
    ls = Loader(single, a.batch, fields=["image", "label"])
    epoch(lb, n), epoch(ls, n)  # warm-up: the page cache, the rings
    rates: dict[str, list[float]] = {"buckets": [], "single": []}
    for r in range(a.rounds):
        rates["buckets"].append(epoch(lb, n))
        rates["single"].append(epoch(ls, n))
        say(f"round {r}: buckets {rates['buckets'][-1]:,.0f}/s  single shape {rates['single'][-1]:,.0f}/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {
        "bench": "buckets", "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
        "cpus": os.cpu_count(), "usable_cores": cc.cores(), "python": platform.python_version(),
        "records": n, "batch": a.batch, "bucket_sizes": {f"{h}x{w}": c for (h, w), c in sorted(sizes.items())},
        "batches": {"buckets": len(lb), "single": len(ls)}, "samples_per_s": med, "rates": rates,
        "ratio": med["buckets"] / med["single"], "target": 0.9,
    }
    print(f"{'case':<40}{'samples/s':>12}")
    print(f"{'BucketLoader, raw, ' + str(len(sizes)) + ' sizes':<40}{med['buckets']:>12,.0f}")
    print(f"{'single shape, raw, same bytes':<40}{med['single']:>12,.0f}")
    print(f"ratio {out['ratio']:.2f} (target >= 0.9)")
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    lb.close()
    ls.close()


if __name__ == "__main__":
    main()
