#!/usr/bin/env python3
"""Train-time crops against FFCV: the Loader with ``crop=RandomResizedCrop(224)`` and FFCV's
``RandomResizedCropRGBImageDecoder`` on the same photographs, the same cores, in one run.

    python benchmarks/bench_crop_ffcv.py --ffcv-python FFCV_VENV/bin/python [--dir /var/tmp/bench_crop_ffcv]
        [--photos 2000] [--sides 256,512,1024] [--batch 256] [--rounds 3] [--epochs 3] [--json OUT]

FFCV is not a dependency of mmstore: its side runs in child processes of ``--ffcv-python`` (a
Python with FFCV installed; ``python benchmarks/bench_crop_ffcv.py --child JSON``, which imports
numpy, OpenCV and FFCV only). Without ``--ffcv-python`` the current interpreter is used if it
imports ``ffcv``.

Images: ``bench_crop.make_photos`` (variants of a real photograph, JPEG q95, long side 300-2,000 px
here). For each long side N of ``--sides``, the same files are written twice:

* an mmstore store of images of their own shape: ``mmstore.ingest(photos, max_side=N,
  codecs=["image=jpeg:90"])``;
* an FFCV ``.beton``: ``RGBImageField(max_resolution=N, write_mode="jpg", jpeg_quality=90)``, each
  file read by ``cv2.imread`` and given as RGB.

Both resize with OpenCV's ``INTER_AREA`` and never enlarge. Then, with both in the page cache,
rounds that alternate the order of the contenders (a busy moment of a shared machine hits
all of them) at each side:

* mmstore: a fresh ``Loader(store, batch, crop=RandomResizedCrop(224), fields=["image", "label"])``
  (default tuning: the crops run on one reader thread per usable core); one epoch left out, then
  ``--epochs`` timed epochs; where the crop takes ``dct_scale`` (NOTE [DCT-scaled decode] in
  ``mmstore/engine/crop.py``), the same with ``RandomResizedCrop(224, dct_scale=False)`` too (every
  record decoded whole), "mmstore, whole decode";
* FFCV: a fresh child process, ``ffcv.loader.Loader(beton, batch, order=RANDOM,
  num_workers=usable cores, os_cache=True)`` with ``[RandomResizedCropRGBImageDecoder((224, 224)),
  ToTensor()]`` and ``[IntDecoder(), ToTensor()]``; its first epoch compiles the pipeline (numba)
  and is left out, then ``--epochs`` timed epochs, each checked to yield every sample once.

Both yield uint8 ``(batch, 224, 224, 3)`` tensors on the CPU, random order, scale (0.08, 1), ratio
(3/4, 4/3), no flip. The figure of a contender is the median of its timed epochs over all
rounds; the ratio is mmstore / FFCV. Also per contender: CPU seconds per 1,000 samples (the
process's user + system time over the timed epochs) and KiB of image entries per image. Prints a
table and one JSON object (also written to ``--json``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = 224


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _photo_files(folder: str) -> list[str]:
    sub = os.path.join(folder, "a")
    return [os.path.join(sub, f) for f in sorted(os.listdir(sub))]


# -- the child: runs in the FFCV interpreter (numpy, OpenCV, torch, ffcv; no mmstore) ------------


class _Photos:
    """The photo files as FFCV's writer wants them: ``(RGB uint8 array, label)``, label = index."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        import cv2

        img = cv2.imread(self.files[i], cv2.IMREAD_COLOR)
        if img is None:
            raise RuntimeError(f"{self.files[i]}: OpenCV could not read it")
        return np.ascontiguousarray(img[:, :, ::-1]), i


def child_write(args: dict[str, Any]) -> dict[str, Any]:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    t0 = time.perf_counter()
    fields = {"image": RGBImageField(max_resolution=int(args["side"]), write_mode="jpg", jpeg_quality=90),
              "label": IntField()}
    DatasetWriter(args["beton"], fields, num_workers=int(args["workers"])).from_indexed_dataset(
        _Photos(_photo_files(args["photos"])))
    return {"write_s": time.perf_counter() - t0}


def child_bytes(args: dict[str, Any]) -> dict[str, Any]:
    """The bytes of the images' entries in the ``.beton`` (its file is larger: whole pages are allocated)."""
    from ffcv.reader import Reader

    return {"image_bytes": int(Reader(args["beton"]).alloc_table["size"].sum())}


