#!/usr/bin/env python3
"""Compact records measured: size, larger than RAM, warm, open and quality, as ratios in one run.

    python benchmarks/bench_compact.py [--dir /var/tmp/bench_compact] [--parts size,quality,ltr,hdd,warm,open,ffcv]
                                  [--photos 600] [--ltr-records 10000] [--json OUT]
                                  [--ffcv-python /tmp/ffcvvenv/bin/python]

Images. *Real photographs*: every RGB photo among scikit-image's and scikit-learn's sample
images (installed for benchmarks only; not a dependency of mmstore), cut into many variants
(a random square crop of 35-100% of the short side, a random flip), resized to 224x224 with
INTER_AREA; the crop before resizing is the variant's "original file" (JPEG quality 95).
*Demo images*: ``mmstore demo``'s generator (``mmstore.cli.demo._photo``), resized the same way.

1. size: data bytes of the image field (``image.bin`` + ``image.offsets.npy``, or ``image.npy``)
   of stores written with raw, jpeg:90, jpeg:95, png and zstd, on both image sets; ratio raw / codec.
2. ltr (larger than RAM): a raw store of ``--ltr-records`` photo variants (about 4.5 GB) and its
   jpeg:90 twin; each read for one Loader epoch (order "block", defaults otherwise, batch 256) in a
   child process confined to a cgroup-v1 memory limit of 1/4 of the raw store's data bytes, the
   store's files evicted first; ratio of samples/s, jpeg:90 / raw. The limit also holds the
   process's own memory (torch, the Loader's batch buffers: about 350 MB), so with a 1.5 GB raw
   store (limit 376 MB) not even the compact store stays cached and both thrash: 4.5 GB is the
   smallest store for which the figure means what it says.
2b. hdd (larger than RAM on a spinning disk): a model of one, a loop-mounted
   ext4 throttled by the blkio cgroup to 120 read IOs/s and 150 MB/s plus a 600 MB memory cgroup;
   a raw and a jpeg:90 store of ``--hdd-records`` photo variants on it, one Loader epoch each (block,
   defaults), evicted first; ratio jpeg:90 / raw.
3. warm: the Loader over a warm jpeg:90 store (batch 256, permutation, best of 3 epochs after one
   warm-up epoch) vs the decode limit (the same decoder on the same bytes, from RAM, one thread per
   core, no store: ``mmstore.check.codec_advice.decode_rate``) and vs a folder of the original
   JPEG files read by torch ``DataLoader(num_workers=cores)`` with a cv2.imread Dataset
   (``mmstore.cli.demo._JpegFolder``: imread, BGR to RGB, resize to 224).
4. open: ``mmstore.open`` + ``close`` of a 10,000,000-slot compact store vs a 1,000-slot one
   (median of 30, warm); the pages of ``x.offsets.npy`` resident after opening the evicted store
   (the reader checks offsets[0] and offsets[-1] only).
5. quality: mean absolute pixel difference and PSNR of jpeg:90 and jpeg:95 against raw, on the
   photographs (per image, then the mean; PSNR's minimum too).
6. ffcv: FFCV's jpg loader and mmstore's jpeg:90 Loader on the same images (FFCV's synthetic
   ones and the photo variants), side by side in alternating rounds, FFCV run by the interpreter
   ``--ffcv-python`` names; the decode cost by each way libjpeg-turbo decodes, and 4:2:0 vs 4:4:4
   (``benchmarks/bench_compact_ffcv.py`` says exactly what is run).

Prints a table per part and, at the end, one JSON object (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compact_common import (
    BATCH,
    SIDE,
    cores,
    data_bytes,
    demo_images,
    evict_store,
    field_bytes,
    loader_epoch,
    photo_variants,
    say,
    write_store,
)

import mmstore
from mmstore import _os
from mmstore.check.codec_advice import decode_rate
from mmstore.check.common import table
from mmstore.format.codecs import parse_codec

CODECS = ("raw", "jpeg:90", "jpeg:95", "png", "zstd")
CG_ROOT = "/sys/fs/cgroup/memory"


# -- 1. size -----------------------------------------------------------------------------------


def part_size(work: str, sets: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = []
    for set_name, imgs in sets.items():
        res: dict[str, Any] = {"images": len(imgs)}
        raw = None
        for c in CODECS:
            t0 = time.perf_counter()
            p = write_store(os.path.join(work, f"size-{set_name}-{c.replace(':', '')}.store"), imgs, c)
            nb = field_bytes(p)
            raw = nb if c == "raw" else raw
            res[parse_codec(c).spec] = {"bytes": nb, "ratio": raw / nb, "kib_per_image": nb / len(imgs) / 1024,
                                        "write_s": time.perf_counter() - t0}
            rows.append([set_name, parse_codec(c).spec, f"{nb:,}", f"{nb / len(imgs) / 1024:.1f}", f"{raw / nb:.1f}x"])
            shutil.rmtree(p)
        out[set_name] = res
    say(table(rows, header=["images", "codec", "image field bytes", "KiB/image", "raw / codec"]))
    return out


# -- 5. quality --------------------------------------------------------------------------------


def part_quality(imgs: list[np.ndarray]) -> dict[str, Any]:
    out, rows = {}, []
    for q in (90, 95):
        c = parse_codec(f"jpeg:{q}")
        mad, psnr = [], []
        for img in imgs:
            d = c.decode(c.encode(img), np.uint8, img.shape).astype(np.int32) - img.astype(np.int32)
            mad.append(float(np.abs(d).mean()))
            psnr.append(float(10 * np.log10(255.0**2 / max(float((d * d).mean()), 1e-12))))
        out[c.spec] = {"mean_abs_diff": statistics.fmean(mad), "max_mean_abs_diff": max(mad),
                       "psnr_db": statistics.fmean(psnr), "min_psnr_db": min(psnr), "images": len(imgs)}
        rows.append([c.spec, f"{statistics.fmean(mad):.2f}", f"{max(mad):.2f}", f"{statistics.fmean(psnr):.1f}",
                     f"{min(psnr):.1f}"])
    say(table(rows, header=["codec", "mean |diff|", "worst image", "PSNR dB", "worst PSNR"]))
    return out


# -- 2. larger than RAM --------------------------------------------------------------------------


def _child_ltr(path: str) -> dict[str, Any]:
    evict_store(path)
    rate = loader_epoch(path, order="block")[0]
    with open("/proc/self/status") as fh:  # the process's own memory, which the limit also holds
        anon = next(int(ln.split()[1]) for ln in fh if ln.startswith("RssAnon:"))
    return {"samples_per_s": rate, "rss_anon_mib": anon / 1024}



def _raw_vs_jpeg(res: dict[str, Any], raw_bytes: int, jpg_bytes: int, bytes_header: str) -> None:
    """The medians of a raw-vs-jpeg:90 comparison's runs into ``res``, and its table."""
    med = {k: statistics.median(r["samples_per_s"] for r in res["runs"] if r["kind"] == k) for k in ("raw", "jpeg:90")}
    res["raw_samples_per_s"], res["jpeg90_samples_per_s"] = med["raw"], med["jpeg:90"]
    res["ratio"] = med["jpeg:90"] / med["raw"]
    say(table([["raw", f"{raw_bytes:,}", f"{med['raw']:,.0f}", "1.0x"],
               ["jpeg:90", f"{jpg_bytes:,}", f"{med['jpeg:90']:,.0f}", f"{res['ratio']:.2f}x"]],
              header=["store", bytes_header, "samples/s (median of 2)", "vs raw"]))


