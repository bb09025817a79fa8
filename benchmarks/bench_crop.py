#!/usr/bin/env python3
"""Train-time crops measured: the Loader with ``crop=RandomResizedCrop(224)`` against a bare loop, as ratios in one run.

    python benchmarks/bench_crop.py [--dir /var/tmp/bench_crop] [--photos 1000] [--batch 128] [--rounds 3]
                                    [--epochs 2] [--json OUT]

Images: variants of the real photograph ``grace_hopper.jpg`` (matplotlib's sample data, 512 x 600): a
random crop of 40-100% of each side, a random flip, resized so that the long side is 1,024-1,600 px, plus
Gaussian noise of sigma 2 (the sensor noise that keeps the JPEG's entropy near a photograph's), saved as
JPEG q95 files. From these folders, stores of images of their own shape (``max_side``, so every record
has exactly that long side): jpeg:90 at long side 256, 512 and 1,024, raw at 256.

1. jpeg: ``Loader(store, batch, crop=RandomResizedCrop(224), fields=["image", "label"])`` with default
   settings (the DCT-scaled decode, NOTE [DCT-scaled decode] in mmstore/engine/crop.py), the same with
   ``RandomResizedCrop(224, dct_scale=False)`` (every record decoded whole), and a bare loop on the same
   number of threads (the usable cores): the store's entries in RAM as bytes, each decoded whole by the
   same decoder (the field's codec), the same crop boxes (``crop_boxes``, drawn per share of a batch), one
   ``cv2.resize`` into a batch array. Target: Loader / bare >= 1.0; the DCT-scaled decode's own gain is
   the default Loader over the whole-decode one. Beside them, for the first 300 records of epoch 0:
   how many were decoded at 1/2, 1/4, 1/8 and the PSNR of the scaled path's crops against the whole
   decode's.
2. raw: the same Loader over the raw store against a bare loop over the decoded images in RAM (a list
   of arrays): the boxes, crop, ``cv2.resize`` into a batch array. Target: ratio >= 0.8.

Rounds alternate the cases so that a busy moment of a shared machine hits all of them; the figure of
a case is the median of its epochs (the loaders' warm-up epochs before the first round). Beside the
rates, the process's CPU time per sample (all threads) of each case, which a busy machine disturbs
less than the rates. Prints a table and one JSON object (also written to --json).
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
from mmstore.engine.crop import CropReader, RandomResizedCrop, crop_boxes, dct_scale, resize_into


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_photos(folder: str, n: int, seed: int, sides: tuple[int, int] = (300, 1000)) -> None:
    """``n`` JPEG q95 variants of the sample photograph in ``folder/a``, long side ``sides[0]..sides[1]`` px."""
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
        side = int(rng.integers(sides[0], sides[1] + 1))
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
        boxes = crop_boxes(self.crop, self.hw[recs], 0, self.epoch, recs).tolist()
        for j, r in enumerate(recs.tolist()):
            t, le, ch, cw, fl = boxes[j]
            if self.raw:
                img = self.imgs[r]
            else:
                h, w = self.hw[r]
                img = np.empty((h, w, 3), np.uint8)
                self.field.codec.decode_into(self.entries[r], img)
            resize_into(img[t : t + ch, le : le + cw], out[j], bool(fl))

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


def dct_quality(path: str, crop: RandomResizedCrop, n: int = 300) -> dict[str, Any]:
    """Records decoded at each scale, and the PSNR of the scaled path's crops against the whole
    decode's, over the first ``n`` records of epoch 0 (seed 0)."""
    s = mmstore.open(path)
    recs = np.arange(min(n, len(s)))
    whole = RandomResizedCrop(crop.size, crop.scale, crop.ratio, dct_scale=False)
    a = np.empty((len(recs), *crop.size, 3), np.uint8)
    b = np.empty_like(a)
    CropReader(s, "image", crop, 0, 0).read(recs, a)
    CropReader(s, "image", whole, 0, 0).read(recs, b)
    hw = s.column("image_hw")[recs]
    boxes = crop_boxes(crop, hw, 0, 0, recs)
    d = np.array([dct_scale(h, w, bh, bw, *crop.size) for (h, w), (_, _, bh, bw, _) in zip(hw.tolist(),
                                                                                         boxes.tolist())])
    mse = ((a.astype(np.float64) - b) ** 2).reshape(len(recs), -1).mean(1)
    psnr = 10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-12))
    sc = psnr[d > 1]
    return {"records": len(recs), "at_scale": {f"1/{k}": int((d == k).sum()) for k in (1, 2, 4, 8)},
            "psnr_median": round(float(np.median(sc)), 1) if len(sc) else None,
            "psnr_min": round(float(sc.min()), 1) if len(sc) else None}


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
        make_photos(folder, args.photos, 0, sides=(1024, 1600))
    stores = {"jpeg:90 @256": ("jpeg:90", 256), "jpeg:90 @512": ("jpeg:90", 512),
              "jpeg:90 @1024": ("jpeg:90", 1024), "raw @256": ("raw", 256)}
    paths = {}
    for name, (codec, side) in stores.items():
        p = paths[name] = os.path.join(work, f"{codec.replace(':', '')}_{side}")
        if not os.path.exists(os.path.join(p, "manifest.json")):
            shutil.rmtree(p, ignore_errors=True)
            say(f"ingest {name}")
            mmstore.ingest(folder, p, max_side=side, codecs=None if codec == "raw" else [f"image={codec}"],
                           quiet=True)
    crop = RandomResizedCrop(224)
    whole = RandomResizedCrop(224, dct_scale=False)
    threads = _os.usable_cores()
    cases: dict[str, Any] = {}
    loaders: dict[str, Any] = {}
    bares = {name: Bare(p, args.batch, crop, threads) for name, p in paths.items()}
    for name, p in paths.items():
        variants = [("loader", crop)] + ([("loader whole", whole)] if name.startswith("jpeg") else [])
        for kind, c in variants:
            def run_loader(key: str = f"{kind} {name}", p: str = p, c: Any = c) -> list[float]:
                loaders[key], rates = loader_epochs(p, args.batch, c, args.epochs, loaders.get(key))
                return rates
            cases[f"{kind} {name}"] = run_loader
        cases[f"bare {name}"] = lambda name=name: bares[name].epochs(args.epochs)
    out: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}  # process CPU time per sample (all threads), microseconds
    sizes = {name: len(mmstore.open(p)) for name, p in paths.items()}
    for k, fn in cases.items():  # the loaders' warm-up epochs, outside the rounds
        if not k.startswith("bare"):
            fn()
            out[k].clear()
    for r in range(args.rounds):
        for k, fn in cases.items():
            c0 = time.process_time()
            rates = fn()
            out[k].extend(rates)
            n = sizes[k.split(" ", 1)[1].replace("whole ", "")]
            cpu[k].append((time.process_time() - c0) * 1e6 / (len(rates) * n))
        say(f"round {r + 1}/{args.rounds} done")
    med = {k: statistics.median(v) for k, v in out.items()}
    cpu_med = {k: round(statistics.median(v), 1) for k, v in cpu.items()}
    rows = []
    for name in paths:
        a, b = med[f"loader {name}"], med[f"bare {name}"]
        row: dict[str, Any] = {"store": name, "loader_samples_s": round(a), "bare_samples_s": round(b),
                               "ratio": round(a / b, 3), "target": 0.8 if name.startswith("raw") else 1.0,
                               "cpu_us_per_sample": {"loader": cpu_med[f"loader {name}"],
                                                     "bare": cpu_med[f"bare {name}"]}}
        if name.startswith("jpeg"):
            w = med[f"loader whole {name}"]
            row["cpu_us_per_sample"]["loader whole"] = cpu_med[f"loader whole {name}"]
            row.update(whole_decode_samples_s=round(w), whole_decode_ratio=round(w / b, 3),
                       dct_gain=round(a / w, 3), dct=dct_quality(paths[name], crop))
        rows.append(row)
    info = {"python": platform.python_version(), "cores": threads, "cpus": os.cpu_count(), "opencv": cv2.__version__,
            "simplejpeg": simplejpeg.__version__, "torch": torch.__version__, "batch": args.batch,
            "photos": args.photos, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "describe": {n: (ld.describe()["crop"] or {}).get("path") for n, ld in loaders.items()}}
    print(f"{'store':<14} {'Loader/s':>9} {'whole/s':>8} {'bare/s':>8} {'ratio':>6} {'whole':>6} {'DCT gain':>8} "
          f"{'target':>6}  scaled records (1/1 1/2 1/4 1/8), PSNR median / min")
    for row in rows:
        dq = row.get("dct")
        extra = (f"  {' '.join(str(v) for v in dq['at_scale'].values())}, {dq['psnr_median']} / {dq['psnr_min']} dB"
                 if dq else "")
        print(f"{row['store']:<14} {row['loader_samples_s']:>9} {row.get('whole_decode_samples_s', '-'):>8} "
              f"{row['bare_samples_s']:>8} {row['ratio']:>6} {row.get('whole_decode_ratio', '-'):>6} "
              f"{row.get('dct_gain', '-'):>8} {row['target']:>6}{extra}")
    for row in rows:
        per = ", ".join(f"{k} {v}" for k, v in row["cpu_us_per_sample"].items())
        print(f"{row['store']:<14} CPU us per sample: {per}")
    res = {"machine": info, "rows": rows, "rates": out, "cpu_us_per_sample": cpu}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
