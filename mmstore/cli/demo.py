"""``mmstore demo``: see a store work on this machine, on generated data."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

EXAMPLE = """example:
  mmstore demo                 # generate, write, read back, print the summary
  mmstore demo --keep --workdir /tmp/mm
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="write a small store from generated data and read it back",
        description="Write a store of generated images and labels, read it back in shuffled "
        "batches, and print what happened.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--records", type=int, default=2000, help="records to generate (default 2000)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    p.add_argument("--workdir", help="where to write (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..reader import open_store
    from ..writer import StoreWriter

    work = args.workdir or tempfile.mkdtemp(prefix="mmstore-demo-")
    os.makedirs(work, exist_ok=True)
    dest = os.path.join(work, "demo.store")
    n, side = int(args.records), int(args.size)
    rng = np.random.default_rng(0)
    try:
        t0 = time.perf_counter()
        with StoreWriter(
            dest,
            {"image": ("|u1", (side, side, 3)), "label": ("<i8", ())},
            slots=n,
            overwrite=True,
            label_names=[f"class{k}" for k in range(10)],
            provenance={"source": "mmstore demo (generated)"},
        ) as w:
            for i in range(n):
                label = i % 10
                img = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                img[..., label % 3] = (img[..., label % 3] // 2) + 100
                w.write(i, {"image": img, "label": label}, key=f"generated/{i:06d}")
        t_write = time.perf_counter() - t0
        store = open_store(dest)
        perm = rng.permutation(n)
        t0 = time.perf_counter()
        seen = 0
        for a in range(0, n, 256):
            b = store.read_batch(perm[a : a + 256])
            seen += len(b["label"])
        t_read = time.perf_counter() - t0
        hist = np.bincount(store.column("label"), minlength=10)
        mb = store.schema.record_bytes * n / 1e6
        print(f"store      {dest}")
        print(f"records    {len(store)} x {store.schema}")
        print(f"written    {n} records, {mb:.1f} MB in {t_write:.2f} s ({n / t_write:,.0f} records/s)")
        print(f"read       {seen} records in shuffled batches of 256: {seen / max(t_read, 1e-9):,.0f} records/s")
        print(f"labels     {dict(zip(store.label_names or [], hist.tolist()))}")
        store.close()
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:
            shutil.rmtree(dest, ignore_errors=True)
    return 0
