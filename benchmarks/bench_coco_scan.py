#!/usr/bin/env python3
"""The COCO source's scan and per-record work on a COCO-train-sized annotation file.

    python benchmarks/bench_coco_scan.py [--dir /var/tmp/bench_coco] [--images 118000] [--annotations 860000]

Writes (once, kept in ``--dir``) a synthetic instances JSON: ``--images`` image entries
(640x480), ``--annotations`` annotations on random images, each a box and one 12-point polygon,
80 categories. Then, in a fresh child process (so the generator's memory does not count),
``CocoSource.scan()`` is timed: the parent's one parse of the JSON plus the grouping into numpy
arrays. Reported: scan seconds, the child's peak RSS (the parsed JSON's Python objects), its RSS
after the scan (what the workers inherit by fork) and the bytes of the kept arrays; then
``annotation_fields`` (boxes and polygons mapped to a 640x480 letterbox in a 640x640 record,
clipped) per record, averaged over the first 2,000 records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import gc, os, resource, sys, time
from mmstore.ingest.coco import CocoSource
t = time.perf_counter()
s = CocoSource(sys.argv[1], root=os.path.dirname(os.path.abspath(sys.argv[1])))  # an existing folder without the images
s.scan()
dt = time.perf_counter() - t
gc.collect()
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
kept = sum(getattr(s, a).nbytes for a in ("ann_offsets", "ann_id", "ann_cat", "ann_crowd", "ann_box", "ann_npoly",
                                          "poly_size", "points", "poly_offsets", "pt_offsets"))
n = min(2000, len(s.listing))
t = time.perf_counter()
for i in range(n):
    s.annotation_fields(i, ((0, 0, 640, 480), (0, 80, 640, 560)))
per = (time.perf_counter() - t) / n
print(f"scan {dt:.1f} s; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:,.0f} MB; "
      f"RSS after the scan {rss / 1e6:,.0f} MB (arrays {kept / 1e6:,.0f} MB); "
      f"annotation_fields {per * 1e6:.0f} us/record")
"""


def make_json(path: str, n_img: int, n_ann: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    imgs = [{"id": i, "file_name": f"{i:012d}.jpg", "width": 640, "height": 480} for i in range(n_img)]
    img_of = rng.integers(0, n_img, n_ann)
    xy = rng.uniform(0, 400, (n_ann, 2))
    poly = np.round(rng.uniform(0, 400, (n_ann, 24)), 2)
    anns = [{"id": k, "image_id": int(img_of[k]), "category_id": int(k % 80) + 1,
             "bbox": [float(xy[k, 0]), float(xy[k, 1]), 30.5, 20.25], "iscrowd": 0,
             "segmentation": [poly[k].tolist()], "area": 600.0} for k in range(n_ann)]
    cats = [{"id": i, "name": f"c{i}"} for i in range(1, 81)]
    with open(path + ".tmp", "w") as fh:
        json.dump({"images": imgs, "annotations": anns, "categories": cats}, fh)
    os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/bench_coco")
    ap.add_argument("--images", type=int, default=118000)
    ap.add_argument("--annotations", type=int, default=860000)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"instances_{a.images}_{a.annotations}.json")
    if not os.path.exists(path):
        make_json(path, a.images, a.annotations)
    print(f"{path}: {os.path.getsize(path) / 1e6:,.0f} MB, {a.images:,} images, {a.annotations:,} annotations")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", CHILD, path], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