def part_ltr(work: str, n: int, seed: int) -> dict[str, Any]:
    if not os.path.isdir(CG_ROOT) or os.geteuid() != 0:
        say(f"ltr: skipped (needs root and cgroup v1 at {CG_ROOT})")
        return {"skipped": "no cgroup v1 memory controller or not root"}
    imgs, _ = photo_variants(min(n, 2000), seed + 1)
    raw = write_store(os.path.join(work, "ltr-raw.store"), imgs, "raw", n)
    jpg = write_store(os.path.join(work, "ltr-jpeg90.store"), imgs, "jpeg:90", n)
    raw_bytes, jpg_bytes = data_bytes(raw), data_bytes(jpg)
    limit = raw_bytes // 4
    cg = os.path.join(CG_ROOT, f"mmstore_bench_compact_{os.getpid()}")
    os.makedirs(cg, exist_ok=True)
    res: dict[str, Any] = {"records": n, "raw_bytes": raw_bytes, "jpeg90_bytes": jpg_bytes, "limit_bytes": limit,
                           "runs": []}
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as fh:
            fh.write(str(limit))
        for rep in range(2):
            for kind, p in (("raw", raw), ("jpeg:90", jpg)):
                r = _in_cgroups([cg], p)
                r.update(kind=kind, rep=rep)
                res["runs"].append(r)
                say(f"  ltr {kind} rep {rep}: {r['samples_per_s']:,.0f} samples/s (anonymous memory "
                    f"{r['rss_anon_mib']:.0f} MiB)")
        with open(os.path.join(cg, "memory.max_usage_in_bytes")) as fh:
            res["cgroup_max_usage_bytes"] = int(fh.read())
    finally:
        os.rmdir(cg)
    _raw_vs_jpeg(res, raw_bytes, jpg_bytes, f"data bytes (limit {limit:,})")
    for p in (raw, jpg):
        shutil.rmtree(p)
    return res


