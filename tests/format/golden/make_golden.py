"""Write the golden stores of ``tests/format/golden/``: one small store per
format version (and backend / layout), plus ``expected.json``, the values
every record was written with.

Run by hand, from the repository root, only when a new format version (or
layout) is added::

    .venv/bin/python tests/format/golden/make_golden.py

A store that already exists is never rewritten, and its entry in
``expected.json`` is kept as it is: the old stores are what an older mmstore
wrote, and the test checks that this mmstore still reads them. To add a
store, add it to ``STORES`` and run the script: only the missing ones are
written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

import mmstore
from mmstore.format import MANIFEST_FILE
from mmstore.ingest import merge
from mmstore.ingest.parts import commit_parts

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "expected.json")
LABEL_NAMES = ["cat", "dog", "bird"]

PLAIN = {"image": ("|u1", (4, 6, 3)), "label": ("<i8", ()), "score": ("<f4", (2,))}
ENCODED = {"image": ("|u1", (4, 6, 3), "png:6"), "label": ("<i8", ()), "depth": ("<u2", (4, 4), "zstd:3")}
RAGGED = {
    "image": ("|u1", (4, 6, 3)),
    "label": ("<i8", ()),
    "boxes": ("<f4", (None, 4)),
    "tokens": ("<i8", (None,)),
    "poly": ("<f8", (None, 2), "zstd:3"),
    "caption": "str",
    "blob": "bytes",
}


def value(field: str, slot: int) -> Any:
    """The value of ``field`` in the record at ``slot``: a pure function of
    both, with values every dtype holds exactly (floats are multiples of
    powers of two), empty ragged entries at some slots."""
    if field == "image":
        return ((np.arange(72).reshape(4, 6, 3) * (slot + 3) + 17 * slot) % 256).astype(np.uint8)
    if field == "label":
        return np.int64(slot % 3)
    if field == "score":
        return np.array([slot * 0.25, -slot * 0.5], np.float32)
    if field == "depth":
        return ((np.arange(16).reshape(4, 4) * 1000 + slot * 37) % 65536).astype(np.uint16)
    if field == "boxes":
        return np.array([[r, r + 0.5, r + slot, r + slot + 1.5] for r in range(slot % 4)], np.float32).reshape(-1, 4)
    if field == "tokens":
        return np.array([(-1) ** j * (j + 1) * 10 ** (slot % 4 * 3) for j in range(slot % 5)], np.int64)
    if field == "poly":
        return np.array([[j * 0.125, -slot * 0.375] for j in range(slot % 3 * 2)], np.float64).reshape(-1, 2)
    if field == "caption":
        return "" if slot % 5 == 0 else f"record {slot}: caf\u00e9 \u2603"
    if field == "blob":
        return bytes((slot * 31 + j) % 256 for j in range(slot % 7))
    raise KeyError(field)


def key(slot: int, name: str) -> str:
    if name.startswith("v2_1") and slot == 7:
        return f"img/caf\u00e9_{slot:05d}.png"  # a non-ASCII key (stored as UTF-8)
    return f"img/{slot:05d}.png"


def reason(slot: int) -> str:
    return f"corrupt: golden hole {slot}"


# name -> how it is written: schema, backend, slots, holes, cuts (merged from
# parts cut there: a segmented store), label names; and the version it must be
STORES: dict[str, dict[str, Any]] = {
    "v1_0_memmap": dict(schema=PLAIN, backend="memmap", slots=8, holes=(), label_names=LABEL_NAMES),
    "v1_0_lmdb": dict(schema=PLAIN, backend="lmdb", slots=8, holes=(3,), label_names=LABEL_NAMES),
    "v1_1_segmented": dict(schema=PLAIN, backend="memmap", slots=10, holes=(6,), cuts=(4,)),
    "v2_0_encoded": dict(schema=ENCODED, backend="memmap", slots=8, holes=(2,)),
    "v2_0_encoded_lmdb": dict(schema=ENCODED, backend="lmdb", slots=7, holes=()),
    "v2_0_encoded_segmented": dict(schema=ENCODED, backend="memmap", slots=9, holes=(0,), cuts=(3,)),
    "v2_1_ragged": dict(schema=RAGGED, backend="memmap", slots=10, holes=(4,)),
    "v2_1_ragged_lmdb": dict(schema=RAGGED, backend="lmdb", slots=8, holes=(5,)),
    "v2_2_parts": dict(schema=RAGGED, backend="memmap", slots=11, holes=(1, 7), cuts=(3, 3, 8), parts=True),
}


def version_of(name: str) -> list[int]:
    """``v<major>_<minor>_...``: the version the store's name says."""
    major, minor = name[1:].split("_")[:2]
    return [int(major), int(minor)]


