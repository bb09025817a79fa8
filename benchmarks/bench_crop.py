#!/usr/bin/env python3
"""Train-time crops measured: the Loader with ``crop=RandomResizedCrop(224)`` against a bare loop, as ratios in one run.

    python benchmarks/bench_crop.py [--dir /var/tmp/bench_crop] [--photos 1000] [--batch 128] [--rounds 3]
                                    [--json OUT]

Images: variants of the real photograph ``grace_hopper.jpg`` (matplotlib's sample data, 512 x 600): a
random crop of 40-100% of each side, a random flip, resized so that the long side is 300-1,000 px, plus
Gaussian noise of sigma 2 (the sensor noise that keeps the JPEG's entropy near a photograph's), saved as
JPEG q95 files. From these folders, stores of images of their own shape (``max_side``): jpeg:90 at long
side 256 and 512, raw at 256.

1. jpeg: ``Loader(store, batch, crop=RandomResizedCrop(224), fields=["image", "label"])`` with default
   settings, one warm-up epoch then samples/s per epoch, against a bare loop on the same number of
   threads (the usable cores): the store's entries in RAM as bytes, each decoded whole by the same
   decoder (the field's codec), the same crop box (``crop_box``), one ``cv2.resize`` into a batch
   array. Target: ratio >= 1.0.
2. raw: the same Loader over the raw store against a bare loop over the decoded images in RAM (a list
   of arrays): box, crop, ``cv2.resize`` into a batch array. Target: ratio >= 0.8.

Rounds alternate the cases so that a busy moment of a shared machine hits all of them; the figure of
a case is the median of its epochs. Prints a table and one JSON object (also written to --json).
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore
from mmstore import _os
from mmstore.engine.crop import RandomResizedCrop, crop_box, resize_into


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_photos(folder: str, n: int, seed: int) -> None:
    import cv2
    import matplotlib.cbook as cbook

    photo = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "a"), exist_ok=True)
    H, W = photo.shape[:2]
    for k in range(n):
        h, w = int(H * rng.uniform(0.4, 1.0)), int(W * rng.uniform(0.4, 1.0))
        y, x = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
        img = photo[y : y + h, x : x + w]
        if rng.random() < 0.5:
            img = img[:, ::-1]
        side = int(rng.integers(300, 1001))
        s = side / max(h, w)
        img = cv2.resize(np.ascontiguousarray(img), (max(1, round(w * s)), max(1, round(h * s))),
                         interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR)
        img = np.clip(img + rng.normal(0, 2, img.shape), 0, 255).astype(np.uint8)
        cv2.imwrite(os.path.join(folder, "a", f"{k:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])


def loader_epochs(path: str, batch: int, crop: Any, epochs: int, loader: Any = None) -> tuple[Any, list[float]]:
    from mmstore.torch import Loader

    if loader is None:
        loader = Loader(path, batch, crop=crop, fields=["image", "label"])
        for _ in loader:  # warm-up epoch
            pass
    rates = []
    for _ in range(epochs):
        t = time.perf_counter()
        n = sum(len(b["label"]) for b in loader)
        rates.append(n / (time.perf_counter() - t))
    return loader, rates


class Bare:
    """The bare loop: ``threads`` threads, each a contiguous share of a batch, out of RAM."""

    def __init__(self, path: str, batch: int, crop: RandomResizedCrop, threads: int) -> None:
        s = mmstore.open(path)
        self.field = s.schema["image"]
        self.hw = s.column("image_hw").astype(np.int64)
        self.n = len(s)
        self.raw = self.field.codec.raw
        if self.raw:
            self.imgs = [s[i]["image"] for i in range(self.n)]
        else:
            flat, sizes = s.slot_view.backend.gather_entries("image", np.arange(s.slots))
            starts = np.concatenate([[0], np.cumsum(sizes)])
            self.entries = [flat[starts[i] : starts[i + 1]].tobytes() for i in range(self.n)]
        s.close()
        self.batch, self.crop, self.threads = batch, crop, threads
        self.pool = ThreadPoolExecutor(threads)
        self.out = np.empty((batch, *crop.size, 3), np.uint8)
        self.epoch = 0

    def _piece(self, recs: np.ndarray, out: np.ndarray) -> None:
        for j, r in enumerate(recs.tolist()):
            h, w = self.hw[r]
            t, le, ch, cw, fl = crop_box(self.crop, int(h), int(w), 0, self.epoch, r)
            if self.raw:
                img = self.imgs[r]
            else:
                img = np.empty((h, w, 3), np.uint8)
                self.field.codec.decode_into(self.entries[r], img)
            resize_into(img[t : t + ch, le : le + cw], out[j], fl)

    def epochs(self, k: int) -> list[float]:
        rates = []
        for _ in range(k):
            self.epoch += 1
            order = np.random.default_rng(self.epoch).permutation(self.n)
            t = time.perf_counter()
            for a in range(0, self.n, self.batch):
                recs = order[a : a + self.batch]
                step = -(-len(recs) // self.threads)
                futs = [self.pool.submit(self._piece, recs[i : i + step], self.out[i : i + step])
                        for i in range(0, len(recs), step)]
                for f in futs:
                    f.result()
            rates.append(self.n / (time.perf_counter() - t))
        return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/bench_crop")
    ap.add_argument("--photos", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2, help="epochs per case per round")
    ap.add_argument("--json")
    args = ap.parse_args()
    import cv2
    import simplejpeg
    import torch

    work = args.dir
    folder = os.path.join(work, "photos")
    if not os.path.isdir(folder) or len(os.listdir(os.path.join(folder, "a"))) != args.photos:
        shutil.rmtree(folder, ignore_errors=True)
        say(f"making {args.photos} photo variants in {folder}")
        make_photos(folder, args.photos, 0)
    stores = {"jpeg:90 @256": ("jpeg:90", 256), "jpeg:90 @512": ("jpeg:90", 512), "raw @256": ("raw", 256)}
    paths = {}
    for name, (codec, side) in stores.items():
        p = paths[name] = os.path.join(work, f"{codec.replace(':', '')}_{side}")
        if not os.path.exists(os.path.join(p, "manifest.json")):
            shutil.rmtree(p, ignore_errors=True)
            say(f"ingest {name}")
            mmstore.ingest(folder, p, max_side=side, codecs=None if codec == "raw" else [f"image={codec}"],
                           quiet=True)
    crop = RandomResizedCrop(224)
    threads = _os.usable_cores()
    cases: dict[str, Any] = {}
    loaders: dict[str, Any] = {}
    bares = {name: Bare(p, args.batch, crop, threads) for name, p in paths.items()}
    for name, p in paths.items():
        def run_loader(name: str = name, p: str = p) -> list[float]:
            loaders[name], rates = loader_epochs(p, args.batch, crop, args.epochs, loaders.get(name))
            return rates
        cases[f"loader {name}"] = run_loader
        cases[f"bare {name}"] = lambda name=name: bares[name].epochs(args.epochs)
    out: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for k, fn in cases.items():
            out[k].extend(fn())
        say(f"round {r + 1}/{args.rounds} done")
    med = {k: statistics.median(v) for k, v in out.items()}
    rows = []
    for name in paths:
        a, b = med[f"loader {name}"], med[f"bare {name}"]
        target = 0.8 if name.startswith("raw") else 1.0
        rows.append({"store": name, "loader_samples_s": round(a), "bare_samples_s": round(b),
                     "ratio": round(a / b, 3), "target": target})
    info = {"python": platform.python_version(), "cores": threads, "cpus": os.cpu_count(), "opencv": cv2.__version__,
            "simplejpeg": simplejpeg.__version__, "torch": torch.__version__, "batch": args.batch,
            "photos": args.photos, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "describe": {n: (ld.describe()["crop"] or {}).get("path") for n, ld in loaders.items()}}
    print(f"{'store':<14} {'Loader/s':>9} {'bare/s':>9} {'ratio':>6} {'target':>6}")
    for row in rows:
        print(f"{row['store']:<14} {row['loader_samples_s']:>9} {row['bare_samples_s']:>9} {row['ratio']:>6} "
              f"{row['target']:>6}")
    res = {"machine": info, "rows": rows, "rates": out}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
