"""``show``: a captioned grid image of some records."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..reader import open_store
from .._names import ascii_text
from ._common import (
    check_output,
    find_image_field,
    find_label_field,
    sample_indices,
    to_hwc,
    write_output,
)

__all__ = ["ShowReport", "Tile", "render_grid", "show_store"]

PAD = 4
LINE_H = 12
FONT_SCALE = 0.33


@dataclass
class Tile:
    """Where record ``index`` sits in the grid: pixels ``[y:y+h, x:x+w]`` are
    the record's image (upscaled by ``scale`` with nearest neighbour)."""

    index: int
    slot: int
    key: str
    label: int | None
    label_name: str | None
    x: int
    y: int
    w: int
    h: int
    other: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShowReport:
    path: str
    output: str
    image_field: str
    layout: str
    channels: int
    scale: int
    width: int
    height: int
    color_order: str
    tiles: list[Tile] = field(default_factory=list)


def _summary(v: np.ndarray) -> str:
    v = np.asarray(v)
    if v.ndim == 0:
        x = v.item()
        return f"{x:.4g}" if isinstance(x, float) else str(x)
    if v.size <= 4:
        return "[" + ",".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in v.ravel().tolist()) + "]"
    return f"{'x'.join(map(str, v.shape))} mean {float(v.mean()):.3g}"


def render_grid(
    images: np.ndarray,
    captions: list[list[str]],
    *,
    cols: int | None = None,
    scale: int = 1,
    bgr_in: bool = False,
) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """Lay ``images`` (N, H, W, C uint8, C in 1|3, RGB unless ``bgr_in``) out in
    a grid with caption lines under each tile; return the BGR canvas (for
    ``cv2.imwrite``) and each tile's ``(x, y, w, h)``."""
    import cv2

    n, h, w, c = images.shape
    th, tw = h * scale, w * scale
    lines = max((len(cp) for cp in captions), default=0)
    cols = cols or max(1, math.ceil(math.sqrt(n)))
    rows = max(1, math.ceil(n / cols))
    cell_w = max(tw, 48)
    cell_h = th + lines * LINE_H + 2
    W = PAD + cols * (cell_w + PAD)
    H = PAD + rows * (cell_h + PAD)
    canvas = np.full((H, W, 3), 32, np.uint8)
    boxes = []
    max_chars = max(4, int(cell_w / (FONT_SCALE * 20)))
    for i in range(n):
        r, k = divmod(i, cols)
        x0 = PAD + k * (cell_w + PAD)
        y0 = PAD + r * (cell_h + PAD)
        img = images[i]
        if scale > 1:
            img = np.repeat(np.repeat(img, scale, axis=0), scale, axis=1)
        if c == 1:
            tile = np.repeat(img, 3, axis=2)
        else:
            tile = img if bgr_in else img[..., ::-1]
        canvas[y0 : y0 + th, x0 : x0 + tw] = tile
        boxes.append((x0, y0, tw, th))
        for j, text in enumerate(captions[i]):
            text = ascii_text(text)  # putText draws ASCII only (and crashes on lone surrogates)
            t = text if len(text) <= max_chars else text[: max_chars - 1] + "~"
            cv2.putText(canvas, t, (x0, y0 + th + (j + 1) * LINE_H - 2), cv2.FONT_HERSHEY_SIMPLEX,
                        FONT_SCALE, (230, 230, 230), 1, cv2.LINE_AA)
    return canvas, boxes


def show_store(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    n: int = 16,
    seed: int = 0,
    indices: list[int] | None = None,
    cols: int | None = None,
    scale: int | None = None,
    image_field: str | None = None,
    label_field: str | None = None,
) -> ShowReport:
    """Write a PNG grid of ``n`` random records (``seed``) or of ``indices``.

    Each tile is captioned with the dataset index, the label (and its name)
    and the source key; other non-image fields are summarised on extra lines.
    ``scale`` (default: enough to make tiles at least 96 pixels wide) enlarges
    small images by pixel repetition, so every tile is the record's exact
    pixels. Colour order: RGB unless the provenance says the store is BGR.

    Captions are drawn as printable ASCII (see :func:`ascii_text`: a byte of
    a name that is not valid UTF-8 shows as ``\\xNN``); the report keeps the
    names as they are.

    Raises
    ------
    ValueError
        No uint8 image field of shape (H, W, 1|3), (1|3, H, W) or (H, W).
    UsageError
        ``output`` is in a folder that does not exist, or inside the store.
    """
    import cv2

    check_output(path, output)
    store = open_store(path)
    try:
        found = find_image_field(store.schema, image_field)
        if found is None:
            raise ValueError(
                f"{store.path}: no image field (uint8 of shape (H, W, 1|3), (1|3, H, W) or (H, W)) "
                f"in {store.schema!r}; pass --image-field"
            )
        f, lay = found
        if indices is None:
            idx = sample_indices(store.records, n, seed)
            np.random.default_rng(seed).shuffle(idx)
        else:
            idx = store._as_indices(indices)
        if len(idx) == 0:
            raise ValueError(f"{store.path}: nothing to show (the store has {store.records} records)")
        batch = store.read_batch(idx)
        imgs = np.ascontiguousarray(to_hwc(batch[f.name], lay))
        ih, iw = imgs.shape[1:3]
        if scale is None:
            scale = max(1, math.ceil(96 / max(iw, 1)))
        lf = find_label_field(store.schema, label_field)
        names = store.label_names or []
        others = [g for g in store.schema if g.name != f.name and (lf is None or g.name != lf.name)]
        prov = store.provenance
        bgr = _is_bgr(prov)
        slots = store.slots_of(idx)
        tiles = []
        captions = []
        for j, i in enumerate(idx.tolist()):
            key = store.key(i)
            lab = int(batch[lf.name][j]) if lf is not None else None
            lname = names[lab] if lab is not None and 0 <= lab < len(names) else None
            cap = [f"#{i}" + (f" {lab}" if lab is not None else "") + (f" {lname}" if lname else ""), key]
            other = {g.name: _summary(batch[g.name][j]) for g in others}
            cap += [f"{k}={v}" for k, v in other.items()][:3]
            captions.append(cap)
            tiles.append(Tile(i, int(slots[j]), key, lab, lname, 0, 0, iw * scale, ih * scale, other))
        canvas, boxes = render_grid(imgs, captions, cols=cols, scale=scale, bgr_in=bgr)
        for t, (x, y, _, _) in zip(tiles, boxes):
            t.x, t.y = x, y
        out = os.fspath(output)
        ext = os.path.splitext(out)[1] or ".png"
        ok, enc = cv2.imencode(ext, canvas)
        if not ok:
            raise ValueError(f"{out}: OpenCV cannot write {ext} images; use .png")
        written = write_output(out, enc.tobytes())  # never through a link (see write_output)
        return ShowReport(store.path, written, f.name, lay, imgs.shape[3], scale,
                          canvas.shape[1], canvas.shape[0], "bgr" if bgr else "rgb", tiles)
    finally:
        store.close()


def _is_bgr(prov: dict[str, Any]) -> bool:
    for k in ("decode", "decode_spec", "spec"):
        d = prov.get(k)
        if isinstance(d, dict) and d.get("bgr") is True:
            return True
    return prov.get("bgr") is True or prov.get("color_order") == "bgr"
