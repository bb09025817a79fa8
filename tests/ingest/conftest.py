"""Fixtures for the ingest tests: small generated images and store comparison."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def photo(rng: np.random.Generator, h: int, w: int, ch: int = 3) -> np.ndarray:
    """A smooth photo-like image (gradient + shape + a little noise)."""
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


def write_image(path: str | bytes, img: np.ndarray, ext: str = ".jpg") -> bytes:
    ok, buf = cv2.imencode(ext, img, [cv2.IMWRITE_JPEG_QUALITY, 90] if ext in (".jpg", ".jpeg") else [])
    assert ok
    data = buf.tobytes()
    with open(path, "wb") as fh:
        fh.write(data)
    return data


def make_folder(root: str, classes=("cat", "dog"), per_class: int = 6, seed: int = 0, exts=(".jpg", ".png")) -> list[str]:
    """ImageFolder of small images of random sizes; returns the relative paths in slot order."""
    rng = np.random.default_rng(seed)
    rels = []
    for c in classes:
        d = os.path.join(root, c) if c else root
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(20, 64, 2))
            ext = exts[i % len(exts)]
            name = f"img{i:03d}{ext}"
            write_image(os.path.join(d, name), cv2.cvtColor(photo(rng, h, w), cv2.COLOR_RGB2BGR), ext)
            rels.append(f"{c}/{name}" if c else name)
    return sorted(rels)


def store_files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name == "manifest.json":
            continue
        with open(os.path.join(path, name), "rb") as fh:
            out[name] = fh.read()
    return out


def assert_same_store(a: str, b: str) -> None:
    fa, fb = store_files(a), store_files(b)
    assert sorted(fa) == sorted(fb), (sorted(fa), sorted(fb))
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a} and {b}"


def cli(*argv: str) -> int:
    from mmstore.cli import main

    return main([str(a) for a in argv])


def cli_subprocess(*argv: str, env=None, **kw) -> subprocess.Popen:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    if env:
        e.update(env)
    return subprocess.Popen([sys.executable, "-m", "mmstore", *map(str, argv)], env=e, cwd=REPO, **kw)


@pytest.fixture
def h():
    """Helper namespace."""
    return types.SimpleNamespace(
        photo=photo,
        write_image=write_image,
        make_folder=make_folder,
        store_files=store_files,
        assert_same_store=assert_same_store,
        cli=cli,
        cli_subprocess=cli_subprocess,
        REPO=REPO,
    )


@pytest.fixture
def folder(tmp_path):
    root = str(tmp_path / "imgs")
    rels = make_folder(root)
    return root, rels
