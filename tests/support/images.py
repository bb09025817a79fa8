"""Image generators: photo-like images (smooth, so JPEG behaves as on real
photos), their encoded bytes, and folders of them with broken inputs."""

from __future__ import annotations

import os

import numpy as np


def photo(rng: np.random.Generator, h: int, w: int, ch: int = 3) -> np.ndarray:
    """A smooth photo-like RGB image (gradient + a disc + a little noise);
    ``ch=1`` gives its first channel."""
    import cv2

    y, x = np.mgrid[0:h, 0:w]
    img = np.zeros((h, w, 3), np.float32)
    img[..., 0] = 255 * x / max(w - 1, 1)
    img[..., 1] = 255 * y / max(h - 1, 1)
    img[..., 2] = rng.integers(0, 256)
    cv2.circle(img, (int(rng.integers(0, w)), int(rng.integers(0, h))), int(rng.integers(3, max(4, min(h, w) // 2))),
               tuple(float(v) for v in rng.integers(0, 256, 3)), -1)
    img += rng.normal(0, 6, img.shape)
    out = np.clip(img, 0, 255).astype(np.uint8)
    return out[..., 0] if ch == 1 else out


def marked_photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image that is not symmetric (smooth gradients,
    texture, a red marker in the top-left corner), so a flip, rotation or
    channel swap shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 128 + 100 * np.sin(x / (w / 3 + 1) + seed)
    g = 255 * y / max(h - 1, 1)
    b = 128 + 90 * np.cos((x + 2 * y) / (min(h, w) / 4 + 1))
    img = np.stack([r, g, b], -1) + rng.normal(0, 6, (h, w, 3))
    img = np.clip(img, 0, 255).astype(np.uint8)
    img[: max(1, h // 4), : max(1, w // 5)] = (250, 20, 20)
    return img


def encode(img: np.ndarray, ext: str = ".jpg", params=(), rgb: bool = False) -> bytes:
    """``img`` encoded by OpenCV as ``ext`` with OpenCV ``params``. Its
    channels are in OpenCV's (BGR) order unless ``rgb``; a 2-D array is gray."""
    import cv2

    if rgb and img.ndim == 3:
        img = img[..., ::-1]
    ok, buf = cv2.imencode(ext, np.ascontiguousarray(img), list(params))
    if not ok:
        raise ValueError(f"OpenCV could not encode a {img.shape} {img.dtype} image as {ext}")
    return buf.tobytes()


def write_image(path, img: np.ndarray, ext: str = ".jpg", rgb: bool = False, quality: int = 90) -> bytes:
    """Write ``img`` (see ``encode``) as ``ext`` (JPEG at ``quality``) to ``path``; return the bytes."""
    import cv2

    params = [cv2.IMWRITE_JPEG_QUALITY, quality] if ext.lower() in (".jpg", ".jpeg") else []
    data = encode(img, ext, params, rgb=rgb)
    with open(path, "wb") as fh:
        fh.write(data)
    return data


def make_folder(root: str, classes=("cat", "dog"), per_class: int = 6, seed: int = 0, exts=(".jpg", ".png"),
                name: str = "img{:03d}", sizes=(20, 64)) -> list[str]:
    """An ImageFolder of photo-like images of random sizes in [sizes) (files
    ``<class>/<name><ext>``, or ``<name><ext>`` at the root for class "");
    returns the relative paths, sorted (the slot order)."""
    rng = np.random.default_rng(seed)
    rels = []
    for c in classes:
        d = os.path.join(root, c) if c else root
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(*sizes, 2))
            ext = exts[i % len(exts)]
            fname = name.format(i) + ext
            write_image(os.path.join(d, fname), photo(rng, h, w), ext, rgb=True)
            rels.append(f"{c}/{fname}" if c else fname)
    return sorted(rels)


def make_source(root: str, n_per_class: int = 5, seed: int = 0, broken: bool = True) -> str:
    """A small ImageFolder (classes ant, bee; alternating JPEG / PNG) plus,
    with ``broken``, an empty file and an HTML page named ``.jpg``."""
    make_folder(root, ("ant", "bee"), n_per_class, seed, name="{:03d}", sizes=(24, 60))
    if broken:
        with open(os.path.join(root, "ant", "zz_empty.jpg"), "wb"):
            pass
        with open(os.path.join(root, "bee", "zz_html.jpg"), "wb") as fh:
            fh.write(b"<html><body>404 not found</body></html>")
    return root
