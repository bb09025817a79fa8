#!/usr/bin/env python3
"""Part ``ffcv`` of ``benchmarks/bench_compact.py``: FFCV and mmstore on the same images, side by side.

    python benchmarks/bench_compact.py --parts ffcv [--ffcv-python /tmp/ffcvvenv/bin/python] [--ffcv-images 2000]

For each image set (FFCV's own synthetic images, ``make_image`` of
FFCV's peer benchmark script ``bench_ffcv.py`` (``--ffcv-dir``), and the real-photo variants of bench_compact), the same
224x224 RGB pixels are written once as an mmstore ``jpeg:90`` store and, when ``--ffcv-python``
names a Python with FFCV installed (FFCV is not a dependency of mmstore: it runs in a child
process of that interpreter, ``python benchmarks/bench_compact_ffcv.py --child JSON``), as an FFCV
``.beton`` (``RGBImageField(write_mode="jpg", jpeg_quality=90)``). Then, in rounds that
alternate the two (a busy moment of a shared machine hits both):

* FFCV: a fresh child process, ``ffcv.loader.Loader(batch 256, RANDOM, num_workers=cores,
  os_cache=True)`` with ``SimpleRGBImageDecoder, ToTensor``; 4 epochs, the first one compiles
  the pipeline (numba) and is left out: best of epochs 2-4;
* mmstore: ``Loader(store, 256, "permutation")`` (defaults), 3 epochs, best of epochs 2-3.

Both count every sample of the epoch. Also per set: stored bytes per image of each, and the CPU
time of one decode of the same entries by the ways libjpeg-turbo decodes them (mmstore's accurate
DCT and fancy upsampling; fast DCT, which is FFCV's flag; fast upsampling; OpenCV's imdecode), and
for the photos the chroma subsampling chosen at encode (4:2:0, mmstore's, vs 4:4:4): bytes, decode
time and PSNR against the raw pixels.
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

BATCH = 256


# -- the child: runs in the FFCV interpreter (numpy, torch, ffcv; no mmstore needed) ------------


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(args: dict[str, Any]) -> dict[str, Any]:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor
    from ffcv.writer import DatasetWriter

    images = np.load(args["images"], mmap_mode="r")
    n, beton, workers = len(images), args["beton"], int(args["workers"])
    out: dict[str, Any] = {}
    if not os.path.exists(beton):

        class _Images:
            def __len__(self) -> int:
                return n

            def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
                return np.ascontiguousarray(images[i]), int(i)

        t0 = time.perf_counter()
        w = DatasetWriter(beton, {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
                          num_workers=workers)
        w.from_indexed_dataset(_Images())
        out["write_s"] = time.perf_counter() - t0
    out["bytes"] = os.path.getsize(beton)
    loader = Loader(beton, batch_size=BATCH, order=OrderOption.RANDOM, num_workers=workers, os_cache=True,
                    drop_last=False, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()],
                                                "label": [IntDecoder(), ToTensor()]})
    rates, cpu = [], []
    for _ in range(int(args["epochs"])):
        seen = np.zeros(n, np.int64)
        c0, t0 = _cpu(), time.perf_counter()
        for img, lab in loader:
            seen[np.asarray(lab).reshape(-1)] += 1
            if img.shape[1:] != (224, 224, 3):
                raise RuntimeError(f"FFCV batch of shape {tuple(img.shape)}")
        rates.append(n / (time.perf_counter() - t0))
        cpu.append((_cpu() - c0) / n * 1e3)
        if not (seen == 1).all():
            raise RuntimeError("an FFCV epoch did not yield every sample exactly once")
    out.update(rates=rates, cpu_ms_per_sample=cpu)
    return out


# -- the parent: runs in mmstore's interpreter ------------------------------------------------------


def _run_ffcv(python: str, images: str, beton: str, workers: int, epochs: int) -> dict[str, Any]:
    arg = json.dumps({"images": images, "beton": beton, "workers": workers, "epochs": epochs})
    p = subprocess.run([python, os.path.abspath(__file__), "--child", arg], capture_output=True, text=True,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"the FFCV child failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _loader_run(path: str, epochs: int) -> tuple[list[float], list[float]]:
    from compact_common import loader_epoch

    c0 = _cpu()
    rates = loader_epoch(path, "permutation", epochs=epochs)
    return rates, [(_cpu() - c0) / (epochs * len(np.load(os.path.join(path, "label.npy"), mmap_mode="r"))) * 1e3]


def _decode_ways(entries: list[bytes]) -> dict[str, float]:
    import cv2
    import simplejpeg
    from compact_common import cpu_ms_per_decode

    from mmstore.format.codecs import parse_codec

    c = parse_codec("jpeg:90")
    out = np.empty((224, 224, 3), np.uint8)
    ways = {
        "mmstore codec (accurate DCT, fancy upsampling)": lambda e: c.decode_into(e, out),
        "fast DCT (FFCV's flag)": lambda e: simplejpeg.decode_jpeg(e, "RGB", True, False, buffer=out),
        "fast upsampling": lambda e: simplejpeg.decode_jpeg(e, "RGB", False, True, buffer=out),
        "fast DCT + fast upsampling": lambda e: simplejpeg.decode_jpeg(e, "RGB", True, True, buffer=out),
        "cv2.imdecode": lambda e: cv2.imdecode(np.frombuffer(e, np.uint8), cv2.IMREAD_COLOR),
    }
    return {k: cpu_ms_per_decode(entries, fn) for k, fn in ways.items()}


def _pixel_cost(entries: list[bytes]) -> dict[str, dict[str, float]]:
    """Pixel difference of the fast decodes from the accurate one (mmstore's)."""
    import simplejpeg

    out = {}
    for name, fd, fu in (("fast DCT", True, False), ("fast upsampling", False, True), ("both", True, True)):
        diffs = [np.abs(simplejpeg.decode_jpeg(e, "RGB", fd, fu).astype(np.int16)
                        - simplejpeg.decode_jpeg(e, "RGB", False, False).astype(np.int16)) for e in entries]
        out[name] = {"mean_abs": float(np.mean([d.mean() for d in diffs])), "max_abs": int(max(d.max() for d in diffs)),
                     "pixels_differing": float(np.mean([(d > 0).mean() for d in diffs]))}
    return out


def _subsampling(imgs: list[np.ndarray]) -> dict[str, dict[str, float]]:
    """4:2:0 (mmstore's) vs 4:4:4 at quality 90: bytes, decode CPU ms, PSNR vs raw."""
    import simplejpeg
    from compact_common import cpu_ms_per_decode

    out = {}
    for sub in ("420", "444"):
        enc = [simplejpeg.encode_jpeg(im, 90, "RGB", sub, False) for im in imgs]
        mse = [float(np.mean((simplejpeg.decode_jpeg(e, "RGB").astype(np.float64) - im) ** 2))
               for e, im in zip(enc, imgs)]
        buf = np.empty((224, 224, 3), np.uint8)
        out[sub] = {"kib_per_image": float(np.mean([len(e) for e in enc])) / 1024,
                    "decode_cpu_ms": cpu_ms_per_decode(
                        enc, lambda e, b=buf: simplejpeg.decode_jpeg(e, "RGB", buffer=b)),
                    "psnr_db": float(np.mean([10 * np.log10(255.0**2 / max(m, 1e-12)) for m in mse]))}
    return out


def part_ffcv(work: str, n: int, ffcv_dir: str | None, ffcv_python: str | None, rounds: int = 2) -> dict[str, Any]:
    import importlib.util
    import shutil

    import compact_common as bc

    from mmstore.check.common import table
    from mmstore.format.codecs import parse_codec

    sets: dict[str, list[np.ndarray]] = {}
    src = os.path.join(ffcv_dir, "bench_ffcv.py") if ffcv_dir else "bench_ffcv.py (--ffcv-dir)"
    if ffcv_dir and os.path.exists(src):
        spec = importlib.util.spec_from_file_location("bench_ffcv", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        sets["FFCV's synthetic images"] = [mod.make_image(i)[0] for i in range(n)]
    else:
        bc.say(f"  FFCV's synthetic images left out ({src} not found)")
    sets["photo variants"] = bc.photo_variants(n, 5)[0]
    k = bc.cores()
    res: dict[str, Any] = {"images": n, "ffcv_python": ffcv_python, "workers": k, "rounds": rounds}
    for name, imgs in sets.items():
        tag = "synthetic" if name.startswith("FFCV") else "photos"
        path = bc.write_store(os.path.join(work, f"ffcv-{tag}-jpeg90.store"), imgs, "jpeg:90")
        npy = os.path.join(work, f"ffcv-{tag}.npy")
        np.save(npy, np.stack(imgs))
        beton = os.path.join(work, f"ffcv-{tag}.beton")
        if os.path.exists(beton):
            os.remove(beton)
        entries = [parse_codec("jpeg:90").encode(im) for im in imgs[:300]]  # the store's bytes (deterministic)
        r: dict[str, Any] = {"mmstore_kib_per_image": bc.field_bytes(path) / n / 1024,
                             "cpu_ms_per_decode": _decode_ways(entries),
                             "fast_decode_pixels": _pixel_cost(entries[:100])}
        if tag == "photos":
            r["subsampling_q90"] = _subsampling(imgs[:300])
        bc.loader_epoch(path, "permutation")  # into the page cache
        runs: dict[str, list[Any]] = {"mmstore": [], "ffcv": []}
        for rd in range(rounds):
            order = ["mmstore", "ffcv"] if rd % 2 == 0 else ["ffcv", "mmstore"]
            for who in order:
                if who == "mmstore":
                    rates, cpu = _loader_run(path, 3)
                    runs["mmstore"].append({"rates": rates, "cpu_ms_per_sample": cpu})
                elif ffcv_python:
                    runs["ffcv"].append(_run_ffcv(ffcv_python, npy, beton, k, 4))
        ours = max(max(x["rates"][1:]) for x in runs["mmstore"])
        r.update(runs=runs, mmstore_samples_per_s=ours)
        rows = [["mmstore Loader, jpeg:90 store", f"{ours:,.0f}", f"{r['mmstore_kib_per_image']:.1f}"]]
        if runs["ffcv"]:
            theirs = max(max(x["rates"][1:]) for x in runs["ffcv"])
            r.update(ffcv_samples_per_s=theirs, ratio=ours / theirs,
                     ffcv_kib_per_image=runs["ffcv"][0]["bytes"] / n / 1024)
            rows.append([f"FFCV jpg q90, {k} workers", f"{theirs:,.0f}", f"{r['ffcv_kib_per_image']:.1f} (.beton)"])
            rows.append(["mmstore / FFCV", f"{ours / theirs:.2f}x", ""])
        bc.say(f"  {name}, {n} images, batch {BATCH}, best warm epoch of {rounds} alternating rounds")
        bc.say(table(rows, header=["loader", "samples/s", "KiB/image"]))
        bc.say(table([[w, f"{ms:.3f}"] for w, ms in r["cpu_ms_per_decode"].items()],
                     header=["decode of one 224x224 entry", "CPU ms"]))
        for f in (npy, beton):
            if os.path.exists(f):
                os.remove(f)
        shutil.rmtree(path)
        res[tag] = r
    return res


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(child(json.loads(sys.argv[2]))))
