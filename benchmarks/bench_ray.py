#!/usr/bin/env python
"""Benchmark of ingest through Ray Data (``mmstore.ray.write``) against ``mmstore ingest`` with
as many workers, on the same real photographs, in one run.

Usage::

    .venv/bin/python benchmarks/bench_ray.py                 # 2,000 photos, 3 rounds
    .venv/bin/python benchmarks/bench_ray.py --quick         # 300 photos, 2 rounds
    .venv/bin/python benchmarks/bench_ray.py --n 2000 --rounds 3 --out docs/benchmarks/data/ray.json

The photos: JPEG files (quality 90, 300 to 640 pixels a side) cut from the sample photographs
of scikit-image and scikit-learn (random crops and flips, ``bench_compact.real_photos``), in an
ImageFolder of 4 classes. Both sides decode them to 224x224 with the defaults:

- baseline: ``mmstore.ingest(folder, dest, size=(224, 224), workers=2)``, what
  ``mmstore ingest --workers 2`` runs;
- Ray: a local cluster of 2 CPUs (``ray.init(num_cpus=2)``, started once, its time reported
  apart), ``read_binary_files(folder, include_paths=True)``, a ``map`` adding the class label,
  and ``mmstore.ray.write(ds, dest, size=(224, 224), image="bytes", root=folder)``, Ray's and
  mmstore's defaults otherwise.

The two alternate (ABAB...), each timed from the call to its return (the store published);
the figure is the ratio of the medians (ingest seconds / Ray seconds: above 1, Ray is
faster; target >= 0.8). The Ray store is checked to equal the ingest's (checksums and keys).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make_photos(root: str, n: int, seed: int = 0) -> list[str]:
    import cv2
    from bench_compact import real_photos

    photos = real_photos()
    rng = np.random.default_rng(seed)
    classes = [f"class{k}" for k in range(4)]
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
    for i in range(n):
        img = photos[i % len(photos)][1]
        h, w = img.shape[:2]
        s = int(min(h, w) * rng.uniform(0.4, 1.0))
        y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
        crop = img[y : y + s, x : x + s]
        if rng.integers(2):
            crop = crop[:, ::-1]
        side = int(rng.integers(300, 641))
        out = cv2.resize(np.ascontiguousarray(crop), (side, int(side * rng.uniform(0.75, 1.0))),
                         interpolation=cv2.INTER_AREA)
        cv2.imwrite(os.path.join(root, classes[i % 4], f"{i:05d}.jpg"), out[:, :, ::-1],
                    [cv2.IMWRITE_JPEG_QUALITY, 90])
    return classes


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} vCPU ({cpu}), {mem:.1f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="photos (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--quick", action="store_true", help="300 photos, 2 rounds")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks", "data", "ray.json"))
    args = ap.parse_args()
    if args.quick:
        args.n, args.rounds = 300, 2
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import logging

    import ray

    import mmstore
    import mmstore.ray

    work = tempfile.mkdtemp(prefix="bench-ray-")
    try:
        folder = os.path.join(work, "photos")
        t = time.monotonic()
        classes = make_photos(folder, args.n)
        photo_bytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(folder) for f in fs)
        print(f"{args.n} photos, {photo_bytes / 1e6:.1f} MB, made in {time.monotonic() - t:.1f} s", flush=True)
        t = time.monotonic()
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                 log_to_driver=False)
        ray_start = time.monotonic() - t
        ray.data.DataContext.get_current().enable_progress_bars = False
        print(f"ray.init: {ray_start:.2f} s", flush=True)

        def run_ingest() -> float:
            dest = os.path.join(work, "ingest.store")
            t0 = time.monotonic()
            mmstore.ingest(folder, dest, size=(224, 224), workers=2, quiet=True, overwrite=True)
            return time.monotonic() - t0

        parts = []

        def run_ray() -> float:
            dest = os.path.join(work, "ray.store")
            t0 = time.monotonic()
            ds = ray.data.read_binary_files(folder, include_paths=True)
            ds = ds.map(lambda r: {**r, "label": classes.index(os.path.basename(os.path.dirname(r["path"])))})
            res = mmstore.ray.write(ds, dest, (224, 224), image="bytes", root=folder, label_names=classes,
                                    quiet=True, overwrite=True)
            parts.append(res.parts)
            return time.monotonic() - t0

        ti, tr = [], []
        for r in range(args.rounds):
            ti.append(run_ingest())
            tr.append(run_ray())
            print(f"round {r + 1}: ingest {ti[-1]:.2f} s, ray {tr[-1]:.2f} s", flush=True)
        a, b = mmstore.open(os.path.join(work, "ingest.store")), mmstore.open(os.path.join(work, "ray.store"))
        same = (np.array_equal(a.slot_view.checksums(), b.slot_view.checksums())
                and all(a.key(i) == b.key(i) for i in range(len(a))) and len(a) == len(b))
        a.close()
        b.close()
        mi, mr = statistics.median(ti), statistics.median(tr)
        ratio = mi / mr
        load = os.getloadavg()
        print(f"median ingest {mi:.2f} s, ray {mr:.2f} s: ray/ingest speed {ratio:.2f} (target >= 0.8); "
              f"stores equal: {same}; parts {parts[-1]}; load {load[0]:.1f}", flush=True)
        cmd = "python benchmarks/bench_ray.py" + ("" if args.n == 2000 else f" --n {args.n}") + \
            ("" if args.rounds == 3 else f" --rounds {args.rounds}")
        record = {
            "title": "Ingest on Ray",
            "command": cmd,
            "machine": machine(),
            "versions": {"ray": ray.__version__, "mmstore": mmstore.__version__},
            "date": time.strftime("%Y-%m-%d"),
            "load_average": [round(x, 2) for x in load],
            "sections": [{
                "heading": "mmstore.ray.write against mmstore ingest --workers 2",
                "text": (f"{args.n:,} JPEG photographs ({photo_bytes / 1e6:.0f} MB, 300 to 640 pixels a side, cut "
                         "from the sample photographs of scikit-image and scikit-learn) decoded to 224x224, "
                         f"{args.rounds} alternating rounds, medians. Ray: a local cluster of 2 CPUs, "
                         "read_binary_files + a map adding the label + mmstore.ray.write at the defaults; "
                         f"starting Ray (ray.init) took {ray_start:.1f} s, not counted. Both stores are "
                         f"checked equal (checksums and keys): {'yes' if same else 'NO'}."),
                "table": {"columns": ["figure", "measured", "baseline", "ratio", "target", "met"],
                          "rows": [["ingest through Ray, 2 CPUs", f"{mr:.2f} s ({args.n / mr:,.0f} photos/s)",
                                    f"mmstore ingest --workers 2: {mi:.2f} s ({args.n / mi:,.0f} photos/s)",
                                    f"{ratio:.2f}", ">= 0.8", "yes" if ratio >= 0.8 else "NO"],
                                   ["parts joined", str(parts[-1]), "", "", "", ""],
                                   ["ray.init (apart)", f"{ray_start:.2f} s", "", "", "", ""]]},
            }],
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
