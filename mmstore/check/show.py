"""``show``: a captioned grid image of some records.

A store with a ``boxes`` field (ragged, rows of 4 numbers: ``x0, y0, x1, y1``
in stored-image pixels, the layout of the COCO source) gets each record's
boxes drawn on its tile, named by the ``category`` field's class names (its
id when unnamed), one colour per class (:func:`class_color`). Tags (a ragged
integer field with class names) and text (``str``) fields are captioned
first, by name and by the start of the text."""

from __future__ import annotations

import colorsys
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.names import ascii_text
from ..store.reader import open_store
from .common import check_output, find_image_field, find_label_field, sample_indices, to_hwc, write_output

__all__ = ["ShowReport", "Tile", "class_color", "draw_boxes", "render_grid", "show_store"]

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
    boxes: list[dict[str, Any]] = field(default_factory=list)
    """The boxes drawn: ``{"box": [x0, y0, x1, y1], "category": id or None, "name": str or None}``."""


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


def _caption_value(f: Any, v: Any) -> str:
    """A field's value as a caption: a tags field's names, the start of a text, else :func:`_summary`."""
    if isinstance(v, str):
        return v[:80]
    if f.ragged and f.classes is not None and f.dtype.kind in "iu" and np.ndim(v) == 1:
        names = f.class_names
        return ",".join(names.get(int(k), str(int(k))) for k in v[:20])
    return _summary(v)


def class_color(cid: int | None) -> tuple[int, int, int]:
    """The BGR colour of class ``cid``: hues spread by the golden ratio, so
    neighbouring ids differ; green for a box without a class."""
    if cid is None:
        return (0, 255, 0)
    r, g, b = colorsys.hsv_to_rgb((int(cid) * 0.6180339887) % 1.0, 0.85, 1.0)
    return (int(b * 255), int(g * 255), int(r * 255))


def draw_boxes(tile: np.ndarray, boxes: np.ndarray, ids: np.ndarray | None, names: dict[int, str],
               scale: int) -> list[dict[str, Any]]:
    """Draw ``boxes`` (``(n, 4)`` xyxy in the record's pixels) on ``tile``
    (the record's image upscaled by ``scale``, BGR, drawn in place): a
    1-pixel rectangle along the edge pixels (columns ``x0 .. x1 - 1``, rows
    ``y0 .. y1 - 1``, clipped to the tile) in the class's colour, and the
    class name on a filled label at the box's top-left corner. Boxes with a
    non-finite coordinate are not drawn. Returns what was drawn."""
    import cv2

    th, tw = tile.shape[:2]
    out = []
    for r, b in enumerate(np.asarray(boxes, np.float64).reshape(-1, 4)):
        if not np.isfinite(b).all():
            continue
        cid = int(ids[r]) if ids is not None else None
        name = None if cid is None else names.get(cid, str(cid))
        color = class_color(cid)
        x0, x1 = (int(np.clip(round(v * scale), 0, tw)) for v in (b[0], b[2]))
        y0, y1 = (int(np.clip(round(v * scale), 0, th)) for v in (b[1], b[3]))
        cv2.rectangle(tile, (x0, y0), (max(x0, x1 - 1), max(y0, y1 - 1)), color, 1)
        if name:
            text = ascii_text(name)
            (w, h), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, FONT_SCALE, 1)
            ty = min(max(y0, 0), max(th - h - base, 0))
            cv2.rectangle(tile, (x0, ty), (x0 + w + 1, ty + h + base), color, -1)
            ink = (0, 0, 0) if sum(color) > 380 else (255, 255, 255)
            cv2.putText(tile, text, (x0 + 1, ty + h), cv2.FONT_HERSHEY_SIMPLEX, FONT_SCALE, ink, 1, cv2.LINE_AA)
        out.append({"box": [float(v) for v in b], "category": cid, "name": name})
    return out


