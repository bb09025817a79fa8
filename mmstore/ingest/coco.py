"""The COCO source: an instances JSON (``images``, ``annotations``, ``categories``) and its image folder.

``mmstore ingest annotations.json DEST --root images/ --size 512x512 --resize pad``

Scan (in the parent, once)
--------------------------
The JSON is parsed once; malformed JSON, or a top level that is not an
object with an ``images`` list, is an :class:`~mmstore.errors.IngestError`
naming the JSON error's line and column. ``categories`` (a list of
``{"id": int, "name": str}``) and every entry of ``images`` (``{"id": int,
"file_name": str}``, ``width``/``height`` optional whole numbers) must be well formed
too (an ``IngestError`` names the first bad entry): without them no record
can be keyed. Records are the ``images`` sorted by ``file_name`` (UTF-8
bytes, then by id), the record key is the ``file_name`` and the image file is
``root/file_name`` (``root`` defaults to the JSON's directory). An image
without annotations is kept, with zero boxes.

Each annotation is checked; a bad one is *skipped* (its image keeps its other
annotations) and listed in ``errors.jsonl`` (see ``mmstore/format/__init__.py``) with
its reason, whose first word is the category:

* ``malformed``: not an object, a missing ``id``/``image_id``/``category_id``/
  ``bbox``, a value of the wrong type (ids must be 64-bit integers, ``bbox`` four
  numbers, ``iscrowd`` 0 or 1 (``true``/``false`` too), ``segmentation``
  polygons or an RLE object);
* ``unknown-image``: its ``image_id`` is not in ``images`` (``slot`` null);
* ``unknown-category``: its ``category_id`` is not in ``categories``;
* ``bad-box``: a ``bbox`` coordinate that is not finite (as a float64), or a width or
  height that is not positive.

Annotations sharing an ``id`` are all kept (a note counts them: tools that
index annotations by id keep one), as are ``images`` entries sharing a
``file_name`` (each its own record; counted too). Annotations of an image
keep their order in the JSON. Everything kept lives in numpy arrays (one row
per annotation, one per polygon, one per point);
the parsed JSON is dropped after the scan and workers inherit the arrays by
fork. The JSON's bytes enter the inputs fingerprint (a resume with another
JSON is refused).

Record (in the workers)
-----------------------
A target size is needed (records are fixed-shape, as for any encoded
image); ``resize="none"`` stores images of exactly that size unresampled,
and then the transform is the identity (the JSON's boxes as they are, made
xyxy). The image is decoded as any image (``orig_size``, ``box``, ``dst``: see
:mod:`mmstore.decode.geometry`). An image entry whose ``width``/``height`` differ
from the decoded (EXIF-oriented) size becomes a hole with reason
``wrong-shape`` (its annotations would land in the wrong place), as does a
missing or corrupt image file (the reason the decoder gives). Boxes
(``[x, y, w, h]`` source pixels -> xyxy) and polygons are mapped to stored
pixels and clipped to the picture area by the rule of
:mod:`mmstore.decode.geometry` (``min_box_size``). A crowd annotation's RLE mask is
not stored (its box is, with ``iscrowd`` 1); the scan counts them.

Stored fields (beside ``image``, ``orig_size``, ``box``, ``dst``):
``image_id`` ``<i8`` (the COCO image id), ``boxes`` ``<f4 (None, 4)`` xyxy
stored pixels, ``category`` ``<i8 (None,)`` COCO category ids with the
category names as the field's ``classes``, ``iscrowd`` ``|u1 (None,)``,
``annotation_id`` ``<i8 (None,)``, and the polygons: ``polygon_points``
``<f4 (None, 2)`` (every point of the record's polygons, in order),
``polygon_sizes`` ``<i4 (None,)`` (points per polygon) and ``polygon_box``
``<i4 (None,)`` (the row in ``boxes`` each polygon belongs to).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, TypeGuard

import numpy as np
import xxhash

from ..decode.geometry import MIN_BOX_SIZE, clip_boxes, clip_polygon, to_stored
from ..errors import IngestError, SourceError
from ..format.schema import Schema
from ._listing import InputError, Listing, Source, _Builder, _stat_key, none_found, read_file

__all__ = ["COCO_FIELDS", "CocoSource", "is_coco_json"]

COCO_FIELDS = ("image_id", "boxes", "category", "iscrowd", "annotation_id", "polygon_points", "polygon_sizes",
               "polygon_box")
MAX_JSON_BYTES = 8 << 30


def is_coco_json(path: str) -> bool:
    """A ``.json`` file (by name): the COCO source handles it (and says what is wrong with it)."""
    return path.lower().endswith(".json")


_I64 = 1 << 63  # ids are stored as <i8: an integer outside [-2**63, 2**63) cannot be


def _is_int(v: Any) -> TypeGuard[int]:
    """An integer (not a bool) that fits the stored ``<i8``."""
    return isinstance(v, int) and not isinstance(v, bool) and -_I64 <= v < _I64


def _is_dim(v: Any) -> bool:
    """An image ``width``/``height``: absent (None), or a whole number from 1
    to 2**31 - 1 (an integer, or a float such as ``640.0`` that some exporters write)."""
    if v is None:
        return True
    if type(v) is float and v.is_integer():
        v = int(v)
    return type(v) is int and 0 < v < 1 << 31


def _all_finite(values: list[Any]) -> bool:
    """Every number finite as a float64 (an integer beyond the float range is not)."""
    try:
        if math.isfinite(math.fsum(values)):  # C loop; any non-finite value makes the sum non-finite
            return True
    except (OverflowError, ValueError):  # an int beyond the float range, or finite floats summing past it
        pass
    try:
        return all(math.isfinite(v) for v in values)
    except OverflowError:
        return False


_NUMBER_TYPES = frozenset({int, float})  # JSON numbers (not bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])``, vectorised (int64)."""
    starts = np.asarray(starts, np.int64)
    lens = np.asarray(lens, np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.cumsum(lens) - lens  # position of each range's first element in the output
    return np.arange(total, dtype=np.int64) - np.repeat(first - starts, lens)


class _Bad(Exception):
    """An annotation that is skipped (``args[0]`` is the reason)."""


class CocoSource(Source):
    """A COCO instances JSON and the folder of its images (see the module docstring)."""

    kind = "coco"

    def __init__(self, path: str, root: str | None = None, min_box_size: float | None = None) -> None:
        super().__init__(path)
        self.root = os.path.abspath(root if root is not None else (os.path.dirname(path) or "."))
        self.min_box_size = float(MIN_BOX_SIZE if min_box_size is None else min_box_size)
        if not (self.min_box_size >= 0 and math.isfinite(self.min_box_size)):
            raise ValueError(f"min_box_size must be a finite number >= 0, got {min_box_size!r}")
        self.fields: Schema | None = None
        self.ann_errors: list[dict[str, Any]] = []

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(root=self.root, min_box_size=self.min_box_size)
        return d

    # -- scan ------------------------------------------------------------------
    def _load_json(self) -> tuple[dict[str, Any], str]:
        try:
            with open(self.path, "rb") as fh:
                data = fh.read(MAX_JSON_BYTES + 1)
        except OSError as e:
            raise IngestError(f"{self.path}: cannot read the annotations ({e.strerror})") from None
        if len(data) > MAX_JSON_BYTES:
            raise SourceError(f"{self.path}: over {MAX_JSON_BYTES >> 30} GiB; not read")
        digest = xxhash.xxh3_128(data).hexdigest()
        try:
            doc = json.loads(data.decode("utf-8-sig"))  # a leading byte-order mark (Windows tools) is allowed
        except UnicodeDecodeError as e:
            raise SourceError(f"{self.path}: not UTF-8 text (byte {e.start}); a COCO JSON is UTF-8") from None
        except json.JSONDecodeError as e:
            raise SourceError(f"{self.path}: line {e.lineno} column {e.colno}: not valid JSON ({e.msg}); "
                              "fix or re-export the annotation file") from None
        except RecursionError:
            raise SourceError(f"{self.path}: nested too deeply to be a COCO annotation file") from None
        del data
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            found = type(doc).__name__ if not isinstance(doc, dict) else f"keys {sorted(doc)[:10]}"
            raise SourceError(f"{self.path}: expected a COCO instances JSON, an object with an 'images' list (and "
                              f"'annotations', 'categories'), found {found}")
        for k in ("annotations", "categories"):
            if not isinstance(doc.get(k, []), list):
                raise SourceError(f"{self.path}: '{k}' must be a list, found {type(doc[k]).__name__}")
        return doc, digest

    def _categories(self, cats: list[Any]) -> dict[int, str]:
        out: dict[int, str] = {}
        for k, c in enumerate(cats):
            if not (isinstance(c, dict) and _is_int(c.get("id")) and isinstance(c.get("name"), str)):
                raise SourceError(f"{self.path}: categories[{k}] must be an object with an integer 'id' (64-bit) and "
                                  f"a string 'name', found {json.dumps(c)[:200]}")
            if c["id"] in out:
                raise SourceError(f"{self.path}: category id {c['id']} appears twice ({out[c['id']]!r} and "
                                  f"{c['name']!r})")
            out[c["id"]] = c["name"]
        return out

    def _images(self, imgs: list[Any]) -> list[tuple[bytes, int, int, int]]:
        """``(file_name bytes, id, width, height)`` in record order (width/height -1 when absent)."""
        rows = []
        seen: set[int] = set()
        for k, im in enumerate(imgs):
            ok = isinstance(im, dict) and _is_int(im.get("id")) and isinstance(im.get("file_name"), str) \
                and im["file_name"] != ""
            ok = ok and all(_is_dim(im.get(d)) for d in ("width", "height"))
            if not ok:
                raise SourceError(f"{self.path}: images[{k}] must be an object with an integer 'id' (64-bit), a "
                                  f"non-empty 'file_name' (and 'width'/'height' whole numbers from 1 to 2**31 - 1 "
                                  f"when present), found {json.dumps(im)[:200]}")
            if im["id"] in seen:
                raise SourceError(f"{self.path}: image id {im['id']} appears twice in 'images'")
            seen.add(im["id"])
            name = im["file_name"].encode("utf-8", "surrogateescape")
            w, h = (-1 if im.get(d) is None else int(im[d]) for d in ("width", "height"))  # 640.0 is 640
            rows.append((name, im["id"], w, h))
        rows.sort()
        return rows

    @staticmethod
    def _check(a: Any, cats: dict[int, str], slot_of: dict[int, int]) -> tuple[int, list[list[float]], bool]:
        """``(slot, polygons, has_rle)`` of a good annotation; raises ``_Bad`` with the reason."""
        # exact types (``type(v) is int`` is False for a bool): the JSON parser makes only these
        if type(a) is not dict:
            raise _Bad(f"malformed: an annotation must be an object, found {type(a).__name__}")
        try:
            ids, bb = (a["id"], a["image_id"], a["category_id"]), a["bbox"]
        except KeyError as e:
            raise _Bad(f"malformed: no {e.args[0]!r}") from None
        for k, v in zip(("id", "image_id", "category_id"), ids):
            if type(v) is not int or not -_I64 <= v < _I64:
                raise _Bad(f"malformed: {k!r} must be an integer (64-bit), found {json.dumps(v)[:60]}")
        if not (type(bb) is list and len(bb) == 4 and {type(v) for v in bb} <= _NUMBER_TYPES):
            raise _Bad(f"malformed: 'bbox' must be 4 numbers [x, y, w, h], found {json.dumps(bb)[:80]}")
        crowd = a.get("iscrowd", 0)
        if crowd not in (0, 1) or type(crowd) not in (int, bool, float):  # true/false and 1.0 mean 1/0 (COCO tools)
            raise _Bad(f"malformed: 'iscrowd' must be 0 or 1, found {json.dumps(crowd)[:60]}")
        seg = a.get("segmentation", [])
        polys: list[list[float]] = []
        rle = False
        if isinstance(seg, dict):
            rle = True  # a run-length mask: not stored (counted)
        elif isinstance(seg, list):
            for p in seg:  # set comprehension and sum: C loops over the (many) coordinates
                if not (isinstance(p, list) and {type(v) for v in p} <= _NUMBER_TYPES):
                    raise _Bad("malformed: 'segmentation' must be a list of polygons (lists of numbers) or an "
                               "RLE object")
                if len(p) % 2 or not _all_finite(p):
                    raise _Bad("malformed: a 'segmentation' polygon must be finite x, y pairs")
            polys = seg
        elif seg is not None:
            raise _Bad("malformed: 'segmentation' must be a list of polygons (lists of numbers) or an RLE object")
        if a["image_id"] not in slot_of:
            raise _Bad(f"unknown-image: image_id {a['image_id']} is not in 'images'")
        if a["category_id"] not in cats:
            raise _Bad(f"unknown-category: category_id {a['category_id']} is not in 'categories'")
        if not _all_finite(bb):
            raise _Bad("bad-box: a 'bbox' coordinate is not finite (or beyond the float64 range)")
        if not (bb[2] > 0 and bb[3] > 0):
            raise _Bad(f"bad-box: width and height must be positive, found w={bb[2]} h={bb[3]}")
        return slot_of[a["image_id"]], polys, rle

    def scan(self) -> Listing:
        if not os.path.isdir(self.root):  # a mistyped --root: every image would be a hole, the store empty
            raise SourceError(f"{self.path}: the image folder {self.root} (--root) is not a directory; pass the "
                              "folder the JSON's file_name entries start from")
        doc, digest = self._load_json()
        cats = self._categories(doc.get("categories", []))
        rows = self._images(doc["images"])
        slot_of = {r[1]: s for s, r in enumerate(rows)}
        n = len(rows)
        ann = doc.get("annotations", [])
        del doc
        a_slot, a_id, a_cat, a_crowd, a_box, a_npoly = [], [], [], [], [], []
        p_size: list[int] = []
        points: list[float] = []
        errors: list[dict[str, Any]] = []
        notes: dict[str, int] = {}
        rle = small = 0
        for k, a in enumerate(ann):
            try:
                s, polys, has_rle = self._check(a, cats, slot_of)
            except _Bad as e:
                reason = str(e.args[0])
                img = a.get("image_id") if isinstance(a, dict) else None
                s_bad = slot_of.get(img) if _is_int(img) else None
                errors.append({"slot": s_bad, "key": rows[s_bad][0] if s_bad is not None else None,
                               "annotation": k, "id": a.get("id") if isinstance(a, dict) and _is_int(a.get("id"))
                               else None, "reason": reason})
                cat = reason.split(":", 1)[0]
                notes[cat] = notes.get(cat, 0) + 1
                continue
            rle += has_rle
            kept = [p for p in polys if len(p) >= 6]
            small += len(polys) - len(kept)
            x, y, w, h = (float(v) for v in a["bbox"])  # float64: x + w of two huge ints stays a float
            a_slot.append(s)
            a_id.append(a["id"])
            a_cat.append(a["category_id"])
            a_crowd.append(int(a.get("iscrowd", 0)))
            a_box += [x, y, x + w, y + h]
            a_npoly.append(len(kept))
            for p in kept:
                p_size.append(len(p) // 2)
                points += p
        del ann
        self._arrays(n, a_slot, a_id, a_cat, a_crowd, a_box, a_npoly, p_size, points)
        warnings = {f"annotations skipped, {cat} (listed in errors.jsonl)": c for cat, c in sorted(notes.items())}
        if rle:
            warnings["crowd annotations whose RLE mask is not stored (box kept, iscrowd 1)"] = rle
        if small:
            warnings["polygons of fewer than 3 points not stored"] = small
        dup = len(self.ann_id) - len(np.unique(self.ann_id))
        if dup:  # kept (nothing is dropped for it), but said: tools that index annotations by id keep one
            warnings["annotations whose id repeats an earlier annotation's (all kept, stored as written)"] = dup
        same_name = n - len({r[0] for r in rows})
        if same_name:  # each entry is its own record (its own id and annotations) of the same picture
            warnings["'images' entries whose file_name another entry also has (each its own record)"] = same_name
        self.ann_errors = errors
        self.image_ids = np.array([r[1] for r in rows], np.int64)
        self.image_sizes = np.array([(r[3], r[2]) for r in rows], np.int64).reshape(-1, 2)  # (h, w), -1: absent
        classes = {"category": cats} if cats else None
        self.fields = Schema({
            "image_id": ("<i8", ()), "boxes": ("<f4", (None, 4)), "category": ("<i8", (None,)),
            "iscrowd": ("|u1", (None,)), "annotation_id": ("<i8", (None,)), "polygon_points": ("<f4", (None, 2)),
            "polygon_sizes": ("<i4", (None,)), "polygon_box": ("<i4", (None,)),
        }, classes=classes)
        b = _Builder("coco", False)
        root = os.fsencode(self.root)
        for name, _, _, _ in rows:
            size, mtime = _stat_key(os.path.join(root, name))
            b.add(name, size, mtime)
        missing = none_found(b, self.path, os.path.join(root, rows[0][0]) if rows else b"",
                             f"file_name is resolved against the image folder {self.root} (--root): check it")
        extra = repr((digest, self.min_box_size, sorted(cats.items())))
        self.listing = b.finish(None, extra=extra, warnings=warnings)
        self.listing.none_found = missing
        return self.listing

    def _arrays(self, n: int, a_slot: list[int], a_id: list[int], a_cat: list[int], a_crowd: list[int],
                a_box: list[float], a_npoly: list[int], p_size: list[int], points: list[float]) -> None:
        """Group the kept annotations by slot (stable: JSON order within an image) into numpy arrays."""
        slot = np.array(a_slot, np.int64)
        order = np.argsort(slot, kind="stable")
        npoly = np.array(a_npoly, np.int64)
        poly_start = np.concatenate([[0], np.cumsum(npoly)])  # annotation -> first polygon (JSON order)
        psize = np.array(p_size, np.int64)
        pt_start = np.concatenate([[0], np.cumsum(psize)])  # polygon -> first point
        pts = np.array(points, np.float64).reshape(-1, 2)
        self.ann_offsets = np.searchsorted(slot[order], np.arange(n + 1)).astype(np.int64)
        self.ann_id = np.array(a_id, np.int64)[order]
        self.ann_cat = np.array(a_cat, np.int64)[order]
        self.ann_crowd = np.array(a_crowd, np.uint8)[order]
        self.ann_box = np.array(a_box, np.float64).reshape(-1, 4)[order]
        # polygons re-ordered with their annotations: for each annotation (new order) its polygon range
        self.ann_npoly = npoly[order]
        poly_idx = _ranges(poly_start[:-1][order], self.ann_npoly)
        self.poly_size = psize[poly_idx]
        self.points = pts[_ranges(pt_start[:-1][poly_idx], self.poly_size)]
        self.poly_offsets = np.concatenate([[0], np.cumsum(self.ann_npoly)]).astype(np.int64)
        self.pt_offsets = np.concatenate([[0], np.cumsum(self.poly_size)]).astype(np.int64)

    # -- records ----------------------------------------------------------------
    def load(self, i: int) -> Any:
        return read_file(os.path.join(os.fsencode(self.root), self.listing.key(i)))

    def input_path(self, i: int) -> bytes:
        """The file of input ``i`` (``load`` reads it)."""
        return os.path.join(os.fsencode(self.root), self.listing.key(i))

    def check_size(self, i: int, orig_size: tuple[int, int]) -> None:
        """``InputError`` (a hole) when image ``i``'s JSON size is not the decoded one."""
        h, w = (int(v) for v in self.image_sizes[i])
        if h < 0 or w < 0 or (h, w) == tuple(orig_size):
            return
        turned = (" (the JSON gives the size before the EXIF orientation? mmstore decodes the image upright: give "
                  "its size and boxes in the upright image's pixels, or remove the file's orientation tag)"
                  if (w, h) == tuple(orig_size) else "")
        raise InputError(f"wrong-shape: the annotation file says {w}x{h} (width x height), the decoded image is "
                         f"{orig_size[1]}x{orig_size[0]}{turned}; its annotations would land in the wrong place")

    def record_fields(self, i: int, decoded: Any) -> dict[str, np.ndarray]:
        """The annotation fields of input ``i``, whose image decoded to
        ``decoded`` (a :class:`~mmstore.decode.Decoded`); taken by
        :class:`mmstore.ingest.records.RecordJob` and by ``verify --repair``.
        ``InputError`` (a hole) when the JSON's size is not the decoded one."""
        self.check_size(i, decoded.orig_size)
        return self.annotation_fields(i, (decoded.box, decoded.dst))

    def annotation_fields(self, i: int, transform: tuple[Any, Any]) -> dict[str, np.ndarray]:
        """The annotation fields of input ``i`` in stored pixels (see the module docstring)."""
        a, b = int(self.ann_offsets[i]), int(self.ann_offsets[i + 1])
        dst = np.asarray(transform[1])
        boxes, keep, _ = clip_boxes(to_stored(self.ann_box[a:b], transform), dst, self.min_box_size)
        out = {
            "image_id": np.array(self.image_ids[i], "<i8"),
            "boxes": boxes[keep].astype("<f4"),
            "category": self.ann_cat[a:b][keep].astype("<i8"),
            "iscrowd": self.ann_crowd[a:b][keep].astype("|u1"),
            "annotation_id": self.ann_id[a:b][keep].astype("<i8"),
        }
        row = np.cumsum(keep) - 1  # annotation -> its row among the kept boxes
        p0, p1 = int(self.poly_offsets[a]), int(self.poly_offsets[b])  # the record's polygons (contiguous)
        psz = self.poly_size[p0:p1]
        allpts = to_stored(self.points[int(self.pt_offsets[p0]): int(self.pt_offsets[p1])], transform)
        owner = np.repeat(np.arange(b - a), self.ann_npoly[a:b])  # polygon -> its annotation in the record
        kept = keep[owner]
        inside = np.all((allpts >= dst[:2]) & (allpts <= dst[2:]), axis=1)
        starts = np.concatenate([[0], np.cumsum(psz)[:-1]]).astype(np.int64)
        whole = np.logical_and.reduceat(inside, starts) if len(psz) else np.zeros(0, bool)
        if np.all(whole[kept]):  # the usual case: every kept polygon lies in the picture area
            pts = allpts[np.repeat(kept, psz)]
            sizes, own = psz[kept], row[owner[kept]]
        else:
            parts, sz, ow = [], [], []
            for k in np.flatnonzero(kept).tolist():
                q = allpts[starts[k]: starts[k] + psz[k]]
                c = q if whole[k] else clip_polygon(q, dst)
                if len(c) >= 3:
                    parts.append(c)
                    sz.append(len(c))
                    ow.append(int(row[owner[k]]))
            pts = np.concatenate(parts) if parts else np.zeros((0, 2))
            sizes, own = np.array(sz, np.int64), np.array(ow, np.int64)
        out["polygon_points"] = pts.astype("<f4").reshape(-1, 2)
        out["polygon_sizes"] = np.asarray(sizes).astype("<i4")
        out["polygon_box"] = np.asarray(own).astype("<i4")
        return out

    def geometry_counts(self, box: np.ndarray, dst: np.ndarray, slots: np.ndarray) -> dict[str, int]:
        """Boxes clipped and dropped over the records at ``slots`` (whose
        stored ``box`` and ``dst`` are given): the clip rule of
        :func:`annotation_fields`, vectorised, for the summary."""
        if len(slots) == 0:
            return {}
        start, end = self.ann_offsets[slots], self.ann_offsets[slots + 1]
        counts = (end - start).astype(np.int64)
        if counts.sum() == 0:
            return {}
        rows = np.repeat(np.arange(len(slots)), counts)
        idx = _ranges(start, counts)
        st = to_stored(self.ann_box[idx], (box[rows], dst[rows]))
        _, keep, clipped = clip_boxes(st, dst[rows], self.min_box_size)
        out = {}
        if clipped.sum():
            out["boxes clipped to the picture area"] = int(clipped.sum())
        if (~keep).sum():
            out[f"boxes dropped (under {self.min_box_size:g} stored pixel(s) wide or high after the clip)"] = \
                int((~keep).sum())
        return out
