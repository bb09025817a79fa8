"""mmstore.decode.geometry: the stored transform (box -> dst) against the decode itself, its inverse,
the clip/drop rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore
from mmstore.decode import DecodeSpec, decode_image
from mmstore.decode.geometry import Transform, clip_boxes, clip_polygon, derive_dst, to_source, to_stored, transform_of
from mmstore.errors import GeometryError

cv2 = pytest.importorskip("cv2")


@st.composite
def transforms(draw):
    x0, y0 = draw(st.integers(0, 500)), draw(st.integers(0, 500))
    box = (x0, y0, x0 + draw(st.integers(1, 4000)), y0 + draw(st.integers(1, 4000)))
    u0, v0 = draw(st.integers(0, 300)), draw(st.integers(0, 300))
    dst = (u0, v0, u0 + draw(st.integers(1, 1024)), v0 + draw(st.integers(1, 1024)))
    return Transform(box, dst)


coords = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)


@given(transforms(), st.lists(st.tuples(coords, coords, coords, coords), min_size=0, max_size=8))
@settings(max_examples=300, deadline=None)
def test_round_trip_points_and_boxes(t, rows):
    boxes = np.array(rows, np.float64).reshape(-1, 4)
    there = to_stored(boxes, t)
    assert there.dtype == np.float64 and there.shape == boxes.shape
    assert np.allclose(to_source(there, t), boxes, rtol=1e-9, atol=1e-6)
    pts = boxes.reshape(-1, 2)
    assert np.allclose(to_stored(to_source(pts, t), t), pts, rtol=1e-9, atol=1e-6)
    # the box edges map exactly onto dst
    assert np.allclose(to_stored(np.array([t.box], float), t), [t.dst])


def test_transform_forms_and_errors():
    t = Transform((10, 0, 110, 50), (0, 0, 20, 10))
    rec = {"box": np.array(t.box, "<i4"), "dst": np.array(t.dst, "<i4")}
    p = np.array([[60.0, 25.0]])
    for form in (t, rec, (t.box, t.dst)):
        assert np.allclose(to_stored(p, form), [[10.0, 5.0]])
    per_row = (np.array([t.box, (0, 0, 10, 10)]), np.array([t.dst, (0, 0, 20, 20)]))
    assert np.allclose(to_stored(np.array([[60.0, 25.0], [5.0, 5.0]]), per_row), [[10, 5], [10, 10]])
    with pytest.raises(GeometryError):
        to_stored(np.zeros((2, 3)), t)
    with pytest.raises(GeometryError):
        transform_of({"box": [0, 0, 1, 1], "orig_size": [1, 1]})  # no dst, no store to derive it from
    with pytest.raises(GeometryError):
        transform_of(((0, 0, 0, 5), (0, 0, 4, 4)))  # empty source box


def test_clip_and_drop_rule():
    dst = (5, 0, 25, 30)
    boxes = np.array([[6, 1, 20, 10],       # inside: kept, not clipped
                      [0, 2, 10, 12],       # crosses the left edge (into the pad border): clipped
                      [0, 0, 5.5, 10],      # 0.5 px wide once clipped: dropped
                      [30, 0, 40, 10],      # outside: dropped
                      [7, 29, 9, 30.0]])    # exactly 1 px high: kept
    out, keep, clipped = clip_boxes(boxes, dst)
    assert keep.tolist() == [True, True, False, False, True]
    assert clipped.tolist() == [False, True, False, False, False]
    assert out[1].tolist() == [5, 2, 10, 12]
    _, keep2, _ = clip_boxes(boxes, dst, min_size=0.25)
    assert keep2.tolist() == [True, True, True, False, True]
    # a triangle cut by the right edge: exact intersection
    tri = np.array([[0, 0], [20, 0], [0, 20.0]])
    c = clip_polygon(tri, (0, 0, 10, 20))
    assert sorted(map(tuple, c.tolist())) == sorted([(0, 0), (10, 0), (10, 10), (0, 20)])
    assert len(clip_polygon(tri + 100, (0, 0, 10, 10))) == 0


def _png(img):
    ok, buf = cv2.imencode(".png", img)
    assert ok
    return np.frombuffer(buf, np.uint8)


@given(
    h=st.integers(6, 90), w=st.integers(6, 90), th=st.integers(6, 48), tw=st.integers(6, 48),
    policy=st.sampled_from(["center-crop", "stretch", "pad"]),
    fx=st.tuples(st.floats(0, 1), st.floats(0, 1)), fy=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_box_lands_where_the_rectangle_pixels_land(h, w, th, tw, policy, fx, fy):
    """A filled rectangle drawn in a source lands, after the real decode, where
    to_stored + clip says (within the resampling blur: 1 stored pixel)."""
    x0, x1 = sorted(round(f * w) for f in fx)
    y0, y1 = sorted(round(f * h) for f in fy)
    if x1 - x0 < 1 or y1 - y0 < 1:
        return
    src = np.zeros((h, w), np.uint8)
    src[y0:y1, x0:x1] = 255
    spec = DecodeSpec(size=(th, tw), resize=policy, channels=1)
    d = decode_image(_png(src), spec)
    assert d.dst == derive_dst(d.orig_size, spec)
    got, keep, _ = clip_boxes(to_stored([[x0, y0, x1, y1]], (d.box, d.dst)), d.dst, min_size=0)
    want = got[0]
    if not keep[0] or min(want[2] - want[0], want[3] - want[1]) < 2.5:
        return  # cropped away, or too thin to survive the resampling as a clear edge
    mask = d.image[..., 0] >= 128
    ys, xs = np.nonzero(mask)
    assert len(xs), (want, d.box, d.dst)
    seen = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], float)
    assert np.all(np.abs(seen - want) <= 1.0), (seen, want, d.box, d.dst)
    # and back: the stored pixels' box maps into the source within one stored pixel's size
    back = to_source(seen[None], (d.box, d.dst))[0]
    px = np.array([(d.box[2] - d.box[0]) / (d.dst[2] - d.dst[0]), (d.box[3] - d.box[1]) / (d.dst[3] - d.dst[1])])
    clipped_src = to_source(want[None], (d.box, d.dst))[0]
    assert np.all(np.abs(back - clipped_src) <= np.tile(px, 2) + 1e-9)


def test_old_store_without_dst_derives_it(tmp_path):
    spec = DecodeSpec(size=(16, 24), resize="pad")
    sch = {"image": ("|u1", spec.record_shape()), "orig_size": ("<i4", (2,)), "box": ("<i4", (4,))}
    prov = {"ingest": {"params": {"decode": spec.to_dict()}}}
    with mmstore.StoreWriter(str(tmp_path / "old"), sch, slots=1, provenance=prov) as w:
        w.write(0, {"image": np.zeros(spec.record_shape(), np.uint8), "orig_size": [40, 100], "box": [0, 0, 100, 40]})
    s = mmstore.open(str(tmp_path / "old"))
    t = transform_of(s[0], s)
    assert t.dst == (0, 3, 24, 13) == derive_dst((40, 100), spec)  # nh = round(40 * 24 / 100) = 10, oy = 3
    with mmstore.StoreWriter(str(tmp_path / "bare"), sch, slots=1) as w:
        w.write(0, {"image": np.zeros(spec.record_shape(), np.uint8), "orig_size": [40, 100], "box": [0, 0, 100, 40]})
    b = mmstore.open(str(tmp_path / "bare"))
    with pytest.raises(GeometryError, match="decode spec"):
        transform_of(b[0], b)


@given(st.lists(st.tuples(st.floats(-50, 150, allow_subnormal=False), st.floats(-50, 150, allow_subnormal=False)),
                min_size=3, max_size=12),
       st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 80), st.integers(1, 80)))
@settings(max_examples=300, deadline=None)
def test_clip_polygon_stays_in_the_area(pts, rect):
    x0, y0, w, h = rect
    area = (x0, y0, x0 + w, y0 + h)
    p = np.array(pts, np.float64)
    c = clip_polygon(p, area)
    assert c.ndim == 2 and c.shape[1] == 2
    assert np.all(c[:, 0] >= area[0] - 1e-9) and np.all(c[:, 0] <= area[2] + 1e-9)
    assert np.all(c[:, 1] >= area[1] - 1e-9) and np.all(c[:, 1] <= area[3] + 1e-9)
    inside = np.all((p >= area[:2]) & (p <= area[2:]))
    if inside:
        assert np.array_equal(c, p)

    def shoelace(q):
        if len(q) < 3:
            return 0.0
        return 0.5 * abs(np.dot(q[:, 0], np.roll(q[:, 1], -1)) - np.dot(q[:, 1], np.roll(q[:, 0], -1)))

    # a convex input (its hull): the clip's area is the intersection's, measured on a fine grid
    hull = cv2.convexHull(p.astype(np.float32))  # None for points that are all equal: a polygon of one point
    hull = p[:1] if hull is None else hull.reshape(-1, 2).astype(np.float64)
    ch = clip_polygon(hull, area)
    assert shoelace(ch) <= min(shoelace(hull), w * h) + 1e-6
    if len(hull) >= 3:
        n = 300
        gx, gy = np.meshgrid(x0 + (np.arange(n) + 0.5) * w / n, y0 + (np.arange(n) + 0.5) * h / n)
        q = np.stack([gx.ravel(), gy.ravel()], 1)
        e0, e1 = hull, np.roll(hull, -1, axis=0)
        cross = (e1[:, 0] - e0[:, 0]) * (q[:, None, 1] - e0[:, 1]) - (e1[:, 1] - e0[:, 1]) * (q[:, None, 0] - e0[:, 0])
        inside_q = np.all(cross >= 0, axis=1) | np.all(cross <= 0, axis=1)
        grid_area = inside_q.mean() * w * h
        assert abs(shoelace(ch) - grid_area) <= 4 * (w + h) * max(w, h) / n + 1e-6
