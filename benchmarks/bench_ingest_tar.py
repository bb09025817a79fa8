#!/usr/bin/env python3
"""Ingest from local WebDataset tar shards against a bare decode + resize loop over the same bytes in
memory, as a ratio in one run (and the folder ingest of the same JPEGs beside it).

    python benchmarks/bench_ingest_tar.py [--dir /var/tmp/bench_ingest_tar] [--n 2000] [--per-shard 250]
                                          [--size 224] [--workers 2] [--rounds 3] [--json OUT]

Images: variants of the real photograph ``grace_hopper.jpg`` (matplotlib's sample data, 512 x 600): a random
crop of 40-100% of each side, a random flip, Gaussian noise of sigma 2 (a photograph's sensor noise), resized
(``INTER_AREA``) so that its long side is 256-512 pixels (DataComp's shards: long side at most 512), saved as
JPEG q90. They are written with ``tarfile`` into shards of ``--per-shard`` samples in img2dataset's layout
(``KEY.jpg`` and ``KEY.json``, what img2dataset writes without a caption column; with ``--captions`` a
``KEY.txt`` too, which the ingest stores as the field ``text``) and, for the comparison, as a folder of the same
JPEGs, so that both ingests store the same fields.

Cases, on a warm page cache:

* ``bare``: one process, ``cv2.setNumThreads(1)``: ``cv2.imdecode`` (RGB) of each image's bytes, already in
  memory, centre crop, ``cv2.resize(INTER_AREA)`` to ``--size``: the per-core speed limit. Its rate times
  ``--workers`` is what the ingest is compared with.
* ``tar``: ``mmstore.ingest('shards/{00000..N}.tar', DEST, size, workers=W)`` in a fresh process (index the
  shards, decode, write, checksums, fsync, commit log, manifest): wall time of the call.
* ``folder``: the same ingest of the folder.

Rounds alternate the cases, each ingest's ratio taken against the mean of the bare rates measured just before
and after it; a case's figure is the median ratio. Target: tar >= 0.8. On a machine shared with other work the
wall ratio moves with the load, so each case also gets a CPU ratio: the bare loop's CPU seconds per image over
the ingest's (every process of it, from ``getrusage``), what the ingest adds per image whatever the machine
does meanwhile. Prints a table and one JSON object (also written to --json).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def build(d: str, n: int, per_shard: int, captions: bool) -> tuple[str, str, list[bytes]]:
    """The shards, the folder and the JPEG bytes (built once per --dir)."""
    import cv2

    shards, folder = os.path.join(d, "shards"), os.path.join(d, "folder")
    done = os.path.join(d, "built.json")
    if not os.path.exists(done) or json.load(open(done)) != [n, per_shard, captions]:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(shards)
        os.makedirs(folder)
        from matplotlib import cbook

        photo = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
        rng = np.random.default_rng(0)
        ph, pw = photo.shape[:2]
        tar = None
        for i in range(n):
            if i % per_shard == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(os.path.join(shards, f"{i // per_shard:05d}.tar"), "w")
            ch, cw = int(ph * rng.uniform(0.4, 1.0)), int(pw * rng.uniform(0.4, 1.0))
            y, x = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
            crop = photo[y : y + ch, x : x + cw]
            if rng.integers(2):
                crop = crop[:, ::-1]
            long_side = int(rng.integers(256, 513))
            s = long_side / max(ch, cw)
            img = cv2.resize(np.ascontiguousarray(crop), (max(1, round(cw * s)), max(1, round(ch * s))),
                             interpolation=cv2.INTER_AREA).astype(np.float32)
            img = np.clip(img + rng.normal(0, 2, img.shape), 0, 255).astype(np.uint8)
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
            key = f"{i // per_shard:05d}{i % per_shard:04d}"
            jpg = buf.tobytes()
            with open(os.path.join(folder, key + ".jpg"), "wb") as fh:
                fh.write(jpg)
            meta = json.dumps({"key": key, "width": img.shape[1], "height": img.shape[0]}).encode()
            members = [("jpg", jpg), ("txt", f"photo {key}".encode()), ("json", meta)]
            for ext, data in members if captions else [members[0], members[2]]:
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))  # type: ignore[union-attr]
        if tar is not None:
            tar.close()
        with open(done, "w") as fh:
            json.dump([n, per_shard, captions], fh)
    jpegs = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as fh:
            jpegs.append(fh.read())
    for name in os.listdir(shards):  # warm the page cache
        with open(os.path.join(shards, name), "rb") as fh:
            while fh.read(1 << 24):
                pass
    return shards, folder, jpegs


def bare_rate(jpegs: list[bytes], size: int) -> tuple[float, float]:
    """Images per second and CPU seconds per image."""
    import cv2

    cv2.setNumThreads(1)
    c0 = time.process_time()
    t0 = time.perf_counter()
    for b in jpegs:
        img = cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR_RGB)
        h, w = img.shape[:2]
        s = min(h, w)
        y0, x0 = (h - s) // 2, (w - s) // 2
        cv2.resize(img[y0 : y0 + s, x0 : x0 + s], (size, size), interpolation=cv2.INTER_AREA)
    return len(jpegs) / (time.perf_counter() - t0), (time.process_time() - c0) / len(jpegs)


_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from mmstore.ingest import ingest

def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

c0 = cpu()
t0 = time.perf_counter()
r = ingest({src!r}, {dest!r}, ({size}, {size}), workers={workers}, quiet=True)
print(json.dumps(dict(elapsed=time.perf_counter() - t0, records=r.records, cpu=cpu() - c0)))
"""


