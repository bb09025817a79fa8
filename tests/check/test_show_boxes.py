"""``show`` draws a store's boxes and their class names; tags and captions are captioned."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mmstore
from mmstore.check.show import class_color, render_grid, show_store
from mmstore.cli import main
from mmstore.format.schema import Schema

cv2 = pytest.importorskip("cv2")

SIDE = 40
SCHEMA = Schema(
    {"image": ("|u1", (SIDE, SIDE, 3)), "boxes": ("<f4", (None, 4)), "category": ("<i8", (None,)),
     "tags": ("<i4", (None,)), "text": str},
    classes={"category": {1: "person", 18: "dog"}, "tags": ["cat", "animal"]},
)
BOXES = [
    np.array([[4, 6, 20, 25], [10, 10, 38, 30]], np.float32),
    np.zeros((0, 4), np.float32),
    np.array([[0, 0, 40, 40]], np.float32),
    np.array([[2.0, 3.0, 12.0, 14.0], [np.nan, 0, 5, 5]], np.float32),
]
CATS = [[1, 18], [], [7], [18, 1]]


def _image(i: int) -> np.ndarray:
    return np.full((SIDE, SIDE, 3), 60 + 30 * i, np.uint8)


def _box_store(path, backend="memmap") -> str:
    with mmstore.StoreWriter(path, SCHEMA, slots=4, backend=backend) as w:
        for i in range(4):
            w.write(i, {"image": _image(i), "boxes": BOXES[i], "category": np.array(CATS[i], np.int64),
                        "tags": np.array([[0, 1], [], [1], [0]][i], np.int32), "text": ["a cat", "", "x", "é"][i]},
                    key=f"r{i}")
    return str(path)


def _tile(png, t):
    img = cv2.imread(str(png), cv2.IMREAD_COLOR)
    return img[t.y : t.y + t.h, t.x : t.x + t.w].astype(np.int16)


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_boxes_drawn_at_their_edges(tmp_path, backend):
    p = _box_store(tmp_path / "s", backend)
    drawn = show_store(p, tmp_path / "on.png", indices=[0, 1, 2, 3], cols=2, scale=3)
    plain = show_store(p, tmp_path / "off.png", indices=[0, 1, 2, 3], cols=2, scale=3, boxes=False)
    t0 = drawn.tiles[0]
    on, off = _tile(tmp_path / "on.png", t0), _tile(tmp_path / "off.png", plain.tiles[0])
    # without boxes the tile is the record's exact pixels (scaled by repetition)
    assert (off == np.repeat(np.repeat(_image(0), 3, 0), 3, 1)).all()
    # box [4, 6, 20, 25] of class 1 ('person'): its right edge column 20 * 3 - 1 = 59, rows 18 .. 74,
    # in the class's colour; its bottom edge row 74 from column 12 to 59
    person = np.array(class_color(1), np.int16)
    assert (on[31:70, 59] == person).all()
    assert (on[74, 40:60] == person).all()
    # box [10, 10, 38, 30] of class 18 ('dog'), drawn after: left edge column 30, rows 30 .. 89
    assert (on[41:90, 30] == np.array(class_color(18), np.int16)).all()
    assert (on[90, 30] == off[90, 30]).all() and (on[60, 29] == off[60, 29]).all()
    # inside a box (away from the name label) and outside every box: untouched
    assert (on[60:70, 20:28] == off[60:70, 20:28]).all()
    assert (on[100:, 0:25] == off[100:, 0:25]).all()
    # the name is written at the box's top-left: pixels there differ from the image
    assert (on[19:26, 13:30] != off[19:26, 13:30]).any(axis=-1).sum() > 10
    assert [b["name"] for b in t0.boxes] == ["person", "dog"]
    assert t0.boxes[0]["box"] == [4.0, 6.0, 20.0, 25.0] and t0.boxes[1]["category"] == 18
    # zero boxes: nothing drawn; an unnamed id is shown as its number; a non-finite box is not drawn
    assert drawn.tiles[1].boxes == [] and (_tile(tmp_path / "on.png", drawn.tiles[1])
                                           == _tile(tmp_path / "off.png", plain.tiles[1])).all()
    assert [b["name"] for b in drawn.tiles[2].boxes] == ["7"]
    assert [b["name"] for b in drawn.tiles[3].boxes] == ["dog"]
    # captions: tag names and the caption text first
    assert drawn.tiles[0].other["tags"] == "cat,animal" and drawn.tiles[0].other["text"] == "a cat"
    assert list(drawn.tiles[0].other)[:2] == ["tags", "text"]


def test_cli_no_boxes_and_json(tmp_path, capsys):
    p = _box_store(tmp_path / "s")
    assert main(["show", p, "-o", str(tmp_path / "a.png"), "--indices", "0,2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [len(t["boxes"]) for t in rep["tiles"]] == [2, 1]
    assert main(["show", p, "-o", str(tmp_path / "b.png"), "--indices", "0,2", "--no-boxes"]) == 0
    assert "box(es)" not in capsys.readouterr().out
    assert main(["show", p, "-o", str(tmp_path / "c.png"), "--indices", "0,2"]) == 0
    assert "2 box(es)" in capsys.readouterr().out
    a, b = cv2.imread(str(tmp_path / "a.png")), cv2.imread(str(tmp_path / "b.png"))
    assert a.shape == b.shape and (a != b).any()


def test_store_without_boxes_renders_as_before(tmp_path):
    """No boxes field: the image is the grid of the records' pixels and
    captions alone (render_grid), byte for byte, boxes on or off."""
    from support.stores import image_store

    p, _ = image_store(str(tmp_path / "plain"), n=20, side=16)
    on = show_store(p, tmp_path / "on.png", n=6, seed=3)
    show_store(p, tmp_path / "off.png", n=6, seed=3, boxes=False)
    assert (tmp_path / "on.png").read_bytes() == (tmp_path / "off.png").read_bytes()
    s = mmstore.open(p)
    idx = [t.index for t in on.tiles]
    imgs = s.read_batch(np.array(idx))["image"]
    caps = [[f"#{t.index} {t.label}" + (f" {t.label_name}" if t.label_name else ""), t.key]
            + [f"{k}={v}" for k, v in t.other.items()][:3] for t in on.tiles]
    canvas, _ = render_grid(imgs, caps, scale=on.scale)
    ok, enc = cv2.imencode(".png", canvas)
    assert ok and enc.tobytes() == (tmp_path / "on.png").read_bytes()
    assert all(t.boxes == [] for t in on.tiles)