def _fill(path: str, spec: dict[str, Any], name: str, lo: int, hi: int) -> None:
    """Write global slots ``[lo, hi)`` as local slots ``[0, hi - lo)``."""
    with mmstore.StoreWriter(path, spec["schema"], slots=hi - lo, backend=spec["backend"],
                             label_names=spec.get("label_names"),
                             provenance={"source": "tests/format/golden/make_golden.py", "store": name}) as w:
        for s in range(lo, hi):
            if s in spec["holes"]:
                w.skip(s - lo, key(s, name), reason(s))
            else:
                w.write(s - lo, {f: value(f, s) for f in spec["schema"]}, key=key(s, name))


def write(name: str, spec: dict[str, Any], path: str) -> None:
    cuts = spec.get("cuts")
    if cuts is None:
        _fill(path, spec, name, 0, spec["slots"])
        return
    bounds = [0, *cuts, spec["slots"]]
    if spec.get("parts"):  # a store joined from parts (format.py "Parts"), as mmstore.ray commits one
        ids = [f"{k:06d}-golden" for k in range(len(bounds) - 1)]
        os.makedirs(os.path.join(path + ".partial", "parts"))
        for k, pid in enumerate(ids):
            _fill(os.path.join(path + ".partial", "parts", pid), spec, name, bounds[k], bounds[k + 1])
        commit_parts(path, ids, provenance={"source": "tests/format/golden/make_golden.py", "store": name})
        return
    with tempfile.TemporaryDirectory() as tmp:
        parts: list[str | os.PathLike[str]] = []
        for k in range(len(bounds) - 1):
            part = os.path.join(tmp, f"part{k}")
            _fill(part, spec, name, bounds[k], bounds[k + 1])
            parts.append(part)
        merge(parts, path, copy=True)  # copies: the parts go away with the temporary directory


def jsonable(v: Any) -> Any:
    """A value as ``expected.json`` holds it: nested lists of numbers, a
    ``str``, or a ``bytes`` value as its hex digits."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, str):
        return v
    return np.asarray(v).tolist()


def expected(name: str, spec: dict[str, Any], path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as fh:
        manifest = json.load(fh)
    slots = range(spec["slots"])
    return {
        "version": manifest["version"],
        "backend": spec["backend"],
        "records": spec["slots"] - len(spec["holes"]),
        "slots": spec["slots"],
        "segments": manifest.get("segments"),
        "label_names": spec.get("label_names"),
        "schema": manifest["schema"],
        "skipped": [{"slot": s, "key": key(s, name), "reason": reason(s)} for s in slots if s in spec["holes"]],
        "items": [
            {"slot": s, "key": key(s, name), "values": {f: jsonable(value(f, s)) for f in spec["schema"]}}
            for s in slots if s not in spec["holes"]
        ],
    }


def dump(stores: dict[str, Any]) -> str:
    """``expected.json``, one record per line (readable diffs, small file)."""

    def d(o: Any) -> str:
        return json.dumps(o, ensure_ascii=False, separators=(",", ":"))

    out = ["{"]
    for n, (name, st) in enumerate(sorted(stores.items())):
        out.append(f"  {d(name)}: {{")
        rest = [k for k in st if k != "items"]
        for k in rest:
            out.append(f"    {d(k)}: {d(st[k])},")
        out.append('    "items": [')
        out.append(",\n".join(f"      {d(item)}" for item in st["items"]))
        out.append("    ]")
        out.append("  }" + ("," if n < len(stores) - 1 else ""))
    out.append("}")
    return "\n".join(out) + "\n"


def main() -> int:
    old: dict[str, Any] = {}
    if os.path.exists(EXPECTED):
        with open(EXPECTED, encoding="utf-8") as fh:
            old = json.load(fh)
    result: dict[str, Any] = {}
    for name, spec in STORES.items():
        path = os.path.join(HERE, name)
        if os.path.exists(path):
            if name not in old:
                print(f"{name}: exists but has no entry in expected.json; remove it to write it again",
                      file=sys.stderr)
                return 1
            result[name] = old[name]
            print(f"{name}: kept (an existing golden store is never rewritten)")
            continue
        try:
            write(name, spec, path)
            exp = expected(name, spec, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        if exp["version"] != version_of(name):
            shutil.rmtree(path)
            print(f"{name}: written as version {exp['version']}, not {version_of(name)}", file=sys.stderr)
            return 1
        result[name] = exp
        print(f"{name}: written, version {exp['version'][0]}.{exp['version'][1]}")
    for name in sorted(set(old) - set(result)):
        result[name] = old[name]  # a store written by an earlier STORES list: kept
    with open(EXPECTED, "w", encoding="utf-8") as fh:
        fh.write(dump(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