def child_run(args: dict[str, Any]) -> dict[str, Any]:
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor

    t0 = time.perf_counter()
    loader = Loader(args["beton"], batch_size=int(args["batch"]), order=OrderOption.RANDOM,
                    num_workers=int(args["workers"]), os_cache=True, drop_last=False,
                    pipelines={"image": [RandomResizedCropRGBImageDecoder((OUT, OUT)), ToTensor()],
                               "label": [IntDecoder(), ToTensor()]})
    n = len(loader.indices)
    rates, cpu = [], []
    for _ in range(1 + int(args["epochs"])):
        seen = np.zeros(n, np.int64)
        c0, t = _cpu(), time.perf_counter()
        for img, lab in loader:
            if tuple(img.shape[1:]) != (OUT, OUT, 3):
                raise RuntimeError(f"an FFCV batch of shape {tuple(img.shape)}")
            seen[np.asarray(lab).reshape(-1)] += 1
        rates.append(n / (time.perf_counter() - t))
        cpu.append((_cpu() - c0) / n * 1e3)
        if not (seen == 1).all():
            raise RuntimeError("an FFCV epoch did not yield every sample exactly once")
    return {"first_epoch_s": n / rates[0], "start_s": time.perf_counter() - t0, "rates": rates[1:],
            "cpu_s_per_1000": cpu[1:]}


# -- the parent: runs in mmstore's interpreter ------------------------------------------------------


