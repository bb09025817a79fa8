"""Shared helpers of the tools tests (imported as ``helpers`` via conftest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

import mmstore
from mmstore.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(argv, capsys):
    """main(argv) in-process; return (rc, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_json(argv, capsys):
    rc, out, err = run_cli(list(argv) + ["--json"], capsys)
    return rc, json.loads(out)


def run_sub(argv, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "mmstore", *[str(a) for a in argv]], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def small_image_store(path, n=10_000, backend="memmap", holes=(), side=16, channels=3, layout="hwc",
                      label_names=None, provenance=None):
    """n slots of side x side x channels uint8 images + an int64 label."""
    shape = (side, side, channels) if layout == "hwc" else (channels, side, side)
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    with mmstore.StoreWriter(path, {"image": ("|u1", shape), "label": ("<i8", ())}, slots=n, backend=backend,
                             label_names=label_names, provenance=provenance) as w:
        for s in range(n):
            if s in holes:
                w.skip(s, f"img/{s:05d}.png", "corrupt: test")
            else:
                w.write(s, {"image": imgs[s], "label": s % 5}, key=f"img/{s:05d}.png")
    return str(path), imgs


def flip_bit(path, offset, bit=0):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ (1 << bit)]))