def _sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


def _in_cgroups(cgs: list[str], path: str) -> dict[str, Any]:
    def join() -> None:
        for cg in cgs:
            with open(os.path.join(cg, "tasks"), "w") as fh:
                fh.write(str(os.getpid()))

    p = subprocess.run([sys.executable, __file__, "--child-ltr", path], capture_output=True, text=True,
                       preexec_fn=join, timeout=900, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def part_hdd(work: str, n: int, seed: int, iops: int = 120, mbps: int = 150, mem_mb: int = 600) -> dict[str, Any]:
    """A modelled spinning disk: both stores on a loop-mounted ext4 whose loop
    device the blkio cgroup throttles to ``iops`` read IOs/s and ``mbps`` MB/s, read in a child in that
    cgroup and a ``mem_mb`` memory cgroup (so neither store is served from the page cache)."""
    blk_root = "/sys/fs/cgroup/blkio"
    if os.geteuid() != 0 or not os.path.isdir(blk_root) or not os.path.isdir(CG_ROOT):
        say("hdd: skipped (needs root and cgroup v1 blkio + memory)")
        return {"skipped": "needs root and cgroup v1 blkio + memory controllers"}
    imgs, _ = photo_variants(min(n, 2000), seed + 2)
    img, mnt = os.path.join(work, "hdd.img"), os.path.join(work, "hdd-mnt")
    os.makedirs(mnt, exist_ok=True)
    with open(img, "wb") as fh:
        fh.truncate(int(n * SIDE * SIDE * 3 * 1.4) + (512 << 20))
    _sh("mkfs.ext4", "-q", "-F", img)
    _sh("mount", "-o", "loop", img, mnt)
    blk = os.path.join(blk_root, f"mmstore_bench_hdd_{os.getpid()}")
    mem = os.path.join(CG_ROOT, f"mmstore_bench_hdd_{os.getpid()}")
    res: dict[str, Any] = {"records": n, "iops": iops, "mbps": mbps, "mem_mb": mem_mb, "runs": []}
    try:
        raw = write_store(os.path.join(mnt, "raw.store"), imgs, "raw", n)
        jpg = write_store(os.path.join(mnt, "jpeg90.store"), imgs, "jpeg:90", n)
        res["raw_bytes"], res["jpeg90_bytes"] = data_bytes(raw), data_bytes(jpg)
        _sh("sync")
        majmin = _sh("lsblk", "-n", "-d", "-o", "MAJ:MIN", _sh("findmnt", "-n", "-o", "SOURCE", mnt)).strip()
        os.makedirs(blk)
        os.makedirs(mem)
        with open(os.path.join(blk, "blkio.throttle.read_iops_device"), "w") as fh:
            fh.write(f"{majmin} {iops}")
        with open(os.path.join(blk, "blkio.throttle.read_bps_device"), "w") as fh:
            fh.write(f"{majmin} {mbps * 1000 * 1000}")
        with open(os.path.join(mem, "memory.limit_in_bytes"), "w") as fh:
            fh.write(str(mem_mb << 20))
        for rep in range(2):
            for kind, p in (("raw", raw), ("jpeg:90", jpg)):
                r = _in_cgroups([blk, mem], p)
                r.update(kind=kind, rep=rep)
                res["runs"].append(r)
                say(f"  hdd {kind} rep {rep}: {r['samples_per_s']:,.0f} samples/s")
    finally:
        for cg in (blk, mem):
            if os.path.isdir(cg):
                os.rmdir(cg)
        _sh("umount", mnt)
        os.remove(img)
    _raw_vs_jpeg(res, res["raw_bytes"], res["jpeg90_bytes"], f"data bytes ({iops} IO/s, {mbps} MB/s, {mem_mb} MB)")
    return res


# -- 3. warm, decode-bound -------------------------------------------------------------------------


def _folder_rate(folder: list[str], workers: int, epochs: int) -> list[float]:
    """samples/s of ``epochs`` DataLoader epochs over the JPEG files (the first
    one also starts the workers and brings the files into the page cache)."""
    import torch
    from torch.utils.data import DataLoader

    from mmstore.cli.demo import _JpegFolder

    ds = _JpegFolder(folder, list(range(len(folder))), SIDE)
    dl = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=True,
                    generator=torch.Generator().manual_seed(0))
    rates = []
    for _ in range(epochs):
        t0, seen = time.perf_counter(), 0
        for x, _y in dl:
            seen += len(x)
        rates.append(seen / (time.perf_counter() - t0))
    return rates


