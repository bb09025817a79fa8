"""Store builders: small synthetic stores whose records are a pure function
of their slot, so any read can be checked byte for byte."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

import mmstore
from mmstore.ingest import merge

SMALL_SCHEMA = {"image": ("|u1", (8, 6, 3)), "label": ("<i8", ()), "score": ("<f4", (2,))}
# records that say who they are (the ``idx`` field), for the torch layer
IDX_SCHEMA = {"image": ("|u1", (12, 10, 3)), "label": ("<i8", ()), "idx": ("<i8", ())}
# a field of >= 2 KiB per record, so the Loader's preadv path is exercised
IDX_BIG_SCHEMA = {"image": ("|u1", (24, 32, 3)), "label": ("<i8", ()), "idx": ("<i8", ())}

KEYS = "in/{:05d}.jpg"
REASON = "corrupt: test hole {}"


def sample(i: int) -> dict[str, np.ndarray]:
    """Deterministic record i of SMALL_SCHEMA."""
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 256, (8, 6, 3), dtype=np.uint8),
        "label": np.int64(i % 7),
        "score": rng.random(2, dtype=np.float32),
    }


def indexed(slot: int, shape=(12, 10, 3)) -> dict[str, np.ndarray]:
    """Deterministic record of IDX_SCHEMA (or IDX_BIG_SCHEMA with its image ``shape``)."""
    rng = np.random.default_rng(slot)
    return {
        "image": rng.integers(0, 256, shape, dtype=np.uint8),
        "label": np.int64(slot % 10),
        "idx": np.int64(slot),
    }


def _fill(w, slots, first: int, holes, make: Callable[[int], Any], keys: str, reason: str) -> None:
    """Write global records ``slots`` into writer ``w`` at local slot ``s - first``."""
    for s in slots:
        if s in holes:
            w.skip(s - first, keys.format(s), reason.format(s))
        else:
            w.write(s - first, make(s), key=keys.format(s))


def write_store(path, n, backend="memmap", holes=(), order=None, schema=SMALL_SCHEMA, make=sample,
                keys=KEYS, reason=REASON, **kw) -> str:
    """Write n slots (holes skipped) in ``order`` (default ascending); return path.
    ``keys`` and ``reason`` are format strings of the slot; ``kw`` goes to StoreWriter."""
    slots = range(n) if order is None else list(order)
    with mmstore.StoreWriter(path, schema, slots=n, backend=backend, **kw) as w:
        _fill(w, slots, 0, holes, make, keys, reason)
    return str(path)


def write_parts(root, n, cuts, backend="memmap", holes=(), schema=SMALL_SCHEMA, make=sample,
                keys=KEYS, reason=REASON) -> list[str]:
    """Write slots [0, n) as consecutive part stores ``root/part<k>`` cut at
    ``cuts`` (each part's local slot j holds global record ``lo + j``, with its
    key and hole status), so merging the parts in order must read like
    ``write_store(path, n, holes=holes)``. Returns the part paths."""
    os.makedirs(str(root), exist_ok=True)
    bounds = [0, *sorted(cuts), n]
    paths = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        p = os.path.join(str(root), f"part{k}")
        with mmstore.StoreWriter(p, schema, slots=hi - lo, backend=backend) as w:
            _fill(w, range(lo, hi), lo, holes, make, keys, reason)
        paths.append(p)
    return paths


def write_merged(path, n, cuts, **kw) -> str:
    """The store ``write_store(path, n, **kw)`` would write, as a merged
    (segmented) store of parts cut at ``cuts`` (parts kept in ``path.parts``)."""
    return merge(write_parts(f"{path}.parts", n, cuts, **kw), str(path))


def write_every_layout(root, n, cuts, **kw) -> dict[str, str]:
    """The same records as a memmap, an lmdb and a merged (cut at ``cuts``)
    store under ``root``: ``{"memmap": path, "lmdb": path, "merged": path}``."""
    return {
        "memmap": write_store(os.path.join(root, "m"), n, **kw),
        "lmdb": write_store(os.path.join(root, "l"), n, **{**kw, "backend": "lmdb"}),
        "merged": write_merged(os.path.join(root, "g"), n, cuts, **kw),
    }


def finish_resumed(dest, schema, n, holes, make, committed, backend="memmap") -> None:
    """What a resumed ingest does with ``dest.partial`` after a kill: slots
    ``0..committed`` (holes aside) are committed and kept, slot 3 is written
    again, the rest are written (or skipped, for ``holes``) as ``write_store``
    with keys ``in/<slot>`` and reasons ``corrupt: hole <slot>`` would."""
    with mmstore.StoreWriter(dest, schema, slots=n, resume=True, backend=backend) as w:
        w.mark_written([s for s in range(committed) if s not in holes])
        w.write(3, make(3))  # what a resumed ingest does: committed ranges stay, others are redone
        for s in range(n):
            w.set_key(s, f"in/{s}")
            if s in holes:
                w.skip(s, f"in/{s}", f"corrupt: hole {s}")
            elif s >= committed:
                w.write(s, make(s))


def write_indexed(path, n, backend="memmap", holes=(), schema=IDX_SCHEMA, cuts=None) -> str:
    """The torch layer's stores: ``indexed`` records keyed ``k<slot>``; merged
    from parts cut at ``cuts`` when given."""
    shape = schema["image"][1]
    kw = dict(backend=backend, holes=holes, schema=schema, make=lambda s: indexed(s, shape),
              keys="k{}", reason="test hole")
    if cuts is None:
        return write_store(path, n, **kw)
    return write_merged(path, n, cuts, **kw)


def image_store(path, n=10_000, backend="memmap", holes=(), side=16, channels=3, layout="hwc",
                label_names=None, provenance=None) -> tuple[str, np.ndarray]:
    """n slots of side x side x channels uint8 images (``layout`` "hwc" or
    "chw") + an int64 label ``slot % 5``; returns (path, the images)."""
    shape = (side, side, channels) if layout == "hwc" else (channels, side, side)
    imgs = np.random.default_rng(1).integers(0, 256, (n, *shape), dtype=np.uint8)
    path = write_store(path, n, backend=backend, holes=holes, schema={"image": ("|u1", shape), "label": ("<i8", ())},
                       make=lambda s: {"image": imgs[s], "label": s % 5}, keys="img/{:05d}.png",
                       reason="corrupt: test", label_names=label_names, provenance=provenance)
    return path, imgs


# compact records: an encoded image beside raw fields
COMPACT_SCHEMA = {"image": ("|u1", (16, 12, 3)), "label": ("<i8", ()), "box": ("<f4", (4,))}


def compact_sample(slot: int) -> dict[str, np.ndarray]:
    """Deterministic record of COMPACT_SCHEMA: a photo-like image (JPEG
    behaves as on real photos) and raw label and box."""
    from .images import photo

    rng = np.random.default_rng(slot)
    return {"image": photo(rng, 16, 12), "label": np.int64(slot % 7),
            "box": rng.random(4, dtype=np.float32)}


def compact_store(path, n, codecs=("image=jpeg:90",), backend="memmap", holes=(), cuts=None) -> str:
    """``write_store`` of COMPACT_SCHEMA with ``codecs`` (merged from parts
    cut at ``cuts`` when given)."""
    schema = mmstore.Schema(COMPACT_SCHEMA, codecs=list(codecs))
    kw = dict(backend=backend, holes=holes, schema=schema, make=compact_sample)
    if cuts is None:
        return write_store(path, n, **kw)
    return write_merged(path, n, cuts, **kw)


def many_parts_img(slot: int, nbytes: int) -> np.ndarray:
    """The ``img`` entry of slot ``slot`` of ``write_many_parts(..., img=nbytes)``."""
    return ((np.arange(nbytes, dtype=np.int64) + slot * 31) % 251).astype(np.uint8)


def write_many_parts(path, n, per=1, *, table=True, img=0) -> list[str]:
    """A memmap store of ``n`` slots in parts of ``per`` slots (the last may be
    shorter), built directly as ``mmstore.ray.write`` lays one out (format
    2.2, "Parts"), with its parts in a part table (2.4) or, ``table=False``,
    in the manifest's JSON: one ``<i8`` field ``idx`` holding the slot (and,
    ``img`` > 0, a ``|u1`` field ``img`` of that many bytes: ``many_parts_img``), key
    ``k<slot>``, real checksums (``verify`` passes). Returns the part ids.
    Seconds for thousands of parts, where a write of that many parts takes
    minutes."""
    import xxhash

    from mmstore.format import layout
    from mmstore.format.layout import KEY_DTYPE, npy_header
    from mmstore.format.schema import Schema
    from mmstore.store.writer import write_manifest

    path = os.fspath(path)
    partial = path + ".partial"
    os.makedirs(os.path.join(partial, "parts"))
    idx = np.arange(n, dtype="<i8")
    ids, counts, names = [], [], []
    for k, lo in enumerate(range(0, n, per)):
        pid = f"{k:05d}-p"
        rows = idx[lo : lo + per]
        os.makedirs(os.path.join(partial, "parts", pid))
        with open(os.path.join(partial, "parts", pid, "idx.npy"), "wb") as fh:
            fh.write(npy_header(np.dtype("<i8"), (len(rows),)) + rows.tobytes())
        names.append(f"parts/{pid}/idx.npy")
        if img:
            with open(os.path.join(partial, "parts", pid, "img.npy"), "wb") as fh:
                fh.write(npy_header(np.dtype("|u1"), (len(rows), img))
                         + b"".join(many_parts_img(int(s), img).tobytes() for s in rows))
            names.append(f"parts/{pid}/img.npy")
        ids.append(pid)
        counts.append(len(rows))
    keys = [f"k{s}".encode() for s in range(n)]
    offsets = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(KEY_DTYPE)
    sums = np.array([xxhash.xxh3_64_intdigest(v.tobytes() + (many_parts_img(int(v), img).tobytes() if img else b""))
                     for v in idx], KEY_DTYPE)
    for name, data in (("_checksums.npy", npy_header(KEY_DTYPE, (n,)) + sums.tobytes()),
                       ("_keys_offsets.npy", npy_header(KEY_DTYPE, (n + 1,)) + offsets.tobytes()),
                       ("_keys.bin", b"".join(keys))):
        with open(os.path.join(partial, name), "wb") as fh:
            fh.write(data)
    schema = Schema.from_json([{"name": "idx", "dtype": "<i8", "shape": []}]
                              + ([{"name": "img", "dtype": "|u1", "shape": [img]}] if img else []))
    was = layout.PART_TABLE_MIN_PARTS
    layout.PART_TABLE_MIN_PARTS = 1 if table else len(ids) + 1
    try:
        write_manifest(partial, names + ["_checksums.npy", "_keys_offsets.npy", "_keys.bin"], backend="memmap",
                       records=n, slots=n, schema=schema, label_names=None, provenance={"test": "many parts"},
                       segments=counts, parts=ids)
    finally:
        layout.PART_TABLE_MIN_PARTS = was
    os.rename(partial, path)
    return ids