def run_ingest(src: str, dest: str, size: int, workers: int) -> tuple[float, float]:
    """Records per second of one ingest in a fresh process, and its CPU seconds per record (every process)."""
    shutil.rmtree(dest, ignore_errors=True)
    code = _CHILD.format(repo=REPO, src=src, dest=dest, size=size, workers=workers)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return float(res["records"] / res["elapsed"]), float(res["cpu"] / res["records"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/bench_ingest_tar")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--per-shard", type=int, default=250)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--captions", action="store_true",
                    help="shards with a KEY.txt caption too (stored as the field text, which the folder lacks)")
    ap.add_argument("--json")
    a = ap.parse_args()
    shards, folder, jpegs = build(a.dir, a.n, a.per_shard, a.captions)
    last = (a.n - 1) // a.per_shard
    pattern = os.path.join(shards, f"{{00000..{last:05d}}}.tar")
    bare_rate(jpegs[:200], a.size)  # warm-up
    rows: dict[str, list[float]] = {"tar": [], "folder": []}
    cpu_rows: dict[str, list[float]] = {"tar": [], "folder": []}
    rates: dict[str, list[float]] = {"bare": [], "tar": [], "folder": []}
    for r in range(a.rounds):
        for case, src in (("tar", pattern), ("folder", folder)):
            b1, c1 = bare_rate(jpegs, a.size)
            got, cpu = run_ingest(src, os.path.join(a.dir, f"{case}.store"), a.size, a.workers)
            b2, c2 = bare_rate(jpegs, a.size)
            bare = (b1 + b2) / 2
            rates["bare"].append(bare)
            rates[case].append(got)
            rows[case].append(got / (a.workers * bare))
            cpu_rows[case].append((c1 + c2) / 2 / cpu)
            say(f"round {r}: {case:6s} {got:8.0f} img/s   bare {bare:6.0f} img/s/core   ratio "
                f"{rows[case][-1]:.3f}   CPU ratio {cpu_rows[case][-1]:.3f}")
    out = {
        "images": a.n, "shards": last + 1, "captions": a.captions, "size": a.size, "workers": a.workers,
        "rounds": a.rounds,
        "bare_per_core": statistics.median(rates["bare"]),
        "tar_rate": statistics.median(rates["tar"]), "folder_rate": statistics.median(rates["folder"]),
        "tar_ratio": statistics.median(rows["tar"]), "folder_ratio": statistics.median(rows["folder"]),
        "tar_cpu_ratio": statistics.median(cpu_rows["tar"]),
        "folder_cpu_ratio": statistics.median(cpu_rows["folder"]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    say(f"\n{'case':10s} {'img/s':>8s} {'ratio to W x bare':>18s} {'CPU ratio':>10s}")
    say(f"{'bare/core':10s} {out['bare_per_core']:8.0f}")
    for case in ("tar", "folder"):
        say(f"{case:10s} {out[case + '_rate']:8.0f} {out[case + '_ratio']:18.3f} {out[case + '_cpu_ratio']:10.3f}")
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