def _box_fields(schema: Any) -> tuple[Any, Any]:
    """The ``boxes`` field (ragged rows of 4 numbers) and the ``category``
    field (ragged integers, one per box) of ``schema``, or None."""
    by_name = {f.name: f for f in schema}
    bf = by_name.get("boxes")
    if bf is None or not bf.ragged or bf.kind != "array" or bf.row_shape != (4,) or bf.dtype.kind not in "iuf":
        return None, None
    cf = by_name.get("category")
    if cf is not None and not (cf.ragged and cf.kind == "array" and cf.row_shape == () and cf.dtype.kind in "iu"):
        cf = None
    return bf, cf


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
    boxes: bool = True,
) -> ShowReport:
    """Write a PNG grid of ``n`` random records (``seed``) or of ``indices``.

    Each tile is captioned with the dataset index, the label (and its name)
    and the source key; other non-image fields are summarised on extra lines
    (tags and text first). With ``boxes`` (default) a ``boxes`` field is drawn
    on the tiles (see :func:`draw_boxes`; the module docstring for the
    fields), named by the ``category`` field.
    Images of their own shape are drawn each at its own size, at the top
    left of a tile of the largest. Of an image field with aspect buckets
    (and no ``indices``) a few records of every bucket are drawn, bucket by
    bucket from the tallest to the widest (``n`` shared among the buckets
    that hold records, at least one each), each captioned with its bucket.
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
        if indices is None and f.buckets and store.records:
            idx = _per_bucket(store, f, n, seed)
        elif indices is None:
            idx = sample_indices(store.records, n, seed)
            np.random.default_rng(seed).shuffle(idx)
        else:
            idx = store._as_indices(indices)
        if len(idx) == 0:
            raise ValueError(f"{store.path}: nothing to show (the store has {store.records} records)")
        batch = store.read_batch(idx)
        own = None  # images of their own shape: each drawn at its size, top-left in a tile of the largest
        if f.shaped:
            own = [to_hwc(a, lay) for a in batch[f.name]]
            imgs = np.full((len(own), max(a.shape[0] for a in own), max(a.shape[1] for a in own),
                            own[0].shape[2]), 32, np.uint8)
            for j, a in enumerate(own):
                imgs[j, : a.shape[0], : a.shape[1]] = a
        else:
            imgs = np.ascontiguousarray(to_hwc(batch[f.name], lay))
        ih, iw = imgs.shape[1:3]
        if scale is None:
            scale = max(1, math.ceil(96 / max(iw, 1)))
        lf = find_label_field(store.schema, label_field)
        names = store.label_names or []
        others = [g for g in store.schema if g.name != f.name and (lf is None or g.name != lf.name)]
        bf, cf = _box_fields(store.schema) if boxes else (None, None)
        drawn = {g.name for g in (bf, cf) if g is not None}
        # text and named tags say most about a record: caption them first (drawn boxes need no caption)
        others.sort(key=lambda g: g.name in drawn or not (g.kind == "str" or (g.ragged and g.classes is not None)))
        prov = store.provenance
        bgr = _is_bgr(prov)
        slots = store.slot_view.slots_of(idx)
        tiles = []
        captions = []
        for j, i in enumerate(idx.tolist()):
            key = store.key(i)
            lab = int(batch[lf.name][j]) if lf is not None else None
            lname = names[lab] if lab is not None and 0 <= lab < len(names) else None
            cap = [f"#{i}" + (f" {lab}" if lab is not None else "") + (f" {lname}" if lname else ""), key]
            if f.buckets and own is not None:
                cap[0] += f" bucket {own[j].shape[0]}x{own[j].shape[1]}"
            other = {g.name: _caption_value(g, batch[g.name][j]) for g in others}
            cap += [f"{k}={v}" for k, v in other.items()][:3]
            captions.append(cap)
            th, tw = (ih, iw) if own is None else own[j].shape[:2]
            tiles.append(Tile(i, int(slots[j]), key, lab, lname, 0, 0, tw * scale, th * scale, other))
        canvas, grid = render_grid(imgs, captions, cols=cols, scale=scale, bgr_in=bgr)
        for t, (x, y, _, _) in zip(tiles, grid):
            t.x, t.y = x, y
        if bf is not None:
            _draw_all(canvas, tiles, batch, bf, cf, scale)
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


def _per_bucket(store: Any, f: Any, n: int, seed: int) -> np.ndarray:
    """About ``n`` records of bucketed field ``f``: an equal share of every
    bucket that holds records (at least one each), drawn with ``seed``,
    bucket by bucket."""
    from ..format.shaped import bucket_ids

    ids = bucket_ids(f, store.column(f.hw_name))
    used = [k for k in range(len(f.buckets)) if (ids == k).any()]
    per = max(1, math.ceil(n / max(1, len(used))))
    rng = np.random.default_rng(seed)
    out = []
    for k in used:
        mine = np.flatnonzero(ids == k)
        out.append(np.sort(rng.choice(mine, min(per, len(mine)), replace=False)))
    return np.concatenate(out).astype(np.int64)


def _draw_all(canvas: np.ndarray, tiles: list[Tile], batch: dict[str, Any], bf: Any, cf: Any, scale: int) -> None:
    """Draw each tile's boxes; a category field with another number of rows than the boxes names none."""
    names = cf.class_names if cf is not None else {}
    for j, t in enumerate(tiles):
        bx = batch[bf.name][j]
        ids = batch[cf.name][j] if cf is not None else None
        if ids is not None and len(ids) != len(bx):
            ids = None
        if not len(bx):
            continue
        view = canvas[t.y : t.y + t.h, t.x : t.x + t.w]
        tile = np.ascontiguousarray(view)
        t.boxes = draw_boxes(tile, bx, ids, names, scale)
        view[...] = tile


def _is_bgr(prov: dict[str, Any]) -> bool:
    for k in ("decode", "decode_spec", "spec"):
        d = prov.get(k)
        if isinstance(d, dict) and d.get("bgr") is True:
            return True
    return prov.get("bgr") is True or prov.get("color_order") == "bgr"