def _ffcv(python: str, mode: str, **args: Any) -> dict[str, Any]:
    args["mode"] = mode
    p = subprocess.run([python, os.path.abspath(__file__), "--child", json.dumps(args)], capture_output=True,
                       text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"the FFCV child ({mode}) failed with exit status {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _has_ffcv(python: str) -> bool:
    return subprocess.run([python, "-c", "import ffcv"], capture_output=True, check=False).returncode == 0


def _mmstore_crops() -> dict[str, Any]:
    """The crops to time: the default, and the whole decode where the crop can be told to skip the DCT-scaled one."""
    import inspect

    from mmstore.engine.crop import RandomResizedCrop

    out = {"mmstore": RandomResizedCrop(OUT)}
    if "dct_scale" in inspect.signature(RandomResizedCrop).parameters:
        out["mmstore, whole decode"] = RandomResizedCrop(OUT, dct_scale=False)
    return out


def _mmstore_run(path: str, batch: int, epochs: int, crop: Any) -> dict[str, Any]:
    from mmstore.torch import Loader

    with Loader(path, batch, crop=crop, fields=["image", "label"]) as loader:
        n = len(loader.store)
        rates, cpu = [], []
        for _ in range(1 + epochs):
            c0, t = _cpu(), time.perf_counter()
            got = 0
            for b in loader:
                if tuple(b["image"].shape[1:]) != (OUT, OUT, 3):
                    raise RuntimeError(f"a Loader batch of shape {tuple(b['image'].shape)}")
                got += len(b["label"])
            rates.append(n / (time.perf_counter() - t))
            cpu.append((_cpu() - c0) / n * 1e3)
            if got != n:
                raise RuntimeError(f"a Loader epoch yielded {got} samples, not {n}")
        d = loader.describe()
    return {"rates": rates[1:], "cpu_s_per_1000": cpu[1:], "path": (d.get("crop") or {}).get("path"),
            "threads": d.get("threads")}


def _read_through(path: str) -> None:
    """Every file of ``path`` read once: into the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    for f in files:
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                while fh.read(8 << 20):
                    pass


def _machine() -> str:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
        except OSError:
            return ""

    model = next((ln.split(":", 1)[1].strip() for ln in run(["lscpu"]).splitlines() if ln.startswith("Model name")),
                 "?")
    mem = next((ln.split()[1] for ln in run(["free", "-g"]).splitlines() if ln.startswith("Mem:")), "?")
    return f"{os.cpu_count()} vCPU {model}, {mem} GiB RAM"


def main() -> int:
    import argparse
    import platform
    import shutil
    import statistics

    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import cv2
    import simplejpeg
    import torch
    from bench_crop import make_photos, say
    from compact_common import field_bytes

    import mmstore
    from mmstore import _os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ffcv-python", help="a Python with FFCV installed (default: this one, if it imports ffcv)")
    ap.add_argument("--dir", default="/var/tmp/bench_crop_ffcv")
    ap.add_argument("--photos", type=int, default=2000)
    ap.add_argument("--sides", default="256,512,1024", help="long sides of the stores, comma-separated")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per contender per round")
    ap.add_argument("--json")
    args = ap.parse_args()
    python = args.ffcv_python or sys.executable
    if not _has_ffcv(python):
        ap.error(f"{python} cannot import ffcv: give --ffcv-python, a Python with FFCV installed "
                 "(FFCV builds from its sdist: pip install --no-build-isolation ffcv, with libturbojpeg and OpenCV)")
    sides = [int(s) for s in args.sides.split(",")]
    cores = _os.usable_cores()
    os.makedirs(args.dir, exist_ok=True)
    folder = os.path.join(args.dir, "photos")
    if not os.path.isdir(os.path.join(folder, "a")) or len(os.listdir(os.path.join(folder, "a"))) != args.photos:
        shutil.rmtree(folder, ignore_errors=True)
        say(f"making {args.photos} photo variants (long side 300-2,000 px) in {folder}")
        make_photos(folder, args.photos, 0, sides=(300, 2000))
    stores, betons, sizes = {}, {}, {}
    for side in sides:
        p = stores[side] = os.path.join(args.dir, f"jpeg90_{side}.store")
        if not os.path.exists(os.path.join(p, "manifest.json")):
            shutil.rmtree(p, ignore_errors=True)
            say(f"ingest, long side {side}")
            mmstore.ingest(folder, p, max_side=side, codecs=["image=jpeg:90"], quiet=True)
        b = betons[side] = os.path.join(args.dir, f"jpg90_{side}.beton")
        if not os.path.exists(b):
            say(f"FFCV .beton, long side {side}")
            _ffcv(python, "write", photos=folder, beton=b, side=side, workers=cores)
        with mmstore.open(p) as s:
            hw = s.column("image_hw")
            orig = s.column("orig_size") if "orig_size" in s.schema else None
            ffcv_bytes = _ffcv(python, "bytes", beton=b)["image_bytes"]
            sizes[side] = {"mmstore_kib_per_image": round(field_bytes(p, "image") / len(s) / 1024, 1),
                           "ffcv_kib_per_image": round(ffcv_bytes / len(s) / 1024, 1),
                           "median_h_w": [int(v) for v in np.median(hw, axis=0)]}
        if orig is not None:
            sizes["photos_long_side"] = [int(np.min(orig.max(axis=1))), int(np.median(orig.max(axis=1))),
                                         int(np.max(orig.max(axis=1)))]
    for side in sides:
        _read_through(stores[side])
        _read_through(betons[side])
    crops = _mmstore_crops()
    who_all = [*crops, "ffcv"]
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {s: {w: [] for w in who_all} for s in sides}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for side in sides:
            for who in (who_all if r % 2 == 0 else who_all[::-1]):
                if who in crops:
                    runs[side][who].append(_mmstore_run(stores[side], args.batch, args.epochs, crops[who]))
                else:
                    runs[side][who].append(_ffcv(python, "run", beton=betons[side], batch=args.batch,
                                                 workers=cores, epochs=args.epochs))
                load.append(os.getloadavg()[0])
        say(f"round {r + 1}/{args.rounds} done")
    rows = []
    for side in sides:
        row: dict[str, Any] = {"side": side}
        for who in who_all:
            rates = [x for run in runs[side][who] for x in run["rates"]]
            cpu = [x for run in runs[side][who] for x in run["cpu_s_per_1000"]]
            row[f"{who}_samples_s"] = round(statistics.median(rates))
            row[f"{who}_best"] = round(max(rates))
            row[f"{who}_cpu_s_per_1000"] = round(statistics.median(cpu), 2)
        row["ratio"] = round(row["mmstore_samples_s"] / row["ffcv_samples_s"], 3)
        if "mmstore, whole decode" in crops:
            row["ratio_whole_decode"] = round(row["mmstore, whole decode_samples_s"] / row["ffcv_samples_s"], 3)
        row["target"] = 1.3 if side >= 1024 else 1.0
        row.update(sizes[side])
        rows.append(row)
    info = {"machine": _machine(), "cores": cores, "python": platform.python_version(), "opencv": cv2.__version__,
            "simplejpeg": simplejpeg.__version__, "torch": torch.__version__, "mmstore": mmstore.__version__,
            "batch": args.batch, "photos": args.photos, "photos_long_side": sizes.get("photos_long_side"),
            "rounds": args.rounds, "epochs": args.epochs, "load_1min": [round(x, 2) for x in load],
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "mmstore_path": {w: sorted({run["path"] for s in sides for run in runs[s][w]}) for w in crops},
            "mmstore_threads": sorted({run["threads"] for s in sides for w in crops for run in runs[s][w]}),
            "ffcv_first_epoch_s": {s: [round(run["first_epoch_s"], 2) for run in runs[s]["ffcv"]] for s in sides}}
    print(f"{'side':>5} {'mmstore/s':>10} {'FFCV/s':>8} {'ratio':>6} {'target':>6} "
          f"{'mm CPU s/1k':>11} {'FFCV CPU s/1k':>13}")
    for row in rows:
        print(f"{row['side']:>5} {row['mmstore_samples_s']:>10} {row['ffcv_samples_s']:>8} {row['ratio']:>6} "
              f"{row['target']:>6} {row['mmstore_cpu_s_per_1000']:>11} {row['ffcv_cpu_s_per_1000']:>13}")
        if "ratio_whole_decode" in row:
            print(f"{'':>5} {row['mmstore, whole decode_samples_s']:>10} {'':>8} {row['ratio_whole_decode']:>6} "
                  f"{'':>6} {row['mmstore, whole decode_cpu_s_per_1000']:>11}   (mmstore, whole decode)")
    res = {"machine": info, "rows": rows, "runs": {str(s): v for s, v in runs.items()}}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    _args = json.loads(sys.argv[2])
    print(json.dumps({"write": child_write, "bytes": child_bytes, "run": child_run}[_args["mode"]](_args)))
elif __name__ == "__main__":
    sys.exit(main())
