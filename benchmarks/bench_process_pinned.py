"""``Loader(process=True, device="cuda")`` with its shared memory pinned (the default) against the
same loader with ``pin_memory=False``: records/s of a sequential epoch to the GPU, best of three
epochs after a warm one, the two alternating in one run. Needs a CUDA device.

The store (4,096 records of 224x224x3 uint8 and a label, ~600 MB) is written under ``--dir`` once.

Usage::

    python benchmarks/bench_process_pinned.py [--dir /tmp/pinbench.store] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import mmstore
from mmstore.torch import Loader

N = 4096


def build(path: str) -> None:
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (64, 224, 224, 3), dtype=np.uint8)
    with mmstore.StoreWriter(path, {"image": ("|u1", (224, 224, 3)), "label": ("<i8", ())}, slots=N) as w:
        for i in range(N):
            w.write(i, {"image": img[i % 64], "label": np.int64(i)})


def epoch_rate(store: mmstore.Store, pin: bool) -> float:
    ld = Loader(store, 256, "sequential", device="cuda", process=True, pin_memory=pin)
    try:
        list(ld)  # the helper started, the pages in
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _b in ld:
                pass
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return N / best
    finally:
        ld.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/pinbench.store")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if not os.path.exists(a.dir):
        build(a.dir)
    store = mmstore.open(a.dir)
    for r in range(a.rounds):
        for pin in (True, False):
            rate = epoch_rate(store, pin)
            print(f"round {r} pin_memory={pin}: {rate:,.0f} records/s, {rate * 224 * 224 * 3 / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
