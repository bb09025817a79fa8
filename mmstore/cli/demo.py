"""``mmstore demo``: see mmstore work on this machine, and why it matters.

On generated data, in a temporary directory: a folder of photo-like JPEGs of
varied sizes in ten classes (plus a few broken files, as real folders have),
ingested into a store; verify; a grid PNG (the one file left behind without
``--keep``, in the temporary directory); the slow-first-epoch experiment
(the JPEG folder vs the store, epoch 1 cold and epoch 2 warm, through
DataLoader and through Loader); one epoch of a tiny CNN from the store. Every
number printed is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, cast

import numpy as np

from ..errors import DecodeError
from ..store.reader import open_store

# how long `mmstore demo` (the defaults) takes, a large part of it spent
# generating the JPEGs; the README states the same figure (a test checks)
DEMO_TIME = "about 1 minute on an idle 2-core VM, 3.5 when it is shared"

EXAMPLE = f"""example:
  mmstore demo                        # {DEMO_TIME}
  mmstore demo --images 400 --quick   # a fast smoke run
  mmstore demo --keep --workdir /tmp/mm-demo
"""

N_CLASSES = 10
CLASS_NAMES = ["apple", "boat", "cloud", "desert", "forest", "glacier", "harbor", "island", "jungle", "lake"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="generate a JPEG folder, ingest it, and measure the slow-first-epoch fix",
        description=__doc__,
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=3000, help="JPEGs to generate (default 3000)")
    p.add_argument("--size", type=int, default=160, help="stored image side in pixels (default 160)")
    p.add_argument("--workers", type=int, default=None, help="processes for generation, ingest and DataLoader")
    p.add_argument("--workdir", help="where to work (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the generated files and the store")
    p.add_argument("--quick", action="store_true", help="smaller experiment and training (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


# -- data generation ---------------------------------------------------------------


def _photo(rng: np.random.Generator, label: int) -> np.ndarray:
    """A photo-like BGR image 300-640 px: sky/ground gradient, class-coloured
    shapes, texture and sensor noise, so JPEG sizes and decode costs are real."""
    import cv2

    h, w = (int(v) for v in rng.integers(300, 641, 2))
    hue = (label * 18 + int(rng.integers(-4, 5))) % 180
    top = np.array([hue, 80 + rng.integers(0, 60), 200 + rng.integers(0, 55)], np.float32)
    bottom = np.array([(hue + 30) % 180, 150 + rng.integers(0, 100), 60 + rng.integers(0, 80)], np.float32)
    t = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None, None]
    img = (top * (1 - t) + bottom * t).repeat(w, axis=1)
    img = cv2.cvtColor(np.clip(img, 0, 255).astype(np.uint8), cv2.COLOR_HSV2BGR)
    for _ in range(int(rng.integers(3, 9))):
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(10, max(12, min(h, w) // 3)))
        if (label + _) % 3 == 0:
            cv2.circle(img, (cx, cy), r, color, -1, cv2.LINE_AA)
        elif (label + _) % 3 == 1:
            cv2.rectangle(img, (cx - r, cy - r // 2), (cx + r, cy + r // 2), color, -1)
        else:
            pts = rng.integers(0, [w, h], (3, 2)).astype(np.int32)
            cv2.fillPoly(img, [pts], color, cv2.LINE_AA)
    noise = rng.normal(0, 4 + label % 4, img.shape).astype(np.float32)
    return np.clip(img.astype(np.float32) + noise, 0, 255).astype(np.uint8)


def _write_images(args: tuple[str, int, int, int]) -> int:
    import cv2

    root, start, stop, seed = args
    cv2.setNumThreads(1)
    total = 0
    for i in range(start, stop):
        rng = np.random.default_rng([seed, i])
        label = i % N_CLASSES
        ok, buf = cv2.imencode(".jpg", _photo(rng, label), [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(80, 96))])
        if not ok:
            raise RuntimeError("cv2.imencode failed")
        with open(os.path.join(root, CLASS_NAMES[label], f"img_{i:06d}.jpg"), "wb") as fh:
            fh.write(buf.tobytes())
        total += len(buf)
    return total


def _broken_files(root: str, seed: int) -> int:
    """The broken files a real folder has: each must be reported and skipped."""
    d = os.path.join(root, CLASS_NAMES[0])
    good = sorted(os.listdir(d))[0]
    with open(os.path.join(d, good), "rb") as fh:
        jpeg = fh.read()
    with open(os.path.join(d, "zz_empty.jpg"), "wb"):
        pass
    with open(os.path.join(root, CLASS_NAMES[1], "zz_error_page.jpg"), "wb") as fh:
        fh.write(b"<!DOCTYPE html><html><body>503 Service Unavailable</body></html>\n")
    with open(os.path.join(root, CLASS_NAMES[2], "zz_truncated.jpg"), "wb") as fh:
        fh.write(jpeg[: len(jpeg) // 2])
    os.symlink("does-not-exist.jpg", os.path.join(root, CLASS_NAMES[3], "zz_broken_link.jpg"))
    return 4


def _generate(root: str, n: int, seed: int, procs: int) -> tuple[int, int, float]:
    for c in CLASS_NAMES:
        os.makedirs(os.path.join(root, c), exist_ok=True)
    t0 = time.perf_counter()
    parts = [(root, a, min(n, a + 64), seed) for a in range(0, n, 64)]
    if procs > 1:
        import multiprocessing as mp

        # not "fork": the caller (a notebook, a test runner) may run threads
        # whose locks a forked child would inherit held
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        with mp.get_context(method).Pool(procs) as pool:
            total = sum(pool.map(_write_images, parts))
    else:
        total = sum(map(_write_images, parts))
    broken = _broken_files(root, seed)
    return total, broken, time.perf_counter() - t0


# -- the slow-first-epoch experiment ------------------------------------------------


class _JpegFolder:
    """What people start from: a Dataset that decodes each JPEG per access."""

    def __init__(self, files: list[str], labels: list[int], side: int) -> None:
        self.files, self.labels, self.side = files, labels, side

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Any:
        import cv2
        import torch

        img = cv2.imread(self.files[i], cv2.IMREAD_COLOR)
        if img is None:
            raise DecodeError(f"{self.files[i]}: OpenCV cannot read it as an image")
        img = cv2.resize(cv2.cvtColor(img, cv2.COLOR_BGR2RGB), (self.side, self.side), interpolation=cv2.INTER_AREA)
        return torch.from_numpy(img), self.labels[i]


def _evict(paths: list[str]) -> None:
    from .. import _os  # lazy: NOTE [lazy commands]

    for p in paths:
        try:
            _os.evict(p)
        except OSError:
            pass


def _epoch_rate(make_iter: Any, n_expected: int) -> float:
    t0 = time.perf_counter()
    seen = 0
    for batch in make_iter():
        x = batch[0] if isinstance(batch, (list, tuple)) else batch["image"]
        seen += len(x)
    dt = time.perf_counter() - t0
    if seen != n_expected:
        raise RuntimeError(f"an epoch yielded {seen} samples, expected {n_expected}")
    return seen / dt


def _experiment(folder: str, store_path: str, side: int, workers: int, quick: bool) -> list[tuple[str, float, float]]:
    import cv2
    import torch
    from torch.utils.data import DataLoader, Dataset

    from ..order import OrderSpec
    from ..torch import Loader, StoreDataset

    # one OpenCV thread per DataLoader worker, and no thread pool alive in this
    # process when the workers fork (NOTE [OpenCV and fork] in ingest/workers.py)
    cv2.setNumThreads(1)

    files, labels = [], []
    for k, c in enumerate(CLASS_NAMES):
        for name in sorted(os.listdir(os.path.join(folder, c))):
            if name.startswith("img_"):
                files.append(os.path.join(folder, c, name))
                labels.append(k)
    if quick:
        files, labels = files[:400], labels[:400]
    bs = 64
    jpeg = _JpegFolder(files, labels, side)
    store = open_store(store_path)
    n_store = len(store)
    store_files = store.data_paths()
    rows = []
    g = torch.Generator().manual_seed(0)

    def jpeg_loader() -> Any:
        # a map-style dataset (len and [i]) without subclassing torch's Dataset at module level
        return DataLoader(cast("Dataset[Any]", jpeg), batch_size=bs, shuffle=True, num_workers=workers, generator=g)

    def store_loader() -> Any:
        return DataLoader(StoreDataset(store_path), batch_size=bs, shuffle=True, num_workers=workers, generator=g)

    # epoch 1: every file evicted from the page cache; epoch 2: warm
    _evict(files)
    r1 = _epoch_rate(jpeg_loader, len(files))
    r2 = _epoch_rate(jpeg_loader, len(files))
    rows.append((f"JPEG folder, cv2.imread, DataLoader({workers} workers)", r1, r2))
    _evict(store_files)
    r1 = _epoch_rate(store_loader, n_store)
    r2 = _epoch_rate(store_loader, n_store)
    rows.append((f"store, StoreDataset, DataLoader({workers} workers)", r1, r2))
    loader = Loader(store, batch_size=bs, order=OrderSpec("permutation", seed=0))
    _evict(store_files)
    r1 = _epoch_rate(lambda: iter(loader), n_store)
    r2 = _epoch_rate(lambda: iter(loader), n_store)
    rows.append(("store, Loader (threads, no workers)", r1, r2))
    _evict(store_files)
    t0 = time.perf_counter()
    store.warm(max_fraction=0.5)
    t_warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    _epoch_rate(lambda: iter(loader), n_store)
    rows.append(("store, warm() then Loader (warm time included)", n_store / (time.perf_counter() - t0 + t_warm), r2))
    loader.close()
    store.close()
    return rows


def _train(store_path: str, quick: bool) -> tuple[float, float, float, int]:
    """One epoch of a tiny CNN from the store, on the CPU: the whole path."""
    import torch
    from torch import nn

    from ..order import OrderSpec
    from ..torch import Loader, gpu

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=4, padding=2), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, N_CLASSES),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    loader = Loader(store_path, batch_size=32, order=OrderSpec("permutation", seed=1), fields=["image", "label"])
    losses, correct, seen = [], 0, 0
    t0 = time.perf_counter()
    limit = 400 if quick else None
    for batch in loader:
        x = gpu.normalize(batch["image"], mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25], layout="NHWC")
        x = gpu.random_flip(x, 0.5, layout="NCHW")
        y = batch["label"]
        out = model(x)
        loss = loss_fn(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        correct += int((out.argmax(1) == y).sum())
        seen += len(y)
        if limit and seen >= limit:
            break
    loader.close()
    dt = time.perf_counter() - t0
    k = max(1, len(losses) // 5)
    return float(np.mean(losses[:k])), float(np.mean(losses[-k:])), dt, seen


# -- main ---------------------------------------------------------------------------


def _say(msg: str = "") -> None:
    print(msg, flush=True)


DEMO_MARKER = ".mmstore-demo"  # in a --workdir: the demo's files there are its own


def run(args: argparse.Namespace) -> int:
    from ..check import show_store, verify_store  # lazy: NOTE [lazy commands]
    from ..ingest import ingest

    n, side = int(args.images), int(args.size)
    if n < N_CLASSES or side < 8:
        print("mmstore demo: --images must be >= 10 and --size >= 8", file=sys.stderr)
        return 2
    procs = int(args.workers or min(4, os.cpu_count() or 1))
    work = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="mmstore-demo-")
    os.makedirs(work, exist_ok=True)
    folder, store_path = os.path.join(work, "photos"), os.path.join(work, "photos.store")
    own = (folder, store_path, store_path + ".partial", os.path.join(work, "grid.png"), store_path + ".lock")
    marker = os.path.join(work, DEMO_MARKER)
    taken = [os.path.basename(p) for p in own if os.path.lexists(p)]
    if taken and not os.path.isfile(marker):  # never replace what the demo did not make
        print(f"mmstore demo: {work} already holds {', '.join(taken)}, which the demo did not make; "
              "pick an empty --workdir", file=sys.stderr)
        return 2
    with open(marker, "w") as fh:
        fh.write("made by `mmstore demo`: it may replace photos/, photos.store and grid.png here\n")
    for p in own[:3]:
        shutil.rmtree(p, ignore_errors=True)
    t_all = time.perf_counter()
    try:
        _say(f"mmstore demo: working in {work}")
        _say(f"\n1. Generating {n:,} photo-like JPEGs (300-640 px) in {N_CLASSES} class folders ...")
        total, broken, dt = _generate(folder, n, args.seed, procs)
        _say(f"   {n:,} JPEGs, {total / 1e6:.0f} MB, plus {broken} broken files ({dt:.1f} s)")

        _say(f"\n2. Ingesting: mmstore ingest {folder} {store_path} --size {side}x{side}")
        res = ingest(folder, store_path, (side, side), workers=procs)
        _say("   " + res.summary().replace("\n", "\n   "))

        _say("\n3. Verifying every record's checksum, and drawing a grid")
        rep = verify_store(store_path)
        _say(f"   {rep.summary()} ({rep.checked_bytes / 1e6:.0f} MB at {rep.mb_per_s:,.0f} MB/s)")
        if args.keep:
            grid = os.path.join(work, "grid.png")
        else:  # the work folder goes at the end: the grid, whose path is printed, is a file of its own
            fd, grid = tempfile.mkstemp(prefix="mmstore-demo-grid-", suffix=".png")
            os.close(fd)
        try:
            show_store(store_path, grid, n=16, seed=args.seed)
        except BaseException:
            if not args.keep:
                os.unlink(grid)
            raise
        _say(f"   grid of 16 random records: {grid}" + ("" if args.keep else " (kept after the demo)"))
        if not rep.ok:
            print("mmstore demo: the store did not verify", file=sys.stderr)
            return 1

        try:
            import torch  # noqa: F401
        except ImportError:
            _say("\n(PyTorch is not installed: pip install torch, then rerun for the epoch experiment.)")
            return 0
        _say("\n4. The slow first epoch: epoch 1 with every file evicted from the page cache, epoch 2 warm")
        rows = _experiment(folder, store_path, side, min(procs, 2), args.quick)
        base1, base2 = rows[0][1], rows[0][2]
        w = max(len(r[0]) for r in rows)
        _say(f"   {'samples/s':<{w}}  {'epoch 1 (cold)':>15}  {'epoch 2 (warm)':>15}  {'speed-up 1':>10}  "
             f"{'speed-up 2':>10}")
        for name, r1, r2 in rows:
            _say(f"   {name:<{w}}  {r1:>15,.0f}  {r2:>15,.0f}  {r1 / base1:>9.1f}x  {r2 / base2:>9.1f}x")

        _say("\n5. One epoch of a tiny CNN, fed from the store by Loader (CPU)")
        first, last, dt, seen = _train(store_path, args.quick)
        _say(f"   {seen:,} samples in {dt:.1f} s; loss {first:.2f} -> {last:.2f}")

        _say("\n6. Now your own data:")
        _say("   mmstore ingest /path/to/train train.store --size 224x224     # ImageFolder or a flat folder")
        _say("   mmstore verify train.store && mmstore show train.store -o grid.png")
        _say("   python -c \"from mmstore.torch import Loader; "
             "[b['image'].shape for b in Loader('train.store', 256)]\"")
        _say(f"\nDone in {time.perf_counter() - t_all:.0f} s.")
        return 0
    finally:
        if args.keep:
            _say(f"(kept {work})")
        elif args.workdir:
            for p in own[:3]:
                shutil.rmtree(p, ignore_errors=True)
            for p in (*own[3:], marker):
                if os.path.lexists(p):
                    os.unlink(p)
        else:
            shutil.rmtree(work, ignore_errors=True)