def interleaved(cases: dict[str, Any], rounds: int = 3) -> dict[str, list[float]]:
    """Run every case once per round, round-robin, so that a busy moment of a
    shared machine hits all of them; each case returns a list of rates."""
    out: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            out[k].extend(fn())
    return out


def part_warm(work: str, n: int, seed: int) -> dict[str, Any]:
    import cv2

    imgs, crops = photo_variants(n, seed + 2)
    path = write_store(os.path.join(work, "warm-jpeg90.store"), imgs, "jpeg:90")
    c, k = parse_codec("jpeg:90"), cores()
    entries = [c.encode(im) for im in imgs]  # the same bytes as the store's (deterministic encoder)
    folder_dir = os.path.join(work, "warm-originals")
    os.makedirs(folder_dir, exist_ok=True)
    files = []
    for i, crop in enumerate(crops):
        f = os.path.join(folder_dir, f"{i:06d}.jpg")
        cv2.imwrite(f, crop[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 95])
        files.append(f)
    loader_epoch(path, "permutation")  # the store's files into the page cache
    runs = interleaved({
        "limit": lambda: [decode_rate(c, entries, np.empty((SIDE, SIDE, 3), np.uint8), k, 2.0)],
        "loader": lambda: loader_epoch(path, "permutation", epochs=2),
        "folder": lambda: _folder_rate(files[: max(BATCH * 2, n // 4)], k, 2)[1:],  # a quarter: it is slow
    })
    loader, limit, folder = max(runs["loader"]), max(runs["limit"]), max(runs["folder"])
    res = {"images": n, "cores": k, "loader_samples_per_s": loader, "runs": runs,
           "decode_limit_samples_per_s": limit, "folder_samples_per_s": folder,
           "loader_vs_limit": loader / limit, "loader_vs_folder": loader / folder,
           "originals_mean_side": float(np.mean([c_.shape[0] for c_ in crops]))}
    say("  best of 3 interleaved rounds each (the machine is shared)")
    say(table([["Loader, jpeg:90 store (warm)", f"{loader:,.0f}", "1.00x"],
               [f"decode limit ({k} threads, bytes in RAM)", f"{limit:,.0f}", f"{loader / limit:.2f}x"],
               [f"JPEG folder, DataLoader({k} workers)", f"{folder:,.0f}", f"{loader / folder:.2f}x"]],
              header=["path", "samples/s", "Loader / this"]))
    shutil.rmtree(path)
    shutil.rmtree(folder_dir)
    return res


# -- 4. open time ------------------------------------------------------------------------------


def _tiny_store(path: str, slots: int) -> str:
    """A store of ``slots`` records of one zstd field ``x`` (4 zero bytes), written
    by StoreWriter for a few slots, then extended to ``slots`` the way the
    format (format.py) lays it out: the same entry repeated, its offsets, the
    same checksum, no keys; the bookkeeping digests and the manifest redone."""
    import xxhash

    from mmstore.format import layout as fmt

    seedn = 4
    if os.path.exists(path):
        shutil.rmtree(path)
    with mmstore.StoreWriter(path, {"x": ("|u1", (4,), "zstd:1")}) as w:
        for _ in range(seedn):
            w.append({"x": np.zeros(4, np.uint8)})
    if slots == seedn:
        return path
    with open(os.path.join(path, fmt.MANIFEST_FILE)) as fh:
        man = json.load(fh)
    with open(os.path.join(path, "x.bin"), "rb") as fh:
        blob = fh.read()
    size = len(blob) // seedn  # every entry is the same frame (a deterministic encoder)
    entry = blob[:size]

    def npy(name: str, arr: np.ndarray) -> None:
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(fmt.npy_header(arr.dtype, arr.shape))
            fh.write(arr.tobytes())

    with open(os.path.join(path, "x.bin"), "wb") as fh:
        chunk = entry * 100_000
        fh.writelines(chunk[: size * min(100_000, slots - a)] for a in range(0, slots, 100_000))
    npy("x.offsets.npy", np.arange(slots + 1, dtype="<u8") * np.uint64(size))
    with open(os.path.join(path, fmt.CHECKSUMS_FILE), "rb") as fh:
        hdr = len(fmt.npy_header(fmt.KEY_DTYPE, (seedn,)))
        one = np.frombuffer(fh.read()[hdr : hdr + 8], "<u8")[0]
    sums = np.full(slots, one, "<u8")
    npy(fmt.CHECKSUMS_FILE, sums)
    npy(fmt.KEYS_OFFSETS_FILE, np.zeros(slots + 1, "<u8"))
    man["records"] = man["slots"] = slots
    man["checksum"]["digest"] = xxhash.xxh3_64_hexdigest(sums.tobytes())
    for name in man["files"]:
        man["files"][name] = os.path.getsize(os.path.join(path, name))
    for name in man.get("digests", {}):
        with open(os.path.join(path, name), "rb") as fh:
            man["digests"][name] = xxhash.xxh3_64_hexdigest(fh.read())
    with open(os.path.join(path, fmt.MANIFEST_FILE), "w") as fh:
        json.dump(man, fh)
    return path


def _open_s(path: str, reps: int = 30) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mmstore.open(path).close()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def part_open(work: str) -> dict[str, Any]:
    small = _tiny_store(os.path.join(work, "open-1k.store"), 1000)
    big = _tiny_store(os.path.join(work, "open-10m.store"), 10_000_000)
    with mmstore.open(big) as s:  # the built store reads back: first, middle, last
        got = s.read_batch([0, 5_000_000, 9_999_999])["x"]
        if got.shape != (3, 4) or got.any():
            raise RuntimeError("the 10M-slot store does not read back")
    off = os.path.join(big, "x.offsets.npy")
    _os.evict(off)
    s = mmstore.open(big)
    resident = _os.resident_bytes(off)[0]
    s.close()
    t_small, t_big = _open_s(small), _open_s(big)
    res = {"small_slots": 1000, "big_slots": 10_000_000, "small_open_s": t_small, "big_open_s": t_big,
           "ratio": t_big / t_small, "offsets_file_bytes": os.path.getsize(off),
           "offsets_resident_after_open": resident}
    say(table([["1,000 slots", f"{t_small * 1e3:.2f}", "1.00x"],
               ["10,000,000 slots", f"{t_big * 1e3:.2f}", f"{t_big / t_small:.2f}x"]],
              header=["compact store", "open+close ms (median of 30)", "vs 1,000"]))
    say(f"  offsets file {os.path.getsize(off):,} bytes; resident after opening it cold: {resident:,} bytes")
    shutil.rmtree(small)
    shutil.rmtree(big)
    return res


# -- 6. FFCV's images --------------------------------------------------------------------------


# -- main --------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import simplejpeg
    import zstandard

    info = {"python": platform.python_version(), "numpy": np.__version__, "cores": cores(),
            "cpus": os.cpu_count(), "kernel": platform.release(), "simplejpeg": simplejpeg.__version__,
            "zstandard": zstandard.__version__, "mem_available": _os.mem_available(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import cv2
        import torch

        info.update(opencv=cv2.__version__, torch=torch.__version__)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/bench_compact")
    ap.add_argument("--parts", default="size,quality,ltr,hdd,warm,open,ffcv")
    ap.add_argument("--photos", type=int, default=600, help="photo variants for size, quality and warm")
    ap.add_argument("--demo", type=int, default=300, help="demo images for size")
    ap.add_argument("--ltr-records", type=int, default=30_000,
                    help="records of the larger-than-RAM stores (30,000: 4.5 GB raw, so that 1/4 of it holds the "
                         "Loader process's own ~350 MB and the jpeg:90 store)")
    ap.add_argument("--hdd-records", type=int, default=6000,
                    help="records of the spinning-disk stores (part hdd; 6,000: 900 MB raw)")
    ap.add_argument("--ffcv-images", type=int, default=2000)
    ap.add_argument("--ffcv-dir", default=None,
                    help="a directory holding FFCV's peer benchmark script bench_ffcv.py (part ffcv)")
    ap.add_argument("--ffcv-python", default=None,
                    help="a Python with FFCV installed (e.g. /tmp/ffcvvenv/bin/python): part ffcv runs FFCV's "
                         "Loader in a child process of it on the same images; without it only mmstore is measured")
    ap.add_argument("--ffcv-rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child-ltr", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_ltr:
        print(json.dumps(_child_ltr(a.child_ltr)))
        return 0
    parts = [p for p in a.parts.split(",") if p]
    work = os.path.abspath(a.dir)
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine()}
    say(f"machine: {json.dumps(res['machine'])}")
    photos = None
    if "size" in parts or "quality" in parts:
        photos, _ = photo_variants(a.photos, a.seed)
    for part in parts:
        say(f"\n== {part}")
        t = time.perf_counter()
        if part == "size":
            res[part] = part_size(work, {"photos": photos, "demo": demo_images(a.demo, a.seed)})
        elif part == "quality":
            res[part] = part_quality(photos)
        elif part == "ltr":
            res[part] = part_ltr(work, a.ltr_records, a.seed)
        elif part == "hdd":
            res[part] = part_hdd(work, a.hdd_records, a.seed)
        elif part == "warm":
            res[part] = part_warm(work, a.photos * 4, a.seed)
        elif part == "open":
            res[part] = part_open(work)
        elif part == "ffcv":
            from bench_compact_ffcv import part_ffcv

            res[part] = part_ffcv(work, a.ffcv_images, a.ffcv_dir, a.ffcv_python, a.ffcv_rounds)
        else:
            ap.error(f"unknown part {part!r}")
        say(f"({part}: {time.perf_counter() - t:.0f} s)")
    res["seconds"] = time.perf_counter() - t0
    text = json.dumps(res, indent=1, default=str)
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(text)
    say("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
