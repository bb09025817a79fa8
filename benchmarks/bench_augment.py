#!/usr/bin/env python
"""Benchmark of batch augmentation on the CPU.

Usage::

    python benchmarks/bench_augment.py                 # 3,000 records of 224x224x3, batch 256
    python benchmarks/bench_augment.py --quick         # 1,000 records
    python benchmarks/bench_augment.py --out results.json --workdir /var/tmp/mmbench_aug --keep

What it measures, one warm epoch each (the page cache is warmed first), on a
synthetic store of 224x224x3 uint8 images + an int64 label, shuffled:

1. ``Loader`` alone (uint8 NHWC batches).
2. ``Loader`` + ``augment.imagenet_train(224)``: random_resized_crop
   (bilinear, antialias off) + horizontal flip + normalize to float NCHW,
   in the training process on the CPU (torch's intra-op threads).
3. ``DataLoader(num_workers=cores)`` over a per-sample Dataset applying the
   same transforms per image with torch ops, as torchvision's
   ``RandomResizedCrop`` (antialias on, torchvision's default), ``RandomHorizontalFlip``,
   ``ToTensor`` + ``Normalize`` do; batched by ``default_collate``.

Also the time of each batch operation on a batch in memory, and
``resized_crop`` (one ``F.interpolate`` per image into one output batch)
against the whole batch computed as two pairs of gathers (the alternative;
slower on the CPU, so not used).
Rates are samples/s; ratios are printed in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore
from mmstore.order import OrderSpec
from mmstore.torch import Loader
from mmstore.torch import augment as A

H = W = 224
BATCH = 256


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def make_store(path: str, n: int) -> None:
    if os.path.exists(os.path.join(path, "manifest.json")):
        return
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:H, 0:W]
    base = ((xx[..., None] * 3 + yy[..., None] * 5 + np.arange(3) * 40) % 256).astype(np.uint8)
    with mmstore.StoreWriter(path, {"image": ("|u1", (H, W, 3)), "label": ("<i8", ())}, slots=n,
                             overwrite=True) as w:
        for i in range(n):
            noise = rng.integers(0, 32, (H, W, 3), dtype=np.uint8)
            w.write(i, {"image": base + noise, "label": i % 1000}, key=f"{i:06d}")


# ------------------------------------------------------------------------------
# the per-sample reference: torchvision's transforms written with torch ops


def rrc_params_one(height: int, width: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, as written there."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1])).item())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            i = int(torch.randint(0, height - h + 1, size=(1,)).item())
            j = int(torch.randint(0, width - w + 1, size=(1,)).item())
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


MEAN = torch.tensor(A.IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(A.IMAGENET_STD).view(3, 1, 1)


def per_sample_transform(img: np.ndarray, size: int = 224) -> torch.Tensor:
    """RandomResizedCrop(size) + RandomHorizontalFlip() + ToTensor() + Normalize() on one HWC uint8 image."""
    x = torch.from_numpy(img).permute(2, 0, 1)  # CHW uint8 view, like PIL -> tensor
    i, j, h, w = rrc_params_one(x.shape[1], x.shape[2])
    x = x[:, i:i + h, j:j + w].unsqueeze(0)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    if torch.rand(1).item() < 0.5:
        x = x.flip(-1)
    return (x.float().div_(255) - MEAN) / STD


class PerSampleDataset(torch.utils.data.Dataset):
    def __init__(self, path: str) -> None:
        self.path = path
        self.store: Any = None
        self.n = len(mmstore.open(path))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.store is None:
            self.store = mmstore.open(self.path)
        rec = self.store[i]
        return per_sample_transform(np.asarray(rec["image"])), int(rec["label"])


# ------------------------------------------------------------------------------
# measurements


def epoch_rate(make_iter, n: int, consume) -> float:
    t0 = time.perf_counter()
    got = 0
    for b in make_iter():
        got += consume(b)
    dt = time.perf_counter() - t0
    if got != n:
        raise RuntimeError(f"an epoch gave {got} samples, expected {n}")
    return n / dt


def bench_loader(path: str, n: int, pipe: A.Pipeline | None, epochs: int) -> float:
    rates = []
    with Loader(path, BATCH, OrderSpec("permutation", seed=0), fields=("image", "label")) as L:
        for e in range(epochs + 1):  # epoch 0 warms up (page cache, ring, threads)
            L.set_epoch(e)
            if pipe is not None:
                pipe.set_epoch(e)

            def consume(b: dict) -> int:
                if pipe is not None:
                    b = pipe(b)
                    if b["image"].shape[1:] != (3, H, W) or b["image"].dtype != torch.float32:
                        raise RuntimeError(f"unexpected batch {tuple(b['image'].shape)} {b['image'].dtype}")
                return len(b["label"])

            r = epoch_rate(lambda: iter(L), n, consume)
            if e:
                rates.append(r)
    return float(np.median(rates))


def bench_dataloader(path: str, n: int, workers: int, epochs: int) -> float:
    ds = PerSampleDataset(path)
    gen = torch.Generator().manual_seed(0)
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=gen, num_workers=workers,
                                     persistent_workers=True, multiprocessing_context="fork", prefetch_factor=2)

    def consume(b: list) -> int:
        if b[0].shape[1:] != (3, H, W):
            raise RuntimeError(f"unexpected batch {tuple(b[0].shape)}")
        return len(b[1])

    rates = [epoch_rate(lambda: iter(dl), n, consume) for _ in range(epochs + 1)][1:]
    return float(np.median(rates))


def _taps(start: torch.Tensor, length: torch.Tensor, out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners=False) of resizing ``length`` to ``out``, per image, absolute."""
    src = ((torch.arange(out, dtype=torch.float64) + 0.5) * (length.double() / out).view(-1, 1) - 0.5).clamp_min(0)
    i0 = torch.minimum(src.floor().long(), (length - 1).view(-1, 1))
    i1 = torch.minimum(i0 + 1, (length - 1).view(-1, 1))
    return i0 + start.view(-1, 1), i1 + start.view(-1, 1), (src - i0).float()


