"""What the compact-records benchmarks share (``bench_compact.py``, its part
``bench_compact_ffcv.py``, and ``bench_ray.py``'s photos): the images, the
stores written from them, a checked Loader epoch, the CPU cost of a decode.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore
from mmstore import _os

SIDE = 224
BATCH = 256
PHOTOS_SKIMAGE = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
                  "stereo_motorcycle")


def cores() -> int:
    from mmstore.ingest.workers import default_workers

    return default_workers()


def say(*a: Any) -> None:
    print(*a, flush=True)


# -- images ------------------------------------------------------------------------------------


def real_photos() -> list[tuple[str, np.ndarray]]:
    """(name, RGB uint8) of every RGB sample photo of scikit-image and scikit-learn."""
    from skimage import data as skd
    from sklearn.datasets import load_sample_images

    out = []
    for name in PHOTOS_SKIMAGE:
        fn = getattr(skd, name, None)
        if fn is None:
            continue
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 - a photo that needs a download is left out
            say(f"  {name}: left out ({type(exc).__name__})")
            continue
        for k, img in enumerate(got[:2] if isinstance(got, tuple) else [got]):  # stereo: left and right
            out.append((f"{name}{k or ''}", np.asarray(img)))
    out = [(n, im) for n, im in out if im.ndim == 3 and im.shape[2] == 3 and im.dtype == np.uint8
           and min(im.shape[:2]) >= SIDE]
    sk = load_sample_images()
    for fname, img in zip(sk.filenames, sk.images):
        out.append((os.path.basename(fname).split(".")[0], np.asarray(img, np.uint8)))
    return out


def resize(img: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.resize(img, (SIDE, SIDE), interpolation=cv2.INTER_AREA)


def random_square(img: np.ndarray, rng: np.random.Generator, least: float) -> np.ndarray:
    """A square of ``img`` (side ``least``..1 of its short side, anywhere in it), flipped
    left-right half the time: one photo variant's draws, in this order."""
    h, w = img.shape[:2]
    s = int(min(h, w) * rng.uniform(least, 1.0))
    y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
    crop = img[y : y + s, x : x + s]
    if rng.integers(2):
        crop = crop[:, ::-1]
    return np.ascontiguousarray(crop)


def photo_variants(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``n`` 224x224 variants of the real photos and the crop each came from."""
    photos = real_photos()
    rng = np.random.default_rng(seed)
    small, crops = [], []
    for i in range(n):
        crop = random_square(photos[i % len(photos)][1], rng, 0.35)
        crops.append(crop)
        small.append(resize(crop))
    return small, crops


def demo_images(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` images of ``mmstore demo``'s generator (BGR there), as RGB 224x224."""
    from mmstore.cli.demo import _photo

    return [resize(_photo(np.random.default_rng([seed, i]), i % 10)[:, :, ::-1]) for i in range(n)]


# -- stores ------------------------------------------------------------------------------------


def write_store(path: str, images: Any, codec: str, n: int | None = None) -> str:
    """A store of ``image`` (224x224x3, ``codec``) + ``label`` (int64 i) from ``images[i]``."""
    if os.path.exists(path):
        shutil.rmtree(path)
    schema = {"image": ("|u1", (SIDE, SIDE, 3), codec), "label": ("<i8", ())}
    count = len(images) if n is None else n
    with mmstore.StoreWriter(path, schema) as w:
        for i in range(count):
            w.append({"image": images[i % len(images)], "label": np.int64(i)})
    return path


def field_bytes(path: str, name: str = "image") -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.split(".")[0] == name and f.endswith((".npy", ".bin")))


def data_bytes(path: str) -> int:
    with mmstore.open(path) as s:
        return sum(os.path.getsize(p) for p in s.slot_view.backend.data_paths())


def evict_store(path: str) -> None:
    for f in os.listdir(path):
        _os.evict(os.path.join(path, f))


def loader_epoch(path: str, order: str = "permutation", epochs: int = 1, **kw: Any) -> list[float]:
    """samples/s of ``epochs`` Loader epochs (each checked: every record exactly once)."""
    from mmstore.torch import Loader

    rates = []
    with mmstore.open(path) as s:
        n = s.records
    with Loader(path, BATCH, order=order, as_tuple=True, **kw) as ld:
        for e in range(epochs):
            if hasattr(ld, "set_epoch"):
                ld.set_epoch(e)
            seen = np.zeros(n, np.int64)
            t0 = time.perf_counter()
            for _img, lab in ld:
                seen[lab.numpy()] += 1
            rates.append(n / (time.perf_counter() - t0))
            if not (seen == 1).all():
                raise RuntimeError(f"{path}: an epoch did not read every record exactly once")
    return rates


# -- decoding ------------------------------------------------------------------------------------


def cpu_ms_per_decode(entries: list[bytes], fn: Any, reps: int = 3) -> float:
    """CPU milliseconds of one ``fn(entry)`` over ``entries``: the best of ``reps`` passes."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for e in entries:
            fn(e)
        best = min(best, (time.process_time() - t0) / len(entries))
    return best * 1e3
