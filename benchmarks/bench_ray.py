#!/usr/bin/env python
"""Benchmark of ingest through Ray Data (``mmstore.ray.write``) against ``mmstore ingest`` with
as many workers, on the same real photographs, in one run.

Usage::

    .venv/bin/python benchmarks/bench_ray.py                 # 2,000 photos, 3 rounds
    .venv/bin/python benchmarks/bench_ray.py --quick         # 300 photos, 2 rounds
    .venv/bin/python benchmarks/bench_ray.py --n 2000 --rounds 3 --out docs/benchmarks/data/ray.json

The photos: JPEG files (quality 90, 300 to 640 pixels a side) cut from the sample photographs
of scikit-image and scikit-learn (random crops and flips, ``compact_common.real_photos``), in an
ImageFolder of 4 classes. Every side decodes them to 224x224 with the defaults:

- baseline: ``mmstore.ingest(folder, dest, size=(224, 224), workers=2)``, what
  ``mmstore ingest --workers 2`` runs;
- Ray, rows of paths (the guide's way for a folder on a file system): ``from_items`` of the
  files' paths and labels, then ``mmstore.ray.write(ds, dest, size=(224, 224), image="path",
  root=folder)``: each write task reads and decodes its files;
- Ray, bytes (the guide's way for a folder in object storage): ``read_binary_files(folder,
  include_paths=True)``, a ``map`` adding the label, then ``write(..., image="bytes")``: Ray's
  read tasks read the files, the write tasks decode the bytes;
- Ray, rows of paths through Ray Data's own write operator: ``from_items(rows).write_datasink(
  mmstore.ray.MmstoreDatasink(dest, (224, 224), image="path", root=folder))`` with
  ``preserve_order`` (the streaming executor runs one task until it knows the cluster's CPUs);
- beside them, a tuned variant: rows of paths with ``ray_remote_args={"num_cpus": 2}`` (write
  tasks of 2 CPUs, each decoding on 2 threads), timed in a second phase, alternating with the
  ingest again (a job of 2-CPU tasks makes Ray start new 1-CPU workers for the job after it).

Ray is a local cluster of 2 CPUs (``ray.init(num_cpus=2)`` and a first job of each kind on 4
photos, in which Ray's workers import mmstore: started once, its time reported apart); Ray's
and mmstore's defaults otherwise. The sides alternate (ABCABC...), each timed from the call
to its return (the store published); the figure is the ratio of the medians (ingest seconds
/ Ray seconds; above 1, Ray is faster; target >= 0.8). Beside it, each side's fixed cost of
one job, measured in the same rounds as the time of the same job on 4 photos (for Ray:
starting the job, the commit), and the ratio with those costs taken off.

Each Ray store is checked to equal the ingest's (checksums and keys).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make_photos(root: str, n: int, seed: int = 0) -> list[str]:
    import cv2
    from compact_common import random_square, real_photos

    photos = real_photos()
    rng = np.random.default_rng(seed)
    classes = [f"class{k}" for k in range(4)]
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
    for i in range(n):
        crop = random_square(photos[i % len(photos)][1], rng, 0.4)
        side = int(rng.integers(300, 641))
        out = cv2.resize(crop, (side, int(side * rng.uniform(0.75, 1.0))),
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

    n = args.n
    work = tempfile.mkdtemp(prefix="bench-ray-")
    try:
        small = os.path.join(work, "photos")
        t = time.monotonic()
        classes = make_photos(small, n)
        tiny = os.path.join(work, "four")  # a photo of each class (hard links): the fixed cost of a job
        for c in classes:
            os.makedirs(os.path.join(tiny, c))
            name = sorted(os.listdir(os.path.join(small, c)))[0]
            os.link(os.path.join(small, c, name), os.path.join(tiny, c, name))
        photo_bytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(small) for f in fs)
        print(f"{n} photos, {photo_bytes / 1e6:.1f} MB, made in {time.monotonic() - t:.1f} s", flush=True)
        t = time.monotonic()
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                 log_to_driver=False)
        ray_start = time.monotonic() - t
        ray.data.DataContext.get_current().enable_progress_bars = False
        print(f"ray.init: {ray_start:.2f} s", flush=True)

        def label(p: str) -> int:
            return classes.index(os.path.basename(os.path.dirname(p)))

        def run_ingest(folder: str) -> float:
            t0 = time.monotonic()
            mmstore.ingest(folder, os.path.join(work, "ingest.store"), size=(224, 224), workers=2, quiet=True,
                           overwrite=True)
            return time.monotonic() - t0

        parts: dict[str, int] = {}

        def run_paths(folder: str, side: str = "paths", **kw: Any) -> float:
            t0 = time.monotonic()
            rows = [{"path": os.path.join(folder, c, f), "label": k}
                    for k, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(folder, c)))]
            res = mmstore.ray.write(ray.data.from_items(rows), os.path.join(work, f"{side}.store"), (224, 224),
                                    image="path", root=folder, label_names=classes, quiet=True, overwrite=True, **kw)
            parts[side] = res.parts
            return time.monotonic() - t0

        # the tuned variant: write tasks of 2 CPUs, 2 decode threads each
        run_wide = functools.partial(run_paths, side="wide", ray_remote_args={"num_cpus": 2})

        def run_sink(folder: str) -> float:  # the same rows through Ray Data's own write operator
            t0 = time.monotonic()
            rows = [{"path": os.path.join(folder, c, f), "label": k}
                    for k, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(folder, c)))]
            sink = mmstore.ray.MmstoreDatasink(os.path.join(work, "sink.store"), (224, 224), image="path",
                                               root=folder, label_names=classes, overwrite=True)
            opts = ray.data.DataContext.get_current().execution_options
            before, opts.preserve_order = opts.preserve_order, True  # the row order
            try:
                ray.data.from_items(rows).write_datasink(sink)
            finally:
                opts.preserve_order = before
            assert sink.result is not None
            parts["sink"] = sink.result.parts
            return time.monotonic() - t0

        def run_bytes(folder: str) -> float:
            t0 = time.monotonic()
            ds = ray.data.read_binary_files(folder, include_paths=True)
            ds = ds.map(lambda r: {**r, "label": label(r["path"])})
            res = mmstore.ray.write(ds, os.path.join(work, "bytes.store"), (224, 224), image="bytes", root=folder,
                                    label_names=classes, quiet=True, overwrite=True)
            parts["bytes"] = res.parts
            return time.monotonic() - t0

        # two phases, each alternating with the ingest: the defaults, then the tuned variant (a job of 2-CPU
        # tasks makes Ray start new 1-CPU workers for the next job, which would charge the defaults for it)
        phases = [{"ingest0": run_ingest, "paths": run_paths, "bytes": run_bytes, "sink": run_sink},
                  {"ingest1": run_ingest, "wide": run_wide}]
        times: dict[str, list[float]] = {}
        fixed: dict[str, list[float]] = {}
        warm = 0.0
        for sides in phases:
            t = time.monotonic()
            for k, fn in sides.items():
                if not k.startswith("ingest"):  # Ray's workers import mmstore and OpenCV: part of starting Ray
                    fn(tiny)
            warm += time.monotonic() - t
            for r in range(args.rounds):
                for k, fn in sides.items():
                    fixed.setdefault(k, []).append(fn(tiny))
                    times.setdefault(k, []).append(fn(small))  # last: the stores compared are of the N photos
                print(f"round {r + 1}: " + "; ".join(f"{k} {times[k][-1]:.2f} s (4 photos: {fixed[k][-1]:.2f} s)"
                                                     for k in sides), flush=True)
        same = {}
        a = mmstore.open(os.path.join(work, "ingest.store"))
        for k in ("paths", "bytes", "sink", "wide"):
            b = mmstore.open(os.path.join(work, f"{k}.store"))
            same[k] = (len(a) == len(b) and np.array_equal(a.slot_view.checksums(), b.slot_view.checksums())
                       and all(a.key(i) == b.key(i) for i in range(len(a))))
            b.close()
        a.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        fix = {k: statistics.median(v) for k, v in fixed.items()}
        load = os.getloadavg()
        rows = []
        names = {"paths": "Ray, rows of paths", "bytes": "Ray, read_binary_files",
                 "sink": "rows of paths through write_datasink(MmstoreDatasink)",
                 "wide": "tuned: rows of paths, num_cpus=2 per write task"}
        for k in ("paths", "bytes", "sink", "wide"):
            base = "ingest1" if k == "wide" else "ingest0"  # the ingest of the same phase
            ratio = med[base] / med[k]
            apart = (med[base] - fix[base]) / max(1e-9, med[k] - fix[k])
            print(f"{names[k]}: {med[k]:.2f} s against ingest {med[base]:.2f} s: {ratio:.2f} (target >= 0.8); "
                  f"fixed cost of a job {fix[k]:.2f} s against {fix[base]:.2f} s, apart: {apart:.2f}; "
                  f"stores equal: {same[k]}; parts {parts[k]}", flush=True)
            rows.append([f"{names[k]}, {n:,} photos", f"{med[k]:.2f} s ({n / med[k]:,.0f} photos/s)",
                         f"{med[base]:.2f} s ({n / med[base]:,.0f} photos/s)", f"{ratio:.2f}", ">= 0.8",
                         "yes" if ratio >= 0.8 else "NO"])
            rows.append([f"{names[k]}, fixed cost of a job (4 photos)", f"{fix[k]:.2f} s", f"{fix[base]:.2f} s",
                         "", "", ""])
            rows.append([f"{names[k]}, the fixed costs taken off", f"{med[k] - fix[k]:.2f} s",
                         f"{med[base] - fix[base]:.2f} s", f"{apart:.2f}", "", ""])
        rows.append(["ray.init (apart, once)", f"{ray_start:.2f} s", "", "", "", ""])
        rows.append(["a first job of each kind on 4 photos (apart, once: the workers' imports)", f"{warm:.2f} s",
                     "", "", "", ""])
        cmd = "python benchmarks/bench_ray.py" + ("" if n == 2000 else f" --n {n}") + \
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
                "text": (f"{n:,} JPEG photographs ({photo_bytes / 1e6:.0f} MB, 300 to 640 pixels a side, cut "
                         "from the sample photographs of scikit-image and scikit-learn) decoded to 224x224, "
                         f"{args.rounds} alternating rounds, medians. Ray: a local cluster of 2 CPUs at its "
                         f"defaults, mmstore.ray.write at its defaults ({parts['paths']} parts: parts of up to "
                         "1,000 rows, the rows left at the end split evenly); "
                         "starting Ray (ray.init, then a first job of each kind on 4 photos) took "
                         f"{ray_start + warm:.1f} s, "
                         "not counted. Ray's stores equal "
                         f"the ingest's (checksums and keys): rows of paths {'yes' if same['paths'] else 'NO'}, "
                         f"bytes {'yes' if same['bytes'] else 'NO'}, Datasink {'yes' if same['sink'] else 'NO'}, "
                         f"tuned {'yes' if same['wide'] else 'NO'}. "
                         "The tuned "
                         "variant asks Ray for 2 CPUs per write task (ray_remote_args={'num_cpus': 2}), which "
                         "then decodes on 2 threads."),
                "table": {"columns": ["figure", "Ray", "mmstore ingest --workers 2", "ratio", "target", "met"],
                          "rows": rows},
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