def gather_resized_crop(x: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """The alternative to a loop of interpolate calls: the whole NHWC batch as two pairs of gathers."""
    n, h, w, c = x.shape
    y0, y1, wy = _taps(boxes[:, 0], boxes[:, 2], size)
    x0, x1, wx = _taps(boxes[:, 1], boxes[:, 3], size)
    rows_of = lambda idx: x.reshape(n * h, w * c).index_select(0, (torch.arange(n).view(-1, 1) * h + idx).reshape(-1))
    top = rows_of(y0).view(n, size, w, c).float()
    rows = top + (rows_of(y1).view(n, size, w, c).float() - top) * wy.view(n, size, 1, 1)
    cols_of = lambda idx: rows.reshape(n * size * w, c).index_select(
        0, ((torch.arange(n * size).view(-1, 1) * w) + idx.repeat_interleave(size, 0)).reshape(-1))
    left = cols_of(x0).view(n, size, size, c)
    return (left + (cols_of(x1).view(n, size, size, c) - left) * wx.view(n, 1, size, 1)).round_().to(torch.uint8)


def ms_per_call(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def bench_ops(path: str, reps: int) -> dict[str, float]:
    st = mmstore.open(path)
    x = torch.from_numpy(st.read_batch(np.arange(min(BATCH, len(st))))["image"])
    g = torch.Generator().manual_seed(0)
    boxes = A.random_resized_crop_params(len(x), H, W, generator=g)

    crop_out = A.resized_crop(x, boxes, H)
    return {
        "resized_crop_ms": ms_per_call(lambda: A.resized_crop(x, boxes, H), reps),
        "resized_crop_gathers_ms": ms_per_call(lambda: gather_resized_crop(x, boxes, H), reps),
        "horizontal_flip_ms": ms_per_call(lambda: A.horizontal_flip(crop_out, 0.5, g), reps),
        "normalize_ms": ms_per_call(lambda: A.normalize(crop_out, A.IMAGENET_MEAN, A.IMAGENET_STD), reps),
        "color_jitter_ms": ms_per_call(lambda: A.color_jitter(crop_out, 0.4, 0.4, 0.4, g), reps),
        "random_crop_pad4_ms": ms_per_call(lambda: A.random_crop(x, H, padding=4, generator=g), reps),
        "batch": len(x),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1,000 records, 1 measured epoch")
    ap.add_argument("--n", type=int, default=None, help="records (default 3,000)")
    ap.add_argument("--epochs", type=int, default=None, help="measured epochs per setting (default 2)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="DataLoader workers (default: cores)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads of the training process (default: torch's choice)")
    ap.add_argument("--workdir", default="/var/tmp/mmstore_bench_augment")
    ap.add_argument("--keep", action="store_true", help="keep the generated store (reused by the next run)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    n = args.n or (1000 if args.quick else 3000)
    epochs = args.epochs or (1 if args.quick else 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"aug{n}.store")
    log(f"store {path}: {n} records of {H}x{W}x3")
    make_store(path, n)
    mmstore.open(path).warm()
    res: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} intra-op threads",
        "n": n, "batch": BATCH, "workers": args.workers,
    }
    try:
        log("Loader alone")
        res["loader"] = bench_loader(path, n, None, epochs)
        log("Loader + imagenet_train (random_resized_crop + flip + normalize, batched)")
        res["loader_augment"] = bench_loader(path, n, A.imagenet_train(H, seed=0), epochs)
        log(f"DataLoader(num_workers={args.workers}) + the same transforms per sample")
        res["dataloader_per_sample"] = bench_dataloader(path, n, args.workers, epochs)
        log("batch operations on one batch in memory")
        res["ops"] = bench_ops(path, 2 if args.quick else 4)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    res["ratio_augment_vs_loader"] = res["loader_augment"] / res["loader"]
    res["ratio_augment_vs_dataloader"] = res["loader_augment"] / res["dataloader_per_sample"]
    ops = res["ops"]
    print()
    print(f"machine: {res['machine']}; {n} records, batch {BATCH}")
    print(f"  Loader alone                                 {res['loader']:10,.0f} samples/s")
    print(f"  Loader + RRC + flip + normalize (batched)    {res['loader_augment']:10,.0f} samples/s"
          f"   {res['ratio_augment_vs_loader']:.2f}x of Loader alone")
    print(f"  DataLoader({args.workers} workers) + per-sample same   {res['dataloader_per_sample']:10,.0f} samples/s"
          f"   batched is {res['ratio_augment_vs_dataloader']:.2f}x this")
    print(f"  per batch of {ops['batch']}: resized_crop (interpolate per image) {ops['resized_crop_ms']:.1f} ms, "
          f"as two pairs of gathers {ops['resized_crop_gathers_ms']:.1f} ms; flip {ops['horizontal_flip_ms']:.1f} ms, "
          f"normalize {ops['normalize_ms']:.1f} ms, color_jitter {ops['color_jitter_ms']:.1f} ms, "
          f"random_crop(pad 4) {ops['random_crop_pad4_ms']:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
